"""The feed: CPU batches from the slots copied to the device on the sampler's own stream,
issued ahead, handed to the caller's stream, and let go once copied; page-locked CPU batches
(``pin_memory=True``) kept until the caller's copies of them are done; and batches made in
this process on the device handed to the caller's stream.

The feed's rules (the orderings, argued once; the other files cite this note)
------------------------------------------------------------------------------

1. **The source is whole before the copy is issued.**  A worker writes a batch into its slot
   and then publishes the result entry with a release store; the parent reads the entry
   with an acquire load before it decodes the batch (see csrc/umr_ring.c).  The copy is
   issued by the parent after that, so the device reads what the worker wrote.

2. **The copy runs on the sampler's stream S**, never on the caller's stream C:
   ``out = cpu.to(device, non_blocking=True)`` under S, then event E recorded on S.  The
   device memory of ``out`` is allocated for S, so the caching allocator orders its reuse
   on S.  S is a stream of the sampler's own (a high-priority one, see
   `.ops.CudaOps`), which the caller's ordinary streams are never handed; should the
   caller make S current all the same, the hand-out sees it (C == S), warns once and takes
   another S for the copies after (the data stays right either way: C then orders after
   the copy by itself).

3. **The caller's stream waits, the caller does not.**  At the hand-out, C waits on E (a
   device-side wait) and every tensor of ``out`` records C (``record_stream``), so the
   allocator reuses its memory only after C's work queued before it is freed.  Whatever
   the caller then queues on C reads the finished copy.  Only C waits: a caller who reads
   the batch on another stream D orders D after C first (``D.wait_stream(C)``), and keeps
   the batch alive until D is done with it (or calls ``record_stream(D)``), as for any
   tensor made on C.

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
   reseed) is simply retired with the others.  A batch whose slot is still being
   page-locked is not issued ahead (its hand-out issues it).

7. **Registration.**  Every segment that a batch is read from is page-locked on the pins'
   own thread, as soon as the feed first meets it (a batch handed out, or the next batch
   looked at ahead), never on the caller's thread; a copy, or a ``pin_memory`` hand-out,
   of a batch whose segment is still being registered waits for that registration, so
   that no range is copied from while it is registered.  A segment is unregistered only
   when nothing reads it (see `.pins`).

8. **close.**  Waits for every copy in flight and for the events of the page-locked batches
   let go, drops their CPU batches, then unregisters everything; the managers unmap the
   slots only after (a pin's view keeps them mapped).  In a forked child, close drops
   nothing made on the device (events, device tensors): they are the parent's, and
   freeing them would be a CUDA call in the child; they are kept for the child's life.

9. **Page-locked batches** (``pin_memory=True``) are kept after the hand-out until the
   caller has let go of them and an event recorded on its current stream after that has
   completed, so that a copy the caller queued (``.to("cuda", non_blocking=True)``) has
   read the slot before a worker writes it again (see `.keep`).

10. **Batches made on the device in this process** (data on a GPU: see `.resident`) are
    gathered on the stream current when their chunk is made, and an event recorded there
    after it; a batch of the chunk handed out later while another stream C is current gets
    C's wait on that event and ``record_stream(C)`` on each tensor, as in rule 3.

A copy cut short by a Ctrl-C or an error is in ``_in_flight`` before its first leaf is
issued, so whatever was issued is retired (after an event recorded later on S, which
completes after it) with the rest.
"""
import collections
import ctypes
import time
import warnings

from .. import _os
from ..stats import DeviceStats
from .keep import KeptBatches
from .pins import HostPins

__all__ = ["DeviceFeed", "make_feed", "keep_in_forked_child"]

#: Copies issued ahead kept for their hand-out (one per stream in use is the need).
_AHEAD = 4

#: What a forked child must never free (see rule 8): kept here for the child's life.  The
#: list holds a reference of its own, so that not even the interpreter's end frees it.
_KEPT_IN_CHILD = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT_IN_CHILD))


def keep_in_forked_child(*objects):
    """Keep ``objects`` (anything holding CUDA events or device tensors of the parent) for
    the rest of this forked child's life (rule 8)."""
    _KEPT_IN_CHILD.extend(objects)


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
    """The hand-out of a sampler's batches on ``ops``'s device, following the feed's rules
    (see the module's docstring).  ``mode``: ``"copy"`` (CPU batches copied to the device),
    ``"pinned"`` (``pin_memory=True``: CPU batches from page-locked slots, kept, see
    `.keep`) or ``"resident"`` (batches made on the device in this process, rule 10).
    ``segments()``: the slot segments of the sampler's live managers (see
    `.pins.HostPins`).  Not thread-safe: the sampler calls it under its lock."""

    def __init__(self, ops, segments, *, mode="copy", max_in_flight=4, timing=True):
        import torch
        if mode not in ("copy", "pinned", "resident"):
            raise ValueError(f"mode must be 'copy', 'pinned' or 'resident', got {mode!r}")
        self._tensor = torch.Tensor
        self._ops = ops
        self.mode = mode
        self.copying = mode == "copy"
        self.pins = None if mode == "resident" else HostPins(ops, segments)
        self.kept = KeptBatches(ops, max_in_flight) if mode == "pinned" else None
        self._stream = ops.copy_stream() if self.copying else None
        self._max = max_in_flight
        self._timing = timing
        self._in_flight = collections.deque()   # _Copy, in issue order
        # id(cpu batch) -> (the batch, its _Copy) issued ahead of its hand-out, oldest
        # first (one per stream whose next batch is here; the batch is kept with it, so
        # that the id is its own)
        self._ahead = {}
        self._closing = False     # close() began: no copy is issued any more
        self.closed = False       # close() ended
        self._pid = _os.pid       # (a forked child never touches its parent's device)
        self._warned_stream = False
        self._copies = 0
        self._copy_s = 0.0
        self._wait_ns = 0
        self._pageable = 0

    # -- the caller's side ------------------------------------------------------------------

    def give(self, batch):
        """``batch`` (from a slot, or made in this process) handed out as the mode says."""
        mode = self.mode
        if mode == "copy":
            return self.hand_out(batch)
        if mode == "pinned":
            return self.pinned(batch)
        return self.resident(batch)

    def hand_out(self, cpu):
        """``cpu`` on the device, ordered on the caller's current stream (rules 2, 3, 6)."""
        t0 = time.perf_counter_ns()
        entry = self._ahead.pop(id(cpu), None)
        if entry is not None and entry[0] is cpu:
            copy = entry[1]
        else:
            copy = self._issue(cpu)
        ops = self._ops
        stream = ops.current_stream()
        if stream == self._stream:
            self._other_stream(stream)
        ops.wait(stream, copy.end)
        out = copy.out
        for t in _leaves(out, self._tensor):
            ops.hold(t, stream)
        self._retire()
        self._wait_ns += time.perf_counter_ns() - t0
        return out

    def start(self, cpu):
        """Issue the copy of ``cpu``, the stream's next batch, ahead of its hand-out
        (rule 6); not if its slot is still being page-locked (rule 7)."""
        ahead = self._ahead
        entry = ahead.get(id(cpu))
        if entry is not None and entry[0] is cpu:
            return
        t0 = time.perf_counter_ns()
        if self._notice(cpu):
            ahead[id(cpu)] = (cpu, self._issue(cpu))
            if len(ahead) > _AHEAD:
                # (batches started ahead and then dropped, by a reseed say: the oldest goes)
                del ahead[next(iter(ahead))]
        self._wait_ns += time.perf_counter_ns() - t0

    def pinned(self, cpu):
        """``cpu`` itself, its slot page-locked, and kept until the caller's copies of it
        are done (``pin_memory=True``, rule 9)."""
        t0 = time.perf_counter_ns()
        kept = self.kept
        kept.step()
        kept.add(self._pin(list(_leaves(cpu, self._tensor))))
        self._wait_ns += time.perf_counter_ns() - t0
        return cpu

    def notice(self, cpu):
        """Have the slot of ``cpu`` (a batch handed out later) page-locked, without waiting
        for it (rule 7)."""
        self._notice(cpu)

    def resident(self, value):
        """A batch made on the device in this process, ordered on the caller's current
        stream (rule 10); ``value`` as `gathered_on` tagged it."""
        if type(value) is not Gathered:
            return value
        ops = self._ops
        stream = ops.current_stream()
        if stream != value.stream:
            ops.wait(stream, value.event)
            for t in _leaves(value.batch, self._tensor):
                ops.hold(t, stream)
        return value.batch

    def gathered_on(self):
        """``(stream, event)``: the caller's current stream, and an event recorded there
        now, after a chunk was gathered on it (rule 10)."""
        ops = self._ops
        stream = ops.current_stream()
        return stream, ops.record(stream)

    # -- copies -----------------------------------------------------------------------------

    def _notice(self, cpu):
        """Hand the slots of ``cpu`` not page-locked yet to the pins' thread; False if one
        of them is being page-locked now."""
        pins = self.pins
        refreshed = False
        for t in _leaves(cpu, self._tensor):
            if t.numel() == 0:
                continue
            address = t.data_ptr()
            if pins.covers(address):
                continue
            if not refreshed:
                pins.refresh()
                refreshed = True
                if pins.covers(address):
                    continue
            if pins.registering(address) is not None:
                return False
        return True

    def _pin(self, leaves):
        """Have the slots of ``leaves`` page-locked, waiting for those being page-locked
        now (rule 7); count the leaves copied from pageable memory: those outside a
        registered range, and those that are not contiguous (copied through a pageable
        temporary).  Returns the leaves that lie in a registered range."""
        pins = self.pins
        refreshed = False
        locked = []
        for t in leaves:
            if t.numel() == 0:
                continue
            address = t.data_ptr()
            if not pins.covers(address):
                if not refreshed:
                    pins.refresh()
                    refreshed = True
                job = pins.registering(address)
                if job is not None:
                    pins.wait(job)
                if not pins.covers(address):
                    self._pageable += 1
                    continue
            locked.append(t)
            if not t.is_contiguous():
                self._pageable += 1
        refusal = pins.take_refusal()
        if refusal is not None:
            warnings.warn(f"unienv_mp: could not page-lock a batch slot for "
                          f"{self._ops.device} ({refusal}); batches are copied from "
                          f"pageable memory instead (slower, and the copy blocks the "
                          f"caller)", RuntimeWarning, stacklevel=5)
        return locked

    def _other_stream(self, current):
        """The caller made the copy stream its current stream (rule 2): take another."""
        self._stream = self._ops.copy_stream(avoid=current)
        if not self._warned_stream:
            self._warned_stream = True
            warnings.warn("unienv_mp: the current CUDA stream is the sampler's copy stream, "
                          "so its copies could not overlap the work queued there; the "
                          "sampler copies on another stream from now on (batches are "
                          "right either way)", RuntimeWarning, stacklevel=5)

    def _issue(self, cpu):
        if self._closing:
            raise RuntimeError("the device feed is closed")
        in_flight = self._in_flight
        self._retire()
        while len(in_flight) >= self._max:
            self._ops.synchronize(in_flight[0].end)   # (rule 5)
            self._retire()
        self._pin(list(_leaves(cpu, self._tensor)))
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
        mine = not self._closing and _os.pid == self._pid
        if mine and self.copying:
            self._retire()
        pins = self.pins
        if mine and pins is not None:
            pins.collect()
        kept = self.kept
        out = DeviceStats(
            device=str(self._ops.device) if self.mode != "pinned" else "cpu (pinned)",
            copies=self._copies, copy_seconds=self._copy_s, wait_seconds=self._wait_ns / 1e9,
            pinned_bytes=0 if pins is None else pins.pinned_bytes,
            pinned_slots=0 if pins is None else len(pins),
            pageable_leaves=self._pageable,
            in_flight=len(self._in_flight) + (0 if kept is None else len(kept)),
            registrations=0 if pins is None else pins.registrations,
            registration_seconds=0.0 if pins is None else pins.registration_ns / 1e9)
        if reset:
            self._copies = 0
            self._copy_s = 0.0
            self._wait_ns = 0
            self._pageable = 0
            if pins is not None:
                pins.reset()
        return out

    def close(self):
        """Wait for every copy in flight and for the page-locked batches let go, let go of
        the CPU batches, unregister every slot (rule 8).  Idempotent, and a close cut short
        (a Ctrl-C while it waits) is finished by the next; a device error is reported as a
        warning, not raised.  In a forked child, lets go of nothing made on the device (the
        device work is the parent's)."""
        if self.closed:
            return
        self._closing = True
        if _os.pid != self._pid:
            self._close_in_child()
            return
        self._ahead.clear()
        in_flight = self._in_flight
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
        if self.kept is not None:
            try:
                self.kept.close()
            except Exception as e:
                error = error or e
        if self.pins is not None:
            try:
                self.pins.close()
            except Exception as e:
                error = error or e
        self.closed = True
        if error is not None:
            warnings.warn(f"unienv_mp: a copy to {self._ops.device} failed while the sampler "
                          f"closed: {error}", RuntimeWarning, stacklevel=3)

    def _close_in_child(self):
        # A forked child: the copies, events and registrations are its parent's.  It
        # keeps what was made on the device (freeing it would call CUDA here), lets go of
        # its own copies of the mappings, and calls nothing on the device.
        keep_in_forked_child(self._ahead, self._in_flight, self._stream)
        if self.kept is not None:
            keep_in_forked_child(self.kept.events())
            self.kept.forget()
        self._ahead = {}
        self._in_flight = collections.deque()
        if self.pins is not None:
            self.pins.forget()
        self.closed = True


class Gathered:
    """A batch made on the device in this process, with the ``stream`` it was gathered on
    and an ``event`` recorded there after it (rule 10): what the resident manager hands the
    sampler's streams, and the feed unwraps at the hand-out."""
    __slots__ = ("batch", "stream", "event")

    def __init__(self, batch, stream, event):
        self.batch = batch
        self.stream = stream
        self.event = event


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
    one that copies to the device for ``"copy"``; one that hands out batches made in this
    process on a CUDA device for ``"in_process"``; one that page-locks the slots for CPU
    batches with ``pin_memory``, if CUDA can be used here (else one ``RuntimeWarning``, as
    torch's DataLoader gives, and plain slots)."""
    from . import ops as _ops
    from .placement import device_type
    kind = None if placement is None else placement.kind
    if pin_memory and kind in ("copy", "in_process"):
        raise ValueError(f"pin_memory=True hands out CPU batches from page-locked slots, but "
                         f"the batches go to {placement.device} already: leave pin_memory "
                         f"out")
    if kind == "copy":
        return DeviceFeed(_ops.for_device(placement.device), segments)
    if kind == "in_process":
        if device_type(placement.device) != "cuda":
            return None
        return DeviceFeed(_ops.for_device(placement.device), segments, mode="resident")
    if pin_memory:
        why = _ops.cuda_unavailable("cuda")
        if why is not None:
            warnings.warn(f"unienv_mp: pin_memory=True, but {why}: batches are handed out "
                          f"from pageable slots", RuntimeWarning, stacklevel=4)
            return None
        return DeviceFeed(_ops.for_device("cuda"), segments, mode="pinned")
    return None
