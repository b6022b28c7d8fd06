"""The worker process: take tasks from its ring, run the target, write results into its own
slots, announce them on its result ring.  Started by the manager, through a
`WorkerHandle`."""
import faulthandler
import os
import pickle
import signal
import time

from .. import _os
from .. import stats as _stats
from .._transport import codec as _codec
from .._transport import protocol as P
from .._transport.result_slots import ResultSlots
from .._transport.ring import Event, RingBuffer, segment_from_peer
from ..errors import MAX_TRACEBACK, RingClosed, error_payload

__all__ = ["worker_main"]

_ST_OK = P.ST_OK


class _Stop(Exception):
    """The worker was told to stop (done_event set)."""


def _fatal_payload(exc, limit):
    """The encoded error of a worker that cannot start (or cannot write a result into a
    slot), cut down to fit inline."""
    for tb, msg, keep in ((MAX_TRACEBACK, MAX_TRACEBACK, True), (2000, 500, False),
                          (200, 100, False)):
        info = error_payload(exc, tb, msg)
        if not keep:
            info["exception"] = None
        data = _codec.encode(info)
        if len(data) <= limit:
            return data
    return _codec.encode({"type": "builtins.Exception", "message": "worker could not start",
                          "traceback": "", "exception": None})


class _Results:
    """The worker's side of its result ring: publishes each result, inline or in a slot,
    and rings the parent's doorbell."""

    def __init__(self, index, ring, doorbell, check):
        self.ring = ring
        self.doorbell = doorbell
        self.check = check
        self.inline_max = ring.entry_size - P.ENTRY_HEADER
        self.slots = ResultSlots(f"slot{index}")

    def send(self, status, slot, ticket, value):
        """Publish the result; returns its status (a result that cannot be written is an
        error)."""
        ring, check = self.ring, self.check
        if isinstance(value, P.SlotWriter):
            try:
                where, payload = self._write(slot, value)
            except Exception as e:   # e.g. rows out of bounds, no memory for a slot
                status, value = P.ST_ERROR, error_payload(e)
            else:
                ring.push_tagged(P.tag(status, where), slot, ticket, payload, check=check)
                self.doorbell.notify()
                return status
        try:
            p = _codec.prepare(value)
        except Exception as e:   # e.g. a CUDA tensor, an unpicklable leaf
            status, p = P.ST_ERROR, _codec.prepare(error_payload(e))
        if p.nbytes <= self.inline_max:
            ring.push_tagged(P.tag(status, P.AT_INLINE), slot, ticket,
                             _codec.encode_prepared(p), check=check)
        else:
            try:
                gen, sseg, cache = self.slots.get(slot, p.nbytes)
                with memoryview(sseg) as mv:
                    _codec.write(p, mv)
                desc = P.SLOT_DESC.pack(gen, sseg.fd, sseg.ino, sseg.size, p.nbytes)
            except Exception as e:   # e.g. out of memory or descriptors for a slot
                status = P.ST_ERROR
                ring.push_tagged(P.tag(status, P.AT_INLINE), slot, ticket,
                                 _fatal_payload(e, self.inline_max), check=check)
            else:
                ring.push_tagged(P.tag(status, P.AT_SLOT), slot, ticket, desc, check=check)
        self.doorbell.notify()
        return status

    def _write(self, slot, writer):
        """Let ``writer`` write its result (inline if it is small, as encoded results
        are); returns where it is and the entry's payload."""
        nbytes = writer.nbytes
        if nbytes <= self.inline_max:
            buf, cache = self.slots.inline_buffer(nbytes)
            writer.write_into(buf, cache)
            return P.AT_INLINE, buf
        gen, sseg, cache = self.slots.get(slot, nbytes)
        writer.write_into(sseg, cache)
        return P.AT_SLOT, P.SLOT_DESC.pack(gen, sseg.fd, sseg.ino, sseg.size, nbytes)

    def fatal(self, exc):
        """The worker cannot start (``exc``): say so, before it exits."""
        self.ring.push_tagged(P.tag(P.ST_FATAL, P.AT_INLINE), 0, 0,
                              _fatal_payload(exc, self.inline_max))
        self.doorbell.notify()


def worker_main(index, target_fn, seg, doorbell_seg, parent_pid, init_fn, seed, options):
    """Entry point of a worker process (see MultiProcessingSampleManager)."""
    _os.ignore_sigint()   # Ctrl-C is the parent's to handle
    _os.exit_with_parent(parent_pid, options.get("pdeathsig", False))
    _os.limit_threads()
    poll = options.get("poll_interval", 0.005)
    spin = options.get("spin", 20e-6)
    done_event = options.get("done_event")
    magic, version, t_off, _, _, r_off, _, _ = P.WORKER_HEADER.unpack_from(seg, 0)
    if magic != P.WORKER_MAGIC or version != P.WORKER_VERSION:
        os._exit(3)
    tasks = RingBuffer.attach(seg, t_off, poll, spin)

    def check():
        if done_event is not None and done_event.is_set():
            raise _Stop

    out = _Results(index, RingBuffer.attach(seg, r_off, poll, spin), Event(doorbell_seg, 0),
                   check)
    stack_pipe = options.get("stack_pipe")
    if stack_pipe is not None:
        # The parent asks for this process's Python stacks with SIGUSR1 (a stalled task,
        # see MultiProcessingSampleManager's stall_timeout): faulthandler writes them from
        # the signal handler itself, so they come even from a thread stuck in C code.
        faulthandler.register(signal.SIGUSR1, file=stack_pipe.fd, all_threads=True)
    counters = _stats.WorkerCounters(
        memoryview(seg)[P.STATS_AT:P.STATS_AT + 8 * _stats.COUNTERS].cast("Q"))
    if init_fn is not None and seed is not None:
        try:
            init_fn(seed)
        except Exception as e:
            out.fatal(e)
            return
    counters.started(time.monotonic_ns(), time.process_time_ns())
    try:
        _serve(tasks, target_fn, out, counters, parent_pid)
    except (RingClosed, _Stop):
        pass


def _serve(tasks, target_fn, out, counters, parent_pid):
    """Take tasks and publish their results until told to stop."""
    batches_in = getattr(target_fn, "batches_in", None)
    clock = time.monotonic_ns
    begin, end, send, check = counters.begin, counters.end, out.send, out.check
    n_check, unpack_check, task_check = P.TASK_CHECK.size, P.TASK_CHECK.unpack, P.task_check
    while True:
        t, slot, ticket, payload = tasks.pop_tagged(check=check)
        body = payload[:-n_check]
        if (len(payload) < n_check
                or unpack_check(payload[-n_check:])[0] != task_check(t, slot, ticket, body)):
            os._exit(_os.EXIT_TASK_REWRITTEN)   # (see _os.EXIT_TASK_REWRITTEN)
        payload = body
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
