"""A writer's result slots: one growable segment per slot number, which the reader maps
(see `Segment` and `segment_from_peer`), and small reused buffers for the results that
travel inline.  The process workers write their results here, and so do the Ray actors
on the training node (`unienv_mp.ray`)."""
from .ring import Segment

__all__ = ["ResultSlots"]

_PAGE = 4096
#: The smallest slot segment made.
MIN_SLOT = 64 * 1024


class ResultSlots:
    """The slots of one writer.

    Args:
        name: a name for its segments (e.g. ``"slot3"``), shown in errors.
    """

    def __init__(self, name):
        self.name = name
        self.segs = {}     # slot -> [generation, Segment, cache of the SlotWriters]
        self.inline = {}   # nbytes -> (bytearray, cache of the SlotWriters)

    def get(self, slot, nbytes):
        """``[generation, Segment, cache]`` of slot number ``slot``, at least ``nbytes``
        long: a new segment (of the next generation, an eighth larger than asked, whole
        pages) where the slot has none yet or a smaller one.  The reader maps a slot again
        when its generation changes; the cache is the `SlotWriter`'s (see
        `unienv_mp._transport.protocol`)."""
        entry = self.segs.get(slot)
        if entry is None or entry[1].size < nbytes:
            size = max(MIN_SLOT, (nbytes + nbytes // 8 + _PAGE - 1) // _PAGE * _PAGE)
            gen = 1 if entry is None else entry[0] + 1
            seg = Segment.create(size, self.name)
            if entry is not None:
                # (views the old cache holds keep the old mapping until it is dropped here;
                # the reader keeps its own mapping for as long as it needs)
                entry[2].clear()
                entry[1].close()
            entry = [gen, seg, {}]
            self.segs[slot] = entry
        return entry

    def inline_buffer(self, nbytes):
        """``(bytearray, cache)``: a buffer of ``nbytes`` reused for results of that size
        (16 sizes kept at most)."""
        entry = self.inline.get(nbytes)
        if entry is None:
            if len(self.inline) >= 16:
                self.inline.clear()
            entry = self.inline[nbytes] = (bytearray(nbytes), {})
        return entry

    def close(self):
        """Close every slot segment (each is unmapped once no view of it is left)."""
        segs, self.segs = self.segs, {}
        for _, seg, cache in segs.values():
            cache.clear()
            seg.close()
        self.inline.clear()
