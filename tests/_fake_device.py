"""A fake device for the device feed (unienv_mp._device.ops.DeviceOps), whose copies
complete later, so that the CPU tests run the feed's ordering and release rules.

* Each stream has its own queue, run in order; streams run independently of each other,
  except where one waits for an event of another (``wait``).  An event is a position in
  its stream's queue.
* A copy from page-locked (registered), contiguous memory is queued when issued and made
  when its stream runs it: only then are the source's bytes read, by address (the fake
  keeps no reference to the source).  So a slot given back to its worker before its copy
  completed, and written again, shows up as a wrong batch.  A copy from pageable memory, or
  of a tensor that is not contiguous, is staged at once (as CUDA stages pageable memory
  through a buffer of its own before the call returns); it too completes later.
* The caller's own copies (``user_copy``: ``.to("cuda", non_blocking=True)``) go on the
  current stream (``current``, which a test may change, as ``torch.cuda.stream(s)`` does).
* Each stream runs ``speed`` queued operations at each ``done()`` query (0: only when
  something synchronizes, or :meth:`FakeOps.run_all`).
* Registrations are checked: no range registered twice, each range mapped while it is
  registered, none unregistered while a copy that reads it is queued.  What is wrong is
  appended to ``violations``.  Registrations may come from any thread (``threads`` says
  which made each).
* Events and device tensors remember the process that made them: one freed in another
  process (a forked child) is a violation too, appended to the list that process sees.
"""
import ctypes
import os
import threading
import time
import weakref

import torch

from unienv_mp._device.ops import DeviceOps, RegistrationRefused


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.ops = []        # ("copy", src address, nbytes, dst) | ("staged", data, dst)
        #                      | ("wait", event); None once run
        self.completed = 0   # ops[:completed] have run
        self.copies = 0      # copies issued on it

    def __repr__(self):
        return f"<FakeStream {self.name}>"


class FakeEvent:
    __slots__ = ("stream", "pos", "timing", "pid", "report", "__weakref__")

    def __init__(self, stream, pos, timing, report):
        self.stream = stream
        self.pos = pos
        self.timing = timing
        self.pid = os.getpid()
        self.report = report

    def __del__(self):
        if os.getpid() != self.pid:
            self.report.append(f"an event of process {self.pid} destroyed in {os.getpid()}")


def _freed_elsewhere(report, pid):
    if os.getpid() != pid:
        report.append(f"a device tensor of process {pid} freed in {os.getpid()}")


def _mapped_ranges():
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            out.append((lo, hi))
    return out


def _is_mapped(address, nbytes, ranges):
    return any(lo <= address and address + nbytes <= hi for lo, hi in ranges)


class FakeOps(DeviceOps):
    def __init__(self, device="cuda:0", speed=0, refuse=False):
        self.device = torch.device(device)
        self.speed = speed
        self.refuse = refuse
        self.caller_stream = FakeStream("caller")
        self.current = self.caller_stream   # the caller's current stream
        self.copy_streams = []              # the streams copy_stream() made
        self.streams = [self.caller_stream]
        self._lock = threading.RLock()      # (registrations come from another thread)
        self.registered = {}     # address -> nbytes
        self.registering = {}    # address -> nbytes, while a registration runs
        self.register_delay = 0.0   # seconds each registration takes
        self.registrations = 0
        self.unregistrations = 0
        self.threads = set()     # names of the threads that (un)registered
        self.violations = []
        self.waited = []         # (stream waiting, event's stream, event's position)
        self.held = []           # (data_ptr, stream name) of tensors handed to a stream
        self.fail_copies = 0     # the next n copies raise, as a device out of memory would
        self.copies = 0
        self.staged = 0          # copies staged at once (pageable or not contiguous)
        self.device_syncs = 0

    # -- streams and events ---------------------------------------------------------------

    def copy_stream(self, avoid=None):
        stream = FakeStream(f"copy{len(self.copy_streams)}")
        self.copy_streams.append(stream)
        self.streams.append(stream)
        return stream

    def side_stream(self, name="side"):
        """Another stream of the caller's (as ``torch.cuda.Stream()``)."""
        stream = FakeStream(name)
        self.streams.append(stream)
        return stream

    def current_stream(self):
        return self.current

    def copy(self, tensor, stream):
        if stream not in self.copy_streams:
            self.violations.append(f"a copy issued on {stream}, not a copy stream")
        if self.fail_copies:
            self.fail_copies -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        return self._enqueue_copy(tensor, stream)

    def user_copy(self, batch):
        """The caller's ``.to("cuda", non_blocking=True)`` of every tensor of ``batch``, on
        the current stream."""
        if isinstance(batch, dict):
            return {k: self.user_copy(v) for k, v in batch.items()}
        if isinstance(batch, (tuple, list)):
            return type(batch)(self.user_copy(v) for v in batch)
        return self._enqueue_copy(batch, self.current)

    def _enqueue_copy(self, tensor, stream):
        out = torch.full_like(tensor, 0)
        f = weakref.finalize(out, _freed_elsewhere, self.violations, os.getpid())
        f.atexit = False
        nbytes = tensor.numel() * tensor.element_size()
        src = tensor.data_ptr()
        with self._lock:
            pinned = tensor.is_contiguous() and self.covers(src, nbytes)
            if any(a < src + nbytes and src < a + n for a, n in self.registering.items()):
                self.violations.append(f"a copy from {src:#x} while it was being registered")
        if pinned:
            stream.ops.append(("copy", tensor.data_ptr(), nbytes, out))
        else:
            self.staged += 1
            stream.ops.append(("staged", tensor.contiguous().clone(), out))
        self.copies += 1
        stream.copies += 1
        return out

    def record(self, stream, timing=False):
        return FakeEvent(stream, len(stream.ops), timing, self.violations)

    def done(self, event):
        if self.speed:
            for stream in self.streams:
                self._run(stream, stream.completed + self.speed, force=False)
        return event.stream.completed >= event.pos

    def synchronize(self, event):
        self._run(event.stream, event.pos, force=True)

    def elapsed(self, start, end):
        if not (start.timing and end.timing):
            raise RuntimeError("elapsed() of an event without timing")
        return 1e-6 * max(1, end.pos - start.pos)

    def wait(self, stream, event):
        self.waited.append((stream.name, event.stream.name, event.pos))
        stream.ops.append(("wait", event))

    def synchronize_device(self):
        self.device_syncs += 1
        self.run_all()

    def hold(self, tensor, stream):
        self.held.append((tensor.data_ptr(), stream.name))

    def run_all(self):
        for stream in self.streams:
            self._run(stream, len(stream.ops), force=True)

    def pending(self):
        """Operations queued and not run yet, on every stream."""
        return sum(len(s.ops) - s.completed for s in self.streams)

    def pending_copies(self):
        """Copies queued and not run yet, on every stream (not counting a stream's waits
        for another: the caller's stream waits for each batch handed out, and those
        waits are the caller's, run when its stream next runs)."""
        return sum(op is not None and op[0] in ("copy", "staged")
                   for s in self.streams for op in s.ops[s.completed:])

    def _run(self, stream, upto, force):
        upto = min(upto, len(stream.ops))
        while stream.completed < upto:
            op = stream.ops[stream.completed]
            if op[0] == "wait":
                event = op[1]
                if event.stream.completed < event.pos:
                    if not force:
                        return
                    self._run(event.stream, event.pos, force=True)
            elif op[0] == "staged":
                op[2].copy_(op[1])
            else:
                _, src, nbytes, out = op
                with self._lock:
                    registered = self.covers(src, nbytes)
                if not registered and not _is_mapped(src, nbytes, _mapped_ranges()):
                    self.violations.append(f"a copy from {src:#x}, unmapped by then")
                else:
                    ctypes.memmove(out.data_ptr(), src, nbytes)
                    if not registered:
                        self.violations.append(f"a copy from {src:#x}, unregistered while "
                                               f"it was queued")
            stream.ops[stream.completed] = None
            stream.completed += 1

    def pending_reads(self, address, nbytes):
        return [op for s in self.streams for op in s.ops[s.completed:]
                if op is not None and op[0] == "copy" and address <= op[1] < address + nbytes]

    # -- registrations --------------------------------------------------------------------

    def register(self, address, nbytes):
        if self.register_delay:
            with self._lock:
                self.registering[address] = nbytes
            time.sleep(self.register_delay)
        with self._lock:
            self.registering.pop(address, None)
            self.threads.add(threading.current_thread().name)
            if self.refuse:
                raise RegistrationRefused(12, "cudaHostRegister failed (fake: memlock limit)")
            for a, n in self.registered.items():
                if a < address + nbytes and address < a + n:
                    self.violations.append(f"{address:#x} registered over {a:#x}")
            if not _is_mapped(address, nbytes, _mapped_ranges()):
                self.violations.append(f"{address:#x} registered while not mapped")
            self.registered[address] = nbytes
            self.registrations += 1

    def unregister(self, address):
        with self._lock:
            self.threads.add(threading.current_thread().name)
            nbytes = self.registered.pop(address, None)
            if nbytes is None:
                self.violations.append(f"{address:#x} unregistered but not registered")
                return
            if not _is_mapped(address, nbytes, _mapped_ranges()):
                self.violations.append(f"{address:#x} unmapped while registered")
            if self.pending_reads(address, nbytes):
                self.violations.append(f"{address:#x} unregistered while a copy reads it")
            self.unregistrations += 1

    def check_registered_mapped(self):
        ranges = _mapped_ranges()
        with self._lock:
            for a, n in self.registered.items():
                if not _is_mapped(a, n, ranges):
                    self.violations.append(f"{a:#x} unmapped while registered")

    def covers(self, address, nbytes=1):
        with self._lock:
            return any(a <= address and address + nbytes <= a + n
                       for a, n in self.registered.items())
