"""Kept workers over files: later epochs over unchanged HDF5, parquet, image, video and
memory-mapped buffers run on the workers of the first (``epoch_workers == "kept"``, with a
reason that names the files), under fork and spawn, and serve the data as it is, bit for
bit; after the files change (rewritten or appended through the buffer, replaced by another
file of the same size, touched, or written too recently to tell) the next epoch runs on new
workers and serves the files as they are now."""
import multiprocessing as mp
import os
import shutil
import time

import numpy as np
import pytest
from unienv_data.samplers import StepSampler

from _disk_data import build, close, missing, np_space, same_batch, steps
from unienv_mp import MultiprocessingSampler
from unienv_mp._sampling import files as _files

B = 32
SETTLE = _files.RACY_NS / 1e9 + 0.1   # (an identity taken sooner is not trusted)


def _settled(*paths):
    """Wait until every file under ``paths`` last changed long enough ago that its
    identity can tell a later change."""
    newest = 0
    for root in paths:
        for folder, _, names in os.walk(root):
            for name in names + ["."]:
                st = os.stat(os.path.join(folder, name))
                newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
    wait = newest / 1e9 + SETTLE - time.time()
    if wait > 0:
        time.sleep(wait)


def _need(kind):
    lib = missing(kind)
    if lib is not None:
        pytest.skip(f"{kind} needs {lib}: pip install -e '.[disk]'")


def _epoch(ms):
    batches = list(ms.epoch_iter())
    return batches, ms.epoch_workers, ms.epoch_workers_reason


def _in_process(rb, seed, epochs):
    """The epochs UniEnv's StepSampler reads in this process (the file as it is)."""
    s = StepSampler(rb, batch_size=B, seed=seed)
    return [list(s.epoch_iter()) for _ in range(epochs)]


# (every kind under fork; under spawn, whose starts cost ~2 s each, hdf5, parquet and video)
@pytest.mark.parametrize("kind, start", [
    (kind, "fork") for kind in ("hdf5", "parquet", "video", "images", "memmap")] + [
    (kind, "spawn") for kind in ("hdf5", "parquet", "video")])
def test_later_epochs_over_unchanged_files_keep_their_workers(tmp_path, kind, start):
    _need(kind)
    rb = build(kind, str(tmp_path))
    try:
        _settled(str(tmp_path))
        ms = MultiprocessingSampler(StepSampler(rb, batch_size=B, seed=5), n_workers=2,
                                    ctx=mp.get_context(start))
        with ms:
            first, workers, reason = _epoch(ms)
            assert workers == "new"
            second, workers, reason = _epoch(ms)
            third, workers3, _ = _epoch(ms)
        assert workers == workers3 == "kept", reason
        name = "storage" if kind != "memmap" else "image"
        assert name in reason and ("have the device, inode, size and times" in reason
                                   or "the files it maps" in reason), reason
        if kind != "memmap":   # (no tensor: all recorded by value or identity, exactly)
            assert reason.startswith("the data is unchanged since they started"), reason
        expect = _in_process(rb, 5, 3)
        for got, want in zip((first, second, third), expect):
            assert len(got) == len(want) and all(map(same_batch, got, want))
    finally:
        close(rb)


def _changed_epoch(rb, change, start, seed=7):
    """Two epochs, ``change()`` between them: the second's workers, reason and batches."""
    ms = MultiprocessingSampler(StepSampler(rb, batch_size=B, seed=seed), n_workers=2,
                                ctx=mp.get_context(start))
    with ms:
        _epoch(ms)
        change()
        batches, workers, reason = _epoch(ms)
    return batches, workers, reason


# (a file open for writing here is locked by HDF5: a spawned worker cannot open it, with
# UniEnv's sampler as with this one; such a buffer is sampled under fork)
@pytest.mark.parametrize("start", ["fork"])
def test_rows_rewritten_through_the_buffer_start_new_workers(tmp_path, start):
    _need("hdf5-writable")
    rb = build("hdf5-writable", str(tmp_path))
    try:
        _settled(str(tmp_path))

        def change():
            new = steps(1000, 8, np_space())
            rb.set_at(np.arange(8), new)   # (same size: the file's times tell)

        batches, workers, reason = _changed_epoch(rb, change, start)
        assert workers == "new", reason
        s = StepSampler(rb, batch_size=B, seed=7)
        list(s.epoch_iter())
        assert all(map(same_batch, batches, list(s.epoch_iter())))
        ids = {int(i) for b in batches for i in b["state"][:, 0]}
        assert set(range(1000, 1008)) <= ids
    finally:
        close(rb)


@pytest.mark.parametrize("start", ["fork"])
def test_rows_appended_through_the_buffer_start_new_workers(tmp_path, start):
    _need("hdf5-unbounded")
    rb = build("hdf5-unbounded", str(tmp_path))
    try:
        _settled(str(tmp_path))
        batches, workers, reason = _changed_epoch(
            rb, lambda: rb.extend(steps(len(rb), 20, np_space())), start)
        assert workers == "new", reason
        ids = sorted(int(i) for b in batches for i in b["state"][:, 0])
        assert ids == list(range(len(rb))) and len(rb) == 116
    finally:
        close(rb)


def test_a_file_replaced_by_another_of_the_same_size_starts_new_workers(tmp_path):
    """An image file replaced (a new inode, the same size and name): the next epoch
    starts new workers, which decode the new one, as this process does."""
    _need("images")
    rb = build("images", str(tmp_path))
    try:
        npz = rb.storage.storage_map["npz"]
        target = os.path.join(npz.cache_filename, "3.npz")
        data = np.load(target)["data"]
        np.savez(target, data=data)   # (stored, not compressed: same size for any data)
        size = os.path.getsize(target)
        _settled(str(tmp_path))

        def change():
            copy = target[:-len(".npz")] + ".new.npz"
            np.savez(copy, data=255 - data)
            assert os.path.getsize(copy) == size
            os.replace(copy, target)

        batches, workers, reason = _changed_epoch(rb, change, "fork")
        assert workers == "new", reason
        s = StepSampler(rb, batch_size=B, seed=7)
        list(s.epoch_iter())
        assert all(map(same_batch, batches, list(s.epoch_iter())))
    finally:
        close(rb)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_touched_file_starts_new_workers_even_with_its_old_times_put_back(tmp_path,
                                                                           start):
    _need("hdf5")
    rb = build("hdf5", str(tmp_path))
    try:
        path = rb.storage.cache_filename
        _settled(str(tmp_path))
        st = os.stat(path)

        def change():   # (the modification time set back: the change time still moves)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

        _, workers, reason = _changed_epoch(rb, change, start)
        assert workers == "new" and "changed" in reason, reason
    finally:
        close(rb)


def test_an_hdf5_file_replaced_under_an_open_buffer_is_not_vouched_for(tmp_path):
    """The buffer reads the file it opened; the path now names another one (which a
    spawned worker would open): whether the data is what workers read cannot be told."""
    _need("hdf5")
    rb = build("hdf5", str(tmp_path))
    try:
        path = rb.storage.cache_filename
        _settled(str(tmp_path))

        def change():
            shutil.copyfile(path, path + ".new")
            os.replace(path + ".new", path)

        batches, workers, reason = _changed_epoch(rb, change, "fork")
        assert workers == "new" and "replaced" in reason, reason
        s = StepSampler(rb, batch_size=B, seed=7)
        list(s.epoch_iter())
        assert all(map(same_batch, batches, list(s.epoch_iter())))
    finally:
        close(rb)


def test_files_written_just_before_the_workers_started_are_not_trusted(tmp_path):
    """An identity taken within the file system's clock tick of a write cannot tell a
    later write: the pool that started then serves no later epoch, and the one after it
    (whose identity can) is kept."""
    _need("hdf5")
    rb = build("hdf5", str(tmp_path))
    try:
        ms = MultiprocessingSampler(StepSampler(rb, batch_size=B, seed=1), n_workers=2)
        with ms:
            _epoch(ms)
            _, workers, reason = _epoch(ms)
            assert workers == "new" and "cannot be told" in reason, reason
            assert rb.storage.cache_filename in reason
            _settled(str(tmp_path))
            _epoch(ms)   # (its workers took an identity that can be trusted)
            _, workers, reason = _epoch(ms)
            assert workers == "kept", reason
    finally:
        close(rb)


def test_the_identity_of_a_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    ident = _files.identity(str(path))
    st = os.stat(path)
    assert ident == (str(path), st.st_dev, st.st_ino, 10, st.st_mtime_ns, st.st_ctime_ns)
    assert _files.racy(ident)
    assert not _files.racy(ident, max(st.st_mtime_ns, st.st_ctime_ns) + _files.RACY_NS + 1)
    assert _files.identity(str(tmp_path / "missing"))[1:] == (None,) * 5
    assert not _files.racy(_files.identity(str(tmp_path / "missing")))


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_worker_started_after_the_files_changed_does_not_start(tmp_path, start):
    """One copy per pool over files: the first worker reads the file it opened.  Under
    spawn a worker left to start later would open the path, which names another file now,
    so it does not start; under fork it starts from the snapshot process, which holds the
    file the first one opened.  Either way the stream is the one of the file the pool
    started with."""
    _need("hdf5")
    rb = build("hdf5", str(tmp_path))
    twin_dir = tmp_path / "twin"
    twin_dir.mkdir()
    twin = build("hdf5", str(twin_dir))
    try:
        path = rb.storage.cache_filename
        _settled(str(tmp_path))
        kw = dict(n_workers=2, n_buffers=2, ctx=mp.get_context(start))
        with MultiprocessingSampler(StepSampler(rb, batch_size=B, seed=9), **kw) as ms, \
                MultiprocessingSampler(StepSampler(twin, batch_size=B, seed=9), **kw) as tw:
            first = ms.sample()
            assert len(ms.stats().workers) == 1   # (the second is left to start later)
            import h5py
            with h5py.File(path + ".new", "w") as f:   # another file, other rows
                for key, value in steps(500, len(rb), np_space()).items():
                    f[key] = value
            os.replace(path + ".new", path)
            got, want = [first], [tw.sample()]
            for s in (ms, tw):   # (the worker left to start later: now, where it can)
                s._pools.sample.start_all()
            for _ in range(24):
                got.append(ms.sample())
                want.append(tw.sample())
            assert len(tw.stats().workers) == 2
            assert len(ms.stats().workers) == (2 if start == "fork" else 1)
            assert all(map(same_batch, got, want))
    finally:
        close(rb)
        close(twin)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_worker_killed_over_unchanged_files_is_replaced(tmp_path, start):
    """A SIGKILLed worker of a pool over files that did not change is replaced, and the
    stream is an unkilled twin's."""
    import signal
    _need("hdf5")
    rb = build("hdf5", str(tmp_path))
    try:
        _settled(str(tmp_path))
        kw = dict(n_workers=2, n_buffers=2, ctx=mp.get_context(start))
        with MultiprocessingSampler(StepSampler(rb, batch_size=B, seed=4), **kw) as ms, \
                MultiprocessingSampler(StepSampler(rb, batch_size=B, seed=4), **kw) as tw:
            got, want = [ms.sample()], [tw.sample()]
            ms._pools.sample.start_all()
            victim = ms.stats().workers[0].pid
            os.kill(victim, signal.SIGKILL)
            for _ in range(20):
                got.append(ms.sample())
                want.append(tw.sample())
            assert all(map(same_batch, got, want))
            pids = [w.pid for w in ms.stats().workers]
            assert len(pids) == 2 and victim not in pids and ms.stats().workers[0].respawns
    finally:
        close(rb)
