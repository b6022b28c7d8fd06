"""Timing one row: ``measure`` (batches per second of ``sample()``), its ``Result``, and
what the other cases' measurements share (``touch``, ``time_steps``, ``guarded``)."""
import dataclasses
import gc
import importlib
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

from .config import LABELS, Config
from .peers import make_sampler


@dataclass
class Result:
    name: str
    label: str
    batches: int = 0
    seconds: float = 0.0
    batch_bytes: int = 0
    main_cpu_s: float = 0.0       # CPU time of this (the training) process while measuring
    startup_s: float = 0.0
    error: Optional[str] = None
    extra: Dict[str, float] = field(default_factory=dict)
    stats: Optional[object] = None   # unienv_mp's SamplerStats of the measured batches

    @property
    def ms_per_batch(self):
        return 1e3 * self.seconds / self.batches if self.batches else float("nan")

    @property
    def batches_per_s(self):
        return self.batches / self.seconds if self.seconds else float("nan")

    @property
    def mb_per_s(self):
        return self.batch_bytes * self.batches_per_s / 1e6

    @property
    def main_cpu_ms_per_batch(self):
        """CPU time the main process spent per batch, all its threads together: what the
        training loop pays, as opposed to the workers."""
        return 1e3 * self.main_cpu_s / self.batches if self.batches else float("nan")

    def as_dict(self):
        return {"name": self.name, "label": self.label, "batches": self.batches,
                "seconds": self.seconds, "ms_per_batch": self.ms_per_batch,
                "batches_per_s": self.batches_per_s, "mb_per_s": self.mb_per_s,
                "batch_bytes": self.batch_bytes, "startup_s": self.startup_s,
                "main_cpu_ms_per_batch": self.main_cpu_ms_per_batch,
                "error": self.error,
                "stats": None if self.stats is None else dataclasses.asdict(self.stats)}


def _is_tensor_collection(x):
    """A TensorDict (or the like): a mapping of arrays with a ``batch_size``; told apart from
    tensors, which have ``values()`` too (sparse), without importing tensordict."""
    return (hasattr(x, "batch_size") and callable(getattr(x, "keys", None))
            and callable(getattr(x, "values", None)))


def _arrays(batch):
    """The numpy arrays (torch tensors as numpy views) of a nested batch: dicts, lists,
    tuples and TensorDicts of arrays and tensors."""
    stack = [batch]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif _is_tensor_collection(x):
            stack.extend(x.values())
        elif x is not None:
            yield x if isinstance(x, np.ndarray) else x.numpy()


def touch(batch):
    """Read one byte per 4 KiB page of every array in ``batch``; returns a checksum."""
    return sum(int(a.reshape(-1).view(np.uint8)[::4096].sum()) for a in _arrays(batch))


def batch_nbytes(batch):
    """Bytes of array data in ``batch``."""
    return sum(a.nbytes for a in _arrays(batch))


# Modules an implementation imports when it starts, imported before its clock starts:
# importing torchrl takes seconds, which are not its start-up.
_PREIMPORT = {"torchrl": ("tensordict", "torchrl.data")}


def _error(e):
    return f"{type(e).__name__}: {e}"


def preimport(name):
    for module in _PREIMPORT.get(name, ()):
        importlib.import_module(module)


def time_steps(res, step, cfg: Config, progress: Callable[[float], None]):
    """Call ``step()`` as often as fits in ``cfg.seconds`` (at least ``cfg.min_batches``
    times, at most ``cfg.max_batches``); the count, the seconds and this process's CPU
    time go into ``res`` (a ``Result``)."""
    n = 0
    cpu0 = _process_cpu()
    start = time.perf_counter()
    elapsed = 0.0
    while n < cfg.max_batches and (elapsed < cfg.seconds or n < cfg.min_batches):
        step()
        n += 1
        elapsed = time.perf_counter() - start
        progress(min(1.0, elapsed / cfg.seconds))
    res.batches, res.seconds = n, elapsed
    res.main_cpu_s = _process_cpu() - cpu0


def measure(name: str, rb, cfg: Config, progress: Callable[[float], None] = lambda f: None,
            make: Optional[Callable] = None):
    """Time implementation ``name``: start it (``make()``, default
    ``make_sampler(name, rb, cfg)``: ``(next_batch, close)``), take ``cfg.warmup``
    batches, then as many as fit in ``cfg.seconds`` (at least ``cfg.min_batches``)."""
    res = Result(name, LABELS.get(name, name))
    try:
        preimport(name)
    except Exception as e:   # reported in the table, not fatal to the comparison
        res.error = _error(e)
        return res
    gc.collect()
    t0 = time.perf_counter()

    def run(next_batch):
        for _ in range(cfg.warmup):
            b = next_batch()
            touch(b)
            res.batch_bytes = batch_nbytes(b)
            del b
        res.startup_s = time.perf_counter() - t0
        owner = getattr(next_batch, "__self__", None)
        if name == "ray" and cfg.ray_buffers is None and owner is not None:
            res.label = f"{res.label[:-1]}, {owner.n_buffers} buffers)"   # (its default)
        stats = owner.stats if _is_unienv_mp_sampler(owner) else None
        if stats is not None:
            stats(reset=True)          # (the measured batches only)
        time_steps(res, lambda: touch(next_batch()), cfg, progress)
        if stats is not None:
            res.stats = stats()
    return guarded(res, make or (lambda: make_sampler(name, rb, cfg)), run)


def _is_unienv_mp_sampler(obj):
    from .._sampling.sampler import SamplerBase
    return isinstance(obj, SamplerBase)


def guarded(res, make, run):
    """``value, close = make()``, then ``run(value)``, then ``close()`` whatever happened;
    an exception in ``make`` or ``run`` goes into ``res.error`` (reported in the table,
    not fatal to the comparison).  Returns ``res``."""
    try:
        value, close = make()
    except Exception as e:
        res.error = _error(e)
        return res
    try:
        run(value)
    except Exception as e:
        res.error = _error(e)
    finally:
        try:
            close()
        except Exception:
            pass
    return res


def _process_cpu():
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def speedups(results: List[Result], reference: str = "unienv_mp"):
    """{other name: how many times faster ``reference`` is per batch}."""
    ref = next((r for r in results if r.name == reference and r.batches), None)
    out = {}
    for r in results:
        if ref is not None and r is not ref and r.batches:
            out[r.name] = r.ms_per_batch / ref.ms_per_batch
    return out
