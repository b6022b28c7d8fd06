"""What the end of a worker's process means: whether a new process takes its place, and
what the caller is told.

The pool buries a dead process (`unienv_mp._process.pool`); `judge` says what its death
means, from what is known of it: its exit, how many of its worker's processes died in a
row, the respawn budget (``respawn``, ``max_respawns``), and whether it was killed for
stalling or for writing on its rings what it could not have written.

A stalled process is found by its handle (``WorkerHandle.check_stall`` raises
``WorkerStalled``).  The pool then makes a `Stall`, which takes the process's Python
stacks, keeps it on the worker's lane, and only then kills the process: however a Ctrl-C
cuts the burial short, the death that follows is known to be this stall.  The stalled
task goes to the replacement, with a ``RuntimeWarning`` (`Stall.warn`), or is given up,
its result being `Stall.error` (a `WorkerStalledError`).
"""
import inspect
import os
import signal
import warnings

from .. import _os
from ..backend import respawn_refusal
from ..errors import CodecError, WorkerDiedError, WorkerStalledError

__all__ = ["Stall", "judge", "warn_user"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn_user(message):
    """``warnings.warn(message, RuntimeWarning)``, attributed to the line outside unienv_mp
    that led here (the caller's ``sample()``, ``result()``, ``ready()``...), however deep in
    the package it was found that a process died, stalled or could not start."""
    frame = inspect.currentframe()
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    del frame
    warnings.warn(message, RuntimeWarning, stacklevel=level)


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

    def warn(self, task_wanted):
        """Warn that the process stalled and was replaced, and that its task is given to
        the replacement (``task_wanted``) or was no longer wanted."""
        if self.ticket is None:
            fate = "Its tasks are given to the replacement."
        else:
            fate = ("Its task is given to the replacement." if task_wanted
                    else "Its task was no longer wanted.")
        warn_user(f"{self._message()}\n{fate}")


def judge(index, pid, code, how, in_a_row, stall, corrupt, settings, start_method, tasks):
    """What the death of process ``pid`` of worker ``index`` means: ``(deaths, give_up,
    failed)``.

    ``code``: its exit code (see `unienv_mp._os.exit_code`), ``how`` it ended, in words;
    ``in_a_row``: the deaths of
    that worker's processes since one last made a result; ``stall``: the `Stall` it was
    killed for, or None; ``corrupt``: the `CodecError` of what it wrote on its rings, or
    None; ``settings``: the manager's ``respawn`` and ``max_respawns``; ``start_method``:
    how its processes start; ``tasks``: the manager's ticket table.

    ``deaths`` is its deaths in a row counting this one (0 when the count starts again),
    ``give_up`` the error to raise once it is buried (None: it is replaced), ``failed``
    the task whose result is its stall, as ``(task, error)`` (or None).  Warns of a
    replacement the caller should hear of."""
    # (a SIGINT is a terminal's Ctrl-C that reached the worker too, not a crash)
    deaths = in_a_row + (code != -signal.SIGINT)
    give_up = failed = None
    refusal = respawn_refusal(settings.respawn, deaths, settings.max_respawns)
    if code == _os.EXIT_TASK_REWRITTEN and corrupt is None:
        corrupt = CodecError(f"worker {index} (pid {pid}) found a task in its ring "
                             f"rewritten (it did not match its check)")
    if code == _os.EXIT_MAIN_REIMPORTED and stall is None:
        # a replacement would make the same mistake: one error, with the fix
        give_up = WorkerDiedError(
            f"worker {index} {how}: started with {start_method!r}, it imported the main "
            f"module, whose top level starts a sampler's workers again (the script has no "
            f"`if __name__ == \"__main__\":` guard around its work).  Put the work under "
            f"such a guard (see unienv_mp's docs, Getting started); workers started with "
            f"spawn or forkserver import the main module", worker=index, exitcode=code)
    elif corrupt is not None:
        if refusal is not None:
            give_up = CodecError(f"{corrupt}; the worker was killed; {refusal}")
        else:
            warn_user(f"{corrupt}; the worker was killed and replaced, and its unfinished "
                      f"tasks are given to the replacement")
    elif stall is not None and stall.ticket is None:
        # (it took no task: none is to blame, nor counted as failing)
        deaths = in_a_row
        stall.warn(True)
    elif stall is not None:
        task = tasks.get(stall.ticket)
        if refusal is not None:
            if task is not None and not task.arrived and task.worker == index:
                failed = (task, stall.error())
            deaths = 0   # (the task that kept stalling is given up)
        else:
            stall.warn(task is not None and not task.cancelled)
    elif refusal is not None:
        give_up = WorkerDiedError(f"worker {index} (pid {pid}) {how}; {refusal}",
                                  worker=index, exitcode=code)
    return deaths, give_up, failed
