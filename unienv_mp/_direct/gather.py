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

Which configurations qualify (:func:`check`): a ``StepSampler`` (or a subclass that
overrides none of the sampling methods) on the CPU over a ``ReplayBuffer`` (likewise) whose
storage is a ``PytorchTensorStorage`` (in memory, memory-mapped or shared), a
``DictStorage`` of qualifying storages (nested too), or a ``FlattenedStorage`` over a
``PytorchTensorStorage``.  Everything else -- transformations, image, video, HDF5 and
parquet storages, custom samplers -- takes the generic path, where the worker calls the
wrapped sampler and the codec copies its result into the slot.

The contract is exactness: for the same seed, both paths give the same batches bit for bit,
with the same structure, key order, dtypes, shapes and array types.  The plan is therefore
built by walking UniEnv's own structures the way UniEnv's ``get`` / ``get_flattened`` /
``flatten_data`` / ``unflatten_data`` walk them (``DictStorage``'s key mapping is UniEnv's
own ``map_transform``), and every case it does not reproduce exactly is refused, with the
reason, rather than approximated.

This module is the only one besides :mod:`unienv_mp._sampling.sampler` that knows UniEnv's classes.
"""
import sys

import numpy as np

from .._transport import codec as _codec
from . import rows as _rows, unienv as _unienv
from .._transport.protocol import SlotWriter

__all__ = ["NotDirect", "check", "row_nbytes", "sampled_rows", "Gatherer", "DIRECT_METHODS",
           "PlannedBatch"]

#: Sampler methods a direct plan can serve (``sample_index`` stays generic: it gathers
#: nothing), by the epoch getter that computes the same thing from given indices.
DIRECT_METHODS = {
    "sample": "get_at",
    "sample_with_metadata": "get_at_with_metadata",
    "sample_flat": "get_flattened_at",
    "sample_flat_with_metadata": "get_flattened_at_with_metadata",
}
_GETTERS = {g: s for s, g in DIRECT_METHODS.items()}
_SAMPLER_METHODS = ("sample_index", *DIRECT_METHODS, *_GETTERS)
BUFFER_METHODS = ("get_at", "get_at_with_metadata", "get_flattened_at",
                   "get_flattened_at_with_metadata", "_logical_to_physical_index")


class NotDirect(Exception):
    """The batch cannot be gathered directly; ``str()`` says why."""


def check(sampler):
    """Raise :class:`NotDirect` (saying why) unless ``sampler.sample()`` can be gathered
    directly; build nothing that lasts."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise NotDirect("torch is not installed") from None
    planner = Planner(sampler)
    planner.structure("get_at")
    if planner.view is not None:
        from . import views as _views
        _views.layout_check(planner.view, sampler)


def row_nbytes(sampler, method):
    """Bytes per batch row of ``sampler.<method>()`` if it can be gathered directly (one
    of :data:`DIRECT_METHODS`), else None.  Whether or not the direct path is used, this
    is the same for the same sampler: what the sampler groups by (see
    :class:`~unienv_mp.MultiprocessingSampler`'s ``batches_per_task``) must not depend on
    the path, or the two paths would give different streams."""
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


class Leaf:
    """One array of the batch: ``(B, *tail)`` of ``dtype``, made of ``parts``: column
    ranges ``[a, b)`` of the output viewed as ``(B, -1)``, each filled with the rows of a
    2-D source ``(N, b - a)`` (or, for a single part, rows of an N-D source of the output's
    own shape)."""
    __slots__ = ("tail", "dtype", "parts", "direct", "columns")

    def __init__(self, tail, dtype, parts, columns=None):
        self.tail = tuple(int(d) for d in tail)
        self.dtype = dtype
        self.parts = parts
        # (flat rows, a, b) for a leaf cut from columns [a, b) of a FlattenedStorage's rows
        self.columns = columns
        # one source of the output's own row shape and dtype: index_select straight into
        # the output
        self.direct = (len(parts) == 1 and tuple(parts[0][0].shape[1:]) == self.tail
                       and parts[0][0].dtype == dtype)

    def element_nbytes(self):
        """Bytes per batch row."""
        return (int(np.prod(self.tail, dtype=np.int64))
                * sys.modules["torch"].empty((), dtype=self.dtype).element_size())


class Planner:
    """Reads a wrapped sampler's structure: which tensor each leaf of a batch comes from.
    Over a ReplayBuffer it plans flat rows (this module); over a view of ReplayBuffers
    (frame stacks, columns, combined datasets: :mod:`unienv_mp._direct.views`) ``view`` is the
    plan of the view, and this planner plans the storages under it."""

    def __init__(self, sampler, on_device=False):
        import torch
        from unienv_data.replay_buffer.replay_buffer import ReplayBuffer
        from unienv_data.samplers.step_sampler import StepSampler
        self.torch = torch
        # (True: the sources may live on a GPU, for a gather in the calling process; see
        # unienv_mp._device.resident.  The workers take CPU rows only.)
        self.on_device = on_device
        self.require(sampler, StepSampler, _SAMPLER_METHODS, "the wrapped sampler")
        device = getattr(sampler, "_device", None)
        if device is not None and torch.device(device).type != "cpu":
            raise NotDirect(f"the sampler moves batches to {device}")
        data = sampler.data
        self.sampler = sampler
        self.buffer = self.view = None
        if isinstance(data, ReplayBuffer):
            self.require(data, ReplayBuffer, BUFFER_METHODS, "the sampler's data")
            self.buffer = data
        else:
            from . import views as _views  # (which builds on this module)
            self.view = _views.plan(data, self)

    # -- what storage.get(rows) returns: a tree of Leaf ------------------------------------

    def rows(self, storage):
        from unienv_data.storages.dict_storage import DictStorage, map_transform
        from unienv_data.storages.flattened import FlattenedStorage
        from unienv_data.storages.pytorch import PytorchTensorStorage
        if isinstance(storage, PytorchTensorStorage):
            self._no_override(storage, PytorchTensorStorage, ("get",))
            src = self._source(storage.data, storage)
            return Leaf(src.shape[1:], src.dtype, [(src, 0, self._width(src))])
        if isinstance(storage, DictStorage):
            self._no_override(storage, DictStorage, ("get", "get_flattened"))
            tree, residual = map_transform(
                storage.single_instance_space, storage.storage_map,
                lambda key, space, sub: self.rows(sub),
                nested_separator=storage.nested_separator)
            if residual:
                raise NotDirect(f"DictStorage keys without a storage: {sorted(residual)}")
            return tree
        if isinstance(storage, FlattenedStorage):
            self._no_override(storage, FlattenedStorage, ("get", "get_flattened"))
            flat = self.flat_rows(storage)
            return self._unflatten(storage.single_instance_space, flat.parts[0][0], [0])
        raise NotDirect(f"storage {qualname(storage)} is not one that keeps its rows in one "
                        f"in-memory tensor (PytorchTensorStorage, DictStorage or "
                        f"FlattenedStorage of those)")

    def flat_rows(self, storage):
        """The single 2-D leaf of a FlattenedStorage's ``get_flattened``."""
        from unienv_data.storages.pytorch import PytorchTensorStorage
        inner = storage.inner_storage
        if not isinstance(inner, PytorchTensorStorage):
            raise NotDirect(f"FlattenedStorage over {qualname(inner)}")
        leaf = self.rows(inner)
        if len(leaf.tail) != 1:
            raise NotDirect("FlattenedStorage whose inner rows are not 1-D")
        return leaf

    def require(self, obj, base, names, role):
        """``obj`` is a ``base`` that overrides none of ``names``, or NotDirect."""
        if not isinstance(obj, base):
            raise NotDirect(f"{role} is a {qualname(obj)}, not a UniEnv {base.__name__}")
        self._no_override(obj, base, names)

    def _no_override(self, storage, base, names):
        name = overridden(storage, base, names)
        if name is not None:
            raise NotDirect(f"{qualname(storage)} overrides {name}()")

    def _source(self, data, storage):
        torch = self.torch
        from unienv_data.third_party.tensordict.memmap_tensor import MemoryMappedTensor
        if type(data) is not torch.Tensor and type(data) is not MemoryMappedTensor:
            # a subclass may compute what indexing returns: only a plain or memory-mapped
            # tensor is known to return its rows' bytes
            raise NotDirect(f"{qualname(storage)} holds a {qualname(data)}, not a plain "
                            f"or memory-mapped tensor")
        if data.device.type != "cpu" and not self.on_device:
            raise NotDirect(f"{qualname(storage)} holds its rows on {data.device}")
        if data.dim() < 1 or data.layout != torch.strided or data.is_quantized:
            raise NotDirect(f"{qualname(storage)} holds a tensor that is not a strided "
                            f"array of rows")
        if data.requires_grad or data.is_conj() or data.is_neg():
            raise NotDirect(f"{qualname(storage)} holds a tensor that requires grad or "
                            f"has a lazy conjugate/negative bit")
        if type(data) is not torch.Tensor:
            # a MemoryMappedTensor: the same memory as a plain tensor, without the
            # subclass's __torch_function__ on every gather
            data = torch.Tensor.as_subclass(data, torch.Tensor)
        return data

    def _width(self, src):
        return int(np.prod(src.shape[1:], dtype=np.int64))

    def _as_2d(self, src):
        """``src`` viewed as ``(N, row elements)``, sharing its memory."""
        try:
            return src.view(src.shape[0], -1)
        except RuntimeError:
            raise NotDirect("a storage tensor whose rows cannot be viewed as flat rows "
                            "(not contiguous)") from None

    def _unflatten(self, space, flat, col):
        """Mirror of UniEnv's ``unflatten_data(space, rows, start_dim=1)``: the columns of
        the flat rows each leaf is cut from (``col``: the next column, a 1-list)."""
        from unienv_interface.space import BinarySpace, BoxSpace, DictSpace, TupleSpace
        if type(space) is BoxSpace:
            n = int(np.prod(space.shape, dtype=np.int64))
            a = col[0]
            col[0] += n
            dtype = space.dtype
            if not isinstance(dtype, self.torch.dtype):
                raise NotDirect(f"a space whose dtype {dtype!r} is not a torch dtype")
            return Leaf(space.shape, dtype, [(flat[:, a:a + n], 0, n)], (flat, a, a + n))
        if type(space) is DictSpace:
            return {k: self._unflatten(sub, flat, col) for k, sub in _unienv.dict_items(space)}
        if type(space) is TupleSpace:
            return tuple(self._unflatten(sub, flat, col) for sub in space.spaces)
        if isinstance(space, BinarySpace):
            raise NotDirect("BinarySpace leaves (cast on flattening)")
        raise NotDirect(f"flattened {type(space).__name__} leaves")

    def _flatten(self, space, tree, parts, col):
        """Mirror of UniEnv's ``flatten_data(space, tree, start_dim=1)``: append to
        ``parts`` the 2-D source of each column range of the flat rows."""
        from unienv_interface.space import BoxSpace, DictSpace, TupleSpace
        if type(space) is BoxSpace:
            # (a batched space: its first dimension is the batch's)
            if not isinstance(tree, Leaf) or tree.tail != tuple(space.shape[1:]):
                raise NotDirect("a leaf whose shape differs from its space")
            if len(tree.parts) != 1 or not tree.direct:
                raise NotDirect("flattening a leaf that is itself cut from flat rows")
            src = self._as_2d(tree.parts[0][0])
            n = src.shape[1]
            parts.append((src, col[0], col[0] + n))
            col[0] += n
        elif type(space) is DictSpace:
            if not isinstance(tree, dict):
                raise NotDirect("a DictSpace whose data is not a dict")
            for k, sub in _unienv.dict_items(space):
                self._flatten(sub, tree[k], parts, col)
        elif type(space) is TupleSpace:
            for i, sub in enumerate(space.spaces):
                self._flatten(sub, tree[i], parts, col)
        else:
            raise NotDirect(f"flattening {type(space).__name__} leaves")

    # -- what each getter returns ---------------------------------------------------------

    def structure(self, getter):
        """The tree of Leaf (and None) that ``sampler.<getter>(idx)`` returns; for a
        view, of :class:`unienv_mp._direct.views.Spec`."""
        if self.view is not None:
            from . import views as _views
            return _views.getter_specs(self.view, getter)
        rb = self.buffer
        storage = rb.storage
        if getter in ("get_at", "get_at_with_metadata"):
            tree = self.rows(storage)
        elif getter in ("get_flattened_at", "get_flattened_at_with_metadata"):
            tree = self.flat(storage)
        else:
            raise NotDirect(f"{getter} is not a gathering method")
        if getter.endswith("_with_metadata"):
            tree = (tree, None)
        return tree

    def flat(self, storage):
        from unienv_data.storages.dict_storage import DictStorage
        from unienv_data.storages.flattened import FlattenedStorage
        if isinstance(storage, FlattenedStorage):
            self._no_override(storage, FlattenedStorage, ("get", "get_flattened"))
            return self.flat_rows(storage)
        if isinstance(storage, DictStorage):
            self._no_override(storage, DictStorage, ("get", "get_flattened"))
            space = _unienv.instance_space(storage)
            tree = self.rows(storage)
        elif hasattr(storage, "get_flattened"):
            raise NotDirect(f"{qualname(storage)}.get_flattened")
        else:
            # ReplayBuffer: flatten_data(self._batched_space, get_at(idx), start_dim=1)
            space = _unienv.batched_space(self.buffer)
            tree = self.rows(storage)
        parts = []
        col = [0]
        self._flatten(space, tree, parts, col)
        if not parts:
            raise NotDirect("nothing to flatten")
        dtype = parts[0][0].dtype
        for src, _, _ in parts[1:]:
            dtype = self.torch.promote_types(dtype, src.dtype)
        return Leaf((col[0],), dtype, parts)


def is_index_tensor(arg):
    """A non-empty 1-D int64 tensor: the indices an epoch sends (anything else, the
    generic getter handles as UniEnv does)."""
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
    offset is 0.  (Used by the workers, and by the main job's in-process speed limit.)"""
    ring = _unienv.ring_state(buffer)
    if ring is None:
        return _unienv.logical_to_physical(buffer, idx)
    count, offset = ring
    if offset == 0:
        return idx
    return (idx + offset).remainder_(count)


class Gatherer:
    """Lives in a worker: turns a task ``(method, argument)`` into a :class:`SlotWriter`
    that gathers the batch into the worker's slot, or None for tasks it does not serve."""

    def __init__(self, sampler):
        self._planner = Planner(sampler)
        self.sampler = sampler
        self.buffer = self._planner.buffer
        self._view = None
        if self._planner.view is not None:
            from . import views as _views
            self._view = _views.ViewGatherer(self._planner.view, sampler)
        self._structures = {}   # getter -> tree of Leaf, or None (not direct)
        self._plans = {}        # (getter, batch size, batches or None) -> _Plan

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

    def __call__(self, name, arg):
        """A :class:`SlotWriter` for the task, or None to run it the generic way.  For a
        sampling method, ``arg`` is None (one batch) or a count ``k`` (a tuple of ``k``
        batches, drawn one after the other as ``k`` calls would draw them)."""
        task = self._task(name, arg)
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
            plan = self._plans[key] = _Plan(self.structure(getter), n, k)
        return PlannedBatch(plan, rows)

    def _task(self, name, arg):
        """``(getter, k, index tensors)`` of a task that a plan serves, or None: a sampling method's ``k`` (None for one batch) draws of
        ``sample_index()`` (the RNG advances as in ``sample*()``), or a getter's given
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
            return getter, k, [sample_index() for _ in range(k or 1)]
        if name in _GETTERS and is_index_tensor(arg) and self.structure(name) is not None:
            return name, None, [arg]
        return None


class _Plan:
    """The slot layout of one batch structure at one batch size ``n`` -- or of a tuple of
    ``k`` such batches -- : the codec frame, and for every array, where it goes, which
    batch of the tuple it belongs to, and what fills it."""

    def __init__(self, tree, n, k=None):
        import torch
        self.torch = torch
        self.n = n
        fills = {}
        keep = []
        batch = [0]

        def template(node):
            if isinstance(node, Leaf):
                # zero-stride stand-in with the leaf's shape and dtype: the codec reads
                # shapes and dtypes from it, never its data
                t = torch.empty((), dtype=node.dtype).expand((n, *node.tail))
                fills[id(t)] = (batch[0], node)
                keep.append(t)
                return t
            if isinstance(node, dict):
                return {k: template(v) for k, v in node.items()}
            if isinstance(node, tuple):
                return tuple(template(v) for v in node)
            return node

        if k is None:
            whole = template(tree)
        else:
            whole = []
            for b in range(k):
                batch[0] = b
                whole.append(template(tree))
            whole = tuple(whole)
        self.prepared = _codec.prepare(whole)
        self.nbytes = self.prepared.nbytes
        # (offset, nbytes, Leaf, table of byte rows or None, row bytes, batch)
        self.leaves = []
        for t, off, nbytes in self.prepared.array_layout():
            b, leaf = fills[id(t)]
            table = byte_rows(leaf.parts[0][0]) if leaf.direct and nbytes else None
            self.leaves.append((off, nbytes, leaf, table,
                                0 if table is None else table.shape[1], b))
        self.scratch = {}  # (leaf index, part index) -> tensor, for converting parts

    def views(self, buffer):
        """The output arrays over ``buffer`` (a slot) of the leaves that need one, and a
        memoryview of it that keeps the memory mapped (a Segment is unmapped on close only
        once no export is left) for as long as the views are kept: torch.frombuffer holds
        no export of its own."""
        torch = self.torch
        buffer = memoryview(buffer)
        out = [buffer]
        for off, nbytes, leaf, table, _, _ in self.leaves:
            if nbytes == 0 or table is not None:
                out.append(None)
                continue
            count = nbytes // torch.empty((), dtype=leaf.dtype).element_size()
            v = torch.frombuffer(buffer, dtype=leaf.dtype, count=count, offset=off)
            out.append(v.view(self.n, *leaf.tail) if leaf.direct else v.view(self.n, -1))
        return out   # [memoryview, view of leaf 0, view of leaf 1, ...]

    def fill(self, buffer, views, batch_rows):
        """Gather every leaf of batch ``b`` from storage rows ``batch_rows[b]``."""
        torch = self.torch
        rows_np = None
        gathered = None
        last = -1
        for i, (off, nbytes, leaf, table, row_bytes, b) in enumerate(self.leaves):
            if b != last:   # the next batch of a tuple: its own rows
                rows, rows_np, gathered, last = batch_rows[b], None, None, b
            if table is not None:
                if rows_np is None:
                    if rows.dtype != torch.int64 or not rows.is_contiguous():
                        rows = rows.to(torch.int64).contiguous()
                    rows_np = rows.numpy()
                _rows.gather_rows(table, row_bytes, rows_np, buffer, off)
                continue
            out = views[i + 1]
            if out is None:
                continue
            if leaf.direct:
                torch.index_select(leaf.parts[0][0], 0, rows, out=out)
                continue
            if leaf.columns is not None and leaf.dtype != leaf.parts[0][0].dtype:
                # UniEnv's unflatten_data casts a (strided) column slice of the gathered
                # flat rows; torch may round a cast from a strided source differently
                # (NaN payloads) than from a contiguous one, so cast from the same slice
                flat, a, b = leaf.columns
                if gathered is None:
                    gathered = {}
                full = gathered.get(id(flat))
                if full is None:
                    full = self.scratch.get(id(flat))
                    if full is None:
                        full = self.scratch[id(flat)] = torch.empty(
                            (self.n, flat.shape[1]), dtype=flat.dtype)
                    torch.index_select(flat, 0, rows, out=full)
                    gathered[id(flat)] = full
                out.view(self.n, *leaf.tail).copy_(full[:, a:b].reshape(self.n, *leaf.tail))
                continue
            for j, (src, a, b) in enumerate(leaf.parts):
                if src.dtype == leaf.dtype and len(leaf.parts) == 1:
                    torch.index_select(src, 0, rows, out=out)
                    continue
                tmp = self.scratch.get((i, j))
                if tmp is None:
                    tmp = self.scratch[(i, j)] = torch.empty((self.n, b - a), dtype=src.dtype)
                torch.index_select(src, 0, rows, out=tmp)
                out[:, a:b].copy_(tmp)


def byte_rows(src):
    """``src``'s memory as a numpy ``(rows, bytes per row)`` uint8 array, for
    :func:`_rows.gather_rows`; None where it is not one contiguous table (then torch
    gathers it)."""
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
    """One batch (or a tuple of them) to gather: a plan (the codec frame ``prepared``,
    ``views(buffer)`` of a slot, ``fill(buffer, views, what)``) and what it is filled
    with (the storage rows of each batch; for a view, its evaluated parts)."""
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
