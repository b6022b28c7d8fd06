"""The direct gather over UniEnv's file-backed storages: what each leaf of a batch reads,
straight into its place in the slot.

Each storage is read the way its own ``get`` reads it, or by a reader that gives the same
bytes, and every array is written into the slot once:

* `Pread`: an ``HDF5Storage`` dataset stored contiguously, unfiltered, of a plain numeric
  dtype in this machine's byte order, in a file opened read-only: its rows lie in the file
  one after the other, so a worker reads each row from the file into its place in the slot
  (``csrc/umr_pread.c``: sorted, coalesced, no intermediate array).
* `H5Rows`: any other numeric HDF5 dataset (chunked, compressed, or in a file opened for
  writing, whose newest rows HDF5 may still hold in its caches): UniEnv's own reader of the
  sorted, distinct rows (``read_sorted_unique_rows``, as ``HDF5Storage.get`` reads them),
  then the rows copied into batch order in the slot.
* `PerRow`: ``ImageStorage`` and ``NPZStorage`` (a file per row): each row decoded by the
  storage's own ``get_single``, in batch order, and copied into its place (no batch of
  decoded rows is put together first).
* `PieceRows`: a ``ParquetStorage`` loaded read-only: each column's rows copied from the
  Arrow table of their piece that the storage's ``get`` takes them from (the storage reads
  and keeps each piece's table when first asked for it) straight into their places in the
  slot, one copy per row, no batch put together first.  A piece whose column is not one
  plain array of rows of the leaf's dtype (several chunks, nulls, another type) is read
  by the storage's own reader of that piece's column, as its ``get`` reads it.
* `OwnRead`: ``VideoStorage`` and a writable ``ParquetStorage``: the storage's own
  ``get`` for the batch's rows, its arrays copied into the slot.

Each storage's structure (the shape and dtype of every array) comes from its space, so that
the training process plans a batch without opening a file; a worker binds the readers to its
own copy of the storage (`bind`), opening the files and checking that they hold what the
space says, before it draws a batch's indices (where they do not, the worker takes the
generic path).  A row that a decoder gives in another shape or dtype than the space's
raises (the generic path would hand out a batch of another shape): ``direct_gather=False``
gives UniEnv's batch then.
"""
import numpy as np

from . import rows as _rows
from . import unienv as _unienv
from .base import NotDirect, overridden, qualname

__all__ = ["plan", "file_storage", "Reader", "Pread", "H5Rows", "PerRow", "PieceRows",
           "OwnRead"]


def _no_override(storage, base, names):
    name = overridden(storage, base, names)
    if name is not None:
        raise NotDirect(f"{qualname(storage)} overrides {name}()")


def _leaf_type(space, where):
    """``(row shape, numpy dtype)`` of a BoxSpace or BinarySpace leaf of the numpy
    backend, as its storage returns it; NotDirect for anything else."""
    from unienv_interface.space import BinarySpace, BoxSpace
    if type(space) is BoxSpace:
        dtype = space.dtype
    elif type(space) is BinarySpace:
        dtype = space.dtype if space.dtype is not None else np.bool_
    else:
        raise NotDirect(f"{where} holds {type(space).__name__} leaves")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise NotDirect(f"{where} holds a leaf whose dtype {dtype!r} is not numpy's") \
            from None
    if dtype.kind not in "biuf" or not dtype.isnative:
        raise NotDirect(f"{where} holds a leaf of dtype {dtype}")
    return tuple(int(d) for d in space.shape), dtype


class Reader:
    """What fills the leaves of one storage.  ``bind()`` (in a worker) opens what the
    reads need; ``fill(rows, buffer, off, view, memo)`` writes the leaf at ``path`` of the
    batch of storage rows ``rows`` (a contiguous int64 numpy array, in batch order) into
    bytes ``off`` onwards of ``buffer``, or into ``view`` (a numpy view of them); ``memo``
    lives for one batch, for readers that read every leaf at once."""
    bound = False

    def bind(self):
        self.bound = True


def _copy_into(view, value, what):
    """Copy ``value`` (an array a storage returned) into ``view``: the same shape and
    dtype, or a ValueError that says what differs."""
    if not isinstance(value, np.ndarray) or value.shape != view.shape \
            or value.dtype != view.dtype:
        got = (f"a {type(value).__name__}" if not isinstance(value, np.ndarray)
               else f"shape {value.shape} of {value.dtype}")
        raise ValueError(
            f"{what} gave {got}, not the shape {view.shape} of {view.dtype} its space "
            f"says: the direct gather cannot write it into the slot (direct_gather=False "
            f"gives UniEnv's batch)")
    np.copyto(view, value, casting="no")


class Pread(Reader):
    """Rows of a contiguous HDF5 dataset, read from the file into the slot."""

    def __init__(self, dataset, row_bytes):
        self.dataset = dataset   # (keeps the file open)
        self.fd = _unienv.hdf5_fd(dataset)
        self.base = int(dataset.id.get_offset())
        self.row_bytes = row_bytes
        self.n_rows = int(dataset.shape[0])
        self.bound = True

    def fill(self, rows, buffer, off, view, memo):
        _rows.pread_rows(self.fd, self.base, self.row_bytes, self.n_rows, rows, buffer, off)


class H5Rows(Reader):
    """Rows of any numeric HDF5 dataset, read as ``HDF5Storage.get`` reads them (sorted,
    distinct), then copied into batch order."""

    def __init__(self, dataset, row_bytes):
        self.dataset = dataset
        self.row_bytes = row_bytes
        self.bound = True

    def fill(self, rows, buffer, off, view, memo):
        unique, inverse = np.unique(rows, return_inverse=True)
        table = _unienv.read_sorted_unique_rows(self.dataset, unique)
        table = np.ascontiguousarray(table)
        _rows.gather_rows(table.reshape(-1).view(np.uint8), self.row_bytes,
                          inverse.astype(np.int64, copy=False), buffer, off)


def _contiguous(dataset, row_bytes):
    """Whether ``dataset``'s rows lie in its file one after the other, with nothing
    between the file and the bytes (see `Pread`)."""
    try:
        import h5py
        plist = dataset.id.get_create_plist()
        if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters() \
                or plist.get_external_count():
            return False
        if dataset.file.mode != "r" or dataset.file.driver != "sec2":
            return False
        if dataset.id.get_offset() is None:   # (never written: HDF5 reads its fill value)
            return False
        return _unienv.hdf5_fd(dataset) >= 0 and row_bytes > 0
    except Exception:
        return False


class _H5Leaf(Reader):
    """A leaf of an ``HDF5Storage``: `Pread` or `H5Rows`, chosen when bound."""

    def __init__(self, storage, path, tail, dtype):
        self.storage = storage
        self.path = path
        self.tail = tail
        self.dtype = dtype
        self.inner = None

    def bind(self):
        leaves = {p: d for p, _, d in _unienv.hdf5_leaves(self.storage)}
        dataset = leaves.get(self.path)
        if dataset is None:
            raise NotDirect(f"the HDF5 file has no dataset for {'/'.join(self.path)}")
        if dataset.dtype != self.dtype or tuple(dataset.shape[1:]) != self.tail:
            raise NotDirect(f"the HDF5 dataset {dataset.name} holds rows of "
                            f"{tuple(dataset.shape[1:])} {dataset.dtype}, not the "
                            f"{self.tail} {self.dtype} of its space")
        row_bytes = int(np.prod(self.tail, dtype=np.int64)) * self.dtype.itemsize
        cls = Pread if _contiguous(dataset, row_bytes) else H5Rows
        self.inner = cls(dataset, row_bytes)
        self.bound = True

    def fill(self, rows, buffer, off, view, memo):
        self.inner.fill(rows, buffer, off, view, memo)


class PerRow(Reader):
    """A storage of a file per row: each row decoded by its own ``get_single`` into its
    place, on UniEnv's pool of I/O threads as its ``get`` decodes them (its decoders let
    go of the GIL)."""

    def __init__(self, storage):
        self.storage = storage

    def fill(self, rows, buffer, off, view, memo):
        get_single = self.storage.get_single
        what = type(self.storage).__name__

        def one(job):
            i, row = job
            _copy_into(view[i], get_single(row), f"{what} row {row}")
        _unienv.map_io(one, list(enumerate(rows.tolist())))


class PieceRows(Reader):
    """One column of a read-only ``ParquetStorage``: the batch's rows mapped to pieces as
    its ``get`` maps them (once per batch for all its leaves: ``memo``), then each piece's
    rows copied from the piece's Arrow table, the one its ``get`` takes them from, into
    their places in the slot.  Where a piece's column is not one chunk of rows of the
    leaf's dtype without nulls, that piece's rows are the storage's own read of them,
    assigned to their places as its ``get`` assigns them (the same numpy assignment,
    casts included)."""

    def __init__(self, storage, path, tail, dtype):
        self.storage = storage
        self.column = _unienv.parquet_column(storage, path)
        self.tail = tail
        self.dtype = dtype
        self.row_bytes = int(np.prod(tail, dtype=np.int64)) * dtype.itemsize
        # piece -> (the storage's table of it, its rows as a 2-D uint8 array or None):
        # kept while the storage keeps handing out the same table
        self._pieces = {}

    def _rows_of(self, piece):
        table = _unienv.parquet_piece_table(self.storage, piece)
        kept = self._pieces.get(piece)
        if kept is not None and kept[0] is table:
            return kept[1]
        rows = _piece_rows(table, self.column, self.tail, self.dtype, self.row_bytes)
        self._pieces[piece] = (table, rows)
        return rows

    def fill(self, rows, buffer, off, view, memo):
        key = ("pieces", id(self.storage))
        mapping = memo.get(key)
        if mapping is None:
            mapping = memo[key] = [
                (int(piece), np.ascontiguousarray(local, dtype=np.int64),
                 np.ascontiguousarray(positions, dtype=np.int64))
                for piece, (local, positions)
                in _unienv.parquet_piece_rows(self.storage, rows).items()]
        n = int(rows.shape[0])
        for piece, local, positions in mapping:
            table = self._rows_of(piece)
            if table is not None:
                _rows.scatter_rows(table, self.row_bytes, local, positions, buffer, off, n)
            else:
                view[positions] = _unienv.parquet_piece_values(
                    self.storage, piece, self.column, local, self.dtype, self.tail)


def _piece_rows(table, column, tail, dtype, row_bytes):
    """The rows of ``column`` of one piece's Arrow ``table`` as a 2-D uint8 array (one row
    of ``row_bytes`` per storage row, sharing the table's memory where Arrow can give it),
    holding what ``ParquetStorage._read_only_piece_column_values`` gives for those rows;
    None where it is not one chunk of such rows (several chunks, nulls, another type or
    row size): the storage's own reader reads that piece."""
    import pyarrow as pa
    if row_bytes <= 0 or column not in table.column_names:
        return None
    chunked = table.column(column)
    if chunked.num_chunks != 1:
        return None
    chunk = chunked.chunk(0)
    if chunk.null_count:
        return None
    if pa.types.is_fixed_size_list(chunk.type):
        # (``get`` reshapes the taken rows' values to (rows, *tail): a row is the list's
        # values in order)
        if not tail or chunk.type.list_size != int(np.prod(tail, dtype=np.int64)):
            return None
        values = chunk.flatten()   # (the list values of this chunk's rows, offset applied)
    elif tail or pa.types.is_nested(chunk.type):
        return None
    else:
        values = chunk
    if values.null_count:
        return None
    try:
        flat = values.to_numpy(zero_copy_only=False)
    except (pa.ArrowException, NotImplementedError, TypeError, ValueError):
        return None
    if flat.dtype != dtype or flat.ndim != 1 or flat.size != len(chunk) * (
            row_bytes // dtype.itemsize):
        return None
    return np.ascontiguousarray(flat).view(np.uint8).reshape(len(chunk), row_bytes)


class OwnRead(Reader):
    """The storage's own ``get`` of a batch's rows, each of its arrays copied into the
    slot; read once per batch for all its leaves (``memo``)."""

    def __init__(self, storage, path):
        self.storage = storage
        self.path = path

    def fill(self, rows, buffer, off, view, memo):
        key = id(self.storage)
        value = memo.get(key)
        if value is None:
            value = memo[key] = self.storage.get(rows)
        for k in self.path:
            value = value[k]
        _copy_into(view, value, f"{type(self.storage).__name__}.get")


def _tree(space, where, make, path=()):
    """The tree of leaves of ``space`` (a DictSpace nested as the storage's ``get``
    nests its result, in the space's key order, or one leaf), each ``make(path, tail,
    dtype)``."""
    from unienv_interface.space import DictSpace
    if type(space) is DictSpace:
        if not space.spaces:
            raise NotDirect(f"{where} holds no arrays")
        return {k: _tree(sub, where, make, path + (k,)) for k, sub in space.spaces.items()}
    tail, dtype = _leaf_type(space, where)
    return make(path, tail, dtype)


def plan(storage, leaf, bind):
    """The tree of leaves (``leaf(tail, dtype, reader)``) that ``storage.get(rows)``
    returns, if ``storage`` is one of UniEnv's file-backed storages, else None; raises
    NotDirect where it is one whose batches this module does not read.  ``bind``: open the
    files and check them (in a worker)."""
    HDF5Storage = _unienv.storage_class("HDF5Storage")
    name = type(storage).__name__
    if HDF5Storage is not None and isinstance(storage, HDF5Storage):
        _no_override(storage, HDF5Storage, ("get", "_read_leaf", "_get_leaves"))

        def make(path, tail, dtype):
            return leaf(tail, dtype, _H5Leaf(storage, path, tail, dtype))
        tree = _tree(storage.single_instance_space, name, make)
    elif isinstance(storage, _unienv.list_storage_class()):
        cls = _known(storage, ("ImageStorage", "NPZStorage"))
        if cls is None:
            return None
        _no_override(storage, cls, ("get", "get_single", "get_from_file"))
        space = storage.single_instance_space
        if getattr(space, "dtype", None) is None:
            raise NotDirect(f"{name} over a space with no dtype (rows come in the file's)")
        tail, dtype = _leaf_type(space, name)
        tree = leaf(tail, dtype, PerRow(storage))
    else:
        cls = _known(storage, ("VideoStorage", "ParquetStorage"))
        if cls is None:
            return None
        _no_override(storage, cls, ("get",))
        if getattr(storage, "has_open_segment", False):
            raise NotDirect(f"{name} has a segment open")
        if (cls.__name__ == "ParquetStorage" and _unienv.parquet_read_only(storage)
                and overridden(storage, cls, _unienv.PARQUET_READS) is None):
            def make(path, tail, dtype):
                return leaf(tail, dtype, PieceRows(storage, path, tail, dtype))
        else:
            def make(path, tail, dtype):
                return leaf(tail, dtype, OwnRead(storage, path))
        tree = _tree(storage.single_instance_space, name, make)
    if bind:
        _bind(tree)
    return tree


def file_storage(storage):
    """The name of UniEnv's file-backed storage class that ``storage`` is an instance of
    (``"HDF5Storage"``, ...), or None."""
    HDF5Storage = _unienv.storage_class("HDF5Storage")
    if HDF5Storage is not None and isinstance(storage, HDF5Storage):
        return "HDF5Storage"
    cls = _known(storage, ("ImageStorage", "NPZStorage", "VideoStorage", "ParquetStorage"))
    return None if cls is None else cls.__name__


def _known(storage, names):
    """The class of UniEnv's named ``names`` that ``storage`` is an instance of, or None
    (also when its module cannot be imported: its library is missing)."""
    for name in names:
        cls = _unienv.storage_class(name)
        if cls is not None and isinstance(storage, cls):
            return cls
    return None


def _bind(tree):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif not node.reader.bound:
            node.reader.bind()
