"""Whether this process wrote the data since a pool of workers was forked: the page table's
answer, checked against a worker's copy, which sees every write, also those torch's version
counters miss.

The trick, once.  A worker started with fork shares the training process's memory page by
page, copy-on-write: until one of the two writes a page, both map the same physical page.
The first write by the training process gives it a private copy, mapped by it alone.
Linux reports, for each page of this process, whether it is mapped by this process alone
(``/proc/self/pagemap``, bit 56, "exclusively mapped", since Linux 4.2, readable without
privileges).  So while the processes forked at the copy (the snapshot process, the
workers) are alive, a page of the data that is present and *not* ours alone was not
written by this process since: through torch, through ``tensor.numpy()``,
``tensor.data``, ctypes, ``readinto``, anything.  A page that is not present and not
swapped out was never touched since, either.

The others are *candidates*.  A page is ours alone also when something else on it was
written (a small tensor shares its page with other objects of the heap; a large one its
first and last page), or when the processes that shared it wrote their own copy; a page
swapped out cannot tell.  So each candidate is settled by its bytes: the data's part of
the page is read from a process that holds the copy (``process_vm_readv``: allowed on our
own children and theirs) and compared with ours.  Only a difference counts as written.

What else could fool it, and how that is kept safe:

* A later fork (a DataLoader's worker, another pool's) maps our written pages again, and
  they stop being ours alone.  A hook run before every ``os.fork()`` of this process
  (`os.register_at_fork`) checks every witness first, and a witness that finds a write
  stays written for good.  (C code that forks without running Python's at-fork hooks is
  not seen; a child that calls ``exec`` at once shares nothing for longer than that.)
* No process holding the copy can be read (all gone, or refused): then nothing can tell,
  and `PageWitness.written` answers None, as where the page table cannot be read.  (Once
  every process holding the copy is gone, a process forked now is the copy's only holder:
  what it copies is the data as it is.)
* Memory shared between processes (``share_memory_()``, ``multiprocessing=True``
  buffers) is not a copy: workers read it as it is, so it is not watched.

Where ``/proc/self/pagemap`` cannot be read (another kernel, a sandbox), `PageWitness`
answers None: it cannot tell.
"""
import ctypes
import os
import weakref

import numpy as np

__all__ = ["PageWitness", "PAGE"]

PAGE = os.sysconf("SC_PAGE_SIZE")

_PRESENT = np.uint64(1 << 63)
_SWAPPED = np.uint64(1 << 62)
_EXCLUSIVE = np.uint64(1 << 56)
#: Pagemap entries read at once (8 bytes each).
_CHUNK = 1 << 18
#: Candidate pages compared with a holder's copy at once.
_BATCH = 256

#: Weak references to the witnesses not yet written, checked before every fork (see the
#: module's docstring).  A plain set: adding, discarding and copying it are single steps
#: under the GIL, so no lock is needed (a lock held by another thread at a fork would stay
#: held for good in the child).
_live = set()


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_readv = None


def _process_vm_readv():
    global _readv
    if _readv is None:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                       ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        _readv = fn
    return _readv


def _candidates(fd, start, nbytes):
    """The page numbers of ``[start, start + nbytes)`` that may have been written (see the
    module's docstring), as a numpy array."""
    first = start // PAGE
    last = (start + nbytes - 1) // PAGE
    out = []
    page = first
    while page <= last:
        n = min(_CHUNK, last - page + 1)
        raw = os.pread(fd, 8 * n, 8 * page)
        if len(raw) != 8 * n:
            raise OSError(f"short read of the page table ({len(raw)} of {8 * n} bytes)")
        entries = np.frombuffer(raw, dtype=np.uint64)
        present = (entries & _PRESENT) != 0
        maybe = np.flatnonzero((present & ((entries & _EXCLUSIVE) != 0))
                               | (~present & ((entries & _SWAPPED) != 0)))
        if maybe.size:
            out.append(maybe + page)
        page += n
    return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


def _differs(pid, pieces):
    """True if the bytes of ``pieces`` (``(address, nbytes)``) in process ``pid`` differ
    from ours; None if they cannot be read there."""
    total = sum(n for _, n in pieces)
    buf = ctypes.create_string_buffer(total)
    local = (_Iovec * len(pieces))()
    remote = (_Iovec * len(pieces))()
    off = 0
    base = ctypes.addressof(buf)
    for i, (addr, n) in enumerate(pieces):
        local[i].iov_base, local[i].iov_len = base + off, n
        remote[i].iov_base, remote[i].iov_len = addr, n
        off += n
    got = _process_vm_readv()(pid, local, len(pieces), remote, len(pieces), 0)
    if got != total:
        return None
    theirs = memoryview(buf.raw)
    off = 0
    for addr, n in pieces:
        if ctypes.string_at(addr, n) != theirs[off:off + n]:
            return True
        off += n
    return False


class PageWitness:
    """Tells whether this process wrote any byte of ``ranges`` (``(address, nbytes)``
    pairs: the data's memory) since it was made, which must be right after a fork whose
    children keep those pages; ``holders()``: the pids of processes that hold the copy
    (children of this process or theirs), the best first (see the module's docstring).
    `written` answers True, False, or None where the page table cannot be read."""

    def __init__(self, ranges, holders):
        self.ranges = tuple((int(a), int(n)) for a, n in ranges if n > 0)
        self.holders = holders
        self._written = False
        self._readable = True
        self._ref = weakref.ref(self, _live.discard)
        _live.add(self._ref)

    def written(self):
        """True if a byte of the data was written since this witness was made; False if
        none was; None if that cannot be told here (the page table cannot be read, or a
        page that may have been written cannot be compared: no holder can be read)."""
        if self._written:
            return True
        if not self._readable:
            return None
        try:
            fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._readable = False
            return None
        try:
            pieces = []
            for start, nbytes in self.ranges:
                end = start + nbytes
                for page in _candidates(fd, start, nbytes):
                    lo = max(start, int(page) * PAGE)
                    pieces.append((lo, min(end, int(page) * PAGE + PAGE) - lo))
        except OSError:
            self._readable = False
            return None
        finally:
            os.close(fd)
        if not pieces:
            return False
        differs = self._compare(pieces)
        if differs:
            self._mark()
        return differs

    def _compare(self, pieces):
        """True if one of ``pieces`` differs from a holder's copy, False if all are the
        same, None if no holder could be read."""
        try:
            holders = list(self.holders())
        except Exception:
            holders = []
        for pid in holders:
            verdict = False
            for i in range(0, len(pieces), _BATCH):
                verdict = _differs(pid, pieces[i:i + _BATCH])
                if verdict is not False:
                    break
            if verdict is not None:
                return verdict
        return None

    def _mark(self):
        self._written = True
        _live.discard(self._ref)

    def close(self):
        """Stop watching (the pool is gone)."""
        self._mark()


def _before_fork():
    # A fork maps every written page of this process again: look first (see the module's
    # docstring).  Nothing raised here may stop the fork.  (As in any at-fork hook, a
    # Ctrl-C landing in it is dropped by Python: it reads the page table, and is short.)
    for ref in list(_live):
        w = ref()
        if w is None:
            continue
        try:
            w.written()
        except Exception:
            pass


def _in_child():
    _live.clear()   # (a child's copies of the witnesses watch nothing of its own)


os.register_at_fork(before=_before_fork, after_in_child=_in_child)
