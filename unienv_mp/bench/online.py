"""The online case: a training loop that appends to a shared buffer before every
``sample()`` (``measure_online``): time per loop step, and how stale the batches are."""
import gc
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np

from .config import LABELS, Config
from .data import build_online_buffer, dict_storage_tensors
from .measure import Result, batch_nbytes, guarded, time_steps, touch
from .peers import make_sampler


@dataclass
class OnlineResult(Result):
    """``Result`` of the online case, where a "batch" is one loop step (an append, then
    one ``sample()``); ``staleness`` holds the staleness of every measured step, in loop
    steps (see ``run_online``)."""
    staleness: List[int] = field(default_factory=list)

    def staleness_stats(self):
        """{"mean", "p50", "p99", "max"} of ``staleness``, in loop steps."""
        if not self.staleness:
            return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan"),
                    "max": None}
        a = np.asarray(self.staleness)
        return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
                "p99": float(np.percentile(a, 99)), "max": int(a.max())}

    def as_dict(self):
        out = super().as_dict()
        out["ms_per_step"] = self.ms_per_batch
        out["main_cpu_ms_per_step"] = self.main_cpu_ms_per_batch
        out["staleness_steps"] = self.staleness_stats()
        return out


def staleness(step: int, batch) -> int:
    """How many loop steps ``batch`` lags behind ``step``, the newest step written: ``step``
    minus the largest ``clock`` among the batch's rows, which is the newest step the batch
    could contain (see ``run_online``)."""
    return int(step) - int(batch["clock"].max())


def online_warmup(cfg: Config) -> int:
    """Loop steps taken before the online case's clock starts: enough for every sampler's
    pipeline (up to ``2 * n_buffers`` batches ahead) to fill."""
    return max(cfg.warmup, 4 * cfg.buffers)


def online_stepper(next_batch, rb, cfg: Config):
    """One loop step of the online case at a time, over ``rb`` (from
    ``build_online_buffer``) with ``next_batch`` as its sampler: a function that does the
    next step and returns ``(staleness, batch)``.

    Loop step ``t`` (1, 2, ...) appends ``cfg.append`` transitions whose ``clock`` is
    ``t``, sets the ``clock`` of every row of the buffer to ``t`` (one ``fill_`` of the
    shared column), then takes one batch and reads it.  A worker that reads a row
    therefore sees the last step whose writes had landed by then, so the largest
    ``clock`` in a batch is the newest step the batch could contain, and its staleness
    (``staleness``) is ``t`` minus that: 0 for a batch read after this step's writes (as
    in process).  The fill is not atomic: a row read while it runs can still show
    ``t - 1``, which makes a staleness read at most one step high.  Every implementation
    pays the same fill (a few microseconds for 20k rows)."""
    import torch
    clock = dict_storage_tensors(rb)["clock"]
    gen = torch.Generator().manual_seed(1)
    rows = {"state": torch.rand(cfg.append, 10, generator=gen) * 2 - 1,
            "action": torch.rand(cfg.append, 7, generator=gen) * 2 - 1,
            "clock": torch.zeros(cfg.append, dtype=torch.int64)}
    step = 0

    def one_step():
        nonlocal step
        step += 1
        rows["clock"].fill_(step)
        rb.extend(rows)
        clock.fill_(step)
        b = next_batch()
        touch(b)
        return staleness(step, b), b
    return one_step


def run_online(next_batch, rb, cfg: Config, progress: Callable[[float], None] = lambda f: None,
               result: Optional[OnlineResult] = None) -> OnlineResult:
    """The online loop (see ``online_stepper``): ``online_warmup(cfg)`` steps, then as
    many as fit in ``cfg.seconds``, each one's staleness kept; returns ``result`` (or a
    new ``OnlineResult``) filled in."""
    res = result if result is not None else OnlineResult("", "")
    one_step = online_stepper(next_batch, rb, cfg)
    for _ in range(online_warmup(cfg)):
        res.batch_bytes = batch_nbytes(one_step()[1])
    time_steps(res, lambda: res.staleness.append(one_step()[0]), cfg, progress)
    return res


def measure_online(name: str, cfg: Config, progress: Callable[[float], None] = lambda f: None):
    """The online case for implementation ``name``, over a fresh ``build_online_buffer``
    (every row starts from the same buffer): an ``OnlineResult``."""
    res = OnlineResult(name, LABELS.get(name, name))
    gc.collect()
    t0 = time.perf_counter()

    def make():
        rb = build_online_buffer(cfg)
        next_batch, close = make_sampler(name, rb, cfg)
        return (next_batch, rb), close

    def run(sampler_and_buffer):
        run_online(*sampler_and_buffer, cfg, progress, res)
        res.startup_s = time.perf_counter() - t0 - res.seconds
    return guarded(res, make, run)
