"""WorkEncoder: how the manager turns the work info of a task into a task entry (see
`unienv_mp._transport.protocol`)."""
import os
import pickle

from .._transport import codec as _codec
from .._transport import protocol as P
from .._transport.ring import Segment

__all__ = ["WorkEncoder", "spill_entry"]

_is_simple = P.is_simple
_dumps = pickle.dumps
_PICKLE_INLINE = P.tag(P.ENC_PICKLE, P.AT_INLINE)
_CODEC_INLINE = P.tag(P.ENC_CODEC, P.AT_INLINE)
_CODEC_SPILL = P.tag(P.ENC_CODEC, P.AT_SPILL)


def spill_entry(seg):
    """``(tag, payload)`` of a task entry whose work info is in the spill segment ``seg``."""
    return _CODEC_SPILL, P.TASK_SPILL_DESC.pack(os.getpid(), seg.fd, seg.ino, seg.size,
                                                seg.size)


class WorkEncoder:
    """Encodes work info: small immutable items (`is_simple`, e.g. a sampler's
    ``(method, key, first, k)``) as pickles inside the task entry; anything else with the
    slot codec, inside the task entry up to ``inline_max`` bytes, else in a
    one-off "spill" segment that the worker maps."""

    def __init__(self, inline_max):
        self.inline_max = inline_max

    def encode(self, work):
        """``(tag, payload, spill)`` for a task running ``work``: the tag and payload of its
        entry, and the spill segment holding the work info (None if it is inline), which
        the caller closes once the task's result has arrived."""
        if _is_simple(work):
            payload = _dumps(work, 5)
            if len(payload) <= self.inline_max:
                return _PICKLE_INLINE, payload, None
        p = _codec.prepare(work)
        if p.nbytes <= self.inline_max:
            return _CODEC_INLINE, _codec.encode_prepared(p), None
        seg = Segment.create(p.nbytes, "task")
        try:
            with memoryview(seg) as mv:
                _codec.write(p, mv)
            tag, payload = spill_entry(seg)
        except BaseException:
            seg.close()
            raise
        return tag, payload, seg
