"""The views case: the UniEnv views robot learners sample (``VIEWS``), over the episodic
buffer of ``data.case_data("views", ...)``, and the sampler of each row for each view."""
from dataclasses import dataclass
from typing import Callable, Optional

from .config import Config
from .index_select import view_limit_sampler
from .measure import measure
from .peers import make_sampler
from .torchrl_peer import torchrl_slice_sampler


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


def frame_stack(rb):
    """The frame stack robot learners sample: the step and the one before it
    (``prefetch_horizon=1``: 2 frames), invalid across episode starts (episode_id)."""
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
    return CombinedBatch([frame_stack(h) for h in halves], use_thread_pool=True)


#: The views case's rows, in table order (the rows of UniEnv's own pipeline benchmark).
VIEWS = {
    "framestack": View("FrameStackedBatch(rb, 1, episode_id mask)",
                       lambda rb, halves: frame_stack(rb)),
    "framestack_image": View("  same, .get_column(['obs', 'image'])",
                             lambda rb, halves: frame_stack(rb).get_column(["obs", "image"])),
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
        return None if spec.torchrl_slice is None else torchrl_slice_sampler(
            rb, cfg, spec.torchrl_slice)
    view = spec.build(rb, halves)
    if name == "index_select":
        from unienv_data.samplers import StepSampler
        return view_limit_sampler(StepSampler(view, cfg.batch_size, seed=0), cfg)
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
