"""Cython binding of csrc/: shared-memory segments, the lock-free ring, futex events.

Everything that can block releases the GIL and comes back to Python at least every
``poll_interval`` seconds (and on every signal) so that Ctrl-C, a ``check`` callable and a
closed ring are all noticed.
"""
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Final, Protocol, TypeVar, type_check_only

from _typeshed import ReadableBuffer
from typing_extensions import Self, disjoint_base

__all__ = ["Segment", "RingBuffer", "Event", "DEFAULT_POLL_INTERVAL", "DEFAULT_SPIN",
           "ENTRY_HEADER", "now_ns", "segment_from_peer"]

_T = TypeVar("_T")
_T_contra = TypeVar("_T_contra", contravariant=True)

@type_check_only
class _Appendable(Protocol[_T_contra]):
    def append(self, item: _T_contra, /) -> object: ...

#: Default longest sleep before a blocked call re-checks liveness and the closed flag.
DEFAULT_POLL_INTERVAL: Final[float]
#: Default time a blocked call spins (polls the ring without sleeping) before it sleeps.
DEFAULT_SPIN: Final[float]
#: Bytes of the header of a tagged entry (RingBuffer.push_tagged): tag u32, aux u32,
#: value u64, in this process's byte order.
ENTRY_HEADER: Final[int]

def now_ns() -> int:
    """CLOCK_MONOTONIC in nanoseconds (the clock every deadline here is measured on)."""

def segment_from_peer(pid: int, fd: int, ino: int, size: int, name: str,
                      copy_on_write: bool = False) -> Segment:
    """Attach the segment that live process ``pid`` holds as its descriptor ``fd``
    (through ``/proc/<pid>/fd``), checking that it is the one of inode ``ino`` and at least
    ``size`` bytes; ``name`` names it in errors.  This is how a process maps a segment that
    another one described in a message, and how a pickled `Segment` is unpickled while its
    sender lives.  Raises `PeerGoneError` if that process has exited or closed the
    descriptor.  ``copy_on_write``: map it copy-on-write (see `Segment.create`)."""

@disjoint_base
class Segment:
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

    @property
    def fd(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def ino(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def copy_on_write(self) -> bool: ...
    @staticmethod
    def create(size: int, tag: str = "segment", *, copy_on_write: bool = False) -> Segment:
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
    @property
    def address(self) -> int:
        """Address of the mapping in this process (0 once unmapped)."""
    @property
    def closed(self) -> bool:
        """True once [`close`][unienv_mp.Segment.close] was called in this process."""
    @property
    def users(self) -> int:
        """Buffer views (and C-level users) of the mapping alive now: while there is one,
        the mapping stays (see `unienv_mp._device.pins`)."""
    def close(self) -> None:
        """Release the segment in this process: close its descriptor and unmap it (at once,
        or when the last view of it is released).  Idempotent."""
    def unlink(self) -> None:
        """Close this process's descriptor: the segment can no longer be handed to new
        processes from here.  The mapping, and every process attached, is unaffected."""
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...
    def __reduce__(self) -> tuple[Any, ...]: ...

@disjoint_base
class Event:
    """A futex-backed wake-up signal at a 64-byte line of a `Segment`.

    Waiters call `wait_until` with a condition; notifiers call `notify` after making the
    condition true.  Used as the "any result is ready" doorbell of the manager.
    """

    SIZE: ClassVar[int]
    def __new__(cls, segment: Segment, offset: int, init: bool = False) -> Self: ...
    @property
    def segment(self) -> Segment: ...
    @property
    def offset(self) -> int: ...
    def notify(self) -> None:
        """Wake every waiter (one fence and one load when there is none)."""
    def notify_all(self) -> None: ...
    def wait_until(self, condition: Callable[[], _T], timeout: float | None = None,
                   poll_interval: float = 0.1,
                   check: Callable[[], object] | None = None) -> _T | None:
        """Call ``condition()`` until it returns something true and return that.  Between
        tries sleep until notified, at most ``poll_interval`` seconds at a time (then
        ``check()`` runs, if given).  Returns ``None`` when ``timeout`` expires."""

@disjoint_base
class RingBuffer:
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

    def __init__(self, capacity: int, entry_size: int, *, poll_interval: float = 0.1,
                 spin: float = 20e-6) -> None: ...
    @staticmethod
    def footprint(capacity: int, entry_size: int) -> int:
        """Bytes of shared memory a ring of this geometry occupies (a multiple of 64)."""
    @staticmethod
    def create_in(segment: Segment, offset: int, capacity: int, entry_size: int,
                  poll_interval: float = 0.1, spin: float = 20e-6) -> RingBuffer:
        """Lay out a new, empty ring at ``offset`` (a multiple of 64) of ``segment``, which
        must hold [`footprint`][unienv_mp.RingBuffer.footprint] bytes from there, and return
        it.  Several rings (and other data) can share one segment this way; processes handed
        the segment attach to the ring with [`attach`][unienv_mp.RingBuffer.attach]."""
    @staticmethod
    def attach(segment: Segment, offset: int, poll_interval: float = 0.1,
               spin: float = 20e-6) -> RingBuffer:
        """The ring that [`create_in`][unienv_mp.RingBuffer.create_in] laid out at
        ``offset`` of ``segment`` (in this process or another one that handed the segment
        over).  Raises ``ValueError`` if no ring lies there."""
    @property
    def segment(self) -> Segment: ...
    @property
    def offset(self) -> int: ...
    @property
    def capacity(self) -> int:
        """Most entries the ring holds."""
    @property
    def entry_size(self) -> int:
        """Most bytes one entry holds."""
    @property
    def poll_interval(self) -> float:
        """Longest sleep, in seconds, before a blocked call re-checks ``check`` and signals."""
    @property
    def is_shutdown(self) -> bool:
        """True once any process called [`shutdown`][unienv_mp.RingBuffer.shutdown]."""
    @property
    def closed(self) -> bool:
        """True once this process called [`close`][unienv_mp.RingBuffer.close]."""
    def __len__(self) -> int: ...
    def empty(self) -> bool:
        """True if the ring holds no entry (a snapshot: others may push meanwhile)."""
    def full(self) -> bool:
        """True if every cell is taken (a snapshot: others may pop meanwhile)."""
    def push(self, data: ReadableBuffer, block: bool = True, timeout: float | None = None,
             *, check: Callable[[], object] | None = None) -> None:
        """Append ``data`` (any bytes-like object of at most ``entry_size`` bytes).

        Blocks while the ring is full (``block=False``: raises `queue.Full` at once;
        ``timeout``: raises `queue.Full` after that many seconds).  Raises
        [`RingClosed`][unienv_mp.RingClosed] if the ring was shut down, ``ValueError`` if
        ``data`` is longer than ``entry_size``.  ``check``, if given, is called every
        ``poll_interval`` seconds while blocked; an exception from it ends the wait.
        """
    def push_nowait(self, data: ReadableBuffer) -> None:
        """``push(data, block=False)``."""
    def push_many(self, items: Iterable[ReadableBuffer], block: bool = True,
                  timeout: float | None = None, *,
                  check: Callable[[], object] | None = None) -> int:
        """Append every bytes-like object of the sequence ``items`` in order, claiming as
        many cells as are free with one atomic operation.  Returns how many were pushed:
        all of them when ``block`` (raising `queue.Full` if ``timeout`` expires first),
        possibly fewer (even 0) when not.  If it raises part-way (timeout, shutdown, an
        exception from ``check``), the items before the failure were pushed: the exception's
        ``pushed`` attribute says how many."""
    def pop(self, block: bool = True, timeout: float | None = None, *,
            check: Callable[[], object] | None = None) -> bytes:
        """Remove and return the oldest entry as ``bytes``.

        Blocks while the ring is empty (``block=False``: raises `queue.Empty` at once;
        ``timeout``: after that many seconds).  Raises [`RingClosed`][unienv_mp.RingClosed]
        once the ring is shut down and empty.  ``check`` as for
        [`push`][unienv_mp.RingBuffer.push].
        """
    def pop_nowait(self) -> bytes:
        """``pop(block=False)``."""
    def pop_many(self, max_items: int, block: bool = True, timeout: float | None = None,
                 *, check: Callable[[], object] | None = None) -> list[bytes]:
        """Remove up to ``max_items`` of the oldest entries with one atomic claim and return
        them as a list of ``bytes``.  When ``block``, waits until at least one is there
        (raising `queue.Empty` if ``timeout`` expires); otherwise the list may be empty.
        Raises [`RingClosed`][unienv_mp.RingClosed] once the ring is shut down and empty."""
    def push_tagged(self, tag: int, aux: int, value: int, payload: ReadableBuffer = b"",
                    block: bool = True, timeout: float | None = None, *,
                    check: Callable[[], object] | None = None,
                    record: _Appendable[int] | None = None) -> None:
        """Push one entry made of a header of ``ENTRY_HEADER`` bytes (``tag``, ``aux``,
        ``value``) followed by ``payload`` (bytes-like, at most ``entry_size -
        ENTRY_HEADER`` bytes).  Same blocking rules as [`push`][unienv_mp.RingBuffer.push].
        The queue and the sampler describe messages this way: what kind, which slot, how
        many bytes, and small payloads inline.

        ``record``: if given (a list or deque), ``record.append(value)`` runs inside this
        call once the entry is in the ring, and only then.  A Python caller can be
        interrupted (a Ctrl-C's ``KeyboardInterrupt``) right after any call returns, so
        it cannot tell from the return alone whether the push happened; ``record`` can."""
    def pop_tagged(self, block: bool = True, timeout: float | None = None, *,
                   check: Callable[[], object] | None = None,
                   into: _Appendable[tuple[int, int, int, bytes]] | None = None,
                   ) -> tuple[int, int, int, bytes]:
        """Pop one entry pushed by [`push_tagged`][unienv_mp.RingBuffer.push_tagged];
        returns ``(tag, aux, value, payload)`` with ``payload`` as ``bytes``.

        ``into``: if given (a list or deque), the entry is also appended to it inside this
        call, so that an entry taken off the ring is never lost to a ``KeyboardInterrupt``
        landing right after the call returns (see ``record`` of
        [`push_tagged`][unienv_mp.RingBuffer.push_tagged])."""
    def push_while_mapped(self, data: ReadableBuffer) -> None:
        """Push ``data`` without waiting (``queue.Full`` if the ring is full) as long as the
        ring's memory is mapped in this process, even after
        [`close`][unienv_mp.RingBuffer.close]: a close while views of the segment are alive
        leaves it mapped until they are released, and what they held (a queue's slot) can
        still be handed back to the other processes."""
    def shutdown(self) -> None:
        """Mark the ring closed for every process and wake every blocked caller."""
    def close(self) -> None:
        """Detach this process from the ring (the ring lives on in other processes).  If
        this process created the ring and no other process attached, its memory is freed."""
    def unlink(self) -> None:
        """Stop new processes from attaching through this process (see
        [`Segment.unlink`][unienv_mp.Segment.unlink])."""
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...
    def __reduce__(self) -> tuple[Any, ...]: ...
