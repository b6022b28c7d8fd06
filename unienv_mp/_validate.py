"""Checks of the arguments that the sampler, the manager and the queue take: each returns the
value normalised, or raises a clear ``TypeError`` / ``ValueError`` naming the argument."""
import numbers


def check_int(value, what, minimum=1):
    """``value`` as an int of at least ``minimum`` (numpy integers accepted; bools not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


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
