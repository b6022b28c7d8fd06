"""The slot and lease accounting of a MultiProcessingSampleManager.

A worker writes each result into a slot, a segment of its own numbered per process; a
slot number is given to one task at a time, and goes back to its worker once the task's
result was read or dropped and no zero-copy view of it (a lease) is alive.
:class:`SlotAccounting`, a base class of the manager, holds the methods that give slots
back and forget tasks; :meth:`~unienv_mp.MultiProcessingSampleManager._deliver` makes the
leases.  The rule against a Ctrl-C they keep: a slot number is given back only through
``_give_back_slot``, which clears ``task.slot`` first, so an interruption can at worst
leak a slot number (the worker makes another slot), never give one back twice (two tasks
writing into one slot).
"""
__all__ = ["SlotAccounting"]


class SlotAccounting:
    """The manager's methods that give slots back and release what a task holds."""

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

    def slot_segments(self):
        """The result slots of the workers now, as mapped here (none once closed): what a
        device feed page-locks (see :mod:`unienv_mp._device.pins`)."""
        if self.closed:
            return []
        return [seg for lane in self._lanes for seg in lane.worker.slot_segments()]
