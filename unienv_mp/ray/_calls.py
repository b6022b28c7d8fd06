"""The RayManager's records: its tasks, the Ray calls that carry them, and its lanes.

A *call* is one Ray actor call carrying several tasks at once (``SamplerActor.run``):
Ray costs the caller a few hundred microseconds of CPU per call and per ``ray.get``,
whatever it carries, so small tasks travel together.  A task submitted waits in its
lane's *outbox* until the outbox holds ``group`` tasks, or until the caller asks for it
(``Lane.flush``); its answer is read from its call's, which one ``ray.get`` fetches for
all of them (``Call.answers``).

*Stand-ins.*  Ray actors start one to three seconds after they are asked for (each
imports torch), and not all at once: on 2 cores the last of 4 answered up to 0.8 s after
the first; an actor that does not fit in the cluster's CPUs does not start at all, and a
stream dealt round-robin waited for it for ever.  RaySampler promises the same batches
whichever actors make them: a chunk of a ``sample*`` stream carries its seed, a
``get*_at`` call its indices.  So once an actor is *late* (it has not started
``LATE_NS`` after another did), a task of that kind (*movable*) dealt to it that the
caller waits for is sent to an actor that has started, the one with the fewest tasks in
flight (``relayed``, ``Lane.move``): the old copy runs if its actor ever starts, and its
answer is dropped, as a cancelled task's is.  New tasks are not dealt to a late actor
(``taking``, the ``Dealer``'s ``up``).  An actor has started once it has answered
anything, or the probe (``made``) sent when it was asked for.  Before any actor is late,
tasks wait for theirs: moving them while all start together made the first thousands of
batches no sooner (the CPU goes to the actors' imports), and split the calls.

*The first wait.*  The first time the caller waits for a result that has not come, it
waits until every actor has started, or one is late (``all_up``).  A stream dealt
round-robin stops at each actor's first task until that actor has started anyway;
waiting for all of them at once moves those stops to the first batch (which the samplers
ask for alone: see `unienv_mp._sampling.ahead`), and the batches requested after it come
at the actors' pace from the start.  (Measured on 2 cores with 4 actors: one stop of 130
to 240 ms somewhere in the first 25 batches, nearly every time.)
"""
import collections
import time

import ray
from ray.exceptions import GetTimeoutError

import numpy as np

from .. import _os
from .. import stats as _stats
from .._transport import codec as _codec
from ._batch import LaneSlots, read_frame

__all__ = ["Task", "Call", "Lane", "MAX_LEASES", "LATE_NS", "taking", "relayed",
           "wait_start", "first_up", "all_up", "batches_ready"]

#: Zero-copy batches alive from one actor's slots beyond which the next are copied (its
#: slots are not given back while the caller holds them: this bounds their number).
MAX_LEASES = 64

#: How often (ns) whether an actor has started is asked of Ray, at most.
_ASK_EVERY_NS = 1_000_000
#: How long (ns) an actor may be later than the first to start before its tasks go to
#: others (see the stand-ins above).
LATE_NS = 1_000_000_000


class Task:
    """One task: its ticket, work and lane, and once sent, ``sent``: ``(call, index in
    the call, slot)`` (the slot of the actor it writes into, None for the object store),
    set in one step."""
    __slots__ = ("ticket", "work", "lane", "sent", "cancelled", "movable")

    def __init__(self, work, lane, movable=False):
        self.ticket = None
        self.work = work
        self.lane = lane
        self.sent = None
        self.cancelled = False
        self.movable = movable   # (any actor may run it: see the stand-ins above)


class Call:
    """One Ray call: its object reference, and its answer once fetched (see
    ``SamplerActor.run``)."""
    __slots__ = ("ref", "answer")

    def __init__(self, ref):
        self.ref = ref
        self.answer = None

    def answers(self, timeout):
        """``(results, pid, cpu)`` of the call, fetched once (``ray.get``'s errors and
        ``GetTimeoutError`` pass through)."""
        answer = self.answer
        if answer is None:
            answer = self.answer = ray.get(self.ref, timeout=timeout)
        return answer


class Lane:
    """One worker index: its actor (replaced when it dies), the tickets submitted to it
    and not delivered yet, in order, the tasks in its outbox, and its counters (see
    `unienv_mp.stats`)."""
    __slots__ = ("index", "actor", "pid", "cpu", "inflight", "outbox", "deaths_in_a_row",
                 "counters", "record", "incarnation", "slots", "local", "cancelled",
                 "probe", "up", "ok", "up_ns", "asked_ns")

    def __init__(self, index, now_ns):
        self.index = index
        self.actor = None
        self.pid = None
        self.cpu = None   # the actor's CPU seconds at its last result
        self.inflight = collections.deque()
        self.outbox = []   # tasks submitted, not sent yet
        self.deaths_in_a_row = 0
        self.counters = None
        self.record = _stats.WorkerRecord(now_ns)
        self.incarnation = 0
        self.slots = None   # the actor's result slots (see unienv_mp.ray._batch)
        self.local = None   # whether the actor is on this node (None: not known yet)
        self.cancelled = collections.deque()   # cancelled tasks that hold a slot
        self.probe = None   # the actor's first call (see is_up)
        self.up = False    # (it has answered)
        self.ok = False    # (it has answered, not with an error: it may stand in)
        self.up_ns = 0     # (when it was first seen up)
        self.asked_ns = 0

    def started(self, actor, local):
        """``actor`` is this lane's now (``local``: whether it may be on this node, None if
        that is not known): nothing it has been sent is its."""
        self.actor = actor
        if self.slots is not None:
            self.slots.close()   # (each is unmapped once no batch read from it is left)
        self.slots = LaneSlots()
        self.local = local
        self.cancelled.clear()
        self.pid = self.cpu = None
        self.incarnation += 1
        self.up = self.ok = False
        self.probe = actor.made.remote()

    def mark_up(self, ok=True):
        """The actor has answered: it has started (``ok``: it may stand in for a late one:
        it lives and made its sampler).  (In this order, a Ctrl-C between two steps
        never leaves ``ok`` set with the ``up_ns`` of an earlier actor of the lane.)"""
        if not self.up:
            self.up_ns = time.monotonic_ns()
        self.ok = self.ok or ok
        self.up = True

    def probed(self):
        """The probe has come back: mark the actor up, ok if it made its sampler (a dead
        actor's probe answers with an error)."""
        try:
            made = ray.get(self.probe, timeout=0)
        except Exception:
            made = False
        self.mark_up(made is True)

    def is_up(self):
        """Whether the actor has started: it has answered its probe or a call (an actor
        that died answers with its error, and counts: the call that waits finds it)."""
        if not self.up:
            now = time.monotonic_ns()
            if now - self.asked_ns >= _ASK_EVERY_NS:   # (a ray.wait costs ~50 us)
                self.asked_ns = now
                ready, _ = ray.wait([self.probe], timeout=0)
                if ready:
                    self.probed()
        return self.up

    def withdraw(self, task):
        """Take ``task`` out of this lane: out of flight, and out of the outbox if it was
        not sent; if it was, it runs, and its slot goes back once its call is answered
        (see ``reclaim``)."""
        try:
            self.inflight.remove(task.ticket)
        except ValueError:
            pass
        if task.sent is None:
            try:
                self.outbox.remove(task)
            except ValueError:
                pass
        elif task.sent[2] is not None:
            self.cancelled.append(task)

    def move(self, task, tasks):
        """``task`` (of another lane, whose actor has not started) again, as a task of this
        lane under the same ticket in ``tasks`` (the ticket table), sent now with this
        lane's outbox; the old one is cancelled.  One step that a Ctrl-C does not cut."""
        with _os.interrupts_deferred():
            new = Task(task.work, self, movable=True)
            new.ticket = task.ticket
            task.cancelled = True
            task.lane.withdraw(task)
            tasks[new.ticket] = new
            self.inflight.append(new.ticket)
            self.outbox.append(new)
            self.flush()
        return new

    def flush(self, tasks=None):
        """Send ``tasks`` (default: the outbox) to the actor in one call, each with a
        slot of the actor if it may be on this node.  One step that a Ctrl-C does not
        cut: every task it sends knows its call."""
        with _os.interrupts_deferred():
            if tasks is None:
                tasks, self.outbox = self.outbox, []
            if not tasks:
                return
            slots = [None if self.local is False else self.slots.take() for _ in tasks]
            call = Call(self.actor.run.remote([(t.work, s) for t, s in zip(tasks, slots)]))
            for i, (task, slot) in enumerate(zip(tasks, slots)):
                task.sent = (call, i, slot)

    def read(self, slot, value, copy):
        """The batch of an answer: from an object-store frame (a numpy buffer), or from
        ``slot``'s segment (``value`` is ``(segment, nbytes)``), where it is read
        zero-copy unless ``copy`` or the caller holds ``MAX_LEASES`` batches of this
        actor."""
        slots = self.slots
        if type(value) is np.ndarray:
            if slot is not None:   # (the actor is on another node)
                self.local = False
                slots.give_back(slot)
            return read_frame(value, copy)
        if self.local is None:
            self.local = True
        seg, nbytes = value
        if copy or slots.leases >= MAX_LEASES:
            try:
                with memoryview(seg) as mv:
                    return _codec.decode(mv[:nbytes], True)
            finally:
                slots.give_back(slot)
        return _codec.decode(slots.lease(slot, seg, nbytes))

    def reclaim(self):
        """Give back the slots of cancelled tasks whose call the actor has answered (it no
        longer writes there)."""
        cancelled = self.cancelled
        refs = list({task.sent[0].ref for task in cancelled})
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = set(done)
        for task in list(cancelled):
            if task.sent[0].ref in done:
                cancelled.remove(task)
                self.slots.give_back(task.sent[2])


def _late(lane, lanes, now):
    """Whether ``lane``'s actor has not started while another of ``lanes`` has, for
    ``LATE_NS`` or more."""
    return not lane.is_up() and any(
        other.ok and now - other.up_ns >= LATE_NS for other in lanes)


def taking(lanes, lane):
    """Whether new tasks may be dealt to ``lane`` (of ``lanes``): unless it is late."""
    return lane.up or not _late(lane, lanes, time.monotonic_ns())


def relayed(task, lanes, table):
    """``task``; or, if it is movable and its actor is late, a copy of it sent under its
    ticket (in ``table``) to the actor among ``lanes`` that has started (and answered
    without error) with the fewest tasks in flight."""
    if not task.movable or task.lane.up or not _late(task.lane, lanes, time.monotonic_ns()):
        return task
    up = [lane for lane in lanes if lane is not task.lane and lane.is_up() and lane.ok]
    if not up:
        return task
    return min(up, key=lambda lane: len(lane.inflight)).move(task, table)


def wait_start(refs, lanes, waiting, timeout):
    """Wait until one of the calls ``refs`` is answered, and return it.  With ``waiting``
    (movable tasks whose actors have not started), also come back with None when another
    actor of ``lanes`` starts, or when one that has becomes ``LATE_NS`` older than theirs
    (their tasks may move now).  Raises ``GetTimeoutError`` after ``timeout`` seconds."""
    mine = {task.lane for task in waiting}
    others = {} if not waiting else {
        lane.probe: lane for lane in lanes
        if lane not in mine and not lane.up and lane.probe is not None}
    since = [lane.up_ns for lane in lanes if lane.ok] if waiting else []
    limit, wake = timeout, False
    if since:
        # (+1 ms: ray.wait rounds its timeout down to whole milliseconds)
        late_in = max(0.0, (min(since) + LATE_NS - time.monotonic_ns()) / 1e9) + 0.001
        if timeout is None or late_in < timeout:
            limit, wake = late_in, True
    ready, _ = ray.wait([*refs, *others], num_returns=1, timeout=limit)
    if not ready:
        if wake:
            return None
        raise GetTimeoutError(f"no answer within {timeout} s")
    lane = others.get(ready[0])
    if lane is not None:
        lane.probed()
        return None
    return ready[0]


def first_up(lanes, timeout=None):
    """The lane of the first actor to answer its probe, waiting for one (a lane whose
    actor has answered without error, if there is one).  Raises ``GetTimeoutError``
    after ``timeout`` seconds (None: no limit)."""
    for lane in lanes:
        if lane.ok:
            return lane
    by_probe = {lane.probe: lane for lane in lanes}
    ready, _ = ray.wait(list(by_probe), num_returns=1, timeout=timeout)
    if not ready:
        raise GetTimeoutError(f"no actor started within {timeout} s")
    lane = by_probe[ready[0]]
    lane.probed()
    return lane


def all_up(lanes, refs, timeout, caller):
    """The first wait: until every actor of ``lanes`` has started, or one of them is late
    (see ``LATE_NS``), or one has answered with an error (it died, or could not make its
    sampler), or ``timeout`` seconds (None: no limit) have passed; at once if one of the
    calls ``refs`` (those waited for) is answered already.  Whether the wait is over
    (False: it ended for time, or for an answer already in: the next wait tries again).
    The time waited counts in ``caller``'s (a `CallerRecord`).  Nothing is raised: the
    wait for a result that follows finds what went wrong."""
    start = time.monotonic_ns()
    try:
        return _all_up(lanes, refs, None if timeout is None else start + int(timeout * 1e9))
    finally:
        caller.wait_ns += time.monotonic_ns() - start


def _all_up(lanes, refs, deadline):
    # (the checks that need no Ray call come first: once every actor has answered, the
    # wait is over without one)
    while True:
        by_probe = {lane.probe: lane for lane in lanes
                    if not lane.up and lane.probe is not None}
        if not by_probe or any(lane.up and not lane.ok for lane in lanes):
            return True
        now = time.monotonic_ns()
        ends = [lane.up_ns + LATE_NS for lane in lanes if lane.ok]
        if ends and min(ends) <= now:
            return True   # (one is late)
        if deadline is not None and now >= deadline:
            return False
        if refs is not None:
            if ray.wait(refs, num_returns=1, timeout=0)[0]:
                return False
            refs = None   # (asked once: from here on, the wait is for the actors)
        if deadline is not None:
            ends.append(deadline)
        limit = None if not ends else (min(ends) - now) / 1e9
        # (+1 ms: ray.wait rounds its timeout down to whole milliseconds)
        ready, _ = ray.wait(list(by_probe), num_returns=1,
                            timeout=None if limit is None else limit + 0.001)
        for ref in ready:
            by_probe[ref].probed()


def batches_ready(tasks, batches_in):
    """How many batches ``tasks`` hold whose calls have been answered (``batches_in``
    counts a task's work's)."""
    calls = {}
    for task in tasks:
        if task.sent is not None:
            calls.setdefault(task.sent[0].ref, []).append(task)
    if not calls:
        return 0
    done, _ = ray.wait(list(calls), num_returns=len(calls), timeout=0)
    return sum(batches_in(t.work) for r in done for t in calls[r])
