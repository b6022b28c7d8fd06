"""ShmQueue: the multiprocessing.Queue interface, every message path, many processes."""
import collections
import multiprocessing as mp
import os
import pickle
import queue
import random
import signal
import struct
import time
import zlib

import numpy as np
import pytest

from unienv_mp import RingClosed
from unienv_mp._transport.shm_queue import ShmQueue

from conftest import own_segment_fds, wait_until

Point = collections.namedtuple("Point", "x y")


# -- interface -----------------------------------------------------------------------------

def test_put_get_and_sizes():
    q = ShmQueue(maxsize=3)
    assert q.empty() and not q.full() and q.qsize() == 0
    q.put(1)
    q.put_nowait("two")
    q.put(b"three")
    assert q.qsize() == 3 and q.full()
    with pytest.raises(queue.Full):
        q.put_nowait(4)
    with pytest.raises(queue.Full):
        q.put(4, timeout=0.05)
    assert [q.get(), q.get_nowait(), q.get(timeout=1)] == [1, "two", b"three"]
    with pytest.raises(queue.Empty):
        q.get_nowait()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    q.close()


def test_round_trips_many_kinds_of_objects():
    import torch
    q = ShmQueue(slot_size=4096, inline_size=64)
    objects = [
        None, 0, -5, 2**100, 1.5, float("inf"), "text", "ünïcode", b"", b"raw bytes",
        bytearray(b"ba"), [1, [2, (3, None)]], (), {"a": 1, "b": [2]}, {1: "int key"},
        Point(1, "y"), {1, 2}, np.float32(3.5), np.arange(7, dtype=np.int16),
        np.zeros((3, 0)), np.array(5.0), {"big": np.arange(10_000, dtype=np.float64)},
        torch.arange(6, dtype=torch.float32).reshape(2, 3), b"x" * 100_000,
        ValueError("an exception"),
    ]
    for obj in objects:
        q.put(obj)
    for obj in objects:
        got = q.get(timeout=5)
        assert type(got) is type(obj)
        if isinstance(obj, np.ndarray):
            assert got.dtype == obj.dtype and np.array_equal(got, obj)
        elif isinstance(obj, dict) and "big" in obj:
            assert np.array_equal(got["big"], obj["big"])
        elif type(obj).__module__ == "torch":
            assert torch.equal(got, obj)
        elif isinstance(obj, ValueError):
            assert got.args == obj.args
        elif obj != obj:
            pass
        else:
            assert got == obj
    q.close()


def test_put_serialises_at_call_time():
    q = ShmQueue()
    data = [1, 2]
    q.put(data)
    data.append(3)
    assert q.get() == [1, 2]
    q.close()


def test_bad_arguments():
    with pytest.raises(ValueError):
        ShmQueue(-1)
    with pytest.raises(TypeError):
        ShmQueue("3")
    with pytest.raises(TypeError):
        ShmQueue(1.5)
    with pytest.raises(ValueError):
        ShmQueue(slot_size=0)
    with pytest.raises(ValueError):
        ShmQueue(n_slots=0)
    q = ShmQueue()
    with pytest.raises(ValueError, match="non-negative"):
        q.put(1, timeout=-1)
    with pytest.raises(ValueError, match="non-negative"):
        q.get(timeout=-1)
    with pytest.raises(Exception):
        q.put(lambda: 0)  # unpicklable
    assert q.empty()      # and nothing half-sent
    q.close()


def test_close_semantics():
    q = ShmQueue()
    q.put(1)
    with pytest.raises(AssertionError, match="not closed"):   # as multiprocessing.Queue
        q.join_thread()
    q.close()
    q.close()
    with pytest.raises(ValueError, match="is closed"):
        q.put(2)
    with pytest.raises(ValueError, match="is closed"):
        q.get()
    assert q.qsize() == 1 and not q.empty()   # sizes still answer after close
    q.join_thread()


# -- slots, spills and zero-copy ------------------------------------------------------------

def test_zero_copy_views_pin_their_slot_until_collected():
    q = ShmQueue(slot_size=8192, n_slots=2, inline_size=64)
    sent = [np.full(1000, i, dtype=np.float64) for i in range(6)]
    q.put(sent[0])
    q.put(sent[1])
    held = [q.get(), q.get()]        # both slots are now pinned by views
    assert all(not a.flags.owndata for a in held)
    q.put(sent[2])                   # no free slot: travels as a spill, nothing overwritten
    q.put(sent[3])
    more = [q.get(), q.get()]
    for a, b in zip(held + more, sent):
        assert np.array_equal(a, b)
    del held, more                   # slots go back to the free ring
    import gc
    gc.collect()
    assert len(q._free) == 2
    q.put(sent[4])
    out = q.get()
    assert np.array_equal(out, sent[4]) and len(q._free) == 1
    del out
    q.close()


def test_copy_mode_frees_slots_at_once():
    q = ShmQueue(slot_size=8192, n_slots=1, inline_size=64, copy=True)
    got = []
    for i in range(5):
        q.put(np.full(1000, i))
        got.append(q.get())
        assert len(q._free) == 1 and got[-1].flags.owndata
    assert [int(a[0]) for a in got] == list(range(5))
    q.close()


def _put_big_and_wait(q, n):
    q.put(np.arange(n, dtype=np.int64))
    q.put("done")


def test_spill_from_another_process_is_delivered(ctx):
    q = ShmQueue(slot_size=4096)
    p = ctx.Process(target=_put_big_and_wait, args=(q, 300_000))
    p.start()
    big = q.get(timeout=60)
    assert q.get(timeout=60) == "done"
    p.join(60)   # the producer could only exit once we had mapped its spill
    assert p.exitcode == 0
    assert np.array_equal(big, np.arange(300_000))
    del big
    q.close()


def _spill_then_die(q):
    q.put(np.zeros(100_000))
    os.kill(os.getpid(), signal.SIGKILL)


def test_message_of_a_killed_producer_is_skipped_with_a_warning(ctx):
    q = ShmQueue(slot_size=4096)
    p = ctx.Process(target=_spill_then_die, args=(q,))
    p.start()
    p.join(60)
    q.put("after")
    with pytest.warns(RuntimeWarning, match="lost"):
        assert q.get(timeout=10) == "after"
    q.close()


def test_a_slow_reader_does_not_cost_a_descriptor_per_message():
    import unienv_mp._transport.shm_queue as qm
    q = ShmQueue(slot_size=8192, n_slots=2, inline_size=64)
    before = len(own_segment_fds())
    for i in range(40):
        q.put(np.full(900, i))           # slot-sized; nobody reads yet
    spills = len(own_segment_fds()) - before
    assert spills <= qm.MAX_PENDING_SPILLS + 2, spills
    got = [int(q.get(timeout=30)[0]) for _ in range(40)]
    assert got == list(range(40))
    q.close()
    q.join_thread()


def _keep_all_forever(q, n, out):
    kept = [q.get(timeout=30) for _ in range(n)]   # holds every slot it is sent
    out.put([int(a[0]) for a in kept])


def _put_arrays(q, n):
    for i in range(n):
        q.put(np.full(4096, i, dtype=np.int64))    # 32 KiB: fits a slot


def test_a_reader_keeping_every_array_still_gets_every_message(ctx):
    # Slots all held, spills up to the limit: the producer must notice that its spills
    # have been read and go on spilling, rather than wait for a slot that never comes.
    import unienv_mp._transport.shm_queue as qm
    n = 4 + qm.MAX_PENDING_SPILLS + 20
    q = ShmQueue(slot_size=64 << 10, n_slots=4)
    out = ShmQueue()
    p = ctx.Process(target=_put_arrays, args=(q, n))
    p.start()
    time.sleep(0.5)                                 # the producer gets ahead
    c = ctx.Process(target=_keep_all_forever, args=(q, n, out))
    c.start()
    assert out.get(timeout=60) == list(range(n))
    c.join(30)
    p.join(30)
    assert (c.exitcode, p.exitcode) == (0, 0)
    q.close()
    out.close()


# -- slots and locks across process exit and fork ------------------------------------------

_kept = []


def _take_and_keep(q, n):
    for _ in range(n):
        _kept.append(q.get(timeout=30))   # held until the process ends


def test_slots_held_by_a_process_that_exits_come_back_once(ctx):
    q = ShmQueue(slot_size=8192, n_slots=4, inline_size=64)
    for i in range(3):
        q.put(np.full(900, i))           # each in a slot
    p = ctx.Process(target=_take_and_keep, args=(q, 3))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    # The process is gone: its slots came back, each once (a second give-back, e.g. from
    # a lease freed at interpreter teardown, would let two messages share a slot).
    assert len(q._free) == 4
    for i in range(4):
        q.put(np.full(900, 10 + i))
    held = [q.get(timeout=10) for _ in range(4)]
    assert [int(a[0]) for a in held] == [10, 11, 12, 13]
    assert all((a == a[0]).all() for a in held)
    del held
    q.close()


def _drop_inherited(cache):
    cache.clear()
    import gc
    gc.collect()


def test_a_forked_child_dropping_inherited_arrays_leaves_the_parents_slots_alone():
    q = ShmQueue(slot_size=64 << 10, n_slots=2)
    q.put(np.full(4096, 7, dtype=np.int64))
    cache = [q.get(timeout=5)]                     # the parent holds one slot
    assert len(q._free) == 1
    p = mp.get_context("fork").Process(target=_drop_inherited, args=(cache,))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    pid = os.fork()
    if pid == 0:                                   # a bare os.fork child too
        try:
            _drop_inherited(cache)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert len(q._free) == 1
    for i in range(2):
        q.put(np.full(4096, 100 + i, dtype=np.int64))
    assert (cache[0] == 7).all()
    assert [int(q.get(timeout=5)[0]) for _ in range(2)] == [100, 101]
    del cache
    q.close()


def test_a_child_made_by_os_fork_gives_back_the_slots_it_receives():
    q = ShmQueue(maxsize=8, n_slots=2, slot_size=4096)
    pid = os.fork()
    if pid == 0:
        try:
            for _ in range(3):
                a = q.get(timeout=10)
                del a                              # its slot goes back
        finally:
            os._exit(0)
    for _ in range(3):
        q.put(np.zeros(200))                       # 1600 B: in a slot
    os.waitpid(pid, 0)
    assert len(q._free) == 2
    q.close()


def _noop():
    pass


def test_fork_while_another_thread_holds_the_spill_lock():
    import unienv_mp._transport.shm_queue as qm
    qm._spill_lock.acquire()
    try:
        p = mp.get_context("fork").Process(target=_noop)
        p.start()
        p.join(20)
        assert p.exitcode == 0, "the child deadlocked on a lock held at fork time"
    finally:
        qm._spill_lock.release()


# -- unbounded puts and the feeder thread ---------------------------------------------------

def _flood(q, n):
    for i in range(n):
        q.put(i)


def test_unbounded_put_never_blocks_and_child_flushes_before_exit(ctx, monkeypatch):
    import unienv_mp._transport.shm_queue as qm
    monkeypatch.setattr(qm, "DEFAULT_CAPACITY", 16)
    q = ShmQueue()
    assert q._capacity == 16
    p = ctx.Process(target=_flood, args=(q, 2000))
    p.start()
    time.sleep(0.3)
    assert p.is_alive()   # still flushing its buffer: nobody has read yet
    got = [q.get(timeout=30) for _ in range(2000)]
    p.join(30)
    assert p.exitcode == 0 and got == list(range(2000))
    q.close()


def test_unbounded_put_in_this_process_buffers_locally():
    import unienv_mp._transport.shm_queue as qm
    q = ShmQueue()
    n = qm.DEFAULT_CAPACITY + 500
    for i in range(n):
        q.put_nowait(i)   # never raises Full
    assert q.qsize() == n
    assert [q.get(timeout=5) for _ in range(n)] == list(range(n))
    q.close()
    q.join_thread()


def _flood_and_cancel(q):
    q.cancel_join_thread()
    for i in range(5000):
        q.put(i)


def test_cancel_join_thread_lets_a_process_exit_with_data_unsent(ctx, monkeypatch):
    import unienv_mp._transport.shm_queue as qm
    monkeypatch.setattr(qm, "DEFAULT_CAPACITY", 16)
    q = ShmQueue()
    p = ctx.Process(target=_flood_and_cancel, args=(q,))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    assert q.qsize() <= 16
    q.close()


def _fill_then_spill_via_feeder(q, n_small, n_big):
    for i in range(n_small):
        q.put(i)                                   # fills the ring: the feeder starts
    for i in range(n_big):
        q.put(np.full(64 << 10, i, dtype=np.uint8))  # larger than a slot: spills


def test_spills_sent_by_the_feeder_are_waited_for_at_exit(ctx, monkeypatch):
    import unienv_mp._transport.shm_queue as qm
    monkeypatch.setattr(qm, "DEFAULT_CAPACITY", 8)
    q = ShmQueue(slot_size=4096, n_slots=2)
    p = ctx.Process(target=_fill_then_spill_via_feeder, args=(q, 8, 5))
    p.start()
    time.sleep(0.5)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")             # "a message was lost" fails the test
        got = [q.get(timeout=30) for _ in range(13)]
    p.join(30)
    assert p.exitcode == 0
    assert got[:8] == list(range(8))
    assert [int(a[0]) for a in got[8:]] == list(range(5))
    del got
    q.close()


def test_dropping_a_queue_with_unread_spills_does_not_block(monkeypatch):
    import threading
    import unienv_mp._transport.shm_queue as qm
    monkeypatch.setattr(qm, "DEFAULT_CAPACITY", 2)
    q = ShmQueue(slot_size=4096)
    big = np.zeros(10_000)                         # 80 kB: a spill
    for _ in range(3):
        q.put(big)                                 # the third waits for the feeder
    q.get(timeout=5)                               # room: the feeder sends it
    q.close()                                      # ... and then ends
    q._thread.join(10)
    assert not q._thread.is_alive() and len(q._msgs) == 2
    box = [q]
    del q
    dropper = threading.Thread(target=box.clear, daemon=True)  # drops the last reference
    dropper.start()
    dropper.join(10)
    try:
        assert not dropper.is_alive(), "dropping the queue waited for its unread spills"
    finally:
        with qm._spill_lock:                       # nobody will read them: let them go
            for item in qm._pending_spills:
                item[0].close()
            qm._pending_spills.clear()


# -- shutdown ------------------------------------------------------------------------------

def test_shutdown_is_seen_by_every_process_handle():
    q = ShmQueue()
    q2 = pickle.loads(pickle.dumps(q))
    q.put("last")
    q.shutdown()
    assert q2.get() == "last"
    with pytest.raises(RingClosed):
        q2.get(timeout=1)
    with pytest.raises(RingClosed):
        q2.put(1)
    q.close()
    q2.close()


def test_put_after_shutdown_raises_even_with_messages_buffered(monkeypatch):
    import unienv_mp._transport.shm_queue as qm
    monkeypatch.setattr(qm, "DEFAULT_CAPACITY", 4)
    q = ShmQueue()
    for i in range(6):
        q.put(i)                                   # 4 in the ring, 2 with the feeder
    q.shutdown()
    q._thread.join(10)
    assert not q._thread.is_alive()
    with pytest.raises(RingClosed):
        q.put("after")
    assert q.qsize() == 4                          # the ring's; the feeder's were dropped
    assert [q.get(timeout=5) for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(RingClosed):
        q.get(timeout=5)
    q.close()
    q.join_thread()


def _spill_then_shut_down(q):
    q.put(np.arange(1 << 18, dtype=np.int64))      # 2 MiB: a spill
    q.shutdown()


def test_a_spill_put_before_shutdown_is_drained_by_a_slow_reader(ctx):
    q = ShmQueue()
    p = ctx.Process(target=_spill_then_shut_down, args=(q,))
    p.start()
    assert wait_until(lambda: q._msgs.is_shutdown, timeout=30)
    time.sleep(1.5)                                # a slow reader
    assert p.is_alive()                            # it waits for us, as mp.Queue would
    got = q.get(timeout=10)
    assert np.array_equal(got, np.arange(1 << 18))
    with pytest.raises(RingClosed):
        q.get(timeout=5)
    p.join(30)
    assert p.exitcode == 0
    del got
    q.close()


# -- many producers, many consumers ----------------------------------------------------------

def _make_message(rng, producer, seq):
    r = rng.random()
    if r < 0.01:
        size = rng.randrange(5000, 20000)     # larger than a slot: spill
    elif r < 0.3:
        size = rng.randrange(64, 4000)        # a slot
    else:
        size = rng.randrange(0, 48)           # inline
    body = rng.randbytes(size)
    head = struct.pack("<IIII", producer, seq, zlib.crc32(body), size)
    if r > 0.95:
        return {"head": np.frombuffer(head, dtype=np.uint8).copy(),
                "body": np.frombuffer(body, dtype=np.uint8).copy()}
    return head + body


def _stress_producer(q, producer, count, seed):
    rng = random.Random(seed)
    for seq in range(count):
        q.put(_make_message(rng, producer, seq))


def _stress_consumer(q, results):
    seen, bad = [], 0
    while True:
        msg = q.get(timeout=120)
        if msg is None:
            break
        if isinstance(msg, dict):
            msg = msg["head"].tobytes() + msg["body"].tobytes()
        producer, seq, crc, size = struct.unpack_from("<IIII", msg)
        body = msg[16:]
        if len(body) != size or zlib.crc32(body) != crc:
            bad += 1
        seen.append((producer, seq))
    results.put((seen, bad))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_stress_4_producers_2_consumers_100k_messages(method):
    ctx = mp.get_context(method)
    q = ShmQueue(maxsize=256, slot_size=4096, inline_size=64, n_slots=32)
    results = ctx.Queue()
    n_prod, n_cons, per = 4, 2, 25_000
    consumers = [ctx.Process(target=_stress_consumer, args=(q, results)) for _ in range(n_cons)]
    producers = [ctx.Process(target=_stress_producer, args=(q, k, per, 1000 + k))
                 for k in range(n_prod)]
    for p in consumers + producers:
        p.start()
    for p in producers:
        p.join(300)
        assert p.exitcode == 0
    for _ in range(n_cons):
        q.put(None)
    seen, bad = [], 0
    for _ in range(n_cons):
        s, b = results.get(timeout=300)
        seen += s
        bad += b
    for p in consumers:
        p.join(60)
        assert p.exitcode == 0
    assert bad == 0, f"{bad} corrupted messages"
    assert len(seen) == n_prod * per, "lost or duplicated messages"
    assert sorted(seen) == [(k, s) for k in range(n_prod) for s in range(per)]
    # every consumer saw each producer's messages in the order they were put
    q.close()


def _stream_batches(q, n):
    rng = np.random.default_rng(0)
    for i in range(n):
        q.put({"obs": rng.random((64, 32), dtype=np.float32), "i": i})
    q.put(None)


def test_10k_batches_through_a_queue_keep_memory_and_slots_flat():
    import gc
    q = ShmQueue(maxsize=8, slot_size=16384, n_slots=8, inline_size=64)
    p = mp.get_context("fork").Process(target=_stream_batches, args=(q, 10_000))
    p.start()
    rss, got = [], 0
    while True:
        b = q.get(timeout=60)
        if b is None:
            break
        assert b["i"] == got and b["obs"].shape == (64, 32)
        got += 1
        del b
        if got % 1000 == 0:
            gc.collect()
            with open("/proc/self/statm") as f:
                rss.append(int(f.read().split()[1]))
    p.join(30)
    assert got == 10_000
    assert len(q._free) == 8              # every slot came back
    assert max(rss[5:]) <= max(rss[:5]) + 2560, rss   # no growth beyond 10 MiB of noise
    q.close()
