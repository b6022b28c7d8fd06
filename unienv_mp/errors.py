"""Exceptions raised by unienv_mp.  This module imports nothing from the package, so every
layer can use it."""

import pickle
import traceback

__all__ = ["RingClosed", "CodecError", "WorkerError", "WorkerStalledError", "WorkerDiedError",
           "PeerGoneError", "error_payload"]

#: Longest traceback (and message) text a worker sends, in characters (of a traceback the
#: end is kept, of a message the start).
MAX_TRACEBACK = 20_000


def _dumps_or_none(obj):
    if obj is None:
        return None
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None


def _loads_or_none(data):
    """The object pickled in ``data``, or None if there is none or it cannot be loaded here
    (e.g. its class lives in a module only the worker can import)."""
    if data is None:
        return None
    try:
        return pickle.loads(data)
    except Exception:
        return None


def error_payload(exc, max_traceback=MAX_TRACEBACK, max_message=MAX_TRACEBACK):
    """What a worker sends for an exception: type, message, traceback, and the exception
    itself, pickled (bytes), when it survives pickling *and unpickling* here (an exception
    whose ``__init__`` takes other arguments than its ``args`` pickles but does not load).
    It is pickled on its own so that the receiver, which may not be able to import its
    class, still gets the rest (see
    [`WorkerError.from_payload`][unienv_mp.WorkerError.from_payload]).

    Args:
        exc: the exception.
        max_traceback: longest traceback text sent, in characters: a longer one keeps its
            end, after a line ``...``.
        max_message: longest message sent, in characters: a longer one keeps its start,
            followed by ``...``.

    Returns:
        A dict: ``"type"`` (the qualified name of the exception's type), ``"message"``,
        ``"traceback"`` (text), and ``"exception"`` (the pickled exception, or None).
    """
    try:
        original = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        if type(pickle.loads(original)) is not type(exc):
            original = None
    except Exception:
        original = None
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if len(tb) > max_traceback:
        tb = "...\n" + tb[-max_traceback:]
    try:
        message = str(exc)
    except Exception:
        message = f"<{type(exc).__name__} whose str() failed>"
    if len(message) > max_message:
        message = message[:max_message] + "..."
    t = type(exc)
    return {"type": f"{t.__module__}.{t.__qualname__}", "message": message,
            "traceback": tb, "exception": original}


def _rebuild_worker_error(cls, exc_type, exc_message, worker_traceback, original, worker):
    return cls(exc_type, exc_message, worker_traceback, _loads_or_none(original), worker)


class RingClosed(Exception):
    """The ring (or queue built on it) was shut down: nothing more can be pushed, and
    nothing is left to pop."""


class PeerGoneError(OSError):
    """A shared-memory segment could not be attached because the process that described
    it has exited (or closed the descriptor it named)."""


class CodecError(ValueError):
    """A slot could not be encoded or decoded: an unsupported leaf, a batch that does not
    fit, or a slot whose contents are not a valid encoding (truncated, wrong magic, offsets
    or shapes out of bounds)."""


class WorkerError(RuntimeError):
    """A worker process raised while producing a result.

    Attributes:
        exc_type: qualified name of the original exception's type (``"builtins.KeyError"``).
        exc_message: ``str()`` of the original exception.
        worker_traceback: the formatted traceback text from the worker.
        original: the original exception object when it could be pickled, else ``None``.
        worker: index of the worker that raised.
    """

    def __init__(self, exc_type, exc_message, worker_traceback, original=None, worker=None):
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.worker_traceback = worker_traceback
        self.original = original
        self.worker = worker
        super().__init__(
            f"worker {worker} raised {exc_type}: {exc_message}\n"
            f"--- worker traceback ---\n{worker_traceback}"
        )

    @classmethod
    def from_payload(cls, info, worker=None, prefix=""):
        """The error a worker described in ``info``
        ([`error_payload`][unienv_mp.errors.error_payload]'s dict: type, message, traceback,
        and the exception pickled on its own, or None), its message prefixed with
        ``prefix``.  ``original`` is None if the exception cannot be loaded here (e.g. its
        class lives in a module only the worker can import)."""
        return cls(info["type"], prefix + info["message"], info["traceback"],
                   _loads_or_none(info["exception"]), worker)

    def __reduce__(self):
        # The original travels pickled on its own: if it cannot be loaded where this
        # error arrives, only ``original`` is lost (None), not type, message and traceback.
        return (_rebuild_worker_error,
                (type(self), self.exc_type, self.exc_message, self.worker_traceback,
                 _dumps_or_none(self.original), self.worker))


class WorkerStalledError(WorkerError):
    """A worker spent longer than ``stall_timeout`` on one task, was killed and replaced,
    and that task is given up (see the manager's ``stall_timeout``).  A
    [`WorkerError`][unienv_mp.WorkerError] whose ``exc_type`` is
    ``"unienv_mp.WorkerStalledError"``.

    Args:
        message: the error's text (its ``str()``).
        worker_stack: the worker's stacks, kept as ``worker_stack`` and as
            ``worker_traceback``.
        worker: index of the worker.
        seconds: how long it had been on the task, or None.

    Attributes:
        worker: index of the worker.
        worker_stack: the worker's Python stacks (all its threads, faulthandler's format)
            when it was found stalled.
        seconds: how long it had been on the task.
    """

    def __init__(self, message, worker_stack, worker=None, seconds=None):
        self.worker_stack = worker_stack
        self.seconds = seconds
        super().__init__("unienv_mp.WorkerStalledError", message, worker_stack, None, worker)
        self.args = (message,)

    def __str__(self):
        return self.args[0]

    def __reduce__(self):
        return (type(self), (self.args[0], self.worker_stack, self.worker, self.seconds))


class WorkerDiedError(RuntimeError):
    """A worker (a process, or a Ray actor) ended without being asked to (killed by a
    signal, a crash, or ``os._exit``) and the sampler was told not to replace it, or it kept
    dying; or a worker started with spawn or forkserver ran a main module without its
    ``if __name__ == "__main__":`` guard, which a replacement would run again.

    Args:
        message: the error's text.
        worker: index of the worker that died; kept as ``worker``.
        exitcode: its process's exit code (negative: the signal that killed it), or None
            (a Ray actor, or an exit status collected elsewhere); kept as ``exitcode``.
    """

    def __init__(self, message, worker=None, exitcode=None):
        self.worker = worker
        self.exitcode = exitcode
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.args[0], self.worker, self.exitcode))
