"""RingBuffer and Segment: behaviour, errors, and crossing processes."""
import gc
import os
import pickle
import queue
import signal
import threading
import time

import pytest

from unienv_mp import RingBuffer, RingClosed, Segment
from unienv_mp._transport.ring import Event

from conftest import own_segment_fds, own_segment_maps


# -- push and pop --------------------------------------------------------------------------

def test_push_pop_fifo_and_len():
    with RingBuffer(4, 16) as r:
        assert len(r) == 0 and r.empty() and not r.full()
        for i in range(4):
            r.push(bytes([i]) * (i + 1))
        assert len(r) == 4 and r.full()
        assert [r.pop() for _ in range(4)] == [bytes([i]) * (i + 1) for i in range(4)]
        assert r.capacity == 4 and r.entry_size == 16


def test_accepts_any_bytes_like():
    import numpy as np
    with RingBuffer(8, 32) as r:
        r.push(bytearray(b"ab"))
        r.push(memoryview(b"xcdx")[1:3])
        r.push(np.frombuffer(b"ef", dtype=np.uint8))
        r.push(b"")
        assert [r.pop() for _ in range(4)] == [b"ab", b"cd", b"ef", b""]


def test_full_and_empty_nonblocking():
    with RingBuffer(2, 8) as r:
        with pytest.raises(queue.Empty):
            r.pop_nowait()
        r.push_nowait(b"a")
        r.push_nowait(b"b")
        with pytest.raises(queue.Full):
            r.push_nowait(b"c")
        with pytest.raises(queue.Full):
            r.push(b"c", block=False)


def test_timeouts():
    with RingBuffer(1, 8) as r:
        t = time.monotonic()
        with pytest.raises(queue.Empty):
            r.pop(timeout=0.1)
        assert time.monotonic() - t >= 0.09
        r.push(b"x")
        t = time.monotonic()
        with pytest.raises(queue.Full):
            r.push(b"y", timeout=0.1)
        assert time.monotonic() - t >= 0.09
        with pytest.raises(queue.Full):
            r.push(b"y", timeout=0)


def test_wraps_around_many_laps():
    with RingBuffer(3, 8) as r:
        for i in range(1000):
            r.push(i.to_bytes(8, "little"))
            assert int.from_bytes(r.pop(), "little") == i


def test_batch_push_pop():
    with RingBuffer(8, 8) as r:
        items = [bytes([i]) for i in range(12)]
        assert r.push_many(items, block=False) == 8
        assert r.pop_many(3) == items[:3]
        assert r.push_many(items[8:], block=False) == 3
        assert r.pop_many(100) == items[3:11]
        assert r.pop_many(5, block=False) == []
        assert r.push_many([]) == 0


def test_batch_push_blocks_until_all_fit():
    with RingBuffer(4, 8) as r:
        got = []

        def consume():
            while len(got) < 10:
                got.extend(r.pop_many(3, timeout=5))

        t = threading.Thread(target=consume)
        t.start()
        assert r.push_many([bytes([i]) for i in range(10)], timeout=5) == 10
        t.join(5)
        assert got == [bytes([i]) for i in range(10)]


class _FreshBytes:
    """A sequence whose items are new bytes objects every time they are read."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i >= 8:
            raise IndexError(i)
        return bytes([65 + i]) * 6


def test_push_many_keeps_every_item_alive():
    with RingBuffer(8, 8) as r:
        assert r.push_many(_FreshBytes()) == 8
        assert r.pop_many(8) == [bytes([65 + i]) * 6 for i in range(8)]


def test_push_many_reports_partial_progress():
    with RingBuffer(2, 8) as r:
        with pytest.raises(queue.Full) as info:
            r.push_many([b"a", b"b", b"c"], timeout=0.05)
        assert info.value.pushed == 2


def test_tagged_entries_and_what_the_calls_record():
    import collections
    with RingBuffer(2, 32) as r:
        pushed, popped = [], collections.deque()
        r.push_tagged(7, 1, 10, b"ab", record=pushed)
        r.push_tagged(2**32 - 1, 2**32 - 1, 2**64 - 1, bytearray(16))
        assert pushed == [10]
        # what did not go into the ring is not recorded: full, a timeout, a check raising
        with pytest.raises(queue.Full):
            r.push_tagged(1, 1, 11, b"", False, record=pushed)
        with pytest.raises(queue.Full):
            r.push_tagged(1, 1, 12, b"", timeout=0.01, record=pushed)

        def stop():
            raise KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            r.push_tagged(1, 1, 13, b"", check=stop, record=pushed)
        assert pushed == [10]
        with pytest.raises(ValueError):   # 17 payload bytes do not fit in 32 - 16
            r.push_tagged(1, 1, 14, bytes(17), record=pushed)
        assert pushed == [10]
        assert r.pop_tagged(into=popped) == (7, 1, 10, b"ab")
        assert r.pop_tagged(False) == (2**32 - 1, 2**32 - 1, 2**64 - 1, bytes(16))
        assert list(popped) == [(7, 1, 10, b"ab")]
        with pytest.raises(queue.Empty):
            r.pop_tagged(False, into=popped)
        with pytest.raises(queue.Empty):
            r.pop_tagged(timeout=0.01, into=popped)
        assert len(popped) == 1


# -- bad arguments -------------------------------------------------------------------------

@pytest.mark.parametrize("bad, exc", [
    ((0, 8), ValueError), ((-1, 8), ValueError), ((4, 0), ValueError),
    ((4.5, 8), TypeError), (("4", 8), TypeError), ((True, 8), TypeError),
    ((4, None), TypeError), ((1 << 40, 8), ValueError),
])
def test_bad_construction_arguments(bad, exc):
    with pytest.raises(exc) as info:
        RingBuffer(*bad)
    assert "capacity" in str(info.value) or "entry_size" in str(info.value)


def test_bad_call_arguments():
    with RingBuffer(2, 4) as r:
        with pytest.raises(ValueError, match="entry_size is 4 bytes"):
            r.push(b"12345")
        with pytest.raises(ValueError, match="does not fit"):
            r.push_many([b"1", b"12345"])
        assert len(r) == 0  # nothing of a rejected batch was pushed
        with pytest.raises(TypeError):
            r.push("text")
        with pytest.raises(TypeError):
            r.push(12)
        with pytest.raises(ValueError, match="non-negative"):
            r.pop(timeout=-1)
        with pytest.raises(TypeError, match="timeout"):
            r.pop(timeout="1")
        with pytest.raises(ValueError):
            r.pop_many(0)
        with pytest.raises(ValueError):
            RingBuffer(2, 4, poll_interval=0)


def test_none_segment_is_a_type_error():
    with pytest.raises(TypeError):
        RingBuffer.attach(None, 0)
    with pytest.raises(TypeError):
        Event(None, 0)


# -- shutdown and close --------------------------------------------------------------------

def test_shutdown_drains_then_raises():
    r = RingBuffer(4, 8)
    r.push(b"a")
    r.shutdown()
    assert r.is_shutdown
    with pytest.raises(RingClosed):
        r.push(b"b")
    assert r.pop() == b"a"
    with pytest.raises(RingClosed):
        r.pop()
    with pytest.raises(RingClosed):
        r.pop_many(2)
    r.close()


def test_shutdown_wakes_blocked_waiters():
    r = RingBuffer(1, 8, poll_interval=30)  # only the shutdown can wake them in time
    r.push(b"x")
    errors = []

    def blocked_push():
        try:
            r.push(b"y")
        except RingClosed as e:
            errors.append(e)

    t = threading.Thread(target=blocked_push)
    t.start()
    time.sleep(0.1)
    r.shutdown()
    t.join(5)
    assert not t.is_alive() and len(errors) == 1
    r.close()


def test_close_detaches_and_calls_raise():
    r = RingBuffer(2, 8)
    r.close()
    r.close()  # idempotent
    assert r.closed
    with pytest.raises(ValueError, match="closed"):
        r.push(b"a")
    with pytest.raises(ValueError, match="closed"):
        len(r)
    with pytest.raises(ValueError):
        pickle.dumps(r)


def test_closing_from_another_thread_never_crashes():
    # Run in a child: a use-after-unmap would kill it with SIGSEGV rather than fail.
    import multiprocessing as mp
    p = mp.get_context("spawn").Process(target=_close_while_busy)
    p.start()
    p.join(120)
    assert p.exitcode == 0


def _close_while_busy():
    for _ in range(200):
        r = RingBuffer(4, 16)
        stop = threading.Event()

        def busy():
            while not stop.is_set():
                try:
                    r.push(b"x", timeout=0.5)
                    r.pop(timeout=0.5)
                except (ValueError, queue.Empty, queue.Full):
                    if r.closed:
                        return

        t = threading.Thread(target=busy)
        t.start()
        time.sleep(0.001)
        r.close()
        stop.set()
        t.join()


# -- blocking waits: the GIL, check, signals, events ---------------------------------------

def test_blocking_releases_the_gil():
    with RingBuffer(1, 8) as r:
        ticks = []

        def ticker():
            for _ in range(20):
                ticks.append(1)
                time.sleep(0.005)

        t = threading.Thread(target=ticker)
        t.start()
        with pytest.raises(queue.Empty):
            r.pop(timeout=0.3)
        t.join()
        assert len(ticks) == 20


def test_check_callback_runs_every_poll_interval_and_can_abort():
    with RingBuffer(1, 8, poll_interval=0.02) as r:
        calls = []

        def check():
            calls.append(time.monotonic())
            if len(calls) == 3:
                raise RuntimeError("peer died")

        with pytest.raises(RuntimeError, match="peer died"):
            r.pop(check=check)
        assert len(calls) == 3


def test_signal_interrupts_a_blocked_pop():
    with RingBuffer(1, 8, poll_interval=60) as r:
        old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            t = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                r.pop()
            assert time.monotonic() - t < 5
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def test_events_wake_a_waiter():
    seg = Segment.create(128)
    ev = Event(seg, 64, True)
    flag = []

    def later():
        time.sleep(0.05)
        flag.append(1)
        ev.notify()

    threading.Thread(target=later).start()
    t = time.monotonic()
    assert ev.wait_until(lambda: flag, timeout=5, poll_interval=30)
    assert time.monotonic() - t < 5
    assert ev.wait_until(lambda: False, timeout=0.05) is None
    del ev
    seg.close()


# -- segments ------------------------------------------------------------------------------

def test_segment_views_keep_memory_mapped_after_close():
    seg = Segment.create(4096)
    mv = memoryview(seg)
    mv[:3] = b"abc"
    seg.close()
    assert seg.closed
    assert bytes(mv[:3]) == b"abc"  # still mapped: a view is alive
    assert own_segment_maps()
    mv.release()
    assert not own_segment_maps()
    with pytest.raises(ValueError):
        memoryview(seg)


def test_segment_bad_size():
    with pytest.raises(ValueError):
        Segment.create(0)
    with pytest.raises(TypeError):
        Segment.create("10")


def test_nothing_left_after_garbage_collection():
    r = RingBuffer(16, 64)
    assert own_segment_fds()
    del r
    gc.collect()
    assert not own_segment_fds() and not own_segment_maps()


# -- across processes ------------------------------------------------------------------------

def _echo(inbox, outbox, n):
    for _ in range(n):
        outbox.push(inbox.pop(timeout=30))


def _producer(ring, start, count):
    for i in range(start, start + count):
        ring.push(i.to_bytes(8, "little"), timeout=30)


def test_ping_pong_under_every_start_method(ctx):
    a, b = RingBuffer(4, 64), RingBuffer(4, 64)
    p = ctx.Process(target=_echo, args=(a, b, 200))
    p.start()
    for i in range(200):
        a.push(b"m%d" % i)
        assert b.pop(timeout=30) == b"m%d" % i
    p.join(30)
    assert p.exitcode == 0
    a.close()
    b.close()


def test_many_producers_one_consumer(ctx):
    ring = RingBuffer(64, 8)
    procs = [ctx.Process(target=_producer, args=(ring, k * 5000, 5000)) for k in range(4)]
    for p in procs:
        p.start()
    got = []
    while len(got) < 20000:
        got.extend(int.from_bytes(x, "little") for x in ring.pop_many(64, timeout=30))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sorted(got) == list(range(20000))
    # each producer's entries stay in its own order
    for k in range(4):
        mine = [x for x in got if k * 5000 <= x < (k + 1) * 5000]
        assert mine == sorted(mine)
    ring.close()


def _push_until_closed(ring, results, k):
    pushed = 0
    try:
        while True:
            ring.push(k.to_bytes(4, "little") + pushed.to_bytes(4, "little"), timeout=30)
            pushed += 1
    except RingClosed:
        pass
    results.push(pushed.to_bytes(8, "little"))


@pytest.mark.parametrize("capacity", [1, 4])
def test_shutdown_racing_many_producers_strands_nothing(capacity):
    # Every push that returned must be popped before consumers are told the ring is closed.
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    for attempt in range(3):
        ring, results = RingBuffer(capacity, 8), RingBuffer(8, 8)
        procs = [ctx.Process(target=_push_until_closed, args=(ring, results, k))
                 for k in range(3)]
        for p in procs:
            p.start()
        popped = 0
        t_end = time.monotonic() + 0.2
        while time.monotonic() < t_end:
            popped += len(ring.pop_many(16, timeout=5))
        ring.shutdown()
        try:
            while True:
                popped += len(ring.pop_many(16, timeout=30))
        except RingClosed:
            pass
        for p in procs:
            p.join(30)
        pushed = sum(int.from_bytes(results.pop(timeout=5), "little") for _ in procs)
        assert popped == pushed
        ring.close()
        results.close()


def _attach_and_push(queue_of_handles):
    ring = pickle.loads(queue_of_handles.pop(timeout=30))
    ring.push(b"via /proc")


def test_handle_sent_through_another_ring_attaches_via_proc(ctx):
    # Outside process start-up the handle travels as (pid, fd, inode) and the receiver
    # opens /proc/<pid>/fd/<fd>.
    carrier = RingBuffer(2, 256)
    target = RingBuffer(2, 64)
    p = ctx.Process(target=_attach_and_push, args=(carrier,))
    p.start()
    carrier.push(pickle.dumps(target))
    assert target.pop(timeout=30) == b"via /proc"
    p.join(30)
    assert p.exitcode == 0
    carrier.close()
    target.close()


def test_unlinked_ring_cannot_be_shared_but_still_works():
    r = RingBuffer(2, 8)
    r.unlink()
    with pytest.raises(ValueError, match="unlinked"):
        pickle.dumps(r)
    r.push(b"a")
    assert r.pop() == b"a"
    r.close()


def _sleep_then_push(ring, delay):
    time.sleep(delay)
    ring.push(b"late")


def test_sleeping_consumer_is_woken_across_processes(ctx):
    # poll_interval far longer than the test: only a futex wake can end the pop in time.
    ring = RingBuffer(2, 8, poll_interval=60, spin=0)
    p = ctx.Process(target=_sleep_then_push, args=(ring, 0.3))
    p.start()
    t = time.monotonic()
    assert ring.pop(timeout=30) == b"late"
    assert time.monotonic() - t < 20
    p.join(30)
    ring.close()


def _block_in_pop(ring):
    ring.pop()


def test_a_waiter_killed_while_asleep_does_not_slow_the_ring(ctx):
    ring = RingBuffer(2, 8, spin=0)
    p = ctx.Process(target=_block_in_pop, args=(ring,))
    p.start()
    time.sleep(1.0 if ctx.get_start_method() != "fork" else 0.3)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    with memoryview(ring.segment) as mv:
        word = lambda: int.from_bytes(mv[192:196], "little")   # not_empty event word
        ring.push(b"a")   # one notify clears the dead waiter's flag ...
        ring.pop()
        assert word() & 1 == 0   # ... so later pushes make no futex syscall
    ring.close()


def _create_share_and_sleep(carrier):
    ring = RingBuffer(4, 16)
    ring.push(b"from the creator")
    carrier.push(pickle.dumps(ring))
    time.sleep(60)


def test_creator_sigkilled_leaves_nothing_behind(ctx):
    from conftest import shm_files
    carrier = RingBuffer(2, 256)
    p = ctx.Process(target=_create_share_and_sleep, args=(carrier,))
    p.start()
    ring = pickle.loads(carrier.pop(timeout=30))
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    # The memory outlives its creator for as long as someone maps it ...
    assert ring.pop() == b"from the creator"
    ring.push(b"still works")
    assert ring.pop() == b"still works"
    assert not shm_files()
    # ... and is gone from this process once released here.
    ring.close()
    carrier.close()
    assert not own_segment_fds() and not own_segment_maps()


# -- hostile peers: memory scribbled on or resized by another process --------------------

def test_scribbled_cell_is_reported_not_spun_on():
    with RingBuffer(4, 8) as r:
        with memoryview(r.segment) as mv:
            # cell 0's sequence number (after the 5-line header) jumps ahead of the counter
            mv[320:328] = (10).to_bytes(8, "little")
        with pytest.raises(RuntimeError, match="corrupt"):
            r.push(b"x", block=False)


def test_segments_cannot_be_resized_by_a_peer():
    seg = Segment.create(8192)
    with pytest.raises(PermissionError):
        os.ftruncate(seg.fd, 0)
    with pytest.raises(PermissionError):
        os.ftruncate(seg.fd, 1 << 20)
    seg.close()
