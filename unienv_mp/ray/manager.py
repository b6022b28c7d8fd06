"""RayManager: tasks dealt to Ray actors, their results collected by ticket, and dead
actors replaced.

The ticket interface of `MultiProcessingSampleManager` (``submit``, ``result``, ``ready``,
``wait_any``, ``cancel``, ``stats``, ``close``), which `SamplerBase` runs on, with Ray
actors instead of processes and Ray calls instead of rings.  Each worker is a
`SamplerActor` that runs the tasks sent to it one after the other, several to a call (see
`unienv_mp.ray._calls`); a result is read zero-copy from the actor's result slot when the
actor is on this node, else from the object store (see `unienv_mp.ray._batch`).

Faults: an exception in the work function comes back as
`WorkerError` with the actor's traceback.  An actor found dead when a result is read
(``ray.kill``, its process killed, its node lost), or whose result was lost with its node,
is replaced by a new actor, and every task it had not delivered is sent to the replacement
(or, for a task that any actor may run, to an actor that has started: see late actors in
`unienv_mp.ray._calls`); with ``respawn=False``, or after ``max_respawns`` replacements in
a row without a result, `WorkerDiedError` is raised instead.
"""
import functools
import time
import warnings

import ray
import ray.exceptions as _rx

from .. import _os
from .. import stats as _stats
from .._sampling.target import NO_ARG, SamplerTarget
from .._validate import check_bool, check_index, check_int, check_seconds
from ..backend import Dealer, TicketTable, no_result, none_pending, respawn_refusal
from ..errors import PeerGoneError, WorkerDiedError, WorkerError
from . import _actor
from ._calls import (Lane, Task, all_up, batches_ready, first_up, relayed, taking,
                     wait_start)
from ._ship import Shipped

__all__ = ["RayManager", "check_cpus"]

#: What reading a result raises when the actor that made it, or the copy of it, is gone.
_LOST = (_rx.RayActorError, _rx.ObjectLostError, _rx.WorkerCrashedError,
         _rx.NodeDiedError)

#: Actor options the manager sets itself, and why.
_REFUSED_OPTIONS = {
    "max_restarts": "the manager replaces a dead actor itself, and sends it the tasks the "
                    "dead one had not delivered (a restart by Ray would not be seen)",
    "max_task_retries": "the manager sends a dead actor's tasks again itself",
    "max_concurrency": "an actor runs one call at a time (its sampler and result slots "
                       "are not shared between threads)",
    "concurrency_groups": "an actor runs one call at a time",
}



def check_cpus(value, what="num_cpus_per_worker"):
    """``value`` as a number of CPUs >= 0 (Ray takes fractions)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    if value < 0 or value == float("inf"):
        raise ValueError(f"{what} must be >= 0 and finite, got {value}")
    return value


def _sent(task):
    """``(call, index, slot)`` of ``task`` (see `unienv_mp.ray._calls.Task`), sending it
    now, with the rest of its lane's outbox, if it has not been sent."""
    if task.sent is None:
        task.lane.flush()
        if task.sent is None:   # (not in the outbox: a flush that raised took it out)
            task.lane.flush([task])
    return task.sent


def _left(deadline):
    """Seconds left until ``deadline`` (a ``time.monotonic()``; None: no limit)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _told_size(sized, work, value):
    """Tell ``sized`` (see `RayManager`) the size of an answer's ``value``; False, with a
    warning, if it raised (it sizes defaults only: they stay as they are, and the batch
    is delivered)."""
    try:
        sized(work, value.nbytes if type(value) is not tuple else value[1])
        return True
    except Exception as e:
        warnings.warn(f"unienv_mp: RaySampler could not size its defaults from the first "
                      f"batch ({type(e).__name__}: {e}); n_buffers and tasks_per_call stay "
                      f"as they were", RuntimeWarning, stacklevel=2)
        return False


def _load(lane):
    """How busy a lane is (tasks in flight), for a deal that is not in order."""
    return len(lane.inflight)


class RayManager:
    """Run ``SamplerTarget`` tasks on ``n_workers`` Ray actors.

    Args:
        n_workers: actors.
        target: a [`SamplerTarget`][unienv_mp.sampler.SamplerTarget], put into the object
            store once and read by every actor (replacements included) ...
        factory: ... or, instead, a callable each actor calls to make its own sampler.
        in_order: ``True``: tasks are dealt round-robin (results are collected by ticket
            either way).  ``False``: each task goes to the actor with the fewest tasks.
            Either way a late actor is passed over (see `unienv_mp.ray._calls`).
        copy: ``False``: results are views of an actor's result slot (on this node) or
            read-only views of the object store (from another node); ``True``: copies.
        timeout: seconds to wait for one result before ``TimeoutError`` (None: as long as
            the actors live).
        respawn: ``True``: an actor found dead (``ray.kill``-ed, its process killed, its
            node lost), or whose result was lost with its node, is replaced, and every
            task it had not delivered is sent to the replacement.  ``False``: the call
            that finds it dead raises [`WorkerDiedError`][unienv_mp.WorkerDiedError]
            (the actor is replaced all the same, for the calls after it).
        max_respawns: replacements of one actor without a result in between before its
            next death raises [`WorkerDiedError`][unienv_mp.WorkerDiedError].
        num_cpus_per_worker: the CPUs Ray reserves for each actor.
        actor_options: more options for the actors (``ActorClass.options``), e.g. a
            ``scheduling_strategy`` or ``resources`` to place them on certain nodes, or a
            ``runtime_env``.
        direct: with ``factory``, whether the actors gather batches directly where they
            can (see `unienv_mp._direct.gather`).
        local_slots: ``True``: an actor on this node writes each result into a slot of its
            own that this process maps (see `unienv_mp.ray._batch`); ``False``: every
            result travels through Ray's object store.
        group: tasks sent to an actor in one Ray call at most (see
            `unienv_mp.ray._calls`): a task submitted waits until ``group`` tasks are
            waiting for its actor, or until it is asked for (``result``, ``ready``,
            ``wait_any``).
    """

    def __init__(self, n_workers, *, target=None, factory=None, in_order=True, copy=False,
                 timeout=None, respawn=True, max_respawns=3, num_cpus_per_worker=1,
                 actor_options=None, direct=True, local_slots=True, group=1):
        self.closed = True
        self._lanes = []
        n_workers = check_int(n_workers, "n_workers")
        if (target is None) == (factory is None):
            raise ValueError("give the manager a target or a factory, not both or neither")
        num_cpus_per_worker = check_cpus(num_cpus_per_worker)
        if actor_options is not None and not isinstance(actor_options, dict):
            raise TypeError(f"actor_options must be a dict, got "
                            f"{type(actor_options).__name__}")
        for key, why in _REFUSED_OPTIONS.items():
            if key in (actor_options or {}):
                raise ValueError(f"actor_options may not set {key!r}: {why}")
        local_slots = check_bool(local_slots, "local_slots")
        self.in_order = bool(in_order)
        self.copy = bool(copy)
        self.timeout = check_seconds(timeout, "timeout")
        self.respawn = bool(respawn)
        self.max_respawns = check_int(max_respawns, "max_respawns", 0)
        self._factory = factory
        self._direct = bool(direct)
        self.group = check_int(group, "group")
        #: None, or a callable told ``(work, size in bytes)`` of each answer delivered
        self.sized = None
        if target is not None:
            try:
                self._target = ray.put(Shipped(target))
            except Exception as e:
                raise TypeError(
                    f"the sampler cannot be sent to Ray actors ({type(e).__name__}: {e}); "
                    f"pass a sampler_factory that makes it in each actor instead") from e
        else:
            self._target = None
        have = ray.cluster_resources().get("CPU", 0)
        if n_workers * num_cpus_per_worker > have:
            warnings.warn(
                f"{n_workers} actors of {num_cpus_per_worker:g} CPU each do not fit in the "
                f"Ray cluster's {have:g} CPUs: those that do not fit wait for CPUs (or nodes) "
                f"to be free, and the others make the batches meanwhile.  Ask for fewer "
                f"workers, or "
                f"fewer CPUs each (num_cpus_per_worker may be 0)", RuntimeWarning,
                stacklevel=3)
        options = {"num_cpus": num_cpus_per_worker, "max_restarts": 0,
                   "max_task_retries": 0}
        options.update(actor_options or {})
        self._actor_class = ray.remote(_actor.SamplerActor).options(**options)
        self._batches_in = SamplerTarget.batches_in
        self._tasks = TicketTable()  # ticket -> _Task, until delivered or cancelled
        self._caller = _stats.CallerRecord()   # batches handed out, time waited (stats)
        self._home = ray.get_runtime_context().get_node_id() if local_slots else None
        now = time.monotonic_ns()
        self._lanes = [Lane(i, now) for i in range(n_workers)]
        # (a late actor is passed over: see stand-ins, unienv_mp.ray._calls)
        self._dealer = Dealer(up=functools.partial(taking, self._lanes))
        self._all_up = False   # (the first wait has waited for every actor: see all_up)
        self.closed = False
        for lane in self._lanes:
            self._start(lane)

    # -- actors -------------------------------------------------------------------------

    @property
    def n_workers(self):
        """Number of actors."""
        return len(self._lanes)

    @property
    def workers(self):
        """The actor handles (replacements included, after a respawn)."""
        return [lane.actor for lane in self._lanes]

    def _start(self, lane):
        now = time.monotonic_ns()
        lane.started(self._actor_class.remote(lane.index, self._target, self._factory,
                                              self._home, self._direct),
                     None if self._home is not None else False)
        # (this process keeps the actor's counters: they move when a result is collected)
        lane.counters = _stats.WorkerCounters([0] * _stats.COUNTERS, now)

    def _replace(self, lane, error):
        """``lane``'s actor is gone (``error`` said so): start another and send it every
        task the old one had not delivered.  Raises WorkerDiedError if it must not
        (respawn=False) or should not (it keeps dying) be replaced: after the new actor
        has the tasks, with the whole budget, so that the next call goes on from there (a
        lane never keeps a dead actor)."""
        deaths = lane.deaths_in_a_row + 1
        what = f"worker {lane.index} (Ray actor, pid {lane.pid})"
        cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        verdict = respawn_refusal(self.respawn, deaths, self.max_respawns)
        # One step that a Ctrl-C must not cut in two: every task in flight goes to the
        # new actor (one left with the old one would count as a death again).
        with _os.interrupts_deferred():
            lane.deaths_in_a_row = 0 if verdict is not None else deaths
            lane.record.process_ended(lane.counters.view, time.monotonic_ns())
            lane.record.respawns += 1
            try:
                ray.kill(lane.actor, no_restart=True)
            except Exception:
                pass   # (already gone)
            self._start(lane)
            tasks = self._tasks
            lane.outbox = []
            lane.flush([tasks[t] for t in lane.inflight if t in tasks])
        if verdict is not None:
            raise WorkerDiedError(f"{what} died ({cause}); {verdict}", worker=lane.index)

    def _ask(self, method, *args):
        """Call ``method`` of the first actor to start and return what it answers (the
        ``(status, value)`` of `SamplerActor`'s methods), asking another if it is found
        dead (and replacing it).  Raises ``TimeoutError`` after the manager's timeout."""
        self._ensure_open()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            while True:
                lane = first_up(self._lanes, _left(deadline))   # (one may never start)
                try:
                    status, value = ray.get(getattr(lane.actor, method).remote(*args),
                                            timeout=_left(deadline))
                    break
                except _LOST as e:
                    self._replace(lane, e)
        except _rx.GetTimeoutError:
            raise no_result(self.timeout) from None
        if status != _actor.OK:
            prefix = "could not start: " if status == _actor.COULD_NOT_START else ""
            raise WorkerError.from_payload(value, lane.index, prefix)
        return value

    def describe(self):
        """What a worker's sampler is (see ``SamplerActor.describe``)."""
        return self._ask("describe")

    def seeded_rngs(self, seed):
        """The RNGs of a worker's sampler after its ``manual_seed(seed)``."""
        return self._ask("seeded_rngs", seed)

    # -- tickets ------------------------------------------------------------------------

    def _ensure_open(self):
        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")

    def submit(self, work, worker=None, *, record=None):
        """Send ``work`` to an actor and return its ticket (see
        [`result`][unienv_mp.ray.RayManager.result]).  ``worker`` picks the actor; by
        default the next one round-robin (``in_order``) or the one with the fewest tasks.
        ``record``: a list or deque the ticket is appended to as the last step."""
        self._ensure_open()
        if self._caller.since_ns is None:
            self._caller.begin()
        lanes = self._lanes
        if worker is not None:
            lane = lanes[check_index(worker, "worker", len(lanes))]
        else:
            lane = self._dealer.pick(lanes, self.in_order, _load)
        # (a chunk of a sample* stream, or a get*_at call, gives the same result on any
        # actor: see unienv_mp.ray._calls on stand-ins; a function's call may not)
        task = Task(work, lane, movable=worker is None and work[0] is not None
                    and work[-1] is not NO_ARG)
        # One step that a Ctrl-C does not cut: a ticket issued is recorded (else the
        # caller could not cancel it, and it would stay in flight, holding its slot).
        with _os.interrupts_deferred():
            if lane.cancelled:
                lane.reclaim()
            ticket = self._tasks.issue(task)
            lane.inflight.append(ticket)
            lane.outbox.append(task)
            try:
                if len(lane.outbox) >= self.group:
                    lane.flush()
            except BaseException:
                self.cancel(ticket)   # (Ray refused the call: no ticket to record)
                raise
            if record is not None:
                record.append(ticket)
        return ticket

    def reset_order(self):
        """Deal the next task to worker 0, and the ones after it round-robin from there."""
        self._dealer.reset()

    def result(self, ticket, timeout=None):
        """The result of ``ticket``, waiting for it if needed.  Raises
        [`WorkerError`][unienv_mp.WorkerError] if the work raised, ``TimeoutError`` after
        ``timeout`` (default: the manager's) seconds,
        [`WorkerDiedError`][unienv_mp.WorkerDiedError] if its actor died and is not
        replaced."""
        self._ensure_open()
        task = self._tasks.pending(ticket)
        limit = self.timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            task = relayed(task, self._lanes, self._tasks)   # (see unienv_mp.ray._calls)
            call, index, slot = _sent(task)
            if not self._all_up and call.answer is None:   # (the first wait: see all_up)
                self._all_up = all_up(self._lanes, [call.ref], _left(deadline), self._caller)
            left = _left(deadline)
            start = time.monotonic_ns()
            try:
                if (task.movable and not task.lane.up
                        and wait_start([call.ref], self._lanes, [task], left) is None):
                    continue   # (its actor may be late now)
                results, pid, cpu = call.answers(left)
            except _rx.GetTimeoutError:
                raise no_result(limit) from None
            except _LOST as e:
                self._replace(task.lane, e)   # (the task is sent again: wait for it)
                continue
            finally:
                self._caller.wait_ns += time.monotonic_ns() - start
            # One step that a Ctrl-C does not cut (it is raised after it): a slot number
            # is given back or held by a lease, never lost.
            with _os.interrupts_deferred():
                status, value, elapsed_ns = results[index]
                if status == _actor.OK and type(value) is tuple:
                    lane = task.lane
                    try:
                        value = lane.slots.segment(slot, pid, value[:4]), value[4]
                    except PeerGoneError as e:   # (its actor is gone)
                        self._replace(lane, e)
                        continue
                    except OSError:
                        # its segments cannot be opened from here: results come through
                        # the object store from now on (this one too: it is sent again)
                        lane.local = False
                        lane.slots.give_back(slot)   # (answered: the actor is done with it)
                        task.sent = None   # (so a flush that raises leaves it to be sent)
                        lane.flush([task])
                        continue
                return self._deliver(task, slot, status, value, elapsed_ns, pid, cpu)

    def _deliver(self, task, slot, status, value, elapsed_ns, pid, cpu):
        lane = task.lane
        try:
            lane.inflight.remove(task.ticket)
        except ValueError:
            pass
        del self._tasks[task.ticket]   # (before its slot goes back: that happens once)
        lane.pid, lane.cpu = pid, cpu
        # (an answer: the actor lives; one that could not make its sampler may not stand in)
        lane.mark_up(status != _actor.COULD_NOT_START)
        counters = lane.counters
        if status == _actor.OK:
            lane.deaths_in_a_row = 0
            if self.sized is not None and not _told_size(self.sized, task.work, value):
                self.sized = None
            batches = self._batches_in(task.work)
            counters.end(batches, False, elapsed_ns)
            self._caller.batches += batches
            return lane.read(slot, value, self.copy)
        if slot is not None:
            lane.slots.give_back(slot)
        counters.end(0, True, elapsed_ns)
        prefix = "could not start: " if status == _actor.COULD_NOT_START else ""
        raise WorkerError.from_payload(value, lane.index, prefix)

    def ready(self, ticket):
        """True if the result of ``ticket`` has arrived (a task still waiting in its
        lane's outbox is sent now)."""
        self._ensure_open()
        call = _sent(self._tasks.pending(ticket))[0]
        if call.answer is not None:
            return True
        ready, _ = ray.wait([call.ref], timeout=0)
        return bool(ready)

    def wait_any(self, tickets, timeout=None):
        """One of ``tickets`` whose result has arrived (collect it with
        [`result`][unienv_mp.ray.RayManager.result]), waiting for one if none has.  Raises
        ``TimeoutError`` after ``timeout`` (default: the manager's) seconds, ``KeyError`` if
        no ticket is pending."""
        self._ensure_open()
        limit = self.timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            by_ref, waiting = {}, []
            for t in tickets:
                task = self._tasks.get(t)
                if task is not None and not task.cancelled:
                    task = relayed(task, self._lanes, self._tasks)
                    call = _sent(task)[0]
                    if call.answer is not None:
                        return t
                    by_ref.setdefault(call.ref, t)
                    if task.movable and not task.lane.up:
                        waiting.append(task)
            if not by_ref:
                raise none_pending(tickets)
            if not self._all_up:   # (the first wait: see all_up)
                self._all_up = all_up(self._lanes, list(by_ref), _left(deadline), self._caller)
            left = _left(deadline)
            start = time.monotonic_ns()
            try:
                ref = wait_start(list(by_ref), self._lanes, waiting, left)
            except _rx.GetTimeoutError:
                raise no_result(limit) from None
            finally:
                self._caller.wait_ns += time.monotonic_ns() - start
            if ref is not None:
                return by_ref[ref]

    def cancel(self, ticket):
        """Forget a ticket.  A task not sent yet is not sent; one sent still runs, and its
        answer is dropped: Ray's own cancel of an actor task interrupts the actor's
        thread, and after a Ctrl-C in the caller it was seen to hold the actor's later
        answers up for 20 s and more."""
        with _os.interrupts_deferred():   # (one step: a slot is never lost)
            task = self._tasks.pop(ticket, None)
            if task is not None:
                task.cancelled = True
                task.lane.withdraw(task)

    # -- where the time goes --------------------------------------------------------------

    def stats(self, reset=False):
        """Where the time went since the first request (or the last ``stats(reset=True)``),
        as a [`SamplerStats`][unienv_mp.SamplerStats].  Each actor's time per task is
        measured in the actor and counted here when its result is collected; ``pid`` is the
        actor's process (None until its first result), and ``cpu_fraction`` its CPU time, as
        of its last result, over its time alive."""
        now = time.monotonic_ns()
        ready = batches_ready(self._tasks.values(), self._batches_in)
        workers = []
        for lane in self._lanes:
            counters = lane.counters.view
            workers.append(lane.record.report(lane.index, lane.pid, counters, now, lane.cpu))
            if reset:
                lane.record.reset(list(counters), now, lane.cpu)
        return self._caller.report(ready, workers, now, reset)

    # -- lifecycle ------------------------------------------------------------------------

    def close(self):
        """Kill the actors.  Results already handed out stay valid.  Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._tasks.clear()
        for lane in self._lanes:
            if lane.actor is not None:
                try:
                    ray.kill(lane.actor, no_restart=True)
                except Exception:
                    pass   # (already gone, or Ray was shut down)
                lane.actor = None
            lane.inflight.clear()
            if lane.slots is not None:
                lane.slots.close()   # (each is unmapped once no batch read from it is left)
        self._target = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"{self.n_workers} actors"
        return f"<{type(self).__name__} {state}, {len(self._tasks)} pending>"
