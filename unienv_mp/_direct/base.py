"""What every direct plan shares, flat rows and views alike: the refusal
(`NotDirect`), the methods a plan serves, the ReplayBuffer's row mapping (`sampled_rows`),
the byte tables of the row kernel, and the slot writer that fills a planned layout
(`PlannedBatch`).  Imports nothing of the planners."""
import sys

import numpy as np

from .._transport import codec as _codec
from .._transport.protocol import SlotWriter
from . import unienv as _unienv

__all__ = ["NotDirect", "DIRECT_METHODS", "EPOCH_GETTERS", "SAMPLER_METHODS",
           "BUFFER_METHODS", "overridden", "qualname", "is_index_tensor", "sampled_rows",
           "byte_rows", "PlannedBatch"]

#: Sampler methods a direct plan can serve (``sample_index`` stays generic: it gathers
#: nothing), by the epoch getter that computes the same thing from given indices.
DIRECT_METHODS = {
    "sample": "get_at",
    "sample_with_metadata": "get_at_with_metadata",
    "sample_flat": "get_flattened_at",
    "sample_flat_with_metadata": "get_flattened_at_with_metadata",
}
#: The epoch getters, each with the sampler method that draws the same batch.
EPOCH_GETTERS = {g: s for s, g in DIRECT_METHODS.items()}
#: What the wrapped sampler must not override.
SAMPLER_METHODS = ("sample_index", *DIRECT_METHODS, *EPOCH_GETTERS)
#: What the ReplayBuffer must not override.
BUFFER_METHODS = ("get_at", "get_at_with_metadata", "get_flattened_at",
                   "get_flattened_at_with_metadata", "_logical_to_physical_index")


class NotDirect(Exception):
    """The batch cannot be gathered directly; ``str()`` says why."""


def overridden(obj, base, names):
    """The first of ``names`` that ``obj`` overrides from ``base`` (in its class, or as an
    attribute of the instance itself), or None."""
    attrs = getattr(obj, "__dict__", {})
    for n in names:
        if n in attrs or getattr(type(obj), n, None) is not getattr(base, n, None):
            return n
    return None


def qualname(obj):
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"

def is_index_tensor(arg):
    """A non-empty 1-D int64 tensor, or numpy array over a buffer of the numpy backend
    (HDF5, parquet, image and video storages): the indices an epoch sends (anything else,
    the generic getter handles as UniEnv does)."""
    if type(arg) is np.ndarray:
        return arg.ndim == 1 and arg.dtype == np.int64 and arg.shape[0] > 0
    torch = sys.modules.get("torch")
    return (torch is not None and type(arg) is torch.Tensor and arg.dim() == 1
            and arg.dtype == torch.int64 and arg.shape[0] > 0)


def sampled_rows(buffer, idx):
    """Storage rows of indices drawn by ``sample_index()`` over ``buffer``: the
    ReplayBuffer's mapping ``(idx + count + offset) % count`` on one snapshot of its ring
    state, as ``_logical_to_physical_index`` computes it, without its bounds check (a
    reduction that costs more than gathering a small batch): the indices were drawn in
    ``[0, len)``, and a buffer only grows while it is sampled, so they are in bounds.  For
    those indices the mapping is ``(idx + offset) % count``, and ``idx`` itself when the
    offset is 0.  (Used by the workers, and by the main job's in-process speed limit.)

    Args:
        buffer: the ReplayBuffer.
        idx: the indices drawn (a tensor).
    """
    ring = _unienv.ring_state(buffer)
    if ring is None:
        return _unienv.logical_to_physical(buffer, idx)
    count, offset = ring
    if offset == 0:
        return idx
    if type(idx) is np.ndarray:   # (a buffer of the numpy backend)
        return np.remainder(idx + offset, count)
    return (idx + offset).remainder_(count)

def byte_rows(src):
    """``src``'s memory as a numpy ``(rows, bytes per row)`` uint8 array, for
    `unienv_mp._direct.rows.gather_rows`; None where it is not one contiguous table (then
    torch gathers it)."""
    torch = sys.modules["torch"]
    if not src.is_contiguous() or src.dim() < 1 or src.element_size() == 0:
        return None
    try:
        table = src.reshape(src.shape[0], -1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None   # e.g. a dtype that has no byte view
    if table.ctypes.data != src.data_ptr() or not table.flags.c_contiguous:
        return None
    return table


class PlannedBatch(SlotWriter):
    """One batch (or a tuple of them) to gather: a plan and what it is filled with.

    Args:
        plan: the slot's layout: its codec frame ``prepared``, its size ``nbytes``,
            ``views(buffer)`` of a slot, and ``fill(buffer, views, what)``.
        what: what the plan is filled with: the storage rows of each batch; for a view,
            its evaluated parts.
    """
    __slots__ = ("plan", "what", "nbytes")

    def __init__(self, plan, what):
        self.plan = plan
        self.what = what
        self.nbytes = plan.nbytes

    def write_into(self, buffer, cache):
        plan = self.plan
        views = cache.get(plan)
        if views is None:
            views = cache[plan] = plan.views(buffer)
        _codec.write_frame(plan.prepared, buffer)
        plan.fill(buffer, views, self.what)
