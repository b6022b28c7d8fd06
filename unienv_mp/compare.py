"""Side-by-side timing of batch samplers over one in-memory UniEnv ReplayBuffer.

Used by the main job (``python -m unienv_mp``) and by ``benchmarks/bench_sampler.py``.
Every implementation samples the same buffer with the same batch size; the consumer touches
one byte per 4 KiB page of every array it receives, as a training step that reads the
batch would.
"""
import gc
import importlib.util
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

IMPLEMENTATIONS = ("unienv_mp", "unienv", "unienv_shm", "in_process", "dataloader")
LABELS = {
    "unienv_mp": "unienv_mp MultiprocessingSampler",
    "unienv": "UniEnv MultiprocessingSampler",
    "unienv_shm": "UniEnv MultiprocessingSampler(shared_memory=True)",
    "in_process": "UniEnv StepSampler, in process",
    "dataloader": "torch DataLoader",
}


@dataclass
class Config:
    transitions: int = 20_000
    batch_size: int = 256
    image_shape: tuple = (3, 128, 128)
    workers: int = 4
    buffers: int = 8
    start_method: str = "fork"
    seconds: float = 6.0          # time spent measuring each implementation
    warmup: int = 3               # batches taken before the clock starts
    min_batches: int = 5
    max_batches: int = 5000


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
                "error": self.error}


def available():
    """Which implementations can run here, and why not for the others."""
    missing = {}
    if importlib.util.find_spec("torch") is None:
        missing.update({k: "torch is not installed" for k in IMPLEMENTATIONS})
        return missing
    if importlib.util.find_spec("unienv_data") is None:
        missing.update({k: "unienv is not installed" for k in IMPLEMENTATIONS})
        return missing
    try:
        from unienv_data.samplers import MultiprocessingSampler  # noqa: F401
    except ImportError:
        missing["unienv"] = missing["unienv_shm"] = (
            "this unienv has no unienv_data.samplers.MultiprocessingSampler")
    return missing


def build_buffer(cfg: Config, progress: Callable[[int], None] = lambda n: None):
    """An in-memory ReplayBuffer of ``cfg.transitions`` steps of
    {state: 10 f32, action: 7 f32, image: ``cfg.image_shape`` u8} (or no image if the
    shape is empty)."""
    import torch
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    from unienv_interface.backends.pytorch import PyTorchComputeBackend as B
    from unienv_interface.space import BoxSpace, DictSpace

    spaces = {"state": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(10,)),
              "action": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(7,))}
    if cfg.image_shape:
        spaces["image"] = BoxSpace(B, 0, 255, torch.uint8, shape=tuple(cfg.image_shape))
    rb = ReplayBuffer.create(DictStorage, DictSpace(B, spaces),
                             {k: PytorchTensorStorage for k in spaces},
                             capacity=cfg.transitions, is_memmap=False)
    gen = torch.Generator().manual_seed(0)
    chunk = 500
    for start in range(0, cfg.transitions, chunk):
        n = min(chunk, cfg.transitions - start)
        rows = {"state": torch.rand(n, 10, generator=gen) * 2 - 1,
                "action": torch.rand(n, 7, generator=gen) * 2 - 1}
        if cfg.image_shape:
            rows["image"] = torch.randint(0, 256, (n, *cfg.image_shape), dtype=torch.uint8,
                                          generator=gen)
        rb.extend(rows)
        progress(n)
    return rb


def _arrays(batch):
    """The numpy arrays (torch tensors as numpy views) of a nested batch."""
    stack = [batch]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif x is not None:
            yield x if isinstance(x, np.ndarray) else x.numpy()


def touch(batch):
    """Read one byte per 4 KiB page of every array in ``batch``; returns a checksum."""
    return sum(int(a.reshape(-1).view(np.uint8)[::4096].sum()) for a in _arrays(batch))


def batch_nbytes(batch):
    """Bytes of array data in ``batch``."""
    return sum(a.nbytes for a in _arrays(batch))


class _SampleDataset:
    """A torch IterableDataset yielding ``sampler.sample()`` forever (one worker's share)."""

    def __init__(self, sampler):
        import torch.utils.data as tud
        self.sampler = sampler
        self.__class__ = type("SampleDataset", (_SampleDataset, tud.IterableDataset), {})

    def __iter__(self):
        import torch.utils.data as tud
        info = tud.get_worker_info()
        if info is not None:
            self.sampler.manual_seed(info.seed % (2 ** 31))
        while True:
            yield self.sampler.sample()


def make_sampler(name: str, rb, cfg: Config, seed: int = 0):
    """(next_batch, close) for implementation ``name``."""
    from unienv_data.samplers import StepSampler
    base = StepSampler(rb, cfg.batch_size, seed=seed)
    ctx = mp.get_context(cfg.start_method)
    if name == "unienv_mp":
        from .sampler import MultiprocessingSampler
        s = MultiprocessingSampler(base, n_workers=cfg.workers, n_buffers=cfg.buffers, ctx=ctx)
        return s.sample, s.close
    if name in ("unienv", "unienv_shm"):
        from unienv_data.samplers import MultiprocessingSampler as UniEnvSampler
        s = UniEnvSampler(base, n_workers=cfg.workers, n_buffers=cfg.buffers, ctx=ctx,
                          shared_memory=name == "unienv_shm")
        return s.sample, s.close
    if name == "in_process":
        return base.sample, lambda: None
    if name == "dataloader":
        import warnings
        import torch.utils.data as tud
        # (torch warns when workers outnumber cores; the comparison uses the same count)
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        loader = tud.DataLoader(_SampleDataset(base), batch_size=None,
                                num_workers=cfg.workers, multiprocessing_context=ctx,
                                prefetch_factor=max(2, cfg.buffers // cfg.workers),
                                persistent_workers=True)
        it = iter(loader)

        def close():
            it._shutdown_workers()
        return it.__next__, close
    raise ValueError(f"unknown implementation {name!r}; expected one of {IMPLEMENTATIONS}")


def measure(name: str, rb, cfg: Config, progress: Callable[[float], None] = lambda f: None):
    """Time implementation ``name``: start it, take ``cfg.warmup`` batches, then as many as
    fit in ``cfg.seconds`` (at least ``cfg.min_batches``)."""
    res = Result(name, LABELS.get(name, name))
    gc.collect()
    t0 = time.perf_counter()
    try:
        next_batch, close = make_sampler(name, rb, cfg)
    except Exception as e:   # reported in the table, not fatal to the comparison
        res.error = f"{type(e).__name__}: {e}"
        return res
    try:
        for _ in range(cfg.warmup):
            b = next_batch()
            touch(b)
            res.batch_bytes = batch_nbytes(b)
            del b
        res.startup_s = time.perf_counter() - t0
        n = 0
        cpu0 = _process_cpu()
        start = time.perf_counter()
        elapsed = 0.0
        while n < cfg.max_batches and (elapsed < cfg.seconds or n < cfg.min_batches):
            b = next_batch()
            touch(b)
            del b
            n += 1
            elapsed = time.perf_counter() - start
            progress(min(1.0, elapsed / cfg.seconds))
        res.batches, res.seconds = n, elapsed
        res.main_cpu_s = _process_cpu() - cpu0
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"
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
