"""Direct gather: a worker writes a batch straight into its slot, row by row from the
replay buffer's own tensors, with no intermediate batch.

When a wrapped sampler's batch is a pure function of row indices into tensors held in
memory, the worker does what UniEnv's generic path does, minus the allocations:

1. it draws the indices with the wrapped sampler's own ``sample_index()`` (its RNG advances
   exactly as ``sample()`` would advance it), or takes an epoch's indices as given;
2. it maps them to storage rows with the ReplayBuffer's own mapping (offset, wrap-around,
   count, read once, as ``get_at`` reads them);
3. it gathers every leaf of the batch with ``torch.index_select(..., out=)`` into its place
   in the slot.  The slot's layout (the codec's frame: header, tree description, offsets)
   is planned once per method and batch size; per batch only the frame's few hundred
   bytes and the rows are written.

Which configurations qualify (`check`): a ``StepSampler`` (or a subclass that overrides none
of the sampling methods) on the CPU over a ``ReplayBuffer`` (likewise) whose storage is a
``PytorchTensorStorage`` (in memory, memory-mapped or shared), one of UniEnv's file-backed
storages (``HDF5Storage``, ``ImageStorage``, ``NPZStorage``, ``VideoStorage``,
``ParquetStorage`` of numeric arrays: `unienv_mp._direct.files` says how each is read), a
``DictStorage`` of qualifying storages (nested too), or a ``FlattenedStorage`` over a
``PytorchTensorStorage``.  Everything else -- transformations, file-backed storages under a
view, text, custom samplers -- takes the generic path, where the worker calls the wrapped
sampler and the codec copies its result into the slot.

The contract is exactness: for the same seed, both paths give the same batches bit for bit,
with the same structure, key order, dtypes, shapes and array types.  The plan is therefore
built by walking UniEnv's own structures the way UniEnv's ``get`` / ``get_flattened`` /
``flatten_data`` / ``unflatten_data`` walk them (``DictStorage``'s key mapping is UniEnv's
own ``map_transform``), and every case it does not reproduce exactly is refused, with the
reason, rather than approximated.

Here are the entry points: `check`, `row_nbytes`, the sampler's `Planner`, and the worker's
`Gatherer`.  The plans are below them: the storages' flat rows in `.storages`, the views in
`.views`, what both share in `.base`.  With the other modules of `unienv_mp._direct` and
`unienv_mp._sampling.sampler`, this module knows UniEnv's classes.
"""
from . import storages as _storages
from . import unienv as _unienv
from . import views as _views
from .base import (BUFFER_METHODS, DIRECT_METHODS, EPOCH_GETTERS, SAMPLER_METHODS,
                   NotDirect, PlannedBatch, is_index_tensor, sampled_rows)

# (NotDirect, sampled_rows, DIRECT_METHODS and PlannedBatch are base's, named here too)
__all__ = ["NotDirect", "check", "why_not", "row_nbytes", "sampled_rows", "Planner", "Gatherer",
           "DIRECT_METHODS", "PlannedBatch"]


def check(sampler):
    """Raise [`NotDirect`][unienv_mp.gather.NotDirect] (saying why) unless
    ``sampler.sample()`` can be gathered directly; build nothing that lasts.

    Args:
        sampler: the wrapped sampler, as the workers get it.
    """
    try:
        import torch  # noqa: F401
    except ImportError:
        raise NotDirect("torch is not installed") from None
    planner = Planner(sampler)
    planner.structure("get_at")
    if planner.view is not None:
        _views.layout_check(planner.view, sampler)


def why_not(sampler):
    """Why ``sampler.sample()`` cannot be gathered directly (what
    [`check`][unienv_mp.gather.check] raises, as a string), or None if it can.

    Args:
        sampler: the wrapped sampler, as the workers get it.
    """
    try:
        check(sampler)
    except NotDirect as e:
        return str(e)
    return None


def row_nbytes(sampler, method):
    """Bytes per batch row of ``sampler.<method>()`` if it can be gathered directly (one
    of [`DIRECT_METHODS`][unienv_mp.gather.DIRECT_METHODS]), else None.  Whether or not the
    direct path is used, this is the same for the same sampler: what the sampler groups by
    (see [`MultiprocessingSampler`][unienv_mp.MultiprocessingSampler]'s
    ``batches_per_task``) must not depend on the path, or the two paths would give different
    streams.

    Args:
        sampler: the wrapped sampler, as the workers get it.
        method: the name of one of its methods (e.g. ``"sample"``).
    """
    getter = DIRECT_METHODS.get(method)
    if getter is None:
        return None
    try:
        import torch  # noqa: F401
        tree = Planner(sampler).structure(getter)
    except Exception:
        return None
    total = 0
    stack = [tree]
    while stack:
        node = stack.pop()
        if hasattr(node, "element_nbytes"):   # a Leaf, or a view's Spec
            total += node.element_nbytes()
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, tuple):
            stack.extend(node)
    return total


class Planner:
    """Reads a wrapped sampler's structure: which tensor each leaf of a batch comes from.
    Over a ReplayBuffer it plans flat rows (`unienv_mp._direct.storages`); over a view of
    ReplayBuffers (frame stacks, columns, combined datasets: `unienv_mp._direct.views`)
    ``view`` is the plan of the view, and the storage planner ``storages`` plans the
    storages under it."""

    def __init__(self, sampler, on_device=False, bind=False):
        import torch
        from unienv_data.replay_buffer.replay_buffer import ReplayBuffer
        from unienv_data.samplers.step_sampler import StepSampler

        # (on_device True: the sources may live on a GPU, for a gather in the calling
        # process; see unienv_mp._device.resident.  The workers take CPU rows only, and
        # read file-backed storages (unienv_mp._direct.files) of a flat buffer: bind True,
        # in a worker, opens their files.)
        self.storages = _storages.StoragePlanner(
            on_device, files=None if on_device else ("bind" if bind else "plan"))
        self.storages.require(sampler, StepSampler, SAMPLER_METHODS, "the wrapped sampler")
        device = getattr(sampler, "_device", None)
        if device is not None and torch.device(device).type != "cpu":
            raise NotDirect(f"the sampler moves batches to {device}")
        data = sampler.data
        self.sampler = sampler
        self.buffer = self.view = None
        if isinstance(data, ReplayBuffer):
            self.storages.require(data, ReplayBuffer, BUFFER_METHODS, "the sampler's data")
            self.buffer = data
        else:
            self.storages.files = None   # (not under a view)
            self.storages.files_refused = ("under a view (a frame stack, a window): the "
                                           "generic path reads them")
            self.view = _views.plan(data, self.storages)

    def structure(self, getter):
        """The tree of Leaf (and None) that ``sampler.<getter>(idx)`` returns; for a
        view, of `unienv_mp._direct.views.Spec`."""
        if self.view is not None:
            return _views.getter_specs(self.view, getter)
        return self.storages.structure(self.buffer, getter)


class Gatherer:
    """Lives in a worker: turns a task ``(method, argument)`` into a `SlotWriter` that
    gathers the batch into the worker's slot, or None for tasks it does not serve.

    Args:
        sampler: the worker's own wrapped sampler; one that the direct path cannot serve
            raises [`NotDirect`][unienv_mp.gather.NotDirect].
    """

    def __init__(self, sampler):
        self._planner = Planner(sampler, bind=True)
        self.sampler = sampler
        self.buffer = self._planner.buffer
        self._view = None
        if self._planner.view is not None:
            self._view = _views.ViewGatherer(self._planner.view, sampler)
        self._structures = {}   # getter -> tree of Leaf, or None (not direct)
        self._plans = {}        # (getter, batch size, batches or None) -> FlatLayout

    def structure(self, getter):
        try:
            return self._structures[getter]
        except KeyError:
            pass
        try:
            tree = self._planner.structure(getter)
        except Exception:
            # NotDirect, or anything the planner trips on (e.g. dtypes torch cannot
            # promote): the generic path runs it, and raises what UniEnv raises, if
            # anything, after drawing the indices as UniEnv does
            tree = None
        self._structures[getter] = tree
        return tree

    def __call__(self, name, arg, before=None):
        """A `SlotWriter` for the task, or None to run it the generic way (over a view, the
        generic getter's batch itself where the direct path cannot serve those indices;
        the caller sends it as any result).  For a sampling method, ``arg`` is None (one
        batch) or a count ``k`` (a tuple of ``k`` batches, drawn one after the other as
        ``k`` calls would draw them); ``before(i)``, if given, is called before batch ``i``
        is drawn (the stream reseeds the RNGs there)."""
        task = self._task(name, arg, before)
        if task is None:
            return None
        getter, k, indices = task
        if self._view is not None:
            return self._view(getter, indices, k)
        if name in DIRECT_METHODS:
            rows = [sampled_rows(self.buffer, idx) for idx in indices]
        else:
            # indices from outside: the ReplayBuffer's own mapping, bounds checks included
            rows = [_unienv.logical_to_physical(self.buffer, indices[0])]
        n = int(rows[0].shape[0])
        key = (getter, n, k)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _storages.FlatLayout(self.structure(getter), n, k)
        return PlannedBatch(plan, rows)

    def _task(self, name, arg, before=None):
        """``(getter, k, index tensors)`` of a task that a plan serves, or None: a
        sampling method's ``k`` (None for one batch) draws of ``sample_index()`` (the RNG
        advances as in ``sample*()``; ``before(i)`` first, if given), or a getter's given
        indices."""
        getter = DIRECT_METHODS.get(name)
        if getter is not None:
            if arg is None:
                k = None
            elif type(arg) is int and arg >= 1:
                k = arg
            else:
                return None
            if self.structure(getter) is None:
                return None
            sample_index = self.sampler.sample_index
            if before is None:
                return getter, k, [sample_index() for _ in range(k or 1)]
            drawn = []
            for i in range(k or 1):
                before(i)
                drawn.append(sample_index())
            return getter, k, drawn
        if (name in EPOCH_GETTERS and is_index_tensor(arg)
                and self.structure(name) is not None):
            return name, None, [arg]
        return None

