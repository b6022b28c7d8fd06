"""The worker pool a MultiProcessingSampleManager owns: its worker processes, started,
checked, replaced, and at last stopped.

A *lane* (`Lane`) is the pool's record of one worker: its handle, how its processes
ended, and its counters (its tasks are the ledger's, `unienv_mp._process.ledger`).  A
lane whose worker died and cannot be replaced by a process holding the copy of the data
the others started from (`CopyGone`, see `unienv_mp._process.launch`) is *retired*: its
tasks go to the other lanes, and no task is dealt to it again.  `Resources` is what must
be released however the manager ends.  `WorkerPool` starts the workers left to start
later, notices a worker that died or stalled, buries it (keeps what it published, stops
and releases its process, and has the ledger queue its unfinished tasks again) and
restarts the lane with a new process, pushing the tasks the ledger says wait for it.  It
is handed the manager's `WorkLedger`, which takes a worker's results off its ring
(`WorkLedger.take`); it keeps the rules against a Ctrl-C written at the top of
`unienv_mp._process.manager`.
"""
import collections
import queue as _queue
import time

import numpy as np

from .. import _os
from .. import stats as _stats
from ..backend import CLOSED_WHILE_WAITING, no_result
from ..errors import RingClosed, WorkerDiedError
from .deaths import Stall, judge, warn_user
from .handle import TASK_CAPACITY, WorkerCorrupt, WorkerDied, WorkerHandle, WorkerStalled
from .launch import CopyGone
from .snapshot import SnapshotLate

__all__ = ["Lane", "Resources", "Settings", "WorkerPool", "CLOSE_WAIT", "CopyLost"]


class CopyLost(WorkerDiedError):
    """Every worker of a manager is gone, and none can start again from the copy of the
    data they started from: the manager can make nothing more of that copy."""

#: Seconds close() waits for a call running in another thread to leave (it is woken at
#: once; this bounds a call stuck in a work function's ``start_later`` or the like).
CLOSE_WAIT = 10.0


class Settings:
    """The settings of a manager that its parts read each time they act, so that a value
    the user sets on the manager after construction is the one used: the manager owns
    this, its public properties write through to it, and it hands it to its pool and
    poller (which hold no reference to the manager).  Plain values, checked by the
    manager before they are stored here."""
    __slots__ = ("timeout", "stall_timeout", "respawn", "max_respawns", "doze_time")

    def __init__(self, timeout, stall_timeout, respawn, max_respawns, doze_time):
        self.timeout = timeout
        self.stall_timeout = stall_timeout
        self.respawn = respawn
        self.max_respawns = max_respawns
        self.doze_time = doze_time


class Lane:
    """What the pool keeps for one worker: its handle, how many of its processes died
    since one last produced a result, and its counters' record.  (Its tasks in flight and
    waiting are the ledger's, under ``worker.index``.)"""
    __slots__ = ("worker", "deaths_in_a_row", "record", "stall", "retired")

    def __init__(self, worker):
        self.worker = worker
        self.deaths_in_a_row = 0
        self.record = _stats.WorkerRecord(time.monotonic_ns())
        self.stall = None   # the Stall of a process killed for stalling, not yet buried
        self.retired = False   # no process of it starts again (see the module's docstring)


class Resources:
    """Processes and shared memory of a manager: what must be released even if the manager
    is garbage collected or the interpreter exits without close() (its finalizer holds
    this, not the manager)."""

    def __init__(self):
        self.workers = []          # WorkerHandle
        self.launch = None         # what they start with (its snapshot: see Launch)
        self.doorbell_seg = None
        self.spills = []
        self.done_event = None
        self.closed = False   # (no process starts once set)
        self.done = False     # close() ran to its end

    def shut_down(self):
        """Tell every worker to stop (their rings shut down, the done event set), and make
        every wait on them raise: a call waiting in another thread returns (also one waiting
        for the snapshot process to start a worker)."""
        for w in self.workers:
            w.shut_down_rings()
        if self.launch is not None:
            self.launch.wake()
        if self.done_event is not None:
            try:
                self.done_event.set()
            except Exception:
                pass

    def close(self, join_timeout=2.0):
        """Stop the processes and release the memory.  Cut short (a Ctrl-C while it waits
        for the processes), it kills them and releases the memory, and the next call
        finishes what is left (the processes' end, their descriptors); then it does
        nothing."""
        if self.done:
            return
        self.closed = True
        try:
            self.shut_down()   # (again: a process started since, by a call ending now)
            _os.stop_processes([w.proc for w in self.workers if w.proc is not None],
                                    join_timeout)
            self.done = True
        finally:
            if self.launch is not None:
                self.launch.release()
            for w in self.workers:
                w.release_memory()
            for seg in self.spills:
                seg.close()
            self.spills.clear()
            if self.doorbell_seg is not None:
                self.doorbell_seg.close()


class WorkerPool:
    """The workers of one manager: ``lanes`` of those started, in index order, and those
    left to start later.

    ``ledger`` is the manager's `WorkLedger`: the pool asks it for the tasks to push and
    hands it a dead process's unfinished work; it takes the workers' results off their
    rings (`WorkLedger.take`).  ``settings``
    (`Settings`: ``respawn``, ``max_respawns``, ``timeout``, ``stall_timeout``) are read
    each time they are needed.  ``closed`` starts True; the manager sets it False before
    `start` and True again when it is closed: no process starts once it is set.

    ``stall_timeout``: when a caller waiting on a worker finds it on one task for longer,
    the worker's Python stacks are taken (faulthandler, from a signal handler: a worker
    stuck in C code has them too), and the worker is killed and replaced.  With
    ``respawn=True`` a ``RuntimeWarning`` carrying the stacks is issued and the task is
    given to the replacement; the task's result is `WorkerStalledError` (raised by the call
    that collects it) if it stalls ``max_respawns + 1`` times in a row, or at once with
    ``respawn=False``.  The other tasks of that worker go to the replacement either way.  A
    worker that takes none of the tasks waiting for it for longer (it was stopped, by
    SIGSTOP or a debugger, or has stopped responding after its first task) is killed and
    replaced too, with the warning, whatever ``respawn`` says: no task is to blame.  A
    stopped process cannot give its stacks, and is not waited on for them.

    ``start_later``: only worker 0 starts with the manager, so that a first result can
    come after one process start rather than ``n_workers`` of them (each start of a large
    parent under fork copies its page tables: tens of ms).  The others start one at a
    time, in order, when the caller would otherwise wait for a result, after the first
    result was handed out, and only if ``start_later()`` returns True then (if it returns
    False, the workers not started yet never start: e.g. the data they would copy is no
    longer the data the first one copied).  Until they start, tasks are dealt among the
    workers started (what a task gives must not depend on which worker runs it), and
    ``workers`` and ``stats`` list the started ones.

    Every process after the first ones starts from their copy of the data, or not at all
    (`CopyGone`): a worker left to start later then never starts, and a dead worker whose
    replacement cannot start is retired, its tasks given to the others (one
    ``RuntimeWarning``); once none is left, `CopyLost` is raised.  A worker that dies
    before it begins taking tasks (nothing waits on it yet) is noticed by
    `check_starting`, which the manager's waits call.

    ``deadline`` (``time.monotonic()`` seconds, or None), where a method takes one, bounds
    its wait for the snapshot process to start a worker (`SnapshotLate`, a
    ``TimeoutError``).
    """

    def __init__(self, n_workers, seeds, start_later, start_method, settings, ledger,
                 caller, resources):
        self.n_workers = n_workers
        self.seeds = seeds                 # one per worker, or None (checked by the manager)
        self.start_later = start_later
        self.start_method = start_method   # (named in the errors)
        self.settings = settings     # the manager's Settings (read when they are needed)
        self.ledger = ledger
        self.caller = caller         # the manager's CallerRecord: time waited is counted
        self.resources = resources   # (its workers: the handles the ledger gives slots to)
        self.closed = True           # (set by the manager: no process starts while True)
        self.lanes = []              # of the workers started, in index order
        self.launch = None           # what their processes start with (see start)
        self.snapshot_due = False    # the snapshot process is to start at the next push
        self.deferred = collections.deque()   # (handle, seed) of those to start later
        self.seed_rng = np.random.default_rng(seeds)
        self.starting = set()   # lanes whose process has not been seen taking tasks yet

    def start(self, launch):
        """Make every worker's handle (``launch``: what starts its process) and start
        the processes: all of them, or worker 0 alone with ``start_later`` (the others
        wait in ``deferred``)."""
        self.launch = self.resources.launch = launch
        for i in range(self.n_workers):
            w = WorkerHandle(i, launch)
            self.resources.workers.append(w)
            seed = None if self.seeds is None else self.seeds[i]
            if i > 0 and self.start_later is not None:
                self.deferred.append((w, seed))
                continue
            lane = Lane(w)
            self.lanes.append(lane)
            w.start(seed)
            self.starting.add(lane)
        if self.start_later is None:
            launch.keep_snapshot()
        else:   # (after the first push, so that its fork does not delay the first result)
            self.snapshot_due = launch.fork
        launch.first_done()

    def start_deferred(self, quiet=False, deadline=None):
        """Start the next worker left to start later, if ``start_later()`` allows and it
        can start from the first workers' copy of the data (else none of them will start);
        True if one started.  ``quiet``: a worker that cannot be started (or a
        ``start_later`` that raises) is not the caller's error, since the workers started
        can do the work: none of the rest will start, with a ``RuntimeWarning`` saying
        why; one that the snapshot process did not start by ``deadline`` is left to start
        later."""
        if not self.deferred:
            return False
        # (one step: either the worker has its lane and its process, or neither)
        with _os.interrupts_deferred():
            try:
                w, seed = self.deferred[0]
                # (start_later is asked, with same_copy, unless it starts from the snapshot)
                w.start(seed, deadline, also=self.start_later)
            except CopyGone:
                self.deferred.clear()   # (none of them can start from the copy now)
                return False
            except SnapshotLate:
                if not quiet:
                    raise
                return False
            except Exception as e:
                if not quiet or self.closed:
                    raise
                left = len(self.deferred)
                self.deferred.clear()
                warn_user(f"unienv_mp: could not start a worker after the first "
                          f"({type(e).__name__}: {e}); going on with {len(self.lanes)} "
                          f"worker(s), {left} not started")
                return False
            self.deferred.popleft()
            lane = Lane(w)
            self.lanes.append(lane)
            self.starting.add(lane)
        return True

    def check_starting(self, deadline=None):
        """Look after the workers no wait may be on (they take no task until they are
        up): one whose process ended before it began taking tasks is buried and replaced,
        one left without a process (its replacement failed to start, say out of
        descriptors) is started again (what that raises is raised: the next call tries
        again), and those seen taking tasks are forgotten."""
        for lane in list(self.starting):
            w = lane.worker
            if lane.retired:
                self.starting.discard(lane)
            elif not w.has_process:
                self.restart(lane, deadline)
            elif w.started_ns:
                self.starting.discard(lane)
            elif w.has_exited():
                self.replace(lane, None, deadline)

    def bury(self, lane, cause=None):
        """The process of ``lane``'s worker died (``cause``: the WorkerDied noticed), or
        stalled (a WorkerStalled: it is killed here): keep what it published, stop and
        release it, and queue its unfinished work for the next process (see `restart`).
        Raises WorkerDiedError if a dead worker must not (respawn=False) or should not
        (it keeps dying) be replaced: after the process is taken off the lane, so that
        the next call starts a fresh one, with the whole budget, for the work left
        waiting (a lane never keeps a dead process).  A stalled one is always replaced;
        its task in hand fails with WorkerStalledError unless it may be tried again (see
        stall_timeout).  One that wrote on its rings what it could not have written (a
        WorkerCorrupt) is killed here and dies like any other, but with a warning, or a
        CodecError instead of the WorkerDiedError; nothing more is read from its
        rings.  What its death means is `unienv_mp._process.deaths.judge`'s to say."""
        w = lane.worker
        corrupt = cause.error if isinstance(cause, WorkerCorrupt) else None
        if isinstance(cause, WorkerStalled):
            # (kept before the kill: its death is this stall)
            lane.stall = Stall(w, cause, self.settings.stall_timeout)
        code, how = w.end(1.0, kill=corrupt is not None or lane.stall is not None)
        if w.has_process and corrupt is None:
            take = self.ledger.take
            try:
                while True:
                    take(w, 0)
            except (_queue.Empty, RingClosed, WorkerDied):
                pass
        # (its deaths in a row start again if it made a result)
        in_a_row = 0 if w.made_result else lane.deaths_in_a_row
        deaths, give_up, failed = judge(w.index, w.pid, code, how, in_a_row,
                                        lane.stall, corrupt, self.settings,
                                        self.start_method, self.ledger.tasks)
        if give_up is not None:
            # The next call starts a fresh process, with the whole budget; the unfinished
            # work waits for it (nothing is lost: its caller may ask again).
            deaths = 0
        # One step that a Ctrl-C must not cut in two: the process's end is recorded, the
        # result of ``failed`` handed out, the unfinished work queued for the next
        # process, and the process taken off the worker.  A KeyboardInterrupt can land
        # between any two statements, so SIGINT is held back until the step is done, then
        # raised.  Stopping the old process and releasing its memory, which take a while
        # and may be interrupted themselves, come after, in the ``finally``: also when
        # the Ctrl-C held back is raised as the step ends.
        detached = None
        try:
            with _os.interrupts_deferred():
                lane.deaths_in_a_row = deaths
                lane.stall = None
                self.starting.add(lane)   # (without a process until the restart: looked after)
                lane.record.process_ended(w.counters(), time.monotonic_ns())
                self.ledger.requeue(w.index, failed)
                detached = w.detach()
        finally:
            if detached is not None:
                detached.stop(1.0)
        if give_up is not None:
            raise give_up from None

    def restart(self, lane, deadline=None):
        """Start a process for ``lane``'s worker if it has none, and hand it the tasks
        waiting for it, in order.  Survives the new process dying too (up to the limit).
        A lane retired (see the module's docstring) hands its tasks to the others."""
        w = lane.worker
        while True:
            try:
                if lane.retired:
                    self._hand_over(lane, deadline)
                    return
                if not w.has_process:
                    if self.closed:
                        raise RuntimeError(CLOSED_WHILE_WAITING)
                    seed = (None if self.seeds is None
                            else int(self.seed_rng.integers(2 ** 31)))
                    try:
                        w.start(seed, deadline)
                    except CopyGone as e:
                        self._retire(lane, e)
                        continue
                    self.starting.add(lane)
                    if w.incarnation > 1:
                        lane.record.respawns += 1
                ledger, i = self.ledger, w.index
                while True:
                    task = ledger.next_waiting(i)
                    if task is None:
                        return
                    self.push(task, lane)
                    ledger.pushed_waiting(i)   # (cut short before: in flight, skipped)
            except WorkerDied as e:
                self.bury(lane, e)   # (and the loop starts the next process)

    def replace(self, lane, cause=None, deadline=None):
        """Bury the dead (or stalled, or corrupt: ``cause``) process of ``lane``'s worker
        and start its replacement (`bury`, then `restart`)."""
        self.bury(lane, cause)
        self.restart(lane, deadline)

    def _retire(self, lane, why):
        """``lane``'s worker is dead and cannot be replaced from the copy of the data the
        others hold (``why``, a CopyGone): retire it (see the module's docstring).  Its tasks
        go to the others (`_hand_over`, at the restart that follows)."""
        lane.retired = True
        self.starting.discard(lane)
        left = sum(not other.retired for other in self.lanes)
        warn_user(f"unienv_mp: worker {lane.worker.index} died and is not replaced: {why}; "
                  f"its tasks go to the {left} worker(s) that hold the copy of the data "
                  f"the others started from")

    def _hand_over(self, lane, deadline=None):
        """Give the tasks waiting on the retired ``lane`` to the least busy lanes not
        retired, in order (each task moves in one step that a Ctrl-C cannot cut in two).
        Raises `CopyLost` if there is none left."""
        ledger, i = self.ledger, lane.worker.index
        while ledger.waiting[i]:
            targets = [other for other in self.lanes if not other.retired]
            with _os.interrupts_deferred():
                if ledger.shed_finished(i):
                    continue
                if not targets:
                    raise CopyLost(
                        f"every worker of this manager died, and none can start again "
                        f"from the copy of the data they started from (the process that "
                        f"keeps it is gone, and the data may have changed since)",
                        worker=lane.worker.index)
                target = min(targets, key=lambda other: ledger.load(other.worker.index))
                ledger.hand_over(i, target.worker.index)
            self.restart(target, deadline)

    def check_all_alive(self, deadline=None):
        if self.closed:
            raise RuntimeError(CLOSED_WHILE_WAITING)
        stall = self.settings.stall_timeout
        stall_ns = None if stall is None else int(stall * 1e9)
        for lane in self.lanes:
            w = lane.worker
            if lane.retired:
                if self.ledger.waiting[w.index]:
                    self.restart(lane, deadline)
            elif w.proc is None:          # replaced, but its replacement could not start yet
                self.restart(lane, deadline)
            elif w.has_exited():
                self.replace(lane, None, deadline)
            elif stall_ns is not None:
                try:
                    w.check_stall(stall_ns)
                except (WorkerStalled, WorkerCorrupt) as e:
                    self.replace(lane, e, deadline)

    # -- tasks onto a worker's ring ---------------------------------------------------------

    def push(self, task, lane):
        """Push ``task`` onto the task ring of ``lane``'s worker (`WorkLedger.push`: it is
        in flight once pushed), once it has fewer than TASK_CAPACITY tasks in flight (see
        `make_room`: the one bound on a worker's tasks in flight); raises WorkerCorrupt, a
        WorkerDied (not pushed), if the process wrote into its task ring.  The first push
        may start the snapshot process."""
        if len(self.ledger.inflight[lane.worker.index]) >= TASK_CAPACITY:
            self.make_room(lane)
        self.ledger.push(task, lane.worker)
        if self.snapshot_due:
            self._keep_snapshot()

    def _keep_snapshot(self):
        """After the first push (under fork with ``start_later``): fork the snapshot
        process while the first worker makes the first result, if the data is still what
        the first workers copied (``start_later()``).  If it is not, later workers are
        forked from this process while ``start_later()`` allows."""
        self.snapshot_due = False
        try:
            unchanged = self.start_later()
        except Exception:
            unchanged = False
        if unchanged:
            self.launch.keep_snapshot()

    def make_room(self, lane):
        """Keep at most TASK_CAPACITY tasks in flight on ``lane``'s worker: collect (not
        hand out) results until there is room.  A worker whose rings were both full would
        wait for the parent while the parent waits for it."""
        w = lane.worker
        timeout = self.settings.timeout
        in_flight = self.ledger.in_flight
        while in_flight(w.index) >= TASK_CAPACITY:
            try:
                self.ledger.take(w, timeout)
            except _queue.Empty:
                raise no_result(timeout, w.index) from None
            except RingClosed:
                raise RuntimeError(CLOSED_WHILE_WAITING) from None

    # -- results off the rings -------------------------------------------------------------

    def wait_for(self, task, timeout):
        """Block until ``task`` has a result, replacing its worker's process if it dies;
        raises ``TimeoutError`` after ``timeout`` seconds (None: no limit).  The time is
        counted as the caller's wait (see `unienv_mp.stats`)."""
        t0 = time.monotonic_ns()
        try:
            self._wait_for(task, timeout)
        finally:
            self.caller.waited(t0, time.monotonic_ns(),
                               self.lanes[task.worker].worker.started_ns)

    def _wait_for(self, task, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        ledger = self.ledger
        if self.starting:
            self.check_starting(deadline)   # (workers no wait is on: see check_starting)
        while not task.arrived:
            # (the task's worker, again each time: a retired worker's tasks move)
            lane = self.lanes[task.worker]
            w = lane.worker
            if ledger.waiting[task.worker] or not w.has_process:
                self.restart(lane, deadline)   # a replacement not finished earlier
                continue
            if self.deferred and self.caller.batches and not w.results_published:
                # (while this worker makes the result)
                self.start_deferred(quiet=True, deadline=deadline)
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ledger.take(w, left)
            except _queue.Empty:
                raise no_result(timeout, w.index) from None
            except RingClosed:
                raise RuntimeError(CLOSED_WHILE_WAITING) from None
            except WorkerDied as e:
                try:
                    self.replace(lane, e, deadline)
                except CopyLost:
                    if not task.arrived:
                        raise
                    # (its result came, e.g. the error of a stall: handed out first; a
                    # wait for a task no worker is left to make raises this again)

    def poll_all(self, check_alive=False):
        """Record every result already published by any worker (never blocks, except to
        replace a worker found dead).  ``check_alive``: also look for dead workers (a
        caller that does not block never reaches the liveness checks of the waits)."""
        waiting = self.ledger.waiting
        take = self.ledger.take
        for lane in self.lanes:
            w = lane.worker
            if lane.retired:
                if waiting[w.index]:
                    self.restart(lane)   # (its tasks go to the others)
                continue
            if waiting[w.index] or not w.has_process:
                self.restart(lane)
            try:
                while True:
                    take(w, 0)
            except RingClosed:
                raise RuntimeError(CLOSED_WHILE_WAITING) from None
            except _queue.Empty:
                if check_alive and w.has_exited():
                    self.replace(lane)
            except WorkerDied as e:
                self.replace(lane, e)

    # -- what the workers did, and the end ---------------------------------------------------

    def worker_stats(self, now, reset):
        """``(ready, workers)``: how many batches are ready to hand out, collected or
        still on the workers' rings (see `WorkLedger.ready`), and a `WorkerStats` of each
        worker started."""
        workers = []
        published = []
        for lane in self.lanes:
            w = lane.worker
            counters = w.counters()
            if w.has_process:   # published, not yet taken off the ring: in flight order
                published.append((w.index, w.results_published))
            workers.append(lane.record.read(w.index, w.pid, counters, now, reset,
                                            w.launched_ns if w.has_process else None))
        return self.ledger.ready(published), workers

    def slot_segments(self):
        """The result slots of the workers now, as mapped here: what a device feed
        page-locks (see `unienv_mp._device.pins`)."""
        return [seg for lane in self.lanes for seg in lane.worker.slot_segments()]

    def shut_down(self):
        """Every worker is told to stop, and every wait on them raises (a call waiting in
        another thread returns); the manager is closed first, so no process starts
        after this."""
        self.resources.shut_down()

    def stop_now(self):
        """Stop the processes without releasing the memory (a call in another thread
        still uses it; the finalizer releases it)."""
        _os.stop_processes([w.proc for w in self.resources.workers if w.proc is not None],
                           2.0)
