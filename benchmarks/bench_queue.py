"""ShmQueue vs multiprocessing.Queue vs faster_fifo.Queue, and the raw RingBuffer.

    pytest benchmarks/bench_queue.py --benchmark-only

Groups (one table each, implementations side by side):

* ``queue: stream 64 B``      64-byte ``bytes`` messages, producer process -> parent
* ``queue: ping-pong 64 B``   parent -> echo process -> parent, one message in flight
* ``queue: stream 1 MiB <x>`` 1 MiB ``bytes`` / numpy uint8 arrays, producer -> parent; the
  parent reads one byte per 4 KiB page of each message it gets
* ``ring: stream 64 B``       RingBuffer push/pop, and push_many/pop_many of 1000 entries
* ``ring: ping-pong 64 B``    RingBuffer round trip through an echo process

Every round moves a fixed number of messages (``msgs_per_round`` in extra_info); the
derived figures (msgs/s, us per message or round trip, MB/s) are in extra_info and in the
"derived figures" section printed after the tables.

Targets (recorded in extra_info, not asserted):
RingBuffer from Python >= 5M msgs/s (>= 20M with the batch API), round trip <= 5 us;
ShmQueue >= 10x multiprocessing.Queue's streaming rate and <= 1/10 of its round trip.

Queues are built with their defaults (unbounded; ShmQueue: 8192 entries in shared memory,
more are buffered by a feeder thread in the producer, as multiprocessing.Queue does) except
where a message size needs more: ShmQueue slot_size=2 MiB and faster_fifo
max_size_bytes=64 MiB for the 1 MiB groups.  ``shm_bounded`` is ShmQueue(maxsize=1024): the
same ring without the feeder-thread fallback.
"""
import numpy as np
import pytest

import unienv_mp
from .benchutil import IMPLS, MiB, getter, putter, record_rates, warmups

ROUNDS = 20

SMALL = b"x" * 64

# Messages per round: fewer for the slower transports (all figures are per message).
STREAM_N = {"shm": 20_000, "shm_bounded": 20_000, "mp": 5_000, "faster_fifo": 10_000}
PINGPONG_N = {"shm": 2_000, "mp": 500, "faster_fifo": 1_000}
BIG_N = 32
RING_STREAM_N = {"single": 200_000, "batch": 1_000_000}
RING_BATCH = 1000
RING_PINGPONG_N = 10_000

TARGETS = {
    "queue": "ShmQueue >= 10x mp.Queue msgs/s; round trip <= 1/10 of mp.Queue's",
    "ring": "RingBuffer >= 5M msgs/s single, >= 20M msgs/s batch, round trip <= 5 us",
}


def _make(queues, impl, **kw):
    if impl == "shm_bounded":
        return queues("shm", maxsize=1024, **kw)
    return queues(impl, **kw)


def _base(impl):
    return "shm" if impl.startswith("shm") else impl


# ---------------------------------------------------------------------------------------
# workers (forked; they take orders through their Pipe, None = stop)
# ---------------------------------------------------------------------------------------

def _producer(conn, q, impl, payloads):
    """On order (kind, n): put payloads[kind] n times."""
    put = putter(q, impl)
    while True:
        order = conn.recv()
        if order is None:
            break
        kind, n = order
        msg = payloads[kind]
        for _ in range(n):
            put(msg)


def _echo(conn, q_in, q_out, impl):
    """Put back every message until None arrives."""
    get, put = getter(q_in, impl), putter(q_out, impl)
    while True:
        m = get()
        if m is None:
            break
        put(m)


def _ring_producer(conn, ring, mode):
    msg = SMALL
    batch = [msg] * RING_BATCH
    while True:
        n = conn.recv()
        if n is None:
            break
        if mode == "single":
            push = ring.push
            for _ in range(n):
                push(msg)
        else:
            push_many = ring.push_many
            for _ in range(n // RING_BATCH):
                push_many(batch)


def _ring_echo(conn, ring_in, ring_out):
    pop, push = ring_in.pop, ring_out.push
    while True:
        m = pop()
        if m == b"stop":
            break
        push(m)


@pytest.fixture
def rings():
    made = []

    def make(*a, **kw):
        r = unienv_mp.RingBuffer(*a, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


# ---------------------------------------------------------------------------------------
# (a) streaming 64-byte bytes
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["shm", "shm_bounded", "mp", "faster_fifo"])
def test_stream_64B(benchmark, impl, queues, spawn_worker):
    benchmark.group = "queue: stream 64 B"
    q = _make(queues, impl)
    n = STREAM_N[impl]
    w = spawn_worker(_producer, q, _base(impl), {"small": SMALL})
    get = getter(q, _base(impl))

    def one_round():
        w.order(("small", n))
        m = None
        for _ in range(n):
            m = get()
        assert m == SMALL

    for _ in range(warmups(benchmark, 1)):  # feeder threads, page faults
        one_round()
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    record_rates(benchmark, msgs_per_round=n, bytes_per_msg=64, target=TARGETS["queue"])


# ---------------------------------------------------------------------------------------
# (b) ping-pong round trip
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_pingpong_64B(benchmark, impl, queues, spawn_worker):
    benchmark.group = "queue: ping-pong 64 B"
    q_in, q_out = queues(impl), queues(impl)
    n = PINGPONG_N[impl]
    spawn_worker(_echo, q_in, q_out, impl)
    put, get = putter(q_in, impl), getter(q_out, impl)
    spawn_worker.on_stop(lambda: put(None))
    msg = b"p" * 64

    def one_round():
        for _ in range(n):
            put(msg)
            m = get()
        assert m == msg

    for _ in range(warmups(benchmark, 1)):
        one_round()
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    record_rates(benchmark, msgs_per_round=n, round_trips=True, target=TARGETS["queue"])


# ---------------------------------------------------------------------------------------
# (c) 1 MiB payloads
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("payload", ["bytes", "numpy"])
@pytest.mark.parametrize("impl", IMPLS)
def test_stream_1MiB(benchmark, impl, payload, queues, spawn_worker):
    benchmark.group = f"queue: stream 1 MiB {payload}"
    q = queues(impl, slot_size=2 * MiB, max_size_bytes=64 * MiB)
    if payload == "bytes":
        msg = bytes(range(256)) * (MiB // 256)
    else:
        msg = np.arange(MiB, dtype=np.uint64).astype(np.uint8)
    w = spawn_worker(_producer, q, impl, {"big": msg})
    get = getter(q, impl)

    def one_round():
        w.order(("big", BIG_N))
        for _ in range(BIG_N):
            m = get()
            # read one byte per 4 KiB page (a zero-copy view is not free until read)
            assert len(m[::4096]) == 256
            del m  # a ShmQueue view holds its slot until it is gone

    # warm-up: ShmQueue's 64 slots (default n_slots) are memfd pages faulted in on first
    # use, which costs ~10x a steady-state round; 3 rounds of 32 use every slot once
    for _ in range(warmups(benchmark, 3)):
        one_round()
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    record_rates(benchmark, msgs_per_round=BIG_N, bytes_per_msg=MiB,
                 target=TARGETS["queue"],
                 note="consumer reads 1 byte per 4 KiB page; shm numpy = zero-copy view")


# ---------------------------------------------------------------------------------------
# (d) RingBuffer raw
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["single", "batch"])
def test_ring_stream_64B(benchmark, mode, rings, spawn_worker):
    benchmark.group = "ring: stream 64 B"
    ring = rings(8192, 64)
    n = RING_STREAM_N[mode]
    w = spawn_worker(_ring_producer, ring, mode)

    if mode == "single":
        def one_round():
            w.order(n)
            pop = ring.pop
            m = None
            for _ in range(n):
                m = pop()
            assert m == SMALL
    else:
        def one_round():
            w.order(n)
            pop_many = ring.pop_many
            got = 0
            while got < n:
                got += len(pop_many(RING_BATCH))
            assert got == n

    for _ in range(warmups(benchmark, 1)):
        one_round()
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    record_rates(benchmark, msgs_per_round=n, bytes_per_msg=64, target=TARGETS["ring"],
                 api="push/pop" if mode == "single" else f"push_many/pop_many({RING_BATCH})")


def test_ring_pingpong_64B(benchmark, rings, spawn_worker):
    benchmark.group = "ring: ping-pong 64 B"
    a, b = rings(1024, 64), rings(1024, 64)
    n = RING_PINGPONG_N
    spawn_worker(_ring_echo, a, b)
    spawn_worker.on_stop(lambda: a.push(b"stop"))
    push, pop = a.push, b.pop
    msg = b"p" * 64

    def one_round():
        for _ in range(n):
            push(msg)
            m = pop()
        assert m == msg

    for _ in range(warmups(benchmark, 1)):
        one_round()
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    record_rates(benchmark, msgs_per_round=n, round_trips=True, target=TARGETS["ring"])
