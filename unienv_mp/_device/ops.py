"""What the feed and the pins ask of a device: the seam between the ordering rules (in
`.feed`, `.keep` and `.pins`) and CUDA.

`DeviceOps` names the operations; `CudaOps` does them with torch.  The CPU tests give the
same feed a fake device whose copies complete later, so that CI, which has no GPU, runs
every rule (tests/_fake_device.py); and they give `CudaOps` a fake ``torch.cuda``
(tests/_fake_cuda.py) to hold it to the device it was made for, its own stream, and the
errors it leaves behind.

Everything here runs in the training process; workers never touch a device.
"""
import contextlib
import ctypes

__all__ = ["DeviceOps", "CudaOps", "RegistrationRefused", "ALREADY_REGISTERED", "for_device",
           "cuda_unavailable"]

#: ``cudaErrorHostMemoryAlreadyRegistered``: the range, or part of it, is page-locked
#: already (by someone else: the pins never register a range twice).
ALREADY_REGISTERED = 712

#: How many streams `CudaOps.copy_stream` draws at most to find one other than the one to
#: avoid (torch hands its streams out round-robin from a pool of 32 per priority).
_STREAM_TRIES = 64


class RegistrationRefused(OSError):
    """The device would not page-lock a host range (a memlock limit, no CUDA, an address
    it does not take; ``errno`` is the CUDA error code).  The feed then copies from
    pageable memory."""


class DeviceOps:
    """The operations of one device that the feed and the pins use.

    ``device`` is the device batches are copied to (a ``torch.device``).  A *stream* and
    an *event* are whatever the implementation makes; the feed only passes them back, and
    compares streams with ``==``.  Every operation acts on ``device``, whichever device is
    current in the calling thread.  `register` and `unregister` are called on the pins' own
    thread (see `.pins`), the others on the caller's."""
    device = None

    def copy_stream(self, avoid=None):
        """A stream of the sampler's own for its copies: never the device's default
        stream, nor one that work queued on the caller's ordinary streams can share; one
        other than ``avoid`` (a stream), if given.  Each call may give another."""
        raise NotImplementedError

    def current_stream(self):
        """The caller's current stream on ``device``."""
        raise NotImplementedError

    def copy(self, tensor, stream):
        """Issue a copy of CPU ``tensor`` to the device on ``stream``, without waiting for
        it; return the device tensor (allocated for ``stream``)."""
        raise NotImplementedError

    def record(self, stream, timing=False):
        """An event recorded on ``stream`` now (``timing``: one that can be timed)."""
        raise NotImplementedError

    def done(self, event):
        """True once the work recorded before ``event`` has completed (never blocks)."""
        raise NotImplementedError

    def synchronize(self, event):
        """Block until ``event`` has completed."""
        raise NotImplementedError

    def elapsed(self, start, end):
        """Seconds between two completed timing events."""
        raise NotImplementedError

    def wait(self, stream, event):
        """Make the later work of ``stream`` wait for ``event`` (no host wait)."""
        raise NotImplementedError

    def synchronize_device(self):
        """Block until all the work queued on the device, on every stream, has
        completed."""
        raise NotImplementedError

    def hold(self, tensor, stream):
        """Tell the allocator that ``tensor`` is used on ``stream``, so that its memory is
        not reused before ``stream``'s work enqueued before it is freed has completed."""
        raise NotImplementedError

    def register(self, address, nbytes):
        """Page-lock host memory ``[address, address + nbytes)`` for the device; raise
        `RegistrationRefused` if the device will not."""
        raise NotImplementedError

    def unregister(self, address):
        """Undo `register` of the range starting at ``address``."""
        raise NotImplementedError


def cuda_unavailable(device):
    """Why batches cannot go to CUDA device ``device`` in this process (a sentence), or
    None if they can.  Runs no CUDA call but ``torch.cuda.is_available``."""
    try:
        import torch
    except ImportError:
        return f"device={device!r} needs CUDA through torch, and torch is not installed"
    if not torch.backends.cuda.is_built():
        return (f"device={device!r} needs CUDA, but this torch {torch.__version__} is a "
                f"CPU-only build")
    if not torch.cuda.is_available():
        return (f"device={device!r} needs CUDA, but torch.cuda.is_available() is False "
                f"here (no GPU visible to this process)")
    return None


def for_device(device):
    """The `DeviceOps` of ``device`` (a CUDA device); raises ``RuntimeError`` naming CUDA
    where it cannot be used.  (The tests replace this function to hand the sampler a fake
    device.)"""
    why = cuda_unavailable(device)
    if why is not None:
        raise RuntimeError(why)
    return CudaOps(device)


class CudaOps(DeviceOps):
    """`DeviceOps` of one CUDA device, through torch.

    **Its device, whichever is current.**  The CUDA runtime acts on the calling thread's
    current device, and a thread starts on device 0: a host registration made there while
    the sampler's device is ``cuda:1`` (a DDP process) would make a context on GPU 0 and
    pin the memory for it.  So every call that is not tied to a stream or an event of the
    device (registrations, events made, streams made, the device synchronised) runs under
    ``torch.cuda.device(device)``, which puts the calling thread's device back after
    without making a context on it.

    **Its own stream.**  ``torch.cuda.Stream()`` hands out streams round-robin from a
    small pool, which the application draws from too: the sampler's copies could land on
    the stream the training step runs on, and nothing would overlap.  The copy stream is
    drawn from the high-priority pool instead, which ordinary streams (and the default
    stream) never come from; the feed also checks at each hand-out that it is not the
    caller's current stream (see `.feed`)."""

    def __init__(self, device):
        import torch
        self._torch = torch
        self._cuda = torch.cuda
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaOps takes a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._cudart = torch.cuda.cudart()

    def _on_device(self):
        return self._cuda.device(self.device)

    def copy_stream(self, avoid=None):
        """A stream of ``device``'s high-priority pool (one other than ``avoid``, if
        given)."""
        cuda = self._cuda
        with self._on_device():
            try:
                high = cuda.Stream.priority_range()[1]
            except Exception:
                high = -1
            for _ in range(_STREAM_TRIES):
                stream = cuda.Stream(device=self.device, priority=high)
                if avoid is None or stream != avoid:
                    return stream
        return stream

    def current_stream(self):
        return self._cuda.current_stream(self.device)

    def copy(self, tensor, stream):
        with self._cuda.stream(stream):
            return tensor.to(self.device, non_blocking=True)

    def record(self, stream, timing=False):
        with self._on_device():
            event = self._cuda.Event(enable_timing=timing)
            event.record(stream)
        return event

    def done(self, event):
        return event.query()

    def synchronize(self, event):
        event.synchronize()

    def elapsed(self, start, end):
        return start.elapsed_time(end) / 1e3

    def wait(self, stream, event):
        stream.wait_event(event)

    def synchronize_device(self):
        with self._on_device():
            self._cuda.synchronize(self.device)

    def hold(self, tensor, stream):
        tensor.record_stream(stream)

    def register(self, address, nbytes):
        # cudaHostRegisterPortable (1): pinned for every CUDA context, as torch's own
        # pin_memory does.
        with self._on_device():
            code = int(self._cudart.cudaHostRegister(address, nbytes, 1))
            if code != 0:
                clear_last_error(self._cudart)
        if code != 0:
            raise RegistrationRefused(code, f"cudaHostRegister of {nbytes} bytes at "
                                            f"{address:#x} failed: {_error(code, self._cuda)}")

    def unregister(self, address):
        with self._on_device():
            code = int(self._cudart.cudaHostUnregister(address))
            if code != 0:
                clear_last_error(self._cudart)
        if code != 0:
            raise RegistrationRefused(code, f"cudaHostUnregister at {address:#x} failed: "
                                            f"{_error(code, self._cuda)}")


def _error(code, cuda):
    try:
        return f"{cuda.CudaError(code)}"
    except Exception:
        return f"CUDA error {code}"


def clear_last_error(cudart):
    """Reset the CUDA runtime's last error in this thread after a refused (un)registration,
    where a way to is found; True if one was.

    The last error is kept per thread (and per copy of the runtime loaded), and torch reads
    it on its own thread after each kernel launch, so an error left there would be reported
    as that kernel's.  The pins (un)register on a thread of their own, which torch never
    launches from (see `.pins`): an error that cannot be reset here (libcudart linked
    statically into torch, so that its symbols are hidden) stays on that thread, harmless.
    Tried in turn: the runtime binding's own ``cudaGetLastError`` (newer torch); the symbol
    as this process resolves it; each libcudart mapped in this process (a runtime loaded
    twice, from two paths, has two last errors: both are reset)."""
    get = getattr(cudart, "cudaGetLastError", None)
    if get is not None:
        try:
            get()
            return True
        except Exception:
            pass
    cleared = False
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).cudaGetLastError()
        cleared = True
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[5] for line in f
                     if "libcudart" in line and len(line.split()) == 6}
    except OSError:
        paths = ()
    for path in sorted(paths):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(path).cudaGetLastError()
            cleared = True
    return cleared
