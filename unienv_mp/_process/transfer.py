"""How a work function reaches workers started with spawn or forkserver: its CPU torch
tensors and numpy arrays through shared-memory segments, copied once for all workers, and
the rest pickled.

Under spawn and forkserver the work function (for the sampler: the wrapped sampler and
its ReplayBuffer) is pickled into each new process.  multiprocessing's pickler hands every
torch tensor to torch's reductions, which move its storage into a file under ``/dev/shm``
(a few MiB in a container by default); numpy arrays it copies into the pickle, once per
worker.  Here the work function travels as a `Parcel`, whose pickler takes every plain CPU
tensor and array out of the pickle and copies its bytes into a segment of ours (``memfd``,
see `Segment`) instead:

* **Once.**  The array data is copied at the first start only, and the rest of that
  first pickle (a ReplayBuffer's count, say) is kept and given to every later start
  (another worker, a replacement).  So every worker of a manager starts from the same
  snapshot of the data, whatever the parent changes later, and the copy costs memory
  once, for the manager's life.
* **Held objects.**  An object with a reduction registered with multiprocessing by
  others (a tensor already in shared memory or that torch moves there, such as a
  parameter; a storage; a connection) may be bound to one start: it hands the new
  process a descriptor, or takes a reference count per pickle.  So it is not put in the
  kept pickle: the pickle names it, the `Parcel` holds the object itself, and each start
  pickles the held objects anew, with their own reductions.  Every worker gets the same
  objects the first one got (a tensor in shared memory: the same memory, which all read
  as it is), even if the training process has put others in their place since.  A held
  tensor whose place in memory, shape or strides changed in place since the first start
  (``set_``, ``resize_``) would give later workers another view: such a start is refused
  (`ParcelChanged`).  Only a work function whose pickling itself hands a descriptor over
  (an object of its own that calls ``DupFd``) is pickled again at each start (`reused`
  stays False): its other parts are then read as they are at that start, and an array
  met again refers to the copy made at the first.
* **Copy-on-write.**  A worker maps the segments copy-on-write: the arrays it gets are
  views of them, writable, and pages it only reads are shared with every other worker.
  What a worker writes into such an array goes into its own copy of the page and is seen
  by no other process, as under fork.  Read-only numpy arrays stay read-only.
* **What keeps travelling as before:** tensors already in shared memory
  (``tensor.is_shared()``: a ReplayBuffer made with ``multiprocessing=True``, or a tensor
  mapped from a file), which torch's reductions hand over as the same memory, so that
  workers and the parent keep sharing it; tensor subclasses (UniEnv's
  ``MemoryMappedTensor`` travels as its file); numpy arrays that view a memory map;
  object arrays; tensors that are not plain strided CPU tensors, or that need their
  autograd history.
* Identity is kept within a worker: an array or tensor referred to twice is one object
  there, and tensors that shared a storage share one again.

Under fork none of this applies: the workers inherit the parent's memory.
"""
import io
import mmap
import os
import pickle
import sys
from multiprocessing import context as _mpcontext
from multiprocessing.reduction import ForkingPickler

import numpy as np

from .. import _os
from .._transport.ring import Segment

__all__ = ["Parcel", "ParcelChanged"]

_ALIGN = 64   # each array's bytes start on a cache line (and on any dtype's alignment)


class ParcelChanged(RuntimeError):
    """A held object of a `Parcel` changed in place since the first start: a process
    started now would not get what the first one got."""


class Parcel:
    """``target`` as an argument of a process started with spawn or forkserver (see the
    module's docstring).  The arrays' copies, and the held objects, live until `close`."""

    def __init__(self, target):
        self.target = target
        self._segments = []    # Segment, copy_on_write
        self._records = []     # record -> (segment index, offset, nbytes)
        self._known = {}       # key of an array's memory -> record
        self._keep = []        # what the keys were made from, kept so that no id is reused
        self._pickled = None   # the first start's pickle, where every start may have it
        self._held = ()        # the objects it names (see "Held objects")
        self._marks = ()       # what each held object was at the first start (_mark)
        self.closed = False

    def close(self):
        """Release the copies (processes started with them keep their mappings)."""
        self.closed = True
        segments, self._segments = self._segments, []
        self._records, self._known, self._keep = [], {}, []
        self._pickled = None
        self._held, self._marks = (), ()
        for seg in segments:
            seg.close()

    def __reduce__(self):
        if _mpcontext.get_spawning_popen() is None:
            raise TypeError("a Parcel is pickled only as an argument of a process being "
                            "started")
        if self.closed:
            raise RuntimeError("this Parcel was closed")
        data, held = self._pickled, self._held
        if data is None:
            # (the descriptors a pickling hands over are listed on the Popen being started)
            fds = getattr(_mpcontext.get_spawning_popen(), "_fds", None)
            handed = None if fds is None else len(fds)
            pickler = _Pickler(self)
            data = pickler.dump_target(self.target)
            held = tuple(pickler.held)
            if pickler.pending:
                self._add_segment(pickler.pending)
            if handed is not None and len(fds) == handed:
                # (nothing in it is bound to one start: kept, with what it names)
                with _os.interrupts_deferred():
                    self._pickled, self._held = data, held
                    self._marks = tuple(_mark(obj) for obj in held)
        else:
            for obj, mark in zip(held, self._marks):
                if _mark(obj) != mark:
                    raise ParcelChanged(
                        f"a {type(obj).__name__} that the workers started with (shared "
                        f"memory, held for every later start) has changed in place since "
                        f"the first one started: {mark} then, {_mark(obj)} now")
        return (_unpack, (data, tuple(self._records), list(self._segments), held))

    @property
    def reused(self):
        """True once the first start's pickle serves every later start (see the module's
        docstring: all but a work function whose pickling hands descriptors over)."""
        return self._pickled is not None

    def spot_check(self, blocks, rng):
        """Compare up to ``blocks`` blocks of `_BLOCK` bytes of each array copied (the
        first, the last and others drawn with ``rng``, a numpy Generator) with the array as
        it is now: False at the first that differs, True if none does, None if nothing was
        copied."""
        sources = self._keep
        if not sources:
            return None
        for (index, off, nbytes), source in zip(self._records, sources):
            now = _bytes_of(source)
            if now is None:
                continue
            with memoryview(self._segments[index]) as mv:
                copy = np.frombuffer(mv, dtype=np.uint8, count=nbytes, offset=off)
                n = -(-nbytes // _BLOCK)
                picks = {0, n - 1}
                if n > 2:
                    picks.update(int(i) for i in rng.integers(1, n - 1, min(blocks, n)))
                for i in picks:
                    lo, hi = i * _BLOCK, min(nbytes, (i + 1) * _BLOCK)
                    if not np.array_equal(now[lo:hi], copy[lo:hi]):
                        return False
                del copy
        return True

    def lookup(self, key):
        return self._known.get(key)

    def next_record(self, pending):
        return len(self._records) + len(pending)

    def _add_segment(self, pending):
        """Copy the arrays a pickling met for the first time into one new segment, and
        record where each lies.  Nothing is recorded if this fails (a later start tries
        again)."""
        offsets, end = [], 0
        for item in pending:
            offsets.append(end)
            end += -(-item.nbytes // _ALIGN) * _ALIGN
        try:
            seg = Segment.create(max(end, _ALIGN), "data", copy_on_write=True)
        except MemoryError as e:
            raise MemoryError(
                f"cannot copy the work function's {len(pending)} arrays into shared memory "
                f"for workers started with spawn or forkserver: {e}") from None
        try:
            with memoryview(seg) as mv:
                for item, off in zip(pending, offsets):
                    item.copy_into(mv, off, seg.fd)
        except BaseException:
            seg.close()
            raise
        # (recorded in one step that a Ctrl-C cannot cut in two: the record numbers that
        # the pickling gave out are the positions the records are appended at)
        with _os.interrupts_deferred():
            index = len(self._segments)
            self._segments.append(seg)
            for item, off in zip(pending, offsets):
                self._records.append((index, off, item.nbytes))
                self._known[item.key] = item.record
                self._keep.append(item.source)


#: Bytes compared at once by a spot check.
_BLOCK = 4096


def _bytes_of(source):
    """The bytes of an array the parcel copied (a torch storage, or a contiguous numpy
    array) as a flat uint8 array, as they are now; None for an array whose bytes are not
    in one piece (not compared)."""
    if isinstance(source, np.ndarray):
        if not (source.flags.c_contiguous or source.flags.f_contiguous):
            return None
        return np.ravel(source, order="K").view(np.uint8)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(source, torch.UntypedStorage):
        return torch.empty(0, dtype=torch.uint8).set_(source).numpy()
    return None


class _Pending:
    """An array's memory met for the first time by a pickling: to be copied."""
    __slots__ = ("key", "record", "nbytes", "source", "copy_into")

    def __init__(self, key, record, nbytes, source, copy_into):
        self.key = key
        self.record = record
        self.nbytes = nbytes
        self.source = source
        self.copy_into = copy_into


def _write(fd, off, data):
    """Write the bytes of ``data`` (a contiguous uint8 array) at ``off`` of the segment
    ``fd``, by ``pwrite``: the kernel copies them straight into the segment's pages, at
    twice the speed of a copy through its mapping, which takes a page fault per page."""
    view = memoryview(data)
    done, n = 0, len(view)
    while done < n:
        wrote = os.pwrite(fd, view[done:done + _WRITE_CHUNK], off + done)
        if wrote <= 0:
            raise OSError(f"pwrite into a shared-memory segment wrote nothing at "
                          f"{off + done}")
        done += wrote


#: Bytes per ``pwrite`` (Linux writes at most about 2 GiB in one call).
_WRITE_CHUNK = 1 << 30


def _on_file_or_shared(a):
    """True if numpy array ``a`` views a memory map, or a torch tensor in shared memory."""
    torch = sys.modules.get("torch")
    base = a.base
    while base is not None:
        if isinstance(base, (mmap.mmap, np.memmap)):
            return True
        if torch is not None and isinstance(base, torch.Tensor):
            return base.is_shared()
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return False


class _Pickler(ForkingPickler):
    """multiprocessing's pickler, with plain CPU tensors and numpy arrays taken out of the
    pickle as persistent ids that name their copy in the parcel's segments."""

    def __init__(self, parcel):
        self._out = io.BytesIO()
        super().__init__(self._out, pickle.HIGHEST_PROTOCOL)
        self.parcel = parcel
        self.pending = []       # _Pending, in record order
        self._pending = {}      # key -> record, for this pickling
        self._ids = {}          # id(obj) -> its persistent id (one object stays one)
        self._objs = []         # the objects in _ids, alive while it lasts
        self._torch = sys.modules.get("torch")
        # Types with a reduction registered with multiprocessing by others than
        # multiprocessing.reduction itself (whose own, for methods and partials, keep
        # nothing per start): torch's tensors, storages and parameters, connections.
        # Theirs may be bound to one pickling (a descriptor handed to the process being
        # started, a shared-memory reference count taken per pickle), so such objects are
        # held, and pickled anew at each start (see Parcel).
        self._others = {t for t, r in ForkingPickler._extra_reducers.items()
                        if getattr(r, "__module__", None) != "multiprocessing.reduction"}
        self.held = []          # the objects held, in the order the pickle names them

    def dump_target(self, target):
        self.dump(target)
        return self._out.getvalue()

    def persistent_id(self, obj):
        t = type(obj)
        if t is np.ndarray:
            make = self._array
        elif self._torch is not None and t is self._torch.Tensor:
            make = self._tensor
        elif t in self._others:
            make = self._hold
        else:
            return None
        pid = self._ids.get(id(obj))
        if pid is None:
            pid = make(obj)
            if pid is None and t in self._others:
                pid = self._hold(obj)   # (a tensor torch pickles itself)
            if pid is not None:
                self._ids[id(obj)] = pid
                self._objs.append(obj)
        return pid

    def _hold(self, obj):
        self.held.append(obj)
        return ("h", len(self._objs), len(self.held) - 1)

    def _record(self, key, nbytes, source, copy_into):
        record = self.parcel.lookup(key)
        if record is None:
            record = self._pending.get(key)
        if record is None:
            record = self.parcel.next_record(self.pending)
            self._pending[key] = record
            self.pending.append(_Pending(key, record, nbytes, source, copy_into))
        return record

    def _array(self, a):
        if a.dtype.hasobject or a.size == 0 or a.dtype.itemsize == 0 \
                or _on_file_or_shared(a):
            return None
        order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"

        def copy_into(mv, off, fd, a=a, order=order):
            if a.flags.c_contiguous or a.flags.f_contiguous:
                _write(fd, off, np.ravel(a, order="K").view(np.uint8))
                return
            dst = np.frombuffer(mv, dtype=a.dtype, count=a.size, offset=off)
            np.copyto(dst.reshape(a.shape, order=order), a, casting="no")

        record = self._record(("np", id(a)), a.nbytes, a, copy_into)
        return ("n", len(self._objs), record, a.dtype, a.shape, order,
                bool(a.flags.writeable))

    def _tensor(self, t):
        torch = self._torch
        if (t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized
                or t.is_nested or t.is_conj() or t.is_neg()
                or (t.requires_grad and not t.is_leaf) or t.is_shared()):
            return None   # pickled as torch pickles it
        storage = t.untyped_storage()
        nbytes = storage.nbytes()

        def copy_into(mv, off, fd, storage=storage):
            _write(fd, off, torch.empty(0, dtype=torch.uint8).set_(storage).numpy())

        if nbytes == 0:
            record = None
        else:
            record = self._record(("torch", storage.data_ptr(), nbytes), nbytes, storage,
                                  copy_into)
        state = t.__dict__ or None
        return ("t", len(self._objs), record, t.dtype, tuple(t.size()), t.stride(),
                t.storage_offset(), t.requires_grad, state)


def _mark(obj):
    """What a held object is, for `Parcel` to tell that it changed in place: a tensor's or a
    storage's memory and view of it; None for other objects (handles, not data)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(obj, torch.Tensor):
        return (obj.data_ptr(), tuple(obj.shape), obj.stride(), obj.storage_offset(),
                obj.dtype, obj.device.type, obj.is_shared())
    if isinstance(obj, torch.UntypedStorage):
        return (obj.data_ptr(), obj.nbytes(), obj.device.type)
    return None


def _unpack(data, records, segments, held=()):
    """In the new process: the work function, its arrays views of ``segments`` (mapped
    copy-on-write), and the objects it names in ``held`` as they came.  The segments'
    descriptors are closed: the mappings are what the arrays use, and they last as long as
    the arrays."""
    loader = _Unpickler(io.BytesIO(data), records, segments, held)
    try:
        return loader.load()
    finally:
        for i, seg in enumerate(segments):
            if loader.views[i] is None:
                seg.close()
            else:
                seg.unlink()


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, records, segments, held):
        super().__init__(file)
        self.records = records
        self.segments = segments
        self.held = held
        self.views = [None] * len(segments)   # a memoryview of each segment used
        self.objects = {}                     # object number -> the array or tensor
        self.storages = {}                    # record -> torch UntypedStorage

    def _where(self, record):
        index, off, nbytes = self.records[record]
        mv = self.views[index]
        if mv is None:
            # (the arrays' bases hold this view, and the view holds the mapping)
            mv = self.views[index] = memoryview(self.segments[index])
        return mv, off, nbytes

    def persistent_load(self, pid):
        if pid[0] == "h":
            return self.held[pid[2]]
        obj = self.objects.get(pid[1])
        if obj is None:
            obj = self.objects[pid[1]] = (self._array if pid[0] == "n" else self._tensor)(*pid[2:])
        return obj

    def _array(self, record, dtype, shape, order, writeable):
        mv, off, _ = self._where(record)
        count = 1
        for n in shape:
            count *= n
        a = np.frombuffer(mv, dtype=dtype, count=count, offset=off).reshape(shape,
                                                                             order=order)
        if not writeable:
            a.flags.writeable = False
        return a

    def _tensor(self, record, dtype, size, stride, storage_offset, requires_grad, state):
        import torch
        if record is None:
            storage = torch.UntypedStorage(0)
        else:
            storage = self.storages.get(record)
            if storage is None:
                mv, off, nbytes = self._where(record)
                storage = self.storages[record] = torch.frombuffer(
                    mv, dtype=torch.uint8, count=nbytes, offset=off).untyped_storage()
        t = torch.empty(0, dtype=dtype).set_(storage, storage_offset, size, stride)
        if requires_grad:
            t.requires_grad_(True)
        if state:
            t.__dict__.update(state)
        return t
