"""Checks of the arguments that the ring, the queue, the manager and the sampler take: each
returns the value normalised, or raises a clear ``TypeError`` / ``ValueError`` naming the
argument.

An integer is anything Python accepts as an index (``operator.index``: ``int``, numpy's
integers, ...), but not a bool."""
import multiprocessing as mp
import numbers
import operator


def _as_int(value):
    """``value`` as an int if it is an integer (see the module's docstring), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_int(value, what, minimum=1, maximum=None):
    """``value`` as an int of at least ``minimum`` and, unless ``maximum`` is None, at most
    ``maximum``."""
    number = _as_int(value)
    if number is None:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if number < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{what} must be <= {maximum}, got {number}")
    return number


def check_index(value, what, size):
    """``value`` as an int in ``[0, size)``; anything else is a ``ValueError``."""
    number = _as_int(value)
    if number is None or not 0 <= number < size:
        raise ValueError(f"{what} must be an index below {size}, got {value!r}")
    return number


def check_seconds(value, what, allow_none=True):
    """``value`` as a float number of seconds > 0 (or None, if ``allow_none``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__} "
                        f"{value!r}")
    if value <= 0:
        raise ValueError(f"{what} must be > 0, got {value}")
    return float(value)


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
