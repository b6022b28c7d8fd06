"""Every use of UniEnv's private names, in one place.

The direct gather (`unienv_mp._direct.gather`, `unienv_mp._direct.views`) reproduces what
UniEnv's batches compute, so it reads some of their internals: a ReplayBuffer's ring state,
the batched spaces UniEnv caches, a stack's anchor position, the functions behind UniEnv's
valid-mask helpers, the column-stack class, an HDF5 storage's datasets and the base class
of UniEnv's storages of a file per row.  They are private to UniEnv and may change in
any release (``pyproject.toml`` pins the one release this package is written for), so they
are read here only, each through one small function, and nowhere else in the package.
"""
import os

__all__ = ["ring_state", "same_ring", "logical_to_physical", "batched_space", "instance_space",
           "dict_items", "stack_anchor", "stack_mask_key", "column_stack_class", "mask_helpers",
           "cache_attributes", "SHARED_BUFFER_LIVE", "SHARED_BUFFER_LOCAL", "storage_class",
           "list_storage_class", "hdf5_leaves", "hdf5_fd", "read_sorted_unique_rows",
           "map_io", "io_threads", "hdf5_file", "row_files", "episode_files", "parquet_files", "parquet_read_only",
           "parquet_column", "parquet_piece_rows", "parquet_piece_table",
           "parquet_piece_values", "PARQUET_READS", "memmap_readonly"]


def ring_state(rb):
    """A ReplayBuffer's ``(count, offset)``, read once as UniEnv reads them (one snapshot
    of its shared ring state), or None if the buffer keeps no ring state."""
    ring = getattr(rb, "_ring_state", None)
    return None if ring is None else ring.read()


def same_ring(a, b):
    """Whether two ReplayBuffers share one ring state (a buffer and its column views do):
    one snapshot of it maps both."""
    ring = getattr(a, "_ring_state", None)
    return ring is not None and ring is getattr(b, "_ring_state", None)


def logical_to_physical(rb, idx):
    """The ReplayBuffer's own mapping of logical indices to storage rows, bounds checks
    included."""
    return rb._logical_to_physical_index(idx)


def batched_space(obj):
    """The batched space UniEnv caches on a batch (``_batched_space``)."""
    return obj._batched_space


def instance_space(storage):
    """A DictStorage's batched instance space (``_batched_instance_space``)."""
    return storage._batched_instance_space


def dict_items(space):
    """UniEnv's own key order of a DictSpace when it flattens one (sorted, or insertion
    order if the keys do not sort)."""
    from unienv_interface.space.space_utils.flatten_utils import _dict_items
    return _dict_items(space)


def stack_anchor(view):
    """The position of offset 0 in a SliceStackedBatch's window (``_idx_zero``)."""
    return int(view._idx_zero)


def stack_mask_key(view):
    """What a SliceStackedBatch's valid mask reads: ``None`` without a mask function;
    ``("episode_id", key)`` or ``("episode_end", key)`` for UniEnv's own helpers
    (``get_valid_mask_function_with_episodeid_key`` / ``..._with_episode_end_key``) on a
    data key; otherwise a string saying why the mask cannot be reproduced (a custom
    function, or a key read from metadata)."""
    from unienv_data.batches.slicestack_batch import SliceStackedBatch
    fn = view.get_valid_mask_function
    if fn is None:
        return None
    func = getattr(fn, "func", None)
    keywords = getattr(fn, "keywords", None) or {}
    if func is SliceStackedBatch._valid_mask_function_episodeid_key:
        kind, name = "episode_id", "episode_id_key"
    elif func is SliceStackedBatch._valid_mask_function_episode_end_key:
        kind, name = "episode_end", "episode_end_key"
    else:
        return "a custom valid mask function"
    if getattr(fn, "args", ()) or set(keywords) - {name, "is_in_metadata"}:
        return "a valid mask helper called with extra arguments"
    if keywords.get("is_in_metadata", False):
        return "a valid mask read from metadata"
    if name not in keywords:
        return "a valid mask helper without its key"
    return (kind, keywords[name])


def column_stack_class():
    """UniEnv's ``_ColumnSliceStackedBatch``: what ``SliceStackedBatch.get_column``
    returns, whose valid mask reads a separate episode column (``mask_batch``)."""
    from unienv_data.batches.slicestack_batch import _ColumnSliceStackedBatch
    return _ColumnSliceStackedBatch


def mask_helpers():
    """The functions behind UniEnv's valid-mask helpers (what
    ``get_valid_mask_function_with_episodeid_key`` and ``..._with_episode_end_key`` wrap
    in a ``functools.partial``): they read nothing but their arguments."""
    from unienv_data.batches.slicestack_batch import SliceStackedBatch
    return (SliceStackedBatch._valid_mask_function_episodeid_key,
            SliceStackedBatch._valid_mask_function_episode_end_key)


def cache_attributes(cls):
    """The attributes of UniEnv's class ``cls`` that hold no data, only what its methods
    cache or run with: a CombinedBatch's thread pool (and the pid that made it) and its
    memo of batched spaces, which its reads check before use."""
    from unienv_data.batches.combined_batch import CombinedBatch
    if cls is CombinedBatch:
        return frozenset(("_executor", "_executor_pid", "_batch_space_cache"))
    return _FILE_CACHES.get(cls.__name__, frozenset())


#: What UniEnv's file-backed storages only cache, or hold open, besides their files (whose
#: identities the fingerprint records instead; `unienv_mp._sampling.files`): an HDF5
#: storage's open handle and its datasets, a video storage's decoders and its index of
#: files and keyframes (rebuilt from its list of files), a read-only parquet storage's
#: memory-mapped tables.
_FILE_CACHES = {
    "HDF5Storage": frozenset(("root", "_leaves")),
    "VideoStorage": frozenset(("_decoder_cache", "_keyframe_cache", "_cache_index_starts",
                               "_cache_index_ranges")),
    "ParquetStorage": frozenset(("_cached_piece_tables",)),
}


#: A ReplayBuffer made with ``multiprocessing=True``: the attributes that every process
#: reads as they are now (its ring state, shared between processes, and its lock) ...
SHARED_BUFFER_LIVE = frozenset(("_ring_state", "_lock"))
#: ... and those each process keeps for itself, which no read uses (the bookkeeping of
#: the episodes' segments that ``extend`` updates).
SHARED_BUFFER_LOCAL = frozenset(("_physical_segments", "_active_segment_start_physical",
                                 "_active_segment_length"))


#: UniEnv's file-backed storages, by class name: the module each lives in (each needs its
#: own library: h5py, Pillow, PyAV, pyarrow).
_STORAGE_MODULES = {
    "HDF5Storage": "unienv_data.storages.hdf5",
    "ImageStorage": "unienv_data.storages.image_storage",
    "NPZStorage": "unienv_data.storages.npz_storage",
    "VideoStorage": "unienv_data.storages.video_storage",
    "ParquetStorage": "unienv_data.storages.parquet",
}


def storage_class(name):
    """UniEnv's file-backed storage class ``name`` (one of ``_STORAGE_MODULES``), or None
    where its module is not imported: a storage of that class can only exist once it is,
    so it is not imported here (which would import h5py, PyAV or pyarrow for nothing)."""
    import sys
    module = sys.modules.get(_STORAGE_MODULES[name])
    return None if module is None else getattr(module, name, None)


def list_storage_class():
    """UniEnv's ``ListStorageBase`` (a storage of a file per row, read by
    ``get_single``), or a class nothing is an instance of where its module is not
    imported."""
    import sys
    module = sys.modules.get("unienv_data.storages._list_storage")
    return getattr(module, "ListStorageBase", _Nothing)


class _Nothing:
    """(a class with no instances)"""


def hdf5_leaves(storage):
    """An ``HDF5Storage``'s ``(key path, space, h5py dataset)`` of every leaf, opening its
    file where it is closed (``_get_leaves``)."""
    return storage._get_leaves()


def hdf5_fd(dataset):
    """The file descriptor HDF5 reads ``dataset``'s file through (its sec2 driver's)."""
    return int(dataset.file.id.get_vfd_handle())


def read_sorted_unique_rows(dataset, index):
    """UniEnv's reader of an HDF5 dataset's rows at sorted, distinct ``index`` (what
    ``HDF5Storage.get`` reads them with)."""
    from unienv_data.storages.hdf5 import read_sorted_unique_rows as read
    return read(dataset, index)


def hdf5_file(storage):
    """An ``HDF5Storage``'s open handle (None where it opens its file when it first reads)
    and the path of its file."""
    return storage.root, storage._filename


def row_files(storage):
    """The files an ``ImageStorage`` or ``NPZStorage`` reads its rows from, one per row, as
    its ``get_single`` names them."""
    return [os.path.join(storage._cache_path, f"{i}.{storage.file_ext}")
            for i in range(len(storage))]


def episode_files(storage):
    """The files a ``VideoStorage`` reads, one per episode; None while it has a segment
    open (frames held in its writer)."""
    if storage.has_open_segment:
        return None
    return [name for _, _, name in storage.get_start_end_filename_iter()]


def parquet_files(storage):
    """The piece files a read-only ``ParquetStorage`` reads, and its metadata; None for a
    writable one, which keeps the pieces written through it in memory until it flushes
    them."""
    if not storage._read_only:
        return None
    return ([storage._piece_path(i) for i in range(storage._num_pieces)]
            + [os.path.join(storage._storage_dir, "_metadata.json")])


def parquet_read_only(storage):
    """Whether a ``ParquetStorage`` was loaded read-only (its ``get`` then takes rows from
    each piece's Arrow table, which it keeps, not from pieces it may have changed)."""
    return bool(storage._read_only)


def parquet_column(storage, path):
    """The column of a ``ParquetStorage`` that the leaf at ``path`` of its ``get`` comes
    from: the key of a flat DictSpace, or its one column (``DEFAULT_KEY``)."""
    return path[0] if path else storage.DEFAULT_KEY


def parquet_piece_rows(storage, rows):
    """A ``ParquetStorage``'s own mapping of rows to pieces, bounds checks included
    (``_index_to_piece_mapping``): ``{piece: (rows in the piece, positions in the
    batch)}``."""
    return storage._index_to_piece_mapping(rows)


def parquet_piece_table(storage, piece):
    """The Arrow table of one piece that a read-only ``ParquetStorage``'s ``get`` takes
    rows from, read and kept by the storage when first asked for
    (``_load_piece_table``)."""
    return storage._load_piece_table(piece)


def parquet_piece_values(storage, piece, column, local, dtype, shape):
    """What a read-only ``ParquetStorage``'s ``get`` takes from one column of one piece
    for the rows ``local`` of the piece (``_read_only_piece_column_values``)."""
    return storage._read_only_piece_column_values(piece, column, local, dtype, shape)


#: What a read-only ``ParquetStorage``'s ``get`` reads through (`files.PieceRows` reads
#: the same tables, so a subclass that overrides one of them is read by its ``get``).
PARQUET_READS = ("get", "_index_to_piece_mapping", "_load_piece_table",
                 "_read_only_piece_column_values")


def memmap_readonly(tensor):
    """Whether UniEnv's ``MemoryMappedTensor`` ``tensor`` maps its file privately (loaded
    read-only: what this process writes into it stays in this process)."""
    return bool(getattr(tensor, "_readonly", False))


def map_io(fn, items):
    """UniEnv's ``map_io``: ``fn`` over ``items`` on its process-wide pool of I/O threads,
    as its storages of a file per row decode a batch."""
    from unienv_data.storages._io_pool import map_io as run
    return run(fn, items)


def io_threads(n=None):
    """The threads of UniEnv's pool of I/O threads (``IO_POOL_WORKERS``), set to ``n``
    first if given (it takes effect for pools made after; at one, batches are read in the
    calling thread)."""
    from unienv_data.storages import _io_pool
    if n is not None:
        _io_pool.IO_POOL_WORKERS = n
    return _io_pool.IO_POOL_WORKERS
