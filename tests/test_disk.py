"""Data on disk: every file-backed storage of UniEnv gathered directly by the workers is
exact, bit for bit, against the generic path (the wrapped sampler called in the worker) and
against the file (the buffer read in this process, and for HDF5 h5py itself), under fork
and spawn.  Each kind of buffer is skipped, saying why, where its library is missing (the
`disk` extra brings them all)."""
import multiprocessing as mp
import os

import numpy as np
import pytest
from unienv_data.samplers import StepSampler

from _disk_data import KINDS, build, close, missing, same_batch, step_ids
from unienv_mp import MultiprocessingSampler
from unienv_mp._direct import gather as _gather

B = 16


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """One buffer of each kind, built once for the module (lazily)."""
    root = tmp_path_factory.mktemp("disk")
    made = {}

    def get(kind):
        lib = missing(kind)
        if lib is not None:
            pytest.skip(f"{kind} needs {lib}: pip install -e '.[disk]'")
        if kind not in made:
            made[kind] = build(kind, str(root))
        return made[kind]
    yield get
    for rb in made.values():
        close(rb)


def _draws(rb, ctx=None, direct=None, n_workers=2):
    """What a sampler over ``rb`` hands out: a few sample*() batches, then a whole
    epoch."""
    ms = MultiprocessingSampler(StepSampler(rb, batch_size=B, seed=3), n_workers=n_workers,
                                ctx=ctx, direct_gather=direct)
    with ms:
        out = [ms.sample() for _ in range(3)]
        out.append(ms.sample_with_metadata())
        out.append(ms.sample_index())
        epoch = list(ms.epoch_iter())
        path = ms.gather_path, ms.gather_path_reason
    return out, epoch, path


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_gathered_directly(disk, kind):
    rb = disk(kind)
    assert _gather.why_not(StepSampler(rb, batch_size=B)) is None


@pytest.mark.parametrize("kind", KINDS)
def test_direct_is_the_generic_path_and_the_file_bit_for_bit(disk, kind):
    """Under fork: the same sample*() stream and epoch, direct and generic; the epoch's
    batches are what UniEnv's StepSampler reads from the file in this process."""
    rb = disk(kind)
    fork = mp.get_context("fork")
    direct, direct_epoch, path = _draws(rb, fork, None)
    assert path == ("direct", None)
    generic, generic_epoch, path = _draws(rb, fork, False)
    assert path[0] == "generic"
    assert all(same_batch(a, b) for a, b in zip(direct, generic))
    assert len(direct_epoch) == len(generic_epoch) == -(-len(rb) // B)
    assert all(same_batch(a, b) for a, b in zip(direct_epoch, generic_epoch))
    in_process = list(StepSampler(rb, batch_size=B, seed=3).epoch_iter())
    assert all(same_batch(a, b) for a, b in zip(direct_epoch, in_process))
    seen = sorted(i for b in direct_epoch for i in step_ids(b))
    assert seen == list(range(len(rb)))


@pytest.mark.parametrize("kind", ["hdf5", "hdf5-gzip", "images", "video", "parquet"])
def test_spawned_workers_read_the_same_bits(disk, kind):
    """Under spawn (the storage pickled, its files opened again in each worker): the
    direct batches are the generic ones, and the epoch is the file as read here."""
    rb = disk(kind)
    spawn = mp.get_context("spawn")
    direct, direct_epoch, path = _draws(rb, spawn, True, n_workers=2)
    assert path == ("direct", None)
    generic, generic_epoch, _ = _draws(rb, mp.get_context("fork"), False)
    assert all(same_batch(a, b) for a, b in zip(direct, generic))
    in_process = list(StepSampler(rb, batch_size=B, seed=3).epoch_iter())
    assert all(same_batch(a, b) for a, b in zip(direct_epoch, in_process))


def test_hdf5_rows_are_the_files_rows(disk):
    """The rows a worker reads from an HDF5 file (preadv into the slot) are h5py's."""
    import h5py
    rb = disk("hdf5")
    ms = MultiprocessingSampler(StepSampler(rb, batch_size=50, seed=11), n_workers=2)
    with ms:
        batches = [ms.sample() for _ in range(4)]
    with h5py.File(rb.storage.cache_filename, "r") as f:
        for batch in batches:
            ids = step_ids(batch)
            for key in ("state", "action", "done", "image"):
                assert batch[key].dtype == f[key].dtype
                assert np.array_equal(batch[key], f[key][...][ids]), key


def test_the_readers_each_storage_gets(disk):
    """Which reader fills each leaf, as files.py says: pread for a contiguous dataset in a
    file opened read-only, UniEnv's reader for a compressed one or a file open for
    writing, a decoder per row for images, the storage's own read for video."""
    from unienv_mp._direct import files
    kinds = {"hdf5": files.Pread, "hdf5-gzip": files.H5Rows, "hdf5-writable": files.H5Rows}
    for kind, cls in kinds.items():
        tree = _gather.Planner(StepSampler(disk(kind), batch_size=B), bind=True).structure(
            "get_at")
        assert all(type(leaf.reader.inner) is cls for leaf in tree.values()), kind
    tree = _gather.Planner(StepSampler(disk("images"), batch_size=B), bind=True).structure(
        "get_at")
    assert type(tree["png"].reader) is files.PerRow
    assert type(tree["npz"].reader) is files.PerRow
    assert type(tree["state"].reader.inner) is files.Pread


def test_a_row_its_space_does_not_describe_raises_and_says_how_to_get_it(disk, tmp_path):
    """An image file replaced by one of another size: UniEnv's batch would have another
    shape; the direct gather says so, and direct_gather=False gives UniEnv's answer."""
    from PIL import Image
    pytest.importorskip("h5py")
    from _disk_data import build as build_again
    rb = build_again("images", str(tmp_path))
    try:
        png = rb.storage.storage_map["png"]
        for i in range(len(rb)):
            Image.new("RGB", (4, 4)).save(os.path.join(png.cache_filename, f"{i}.png"))
        from unienv_mp.errors import WorkerError
        with MultiprocessingSampler(StepSampler(rb, batch_size=B, seed=1),
                                    n_workers=1) as ms:
            with pytest.raises(WorkerError, match="direct_gather=False"):
                ms.sample()
        with MultiprocessingSampler(StepSampler(rb, batch_size=B, seed=1), n_workers=1,
                                    direct_gather=False) as ms:
            assert ms.sample()["png"].shape == (B, 4, 4, 3)   # (UniEnv's batch)
    finally:
        close(rb)


def test_an_hdf5_file_unlike_its_space_takes_the_generic_path(tmp_path):
    """A dataset of another dtype than its space (a file loaded without UniEnv's check):
    the workers' plan is refused, and the batches are UniEnv's (the dataset's dtype)."""
    h5py = pytest.importorskip("h5py")
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.storages.hdf5 import HDF5Storage
    from _disk_data import np_space
    path = str(tmp_path / "f.hdf5")
    with h5py.File(path, "w") as f:
        for key, sub in np_space().spaces.items():
            f.create_dataset(key, data=np.zeros((40, *sub.shape), np.float64))
    f = h5py.File(path, "r")
    storage = HDF5Storage(np_space(), f, capacity=40, check_file=False)
    rb = ReplayBuffer(storage, "storage.hdf5", count=40, offset=0, cache_path=None,
                      maintain_segment_metadata=False)
    try:
        with MultiprocessingSampler(StepSampler(rb, batch_size=8, seed=0),
                                    n_workers=1) as ms:
            batch = ms.sample()
        assert batch["state"].dtype == np.float64 and batch["image"].dtype == np.float64
    finally:
        f.close()


def test_a_read_only_parquet_buffer_is_read_from_its_pieces_tables(disk):
    """A ParquetStorage loaded read-only: every leaf's rows copied from the pieces' Arrow
    tables (PieceRows), and for every row of the buffer, in any order and across pieces,
    those bytes are what the storage's own get returns."""
    from unienv_mp._direct import files
    rb = disk("parquet")
    tree = _gather.Planner(StepSampler(rb, batch_size=B), bind=True).structure("get_at")
    assert all(type(leaf.reader) is files.PieceRows for leaf in tree.values())
    rows = np.random.default_rng(5).permutation(np.r_[np.arange(len(rb)), [0, 95, 31, 32]])
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    want = rb.storage.get(rows)
    memo = {}
    for key, leaf in tree.items():
        out = np.empty((len(rows), *leaf.tail), dtype=leaf.dtype)
        out.reshape(-1).view(np.uint8)[:] = 0xAB
        leaf.reader.fill(rows, out, 0, out, memo)
        assert out.dtype == want[key].dtype and out.tobytes() == want[key].tobytes(), key


def _rewrite_pieces(storage):
    """Piece 1's ``state`` stored as float64 (the storage's get casts it to the space's
    float32) and piece 2 written in row groups of 5 rows (its columns read back in
    several chunks)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = storage._piece_path(1)
    table = pq.read_table(path)
    i = table.column_names.index("state")
    state = table.column(i).cast(pa.list_(pa.float64(), 5))
    pq.write_table(table.set_column(i, "state", state), path)
    path = storage._piece_path(2)
    pq.write_table(pq.read_table(path), path, row_group_size=5)


def test_parquet_pieces_not_one_plain_array_are_read_as_get_reads_them(tmp_path):
    """Pieces whose columns are another type than the space's or in several chunks: the
    direct gather reads those pieces as the storage's get does (casts included), bit for
    bit against the generic path and against get in this process."""
    pytest.importorskip("pyarrow")
    from _disk_data import build as build_again
    rb = build_again("parquet", str(tmp_path))
    try:
        _rewrite_pieces(rb.storage)
        tree = _gather.Planner(StepSampler(rb, batch_size=B), bind=True).structure(
            "get_at")
        rows = np.ascontiguousarray(np.random.default_rng(2).permutation(len(rb)),
                                    dtype=np.int64)
        want = rb.storage.get(rows)
        memo = {}
        for key, leaf in tree.items():
            out = np.zeros((len(rows), *leaf.tail), dtype=leaf.dtype)
            leaf.reader.fill(rows, out, 0, out, memo)
            assert out.tobytes() == want[key].tobytes(), key
        state = tree["state"].reader._pieces
        assert state[0][1] is not None and state[1][1] is None and state[2][1] is None
        assert tree["image"].reader._pieces[1][1] is not None
        fork = mp.get_context("fork")
        direct, direct_epoch, path = _draws(rb, fork, None)
        assert path == ("direct", None)
        generic, generic_epoch, _ = _draws(rb, fork, False)
        assert all(same_batch(a, b) for a, b in zip(direct, generic))
        assert all(same_batch(a, b) for a, b in zip(direct_epoch, generic_epoch))
    finally:
        close(rb)


def test_a_parquet_storage_whose_reads_are_overridden_is_read_by_its_get(tmp_path):
    """A ParquetStorage subclass that changes how a piece's column is read: its own get
    reads it (OwnRead), not the pieces' tables."""
    pytest.importorskip("pyarrow")
    from _disk_data import build as build_again
    from unienv_data.storages.parquet import ParquetStorage

    from unienv_mp._direct import files

    class Doubled(ParquetStorage):
        def _read_only_piece_column_values(self, *args):
            return super()._read_only_piece_column_values(*args) * 2

    rb = build_again("parquet", str(tmp_path))
    try:
        rb.storage.__class__ = Doubled
        tree = _gather.Planner(StepSampler(rb, batch_size=B), bind=True).structure(
            "get_at")
        assert all(type(leaf.reader) is files.OwnRead for leaf in tree.values())
        _, direct_epoch, path = _draws(rb, mp.get_context("fork"), None)
        assert path == ("direct", None)
        in_process = list(StepSampler(rb, batch_size=B, seed=3).epoch_iter())
        assert all(same_batch(a, b) for a, b in zip(direct_epoch, in_process))
    finally:
        rb.storage.__class__ = ParquetStorage
        close(rb)
