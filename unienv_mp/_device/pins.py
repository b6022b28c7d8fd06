"""Slot segments page-locked for the device: each registered once, unregistered before it
can be unmapped.

A pageable slot copies to a GPU at a quarter of the link's speed and blocks the caller; a
registered one copies at full speed, asynchronously.  Registering costs milliseconds (about
5 ms for 12.6 MB), so each segment is registered once, when the first batch in it is met,
and stays registered while it backs a slot.

**Never unmapped while registered.**  A mapping unmapped while still registered breaks
later, unrelated pinning in the process ("invalid argument").  A `Pin` holds a buffer view
of its segment, and a `Segment` is never unmapped while a view of it lives (its ``close``
only marks it; the unmap waits for the last view).  So the order is fixed by construction:
`HostPins._unpin` unregisters, then releases the view.

**Unregistered once nothing reads it.**  A segment leaves when it no longer backs a slot of
a live manager (the worker grew the slot into a new segment, died, or its manager closed)
and nothing but the pin views it: no batch of the caller's, and no copy in flight (the
feed holds a copy's CPU batch until the copy has completed, see `.feed`).  That is
``segment.users == 1``.  Such segments are swept whenever a new one is registered, and at
`HostPins.close`.

A refused registration (a memlock limit, say) gives one ``RuntimeWarning`` and no more
attempts: the batches copy from pageable memory, correctly but synchronously.
"""
import bisect
import warnings

from .. import _os
from .ops import RegistrationRefused

__all__ = ["HostPins", "Pin"]


class Pin:
    """One registered segment: the segment, the view that keeps it mapped, and the range
    registered."""
    __slots__ = ("segment", "view", "address", "nbytes")

    def __init__(self, segment, view, address, nbytes):
        self.segment = segment
        self.view = view
        self.address = address
        self.nbytes = nbytes


class HostPins:
    """The slot segments registered with ``ops``'s device.  ``segments()`` returns the
    segments that back slots now (of every live manager of the sampler)."""

    def __init__(self, ops, segments):
        self._ops = ops
        self._segments = segments
        self._starts = []   # addresses of the pins, ascending
        self._pins = []     # the pins, in the same order
        self.refused = None   # the first refusal: no registration is tried after it
        self.pinned_bytes = 0
        self.registrations = 0
        self._warned_unregister = False

    def __len__(self):
        return len(self._pins)

    def covers(self, address):
        """True if ``address`` lies in a registered range."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return False
        pin = self._pins[i]
        return address < pin.address + pin.nbytes

    def refresh(self):
        """Register the segments backing slots now that are not registered yet, then
        sweep (see the module's docstring)."""
        current = list(self._segments())
        ids = {id(s) for s in current}
        if self.refused is None:
            known = {id(p.segment) for p in self._pins}
            for seg in current:
                if id(seg) not in known and not seg.closed:
                    self._pin(seg)
                    if self.refused is not None:
                        break
        self.sweep(ids)

    def sweep(self, current_ids):
        """Unregister the pins of segments not in ``current_ids`` that nothing else
        views."""
        for pin in [p for p in self._pins
                    if id(p.segment) not in current_ids and p.segment.users <= 1]:
            self._unpin(pin)

    def close(self):
        """Unregister every segment (the feed has waited for its copies first).  Batches
        the caller still holds (``pin_memory=True``) may still be read by copies the
        caller queued: the device finishes its queued work first."""
        if any(p.segment.users > 1 for p in self._pins):
            self._ops.synchronize_device()
        for pin in list(self._pins):
            self._unpin(pin)

    def forget(self):
        """Drop every pin without a device call (in a forked child, whose parent owns the
        registrations)."""
        pins, self._pins, self._starts = self._pins, [], []
        self.pinned_bytes = 0
        for pin in pins:
            pin.view.release()

    def _pin(self, seg):
        # (one step a Ctrl-C cannot cut: registered exactly when recorded)
        with _os.interrupts_deferred():
            self._pin_now(seg)

    def _pin_now(self, seg):
        view = memoryview(seg)   # (first: the mapping now lives at least as long as the pin)
        address, nbytes = seg.address, seg.size
        try:
            self._ops.register(address, nbytes)
        except RegistrationRefused as e:
            view.release()
            self.refused = e
            warnings.warn(f"unienv_mp: could not page-lock a {nbytes}-byte batch slot for "
                          f"{self._ops.device} ({e}); batches are copied from pageable "
                          f"memory instead (slower, and the copy blocks the caller)",
                          RuntimeWarning, stacklevel=4)
            return
        i = bisect.bisect_right(self._starts, address)
        self._starts.insert(i, address)
        self._pins.insert(i, Pin(seg, view, address, nbytes))
        self.pinned_bytes += nbytes
        self.registrations += 1

    def _unpin(self, pin):
        # (one step a Ctrl-C cannot cut: the view goes only after the unregistration)
        with _os.interrupts_deferred():
            self._unpin_now(pin)

    def _unpin_now(self, pin):
        i = self._pins.index(pin)
        del self._pins[i]
        del self._starts[i]
        self.pinned_bytes -= pin.nbytes
        try:
            self._ops.unregister(pin.address)
        except Exception as e:   # (a device gone bad: the view goes all the same)
            if not self._warned_unregister:
                self._warned_unregister = True
                warnings.warn(f"unienv_mp: could not unregister a batch slot from "
                              f"{self._ops.device}: {e}", RuntimeWarning, stacklevel=3)
        finally:
            pin.view.release()   # (last: unregistered before it can be unmapped)
