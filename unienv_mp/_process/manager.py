"""MultiProcessingSampleManager: tasks dealt to worker processes, their results collected in
order, and dead workers replaced.

Each worker is a `WorkerHandle`: its process, a pair of single-producer single-consumer
rings (tasks in, results out) in a segment the parent creates, and its own result slots
(segments it creates and grows).  The manager decides which worker and which slot each task
uses; a result comes back as a small ring entry pointing at the slot, and is handed to the
caller as zero-copy views of it.  The slot is given to a new task only after the last view
is garbage collected.

Faults: a worker that raises sends the exception back (the caller gets
`WorkerError`, the worker carries on); a worker that dies is noticed within one
``doze_time`` of the caller waiting on it, replaced, and its unfinished tasks are given to
the replacement (or `WorkerDiedError` is raised); so is one that wrote a result entry it
could not have written, which is killed first (a warning, or `CodecError` instead).  Workers
end with the parent however the parent ends (see `unienv_mp._os`).
"""
import functools
import numbers
import os
import threading
import time
import warnings
from multiprocessing import util as _mputil
from typing import Callable, Generic, Optional, Sequence

import numpy as np

from .. import _os
from .. import stats as _stats
from .._transport import protocol as P
from .._transport.ring import DEFAULT_SPIN as _DEFAULT_SPIN
from .._transport.ring import Event, Segment
from .._validate import (MAX_LEASES, MAX_RESPAWNS, check_bool, check_context,
                         check_doze_time, check_index, check_int, check_seconds, check_spin,
                         check_workers)
from ..backend import (CLOSED_WHILE_WAITING, Dealer, ResultT, TaskInfoT, no_result,
                       none_pending)
from ..errors import RingClosed
from .encoder import WorkEncoder
from .handle import RESULT_INLINE, TASK_CAPACITY, TASK_INLINE, WorkerDied
from .launch import Launch
from .ledger import Task, WorkLedger
from .polling import Poller
from .pool import CLOSE_WAIT, CopyLost, Resources, Settings, WorkerPool
from .unienv_queue import UniEnvQueue

__all__ = ["MultiProcessingSampleManager", "TaskInfoT", "ResultT", "TASK_CAPACITY",
           "TASK_INLINE", "RESULT_INLINE", "CLOSE_WAIT", "CopyLost"]


# A Ctrl-C (KeyboardInterrupt) can land between any two bytecodes of this module, in
# particular right after any call returns.  What keeps the manager consistent whatever it
# cuts short:
#
# * The rings record what they did inside the call: a task pushed is appended to its
#   worker's ``inflight`` (the ledger's) by the push itself (RingBuffer.push_tagged's
#   ``record``), and a result entry popped stays in its handle until its recording ends
#   (next_result / result_recorded).  So "pushed" is exactly "in inflight", and no popped
#   entry is lost.
# * Recording a result (WorkLedger.accept) may run again on the same entry, and every
#   step of it gives the same state when run twice; ``arrived`` is set before the ticket
#   leaves ``inflight``, so a task is never neither arrived nor in flight (nor re-issued
#   once it has arrived: WorkLedger.requeue skips arrived tasks).
# * A slot number is given back only through WorkLedger.give_back_slot, which clears
#   ``task.slot`` first: an interruption can at worst leak a slot number (the worker
#   makes another slot), never give one back twice (two tasks writing into one slot).
#   A delivered result's slot goes back once the task has left the ledger's table and no
#   lease on it is alive (``task.leases``): a delivery cut short can be asked for again,
#   from the same slot.
# * submit() hands its ticket over through ``record`` (the caller's list), appended as
#   the last step; if it raises before, the task is abandoned (WorkLedger.abandon).
# * The rare multi-step changes (replacing a worker's process) hold SIGINT back until
#   they are done (``_os.interrupts_deferred``).


def _dealing(waiting, start_later):
    """The Dealer's ``up(lane)``, whether a lane's worker is taking tasks, over
    ``waiting`` (the ledger's per-worker waiting lists): with ``start_later``, once its
    process began serving them and no task waits for a process to be started; without,
    while it is not retired (see `WorkerPool`)."""
    if start_later is None:
        def up(lane):
            return not lane.retired
    else:
        def up(lane):
            w = lane.worker
            return not waiting[w.index] and not lane.retired and w.started_ns != 0
    return up


class MultiProcessingSampleManager(Generic[TaskInfoT, ResultT]):
    """Run ``target_fn(work_info)`` in ``n_workers`` processes.

    Same interface as UniEnv's ``MultiProcessingSampleManager``: [`add_work`][] queues a
    work item, [`fetch`][] returns a result (``None`` if none arrives in time), and
    [`close`][] ends the workers.  Tickets, which UniEnv lacks: [`submit`][] queues a work
    item and returns its ticket, [`result`][] waits for that ticket's result, [`ready`][]
    says whether it arrived, [`wait_any`][] returns the first of several tickets to arrive,
    [`cancel`][] drops one, and [`reset_order`][] restarts the round-robin deal.
    [`stats`][] says where the time goes (see [`SamplerStats`][unienv_mp.SamplerStats]).

    Args:
        target_fn: the work function, run in the workers on each work item; picklable
            under spawn and forkserver.  With a ``batches_in(work)`` method, [`stats`][]
            counts that many batches per task (the sampler's chunks).
        n_workers: worker processes.
        ctx: multiprocessing context or start method name; default: the current default.
        done_event: a multiprocessing Event (optional): the workers stop when it is set.
        doze_time: how often a waiting side re-checks that its peer is alive (nothing polls
            on the hot path: waits sleep on futexes).
        daemon: passed to ``Process``.
        worker_init_fn: ``worker_init_fn(seed)`` runs first in each worker ...
        worker_seeds: ... with that worker's entry of these ``n_workers`` seeds.
        in_order: ``True``: results come back in the order the work was added, and work is
            dealt round-robin, so a run is reproducible whatever the workers' timing.
            ``False``: each task goes to the least busy worker and [`fetch`][] returns
            whichever result is ready first.
        copy: ``False``: results are zero-copy views of the worker's slot, which is reused
            only once they are garbage collected.  ``True``: results are always copied.
        timeout: seconds to wait for one result before raising `TimeoutError` (default:
            wait as long as the workers are alive).
        respawn: ``True``: a worker that dies is replaced (with a fresh seed) and its
            unfinished work re-issued.  ``False``: raise
            [`WorkerDiedError`][unienv_mp.WorkerDiedError] at the first death.
        max_respawns: replacements of one worker without a result in between; its next
            death raises [`WorkerDiedError`][unienv_mp.WorkerDiedError].
        max_leases: zero-copy results held at once (default ``2 * n_workers + 8``); beyond
            that they are copied.
        spin: seconds a waiting side polls before it sleeps on a futex.  Default: 20 µs
            where this process may run on more CPUs than there are workers; otherwise 0,
            since polling would take a CPU from a process that has work to do.
        stall_timeout: seconds a worker may spend on one task, or go without taking the
            tasks waiting for it (default: no limit); beyond, it is killed and replaced,
            with a warning carrying its stacks (see `WorkerPool` for its tasks).
        start_later: None: all start now.  A function: worker 0 starts now, the others one
            at a time when the caller would wait (after the first result) while
            ``start_later()`` is True (asked unless they start from the first one's
            snapshot: `Launch`); tasks skip those starting; [`start_all`][] starts them.
        same_copy: None: every process, also one started after the first ones that cannot
            start from their snapshot (under fork once the process that keeps it is gone),
            starts.  A function: such a process starts only if ``same_copy()`` is True,
            i.e. it would copy what the first ones copied; otherwise a worker left to start
            later does not start, and a dead worker is not replaced: its tasks go to the
            others, with a ``RuntimeWarning``, and once none is left
            [`WorkerDiedError`][unienv_mp.WorkerDiedError] is raised.

    Threads: every method may be called from any thread.  Calls are serialised (a lock, held
    for the whole call: a second thread waits while the first waits for a result), and
    [`close`][] is safe at any moment, from any thread: a call it cuts short raises
    ``RuntimeError``.  A forked child cannot use its parent's manager (``RuntimeError``).
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
        same_copy: Optional[Callable[[], bool]] = None,
    ):
        # First, so that close() (also run at garbage collection) works on a half-built one.
        self.closed = True
        self._pool = None
        # Held by every call (see "Threads" in the class docstring); re-entrant, for a
        # call made from a signal handler or a garbage collection in the middle of one.
        self._lock = threading.RLock()
        (settings, n_workers, ctx, daemon, worker_seeds, in_order, copy, spin,
         max_leases) = _checked_options(
            target_fn, n_workers, ctx, daemon, worker_seeds, doze_time, in_order, copy,
            timeout, respawn, max_respawns, max_leases, spin, stall_timeout, start_later,
            worker_init_fn, same_copy)
        self.target_fn = target_fn
        self.in_order = in_order
        self.copy = copy
        self.spin = spin
        self.max_leases = max_leases
        # (the settings its parts read when they act: the properties below write through)
        self._settings = settings
        self.done_event = done_event
        self._owner_pid = os.getpid()
        # (no part holds a reference to the manager: a manager dropped without close()
        # is freed at once, and its finalizer ends the workers)
        self._resources = resources = Resources()
        # the work in flight: tickets, tasks, each worker's lists, slots (the one owner)
        self._caller = _stats.CallerRecord()   # batches handed out, time waited (see stats)
        self._ledger = ledger = WorkLedger(n_workers, resources.workers,
                                           WorkEncoder(TASK_INLINE - P.TASK_CHECK.size),
                                           resources.spills, self._caller,
                                           getattr(target_fn, "batches_in", None))
        self._tasks = ledger.tasks   # (ticket -> Task, not yet delivered: for reading)
        self._dealer = Dealer(_dealing(ledger.waiting, start_later))   # (see start_later)
        self._load = functools.partial(_lane_load, ledger.load)
        self._pool = pool = WorkerPool(n_workers, worker_seeds, start_later,
                                       ctx.get_start_method(), settings, ledger,
                                       self._caller, resources)
        self._lanes = pool.lanes                 # (the pool's: the per-batch path reads it)
        resources.done_event = done_event
        resources.doorbell_seg = Segment.create(64, "doorbell")
        self._poller = Poller(pool, ledger.tasks, settings,
                              Event(resources.doorbell_seg, 0, True), self._caller)
        self._unienv = UniEnvQueue(ledger, pool, self._poller, self.in_order)
        self._finalizer = _mputil.Finalize(self, resources.close, exitpriority=100)
        self._spot_rng = np.random.default_rng()   # (which blocks spot_check compares)
        launch = Launch(target_fn, worker_init_fn, ctx, daemon, resources.doorbell_seg,
                        done_event, settings.doze_time, self.spin, settings.stall_timeout,
                        same_copy)
        self.closed = pool.closed = False
        try:
            pool.start(launch)
        except BaseException:
            self.close()
            raise

    # -- settings (may be changed after construction: the parts read them when they act) --

    @property
    def timeout(self) -> Optional[float]:
        """Seconds to wait for one result before raising `TimeoutError` (None: no limit)."""
        return self._settings.timeout

    @timeout.setter
    def timeout(self, value):
        self._settings.timeout = _check_setting["timeout"](value)

    @property
    def stall_timeout(self) -> Optional[float]:
        """Seconds a worker may spend on one task before it is killed and replaced (None:
        no limit)."""
        return self._settings.stall_timeout

    @stall_timeout.setter
    def stall_timeout(self, value):
        self._settings.stall_timeout = _check_setting["stall_timeout"](value)

    @property
    def respawn(self) -> bool:
        """Whether a worker that dies is replaced (read at each death)."""
        return self._settings.respawn

    @respawn.setter
    def respawn(self, value):
        self._settings.respawn = _check_setting["respawn"](value)

    @property
    def max_respawns(self) -> int:
        """Replacements of one worker without a result in between (read at each death)."""
        return self._settings.max_respawns

    @max_respawns.setter
    def max_respawns(self, value):
        self._settings.max_respawns = _check_setting["max_respawns"](value)

    @property
    def doze_time(self) -> float:
        """How often (seconds) a wait in this process re-checks that the workers are alive
        (the workers keep the value they started with)."""
        return self._settings.doze_time

    @doze_time.setter
    def doze_time(self, value):
        self._settings.doze_time = _check_setting["doze_time"](value)

    # -- submitting -----------------------------------------------------------------------

    def _ensure_open(self):
        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")
        if _os.pid != self._owner_pid:
            _os.refuse_child(self, self._owner_pid)

    def submit(self, work_info, worker: Optional[int] = None, *, record=None) -> int:
        """Queue ``work_info`` and return its ticket (see [`result`][]).  ``worker`` picks
        the worker; by default the next one round-robin (``in_order``, see
        [`reset_order`][]) or the least busy one.

        ``record``: a list or deque to which the ticket is appended as the last step.  A
        caller that keeps its tickets there loses none to a ``KeyboardInterrupt``: either
        the ticket is appended, or the work was not submitted (or is dropped when its result
        arrives)."""
        with self._lock:
            if self.closed or _os.pid != self._owner_pid:
                self._ensure_open()   # raises
            ledger = self._ledger
            if ledger.released:
                ledger.give_back_released()
            if self._caller.since_ns is None:
                self._caller.begin()
            lanes = self._lanes
            if worker is not None:
                worker = check_index(worker, "worker", self._pool.n_workers)
                while worker >= len(lanes) and self._pool.start_deferred():
                    pass
                lane = lanes[check_index(worker, "worker", len(lanes))]
            else:
                lane = self._dealer.pick(lanes, self.in_order, self._load)
            task = Task(work_info)
            i = lane.worker.index
            try:
                ticket = ledger.tasks.issue(task)
                # Give the task to the worker, replacing its process first if it died.
                if ledger.waiting[i] or not lane.worker.has_process:
                    ledger.enqueue(task, i)
                    self._pool.restart(lane, self._deadline())
                else:
                    try:
                        self._pool.push(task, lane)
                    except WorkerDied as e:   # (not pushed: it waits for the replacement)
                        self._pool.bury(lane, e)
                        ledger.enqueue(task, i)
                        # (the deadline counts from now: the burial may take seconds)
                        self._pool.restart(lane, self._deadline())
                    except RingClosed:   # (close() shut the ring, from another thread)
                        raise RuntimeError(CLOSED_WHILE_WAITING) from None
                if record is not None:
                    record.append(ticket)
            except BaseException:
                if record is None or not record or record[-1] != task.ticket:
                    ledger.abandon(task, i)
                # (else the caller has the ticket: interrupted after handing it over)
                raise
            return ticket

    def _deadline(self):
        """The deadline of a wait with the manager's ``timeout`` starting now, or None."""
        timeout = self.timeout
        return None if timeout is None else time.monotonic() + timeout

    def reset_order(self) -> None:
        """Deal the next task (submitted without ``worker``) to worker 0, and the ones
        after it round-robin from there, as in a new manager (``in_order``)."""
        with self._lock:
            self._dealer.reset()

    # -- collecting -----------------------------------------------------------------------

    def _deliver(self, task):
        """Hand out the result of an arrived ``task`` (see `WorkLedger.deliver`)."""
        return self._ledger.deliver(task, self.copy, self.max_leases)

    def result(self, ticket: int, timeout: Optional[float] = None):
        """The result of a [`submit`][] ticket, waiting for it if needed.  Raises
        [`WorkerError`][unienv_mp.WorkerError] if the work raised, ``TimeoutError`` after
        ``timeout`` (default: the manager's ``timeout``) seconds."""
        with self._lock:
            if self.closed or _os.pid != self._owner_pid:
                self._ensure_open()   # raises
            task = self._ledger.tasks.pending(ticket)
            if not task.arrived:
                self._pool.wait_for(task, self.timeout if timeout is None else timeout)
            return self._ledger.deliver(task, self.copy, self.max_leases)

    def cancel(self, ticket: int) -> None:
        """Forget a ticket: its result is dropped when it arrives."""
        with self._lock:
            self._ledger.cancel(ticket)

    def ready(self, ticket: int) -> bool:
        """True if the result of ``ticket`` has arrived (collects what has arrived)."""
        with self._lock:
            self._ensure_open()
            task = self._ledger.tasks.pending(ticket)
            if not task.arrived:
                self._pool.poll_all(check_alive=True)
            return task.arrived

    def wait_any(self, tickets, timeout: Optional[float] = None) -> int:
        """One of ``tickets`` whose result has arrived (collect it with [`result`][]),
        waiting for one if none has.  Raises ``TimeoutError`` after ``timeout`` (default:
        the manager's ``timeout``) seconds, ``KeyError`` if no ticket is pending."""
        with self._lock:
            self._ensure_open()
            if not self._poller.any_pending(tickets):
                raise none_pending(tickets)
            limit = self.timeout if timeout is None else timeout
            ticket = self._poller.first_ready(tickets, True, limit)
            if ticket is None:
                raise no_result(limit)
            return ticket

    # -- UniEnv's interface (see unienv_queue.py) --------------------------------------------

    def add_work(self, work_info: TaskInfoT) -> None:
        """Queue ``work_info``; its result is returned by a later [`fetch`][]."""
        self.submit(work_info, record=self._unienv.order)

    def fetch(self, block: bool = True, timeout: Optional[float] = None) -> Optional[ResultT]:
        """Return the result of work added with [`add_work`][]: the oldest one
        (``in_order``) or the first to finish.  Returns ``None`` if ``block`` is false or
        ``timeout`` expires before it arrives, as UniEnv's manager does."""
        with self._lock:
            self._ensure_open()
            return self._unienv.fetch(block, timeout, self.timeout, self._pool.wait_for,
                                     self._deliver)

    @property
    def remaining_work(self) -> int:
        """Work added with [`add_work`][] and not fetched yet."""
        return self._unienv.remaining_work

    # -- the workers, and the end ------------------------------------------------------------

    def start_all(self) -> None:
        """Start now every worker left to start later (see ``start_later``), as far as
        ``start_later()`` allows."""
        with self._lock:
            self._ensure_open()
            while self._pool.start_deferred():
                pass

    @property
    def n_workers(self) -> int:
        """Number of worker processes (those not started yet included, see
        ``start_later``)."""
        return self._pool.n_workers

    @property
    def workers(self):
        """The worker ``Process`` objects (replacements included, after a respawn) of the
        workers started (see ``start_later``)."""
        return [lane.worker.proc for lane in self._lanes]

    def copy_holders(self):
        """The pids of the processes that hold the copy of the data the workers started
        from, under fork: the snapshot process (if it is up), then the workers.  Reads no
        lock (it is asked before a fork, which another thread may make while a call holds
        this manager's lock)."""
        pool = self._pool
        if pool is None or self.closed:
            return []
        launch = pool.launch
        pids = [] if launch is None else launch.snapshot_pids()
        for lane in list(pool.lanes):
            w = lane.worker
            proc = w.proc
            if proc is not None and w.pid is not None and not _os.has_exited(proc):
                pids.append(w.pid)
        return pids

    def spot_check(self, blocks: int = 64) -> Optional[bool]:
        """Compare samples of the copy of the data that the workers started from (under
        spawn and forkserver: the arrays of the work function, copied once) with the data
        as it is now: up to ``blocks`` random blocks of 4 KiB of each array.  False if one
        differs (the data was written since, e.g. through ``tensor.numpy()``), True if none
        does, None where nothing was copied (fork, or no arrays)."""
        with self._lock:
            self._ensure_open()
            launch = self._pool.launch
            return None if launch is None else launch.spot_check(blocks, self._spot_rng)

    def slot_segments(self):
        """The result slots of the workers now, as mapped here (none once closed): what a
        device feed page-locks (see `unienv_mp._device.pins`)."""
        return [] if self.closed else self._pool.slot_segments()

    def stats(self, reset: bool = False) -> _stats.SamplerStats:
        """Where the time went since the first request (or the last ``stats(reset=True)``):
        see [`SamplerStats`][unienv_mp.SamplerStats].  ``reset=True``: the counters start
        again from zero once this is read.  A result counts as ``batches_in(work)`` batches
        if the work function has that method, else one."""
        with self._lock:
            now = time.monotonic_ns()
            ready, workers = self._pool.worker_stats(now, reset)
            return self._caller.report(ready, workers, now, reset)

    def close(self) -> None:
        """Stop the workers (asking first, then terminating any still running after ~2 s)
        and release the shared memory.  Results already handed out stay valid.
        Idempotent, and safe from any thread at any moment: a call running in another
        thread is woken and raises ``RuntimeError``, no process starts after this
        returns, and the memory is released once that call has left (if it has not
        within ``CLOSE_WAIT`` seconds, the processes are stopped and the memory is
        released at the manager's garbage collection or at exit, with a
        ``RuntimeWarning``).  In a forked child it only marks this copy closed: the
        workers, their rings and their slots are the parent's."""
        self.closed = True
        pool = getattr(self, "_pool", None)
        if pool is None:
            return
        pool.closed = True   # (no process starts from now on)
        if os.getpid() != self._owner_pid:
            return
        pool.shut_down()   # first, without the lock: wakes a call waiting meanwhile
        if not self._lock.acquire(timeout=CLOSE_WAIT):
            warnings.warn(f"unienv_mp: a call on this {type(self).__name__} in another "
                          f"thread did not end within {CLOSE_WAIT} s of close(); its "
                          f"workers are stopped, its shared memory is released at exit",
                          RuntimeWarning, stacklevel=2)
            pool.stop_now()
            return
        try:
            finalizer = getattr(self, "_finalizer", None)
            if finalizer is not None:
                finalizer()   # (runs once: a close it ran cut short is finished below)
            pool.resources.close()
            self._ledger.tasks.clear()
            if getattr(self, "_unienv", None) is not None:   # (not in a half-built one)
                self._unienv.order.clear()
        finally:
            self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"{self.n_workers} workers"
        pending = len(self._unienv.order) if getattr(self, "_unienv", None) else 0
        return f"<{type(self).__name__} {state}, {pending} pending>"


#: How each setting that may be changed after construction is checked: at construction
#: and by its property's setter alike.
_check_setting = {
    "timeout": lambda v: check_seconds(v, "timeout"),
    "stall_timeout": lambda v: check_seconds(v, "stall_timeout"),
    "respawn": lambda v: check_bool(v, "respawn"),
    "max_respawns": lambda v: check_int(v, "max_respawns", 0, MAX_RESPAWNS),
    "doze_time": check_doze_time,
}


def _checked_options(target_fn, n_workers, ctx, daemon, worker_seeds, doze_time, in_order,
                     copy, timeout, respawn, max_respawns, max_leases, spin, stall_timeout,
                     start_later, worker_init_fn, same_copy):
    """The arguments of MultiProcessingSampleManager checked and normalised: ``(settings,
    n_workers, ctx, daemon, worker_seeds, in_order, copy, spin, max_leases)``,
    ``settings`` the `Settings` its parts read."""
    if not callable(target_fn):
        raise TypeError(f"target_fn must be callable, got {type(target_fn).__name__}")
    n_workers = check_workers(n_workers)
    if worker_seeds is not None:
        worker_seeds = _checked_seeds(worker_seeds, n_workers)
    for name, fn in (("start_later", start_later), ("worker_init_fn", worker_init_fn),
                     ("same_copy", same_copy)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be None or callable, got {type(fn).__name__}")
    if spin is None:
        spin = _DEFAULT_SPIN if len(os.sched_getaffinity(0)) > n_workers else 0.0
    settings = Settings(
        doze_time=_check_setting["doze_time"](doze_time),
        timeout=_check_setting["timeout"](timeout),
        stall_timeout=_check_setting["stall_timeout"](stall_timeout),
        respawn=_check_setting["respawn"](respawn),
        max_respawns=_check_setting["max_respawns"](max_respawns))
    in_order = check_bool(in_order, "in_order")
    copy = check_bool(copy, "copy")
    spin = check_spin(spin)
    max_leases = (2 * n_workers + 8 if max_leases is None
                  else check_int(max_leases, "max_leases", 0, MAX_LEASES))
    return (settings, n_workers, check_context(ctx),
            check_bool(daemon, "daemon", allow_none=True), worker_seeds, in_order, copy,
            spin, max_leases)


def _checked_seeds(worker_seeds, n_workers):
    """``worker_seeds`` as a list of ``n_workers`` integers, or TypeError / ValueError."""
    try:
        seeds = list(worker_seeds)
    except TypeError:
        raise TypeError(f"worker_seeds must be None or a sequence of n_workers integers, "
                        f"got {type(worker_seeds).__name__}") from None
    if len(seeds) != n_workers:
        raise ValueError(f"worker_seeds must have n_workers={n_workers} entries, "
                         f"got {len(seeds)}")
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"worker_seeds must be integers, got {seed!r}")
    return [int(seed) for seed in seeds]



def _lane_load(load, lane):
    """How busy a lane is (tasks in flight or waiting: ``load``, the ledger's), for a
    deal that is not in order."""
    return load(lane.worker.index)
