"""Batches on a device, on the CPU: the device feed's ordering and release rules
(unienv_mp/_device/feed.py) driven through the sampler with a fake device whose copies
complete later (tests/_fake_device.py), the placement of samplers, ``pin_memory``, and the
in-process manager for data on a GPU.  The tests that need CUDA are in test_cuda.py."""
import warnings

import pytest
import torch
from unienv_data.samplers import StepSampler

import unienv_mp._device.ops as ops_mod
import unienv_mp.sampler as sampler_mod
from unienv_mp import MultiprocessingSampler, WorkerError
from unienv_mp._device.placement import Placement, cpu_twin, place
from unienv_mp._device.resident import InProcessManager, own_target
from unienv_mp._sampling import SamplerTarget

import _data
from _data import replay_buffer
from _fake_device import FakeOps

IMG = (3, 32, 32)


@pytest.fixture
def fake(monkeypatch):
    ops = FakeOps(speed=0)
    monkeypatch.setattr(ops_mod, "for_device", lambda device: ops)
    return ops


def _on_cuda(sampler):
    """``sampler`` as ``StepSampler(..., device="cuda")`` makes it, without CUDA here (its
    spaces stay on the CPU: UniEnv moves them to the device at construction)."""
    sampler._device = torch.device("cuda")
    return sampler


def _clone(batch):
    if isinstance(batch, dict):
        return {k: _clone(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_clone(v) for v in batch)
    return batch.clone() if isinstance(batch, torch.Tensor) else batch


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _cpu_stream(rb, n, method="sample", **kw):
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), **kw) as m:
        return [_clone(getattr(m, method)()) for _ in range(n)]


TIGHT = dict(n_workers=1, n_buffers=1, batches_per_task=1)


@pytest.mark.parametrize("ctx", ["fork", "spawn", "forkserver"])
def test_device_batches_are_the_cpu_batches_bit_for_bit(fake, ctx):
    # Copies complete only when the feed must wait for one (speed 0), and a slot is rewritten
    # as soon as it is given back (one worker, one buffer, one batch per task): a slot given
    # back before its copy completed gives a wrong batch here.
    rb = replay_buffer(500, img=IMG)
    ref = _cpu_stream(rb, 120, ctx=ctx, **TIGHT)
    with MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=3)), ctx=ctx, **TIGHT) as m:
        assert m.device == torch.device("cuda") and m.gather_path == "direct"
        out = [m.sample() for _ in range(120)]
        stats = m.stats().device
    fake.run_all()
    assert not fake.violations
    assert all(_same(a, b) for a, b in zip(ref, out))
    assert stats.copies >= 120 and stats.pinned_bytes > 0 and stats.pageable_leaves == 0
    assert len(fake.waited) == 120                  # the caller's stream waited for each
    assert len(fake.held) == 120 * 3                # and holds each tensor


def test_a_slot_given_back_early_is_seen(fake, monkeypatch):
    # The test above can fail: a feed that lets go of the CPU batch at the copy's issue
    # gives wrong batches.
    import unienv_mp._device.feed as feed_mod
    issue = feed_mod.DeviceFeed._issue

    def early(self, cpu):
        copy = issue(self, cpu)
        copy.cpu = None
        return copy

    monkeypatch.setattr(feed_mod.DeviceFeed, "_issue", early)
    rb = replay_buffer(500, img=IMG)
    ref = _cpu_stream(rb, 60, ctx="fork", **TIGHT)
    with MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=3)), ctx="fork",
                                **TIGHT) as m:
        out = [m.sample() for _ in range(60)]
    fake.run_all()
    assert sum(not _same(a, b) for a, b in zip(ref, out)) > 10


@pytest.mark.parametrize("method", ["sample_with_metadata", "sample_flat"])
def test_other_methods_on_the_device(fake, method):
    rb = replay_buffer(300)
    ref = _cpu_stream(rb, 40, method, n_workers=2, ctx="fork")
    with MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=3)), n_workers=2,
                                ctx="fork") as m:
        out = [getattr(m, method)() for _ in range(40)]
        index = m.sample_index()
    fake.run_all()
    assert all(_same(a, b) for a, b in zip(ref, out))
    assert isinstance(index, torch.Tensor) and index.device.type == "cpu"   # as UniEnv's
    assert not fake.violations


def test_epochs_on_the_device(fake):
    rb = replay_buffer(500, img=IMG)
    with MultiprocessingSampler(StepSampler(rb, 64, seed=5), n_workers=2, ctx="fork") as m:
        ref = [[_clone(b) for b in m.epoch_iter()] for _ in range(2)]
    with MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=5)), n_workers=2,
                                ctx="fork") as m:
        out = [list(m.epoch_iter()) for _ in range(2)]
    fake.run_all()
    assert [len(e) for e in out] == [8, 8]
    assert all(_same(a, b) for ea, eb in zip(ref, out) for a, b in zip(ea, eb))
    assert not fake.violations


def test_memory_stays_flat_and_close_unregisters_with_copies_in_flight(fake):
    rb = replay_buffer(500, img=IMG)
    m = MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=3)), n_workers=2,
                               ctx="fork")
    # A worker makes a slot when none of its own is free: at most one per task in flight
    # (n_buffers of 8, in chunks), per chunk being handed out, and per copy in flight (4)
    # or issued ahead (1).  So the slots, and the bytes registered, stay under a bound that
    # does not grow with the steps, each slot registered once (its size never changes here).
    bound = 2 * (8 + 1 + 4 + 1)
    with m:
        for _ in range(1300):
            m.sample()
            assert len(fake.registered) <= bound
        stats = m.stats().device
        assert stats.in_flight <= 4
        assert fake.registrations == len(fake.registered)   # (none registered twice)
        assert stats.pinned_bytes == sum(fake.registered.values())
        assert stats.pinned_slots == len(fake.registered)
        fake.check_registered_mapped()
        assert fake.completed < len(fake.ops)              # copies in flight ...
        m.close()                                          # ... waited for by close()
    assert fake.completed == len(fake.ops)
    assert fake.registered == {} and not fake.violations


def test_a_refused_registration_warns_once_and_copies_from_pageable_memory(fake):
    fake.refuse = True
    rb = replay_buffer(300)
    ref = _cpu_stream(rb, 30, n_workers=2, ctx="fork")
    with pytest.warns(RuntimeWarning, match="page-lock") as caught:
        with MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=3)), n_workers=2,
                                    ctx="fork") as m:
            out = [m.sample() for _ in range(30)]
            assert m.stats().device.pageable_leaves > 0
    assert len([w for w in caught if "page-lock" in str(w.message)]) == 1
    fake.run_all()
    assert all(_same(a, b) for a, b in zip(ref, out))


def test_a_device_error_reaches_the_caller_and_loses_no_batch(fake):
    rb = replay_buffer(300)
    ref = _cpu_stream(rb, 20, n_workers=2, ctx="fork")
    with MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=3)), n_workers=2,
                                ctx="fork") as m:
        out = [m.sample() for _ in range(5)]
        # The next batch's copy was issued ahead already; the one after fails when issued
        # ahead, and again at its hand-out, which raises.
        fake.fail_copies = 2
        out.append(m.sample())
        with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
            m.sample()
        out += [m.sample() for _ in range(14)]
    fake.run_all()
    assert all(_same(a, b) for a, b in zip(ref, out))
    assert not fake.violations


def test_a_worker_error_met_looking_ahead_comes_with_its_batch(fake):
    rb = replay_buffer(100)

    def run(sampler, keep):
        got = []
        with MultiprocessingSampler(sampler, n_workers=1, n_buffers=2, batches_per_task=1,
                                    ctx="fork") as m:
            for _ in range(12):
                try:
                    got.append(keep(m.sample()))
                except WorkerError:
                    got.append("error")
        return got

    ref = run(_data.FailingSampler(rb, 8, seed=1, fail_every=3), _clone)
    # (the fake's copies are made at run_all: the device batches are read after it)
    out = run(_on_cuda(_data.FailingSampler(rb, 8, seed=1, fail_every=3)), lambda b: b)
    fake.run_all()
    assert ref.count("error") >= 2
    assert all(_same(a, b) for a, b in zip(ref, out)), (ref, out)


def test_pin_memory_hands_out_cpu_batches_from_registered_slots(fake, monkeypatch):
    monkeypatch.setattr(ops_mod, "cuda_unavailable", lambda device: None)
    rb = replay_buffer(300)
    ref = _cpu_stream(rb, 30, n_workers=2, ctx="fork")
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=2, ctx="fork",
                                pin_memory=True) as m:
        out = [m.sample() for _ in range(30)]
        assert all(fake.covers(t.data_ptr()) for b in out for t in b.values())
        assert m.stats().device.device == "cpu (pinned)"
        out = [_clone(b) for b in out]
    assert all(_same(a, b) for a, b in zip(ref, out))
    assert fake.copies == 0 and fake.registered == {} and not fake.violations


def test_pin_memory_without_cuda_warns_and_goes_on():
    rb = replay_buffer(50)
    with pytest.warns(RuntimeWarning, match="pin_memory=True.*CUDA"):
        m = MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=1, pin_memory=True)
    with m:
        assert m.sample()["state"].shape == (8, 10)
        assert m.stats().device is None


def test_device_cuda_without_cuda_is_refused_at_once_naming_cuda():
    rb = replay_buffer(50)
    with pytest.raises(RuntimeError, match="CUDA"):
        MultiprocessingSampler(_on_cuda(StepSampler(rb, 8, seed=0)), n_workers=1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(pin_memory=True), "pin_memory=True.*already"),
    (dict(pin_memory=1), "pin_memory"),
])
def test_absurd_device_options(fake, kwargs, match):
    rb = replay_buffer(50)
    with pytest.raises((ValueError, TypeError), match=match):
        MultiprocessingSampler(_on_cuda(StepSampler(rb, 8, seed=0)), n_workers=1, **kwargs)


def test_the_workers_run_a_cpu_twin_and_the_caller_keeps_the_device():
    rb = replay_buffer(50)
    s = _on_cuda(StepSampler(rb, 8, seed=0))
    twin = cpu_twin(s)
    assert twin is not s and twin._device is None and twin.data is rb
    assert s._device == torch.device("cuda")
    assert place(s, "X").kind == "copy"
    assert place(StepSampler(rb, 8), "X").kind == "cpu"
    assert cpu_twin(_data.CudaSampler(rb, 8)) is None   # (device overridden: unknown way)


# -- data on the GPU: the in-process manager ----------------------------------------------

def _in_process(monkeypatch):
    """Place every sampler in this process, as data on a GPU is (here on the CPU)."""
    monkeypatch.setattr(sampler_mod, "place", lambda sampler, who: Placement(
        "in_process", None, None, "the data is on cuda:0 (pretended)"))


@pytest.mark.parametrize("method", ["sample", "sample_with_metadata", "sample_flat"])
def test_in_process_gives_the_workers_stream(monkeypatch, method):
    rb = replay_buffer(300)
    ref = _cpu_stream(rb, 30, method, n_workers=2, ctx="fork", direct_gather=False)
    _in_process(monkeypatch)
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=2) as m:
        assert m.gather_path == "in_process" and "cuda" in m.gather_path_reason
        out = [_clone(getattr(m, method)()) for _ in range(30)]
        epoch = [_clone(b) for b in m.epoch_iter()]
        state = m.state_dict()
        more = [_clone(m.sample()) for _ in range(5)]
    assert all(_same(a, b) for a, b in zip(ref, out))
    assert sorted(i for b in epoch for i in _data.indices_of(b)) == list(range(300))
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=2) as m:
        m.load_state_dict(state)
        assert all(_same(a, _clone(m.sample())) for a in more)


def test_in_process_errors_and_direct_gather(monkeypatch):
    rb = replay_buffer(100)
    _in_process(monkeypatch)
    with pytest.raises(ValueError, match="direct_gather=True.*cuda"):
        MultiprocessingSampler(StepSampler(rb, 8, seed=0), direct_gather=True)
    with MultiprocessingSampler(_data.FailingSampler(rb, 8, seed=1, fail_every=2),
                                batches_per_task=1) as m:
        with pytest.raises(WorkerError, match="KeyError.*in this process"):
            for _ in range(3):
                m.sample()
        m.sample()   # (goes on)


def test_in_process_manager_keeps_the_wrapped_samplers_rng():
    rb = replay_buffer(100)
    s = StepSampler(rb, 8, seed=0)
    before = s.data_rng.get_state().clone()
    manager = InProcessManager(own_target(SamplerTarget(s)))
    t = manager.submit(("sample", 7, 2))
    assert manager.ready(t)
    assert len(manager.result(t)) == 2
    assert torch.equal(s.data_rng.get_state(), before)
    with pytest.raises(KeyError):
        manager.result(t)
    manager.close()
    with pytest.raises(RuntimeError, match="closed"):
        manager.submit(("sample", 7, 1))


def test_no_warning_on_a_cpu_sampler():
    rb = replay_buffer(50)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=1) as m:
            m.sample()
            assert m.stats().device is None


def test_a_device_sampler_dropped_without_close_ends_at_once(fake):
    # Nothing of the device hand-out refers back to the sampler: dropping the last
    # reference closes it (its workers end, its slots are unregistered) without waiting
    # for a garbage collection.
    import gc
    import weakref
    rb = replay_buffer(100)
    gc.disable()
    try:
        m = MultiprocessingSampler(_on_cuda(StepSampler(rb, 8, seed=0)), n_workers=1,
                                   ctx="fork")
        m.sample()
        assert fake.registered
        ref = weakref.ref(m)
        del m
        assert ref() is None
        assert fake.registered == {}
    finally:
        gc.enable()


def test_a_forked_child_does_not_touch_its_parents_device(fake):
    import os
    rb = replay_buffer(100)
    with MultiprocessingSampler(_on_cuda(StepSampler(rb, 8, seed=0)), n_workers=1,
                                ctx="fork") as m:
        m.sample()
        registered = dict(fake.registered)
        pid = os.fork()
        if pid == 0:   # the child: its copy of the sampler refuses, and closes quietly
            code = 0
            try:
                try:
                    m.sample()
                    code = 3
                except RuntimeError:
                    pass
                m._feed.close()
                if fake.unregistrations:
                    code = 5
            except BaseException:
                code = 6
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert fake.registered == registered      # (the parent's are as they were)
        m.sample()
    assert fake.registered == {} and not fake.violations


def test_in_process_gathers_with_index_select_where_it_can(monkeypatch):
    # The in-process gather (one index draw, one index_select per array) gives the
    # wrapped sampler's own batches for the same seeds, bit for bit; a view runs the
    # wrapped sampler itself.
    from unienv_data.batches.framestack_batch import FrameStackedBatch
    from unienv_mp._device.resident import ResidentTarget
    rb = replay_buffer(300)
    wrapped = replay_buffer(300)
    wrapped.extend(_data.transitions(300, 130))   # (its rows start at 130 of the storage)
    for sampler, planned in ((StepSampler(rb, 16, seed=2), True),
                             (StepSampler(wrapped, 16, seed=2), True),
                             (StepSampler(FrameStackedBatch(rb, 1), 16, seed=2), False)):
        fast = ResidentTarget(own_target(SamplerTarget(sampler)))
        plain = own_target(SamplerTarget(sampler))
        for work in (("sample", 11, 3), ("sample", 12, 1),
                     ("get_at", torch.tensor([5, 0, 299, 7])), ("sample_flat", 13, 2)):
            assert _same(fast(work), plain(work)), work
        assert (fast._tree("get_at") is not None) == planned
