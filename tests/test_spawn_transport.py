"""The wrapped sampler's (or a manager's target's) arrays reach spawn and forkserver workers
through unienv_mp's own memory: one copy-on-write copy for all workers, nothing under
/dev/shm, and buffers shared with ``multiprocessing=True`` stay shared."""
import multiprocessing as mp
import os
import signal

import numpy as np
import pytest
import torch
from unienv_data.samplers import StepSampler

from unienv_mp import MultiProcessingSampleManager, MultiprocessingSampler

import _syscall_filter
import _tiny_shm
from _data import indices_of, replay_buffer, transitions
from conftest import START_METHODS, wait_until

SPAWNED = ["spawn", "forkserver"]

# -- a container's /dev/shm ---------------------------------------------------------------

# Run in a 1 MiB /dev/shm: a 400-row buffer of 3x128x128 images (about 20 MB, twenty
# times the tmpfs), sampled and iterated by unienv_mp, then by UniEnv's sampler the way
# that fails there (under fork only shared_memory=True moves batches through /dev/shm).
_TABLE = """
import multiprocessing as mp
import signal, tempfile, time, traceback
import numpy as np
from unienv_data.samplers import MultiprocessingSampler as UniEnvSampler, StepSampler
from unienv_mp import MultiprocessingSampler
from _data import indices_of, replay_buffer

IMG = (3, 128, 128)
METHOD = {method!r}
ctx = mp.get_context(METHOD)
rb = replay_buffer(n=400, img=IMG)
assert rb.storage.storage_map["image"].data.numel() > 16 * (1 << 20)

def check(batch):
    idx = np.asarray(indices_of(batch, IMG))
    image = batch["image"].numpy()
    assert (image == (idx % 251).astype(np.uint8)[:, None, None, None]).all()
    return idx.tolist()

with MultiprocessingSampler(StepSampler(rb, 32, seed=0), n_workers=2, ctx=ctx) as s:
    for _ in range(20):
        assert len(check(s.sample())) == 32
    print("unienv_mp sample: 20 batches")
    seen = []
    for batch in s.epoch_iter():
        seen += check(batch)
    assert sorted(seen) == list(range(400)), "an epoch covers every row once"
    print("unienv_mp epoch: 400 rows")
    print("/dev/shm while running:", dev_shm_used())
print("/dev/shm after:", dev_shm_used())

# UniEnv's sampler, in a process group of its own: under fork its worker fails and the
# sampler waits for that batch for ever, so it is stopped once the error is in its log.
kw = {{"shared_memory": True}} if METHOD == "fork" else {{}}

def attempt(what, log):
    os.setpgrp()
    os.dup2(os.open(log, os.O_WRONLY | os.O_APPEND), 2)
    try:
        u = UniEnvSampler(StepSampler(rb, 32, seed=0), n_workers=2, ctx=ctx, **kw)
        try:
            if what == "sample":
                u.sample()
            else:
                next(iter(u.epoch_iter()))
        finally:
            u.close()
    except BaseException:
        traceback.print_exc()
    else:
        print("fine", file=sys.stderr)
    sys.stderr.flush()
    os._exit(0)

for what in ("sample", "epoch"):
    tmp = tempfile.TemporaryDirectory()
    log = os.path.join(tmp.name, "unienv.log")
    open(log, "w").close()
    p = mp.get_context("fork").Process(target=attempt, args=(what, log))
    p.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = open(log).read()
        if "RuntimeError" in text or "fine" in text or not p.is_alive():
            break
        time.sleep(0.05)
    time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)
    p.join()
    text = open(log).read()
    tmp.cleanup()
    line = next((x for x in text.splitlines() if x.startswith("RuntimeError")),
                "no RuntimeError: " + text[-500:].replace(chr(10), " | "))
    print(f"UniEnv {{what}}: {{line}}")
"""


@pytest.mark.parametrize("method", START_METHODS)
def test_sampler_and_epochs_in_a_1_mib_dev_shm_against_unienv(method):
    out = _tiny_shm.run(_TABLE.format(method=method))
    lines = out.splitlines()
    assert "unienv_mp sample: 20 batches" in lines
    assert "unienv_mp epoch: 400 rows" in lines
    # nothing was written under /dev/shm, not even a semaphore
    assert "/dev/shm while running: (0, [])" in lines
    assert "/dev/shm after: (0, [])" in lines
    # ... while UniEnv's sampler, where it moves tensors through /dev/shm, cannot run:
    # the namespace really is that small
    for what in ("sample", "epoch"):
        line = next(x for x in lines if x.startswith(f"UniEnv {what}:"))
        assert "RuntimeError: unable to allocate shared memory(shm)" in line, out
        assert "No space left on device" in line, out


# -- one copy, copy-on-write ----------------------------------------------------------------

def _data_segments(pid):
    """``{inode: size}`` of the unienv_mp data segments (a work function's arrays) that
    process ``pid`` holds a descriptor of."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "unienv_mp_data_" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                out[st.st_ino] = st.st_size
        except OSError:
            pass
    return out


def _data_mappings(pid):
    """``[(perms, inode)]`` of process ``pid``'s mappings of unienv_mp data segments."""
    with open(f"/proc/{pid}/maps") as f:
        return [(parts[1], int(parts[4])) for parts in (line.split() for line in f)
                if len(parts) >= 6 and "unienv_mp_data_" in parts[5]]


def _storage_bytes(rb):
    return sum(s.data.nbytes for s in rb.storage.storage_map.values())


@pytest.mark.parametrize("method", SPAWNED)
def test_one_copy_of_the_data_for_all_workers_mapped_copy_on_write(method):
    rb = replay_buffer(300, img=(3, 32, 32))
    data = _storage_bytes(rb)
    with MultiprocessingSampler(StepSampler(rb, 16, seed=0), n_workers=3, ctx=method,
                                doze_time=0.01) as m:
        assert len(m.sample()["state"]) == 16
        segs = _data_segments(os.getpid())
        assert len(segs) == 1, segs
        (ino, size), = segs.items()
        assert data <= size < data + (1 << 16)

        def maps_it(pid):
            # copy-on-write ("p"rivate), and the worker kept no descriptor of it
            return _data_mappings(pid) and all(perms.endswith("p") and i == ino
                                               for perms, i in _data_mappings(pid)) \
                and not _data_segments(pid)
        for p in m._pools.sample.workers:
            assert wait_until(lambda: maps_it(p.pid), timeout=60), _data_mappings(p.pid)
        # a replacement maps the same copy
        old = m._pools.sample.workers[0].pid
        os.kill(old, signal.SIGKILL)
        assert wait_until(lambda: (m.sample() is not None
                                   and m._pools.sample.workers[0].pid != old), timeout=60)
        assert _data_segments(os.getpid()) == {ino: size}
        assert wait_until(lambda: maps_it(m._pools.sample.workers[0].pid), timeout=60)
    assert _data_segments(os.getpid()) == {}


def _mapped_file(ptr):
    """The file of this process's mapping that holds address ``ptr`` ('' if anonymous)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5].strip() if len(parts) > 5 else ""
    return None


def _where(x):
    ptr = x.data_ptr() if isinstance(x, torch.Tensor) else x.__array_interface__["data"][0]
    name = _mapped_file(ptr)
    return "data" if "unienv_mp_data_" in name else name


class _Scribbler:
    """Writes ``value`` into its array and tensor, after reporting what they held."""

    def __init__(self):
        self.array = np.zeros(4, np.int64)
        self.tensor = torch.zeros(4, dtype=torch.int64)

    def __call__(self, value):
        seen = (self.array.tolist(), self.tensor.tolist(), _where(self.array),
                _where(self.tensor))
        if value:
            self.array[:] = value
            self.tensor[:] = value
        return seen


@pytest.mark.parametrize("method", START_METHODS)
def test_what_a_worker_writes_into_its_arrays_stays_in_that_worker(method):
    target = _Scribbler()
    with MultiProcessingSampleManager(target, n_workers=2, ctx=method) as mgr:
        def ask(value, worker):
            return mgr.result(mgr.submit(value, worker=worker))
        a, t, where_a, where_t = ask(5, 0)
        assert (a, t) == ([0] * 4, [0] * 4)
        if method != "fork":
            assert where_a == where_t == "data"
        assert ask(0, 0)[:2] == ([5] * 4, [5] * 4)    # its own write stays
        assert ask(0, 1)[:2] == ([0] * 4, [0] * 4)    # another worker does not see it
    assert target.array.tolist() == [0] * 4 and target.tensor.tolist() == [0] * 4


class _Probe:
    """Holds arrays and tensors of every kind; reports how each arrived."""

    def __init__(self, tmp):
        from unienv_data.third_party.tensordict.memmap_tensor import MemoryMappedTensor
        t = torch.arange(12, dtype=torch.float64).reshape(3, 4)
        a = np.arange(6, dtype=np.int16)
        ro = np.arange(5, dtype=np.float32)
        ro.flags.writeable = False
        tagged = torch.arange(3)
        tagged.tag = "tagged"
        npmm = np.memmap(os.path.join(tmp, "np.bin"), dtype=np.int32, mode="w+", shape=(8,))
        npmm[:] = np.arange(8)
        self.items = {
            "tensor": t, "view": t[1:, 1:], "array": a, "array again": a,
            "read-only": ro, "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
            "strided": np.arange(20, dtype=np.int64)[::3],
            "structured": np.array([(1, 2.5), (3, 4.5)], dtype=[("i", "<i4"), ("f", "<f8")]),
            "empty": np.zeros((0, 3), np.float32), "empty tensor": torch.zeros(0, 2),
            "objects": np.array([{"x": 1}, None], dtype=object),
            "bfloat16": torch.ones(5, dtype=torch.bfloat16) / 3,
            "complex": torch.tensor([1 + 2j, -3j]),
            "bool": torch.tensor([True, False, True]),
            "leaf with grad": torch.ones(3, requires_grad=True),
            "attribute": tagged,
            "shared": torch.zeros(4).share_memory_(),
            "memmap tensor": MemoryMappedTensor.from_tensor(
                torch.arange(4.0), filename=os.path.join(tmp, "mm.bin")),
            "np.memmap": npmm,
        }

    def __call__(self, work):
        items = self.items
        if work == "write shared":
            items["shared"][0] = 7
            return None
        report = {}
        for name, x in items.items():
            if isinstance(x, torch.Tensor):
                r = {"bytes": x.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                     if x.dtype != torch.bool else x.tolist(),
                     "type": type(x).__name__, "shared": x.is_shared(),
                     "grad": (x.requires_grad, x.is_leaf)}
            else:
                r = {"bytes": x.tobytes() if x.dtype != object else repr(x.tolist()),
                     "type": type(x).__name__, "writeable": x.flags.writeable,
                     "fortran": x.flags.f_contiguous and not x.flags.c_contiguous}
            r["where"] = _where(x) if x.nbytes else None
            report[name] = r
        report["identity"] = {
            "array twice": items["array"] is items["array again"],
            "view shares": (items["view"].untyped_storage().data_ptr()
                            == items["tensor"].untyped_storage().data_ptr()),
            "tag": getattr(items["attribute"], "tag", None),
            "memmap file": getattr(items["memmap tensor"], "filename", None),
        }
        return report


@pytest.mark.parametrize("method", SPAWNED)
def test_arrays_of_every_kind_arrive_intact_and_shared_memory_stays_shared(method, tmp_path):
    probe = _Probe(str(tmp_path))
    expected = _Probe.__call__(probe, "report")   # what the parent sees
    with MultiProcessingSampleManager(probe, n_workers=1, ctx=method) as mgr:
        got = mgr.result(mgr.submit("report"))
        mgr.result(mgr.submit("write shared"))
    for name in probe.items:
        assert got[name]["bytes"] == expected[name]["bytes"], name   # bit for bit
        assert got[name]["type"] == expected[name]["type"], name
    copied = ["tensor", "view", "array", "read-only", "fortran", "strided", "structured",
              "bfloat16", "complex", "bool", "leaf with grad", "attribute"]
    for name in copied:
        assert got[name]["where"] == "data", name
    # numpy's own pickling, as before: in the pickle, not in shared memory
    for name in ("objects", "np.memmap"):
        assert got[name]["where"] in ("", "[heap]"), name   # private memory
    # torch's shared memory and files, as before
    assert got["shared"]["shared"] and "torch_" in got["shared"]["where"]
    assert probe.items["shared"][0] == 7          # the worker wrote into the parent's memory
    assert got["memmap tensor"]["type"] == "MemoryMappedTensor"
    assert got["memmap tensor"]["where"] == str(tmp_path / "mm.bin")
    assert got["identity"] == {"array twice": True, "view shares": True, "tag": "tagged",
                               "memmap file": str(tmp_path / "mm.bin")}
    assert got["read-only"]["writeable"] is False and got["array"]["writeable"] is True
    assert got["fortran"]["fortran"] is True
    assert got["leaf with grad"]["grad"] == (True, True)


# -- buffers shared with multiprocessing=True -----------------------------------------------

@pytest.mark.parametrize("method", SPAWNED)
def test_a_multiprocessing_buffer_stays_live_in_spawned_workers(method):
    rb = replay_buffer(50, capacity=300, multiprocessing=True)
    with MultiprocessingSampler(StepSampler(rb, 16, seed=0), n_workers=2, n_buffers=2,
                                batches_per_task=1, ctx=method) as m:
        assert max(indices_of(m.sample())) < 50
        rb.extend(transitions(50, 250))     # the parent appends; the workers see it
        seen = set()
        for _ in range(200):
            batch = m.sample()
            idx = np.asarray(indices_of(batch))
            assert (batch["image"].numpy()[:, 0, 0, 0] == idx % 251).all()
            seen |= set(idx.tolist())
            if max(seen) >= 50:
                break
        assert max(seen) >= 50
        assert sorted(i for b in m.epoch_iter() for i in indices_of(b)) == list(range(300))
        # the buffer's memory was not copied
        assert sum(_data_segments(os.getpid()).values()) < _storage_bytes(rb)


# -- short of memory ------------------------------------------------------------------------

@pytest.mark.parametrize("method", SPAWNED)
def test_no_memory_for_the_copy_is_a_memory_error_saying_what_for(method):
    # Reservations above 4 MiB are refused: the copy of the buffer (7.4 MB) is one.
    out = _syscall_filter.run(f"""
        _syscall_filter.refuse_fallocate(errno.ENOMEM, 4 << 20)
        from unienv_data.samplers import StepSampler
        from unienv_mp import MultiprocessingSampler
        from _data import replay_buffer
        rb = replay_buffer(600, img=(3, 64, 64))
        m = MultiprocessingSampler(StepSampler(rb, 16, seed=0), n_workers=2,
                                   ctx={method!r})
        for _ in range(2):   # it is asked for again, and refused again
            try:
                m.sample()
            except MemoryError as e:
                print(e)
        m.close()
        left = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                left += [t for t in [os.readlink("/proc/self/fd/" + fd)] if "unienv_mp" in t]
            except OSError:
                pass   # (the listing's own descriptor)
        print("fds left:", left)
    """)
    lines = out.splitlines()
    assert len(lines) == 3 and lines[2] == "fds left: []", out
    for line in lines[:2]:
        assert line.startswith("cannot copy the work function's "), out
        assert " arrays into shared memory for workers started with spawn or " \
            "forkserver: cannot reserve " in line and "'data'" in line, out
        assert " bytes (7.1 MiB) of memory" in line, out
        assert "Cannot allocate memory" in line, out
