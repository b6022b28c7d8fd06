"""Requesting batches ahead of the caller: the one rule that ``sample*`` and the epochs
share."""

__all__ = ["depth"]


def depth(n_buffers, first):
    """How many batches to keep requested beyond the one the caller waits for.

    The first batch (nothing requested yet: the first call, the first after
    ``manual_seed``, or an epoch's first batch) is asked for alone, so that the batch
    waited for has a worker, and the CPUs, to itself (it is waited for at once): 0.  The
    rest once it is here, while the caller uses it: ``n_buffers``, as UniEnv keeps
    ``n_buffers``.

    A ``sample*`` stream keeps more than this many batches requested (its tasks are
    chunks of ``k`` batches: the rest of the chunk being handed out counts, and the next
    task goes out as soon as fewer are left, so between ``n_buffers`` and ``n_buffers +
    k - 1`` after a call).  An epoch, whose tasks are one batch each, keeps at most
    ``max(1, depth)`` in flight, the one waited for among them."""
    return 0 if first else n_buffers
