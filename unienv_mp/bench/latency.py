"""The latency case: the time to one batch when nothing was prefetched
(``measure_latency``), for each way of asking for one (``TRIGGERS``)."""
import gc
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np

from .config import LABELS, Config
from .measure import guarded, touch
from .peers import close_sampler, sampler_object


TRIGGERS = {
    "reseed": "manual_seed(), then sample()",
    "epoch": "first batch of a new epoch_iter()",
    "start": "first sample() of a new sampler",
}


# Wait before each run, so that the workers finish what they were asked for and go idle.
LATENCY_PAUSE_S = 0.05


class NotMeasurable(Exception):
    """This implementation's API has no way to ask for a batch like this."""


@dataclass
class LatencyResult:
    name: str
    label: str
    trigger: str
    times: List[float] = field(default_factory=list)   # seconds to the batch, one per run
    error: Optional[str] = None
    skipped: Optional[str] = None    # why this implementation cannot be asked this way

    @property
    def trigger_label(self):
        return TRIGGERS[self.trigger]

    def percentile_ms(self, q):
        return 1e3 * float(np.percentile(self.times, q)) if self.times else float("nan")

    @property
    def p50_ms(self):
        return self.percentile_ms(50)

    @property
    def p99_ms(self):
        return self.percentile_ms(99)

    def as_dict(self):
        return {"name": self.name, "label": self.label, "trigger": self.trigger,
                "trigger_label": self.trigger_label, "runs": len(self.times),
                "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
                "times_s": list(self.times), "error": self.error, "skipped": self.skipped}


def not_measurable(name: str, trigger: str) -> Optional[str]:
    """Why implementation ``name`` cannot be asked for a batch by ``trigger`` (a key of
    ``TRIGGERS``), or None."""
    if trigger not in TRIGGERS:
        raise ValueError(f"unknown trigger {trigger!r}; expected one of {tuple(TRIGGERS)}")
    if trigger == "reseed" and name in ("unienv", "unienv_shm"):
        return ("UniEnv's manual_seed() reseeds only this process's copy of the sampler; "
                "sample() then returns a batch its workers made before")
    return None


def latency_probe(name: str, trigger: str, rb, cfg: Config):
    """``(prepare, first_batch, close)`` for timing one way (``trigger``, a key of
    ``TRIGGERS``) of asking implementation ``name`` for a batch with nothing prefetched:
    ``prepare()`` (not timed) sets up the next run and waits ``LATENCY_PAUSE_S``,
    ``first_batch()`` (timed) asks for the batch and returns it, ``close()`` releases
    everything.

    * ``reseed``: one sampler, started (``cfg.warmup`` batches) before the first run;
      each run calls ``manual_seed`` with a new seed, then ``sample()``.  unienv_mp drops
      the batches requested before and reseeds the workers, so the batch is made after
      the call.  UniEnv's ``manual_seed`` reseeds only this process's copy of the
      sampler: its ``sample()`` returns a batch its workers made before, from the old
      seed, so that row raises ``NotMeasurable``.
    * ``epoch``: one sampler; each run takes the first batch of a new ``epoch_iter()``
      (``prepare`` closes the one before).  Over data that is not shared between
      processes, UniEnv's MultiprocessingSampler starts the epoch's workers there;
      unienv_mp's runs the epoch on the workers it kept, the data being unchanged (its
      first run starts them).
    * ``start``: each run makes a new sampler (seeded with the run's number) and calls
      ``sample()``, so it includes starting the workers (``prepare`` closes the one
      before).
    """
    reason = not_measurable(name, trigger)
    if reason is not None:
        raise NotMeasurable(reason)
    probe = {"reseed": _reseed_probe, "epoch": _epoch_probe, "start": _start_probe}[trigger]
    return probe(name, rb, cfg)


def _pause():
    time.sleep(LATENCY_PAUSE_S)


def _reseed_probe(name: str, rb, cfg: Config):
    """The ``reseed`` probe of ``latency_probe``: ``manual_seed`` with a new seed, then
    ``sample()``, on one sampler started before the first run."""
    seeds = itertools.count(1)
    s = sampler_object(name, rb, cfg)
    try:
        for _ in range(cfg.warmup):
            touch(s.sample())
    except BaseException:
        close_sampler(s)
        raise

    def first_batch():
        s.manual_seed(next(seeds))
        return s.sample()
    return _pause, first_batch, lambda: close_sampler(s)


def _epoch_probe(name: str, rb, cfg: Config):
    """The ``epoch`` probe of ``latency_probe``: the first batch of a new ``epoch_iter()``
    of one sampler (the epoch before closed by ``prepare``)."""
    s = sampler_object(name, rb, cfg)
    epochs = []

    def end_epochs():
        while epochs:
            epochs.pop().close()

    def prepare():
        end_epochs()
        _pause()

    def first_batch():
        it = iter(s.epoch_iter())
        epochs.append(it)
        return next(it)

    def close():
        try:
            end_epochs()
        finally:
            close_sampler(s)
    return prepare, first_batch, close


def _start_probe(name: str, rb, cfg: Config):
    """The ``start`` probe of ``latency_probe``: the first ``sample()`` of a new sampler,
    seeded with the run's number (the one before closed by ``prepare``)."""
    seeds = itertools.count(1)
    made = []

    def close_made():
        while made:
            close_sampler(made.pop())

    def prepare():
        close_made()
        _pause()

    def first_sample():
        made.append(sampler_object(name, rb, cfg, seed=next(seeds)))
        return made[-1].sample()
    return prepare, first_sample, close_made


def measure_latency(name: str, trigger: str, rb, cfg: Config,
                    progress: Callable[[float], None] = lambda f: None) -> LatencyResult:
    """Time ``trigger`` for implementation ``name`` (see ``latency_probe``) as often as
    fits in ``cfg.seconds`` (at least ``cfg.min_batches`` runs, at most
    ``cfg.max_batches``); each run's time covers asking for the batch and reading it."""
    res = LatencyResult(name, LABELS.get(name, name), trigger)
    res.skipped = not_measurable(name, trigger)
    if res.skipped is not None:
        return res
    gc.collect()

    def make():
        prepare, first_batch, close = latency_probe(name, trigger, rb, cfg)
        return (prepare, first_batch), close

    def run(probe):
        prepare, first_batch = probe
        start = time.perf_counter()
        elapsed = 0.0
        while len(res.times) < cfg.max_batches and (
                elapsed < cfg.seconds or len(res.times) < cfg.min_batches):
            prepare()
            t0 = time.perf_counter()
            touch(first_batch())
            res.times.append(time.perf_counter() - t0)
            elapsed = time.perf_counter() - start
            progress(min(1.0, elapsed / cfg.seconds))
    return guarded(res, make, run)
