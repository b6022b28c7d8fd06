"""ShmQueue: a drop-in for `multiprocessing.Queue` on a shared-memory ring.

One shared segment holds three things:

* the *message ring*: every ``put`` is one entry (a 16-byte header saying what kind of
  message, which slot, how many bytes; small messages travel inline in the entry);
* the *free ring* of slot numbers, shared by all producers;
* the *slots*: fixed blocks that carry messages too large to go inline.

A message larger than a slot, or sent while every slot is taken, travels in a one-off
segment of its own ("spill"): the receiver maps it through ``/proc/<sender>/fd``, so the
sender keeps it until the receiver says it has mapped it.

numpy arrays and torch tensors travel through the slot codec (no pickling of array data)
and, unless the queue was made with ``copy=True``, come out as views of the slot, which
goes back to the free ring when the last of them is garbage collected.
"""
import collections
import os
import pickle
import queue as _queue
import sys
import threading
import time
import warnings
import weakref
from multiprocessing import util as _mputil
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np

from .._validate import check_int
from ..errors import CodecError, PeerGoneError, RingClosed
from . import codec as _codec
from . import protocol as P
from .ring import (DEFAULT_POLL_INTERVAL, DEFAULT_SPIN, RingBuffer, Segment,
                   segment_from_peer)

__all__ = ["ShmQueue"]

_PAGE = 4096

#: Spills a process may have waiting for receivers before it waits for a free slot instead.
MAX_PENDING_SPILLS = 16

#: Default number of entries when ``maxsize`` is 0 (beyond it, puts are buffered locally
#: and sent by a feeder thread, as multiprocessing.Queue does).
DEFAULT_CAPACITY = 8192


def _align(n, a):
    return (n + a - 1) // a * a


def _torch_tensor_type():
    torch = sys.modules.get("torch")
    return None if torch is None else torch.Tensor


class ShmQueue:
    """A process-shared FIFO with the interface of `multiprocessing.Queue`.

    ``put``/``get`` (and ``put_nowait``/``get_nowait``) raise `queue.Full` and `queue.Empty`
    as the standard library does; ``qsize``, ``empty``, ``full``, ``close``, ``join_thread``
    and ``cancel_join_thread`` behave as documented for `multiprocessing.Queue`.  Any number
    of processes may put and get, under fork, spawn and forkserver; pass the queue to them
    as a ``Process`` argument (or inherit it).

    Args:
        maxsize: most messages in the queue; ``put`` blocks (or raises ``queue.Full``) when
            it holds that many.  ``0`` (the default) means unbounded, as for
            ``multiprocessing.Queue``: up to ``DEFAULT_CAPACITY`` messages sit in shared
            memory and further ones are buffered in the putting process and sent by a
            feeder thread.
        ctx: a multiprocessing context; accepted for compatibility (shared memory works
            with every start method).
        slot_size: bytes per slot; encoded messages up to this size (and larger than
            ``inline_size``) are written into a slot, larger ones into a one-off segment.
        n_slots: number of slots (default: ``min(capacity, 64)``).
        inline_size: messages whose encoding is at most this many bytes travel inside the
            ring entry itself.
        copy: ``False`` (default): arrays received are zero-copy views of the slot that
            carried them, and the slot is reused only after they are garbage collected.
            ``True``: arrays are copied out and the slot is freed at once.
        poll_interval: see [`RingBuffer`][unienv_mp.RingBuffer].
        spin: see [`RingBuffer`][unienv_mp.RingBuffer].

    Messages are serialised when ``put`` is called (``multiprocessing.Queue`` pickles
    later, in its feeder thread), so changing an object after putting it never changes
    what the receiver gets.  A process that put a message too large for a slot and exits
    waits (at exit) until a receiver has mapped it, as ``multiprocessing.Queue`` waits
    until its buffered data reaches the pipe; ``cancel_join_thread`` turns that off.
    """

    def __init__(self, maxsize: int = 0, *, ctx: BaseContext | None = None,
                 slot_size: int = 1 << 20, n_slots: int | None = None, inline_size: int = 256,
                 copy: bool = False, poll_interval: float = DEFAULT_POLL_INTERVAL,
                 spin: float = DEFAULT_SPIN) -> None:
        maxsize = check_int(maxsize, "maxsize", 0)
        slot_size = check_int(slot_size, "slot_size", 1)
        inline_size = check_int(inline_size, "inline_size", 0)
        capacity = maxsize if maxsize > 0 else DEFAULT_CAPACITY
        if n_slots is None:
            n_slots = min(capacity, 64)
        n_slots = check_int(n_slots, "n_slots", 1)
        if inline_size > 1 << 20:
            raise ValueError(f"inline_size must be <= 1 MiB, got {inline_size}")
        slot_size = _align(slot_size, _PAGE)
        msg_entry = _align(P.ENTRY_HEADER + inline_size, 8)
        msg_bytes = RingBuffer.footprint(capacity, msg_entry)
        free_bytes = RingBuffer.footprint(n_slots, 8)
        msg_off = 64
        free_off = msg_off + msg_bytes
        slots_off = _align(free_off + free_bytes, _PAGE)
        total = slots_off + n_slots * slot_size
        seg = Segment.create(total, "queue")
        try:
            mv = memoryview(seg)
            P.QUEUE_HEADER.pack_into(mv, 0, P.QUEUE_MAGIC, P.QUEUE_VERSION, capacity,
                                     n_slots, slot_size, inline_size, msg_off, free_off,
                                     slots_off)
            mv.release()
            msgs = RingBuffer.create_in(seg, msg_off, capacity, msg_entry, poll_interval,
                                        spin)
            free = RingBuffer.create_in(seg, free_off, n_slots, 8, poll_interval, spin)
            free.push_many([i.to_bytes(8, "little") for i in range(n_slots)], block=False)
        except BaseException:
            seg.close()
            raise
        self._setup(seg, maxsize, ctx, copy, poll_interval, spin, msgs, free)

    # -- construction, pickling, fork ------------------------------------------------------

    def _setup(self, seg, maxsize, ctx, copy, poll_interval, spin, msgs=None, free=None):
        (magic, version, capacity, n_slots, slot_size, inline_size, msg_off, free_off,
         slots_off) = P.QUEUE_HEADER.unpack_from(seg, 0)
        if magic != P.QUEUE_MAGIC or version != P.QUEUE_VERSION:
            raise ValueError(f"segment {seg.name!r} does not hold a ShmQueue")
        self._seg = seg
        self._maxsize = maxsize
        self._ctx = ctx
        self._copy = bool(copy)
        self._poll_interval = poll_interval
        self._spin = spin
        self._capacity = capacity
        self._n_slots = n_slots
        self._slot_size = slot_size
        self._inline = inline_size
        self._slots_off = slots_off
        self._msgs = msgs if msgs is not None else RingBuffer.attach(seg, msg_off,
                                                                     poll_interval, spin)
        self._free = free if free is not None else RingBuffer.attach(seg, free_off,
                                                                     poll_interval, spin)
        self._reset_local()
        _mputil.register_after_fork(self, ShmQueue._reset_local)

    def _reset_local(self):
        """State private to one process: what this process put but could not send yet."""
        self._closed = False
        self._joincancelled = False
        self._buffer = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._thread = None
        self._jointhread = None
        self._sender = _Sender(self._msgs, self._free, self._seg, self._inline,
                               self._slot_size, self._slots_off)
        self._release_slot = _SlotReleaser(self._free)
        _ensure_spill_hook()

    def __getstate__(self):
        if self._seg.closed:
            raise ValueError(f"cannot share closed queue {self!r}")
        return (self._seg, self._maxsize, self._copy, self._poll_interval, self._spin)

    def __setstate__(self, state):
        seg, maxsize, copy, poll_interval, spin = state
        self._setup(seg, maxsize, None, copy, poll_interval, spin)

    # -- put -------------------------------------------------------------------------------

    def put(self, obj: object, block: bool = True, timeout: float | None = None) -> None:
        """Put ``obj`` (any picklable object) on the queue.  If the queue is bounded and
        full, block (at most ``timeout`` seconds) until there is room, else raise
        `queue.Full`.  Raises ``ValueError`` after [`close`][unienv_mp.ShmQueue.close]."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        enc, data = self._serialize(obj)
        if self._maxsize > 0:
            self._sender.send(enc, data, block, timeout)
            return
        # Unbounded: never block.  Send directly while nothing is waiting locally (to keep
        # order), else leave the message to the feeder thread.
        if self._msgs.is_shutdown:
            raise RingClosed("the queue was shut down")
        if not self._buffer:
            try:
                self._sender.send(enc, data, False, None)
                return
            except _queue.Full:
                pass
        if isinstance(data, _codec.Prepared):
            data = _codec.encode_prepared(data)  # freeze it: the caller may change obj
        with self._cond:
            # (again under the lock: a feeder that met the shutdown empties the buffer
            # under it, and would never send what we add after that)
            if self._msgs.is_shutdown:
                raise RingClosed("the queue was shut down")
            self._buffer.append((enc, data))
            if self._thread is None:
                self._start_thread()
            self._cond.notify()

    def put_nowait(self, obj: object) -> None:
        """``put(obj, block=False)``."""
        return self.put(obj, False)

    def _serialize(self, obj):
        t = type(obj)
        if t is bytes:
            return P.ENC_BYTES, obj
        tensor = _torch_tensor_type()
        if (t is np.ndarray or t is dict or t is list or t is tuple
                or (tensor is not None and isinstance(obj, tensor))
                or (isinstance(obj, tuple) and hasattr(t, "_fields"))):
            try:
                return P.ENC_CODEC, _codec.prepare(obj)
            except (CodecError, RecursionError) as e:
                if "on the CPU" in str(e):
                    raise
                # e.g. a self-referencing or very deep container: pickle copes with it
        return P.ENC_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    # -- feeder thread ---------------------------------------------------------------------

    def _start_thread(self):
        self._thread = threading.Thread(
            target=_feed, args=(self._buffer, self._cond, self._sender),
            name="ShmQueue feeder", daemon=True)
        self._thread.start()
        if not self._joincancelled:
            self._jointhread = _mputil.Finalize(
                self._thread, ShmQueue._finalize_join,
                [weakref.ref(self._thread), self._sender.policy], exitpriority=-5)
        # At exit, or when the queue is garbage collected, tell the feeder to stop once it
        # has sent what is buffered (the feeder holds the sender, not the queue).
        self._close_feeder = _mputil.Finalize(self, _stop_feeder, [self._buffer, self._cond],
                                              exitpriority=10)

    @staticmethod
    def _finalize_join(twr, policy):
        thread = twr()
        if thread is not None:
            thread.join()
        # At exit, the feeder may have spilled while we joined it: wait for those here.
        # (Not when the thread object is merely garbage collected: that must not block.)
        if _mputil._exiting and not policy.cancelled:
            _wait_for_spills(policy)

    # -- get -------------------------------------------------------------------------------

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Remove and return the oldest message, blocking (at most ``timeout`` seconds)
        until there is one, else raise `queue.Empty`.  Raises ``ValueError`` after
        [`close`][unienv_mp.ShmQueue.close]."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        if _pending_spills:
            _reap_spills()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            tag, slot, n, payload = self._msgs.pop_tagged(block, left)
            try:
                return self._receive(tag, slot, n, payload)
            except PeerGoneError:
                warnings.warn("a ShmQueue message was lost: the process that put it exited "
                              "before it could be read", RuntimeWarning, stacklevel=2)

    def get_nowait(self) -> Any:
        """``get(block=False)``."""
        return self.get(False)

    def _receive(self, tag, slot, n, payload):
        enc, where = P.untag(tag)
        if where == P.AT_INLINE:
            if enc == P.ENC_BYTES:
                return payload
            if enc == P.ENC_PICKLE:
                return pickle.loads(payload)
            return _codec.decode(payload, copy=True)
        if where == P.AT_SLOT:
            if slot >= self._n_slots or n > self._slot_size:
                raise ValueError(f"corrupt queue entry: slot {slot}, {n} bytes")
            release = self._release_slot
            if release.pid != os.getpid():   # a child made by os.fork (no after-fork hook)
                release = self._release_slot = _SlotReleaser(self._free)
            lease = _codec.SlotLease(self._seg, self._slots_off + slot * self._slot_size, n,
                                     release, slot)
            release.leased(slot)
        elif where == P.AT_SPILL:
            pid, fd, ino, size = P.QUEUE_SPILL_DESC.unpack(payload)
            seg = _open_spill(pid, fd, ino, size)
            lease = _codec.SlotLease(seg, P.QUEUE_SPILL_DATA, n)
            seg.unlink()
        else:
            raise ValueError(f"corrupt queue entry: tag {tag:#x}")
        if enc == P.ENC_BYTES:
            return bytes(lease)
        if enc == P.ENC_PICKLE:
            return pickle.loads(lease)
        return _codec.decode(lease, copy=self._copy)

    # -- size and lifecycle ---------------------------------------------------------------

    def qsize(self) -> int:
        """Approximate number of messages in the queue (those in shared memory, plus those
        this process buffered locally)."""
        buffered = len(self._buffer)
        if buffered and self._buffer[-1] is _STOP:
            buffered -= 1
        return len(self._msgs) + buffered

    def empty(self) -> bool:
        """True if the queue looks empty (approximate, as for multiprocessing.Queue)."""
        return self.qsize() == 0

    def full(self) -> bool:
        """True if a bounded queue looks full (approximate)."""
        return self._maxsize > 0 and len(self._msgs) >= self._maxsize

    @property
    def maxsize(self) -> int:
        """The ``maxsize`` the queue was made with (0: unbounded)."""
        return self._maxsize

    def close(self) -> None:
        """Indicate that this process will put no more data: buffered messages are still
        sent by the feeder thread, which then ends.  ``get`` and ``put`` raise
        ``ValueError`` afterwards in this process.  Other processes are unaffected."""
        if self._closed:
            return
        self._closed = True
        if _pending_spills:
            _reap_spills()
        if self._thread is not None:
            self._close_feeder()   # the feeder sends what is buffered, then ends
        # The shared memory stays mapped (qsize() keeps working) until the queue is
        # garbage collected or the process ends.

    def join_thread(self) -> None:
        """Wait for the feeder thread (and for receivers to map any spilled message) after
        [`close`][unienv_mp.ShmQueue.close], as `multiprocessing.Queue.join_thread`."""
        # AssertionError, as multiprocessing.Queue.join_thread raises
        assert self._closed, f"Queue {self!r} not closed"
        if self._thread is not None:
            self._thread.join()
        if not self._joincancelled:
            _wait_for_spills(self._sender.policy)

    def cancel_join_thread(self) -> None:
        """Do not wait for buffered or spilled messages when this process exits."""
        self._joincancelled = True
        self._sender.policy.cancelled = True
        if self._jointhread is not None:
            self._jointhread.cancel()

    def shutdown(self) -> None:
        """Mark the queue closed for *every* process: blocked ``get`` calls everywhere raise
        [`RingClosed`][unienv_mp.RingClosed] once it is drained, and ``put`` raises it.
        Messages a feeder thread still buffered (``maxsize=0``) are dropped."""
        self._msgs.shutdown()
        self._free.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._msgs)} messages"
        return f"<ShmQueue maxsize={self._maxsize} {state}>"


class _Sender:
    """What a feeder thread needs to send a serialised message: held by the queue and by its
    feeder thread, so that buffered messages are still sent after the queue object itself
    is garbage collected (as multiprocessing.Queue's feeder does)."""

    def __init__(self, msgs, free, seg, inline, slot_size, slots_off):
        self.msgs = msgs
        self.free = free
        self.seg = seg
        self.inline = inline
        self.slot_size = slot_size
        self.slots_off = slots_off
        self.policy = _JoinPolicy()

    def send(self, enc, data, block, timeout):
        """Route one serialised message: inline, through a slot, or through a spill.
        ``timeout`` bounds the whole call (waiting for a slot and for ring room)."""
        if _pending_spills:
            _reap_spills()
        deadline = None if (timeout is None or not block) else time.monotonic() + timeout
        prepared = isinstance(data, _codec.Prepared)
        n = data.nbytes if prepared else len(data)
        if n <= self.inline:
            payload = _codec.encode_prepared(data) if prepared else data
            self.msgs.push_tagged(P.tag(enc, P.AT_INLINE), 0, n, payload, block, timeout)
            return
        slot = None
        if n <= self.slot_size:
            try:
                slot = int.from_bytes(self.free.pop(False), "little")
            except _queue.Empty:
                # Every slot is queued or held by a receiver's arrays.  A few messages may
                # go as spills (so that receivers holding arrays never block us for good);
                # beyond that, wait for a slot like a full queue (each spill holds a
                # descriptor until it is read).
                slot = self._wait_for_slot(block, deadline)
        if slot is None:
            self.send_spill(enc, data, n, block, _left(deadline))
            return
        pushed = False
        try:
            off = self.slots_off + slot * self.slot_size
            with memoryview(self.seg) as mv:
                dest = mv[off:off + n]
                if prepared:
                    _codec.write(data, dest)
                else:
                    dest[:] = data
                dest.release()
            self.msgs.push_tagged(P.tag(enc, P.AT_SLOT), slot, n, b"", block,
                                  _left(deadline))
            pushed = True
        finally:
            if not pushed:  # the entry never went out: nobody else will free the slot
                self.free.push(slot.to_bytes(8, "little"), False)

    def _wait_for_slot(self, block, deadline):
        """A free slot's number, or None when spilling is allowed (fewer than
        MAX_PENDING_SPILLS of this process's spills are unread).  Both are re-checked every
        few milliseconds: receivers may read our spills while holding every slot."""
        while True:
            if _reap_spills() < MAX_PENDING_SPILLS:
                return None
            left = _left(deadline)
            if not block or left == 0:
                raise _queue.Full
            try:
                return int.from_bytes(
                    self.free.pop(True, _SLOT_WAIT if left is None else min(left, _SLOT_WAIT)),
                    "little")
            except _queue.Empty:
                pass

    def send_spill(self, enc, data, n, block, timeout):
        seg = Segment.create(P.QUEUE_SPILL_DATA + n, "spill")
        try:
            with memoryview(seg) as mv:
                dest = mv[P.QUEUE_SPILL_DATA:P.QUEUE_SPILL_DATA + n]
                if isinstance(data, _codec.Prepared):
                    _codec.write(data, dest)
                else:
                    dest[:] = data
                dest.release()
            desc = P.QUEUE_SPILL_DESC.pack(os.getpid(), seg.fd, seg.ino, seg.size)
            self.msgs.push_tagged(P.tag(enc, P.AT_SPILL), 0, n, desc, block, timeout)
        except BaseException:
            seg.close()
            raise
        _keep_spill(seg, self.policy)



_STOP = object()
_SLOT_WAIT = 0.005   # seconds between re-checks of the spill limit while waiting for a slot


def _left(deadline):
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _stop_feeder(buffer, cond):
    with cond:
        buffer.append(_STOP)
        cond.notify()


def _feed(buffer, cond, sender):
    """Feeder thread: send buffered messages in order, blocking as needed; end at _STOP."""
    while True:
        with cond:
            while not buffer:
                cond.wait()
            item = buffer[0]
        if item is _STOP:
            return
        try:
            sender.send(item[0], item[1], True, None)
        except (RingClosed, ValueError):
            # Shut down, or detached under us: nothing more can be sent.  What is still
            # buffered is dropped (put() raises RingClosed from now on).
            with cond:
                buffer.clear()
            return
        except Exception as e:
            # as multiprocessing.Queue's feeder: report, drop this message, go on
            warnings.warn(f"ShmQueue feeder could not send a message and dropped it: "
                          f"{type(e).__name__}: {e}", RuntimeWarning)
        with cond:
            buffer.popleft()


def _give_back(free, slot):
    try:
        # Works even after this process closed the queue (the lease still maps it), so
        # that a slot held past close() is not lost to the other processes.
        free.push_while_mapped(slot.to_bytes(8, "little"))
    except Exception:
        pass  # unmapped here: nothing to give the slot back to


def _give_back_all(free, held):
    for slot in list(held):
        _give_back(free, slot)
    held.clear()


class _SlotReleaser:
    """Called by a SlotLease when its last view is gone: the slot goes back to the free
    ring.  A separate small object so that leases do not keep the whole queue alive.

    It also remembers which slots this process holds, and gives back those still held
    when the process exits (multiprocessing children end with os._exit, so arrays kept
    to the end are never garbage collected): they would be lost to the other processes.
    A slot is given back once: a lease freed after that (during interpreter teardown)
    does nothing.  In a forked child, inherited leases never give back the parent's
    slots: the parent still holds them.
    """
    __slots__ = ("free", "held", "finalizer", "pid", "__weakref__")

    def __init__(self, free):
        self.free = free
        self.held = set()
        self.finalizer = None
        self.pid = os.getpid()

    def leased(self, slot):
        self.held.add(slot)
        if self.finalizer is None:
            self.finalizer = _mputil.Finalize(self, _give_back_all, [self.free, self.held],
                                              exitpriority=-20)

    # The module's globals may already be gone when a lease is freed at teardown: keep
    # what this needs as defaults.
    def __call__(self, slot, _give_back=_give_back, _getpid=os.getpid):
        if self.pid != _getpid() or slot not in self.held:
            return
        self.held.discard(slot)
        _give_back(self.free, slot)


def _open_spill(pid, fd, ino, size):
    seg = segment_from_peer(pid, fd, ino, size, "spill")
    with memoryview(seg) as mv:
        P.QUEUE_SPILL_ACK.pack_into(mv, 0, 1)  # mapped: the sender may let go of it
    return seg


def _spill_acked(seg):
    with memoryview(seg) as mv:
        return P.QUEUE_SPILL_ACK.unpack_from(mv, 0)[0] == 1


class _JoinPolicy:
    """Whether this process waits at exit for the spills of one queue (see
    ShmQueue.cancel_join_thread)."""
    __slots__ = ("cancelled",)

    def __init__(self):
        self.cancelled = False


# Spill segments this process sent and no receiver has mapped yet, with their queue's join
# policy.  Kept here, not on the queue, so that closing or dropping a queue neither loses
# them nor keeps the queue alive; reaped on every send, and waited for at exit.
_pending_spills = []
_spill_lock = threading.Lock()
_spill_exit_hook = None

def _ensure_spill_hook():
    """Register (once per process) the exit hook that waits for unread spills.  It runs
    after the feeder threads are joined (priority -5), which may still spill."""
    global _spill_exit_hook
    # (multiprocessing clears its finalizers when a child starts, after unpickling the
    # Process's arguments: hence still_active.)
    if (_spill_exit_hook is None or _spill_exit_hook.pid != os.getpid()
            or not _spill_exit_hook.still_active()):
        _spill_exit_hook = _mputil.Finalize(None, _wait_for_spills, exitpriority=-10)
        _spill_exit_hook.pid = os.getpid()


def _keep_spill(seg, policy):
    with _spill_lock:
        _pending_spills.append((seg, policy))
        _ensure_spill_hook()


def _reap_spills(policy=None):
    """Close the spills receivers have mapped; return how many of ``policy``'s (or of all,
    if None) are still waiting."""
    waiting = 0
    with _spill_lock:
        keep = []
        for seg, pol in _pending_spills:
            if _spill_acked(seg):
                seg.close()
            else:
                keep.append((seg, pol))
                if policy is None or pol is policy:
                    waiting += 1
        _pending_spills[:] = keep
    return waiting


def _wait_for_spills(policy=None):
    """Block until receivers mapped this process's spills (of one queue, or of every queue
    whose join was not cancelled).  Spills nobody reads are waited for, as
    multiprocessing.Queue waits for data its pipe has not taken (``cancel_join_thread``
    turns both off): a receiver that took the entry may be slow rather than dead, and
    this process cannot tell which."""
    while True:
        _reap_spills()
        with _spill_lock:
            left = [pol for _, pol in _pending_spills
                    if (pol is policy if policy is not None else not pol.cancelled)]
        if not left:
            return
        time.sleep(0.01)


def _forget_spills_after_fork():
    # A forked child inherits the list, not the duty: the parent waits for its own spills.
    # The lock is replaced, never taken: another thread may have held it at the fork.
    global _spill_lock, _spill_exit_hook
    _spill_lock = threading.Lock()
    _spill_exit_hook = None
    for seg, _ in _pending_spills:
        seg.close()
    _pending_spills.clear()


os.register_at_fork(after_in_child=_forget_spills_after_fork)
