"""A fake ``torch.cuda`` for `unienv_mp._device.ops.CudaOps` (the feed's rules are run with
tests/_fake_device.py instead): what the CUDA runtime and torch do that the CPU cannot show.

* **The current device is per thread**, 0 in a new thread.  A runtime call that torch does
  not guard itself (``cudaHostRegister``, ``cudaHostUnregister``) acts on the calling
  thread's current device and makes a context there (``contexts``); torch's own streams,
  events and ``synchronize(device)`` guard their device, as torch does.
  ``torch.cuda.device(i)`` sets the thread's device and puts it back after.
* **Streams come from pools**, as torch's do: ``Stream()`` hands out the 32 ordinary
  streams of a device round-robin, ``Stream(priority=p)`` with ``p < 0`` those of a
  high-priority pool; each thread has a current stream per device (the default stream at
  first).
* **The last error is per thread.**  A refused registration (``refuse``: the code) sets it
  on the calling thread; ``cudaGetLastError`` (present unless ``get_last_error=False``, as
  in torch's binding today) reads and resets it; `FakeCuda.launch_check` is what torch
  does after a kernel launch on a thread.

`FakeCuda.install` puts it in place of ``torch.cuda``'s functions for one test.
"""
import threading

import torch

LOW_POOL = 32


def _index(device):
    """The index of ``device`` (an int, a string or a torch.device), None if it has none."""
    if device is None or isinstance(device, int):
        return device
    return torch.device(device).index


class FakeCudaStream:
    def __init__(self, device, name):
        self.device = torch.device("cuda", device)
        self.device_index = device
        self.name = name

    def wait_event(self, event):
        pass

    def __repr__(self):
        return f"<FakeCudaStream {self.name}>"


class FakeCudaEvent:
    def __init__(self, cuda, enable_timing=False):
        self._cuda = cuda
        self.timing = enable_timing
        self.stream = None

    def record(self, stream):
        self._cuda.runtime_call("event record", stream.device_index)   # (torch guards it)
        self.stream = stream

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 1.0


class _DeviceGuard:
    def __init__(self, cuda, device):
        self._cuda = cuda
        self._device = _index(device)

    def __enter__(self):
        self._prev = self._cuda.current_device()
        self._cuda.set_device(self._device)

    def __exit__(self, *exc):
        self._cuda.set_device(self._prev)


class _StreamGuard:
    def __init__(self, cuda, stream):
        self._cuda = cuda
        self._stream = stream

    def __enter__(self):
        cuda, stream = self._cuda, self._stream
        self._prev_device = cuda.current_device()
        self._prev_stream = cuda.current_stream(stream.device_index)
        cuda.set_device(stream.device_index)
        cuda._local_streams()[stream.device_index] = stream

    def __exit__(self, *exc):
        cuda = self._cuda
        cuda._local_streams()[self._stream.device_index] = self._prev_stream
        cuda.set_device(self._prev_device)


class FakeCudart:
    def __init__(self, cuda, get_last_error):
        self._cuda = cuda
        if get_last_error:
            self.cudaGetLastError = self._get_last_error

    def cudaHostRegister(self, ptr, size, flags):
        cuda = self._cuda
        cuda.runtime_call("cudaHostRegister")
        code = cuda.refuse or 0
        if code:
            cuda.set_last_error(code)
        else:
            cuda.registered[ptr] = size
        return code

    def cudaHostUnregister(self, ptr):
        cuda = self._cuda
        cuda.runtime_call("cudaHostUnregister")
        if cuda.registered.pop(ptr, None) is None:
            cuda.set_last_error(713)   # (cudaErrorHostMemoryNotRegistered)
            return 713
        return 0

    def _get_last_error(self):
        return self._cuda.take_last_error()


class FakeCuda:
    def __init__(self, n_devices=2, refuse=None, get_last_error=True):
        self.n_devices = n_devices
        self.refuse = refuse
        self.contexts = set()     # devices on which a runtime call ran
        self.calls = []           # (what, thread name, device)
        self.registered = {}
        self._last_errors = {}    # thread ident -> the runtime's last error there
        self._local = threading.local()
        self._pools = {}          # (device, pool) -> (streams, next index)
        self._defaults = {d: FakeCudaStream(d, f"default{d}") for d in range(n_devices)}
        self.cudart = FakeCudart(self, get_last_error)

    # -- what the fake's users read ---------------------------------------------------------

    def launch_check(self):
        """What torch does after a kernel launch on this thread: the error left there, now
        reported as the kernel's (0: none)."""
        return self.take_last_error()

    def streams_made(self, device=0, pool=0):
        return list(self._pools.get((device, pool), ([], 0))[0])

    # -- the runtime ------------------------------------------------------------------------

    def runtime_call(self, what, device=None):
        if device is None:
            device = self.current_device()
        self.contexts.add(device)
        self.calls.append((what, threading.current_thread().name, device))

    def set_last_error(self, code):
        self._last_errors[threading.get_ident()] = code

    def take_last_error(self):
        return self._last_errors.pop(threading.get_ident(), 0)

    # -- torch.cuda's functions -------------------------------------------------------------

    def current_device(self):
        return getattr(self._local, "device", 0)

    def set_device(self, device):
        self._local.device = device

    def device(self, device):
        return _DeviceGuard(self, device)

    def _local_streams(self):
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        return streams

    def current_stream(self, device=None):
        index = _index(device)
        if index is None:
            index = self.current_device()
        return self._local_streams().get(index, self._defaults[index])

    def stream(self, stream):
        return _StreamGuard(self, stream)

    def make_stream(self, device=None, priority=0):
        index = _index(device)
        if index is None:
            index = self.current_device()
        pool = 0 if priority >= 0 else min(-priority, 3)
        streams, i = self._pools.get((index, pool), (None, 0))
        if streams is None:
            streams = [FakeCudaStream(index, f"pool{pool}.{k}") for k in range(LOW_POOL)]
        self.runtime_call("stream", index)   # (torch guards it)
        self._pools[(index, pool)] = (streams, i + 1)
        return streams[i % LOW_POOL]

    def event(self, enable_timing=False):
        return FakeCudaEvent(self, enable_timing)

    def synchronize(self, device=None):
        index = _index(device)
        if index is None:
            index = self.current_device()
        self.runtime_call("synchronize", index)   # (torch guards it)

    def install(self, monkeypatch):
        cuda = torch.cuda

        def Stream(device=None, priority=0):
            return self.make_stream(device, priority)
        Stream.priority_range = staticmethod(lambda: (0, -3))

        monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: self.n_devices)
        monkeypatch.setattr(cuda, "current_device", self.current_device)
        monkeypatch.setattr(cuda, "set_device", self.set_device)
        monkeypatch.setattr(cuda, "device", self.device)
        monkeypatch.setattr(cuda, "Stream", Stream)
        monkeypatch.setattr(cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(cuda, "stream", self.stream)
        monkeypatch.setattr(cuda, "Event", self.event)
        monkeypatch.setattr(cuda, "synchronize", self.synchronize)
        monkeypatch.setattr(cuda, "cudart", lambda: self.cudart)
        return self
