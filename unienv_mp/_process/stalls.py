"""Stalled workers: what the manager keeps of a worker process it kills for having been on
one task longer than ``stall_timeout``, or for having taken none of the tasks waiting for
it for that long, and what it tells the caller.

The handle finds the stall (``WorkerHandle.check_stall`` raises ``WorkerStalled``).  The
manager then makes a `Stall`, which takes the process's Python stacks, keeps it on the
worker's lane, and only then kills the process: however a Ctrl-C cuts the burial short, the
death that follows is known to be this stall.  The stalled task goes to the replacement,
with a ``RuntimeWarning`` (`Stall.warn`), or is given up, its result being `Stall.error` (a
`WorkerStalledError`).
"""
import warnings

from ..errors import WorkerStalledError

__all__ = ["Stall"]


class Stall:
    """Process ``pid`` of worker ``index`` was found on the task of ``ticket`` for
    ``seconds``, longer than ``stall_timeout`` (``ticket`` None: it took none of the tasks
    waiting for it for that long); ``stacks`` are its Python stacks, taken from it
    (``WorkerHandle.stacks``) when this is made."""
    __slots__ = ("index", "pid", "ticket", "seconds", "stall_timeout", "stacks")

    def __init__(self, handle, found, stall_timeout):
        self.index = handle.index
        self.pid = handle.pid
        self.ticket = found.ticket
        self.seconds = found.seconds
        self.stall_timeout = stall_timeout
        self.stacks = handle.stacks()

    def _message(self):
        what = ("was on one task for" if self.ticket is not None
                else "took none of the tasks waiting for it for")
        return (f"worker {self.index} (pid {self.pid}) {what} {self.seconds:.1f} s, "
                f"longer than stall_timeout={self.stall_timeout} s; it was killed and "
                f"replaced.  Its stacks:\n{self.stacks}")

    def error(self):
        """The result of the stalled task when it is given up."""
        return WorkerStalledError(self._message(), self.stacks, self.index, self.seconds)

    def warn(self, task_wanted, stacklevel):
        """Warn that the process stalled and was replaced, and that its task is given to
        the replacement (``task_wanted``) or was no longer wanted.  ``stacklevel`` as for
        ``warnings.warn`` called by the caller of this."""
        if self.ticket is None:
            fate = "Its tasks are given to the replacement."
        else:
            fate = ("Its task is given to the replacement." if task_wanted
                    else "Its task was no longer wanted.")
        warnings.warn(f"{self._message()}\n{fate}", RuntimeWarning, stacklevel=stacklevel + 1)
