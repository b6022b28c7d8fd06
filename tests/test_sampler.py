"""MultiprocessingSampler wrapping UniEnv's own objects: every method, every start method."""
import collections
import gc
import multiprocessing as mp
import time

import numpy as np
import pytest
import torch
from unienv_data.base import BatchSampler
from unienv_data.batches.backend_compat import ToBackendOrDeviceBatch
from unienv_data.batches.framestack_batch import FrameStackedBatch
from unienv_data.samplers import StepSampler
from unienv_interface.backends.numpy import NumpyComputeBackend

from unienv_mp import MultiprocessingSampler, WorkerError
from unienv_mp.compat import worker_loop, wrap_epoch_iter_function, wrap_sample_function

import _data
from conftest import in_shared_memory
from _data import indices_of, replay_buffer


# -- every method, the drop-in surface -----------------------------------------------------

def _check_all_methods(m, n_rows):
    b = m.sample()
    assert isinstance(b, dict) and set(b) == {"state", "action", "image"}
    assert isinstance(b["image"], torch.Tensor) and b["image"].dtype == torch.uint8
    assert m.sampled_space.contains(b)
    flat = m.sample_flat()
    assert flat.shape == (m.batch_size, 10 + 7 + int(np.prod(_data.IMG)))
    b, meta = m.sample_with_metadata()
    assert m.sampled_space.contains(b) and meta is None
    flat, meta = m.sample_flat_with_metadata()
    assert flat.shape[0] == m.batch_size and meta is None
    idx = m.sample_index()
    assert idx.shape == (m.batch_size,) and int(idx.max()) < n_rows
    for it in (m.epoch_iter(), m.epoch_iter_with_metadata(), m.epoch_flat_iter(),
               m.epoch_flat_iter_with_metadata()):
        seen = []
        for batch in it:
            seen += indices_of(batch)
        assert sorted(seen) == list(range(n_rows))


def test_every_method_under_every_start_method(ctx):
    rb = replay_buffer(90)
    with MultiprocessingSampler(StepSampler(rb, 16, seed=1), n_workers=2, n_buffers=3,
                                ctx=ctx) as m:
        _check_all_methods(m, 90)
        # every batch was made by a worker: the sampler in this process never moved
        assert m.sampler.data_rng is not None


def test_drop_in_surface():
    rb = replay_buffer(50)
    s = StepSampler(rb, 8, seed=0)
    m = MultiprocessingSampler(s, n_workers=1, n_buffers=1, ctx="fork", doze_time=0.01,
                               daemon=True, shared_memory=True)
    from unienv_data.base import BatchSampler
    assert isinstance(m, BatchSampler)
    assert m.batch_size == 8 and m.single_space is s.single_space
    assert m.sampled_space is s.sampled_space and m.sampled_metadata_space is None
    assert m.backend is s.backend and m.device == s.device and m.data is rb and len(m) == 50
    rng = m.data_rng
    m.data_rng = rng
    assert m.rng is s.rng
    assert torch.equal(m.get_at(torch.tensor([3]))["state"], rb.get_at(torch.tensor([3]))["state"])
    assert m.get_flattened_at(torch.tensor([1, 2])).shape[0] == 2
    assert m.get_at_with_metadata(torch.tensor([1]))[1] is None
    assert m.get_flattened_at_with_metadata(torch.tensor([1]))[1] is None
    assert sorted(i for b in m for i in indices_of(b)) == list(range(50))  # __iter__
    m.close()
    m.close()
    assert m.closed
    for call in (m.sample, m.sample_flat, m.sample_with_metadata,
                 lambda: next(m.epoch_iter()), lambda: m.manual_seed(1) or m.sample()):
        with pytest.raises(RuntimeError, match="closed"):
            call()


class _Synthetic(BatchSampler):
    """A sampler that makes its batches up: no ``data``."""

    def __init__(self):
        from unienv_interface.backends.pytorch import PyTorchComputeBackend
        from unienv_interface.space import BoxSpace
        super().__init__(BoxSpace(PyTorchComputeBackend, -1.0, 1.0, torch.float32,
                                  shape=(3,)), None, 4)
        self.n = 0

    def sample(self):
        self.n += 1
        return torch.full((4, 3), float(self.n))


def test_a_sampler_without_data_is_wrapped():
    with MultiprocessingSampler(_Synthetic(), n_workers=1, n_buffers=1, ctx="fork") as m:
        assert [float(m.sample()[0, 0]) for _ in range(3)] == [1.0, 2.0, 3.0]


class _TwiceSampler(StepSampler):
    def sample_twice(self):
        return self.sample_index(), self.sample_index()


def test_an_extra_method_keeps_its_sampler_alive():
    rb = replay_buffer(50)
    fn = MultiprocessingSampler(_TwiceSampler(rb, 4, seed=0), n_workers=1, n_buffers=1,
                                ctx="fork").sample_twice
    gc.collect()
    a, b = fn()
    assert len(a) == 4 and len(b) == 4
    assert "sample_twice" in dir(fn.__self__)
    fn.__self__.close()
    with pytest.raises(RuntimeError, match="closed"):
        fn()


# -- epochs, seeds and batches requested ahead ---------------------------------------------

def test_epoch_covers_every_index_once_with_partial_last_batch():
    rb = replay_buffer(103)
    with MultiprocessingSampler(StepSampler(rb, 10, seed=3), n_workers=3, n_buffers=4,
                                ctx="fork") as m:
        for _ in range(2):
            sizes, seen = [], []
            for b in m.epoch_iter():
                sizes.append(b["state"].shape[0])
                seen += indices_of(b)
            assert sizes == [10] * 10 + [3]
            assert sorted(seen) == list(range(103))


def test_first_epoch_is_the_in_process_epoch_for_the_same_seed():
    rb = replay_buffer(100)
    expected = [indices_of(b) for b in StepSampler(rb, 16, seed=5).epoch_iter()]
    with MultiprocessingSampler(StepSampler(rb, 16, seed=5), n_workers=2, n_buffers=3,
                                ctx="fork") as m:
        assert [indices_of(b) for b in m.epoch_iter()] == expected


def test_same_seed_same_batches_whatever_the_timing():
    rb = replay_buffer(500)

    def run(delay_worker):
        s = StepSampler(rb, 12, seed=42)
        with MultiprocessingSampler(s, n_workers=3, n_buffers=4, ctx="fork") as m:
            out = []
            for i in range(15):
                if i % 5 == delay_worker:
                    time.sleep(0.05)
                out.append(indices_of(m.sample()))
            out.append([i for b in m.epoch_iter() for i in indices_of(b)][:40])
            return out

    a, b = run(0), run(3)
    assert a == b
    # ... and distinct workers drew distinct batches
    assert len({tuple(x) for x in a[:15]}) == 15


@pytest.mark.parametrize("direct", [None, False])
@pytest.mark.parametrize("k", [1, 3, None])
def test_batch_j_is_the_first_draw_of_the_sampler_seeded_for_batch_j(direct, k):
    """Whatever the batches per task, batch j of the stream is what the wrapped sampler
    draws first after manual_seed(chunk_seed(key, j)), key being the stream's key for the
    sampler's base seed (see unienv_mp._sampling.streams)."""
    from unienv_mp._sampling.streams import base_seed, chunk_seed, stream_key
    rb = replay_buffer(400)
    key = stream_key(base_seed(StepSampler(rb, 5, seed=9)), "sample")
    expected = [StepSampler(rb, 5, seed=chunk_seed(key, j)).sample_index().tolist()
                for j in range(18)]
    with MultiprocessingSampler(StepSampler(rb, 5, seed=9), n_workers=2, n_buffers=4,
                                ctx="fork", batches_per_task=k, direct_gather=direct) as m:
        got = [indices_of(m.sample()) for _ in range(18)]
        assert m.gather_path == ("generic" if direct is False else "direct")
    assert got == expected


@pytest.mark.parametrize("n_buffers,k", [(8, 3), (2, 4), (3, 7), (4, 4), (3, 1)])
def test_n_buffers_batches_stay_requested_ahead_with_groups(n_buffers, k):
    """Whatever k, after each call between n_buffers and n_buffers + k - 1 batches are
    requested ahead of the caller (the rest of the group being handed out, and the tasks
    in flight), as the README says: with k > n_buffers, a task must be in flight while
    the caller works through a group, not asked for only when the group runs out."""
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 4, seed=0), n_workers=2, n_buffers=n_buffers,
                                ctx="fork", batches_per_task=k) as m:
        for _ in range(3 * k + 1):
            m.sample()
            st = m._streams["sample"]
            ahead = len(st.ready) + k * len(st.tickets)
            assert n_buffers <= ahead <= n_buffers + k - 1, (len(st.ready), len(st.tickets))


def test_the_rest_of_a_group_is_dropped_by_manual_seed_and_close():
    rb = replay_buffer(100)
    m = MultiprocessingSampler(StepSampler(rb, 4, seed=0), n_workers=2, n_buffers=4,
                               ctx="fork", batches_per_task=4)
    with m:
        first = [indices_of(m.sample()) for _ in range(3)]   # one left of the first group
        m.manual_seed(0)
        assert not any(st.ready for st in m._streams.values())
        m2 = MultiprocessingSampler(StepSampler(rb, 4, seed=5), n_workers=2, n_buffers=4,
                                    ctx="fork", batches_per_task=4)
        with m2:
            m2.manual_seed(0)
            assert [indices_of(m2.sample()) for _ in range(5)] == \
                [indices_of(m.sample()) for _ in range(5)]
    with pytest.raises(RuntimeError, match="closed"):
        m.sample()
    assert first


def test_manual_seed_restarts_the_sequence():
    rb = replay_buffer(300)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=2, n_buffers=3,
                                ctx="fork") as m:
        m.manual_seed(7)
        first = [indices_of(m.sample()) for _ in range(6)]
        m.sample_flat()
        m.manual_seed(7)
        again = [indices_of(m.sample()) for _ in range(6)]
    assert first == again
    with MultiprocessingSampler(StepSampler(rb, 8, seed=123), n_workers=2, n_buffers=3,
                                ctx="fork") as fresh:
        fresh.manual_seed(7)
        assert [indices_of(fresh.sample()) for _ in range(6)] == first


def test_out_of_order_mode_returns_every_epoch_index():
    rb = replay_buffer(64)
    s = _data.SlowSampler(rb, 8, seed=0, delay=0.01)
    with MultiprocessingSampler(s, n_workers=3, n_buffers=4, ctx="fork", in_order=False) as m:
        assert sorted(i for b in m.epoch_iter() for i in indices_of(b)) == list(range(64))
        assert all(len(indices_of(m.sample())) == 8 for _ in range(10))


# -- the batches handed out: held, copied, other backends, views, structures ---------------

def test_held_batches_never_change():
    rb = replay_buffer(400)
    with MultiprocessingSampler(StepSampler(rb, 16, seed=5), n_workers=2, n_buffers=4,
                                ctx="fork") as m:
        held = []
        for i in range(40):      # beyond max_leases: later ones are copies, still correct
            b = m.sample()
            held.append((b, {k: v.clone() for k, v in b.items()}))
            if i % 2:
                m.sample()       # and dropped batches let their slots be reused
        for b, snapshot in held:
            for k in b:
                assert torch.equal(b[k], snapshot[k])
        # zero-copy: at least the first batches are views of shared memory, not copies
        assert in_shared_memory(held[0][0]["image"])


def test_copy_mode_returns_owned_arrays():
    rb = replay_buffer(60)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=5), n_workers=1, n_buffers=2,
                                ctx="fork", copy=True) as m:
        b = m.sample()
        assert not in_shared_memory(b["image"]) and not in_shared_memory(b["state"])


def test_numpy_backend_sampler():
    rb = replay_buffer(80)
    data = ToBackendOrDeviceBatch(rb, backend=NumpyComputeBackend)
    s = StepSampler(data, 8, seed=0)
    with MultiprocessingSampler(s, n_workers=2, n_buffers=2, ctx="fork") as m:
        b = m.sample()
        assert isinstance(b["image"], np.ndarray) and b["image"].dtype == np.uint8
        assert m.sampled_space.contains(b)
        assert sorted(i for x in m.epoch_iter() for i in indices_of(x)) == list(range(80))


def test_views_metadata_and_columns():
    rb = replay_buffer(120)
    stacked = FrameStackedBatch(rb, prefetch_horizon=2)
    with MultiprocessingSampler(StepSampler(stacked, 6, seed=0), n_workers=2, n_buffers=2,
                                ctx="fork") as m:
        b, meta = m.sample_with_metadata()
        assert b["image"].shape == (6, 3, *_data.IMG)
        assert isinstance(meta, dict) and meta["slice_valid_mask"].shape == (6, 3)
        assert m.sampled_space.contains(b)
        assert m.sampled_metadata_space.contains(meta)
    column = rb.get_column(["state"])
    with MultiprocessingSampler(StepSampler(column, 6, seed=0), n_workers=1, n_buffers=2,
                                ctx="fork") as m:
        b = m.sample()
        assert b.shape == (6, 10)
        assert sorted(int(i) for x in m.epoch_iter() for i in x[:, 0]) == list(range(120))


def test_memmap_storage(tmp_path, ctx):
    rb = replay_buffer(70, memmap_dir=str(tmp_path / "rb"))
    with MultiprocessingSampler(StepSampler(rb, 7, seed=0), n_workers=2, n_buffers=2,
                                ctx=ctx) as m:
        assert sorted(i for b in m.epoch_iter() for i in indices_of(b)) == list(range(70))


def test_batches_that_grow_and_change_structure():
    rb = replay_buffer(50)
    with MultiprocessingSampler(_data.VaryingSampler(rb, 4, seed=0), n_workers=2,
                                n_buffers=3, ctx="fork") as m:
        kinds = collections.Counter()
        for _ in range(24):
            b = m.sample()
            kinds[type(b).__name__ + (str(sorted(b)) if isinstance(b, dict) else "")] += 1
            if isinstance(b, dict) and "extra" in b:
                assert b["extra"].shape[0] % 1000 == 0 and float(b["extra"].sum()) == 0
        assert len(kinds) == 4


# -- data that changes while it is sampled -------------------------------------------------

def test_online_growth_of_a_multiprocessing_replay_buffer(ctx):
    rb = replay_buffer(10, capacity=400, multiprocessing=True)
    s = StepSampler(rb, 32, seed=0)
    with MultiprocessingSampler(s, n_workers=2, n_buffers=2, ctx=ctx) as m:
        assert max(indices_of(m.sample())) < 10
        rb.extend(_data.transitions(10, 390))
        seen = set()
        for _ in range(20):
            seen.update(indices_of(m.sample()))
        assert max(seen) >= 100, "workers did not see the new transitions"
        assert sorted(i for b in m.epoch_iter() for i in indices_of(b)) == list(range(400))


def test_each_epoch_sees_the_data_as_it_is_when_the_epoch_starts():
    # A ReplayBuffer in ordinary memory: workers hold a copy, so each epoch needs its own
    # (as UniEnv's epochs do).  Grown between epochs, then overwritten at the same length.
    rb = replay_buffer(100, capacity=200)
    with MultiprocessingSampler(StepSampler(rb, 32, seed=0), n_workers=2, n_buffers=2,
                                ctx="fork") as m:
        assert sorted(i for b in m.epoch_iter() for i in indices_of(b)) == list(range(100))
        assert len(indices_of(m.sample())) == 32       # the sampling pool starts here
        rb.extend(_data.transitions(100, 100))
        assert sorted(i for b in m.epoch_iter() for i in indices_of(b)) == list(range(200))
        rb.extend(_data.transitions(200, 200))         # every row replaced, len unchanged
        assert sorted(i for b in m.epoch_iter() for i in indices_of(b)) == \
            list(range(200, 400))
        assert max(indices_of(m.sample())) < 100       # sample() keeps its snapshot, as UniEnv
        assert not m._pools.own


# -- lifetime: an epoch left early, a sampler garbage-collected ----------------------------

def test_early_break_cleans_up_and_sampling_goes_on():
    rb = replay_buffer(200)
    with MultiprocessingSampler(StepSampler(rb, 10, seed=0), n_workers=2, n_buffers=6,
                                ctx="fork") as m:
        for _ in range(3):
            for i, b in enumerate(m.epoch_iter()):
                if i == 2:
                    break
        assert indices_of(m.sample())
        assert sorted(i for b in m.epoch_iter() for i in indices_of(b)) == list(range(200))
        gc.collect()
        pool = m._pools.sample
        # nothing accumulates: only the sample stream's look-ahead is still pending
        assert len(pool._tasks) <= m.n_buffers + 3 * 6


def test_garbage_collection_ends_the_workers():
    rb = replay_buffer(20)
    m = MultiprocessingSampler(StepSampler(rb, 4, seed=0), n_workers=2, ctx="fork")
    m.sample()
    m._pools.sample.start_all()   # (the second starts when the caller first waits otherwise)
    children = mp.active_children()
    pids = [p.pid for p in children]
    # the two workers, and the process that keeps their snapshot of the data (fork)
    assert sorted(p.name for p in children) == ["unienv_mp-snapshot", "unienv_mp-worker-0",
                                                "unienv_mp-worker-1"]
    del m
    gc.collect()
    import os
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


# -- worker errors and refused arguments ---------------------------------------------------

def test_a_worker_error_is_raised_and_the_sampler_goes_on():
    rb = replay_buffer(50)
    with MultiprocessingSampler(_data.FailingSampler(rb, 4, seed=0, fail_every=3),
                                n_workers=1, n_buffers=2, ctx="fork") as m:
        outcomes = []
        for _ in range(9):
            try:
                m.sample()
                outcomes.append("ok")
            except WorkerError as e:
                assert e.exc_type == "builtins.KeyError"
                assert "no such row" in e.exc_message
                assert "get_at" in e.worker_traceback and "raise KeyError" in e.worker_traceback
                assert isinstance(e.original, KeyError)
                outcomes.append("err")
        assert outcomes == ["ok", "ok", "err"] * 3


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"n_workers": 0}, ValueError, "n_workers"),
    ({"n_workers": "2"}, TypeError, "n_workers"),
    ({"n_buffers": 0}, ValueError, "n_buffers"),
    ({"n_buffers": 1.5}, TypeError, "n_buffers"),
    ({"doze_time": -1}, ValueError, "doze_time"),
    ({"ctx": 5}, TypeError, "ctx"),
    ({"timeout": 0}, ValueError, "timeout"),
    ({"batches_per_task": 0}, ValueError, "batches_per_task"),
    ({"batches_per_task": "2"}, TypeError, "batches_per_task"),
])
def test_bad_arguments_are_refused_clearly(kwargs, exc, words):
    rb = replay_buffer(10)
    with pytest.raises(exc, match=words):
        MultiprocessingSampler(StepSampler(rb, 2), **kwargs)


def test_numpy_integers_are_accepted_for_counts():
    rb = replay_buffer(50)
    with MultiprocessingSampler(StepSampler(rb, 4, seed=0), n_workers=np.int64(1),
                                n_buffers=np.int32(2), ctx="fork") as m:
        assert m.n_workers == 1 and type(m.n_workers) is int
        assert len(indices_of(m.sample())) == 4


def test_not_a_batch_sampler():
    with pytest.raises(TypeError, match="BatchSampler.*got builtins.list"):
        MultiprocessingSampler([1, 2, 3])


def test_a_sampler_on_another_device_is_refused():
    rb = replay_buffer(10)
    with pytest.raises(ValueError, match="CPU.*cuda"):
        MultiprocessingSampler(_data.CudaSampler(rb, 2))


def test_batches_on_another_device_raise_clearly():
    rb = replay_buffer(10)
    with MultiprocessingSampler(_data.DeviceSampler(rb, 2, seed=0), n_workers=1, n_buffers=1,
                                ctx="fork") as m:
        with pytest.raises(WorkerError, match="expected tensors on the CPU.*meta"):
            m.sample()


def test_unpicklable_sampler_under_spawn():
    rb = replay_buffer(10)
    m = MultiprocessingSampler(_data.Unpicklable(rb, 2, seed=0), n_workers=1, n_buffers=1,
                               ctx="spawn")
    with pytest.raises(TypeError, match="spawn.*picklable"):
        m.sample()
    m.close()


# -- UniEnv's module-level helpers ---------------------------------------------------------

def test_wrap_sample_function_and_epoch_iter_function():
    rb = replay_buffer(40)
    s = StepSampler(rb, 5, seed=0)
    fn = wrap_sample_function(s, 2, 2, s.sample, ctx=mp.get_context("fork"))
    assert fn.sample_manager is None
    assert s.sampled_space.contains(fn())
    assert fn.sample_manager is not None
    fn.close()
    assert fn.sample_manager is None
    epoch = wrap_epoch_iter_function(s, 2, 3, s.get_at, ctx=mp.get_context("fork"))
    assert sorted(i for b in epoch() for i in indices_of(b)) == list(range(40))


def _double(x):
    if x == 3:
        raise ValueError("three")
    return 2 * x


def test_worker_loop_with_multiprocessing_queues():
    ctx = mp.get_context("fork")
    work, results, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=worker_loop, args=(_double, work, results, done, 0.01))
    p.start()
    for i in range(5):
        work.put(i)
    got = [results.get(timeout=30) for _ in range(5)]
    done.set()
    p.join(10)
    assert p.exitcode == 0
    assert got[:3] == [0, 2, 4] and got[4] == 8
    assert isinstance(got[3], WorkerError) and got[3].exc_message == "three"


def test_a_sampler_dropped_without_close_ends_its_workers_at_once():
    """Nothing a sampler owns (its managers, their pools, its epochs) refers back to it
    or to a manager: dropped, everything is freed by reference counting, with no garbage
    collection, and the workers end."""
    import weakref

    from conftest import process_running, wait_until
    rb = replay_buffer(100)
    gc.disable()
    try:
        m = MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=2, ctx="fork")
        m.sample()
        it = m.epoch_iter()
        next(it)   # (an epoch begun, its batches requested ahead)
        pids = [p.pid for p in m._pools.sample.workers]
        manager = weakref.ref(m._pools.sample)
        ref = weakref.ref(m)
        del m, it
        assert ref() is None and manager() is None

        assert wait_until(lambda: not any(process_running(pid) for pid in pids),
                          timeout=30)
    finally:
        gc.enable()
