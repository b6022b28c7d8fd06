"""The worker process: take tasks from its ring, run the target, write results into its own
slots, announce them on its result ring.  Started by the manager, through a
:class:`~unienv_mp._worker_handle.WorkerHandle`."""
import faulthandler
import os
import pickle
import signal
import sys
import time
import traceback

from . import _codec
from . import _process
from . import _protocol as P
from . import stats as _stats
from ._ring import Event, RingBuffer, Segment, segment_from_peer
from .errors import RingClosed

_ST_OK = P.ST_OK
_PAGE = 4096
_MIN_SLOT = 64 * 1024
_MAX_TRACEBACK = 20_000


class _Stop(Exception):
    """The worker was told to stop (done_event set)."""


def limit_threads():
    """Run torch ops single-threaded in a worker, as torch's DataLoader does: a forked
    child inherits the parent's OpenMP pool state but not its threads, and the first
    parallel op would wait forever for them.  The workers are the parallelism."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def error_payload(exc, max_traceback=_MAX_TRACEBACK, max_message=_MAX_TRACEBACK):
    """What a worker sends for an exception: type, message, traceback, and the exception
    itself, pickled (bytes), when it survives pickling *and unpickling* here (an exception
    whose ``__init__`` takes other arguments than its ``args`` pickles but does not load).
    It is pickled on its own so that the receiver, which may not be able to import its
    class, still gets the rest (see ``WorkerError.from_payload``)."""
    try:
        original = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        if type(pickle.loads(original)) is not type(exc):
            original = None
    except Exception:
        original = None
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if len(tb) > max_traceback:
        tb = "...\n" + tb[-max_traceback:]
    try:
        message = str(exc)
    except Exception:
        message = f"<{type(exc).__name__} whose str() failed>"
    if len(message) > max_message:
        message = message[:max_message] + "..."
    t = type(exc)
    return {"type": f"{t.__module__}.{t.__qualname__}", "message": message,
            "traceback": tb, "exception": original}


def _fatal_payload(exc, limit):
    """The encoded error of a worker that cannot start (or cannot write a result into a
    slot), cut down to fit inline."""
    for tb, msg, keep in ((_MAX_TRACEBACK, _MAX_TRACEBACK, True), (2000, 500, False),
                          (200, 100, False)):
        info = error_payload(exc, tb, msg)
        if not keep:
            info["exception"] = None
        data = _codec.encode(info)
        if len(data) <= limit:
            return data
    return _codec.encode({"type": "builtins.Exception", "message": "worker could not start",
                          "traceback": "", "exception": None})


class SlotWriter:
    """A result that writes itself into the worker's memory, instead of being encoded by
    the codec: what a work function returns to gather a batch straight into a slot (see
    :mod:`unienv_mp.gather`).

    ``nbytes``: the bytes it needs.  ``write_into(buffer, cache)`` writes a complete slot
    encoding (as :func:`_codec.write` would) at the start of ``buffer``, a writable buffer
    of at least ``nbytes``; ``cache`` is a dict that lives as long as that buffer does, for
    whatever the writer keeps per buffer (views of it, typically).
    """
    __slots__ = ()
    nbytes = 0

    def write_into(self, buffer, cache):
        raise NotImplementedError


class _Slots:
    """This worker's result slots: one growable segment per slot number, and small reused
    buffers for SlotWriter results that travel inline."""

    def __init__(self, index):
        self.index = index
        self.segs = {}     # slot -> [generation, Segment, cache of the SlotWriters]
        self.inline = {}   # nbytes -> (bytearray, cache of the SlotWriters)

    def get(self, slot, nbytes):
        entry = self.segs.get(slot)
        if entry is None or entry[1].size < nbytes:
            size = max(_MIN_SLOT, (nbytes + nbytes // 8 + _PAGE - 1) // _PAGE * _PAGE)
            gen = 1 if entry is None else entry[0] + 1
            seg = Segment.create(size, f"slot{self.index}")
            if entry is not None:
                # (views the old cache holds keep the old mapping until it is dropped here;
                # the parent keeps its own mapping for as long as it needs)
                entry[2].clear()
                entry[1].close()
            entry = [gen, seg, {}]
            self.segs[slot] = entry
        return entry

    def inline_buffer(self, nbytes):
        entry = self.inline.get(nbytes)
        if entry is None:
            if len(self.inline) >= 16:
                self.inline.clear()
            entry = self.inline[nbytes] = (bytearray(nbytes), {})
        return entry


def worker_main(index, target_fn, seg, doorbell_seg, parent_pid, init_fn, seed, options):
    """Entry point of a worker process (see MultiProcessingSampleManager)."""
    _process.ignore_sigint()   # Ctrl-C is the parent's to handle
    _process.exit_with_parent(parent_pid, options.get("pdeathsig", False))
    limit_threads()
    poll = options.get("poll_interval", 0.005)
    spin = options.get("spin", 20e-6)
    done_event = options.get("done_event")
    magic, version, t_off, _, _, r_off, _, _ = P.WORKER_HEADER.unpack_from(seg, 0)
    if magic != P.WORKER_MAGIC or version != P.WORKER_VERSION:
        os._exit(3)
    tasks = RingBuffer.attach(seg, t_off, poll, spin)
    results = RingBuffer.attach(seg, r_off, poll, spin)
    doorbell = Event(doorbell_seg, 0)
    inline_max = results.entry_size - P.ENTRY_HEADER
    stack_pipe = options.get("stack_pipe")
    if stack_pipe is not None:
        # The parent asks for this process's Python stacks with SIGUSR1 (a stalled task,
        # see MultiProcessingSampleManager's stall_timeout): faulthandler writes them from
        # the signal handler itself, so they come even from a thread stuck in C code.
        faulthandler.register(signal.SIGUSR1, file=stack_pipe.fd, all_threads=True)
    counters = _stats.WorkerCounters(
        memoryview(seg)[P.STATS_AT:P.STATS_AT + 8 * _stats.COUNTERS].cast("Q"))
    batches_in = getattr(target_fn, "batches_in", None)
    clock = time.monotonic_ns
    begin, end = counters.begin, counters.end

    def check():
        if done_event is not None and done_event.is_set():
            raise _Stop

    def send(status, slot, ticket, value):
        """Publish the result; returns its status (a result that cannot be written is an
        error)."""
        if isinstance(value, SlotWriter):
            try:
                where, payload = write(slot, value)
            except Exception as e:   # e.g. rows out of bounds, no memory for a slot
                status, value = P.ST_ERROR, error_payload(e)
            else:
                results.push_tagged(P.tag(status, where), slot, ticket, payload, check=check)
                doorbell.notify()
                return status
        try:
            p = _codec.prepare(value)
        except Exception as e:   # e.g. a CUDA tensor, an unpicklable leaf
            status, p = P.ST_ERROR, _codec.prepare(error_payload(e))
        if p.nbytes <= inline_max:
            results.push_tagged(P.tag(status, P.AT_INLINE), slot, ticket,
                                _codec.encode_prepared(p), check=check)
        else:
            try:
                gen, sseg, cache = slots.get(slot, p.nbytes)
                with memoryview(sseg) as mv:
                    _codec.write(p, mv)
                desc = P.SLOT_DESC.pack(gen, sseg.fd, sseg.ino, sseg.size, p.nbytes)
            except Exception as e:   # e.g. out of memory or descriptors for a slot
                status = P.ST_ERROR
                results.push_tagged(P.tag(status, P.AT_INLINE), slot, ticket,
                                    _fatal_payload(e, inline_max), check=check)
            else:
                results.push_tagged(P.tag(status, P.AT_SLOT), slot, ticket, desc,
                                    check=check)
        doorbell.notify()
        return status

    def write(slot, writer):
        """Let ``writer`` write its result (inline if it is small, as encoded results
        are); returns where it is and the entry's payload."""
        nbytes = writer.nbytes
        if nbytes <= inline_max:
            buf, cache = slots.inline_buffer(nbytes)
            writer.write_into(buf, cache)
            return P.AT_INLINE, buf
        gen, sseg, cache = slots.get(slot, nbytes)
        writer.write_into(sseg, cache)
        return P.AT_SLOT, P.SLOT_DESC.pack(gen, sseg.fd, sseg.ino, sseg.size, nbytes)

    if init_fn is not None and seed is not None:
        try:
            init_fn(seed)
        except Exception as e:
            results.push_tagged(P.tag(P.ST_FATAL, P.AT_INLINE), 0, 0,
                                _fatal_payload(e, inline_max))
            doorbell.notify()
            return
    counters.started(clock(), time.process_time_ns())
    slots = _Slots(index)
    try:
        while True:
            t, slot, ticket, payload = tasks.pop_tagged(check=check)
            enc, where = P.untag(t)
            if enc == P.OP_STOP:
                break
            t0 = clock()
            begin(ticket, t0)
            work = None
            try:
                if enc == P.ENC_PICKLE:
                    work = pickle.loads(payload)
                else:
                    work = _read_work(where, payload, parent_pid)
                value, status = target_fn(work), P.ST_OK
            except Exception as e:
                value, status = error_payload(e), P.ST_ERROR
            status = send(status, slot, ticket, value)
            n = 1 if batches_in is None or work is None else batches_in(work)
            del work, value   # (destructors are part of the task: a hang there is a stall)
            end(n, status != _ST_OK, clock() - t0)
    except (RingClosed, _Stop):
        pass


def _read_work(where, payload, parent_pid):
    if where == P.AT_INLINE:
        return _codec.decode(payload, copy=True)
    pid, fd, ino, size, nbytes = P.TASK_SPILL_DESC.unpack(payload)
    seg = segment_from_peer(pid, fd, ino, size, "task spill")
    try:
        with memoryview(seg) as mv:
            return _codec.decode(mv[:nbytes], copy=True)
    finally:
        seg.close()
