"""The epoch case: seconds per epoch of ``epoch_iter()``, the first epoch and the later
ones, and each epoch's first batch (``measure_epochs``)."""
import gc
import multiprocessing as mp
import time
from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional

import numpy as np

from .config import EPOCH_ROW_OF, LABELS, VIEW_EPOCH_ROWS, Config
from .measure import guarded, preimport, touch
from .peers import close_sampler, drop_dataloader, sampler_object
from .views import frame_stack


@dataclass
class EpochResult:
    """One row of the epoch case: ``seconds`` and ``first_batch`` (seconds to the first
    batch, read), one entry per epoch, in order; ``batches`` per epoch."""
    name: str
    label: str
    seconds: List[float] = field(default_factory=list)
    first_batch: List[float] = field(default_factory=list)
    batches: int = 0
    error: Optional[str] = None

    @property
    def first_epoch_s(self):
        return self.seconds[0] if self.seconds else float("nan")

    @property
    def later_epoch_s(self):
        """The median of the epochs after the first (nan with one epoch or none)."""
        later = self.seconds[1:]
        return float(np.median(later)) if later else float("nan")

    @property
    def first_batch_first_ms(self):
        return 1e3 * self.first_batch[0] if self.first_batch else float("nan")

    @property
    def first_batch_later_ms(self):
        later = self.first_batch[1:]
        return 1e3 * float(np.median(later)) if later else float("nan")

    def as_dict(self):
        return {"name": self.name, "label": self.label, "batches": self.batches,
                "epoch_s": list(self.seconds), "first_batch_s": list(self.first_batch),
                "first_epoch_s": self.first_epoch_s, "later_epoch_s": self.later_epoch_s,
                "first_batch_first_epoch_ms": self.first_batch_first_ms,
                "first_batch_later_epochs_ms": self.first_batch_later_ms,
                "error": self.error}


def epoch_runner(name: str, rb, cfg: Config, seed: int = 0):
    """``(epoch, close)`` for row ``name`` of the epoch case: ``epoch()`` returns an
    iterator over one epoch's batches (for ``unienv_mp_sample``: as many ``sample()``
    batches as an epoch has, after as many taken before, untimed, to reach the steady
    state); ``close()`` releases everything."""
    if name == "unienv_mp_sample":
        return _steady_samples(rb, cfg, seed)
    if name == "dataloader_epoch":
        return _dataloader_epochs(rb, cfg, seed)
    if name in ("unienv_mp", "unienv_shm", "unienv", "in_process"):
        s = sampler_object(name, rb, cfg, seed)
        return s.epoch_iter, lambda: close_sampler(s)
    if name in VIEW_EPOCH_ROWS:
        # (``rb``: the episodic buffer, see runner._epochs)
        view = frame_stack(rb)
        if name == "unienv_mp_view_spawn":
            cfg = replace(cfg, start_method="spawn")
        s = sampler_object(EPOCH_ROW_OF[name], view, cfg, seed)
        return s.epoch_iter, lambda: close_sampler(s)
    raise ValueError(f"{name!r} is not a row of the epoch case")


def _steady_samples(rb, cfg: Config, seed: int):
    """The ``unienv_mp_sample`` row: as many ``sample()`` batches of a running unienv_mp
    sampler as an epoch has, after as many untimed."""
    n_batches = -(-len(rb) // cfg.batch_size)
    s = sampler_object("unienv_mp", rb, cfg, seed)
    try:
        for _ in range(n_batches):
            touch(s.sample())
    except BaseException:
        s.close()
        raise

    def samples():
        for _ in range(n_batches):
            yield s.sample()
    return samples, s.close


def _dataloader_epochs(rb, cfg: Config, seed: int):
    """The ``dataloader_epoch`` row: a torch DataLoader over UniEnv's
    ``UniEnvAsPyTorchDataset``, shuffled, ``persistent_workers=True``; closing it drops
    the loader (``peers.drop_dataloader``), which stops its workers once the caller holds
    none of its epochs' iterators either."""
    import warnings
    import torch
    import torch.utils.data as tud
    from unienv_data.integrations.pytorch import UniEnvAsPyTorchDataset
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    ds = UniEnvAsPyTorchDataset(rb)
    loader = tud.DataLoader(ds, batch_size=cfg.batch_size, shuffle=True,
                            num_workers=cfg.workers, persistent_workers=True,
                            pin_memory=False, collate_fn=UniEnvAsPyTorchDataset.collate_fn,
                            multiprocessing_context=mp.get_context(cfg.start_method),
                            generator=torch.Generator().manual_seed(seed))
    held = {"loader": loader}

    def epoch():
        return iter(held["loader"])
    return epoch, lambda: drop_dataloader(held)


def measure_epochs(name: str, rb, cfg: Config,
                   progress: Callable[[float], None] = lambda f: None) -> EpochResult:
    """Time ``cfg.epochs`` epochs of row ``name`` (see ``epoch_runner``), one after the
    other on one sampler, each batch read (``touch``): seconds per epoch, and to each
    epoch's first batch.  The first epoch includes starting the workers, where the row
    starts them then."""
    res = EpochResult(name, LABELS.get(name, name))
    preimport(name)
    gc.collect()

    def make():
        return epoch_runner(name, rb, cfg)

    def run(epoch):
        for e in range(cfg.epochs):
            t0 = time.perf_counter()
            n = 0
            first = None
            for batch in epoch():
                touch(batch)
                n += 1
                if first is None:
                    first = time.perf_counter() - t0
                del batch
            res.seconds.append(time.perf_counter() - t0)
            res.first_batch.append(first if first is not None else float("nan"))
            res.batches = n
            progress((e + 1) / cfg.epochs)
    return guarded(res, make, run)
