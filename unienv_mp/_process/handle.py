"""WorkerHandle: the parent's side of one worker, i.e. its process, the segment holding its
two rings, and the result slots it writes into, one process after another.

The handle starts a process (`WorkerHandle.start`), pushes tasks and pops result entries on
its rings, maps the slot segments named by result entries, and keeps the slot numbers free
for new tasks.  When the process dies, `detach` takes the process and its memory off the
handle, to be stopped and released, and the next `start` begins a new *incarnation*: slot
numbers belong to one incarnation, since each process creates its own slots.

What to run, in which order, and what to do when a process dies is the manager's
(`unienv_mp._process.manager`).
"""
import collections
import errno
import os
import queue as _queue
import signal
import time

from .. import _os
from .. import stats as _stats
from .._transport import protocol as P
from .._transport.ring import RingBuffer, Segment, segment_from_peer
from ..errors import CodecError, PeerGoneError, RingClosed

__all__ = ["WorkerHandle", "WorkerDied", "WorkerStalled", "WorkerCorrupt",
           "TASK_CAPACITY", "TASK_INLINE", "RESULT_INLINE"]

#: Tasks a worker can have queued (its task ring); the manager keeps at most that many in
#: flight on one worker.
TASK_CAPACITY = 64
#: Bytes of a task entry's payload (larger work info: a one-off segment).  The payload
#: ends with the entry's check, so work info of up to TASK_INLINE - 4 bytes is inline.
TASK_INLINE = 8192
#: Largest encoded result carried inside a result entry (larger: a slot).
RESULT_INLINE = 4096

_unpack_slot = P.SLOT_DESC.unpack
_SLOT_DESC_SIZE = P.SLOT_DESC.size
_STATUSES = frozenset((P.ST_OK, P.ST_ERROR, P.ST_FATAL))
_AT_INLINE = P.AT_INLINE
_AT_SLOT = P.AT_SLOT
_task_check = P.task_check
_pack_check = P.TASK_CHECK.pack
_STARTED = _stats.STARTED


class WorkerDied(Exception):
    """The process of worker ``handle`` ended (raised while waiting on its rings)."""

    def __init__(self, handle):
        super().__init__(handle.index)
        self.handle = handle


class WorkerStalled(WorkerDied):
    """The process of worker ``handle`` has been on one task (``ticket``) for ``seconds``,
    longer than the manager's ``stall_timeout``, or has taken none of the tasks waiting for
    it for that long (``ticket`` None): it is to be killed and replaced."""

    def __init__(self, handle, ticket, seconds):
        super().__init__(handle)
        self.ticket = ticket
        self.seconds = seconds


class WorkerCorrupt(WorkerDied):
    """The process of worker ``handle`` wrote on its rings what it could not have written
    (``what``: how it is wrong), e.g. user code in the worker wrote through a stray
    pointer into a ring or a slot descriptor: a result entry that is not one (``wrote``,
    the default) or a task ring whose counters or cells it overwrote (``wrote="into its
    task ring"``).  The process is to be killed and replaced, as if it had died.
    ``error`` is the `CodecError` that says so."""

    def __init__(self, handle, what, wrote="a corrupt result entry"):
        super().__init__(handle)
        self.error = CodecError(f"worker {handle.index} (pid {handle.pid}) wrote {wrote}: "
                                f"{what}")


class StallWatch:
    """What the stall watchdog remembers of one worker process between two looks at its
    counters (`check`): since when it has owed work while idle, and since when its
    answers have been short."""
    __slots__ = ("owing_since", "lacking_since")

    def __init__(self):
        self.owing_since = None     # (tasks it had ended, ns) when first seen owing work idle
        self.lacking_since = None   # (tasks it had ended, answers read, ns): see _answers

    def check(self, handle, counters, pushed, got, stall_ns):
        """Raise WorkerStalled if the process of ``handle`` (its ``counters``; ``pushed``
        tasks given to it, ``got`` of their answers read here) has been on its task in
        hand for longer than ``stall_ns`` nanoseconds, or has taken none of the tasks
        waiting for it for that long (``ticket`` None) while it was stopped (SIGSTOP, a
        debugger) or after it had ended tasks before (so it is past ``worker_init_fn``,
        whose time is not a stall); WorkerCorrupt if it hid a result (see `_answers`)."""
        # (the worker writes TICKET, then TASK_SINCE, per task: read the other way round,
        # and again, a ticket that did not change is the one TASK_SINCE belongs to)
        ticket = counters[_stats.TICKET]
        since = counters[_stats.TASK_SINCE]
        if since:
            self.owing_since = None
            if counters[_stats.TICKET] == ticket:
                elapsed = time.monotonic_ns() - since
                if elapsed > stall_ns:
                    raise WorkerStalled(handle, ticket, elapsed / 1e9)
            return
        # Between tasks.  It owes work while it has ended fewer tasks than it was given
        # (each task ends, TASKS counted, before the worker takes the next); the clock
        # starts again whenever it ends one.
        ended = counters[_stats.TASKS]
        if ended >= pushed:
            self.owing_since = None
            self._answers(handle, ended, got, stall_ns)
            return
        now = time.monotonic_ns()
        mark = self.owing_since
        if mark is None or mark[0] != ended:
            self.owing_since = (ended, now)
            return
        elapsed = now - mark[1]
        if elapsed > stall_ns and (ended or _os.is_stopped(handle.pid)):
            raise WorkerStalled(handle, None, elapsed / 1e9)

    def _answers(self, handle, ended, got, stall_ns):
        """Raise WorkerCorrupt if the process, idle with all its tasks ended (``ended``),
        has counted more of them answered than the ``got`` result entries read here, and
        for longer than ``stall_ns``: it made an entry it had published look unwritten (a
        stray write into its result ring), and the call waiting for that result would
        wait until its ``timeout``.

        Why the counts differ only for an instant otherwise: the process publishes each
        task's entry before it counts the task as ended, and a caller that checks this
        (while it waits) takes every entry that can be taken: a wait on this worker pops
        its ring, and a wait on several drains every ring before each sleep.  The mark
        starts again whenever either count moves."""
        if ended <= got:
            self.lacking_since = None
            return
        now = time.monotonic_ns()
        mark = self.lacking_since
        if mark is None or mark[:2] != (ended, got):
            self.lacking_since = (ended, got, now)
        elif now - mark[2] > stall_ns:
            raise WorkerCorrupt(handle, f"it counts {ended} tasks answered, and {got} "
                                        f"answers could be read",
                                "over a result it had published")


class _LivenessCheck:
    """Called while waiting on a worker's rings: raises WorkerDied if its process ended,
    WorkerStalled if it has been on one task longer than the stall timeout, RuntimeError
    if the handle was shut down (the manager was closed)."""
    __slots__ = ("handle", "stall_ns")

    def __init__(self, handle, stall_ns):
        self.handle = handle
        self.stall_ns = stall_ns

    def __call__(self):
        handle = self.handle
        proc = handle.proc
        if proc is not None and _os.has_exited(proc):
            raise WorkerDied(handle)
        if handle.shut_down:
            raise RuntimeError("this manager was closed (from another thread) during the call")
        if self.stall_ns is not None:
            handle.check_stall(self.stall_ns)


class _Detached:
    """A process taken off its handle, and its memory: `stop` ends it and releases the
    memory."""

    def __init__(self, proc, memory):
        self.proc = proc
        self.memory = memory

    def stop(self, join_timeout):
        try:
            for ring in self.memory[0]:
                ring.shutdown()   # should the process not be dead after all: it stops
            _os.stop_processes([self.proc] if self.proc is not None else [],
                                    join_timeout)
        finally:
            _close_memory(*self.memory)


def _close_memory(rings, seg, counters, stack_fd):
    for ring in rings:
        ring.close()
    if counters is not None:
        counters.release()
    if seg is not None:
        seg.close()
    if stack_fd is not None:
        os.close(stack_fd)


def _ring_layout():
    """Where a worker's rings lie in its segment: ``(task ring offset, task entry size,
    result ring offset, result ring capacity, result entry size, segment size)``."""
    task_entry = P.ENTRY_HEADER + TASK_INLINE
    result_entry = P.ENTRY_HEADER + RESULT_INLINE
    t_bytes = RingBuffer.footprint(TASK_CAPACITY, task_entry)
    # The manager keeps at most TASK_CAPACITY tasks in flight per worker, so a worker
    # never waits to publish a result.
    r_cap = TASK_CAPACITY + 2
    r_bytes = RingBuffer.footprint(r_cap, result_entry)
    t_off, r_off = P.RINGS_AT, P.RINGS_AT + t_bytes
    return t_off, task_entry, r_off, r_cap, result_entry, r_off + r_bytes


class WorkerHandle:
    """Worker ``index`` of a manager, as the parent sees it.

    Public attributes, read-only outside this class: ``index``; ``incarnation``, the number
    of processes started so far; ``proc``, the current ``Process`` (None between a death
    and the next start); ``pid``; ``shut_down``.
    """

    def __init__(self, index, launch):
        self.index = index
        self.incarnation = 0
        self.proc = None
        self.pid = None             # of proc (no Python code to run to read it)
        self.shut_down = False
        self._launch = launch
        launch.hold(index)
        self._check = _LivenessCheck(self, launch.stall_ns)
        self._seg = None
        self._tasks = None
        self._results = None
        self._rings = ()
        self._counters = None       # memoryview of the process's counter block (stats)
        self._stack_fd = None       # read end of the pipe its stacks come through
        self._slot_maps = {}        # slot -> (generation, Segment mapped here)
        # (a deque: a list taken down to empty and refilled, as a slot goes out and comes
        # back once per batch, is reallocated each time)
        self._free_slots = collections.deque()
        self._next_slot = 0
        # result entries taken off the ring and not yet recorded by the manager (see
        # next_result): the ring appends each one here itself
        self._popped = collections.deque()
        self.repeated = False       # the last next_result returned an entry returned before
        self.launched_ns = None     # monotonic ns at which its process was started
        self._pushed = 0            # tasks pushed to this incarnation
        self._received = 0          # result entries of this incarnation recorded
        # this incarnation made a result that was recorded (set by the ledger as it
        # records one, before the task is marked arrived): its worker's count of deaths
        # in a row starts again
        self.made_result = False
        self._watch = StallWatch()  # what the stall watchdog remembers of the process

    @property
    def has_process(self):
        """True between `start` and `detach`."""
        return self._tasks is not None

    @property
    def results_published(self):
        """Result entries the process published that were not popped yet."""
        return len(self._results) if self._results is not None else 0

    def has_exited(self):
        """True if it has a process and that process ended."""
        proc = self.proc
        return proc is not None and _os.has_exited(proc)

    def end(self, wait, kill=False):
        """``(code, how)``: the exit code of the process (None without a process, or if it
        is unknown: see `_os.exit_code`), waiting up to ``wait`` seconds for its exit
        status, and how it ended, in words.  ``kill``: send it SIGKILL first (through its
        pidfd: see `_os.send_signal`).  Its rings and slots stay with the handle until
        `detach`."""
        proc = self.proc
        if proc is not None and kill:
            _os.send_signal(proc, signal.SIGKILL)
        code = None if proc is None else _os.exit_code(proc, wait)
        return code, _os.describe_exit(code)

    # -- process --------------------------------------------------------------------------

    def start(self, seed, deadline=None, also=None):
        """Start a process, the next incarnation, with fresh rings and no slots.
        ``seed``: passed to the manager's ``worker_init_fn``; ``deadline`` and ``also``:
        see `Launch.start_process`.  Raises ``TypeError`` if the work function cannot be sent
        to the process, `CopyGone` if it could not start from the first workers' copy of
        the data, ``TimeoutError`` if the deadline came first.  Either the handle has the new
        process when this returns or raises (a ``KeyboardInterrupt`` arriving meanwhile
        is raised once the handle has it), or no process is left running."""
        _os.exit_if_reimporting_main()
        if self.shut_down:
            raise RuntimeError("this worker's manager was closed: no process starts now")
        launch = self._launch
        t_off, task_entry, r_off, r_cap, result_entry, size = _ring_layout()
        seg = Segment.create(size, f"worker{self.index}")
        tasks = results = proc = counters = None
        stack_r = stack_w = None
        adopted = False
        try:
            counters = memoryview(seg)[P.STATS_AT:P.STATS_AT + 8 * _stats.COUNTERS].cast("Q")
            stack_r, stack_w = os.pipe()
            os.set_blocking(stack_r, False)
            with memoryview(seg) as mv:
                P.WORKER_HEADER.pack_into(mv, 0, P.WORKER_MAGIC, P.WORKER_VERSION, t_off,
                                          TASK_CAPACITY, task_entry, r_off, r_cap,
                                          result_entry)
            tasks = RingBuffer.create_in(seg, t_off, TASK_CAPACITY, task_entry,
                                         launch.poll_interval, launch.spin)
            results = RingBuffer.create_in(seg, r_off, r_cap, result_entry,
                                           launch.poll_interval, launch.spin)
            proc, launched = launch.start_process(self.index, seg, seed, stack_w, deadline,
                                                  also)
            # The handle takes the process (and a pidfd of it) in one step that a Ctrl-C
            # cannot cut in two.
            with _os.interrupts_deferred():
                os.close(stack_w)   # (the process has its own now)
                stack_w = None
                self._adopt(proc, launched, seg, tasks, results, counters, stack_r)
                adopted = True
        except BaseException:
            if not adopted:
                if proc is not None:
                    _os.stop_half_started(proc)   # (a Ctrl-C as the handle took it)
                # (a worker started despite all is told to stop by its rings, then unmapped)
                for ring in (tasks, results):
                    if ring is not None:
                        ring.shutdown()
                if stack_w is not None:
                    os.close(stack_w)
                _close_memory((), seg, counters, stack_r)
            raise

    def _adopt(self, proc, launched, seg, tasks, results, counters, stack_r):
        """The handle takes a process just started and its memory, with fresh per-process
        bookkeeping (called with interrupts deferred)."""
        _os.open_pidfd(proc)
        self.incarnation += 1
        self._seg, self._tasks, self._results = seg, tasks, results
        self._rings = (tasks, results)
        self._counters, self._stack_fd = counters, stack_r
        self.proc, self.pid = proc, proc.pid
        self.launched_ns = launched
        self._popped = collections.deque()
        self._slot_maps = {}
        self._free_slots = collections.deque()
        self._next_slot = 0
        self._pushed = 0
        self._received = 0
        self.made_result = False
        self._watch = StallWatch()

    def detach(self):
        """Take the process (which died) and its memory off the handle, and return them,
        to be stopped and released with ``.stop(join_timeout)``.  Result entries not
        recorded and slots mapped are dropped with them.  Runs no Python code of other
        modules, so that the caller can make it part of one step that a Ctrl-C cannot cut
        in two."""
        detached = _Detached(self.proc, self._take_memory())
        self.proc = self.pid = None
        self._popped = collections.deque()
        return detached

    def _take_memory(self):
        memory = (self._rings, self._seg, self._counters, self._stack_fd)
        self._tasks = self._results = self._seg = self._counters = self._stack_fd = None
        self._rings = ()
        self._slot_maps = {}
        return memory

    def shut_down_rings(self):
        """Tell the process to stop: shut both rings down (a worker waiting for a task
        exits; one finishing a batch exits instead of taking the next), and make waits on
        this handle raise."""
        self.shut_down = True
        for ring in self._rings:
            try:
                ring.shutdown()
            except ValueError:
                pass

    def release_memory(self):
        """Unmap the rings, the segment and the slots (the process must have ended), for
        good: the handle starts no more processes (see `Launch`)."""
        try:
            _close_memory(*self._take_memory())
        finally:
            self._launch.let_go(self.index)

    # -- counters and stacks --------------------------------------------------------------

    def counters(self):
        """A copy of the process's counter block (see `unienv_mp.stats`), or None without a
        process."""
        counters = self._counters
        return None if counters is None else _stats.read(counters)

    @property
    def started_ns(self):
        """Monotonic ns at which the process began taking tasks (0: not yet, or none)."""
        counters = self._counters
        return 0 if counters is None else counters[_STARTED]

    def check_stall(self, stall_ns):
        """Raise WorkerStalled if the process has been on its task in hand for longer than
        ``stall_ns`` nanoseconds, or has taken none of the tasks waiting for it for that
        long; WorkerCorrupt if it hid a result for that long (see `StallWatch`)."""
        if self._counters is not None:
            self._watch.check(self, self._counters, self._pushed,
                              self._received + len(self._popped), stall_ns)

    def stacks(self, timeout=2.0):
        """The process's Python stacks, all threads, as text (faulthandler's format), or a
        line saying why there are none.  The process is signalled (SIGUSR1) and writes them
        itself, from the signal handler: a thread stuck in C code has them too."""
        fd, proc = self._stack_fd, self.proc
        if fd is None or proc is None:
            return "(no process)"
        if _os.is_stopped(proc.pid):
            return "(none: the process is stopped, e.g. by SIGSTOP, and cannot write them)"
        _os.read_available(fd, 0)   # (anything left from an earlier request)
        _os.send_signal(proc, signal.SIGUSR1)
        text = _os.read_available(fd, timeout).decode("utf-8", "replace")
        return text or f"(no stack came within {timeout} s)"

    # -- rings ----------------------------------------------------------------------------

    def push_task(self, tag, slot, ticket, payload, record):
        """Push a task entry, and append ``ticket`` to ``record`` if and only if it was
        pushed (the ring does that, inside the call: see ``RingBuffer.push_tagged``).
        Never waits.  Raises WorkerCorrupt if the task ring is full, shut down by no one,
        or corrupt: the process wrote into it.

        Why a full ring is corrupt: ``record`` (the worker's tasks in flight) holds fewer
        than TASK_CAPACITY tickets when a task is pushed (see ``WorkerPool.push``), a ticket
        leaves it only when its result has come, and the process takes its tasks in
        order, each off the ring (its cell free again) before it answers it.  So at most
        ``len(record)`` cells are taken, and the ring holds TASK_CAPACITY.

        The payload gets its check (see `unienv_mp._transport.protocol`'s task entries)."""
        payload += _pack_check(_task_check(tag, slot, ticket, payload))
        try:
            self._tasks.push_tagged(tag, slot, ticket, payload, False, None, record=record)
        except _queue.Full:
            raise WorkerCorrupt(self, f"the ring of {TASK_CAPACITY} tasks is full with "
                                      f"{len(record)} in flight",
                                "into its task ring") from None
        except (RingClosed, RuntimeError) as e:
            raise self._ring_fault(e, "", "into its task ring") from None
        self._pushed += 1

    def _ring_fault(self, error, ring, wrote="a corrupt result entry"):
        """What to raise for ``error`` met on one of this worker's rings (``RingClosed``,
        or the ``RuntimeError`` or ``ValueError`` of a ring found corrupt): ``error``
        itself if this process shut the rings (the manager was closed, maybe from another
        thread, meanwhile), else a WorkerCorrupt: a shut-down mark that no one here set,
        or a contradicted cell, was written by the process."""
        if self.shut_down:
            return error
        what = "it is shut down" if isinstance(error, RingClosed) else str(error)
        return WorkerCorrupt(self, ring + what, wrote)

    def next_result(self, timeout):
        """The oldest result entry ``(tag, slot, ticket, payload)`` not recorded yet (see
        `result_recorded`): one taken off the result ring earlier, else the next one there,
        waiting up to ``timeout`` seconds (``None``: as long as the process lives; ``0``:
        not at all).  Raises ``queue.Empty`` when none came, WorkerDied if the process
        ended, ``RingClosed`` if this process shut the ring down.

        An entry stays here until the manager says it recorded it, so a ``KeyboardInterrupt``
        landing anywhere between its pop and the end of its recording loses nothing: the
        next call returns the same entry, to be recorded again (and sets ``repeated``).

        Raises WorkerCorrupt if the ring is corrupt or shut down by no one here, or the
        entry is not one the worker could have written (a status or place that does not
        exist, a slot number it was never given, a slot descriptor of the wrong size)."""
        popped = self._popped
        if popped:
            self.repeated = True
            return popped[0]
        self.repeated = False
        results = self._results
        try:
            try:
                entry = results.pop_tagged(False, None, into=popped)   # one already there
            except _queue.Empty:
                if timeout == 0:
                    raise
                entry = results.pop_tagged(True, timeout, check=self._check, into=popped)
        except (RuntimeError, ValueError, RingClosed) as e:
            raise self._ring_fault(e, "its result ring: ") from None
        t, slot, _, payload = entry
        status = t >> 8
        where = t & 0xFF
        if status not in _STATUSES or not (
                where == _AT_INLINE or (where == _AT_SLOT and slot < self._next_slot
                                        and len(payload) == _SLOT_DESC_SIZE)):
            raise WorkerCorrupt(self, f"tag {t:#x}, slot {slot}, a payload of "
                                      f"{len(payload)} bytes")
        return entry

    def result_recorded(self):
        """The entry `next_result` returned is recorded: drop it.  (Counted first: a Ctrl-C
        between the two steps then counts an entry twice, which only makes the stall
        watchdog blind to one hidden result, never lets it take a healthy worker for one;
        the other way round, an entry would be counted by neither.)"""
        self._received += 1
        self._popped.popleft()

    # -- slots ----------------------------------------------------------------------------

    def take_slot(self):
        """A slot number free for a new task of this incarnation."""
        free = self._free_slots
        if free:
            return free.pop()
        slot = self._next_slot
        self._next_slot = slot + 1
        return slot

    def give_back_slot(self, slot, incarnation):
        """Slot ``slot`` of ``incarnation`` can take new work (nothing, if that process was
        replaced since: slot numbers belong to one process)."""
        if incarnation == self.incarnation:
            self._free_slots.append(slot)

    @property
    def free_slots(self):
        """The slot numbers free for new tasks (a copy, for inspection)."""
        return tuple(self._free_slots)

    def slot_segments(self):
        """The segments of this process's slots mapped here (those a result of it can lie
        in), for the device feed's registrations (see `unienv_mp._device.pins`)."""
        return [seg for _, seg in self._slot_maps.values()]

    def map_slot(self, slot, desc):
        """``(segment, nbytes)`` of the result that a result entry's ``desc``
        (``SLOT_DESC``) places in ``slot``, mapping the slot's segment here the first time
        (and again when the worker grew it).  Raises WorkerDied if the process died before
        it could be mapped, WorkerCorrupt if the living process described a slot it does
        not have, ``OSError`` if mapping failed otherwise (out of descriptors or memory
        here)."""
        gen, fd, ino, size, nbytes = _unpack_slot(desc)   # (next_result checked its size)
        slot_maps = self._slot_maps
        mapped = slot_maps.get(slot)
        if mapped is not None and mapped[0] == gen:
            if nbytes > mapped[1].size:
                raise WorkerCorrupt(self, f"slot {slot} of {mapped[1].size} bytes holds a "
                                          f"result of {nbytes} bytes")
            return mapped[1], nbytes
        if nbytes > size:
            raise WorkerCorrupt(self, f"slot {slot} of {size} bytes holds a result of "
                                      f"{nbytes} bytes")
        try:
            seg = segment_from_peer(self.pid, fd, ino, size, f"slot{self.index}")
        except PeerGoneError:
            # (a process exiting closes its descriptors a moment before it is seen ended)
            if _os.has_exited(self.proc, 0.2):
                raise WorkerDied(self) from None
            raise WorkerCorrupt(self, f"slot {slot}: it has no shared-memory segment of "
                                      f"inode {ino} and at least {size} bytes as its "
                                      f"descriptor {fd}") from None
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                raise
            raise WorkerCorrupt(self, f"slot {slot}: its descriptor {fd}: {e}") from None
        seg.unlink()  # no descriptor needed: the mapping is what we use
        slot_maps[slot] = (gen, seg)
        return seg, nbytes
