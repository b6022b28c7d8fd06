"""Waiting on several workers at once, for a MultiProcessingSampleManager.

A caller that waits for whichever of several tickets comes first (:meth:`~Polling.wait_any`,
``fetch`` without ``in_order``) or asks without blocking (:meth:`~Polling.ready`) collects
what every worker has published, and sleeps on the doorbell that every worker rings after
publishing.  :class:`Polling` is a base class of the manager; its methods work on the
manager's state and keep the rules against a Ctrl-C at the top of :mod:`unienv_mp._process.manager`.
"""
import queue as _queue
import time
from typing import Optional

from ..backend import CLOSED_WHILE_WAITING, no_result, none_pending
from .handle import WorkerDied
from ..errors import RingClosed

__all__ = ["Polling"]


class Polling:
    """The manager's ``ready`` and ``wait_any``, and the collecting from every worker
    behind them."""

    def ready(self, ticket: int) -> bool:
        """True if the result of ``ticket`` has arrived (collects what has arrived)."""
        with self._lock:
            self._ensure_open()
            task = self._tasks.pending(ticket)
            if not task.arrived:
                self._poll_all(check_alive=True)
            return task.arrived

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
                raise RuntimeError(CLOSED_WHILE_WAITING) from None
            except _queue.Empty:
                if check_alive and w.has_exited():
                    self._bury(lane)
                    self._restart(lane)
            except WorkerDied as e:
                self._bury(lane, e)
                self._restart(lane)

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
