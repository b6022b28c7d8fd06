"""Waiting on several workers at once, for a MultiProcessingSampleManager.

A caller that waits for whichever of several tickets comes first (the manager's
``wait_any``, ``fetch`` without ``in_order``) or asks without blocking (``ready``)
collects what every worker has published, and sleeps on the doorbell that every worker
rings after publishing.  `Poller`, which the manager owns, does that over the manager's
pool; it keeps the rules against a Ctrl-C at the top of `unienv_mp._process.manager`.
"""
import queue as _queue
import time

from ..backend import CLOSED_WHILE_WAITING, none_pending
from ..errors import RingClosed
from .handle import WorkerDied

__all__ = ["Poller"]


class Poller:
    """Collects from every worker of ``pool`` at once (`WorkLedger.take` records a result
    entry, into the ledger whose ticket table ``tasks`` this reads), and waits on the
    ``doorbell`` the workers ring, re-checking every ``settings.doze_time`` s (the
    manager's `Settings`, read at each wait) that they are alive; ``caller`` is the
    manager's record of the caller's time (see stats)."""

    def __init__(self, pool, tasks, settings, doorbell, caller):
        self.pool = pool
        self.settings = settings
        self.tasks = tasks
        self.doorbell = doorbell
        self.caller = caller

    def poll_all(self, check_alive=False):
        """Accept every result already published by any worker (never blocks, except to
        replace a worker found dead).  ``check_alive``: also look for dead workers (a
        caller that does not block never reaches the liveness checks of the waits)."""
        pool = self.pool
        waiting = pool.ledger.waiting
        take = pool.ledger.take
        for lane in pool.lanes:
            w = lane.worker
            if lane.retired:
                if waiting[w.index]:
                    pool.restart(lane)   # (its tasks go to the others)
                continue
            if waiting[w.index] or not w.has_process:
                pool.restart(lane)
            try:
                while True:
                    if take(w, 0):
                        lane.deaths_in_a_row = 0
            except RingClosed:
                raise RuntimeError(CLOSED_WHILE_WAITING) from None
            except _queue.Empty:
                if check_alive and w.has_exited():
                    pool.replace(lane)
            except WorkerDied as e:
                pool.replace(lane, e)

    def first_ready(self, tickets, block, limit):
        """A ticket among ``tickets`` whose result has arrived, waiting up to ``limit``
        seconds (None: no limit) if ``block``, on the doorbell that every worker rings
        after publishing; None if there is none."""
        def find():
            self.poll_all()
            for t in tickets:
                task = self.tasks.get(t)
                if task is not None and task.arrived:
                    return (t,)
            if not self.any_pending(tickets):   # (all cancelled meanwhile)
                raise none_pending(tickets)
            return None

        deadline = None if limit is None else time.monotonic() + limit
        pool = self.pool
        found = find()
        if found is None and not block:
            pool.check_all_alive(deadline)
            found = find()
        if found is None and block and pool.deferred and self.caller.batches:
            # (while the workers make the results)
            pool.start_deferred(quiet=True, deadline=deadline)
            found = find()
        if found is None and block:
            t0 = time.monotonic_ns()
            try:
                found = self.doorbell.wait_until(
                    find, None if deadline is None else max(0.0, deadline - time.monotonic()),
                    self.settings.doze_time, check=lambda: pool.check_all_alive(deadline))
            finally:
                self.caller.wait_ns += time.monotonic_ns() - t0
        return None if found is None else found[0]

    def any_pending(self, tickets):
        """True if one of ``tickets`` will have a result to collect (neither collected nor
        cancelled)."""
        tasks = self.tasks
        for t in tickets:
            task = tasks.get(t)
            if task is not None and not task.cancelled:
                return True
        return False
