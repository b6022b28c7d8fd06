"""The transport's API as a user's code calls it: tests/test_typing.py type-checks this file
with ``mypy --strict`` (the types it asserts are those of the stubs) and runs it.

Lines marked ``# type: ignore[...]`` must be rejected by the type checker: with
``warn_unused_ignores`` (part of --strict), a stub that accepted them would fail the check.
"""
import queue
from typing import Any

import numpy as np
from typing_extensions import assert_type

import unienv_mp
from unienv_mp import CodecError, MultiProcessingSampleManager, MultiprocessingSampler, PeerGoneError, RingBuffer, RingClosed, Segment, ShmQueue, WorkerDiedError, WorkerError, worker_loop, wrap_epoch_iter_function, wrap_sample_function
from unienv_mp._transport.codec import SlotLease, decode, encode, prepare, write
from unienv_mp._transport.ring import DEFAULT_POLL_INTERVAL, Event, now_ns
from unienv_mp._direct.rows import gather_rows


def ring_round_trip() -> None:
    with RingBuffer(8, 64, poll_interval=DEFAULT_POLL_INTERVAL, spin=0.0) as ring:
        assert_type(ring.capacity, int)
        assert_type(ring.entry_size, int)
        assert_type(ring.closed, bool)
        ring.push(b"one")
        ring.push(bytearray(b"two"), timeout=0.5, check=lambda: None)
        ring.push_nowait(memoryview(b"three"))
        assert_type(ring.push_many([b"four", b"five"], block=False), int)
        assert_type(len(ring), int)
        assert_type(ring.pop(), bytes)
        assert_type(ring.pop_nowait(), bytes)
        assert_type(ring.pop_many(8, block=False), list[bytes])
        ring.push_tagged(1, 2, 3, b"payload")
        tag, aux, value, payload = ring.pop_tagged(timeout=1.0)
        assert_type(payload, bytes)
        assert (tag, aux, value, payload) == (1, 2, 3, b"payload")
        try:
            ring.pop(block=False)
        except queue.Empty:
            pass
        ring.shutdown()
        assert_type(ring.is_shutdown, bool)
        try:
            ring.push(b"late")
        except RingClosed:
            pass


def segment_and_event() -> None:
    seg = Segment.create(4096, tag="usage")
    assert_type(seg.size, int)
    assert_type(seg.name, str)
    view = memoryview(seg)
    view[:4] = b"abcd"
    view.release()
    doorbell = Event(seg, 0, True)
    doorbell.notify()
    assert_type(doorbell.wait_until(lambda: 7, timeout=0.0), int | None)
    del doorbell
    seg.close()
    assert_type(now_ns(), int)


def codec_round_trip() -> None:
    obj = {"a": np.arange(4), "b": [1.0, "x"]}
    p = prepare(obj)
    assert_type(p.nbytes, int)
    slot = bytearray(p.nbytes)
    assert_type(write(p, slot), int)
    lease = SlotLease(slot, 0, p.nbytes)
    out: Any = decode(lease, copy=True)
    assert out["b"] == [1.0, "x"]
    assert_type(encode(obj), bytearray)
    try:
        decode(b"\0" * 64)
    except CodecError:
        pass


def rows() -> None:
    table = np.arange(12, dtype=np.uint8)
    out = bytearray(6)
    gather_rows(table, 3, np.array([3, 1], dtype=np.int64), out)
    assert bytes(out) == bytes([9, 10, 11, 3, 4, 5])


def queue_round_trip() -> None:
    q = ShmQueue(4, slot_size=1 << 16, copy=True)
    q.put({"x": np.ones(3)}, timeout=1.0)
    q.put_nowait("text")
    assert_type(q.qsize(), int)
    assert_type(q.maxsize, int)
    got = q.get(timeout=1.0)
    assert got["x"].tolist() == [1.0, 1.0, 1.0]
    assert q.get_nowait() == "text"
    assert_type(q.empty(), bool)
    q.close()
    q.join_thread()


def names() -> None:
    assert_type(unienv_mp.__version__, str)
    for cls in (WorkerError, WorkerDiedError, PeerGoneError):
        assert issubclass(cls, Exception)
    for lazy in (MultiprocessingSampler, MultiProcessingSampleManager, worker_loop,
                 wrap_sample_function, wrap_epoch_iter_function):
        assert lazy.__module__.startswith("unienv_mp.")


def _rejected(ring: RingBuffer, q: ShmQueue) -> None:
    """Never called: calls that the stubs must refuse."""
    ring.push("text")  # type: ignore[arg-type]
    ring.push(b"x", check=1)  # type: ignore[arg-type]
    ring.pop_many("8")  # type: ignore[arg-type]
    ring.pop(True, 1.0, None)  # type: ignore[call-arg]
    ring.push_tagged(1, 2, 3, record=set())  # type: ignore[arg-type]
    entries: list[bytes] = []
    ring.pop_tagged(into=entries)  # type: ignore[arg-type]
    x: str = ring.pop()  # type: ignore[assignment]
    Segment.create("4096")  # type: ignore[arg-type]
    RingBuffer(8, 64, 0.1)  # type: ignore[call-arg]
    q.put(1, timeout="soon")  # type: ignore[arg-type]
    ring.no_such_method()  # type: ignore[attr-defined]


if __name__ == "__main__":
    ring_round_trip()
    segment_and_event()
    codec_round_trip()
    rows()
    queue_round_trip()
    names()
    print("usage ok")
