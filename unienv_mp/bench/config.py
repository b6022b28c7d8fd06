"""What the main job runs: its implementations (rows), its cases and their settings.

``IMPLEMENTATIONS`` and ``LABELS`` name the rows (see ``unienv_mp.bench``), ``CASES`` the
workloads, ``Config`` the settings of one run of a case (``case_config``), ``describe``
what one batch holds and ``case_missing`` why a case cannot run here.
"""
from dataclasses import dataclass, field, replace
from typing import Dict, Optional, Tuple


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
                "unienv_mp_sample", "dataloader_epoch", "unienv_mp_view", "unienv_mp_view_spawn",
                "dataloader_map")


#: The steps of one episode in the views case's buffers (``data.build_episodic_buffer``).
EPISODE_STEPS = 200


@dataclass
class Config:
    transitions: int = 20_000
    batch_size: int = 256
    image_shape: tuple = (3, 128, 128)   # C x H x W; () for none
    workers: int = 4
    buffers: int = 8
    # the RaySampler row's n_buffers: None for its own default (more than 8 where Ray calls
    # carry several tasks); --buffers sets every row's
    ray_buffers: Optional[int] = None
    start_method: str = "fork"
    seconds: float = 6.0          # time spent measuring each implementation
    warmup: int = 3               # batches taken before the clock starts
    min_batches: int = 5
    max_batches: int = 5000
    append: int = 4               # online: transitions appended per loop step
    epochs: int = 4               # epoch: epochs timed per row (the first, then the later)


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
    # what --quick changes besides the transitions and the seconds per row
    quick_defaults: Dict[str, object] = field(default_factory=dict)
    # run by --case all (the storages case, which builds a dozen data sets, runs alone)
    in_all: bool = True


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
    "windows": Case("windows", "windows",
                    ("unienv_mp", "unienv_mp_generic", "in_process", "paired_in_process",
                     "dataloader_map", "index_select"),
                    "batches of 256 of one sampled step each: obs image and state at steps "
                    "[-1, 0], actions at 0..15, padded at episode ends, with a pad mask per "
                    "key (unienv_mp.WindowedBatch, sample_with_metadata), over 20,000 steps "
                    "in episodes of 200; against the same view in process, two UniEnv "
                    "samplers paired by seed (a frame stack and an action chunk), a torch "
                    "DataLoader over a map-style dataset doing the same indexing per item, "
                    "and the bare gather",
                    {"seconds": 4.0}),
    "latency": Case("latency", "latency", ("unienv_mp", "unienv", "in_process"),
                    "the time to one batch of 256 {state, action, 3x128x128 image} from "
                    "an in-memory ReplayBuffer with nothing prefetched, p50 and p99, "
                    "asked for by: manual_seed(), then sample(); the first batch of a "
                    "new epoch_iter(); the first sample() of a new sampler"),
    "epoch": Case("epoch", "epoch",
                  ("unienv_mp", "unienv_mp_sample", "unienv_shm", "in_process",
                   "dataloader_epoch", "unienv_mp_view", "unienv_mp_view_spawn",
                   "in_process_view"),
                  "seconds per epoch of epoch_iter() over 20k in-memory steps of {state, "
                  "action, 3x128x128 image}, batches of 256: the first epoch (which starts "
                  "the workers) and the later ones, and each epoch's first batch; the "
                  "unienv_mp sample() row times as many steady-state sample() batches as "
                  "an epoch has; the view rows run epochs over a frame stack of 2 frames "
                  "(FrameStackedBatch(rb, 1), episode_id mask) of the views case's "
                  "episodic buffer of as many steps, under fork and under spawn",
                  quick_transitions=2000),
    "storages": Case("storages", "storages", ("unienv_mp", "unienv", "in_process",
                                              "index_select"),
                     "a row per UniEnv storage backend (torch in memory and memory-mapped, "
                     "HDF5 plain, gzip and per-step lzf, parquet, video, PNG, JPEG, npz) "
                     "and a LeRobot dataset, built by UniEnv's own storage benchmark code "
                     "and loaded back read-only: batches of 256 in process (torch and "
                     "UniEnv's I/O threads by default, and at one), read into reused "
                     "memory, by UniEnv's and by unienv_mp's MultiprocessingSampler, and "
                     "epochs over the HDF5 buffer under spawn (needs the disk extra)",
                     {"transitions": 4000, "seconds": 4.0}, quick_transitions=1024,
                     quick_defaults={"image_shape": (3, 32, 32)}, in_all=False),
}


#: The epoch case's rows besides the UniEnv-API samplers: ``unienv_mp_sample`` (as many
#: ``sample()`` batches of a running unienv_mp sampler as an epoch has, the steady state an
#: epoch is compared with) and ``dataloader_epoch`` (a torch DataLoader over UniEnv's
#: ``UniEnvAsPyTorchDataset``, shuffled, ``persistent_workers=True``, ``pin_memory=False``).
EPOCH_ROWS = {
    "unienv_mp_sample": "unienv_mp sample(), as many batches",
    "dataloader_epoch": "torch DataLoader(UniEnvAsPyTorchDataset), persistent workers",
    "unienv_mp_view": "frame stack: unienv_mp MultiprocessingSampler",
    "unienv_mp_view_spawn": "frame stack: unienv_mp MultiprocessingSampler, spawn",
    "in_process_view": "frame stack: UniEnv StepSampler, in process",
}

#: The epoch case's rows over a view (a frame stack of the episodic buffer), each with the
#: row it is compared with.
VIEW_EPOCH_ROWS = ("unienv_mp_view", "unienv_mp_view_spawn", "in_process_view")


LABELS.update(EPOCH_ROWS)


#: The implementation (``--impl``) each of them comes with.
EPOCH_ROW_OF = {"unienv_mp_sample": "unienv_mp", "dataloader_epoch": "dataloader",
                "unienv_mp_view": "unienv_mp", "unienv_mp_view_spawn": "unienv_mp",
                "in_process_view": "in_process"}


#: The windows case's rows besides the UniEnv-API samplers: ``paired_in_process`` (what a
#: user writes today: two UniEnv StepSamplers, a frame stack and an action chunk, paired
#: by seed) and ``dataloader_map`` (a torch DataLoader over a map-style dataset doing the
#: windows' indexing per item, as a LeRobot-style dataset does).
WINDOW_ROWS = {
    "paired_in_process": "two UniEnv StepSamplers paired by seed, in process",
    "dataloader_map": "torch DataLoader(map-style dataset)",
}
LABELS.update(WINDOW_ROWS)

#: Every row that is not an implementation of its own, with the implementation
#: (``--impl``) it comes with.
ROW_OF = {**EPOCH_ROW_OF, "paired_in_process": "in_process", "dataloader_map": "dataloader"}


def case_config(case: str, quick: bool = False, **overrides) -> Config:
    """The ``Config`` of ``case``: its defaults, the quick run's (a small buffer, 1.5 s
    per row) if ``quick``, then ``overrides``."""
    spec = CASES[case]
    cfg = replace(Config(), **spec.defaults)
    if quick:
        cfg = replace(cfg, transitions=spec.quick_transitions, seconds=1.5, warmup=2,
                      **spec.quick_defaults)
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
    if case == "windows":
        return (f"obs.image {img or 'none'} u8 and obs.state 10 f32 at [-1, 0], action 7 "
                f"f32 at 0..15, a pad mask each; episodes of {EPISODE_STEPS}")
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
