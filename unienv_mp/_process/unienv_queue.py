"""UniEnv's interface of a MultiProcessingSampleManager: ``add_work`` queues work,
``fetch`` returns a result, on top of the manager's tickets.

`UniEnvQueue` is an adapter that holds a manager; the manager's ``add_work``, ``fetch`` and
``remaining_work`` hand over to the one it owns.  The package itself uses this interface
only in `unienv_mp.compat` (UniEnv's ``wrap_*`` helpers); it is kept on the manager for code
written against UniEnv's manager.
"""
import collections

from ..backend import no_result

__all__ = ["UniEnvQueue"]


class UniEnvQueue:
    """``add_work`` / ``fetch`` / ``remaining_work`` over ``manager``: the tickets of
    `add_work` wait in ``order`` for `fetch`.  It works on the manager's ticket table, slot
    ledger and poller, and delivers through it, under its lock: the manager calls it with
    the lock held."""

    def __init__(self, manager, tasks, slots, poller):
        self.manager = manager
        self.tasks = tasks
        self.slots = slots
        self.poller = poller
        self.order = collections.deque()

    @property
    def remaining_work(self):
        """Work added with `add_work` and not fetched yet."""
        tasks = self.tasks
        return sum(1 for t in self.order if t in tasks)

    def add_work(self, work_info):
        """Queue ``work_info``; its result is returned by a later `fetch`."""
        self.manager.submit(work_info, record=self.order)

    def fetch(self, block=True, timeout=None):
        """The result of work added with `add_work`: the oldest one (``in_order``) or the
        first to finish; ``None`` if ``block`` is false or ``timeout`` expires before it
        arrives, as UniEnv's manager does."""
        m = self.manager
        order = self.order
        tasks = self.tasks
        while order and order[0] not in tasks:
            order.popleft()   # collected with result() meanwhile
        if not order:
            raise RuntimeError("no work to fetch: add_work() first")
        self.slots.give_back_released()
        if m.in_order:
            task = tasks[order[0]]
            if not task.arrived:
                if not block:
                    self.poller.poll_all(check_alive=True)
                    if not task.arrived:
                        return None
                else:
                    try:
                        m._wait(task, timeout if timeout is not None else m.timeout)
                    except TimeoutError:
                        if timeout is not None:
                            return None
                        raise
            # The ticket leaves order after its task leaves tasks (cut short in between,
            # the next fetch skips it), or when the result is an exception.
            try:
                value = m._deliver(task)
            except Exception:
                order.popleft()
                raise
            order.popleft()
            return value
        limit = timeout if timeout is not None else m.timeout
        ticket = self.poller.first_ready(order, block, limit)
        if ticket is None:
            if block and timeout is None and limit is not None:
                raise no_result(limit)
            return None
        try:
            value = m._deliver(tasks[ticket])
        except Exception:
            order.remove(ticket)
            raise
        order.remove(ticket)
        return value
