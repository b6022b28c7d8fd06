"""Side-by-side timing of batch samplers over one in-memory UniEnv ReplayBuffer.

Used by the main job (``python -m unienv_mp``) and by ``benchmarks/bench_sampler.py``.
Every implementation samples the same buffer with the same batch size; the consumer touches
one byte per 4 KiB page of every array it receives, as a training step that reads the
batch would.

The implementations (``IMPLEMENTATIONS``):

* ``unienv_mp``: unienv_mp's MultiprocessingSampler (workers gather rows straight into
  the shared slots);
* ``unienv_mp_generic``: the same with ``direct_gather=False`` (workers call the wrapped
  sampler's ``sample()``, and the batch is copied into the slot);
* ``unienv``, ``unienv_shm``: UniEnv's MultiprocessingSampler, ``shared_memory`` False / True;
* ``in_process``: UniEnv's StepSampler, ``sample()`` in the training process;
* ``dataloader``: a torch DataLoader with as many workers, each calling ``sample()``;
* ``index_select``: the speed limit of in-process sampling: the StepSampler's indices, mapped
  to storage rows as the ReplayBuffer does, gathered with ``torch.index_select(..., out=)``
  into one set of output tensors allocated up front and reused for every batch (so a batch
  is only valid until the next one);
* ``torchrl``: a TorchRL ``ReplayBuffer(prefetch=4)`` (uniform ``RandomSampler``, 4
  prefetch threads) over the same rows; needs ``torchrl``, which is optional.
"""
import gc
import importlib.util
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

IMPLEMENTATIONS = ("unienv_mp", "unienv_mp_generic", "unienv", "unienv_shm", "in_process",
                   "dataloader", "index_select", "torchrl")
LABELS = {
    "unienv_mp": "unienv_mp MultiprocessingSampler",
    "unienv_mp_generic": "unienv_mp, direct_gather=False",
    "unienv": "UniEnv MultiprocessingSampler",
    "unienv_shm": "UniEnv MultiprocessingSampler(shared_memory=True)",
    "in_process": "UniEnv StepSampler, in process",
    "dataloader": "torch DataLoader",
    "index_select": "index_select into reused memory, in process",
    "torchrl": "TorchRL ReplayBuffer(prefetch=4)",
}
TORCHRL_PREFETCH = 4


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
    # find_spec only: importing torchrl takes seconds, and it is optional
    if importlib.util.find_spec("torchrl") is None:
        missing["torchrl"] = "torchrl is not installed (pip install torchrl)"
    elif importlib.util.find_spec("tensordict") is None:
        missing["torchrl"] = "tensordict (needed by torchrl) is not installed"
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
    if name in ("unienv_mp", "unienv_mp_generic"):
        from .sampler import MultiprocessingSampler
        s = MultiprocessingSampler(base, n_workers=cfg.workers, n_buffers=cfg.buffers, ctx=ctx,
                                   direct_gather=False if name == "unienv_mp_generic" else None)
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
    if name == "index_select":
        return _index_select_sampler(base, rb, cfg)
    if name == "torchrl":
        return _torchrl_sampler(rb, cfg, seed)
    raise ValueError(f"unknown implementation {name!r}; expected one of {IMPLEMENTATIONS}")


def _dict_storage_tensors(rb):
    """{key: the torch tensor holding every row of that key} of a ReplayBuffer over a flat
    DictStorage of tensor storages (what ``build_buffer`` makes)."""
    storage_map = getattr(rb.storage, "storage_map", None)
    if storage_map is None:
        raise TypeError(f"needs a ReplayBuffer over a DictStorage, not "
                        f"{type(rb.storage).__name__}")
    out = {}
    for key, storage in storage_map.items():
        data = getattr(storage, "data", None)
        if data is None or not hasattr(data, "index_select"):
            raise TypeError(f"needs tensor storages; {key!r} is a {type(storage).__name__}")
        out[key] = data
    return out


def _index_select_sampler(base, rb, cfg: Config):
    """The speed limit of in-process sampling: ``base``'s own indices, mapped to storage
    rows as the ReplayBuffer maps them, gathered by ``torch.index_select`` into output
    tensors allocated once here and returned (the same ones) for every batch.

    The mapping is the ReplayBuffer's arithmetic, ``(index + offset) % count`` on one
    snapshot of its ring state, without ``_logical_to_physical_index``'s bounds check
    (which costs more than the gather of a small batch): ``sample_index()`` draws in
    ``[0, len)`` by construction."""
    import torch
    data = _dict_storage_tensors(rb)
    out = {k: torch.empty((cfg.batch_size, *d.shape[1:]), dtype=d.dtype, device=d.device)
           for k, d in data.items()}
    ring = getattr(rb, "_ring_state", None)
    if ring is None:    # another UniEnv: its own mapping, bounds check included
        physical = rb._logical_to_physical_index
    else:
        shifted = None

        def physical(idx):
            nonlocal shifted
            count, offset = ring.read()
            if offset == 0:     # 0 <= idx < count: (idx + 0) % count is idx
                return idx
            if shifted is None or shifted.shape != idx.shape or shifted.dtype != idx.dtype:
                shifted = torch.empty_like(idx)
            torch.add(idx, offset, out=shifted)
            return shifted.remainder_(count)

    def next_batch():
        rows = physical(base.sample_index())
        for k, d in data.items():
            torch.index_select(d, 0, rows, out=out[k])
        return out
    return next_batch, lambda: None


def _torchrl_sampler(rb, cfg: Config, seed: int = 0):
    """A TorchRL ``ReplayBuffer(prefetch=TORCHRL_PREFETCH)`` over the same rows, sampled
    uniformly with replacement (``RandomSampler``), as an RL user of TorchRL would.

    Its storage is a ``TensorStorage`` over a TensorDict of the UniEnv buffer's tensors
    in logical order: views of them (no copy) when the buffer's logical rows are its
    physical rows ``0..len-1`` (a buffer filled once, as ``build_buffer`` makes), else a
    copy made here.  Sampling reads it exactly as a filled ``LazyTensorStorage``."""
    import torch
    from tensordict import TensorDict
    from torchrl.data import ReplayBuffer, TensorStorage
    from torchrl.data.replay_buffers.samplers import RandomSampler
    data = _dict_storage_tensors(rb)
    n = len(rb)
    rows = rb._logical_to_physical_index(torch.arange(n))
    in_place = bool(torch.equal(torch.as_tensor(rows), torch.arange(n)))
    td = TensorDict({k: d[:n] if in_place else d.index_select(0, torch.as_tensor(rows))
                     for k, d in data.items()}, batch_size=[n])
    trb = ReplayBuffer(storage=TensorStorage(td), sampler=RandomSampler(),
                       batch_size=cfg.batch_size, prefetch=TORCHRL_PREFETCH,
                       generator=torch.Generator().manual_seed(seed))

    def close():
        # stops the prefetch thread pool (after its pending samples)
        shutdown = getattr(trb, "shutdown", None)
        if shutdown is not None:
            shutdown()
        else:   # older torchrl: no shutdown(); its pool is _prefetch_executor
            executor = getattr(trb, "_prefetch_executor", None)
            if executor is not None:
                executor.shutdown(wait=True)
    return trb.sample, close


# Modules an implementation imports when it starts, imported before its clock starts:
# importing torchrl takes seconds, which are not its start-up.
_PREIMPORT = {"torchrl": ("tensordict", "torchrl.data")}


def measure(name: str, rb, cfg: Config, progress: Callable[[float], None] = lambda f: None):
    """Time implementation ``name``: start it, take ``cfg.warmup`` batches, then as many as
    fit in ``cfg.seconds`` (at least ``cfg.min_batches``)."""
    res = Result(name, LABELS.get(name, name))
    try:
        for module in _PREIMPORT.get(name, ()):
            importlib.import_module(module)
    except Exception as e:   # reported in the table, not fatal to the comparison
        res.error = f"{type(e).__name__}: {e}"
        return res
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
