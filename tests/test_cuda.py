"""Batches on a real GPU: skipped where CUDA is not available (CI has none; the feed's rules
are covered on the CPU by test_device.py with a fake device)."""
import pytest
import torch
from unienv_data.samplers import StepSampler

from unienv_mp import MultiprocessingSampler

import _data

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA (torch.cuda.is_available() is False)")


@pytest.mark.parametrize("ctx", ["fork", "spawn", "forkserver"])
def test_device_batches_are_the_cpu_batches_moved(ctx):
    torch.zeros(1, device="cuda")   # (CUDA initialised in the parent before the workers)
    rb = _data.replay_buffer(500, img=(3, 32, 32))
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=2, ctx=ctx) as m:
        ref = [{k: v.clone() for k, v in m.sample().items()} for _ in range(50)]
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3, device="cuda"), n_workers=2,
                                ctx=ctx) as m:
        out = [m.sample() for _ in range(50)]
        assert m.device.type == "cuda"
        stats = m.stats().device
    assert stats.pinned_bytes > 0 and stats.pageable_leaves == 0
    for a, b in zip(ref, out):
        for k in a:
            assert b[k].device.type == "cuda" and torch.equal(a[k], b[k].cpu())


def test_pin_memory_batches_are_pinned():
    rb = _data.replay_buffer(200)
    with MultiprocessingSampler(StepSampler(rb, 32, seed=0), n_workers=2,
                                pin_memory=True) as m:
        batch = m.sample()
        assert all(t.is_pinned() for t in batch.values())
        moved = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}
        torch.cuda.current_stream().synchronize()
        assert all(torch.equal(moved[k].cpu(), batch[k]) for k in batch)


def test_memory_stays_flat_over_many_steps():
    rb = _data.replay_buffer(500, img=(3, 32, 32))
    with MultiprocessingSampler(StepSampler(rb, 64, seed=0, device="cuda"), n_workers=2) as m:
        for _ in range(300):
            m.sample()
        torch.cuda.synchronize()
        gpu = torch.cuda.memory_allocated()
        for _ in range(10_000):
            m.sample()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= gpu + (1 << 20)
        # (slots are made while the pipeline fills, up to a bound: see test_device.py)
        assert m.stats().device.pinned_slots <= 2 * (8 + 1 + 4 + 1)
    torch.ones(4).pin_memory()   # (nothing left registered to break later pinning)


def test_data_on_the_gpu_runs_in_process():
    from unienv_mp.bench.cuda import gpu_copy
    rb = gpu_copy(_data.replay_buffer(200))
    with MultiprocessingSampler(StepSampler(rb, 32, seed=0)) as m:
        assert m.gather_path == "in_process"
        batch = m.sample()
        assert batch["state"].device.type == "cuda"
