"""Side-by-side timing of batch samplers over UniEnv ReplayBuffers: the main job's cases.

Used by the main job (``python -m unienv_mp``) and by ``benchmarks/bench_sampler.py``.
Every row of a case samples the same data with the same batch size; the consumer touches
one byte per 4 KiB page of every array it receives, as a training step that reads the
batch would.

The cases (``CASES``):

* ``image``, ``state``: batches per second of ``sample()`` from an in-memory ReplayBuffer
  (``build_buffer``), every implementation below;
* ``jpeg``: the same where every batch decodes: the images are JPEG files in UniEnv's
  ``ImageStorage`` (``build_jpeg_buffer``), so the worker (or the training process, in
  process) decodes each row it samples;
* ``online``: a training loop that appends ``Config.append`` transitions to a shared
  (``multiprocessing=True``) ReplayBuffer before every ``sample()`` (``measure_online``):
  time per loop step, and how stale the batches are (``staleness``);
* ``latency``: the time to one batch when nothing was prefetched (``measure_latency``),
  for each way of asking for one (``TRIGGERS``);
* ``views``: batches per second of ``sample()`` from the views robot learners sample
  (``VIEWS``: frame stacks, action chunks, columns, a combined dataset) over episodic
  in-memory ReplayBuffers (``build_episodic_buffer``), a row per view
  (``measure_view``), with the bare limit of each (``index_select`` below).
* ``epoch``: seconds per epoch of ``epoch_iter()`` over an in-memory ReplayBuffer, the
  first epoch and the later ones, and each epoch's first batch (``measure_epochs``), with
  a row for the same number of steady-state ``sample()`` batches (``EPOCH_ROWS``).

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
  is only valid until the next one); for a view, its final rows and valid mask computed as
  unienv_mp's workers compute them, then the same gather;
* ``torchrl``: a TorchRL ``ReplayBuffer(prefetch=4)`` (uniform ``RandomSampler``, 4
  prefetch threads) over the same rows; for the action chunks of the views case, its
  ``SliceSampler`` (slices of 16 by the episode key); needs ``torchrl``, which is
  optional;
* ``ray``: unienv_mp's RaySampler on a local Ray that it starts, one actor per worker;
  needs ``ray``, which is optional.  Not in ``DEFAULT_IMPLEMENTATIONS``: asked for by name.

Each measurement returns a result object (``Result``, ``OnlineResult``,
``LatencyResult``); the main job turns each case's results into one table.
"""
import contextlib
import dataclasses
import gc
import importlib.util
import itertools
import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

IMPLEMENTATIONS = ("unienv_mp", "unienv_mp_generic", "unienv", "unienv_shm", "in_process",
                   "dataloader", "index_select", "torchrl", "ray")
#: What runs unless others are asked for ("ray" starts a Ray: asked for by name only).
DEFAULT_IMPLEMENTATIONS = IMPLEMENTATIONS[:-1]
LABELS = {
    "unienv_mp": "unienv_mp MultiprocessingSampler",
    "unienv_mp_generic": "unienv_mp, direct_gather=False",
    "unienv": "UniEnv MultiprocessingSampler",
    "unienv_shm": "UniEnv MultiprocessingSampler(shared_memory=True)",
    "in_process": "UniEnv StepSampler, in process",
    "dataloader": "torch DataLoader",
    "index_select": "index_select into reused memory, in process",
    "torchrl": "TorchRL ReplayBuffer(prefetch=4)",
    "ray": "unienv_mp RaySampler (local Ray)",
}
TORCHRL_PREFETCH = 4
# The implementations whose speed depends on the number of workers (a worker sweep times
# them at each count; the others run once).
USES_WORKERS = ("unienv_mp", "unienv_mp_generic", "unienv", "unienv_shm", "dataloader", "ray",
                "unienv_mp_sample", "dataloader_epoch")


@dataclass
class Config:
    transitions: int = 20_000
    batch_size: int = 256
    image_shape: tuple = (3, 128, 128)   # C x H x W; () for none
    workers: int = 4
    buffers: int = 8
    start_method: str = "fork"
    seconds: float = 6.0          # time spent measuring each implementation
    warmup: int = 3               # batches taken before the clock starts
    min_batches: int = 5
    max_batches: int = 5000
    append: int = 4               # online: transitions appended per loop step
    epochs: int = 4               # epoch: epochs timed per row (the first, then the later)


# ---------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One workload of the main job: what it measures (``kind``: ``"throughput"``,
    ``"online"`` or ``"latency"``), its rows, in table order, and its data."""
    name: str
    kind: str
    rows: Tuple[str, ...]
    summary: str
    defaults: Dict[str, object] = field(default_factory=dict)
    quick_transitions: int = 2000


CASES = {
    "image": Case("image", "throughput", IMPLEMENTATIONS,
                  "batches of 256 {state, action, 3x128x128 uint8 image} from an in-memory "
                  "ReplayBuffer"),
    "state": Case("state", "throughput", IMPLEMENTATIONS,
                  "batches of 32 {state, action} from an in-memory ReplayBuffer",
                  {"batch_size": 32, "image_shape": ()}),
    "jpeg": Case("jpeg", "throughput",
                 ("unienv_mp", "unienv", "unienv_shm", "in_process", "dataloader", "ray"),
                 "batches of 64 {state, action, 128x128x3 image} whose images are JPEG "
                 "files in UniEnv's ImageStorage, decoded for every batch (needs Pillow)",
                 {"transitions": 4000, "batch_size": 64}, quick_transitions=1000),
    "online": Case("online", "online", ("unienv_mp", "unienv", "in_process"),
                   "a loop that appends 4 transitions (--append) to a shared ReplayBuffer "
                   "(multiprocessing=True) before every sample() of 256 {state, action}: "
                   "ms per loop step, and staleness: the newest step written (t) minus "
                   "the newest step the batch could contain.  Each step t appends, then "
                   "writes t into a clock column of every row, then samples; the "
                   "batch's largest clock is the last step whose writes had landed when "
                   "its rows were read",
                   {"image_shape": ()}),
    "views": Case("views", "views",
                  ("unienv_mp", "unienv_mp_generic", "unienv_shm", "in_process",
                   "index_select", "torchrl"),
                  "batches of 256 from the views robot learners sample (frame stacks, "
                  "action chunks, columns, a combined dataset) over 20,000 steps in "
                  "episodes of 200 {obs: {state, 3x128x128 image}, action, reward, "
                  "episode_id, episode_end}, a row per view",
                  {"seconds": 4.0}),
    "latency": Case("latency", "latency", ("unienv_mp", "unienv", "in_process"),
                    "the time to one batch of 256 {state, action, 3x128x128 image} from "
                    "an in-memory ReplayBuffer with nothing prefetched, p50 and p99, "
                    "asked for by: manual_seed(), then sample(); the first batch of a "
                    "new epoch_iter(); the first sample() of a new sampler"),
    "epoch": Case("epoch", "epoch",
                  ("unienv_mp", "unienv_mp_sample", "unienv_shm", "in_process",
                   "dataloader_epoch"),
                  "seconds per epoch of epoch_iter() over 20k in-memory steps of {state, "
                  "action, 3x128x128 image}, batches of 256: the first epoch (which starts "
                  "the workers) and the later ones, and each epoch's first batch; the "
                  "unienv_mp sample() row times as many steady-state sample() batches as "
                  "an epoch has",
                  quick_transitions=2000),
}
#: The epoch case's rows besides the UniEnv-API samplers: ``unienv_mp_sample`` (as many
#: ``sample()`` batches of a running unienv_mp sampler as an epoch has, the steady state an
#: epoch is compared with) and ``dataloader_epoch`` (a torch DataLoader over UniEnv's
#: ``UniEnvAsPyTorchDataset``, shuffled, ``persistent_workers=True``, ``pin_memory=False``).
EPOCH_ROWS = {
    "unienv_mp_sample": "unienv_mp sample(), as many batches",
    "dataloader_epoch": "torch DataLoader(UniEnvAsPyTorchDataset), persistent workers",
}
LABELS.update(EPOCH_ROWS)
#: The implementation (``--impl``) each of them comes with.
EPOCH_ROW_OF = {"unienv_mp_sample": "unienv_mp", "dataloader_epoch": "dataloader"}


def case_config(case: str, quick: bool = False, **overrides) -> Config:
    """The ``Config`` of ``case``: its defaults, the quick run's (a small buffer, 1.5 s
    per row) if ``quick``, then ``overrides``."""
    spec = CASES[case]
    cfg = replace(Config(), **spec.defaults)
    if quick:
        cfg = replace(cfg, transitions=spec.quick_transitions, seconds=1.5, warmup=2)
    return replace(cfg, **overrides)


def describe(case: str, cfg: Config) -> str:
    """What one batch of ``case`` holds, for table titles."""
    img = "x".join(map(str, cfg.image_shape))
    if case == "jpeg":
        c, h, w = cfg.image_shape
        return (f"state 10 f32, action 7 f32, image {h}x{w}x{c} u8 from JPEG files in "
                f"ImageStorage, decoded for every batch")
    if case == "online":
        return "state 10 f32, action 7 f32, clock i64"
    if case == "views":
        return (f"obs.state 10 f32, obs.image {img or 'none'} u8, action 7 f32, reward f32, "
                f"episode_id i64, episode_end bool; episodes of {EPISODE_STEPS}")
    return "state 10 f32, action 7 f32" + (f", image {img} u8" if cfg.image_shape else "")


def case_missing(case: str, cfg: Config) -> Optional[str]:
    """Why ``case`` cannot run here with ``cfg`` (None if it can): a missing optional
    dependency, or a configuration the case cannot use."""
    if case == "jpeg":
        if len(cfg.image_shape) != 3 or cfg.image_shape[0] != 3:
            return (f"the jpeg case needs an RGB image shape 3xHxW, not "
                    f"{'x'.join(map(str, cfg.image_shape)) or 'none'}")
        try:
            from unienv_data.storages.image_storage import ImageStorage  # noqa: F401
        except ImportError as e:
            if e.name == "PIL":
                return ("Pillow, which UniEnv's ImageStorage needs, is not installed "
                        "(pip install pillow)")
            return f"UniEnv's ImageStorage cannot be imported: {e}"
    return None


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
    if importlib.util.find_spec("unienv_data.integrations.pytorch") is None:
        missing["dataloader_epoch"] = "this unienv has no UniEnvAsPyTorchDataset"
    if importlib.util.find_spec("ray") is None:
        missing["ray"] = "ray is not installed (pip install \"unienv_mp[ray]\")"
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



JPEG_QUALITY = 75


def _photo_like(n, shape, gen):
    """``n`` H x W x 3 uint8 images that compress about as well as photographs: smooth
    random colour fields (bicubic upsampling of a coarse random grid) with a little
    noise.  Uniform noise would make files several times larger and slower to decode
    than a camera's frames."""
    import torch
    import torch.nn.functional as F
    _, h, w = shape
    coarse = torch.rand(n, 3, max(2, h // 16), max(2, w // 16), generator=gen) * 255
    img = F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False)
    img = img + torch.randn(n, 3, h, w, generator=gen) * 6
    return img.clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


EPISODE_STEPS = 200


def build_episodic_buffer(n, cfg: Config, progress: Callable[[int], None] = lambda n: None,
                          start: int = 0):
    """An in-memory ReplayBuffer of ``n`` steps numbered from ``start``, in episodes of
    ``EPISODE_STEPS``: {obs: {state 10 f32, image ``cfg.image_shape`` u8}, action 7 f32,
    reward f32, episode_id i64, episode_end bool} (the layout of UniEnv's own
    ``benchmarks/batches/bench_pipeline.py``)."""
    import torch
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    from unienv_interface.backends.pytorch import PyTorchComputeBackend as B
    from unienv_interface.space import BinarySpace, BoxSpace, DictSpace

    obs = {"state": BoxSpace(B, -1e6, 1e6, torch.float32, shape=(10,))}
    if cfg.image_shape:
        obs["image"] = BoxSpace(B, 0, 255, torch.uint8, shape=tuple(cfg.image_shape))
    space = DictSpace(B, {
        "obs": DictSpace(B, obs),
        "action": BoxSpace(B, -1, 1, torch.float32, shape=(7,)),
        "reward": BoxSpace(B, -1e6, 1e6, torch.float32, shape=()),
        "episode_id": BoxSpace(B, 0, 10 ** 9, torch.int64, shape=()),
        "episode_end": BinarySpace(B, shape=()),
    })
    keys = [f"obs/{k}" for k in obs] + ["action", "reward", "episode_id", "episode_end"]
    rb = ReplayBuffer.create(DictStorage, space, {k: PytorchTensorStorage for k in keys},
                             capacity=n, is_memmap=False)
    gen = torch.Generator().manual_seed(start)
    chunk = 500
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        i = torch.arange(start + s, start + s + m)
        o = {"state": torch.randn(m, 10, generator=gen)}
        if cfg.image_shape:
            o["image"] = torch.randint(0, 256, (m, *cfg.image_shape), dtype=torch.uint8,
                                       generator=gen)
        rb.extend({"obs": o, "action": torch.rand(m, 7, generator=gen) * 2 - 1,
                   "reward": torch.randn(m, generator=gen),
                   "episode_id": i // EPISODE_STEPS,
                   "episode_end": (i % EPISODE_STEPS) == EPISODE_STEPS - 1})
        progress(m)
    return rb


@dataclass(frozen=True)
class View:
    """One row of the views case: a UniEnv view over the episodic buffer (``build(rb,
    halves)``), and whether TorchRL's ``SliceSampler`` samples the same thing (slices of
    ``torchrl_slice`` steps of the ``action`` column within an episode)."""
    label: str
    build: Callable
    torchrl_slice: Optional[int] = None


def _episode_id_mask():
    from unienv_data.batches import SliceStackedBatch
    return SliceStackedBatch.get_valid_mask_function_with_episodeid_key("episode_id")


def _episode_end_mask():
    from unienv_data.batches import SliceStackedBatch
    return SliceStackedBatch.get_valid_mask_function_with_episode_end_key("episode_end")


def _frame_stack(rb):
    from unienv_data.batches import FrameStackedBatch
    return FrameStackedBatch(rb, 1, get_valid_mask_function=_episode_id_mask())


def _action_chunk(rb):
    import torch
    from unienv_data.batches import SliceStackedBatch
    return SliceStackedBatch(rb, torch.arange(16), get_valid_mask_function=_episode_id_mask()
                             ).get_column(["action"])


def _state_history(rb):
    import torch
    from unienv_data.batches import SliceStackedBatch
    return SliceStackedBatch(rb, torch.arange(-1, 15),
                             get_valid_mask_function=_episode_end_mask()
                             ).get_column(["obs", "state"])


def _combined(halves):
    from unienv_data.batches import CombinedBatch
    return CombinedBatch([_frame_stack(h) for h in halves], use_thread_pool=True)


#: The views case's rows, in table order (the rows of UniEnv's own pipeline benchmark).
VIEWS = {
    "framestack": View("FrameStackedBatch(rb, 1, episode_id mask)",
                       lambda rb, halves: _frame_stack(rb)),
    "framestack_image": View("  same, .get_column(['obs', 'image'])",
                             lambda rb, halves: _frame_stack(rb).get_column(["obs", "image"])),
    "action_chunk": View("SliceStackedBatch(rb, arange(16), episode_id mask)"
                         ".get_column(['action'])", lambda rb, halves: _action_chunk(rb), 16),
    "state_history": View("SliceStackedBatch(rb, arange(-1, 15), episode_end mask)"
                          ".get_column(['obs', 'state'])",
                          lambda rb, halves: _state_history(rb)),
    "combined": View("CombinedBatch of two halves, each FrameStackedBatch(h, 1)",
                     lambda rb, halves: _combined(halves)),
}


def make_view_sampler(name: str, view_name: str, data, cfg: Config):
    """(next_batch, close) for implementation ``name`` sampling the view
    ``VIEWS[view_name]`` of ``data`` (``(rb, halves)``, from ``case_data("views", ...)``),
    or None for a row that does not apply (TorchRL has a sampler for action chunks
    only)."""
    rb, halves = data
    spec = VIEWS[view_name]
    if name == "torchrl":
        return None if spec.torchrl_slice is None else _torchrl_slice_sampler(
            rb, cfg, spec.torchrl_slice)
    view = spec.build(rb, halves)
    if name == "index_select":
        from unienv_data.samplers import StepSampler
        return _view_limit_sampler(StepSampler(view, cfg.batch_size, seed=0), cfg)
    return make_sampler(name, view, cfg)


def measure_view(name: str, view_name: str, data, cfg: Config,
                 progress: Callable[[float], None] = lambda f: None):
    """Time implementation ``name`` sampling the view ``VIEWS[view_name]`` of ``data``, as
    ``measure`` times a buffer (see ``make_view_sampler``); None for a row that does not
    apply."""
    if name == "torchrl" and VIEWS[view_name].torchrl_slice is None:
        return None
    return measure(name, None, cfg, progress,
                   make=lambda: make_view_sampler(name, view_name, data, cfg))


def _view_limit_sampler(base, cfg: Config):
    """The speed limit of in-process sampling of a view: ``base``'s own indices, the
    view's final storage rows and valid mask computed as unienv_mp's workers compute them
    (``unienv_mp._views``, the same table of rows), and every array gathered by
    ``torch.index_select`` into output tensors allocated once here and returned (the same
    ones) for every batch."""
    from . import gather
    root = gather.Planner(base).view
    if root is None:
        raise TypeError("not a view")
    n = cfg.batch_size

    def out_of(spec):
        import torch
        return torch.empty((n * spec.per_element, *spec.unit), dtype=spec.dtype)

    specs = root.specs()[0]
    outs = _tree_map(out_of, specs)
    batch = _tree_map(lambda o, s: o.view(n, *s.shape), outs, specs)

    def next_batch():
        values = root.evaluate(base.sample_index(), False)[0]
        _tree_map(_gather_parts, values, outs)
        return batch
    return next_batch, lambda: None


def _gather_parts(parts, out):
    """Gather each part's rows into ``out`` with ``index_select``; the rows of a part
    that go to some positions only (a combined dataset's) go to the next rows of ``out``
    instead, in one ``index_select`` too: the same rows moved, in another order, which is
    what the speed limit is about."""
    import torch
    at = 0
    for part in parts:
        if part.pos is None:
            torch.index_select(part.source.tensor, 0, part.data, out=out)
            continue
        n = int(part.data.shape[0])
        torch.index_select(part.source.tensor, 0, part.data, out=out[at:at + n])
        at += n


def _tree_map(fn, tree, *others):
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v, *(o[k] for o in others)) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_tree_map(fn, v, *(o[i] for o in others)) for i, v in enumerate(tree))
    return fn(tree, *others)


def _torchrl_slice_sampler(rb, cfg: Config, slice_len: int):
    """TorchRL's ``ReplayBuffer(prefetch=TORCHRL_PREFETCH)`` with its ``SliceSampler``:
    ``cfg.batch_size`` slices of ``slice_len`` consecutive steps of one episode (by the
    ``episode_id`` key) of the ``action`` column, as a TorchRL user samples action
    chunks.  (TorchRL only samples slices that fit in their episode, where UniEnv's view
    pads the last steps of an episode with its last action and masks them.)"""
    import torch
    from tensordict import TensorDict
    from torchrl.data import ReplayBuffer, TensorStorage
    from torchrl.data.replay_buffers.samplers import SliceSampler
    data = _dict_storage_tensors(rb)
    n = len(rb)
    td = TensorDict({"action": data["action"][:n], "episode_id": data["episode_id"][:n]},
                    batch_size=[n])
    trb = ReplayBuffer(storage=TensorStorage(td),
                       sampler=SliceSampler(slice_len=slice_len, traj_key="episode_id"),
                       batch_size=cfg.batch_size * slice_len, prefetch=TORCHRL_PREFETCH,
                       generator=torch.Generator().manual_seed(0))
    return trb.sample, lambda: _shutdown_torchrl(trb)


def build_jpeg_buffer(cfg: Config, directory, progress: Callable[[int], None] = lambda n: None):
    """A ReplayBuffer of ``cfg.transitions`` steps of {state: 10 f32, action: 7 f32,
    image: H x W x 3 u8} whose images are JPEG files (quality ``JPEG_QUALITY``), one per
    step, in UniEnv's ``ImageStorage`` under ``directory/replay``; state and action are
    in memory.  ``cfg.image_shape`` is 3 x H x W; the images are stored and sampled as
    H x W x 3, ImageStorage's layout.  Every ``get`` of a row opens and decodes its file
    (on UniEnv's per-process pool of IO threads)."""
    import torch
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.image_storage import ImageStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    from unienv_interface.backends.pytorch import PyTorchComputeBackend as B
    from unienv_interface.space import BoxSpace, DictSpace

    reason = case_missing("jpeg", cfg)
    if reason is not None:
        raise ValueError(reason)
    _, h, w = cfg.image_shape
    spaces = {"state": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(10,)),
              "action": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(7,)),
              "image": BoxSpace(B, 0, 255, torch.uint8, shape=(h, w, 3))}
    rb = ReplayBuffer.create(
        DictStorage, DictSpace(B, spaces),
        {"state": PytorchTensorStorage, "action": PytorchTensorStorage, "image": ImageStorage},
        cache_path=os.path.join(directory, "replay"), capacity=cfg.transitions,
        type_kwargs={PytorchTensorStorage: {"is_memmap": False},
                     ImageStorage: {"format": "JPEG", "quality": JPEG_QUALITY}})
    gen = torch.Generator().manual_seed(0)
    chunk = 250
    for start in range(0, cfg.transitions, chunk):
        n = min(chunk, cfg.transitions - start)
        rb.extend({"state": torch.rand(n, 10, generator=gen) * 2 - 1,
                   "action": torch.rand(n, 7, generator=gen) * 2 - 1,
                   "image": _photo_like(n, cfg.image_shape, gen)})
        progress(n)
    return rb


def build_online_buffer(cfg: Config, progress: Callable[[int], None] = lambda n: None):
    """A ReplayBuffer shared between processes (``multiprocessing=True``, tensors in
    shared memory) of capacity ``cfg.transitions``, of {state: 10 f32, action: 7 f32,
    clock: i64}, filled to half with ``clock`` 0 (see ``run_online``)."""
    import torch
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    from unienv_interface.backends.pytorch import PyTorchComputeBackend as B
    from unienv_interface.space import BoxSpace, DictSpace

    spaces = {"state": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(10,)),
              "action": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(7,)),
              "clock": BoxSpace(B, 0, 2 ** 62, torch.int64, shape=())}
    rb = ReplayBuffer.create(DictStorage, DictSpace(B, spaces),
                             {k: PytorchTensorStorage for k in spaces},
                             capacity=cfg.transitions, is_memmap=False, multiprocessing=True)
    gen = torch.Generator().manual_seed(0)
    n = max(cfg.batch_size, cfg.transitions // 2)
    rb.extend({"state": torch.rand(n, 10, generator=gen) * 2 - 1,
               "action": torch.rand(n, 7, generator=gen) * 2 - 1,
               "clock": torch.zeros(n, dtype=torch.int64)})
    progress(n)
    return rb


@contextlib.contextmanager
def case_data(case: str, cfg: Config, progress: Callable[[int], None] = lambda n: None):
    """The ReplayBuffer of ``case`` (``with case_data(...) as rb``); the jpeg case's files
    live in a temporary directory removed on exit.  The online case makes a fresh buffer
    for every row instead (``measure_online``): this yields None for it."""
    if case == "online":
        yield None
    elif case == "views":
        # the buffer, and two halves of as many steps for the combined dataset
        half = cfg.transitions // 2
        yield (build_episodic_buffer(cfg.transitions, cfg, progress),
               [build_episodic_buffer(half, cfg, progress, start=i * half) for i in (0, 1)])
    elif case == "jpeg":
        with tempfile.TemporaryDirectory(prefix="unienv_mp-jpeg-") as directory:
            yield build_jpeg_buffer(cfg, directory, progress)
    else:
        yield build_buffer(cfg, progress)

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


def _sampler_object(name: str, rb, cfg: Config, seed: int = 0):
    """The sampler object of implementation ``name`` (one of the UniEnv-API samplers:
    ``unienv_mp``, ``unienv_mp_generic``, ``unienv``, ``unienv_shm``, ``in_process``)
    over a StepSampler of ``rb`` seeded with ``seed``.  Workers start at its first call."""
    from unienv_data.samplers import StepSampler
    base = StepSampler(rb, cfg.batch_size, seed=seed)
    ctx = mp.get_context(cfg.start_method)
    if name in ("unienv_mp", "unienv_mp_generic"):
        from .sampler import MultiprocessingSampler
        return MultiprocessingSampler(
            base, n_workers=cfg.workers, n_buffers=cfg.buffers, ctx=ctx,
            direct_gather=False if name == "unienv_mp_generic" else None)
    if name in ("unienv", "unienv_shm"):
        from unienv_data.samplers import MultiprocessingSampler as UniEnvSampler
        return UniEnvSampler(base, n_workers=cfg.workers, n_buffers=cfg.buffers, ctx=ctx,
                             shared_memory=name == "unienv_shm")
    if name == "in_process":
        return base
    if name == "ray":
        # (a RaySampler starts a local Ray, with a CPU for each actor, unless this
        # process is connected to one; it shuts it down when closed)
        from .ray import RaySampler
        return RaySampler(base, n_workers=cfg.workers, n_buffers=cfg.buffers)
    raise ValueError(f"{name!r} is not one of the UniEnv-API samplers")


def _close(sampler):
    close = getattr(sampler, "close", None)    # (a StepSampler has none)
    if close is not None:
        close()


def make_sampler(name: str, rb, cfg: Config, seed: int = 0):
    """(next_batch, close) for implementation ``name``."""
    if name in ("unienv_mp", "unienv_mp_generic", "unienv", "unienv_shm", "ray"):
        s = _sampler_object(name, rb, cfg, seed)
        return s.sample, s.close
    from unienv_data.samplers import StepSampler
    base = StepSampler(rb, cfg.batch_size, seed=seed)
    ctx = mp.get_context(cfg.start_method)
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

    return trb.sample, lambda: _shutdown_torchrl(trb)


def _shutdown_torchrl(trb):
    """Stop a TorchRL ReplayBuffer's prefetch thread pool (after its pending samples)."""
    shutdown = getattr(trb, "shutdown", None)
    if shutdown is not None:
        shutdown()
    else:   # older torchrl: no shutdown(); its pool is _prefetch_executor
        executor = getattr(trb, "_prefetch_executor", None)
        if executor is not None:
            executor.shutdown(wait=True)


# Modules an implementation imports when it starts, imported before its clock starts:
# importing torchrl takes seconds, which are not its start-up.
_PREIMPORT = {"torchrl": ("tensordict", "torchrl.data")}


def _error(e):
    return f"{type(e).__name__}: {e}"


def _preimport(name):
    for module in _PREIMPORT.get(name, ()):
        importlib.import_module(module)


def _time_steps(res, step, cfg: Config, progress: Callable[[float], None]):
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
        _preimport(name)
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
        stats = owner.stats if _is_unienv_mp_sampler(owner) else None
        if stats is not None:
            stats(reset=True)          # (the measured batches only)
        _time_steps(res, lambda: touch(next_batch()), cfg, progress)
        if stats is not None:
            res.stats = stats()
    return _guarded(res, make or (lambda: make_sampler(name, rb, cfg)), run)


def _is_unienv_mp_sampler(obj):
    from .sampler import SamplerBase
    return isinstance(obj, SamplerBase)


def _guarded(res, make, run):
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


# ---------------------------------------------------------------------------------------
# online: a training loop that appends to the buffer before every sample()
# ---------------------------------------------------------------------------------------

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
    clock = _dict_storage_tensors(rb)["clock"]
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
    _time_steps(res, lambda: res.staleness.append(one_step()[0]), cfg, progress)
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
    return _guarded(res, make, run)


# ---------------------------------------------------------------------------------------
# latency: one batch with nothing prefetched
# ---------------------------------------------------------------------------------------

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
    seeds = itertools.count(1)

    def pause():
        time.sleep(LATENCY_PAUSE_S)

    if trigger == "reseed":
        s = _sampler_object(name, rb, cfg)
        try:
            for _ in range(cfg.warmup):
                touch(s.sample())
        except BaseException:
            _close(s)
            raise

        def first_batch():
            s.manual_seed(next(seeds))
            return s.sample()
        return pause, first_batch, lambda: _close(s)

    if trigger == "epoch":
        s = _sampler_object(name, rb, cfg)
        epochs = []

        def end_epochs():
            while epochs:
                epochs.pop().close()

        def prepare():
            end_epochs()
            pause()

        def first_batch():
            it = iter(s.epoch_iter())
            epochs.append(it)
            return next(it)

        def close():
            try:
                end_epochs()
            finally:
                _close(s)
        return prepare, first_batch, close

    made = []

    def close_made():
        while made:
            _close(made.pop())

    def prepare_start():
        close_made()
        pause()

    def first_sample():
        made.append(_sampler_object(name, rb, cfg, seed=next(seeds)))
        return made[-1].sample()
    return prepare_start, first_sample, close_made


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
    return _guarded(res, make, run)


# ---------------------------------------------------------------------------------------
# epoch: seconds per epoch
# ---------------------------------------------------------------------------------------

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
    n_batches = -(-len(rb) // cfg.batch_size)
    if name == "unienv_mp_sample":
        s = _sampler_object("unienv_mp", rb, cfg, seed)
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
    if name == "dataloader_epoch":
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
        state = {}

        def epoch():
            it = iter(loader)
            state["it"] = it
            return it

        def close():
            it = state.pop("it", None) or getattr(loader, "_iterator", None)
            if it is not None and hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()
        return epoch, close
    if name in ("unienv_mp", "unienv_shm", "unienv", "in_process"):
        s = _sampler_object(name, rb, cfg, seed)
        return s.epoch_iter, lambda: _close(s)
    raise ValueError(f"{name!r} is not a row of the epoch case")


def measure_epochs(name: str, rb, cfg: Config,
                   progress: Callable[[float], None] = lambda f: None) -> EpochResult:
    """Time ``cfg.epochs`` epochs of row ``name`` (see ``epoch_runner``), one after the
    other on one sampler, each batch read (``touch``): seconds per epoch, and to each
    epoch's first batch.  The first epoch includes starting the workers, where the row
    starts them then."""
    res = EpochResult(name, LABELS.get(name, name))
    _preimport(name)
    gc.collect()

    def make():
        epoch, close = epoch_runner(name, rb, cfg)
        return epoch, close

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
    return _guarded(res, make, run)
