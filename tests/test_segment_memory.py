"""Segments' memory: reserved when a segment is made, refused with MemoryError when there
is none (the kernel's refusal, or more than the memory left), and copy-on-write segments."""
import errno
import multiprocessing as mp
import os

import numpy as np
import pytest

from unienv_mp import Segment
from unienv_mp._transport import headroom as _headroom

import _syscall_filter

def test_memory_is_reserved_when_the_segment_is_made():
    size = 8 << 20
    with Segment.create(size, "reserved") as seg:
        st = os.fstat(seg.fd)
        assert st.st_size == size
        # every page is allocated already, not at first write
        assert st.st_blocks * 512 >= size
        assert seg.copy_on_write is False


def test_a_segment_larger_than_the_memory_left_is_refused_before_anything_is_taken():
    room, where = _headroom.available()
    assert room is not None and where
    ask = room + (1 << 30)
    with pytest.raises(MemoryError) as e:
        Segment.create(ask, "too_big")
    msg = str(e.value)
    assert f"{ask} bytes" in msg and f"{ask / 1048576:.1f} MiB" in msg
    assert "'too_big'" in msg and "left in" in msg


@pytest.mark.parametrize("err", ["ENOSPC", "ENOMEM"])
def test_a_refused_reservation_is_a_memory_error_naming_size_and_purpose(err):
    out = _syscall_filter.run(f"""
        _syscall_filter.refuse_fallocate(errno.{err})
        from unienv_mp import Segment
        before = set(os.listdir("/proc/self/fd"))
        try:
            Segment.create(3 << 20, "slot7")
        except MemoryError as e:
            print("MemoryError:", e)
        # the memfd was closed again
        assert set(os.listdir("/proc/self/fd")) == before
    """)
    assert "MemoryError: cannot reserve 3145728 bytes (3.0 MiB)" in out
    assert "'slot7'" in out and os.strerror(getattr(errno, err)) in out


def test_a_kernel_that_cannot_reserve_gets_a_sparse_segment():
    out = _syscall_filter.run("""
        _syscall_filter.refuse_fallocate(errno.EOPNOTSUPP)
        from unienv_mp import Segment
        seg = Segment.create(4 << 20, "sparse")
        st = os.fstat(seg.fd)
        memoryview(seg)[:5] = b"hello"
        print(st.st_size, st.st_blocks, bytes(memoryview(seg)[:5]).decode())
    """)
    size, blocks, text = out.split()
    assert int(size) == 4 << 20 and int(blocks) == 0 and text == "hello"


def test_an_interrupted_reservation_is_asked_again_until_a_handler_raises():
    # The filter answers EINTR every time: the call keeps asking, running the signal
    # handlers in between, until one raises.
    out = _syscall_filter.run("""
        import signal, time
        _syscall_filter.refuse_fallocate(errno.EINTR)
        from unienv_mp import Segment
        calls = []
        def handler(signum, frame):
            calls.append(signum)
            if len(calls) == 3:
                raise TimeoutError("third alarm")
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
        before = set(os.listdir("/proc/self/fd"))
        t0 = time.monotonic()
        try:
            Segment.create(1 << 16, "interrupted")
        except TimeoutError as e:
            print(e, len(calls), time.monotonic() - t0 >= 0.1)
        signal.setitimer(signal.ITIMER_REAL, 0)
        assert set(os.listdir("/proc/self/fd")) == before
    """)
    assert out.split() == ["third", "alarm", "3", "True"]


def test_a_worker_without_memory_for_a_slot_raises_an_error_instead_of_dying():
    # Slots above 1 MiB are refused; the rest (rings, the doorbell) are not.
    out = _syscall_filter.run("""
        _syscall_filter.refuse_fallocate(errno.ENOSPC, 1 << 20)
        from unienv_data.samplers import StepSampler
        from unienv_mp import MultiprocessingSampler, WorkerError
        from _data import replay_buffer
        rb = replay_buffer(200, img=(3, 64, 64))      # a batch of 128 rows: 1.6 MB
        with MultiprocessingSampler(StepSampler(rb, 128, seed=0), n_workers=1,
                                    ctx="fork") as m:
            for _ in range(2):   # the worker goes on: the next batch fails the same way
                try:
                    m.sample()
                except WorkerError as e:
                    print(e.exc_type, "|", e.exc_message)
            print("alive:", all(p.is_alive() for p in m._pools.sample.workers))
    """)
    lines = out.splitlines()
    assert len(lines) == 3 and lines[2] == "alive: True", out
    for line in lines[:2]:
        assert line.startswith("builtins.MemoryError | cannot reserve "), out
        assert "'slot0'" in line and "No space left on device" in line, out


# -- copy-on-write segments -------------------------------------------------------------

def _write_and_read(seg, value, q):
    mv = memoryview(seg)
    before = bytes(mv[:4])
    mv[:4] = bytes([value]) * 4
    q.put((seg.copy_on_write, before, bytes(mv[:4])))


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_copy_on_write_segment_keeps_each_receivers_writes_to_itself(method):
    ctx = mp.get_context(method)
    seg = Segment.create(1 << 16, "cow", copy_on_write=True)
    try:
        memoryview(seg)[:4] = b"orig"
        q = ctx.Queue()
        for value in (1, 2):
            p = ctx.Process(target=_write_and_read, args=(seg, value, q))
            p.start()
            cow, before, after = q.get(timeout=60)
            p.join(30)
            # each receiver reads the creator's bytes, and its own write stays its own
            assert (cow, before, after) == (True, b"orig", bytes([value]) * 4)
        assert bytes(memoryview(seg)[:4]) == b"orig"
    finally:
        seg.close()


def test_a_copy_on_write_segment_attached_through_proc_is_copy_on_write_too():
    import pickle
    seg = Segment.create(1 << 16, "cow", copy_on_write=True)
    try:
        memoryview(seg)[:4] = b"orig"
        other = pickle.loads(pickle.dumps(seg))   # opens /proc/<pid>/fd/<n>
        try:
            assert other.copy_on_write and bytes(memoryview(other)[:4]) == b"orig"
            memoryview(other)[:4] = b"mine"
            assert bytes(memoryview(seg)[:4]) == b"orig"
        finally:
            other.close()
    finally:
        seg.close()


# -- what is left, read from /proc and the memory cgroup ----------------------------------

def _tree(tmp_path, files):
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def fake_system(tmp_path, monkeypatch):
    monkeypatch.setattr(_headroom, "PROC", str(tmp_path / "proc"))
    monkeypatch.setattr(_headroom, "CGROUP_ROOT", str(tmp_path / "cgroup"))
    monkeypatch.setattr(_headroom, "_limited", None)

    def make(files):
        _tree(tmp_path, files)
    return make


MEMINFO = "MemTotal: 8000000 kB\nMemFree: 100 kB\nMemAvailable: 4000000 kB\nSwapFree: 1000 kB\n"


def test_room_is_the_machines_available_memory_and_free_swap(fake_system):
    fake_system({"proc/meminfo": MEMINFO, "proc/self/cgroup": "0::/\n"})
    room, where = _headroom.available()
    assert room == 4001000 * 1024 and "machine" in where


def test_room_in_a_cgroup_v2_counts_the_tightest_ancestor_without_its_file_cache(fake_system):
    fake_system({
        "proc/meminfo": MEMINFO,
        "proc/self/cgroup": "0::/box/job\n",
        "cgroup/box/memory.max": str(3 << 30),
        "cgroup/box/memory.current": str(2 << 30),
        "cgroup/box/memory.stat": f"anon 5\nactive_file {1 << 29}\ninactive_file 0\n",
        "cgroup/box/job/memory.max": "max\n",
        "cgroup/box/job/memory.current": str(1 << 30),
        "cgroup/box/job/memory.stat": "active_file 0\n",
    })
    room, where = _headroom.available()
    # 3 GiB limit - (2 GiB used - 0.5 GiB of file cache)
    assert room == (3 << 30) - (2 << 30) + (1 << 29)
    assert "box" in where and "3072.0 MiB" in where
    with pytest.raises(MemoryError, match="only 1536.0 MiB left in the memory cgroup"):
        _headroom.check(2 << 30, "'x'")


def test_room_in_a_cgroup_v1_uses_the_hierarchical_limit(fake_system):
    stat = (f"cache 0\nhierarchical_memory_limit {1 << 30}\ntotal_active_file {1 << 28}\n"
            f"total_inactive_file 0\n")
    fake_system({
        "proc/meminfo": MEMINFO,
        "proc/self/cgroup": "4:memory:/docker/abc\n3:cpu:/x\n",
        # inside the container the cgroup's directory is the mount's root
        "cgroup/memory/memory.stat": stat,
        "cgroup/memory/memory.usage_in_bytes": str(1 << 29),
    })
    room, _ = _headroom.available()
    assert room == (1 << 30) - (1 << 29) + (1 << 28)


def test_no_limit_and_nothing_to_read_refuses_nothing(fake_system):
    fake_system({"proc/self/cgroup": "4:memory:/\n",
                 "cgroup/memory/memory.stat": "hierarchical_memory_limit 9223372036854771712\n"})
    assert _headroom.available() == (None, None)
    _headroom.check(1 << 50, "'x'")   # nothing to go by: the kernel decides


def test_segments_below_the_checked_size_skip_the_check(monkeypatch):
    def refuse(size, what):
        raise AssertionError("checked")
    monkeypatch.setattr(_headroom, "check", refuse)
    Segment.create((1 << 20) - 1).close()
    with pytest.raises(AssertionError, match="checked"):
        Segment.create(1 << 20)


def test_zero_filled_after_reservation():
    with Segment.create(2 << 20) as seg:
        a = np.frombuffer(memoryview(seg), dtype=np.uint8)
        assert not a.any()
