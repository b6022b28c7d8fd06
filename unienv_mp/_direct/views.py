"""Direct gather of UniEnv's batch views: frame stacks and action chunks
(``SliceStackedBatch``, ``FrameStackedBatch``), their column views, combined datasets
(``CombinedBatch``), field views (``SubItemBatch``) and index views (``SubIndexedBatch``),
nested as users nest them, over ReplayBuffers, whose storages are read by the storage
planner that `plan` is handed (`unienv_mp._direct.storages`).

A view's batch is a function of storage rows.  A stack expands each index into its window
(``idx + fixed_offset``, clipped to the data), reads the episode column at those rows to
get the valid mask, and, with ``fill_invalid_data``, replaces each invalid frame by the
nearest valid one, which is just another row; a combined dataset sends each index to its
part; a field view keeps some arrays; an index view maps the index first.  So a worker
works out, from the batch's few indices, which storage row each array row of the batch
comes from (a *row table*), and copies those rows straight into the slot with the same
row kernel as for flat rows (``csrc/umr_rows.c``).  No intermediate batch is made.

**Planning** is a table from UniEnv type to the class that plans it (`PLANNERS`): a new view
is one entry.  A node answers three questions about its batch: its length now, the shape of
its arrays (`Spec`: per batch element, the window dimensions the views add, then one storage
row), and, for given indices, where each array's rows come from (a list of `Part`: rows of
one storage tensor, or values computed in the worker such as the valid mask, each to all
positions of the array or to some).

**Exactness.**  Every step is UniEnv's own arithmetic, on indices instead of data: the
same expansion and clipping, the valid mask computed by UniEnv's own mask function from
the episode column's values (gathered exactly as UniEnv gathers them), and UniEnv's fill
(``fill_data_with_stack_mask``) done on the table of indices instead of on the data: the
filled data of a stack is the data at the filled indices.  The layout of the slot -- structure, key
order, dtypes, shapes -- is taken from UniEnv itself: once per plan, the worker asks the
view for one element the generic way and lays the batch out as that answer is laid out,
refusing the plan (the generic path runs) if any array differs from what the nodes
computed.  What a node cannot reproduce exactly is refused when it is planned, with a
reason that names the part of the view: a custom valid mask function or one reading
metadata, a subclass, transformations, storages outside the list of
`unienv_mp._direct.gather`.

Flattened batches of views (``sample_flat*``, ``get_flattened_at*``) are gathered directly
where the view flattens its own batch of one array (a column stack, a field view: the flat
row is the window's rows one after the other); elsewhere they take the generic path.
"""
import numpy as np

from .._transport import codec as _codec
from . import rows as _rows
from . import unienv as _unienv
from .base import BUFFER_METHODS, NotDirect, PlannedBatch, byte_rows, overridden, qualname

__all__ = ["PLANNERS", "plan", "Spec", "Part", "ViewGatherer", "GETTERS", "FLAT_GETTERS",
           "getter_specs"]

#: The getters a view plan serves (``sample`` and ``sample_with_metadata`` gather with
#: them, as do the epochs).
GETTERS = ("get_at", "get_at_with_metadata")
#: The flattened getters, which a view plan serves for the views that flatten their
#: batch with UniEnv's ``flatten_data`` (a column stack, a field view) where that batch
#: is one array (see `flat_specs`).
FLAT_GETTERS = ("get_flattened_at", "get_flattened_at_with_metadata")


def _torch():
    import torch
    return torch


class Spec:
    """One array of a batch, per batch element: ``lead`` (the window dimensions that stacks
    add, outermost first) then ``unit`` (one storage row, or one computed value), of
    ``dtype``.  The array of a batch of ``n`` is ``(n, *lead, *unit)``, or ``(n,
    *shape)`` for a ``shape`` of as many elements (a flattened batch's one row per
    element): ``n * prod(lead)`` rows of ``unit`` in memory either way."""
    __slots__ = ("dtype", "lead", "unit", "per_element", "shape")

    def __init__(self, dtype, lead, unit, shape=None):
        self.dtype = dtype
        self.lead = tuple(int(d) for d in lead)
        self.unit = tuple(int(d) for d in unit)
        #: rows of ``unit`` per batch element
        self.per_element = int(np.prod(self.lead, dtype=np.int64))
        #: the array's shape after the batch dimension
        self.shape = self.lead + self.unit if shape is None else tuple(shape)

    def element_nbytes(self):
        """Bytes per batch element."""
        return (int(np.prod(self.shape, dtype=np.int64))
                * _torch().empty((), dtype=self.dtype).element_size())

    def stacked(self, t):
        return Spec(self.dtype, (t, *self.lead), self.unit)

    def flattened(self):
        """The same rows as one flat row per element (UniEnv's ``flatten_data`` of one
        array: a reshape)."""
        return Spec(self.dtype, self.lead, self.unit,
                    (int(np.prod(self.shape, dtype=np.int64)),))

    def __eq__(self, other):
        return (isinstance(other, Spec) and self.dtype == other.dtype
                and self.shape == other.shape and self.lead == other.lead
                and self.unit == other.unit)

    def __repr__(self):
        return f"Spec({self.dtype}, lead={self.lead}, unit={self.unit}, shape={self.shape})"


class Source:
    """A storage tensor that rows are gathered from, with its byte table for the row kernel
    (None where it is not one contiguous table: then torch gathers it)."""
    __slots__ = ("tensor", "table", "row_bytes")

    def __init__(self, tensor):
        self.tensor = tensor
        self.table = byte_rows(tensor)
        self.row_bytes = 0 if self.table is None else self.table.shape[1]


class Part:
    """Some rows of one array of a batch: ``source``'s rows ``data`` (a `Source`), or, with
    ``source`` None, the values ``data`` (``(count, *unit)``), going to the array's rows
    ``pos`` (flat positions over its ``n * prod(lead)`` rows), or to all of them in order
    when ``pos`` is None."""
    __slots__ = ("source", "data", "pos")

    def __init__(self, source, data, pos=None):
        self.source = source
        self.data = data
        self.pos = pos


class _OutOfRange(Exception):
    """An index outside the data: the generic path raises what UniEnv raises."""


# -- trees ---------------------------------------------------------------------------------

def _map(tree, fn):
    """``tree`` with ``fn`` applied to each leaf (anything but a dict or a tuple)."""
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_map(v, fn) for v in tree)
    return fn(tree)


def _map2(specs, values, fn):
    """``fn(spec, value)`` for each leaf of two trees of the same shape."""
    if isinstance(specs, dict):
        return {k: _map2(s, values[k], fn) for k, s in specs.items()}
    if isinstance(specs, tuple):
        return tuple(_map2(s, v, fn) for s, v in zip(specs, values))
    return fn(specs, values)


def _merge(into, tree):
    """Append the part lists of ``tree`` to those of ``into`` (same shape), or ``tree``
    itself if ``into`` is None."""
    if into is None:
        return tree
    if isinstance(into, dict):
        for k, v in into.items():
            _merge(v, tree[k])
    elif isinstance(into, tuple):
        for a, b in zip(into, tree):
            _merge(a, b)
    else:
        into.extend(tree)
    return into


def _as_rows(t):
    """``t`` as a contiguous int64 tensor (the row kernel's index type)."""
    torch = _torch()
    if t.dtype != torch.int64:
        t = t.to(torch.int64)
    return t if t.is_contiguous() else t.contiguous()


def materialize(spec, parts, n):
    """The array ``(n * prod(spec.lead), *spec.unit)`` that ``parts`` describe."""
    torch = _torch()
    out = torch.empty((n * spec.per_element, *spec.unit), dtype=spec.dtype)
    for part in parts:
        if part.source is None:
            vals = part.data
        elif part.pos is None:
            torch.index_select(part.source.tensor, 0, part.data, out=out)
            continue
        else:
            vals = part.source.tensor.index_select(0, part.data)
        if part.pos is None:
            out.copy_(vals.reshape(out.shape))
        else:
            out.index_copy_(0, part.pos, vals)
    return out


# -- the nodes -------------------------------------------------------------------------------

class _Node:
    """The plan of one UniEnv batch (see the module's docstring)."""

    def length(self):
        """``len(batch)`` now."""
        raise NotImplementedError

    def specs(self):
        """``(data, metadata)``: trees of `Spec` of what ``get_at_with_metadata`` returns
        (metadata None where the batch has none)."""
        raise NotImplementedError

    def evaluate(self, idx, meta, within=None):
        """``(data, metadata)`` trees of `Part` lists for the indices ``idx`` (a 1-D int64
        tensor); metadata only if ``meta``, else None.  ``within``: a length that the
        indices are known to be in ``[0, within)`` of (a window clipped to it, say), or
        None."""
        raise NotImplementedError


class _BufferNode(_Node):
    """A ReplayBuffer: its storage's rows, at ``(idx + offset) % count`` (its own
    mapping, on one snapshot of its ring state)."""

    def __init__(self, rb, planner):
        from unienv_data.replay_buffer.replay_buffer import ReplayBuffer
        planner.require(rb, ReplayBuffer, BUFFER_METHODS, "ReplayBuffer")
        self.rb = rb

        def source(leaf):
            if not leaf.direct:
                raise NotDirect("its storage's arrays are cut from flat rows "
                                "(FlattenedStorage): not gathered directly under a view")
            # a list, not a tuple: tuples are containers of the tree
            return [Source(leaf.parts[0][0]), Spec(leaf.dtype, (), leaf.tail)]

        self.tree = _map(planner.rows(rb.storage), source)
        self._specs = _map(self.tree, lambda s: s[1])

    def length(self):
        ring = _unienv.ring_state(self.rb)
        return len(self.rb) if ring is None else int(ring[0])

    def specs(self):
        return self._specs, None

    def evaluate(self, idx, meta, within=None):
        rows = self._rows(idx, within)
        return _map(self.tree, lambda s: [Part(s[0], rows)]), None

    def _rows(self, idx, within):
        torch = _torch()
        ring = _unienv.ring_state(self.rb)
        if ring is None:
            try:
                return _as_rows(_unienv.logical_to_physical(self.rb, idx))
            except AssertionError:
                raise _OutOfRange() from None
        count, offset = ring
        if idx.numel() == 0:
            return idx
        if within is not None and within <= count:
            lo = 0   # clipped to a length the buffer still has: in [0, count)
        else:
            lo, hi = torch.aminmax(idx)
            lo, hi = int(lo), int(hi)
            if lo < -count or hi >= count:
                raise _OutOfRange()
        if lo >= 0 and offset == 0:
            return _as_rows(idx)
        # UniEnv's index_with_offset: (idx + count + offset) % count
        return (idx + (count + offset)).remainder_(count)


class _StackNode(_Node):
    """A SliceStackedBatch (FrameStackedBatch, and the column stacks of ``get_column``):
    each index's window of rows, its valid mask, invalid frames filled."""

    _METHODS = ("get_at", "get_at_with_metadata", "expand_index", "get_valid_mask",
                "fill_data_with_stack_mask", "_finalize_metadata", "__len__")

    def __init__(self, view, planner):
        torch = _torch()
        name = overridden(view, type(view), self._METHODS)
        if name is not None:
            raise NotDirect(f"it overrides {name}()")
        self.view = view
        self.child = plan(view.batch, planner)
        self.child_meta = self.child.specs()[1] is not None
        off = view.fixed_offset
        if type(off) is not torch.Tensor or off.device.type != "cpu":
            raise NotDirect("its fixed_offset is not a CPU tensor")
        self.offsets = off.to(torch.int64).contiguous().numpy()
        self.t = int(off.shape[0])
        self.anchor = _unienv.stack_anchor(view)
        self.fill = bool(view.fill_invalid_data)
        self.stack_meta = bool(view.stack_metadata)
        self.mask_fn = view.get_valid_mask_function
        self.mask_node = None
        self.kind = None   # the window loops' mask kind, where they compute UniEnv's mask
        key = _unienv.stack_mask_key(view)
        if isinstance(key, str):
            raise NotDirect(key)
        if key is not None:
            kind, key = key
            self.key = key
            column = type(view) is _unienv.column_stack_class()
            if column and view.mask_batch is not None:
                if view.mask_key != key:
                    raise NotDirect("its mask column's key is not its mask function's")
                self.mask_node = plan(view.mask_batch, planner)
                self.mask_path = ()
            else:
                self.mask_node = self.child
                self.mask_path = (key,)
            spec = self.mask_node.specs()[0]
            for k in self.mask_path:
                if not isinstance(spec, dict) or k not in spec:
                    raise NotDirect(f"its valid mask's key {key!r} is not a key of the "
                                    f"stacked data")
                spec = spec[k]
            if not isinstance(spec, Spec):
                raise NotDirect(f"its valid mask's key {key!r} holds more than one array")
            self.mask_spec = spec
            # the window's own loops (csrc/umr_window.c) where they compute what UniEnv's
            # helper computes: one value per frame, ids compared as integers (equality
            # survives the conversion to int64), ends counted after UniEnv's own conversion
            if spec.shape == () and (kind == "episode_end" or not (
                    spec.dtype.is_floating_point or spec.dtype.is_complex)):
                self.kind = _rows.EPISODE_ID if kind == "episode_id" else _rows.EPISODE_END
        self.fast = self._fast_path()

    def _fast_path(self):
        """``(key bytes, key type, mask kind, bits of an episode end)`` where the stack
        sits straight on a buffer (and reads its mask from it or from a column of the
        same buffer) with a mask the window's loops compute: then one call of
        ``_rows.window_rows`` makes the batch's rows and mask.  None elsewhere."""
        torch = _torch()
        child, mask_node = self.child, self.mask_node
        if type(child) is not _BufferNode or _unienv.ring_state(child.rb) is None:
            return None
        bits = {torch.int32: 32, torch.int64: 64}.get(self.view.backend.default_integer_dtype)
        if mask_node is None:
            return np.zeros(0, np.uint8), _rows.KEY_TYPES["int64"], 0, 64
        if (self.kind is None or bits is None or type(mask_node) is not _BufferNode
                or not _unienv.same_ring(child.rb, mask_node.rb)):
            return None
        leaf = mask_node.tree
        for k in self.mask_path:
            leaf = leaf[k]
        source, spec = leaf
        name = str(spec.dtype).replace("torch.", "")
        if source.table is None or spec.unit != () or name not in _rows.KEY_TYPES:
            return None
        return source.table.reshape(-1), _rows.KEY_TYPES[name], self.kind, bits

    def length(self):
        return self.child.length()

    def specs(self):
        data, meta = self.child.specs()
        t = self.t
        data = _map(data, lambda s: s.stacked(t))
        if meta is None:
            meta = {}
        elif self.stack_meta:
            meta = dict(_map(meta, lambda s: s.stacked(t)))
        else:
            meta = dict(meta)
        meta["slice_valid_mask"] = Spec(_torch().bool, (t,), ())
        return data, meta

    def evaluate(self, idx, meta, within=None):
        if self.fast is not None:
            return self._evaluate_fast(idx, meta)
        torch = _torch()
        n = self.child.length()
        if n <= 0:
            raise _OutOfRange()   # (UniEnv's clip gives -1: UniEnv raises)
        idx = _as_rows(idx)
        m, t = int(idx.shape[0]), self.t
        expanded = torch.empty(m * t, dtype=torch.int64)
        _rows.window(idx.numpy(), self.offsets, n, expanded.numpy())
        if self.mask_node is None:
            mask = torch.ones((m, t), dtype=torch.bool)
        else:
            mask = self._mask(expanded, m, n)
        if self.fill:
            if mask.dtype != torch.bool or tuple(mask.shape) != (m, t):
                raise NotDirect("a valid mask that is not one bool per frame")
            _rows.window_fill(expanded.numpy(), mask.reshape(-1).view(torch.uint8).numpy(),
                              t, self.anchor)
        # (every index is in [0, n): clipped to it)
        data, child_meta = self.child.evaluate(expanded, meta and self.stack_meta, n)
        if not meta:
            return data, None
        if not self.stack_meta:
            # the anchor's metadata (the fill leaves the anchor's frame as it is)
            child_meta = (self.child.evaluate(expanded.view(m, t)[:, self.anchor].contiguous(),
                                              True, n)[1] if self.child_meta else None)
        out = {} if child_meta is None else dict(child_meta)
        out["slice_valid_mask"] = [Part(None, mask.reshape(-1))]
        return data, out

    def _evaluate_fast(self, idx, meta):
        """`evaluate` of a stack straight over a buffer, in one call (see `_fast_path`): the
        buffer has no metadata."""
        torch = _torch()
        count, offset = _unienv.ring_state(self.child.rb)
        if count <= 0:
            raise _OutOfRange()
        idx = _as_rows(idx)
        m, t = int(idx.shape[0]), self.t
        rows = torch.empty(m * t, dtype=torch.int64)
        mask = torch.empty((m, t), dtype=torch.bool)
        key, key_type, kind, bits = self.fast
        _rows.window_rows(idx.numpy(), self.offsets, self.anchor, count, offset, key,
                          key_type, kind, bits, self.fill, rows.numpy(),
                          mask.view(-1).view(torch.uint8).numpy())
        data = _map(self.child.tree, lambda s: [Part(s[0], rows)])
        return data, ({"slice_valid_mask": [Part(None, mask.view(-1))]} if meta else None)

    def _mask(self, expanded, m, n):
        """The valid mask ``(m, t)`` of the window ``expanded`` (within ``n``) from the
        episode column's values there, read as UniEnv reads them."""
        torch = _torch()
        t = self.t
        values = self.mask_node.evaluate(expanded, False, n)[0]
        for k in self.mask_path:
            values = values[k]
        spec = self.mask_spec
        column = materialize(spec, values, m * t)
        if self.kind is None:
            # UniEnv's own mask function, on the values it would read
            return self.mask_fn(self.view, expanded.view(m, t),
                                {self.key: column.reshape(m, t, *spec.shape)}, None)
        if self.kind == _rows.EPISODE_END:
            # (UniEnv counts the ends in its default integer type)
            column = column.to(self.view.backend.default_integer_dtype)
        mask = torch.empty((m, t), dtype=torch.bool)
        _rows.window_mask(_as_rows(column).numpy(), t, self.anchor, self.kind,
                          mask.view(-1).view(torch.uint8).numpy())
        return mask


class _CombinedNode(_Node):
    """A CombinedBatch: each index goes to its part, whose rows go to the positions of the
    batch that belong to it."""

    def __init__(self, view, planner):
        name = overridden(view, type(view), ("get_at", "get_at_with_metadata", "__len__",
                                             "_convert_index"))
        if name is not None:
            raise NotDirect(f"it overrides {name}()")
        self.view = view
        self.parts = []
        for i, batch in enumerate(view.batches):
            try:
                self.parts.append(plan(batch, planner))
            except NotDirect as e:
                raise NotDirect(f"part {i}: {e}") from None
        self._specs = self.parts[0].specs()
        for i, part in enumerate(self.parts[1:], 1):
            if not _same_specs(part.specs(), self._specs):
                raise NotDirect(f"part {i}'s arrays differ from part 0's in dtype or shape")

    def length(self):
        return int(self.view.index_caches[-1, 1])

    def specs(self):
        data, meta = self._specs
        meta = {} if meta is None else dict(meta)
        meta["batch_index"] = Spec(self.view.backend.default_integer_dtype, (), ())
        return data, meta

    def evaluate(self, idx, meta, within=None):
        torch = _torch()
        caches = self.view.index_caches
        total = int(caches[-1, 1])
        if idx.numel():
            lo, hi = torch.aminmax(idx)
            if int(lo) < -total or int(hi) >= total:
                raise _OutOfRange()
            if int(lo) < 0:
                idx = (idx + total) % total
        starts = caches[:, 0]
        which = (idx[:, None] >= starts[None, :]).sum(-1) - 1
        data = out_meta = None
        specs = self._specs
        for p in torch.unique(which).tolist():
            sel = which == p
            pos = sel.nonzero().view(-1)
            d, m = self.parts[p].evaluate(idx[sel] - starts[p], meta, int(caches[p, 2]))
            bases = {}   # rows per element -> the rows of the part's elements
            data = _merge(data, _map2(specs[0], d, lambda s, v: _moved(s, v, pos, bases)))
            if meta and m is not None:
                out_meta = _merge(out_meta, _map2(specs[1], m,
                                                  lambda s, v: _moved(s, v, pos, bases)))
        if not meta:
            return data, None
        out = {} if out_meta is None else dict(out_meta)
        out["batch_index"] = [Part(None, which.to(self.view.backend.default_integer_dtype))]
        return data, out


def _moved(spec, parts, pos, bases):
    """``parts`` of a part's batch, moved to the positions ``pos`` of its elements in the
    combined batch (each element owns ``spec.per_element`` consecutive rows; ``bases``
    keeps the rows of those elements by rows per element, for the part's other arrays)."""
    per = spec.per_element
    base = bases.get(per)
    if base is None:
        base = bases[per] = (pos if per == 1 else
                             (pos[:, None] * per + _torch().arange(per)).reshape(-1))
    return [Part(p.source, p.data, base if p.pos is None else base[p.pos]) for p in parts]


def _same_specs(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(
            _same_specs(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(
            _same_specs(x, y) for x, y in zip(a, b))
    return a == b


class _SubItemNode(_Node):
    """A SubItemBatch: some arrays of each element; metadata unchanged."""

    def __init__(self, view, planner):
        name = overridden(view, type(view), ("get_at", "get_at_with_metadata"))
        if name is not None:
            raise NotDirect(f"it overrides {name}()")
        self.child = plan(view.batch, planner)
        self.keys = tuple(view.sub_indexes)
        self._pick(self.child.specs()[0])

    def _pick(self, tree):
        for k in self.keys:
            try:
                tree = tree[k]
            except (KeyError, IndexError, TypeError):
                raise NotDirect(f"its keys {list(self.keys)!r} are not in the data") from None
        return tree

    def length(self):
        return self.child.length()

    def specs(self):
        data, meta = self.child.specs()
        return self._pick(data), meta

    def evaluate(self, idx, meta, within=None):
        data, m = self.child.evaluate(idx, meta, within)
        return self._pick(data), m


class _SubIndexedNode(_Node):
    """A SubIndexedBatch: the indices mapped through its index array first."""

    def __init__(self, view, planner):
        torch = _torch()
        name = overridden(view, type(view), ("get_at", "get_at_with_metadata", "__len__",
                                             "_parent_index"))
        if name is not None:
            raise NotDirect(f"it overrides {name}()")
        self.view = view
        sub = view.sub_indexes
        if sub is not Ellipsis and (type(sub) is not torch.Tensor
                                    or sub.device.type != "cpu"):
            raise NotDirect("its index is not a CPU tensor")
        self.sub = sub
        self.child = plan(view.batch, planner)

    def length(self):
        return len(self.view)

    def specs(self):
        return self.child.specs()

    def evaluate(self, idx, meta, within=None):
        if self.sub is Ellipsis:
            return self.child.evaluate(idx, meta, within)
        try:
            idx = _as_rows(self.sub[idx])
        except IndexError:
            raise _OutOfRange() from None
        return self.child.evaluate(idx, meta)


class _WindowNode(_Node):
    """A WindowedBatch (`unienv_mp.windows`) over a ReplayBuffer: each index's episode
    span found once (``umr_episode_span``), then each key's window clamped to it as
    storage rows, with its pad mask (``umr_span_rows``), and the keys without a window
    at the index's own row.  The view's ``get_at`` computes the same with tensor
    operations; the layout of the slot is taken from its answer, as for UniEnv's views."""

    _METHODS = ("get_at", "get_at_with_metadata", "__len__", "_indices", "_spans",
                "_joined", "_assemble", "_fetch")

    def __init__(self, view, planner):
        torch = _torch()
        name = overridden(view, type(view), self._METHODS)
        if name is not None:
            raise NotDirect(f"it overrides {name}()")
        self.view = view
        self.child = child = plan(view.batch, planner)
        if type(child) is not _BufferNode or _unienv.ring_state(child.rb) is None:
            raise NotDirect(f"its data is a {type(view.batch).__name__}: windows are "
                            f"gathered directly over a ReplayBuffer or a column of one")
        self.windows = [(name, tuple(name.split("/")),
                         np.ascontiguousarray(offs, dtype=np.int64))
                        for name, offs in view.offsets.items()]
        reach = [int(o) for _, _, offs in self.windows for o in offs]
        self.back, self.fwd = max(0, -min(reach)), max(0, max(reach))
        self.key = np.zeros(0, np.uint8), _rows.KEY_TYPES["int64"], 0
        for kind, key in ((_rows.EPISODE_ID, view.episode_id_key),
                          (_rows.EPISODE_END, view.episode_end_key)):
            if key is not None:
                self.key = self._episode_column(key, kind)
        windowed = {path: (i, len(offs)) for i, (_, path, offs) in enumerate(self.windows)}
        # {key: ("window", i) | ("anchor",) | {nested}}, as the view's own layout (in the
        # order of its space)
        self.layout = self._layout(view.single_space, windowed, ())
        pads = {f"{name}_is_pad": Spec(torch.bool, (len(offs),), ())
                for name, _, offs in self.windows}
        self._specs = (self._spec_tree(self.layout, child.tree),
                       {k: pads[k] for k in view.single_metadata_space.spaces})

    def _episode_column(self, key, kind):
        leaf = self.child.tree
        for k in key.split("/"):
            leaf = leaf[k]
        source, spec = leaf
        dtype = str(spec.dtype).replace("torch.", "")
        if source.table is None or spec.unit != () or dtype not in _rows.KEY_TYPES:
            raise NotDirect(f"its episode column {key!r} is {spec.dtype}{spec.unit}: "
                            f"gathered directly from one integer or bool per step")
        return source.table.reshape(-1), _rows.KEY_TYPES[dtype], kind

    def _layout(self, space, windowed, path):
        out = {}
        for key in space.spaces:
            here = path + (key,)
            if here in windowed:
                out[key] = ("window",) + windowed[here]
            elif any(w[:len(here)] == here for w in windowed):
                out[key] = self._layout(space.spaces[key], windowed, here)
            else:
                out[key] = ("anchor",)
        return out

    def _spec_tree(self, layout, tree):
        out = {}
        for key, entry in layout.items():
            sub = tree[key]
            if isinstance(entry, dict):
                out[key] = self._spec_tree(entry, sub)
            elif entry[0] == "window":
                out[key] = _map(sub, lambda s, t=entry[2]: s[1].stacked(t))
            else:
                out[key] = _map(sub, lambda s: s[1])
        return out

    def length(self):
        return self.child.length()

    def specs(self):
        return self._specs

    def evaluate(self, idx, meta, within=None):
        torch = _torch()
        count, offset = _unienv.ring_state(self.child.rb)
        if count <= 0:
            raise _OutOfRange()
        idx = _as_rows(idx)
        m = int(idx.shape[0])
        t, lo, hi = (torch.empty(m, dtype=torch.int64) for _ in range(3))
        key, key_type, kind = self.key
        try:
            _rows.episode_span(idx.numpy(), self.back, self.fwd, count, offset, key, key_type,
                               kind, t.numpy(), lo.numpy(), hi.numpy())
        except IndexError:
            raise _OutOfRange() from None
        rows, pads = [], {}
        for name, _, offs in self.windows:
            r = torch.empty(m * len(offs), dtype=torch.int64)
            pad = torch.empty(m * len(offs), dtype=torch.bool)
            _rows.span_rows(t.numpy(), lo.numpy(), hi.numpy(), offs, count, offset,
                            r.numpy(), pad.view(torch.uint8).numpy())
            rows.append(r)
            pads[f"{name}_is_pad"] = [Part(None, pad)]
        anchor = (t + offset).remainder_(count)   # (0 <= t < count)
        data = self._parts(self.layout, self.child.tree, rows, anchor)
        return data, (pads if meta else None)

    def _parts(self, layout, tree, rows, anchor):
        out = {}
        for key, entry in layout.items():
            sub = tree[key]
            if isinstance(entry, dict):
                out[key] = self._parts(entry, sub, rows, anchor)
            else:
                r = rows[entry[1]] if entry[0] == "window" else anchor
                out[key] = _map(sub, lambda s, r=r: [Part(s[0], r)])
        return out


def _planners():
    from unienv_data.batches.combined_batch import CombinedBatch
    from unienv_data.batches.framestack_batch import FrameStackedBatch
    from unienv_data.batches.slicestack_batch import SliceStackedBatch
    from unienv_data.batches.subindex_batch import SubIndexedBatch
    from unienv_data.batches.subitem_batch import SubItemBatch
    from unienv_data.replay_buffer.replay_buffer import ReplayBuffer

    from ..windows import WindowedBatch
    return {
        ReplayBuffer: _BufferNode,
        WindowedBatch: _WindowNode,
        SliceStackedBatch: _StackNode,
        FrameStackedBatch: _StackNode,
        _unienv.column_stack_class(): _StackNode,
        CombinedBatch: _CombinedNode,
        SubItemBatch: _SubItemNode,
        SubIndexedBatch: _SubIndexedNode,
    }


#: UniEnv type -> the node class that plans it; filled at first use (UniEnv is imported
#: then).  A ReplayBuffer subclass that overrides none of its methods counts as one; every
#: other type must match exactly.
PLANNERS = {}


def plan(batch, planner):
    """The node that plans ``batch`` (raises `NotDirect`, naming the part of the view, if it
    cannot be gathered directly).  ``planner`` plans the storages
    (`unienv_mp._direct.storages.StoragePlanner`)."""
    if not PLANNERS:
        PLANNERS.update(_planners())
    cls = PLANNERS.get(type(batch))
    if cls is None:
        from unienv_data.replay_buffer.replay_buffer import ReplayBuffer
        if isinstance(batch, ReplayBuffer):
            cls = _BufferNode
        else:
            raise NotDirect(f"{qualname(batch)} is not a batch that the direct path "
                            f"reproduces (a ReplayBuffer, or UniEnv's SliceStackedBatch, "
                            f"FrameStackedBatch, CombinedBatch, SubItemBatch or "
                            f"SubIndexedBatch over one, or a WindowedBatch)")
    try:
        return cls(batch, planner)
    except NotDirect as e:
        raise NotDirect(f"{type(batch).__name__} > {e}") from None


def getter_specs(root, getter):
    """What ``getter`` returns, as trees of `Spec`: the data (and the metadata, for a
    ``_with_metadata`` getter).  A flattened getter is planned where the view flattens its
    own batch with UniEnv's ``flatten_data`` (a column stack, a field view) and that batch
    is one array, whose flat row is its rows one after the other; elsewhere (flattened rows
    of a buffer under a window, several arrays promoted to one dtype) it raises
    NotDirect."""
    data, meta = root.specs()
    if getter in FLAT_GETTERS:
        view = getattr(root, "view", None)
        flattens = (isinstance(root, _SubItemNode) or (
            isinstance(root, _StackNode) and type(view) is _unienv.column_stack_class()))
        if not flattens or not isinstance(data, Spec):
            raise NotDirect("flattened batches of this view are not gathered directly "
                            "(only a column stack's or field view's single array)")
        data = data.flattened()
    elif getter not in GETTERS:
        raise NotDirect(f"{getter} is not a gathering method")
    return (data, meta) if getter.endswith("_with_metadata") else data


# -- the slot ---------------------------------------------------------------------------------

class ViewGatherer:
    """Lives in a worker: batches of a view, gathered into the slot (see
    `unienv_mp._direct.gather.Gatherer`, which hands view tasks to it)."""

    def __init__(self, root, sampler):
        self.root = root
        self.sampler = sampler
        self._plans = {}   # (getter, batch size, k) -> ViewLayout, or None: refused

    def __call__(self, getter, indices, k):
        """The batch of ``getter`` at each index tensor of ``indices`` (a tuple of them if
        ``k`` is not None) as a `SlotWriter`; where the direct path cannot serve it (an
        index outside the data, a plan refused), the generic getter's result for the same
        indices."""
        meta = getter.endswith("_with_metadata")
        n = int(indices[0].shape[0])
        key = (getter, n, k)
        plan = self._plans.get(key, False)
        try:
            if plan is None:
                raise NotDirect("refused before")
            values = [self.root.evaluate(idx, meta) for idx in indices]
            if plan is False:
                plan = self._plan(getter, indices[0], k)
        except Exception:
            # an index outside the data, a plan refused, anything the nodes trip on: the
            # generic getter on the same indices gives UniEnv's batch or raises its error
            fn = getattr(self.sampler, getter)
            out = [fn(idx) for idx in indices]
            return tuple(out) if k is not None else out[0]
        return PlannedBatch(plan, values if meta else [v[0] for v in values])

    def _plan(self, getter, idx, k):
        key = (getter, int(idx.shape[0]), k)
        # UniEnv's own answer for one element, from the view itself (what the sampler's
        # getter returns for a CPU sampler): the layout to follow
        reference = getattr(self.sampler.data, getter)(idx[:1].clone())
        try:
            plan = ViewLayout(reference, getter_specs(self.root, getter), key[1], k)
        except NotDirect:
            self._plans[key] = None
            raise
        self._plans[key] = plan
        return plan


def layout_check(root, sampler):
    """Raise NotDirect unless UniEnv's answers for one element (of each of
    `GETTERS`) are laid out as ``root`` plans them (when the data is empty there is nothing
    to ask: nothing is raised; the workers check again when they plan)."""
    torch = _torch()
    if root.length() <= 0:
        return
    for getter in GETTERS + FLAT_GETTERS:
        try:
            specs = getter_specs(root, getter)
        except NotDirect:
            continue   # (a flattened getter that takes the generic path)
        try:
            reference = getattr(sampler.data, getter)(torch.zeros(1, dtype=torch.int64))
        except Exception:
            # UniEnv cannot give element 0 (a view whose first index leaves its data,
            # say): not for this check to decide; the workers plan from a batch UniEnv
            # gives, and a batch it cannot give raises UniEnv's error there
            return
        ViewLayout(reference, specs, 1, None)


class ViewLayout:
    """The slot layout of a view's batch of ``n`` (or of a tuple of ``k``): the codec
    frame, laid out as UniEnv's ``reference`` answer is, and for every array, where it
    goes and which of the nodes' arrays fills it."""

    def __init__(self, reference, specs, n, k):
        torch = _torch()
        self.n = n
        fills = {}
        keep = []

        def template(ref, spec, path, b):
            if isinstance(ref, torch.Tensor):
                if type(ref) is not torch.Tensor or not isinstance(spec, Spec):
                    raise NotDirect(f"{_where(path)}: not an array the direct path plans")
                if ref.dtype != spec.dtype or tuple(ref.shape[1:]) != spec.shape:
                    raise NotDirect(f"{_where(path)}: UniEnv gives {ref.dtype}"
                                    f"{tuple(ref.shape[1:])}, planned {spec.dtype}"
                                    f"{spec.shape}")
                t = torch.empty((), dtype=spec.dtype).expand((n, *spec.shape))
                fills[id(t)] = (b, path, spec)
                keep.append(t)
                return t
            if type(ref) is dict:
                if not isinstance(spec, dict) or set(ref) != set(spec):
                    raise NotDirect(f"{_where(path)}: UniEnv's keys differ from the plan's")
                return {key: template(v, spec[key], path + (key,), b)
                        for key, v in ref.items()}
            if type(ref) is tuple:
                if not isinstance(spec, tuple) or len(ref) != len(spec):
                    raise NotDirect(f"{_where(path)}: UniEnv's tuple differs from the plan's")
                return tuple(template(v, s, path + (i,), b)
                             for i, (v, s) in enumerate(zip(ref, spec)))
            if ref is None and spec is None:
                return None
            raise NotDirect(f"{_where(path)}: a {qualname(ref)} in UniEnv's batch")

        if k is None:
            whole = template(reference, specs, (), 0)
        else:
            whole = tuple(template(reference, specs, (), b) for b in range(k))
        self.prepared = _codec.prepare(whole)
        self.nbytes = self.prepared.nbytes
        # (offset, nbytes, batch of the tuple, path in the batch, spec, rows)
        self.leaves = []
        for t, off, nbytes in self.prepared.array_layout():
            b, path, spec = fills[id(t)]
            self.leaves.append((off, nbytes, b, path, spec, n * spec.per_element))

    def views(self, buffer):
        """Each array's rows over ``buffer`` (a slot), after a memoryview of it that keeps
        the memory mapped while the views are kept (see
        `unienv_mp._direct.storages.FlatLayout.views`)."""
        torch = _torch()
        buffer = memoryview(buffer)
        out = [buffer]
        for off, nbytes, _, _, spec, rows in self.leaves:
            if nbytes == 0:
                out.append(None)
                continue
            count = nbytes // torch.empty((), dtype=spec.dtype).element_size()
            v = torch.frombuffer(buffer, dtype=spec.dtype, count=count, offset=off)
            out.append(v.view(rows, *spec.unit))
        return out

    def fill(self, buffer, views, values):
        """Copy every array's rows into the slot, from the nodes' parts (``values[b]``: the
        evaluated tree of batch ``b`` of the tuple)."""
        for (off, nbytes, b, path, spec, rows), out in zip(self.leaves, views[1:]):
            if out is None:
                continue
            parts = values[b]
            for key in path:
                parts = parts[key]
            for part in parts:
                src = part.source
                if src is None:
                    if part.pos is None:
                        out.copy_(part.data.reshape(out.shape))
                    else:
                        out.index_copy_(0, part.pos, part.data)
                elif src.table is not None:
                    if part.pos is None:
                        if part.data.shape[0] != rows:
                            raise NotDirect("a part that does not cover its array")
                        _rows.gather_rows(src.table, src.row_bytes, part.data.numpy(),
                                          buffer, off)
                    else:
                        _rows.scatter_rows(src.table, src.row_bytes, part.data.numpy(),
                                           _as_rows(part.pos).numpy(), buffer, off, rows)
                elif part.pos is None:
                    _torch().index_select(src.tensor, 0, part.data, out=out)
                else:
                    out.index_copy_(0, part.pos, src.tensor.index_select(0, part.data))


def _where(path):
    return "the batch" + "".join(f"[{k!r}]" for k in path)
