"""Windows over data on disk: a `WindowedBatch` (an observation history and an action chunk
per step, padded at episode ends) over episodes kept in an HDF5 file, and over memory-mapped
tensors.  Its batches are the file's rows and those of the same view over the same steps
held in memory, bit for bit, in process and from the workers under fork and spawn.  Over
memory-mapped tensors the workers gather it directly; over an HDF5 file (whose storage gives
numpy arrays: UniEnv's ``ToBackendOrDeviceBatch`` makes them torch's) they take the generic
path and say why.  Later epochs over the unchanged file keep their workers."""
import copy
import multiprocessing as mp
import os

import numpy as np
import pytest
import torch
from unienv_data.batches.backend_compat import ToBackendOrDeviceBatch
from unienv_data.batches.framestack_batch import FrameStackedBatch
from unienv_data.replay_buffer import ReplayBuffer
from unienv_data.samplers import StepSampler
from unienv_data.storages.dict_storage import DictStorage
from unienv_data.storages.pytorch import PytorchTensorStorage
from unienv_interface.backends.numpy import NumpyComputeBackend as NB
from unienv_interface.backends.pytorch import PyTorchComputeBackend as TB
from unienv_interface.space import BinarySpace, BoxSpace, DictSpace

import _views_data as vd
from _disk_data import close, missing
from test_gather import assert_identical
from test_persistent_files import _settled
from test_windows import check_against_the_buffer

from unienv_mp import MultiprocessingSampler, WindowedBatch
from unienv_mp._direct import gather

LENGTHS = (9, 1, 14, 6, 2, 30)
WINDOWS = {"obs/image": [-1, 0], "obs/state": [-1, 0], "action": range(6)}
B = 7


def _np_space():
    """`_views_data.space` for the numpy backend (what an HDF5Storage holds)."""
    return DictSpace(NB, {
        "obs": DictSpace(NB, {
            "state": BoxSpace(NB, -1e9, 1e9, np.float32, shape=(10,)),
            "image": BoxSpace(NB, 0, 255, np.uint8, shape=vd.IMG),
        }),
        "action": BoxSpace(NB, -1.0, 1.0, np.float32, shape=(7,)),
        "reward": BoxSpace(NB, -1e9, 1e9, np.float32, shape=()),
        "episode_id": BoxSpace(NB, 0, 2 ** 40, np.int64, shape=()),
        "episode_end": BinarySpace(NB, shape=(), dtype=np.bool_),
    })


def _numpy(tree):
    return {k: _numpy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree.numpy()


def build(kind, root):
    """``(buffer, data)``: the episodes of `LENGTHS` written under ``root``, saved and
    loaded back read-only, and the torch batch a WindowedBatch takes over it."""
    path = os.path.join(root, kind)
    total = sum(LENGTHS)
    steps = vd.steps(0, list(LENGTHS))
    if kind == "hdf5":
        from unienv_data.storages.hdf5 import HDF5Storage
        rb = ReplayBuffer.create(HDF5Storage, _np_space(), cache_path=path, capacity=total)
        rb.extend(_numpy(steps))
        rb.dumps(path)
        rb.close()
        rb = ReplayBuffer.load_from(path, backend=NB)
        return rb, ToBackendOrDeviceBatch(rb, backend=TB, device="cpu")
    rb = ReplayBuffer.create(DictStorage, vd.space(),
                             {k: PytorchTensorStorage for k in vd.KEYS},
                             cache_path=path, capacity=total, is_memmap=True)
    rb.extend(steps)
    rb.dumps(path)
    rb.close()
    rb = ReplayBuffer.load_from(path, backend=TB, device="cpu", is_memmap=True)
    return rb, rb


@pytest.fixture
def disk(tmp_path):
    made = []

    def get(kind):
        if kind == "hdf5" and missing("hdf5") is not None:
            pytest.skip("hdf5 needs h5py: pip install -e '.[disk]'")
        made.append(build(kind, str(tmp_path)))
        return made[-1]
    yield get
    for rb, _ in made:
        close(rb)


def _view(data):
    return WindowedBatch(data, WINDOWS, episode_end_key="episode_end")


@pytest.mark.parametrize("kind", ["hdf5", "memmap"])
def test_windows_over_files_are_the_files_rows_in_process(disk, kind):
    """Every step's windows and pads: the file's rows (each step numbered in
    ``obs.state[:, 0]``), and the same view's over the same steps in memory."""
    _, data = disk(kind)
    view = _view(data)
    idx = torch.arange(len(view))
    got = view.get_at_with_metadata(idx)
    assert_identical(got, _view(vd.buffer(LENGTHS)).get_at_with_metadata(idx))
    check_against_the_buffer(data, view, idx, *got, "end")


def _draws(view, ctx, direct=None):
    """A few sample*() batches and an epoch with metadata, from two workers; and the
    sampler's path and reason."""
    with MultiprocessingSampler(StepSampler(view, B, seed=11), n_workers=2, n_buffers=3,
                                ctx=ctx, direct_gather=direct) as m:
        out = [m.sample(), m.sample_with_metadata(), m.sample()]
        epoch = list(m.epoch_iter_with_metadata())
        return copy.deepcopy((out, epoch)), m.gather_path, m.gather_path_reason


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
@pytest.mark.parametrize("kind", ["hdf5", "memmap"])
def test_the_workers_give_uniEnvs_batches(disk, kind, ctx):
    """The sampled batches are the view's own at the steps they hold; the epoch is the one
    UniEnv's StepSampler reads in this process; over memory-mapped tensors the direct
    path, and it gives the generic path's batches."""
    _, data = disk(kind)
    view = _view(data)
    (sampled, epoch), path, reason = _draws(view, ctx)
    if kind == "hdf5":
        assert path == "generic"
        assert reason.startswith("WindowedBatch > unienv_data.batches.backend_compat."
                                 "ToBackendOrDeviceBatch is not a batch that the direct "
                                 "path reproduces"), reason
    else:
        assert (path, reason) == ("direct", None)
        assert_identical((sampled, epoch), _draws(view, "fork", direct=False)[0])
    for batch in sampled:
        d = batch[0] if isinstance(batch, tuple) else batch
        steps = torch.tensor([int(x) for x in d["obs"]["state"][:, -1, 0]])
        want = view.get_at_with_metadata(steps)
        assert_identical(batch, want if isinstance(batch, tuple) else want[0])
    assert_identical(epoch, list(StepSampler(view, B, seed=11).epoch_iter_with_metadata()))
    assert sorted(int(x) for d, _ in epoch for x in d["obs"]["state"][:, -1, 0]) == list(
        range(sum(LENGTHS)))


def test_uniEnvs_own_views_over_files_say_why_they_take_the_generic_path(disk):
    rb, _ = disk("hdf5")
    stack = FrameStackedBatch(rb, 1, 0)
    assert gather.why_not(StepSampler(stack, 4)) == (
        "FrameStackedBatch > ReplayBuffer > its storage HDF5Storage reads files: the "
        "workers read them straight into the slot for a ReplayBuffer sampled as it is, "
        "not under a view (a frame stack, a window): the generic path reads them")


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_epochs_over_windows_of_an_unchanged_file_keep_their_workers(disk, tmp_path, ctx):
    """Three epochs: the later two on the first's workers, with a reason that names the
    file, each UniEnv's in-process epoch; the file touched, the next on new workers."""
    rb, data = disk("hdf5")
    view = _view(data)
    _settled(str(tmp_path))
    s = StepSampler(view, B, seed=3)
    want = [list(s.epoch_iter_with_metadata()) for _ in range(4)]
    got = []
    with MultiprocessingSampler(StepSampler(view, B, seed=3), n_workers=2, n_buffers=3,
                                ctx=mp.get_context(ctx)) as m:
        for i in range(4):
            if i == 3:
                stat = os.stat(rb.storage.root.filename)
                os.utime(rb.storage.root.filename,
                         ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
            got.append(copy.deepcopy(list(m.epoch_iter_with_metadata())))
            if i == 0:
                assert m.epoch_workers == "new"
            elif i < 3:
                assert m.epoch_workers == "kept", m.epoch_workers_reason
                assert "storage.hdf5) have the device, inode, size and times" in (
                    m.epoch_workers_reason)
            else:
                assert m.epoch_workers == "new", m.epoch_workers_reason
    for a, b in zip(got, want):
        assert_identical(a, b)


def test_windows_over_a_files_numpy_arrays_say_how_to_make_them_torchs(disk):
    rb, _ = disk("hdf5")
    with pytest.raises(TypeError, match=r"not of NumpyComputeBackend: wrap it in UniEnv's "
                                        r"ToBackendOrDeviceBatch\(batch, "
                                        r"backend=PyTorchComputeBackend, device='cpu'\)"):
        _view(rb)
