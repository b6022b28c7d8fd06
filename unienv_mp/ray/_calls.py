"""The RayManager's records: its tasks, the Ray calls that carry them, and its lanes.

A *call* is one Ray actor call carrying several tasks at once (``SamplerActor.run``):
Ray costs the caller a few hundred microseconds of CPU per call and per ``ray.get``,
whatever it carries, so small tasks travel together.  A task submitted waits in its
lane's *outbox* until the outbox holds ``group`` tasks, or until the caller asks for it
(``Lane.flush``); its answer is read from its call's, which one ``ray.get`` fetches for
all of them (``Call.answers``).
"""
import collections

import ray

import numpy as np

from .. import _os
from .. import stats as _stats
from .._transport import codec as _codec
from ._batch import LaneSlots, read_frame

__all__ = ["Task", "Call", "Lane", "MAX_LEASES"]

#: Zero-copy batches alive from one actor's slots beyond which the next are copied (its
#: slots are not given back while the caller holds them: this bounds their number).
MAX_LEASES = 64


class Task:
    """One task: its ticket, work and lane, and once sent, ``sent``: ``(call, index in
    the call, slot)`` (the slot of the actor it writes into, None for the object store),
    set in one step."""
    __slots__ = ("ticket", "work", "lane", "sent", "cancelled")

    def __init__(self, work, lane):
        self.ticket = None
        self.work = work
        self.lane = lane
        self.sent = None
        self.cancelled = False


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
                 "counters", "record", "incarnation", "slots", "local", "cancelled")

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
