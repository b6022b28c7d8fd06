"""Small UniEnv data sets and samplers for the tests (importable by spawned workers)."""
import os
import time

import numpy as np
import torch
from unienv_data.base import BatchSampler
from unienv_data.replay_buffer import ReplayBuffer
from unienv_data.samplers import StepSampler
from unienv_data.storages.dict_storage import DictStorage
from unienv_data.storages.pytorch import PytorchTensorStorage
from unienv_interface.backends.pytorch import PyTorchComputeBackend as TB
from unienv_interface.space import BoxSpace, DictSpace

IMG = (3, 8, 8)


def space(img=IMG):
    return DictSpace(TB, {
        "state": BoxSpace(TB, -1e9, 1e9, torch.float32, shape=(10,)),
        "action": BoxSpace(TB, -1.0, 1.0, torch.float32, shape=(7,)),
        "image": BoxSpace(TB, 0, 255, torch.uint8, shape=img),
    })


def transitions(start, count, img=IMG):
    """Rows whose state[:, 0] is the row's index, so a batch tells which rows it holds."""
    idx = torch.arange(start, start + count, dtype=torch.float32)
    state = torch.zeros(count, 10)
    state[:, 0] = idx
    state[:, 1:] = torch.rand(count, 9) * 0.5
    return {"state": state, "action": torch.rand(count, 7) * 2 - 1,
            "image": (idx.to(torch.int64) % 251).to(torch.uint8).view(-1, 1, 1, 1).expand(
                count, *img).contiguous()}


def replay_buffer(n=200, capacity=None, multiprocessing=False, memmap_dir=None, img=IMG):
    storages = {k: PytorchTensorStorage for k in ("state", "action", "image")}
    kwargs = {"is_memmap": memmap_dir is not None}
    rb = ReplayBuffer.create(DictStorage, space(img), storages, capacity=capacity or n,
                             multiprocessing=multiprocessing, cache_path=memmap_dir, **kwargs)
    if n:
        rb.extend(transitions(0, n, img))
    return rb


def indices_of(batch, img=IMG):
    """Row indices of a batch: its state[:, 0] (in a flat batch the keys are flattened in
    sorted order, action (7), image, state (10), so state[:, 0] comes after them)."""
    if isinstance(batch, tuple):
        batch = batch[0]
    if isinstance(batch, dict):
        x = batch["state"][:, 0]
    else:
        x = batch[..., 7 + int(np.prod(img))]
    if isinstance(x, torch.Tensor):
        x = x.numpy()
    return np.asarray(x).round().astype(np.int64).tolist()


def refuse(*args, **kwargs):
    """Stands in for a method that must not be called."""
    raise RuntimeError("refused: this method must not be called")


class ScaledTensor(torch.Tensor):
    """A tensor whose indexing divides what it returns by 10."""

    def __getitem__(self, index):
        return torch.Tensor.__getitem__(self.as_subclass(torch.Tensor), index) / 10


class NegatedStorage(PytorchTensorStorage):
    """A storage whose rows are computed (negated) on the way out."""

    def get(self, index):
        return -super().get(index)


class SlowSampler(StepSampler):
    """A StepSampler whose every batch takes ``delay`` seconds."""

    def __init__(self, data, batch_size, seed=None, delay=0.2):
        super().__init__(data, batch_size, seed=seed)
        self.delay = delay

    def get_at(self, idx):
        time.sleep(self.delay)
        return super().get_at(idx)


class FailingSampler(StepSampler):
    """A StepSampler that raises on every ``fail_every``-th batch it produces."""

    def __init__(self, data, batch_size, seed=None, fail_every=3):
        super().__init__(data, batch_size, seed=seed)
        self.fail_every = fail_every
        self.count = 0

    def get_at(self, idx):
        self.count += 1
        if self.count % self.fail_every == 0:
            raise KeyError(f"no such row (call {self.count} in pid {os.getpid()})")
        return super().get_at(idx)


class VaryingSampler(StepSampler):
    """A StepSampler whose batches change size and structure from call to call."""

    def __init__(self, data, batch_size, seed=None):
        super().__init__(data, batch_size, seed=seed)
        self.count = 0

    def sample(self):
        self.count += 1
        batch = super().sample()
        k = self.count % 4
        if k == 1:
            batch["extra"] = torch.zeros(self.count * 1000, dtype=torch.float64)  # grows
        elif k == 2:
            batch = {"only": batch["state"], "n": self.count}
        elif k == 3:
            batch = [batch["action"], (batch["image"], None)]
        return batch


class DeviceSampler(StepSampler):
    """A StepSampler whose batches land on a non-CPU device after the fact (``meta``)."""

    def sample(self):
        batch = super().sample()
        return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in batch.items()}


class CudaSampler(StepSampler):
    """A StepSampler that says its batches are on cuda:0 (as ``StepSampler(data, b,
    device="cuda")`` would on a machine with a GPU)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


class Unpicklable(StepSampler):
    def __init__(self, data, batch_size, seed=None):
        super().__init__(data, batch_size, seed=seed)
        self.hook = lambda: None  # lambdas cannot be pickled


class DyingSampler(StepSampler):
    """Kills its own worker (SIGKILL, or a segfault) in the middle of a batch, until
    ``deaths`` deaths are recorded in the ``marker`` file (shared by every worker)."""

    def __init__(self, data, batch_size, seed=None, marker=None, deaths=1, how="kill",
                 every=3):
        super().__init__(data, batch_size, seed=seed)
        self.marker = marker
        self.deaths = deaths
        self.how = how
        self.every = every
        self.count = 0

    def _maybe_die(self):
        self.count += 1
        if self.count % self.every:
            return
        try:
            with open(self.marker) as f:
                done = len(f.read().split())
        except FileNotFoundError:
            done = 0
        if done >= self.deaths:
            return
        with open(self.marker, "a") as f:
            f.write(f"{os.getpid()}\n")
        if self.how == "segfault":
            import ctypes
            import faulthandler
            faulthandler.disable()   # (pytest's handler would print a dump: noise)
            ctypes.string_at(0)
        os.kill(os.getpid(), 9)

    def get_at(self, idx):
        self._maybe_die()
        return super().get_at(idx)


class CrashAtStart(BatchSampler):
    """A sampler whose worker dies (exit code 7) as soon as it is seeded (a worker seeds
    the sampler for every chunk of a ``sample*`` method)."""

    def __init__(self, inner):
        super().__init__(inner.single_space, None, inner.batch_size)
        self.inner = inner
        self.data = inner.data
        self.data_rng = inner.data_rng

    def manual_seed(self, seed):
        os._exit(7)

    def get_at(self, idx):
        return self.inner.get_at(idx)


class DiesWhileMarked(StepSampler):
    """Kills its own worker (SIGKILL) each time it is seeded (once per chunk of a
    ``sample*`` method) while the file ``marker`` exists."""

    def __init__(self, data, batch_size, seed=None, marker=None):
        super().__init__(data, batch_size, seed=seed)
        self.marker = marker

    def manual_seed(self, seed):
        if self.marker is not None and os.path.exists(self.marker):
            os.kill(os.getpid(), 9)
        return super().manual_seed(seed)


class WorkerGone(Exception):
    """Stands for a worker's death where the sampler runs in the process that made it (the
    contract test's in-process fake manager)."""


class GoneOnSeed(StepSampler):
    """Raises ValueError when seeded with ``bad_seed``; dies when seeded while the file
    ``marker`` exists: SIGKILLs its process, or, in the process that made it, raises
    WorkerGone."""

    def __init__(self, data, batch_size, seed=None, bad_seed=None, marker=None):
        super().__init__(data, batch_size, seed=seed)
        self.bad_seed = bad_seed
        self.marker = marker
        self.home = os.getpid()

    def manual_seed(self, seed):
        if self.marker is not None and os.path.exists(self.marker):
            if os.getpid() == self.home:
                raise WorkerGone(seed)
            os.kill(os.getpid(), 9)
        if self.bad_seed is not None and seed == self.bad_seed:
            raise ValueError(f"bad seed {seed}")
        return super().manual_seed(seed)


def mapping_of(ptr):
    """The path of the shared mapping that ``ptr`` lies in ("" if none)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi and fields[1][3] == "s":
                return fields[5] if len(fields) > 5 else "(anonymous)"
    return ""


def same_bits(a, b):
    """Bit for bit: the same structure, dtypes, shapes and bytes (``b``'s tensors may be
    on another device)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        b = b.cpu()
        return (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bytes(a), _bytes(b)))
    return a == b


def _bytes(t):
    return t.reshape(-1) if t.dtype == torch.bool else t.reshape(-1).view(torch.uint8)
