"""The plan of a ReplayBuffer's storages (`StoragePlanner`: which tensor each leaf of a
batch comes from, or which reader of a file-backed storage fills it (`.files`), a tree of
`Leaf`), and the slot layout of flat rows (`FlatLayout`).  The view planners (`.views`)
build on the storage planner they are handed."""
import sys

import numpy as np

from .._transport import codec as _codec
from . import files as _files
from . import rows as _rows
from . import unienv as _unienv
from .base import NotDirect, byte_rows, overridden, qualname

__all__ = ["Leaf", "StoragePlanner", "FlatLayout"]


class Leaf:
    """One array of the batch: ``(B, *tail)`` of ``dtype``, made of ``parts``: column
    ranges ``[a, b)`` of the output viewed as ``(B, -1)``, each filled with the rows of a
    2-D source ``(N, b - a)`` (or, for a single part, rows of an N-D source of the output's
    own shape); or, for a file-backed storage, filled by ``reader`` (a
    `unienv_mp._direct.files.Reader`), a numpy array of the numpy ``dtype``."""
    __slots__ = ("tail", "dtype", "parts", "direct", "columns", "reader")

    def __init__(self, tail, dtype, parts, columns=None, reader=None):
        self.tail = tuple(int(d) for d in tail)
        self.dtype = dtype
        self.parts = parts
        # (flat rows, a, b) for a leaf cut from columns [a, b) of a FlattenedStorage's rows
        self.columns = columns
        self.reader = reader
        # one source of the output's own row shape and dtype: index_select straight into
        # the output
        self.direct = (len(parts) == 1 and tuple(parts[0][0].shape[1:]) == self.tail
                       and parts[0][0].dtype == dtype)

    def element_nbytes(self):
        """Bytes per batch row."""
        return int(np.prod(self.tail, dtype=np.int64)) * _itemsize(self.dtype)


def _itemsize(dtype):
    if isinstance(dtype, np.dtype):
        return dtype.itemsize
    return sys.modules["torch"].empty((), dtype=dtype).element_size()


def _file_leaf(tail, dtype, reader):
    return Leaf(tail, dtype, [], reader=reader)


class StoragePlanner:
    """Reads a ReplayBuffer's storages: which tensor each leaf of a batch comes from, as
    flat rows of the buffer (`structure`), or for the view planners, which are handed this
    planner (`unienv_mp._direct.views`), a storage's rows (`rows`)."""

    def __init__(self, on_device=False, files=None):
        import torch
        self.torch = torch
        # (True: the sources may live on a GPU, for a gather in the calling process; see
        # unienv_mp._device.resident.  The workers take CPU rows only.)
        self.on_device = on_device
        # file-backed storages (`.files`): None, not planned (under a view, on a device);
        # "plan", planned from their spaces (the training process); "bind", their files
        # opened and checked too (a worker)
        self.files = files
        # where ``files`` is None: why, as the refusal of a file-backed storage says it
        self.files_refused = "for batches gathered on a device" if on_device else None

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
        if self.files is not None:
            tree = _files.plan(storage, _file_leaf, self.files == "bind")
            if tree is not None:
                return tree
        else:
            name = _files.file_storage(storage)
            if name is not None:
                raise NotDirect(f"its storage {name} reads files: the workers read "
                                f"them straight into the slot for a ReplayBuffer sampled "
                                f"as it is, not {self.files_refused or 'here'}")
        raise NotDirect(f"storage {qualname(storage)} is not one that keeps its rows in "
                        f"one in-memory tensor (PytorchTensorStorage, DictStorage or "
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
        if type(space) is BoxSpace or type(space) is BinarySpace:
            n = int(np.prod(space.shape, dtype=np.int64))
            a = col[0]
            col[0] += n
            dtype = space.dtype
            if dtype is None and type(space) is BinarySpace:
                # (unflatten_data casts to the backend's default boolean dtype)
                dtype = space.backend.default_boolean_dtype
            if not isinstance(dtype, self.torch.dtype):
                raise NotDirect(f"a space whose dtype {dtype!r} is not a torch dtype")
            return Leaf(space.shape, dtype, [(flat[:, a:a + n], 0, n)], (flat, a, a + n))
        if type(space) is DictSpace:
            return {k: self._unflatten(sub, flat, col)
                    for k, sub in _unienv.dict_items(space)}
        if type(space) is TupleSpace:
            return tuple(self._unflatten(sub, flat, col) for sub in space.spaces)
        raise NotDirect(f"flattened {type(space).__name__} leaves")

    def _flatten(self, space, tree, parts, col):
        """Mirror of UniEnv's ``flatten_data(space, tree, start_dim=1)``: append to
        ``parts`` the 2-D source of each column range of the flat rows."""
        from unienv_interface.space import BoxSpace, DictSpace, TupleSpace
        if type(space) is BoxSpace:
            # (a batched space: its first dimension is the batch's)
            if not isinstance(tree, Leaf) or tree.tail != tuple(space.shape[1:]):
                raise NotDirect("a leaf whose shape differs from its space")
            if tree.reader is not None:
                raise NotDirect("flattening the rows of a file-backed storage")
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

    def structure(self, rb, getter):
        """The tree of Leaf (and None) that ``<getter>(idx)`` returns over the
        ReplayBuffer ``rb``."""
        storage = rb.storage
        if getter in ("get_at", "get_at_with_metadata"):
            tree = self.rows(storage)
        elif getter in ("get_flattened_at", "get_flattened_at_with_metadata"):
            tree = self.flat(storage, rb)
        else:
            raise NotDirect(f"{getter} is not a gathering method")
        if getter.endswith("_with_metadata"):
            tree = (tree, None)
        return tree

    def flat(self, storage, rb):
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
            space = _unienv.batched_space(rb)
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


class FlatLayout:
    """The slot layout of flat rows: of one batch structure (a tree of `Leaf`) at one batch
    size ``n`` -- or of a tuple of ``k`` such batches -- : the codec frame, and for every
    array, where it goes, which batch of the tuple it belongs to, and what fills it."""

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
                # shapes and dtypes from it, never its data (a numpy array for a leaf
                # of a file-backed storage, which returns numpy arrays)
                if node.reader is not None:
                    t = np.broadcast_to(np.empty((), dtype=node.dtype), (n, *node.tail))
                else:
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
        # leaf index -> (byte rows of the flat rows, item bytes, items per row, first
        # column): a uint8 leaf of float flat rows, gathered and cast in one pass
        self.casts = {}
        for t, off, nbytes in self.prepared.array_layout():
            b, leaf = fills[id(t)]
            table = byte_rows(leaf.parts[0][0]) if leaf.direct and nbytes else None
            if nbytes and leaf.columns is not None and leaf.dtype == torch.uint8:
                flat, a, _ = leaf.columns
                if flat.dtype in (torch.float32, torch.float64):
                    rows_table = byte_rows(flat)
                    if rows_table is not None:
                        self.casts[len(self.leaves)] = (rows_table, flat.element_size(),
                                                        int(flat.shape[1]), a)
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
            if leaf.reader is not None:
                count = nbytes // leaf.dtype.itemsize
                out.append(np.frombuffer(buffer, dtype=leaf.dtype, count=count,
                                         offset=off).reshape(self.n, *leaf.tail))
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
            if table is not None or leaf.reader is not None:
                if rows_np is None:
                    rows_np = _rows_np(rows, torch)
                if table is not None:
                    _rows.gather_rows(table, row_bytes, rows_np, buffer, off)
                elif nbytes:
                    if gathered is None:
                        gathered = {}
                    leaf.reader.fill(rows_np, buffer, off, views[i + 1], gathered)
                continue
            out = views[i + 1]
            if out is None:
                continue
            if leaf.direct:
                torch.index_select(leaf.parts[0][0], 0, rows, out=out)
                continue
            cast = self.casts.get(i)
            if cast is not None:
                # a uint8 leaf (an image) of float flat rows: each row's columns read and
                # cast in one pass, where C defines the cast of every value (all of them
                # in (-1, 256), where torch's cast gives the same bytes); otherwise
                # (NaN, out of range) torch casts them below, as UniEnv does
                if rows_np is None:
                    rows_np = _rows_np(rows, torch)
                table, item, width, a = cast
                if _rows.gather_cast_u8(table, item, width, a, nbytes // self.n, rows_np,
                                        buffer, off):
                    continue
            if leaf.columns is not None and leaf.dtype != leaf.parts[0][0].dtype:
                # UniEnv's unflatten_data casts a (strided) column slice of the gathered
                # flat rows; torch may round a cast from a strided source differently
                # (NaN payloads) than from a contiguous one, so cast from the same slice:
                # of a scratch of whole flat rows, into which only this leaf's columns
                # are gathered (the others need not be read)
                flat, a, b = leaf.columns
                full = self.scratch.get(id(flat))
                if full is None:
                    full = self.scratch[id(flat)] = torch.empty(
                        (self.n, flat.shape[1]), dtype=flat.dtype)
                torch.index_select(leaf.parts[0][0], 0, rows, out=full[:, a:b])
                out.view(self.n, *leaf.tail).copy_(full[:, a:b].reshape(self.n, *leaf.tail))
                continue
            for j, (src, a, b) in enumerate(leaf.parts):
                if src.dtype == leaf.dtype and len(leaf.parts) == 1:
                    torch.index_select(src, 0, rows, out=out)
                    continue
                tmp = self.scratch.get((i, j))
                if tmp is None:
                    tmp = self.scratch[(i, j)] = torch.empty((self.n, b - a),
                                                             dtype=src.dtype)
                torch.index_select(src, 0, rows, out=tmp)
                out[:, a:b].copy_(tmp)



def _rows_np(rows, torch):
    """Storage rows (a tensor, or a numpy array over a buffer of the numpy backend) as a
    contiguous int64 numpy array."""
    if type(rows) is np.ndarray:
        return np.ascontiguousarray(rows, dtype=np.int64)
    if rows.dtype != torch.int64 or not rows.is_contiguous():
        rows = rows.to(torch.int64).contiguous()
    return rows.numpy()
