"""What the feed and the pins ask of a device: the seam between the ordering rules (in
`.feed` and `.pins`) and CUDA.

`DeviceOps` names the operations; `CudaOps` does them with torch.  The CPU tests give the
same feed a fake device whose copies complete later, so that CI, which has no GPU, runs
every rule (tests/_fake_device.py).

Everything here runs in the training process; workers never touch a device.
"""
import ctypes
import sys

__all__ = ["DeviceOps", "CudaOps", "RegistrationRefused", "for_device", "cuda_unavailable"]


class RegistrationRefused(OSError):
    """The device would not page-lock a host range (a memlock limit, no CUDA, an address
    it does not take).  The feed then copies from pageable memory."""


class DeviceOps:
    """The operations of one device that the feed and the pins use.

    ``device`` is the device batches are copied to (a ``torch.device``).  A *stream* and
    an *event* are whatever the implementation makes; the feed only passes them back."""
    device = None

    def copy_stream(self):
        """The sampler's own stream, on which every copy is issued."""
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
    """`DeviceOps` of one CUDA device, through torch."""

    def __init__(self, device):
        import torch
        self._torch = torch
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaOps takes a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._stream = torch.cuda.Stream(device=device)
        self._cudart = torch.cuda.cudart()

    def copy_stream(self):
        return self._stream

    def current_stream(self):
        return self._torch.cuda.current_stream(self.device)

    def copy(self, tensor, stream):
        with self._torch.cuda.stream(stream):
            return tensor.to(self.device, non_blocking=True)

    def record(self, stream, timing=False):
        event = self._torch.cuda.Event(enable_timing=timing)
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
        self._torch.cuda.synchronize(self.device)

    def hold(self, tensor, stream):
        tensor.record_stream(stream)

    def register(self, address, nbytes):
        # cudaHostRegisterPortable (1): pinned for every CUDA context, as torch's own
        # pin_memory does.
        code = int(self._cudart.cudaHostRegister(address, nbytes, 1))
        if code != 0:
            _clear_last_error(self._cudart)
            raise RegistrationRefused(code, f"cudaHostRegister of {nbytes} bytes at "
                                            f"{address:#x} failed: {_error(code, self._torch)}")

    def unregister(self, address):
        code = int(self._cudart.cudaHostUnregister(address))
        if code != 0:
            _clear_last_error(self._cudart)
            raise RegistrationRefused(code, f"cudaHostUnregister at {address:#x} failed: "
                                            f"{_error(code, self._torch)}")


def _error(code, torch):
    try:
        return f"{torch.cuda.CudaError(code)}"
    except Exception:
        return f"CUDA error {code}"


def _clear_last_error(cudart):
    """Reset the CUDA runtime's last error after a refused (un)registration: torch checks
    it after every kernel launch, and would report this one there as its own."""
    get = getattr(cudart, "cudaGetLastError", None)
    if get is not None:
        get()
        return
    # (older torch: the runtime torch loaded, found among this process's mappings; a
    # dlopen of a loaded library returns that library)
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
        for path in sorted(paths):
            lib = ctypes.CDLL(path)
            lib.cudaGetLastError()
            return
    except (OSError, AttributeError):
        print("unienv_mp: could not reset CUDA's last error after a refused host "
              "registration", file=sys.stderr)
