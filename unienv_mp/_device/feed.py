"""The feed: CPU batches from the slots copied to the device on the sampler's own stream,
issued ahead, handed to the caller's stream, and let go once copied.

The feed's rules (the orderings, argued once; the other files cite this note)
------------------------------------------------------------------------------

1. **The source is whole before the copy is issued.**  A worker writes a batch into its slot
   and then publishes the result entry with a release store; the parent reads the entry
   with an acquire load before it decodes the batch (see csrc/umr_ring.c).  The copy is
   issued by the parent after that, so the device reads what the worker wrote.

2. **The copy runs on the sampler's stream S**, never on the caller's stream C:
   ``out = cpu.to(device, non_blocking=True)`` under S, then event E recorded on S.  The
   device memory of ``out`` is allocated for S, so the caching allocator orders its reuse
   on S.

3. **The caller's stream waits, the caller does not.**  At the hand-out, C waits on E (a
   device-side wait) and every tensor of ``out`` records C (``record_stream``), so the
   allocator reuses its memory only after C's work queued before it is freed.  Whatever
   the caller then queues on C reads the finished copy; a caller who reads it on another
   stream orders that stream after C, as for any tensor.

4. **The slot goes back when E has completed, not before.**  The feed holds the CPU batch
   (its arrays are the slot's views: leases, see the manager) from the copy's issue until
   ``done(E)``.  Completed copies are retired at every call, in issue order (S runs them in
   that order, so E's complete in that order), and the CPU batch is dropped then; the
   slot goes back to its worker at the manager's next call.  A worker can therefore
   overwrite a slot only after the device has finished reading it.

5. **Bounded.**  At most ``max_in_flight`` copies are in flight: a caller far ahead of the
   device waits (``synchronize`` on the oldest) instead of holding every slot.

6. **Issued ahead.**  When the next batch of a stream is already here at a hand-out, its
   copy is issued then (`DeviceFeed.start`), so that it runs while the caller's step does;
   its hand-out later finds it by identity.  A batch started ahead and then dropped (a
   reseed) is simply retired with the others.

7. **Registration.**  Every segment that a batch is read from is page-locked before its
   first copy, and unregistered only when nothing reads it (see `.pins`).

8. **close.**  Waits for every copy in flight, drops their CPU batches, then unregisters
   everything; the managers unmap the slots only after (a pin's view keeps them mapped).

A copy cut short by a Ctrl-C or an error is in ``_in_flight`` before its first leaf is
issued, so whatever was issued is retired (after an event recorded later on S, which
completes after it) with the rest.
"""
import collections
import os
import time

from ..stats import DeviceStats
from .pins import HostPins

__all__ = ["DeviceFeed", "make_feed"]

#: Copies issued ahead kept for their hand-out (one per stream in use is the need).
_AHEAD = 4


class _Copy:
    """One batch being copied: the CPU batch held until the copy completes, the device
    batch, and the events around the copy on the sampler's stream."""
    __slots__ = ("cpu", "out", "start", "end")

    def __init__(self, cpu):
        self.cpu = cpu
        self.out = None
        self.start = None
        self.end = None


class DeviceFeed:
    """Copies CPU batches to ``ops``'s device following the feed's rules (see the module's
    docstring), or, with ``copy=False``, only page-locks the slots they lie in
    (``pin_memory=True``).  ``segments()``: the slot segments of the sampler's live
    managers (see `.pins.HostPins`).  Not thread-safe: the sampler calls it under its
    lock."""

    def __init__(self, ops, segments, *, copy=True, max_in_flight=4, timing=True):
        import torch
        self._tensor = torch.Tensor
        self._ops = ops
        self.pins = HostPins(ops, segments)
        self.copying = copy
        self._stream = ops.copy_stream() if copy else None
        self._max = max_in_flight
        self._timing = timing
        self._in_flight = collections.deque()   # _Copy, in issue order
        # id(cpu batch) -> (the batch, its _Copy) issued ahead of its hand-out, oldest
        # first (one per stream whose next batch is here; the batch is kept with it, so
        # that the id is its own)
        self._ahead = {}
        self._closing = False     # close() began: no copy is issued any more
        self.closed = False       # close() ended
        self._pid = os.getpid()   # (a forked child never touches its parent's device)
        self._copies = 0
        self._copy_s = 0.0
        self._wait_ns = 0
        self._pageable = 0

    # -- the caller's side ------------------------------------------------------------------

    def hand_out(self, cpu):
        """``cpu`` on the device, ordered on the caller's current stream (rules 3, 6)."""
        t0 = time.perf_counter_ns()
        entry = self._ahead.pop(id(cpu), None)
        if entry is not None and entry[0] is cpu:
            copy = entry[1]
        else:
            copy = self._issue(cpu)
        ops = self._ops
        stream = ops.current_stream()
        ops.wait(stream, copy.end)
        out = copy.out
        for t in _leaves(out, self._tensor):
            ops.hold(t, stream)
        self._retire()
        self._wait_ns += time.perf_counter_ns() - t0
        return out

    def start(self, cpu):
        """Issue the copy of ``cpu``, the stream's next batch, ahead of its hand-out
        (rule 6)."""
        ahead = self._ahead
        entry = ahead.get(id(cpu))
        if entry is not None and entry[0] is cpu:
            return
        t0 = time.perf_counter_ns()
        ahead[id(cpu)] = (cpu, self._issue(cpu))
        if len(ahead) > _AHEAD:
            # (batches started ahead and then dropped, by a reseed say: the oldest goes)
            del ahead[next(iter(ahead))]
        self._wait_ns += time.perf_counter_ns() - t0

    def pinned(self, cpu):
        """``cpu`` itself, its slot page-locked (``pin_memory=True``)."""
        self._pin(cpu)
        return cpu

    # -- copies -----------------------------------------------------------------------------

    def _pin(self, cpu):
        pins = self.pins
        refreshed = False
        for t in _leaves(cpu, self._tensor):
            if t.numel() == 0 or pins.covers(t.data_ptr()):
                continue
            if not refreshed:
                pins.refresh()
                refreshed = True
                if pins.covers(t.data_ptr()):
                    continue
            self._pageable += 1

    def _issue(self, cpu):
        if self._closing:
            raise RuntimeError("the device feed is closed")
        in_flight = self._in_flight
        self._retire()
        while len(in_flight) >= self._max:
            self._ops.synchronize(in_flight[0].end)   # (rule 5)
            self._retire()
        self._pin(cpu)
        ops = self._ops
        stream = self._stream
        copy = _Copy(cpu)
        in_flight.append(copy)   # (first: a copy cut short is still retired, see above)
        copy.start = ops.record(stream, self._timing) if self._timing else None
        copy.out = _map(cpu, lambda t: ops.copy(t, stream), self._tensor)
        copy.end = ops.record(stream, self._timing)
        self._copies += 1
        return copy

    def _retire(self):
        """Let go of the CPU batches whose copies completed (rule 4), oldest first."""
        in_flight = self._in_flight
        ops = self._ops
        while in_flight:
            copy = in_flight[0]
            if copy.end is None:   # (cut short: an event after what it issued)
                copy.end = ops.record(self._stream)
                copy.start = None
            if not ops.done(copy.end):
                return
            in_flight.popleft()
            if copy.start is not None:
                try:
                    self._copy_s += ops.elapsed(copy.start, copy.end)
                except Exception:
                    pass
            copy.cpu = None

    def stats(self, reset=False):
        """A `DeviceStats` of what was done since the start (or the last reset)."""
        if not self._closing and os.getpid() == self._pid:
            self._retire()
        out = DeviceStats(
            device=str(self._ops.device) if self.copying else "cpu (pinned)",
            copies=self._copies, copy_seconds=self._copy_s, wait_seconds=self._wait_ns / 1e9,
            pinned_bytes=self.pins.pinned_bytes, pinned_slots=len(self.pins),
            pageable_leaves=self._pageable,
            in_flight=len(self._in_flight))
        if reset:
            self._copies = 0
            self._copy_s = 0.0
            self._wait_ns = 0
            self._pageable = 0
        return out

    def close(self):
        """Wait for every copy in flight, let go of the CPU batches, unregister every slot
        (rule 8).  Idempotent, and a close cut short (a Ctrl-C while it waits) is finished
        by the next; a device error is reported as a warning, not raised.  In a forked
        child, only lets go (the device work is the parent's)."""
        if self.closed:
            return
        self._closing = True
        self._ahead.clear()
        in_flight = self._in_flight
        if os.getpid() != self._pid:
            # A forked child: the copies and registrations are its parent's.  It lets go
            # of its own copies of the mappings, and calls nothing on the device.
            in_flight.clear()
            self.pins.forget()
            self.closed = True
            return
        error = None
        while in_flight:
            copy = in_flight[0]
            try:
                if copy.end is None:
                    copy.end = self._ops.record(self._stream)
                self._ops.synchronize(copy.end)
            except Exception as e:   # (a device gone bad: nothing more to wait for)
                error = error or e
            in_flight.popleft()
            copy.cpu = None
        try:
            self.pins.close()
        except Exception as e:
            error = error or e
        self.closed = True
        if error is not None:
            import warnings
            warnings.warn(f"unienv_mp: a copy to {self._ops.device} failed while the sampler "
                          f"closed: {error}", RuntimeWarning, stacklevel=3)


def _leaves(tree, tensor_type):
    """The tensors of a batch (dicts, lists and tuples of them, in order)."""
    if isinstance(tree, tensor_type):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v, tensor_type)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v, tensor_type)


def _map(tree, fn, tensor_type):
    """``tree`` with ``fn`` applied to each tensor; other leaves kept as they are."""
    if isinstance(tree, tensor_type):
        return fn(tree)
    if isinstance(tree, dict):
        out = {k: _map(v, fn, tensor_type) for k, v in tree.items()}
        return out if type(tree) is dict else type(tree)(out)
    if isinstance(tree, list):
        return [_map(v, fn, tensor_type) for v in tree]
    if isinstance(tree, tuple):
        items = [_map(v, fn, tensor_type) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    return tree


def make_feed(placement, pin_memory, segments):
    """The `DeviceFeed` a sampler placed as ``placement`` (see `.placement`) needs, or None:
    one that copies to the device for ``"copy"``; one that page-locks the slots for CPU
    batches with ``pin_memory``, if CUDA can be used here (else one ``RuntimeWarning``, as
    torch's DataLoader gives, and plain slots)."""
    from . import ops as _ops
    kind = None if placement is None else placement.kind
    if pin_memory and kind in ("copy", "in_process"):
        raise ValueError(f"pin_memory=True hands out CPU batches from page-locked slots, but "
                         f"the batches go to {placement.device} already: leave pin_memory "
                         f"out")
    if kind == "copy":
        return DeviceFeed(_ops.for_device(placement.device), segments)
    if pin_memory:
        why = _ops.cuda_unavailable("cuda")
        if why is not None:
            import warnings
            warnings.warn(f"unienv_mp: pin_memory=True, but {why}: batches are handed out "
                          f"from pageable slots", RuntimeWarning, stacklevel=4)
            return None
        return DeviceFeed(_ops.for_device("cuda"), segments, copy=False)
    return None
