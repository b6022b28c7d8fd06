"""WorkEncoder: how the manager turns the work info of a task into a task entry (see
:mod:`unienv_mp._protocol`)."""
import os

from . import _codec
from . import _protocol as P
from ._ring import Segment

__all__ = ["WorkEncoder", "spill_entry"]

_SIMPLE = P.SIMPLE_TYPES
_RUN_INLINE = P.tag(P.OP_RUN, P.AT_INLINE)
_RUN_SPILL = P.tag(P.OP_RUN, P.AT_SPILL)


def spill_entry(seg):
    """``(tag, payload)`` of a task entry whose work info is in the spill segment ``seg``."""
    return _RUN_SPILL, P.TASK_SPILL_DESC.pack(os.getpid(), seg.fd, seg.ino, seg.size,
                                              seg.size)


class WorkEncoder:
    """Encodes work info with the slot codec: inside the task entry up to ``inline_max``
    bytes, else in a one-off "spill" segment that the worker maps.  The encodings of the
    small immutable items that a sampler sends again and again (e.g. ``("sample", None)``)
    are kept."""

    def __init__(self, inline_max):
        self.inline_max = inline_max
        self._cache = {}

    def encode(self, work):
        """``(tag, payload, spill)`` for a task running ``work``: the tag and payload of its
        entry, and the spill segment holding the work info (None if it is inline), which
        the caller closes once the task's result has arrived."""
        payload = self._cached(work)
        if payload is not None:
            return _RUN_INLINE, payload, None
        p = _codec.prepare(work)
        if p.nbytes <= self.inline_max:
            return _RUN_INLINE, _codec.encode_prepared(p), None
        seg = Segment.create(p.nbytes, "task")
        try:
            with memoryview(seg) as mv:
                _codec.write(p, mv)
            tag, payload = spill_entry(seg)
        except BaseException:
            seg.close()
            raise
        return tag, payload, seg

    def _cached(self, work):
        """The encoding of ``work`` if it is a small immutable item (see
        :func:`~unienv_mp._protocol.is_simple`), from the cache; None for anything else."""
        t = type(work)
        if t is tuple:
            plain = True
            for x in work:
                xt = type(x)
                if xt is not str and x is not None:
                    if xt not in _SIMPLE:
                        return None
                    plain = False
            # Equal tuples of only str and None are made of the same types: such a tuple
            # is its own key (it cannot equal one of the 2-tuples of types below).
            key = work if plain else (tuple(map(type, work)), work)
        elif t in _SIMPLE:
            key = (t, work)   # so that 1, True and 1.0 are not mistaken for one another
        else:
            return None
        cache = self._cache
        payload = cache.get(key)
        if payload is None:
            payload = bytes(_codec.encode(work))
            if len(payload) > self.inline_max:
                return None   # e.g. a long string: it travels in a segment, uncached
            if len(cache) > 1024:
                cache.clear()
            cache[key] = payload
        return payload
