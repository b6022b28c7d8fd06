# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Cython binding of csrc/: shared-memory segments, the lock-free ring, futex events.

Everything that can block releases the GIL and comes back to Python at least every
``poll_interval`` seconds (and on every signal) so that Ctrl-C, a ``check`` callable and a
closed ring are all noticed.
"""
from libc.stdint cimport uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy
from libc.errno cimport errno
from posix.unistd cimport close as c_close
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from cpython.exc cimport PyErr_CheckSignals
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF

import errno as _errno
import itertools as _itertools
import os as _os
import queue as _queue

from multiprocessing import context as _mpcontext
from multiprocessing import reduction as _mpreduction

from . import headroom as _headroom
from .._validate import check_int, check_timeout
from ..errors import RingClosed, PeerGoneError

__all__ = ["Segment", "RingBuffer", "Event", "DEFAULT_POLL_INTERVAL", "DEFAULT_SPIN",
           "ENTRY_HEADER", "now_ns", "segment_from_peer"]

#: Default longest sleep before a blocked call re-checks liveness and the closed flag.
DEFAULT_POLL_INTERVAL = 0.1
#: Default time a blocked call spins (polls the ring without sleeping) before it sleeps.
DEFAULT_SPIN = 20e-6

cpdef enum:
    # Bytes of the header of a tagged entry (RingBuffer.push_tagged): tag u32, aux u32,
    # value u64, in this process's byte order.  Exported as a Python int.
    ENTRY_HEADER = 16

cdef enum:
    # pop_tagged copies an entry of up to this many bytes through a buffer on its stack, a
    # larger one through a malloc of the entry size, which would be most of the cost of the
    # pop.  The manager pops one result entry per batch, of ENTRY_HEADER + RESULT_INLINE
    # (unienv_mp._process.handle) bytes: those fit.
    _POP_ON_STACK = 4608

cdef extern from "Python.h":
    int PyBytes_CheckExact(object o)
    int _PyBytes_Resize(PyObject **bytes, Py_ssize_t newsize) except -1

_names = _itertools.count()

# Segments from this size on are checked against the memory left before they are reserved
# (see _headroom): a reservation larger than that would call the OOM killer.  Below it the
# check would cost more than the reservation, and a segment is touched soon anyway.
_HEADROOM_CHECKED_FROM = 1 << 20


def now_ns():
    """CLOCK_MONOTONIC in nanoseconds (the clock every deadline here is measured on)."""
    return umr_now_ns()


cdef int64_t _seconds_to_ns(object seconds, str what) except -2:
    """``seconds`` (see _validate.check_timeout) in nanoseconds; UMR_NO_DEADLINE for None or
    more than 1e9 s (about 31 years: no limit)."""
    if seconds is None:
        return UMR_NO_DEADLINE
    cdef type t = type(seconds)
    if not ((t is float or t is int) and seconds >= 0):   # (the common case needs no check)
        seconds = check_timeout(seconds, what)
    if seconds > 1e9:
        return UMR_NO_DEADLINE
    return <int64_t>(<double>seconds * 1e9)


cdef inline int64_t _deadline_in(int64_t timeout_ns) noexcept:
    """The CLOCK_MONOTONIC deadline `timeout_ns` from now (UMR_NO_DEADLINE: none)."""
    if timeout_ns == UMR_NO_DEADLINE:
        return UMR_NO_DEADLINE
    return umr_now_ns() + timeout_ns


cdef int64_t _deadline(object timeout) except -2:
    return _deadline_in(_seconds_to_ns(timeout, "timeout"))


cdef int _raise_os(int neg_errno, str what) except -1:
    cdef int code = -neg_errno
    raise OSError(code, f"{what}: {_os.strerror(code)}")


# ---------------------------------------------------------------------------------------
# Segment
# ---------------------------------------------------------------------------------------

def _segment_from_dupfd(dupfd, size, ino, name, copy_on_write=False):
    """Unpickle a Segment handed to a process at its start (spawn / forkserver)."""
    cdef Segment seg = Segment.__new__(Segment)
    fd = dupfd.detach()
    try:
        seg._adopt(fd, size, name, ino, copy_on_write)
    except BaseException:
        _os.close(fd)
        raise
    return seg


def segment_from_peer(pid, fd, ino, size, name, copy_on_write=False):
    """Attach the segment that live process ``pid`` holds as its descriptor ``fd``
    (through ``/proc/<pid>/fd``), checking that it is the one of inode ``ino`` and at least
    ``size`` bytes; ``name`` names it in errors.  This is how a process maps a segment that
    another one described in a message, and how a pickled `Segment` is unpickled while its
    sender lives.  Raises `PeerGoneError` if that process has exited or closed the
    descriptor.  ``copy_on_write``: map it copy-on-write (see `Segment.create`)."""
    cdef int ours = umr_shm_open_peer(pid, fd, ino, size)
    if ours < 0:
        if -ours in (_errno.ENOENT, _errno.ESRCH, _errno.ESTALE):
            raise PeerGoneError(
                -ours, f"cannot attach shared-memory segment {name!r}: process {pid} that "
                       f"described it has exited or closed it")
        _raise_os(ours, f"cannot attach shared-memory segment {name!r} of process {pid}")
    cdef Segment seg = Segment.__new__(Segment)
    try:
        seg._adopt(ours, size, name, ino, copy_on_write)
    except BaseException:
        _os.close(ours)
        raise
    return seg


cdef str _mib(uint64_t size):
    return f"{size} bytes ({<double>size / 1048576.0:.1f} MiB)"


cdef class Segment:
    """A block of shared memory that other processes can map: an anonymous ``memfd``.

    Lifecycle, as for `multiprocessing.shared_memory.SharedMemory`: ``Segment.create(size)``
    makes one; pickling it (as a Process argument, or through a queue while this process
    lives) lets another process attach; [`close`][unienv_mp.Segment.close] releases it in
    this process; [`unlink`][unienv_mp.Segment.unlink] stops new processes from attaching.
    Nothing is ever created under ``/dev/shm``: the memory is returned to the system when
    the last process that maps it is gone, however it ended (normal exit, exception or
    SIGKILL).

    The segment exports the buffer protocol.  While a ``memoryview`` (or an array built on
    one) is alive, [`close`][unienv_mp.Segment.close] only marks the segment closed and the
    memory stays mapped until the last view is released, so a view can never outlive its
    memory.
    """

    def __cinit__(self):
        self.fd = -1
        self.addr = NULL
        self.size = 0
        self._users = 0
        self._closing = False
        self.name = ""

    @staticmethod
    def create(size, tag="segment", *, copy_on_write=False):
        """Create a new zero-filled segment of ``size`` bytes named ``unienv_mp_<tag>_...``.

        Its memory is reserved now: if the machine (or this process's memory limit) has no
        room for it, this raises ``MemoryError`` naming the size and ``tag``, instead of
        a later write into it failing with SIGBUS.

        ``copy_on_write=True`` is for data written here once and then only read elsewhere:
        processes that attach it map it copy-on-write, so what one of them writes stays in
        its own copy of the page, and none of them sees it (nor a later write from here
        into a page it has read).  The ``copy_on_write`` attribute says which kind a
        segment is: the process that made it maps it shared, every other one
        copy-on-write."""
        size = check_int(size, "size")
        name = f"unienv_mp_{tag}_{_os.getpid()}_{next(_names)}"
        cdef bytes cname = name.encode()
        cdef const char *c_name = cname
        cdef uint64_t c_size = size
        cdef int fd
        if size >= _HEADROOM_CHECKED_FROM:
            _headroom.check(size, f"{tag!r} ({name})")
        while True:
            with nogil:
                fd = umr_shm_create(c_name, c_size)
            if fd != -_errno.EINTR:
                break
            PyErr_CheckSignals()   # (raises what a signal handler raised: no retry then)
        if fd in (-_errno.ENOMEM, -_errno.ENOSPC):
            raise MemoryError(
                f"cannot reserve {_mib(c_size)} of memory for shared-memory segment "
                f"{tag!r} ({name}): {_os.strerror(-fd)}; the machine, or this process's "
                f"memory limit (a container's, a cgroup's), has no room for it")
        if fd < 0:
            _raise_os(fd, f"cannot create shared-memory segment {tag!r} of {_mib(c_size)}")
        cdef Segment seg = Segment.__new__(Segment)
        try:
            seg._adopt(fd, size, name, None, False)
        except BaseException:
            _os.close(fd)
            raise
        seg.copy_on_write = copy_on_write
        return seg

    def _adopt(self, int fd, uint64_t size, str name, ino, bint copy_on_write):
        if self.addr != NULL or self.fd >= 0:
            raise RuntimeError("segment already initialised")
        cdef uint64_t got_ino = 0, got_size = 0
        cdef int rc = umr_shm_identity(fd, &got_ino, &got_size)
        if rc < 0:
            _raise_os(rc, "cannot inspect shared-memory descriptor")
        if got_size < size or (ino is not None and got_ino != ino):
            raise PeerGoneError(_errno.ESTALE,
                                f"descriptor {fd} is not shared-memory segment {name!r}")
        cdef void *p = umr_shm_map(fd, size, copy_on_write)
        if p == NULL:
            code = errno
            raise OSError(code, f"cannot map shared-memory segment {name!r} of {size} bytes: "
                                f"{_os.strerror(code)}")
        self.fd = fd
        self.addr = <unsigned char *>p
        self.size = size
        self.ino = got_ino
        self.name = name
        self.copy_on_write = copy_on_write

    @property
    def address(self):
        """Address of the mapping in this process (0 once unmapped)."""
        return <size_t>self.addr

    @property
    def closed(self):
        """True once [`close`][unienv_mp.Segment.close] was called in this process."""
        return self._closing or self.addr == NULL

    @property
    def users(self):
        """Buffer views (and C-level users) of the mapping alive now: while there is one,
        the mapping stays (see `unienv_mp._device.pins`)."""
        return self._users

    cdef unsigned char *enter(self, uint64_t offset, uint64_t length) except NULL:
        """Pin the mapping for a C-level user (e.g. a blocking wait without the GIL) and
        return the address of [offset, offset + length)."""
        if self.addr == NULL or self._closing:
            raise ValueError(f"shared-memory segment {self.name!r} is closed")
        if offset > self.size or length > self.size - offset:
            raise ValueError(f"range [{offset}, {offset + length}) is outside segment "
                             f"{self.name!r} of {self.size} bytes")
        self._users += 1
        return self.addr + offset

    cdef void leave(self) noexcept:
        self._users -= 1
        if self._closing and self._users == 0:
            try:
                self._unmap()
            except BaseException:
                pass

    cdef int _unmap(self) except -1:
        if self.addr != NULL:
            umr_shm_unmap(self.addr, self.size)
            self.addr = NULL
        return 0

    def __getbuffer__(self, Py_buffer *buf, int flags):
        if self.addr == NULL or self._closing:
            raise ValueError(f"shared-memory segment {self.name!r} is closed")
        self._shape[0] = <Py_ssize_t>self.size
        self._strides[0] = 1
        buf.buf = self.addr
        buf.obj = self
        buf.len = <Py_ssize_t>self.size
        buf.readonly = 0
        buf.itemsize = 1
        if flags & 0x0004:  # PyBUF_FORMAT
            buf.format = b"B"
        else:
            buf.format = NULL
        buf.ndim = 1
        buf.shape = self._shape
        buf.strides = self._strides
        buf.suboffsets = NULL
        buf.internal = NULL
        self._users += 1

    def __releasebuffer__(self, Py_buffer *buf):
        self.leave()

    def close(self):
        """Release the segment in this process: close its descriptor and unmap it (at once,
        or when the last view of it is released).  Idempotent."""
        self.unlink()
        self._closing = True
        if self._users == 0:
            self._unmap()

    def unlink(self):
        """Close this process's descriptor: the segment can no longer be handed to new
        processes from here.  The mapping, and every process attached, is unaffected."""
        if self.fd >= 0:
            _os.close(self.fd)
            self.fd = -1

    def __dealloc__(self):
        # Nothing can still use the mapping: buffer views hold a reference to us.
        if self.addr != NULL:
            umr_shm_unmap(self.addr, self.size)
            self.addr = NULL
        if self.fd >= 0:
            c_close(self.fd)  # libc: the os module may be gone at interpreter shutdown
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        if self.addr == NULL or self._closing:
            raise ValueError(f"cannot share closed segment {self.name!r}")
        if self.fd < 0:
            raise ValueError(f"cannot share segment {self.name!r}: it was unlinked in this "
                             f"process (no new process can attach through it)")
        if _mpcontext.get_spawning_popen() is not None:
            # Starting a process (spawn / forkserver): multiprocessing hands the descriptor
            # itself to the child.
            return (_segment_from_dupfd, (_mpreduction.DupFd(self.fd), self.size, self.ino,
                                          self.name, self.copy_on_write))
        return (segment_from_peer, (_os.getpid(), self.fd, self.ino, self.size, self.name,
                                     self.copy_on_write))

    def __repr__(self):
        state = "closed" if self.closed else f"{self.size} bytes"
        return f"<Segment {self.name!r} {state}>"


# ---------------------------------------------------------------------------------------
# Event
# ---------------------------------------------------------------------------------------

cdef class Event:
    """A futex-backed wake-up signal at a 64-byte line of a `Segment`.

    Waiters call `wait_until` with a condition; notifiers call `notify` after making the
    condition true.  Used as the "any result is ready" doorbell of the manager.
    """
    cdef readonly Segment segment
    cdef readonly uint64_t offset
    cdef umr_event_t *ev

    SIZE = 64

    def __cinit__(self, Segment segment not None, offset, bint init=False):
        if offset % 64 or offset + 64 > segment.size:
            raise ValueError(f"event offset {offset} is not a 64-byte line of the segment")
        self.segment = segment
        self.offset = offset
        self.ev = <umr_event_t *>segment.enter(offset, 64)
        if init:
            umr_event_init(self.ev)

    def __dealloc__(self):
        if self.segment is not None and self.ev != NULL:
            self.segment.leave()
            self.ev = NULL

    def notify(self):
        """Wake every waiter (one fence and one load when there is none)."""
        umr_event_notify(self.ev)

    def notify_all(self):
        umr_event_notify_all(self.ev)

    def wait_until(self, condition, timeout=None, poll_interval=DEFAULT_POLL_INTERVAL,
                   check=None):
        """Call ``condition()`` until it returns something true and return that.  Between
        tries sleep until notified, at most ``poll_interval`` seconds at a time (then
        ``check()`` runs, if given).  Returns ``None`` when ``timeout`` expires."""
        cdef int64_t deadline = _deadline(timeout)
        cdef int64_t poll_ns = _seconds_to_ns(poll_interval, "poll_interval")
        cdef int64_t wake_at, now
        cdef uint32_t seen
        cdef int rc
        while True:
            seen = umr_event_prepare(self.ev)
            result = condition()
            if result:
                return result
            now = umr_now_ns()
            if deadline != UMR_NO_DEADLINE and now >= deadline:
                return None
            wake_at = deadline
            if poll_ns != UMR_NO_DEADLINE and (wake_at == UMR_NO_DEADLINE
                                              or now + poll_ns < wake_at):
                wake_at = now + poll_ns
            with nogil:
                rc = umr_event_wait(self.ev, seen, wake_at)
            if rc == UMR_SYSERR:
                raise OSError(errno, "futex wait failed: " + _os.strerror(errno))
            if rc != UMR_OK:
                PyErr_CheckSignals()
                if check is not None:
                    check()


# ---------------------------------------------------------------------------------------
# Blocking waits on a ring
# ---------------------------------------------------------------------------------------

cdef struct _WaitArgs:
    const void *data    # push: the entry
    uint32_t len        # push: its length
    void *out           # pop: where entries go
    size_t out_stride   # pop: bytes from one entry to the next (for one entry: out's size)
    uint32_t *lens      # pop: their lengths
    uint64_t n          # pop_many: most entries to take

# One call of a blocking C wait on `r`: spins for `spin_ns`, sleeps without the GIL, and
# returns >= 0 when done (UMR_OK, or the number of entries popped) or a UMR_* code.
ctypedef int64_t (*_wait_fn)(umr_ring_t *r, const _WaitArgs *a, int64_t deadline_ns,
                             int64_t poll_ns, int64_t spin_ns) noexcept nogil


cdef int64_t _push_wait(umr_ring_t *r, const _WaitArgs *a, int64_t deadline_ns,
                        int64_t poll_ns, int64_t spin_ns) noexcept nogil:
    return umr_ring_push_wait(r, a.data, a.len, deadline_ns, poll_ns, spin_ns)


cdef int64_t _pop_wait(umr_ring_t *r, const _WaitArgs *a, int64_t deadline_ns,
                       int64_t poll_ns, int64_t spin_ns) noexcept nogil:
    return umr_ring_pop_wait(r, a.out, <uint32_t>a.out_stride, a.lens, deadline_ns, poll_ns,
                             spin_ns)


cdef int64_t _pop_many_wait(umr_ring_t *r, const _WaitArgs *a, int64_t deadline_ns,
                            int64_t poll_ns, int64_t spin_ns) noexcept nogil:
    return umr_ring_pop_many_wait(r, a.out, a.out_stride, a.lens, a.n, deadline_ns, poll_ns,
                                  spin_ns)


cdef int64_t _wait(RingBuffer ring, _wait_fn wait, const _WaitArgs *a, int64_t deadline,
                   int64_t *spin, object check, object timeout_exc) except -1:
    """Call `wait` until it succeeds and return what it returned (>= 0).

    The caller holds ring.segment (enter()) and has found the ring full / empty.  Each call
    of `wait` runs without the GIL for at most the ring's poll interval; it spins for
    ``spin[0]`` ns first, and once a call has come back without success, ``spin[0]`` is 0
    for the rest of the caller's operation.  Between calls, the handlers of pending signals
    run, then ``check()`` if given: what either raises (KeyboardInterrupt, ...) ends the
    wait, and so does a ring closed in this process meanwhile, with ValueError.  Raises
    `timeout_exc` (queue.Full / queue.Empty) at `deadline`, RingClosed once the ring is
    shut down (and, for pops, drained).
    """
    cdef int64_t rc
    cdef umr_ring_t *r = &ring.r
    cdef int64_t poll = ring._poll_ns
    while True:
        with nogil:
            rc = wait(r, a, deadline, poll, spin[0])
        if rc >= 0:
            return rc
        spin[0] = 0
        if rc == UMR_TIMEOUT:
            raise timeout_exc
        if rc != UMR_POLL and rc != UMR_INTR:
            ring._raise_rc(<int>rc)
        PyErr_CheckSignals()
        if check is not None:
            check()
        if ring.segment.closed:
            raise ValueError("ring was closed in this process while waiting")


# ---------------------------------------------------------------------------------------
# RingBuffer
# ---------------------------------------------------------------------------------------

def _ring_from_segment(Segment segment not None, offset, poll_interval, spin):
    return RingBuffer.attach(segment, offset, poll_interval, spin)


cdef class RingBuffer:
    """A bounded FIFO of byte strings in shared memory, for any number of producer and
    consumer processes.

    A forked child inherits it; pickling it (as a ``Process`` argument under spawn or
    forkserver, or through a queue while this process lives) attaches the receiving
    process to the same ring.  Pushing copies the bytes into a cell and publishes it with
    one atomic store; popping copies them out.  Blocking calls spin, then sleep on a futex
    without the GIL; they wake when the other side acts.

    Args:
        capacity: most entries the ring holds.
        entry_size: most bytes one entry holds.
        poll_interval: longest sleep, in seconds, before a blocked call runs ``check`` (if
            given) and notices signals.
        spin: seconds a blocked call polls before it sleeps.

    [`shutdown`][unienv_mp.RingBuffer.shutdown] marks the ring closed for every process:
    further pushes raise [`RingClosed`][unienv_mp.RingClosed]; pops return what is left,
    then raise it.  [`close`][unienv_mp.RingBuffer.close] detaches only this process;
    [`unlink`][unienv_mp.RingBuffer.unlink] stops new processes attaching through this one.
    Used as a context manager, the ring is closed (detached) on exit.
    """

    def __init__(self, capacity, entry_size, *, poll_interval=DEFAULT_POLL_INTERVAL,
                 spin=DEFAULT_SPIN):
        capacity = check_int(capacity, "capacity", 1, 1 << 32)
        entry_size = check_int(entry_size, "entry_size", 1, 1 << 30)
        self._set_timing(poll_interval, spin)
        cdef size_t need = umr_ring_footprint(capacity, entry_size)
        if need == 0:
            raise ValueError(f"a ring of {capacity} entries of {entry_size} bytes is too large")
        seg = Segment.create(need, "ring")
        self._init_in(seg, 0, capacity, entry_size)

    @staticmethod
    def footprint(capacity, entry_size):
        """Bytes of shared memory a ring of this geometry occupies (a multiple of 64)."""
        capacity = check_int(capacity, "capacity", 1, 1 << 32)
        entry_size = check_int(entry_size, "entry_size", 1, 1 << 30)
        return umr_ring_footprint(capacity, entry_size)

    @staticmethod
    def create_in(Segment segment not None, offset, capacity, entry_size,
                  poll_interval=DEFAULT_POLL_INTERVAL, spin=DEFAULT_SPIN):
        """Lay out a new, empty ring at ``offset`` (a multiple of 64) of ``segment``, which
        must hold [`footprint`][unienv_mp.RingBuffer.footprint] bytes from there, and return
        it.  Several rings (and other data) can share one segment this way; processes handed
        the segment attach to the ring with [`attach`][unienv_mp.RingBuffer.attach]."""
        cdef RingBuffer self = RingBuffer.__new__(RingBuffer)
        self._set_timing(poll_interval, spin)
        self._init_in(segment, offset, capacity, entry_size)
        return self

    @staticmethod
    def attach(Segment segment not None, offset, poll_interval=DEFAULT_POLL_INTERVAL,
               spin=DEFAULT_SPIN):
        """The ring that [`create_in`][unienv_mp.RingBuffer.create_in] laid out at
        ``offset`` of ``segment`` (in this process or another one that handed the segment
        over).  Raises ``ValueError`` if no ring lies there."""
        cdef RingBuffer self = RingBuffer.__new__(RingBuffer)
        self._set_timing(poll_interval, spin)
        if offset < 0 or offset % 64 or offset >= segment.size:
            raise ValueError(f"ring offset {offset} is not a 64-byte line of the segment")
        cdef unsigned char *mem = segment.enter(offset, segment.size - offset)
        cdef int rc
        try:
            rc = umr_ring_attach(&self.r, mem, segment.size - offset)
        finally:
            segment.leave()
        if rc != UMR_OK:
            raise ValueError(f"no ring at offset {offset} of segment {segment.name!r}")
        self.segment = segment
        self.offset = offset
        return self

    def _set_timing(self, poll_interval, spin):
        self._poll_ns = _seconds_to_ns(poll_interval, "poll_interval")
        if self._poll_ns == 0:
            raise ValueError("poll_interval must be > 0")
        self._spin_ns = _seconds_to_ns(spin, "spin")
        if self._spin_ns == UMR_NO_DEADLINE:
            raise ValueError("spin must be finite")

    def _init_in(self, Segment segment not None, offset, capacity, entry_size):
        if self.segment is not None:
            raise RuntimeError("ring already initialised")
        capacity = check_int(capacity, "capacity", 1, 1 << 32)
        entry_size = check_int(entry_size, "entry_size", 1, 1 << 30)
        cdef size_t need = umr_ring_footprint(capacity, entry_size)
        if offset < 0 or offset % 64:
            raise ValueError(f"ring offset {offset} is not a non-negative multiple of 64")
        cdef unsigned char *mem = segment.enter(offset, need)
        cdef int rc
        try:
            rc = umr_ring_init(&self.r, mem, need, capacity, entry_size)
        finally:
            segment.leave()
        if rc != UMR_OK:
            raise ValueError(f"cannot lay out a ring of {capacity} x {entry_size} bytes")
        self.segment = segment
        self.offset = offset

    # -- properties ---------------------------------------------------------------------

    @property
    def capacity(self):
        """Most entries the ring holds."""
        return self.r.capacity

    @property
    def entry_size(self):
        """Most bytes one entry holds."""
        return self.r.entry_size

    @property
    def poll_interval(self):
        """Longest sleep, in seconds, before a blocked call re-checks ``check`` and signals."""
        return self._poll_ns / 1e9

    @property
    def is_shutdown(self):
        """True once any process called [`shutdown`][unienv_mp.RingBuffer.shutdown]."""
        self._ensure_open()
        return bool(umr_ring_is_closed(&self.r))

    @property
    def closed(self):
        """True once this process called [`close`][unienv_mp.RingBuffer.close]."""
        return self.segment is None or self.segment.closed

    def __len__(self):
        self._ensure_open()
        return umr_ring_count(&self.r)

    def empty(self):
        """True if the ring holds no entry (a snapshot: others may push meanwhile)."""
        return len(self) == 0

    def full(self):
        """True if every cell is taken (a snapshot: others may pop meanwhile)."""
        return <uint64_t>len(self) >= self.r.capacity

    cdef int _ensure_open(self) except -1:
        if self.segment is None or self.segment.addr == NULL or self.segment._closing:
            raise ValueError("ring is closed in this process")
        return 0

    # -- push ---------------------------------------------------------------------------

    def push(self, data, block=True, timeout=None, *, check=None):
        """Append ``data`` (any bytes-like object of at most ``entry_size`` bytes).

        Blocks while the ring is full (``block=False``: raises `queue.Full` at once;
        ``timeout``: raises `queue.Full` after that many seconds).  Raises
        [`RingClosed`][unienv_mp.RingClosed] if the ring was shut down, ``ValueError`` if
        ``data`` is longer than ``entry_size``.  ``check``, if given, is called every
        ``poll_interval`` seconds while blocked; an exception from it ends the wait.
        """
        cdef Py_buffer view
        cdef const char *p
        cdef Py_ssize_t n
        cdef bint have_view = False
        if PyBytes_CheckExact(data):
            p = PyBytes_AS_STRING(data)
            n = PyBytes_GET_SIZE(data)
        else:
            PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
            have_view = True
            p = <const char *>view.buf
            n = view.len
        try:
            self._push(p, n, block, timeout, check)
        finally:
            if have_view:
                PyBuffer_Release(&view)

    def push_nowait(self, data):
        """``push(data, block=False)``."""
        self.push(data, False)

    cdef int _push(self, const char *p, Py_ssize_t n, bint block, object timeout,
                   object check) except -1:
        cdef int rc
        cdef int64_t tmo = UMR_NO_DEADLINE
        cdef int64_t spin = self._spin_ns
        cdef _WaitArgs a
        if n > self.r.entry_size:
            raise ValueError(f"entry of {n} bytes does not fit: this ring's entry_size is "
                             f"{self.r.entry_size} bytes")
        if block and timeout is not None:
            tmo = _seconds_to_ns(timeout, "timeout")
        # No Python code runs between here and leave() except between the waits of _wait:
        # another thread closing the ring meanwhile only defers the unmap until we leave.
        self.segment.enter(0, 0)
        try:
            rc = umr_ring_try_push(&self.r, p, <uint32_t>n)  # fast path, GIL held
            if rc == UMR_OK:
                return 0
            if rc != UMR_FULL:
                return self._raise_rc(rc)
            if not block:
                raise _queue.Full
            a.data = p
            a.len = <uint32_t>n
            _wait(self, _push_wait, &a, _deadline_in(tmo), &spin, check, _queue.Full)
            return 0
        finally:
            self.segment.leave()

    def push_many(self, items, block=True, timeout=None, *, check=None):
        """Append every bytes-like object of the sequence ``items`` in order, claiming as
        many cells as are free with one atomic operation.  Returns how many were pushed:
        all of them when ``block`` (raising `queue.Full` if ``timeout`` expires first),
        possibly fewer (even 0) when not.  If it raises part-way (timeout, shutdown, an
        exception from ``check``), the items before the failure were pushed: the exception's
        ``pushed`` attribute says how many."""
        cdef tuple seq = tuple(items)   # holds every item (and its bytes) for the whole call
        cdef Py_ssize_t n = len(seq), i, done = 0, got
        cdef const void **ptrs = NULL
        cdef uint32_t *lens = NULL
        cdef Py_buffer *views = NULL
        cdef char *have = NULL
        cdef int64_t k, deadline, tmo = UMR_NO_DEADLINE
        cdef int64_t spin = self._spin_ns
        cdef _WaitArgs a
        self._ensure_open()
        if block and timeout is not None:
            tmo = _seconds_to_ns(timeout, "timeout")
        if n == 0:
            return 0
        ptrs = <const void **>malloc(n * sizeof(void *))
        lens = <uint32_t *>malloc(n * sizeof(uint32_t))
        views = <Py_buffer *>malloc(n * sizeof(Py_buffer))
        have = <char *>calloc(n, 1)
        if ptrs == NULL or lens == NULL or views == NULL or have == NULL:
            free(ptrs); free(lens); free(views); free(have)
            raise MemoryError
        try:
            for i in range(n):
                item = seq[i]
                if PyBytes_CheckExact(item):
                    ptrs[i] = PyBytes_AS_STRING(item)
                    got = PyBytes_GET_SIZE(item)
                else:
                    PyObject_GetBuffer(item, &views[i], PyBUF_SIMPLE)
                    have[i] = 1
                    ptrs[i] = views[i].buf
                    got = views[i].len
                if got > self.r.entry_size:
                    raise ValueError(f"item {i} of {got} bytes does not fit: this ring's "
                                     f"entry_size is {self.r.entry_size} bytes")
                lens[i] = <uint32_t>got
            self.segment.enter(0, 0)
            try:
                deadline = _deadline_in(tmo)
                while done < n:
                    k = umr_ring_try_push_many(&self.r, ptrs + done, lens + done, n - done)
                    if k < 0:
                        self._raise_rc(<int>k)
                    done += k
                    if done == n or not block:
                        break
                    if k == 0:
                        # Full: wait for room for the next one, then go back to batches.
                        a.data = ptrs[done]
                        a.len = lens[done]
                        _wait(self, _push_wait, &a, deadline, &spin, check, _queue.Full)
                        done += 1
            except BaseException as e:
                try:
                    e.pushed = done
                except AttributeError:
                    pass
                raise
            finally:
                self.segment.leave()
        finally:
            for i in range(n):
                if have[i]:
                    PyBuffer_Release(&views[i])
            free(ptrs); free(lens); free(views); free(have)
        return done

    # -- pop ----------------------------------------------------------------------------

    def pop(self, block=True, timeout=None, *, check=None):
        """Remove and return the oldest entry as ``bytes``.

        Blocks while the ring is empty (``block=False``: raises `queue.Empty` at once;
        ``timeout``: after that many seconds).  Raises [`RingClosed`][unienv_mp.RingClosed]
        once the ring is shut down and empty.  ``check`` as for
        [`push`][unienv_mp.RingBuffer.push].
        """
        cdef uint32_t length = 0
        cdef char stackbuf[4096]
        cdef char *buf = stackbuf
        cdef uint32_t cap = self.r.entry_size
        self._ensure_open()
        if cap > sizeof(stackbuf):
            buf = <char *>malloc(cap)
            if buf == NULL:
                raise MemoryError
        try:
            self._pop(buf, &length, block, timeout, check)
            return PyBytes_FromStringAndSize(buf, length)
        finally:
            if buf != stackbuf:
                free(buf)

    def pop_nowait(self):
        """``pop(block=False)``."""
        return self.pop(False)

    cdef int _pop(self, char *buf, uint32_t *length, bint block, object timeout,
                  object check) except -1:
        cdef int rc
        cdef int64_t tmo = UMR_NO_DEADLINE
        cdef int64_t spin = self._spin_ns
        cdef uint32_t cap = self.r.entry_size
        cdef _WaitArgs a
        if block and timeout is not None:
            tmo = _seconds_to_ns(timeout, "timeout")
        self.segment.enter(0, 0)   # see _push
        try:
            rc = umr_ring_try_pop(&self.r, buf, cap, length)
            if rc == UMR_OK:
                return 0
            if rc != UMR_EMPTY:
                return self._raise_rc(rc)
            if not block:
                raise _queue.Empty
            a.out = buf
            a.out_stride = cap
            a.lens = length
            _wait(self, _pop_wait, &a, _deadline_in(tmo), &spin, check, _queue.Empty)
            return 0
        finally:
            self.segment.leave()

    def pop_many(self, max_items, block=True, timeout=None, *, check=None):
        """Remove up to ``max_items`` of the oldest entries with one atomic claim and return
        them as a list of ``bytes``.  When ``block``, waits until at least one is there
        (raising `queue.Empty` if ``timeout`` expires); otherwise the list may be empty.
        Raises [`RingClosed`][unienv_mp.RingClosed] once the ring is shut down and empty."""
        max_items = check_int(max_items, "max_items")
        cdef size_t stride = self.r.entry_size
        # at most one lap, and at most ~64 MiB of scratch per call
        cdef uint64_t n = min(<uint64_t>max_items, self.r.capacity,
                              max(<uint64_t>1, (<uint64_t>64 << 20) // stride))
        cdef char *buf
        cdef uint32_t *lens
        cdef int64_t k, tmo = UMR_NO_DEADLINE
        cdef int64_t spin = self._spin_ns
        cdef uint64_t i
        cdef bint blocking = bool(block)
        cdef _WaitArgs a
        self._ensure_open()
        if blocking and timeout is not None:
            tmo = _seconds_to_ns(timeout, "timeout")
        buf = <char *>malloc(n * stride)
        lens = <uint32_t *>malloc(n * sizeof(uint32_t))
        if buf == NULL or lens == NULL:
            free(buf); free(lens)
            raise MemoryError
        try:
            self.segment.enter(0, 0)   # see _push
            try:
                k = umr_ring_try_pop_many(&self.r, buf, stride, lens, n)
                if k < 0:
                    self._raise_rc(<int>k)
                if k == 0 and blocking:
                    a.out = buf
                    a.out_stride = stride
                    a.lens = lens
                    a.n = n
                    k = _wait(self, _pop_many_wait, &a, _deadline_in(tmo), &spin, check,
                              _queue.Empty)
            finally:
                self.segment.leave()
            out = [None] * k
            for i in range(<uint64_t>k):
                out[i] = PyBytes_FromStringAndSize(buf + i * stride, lens[i])
            return out
        finally:
            free(buf)
            free(lens)

    # -- tagged entries -----------------------------------------------------------------

    def push_tagged(self, uint32_t tag, uint32_t aux, uint64_t value, payload=b"",
                    block=True, timeout=None, *, check=None, record=None):
        """Push one entry made of a header of ``ENTRY_HEADER`` bytes (``tag``, ``aux``,
        ``value``) followed by ``payload`` (bytes-like, at most ``entry_size -
        ENTRY_HEADER`` bytes).  Same blocking rules as [`push`][unienv_mp.RingBuffer.push].
        The queue and the sampler describe messages this way: what kind, which slot, how
        many bytes, and small payloads inline.

        ``record``: if given (a list or deque), ``record.append(value)`` runs inside this
        call once the entry is in the ring, and only then.  A Python caller can be
        interrupted (a Ctrl-C's ``KeyboardInterrupt``) right after any call returns, so
        it cannot tell from the return alone whether the push happened; ``record`` can."""
        cdef Py_buffer view
        cdef const char *src
        cdef Py_ssize_t n
        cdef bint have_view = False
        cdef char stackbuf[1024]
        cdef char *buf = stackbuf
        if PyBytes_CheckExact(payload):
            src = PyBytes_AS_STRING(payload)
            n = PyBytes_GET_SIZE(payload)
        else:
            PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
            have_view = True
            src = <const char *>view.buf
            n = view.len
        try:
            if n + ENTRY_HEADER > self.r.entry_size:
                room = self.r.entry_size - ENTRY_HEADER if self.r.entry_size > ENTRY_HEADER else 0
                raise ValueError(f"payload of {n} bytes does not fit: entries of this ring "
                                 f"hold {room} payload bytes")
            if n + ENTRY_HEADER > <Py_ssize_t>sizeof(stackbuf):
                buf = <char *>malloc(n + ENTRY_HEADER)
                if buf == NULL:
                    raise MemoryError
            memcpy(buf, &tag, 4)
            memcpy(buf + 4, &aux, 4)
            memcpy(buf + 8, &value, 8)
            if n:
                memcpy(buf + ENTRY_HEADER, src, n)
            self._push(buf, n + ENTRY_HEADER, block, timeout, check)
            if record is not None:
                record.append(value)
        finally:
            if have_view:
                PyBuffer_Release(&view)
            if buf != stackbuf:
                free(buf)

    def pop_tagged(self, block=True, timeout=None, *, check=None, into=None):
        """Pop one entry pushed by [`push_tagged`][unienv_mp.RingBuffer.push_tagged];
        returns ``(tag, aux, value, payload)`` with ``payload`` as ``bytes``.

        ``into``: if given (a list or deque), the entry is also appended to it inside this
        call, so that an entry taken off the ring is never lost to a ``KeyboardInterrupt``
        landing right after the call returns (see ``record`` of
        [`push_tagged`][unienv_mp.RingBuffer.push_tagged])."""
        cdef uint32_t length = 0, tag, aux
        cdef uint64_t value
        cdef char stackbuf[_POP_ON_STACK]
        cdef char *buf = stackbuf
        cdef uint32_t cap = self.r.entry_size
        self._ensure_open()
        if cap > sizeof(stackbuf):
            buf = <char *>malloc(cap)
            if buf == NULL:
                raise MemoryError
        try:
            self._pop(buf, &length, block, timeout, check)
            if length < ENTRY_HEADER:
                raise ValueError(f"entry of {length} bytes has no tagged header of "
                                 f"{ENTRY_HEADER} bytes")
            memcpy(&tag, buf, 4)
            memcpy(&aux, buf + 4, 4)
            memcpy(&value, buf + 8, 8)
            entry = (tag, aux, value,
                     PyBytes_FromStringAndSize(buf + ENTRY_HEADER, length - ENTRY_HEADER))
            if into is not None:
                into.append(entry)
            return entry
        finally:
            if buf != stackbuf:
                free(buf)

    def push_while_mapped(self, data):
        """Push ``data`` without waiting (``queue.Full`` if the ring is full) as long as the
        ring's memory is mapped in this process, even after
        [`close`][unienv_mp.RingBuffer.close]: a close while views of the segment are alive
        leaves it mapped until they are released, and what they held (a queue's slot) can
        still be handed back to the other processes."""
        if self.segment is None or self.segment.addr == NULL:
            raise ValueError("ring is unmapped in this process")
        cdef const unsigned char[::1] v = data
        if v.shape[0] > self.r.entry_size:
            raise ValueError(f"entry of {v.shape[0]} bytes does not fit")
        cdef int rc = umr_ring_try_push(&self.r, &v[0], <uint32_t>v.shape[0])
        if rc != UMR_OK:
            self._raise_rc(rc) if rc != UMR_FULL else None
            raise _queue.Full

    # -- helpers ------------------------------------------------------------------------

    cdef int _raise_rc(self, int rc) except -1:
        if rc == UMR_CLOSED:
            raise RingClosed("ring was shut down")
        if rc == UMR_TOOBIG:
            raise ValueError(f"entry does not fit: entry_size is {self.r.entry_size} bytes")
        if rc == UMR_CORRUPT:
            raise RuntimeError("ring memory is corrupt: a cell's sequence number contradicts "
                               "the ring's counters (did another process write into it?)")
        if rc == UMR_SYSERR:
            raise OSError(errno, "futex wait failed (is the futex syscall forbidden here?): "
                                 + _os.strerror(errno))
        raise RuntimeError(f"ring operation failed with internal code {rc}")

    # -- lifecycle ----------------------------------------------------------------------

    def shutdown(self):
        """Mark the ring closed for every process and wake every blocked caller."""
        self._ensure_open()
        umr_ring_shutdown(&self.r)

    def close(self):
        """Detach this process from the ring (the ring lives on in other processes).  If
        this process created the ring and no other process attached, its memory is freed."""
        if self.segment is not None:
            self.segment.close()

    def unlink(self):
        """Stop new processes from attaching through this process (see
        [`Segment.unlink`][unienv_mp.Segment.unlink])."""
        if self.segment is not None:
            self.segment.unlink()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        self._ensure_open()
        return (_ring_from_segment, (self.segment, self.offset, self._poll_ns / 1e9,
                                     self._spin_ns / 1e9))

    def __repr__(self):
        if self.closed:
            return "<RingBuffer closed>"
        return (f"<RingBuffer {len(self)}/{self.r.capacity} entries of <= "
                f"{self.r.entry_size} bytes>")
