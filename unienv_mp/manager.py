"""MultiProcessingSampleManager: worker processes, tasks, results and their lifecycle.

Each worker has its own pair of single-producer single-consumer rings (tasks in, results
out) in a segment the parent creates, and its own result slots (segments it creates and
grows).  The parent decides which worker and which slot each task uses; a result comes back
as a small ring entry pointing at the slot, and is handed to the caller as zero-copy views
of it.  The slot is given to a new task only after the last view is garbage collected.

Faults: a worker that raises sends the exception back (the caller gets
:class:`~unienv_mp.WorkerError`, the worker carries on); a worker that dies is noticed
within one ``doze_time`` of the caller waiting on it, replaced, and its unfinished tasks are
given to the replacement (or :class:`~unienv_mp.WorkerDiedError` is raised).  Workers end
with the parent however the parent ends.
"""
import collections
import multiprocessing as mp
import numbers
import os
import pickle
import queue as _queue
import select
import signal
import threading
import time
from multiprocessing import process as _mp_process
from multiprocessing import util as _mputil
from multiprocessing.connection import wait as _wait_ready
from typing import Callable, Generic, Optional, Sequence, TypeVar

import numpy as np

from . import _codec
from . import _protocol as P
from ._ring import DEFAULT_SPIN as _DEFAULT_SPIN
from ._ring import Event, RingBuffer, Segment, _segment_from_peer
from .errors import PeerGoneError, RingClosed, WorkerDiedError, WorkerError, _loads_or_none
from .worker import worker_main

__all__ = ["MultiProcessingSampleManager", "TaskInfoT", "ResultT"]

TaskInfoT = TypeVar("TaskInfoT")
ResultT = TypeVar("ResultT")

#: Tasks a worker can have queued (its task ring); add_work blocks beyond that.
TASK_CAPACITY = 64
#: Largest encoded work info carried inside a task entry (larger: a one-off segment).
TASK_INLINE = 8192
#: Largest encoded result carried inside a result entry (larger: a slot).
RESULT_INLINE = 4096

_SIMPLE = (str, int, bool, type(None))
_LOCAL_ERROR = 255   # a result that arrived but could not be mapped here

# This module is compiled by Cython (see setup.py) and must stay correct as plain Python.
# On the per-batch path, a local annotated with a builtin container type, e.g.
# ``tasks: dict = self._tasks``, changes nothing in Python; Cython uses the annotation to
# call the dict's C API directly instead of looking up and calling its methods.  And calls
# there pass no keyword arguments: from compiled code, a call with one builds a dict.
#
# Protocol constants as globals of this module: the per-batch path reads them once per
# batch, and a global is cheaper to read than a module attribute.
_RUN_INLINE = P.tag(P.OP_RUN, P.AT_INLINE)
_RUN_SPILL = P.tag(P.OP_RUN, P.AT_SPILL)
_ST_OK = P.ST_OK
_ST_ERROR = P.ST_ERROR
_ST_FATAL = P.ST_FATAL
_AT_INLINE = P.AT_INLINE
_AT_SLOT = P.AT_SLOT
_unpack_slot = P.SLOT_DESC.unpack
_decode = _codec.decode
_SlotLease = _codec.SlotLease

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


def _check_int(value, what, minimum=1):
    """``value`` as an int (numpy integers accepted), or a clear TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


def _check_seconds(value, what, allow_none=True):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__} "
                        f"{value!r}")
    if value <= 0:
        raise ValueError(f"{what} must be > 0, got {value}")
    return float(value)


def _open_pidfd(proc):
    """Keep a pidfd of a started worker on its Process object (see _exited, _signal)."""
    try:
        proc._unienv_mp_pidfd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        proc._unienv_mp_pidfd = -1           # already gone (and reaped: SIGCHLD ignored)
    except (AttributeError, OSError):
        proc._unienv_mp_pidfd = None         # no pidfds here: fall back to the sentinel


def _close_pidfd(proc):
    fd = getattr(proc, "_unienv_mp_pidfd", None)
    proc._unienv_mp_pidfd = -1 if fd is not None else None
    if fd is not None and fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def _exited(proc):
    """True if ``proc`` has ended.  A pidfd says so even when something else reaped the
    child (SIGCHLD ignored, an ``os.wait()`` elsewhere: ``is_alive()`` then stays True) and
    when a grandchild holds the sentinel pipe open.  Without one: ``is_alive()``, then the
    sentinel."""
    fd = getattr(proc, "_unienv_mp_pidfd", None)
    try:
        if fd is not None:
            if fd < 0:
                return True
            poller = select.poll()   # (not select.select: it fails on descriptors >= 1024)
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(0))
        if not proc.is_alive():
            return True
        return bool(_wait_ready([proc.sentinel], 0))
    except (ValueError, OSError):
        return True   # the Process object was closed


def _signal(proc, sig):
    """Send ``sig`` to a worker that has not exited, through its pidfd when it has one (a
    pid alone may have been reused once the child was reaped)."""
    fd = getattr(proc, "_unienv_mp_pidfd", None)
    try:
        if fd is None:
            proc.kill() if sig == signal.SIGKILL else proc.terminate()
        elif fd >= 0:
            signal.pidfd_send_signal(fd, sig)
    except (ValueError, AssertionError, OSError):
        pass   # closed, not started, or already gone


class _WorkerDied(Exception):
    def __init__(self, worker):
        self.worker = worker


class _Task:
    """One submitted work item.  One is made per batch: submit() sets ``ticket`` and
    ``work``, and every other field starts as the class attribute below until it is set
    (no __init__ to call, no fields to store up front)."""
    ticket = None
    work = None
    worker = None
    incarnation = None  # of the worker process the slot number belongs to
    slot = None
    spill = None        # parent segment carrying large work info
    cancelled = False
    result = None       # (status, where, slot, payload, segment) once arrived


class _Worker:
    """The parent's view of one worker process (one incarnation after another)."""

    def __init__(self, index):
        self.index = index
        self.incarnation = 0
        self.proc = None
        self.pid = None                      # of proc (no Python code to run to read it)
        self.seg = None
        self.tasks = None
        self.results = None
        self.slot_maps = {}                  # slot -> (generation, Segment mapped here)
        # (a deque: a list taken down to empty and refilled, as a slot goes out and comes
        # back once per batch, is reallocated each time)
        self.free_slots = collections.deque()
        self.next_slot = 0
        self.inflight = collections.deque()  # tickets, in the order given to the worker
        self.failed_starts = 0               # deaths since the last result
        self.check = None                    # liveness check used while waiting on it
        self.reissue = []                    # tasks waiting for a (new) process
        self.unaccepted = []                 # result entries popped, then interrupted

    def take_slot(self):
        if self.free_slots:
            return self.free_slots.pop()
        self.next_slot += 1
        return self.next_slot - 1


class _LivenessCheck:
    """Called while waiting on worker ``w``'s rings: raises if it died (or the manager was
    closed).  Holds the pool, not the manager, so a worker never keeps the manager alive."""
    __slots__ = ("pool", "w")

    def __init__(self, pool, w):
        self.pool = pool
        self.w = w

    def __call__(self):
        proc = self.w.proc
        if proc is not None and _exited(proc):
            raise _WorkerDied(self.w)
        if self.pool.closed:
            raise RuntimeError("manager was closed while waiting")


class _Pool:
    """Processes and shared memory of a manager: what must be released even if the manager
    is garbage collected or the interpreter exits without close()."""

    def __init__(self):
        self.workers = []
        self.doorbell_seg = None
        self.spills = []
        self.done_event = None
        self.closed = False

    def close(self, join_timeout=2.0):
        if self.closed:
            return
        self.closed = True
        try:
            for w in self.workers:
                for ring in (w.tasks, w.results):
                    # tasks: a worker waiting for one exits; results: a worker finishing
                    # a batch exits instead of taking the next queued task
                    if ring is not None:
                        try:
                            ring.shutdown()
                        except ValueError:
                            pass
            if self.done_event is not None:
                try:
                    self.done_event.set()
                except Exception:
                    pass
            _stop_processes([w.proc for w in self.workers if w.proc is not None],
                            join_timeout)
        finally:
            for w in self.workers:
                _close_worker_memory(w)
            for seg in self.spills:
                seg.close()
            self.spills.clear()
            if self.doorbell_seg is not None:
                self.doorbell_seg.close()


def _exitcode(proc):
    try:
        return None if proc is None else proc.exitcode
    except ValueError:
        return None


def _stop_processes(procs, join_timeout):
    """Join ``procs``, terminating (then killing) those still running after
    ``join_timeout`` seconds; tolerant of Process objects never started or already
    closed."""
    def call(p, method, *args):
        try:
            return getattr(p, method)(*args)
        except (ValueError, AssertionError, OSError):
            return None   # closed, not started, or already reaped

    started = [p for p in procs if call(p, "is_alive") is not None]
    try:
        deadline = time.monotonic() + join_timeout
        for p in started:
            if not _exited(p):
                call(p, "join", max(0.0, deadline - time.monotonic()))
        for p in started:
            if not _exited(p):
                _signal(p, signal.SIGTERM)
        for p in started:
            if not _exited(p):
                call(p, "join", 1.0)
            if not _exited(p):
                _signal(p, signal.SIGKILL)
                call(p, "join", 1.0)
        for p in started:
            if not _exited(p):
                continue   # still dying: multiprocessing reaps it later
            call(p, "join", 0.1)   # collect the exit status
            if call(p, "is_alive"):
                # Ended, but reaped by someone else (its exit status is gone):
                # multiprocessing would count it among active_children() for ever.
                _mp_process._children.discard(p)
            else:
                call(p, "close")
    finally:
        for p in procs:
            _close_pidfd(p)


def _stop_started(proc):
    """Stop a worker whose start was interrupted (if it was started at all)."""
    if getattr(proc, "_popen", None) is not None:
        if getattr(proc, "_unienv_mp_pidfd", None) is None:
            _open_pidfd(proc)
        _stop_processes([proc], 0.0)


def _close_worker_memory(w):
    for ring in (w.tasks, w.results):
        if ring is not None:
            ring.close()
    w.tasks = w.results = None
    if w.seg is not None:
        w.seg.close()
        w.seg = None
    w.slot_maps = {}


class MultiProcessingSampleManager(Generic[TaskInfoT, ResultT]):
    """Run ``target_fn(work_info)`` in ``n_workers`` processes.

    Same interface as UniEnv's ``MultiProcessingSampleManager``: :meth:`add_work` queues a
    work item, :meth:`fetch` returns a result (``None`` if none arrives in time), and
    :meth:`close` ends the workers.  ``worker_init_fn(seed)`` runs in each worker first,
    with its entry of ``worker_seeds``.  ``done_event`` (optional, a multiprocessing Event)
    stops the workers when set.  ``doze_time`` is how often a waiting side re-checks that
    its peer is alive (nothing polls on the hot path: waits sleep on futexes).

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
      unfinished work re-issued; after ``max_respawns`` deaths of one worker without a
      result in between, :class:`~unienv_mp.WorkerDiedError` is raised.  ``False``: raise
      it at the first death.

    The work function must be picklable under the spawn and forkserver start methods.
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
    ):
        # First, so that close() (also run at garbage collection) works on a half-built one.
        self._pool = _Pool()
        self.closed = True
        if not callable(target_fn):
            raise TypeError(f"target_fn must be callable, got {type(target_fn).__name__}")
        n_workers = _check_int(n_workers, "n_workers")
        _check_seconds(doze_time, "doze_time", allow_none=False)
        max_respawns = _check_int(max_respawns, "max_respawns", 0)
        if worker_seeds is not None:
            worker_seeds = list(worker_seeds)
            if len(worker_seeds) != n_workers:
                raise ValueError(f"worker_seeds must have n_workers={n_workers} entries, "
                                 f"got {len(worker_seeds)}")
        if ctx is None:
            ctx = mp.get_context()
        elif isinstance(ctx, str):
            ctx = mp.get_context(ctx)
        if not hasattr(ctx, "Process"):
            raise TypeError(f"ctx must be a multiprocessing context, got {ctx!r}")
        self.target_fn = target_fn
        self.doze_time = doze_time
        self.done_event = done_event
        self.in_order = bool(in_order)
        self.copy = bool(copy)
        self.timeout = _check_seconds(timeout, "timeout")
        self.respawn = bool(respawn)
        self.max_respawns = max_respawns
        if spin is None:
            spin = _DEFAULT_SPIN if len(os.sched_getaffinity(0)) > n_workers else 0.0
        if isinstance(spin, bool) or not isinstance(spin, (int, float)) or not 0 <= spin < 1:
            raise ValueError(f"spin must be a number of seconds in [0, 1), got {spin!r}")
        self.spin = float(spin)
        self.max_leases = 2 * n_workers + 8 if max_leases is None else _check_int(
            max_leases, "max_leases", 0)
        self._ctx = ctx
        self._daemon = daemon
        self._init_fn = worker_init_fn
        self._seeds = worker_seeds
        self._seed_rng = np.random.default_rng(
            None if worker_seeds is None else [int(s) for s in worker_seeds])
        self._next_ticket = 0
        self._rr = 0
        self._tasks = {}                         # ticket -> _Task (not yet delivered)
        self._order = collections.deque()        # tickets of add_work, for fetch()
        self._released = collections.deque()     # lease tokens given back by the GC
        self._leases = 0
        self._work_cache = {}
        self._owner_pid = os.getpid()
        self._pool.done_event = done_event
        self._pool.doorbell_seg = Segment.create(64, "doorbell")
        self._doorbell = Event(self._pool.doorbell_seg, 0, True)
        self._finalizer = _mputil.Finalize(self, self._pool.close, exitpriority=100)
        self.closed = False
        try:
            for i in range(n_workers):
                w = _Worker(i)
                self._pool.workers.append(w)
                self._start(w, None if worker_seeds is None else worker_seeds[i])
        except BaseException:
            self.close()
            raise

    # -- properties -----------------------------------------------------------------------

    @property
    def n_workers(self):
        """Number of worker processes."""
        return len(self._pool.workers)

    @property
    def workers(self):
        """The worker ``Process`` objects (replacements included, after a respawn)."""
        return [w.proc for w in self._pool.workers]

    @property
    def remaining_work(self):
        """Work added with :meth:`add_work` and not fetched yet."""
        return len(self._order)

    # -- workers --------------------------------------------------------------------------

    def _start(self, w, seed):
        """Start a (new) process for worker ``w`` with fresh rings."""
        w.incarnation += 1
        w.check = _LivenessCheck(self._pool, w)
        task_entry = 16 + TASK_INLINE
        result_entry = 16 + RESULT_INLINE
        t_bytes = RingBuffer.footprint(TASK_CAPACITY, task_entry)
        # The parent keeps at most TASK_CAPACITY tasks in flight per worker (see
        # _make_room), so a worker never waits to publish a result.
        r_cap = TASK_CAPACITY + 2
        r_bytes = RingBuffer.footprint(r_cap, result_entry)
        t_off, r_off = P.RINGS_AT, P.RINGS_AT + t_bytes
        seg = Segment.create(r_off + r_bytes, f"worker{w.index}")
        tasks = results = None
        try:
            with memoryview(seg) as mv:
                P.HEADER.pack_into(mv, 0, P.MAGIC, P.VERSION, t_off, TASK_CAPACITY,
                                   task_entry, r_off, r_cap, result_entry)
            tasks = RingBuffer._create_in(seg, t_off, TASK_CAPACITY, task_entry,
                                          self.doze_time, self.spin)
            results = RingBuffer._create_in(seg, r_off, r_cap, result_entry, self.doze_time,
                                            self.spin)
            options = {"poll_interval": self.doze_time, "done_event": self.done_event,
                       # PR_SET_PDEATHSIG fires when the *thread* that started the worker
                       # ends: only worth it from the main thread (a watchdog covers the rest)
                       "pdeathsig": threading.current_thread() is threading.main_thread(),
                       "spin": self.spin}
            proc = self._ctx.Process(
                target=worker_main,
                args=(w.index, self.target_fn, seg, self._pool.doorbell_seg, os.getpid(),
                      self._init_fn, seed, options),
                daemon=self._daemon, name=f"unienv_mp-worker-{w.index}")
            try:
                proc.start()
                _open_pidfd(proc)
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                _stop_started(proc)
                raise TypeError(
                    f"cannot start workers with the {self._ctx.get_start_method()!r} start "
                    f"method: the work function (and everything it refers to, e.g. the "
                    f"wrapped sampler) must be picklable, but pickling failed with "
                    f"{type(e).__name__}: {e}") from e
            except BaseException:
                _stop_started(proc)   # e.g. Ctrl-C after the fork: leave no orphan
                raise
        except BaseException:
            # (a worker started despite all is told to stop by its rings, then unmapped)
            for ring in (tasks, results):
                if ring is not None:
                    ring.shutdown()
            seg.close()
            raise
        w.seg, w.tasks, w.results, w.proc, w.pid = seg, tasks, results, proc, proc.pid
        w.unaccepted = []
        w.slot_maps = {}
        w.free_slots = collections.deque()
        w.next_slot = 0

    def _bury(self, w):
        """``w``'s process died: keep what it published, release it, and queue its
        unfinished work for the next process (see _restart).  Raises WorkerDiedError if
        the worker must not (respawn=False) or should not (it keeps dying) be replaced."""
        proc = w.proc
        code = _exitcode(proc)
        if code is None and proc is not None:
            # Its pidfd may tell before the exit status reaches us (forkserver sends it)
            try:
                proc.join(1.0)
            except (ValueError, AssertionError, OSError):
                pass
            code = _exitcode(proc)
        pid = w.pid
        if w.results is not None:
            try:
                self._unstash(w)
                while True:
                    self._take(w, w.results.pop_tagged(False))
            except (_queue.Empty, RingClosed, _WorkerDied):
                pass
        how = (f"was killed by signal {-code}" if code is not None and code < 0
               else f"exited with code {code}" if code is not None
               else "ended (its exit status was collected elsewhere)")
        w.failed_starts += 1
        if not self.respawn:
            raise WorkerDiedError(f"worker {w.index} (pid {pid}) {how}; respawn=False",
                                  worker=w.index, exitcode=code)
        if w.failed_starts > self.max_respawns:
            raise WorkerDiedError(
                f"worker {w.index} {how}; it died {w.failed_starts} times in a row without "
                f"producing a result ({self.max_respawns} replacements), giving up",
                worker=w.index, exitcode=code)
        # First the bookkeeping, with no Python-level call in between (this module is
        # compiled, so a Ctrl-C cannot land half-way): the worker has no process, its
        # unfinished work waits for the next one.  Then release the old process and memory.
        unfinished = []
        for t in w.inflight:
            task = self._tasks.get(t)
            if task is None:
                continue
            if task.cancelled:
                self._forget(task)
            else:
                task.slot = None
                unfinished.append(task)
        w.inflight.clear()
        w.reissue[0:0] = unfinished    # before anything queued for it meanwhile
        w.unaccepted = []
        w.proc = w.pid = None
        old = _Worker(w.index)
        old.tasks, old.results, old.seg = w.tasks, w.results, w.seg
        w.tasks = w.results = w.seg = None
        w.slot_maps = {}
        try:
            for ring in (old.tasks, old.results):
                if ring is not None:
                    ring.shutdown()   # should the process not be dead after all: it stops
            _stop_processes([proc] if proc is not None else [], 1.0)
        finally:
            _close_worker_memory(old)

    def _restart(self, w):
        """Start a process for ``w`` if it has none, and hand it the work queued in
        ``w.reissue``, in order.  Survives the new process dying too (up to the limit)."""
        while True:
            try:
                if w.tasks is None:
                    seed = (None if self._seeds is None
                            else int(self._seed_rng.integers(2 ** 31)))
                    self._start(w, seed)
                while w.reissue:
                    self._make_room(w)
                    self._push_task(w.reissue[0], w)
                    w.reissue.pop(0)
                return
            except _WorkerDied:
                self._bury(w)

    # -- submitting -----------------------------------------------------------------------

    def _ensure_open(self):
        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")
        if _this_pid != self._owner_pid:
            raise RuntimeError(
                f"this {type(self).__name__} belongs to process {self._owner_pid} and cannot "
                f"be used in process {os.getpid()} (a forked child): its workers answer "
                f"only their parent")

    def submit(self, work_info, worker: Optional[int] = None) -> int:
        """Queue ``work_info`` and return its ticket (see :meth:`result`).  ``worker``
        picks the worker; by default the next one round-robin (``in_order``) or the least
        busy one."""
        if self.closed or _this_pid != self._owner_pid:
            self._ensure_open()   # raises
        if self._released:
            self._reclaim()
        workers = self._pool.workers
        if worker is not None:
            if isinstance(worker, bool) or not isinstance(worker, numbers.Integral) \
                    or not 0 <= worker < len(workers):
                raise ValueError(f"worker must be an index below {len(workers)}, got {worker!r}")
            w = workers[int(worker)]
        elif self.in_order:
            rr = self._rr
            w = workers[rr]
            self._rr = (rr + 1) % len(workers)
        else:
            w = min(workers, key=lambda x: len(x.inflight) + len(x.reissue))
        ticket = self._next_ticket
        task = _Task()
        task.ticket = ticket
        task.work = work_info
        self._next_ticket = ticket + 1
        tasks: dict = self._tasks
        tasks[ticket] = task
        try:
            # Give the task to w, replacing w's process first if it died.
            if w.tasks is None or w.reissue:
                w.reissue.append(task)
                self._restart(w)
            else:
                try:
                    if w.unaccepted or len(w.inflight) >= TASK_CAPACITY:
                        self._make_room(w)
                    self._push_task(task, w)
                except _WorkerDied:
                    self._bury(w)
                    w.reissue.append(task)
                    self._restart(w)
        except BaseException:
            # (if the task did reach the worker, its result is dropped as unknown)
            self._forget(task)
            if task in w.reissue:
                w.reissue.remove(task)
            raise
        return ticket

    def _encode_small(self, work):
        """Encoded work info for the small immutable items a sampler sends again and again
        (e.g. ``("sample", None)``), from a cache; None for anything else."""
        t = type(work)
        if t is tuple:
            plain = True
            for x in work:
                xt = type(x)
                if xt is not str and x is not None:
                    if xt not in _SIMPLE:
                        return None
                    plain = False
            # Equal tuples of only str and None are made of the same types: such a tuple
            # is its own key (it cannot equal one of the 2-tuples of types below).
            key = work if plain else (tuple(map(type, work)), work)
        elif t in _SIMPLE:
            key = (t, work)   # so that 1, True and 1.0 are not mistaken for one another
        else:
            return None
        cache: dict = self._work_cache
        payload = cache.get(key)
        if payload is None:
            payload = bytes(_codec.encode(work))
            if len(payload) > TASK_INLINE:
                return None   # e.g. a long string: it travels in a segment, uncached
            if len(cache) > 1024:
                cache.clear()
            cache[key] = payload
        return payload

    def _make_room(self, w):
        """Keep at most TASK_CAPACITY tasks in flight on ``w``: collect (not hand out)
        results until there is room.  A worker whose rings were both full would wait for
        the parent while the parent waits for it."""
        self._unstash(w)
        while len(w.inflight) >= TASK_CAPACITY:
            try:
                self._take(w, w.results.pop_tagged(True, self.timeout, check=w.check))
            except _queue.Empty:
                raise TimeoutError(f"worker {w.index} produced no result within "
                                   f"{self.timeout} s") from None

    def _push_task(self, task, w):
        """Push ``task`` onto ``w``'s task ring.  Raises _WorkerDied (with nothing changed)
        if the worker is gone."""
        seg = task.spill
        if seg is None:
            payload = self._encode_small(task.work)
            if payload is None:
                p = _codec.prepare(task.work)
                if p.nbytes <= TASK_INLINE:
                    payload = _codec.encode_prepared(p)
                else:
                    seg = Segment.create(p.nbytes, "task")
                    with memoryview(seg) as mv:
                        _codec.write(p, mv)
                    task.spill = seg
                    self._pool.spills.append(seg)
        if seg is None:
            tag = _RUN_INLINE
        else:
            tag = _RUN_SPILL
            payload = P.SPILL_DESC.pack(os.getpid(), seg.fd, seg.ino, seg.size, seg.size)
        slot = task.slot
        if slot is None:
            free = w.free_slots
            slot = free.pop() if free else w.take_slot()
        ticket = task.ticket
        inflight = w.inflight
        inflight.append(ticket)
        try:
            # The ring has room (see _make_room): this does not wait, and then needs no check
            try:
                w.tasks.push_tagged(tag, slot, ticket, payload, False)
            except _queue.Full:
                w.tasks.push_tagged(tag, slot, ticket, payload, check=w.check)
        except BaseException:
            inflight.pop()
            if task.slot is None:
                w.free_slots.append(slot)
            raise
        task.slot = slot
        task.worker = w.index
        task.incarnation = w.incarnation

    def add_work(self, work_info: TaskInfoT) -> None:
        """Queue ``work_info``; its result is returned by a later :meth:`fetch`."""
        self._order.append(self.submit(work_info))

    # -- collecting -----------------------------------------------------------------------

    def _accept(self, w, entry):
        """Record a result entry that ``w`` published (hand nothing out yet)."""
        t, slot, ticket, payload = entry
        status, where = t & 0xFF, t >> 8
        if status == _ST_FATAL:
            info = _codec.decode(payload, copy=True)
            raise self._worker_error(info, w.index, "could not start: ")
        tasks: dict = self._tasks
        task = tasks.get(ticket)
        if task is None or task.worker != w.index or task.result is not None:
            return  # stale (e.g. re-issued work that the dead incarnation also finished)
        seg = None
        if where == _AT_SLOT:
            gen, fd, ino, size, nbytes = _unpack_slot(payload)
            slot_maps: dict = w.slot_maps
            mapped = slot_maps.get(slot)
            if mapped is None or mapped[0] != gen:
                try:
                    seg = _segment_from_peer(w.pid, fd, ino, size, f"slot{w.index}")
                except PeerGoneError:
                    # The worker died before we could map its slot: the task stays in
                    # flight on it and is redone by its replacement.
                    raise _WorkerDied(w)
                except OSError as e:
                    # e.g. out of descriptors: this result is lost; its caller hears why
                    w.inflight.remove(ticket)
                    task.result = (_LOCAL_ERROR, e)
                    if task.cancelled:
                        self._forget(task)
                    return
                seg.unlink()  # no descriptor needed: the mapping is what we use
                slot_maps[slot] = (gen, seg)
            else:
                seg = mapped[1]
            payload = nbytes
        w.inflight.remove(ticket)
        if w.failed_starts:
            w.failed_starts = 0
        if task.spill is not None:
            self._close_spill(task)
        task.result = (status, where, slot, payload, seg)
        if task.cancelled:
            self._discard(task)

    def _take(self, w, entry):
        """_accept ``entry``; if a Ctrl-C interrupts that, keep the entry on ``w`` to be
        accepted first next time (it was popped: nothing else would deliver it)."""
        try:
            self._accept(w, entry)
        except KeyboardInterrupt:
            w.unaccepted.append(entry)
            raise

    def _unstash(self, w):
        while w.unaccepted:
            self._accept(w, w.unaccepted[0])
            w.unaccepted.pop(0)

    def _close_spill(self, task):
        if task.spill is not None:
            try:
                self._pool.spills.remove(task.spill)
            except ValueError:
                pass
            task.spill.close()
            task.spill = None

    def _forget(self, task):
        """Drop ``task`` (cancelled, or failed to submit) and what it holds."""
        self._tasks.pop(task.ticket, None)
        self._close_spill(task)

    def _discard(self, task):
        self._forget(task)
        if task.result is not None and task.result[0] != _LOCAL_ERROR:
            self._free_slot(task)

    def _free_slot(self, task):
        """The slot of ``task`` can take new work, unless its worker process was replaced
        since (slot numbers belong to one worker process)."""
        w = self._pool.workers[task.worker]
        if w.incarnation == task.incarnation:
            w.free_slots.append(task.slot)

    def _reclaim(self):
        """Slots whose last view was garbage collected go back to their worker."""
        released = self._released
        workers = self._pool.workers
        while released:
            index, incarnation, slot = released.popleft()
            self._leases -= 1
            w = workers[index]
            if w.incarnation == incarnation:
                w.free_slots.append(slot)

    def _wait(self, task, timeout):
        """Block until ``task`` has a result (or raise)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        workers = self._pool.workers
        while task.result is None:
            w = workers[task.worker]
            if w.tasks is None or w.reissue:
                self._restart(w)   # a replacement that could not be finished earlier
                continue
            try:
                if w.unaccepted:
                    self._unstash(w)
                    continue
                results = w.results
                try:
                    entry = results.pop_tagged(False)   # a result already there
                except _queue.Empty:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    entry = results.pop_tagged(True, left, check=w.check)
                try:   # (_take, inlined: this runs once per batch)
                    self._accept(w, entry)
                except KeyboardInterrupt:
                    w.unaccepted.append(entry)
                    raise
            except _queue.Empty:
                raise TimeoutError(
                    f"no result from worker {w.index} within {timeout} s") from None
            except _WorkerDied:
                self._bury(w)
                self._restart(w)

    def _deliver(self, task):
        """Turn an arrived result into the value returned to the caller."""
        tasks: dict = self._tasks
        tasks.pop(task.ticket, None)
        result = task.result
        if result[0] == _LOCAL_ERROR:
            raise result[1]
        status, where, slot, payload, seg = result
        if where == _AT_INLINE:
            # (_free_slot, inlined: this runs once per batch)
            w = self._pool.workers[task.worker]
            if w.incarnation == task.incarnation:
                w.free_slots.append(task.slot)
            value = _decode(payload, True)   # (copy)
        elif self.copy or self._leases >= self.max_leases or status != _ST_OK:
            try:
                with memoryview(seg) as mv:
                    value = _decode(mv[:payload], True)   # (copy)
            finally:
                self._free_slot(task)
        else:
            self._leases += 1
            lease = _SlotLease(seg, 0, payload, self._released.append,
                               (task.worker, task.incarnation, slot))
            value = _decode(lease)
            del lease
        if status == _ST_ERROR:
            raise self._worker_error(value, task.worker)
        return value

    @staticmethod
    def _worker_error(info, index, prefix=""):
        return WorkerError(info["type"], prefix + info["message"], info["traceback"],
                           _loads_or_none(info["exception"]), index)

    def result(self, ticket: int, timeout: Optional[float] = None):
        """The result of a :meth:`submit` ticket, waiting for it if needed.  Raises
        :class:`~unienv_mp.WorkerError` if the work raised, ``TimeoutError`` after
        ``timeout`` (default: the manager's ``timeout``) seconds."""
        if self.closed or _this_pid != self._owner_pid:
            self._ensure_open()   # raises
        tasks: dict = self._tasks
        task = tasks.get(ticket)
        if task is None:
            raise KeyError(f"unknown or already collected ticket {ticket}")
        if task.result is None:
            self._wait(task, self.timeout if timeout is None else timeout)
        return self._deliver(task)

    def ready(self, ticket: int) -> bool:
        """True if the result of ``ticket`` has arrived (collects what has arrived)."""
        self._ensure_open()
        task = self._tasks.get(ticket)
        if task is None:
            raise KeyError(f"unknown or already collected ticket {ticket}")
        if task.result is None:
            self._poll_all(check_alive=True)
        return task.result is not None

    def cancel(self, ticket: int) -> None:
        """Forget a ticket: its result is dropped when it arrives."""
        task = self._tasks.get(ticket)
        if task is None:
            return
        task.cancelled = True
        if task.result is not None:
            self._discard(task)

    def _poll_all(self, check_alive=False):
        """Accept every result already published by any worker (never blocks, except to
        replace a worker found dead).  ``check_alive``: also look for dead workers (a
        caller that does not block never reaches the liveness checks of the waits)."""
        for w in self._pool.workers:
            if w.tasks is None or w.reissue:
                self._restart(w)
            try:
                self._unstash(w)
                while True:
                    self._take(w, w.results.pop_tagged(False))
            except _queue.Empty:
                if check_alive and w.proc is not None and _exited(w.proc):
                    self._bury(w)
                    self._restart(w)
            except _WorkerDied:
                self._bury(w)
                self._restart(w)

    def fetch(self, block: bool = True, timeout: Optional[float] = None) -> Optional[ResultT]:
        """Return the result of work added with :meth:`add_work`: the oldest one
        (``in_order``) or the first to finish.  Returns ``None`` if ``block`` is false or
        ``timeout`` expires before it arrives, as UniEnv's manager does."""
        self._ensure_open()
        while self._order and self._order[0] not in self._tasks:
            self._order.popleft()   # collected with result() meanwhile
        if not self._order:
            raise RuntimeError("no work to fetch: add_work() first")
        self._reclaim()
        if self.in_order:
            task = self._tasks[self._order[0]]
            if task.result is None:
                if not block:
                    self._poll_all(check_alive=True)
                    if task.result is None:
                        return None
                else:
                    try:
                        self._wait(task, timeout if timeout is not None else self.timeout)
                    except TimeoutError:
                        if timeout is not None:
                            return None
                        raise
            self._order.popleft()
            return self._deliver(task)
        ticket = self._first_ready(block, timeout)
        if ticket is None:
            return None
        self._order.remove(ticket)
        return self._deliver(self._tasks[ticket])

    def _first_ready(self, block, timeout, tickets=None):
        """A ticket among ``tickets`` (default: all added work) whose result has arrived,
        waiting on the doorbell that every worker rings after publishing."""
        tickets = self._order if tickets is None else tickets

        def find():
            self._poll_all()
            for t in tickets:
                task = self._tasks.get(t)
                if task is not None and task.result is not None:
                    return (t,)
            return None

        found = find()
        if found is None and not block:
            self._check_all_alive()
            found = find()
        if found is None and block:
            limit = timeout if timeout is not None else self.timeout
            found = self._doorbell.wait_until(find, limit, self.doze_time,
                                              check=self._check_all_alive)
            if found is None and timeout is None and limit is not None:
                raise TimeoutError(f"no result within {limit} s")
        return None if found is None else found[0]

    def _check_all_alive(self):
        for w in self._pool.workers:
            if w.proc is None:          # replaced, but its replacement could not start yet
                self._restart(w)
            elif _exited(w.proc):
                self._bury(w)
                self._restart(w)

    # -- lifecycle ------------------------------------------------------------------------

    def close(self):
        """Stop the workers (asking first, then terminating any still running after ~2 s)
        and release the shared memory.  Results already handed out stay valid.
        Idempotent."""
        self.closed = True
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            self._pool.close()
        self._tasks.clear()
        self._order.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"{self.n_workers} workers"
        return f"<{type(self).__name__} {state}, {len(self._order)} pending>"
