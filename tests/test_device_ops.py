"""`CudaOps`, the device feed's CUDA side, on a fake ``torch.cuda`` (tests/_fake_cuda.py):
the device every call acts on, a copy stream of its own, and the reset of the error a
refused registration leaves behind.  The same on a GPU: test_cuda.py."""

import pytest
import torch
from unienv_data.samplers import StepSampler

from unienv_mp import MultiprocessingSampler
from unienv_mp._device.ops import CudaOps

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
