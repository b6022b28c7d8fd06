"""Slot segments page-locked for the device: each registered once, on a thread of the pins'
own, and unregistered there before it can be unmapped.

A pageable slot copies to a GPU at a quarter of the link's speed and blocks the caller; a
registered one copies at full speed, asynchronously.  Registering costs milliseconds (about
5 ms for 12.6 MB), so each segment is registered once, and stays registered while it backs
a slot.

**Off the caller's thread.**  Slots are made while the pipeline fills, over the first
hundreds of steps, and now and then later; a registration made on the caller's thread
would land inside those training steps.  So `HostPins.refresh` only hands each new segment
to the pins' thread (`_Registrar`; torch's binding of ``cudaHostRegister`` lets go of the
GIL while it runs), and the caller goes on.  It is called as soon as the feed meets an
address it does not cover, which is when a batch of a new slot is first seen (the next
batch, for the copies issued ahead), so the registration usually runs while earlier batches
are being used.  A batch whose segment is still being registered when it must be copied or
handed out waits for that registration (`HostPins.wait`): a range is never copied from
while it is being registered, and a ``pin_memory`` batch is page-locked when handed out.
`stats().device` counts the registrations and their time.

**Errors stay on that thread.**  A refused (un)registration leaves its error as the CUDA
runtime's last error of the thread that made it, which torch reads after its kernel
launches and would report as theirs.  It is reset where a way to is found
(`unienv_mp._device.ops.clear_last_error`); where none is (libcudart linked statically),
it stays on the pins' thread, from which torch never launches anything.

**Never unmapped while registered.**  A mapping unmapped while still registered breaks
later, unrelated pinning in the process ("invalid argument").  A `Pin` holds a buffer view
of its segment, and a `Segment` is never unmapped while a view of it lives (its ``close``
only marks it; the unmap waits for the last view).  So the order is fixed by construction:
the pins' thread unregisters, then releases the view.

**Unregistered once nothing reads it.**  A segment leaves when it no longer backs a slot of
a live manager (the worker grew the slot into a new segment, died, or its manager closed)
and nothing but the pin views it: no batch of the caller's, no copy in flight (the feed
holds a copy's CPU batch until the copy has completed), and no ``pin_memory`` batch the
caller let go of while a copy of it may still run (the feed keeps those, see `.keep`).
That is ``segment.users == 1``.  Such segments are swept at each `HostPins.refresh`, and at
`HostPins.close`.  The table of registered ranges changes on the caller's thread alone (the
pins' thread only runs the calls and says when each is done), so `HostPins.covers` reads
it without a lock.

A refused registration (a memlock limit, say) gives one ``RuntimeWarning`` and no more
attempts: the batches copy from pageable memory, correctly but synchronously.  A range
already page-locked by someone else (CUDA error 712) is used as it is, and never
unregistered by the pins.
"""
import bisect
import collections
import threading
import time

from .. import _os
from .ops import ALREADY_REGISTERED, RegistrationRefused

__all__ = ["HostPins", "Pin"]


class Pin:
    """One segment registered (or being registered): the segment, the view that keeps it
    mapped, the range, and whether the pins registered it (``owned``; False for a range
    that someone else had page-locked already)."""
    __slots__ = ("segment", "view", "address", "nbytes", "owned")

    def __init__(self, segment, view, address, nbytes):
        self.segment = segment
        self.view = view
        self.address = address
        self.nbytes = nbytes
        self.owned = True


class _Job:
    """One registration (``register``) or unregistration of ``pin`` for the pins' thread:
    made and taken in on the caller's thread, run on the pins' thread, which sets ``done``
    once it ran (``error``: what it raised; ``ns``: how long it took)."""
    __slots__ = ("pin", "register", "error", "ns", "done")

    def __init__(self, pin, register):
        self.pin = pin
        self.register = register
        self.error = None
        self.ns = 0
        self.done = threading.Event()

    def run(self, ops):
        pin = self.pin
        t0 = time.perf_counter_ns()
        try:
            if self.register:
                ops.register(pin.address, pin.nbytes)
            else:
                ops.unregister(pin.address)
        except BaseException as e:
            self.error = e
        finally:
            self.ns = time.perf_counter_ns() - t0
            if not self.register:
                pin.view.release()   # (only now: unregistered before it can be unmapped)
            self.done.set()


class _Registrar:
    """The pins' thread: runs `_Job` s in the order given, started at the first."""

    def __init__(self, ops):
        self._ops = ops
        self._cv = threading.Condition(threading.Lock())
        self._queue = collections.deque()
        self._thread = None
        self._stopping = False

    def submit(self, job):
        with self._cv:
            self._queue.append(job)
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="unienv_mp page-locking")
                self._thread.start()
            else:
                self._cv.notify()

    def _run(self):
        cv = self._cv
        queue = self._queue
        while True:
            with cv:
                while not queue and not self._stopping:
                    cv.wait()
                if not queue:
                    return
                job = queue.popleft()
            job.run(self._ops)

    def stop(self):
        """End the thread once it ran every job given (idempotent)."""
        with self._cv:
            thread = self._thread
            if thread is None:
                return
            self._stopping = True
            self._cv.notify()
        thread.join()
        with self._cv:
            if self._thread is thread:
                self._thread = None


class HostPins:
    """The slot segments registered with ``ops``'s device.  ``segments()`` returns the
    segments that back slots now (of every live manager of the sampler).  Used on the
    caller's thread only (the sampler's lock held), but for the work it hands to its own."""

    def __init__(self, ops, segments):
        self._ops = ops
        self._segments = segments
        self._starts = []   # addresses of the registered pins, ascending
        self._pins = []     # the registered pins, in the same order
        self._known = {}    # id(segment) -> its Pin: registered, being registered, or 712
        self._jobs = []     # the jobs handed to the pins' thread and not taken in yet
        self._registrar = _Registrar(ops)
        self._pid = _os.pid
        self.refused = None   # the first refusal: no registration is tried after it
        self._unwarned = None   # a refusal not reported yet (see take_refusal)
        self.pinned_bytes = 0
        self.registrations = 0      # registrations done (see reset)
        self.registration_ns = 0    # ... and their time on the pins' thread
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

    def registering(self, address):
        """The registration under way of the segment ``address`` lies in, or None."""
        for job in self._jobs:
            pin = job.pin
            if job.register and pin.address <= address < pin.address + pin.nbytes:
                return job
        return None

    def wait(self, job):
        """Block until ``job`` (see `registering`) ran, and take it in."""
        job.done.wait()
        self.collect()

    def refresh(self):
        """Take in the work done; hand the segments backing slots now that are not known
        yet to the pins' thread; then sweep (see the module's docstring)."""
        self.collect()
        current = list(self._segments())
        if self.refused is None:
            known = self._known
            for seg in current:
                if id(seg) not in known and not seg.closed:
                    self._submit(seg)
        self.sweep({id(s) for s in current})

    def collect(self):
        """Take in the jobs that the pins' thread has run: a range registered enters the
        table (`covers`)."""
        jobs = self._jobs
        if not jobs or not any(job.done.is_set() for job in jobs):
            return
        # (one step a Ctrl-C cannot cut: each job is taken in exactly once)
        with _os.interrupts_deferred():
            self._jobs = [job for job in jobs if not job.done.is_set()]
            for job in jobs:
                if job.done.is_set():
                    self._take_in(job)

    def take_refusal(self):
        """The first refusal, once (for the caller to report), or None."""
        refusal, self._unwarned = self._unwarned, None
        return refusal

    def reset(self):
        """Start the counts of registrations again from zero."""
        self.registrations = 0
        self.registration_ns = 0

    def sweep(self, current_ids):
        """Unregister the pins of segments not in ``current_ids`` that nothing else
        views."""
        for pin in [p for p in self._pins
                    if id(p.segment) not in current_ids and p.segment.users <= 1]:
            self._unpin(pin)

    def close(self):
        """Unregister every segment, on the pins' thread, and end it (the feed has let go of
        its batches first).  Batches the caller still holds (``pin_memory=True``) may still
        be read by copies the caller queued: the device finishes its queued work first.  A
        close cut short (Ctrl-C) is finished by the next."""
        for job in list(self._jobs):
            job.done.wait()
        self.collect()
        if any(p.segment.users > 1 for p in self._pins):
            self._ops.synchronize_device()
        for pin in list(self._pins):
            self._unpin(pin)
        for job in list(self._jobs):
            job.done.wait()
        self.collect()
        for pin in list(self._known.values()):   # (none left but by a close cut short)
            self._known.pop(id(pin.segment), None)
            pin.view.release()
        if self._registrar is not None:
            self._registrar.stop()

    def forget(self):
        """Drop every pin without a device call, and without the pins' thread (in a forked
        child: the registrations, and the thread, are its parent's)."""
        pins = list(self._known.values())
        self._pins, self._starts, self._known, self._jobs = [], [], {}, []
        self.pinned_bytes = 0
        self._registrar = None
        for pin in pins:
            pin.view.release()

    # -- the steps, each one a Ctrl-C cannot cut --------------------------------------------

    def _submit(self, seg):
        with _os.interrupts_deferred():
            view = memoryview(seg)   # (first: the mapping now lives at least as long as it)
            pin = Pin(seg, view, seg.address, seg.size)
            job = _Job(pin, True)
            self._known[id(seg)] = pin
            self._jobs.append(job)
            self._registrar.submit(job)

    def _take_in(self, job):
        pin = job.pin
        if not job.register:
            if job.error is not None and not self._warned_unregister:
                self._warned_unregister = True
                import warnings
                warnings.warn(f"unienv_mp: could not unregister a batch slot from "
                              f"{self._ops.device}: {job.error}", RuntimeWarning,
                              stacklevel=5)
            return
        self.registration_ns += job.ns
        error = job.error
        if error is not None and not (isinstance(error, RegistrationRefused)
                                      and error.errno == ALREADY_REGISTERED):
            del self._known[id(pin.segment)]
            pin.view.release()
            if self.refused is None:
                self.refused = self._unwarned = error
            return
        if error is not None:
            pin.owned = False    # (page-locked by someone else: used, never unregistered)
        else:
            self.registrations += 1
            self.pinned_bytes += pin.nbytes
        i = bisect.bisect_right(self._starts, pin.address)
        self._starts.insert(i, pin.address)
        self._pins.insert(i, pin)

    def _unpin(self, pin):
        with _os.interrupts_deferred():
            i = self._pins.index(pin)
            del self._pins[i]
            del self._starts[i]
            del self._known[id(pin.segment)]
            if not pin.owned:
                pin.view.release()
                return
            self.pinned_bytes -= pin.nbytes
            job = _Job(pin, False)
            self._jobs.append(job)
            self._registrar.submit(job)
