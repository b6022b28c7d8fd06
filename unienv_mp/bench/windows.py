"""The windows case: the batch diffusion policies, ACT and VLA fine-tuning train on, an
observation history (image and state at steps t-1 and t) and an action chunk (actions t
.. t+15) of the same step t, padded at episode ends, with the pad masks; over the
episodic buffer of ``data.build_episodic_buffer``, a row per way of making it
(``make_window_sampler``)."""
from typing import Callable

from .config import Config
from .index_select import view_limit_sampler
from .measure import measure
from .peers import close_sampler, drop_dataloader, sampler_object

#: The windows of the case: LeRobot's ``delta_timestamps`` at 1 step per frame period.
WINDOWS = {"obs/image": [-1, 0], "obs/state": [-1, 0], "action": list(range(16))}


def windowed_view(rb):
    """The case's view: ``WindowedBatch(rb, WINDOWS)``, episodes told by ``episode_id``,
    the keys without a window left out."""
    from ..windows import WindowedBatch
    return WindowedBatch(rb, WINDOWS, episode_id_key="episode_id", keep_other_keys=False)


def paired_views(rb):
    """What a user writes today (the diffusion-policy example before this view): a frame
    stack of steps t-1 and t (every key stacked) and the action column's chunk of t ..
    t+15, each masked by UniEnv's episode-id helper, each sampled by its own sampler,
    paired by seed."""
    import torch
    from unienv_data.batches import FrameStackedBatch, SliceStackedBatch
    same = SliceStackedBatch.get_valid_mask_function_with_episodeid_key("episode_id")
    frames = FrameStackedBatch(rb, 1, get_valid_mask_function=same)
    chunks = SliceStackedBatch(rb, torch.arange(16), get_valid_mask_function=same
                               ).get_column(["action"])
    return frames, chunks


def make_window_sampler(name: str, rb, cfg: Config, seed: int = 0):
    """(next_batch, close) for row ``name`` of the windows case over ``rb``: each batch is
    the data and the pad masks (``sample_with_metadata``, or the same arrays)."""
    from unienv_data.samplers import StepSampler
    if name in ("unienv_mp", "unienv_mp_generic"):
        s = sampler_object(name, windowed_view(rb), cfg, seed)
        return s.sample_with_metadata, lambda: close_sampler(s)
    if name == "in_process":
        return StepSampler(windowed_view(rb), cfg.batch_size, seed=seed).sample_with_metadata, \
            lambda: None
    if name == "paired_in_process":
        frames, chunks = paired_views(rb)
        obs = StepSampler(frames, cfg.batch_size, seed=seed)
        act = StepSampler(chunks, cfg.batch_size, seed=seed)
        return lambda: (obs.sample_with_metadata(), act.sample_with_metadata()), lambda: None
    if name == "dataloader_map":
        return _dataloader(rb, cfg, seed)
    if name == "index_select":
        return view_limit_sampler(StepSampler(windowed_view(rb), cfg.batch_size, seed=seed),
                                  cfg, with_metadata=True)
    raise ValueError(f"{name!r} is not a row of the windows case")


class WindowDataset:
    """A map-style torch Dataset doing the windows' indexing per item, as a LeRobot-style
    dataset does: item ``t`` is each key's frames ``t + offset`` clamped to ``t``'s
    episode (its first and last steps, found once for every step, as LeRobot's
    ``episode_data_index``), read from the buffer's storage tensors, and a pad mask per
    key.  (A buffer that has not wrapped around: logical steps are storage rows.  A
    DataLoader takes any object with ``__len__`` and ``__getitem__`` as a map-style
    dataset.)"""

    def __init__(self, rb, windows=None):
        import torch
        windows = WINDOWS if windows is None else windows
        storages = rb.storage.storage_map
        if len(rb) != len(storages["episode_id"].data) or rb.offset != 0:
            raise ValueError("needs a full buffer that has not wrapped around")
        self.columns = {k: storages[k].data for k in windows}
        self.offsets = {k: torch.tensor(v) for k, v in windows.items()}
        ids = storages["episode_id"].data
        n = len(ids)
        start = torch.ones(n, dtype=torch.bool)
        start[1:] = ids[1:] != ids[:-1]
        first = torch.cummax(torch.where(start, torch.arange(n), 0), 0).values
        end = torch.ones(n, dtype=torch.bool)
        end[:-1] = ids[1:] != ids[:-1]
        last = torch.flip(torch.cummin(torch.flip(torch.where(end, torch.arange(n), n), [0]),
                                       0).values, [0])
        self.first, self.last = first, last

    def __len__(self):
        return len(self.first)

    def __getitem__(self, t):
        import torch
        lo, hi = self.first[t], self.last[t]
        item = {"obs": {}}
        for key, off in self.offsets.items():
            q = t + off
            steps = torch.minimum(torch.maximum(q, lo), hi)
            value = self.columns[key][steps]
            if key.startswith("obs/"):
                item["obs"][key[4:]] = value
            else:
                item[key] = value
            item[f"{key}_is_pad"] = steps != q
        return item


def _dataloader(rb, cfg: Config, seed: int):
    """(next_batch, close) of a torch DataLoader over a `WindowDataset` of ``rb``, with
    ``cfg.workers`` persistent workers, steps drawn uniformly with replacement (as
    ``sample()`` draws them), batched by torch's default collate."""
    import multiprocessing as mp
    import warnings

    import torch
    import torch.utils.data as tud

    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    dataset = WindowDataset(rb)
    gen = torch.Generator().manual_seed(seed)
    loader = tud.DataLoader(
        dataset, batch_size=cfg.batch_size,
        sampler=tud.RandomSampler(dataset, replacement=True, num_samples=2 ** 40,
                                  generator=gen),
        num_workers=cfg.workers, multiprocessing_context=mp.get_context(cfg.start_method),
        prefetch_factor=max(2, cfg.buffers // cfg.workers), persistent_workers=True)
    held = {"loader": loader, "it": iter(loader)}

    def next_batch():
        return next(held["it"])
    return next_batch, lambda: drop_dataloader(held)


def measure_windows(name: str, rb, cfg: Config,
                    progress: Callable[[float], None] = lambda f: None):
    """Time row ``name`` of the windows case over ``rb``, as ``measure`` times a
    buffer."""
    return measure(name, None, cfg, progress,
                   make=lambda: make_window_sampler(name, rb, cfg))
