"""Batches on a real GPU: skipped where CUDA is not available (CI has none; the feed's rules
are covered on the CPU by test_device.py with a fake device)."""
import os
import signal

import pytest
import torch
from unienv_data.samplers import StepSampler

from unienv_mp import MultiprocessingSampler

import _data
import _views_data as views
from _data import same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA (torch.cuda.is_available() is False)")

IMG = (3, 32, 32)


def _clone(batch):
    """``batch`` copied to the CPU (dicts, lists and tuples of tensors)."""
    if isinstance(batch, dict):
        return {k: _clone(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_clone(v) for v in batch)
    return batch.detach().to("cpu", copy=True) if isinstance(batch, torch.Tensor) else batch


def _on(batch, device_type):
    if isinstance(batch, dict):
        return all(_on(v, device_type) for v in batch.values())
    if isinstance(batch, (tuple, list)):
        return all(_on(v, device_type) for v in batch)
    return not isinstance(batch, torch.Tensor) or batch.device.type == device_type


def _checksum(batch):
    """A position-weighted sum of every byte of ``batch``'s tensors, computed where they
    are (the same integer on the CPU and on the GPU for the same bytes)."""
    out = []
    for k in sorted(batch):
        t = batch[k].contiguous().view(torch.uint8).flatten().to(torch.int64)
        w = torch.arange(t.numel(), device=t.device) % 251 + 1
        out.append(int((t * w).sum()))
    return out


@pytest.mark.parametrize("ctx", ["fork", "spawn", "forkserver"])
def test_device_batches_are_the_cpu_batches_moved(ctx):
    torch.zeros(1, device="cuda")   # (CUDA initialised in the parent before the workers)
    rb = _data.replay_buffer(500, img=IMG)
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=2, ctx=ctx) as m:
        ref = [_clone(m.sample()) for _ in range(50)]
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3, device="cuda"), n_workers=2,
                                ctx=ctx) as m:
        out = [m.sample() for _ in range(50)]
        assert torch.device(m.device).type == "cuda"   # (as the wrapped sampler says)
        stats = m.stats().device
    assert stats.pinned_bytes > 0 and stats.pageable_leaves == 0
    assert stats.copies >= 50 and stats.copy_seconds > 0
    assert all(_on(b, "cuda") for b in out)
    assert all(same_bits(a, b) for a, b in zip(ref, out))


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_other_methods_and_epochs_on_the_gpu(ctx):
    torch.zeros(1, device="cuda")
    rb = _data.replay_buffer(500, img=IMG)

    def run(device):
        keep = _clone if device is None else (lambda b: b)
        with MultiprocessingSampler(StepSampler(rb, 64, seed=5, device=device),
                                    n_workers=2, ctx=ctx) as m:
            got = [keep(m.sample_with_metadata()) for _ in range(10)]
            got += [keep(m.sample_flat()) for _ in range(10)]
            got += [keep(b) for _ in range(2) for b in m.epoch_iter()]
        return got

    ref, out = run(None), run("cuda")
    assert len(out) == 20 + 2 * 8
    assert all(_on(b, "cuda") for b in out)
    assert all(same_bits(a, b) for a, b in zip(ref, out))


def test_views_on_the_gpu():
    rb = views.buffer()
    stack = views.frame_stack(rb, pre=2)
    chunk = views.action_chunk(rb, horizon=4)
    for view in (stack, chunk):
        with MultiprocessingSampler(StepSampler(view, 16, seed=1), n_workers=2) as m:
            ref = [_clone(m.sample()) for _ in range(20)]
        with MultiprocessingSampler(StepSampler(view, 16, seed=1, device="cuda"),
                                    n_workers=2) as m:
            out = [m.sample() for _ in range(20)]
        assert all(_on(b, "cuda") for b in out)
        assert all(same_bits(a, b) for a, b in zip(ref, out))


def test_many_workers_large_batches_checksums():
    rb = _data.replay_buffer(2000, img=(3, 64, 64))
    with MultiprocessingSampler(StepSampler(rb, 256, seed=7), n_workers=8) as m:
        ref = [_checksum(m.sample()) for _ in range(300)]
    with MultiprocessingSampler(StepSampler(rb, 256, seed=7, device="cuda"),
                                n_workers=8) as m:
        out = [_checksum(m.sample()) for _ in range(300)]
    assert out == ref


def test_the_caller_may_write_keep_and_read_on_another_stream():
    rb = _data.replay_buffer(500, img=IMG)
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=2) as m:
        ref = [_clone(m.sample()) for _ in range(30)]
    side = torch.cuda.Stream()
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3, device="cuda"),
                                n_workers=2) as m:
        first = m.sample()
        first["image"].add_(1)   # (written on the caller's stream)
        kept = [m.sample() for _ in range(9)]
        with torch.cuda.stream(side):   # (handed out while another stream is current)
            on_side = [m.sample() for _ in range(10)]
            sums = [b["image"].to(torch.int64).sum() for b in on_side]
        read, held = [], []
        for _ in range(10):
            b = m.sample()
            held.append(b)   # (alive until side has read it: only the caller's stream
            #                  was recorded on it)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                read.append(b["image"].clone())
        side.synchronize()
        assert same_bits(ref[0]["image"] + 1, first["image"])
        assert all(same_bits(a, b) for a, b in zip(ref[1:10], kept))
        assert all(same_bits(a, b) for a, b in zip(ref[10:20], on_side))
        assert [int(s) for s in sums] == [int(a["image"].to(torch.int64).sum())
                                          for a in ref[10:20]]
        assert all(same_bits(a["image"], b) for a, b in zip(ref[20:30], read))


def test_close_with_copies_in_flight_leaves_the_batches_and_nothing_registered():
    rb = _data.replay_buffer(500, img=(3, 64, 64))
    with MultiprocessingSampler(StepSampler(rb, 128, seed=3), n_workers=4) as m:
        ref = [_clone(m.sample()) for _ in range(6)]
    for _ in range(5):
        m = MultiprocessingSampler(StepSampler(rb, 128, seed=3, device="cuda"), n_workers=4)
        out = [m.sample() for _ in range(6)]   # (the copy of the next one issued ahead)
        m.close()
        assert all(same_bits(a, b) for a, b in zip(ref, out))
    torch.ones(1 << 20).pin_memory()   # (nothing left registered to break later pinning)


def test_a_worker_killed_while_cuda_is_in_use():
    torch.zeros(1, device="cuda")
    rb = _data.replay_buffer(500, img=IMG)
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=3, ctx="fork") as m:
        ref = [_clone(m.sample()) for _ in range(60)]
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3, device="cuda"), n_workers=3,
                                ctx="fork") as m:
        out = [m.sample() for _ in range(10)]
        m._pools.sample.start_all()   # (under fork the others start when first needed)
        out += [m.sample() for _ in range(5)]
        os.kill(m._pools.sample.workers[1].pid, signal.SIGKILL)
        out += [m.sample() for _ in range(45)]
    assert len(out) == 60 and all(same_bits(a, b) for a, b in zip(ref, out))


def test_out_of_device_memory_reaches_the_caller_and_the_sampler_still_closes():
    rb = _data.replay_buffer(300, img=(3, 64, 64))
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=2) as m:
        ref = [_clone(m.sample()) for _ in range(4)]
    m = MultiprocessingSampler(StepSampler(rb, 64, seed=3, device="cuda"), n_workers=2)
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        try:
            # (no new segment for anyone; the sampler's copy stream has none cached, since
            # the allocator keeps free blocks per stream, so its first copy cannot be
            # placed)
            torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_reserved() / total)
            with pytest.raises(torch.OutOfMemoryError):
                m.sample()
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        out = [m.sample() for _ in range(4)]   # (the batch of the failed call comes again)
    finally:
        m.close()
    assert all(same_bits(a, b) for a, b in zip(ref, out))


def test_pin_memory_batches_are_pinned():
    rb = _data.replay_buffer(200)
    with MultiprocessingSampler(StepSampler(rb, 32, seed=0), n_workers=2) as m:
        ref = [_clone(m.sample()) for _ in range(20)]
    with MultiprocessingSampler(StepSampler(rb, 32, seed=0), n_workers=2,
                                pin_memory=True) as m:
        for want in ref:
            batch = m.sample()
            assert all(t.is_pinned() for t in batch.values())
            moved = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}
            torch.cuda.current_stream().synchronize()
            assert same_bits(want, moved) and same_bits(want, batch)


def test_memory_stays_flat_over_many_steps():
    rb = _data.replay_buffer(500, img=IMG)
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
        stats = m.stats().device
        assert stats.pinned_slots <= 2 * (8 + 1 + 4 + 1)
        assert stats.pageable_leaves == 0
    torch.ones(4).pin_memory()   # (nothing left registered to break later pinning)


def test_data_on_the_gpu_runs_in_process_and_gathers_exactly():
    from unienv_mp.bench.cuda import gpu_copy
    rb = _data.replay_buffer(400)
    rb_gpu = gpu_copy(rb)

    def run():
        with MultiprocessingSampler(StepSampler(rb_gpu, 32, seed=0)) as m:
            assert m.gather_path == "in_process"
            return [m.sample() for _ in range(40)], list(m.epoch_iter())

    out, epoch = run()
    again, _ = run()
    assert all(_on(b, "cuda") for b in out + epoch)
    for b in out + epoch:
        idx = _data.indices_of(_clone(b))
        assert same_bits(rb.get_at(torch.tensor(idx)), b)
    assert sorted(i for b in epoch for i in _data.indices_of(_clone(b))) == list(range(400))
    assert all(same_bits(_clone(a), b) for a, b in zip(out, again))   # (the same seed, the same)


# -- safe in the loop everyone writes; registered off the clock; the sampler's own stream -----

TIGHT = dict(n_workers=1, n_buffers=1, batches_per_task=1)


def _late(cycles=20_000_000):
    """Queue about ten milliseconds of GPU work on the current stream: what is queued
    after it runs late."""
    torch.cuda._sleep(cycles)


@pytest.mark.parametrize("idiom", ["chained", "prefetched"])
def test_pin_memory_in_the_usual_loop_is_bit_exact_with_late_copies(idiom):
    # One worker, one buffer: a slot given back before the caller's copy read it is
    # written again at once.  Each copy is queued behind GPU work, so it runs late.
    rb = _data.replay_buffer(500, img=(3, 64, 64))
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), **TIGHT) as m:
        ref = [_checksum(m.sample()) for _ in range(40)]
    out = []
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), pin_memory=True, **TIGHT) as m:
        if idiom == "chained":
            for _ in range(40):
                _late()
                out.append({k: v.to("cuda", non_blocking=True) for k, v in m.sample().items()})
        else:
            nxt = m.sample()
            for _ in range(40):
                cur, nxt = nxt, m.sample()
                _late()
                out.append({k: v.to("cuda", non_blocking=True) for k, v in cur.items()})
                del cur
        stats = m.stats().device
    torch.cuda.synchronize()
    assert [_checksum(b) for b in out] == ref
    assert stats.pageable_leaves == 0 and stats.registrations > 0


def test_registrations_are_counted_and_a_warm_up_ends_them():
    from unienv_mp.bench.cuda import warm_up
    rb = _data.replay_buffer(2000, img=(3, 64, 64))
    with MultiprocessingSampler(StepSampler(rb, 256, seed=0, device="cuda"),
                                n_workers=8) as m:
        m.sample()
        first = m.stats().device
        assert first.registrations > 0 and first.registration_seconds > 0
        steps = warm_up(m, m.sample, window=50)
        assert steps < 4000   # (the slots stopped growing)


def test_the_copy_stream_is_none_of_the_callers():
    rb = _data.replay_buffer(200)
    mine = [torch.cuda.Stream() for _ in range(40)]   # (more than torch's pool holds)
    with MultiprocessingSampler(StepSampler(rb, 32, seed=0, device="cuda"),
                                n_workers=2) as m:
        m.sample()
        copy_stream = m._feed._stream
        assert copy_stream != torch.cuda.current_stream()
        assert copy_stream != torch.cuda.default_stream()
        assert all(copy_stream != s for s in mine)
        assert copy_stream.priority < 0
        with torch.cuda.stream(copy_stream):   # (the caller makes it current: replaced)
            with pytest.warns(RuntimeWarning, match="copy stream"):
                m.sample()
        assert m._feed._stream != copy_stream


def test_another_gpu_gets_no_context_from_the_sampler(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import subprocess
    import sys
    code = (
        "import sys, torch\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import _data\n"
        "from unienv_data.samplers import StepSampler\n"
        "from unienv_mp import MultiprocessingSampler\n"
        "rb = _data.replay_buffer(300, img=(3, 32, 32))\n"
        "with MultiprocessingSampler(StepSampler(rb, 64, seed=0, device='cuda:1'),\n"
        "                            n_workers=2) as m:\n"
        "    out = [m.sample() for _ in range(20)]\n"
        "    assert all(t.device == torch.device('cuda:1') for b in out for t in b.values())\n"
        "torch.cuda.synchronize(1)\n"
        "print(torch._C._cuda_hasPrimaryContext(0), torch._C._cuda_hasPrimaryContext(1))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("pin", [False, True], ids=["device", "pin_memory"])
def test_a_forked_childs_close_leaves_the_parents_gpu_work_alone(pin):
    torch.zeros(1, device="cuda")
    rb = _data.replay_buffer(500, img=IMG)
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=2, ctx="fork") as m:
        ref = [_clone(m.sample()) for _ in range(30)]
    s = StepSampler(rb, 64, seed=3, device=None if pin else "cuda")
    with MultiprocessingSampler(s, n_workers=2, ctx="fork", pin_memory=pin) as m:
        out = []
        for _ in range(10):
            _late()
            b = m.sample()
            out.append({k: v.to("cuda", non_blocking=True) for k, v in b.items()})
            del b
        pid = os.fork()
        if pid == 0:   # (the child closes its copy, drops it, and ends as a program does)
            code = 0
            try:
                m.close()
                del m
                import gc
                gc.collect()
            except BaseException:
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        for _ in range(20):
            b = m.sample()
            out.append({k: v.to("cuda", non_blocking=True) for k, v in b.items()})
    torch.cuda.synchronize()
    assert all(same_bits(a, b) for a, b in zip(ref, out))


def test_a_chunk_gathered_on_one_stream_is_read_right_on_another():
    from unienv_mp.bench.cuda import gpu_copy
    rb = _data.replay_buffer(400, img=IMG)
    rb_gpu = gpu_copy(rb)
    side = torch.cuda.Stream()
    with MultiprocessingSampler(StepSampler(rb_gpu, 64, seed=0)) as m:
        # (the chunk's gather, queued next, runs late where it does not wait on the host;
        # where it does, this checks the values only)
        _late(200_000_000)
        first = m.sample()   # (its chunk of 8 gathered now, on the current stream)
        with torch.cuda.stream(side):   # (the next one handed out, and read, on side)
            second = m.sample()
            read = {k: v.clone() for k, v in second.items()}
        side.synchronize()
        torch.cuda.synchronize()
    for b in (first, read):
        idx = _data.indices_of(_clone(b))
        assert same_bits(rb.get_at(torch.tensor(idx)), b)


def test_a_leaf_that_is_not_contiguous_is_copied_right_and_counted_pageable():
    from unienv_mp._device.feed import DeviceFeed
    from unienv_mp._device.ops import CudaOps
    from unienv_mp._transport.ring import Segment
    seg = Segment.create(1 << 16, "test")
    try:
        whole = torch.frombuffer(seg, dtype=torch.uint8)
        whole.copy_(torch.randint(0, 256, (1 << 16,), dtype=torch.uint8))
        batch = {"t": whole[:4096].view(64, 64).t(), "c": whole[4096:8192]}
        feed = DeviceFeed(CudaOps("cuda"), lambda: [seg])
        out = feed.hand_out(batch)
        assert feed.stats().pageable_leaves == 1
        torch.cuda.synchronize()
        assert same_bits({k: v.clone() for k, v in batch.items()}, out)
        feed.close()
        del whole, batch
    finally:
        seg.close()


def test_a_refused_registration_leaves_torch_no_error():
    # A range registered twice is refused (712), on this thread: the error it left in the
    # runtime's last error must not be reported by torch's next kernel launch.
    from unienv_mp._device.ops import CudaOps, RegistrationRefused
    from unienv_mp._transport.ring import Segment
    ops = CudaOps("cuda")
    seg = Segment.create(1 << 20, "test")
    try:
        ops.register(seg.address, seg.size)
        try:
            with pytest.raises(RegistrationRefused) as refused:
                ops.register(seg.address, seg.size)
            assert refused.value.errno == 712
            x = torch.ones(1000, device="cuda")
            assert float((x * 2).sum()) == 2000.0   # (a kernel launch checks the last error)
            torch.cuda.synchronize()
        finally:
            ops.unregister(seg.address)
    finally:
        seg.close()
