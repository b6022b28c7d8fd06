"""Waiting on several workers at once, for a MultiProcessingSampleManager.

A caller that waits for whichever of several tickets comes first (the manager's
``wait_any``, ``fetch`` without ``in_order``) collects what every worker has published
(`WorkerPool.poll_all`, which ``ready`` calls alone), and sleeps on the doorbell that
every worker rings after publishing.  `Poller`, which the manager owns, does that over the
manager's pool; it keeps the rules against a Ctrl-C at the top of
`unienv_mp._process.manager`.
"""
import time

from ..backend import none_pending

__all__ = ["Poller"]


class Poller:
    """Waits for the first of several tickets: collects from every worker of ``pool`` at
    once (`WorkerPool.poll_all`, into the ledger whose ticket table ``tasks`` this reads),
    and waits on the ``doorbell`` the workers ring, re-checking every
    ``settings.doze_time`` s (the manager's `Settings`, read at each wait) that they are
    alive; ``caller`` is the manager's record of the caller's time (see stats)."""

    def __init__(self, pool, tasks, settings, doorbell, caller):
        self.pool = pool
        self.settings = settings
        self.tasks = tasks
        self.doorbell = doorbell
        self.caller = caller

    def first_ready(self, tickets, block, limit):
        """A ticket among ``tickets`` whose result has arrived, waiting up to ``limit``
        seconds (None: no limit) if ``block``, on the doorbell that every worker rings
        after publishing; None if there is none."""
        def find():
            self.pool.poll_all()
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
