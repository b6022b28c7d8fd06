"""How a batch travels from a Ray actor to the caller: as a slot codec frame
(`unienv_mp._transport.codec`), gathered straight into its place as the process workers
gather theirs.

* An actor on the caller's node writes the frame into a result slot of its own, a shared
  segment (`ResultSlots`), and answers the slot's short description; the caller maps the
  segment once (through ``/proc/<actor pid>/fd``) and reads the batch from it, zero-copy.
  The slot goes back to the actor when the last array of the batch is garbage collected,
  as a process worker's does.  The object store carries nothing.
* An actor on another node writes the frame into a numpy buffer that Ray copies into the
  object store as the task returns; the caller maps that object (Ray moves it to the
  caller's node) and reads the batch from it, zero-copy and read-only.

`ActorFrames` is the actor's side, `LaneSlots` the caller's record of one actor's slots.
"""
import collections

import numpy as np

from .._transport import codec as _codec
from .._transport.codec import SlotLease
from .._transport.protocol import SlotWriter
from .._transport.result_slots import ResultSlots
from .._transport.ring import segment_from_peer

__all__ = ["ActorFrames", "LaneSlots", "read_frame"]


class _Encoded(SlotWriter):
    """A value the codec lays out (a batch of the generic path, anything else a task
    returns), written as any `SlotWriter`."""
    __slots__ = ("prepared", "nbytes")

    def __init__(self, value):
        self.prepared = _codec.prepare(value)
        self.nbytes = self.prepared.nbytes

    def write_into(self, buffer, cache):
        _codec.write(self.prepared, buffer)


class ActorFrames:
    """The actor's side: where the frame of each result is written.

    Args:
        index: the actor's worker index (names its segments).
    """

    def __init__(self, index):
        self.slots = ResultSlots(f"ray-slot{index}")
        self.buffers = {}   # (nbytes, place) -> (numpy buffer, cache): see write

    def write(self, value, slot, place=0):
        """``value`` (a `SlotWriter`, or anything the codec takes) as it travels: with a
        slot number, written into that slot, and ``(generation, fd, inode, size, nbytes)``
        returned; with None, a numpy buffer holding the frame.  The buffer is this
        actor's, for the result at ``place`` in a call's answer, and is written again by a
        later call's result of the same size and place: Ray copies the answer into the
        object store as the call returns, before the actor runs another."""
        writer = value if isinstance(value, SlotWriter) else _Encoded(value)
        nbytes = writer.nbytes
        if slot is not None:
            gen, seg, cache = self.slots.get(slot, nbytes)
            writer.write_into(seg, cache)
            return gen, seg.fd, seg.ino, seg.size, nbytes
        entry = self.buffers.get((nbytes, place))
        if entry is None:
            if len(self.buffers) >= 16:
                self.buffers.clear()
            entry = self.buffers[nbytes, place] = (np.empty(nbytes, np.uint8), {})
        buf, cache = entry
        writer.write_into(buf, cache)
        return buf


class LaneSlots:
    """The caller's record of one actor's result slots: the slot numbers free, the
    segments mapped here, and the leases alive (a replacement actor gets a new record).

    Its segments are mapped through ``/proc/<pid>/fd`` of the actor's process.
    """

    def __init__(self):
        self.free = []
        self.next = 0
        self.mapped = {}     # slot -> (generation, pid, Segment)
        self.leases = 0
        self.released = collections.deque()   # slots whose last lease was collected

    def take(self):
        """A free slot number for a new task (the slots given back since are free again
        first)."""
        released = self.released
        while released:
            self.leases -= 1
            self.free.append(released.popleft())
        if self.free:
            return self.free.pop()
        self.next += 1
        return self.next - 1

    def give_back(self, slot):
        """``slot``'s result was read (copied) or dropped: it can take new work."""
        self.free.append(slot)

    def segment(self, slot, pid, desc):
        """The segment of ``slot`` as the actor's process ``pid`` described it (``desc``:
        generation, fd, inode, size), mapped here once per generation and process.
        Raises ``PeerGoneError`` if the actor is gone, ``OSError`` if its descriptors
        cannot be opened from here."""
        gen, fd, ino, size = desc
        entry = self.mapped.get(slot)
        if entry is not None and entry[0] == gen and entry[1] == pid:
            return entry[2]
        seg = segment_from_peer(pid, fd, ino, size, f"Ray actor slot {slot}")
        if entry is not None:
            entry[2].close()   # (unmapped once the last batch read from it is gone)
        self.mapped[slot] = (gen, pid, seg)
        return seg

    def lease(self, slot, seg, nbytes):
        """A zero-copy lease on ``nbytes`` of ``seg``: ``slot`` is free again once the
        last view of it is garbage collected."""
        self.leases += 1
        return SlotLease(seg, 0, nbytes, self.released.append, slot)

    def close(self):
        """Unmap the segments (each once no batch read from it is left)."""
        mapped, self.mapped = self.mapped, {}
        for _, _, seg in mapped.values():
            seg.close()


def read_frame(frame, copy):
    """The batch in an object-store ``frame`` (a read-only numpy buffer): views of it, or
    (``copy``) arrays of their own.  Tensors that are views cannot be marked read-only
    (see `RaySampler`'s ``copy``)."""
    return _codec.decode(frame, copy=copy, share_readonly=True)
