"""`CudaOps`, the device feed's CUDA side, on a fake ``torch.cuda`` (tests/_fake_cuda.py):
the device every call acts on, a copy stream of its own, and the errors a refused
registration leaves behind.  The same on a GPU: test_cuda.py."""
import warnings

import pytest
import torch
from unienv_data.samplers import StepSampler

from unienv_mp import MultiprocessingSampler
from unienv_mp._device.ops import CudaOps

from _data import replay_buffer
from _fake_cuda import FakeCuda


@pytest.fixture
def cuda(monkeypatch):
    return FakeCuda().install(monkeypatch)


def _clone(batch):
    return {k: v.clone() for k, v in batch.items()}


def _cpu_stream(rb, n, **kw):
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), **kw) as m:
        return [_clone(m.sample()) for _ in range(n)]


def test_the_copy_stream_is_none_of_the_streams_the_caller_gets(cuda):
    ops = CudaOps("cuda:0")
    stream = ops.copy_stream()
    ordinary = [torch.cuda.Stream() for _ in range(40)]   # (more than a pool holds)
    assert all(stream is not s for s in ordinary)
    assert stream is not torch.cuda.current_stream(0)
    assert ops.copy_stream(avoid=stream) is not stream


def test_every_call_is_made_on_the_samplers_device(cuda):
    # device="cuda:1" in a process whose current device is 0 (a DDP rank that did not
    # call set_device): nothing makes a context on GPU 0, and device 0 stays current.
    ops = CudaOps("cuda:1")
    stream = ops.copy_stream()
    ops.register(0x10000, 4096)
    event = ops.record(stream, timing=True)
    ops.wait(ops.current_stream(), event)
    ops.synchronize(event)
    ops.synchronize_device()
    ops.unregister(0x10000)
    assert cuda.contexts == {1}
    assert [d for what, _, d in cuda.calls if what.startswith("cudaHost")] == [1, 1]
    assert torch.cuda.current_device() == 0


def test_the_pins_thread_registers_on_the_samplers_device(cuda):
    # The pins' thread starts on device 0, as every new thread does; the caller's thread
    # made device 1 its own (as a DDP rank does with set_device).
    torch.cuda.set_device(1)
    rb = replay_buffer(300)
    ref = _cpu_stream(rb, 10, n_workers=2, ctx="fork")
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=2, ctx="fork",
                                pin_memory=True) as m:
        out = [_clone(m.sample()) for _ in range(10)]
        stats = m.stats().device
        assert stats.pinned_slots and stats.registrations
    host = [(what, thread, d) for what, thread, d in cuda.calls if what.startswith("cudaHost")]
    assert {what for what, _, _ in host} == {"cudaHostRegister", "cudaHostUnregister"}
    assert {thread for _, thread, _ in host} == {"unienv_mp page-locking"}
    assert cuda.contexts == {1} and cuda.registered == {}
    assert all(torch.equal(a[k], b[k]) for a, b in zip(ref, out) for k in a)


@pytest.mark.parametrize("get_last_error", [False, True], ids=["no-cudaGetLastError",
                                                               "cudaGetLastError"])
@pytest.mark.parametrize("code", [712, 801], ids=["already-registered", "not-supported"])
def test_a_refused_registration_leaves_torch_no_error(monkeypatch, code, get_last_error):
    # torch reads the runtime's last error on the caller's thread after each kernel
    # launch (launch_check), and would report one left there as the kernel's.
    cuda = FakeCuda(refuse=code, get_last_error=get_last_error).install(monkeypatch)
    rb = replay_buffer(300)
    ref = _cpu_stream(rb, 20, n_workers=2, ctx="fork")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=2, ctx="fork",
                                    pin_memory=True) as m:
            out = [_clone(m.sample()) for _ in range(20)]
            stats = m.stats().device
    assert cuda.launch_check() == 0
    assert all(torch.equal(a[k], b[k]) for a, b in zip(ref, out) for k in a)
    refusals = [w for w in caught if "page-lock" in str(w.message)]
    if code == 801:   # (not supported: refused, once, and no more attempts)
        assert len(refusals) == 1 and "801" in str(refusals[0].message)
        assert stats.pinned_slots == 0 and stats.pageable_leaves > 0
        assert len([c for c in cuda.calls if c[0] == "cudaHostRegister"]) <= 3
    else:   # (someone else's page-locked range: used as it is, never unregistered)
        assert not refusals
        assert stats.pinned_slots > 0 and stats.pinned_bytes == 0
        assert stats.pageable_leaves == 0
        assert not [c for c in cuda.calls if c[0] == "cudaHostUnregister"]


def test_clear_last_error_takes_what_it_finds():
    from unienv_mp._device.ops import clear_last_error

    class Binding:
        cleared = 0

        def cudaGetLastError(self):
            Binding.cleared += 1
            return 0

    assert clear_last_error(Binding()) is True and Binding.cleared == 1
    # (no binding, no runtime in this process: nothing to reset, nothing raised)
    assert clear_last_error(object()) is False
