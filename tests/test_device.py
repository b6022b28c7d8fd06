"""Batches on a device, on the CPU: the device feed's ordering and release rules
(unienv_mp/_device/feed.py) driven through the sampler with a fake device whose copies
complete later (tests/_fake_device.py), the placement of samplers, ``pin_memory``, and the
in-process manager for data on a GPU.  The tests that need CUDA are in test_cuda.py."""
import collections
import warnings

import pytest
import torch
from unienv_data.samplers import StepSampler

import unienv_mp._device.ops as ops_mod
import unienv_mp._sampling.sampler as sampler_mod
from unienv_mp import MultiprocessingSampler, WorkerError
from unienv_mp._device.placement import Placement, cpu_twin, place
from unienv_mp._device.resident import InProcessManager, own_target
from unienv_mp._sampling.target import SamplerTarget

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
        assert fake.pending()                              # work in flight ...
        m.close()                                          # ... its copies waited for
    assert not fake.pending_copies()
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


def test_pin_memory_without_cuda_warns_and_goes_on(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # (also on a GPU)
    rb = replay_buffer(50)
    with pytest.warns(RuntimeWarning, match="pin_memory=True.*CUDA"):
        m = MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=1, pin_memory=True)
    with m:
        assert m.sample()["state"].shape == (8, 10)
        assert m.stats().device is None


def test_device_cuda_without_cuda_is_refused_at_once_naming_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # (also on a GPU)
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


# -- an outsider's attacks, each a test ------------------------------------------------------

def _ctrl_c_at(func, marker):
    """Send this process a SIGINT just before the first line of ``func`` holding
    ``marker`` runs (once)."""
    import inspect
    import signal
    import sys
    lines, start = inspect.getsourcelines(func)
    lineno = start + next(i for i, t in enumerate(lines) if marker in t)
    code = func.__code__

    def call(frame, event, arg):
        if frame.f_code is code:
            def line(frame, event, arg):
                if event == "line" and frame.f_lineno == lineno:
                    sys.settrace(None)
                    signal.raise_signal(signal.SIGINT)
                return line
            return line
    sys.settrace(call)


def _untrace():
    import sys
    sys.settrace(None)


@pytest.mark.parametrize("marker", ["feed.start(ready[0])", "manager.ready(tickets[0])",
                                    "self._early[name] = ", "feed.start(taken.value[0])"])
def test_a_ctrl_c_in_the_look_ahead_moves_nothing(fake, marker):
    # The batch whose hand-out a Ctrl-C cuts short is handed out by the next call, and a
    # checkpoint taken meanwhile resumes at it.
    from unienv_mp._device.handout import DeviceHandOut
    rb = replay_buffer(300)
    # (chunks of 2: the next batch is in the chunk every other call, else in the next task)
    kw = dict(n_workers=1, n_buffers=2, batches_per_task=2, ctx="fork")
    with MultiprocessingSampler(StepSampler(rb, 8, seed=0), **kw) as m:
        ref = [_data.indices_of(m.sample()) for _ in range(8)]
    with MultiprocessingSampler(_on_cuda(StepSampler(rb, 8, seed=0)), **kw) as m:
        got = [m.sample() for _ in range(2)]
        for _ in range(4):   # (until the look-ahead reaches the line)
            _ctrl_c_at(DeviceHandOut._look_ahead, marker)
            try:
                got.append(m.sample())
            except KeyboardInterrupt:
                checkpoint, handed = m.state_dict(), len(got)
                break
            finally:
                _untrace()
        else:
            pytest.fail(f"the look-ahead never reached {marker!r}")
        while len(got) < 8:
            got.append(m.sample())
        fake.run_all()
        assert [_data.indices_of(b) for b in got] == ref
    with MultiprocessingSampler(_on_cuda(StepSampler(rb, 8, seed=0)), **kw) as m:
        m.load_state_dict(checkpoint)
        b = m.sample()
        fake.run_all()
        assert _data.indices_of(b) == ref[handed]
    assert not fake.violations


@pytest.mark.parametrize("func,marker", [
    ("_submit", "self._jobs.append(job)"),          # a segment handed to the pins' thread
    ("wait", "self.collect()"),                      # a registration waited for, not taken in
    ("_take_in", "self._pins.insert(i, pin)"),      # a registration being taken in
])
def test_a_ctrl_c_while_a_slot_is_page_locked(fake, func, marker):
    # Each segment is registered once, and recorded exactly when registered: later calls
    # work, nothing is registered twice, and close() unregisters everything.
    from unienv_mp._device.pins import HostPins
    rb = replay_buffer(300, img=IMG)
    m = MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=0)), n_workers=1,
                               ctx="fork")
    with m:
        _ctrl_c_at(getattr(HostPins, func), marker)
        try:
            with pytest.raises(KeyboardInterrupt):
                for _ in range(20):   # (until a new slot is met)
                    m.sample()
        finally:
            _untrace()
        for _ in range(5):
            m.sample()
        assert fake.registrations == len(fake.registered)
    fake.run_all()
    assert fake.registered == {} and not fake.violations


def test_a_close_cut_short_is_finished_by_the_next(fake):
    from unienv_mp._device.feed import DeviceFeed
    rb = replay_buffer(300, img=IMG)
    m = MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=0)), n_workers=1,
                               ctx="fork")
    for _ in range(10):
        m.sample()
    assert m.stats().device.in_flight
    _ctrl_c_at(DeviceFeed.close, "self._ops.synchronize(copy.end)")
    try:
        with pytest.raises(KeyboardInterrupt):
            m.close()
    finally:
        _untrace()
    m.close()
    assert fake.registered == {} and not fake.violations


@pytest.mark.parametrize("between", ["stats", "sample_with_metadata"])
def test_a_copy_issued_ahead_is_used_whatever_runs_between_calls(monkeypatch, between):
    ops = FakeOps(speed=1000)   # (every copy completes at once, as on a fast GPU)
    monkeypatch.setattr(ops_mod, "for_device", lambda device: ops)
    rb = replay_buffer(500, img=IMG)
    with MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=3)), n_workers=2,
                                ctx="fork") as m:
        m.sample()
        m.sample_with_metadata()
        for _ in range(100):
            m.sample()
            getattr(m, between)()
        n = 102 + (100 if between == "sample_with_metadata" else 0)
        # (each batch copied once; a few copies issued ahead for batches still waiting)
        assert m.stats().device.copies <= n + 4


def test_a_worker_error_met_looking_ahead_goes_with_its_stream(fake):
    # A fresh stream (manual_seed, load_state_dict) does not inherit it.
    import time
    from unienv_mp._sampling.streams import base_seed, chunk_seed, stream_key
    rb = replay_buffer(300)
    bad = chunk_seed(stream_key(base_seed(StepSampler(rb, 8, seed=1)), "sample"), 2)

    class FailOnSeed(StepSampler):
        def manual_seed(self, seed):
            self.seed_ = seed
            return super().manual_seed(seed)

        def get_at(self, idx):
            if getattr(self, "seed_", None) == bad:
                raise KeyError("bad chunk")
            return super().get_at(idx)

    for how in ("manual_seed", "load_state_dict"):
        with MultiprocessingSampler(_on_cuda(FailOnSeed(rb, 8, seed=1)), n_workers=1,
                                    n_buffers=2, batches_per_task=1, ctx="fork") as m:
            fresh = m.state_dict()
            m.sample()
            time.sleep(0.5)   # (chunk 2, which raises, has come back)
            m.sample()        # (its look-ahead collects chunk 2)
            if how == "manual_seed":
                m.manual_seed(5)
            else:
                m.load_state_dict(fresh)
            m.sample()        # (a fresh stream's first batch)
            if how == "load_state_dict":
                m.sample()
                with pytest.raises(WorkerError, match="bad chunk"):
                    m.sample()   # (chunk 2 of the restored stream raises in turn)
    fake.run_all()


@pytest.mark.parametrize("device", [False, True])
def test_a_forked_childs_close_leaves_the_parent_alone(fake, device):
    import os
    rb = replay_buffer(300, img=IMG)
    kw = dict(n_workers=2, ctx="fork")
    ref = [_data.indices_of(b) for b in _cpu_stream(rb, 40, **kw)]
    s = StepSampler(rb, 64, seed=3)
    with MultiprocessingSampler(_on_cuda(s) if device else s, **kw) as m:
        out = [m.sample() for _ in range(10)]
        fake.run_all()
        out = [_data.indices_of(b) for b in out]
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                m.stats()
                m.close()
                code = 5 if fake.unregistrations else 0
            except BaseException:
                code = 6
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # (no worker replaced)
            more = [m.sample() for _ in range(30)]
        fake.run_all()
        out += [_data.indices_of(b) for b in more]
    assert out == ref
    assert fake.registered == {} and not fake.violations


def test_copy_true_keeps_device_copies_from_page_locked_slots(fake):
    rb = replay_buffer(300, img=IMG)
    ref = _cpu_stream(rb, 20, n_workers=2, ctx="fork")
    with MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=3)), n_workers=2,
                                ctx="fork", copy=True) as m:
        out = [m.sample() for _ in range(20)]
        assert m.stats().device.pageable_leaves == 0
    fake.run_all()
    assert all(_same(a, b) for a, b in zip(ref, out))


def test_pin_memory_close_waits_for_the_device_before_unregistering(fake, monkeypatch):
    monkeypatch.setattr(ops_mod, "cuda_unavailable", lambda device: None)
    rb = replay_buffer(300)
    with pytest.raises(ValueError, match="pin_memory=True.*copy=True"):
        MultiprocessingSampler(StepSampler(rb, 64, seed=3), pin_memory=True, copy=True)
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=2, ctx="fork",
                                pin_memory=True) as m:
        held = m.sample()   # (the caller's own copy of it may still run)
    assert fake.device_syncs == 1 and fake.registered == {}
    assert held["state"].shape == (64, 10)


# -- pin_memory: a batch is kept until the caller's copies of it are done -------------------

def _copy_through(fake, m, idiom, n):
    """The device batches a caller gets from ``n`` pinned batches of ``m`` with its own
    copies (``.to("cuda", non_blocking=True)``), written as ``idiom``: the CPU batch is
    dropped at once, rebound each step, held one call longer (a batch prefetched), or kept
    three calls before its copy."""
    out = []
    if idiom == "chained":
        for _ in range(n):
            out.append(fake.user_copy(m.sample()))
    elif idiom == "rebound":
        for _ in range(n):
            batch = m.sample()
            batch = fake.user_copy(batch)
            out.append(batch)
    elif idiom == "prefetched":
        nxt = m.sample()
        for _ in range(n - 1):
            cur, nxt = nxt, m.sample()
            out.append(fake.user_copy(cur))
            del cur
        out.append(fake.user_copy(nxt))
    else:   # "kept"
        window = collections.deque()
        for _ in range(n):
            window.append(m.sample())
            if len(window) > 3:
                out.append(fake.user_copy(window.popleft()))
        out += [fake.user_copy(window.popleft()) for _ in range(len(window))]
    return out


@pytest.mark.parametrize("idiom", ["chained", "rebound", "prefetched", "kept"])
def test_pin_memory_in_the_usual_loop_is_bit_exact_when_copies_finish_late(fake, monkeypatch,
                                                                          idiom):
    # The caller's copies run only when something makes the device catch up, and one
    # worker with one buffer writes into a slot as soon as it is back: a slot given back
    # before the caller's copy of it ran gives a wrong batch here.
    monkeypatch.setattr(ops_mod, "cuda_unavailable", lambda device: None)
    rb = replay_buffer(500, img=IMG)
    ref = _cpu_stream(rb, 60, ctx="fork", **TIGHT)
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), ctx="fork", pin_memory=True,
                                **TIGHT) as m:
        out = _copy_through(fake, m, idiom, 60)
        assert m.stats().device.in_flight <= 4   # (bounded: the caller waits beyond)
        assert fake.pending()                    # (copies still queued at close)
    fake.run_all()
    assert len(out) == 60 and sum(not _same(a, b) for a, b in zip(ref, out)) == 0
    assert not fake.violations


def test_pin_memory_keeps_a_slot_while_a_view_of_its_batch_lives(fake, monkeypatch):
    # A view (or a .numpy() array) of the batch keeps it in use: the event is recorded
    # only after the last one is gone.
    monkeypatch.setattr(ops_mod, "cuda_unavailable", lambda device: None)
    rb = replay_buffer(500, img=IMG)
    ref = _cpu_stream(rb, 30, ctx="fork", **TIGHT)
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), ctx="fork", pin_memory=True,
                                **TIGHT) as m:
        out = []
        for _ in range(30):
            b = m.sample()
            view, arr = b["image"][::2], b["state"].numpy()
            del b
            m.sample_index()   # (a call in between: the view still lives)
            out.append((fake.user_copy(view), fake.user_copy(torch.from_numpy(arr))))
            del view, arr
    fake.run_all()
    assert not fake.violations
    assert all(torch.equal(img, r["image"][::2]) and torch.equal(state, r["state"])
               for (img, state), r in zip(out, ref))


def test_pin_memory_close_and_sweeps_unregister_nothing_a_queued_copy_reads(fake,
                                                                           monkeypatch):
    # Epochs on workers of their own: each epoch's slots stop backing a slot when it ends,
    # and are swept at the next; the caller dropped every batch, its copies still queued.
    monkeypatch.setattr(ops_mod, "cuda_unavailable", lambda device: None)
    rb = replay_buffer(300, img=IMG)
    kw = dict(n_workers=1, ctx="fork", persistent_workers=False)
    with MultiprocessingSampler(StepSampler(rb, 64, seed=5), **kw) as m:
        ref = [_clone(b) for _ in range(3) for b in m.epoch_iter()]
    with MultiprocessingSampler(StepSampler(rb, 64, seed=5), pin_memory=True, **kw) as m:
        out = [fake.user_copy(b) for _ in range(3) for b in m.epoch_iter()]
        assert m.stats().device.pinned_slots
    fake.run_all()
    assert not fake.violations
    assert len(out) == 15 and all(_same(a, b) for a, b in zip(ref, out))


# -- registrations: off the caller's thread, counted -------------------------------------

def test_slots_are_page_locked_off_the_callers_thread_and_counted(fake):
    rb = replay_buffer(500, img=IMG)
    with MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=3)), n_workers=2,
                                ctx="fork") as m:
        for _ in range(40):
            m.sample()
        stats = m.stats(reset=True).device
        assert stats.registrations == fake.registrations > 0
        assert stats.registration_seconds > 0
        assert m.stats().device.registrations == 0   # (reset)
    assert fake.threads == {"unienv_mp page-locking"}   # (the unregistrations too)
    assert fake.registered == {} and not fake.violations


def test_a_batch_waits_for_its_slot_being_page_locked_and_is_never_copied_meanwhile(
        monkeypatch):
    ops = FakeOps(speed=1)
    ops.register_delay = 0.02
    monkeypatch.setattr(ops_mod, "for_device", lambda device: ops)
    rb = replay_buffer(500, img=IMG)
    ref = _cpu_stream(rb, 40, n_workers=3, ctx="fork")
    with MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=3)), n_workers=3,
                                ctx="fork") as m:
        out = [m.sample() for _ in range(40)]
        assert m.stats().device.pageable_leaves == 0
    ops.run_all()
    assert not ops.violations
    assert all(_same(a, b) for a, b in zip(ref, out))


def test_the_benchmark_warms_up_until_a_window_without_registrations(fake):
    from unienv_mp.bench.cuda import warm_up
    rb = replay_buffer(500, img=IMG)
    with MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=3)), n_workers=2,
                                ctx="fork") as m:
        steps = warm_up(m, m.sample, window=10)
        # (the first window met the slots' registrations)
        assert steps >= 20 and steps % 10 == 0
        assert fake.registrations > 0


# -- the copy stream is never the caller's -------------------------------------------------

def test_a_copy_stream_made_current_by_the_caller_is_replaced(fake):
    rb = replay_buffer(300)
    ref = _cpu_stream(rb, 20, n_workers=2, ctx="fork")
    with MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=3)), n_workers=2,
                                ctx="fork") as m:
        out = [m.sample() for _ in range(5)]
        fake.current = fake.copy_streams[0]
        with pytest.warns(RuntimeWarning, match="copy stream"):
            out.append(m.sample())
        assert len(fake.copy_streams) == 2
        issued = fake.copy_streams[0].copies
        out += [m.sample() for _ in range(14)]
        assert fake.copy_streams[0].copies == issued   # (the later copies: on the new one)
        assert fake.copy_streams[1].copies >= 14
    fake.run_all()
    assert not fake.violations
    assert all(_same(a, b) for a, b in zip(ref, out))


# -- a forked child frees nothing of its parent's device --------------------------------------

def _child_closes(m, fake):
    """Fork; the child closes its copy of ``m``, drops it, and exits 0 if nothing made on
    the (fake) device was freed there."""
    import gc
    import os
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            m.close()
            del m
            gc.collect()
            bad = [v for v in fake.violations if "destroyed in" in v or "freed in" in v]
            code = 7 if bad else 0
            if fake.unregistrations:
                code = 5
        except BaseException:
            code = 6
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("mode", ["copy", "pinned", "resident"])
def test_a_forked_childs_close_frees_no_event_nor_device_tensor(fake, monkeypatch, mode):
    monkeypatch.setattr(ops_mod, "cuda_unavailable", lambda device: None)
    rb = replay_buffer(300, img=IMG)
    kw = dict(n_workers=1, ctx="fork")
    if mode == "copy":
        m = MultiprocessingSampler(_on_cuda(StepSampler(rb, 64, seed=3)), **kw)
    elif mode == "pinned":
        m = MultiprocessingSampler(StepSampler(rb, 64, seed=3), pin_memory=True, **kw)
    else:
        _in_process_on(monkeypatch, "cuda:0")
        m = MultiprocessingSampler(StepSampler(rb, 64, seed=3), **kw)
    with m:
        for _ in range(6):
            b = m.sample()
            if mode == "pinned":
                fake.user_copy(b)
            del b
        m.sample()
        assert fake.pending() or mode == "resident"   # (work still queued on the device)
        assert _child_closes(m, fake) == 0
        m.sample()
    fake.run_all()
    assert not fake.violations


# -- what is copied from pageable memory ------------------------------------------------------

def test_a_leaf_that_is_not_contiguous_counts_as_pageable(fake):
    from unienv_mp._device.feed import DeviceFeed
    from unienv_mp._transport.ring import Segment
    seg = Segment.create(1 << 16, "test")
    try:
        whole = torch.frombuffer(seg, dtype=torch.uint8)
        whole.copy_(torch.randint(0, 256, (1 << 16,), dtype=torch.uint8))
        grid = whole[:4096].view(64, 64)
        batch = {"t": grid.t(), "c": whole[4096:8192]}
        feed = DeviceFeed(fake, lambda: [seg])
        out = feed.hand_out(batch)
        stats = feed.stats()
        assert stats.pageable_leaves == 1 and stats.pinned_slots == 1
        fake.run_all()
        assert _same(out, {k: v.clone() for k, v in batch.items()})
        feed.close()
        del whole, grid, batch
    finally:
        seg.close()
    assert fake.registered == {} and not fake.violations


# -- data on the GPU: a chunk handed out on another stream ----------------------------------

def _in_process_on(monkeypatch, device):
    """Place every sampler in this process, as data on ``device`` is (here on the CPU)."""
    monkeypatch.setattr(sampler_mod, "place", lambda sampler, who: Placement(
        "in_process", torch.device(device), None, f"the data is on {device} (pretended)"))


def test_a_chunk_made_on_one_stream_and_handed_out_on_another_waits_for_it(fake,
                                                                         monkeypatch):
    rb = replay_buffer(300)
    ref = _cpu_stream(rb, 10, n_workers=2, ctx="fork", direct_gather=False)
    _in_process_on(monkeypatch, "cuda:0")
    side = fake.side_stream()
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=2) as m:
        assert m.gather_path == "in_process"
        out = [m.sample()]   # (its chunk of 8 made now, on the caller's stream)
        assert fake.waited == [] and fake.held == []
        fake.current = side
        out.append(m.sample())   # (made on the caller's stream, handed out on side)
        assert fake.waited == [("side", "caller", 0)]
        assert sorted(fake.held) == sorted((t.data_ptr(), "side") for t in out[1].values())
        index = m.sample_index()   # (its own chunk: made on side, handed out on side)
        assert isinstance(index, torch.Tensor)
        fake.current = fake.caller_stream
        out += [m.sample() for _ in range(8)]   # (the rest made on the stream current)
        assert fake.waited == [("side", "caller", 0)]
        epoch = list(m.epoch_iter())
        assert sorted(i for b in epoch for i in _data.indices_of(b)) == list(range(300))
    assert all(_same(a, b) for a, b in zip(ref, out))
    assert not fake.violations


# -- an outsider's attacks on the kept batches and the pins' thread ---------------------------

def _by_index(batches):
    return {tuple(_data.indices_of(b)): b for b in batches}


def test_pin_memory_from_two_threads_with_late_copies(fake, monkeypatch):
    import threading
    monkeypatch.setattr(ops_mod, "cuda_unavailable", lambda device: None)
    fake.register_delay = 0.005
    rb = replay_buffer(500, img=IMG)
    ref = _by_index(_cpu_stream(rb, 120, n_workers=2, ctx="fork"))
    outs = [[], []]
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=2, ctx="fork",
                                pin_memory=True) as m:
        def run(i):
            for _ in range(60):
                outs[i].append(fake.user_copy(m.sample()))
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    fake.run_all()
    got = _by_index(outs[0] + outs[1])
    assert len(got) == 120 and all(_same(ref[k], b) for k, b in got.items())
    assert not fake.violations


def test_pin_memory_with_workers_killed_and_late_copies(fake, monkeypatch):
    # A replaced worker's segments stop backing slots: swept only once the batches kept
    # from them are let go and their copies done.
    import os
    import signal
    monkeypatch.setattr(ops_mod, "cuda_unavailable", lambda device: None)
    rb = replay_buffer(500, img=IMG)
    kw = dict(n_workers=3, ctx="fork")
    ref = _cpu_stream(rb, 100, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # (the workers replaced)
        with MultiprocessingSampler(StepSampler(rb, 64, seed=3), pin_memory=True, **kw) as m:
            out = []
            for i in range(100):
                out.append(fake.user_copy(m.sample()))
                if i % 25 == 10:
                    workers = m._pools.sample.workers
                    os.kill(workers[i % len(workers)].pid, signal.SIGKILL)
    fake.run_all()
    assert all(_same(a, b) for a, b in zip(ref, out))
    assert fake.registered == {} and not fake.violations


def test_a_sampler_dropped_while_slots_are_being_page_locked_ends_its_thread(monkeypatch):
    import gc
    import threading
    ops = FakeOps()
    ops.register_delay = 0.05
    monkeypatch.setattr(ops_mod, "for_device", lambda device: ops)
    monkeypatch.setattr(ops_mod, "cuda_unavailable", lambda device: None)
    rb = replay_buffer(300, img=IMG)
    m = MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=4, ctx="fork",
                               pin_memory=True)
    for _ in range(3):
        m.sample()
    assert [t for t in threading.enumerate() if t.name == "unienv_mp page-locking"]
    del m
    gc.collect()
    assert not [t for t in threading.enumerate() if t.name == "unienv_mp page-locking"]
    assert ops.registered == {} and not ops.violations


def test_pin_memory_keeps_only_batches_in_page_locked_slots(fake, monkeypatch):
    # A caller holding many batches: beyond the manager's leases they are copied out of
    # their slots, into pageable memory that no copy can outlive, and not kept; the
    # feed looks at a bounded number of those it keeps at each call.
    monkeypatch.setattr(ops_mod, "cuda_unavailable", lambda device: None)
    rb = replay_buffer(500, img=IMG)
    ref = _cpu_stream(rb, 60, n_workers=1, ctx="fork", batches_per_task=1)
    with MultiprocessingSampler(StepSampler(rb, 64, seed=3), n_workers=1, ctx="fork",
                                batches_per_task=1, pin_memory=True) as m:
        held = [m.sample() for _ in range(60)]
        kept = m._feed.kept
        assert len(kept._held) <= 2 * 1 + 8 + 1
        assert m.stats().device.pageable_leaves >= 3 * 40
        out = [fake.user_copy(b) for b in held]
        del held
        for _ in range(3):
            m.sample()
    fake.run_all()
    assert all(_same(a, b) for a, b in zip(ref, out))
    assert not fake.violations
