"""Checks of the arguments that the ring, the queue, the manager and the sampler take: each
returns the value normalised, or raises a clear ``TypeError`` / ``ValueError`` naming the
argument.

An integer is anything Python accepts as an index (``operator.index``: ``int``, numpy's
integers, ...), but not a bool."""
import math
import multiprocessing as mp
import numbers
import operator
import os
import sys


def _as_int(value):
    """``value`` as an int if it is an integer (see the module's docstring), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_int(value, what, minimum=1, maximum=None, why=None):
    """``value`` as an int of at least ``minimum`` and, unless ``maximum`` is None, at most
    ``maximum`` (``why``: what the bound is for, said when it is exceeded)."""
    number = _as_int(value)
    if number is None:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if number < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{what} must be at most {maximum}, got {number}"
                         + (f": {why}" if why else ""))
    return number


def check_index(value, what, size):
    """``value`` as an int in ``[0, size)``; anything else is a ``ValueError``."""
    number = _as_int(value)
    if number is None or not 0 <= number < size:
        raise ValueError(f"{what} must be an index below {size}, got {value!r}")
    return number


#: The longest timeout taken (about 116 days): beyond it, None says "no limit".
MAX_SECONDS = 1e7


def check_seconds(value, what, allow_none=True, maximum=MAX_SECONDS, why=None):
    """``value`` as a float number of seconds > 0 and at most ``maximum`` (or None, if
    ``allow_none``); ``why``: what the bound is for, said when it is exceeded."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__} "
                        f"{value!r}")
    if value <= 0:
        raise ValueError(f"{what} must be > 0, got {value}")
    none = " (None: no limit)" if allow_none else ""
    if value == math.inf:
        raise ValueError(f"{what} must be finite{none}, got {value}")
    if value > maximum:
        most = f"{int(maximum):,}" if maximum == int(maximum) else f"{maximum:g}"
        raise ValueError(f"{what} must be at most {most} s{none}, got {value:g}"
                         + (f": {why}" if why else ""))
    return float(value)


def check_bool(value, what, allow_none=False):
    """``value`` as a bool: ``True`` or ``False`` (numpy's booleans too), or None if
    ``allow_none``.  Anything else (``"no"``, ``1``, ``None``) is a ``TypeError``: taken
    for its truth value it would silently mean something else."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        return value
    np = sys.modules.get("numpy")   # (a numpy bool exists only once numpy is imported)
    if np is not None and isinstance(value, np.bool_):
        return bool(value)
    allowed = "None, True or False" if allow_none else "a bool (True or False)"
    raise TypeError(f"{what} must be {allowed}, got {type(value).__name__} {value!r}")


#: Worker processes allowed per CPU this process may run on (and at least MIN_MAX_WORKERS).
WORKERS_PER_CPU = 8
MIN_MAX_WORKERS = 64


def check_workers(value, what="n_workers"):
    """``value``, a number of worker processes, as an int of at least 1 and at most
    ``WORKERS_PER_CPU`` per CPU available to this process (at least ``MIN_MAX_WORKERS``):
    each is a process with its own copy of what it needs, and more than that only adds
    start-up time and memory."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    most = max(MIN_MAX_WORKERS, WORKERS_PER_CPU * cpus)
    number = check_int(value, what)
    if number > most:
        raise ValueError(f"{what} must be at most {most} here, got {number}: the limit is "
                         f"{WORKERS_PER_CPU} worker processes per CPU this process may run "
                         f"on, and at least {MIN_MAX_WORKERS} ({cpus} CPUs here); each "
                         f"worker is a process, and more of them only add start-up time "
                         f"and memory")
    return number


#: Bounds of a sampler's ``n_buffers`` and ``batches_per_task``: batches ahead of the
#: caller, and in one task (a worker keeps a task's batches until its slot is written).
#: Far more than ever helps: a few batches per worker keep every worker busy.
MAX_BUFFERS = 4096
MAX_BATCHES_PER_TASK = 1024

#: Bounds of the manager's counts: replacements of one worker in a row, zero-copy results
#: held at once.
MAX_RESPAWNS = 10 ** 9
MAX_LEASES = 1_000_000
#: The longest ``doze_time``: how long a dead peer may go unnoticed by a side waiting on it.
MAX_DOZE = 10.0


def check_doze_time(value):
    """``value``, how often (seconds) a waiting side checks that its peer is alive."""
    return check_seconds(value, "doze_time", allow_none=False, maximum=MAX_DOZE,
                         why="it is how long a worker that died may go unnoticed")


def physical_memory():
    """Bytes of physical memory of this machine (None if it cannot be told)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_timeout(value, what):
    """``value``, how long a blocking call of the ring may wait, as a float number of
    seconds >= 0, or None (no limit)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds or None, got "
                        f"{type(value).__name__} {value!r}")
    seconds = float(value)
    if seconds != seconds or seconds < 0:   # (NaN, or negative)
        raise ValueError(f"{what} must be a non-negative number of seconds, got {value!r}")
    return seconds


def check_context(ctx):
    """``ctx``, a multiprocessing context or the name of a start method (``"fork"``,
    ``"spawn"``, ``"forkserver"``), as a context; None: the default context."""
    if ctx is None:
        return mp.get_context()
    if isinstance(ctx, str):
        return mp.get_context(ctx)
    if not hasattr(ctx, "Process"):
        raise TypeError(f"ctx must be a multiprocessing context or a start method name, "
                        f"got {ctx!r}")
    return ctx


def check_spin(value):
    """``value``, the seconds a waiting side polls before it sleeps, as a float in
    ``[0, 1)``; anything else is a ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"spin must be a number of seconds in [0, 1), got {value!r}")
    return float(value)
