"""UniEnv's interface of a MultiProcessingSampleManager: :meth:`~UniEnvQueue.add_work`
queues work, :meth:`~UniEnvQueue.fetch` returns a result, on top of the manager's tickets.

:class:`UniEnvQueue` is a base class of the manager.  The package itself uses this
interface only in :mod:`unienv_mp.compat` (UniEnv's ``wrap_*`` helpers); it is kept on the
manager for code written against UniEnv's manager.
"""
from typing import Generic, Optional

from ..backend import ResultT, TaskInfoT, no_result

__all__ = ["UniEnvQueue"]


class UniEnvQueue(Generic[TaskInfoT, ResultT]):
    """The manager's ``add_work`` / ``fetch`` / ``remaining_work``: the tickets of
    :meth:`add_work` wait in ``_order`` for :meth:`fetch`."""

    @property
    def remaining_work(self):
        """Work added with :meth:`add_work` and not fetched yet."""
        tasks = self._tasks
        return sum(1 for t in self._order if t in tasks)

    def add_work(self, work_info: TaskInfoT) -> None:
        """Queue ``work_info``; its result is returned by a later :meth:`fetch`."""
        self.submit(work_info, record=self._order)

    def fetch(self, block: bool = True, timeout: Optional[float] = None) -> Optional[ResultT]:
        """Return the result of work added with :meth:`add_work`: the oldest one
        (``in_order``) or the first to finish.  Returns ``None`` if ``block`` is false or
        ``timeout`` expires before it arrives, as UniEnv's manager does."""
        with self._lock:
            self._ensure_open()
            while self._order and self._order[0] not in self._tasks:
                self._order.popleft()   # collected with result() meanwhile
            if not self._order:
                raise RuntimeError("no work to fetch: add_work() first")
            self._give_back_released_slots()
            if self.in_order:
                task = self._tasks[self._order[0]]
                if not task.arrived:
                    if not block:
                        self._poll_all(check_alive=True)
                        if not task.arrived:
                            return None
                    else:
                        try:
                            self._wait(task, timeout if timeout is not None else self.timeout)
                        except TimeoutError:
                            if timeout is not None:
                                return None
                            raise
                # The ticket leaves _order after its task leaves _tasks (cut short in between,
                # the next fetch skips it), or when the result is an exception.
                try:
                    value = self._deliver(task)
                except Exception:
                    self._order.popleft()
                    raise
                self._order.popleft()
                return value
            limit = timeout if timeout is not None else self.timeout
            ticket = self._first_ready(self._order, block, limit)
            if ticket is None:
                if block and timeout is None and limit is not None:
                    raise no_result(limit)
                return None
            try:
                value = self._deliver(self._tasks[ticket])
            except Exception:
                self._order.remove(ticket)
                raise
            self._order.remove(ticket)
            return value
