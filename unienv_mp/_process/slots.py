"""The slot ledger a MultiProcessingSampleManager owns: which result slot each task holds,
and when a slot may take new work.

A worker writes each result into a slot, a segment of its own numbered per process; a
slot number is given to one task at a time, and goes back to its worker once the task's
result was read or dropped and no zero-copy view of it (a lease) is alive.
`SlotLedger` gives slots back and forgets tasks, and makes the leases the manager's delivery
hands out (`SlotLedger.lease`).  The rule against a Ctrl-C it keeps: a slot number is given
back only through ``give_back_slot``, which clears ``task.slot`` first, so an interruption
can at worst leak a slot number (the worker makes another slot), never give one back twice
(two tasks writing into one slot).
"""
import collections

from .._transport.codec import SlotLease

__all__ = ["SlotLedger"]


class SlotLedger:
    """The slots of one manager's tasks: ``tasks`` is its ticket table, ``lanes`` its
    pool's lanes, ``spills`` the segments that carry large work items.  ``leases`` counts
    the zero-copy results alive; ``released`` holds the tasks whose leases the garbage
    collector gave back since (see `give_back_released`)."""

    def __init__(self, tasks, lanes, spills):
        self.tasks = tasks
        self.lanes = lanes
        self.spills = spills
        self.leases = 0
        self.released = collections.deque()

    def lease(self, task, seg):
        """A zero-copy lease on ``task``'s slot segment ``seg``: the slot goes back once
        the task was delivered and the last lease on it is garbage collected."""
        task.leases += 1
        self.leases += 1
        return SlotLease(seg, 0, task.nbytes, self.released.append, task)

    def arrived(self, lane, task):
        """The result of ``task`` is recorded: it is no longer in flight.  (``arrived``
        first: a task whose ticket is still in flight meanwhile is not re-issued.)"""
        task.arrived = True
        try:
            lane.inflight.remove(task.ticket)
        except ValueError:
            pass   # (removed already, by a recording cut short)
        if task.cancelled:
            self.drop(task)

    def abandon(self, task, lane):
        """``submit`` of ``task`` raised: its caller has no ticket.  Drop the task, or, if
        it reached the worker, let it be dropped when its result arrives."""
        task.cancelled = True
        while task in lane.waiting:
            lane.waiting.remove(task)
        if task.arrived or task.ticket not in lane.inflight:
            self.drop(task)

    def release_spill(self, task):
        """Close the segment that carried ``task``'s work info, if any."""
        if task.spill is not None:
            try:
                self.spills.remove(task.spill)
            except ValueError:
                pass
            task.spill.close()
            task.spill = None

    def drop(self, task):
        """Forget ``task`` (cancelled, or abandoned by submit) and release what it holds:
        its spill, and its slot unless the worker may still write into it (pushed, and no
        result yet: then the slot goes back when the result arrives, see `abandon`)."""
        self.tasks.pop(task.ticket, None)
        self.release_spill(task)
        if task.worker is None:
            return
        inflight = self.lanes[task.worker].inflight
        if task.arrived:
            try:
                inflight.remove(task.ticket)   # (a recording cut short left it there)
            except ValueError:
                pass
        if task.slot is not None and not task.leases and (
                task.arrived or task.ticket not in inflight):
            self.give_back_slot(task)

    def give_back_slot(self, task):
        """The slot of ``task``, whose result was read or dropped, can take new work.  At
        most once: ``task.slot`` is cleared first (cut short in between, the slot number
        is lost, never given back twice)."""
        slot = task.slot
        if slot is not None:
            task.slot = None
            self.lanes[task.worker].worker.give_back_slot(slot, task.incarnation)

    def give_back_released(self):
        """The leases garbage collected since (their tasks, on ``_released``) are gone;
        a delivered task whose last lease this was gives its slot back."""
        released = self.released
        tasks = self.tasks
        while released:
            task = released.popleft()
            self.leases -= 1
            task.leases -= 1
            if not task.leases and task.ticket not in tasks:
                self.give_back_slot(task)

    def slot_segments(self):
        """The result slots of the workers now, as mapped here: what a device feed
        page-locks (see `unienv_mp._device.pins`)."""
        return [seg for lane in self.lanes for seg in lane.worker.slot_segments()]
