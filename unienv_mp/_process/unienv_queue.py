"""UniEnv's interface of a MultiProcessingSampleManager: ``add_work`` queues work,
``fetch`` returns a result, on top of the manager's tickets.

`UniEnvQueue` holds the tickets of ``add_work`` in order; the manager's ``add_work``,
``fetch`` and ``remaining_work`` use the one it owns, handing it what it needs.  The package itself uses this interface
only in `unienv_mp.compat` (UniEnv's ``wrap_*`` helpers); it is kept on the manager for code
written against UniEnv's manager.
"""
import collections

from ..backend import no_result

__all__ = ["UniEnvQueue"]


class UniEnvQueue:
    """The tickets of ``add_work``, waiting in ``order`` for `fetch`, over the manager's
    ``ledger`` (`WorkLedger`), ``pool`` (`WorkerPool`) and ``poller``.  The manager submits
    (recording into ``order``) and calls `fetch` with its lock held."""

    def __init__(self, ledger, pool, poller, in_order):
        self.ledger = ledger
        self.tasks = ledger.tasks
        self.pool = pool
        self.poller = poller
        self.in_order = in_order
        self.order = collections.deque()

    @property
    def remaining_work(self):
        """Work added with `add_work` and not fetched yet."""
        tasks = self.tasks
        return sum(1 for t in self.order if t in tasks)

    def fetch(self, block, timeout, default_timeout, wait, deliver):
        """The result of work added with ``add_work``: the oldest one (``in_order``) or the
        first to finish; ``None`` if ``block`` is false or ``timeout`` expires before it
        arrives, as UniEnv's manager does.  ``wait(task, timeout)`` waits for a task's
        result, ``deliver(task)`` hands it out (the manager's); ``default_timeout``: the
        manager's ``timeout``."""
        order = self.order
        tasks = self.tasks
        while order and order[0] not in tasks:
            order.popleft()   # collected with result() meanwhile
        if not order:
            raise RuntimeError("no work to fetch: add_work() first")
        self.ledger.give_back_released()
        if self.in_order:
            task = tasks[order[0]]
            if not task.arrived:
                if not block:
                    self.pool.poll_all(check_alive=True)
                    if not task.arrived:
                        return None
                else:
                    try:
                        wait(task, timeout if timeout is not None else default_timeout)
                    except TimeoutError:
                        if timeout is not None:
                            return None
                        raise
            # The ticket leaves order after its task leaves tasks (cut short in between,
            # the next fetch skips it), or when the result is an exception.
            try:
                value = deliver(task)
            except Exception:
                order.popleft()
                raise
            order.popleft()
            return value
        limit = timeout if timeout is not None else default_timeout
        ticket = self.poller.first_ready(order, block, limit)
        if ticket is None:
            if block and timeout is None and limit is not None:
                raise no_result(limit)
            return None
        try:
            value = deliver(tasks[ticket])
        except Exception:
            order.remove(ticket)
            raise
        order.remove(ticket)
        return value
