"""A fake device for the device feed (unienv_mp._device.ops.DeviceOps), whose copies
complete later, so that the CPU tests run the feed's ordering and release rules.

* A copy is queued when issued and made when the device "runs" it: only then are the
  source's bytes read, by address (the fake keeps no reference to the source).  So a slot
  given back to its worker before its copy completed, and written again, shows up as a
  wrong batch.
* The device runs ``speed`` queued operations at each ``done()`` query (0: only when
  something synchronizes, or :meth:`FakeOps.run_all`).
* Registrations are checked: no range registered twice, each range mapped while it is
  registered, none unregistered while a copy that reads it is queued.  What is wrong is
  appended to ``violations``.
"""
import ctypes

import torch

from unienv_mp._device.ops import DeviceOps, RegistrationRefused


class FakeEvent:
    __slots__ = ("pos", "timing")

    def __init__(self, pos, timing):
        self.pos = pos
        self.timing = timing


class FakeStream:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<FakeStream {self.name}>"


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
        self.copy_stream_ = FakeStream("copy")
        self.caller_stream = FakeStream("caller")
        self.ops = []            # (src address, nbytes, dst tensor) or None (an event mark)
        self.completed = 0       # ops[:completed] have run
        self.registered = {}     # address -> nbytes
        self.registrations = 0
        self.unregistrations = 0
        self.violations = []
        self.waited = []         # events the caller's stream waited on
        self.held = []           # (data_ptr, stream) of tensors handed to a stream
        self.fail_copies = 0     # the next n copies raise, as a device out of memory would
        self.copies = 0
        self.device_syncs = 0

    # -- streams and events ---------------------------------------------------------------

    def copy_stream(self):
        return self.copy_stream_

    def current_stream(self):
        return self.caller_stream

    def copy(self, tensor, stream):
        if stream is not self.copy_stream_:
            self.violations.append(f"a copy issued on {stream}, not the copy stream")
        if self.fail_copies:
            self.fail_copies -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        if not tensor.is_contiguous():
            self.violations.append("a copy of a non-contiguous tensor (the fake reads bytes)")
        out = torch.full_like(tensor, 0)
        nbytes = tensor.numel() * tensor.element_size()
        self.ops.append((tensor.data_ptr(), nbytes, out))
        self.copies += 1
        return out

    def record(self, stream, timing=False):
        return FakeEvent(len(self.ops), timing)

    def done(self, event):
        self._run(self.completed + self.speed)
        return self.completed >= event.pos

    def synchronize(self, event):
        self._run(event.pos)

    def elapsed(self, start, end):
        if not (start.timing and end.timing):
            raise RuntimeError("elapsed() of an event without timing")
        return 1e-6 * (end.pos - start.pos)

    def wait(self, stream, event):
        self.waited.append(event)

    def synchronize_device(self):
        self.device_syncs += 1
        self.run_all()

    def hold(self, tensor, stream):
        self.held.append((tensor.data_ptr(), stream))

    def run_all(self):
        self._run(len(self.ops))

    def _run(self, upto):
        upto = min(upto, len(self.ops))
        while self.completed < upto:
            src, nbytes, out = self.ops[self.completed]
            if not any(a <= src and src + nbytes <= a + n for a, n in self.registered.items()):
                # (a source not registered must still be mapped: the caller keeps it)
                if not _is_mapped(src, nbytes, _mapped_ranges()):
                    self.violations.append(f"a copy from {src:#x}, unmapped by then")
                    self.completed += 1
                    continue
            ctypes.memmove(out.data_ptr(), src, nbytes)
            self.ops[self.completed] = None
            self.completed += 1

    def pending_reads(self, address, nbytes):
        return [op for op in self.ops[self.completed:]
                if op is not None and address <= op[0] < address + nbytes]

    # -- registrations --------------------------------------------------------------------

    def register(self, address, nbytes):
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
        for a, n in self.registered.items():
            if not _is_mapped(a, n, ranges):
                self.violations.append(f"{a:#x} unmapped while registered")

    def covers(self, address):
        return any(a <= address < a + n for a, n in self.registered.items())
