"""MultiProcessingSampleManager: tasks dealt to worker processes, their results collected in
order, and dead workers replaced.

Each worker is a :class:`~unienv_mp._worker_handle.WorkerHandle`: its process, a pair of
single-producer single-consumer rings (tasks in, results out) in a segment the parent
creates, and its own result slots (segments it creates and grows).  The manager decides
which worker and which slot each task uses; a result comes back as a small ring entry
pointing at the slot, and is handed to the caller as zero-copy views of it.  The slot is
given to a new task only after the last view is garbage collected.

Faults: a worker that raises sends the exception back (the caller gets
:class:`~unienv_mp.WorkerError`, the worker carries on); a worker that dies is noticed
within one ``doze_time`` of the caller waiting on it, replaced, and its unfinished tasks are
given to the replacement (or :class:`~unienv_mp.WorkerDiedError` is raised); so is one that
wrote a result entry it could not have written, which is killed first (a warning, or
:class:`~unienv_mp.CodecError` instead).  Workers end with the parent however the parent
ends (see :mod:`unienv_mp._process`).
"""
import collections
import os
import queue as _queue
import signal
import threading
import time
import warnings
from multiprocessing import util as _mputil
from typing import Callable, Generic, Optional, Sequence, TypeVar

import numpy as np

from . import _codec
from . import _process
from . import _protocol as P
from . import stats as _stats
from ._backend import Dealer, TicketTable, no_result, none_pending, respawn_verdict
from ._ring import DEFAULT_SPIN as _DEFAULT_SPIN
from ._ring import Event, Segment
from ._stalls import Stall
from ._validate import (MAX_LEASES, MAX_RESPAWNS, check_bool, check_context, check_doze_time,
                        check_index, check_int, check_seconds, check_spin, check_workers)
from ._work_encoder import WorkEncoder, spill_entry
from ._worker_handle import (RESULT_INLINE, TASK_CAPACITY, TASK_INLINE, Launch, WorkerCorrupt,
                             WorkerDied, WorkerHandle, WorkerStalled)
from .errors import CodecError, RingClosed, WorkerDiedError, WorkerError

__all__ = ["MultiProcessingSampleManager", "TaskInfoT", "ResultT", "TASK_CAPACITY",
           "TASK_INLINE", "RESULT_INLINE", "CLOSE_WAIT"]

#: Seconds close() waits for a call running in another thread to leave (it is woken at
#: once; this bounds a call stuck in a work function's ``start_later`` or the like).
CLOSE_WAIT = 10.0

TaskInfoT = TypeVar("TaskInfoT")
ResultT = TypeVar("ResultT")

# A Ctrl-C (KeyboardInterrupt) can land between any two bytecodes of this module, in
# particular right after any call returns.  What keeps the manager consistent whatever it
# cuts short:
#
# * The rings record what they did inside the call: a task pushed is appended to its
#   lane's ``inflight`` by the push itself (RingBuffer.push_tagged's ``record``), and a
#   result entry popped stays in its handle until its recording ends (next_result /
#   result_recorded).  So "pushed" is exactly "in inflight", and no popped entry is lost.
# * Recording a result (_accept) may run again on the same entry, and every step of it
#   gives the same state when run twice; ``arrived`` is set before the ticket leaves
#   ``inflight``, so a task is never neither arrived nor in flight (nor re-issued once it
#   has arrived: _bury skips arrived tasks).
# * A slot number is given back only through _give_back_slot, which clears ``task.slot``
#   first: an interruption can at worst leak a slot number (the worker makes another
#   slot), never give one back twice (two tasks writing into one slot).  A delivered
#   result's slot goes back once the task has left ``_tasks`` and no lease on it is alive
#   (``task.leases``): a delivery cut short can be asked for again, from the same slot.
# * submit() hands its ticket over through ``record`` (the caller's list), appended as
#   the last step; if it raises before, the task is abandoned (_abandon).
# * The rare multi-step changes (replacing a worker's process) hold SIGINT back until
#   they are done (_process.interrupts_deferred).
#
# Protocol constants as globals of this module: the per-batch path reads them once per
# batch, and a global is cheaper to read than a module attribute.
_ST_OK = P.ST_OK
_ST_ERROR = P.ST_ERROR
_ST_FATAL = P.ST_FATAL
_AT_SLOT = P.AT_SLOT
_untag = P.untag
_decode = _codec.decode
_SlotLease = _codec.SlotLease
_CLOSED_WHILE_WAITING = "this manager was closed (from another thread) during the call"

# The pid of this process, read by _ensure_open on every call.  os.getpid() is a system
# call; this is kept current by an at-fork hook instead.  Every way of going on running
# Python in a forked child runs those hooks (os.fork(), hence multiprocessing's fork and
# forkserver; C code must call PyOS_AfterFork_Child, which runs them too), so a forked
# child still sees its own pid here and is refused the manager.
_this_pid = os.getpid()


def _after_fork_in_child():
    global _this_pid
    _this_pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _load(lane):
    """How busy a lane is (tasks in flight or waiting), for a deal that is not in order."""
    return len(lane.inflight) + len(lane.waiting)


class _Task:
    """One submitted work item.  One is made per batch: submit() sets ``ticket`` and
    ``work``, and every other field starts as the class attribute below until it is set
    (no __init__ to call, no fields to store up front)."""
    ticket = None
    work = None
    worker = None       # index of the worker it was given to
    incarnation = None  # of that worker's process: the slot number belongs to it
    slot = None
    spill = None        # parent segment carrying large work info
    cancelled = False
    leases = 0          # zero-copy results of it alive (see _deliver)
    # Its result, set by _accept; ``arrived`` is set last.
    arrived = False
    status = None       # _ST_OK, or _ST_ERROR: the target raised, the value describes it
    inline = None       # the encoded value, if it came inside the entry; else it is in
    seg = None          # the worker's slot segment, mapped here,
    nbytes = 0          # in its first nbytes bytes
    error = None        # an exception met here receiving it, raised in place of the value


class _Lane:
    """What the manager keeps for one worker: its handle, the tickets in flight on its
    process (in the order given), the tasks waiting for a (new) process, how many of its
    processes died since one last produced a result, and its counters' record."""
    __slots__ = ("worker", "inflight", "waiting", "deaths_in_a_row", "record", "stall")

    def __init__(self, worker):
        self.worker = worker
        self.inflight = collections.deque()
        self.waiting = []
        self.deaths_in_a_row = 0
        self.record = _stats.WorkerRecord(time.monotonic_ns())
        self.stall = None   # the Stall of a process killed for stalling, not yet buried


class _Resources:
    """Processes and shared memory of a manager: what must be released even if the manager
    is garbage collected or the interpreter exits without close() (its finalizer holds
    this, not the manager)."""

    def __init__(self):
        self.workers = []          # WorkerHandle
        self.doorbell_seg = None
        self.spills = []
        self.done_event = None
        self.closed = False

    def shut_down(self):
        """Tell every worker to stop (their rings shut down, the done event set), and make
        every wait on them raise: a call waiting in another thread returns."""
        for w in self.workers:
            w.shut_down_rings()
        if self.done_event is not None:
            try:
                self.done_event.set()
            except Exception:
                pass

    def close(self, join_timeout=2.0):
        if self.closed:
            return
        self.closed = True
        try:
            self.shut_down()   # (again: a process started since, by a call ending now)
            # (cut short, this kills the workers: a second close() does nothing)
            _process.stop_processes([w.proc for w in self.workers if w.proc is not None],
                                    join_timeout)
        finally:
            for w in self.workers:
                w.release_memory()
            for seg in self.spills:
                seg.close()
            self.spills.clear()
            if self.doorbell_seg is not None:
                self.doorbell_seg.close()


class MultiProcessingSampleManager(Generic[TaskInfoT, ResultT]):
    """Run ``target_fn(work_info)`` in ``n_workers`` processes.

    Same interface as UniEnv's ``MultiProcessingSampleManager``: :meth:`add_work` queues a
    work item, :meth:`fetch` returns a result (``None`` if none arrives in time), and
    :meth:`close` ends the workers.  ``worker_init_fn(seed)`` runs in each worker first,
    with its entry of ``worker_seeds``.  ``done_event`` (optional, a multiprocessing Event)
    stops the workers when set.  ``doze_time`` is how often a waiting side re-checks that
    its peer is alive (nothing polls on the hot path: waits sleep on futexes).

    Tickets, which UniEnv lacks: :meth:`submit` queues a work item and returns its ticket,
    :meth:`result` waits for that ticket's result, :meth:`ready` says whether it arrived,
    :meth:`wait_any` returns the first of several tickets to arrive, :meth:`cancel` drops
    one, and :meth:`reset_order` restarts the round-robin deal.

    Options UniEnv lacks:

    * ``in_order=True``: results come back in the order the work was added, and work is
      dealt to workers round-robin, so a run is reproducible whatever the workers' timing.
      ``False``: each task goes to the least busy worker and :meth:`fetch` returns whichever
      result is ready first.
    * ``copy=False``: results are zero-copy views of the worker's slot, which is reused
      only once they are garbage collected (at most ``max_leases`` results are held that
      way at once; beyond that they are copied).  ``True``: results are always copied.
    * ``timeout``: seconds to wait for one result before raising :class:`TimeoutError`
      (default: wait as long as the workers are alive).
    * ``spin``: seconds a waiting side polls before it sleeps (a sleep and wake-up costs
      a syscall on both sides, and on virtual machines an inter-processor interrupt).
      Default: 20 µs where this process may run on more CPUs than there are workers;
      otherwise 0, since polling would take a CPU from a process that has work to do.
    * ``respawn=True``: a worker that dies is replaced (with a fresh seed) and its
      unfinished work re-issued; after ``max_respawns`` replacements of one worker without
      a result in between, its next death raises :class:`~unienv_mp.WorkerDiedError`.
      ``False``: raise it at the first death.
    * ``stall_timeout``: seconds a worker may spend on one task (default: no limit).  When
      a caller waiting on a worker finds it on one task for longer, the worker's Python
      stacks are taken (faulthandler, from a signal handler: a worker stuck in C code has
      them too), and the worker is killed and replaced.  With ``respawn=True`` a
      ``RuntimeWarning`` carrying the stacks is issued and the task is given to the
      replacement; the task's result is :class:`~unienv_mp.WorkerStalledError` (raised
      by the call that collects it) if it stalls ``max_respawns + 1`` times in a row, or
      at once with ``respawn=False``.  The other tasks of that worker go to the
      replacement either way.  A worker that takes none of the tasks waiting for it for
      longer (it was stopped, by SIGSTOP or a debugger, or has stopped responding after
      its first task) is killed and replaced too, with the warning, whatever
      ``respawn`` says: no task is to blame.  A stopped process cannot give its stacks,
      and is not waited on for them.
    * ``start_later``: None (default): every worker starts now.  A function: only worker 0
      starts now, so that a first result can come after one process start rather than
      ``n_workers`` of them (each start of a large parent under fork copies its page
      tables: tens of ms).  The others start one at a time, in order, when the caller
      would otherwise wait for a result, after the first result was handed out, and only
      if ``start_later()`` returns True then (if it returns False, the workers not
      started yet never start: e.g. the data they would copy is no longer the data the
      first one copied).  Until they start, tasks are dealt among the workers started
      (what a task gives must not depend on which worker runs it), and :attr:`workers`
      and :meth:`stats` list the started ones; :meth:`start_all` starts the rest now.

    :meth:`stats` says where the time goes (see :class:`~unienv_mp.SamplerStats`): the
    workers count their work in their shared segments, with no message per task.

    Threads: every method may be called from any thread.  Calls are serialised (a lock,
    held for the whole call: a second thread waits while the first waits for a result),
    and :meth:`close` is safe at any moment, from any thread (see there).  A forked child
    cannot use its parent's manager: every call raises ``RuntimeError`` there.

    The work function must be picklable under the spawn and forkserver start methods.  If
    it has a ``batches_in(work)`` method, :meth:`stats` counts that many batches for each
    task (the sampler's chunks); otherwise one.
    """

    def __init__(
        self,
        target_fn: Callable[[TaskInfoT], ResultT],
        n_workers: int = 4,
        ctx=None,
        done_event=None,
        doze_time: float = 0.001,
        daemon: Optional[bool] = None,
        worker_init_fn: Optional[Callable[[int], None]] = None,
        worker_seeds: Optional[Sequence[int]] = None,
        *,
        in_order: bool = True,
        copy: bool = False,
        timeout: Optional[float] = None,
        respawn: bool = True,
        max_respawns: int = 3,
        max_leases: Optional[int] = None,
        spin: Optional[float] = None,
        stall_timeout: Optional[float] = None,
        start_later: Optional[Callable[[], bool]] = None,
    ):
        # First, so that close() (also run at garbage collection) works on a half-built one.
        self._resources = _Resources()
        self.closed = True
        # Held by every call (see "Threads" in the class docstring); re-entrant, for a
        # call made from a signal handler or a garbage collection in the middle of one.
        self._lock = threading.RLock()
        if not callable(target_fn):
            raise TypeError(f"target_fn must be callable, got {type(target_fn).__name__}")
        n_workers = check_workers(n_workers)
        doze_time = check_doze_time(doze_time)
        max_respawns = check_int(max_respawns, "max_respawns", 0, MAX_RESPAWNS)
        in_order = check_bool(in_order, "in_order")
        copy = check_bool(copy, "copy")
        respawn = check_bool(respawn, "respawn")
        daemon = check_bool(daemon, "daemon", allow_none=True)
        if worker_seeds is not None:
            worker_seeds = list(worker_seeds)
            if len(worker_seeds) != n_workers:
                raise ValueError(f"worker_seeds must have n_workers={n_workers} entries, "
                                 f"got {len(worker_seeds)}")
        ctx = check_context(ctx)
        self._start_method = ctx.get_start_method()
        if start_later is not None and not callable(start_later):
            raise TypeError(f"start_later must be None or callable, got "
                            f"{type(start_later).__name__}")
        self.target_fn = target_fn
        self.doze_time = doze_time
        self.done_event = done_event
        self.in_order = in_order
        self.copy = copy
        self.timeout = check_seconds(timeout, "timeout")
        self.stall_timeout = check_seconds(stall_timeout, "stall_timeout")
        self.respawn = respawn
        self.max_respawns = max_respawns
        if spin is None:
            spin = _DEFAULT_SPIN if len(os.sched_getaffinity(0)) > n_workers else 0.0
        self.spin = check_spin(spin)
        self.max_leases = 2 * n_workers + 8 if max_leases is None else check_int(
            max_leases, "max_leases", 0, MAX_LEASES)
        self._seeds = worker_seeds
        self._seed_rng = np.random.default_rng(
            None if worker_seeds is None else [int(s) for s in worker_seeds])
        self._dealer = Dealer()                  # which worker gets the next task
        self._tasks = TicketTable()              # ticket -> _Task (not yet delivered)
        self._order = collections.deque()        # tickets of add_work, for fetch()
        self._released = collections.deque()     # lease tokens given back by the GC
        self._leases = 0
        self._encoder = WorkEncoder(TASK_INLINE)
        self._owner_pid = os.getpid()
        self._lanes = []          # of the workers started, in index order
        self._deferred = collections.deque()   # (handle, seed) of those to start later
        self._start_later = start_later
        self._n_workers = n_workers
        resources = self._resources
        resources.done_event = done_event
        resources.doorbell_seg = Segment.create(64, "doorbell")
        self._doorbell = Event(resources.doorbell_seg, 0, True)
        self._finalizer = _mputil.Finalize(self, resources.close, exitpriority=100)
        self._batches_in = getattr(target_fn, "batches_in", None)
        self._caller = _stats.CallerRecord()   # batches handed out, time waited (see stats)
        launch = Launch(target_fn, worker_init_fn, ctx, daemon, resources.doorbell_seg,
                        done_event, doze_time, self.spin, self.stall_timeout)
        self.closed = False
        try:
            for i in range(n_workers):
                w = WorkerHandle(i, launch)
                resources.workers.append(w)
                seed = None if worker_seeds is None else worker_seeds[i]
                if i > 0 and start_later is not None:
                    self._deferred.append((w, seed))
                    continue
                self._lanes.append(_Lane(w))
                w.start(seed)
        except BaseException:
            self.close()
            raise

    # -- properties -----------------------------------------------------------------------

    @property
    def n_workers(self):
        """Number of worker processes (those not started yet included, see
        ``start_later``)."""
        return self._n_workers

    @property
    def workers(self):
        """The worker ``Process`` objects (replacements included, after a respawn) of the
        workers started (see ``start_later``)."""
        return [lane.worker.proc for lane in self._lanes]

    def start_all(self) -> None:
        """Start now every worker left to start later (see ``start_later``), as far as
        ``start_later()`` allows."""
        with self._lock:
            self._ensure_open()
            while self._start_deferred():
                pass

    def _start_deferred(self, quiet=False):
        """Start the next worker left to start later, if ``start_later()`` allows (else
        none of them will start); True if one started.  ``quiet``: a worker that cannot
        be started (or a ``start_later`` that raises) is not the caller's error, since
        the workers started can do the work: none of the rest will start, with a
        ``RuntimeWarning`` saying why."""
        if not self._deferred:
            return False
        # (one step: either the worker has its lane and its process, or neither)
        with _process.interrupts_deferred():
            try:
                if not self._start_later():
                    self._deferred.clear()
                    return False
                w, seed = self._deferred[0]
                w.start(seed)
            except Exception as e:
                if not quiet or self.closed:
                    raise
                left = len(self._deferred)
                self._deferred.clear()
                warnings.warn(f"unienv_mp: could not start a worker after the first "
                              f"({type(e).__name__}: {e}); going on with "
                              f"{len(self._lanes)} worker(s), {left} not started",
                              RuntimeWarning, stacklevel=3)
                return False
            self._deferred.popleft()
            self._lanes.append(_Lane(w))
        return True

    @property
    def remaining_work(self):
        """Work added with :meth:`add_work` and not fetched yet."""
        tasks = self._tasks
        return sum(1 for t in self._order if t in tasks)

    # -- replacing dead workers -----------------------------------------------------------

    def _bury(self, lane, cause=None):
        """The process of ``lane``'s worker died (``cause``: the WorkerDied noticed), or
        stalled (a WorkerStalled: it is killed here): keep what it published, stop and
        release it, and queue its unfinished work for the next process (see _restart).
        Raises WorkerDiedError if a dead worker must not (respawn=False) or should not
        (it keeps dying) be replaced: after the process is taken off the lane, so that
        the next call starts a fresh one, with the whole budget, for the work left
        waiting (a lane never keeps a dead process).  A stalled one is always replaced;
        its task in hand fails with WorkerStalledError unless it may be tried again (see
        stall_timeout).  One that wrote a corrupt result entry (a WorkerCorrupt) is killed
        here and dies like any other, but with a warning, or a CodecError instead of the
        WorkerDiedError; nothing more is read from its rings."""
        w = lane.worker
        corrupt = None
        if isinstance(cause, WorkerStalled):
            # (kept before the kill: its death is this stall)
            lane.stall = Stall(w, cause, self.stall_timeout)
            w.kill()
        elif isinstance(cause, WorkerCorrupt):
            corrupt = cause.error
            w.kill()
        stall = lane.stall
        code = w.exit_code(1.0)
        pid = w.pid
        if w.has_process and corrupt is None:
            try:
                while True:
                    self._take(lane, w.next_result(0))
            except (_queue.Empty, RingClosed, WorkerDied):
                pass
        how = _process.describe_exit(code)
        # (a SIGINT is a terminal's Ctrl-C that reached the worker too, not a crash)
        deaths = lane.deaths_in_a_row + (code != -signal.SIGINT)
        give_up = None   # the error to raise once the process is detached
        if code == _process.EXIT_MAIN_REIMPORTED and stall is None:
            # a replacement would make the same mistake: one error, with the fix
            give_up = WorkerDiedError(
                f"worker {w.index} {how}: started with {self._start_method!r}, it "
                f"imported the main module, whose top level starts a sampler's workers "
                f"again (the script has no `if __name__ == \"__main__\":` guard around "
                f"its work).  Put the work under such a guard (see the README's quick "
                f"start); workers started with spawn or forkserver import the main module",
                worker=w.index, exitcode=code)
        failed = None   # a stalled task whose result is its stall
        if give_up is not None:
            pass
        elif corrupt is not None:
            verdict = respawn_verdict(self.respawn, deaths, self.max_respawns)
            if verdict is not None:
                give_up = CodecError(f"{corrupt}; the worker was killed; {verdict}")
            else:
                warnings.warn(f"{corrupt}; the worker was killed and replaced, and its "
                              f"unfinished tasks are given to the replacement",
                              RuntimeWarning, stacklevel=4)
        elif stall is not None and stall.ticket is None:
            # (it took no task: none is to blame, nor counted as failing)
            deaths = lane.deaths_in_a_row
            stall.warn(True, stacklevel=4)
        elif stall is not None:
            task = self._tasks.get(stall.ticket)
            if respawn_verdict(self.respawn, deaths, self.max_respawns) is not None:
                if task is not None and not task.arrived and task.worker == w.index:
                    failed = task
                deaths = 0   # (the task that kept stalling is given up)
                error = stall.error()
            else:
                stall.warn(task is not None and not task.cancelled, stacklevel=4)
        else:
            verdict = respawn_verdict(self.respawn, deaths, self.max_respawns)
            if verdict is not None:
                give_up = WorkerDiedError(f"worker {w.index} (pid {pid}) {how}; {verdict}",
                                          worker=w.index, exitcode=code)
        if give_up is not None:
            # The next call starts a fresh process, with the whole budget; the unfinished
            # work waits for it (nothing is lost: its caller may ask again).
            deaths = 0
        # One step that a Ctrl-C must not cut in two: the worker has no process, and its
        # unfinished work waits for the next one.  A KeyboardInterrupt can land between
        # any two statements, so SIGINT is held back until the step is done, then
        # raised.  Stopping the old process and releasing its memory, which take a while
        # and may be interrupted themselves, come after, in the ``finally``: also when
        # the Ctrl-C held back is raised as the step ends.
        detached = None
        try:
            with _process.interrupts_deferred():
                lane.deaths_in_a_row = deaths
                lane.stall = None
                lane.record.process_ended(w.counters(), time.monotonic_ns())
                if failed is not None:
                    failed.error = error
                    self._arrived(lane, failed)
                unfinished = []
                tasks = self._tasks
                for t in lane.inflight:
                    task = tasks.get(t)
                    if task is None or task.arrived:
                        continue
                    task.slot = None   # (the slot numbers of the dead process are void)
                    if task.cancelled:
                        self._drop(task)
                    elif task not in lane.waiting:
                        unfinished.append(task)
                lane.inflight.clear()
                lane.waiting[0:0] = unfinished    # before anything queued for it meanwhile
                detached = w.detach()
        finally:
            if detached is not None:
                detached.stop(1.0)
        if give_up is not None:
            raise give_up from None

    def _restart(self, lane):
        """Start a process for ``lane``'s worker if it has none, and hand it the tasks
        waiting for it, in order.  Survives the new process dying too (up to the limit)."""
        w = lane.worker
        while True:
            try:
                if not w.has_process:
                    if self.closed:
                        raise RuntimeError(_CLOSED_WHILE_WAITING)
                    seed = (None if self._seeds is None
                            else int(self._seed_rng.integers(2 ** 31)))
                    w.start(seed)
                    if w.incarnation > 1:
                        lane.record.respawns += 1
                waiting = lane.waiting
                while waiting:
                    task = waiting[0]
                    if task.cancelled and not task.arrived:
                        self._drop(task)   # (nobody waits for it any more)
                    # (pushed already, by a step that a Ctrl-C cut short: in flight)
                    elif not task.arrived and task.ticket not in lane.inflight:
                        self._make_room(lane)
                        self._push_task(task, lane)
                    del waiting[0]
                return
            except WorkerDied as e:
                self._bury(lane, e)

    # -- submitting -----------------------------------------------------------------------

    def _ensure_open(self):
        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")
        if _this_pid != self._owner_pid:
            raise RuntimeError(
                f"this {type(self).__name__} belongs to process {self._owner_pid} and cannot "
                f"be used in process {os.getpid()} (a forked child): its workers answer "
                f"only their parent")

    def submit(self, work_info, worker: Optional[int] = None, *, record=None) -> int:
        """Queue ``work_info`` and return its ticket (see :meth:`result`).  ``worker``
        picks the worker; by default the next one round-robin (``in_order``, see
        :meth:`reset_order`) or the least busy one.

        ``record``: a list or deque to which the ticket is appended as the last step.  A
        caller that keeps its tickets there loses none to a ``KeyboardInterrupt``: either
        the ticket is appended, or the work was not submitted (or is dropped when its
        result arrives)."""
        with self._lock:
            if self.closed or _this_pid != self._owner_pid:
                self._ensure_open()   # raises
            if self._released:
                self._give_back_released_slots()
            if self._caller.since_ns is None:
                self._caller.begin()
            lanes = self._lanes
            if worker is not None:
                worker = check_index(worker, "worker", self._n_workers)
                while worker >= len(lanes) and self._start_deferred():
                    pass
                lane = lanes[check_index(worker, "worker", len(lanes))]
            else:
                lane = self._dealer.pick(lanes, self.in_order, _load)
            task = _Task()
            task.work = work_info
            try:
                ticket = self._tasks.issue(task)
                # Give the task to the worker, replacing its process first if it died.
                if lane.waiting or not lane.worker.has_process:
                    lane.waiting.append(task)
                    self._restart(lane)
                else:
                    try:
                        if len(lane.inflight) >= TASK_CAPACITY:
                            self._make_room(lane)
                        self._push_task(task, lane)
                    except WorkerDied as e:
                        self._bury(lane, e)
                        lane.waiting.append(task)
                        self._restart(lane)
                if record is not None:
                    record.append(ticket)
            except BaseException:
                if record is None or not record or record[-1] != task.ticket:
                    self._abandon(task, lane)
                # (else the caller has the ticket: interrupted after handing it over)
                raise
            return ticket

    def _abandon(self, task, lane):
        """``submit`` of ``task`` raised: its caller has no ticket.  Drop the task, or, if
        it reached the worker, let it be dropped when its result arrives."""
        task.cancelled = True
        while task in lane.waiting:
            lane.waiting.remove(task)
        if task.arrived or task.ticket not in lane.inflight:
            self._drop(task)

    def reset_order(self) -> None:
        """Deal the next task (submitted without ``worker``) to worker 0, and the ones
        after it round-robin from there, as in a new manager (``in_order``)."""
        with self._lock:
            self._dealer.reset()

    def _make_room(self, lane):
        """Keep at most TASK_CAPACITY tasks in flight on ``lane``'s worker: collect (not
        hand out) results until there is room.  A worker whose rings were both full would
        wait for the parent while the parent waits for it."""
        w = lane.worker
        while len(lane.inflight) >= TASK_CAPACITY:
            try:
                self._take(lane, w.next_result(self.timeout))
            except _queue.Empty:
                raise no_result(self.timeout, w.index) from None
            except RingClosed:
                raise RuntimeError(_CLOSED_WHILE_WAITING) from None

    def _push_task(self, task, lane):
        """Push ``task`` onto the task ring of ``lane``'s worker; it is in
        ``lane.inflight`` once pushed.  Raises WorkerCorrupt, a WorkerDied (not pushed),
        if the process wrote into its task ring.  Whether it was pushed or not, the task keeps the slot number it was given,
        for the next try (or for _drop)."""
        seg = task.spill
        if seg is None:
            tag, payload, seg = self._encoder.encode(task.work)
            if seg is not None:
                task.spill = seg
                self._resources.spills.append(seg)
        else:
            tag, payload = spill_entry(seg)   # (work given again, to a new process)
        w = lane.worker
        task.worker = w.index
        task.incarnation = w.incarnation
        if task.slot is None:
            task.slot = w.take_slot()
        # (the ticket goes into inflight if and only if the push happens)
        w.push_task(tag, task.slot, task.ticket, payload, lane.inflight)

    def add_work(self, work_info: TaskInfoT) -> None:
        """Queue ``work_info``; its result is returned by a later :meth:`fetch`."""
        self.submit(work_info, record=self._order)

    # -- collecting -----------------------------------------------------------------------

    def _accept(self, lane, entry):
        """Record a result entry that ``lane``'s worker published (hand nothing out
        yet).  The caller then tells the worker handle it is recorded (see _take); an
        entry whose recording was cut short is recorded again, so every step below gives
        the same state when it runs twice."""
        t, slot, ticket, payload = entry
        status, where = _untag(t)
        w = lane.worker
        if status == _ST_FATAL:
            w.result_recorded()   # (the worker exits; a replacement starts afresh)
            info = _codec.decode(payload, copy=True)
            raise WorkerError.from_payload(info, w.index, "could not start: ")
        tasks = self._tasks
        task = tasks.get(ticket)
        if task is None:
            # no longer wanted (dropped, or delivered by a recording cut short)
            try:
                lane.inflight.remove(ticket)
            except ValueError:
                if not w.repeated:   # (a recording cut short removed it already)
                    raise WorkerCorrupt(w, f"ticket {ticket} was not given to it") from None
            return
        if task.arrived:
            if task.worker != w.index or not w.repeated:
                raise WorkerCorrupt(w, f"ticket {ticket}: its result came already")
            self._arrived(lane, task)   # (finish a recording cut short)
            return
        # (pushed to this process is exactly: in its lane's inflight, see the top)
        if task.worker != w.index or ticket not in lane.inflight or (
                where == _AT_SLOT and slot != task.slot):
            raise WorkerCorrupt(w, f"ticket {ticket}, slot {slot}: no such task was given "
                                   f"to it")
        if where == _AT_SLOT:
            try:
                task.seg, task.nbytes = w.map_slot(slot, payload)
            except OSError as e:
                # e.g. out of descriptors: this result is lost; its caller hears why.
                # (WorkerDied: the task stays in flight, and is redone by the replacement.)
                task.error = e
                self._arrived(lane, task)
                return
        else:
            task.inline = payload
        if lane.deaths_in_a_row:
            lane.deaths_in_a_row = 0
        if task.spill is not None:
            self._release_spill(task)
        task.status = status
        self._arrived(lane, task)

    def _arrived(self, lane, task):
        """The result of ``task`` is recorded: it is no longer in flight.  (``arrived``
        first: a task whose ticket is still in flight meanwhile is not re-issued.)"""
        task.arrived = True
        try:
            lane.inflight.remove(task.ticket)
        except ValueError:
            pass   # (removed already, by a recording cut short)
        if task.cancelled:
            self._drop(task)

    def _take(self, lane, entry):
        """Record ``entry``, the oldest result entry of ``lane``'s worker not recorded yet
        (WorkerHandle.next_result), then let the handle drop it.  Interrupted anywhere,
        the entry stays with the handle and is recorded again next time."""
        self._accept(lane, entry)
        lane.worker.result_recorded()

    def _release_spill(self, task):
        """Close the segment that carried ``task``'s work info, if any."""
        if task.spill is not None:
            try:
                self._resources.spills.remove(task.spill)
            except ValueError:
                pass
            task.spill.close()
            task.spill = None

    def _drop(self, task):
        """Forget ``task`` (cancelled, or abandoned by submit) and release what it holds:
        its spill, and its slot unless the worker may still write into it (pushed, and no
        result yet: then the slot goes back when the result arrives, see _abandon)."""
        self._tasks.pop(task.ticket, None)
        self._release_spill(task)
        if task.worker is None:
            return
        inflight = self._lanes[task.worker].inflight
        if task.arrived:
            try:
                inflight.remove(task.ticket)   # (a recording cut short left it there)
            except ValueError:
                pass
        if task.slot is not None and not task.leases and (
                task.arrived or task.ticket not in inflight):
            self._give_back_slot(task)

    def _give_back_slot(self, task):
        """The slot of ``task``, whose result was read or dropped, can take new work.  At
        most once: ``task.slot`` is cleared first (cut short in between, the slot number
        is lost, never given back twice)."""
        slot = task.slot
        if slot is not None:
            task.slot = None
            self._lanes[task.worker].worker.give_back_slot(slot, task.incarnation)

    def _give_back_released_slots(self):
        """The leases garbage collected since (their tasks, on ``_released``) are gone;
        a delivered task whose last lease this was gives its slot back."""
        released = self._released
        tasks = self._tasks
        while released:
            task = released.popleft()
            self._leases -= 1
            task.leases -= 1
            if not task.leases and task.ticket not in tasks:
                self._give_back_slot(task)

    def _wait(self, task, timeout):
        """Block until ``task`` has a result (or raise); the time is counted (see stats)."""
        t0 = time.monotonic_ns()
        try:
            self._wait_for(task, timeout)
        finally:
            self._caller.waited(t0, time.monotonic_ns(),
                                self._lanes[task.worker].worker.started_ns)

    def _wait_for(self, task, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        lane = self._lanes[task.worker]
        w = lane.worker
        while not task.arrived:
            if lane.waiting or not w.has_process:
                self._restart(lane)   # a replacement that could not be finished earlier
                continue
            if self._deferred and self._caller.batches and not w.results_published:
                self._start_deferred(quiet=True)   # (while this worker makes the result)
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                entry = w.next_result(left)
                self._accept(lane, entry)   # (_take, inlined: this runs once per batch)
                w.result_recorded()
            except _queue.Empty:
                raise no_result(timeout, w.index) from None
            except RingClosed:
                raise RuntimeError(_CLOSED_WHILE_WAITING) from None
            except WorkerDied as e:
                self._bury(lane, e)
                self._restart(lane)

    def _deliver(self, task):
        """Turn an arrived result into the value returned to the caller.  The task leaves
        ``_tasks`` once the value is made: cut short before, it can be delivered again
        (from the slot, which it still holds) or cancelled.  Its slot goes back then, or
        once the last lease on it is garbage collected (see _give_back_released_slots)."""
        status = task.status
        seg = task.seg
        try:
            if task.error is not None:
                raise task.error
            if seg is None:
                value = _decode(task.inline, True)   # (copy)
            elif self.copy or self._leases >= self.max_leases or status != _ST_OK:
                with memoryview(seg) as mv:
                    value = _decode(mv[:task.nbytes], True)   # (copy)
            else:
                task.leases += 1
                self._leases += 1
                lease = _SlotLease(seg, 0, task.nbytes, self._released.append, task)
                value = _decode(lease)
                del lease
        except Exception:
            self._tasks.pop(task.ticket, None)   # (the caller hears why instead)
            self._release_spill(task)
            if not task.leases:
                self._give_back_slot(task)
            raise
        self._tasks.pop(task.ticket, None)
        if not task.leases:
            self._give_back_slot(task)
        if status == _ST_ERROR:
            raise WorkerError.from_payload(value, task.worker)
        self._caller.batches += 1 if self._batches_in is None else self._batches_in(task.work)
        return value

    def result(self, ticket: int, timeout: Optional[float] = None):
        """The result of a :meth:`submit` ticket, waiting for it if needed.  Raises
        :class:`~unienv_mp.WorkerError` if the work raised, ``TimeoutError`` after
        ``timeout`` (default: the manager's ``timeout``) seconds."""
        with self._lock:
            if self.closed or _this_pid != self._owner_pid:
                self._ensure_open()   # raises
            task = self._tasks.pending(ticket)
            if not task.arrived:
                self._wait(task, self.timeout if timeout is None else timeout)
            return self._deliver(task)

    def ready(self, ticket: int) -> bool:
        """True if the result of ``ticket`` has arrived (collects what has arrived)."""
        with self._lock:
            self._ensure_open()
            task = self._tasks.pending(ticket)
            if not task.arrived:
                self._poll_all(check_alive=True)
            return task.arrived

    def cancel(self, ticket: int) -> None:
        """Forget a ticket: its result is dropped when it arrives."""
        with self._lock:
            task = self._tasks.get(ticket)
            if task is None:
                return
            task.cancelled = True
            if task.arrived:
                self._drop(task)

    def wait_any(self, tickets, timeout: Optional[float] = None) -> int:
        """One of ``tickets`` whose result has arrived (collect it with :meth:`result`),
        waiting for one if none has.  Raises ``TimeoutError`` after ``timeout`` (default:
        the manager's ``timeout``) seconds, ``KeyError`` if no ticket is pending."""
        with self._lock:
            self._ensure_open()
            if not self._any_pending(tickets):
                raise none_pending(tickets)
            limit = self.timeout if timeout is None else timeout
            ticket = self._first_ready(tickets, True, limit)
            if ticket is None:
                raise no_result(limit)
            return ticket

    def _poll_all(self, check_alive=False):
        """Accept every result already published by any worker (never blocks, except to
        replace a worker found dead).  ``check_alive``: also look for dead workers (a
        caller that does not block never reaches the liveness checks of the waits)."""
        for lane in self._lanes:
            w = lane.worker
            if lane.waiting or not w.has_process:
                self._restart(lane)
            try:
                while True:
                    self._take(lane, w.next_result(0))
            except RingClosed:
                raise RuntimeError(_CLOSED_WHILE_WAITING) from None
            except _queue.Empty:
                if check_alive and w.has_exited():
                    self._bury(lane)
                    self._restart(lane)
            except WorkerDied as e:
                self._bury(lane, e)
                self._restart(lane)

    def fetch(self, block: bool = True, timeout: Optional[float] = None) -> Optional[ResultT]:
        """Return the result of work added with :meth:`add_work`: the oldest one
        (``in_order``) or the first to finish.  Returns ``None`` if ``block`` is false or
        ``timeout`` expires before it arrives, as UniEnv's manager does."""
        with self._lock:
            self._ensure_open()
            while self._order and self._order[0] not in self._tasks:
                self._order.popleft()   # collected with result() meanwhile
            if not self._order:
                raise RuntimeError("no work to fetch: add_work() first")
            self._give_back_released_slots()
            if self.in_order:
                task = self._tasks[self._order[0]]
                if not task.arrived:
                    if not block:
                        self._poll_all(check_alive=True)
                        if not task.arrived:
                            return None
                    else:
                        try:
                            self._wait(task, timeout if timeout is not None else self.timeout)
                        except TimeoutError:
                            if timeout is not None:
                                return None
                            raise
                # The ticket leaves _order after its task leaves _tasks (cut short in between,
                # the next fetch skips it), or when the result is an exception.
                try:
                    value = self._deliver(task)
                except Exception:
                    self._order.popleft()
                    raise
                self._order.popleft()
                return value
            limit = timeout if timeout is not None else self.timeout
            ticket = self._first_ready(self._order, block, limit)
            if ticket is None:
                if block and timeout is None and limit is not None:
                    raise no_result(limit)
                return None
            try:
                value = self._deliver(self._tasks[ticket])
            except Exception:
                self._order.remove(ticket)
                raise
            self._order.remove(ticket)
            return value

    def _first_ready(self, tickets, block, limit):
        """A ticket among ``tickets`` whose result has arrived, waiting up to ``limit``
        seconds (None: no limit) if ``block``, on the doorbell that every worker rings
        after publishing; None if there is none."""
        def find():
            self._poll_all()
            for t in tickets:
                task = self._tasks.get(t)
                if task is not None and task.arrived:
                    return (t,)
            if not self._any_pending(tickets):   # (all cancelled meanwhile)
                raise none_pending(tickets)
            return None

        found = find()
        if found is None and not block:
            self._check_all_alive()
            found = find()
        if found is None and block and self._deferred and self._caller.batches:
            self._start_deferred(quiet=True)   # (while the workers make the results)
            found = find()
        if found is None and block:
            t0 = time.monotonic_ns()
            try:
                found = self._doorbell.wait_until(find, limit, self.doze_time,
                                                  check=self._check_all_alive)
            finally:
                self._caller.wait_ns += time.monotonic_ns() - t0
        return None if found is None else found[0]

    def _any_pending(self, tickets):
        """True if one of ``tickets`` will have a result to collect (neither collected nor
        cancelled)."""
        tasks = self._tasks
        for t in tickets:
            task = tasks.get(t)
            if task is not None and not task.cancelled:
                return True
        return False

    def _check_all_alive(self):
        if self.closed:
            raise RuntimeError(_CLOSED_WHILE_WAITING)
        stall_ns = None if self.stall_timeout is None else int(self.stall_timeout * 1e9)
        for lane in self._lanes:
            w = lane.worker
            if w.proc is None:          # replaced, but its replacement could not start yet
                self._restart(lane)
            elif w.has_exited():
                self._bury(lane)
                self._restart(lane)
            elif stall_ns is not None:
                try:
                    w.check_stall(stall_ns)
                except WorkerStalled as e:
                    self._bury(lane, e)
                    self._restart(lane)

    # -- where the time goes --------------------------------------------------------------

    def stats(self, reset: bool = False) -> _stats.SamplerStats:
        """Where the time went since the first request (or the last ``stats(reset=True)``):
        see :class:`~unienv_mp.SamplerStats`.  ``reset=True``: the counters start again
        from zero once this is read.  A result counts as ``batches_in(work)`` batches if
        the work function has that method, else one."""
        with self._lock:
            now = time.monotonic_ns()
            count = (lambda work: 1) if self._batches_in is None else self._batches_in
            tasks = self._tasks
            ready = sum(count(task.work) for task in tasks.values() if task.arrived
                        and not task.cancelled and task.status == _ST_OK and task.error is None)
            workers = []
            for lane in self._lanes:
                w = lane.worker
                counters = w.counters()
                if w.has_process:   # published, not yet taken off the ring: in flight order
                    for ticket in list(lane.inflight)[:w.results_published]:
                        task = tasks.get(ticket)
                        if task is not None and not task.arrived and not task.cancelled:
                            ready += count(task.work)
                workers.append(lane.record.read(w.index, w.pid, counters, now, reset,
                                                w.launched_ns if w.has_process else None))
            return self._caller.report(ready, workers, now, reset)

    # -- lifecycle ------------------------------------------------------------------------

    def close(self):
        """Stop the workers (asking first, then terminating any still running after ~2 s)
        and release the shared memory.  Results already handed out stay valid.
        Idempotent, and safe from any thread at any moment: a call running in another
        thread is woken and raises ``RuntimeError``, no process starts after this
        returns, and the memory is released once that call has left (if it has not
        within ``CLOSE_WAIT`` seconds, the processes are stopped and the memory is
        released at the manager's garbage collection or at exit, with a
        ``RuntimeWarning``)."""
        self.closed = True
        resources = self._resources
        resources.shut_down()   # first, without the lock: wakes a call waiting meanwhile
        lock = getattr(self, "_lock", None)
        got = lock is None or lock.acquire(timeout=CLOSE_WAIT)
        try:
            if not got:
                warnings.warn(f"unienv_mp: a call on this {type(self).__name__} in another "
                              f"thread did not end within {CLOSE_WAIT} s of close(); its "
                              f"workers are stopped, its shared memory is released at "
                              f"exit", RuntimeWarning, stacklevel=2)
                _process.stop_processes(
                    [w.proc for w in resources.workers if w.proc is not None], 2.0)
                return
            finalizer = getattr(self, "_finalizer", None)
            if finalizer is not None:
                finalizer()
            else:
                resources.close()
            self._tasks.clear()
            self._order.clear()
        finally:
            if got and lock is not None:
                lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"{self.n_workers} workers"
        return f"<{type(self).__name__} {state}, {len(self._order)} pending>"
