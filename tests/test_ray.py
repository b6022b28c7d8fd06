"""RaySampler on a local Ray: the same batches as MultiprocessingSampler, epochs, the
factory, faults, checkpoints, what the caller gets, and which Ray it uses."""
import gc
import os
import pickle
import time
import weakref

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' "
                                        "(CI installs it)")

import _data  # noqa: E402
from _data import indices_of, mapping_of, replay_buffer  # noqa: E402
from unienv_data.batches.backend_compat import ToBackendOrDeviceBatch  # noqa: E402
from unienv_data.samplers import StepSampler  # noqa: E402
from unienv_interface.backends.numpy import NumpyComputeBackend  # noqa: E402

from unienv_mp import MultiprocessingSampler, WorkerDiedError, WorkerError  # noqa: E402
from unienv_mp.ray import RaySampler, RemoteSampler  # noqa: E402
from unienv_mp._transport import codec as _codec  # noqa: E402
from unienv_mp.ray._batch import ActorFrames, LaneSlots, read_frame  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    # (the actors import the tests' helper module _data, as spawned workers do)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": TESTS}})
    yield
    ray.shutdown()


def same(a, b):
    """Bit for bit: structure, key order, types, dtypes, shapes and values."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point else a,
                           b.view(torch.uint8) if b.dtype.is_floating_point else b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    else:
        assert a == b


def take(sampler, n, method="sample"):
    return [getattr(sampler, method)() for _ in range(n)]


def factory(n=120, batch_size=8, seed=5):
    """A sampler_factory: each actor makes the same buffer (rows named by their index)."""
    def make():
        import _data as d
        from unienv_data.samplers import StepSampler as S
        torch.manual_seed(0)
        return S(d.replay_buffer(n), batch_size, seed=seed)
    return make


# -- the same batches as MultiprocessingSampler ------------------------------------------

@pytest.mark.parametrize("direct_gather,local_slots", [(None, True), (None, False),
                                                      (False, True)])
def test_the_same_batches_as_multiprocessing_sampler_bit_for_bit(direct_gather, local_slots):
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=3), n_workers=3, ctx="fork") as m:
        want = {name: take(m, 12, name) for name in
                ("sample", "sample_flat", "sample_with_metadata", "sample_index")}
        want_epoch = list(m.epoch_iter())
        want_flat_epoch = list(m.epoch_flat_iter())
    with RaySampler(StepSampler(rb, 8, seed=3), n_workers=2, n_buffers=3,
                    direct_gather=direct_gather, local_slots=local_slots) as r:
        assert r.gather_path == ("generic" if direct_gather is False else "direct")
        assert len(r.workers) == 2
        for name, batches in want.items():
            for a, b in zip(batches, take(r, 12, name)):
                same(a, b)
        for a, b in zip(want_epoch, list(r.epoch_iter()), strict=True):
            same(a, b)
        for a, b in zip(want_flat_epoch, list(r.epoch_flat_iter()), strict=True):
            same(a, b)
        assert r.sampled_space.contains(r.sample())


@pytest.mark.parametrize("tasks_per_call,in_order", [(1, True), (3, True), (3, False)])
def test_tasks_per_call_do_not_change_the_batches(tasks_per_call, in_order):
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=6), n_workers=2, ctx="fork",
                                batches_per_task=2) as m:
        want = [indices_of(b) for b in take(m, 60)]
        it = m.epoch_iter()
        want_first = [indices_of(next(it)) for _ in range(3)]
        del it
        want_epoch = [indices_of(b) for b in m.epoch_iter()]
        want_after = [indices_of(b) for b in take(m, 20)]
    with RaySampler(StepSampler(rb, 8, seed=6), n_workers=2, batches_per_task=2,
                    tasks_per_call=tasks_per_call, n_buffers=20, in_order=in_order) as r:
        got = [indices_of(b) for b in take(r, 60)]
        it = r.epoch_iter()
        first = [indices_of(next(it)) for _ in range(3)]
        del it   # (an epoch left early: its tasks, sent or waiting, are cancelled)
        epoch = [indices_of(b) for b in r.epoch_iter()]
        after = [indices_of(b) for b in take(r, 20)]
        assert r.tasks_per_call == tasks_per_call
        stats = r.stats()
    if in_order:
        assert got == want and after == want_after
    else:   # (whole chunks of 2 of the same stream, in another order)
        assert all(b in want for b in got[:30])   # (requested within the first 60)
        assert len({tuple(b) for b in got}) == 60
    assert sorted(i for b in epoch for i in b) == list(range(100))
    assert (first, epoch) == (want_first, want_epoch) or not in_order
    assert sum(w.batches for w in stats.workers) >= 80


def test_the_default_calls_and_depth_follow_the_batch_size():
    small = replay_buffer(200)                  # 2 KiB batches of 8 rows
    large = replay_buffer(200, img=(3, 256, 256))   # 1.5 MiB batches
    with RaySampler(StepSampler(small, 8, seed=0), n_workers=2) as r:
        assert (r.tasks_per_call, r.chunk_size("sample")) == (8, 8)
        assert r.n_buffers == 4 * 2 * 8 * 8   # four calls per actor
        take(r, 300)
    with RaySampler(StepSampler(large, 8, seed=0), n_workers=2) as r:
        # (four tasks a call: four calls of them per actor fit in 256 MiB)
        assert (r.tasks_per_call, r.chunk_size("sample"), r.n_buffers) == (4, 1, 32)
    with RaySampler(StepSampler(large, 8, seed=0), n_workers=3, direct_gather=False,
                    num_cpus_per_worker=0.5) as r:
        assert (r.tasks_per_call, r.n_buffers) == (2, 8)   # (a size not known yet)
        r.sample_index()   # (indices: not what a batch's size is told by)
        assert r.n_buffers == 8
        r.sample()
        # (then known: as gathered directly, four a call, four calls of them per actor)
        assert (r.tasks_per_call, r.n_buffers) == (4, 4 * 3 * 4)
        assert r._actors.group == 4
        take(r, 60)
    with RaySampler(StepSampler(small, 8, seed=0), n_workers=2, direct_gather=False,
                    batches_per_task=4) as r:
        r.sample()   # (then known: tasks of 4 small batches, 8 a call)
        assert (r.tasks_per_call, r.n_buffers) == (8, 4 * 2 * 8 * 4)
    with RaySampler(StepSampler(small, 8, seed=0), n_workers=2, direct_gather=False,
                    tasks_per_call=3) as r:
        r.sample()   # (what the caller chose stays)
        assert (r.tasks_per_call, r._actors.group) == (3, 3)
        sampler = weakref.ref(r)
    del r
    gc.collect()
    assert sampler() is None
    with RaySampler(StepSampler(small, 8, seed=0), n_workers=2, n_buffers=5,
                    tasks_per_call=1) as r:
        assert (r.tasks_per_call, r.n_buffers) == (1, 5)
    # (n_buffers chosen: no more tasks a call than the batches ahead give each actor, or
    # no call would go ahead of the caller)
    with RaySampler(StepSampler(small, 8, seed=0), n_workers=2, n_buffers=32) as r:
        assert (r.tasks_per_call, r.chunk_size("sample")) == (2, 8)
    with RaySampler(StepSampler(small, 8, seed=0), n_workers=2, n_buffers=8,
                    direct_gather=False) as r:
        r.sample()   # (sized: 8 a call by size, but the tasks ahead give each actor fewer)
        k = r.chunk_size("sample")
        assert r.n_buffers == 8 and r.tasks_per_call == max(1, 8 // k // 2) < 8


@pytest.mark.parametrize("persistent_workers", [None, True, False])
def test_epochs_see_the_data_as_it_is_and_keep_their_actors_while_it_does_not_change(
        persistent_workers):
    rb = replay_buffer(40, capacity=200)
    with RaySampler(StepSampler(rb, 8, seed=0), n_workers=2,
                    persistent_workers=persistent_workers) as r:
        sample_actors = list(r.workers)
        assert sorted(i for b in r.epoch_iter() for i in indices_of(b)) == list(range(40))
        first = r.epoch_workers
        rb.extend(_data.transitions(40, 20))   # (the actors hold the first 40 rows)
        assert sorted(i for b in r.epoch_iter() for i in indices_of(b)) == list(range(60))
        second = r.epoch_workers
        assert sorted(i for b in r.epoch_iter() for i in indices_of(b)) == list(range(60))
        third = r.epoch_workers
        assert max(max(indices_of(r.sample())) for _ in range(30)) < 40   # (sample* too)
        assert r.workers == sample_actors
    if persistent_workers is False:
        assert (first, second, third) == ("new", "new", "new")
    else:
        assert (first, second, third) == ("kept", "new", "kept")


def test_epochs_cover_every_index_once_with_a_partial_last_batch():
    rb = replay_buffer(61)
    with RaySampler(StepSampler(rb, 8, seed=0), n_workers=2, in_order=False) as r:
        for _ in range(2):
            batches = [indices_of(b) for b in r.epoch_iter()]
            assert sorted(len(b) for b in batches) == [5] + [8] * 7
            assert sorted(i for b in batches for i in b) == list(range(61))


def whole_chunks(got, want, k):
    """The indices of the chunks of ``k`` batches of stream ``want`` (batches' indices)
    that ``got``, cut into chunks of ``k``, is made of; fails if any is not one."""
    chunks = [want[i:i + k] for i in range(0, len(want), k)]
    found = []
    for i in range(0, len(got), k):
        assert got[i:i + k] in chunks, f"batches {i}.. are not a chunk of the stream"
        found.append(chunks.index(got[i:i + k]))
    return found


def test_calls_of_four_only_where_every_actor_still_gets_a_call_and_one_more():
    from unienv_mp.ray import sampler as ray_sampler
    large = StepSampler(replay_buffer(200, img=(3, 256, 256)), 64)   # 12 MiB batches
    # 256 MiB ahead is 21 batches: 5 calls of 4, or 10 of 2 (one actor: four calls of 4)
    for workers, depth, per_call in ((1, 16, 4), (4, 21, 4), (5, 21, 2), (8, 21, 2)):
        assert ray_sampler._calls(large, None, workers, None, None) == (depth, per_call)
    assert ray_sampler._calls(large, None, 8, None, 3) == (21, 3)   # (as asked)


def test_in_order_false_gives_the_same_batches():
    # (a task makes a chunk of 8 batches: out of order, whole chunks of the in-order
    # stream come in another order, each at most once.  Which come first is Ray's
    # scheduling, and a late actor's tasks go to the back of another's queue: any chunk
    # requested may, and those lie within n_buffers batches of the first not handed out)
    rb = replay_buffer(100)
    with RaySampler(StepSampler(rb, 8, seed=1), n_workers=2, in_order=False) as r:
        got = [indices_of(b) for b in take(r, 24)]
        ahead, k = r.n_buffers, r.chunk_size("sample")
    assert k == 8
    with RaySampler(StepSampler(rb, 8, seed=1), n_workers=2) as r:
        want = [indices_of(b) for b in take(r, 24 + ahead + k)]
    assert len(set(whole_chunks(got, want, k))) == 3


def test_numpy_batches_arrive_as_numpy():
    data = ToBackendOrDeviceBatch(replay_buffer(40), backend=NumpyComputeBackend)
    with MultiprocessingSampler(StepSampler(data, 4, seed=0), n_workers=1, ctx="fork") as m:
        want = take(m, 3)
    with RaySampler(StepSampler(data, 4, seed=0), n_workers=1) as r:
        got = take(r, 3)
    for a, b in zip(want, got):
        same(a, b)
        assert isinstance(b["image"], np.ndarray)


# -- the factory ----------------------------------------------------------------------

def test_a_sampler_factory_gives_the_same_stream_and_stands_in_for_the_sampler():
    local = factory()()
    with MultiprocessingSampler(factory()(), n_workers=2, ctx="fork") as m:
        want = take(m, 20)
        want_epoch = [indices_of(b) for b in m.epoch_iter()]
    with RaySampler(sampler_factory=factory(), n_workers=2) as r:
        assert isinstance(r.sampler, RemoteSampler)
        assert len(r) == len(r.data) == 120 and r.batch_size == 8
        assert r.sampled_space == local.sampled_space
        assert r.single_space == local.single_space
        for a, b in zip(want, take(r, 20)):
            same(a, b)
        assert [indices_of(b) for b in r.epoch_iter()] == want_epoch
        # the get*_at delegates run on a worker
        same(r.get_at(torch.tensor([3, 1, 4])), local.get_at(torch.tensor([3, 1, 4])))
        # manual_seed seeds the workers' sampler; the stream starts again from the seed
        r.manual_seed(11)
        local.manual_seed(11)
        with MultiprocessingSampler(local, n_workers=1, ctx="fork") as m:
            for a, b in zip(take(m, 10), take(r, 10)):
                same(a, b)


def test_a_factory_that_raises_is_a_worker_error_with_its_traceback():
    def broken():
        raise OSError("no dataset at /nowhere")
    with pytest.raises(WorkerError, match="could not start: no dataset") as info:
        RaySampler(sampler_factory=broken, n_workers=1)
    assert "in broken" in info.value.worker_traceback
    assert isinstance(info.value.original, OSError)


def test_an_actor_that_could_not_make_its_sampler_never_stands_in():
    from unienv_mp.ray._calls import first_up
    from unienv_mp.ray.manager import RayManager

    def broken():
        raise OSError("no dataset at /nowhere")
    m = RayManager(2, factory=broken, num_cpus_per_worker=0)
    try:
        lane = first_up(m._lanes, timeout=60)   # (its probe has answered)
        assert lane.up and not lane.ok
        with pytest.raises(WorkerError, match="could not start"):
            m.result(m.submit(("sample", 1, 1), worker=lane.index), timeout=60)
        assert lane.up and not lane.ok
    finally:
        m.close()


def test_get_at_and_batches_from_several_threads_at_once():
    import threading
    local = factory()()
    want = local.get_at(torch.tensor([3, 1, 4]))
    errors = []

    def run(work):
        try:
            work()
        except BaseException as e:   # (reported below)
            errors.append(e)

    def get_at():
        for _ in range(30):
            same(r.get_at(torch.tensor([3, 1, 4])), want)

    def batches():
        take(r, 300)

    with RaySampler(sampler_factory=factory(), n_workers=2, timeout=60) as r:
        threads = [threading.Thread(target=run, args=(w,))
                   for w in (get_at, get_at, batches, batches)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        manager = r.sampler._manager   # (only the stream's requests are pending)
        assert len(manager._tasks) == sum(len(s.tickets) for s in r._streams.values())


def test_a_factory_whose_actors_cannot_start_times_out():
    with pytest.warns(RuntimeWarning, match="do not fit"):
        with pytest.raises(TimeoutError):
            RaySampler(sampler_factory=factory(), n_workers=1, num_cpus_per_worker=3,
                       timeout=1)


# -- faults -----------------------------------------------------------------------------

@pytest.mark.parametrize("tasks_per_call", [1, None])
def test_an_actor_killed_mid_stream_is_replaced_and_the_stream_is_unchanged(tasks_per_call):
    rb = replay_buffer(100)
    with RaySampler(StepSampler(rb, 8, seed=2), n_workers=2, batches_per_task=1) as r:
        want = [indices_of(b) for b in take(r, 130)]
    with RaySampler(StepSampler(rb, 8, seed=2), n_workers=2, batches_per_task=1,
                    tasks_per_call=tasks_per_call) as r:
        # (by default, calls of 8 tasks, and 32 batches requested ahead)
        assert r.tasks_per_call == (tasks_per_call or 8) and r.n_buffers >= 8
        got = [indices_of(b) for b in take(r, 10)]
        first = r.workers[0]
        ray.kill(first, no_restart=True)   # (tasks for it are in flight or waiting)
        got += [indices_of(b) for b in take(r, 120)]
        assert r.workers[0] != first
        stats = r.stats()
        assert stats.workers[0].respawns == 1 and stats.workers[1].respawns == 0
        epoch = [i for b in r.epoch_iter() for i in indices_of(b)]
    assert got == want
    assert sorted(epoch) == list(range(100))


@pytest.mark.parametrize("killed", [[1], [0, 1]])
def test_actors_killed_before_the_first_batch_are_replaced_and_the_stream_is_unchanged(
        killed):
    # (the first wait, for every actor to start, sees a killed one answer with its
    # death, and leaves it to the wait for the batch, which replaces it)
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=2), n_workers=2, ctx="fork",
                                batches_per_task=1) as m:
        want = [indices_of(b) for b in take(m, 60)]
    with RaySampler(StepSampler(rb, 8, seed=2), n_workers=2, batches_per_task=1,
                    timeout=120) as r:
        first = list(r.workers)
        for i in killed:
            ray.kill(first[i], no_restart=True)
        assert [indices_of(b) for b in take(r, 60)] == want
        for i in killed:
            assert r.workers[i] != first[i] and r.stats().workers[i].respawns == 1


def test_with_respawn_false_a_killed_actor_raises_worker_died():
    rb = replay_buffer(50)
    with RaySampler(StepSampler(rb, 8, seed=2), n_workers=1, respawn=False) as r:
        take(r, 9)
        ray.kill(r.workers[0], no_restart=True)
        with pytest.raises(WorkerDiedError, match="respawn=False") as info:
            take(r, 400)   # (chunks made before the kill are still delivered)
        assert info.value.worker == 0


def test_an_actor_that_dies_in_the_middle_of_a_batch_is_replaced(tmp_path):
    rb = replay_buffer(100)
    with RaySampler(StepSampler(rb, 8, seed=4), n_workers=2, batches_per_task=1) as r:
        want = [indices_of(b) for b in take(r, 12)]
    dying = _data.DyingSampler(rb, 8, seed=4, marker=str(tmp_path / "deaths"), deaths=2)
    with RaySampler(dying, n_workers=2, batches_per_task=1) as r:
        assert [indices_of(b) for b in take(r, 12)] == want
        assert sum(w.respawns for w in r.stats().workers) == 2
    assert len((tmp_path / "deaths").read_text().split()) == 2


def test_an_actor_that_keeps_dying_raises_after_max_respawns():
    rb = replay_buffer(50)
    with RaySampler(_data.CrashAtStart(StepSampler(rb, 4, seed=0)), n_workers=1,
                    max_respawns=1) as r:
        with pytest.raises(WorkerDiedError, match="2 times in a row"):
            r.sample()


def test_a_raising_sampler_is_a_worker_error_and_the_sampler_goes_on():
    rb = replay_buffer(60)
    with RaySampler(_data.FailingSampler(rb, 4, seed=0, fail_every=3), n_workers=1,
                    n_buffers=2) as r:
        errors = 0
        for _ in range(6):
            try:
                r.sample()
            except WorkerError as e:
                errors += 1
                assert e.exc_type == "builtins.KeyError" and "no such row" in e.exc_message
                assert "in get_at" in e.worker_traceback and e.worker == 0
                assert isinstance(e.original, KeyError)
        assert errors >= 1
        assert r.stats().workers[0].errors == errors


def slow_factory():
    def make():
        import _data as d
        return d.SlowSampler(d.replay_buffer(40), 4, seed=0, delay=1.5)
    return make


def test_a_get_at_cut_short_leaves_no_task_behind():
    with RaySampler(sampler_factory=slow_factory(), n_workers=1, timeout=60) as r:
        manager = r.sampler._manager
        manager.timeout = 0.3   # (after the actor's start, which the timeout counts)
        with pytest.raises(TimeoutError):
            r.get_at(torch.tensor([1, 2]))
        assert not manager._tasks and not manager._lanes[0].inflight
        assert r.sampler.lock is r._lock   # (its calls and the batches' take turns)


def test_a_timeout_keeps_the_position():
    rb = replay_buffer(40)
    with RaySampler(_data.SlowSampler(rb, 4, seed=0, delay=1.5), n_workers=1,
                    n_buffers=1, timeout=0.2) as r:
        with pytest.raises(TimeoutError):
            r.sample()
        state = r.state_dict()
    assert state["streams"]["sample"]["low"] == 0 and not state["streams"]["sample"]["done"]


# -- checkpoints ------------------------------------------------------------------------

def test_state_dicts_of_either_sampler_load_into_the_other(tmp_path):
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=7), n_workers=2, ctx="fork") as m:
        take(m, 13)
        it = m.epoch_iter()
        for _ in range(4):
            next(it)
        state = m.state_dict()
        want = [indices_of(b) for b in take(m, 10)]
        want_rest = [indices_of(b) for b in it]
        want_next_epoch = [indices_of(b) for b in m.epoch_iter()]
    (tmp_path / "state.pt").write_bytes(pickle.dumps(state))
    with RaySampler(StepSampler(rb, 8, seed=99), n_workers=2) as r:
        r.load_state_dict(pickle.loads((tmp_path / "state.pt").read_bytes()))
        assert [indices_of(b) for b in take(r, 10)] == want
        assert [indices_of(b) for b in r.epoch_iter()] == want_rest
        assert [indices_of(b) for b in r.epoch_iter()] == want_next_epoch
        back = r.state_dict()
        more = [indices_of(b) for b in take(r, 5)]
    with MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=1, ctx="fork") as m:
        m.load_state_dict(back)
        assert [indices_of(b) for b in take(m, 5)] == more


def test_a_state_of_another_configuration_is_refused():
    with RaySampler(sampler_factory=factory(batch_size=8), n_workers=1) as r:
        state = r.state_dict()
        assert state["configuration"]["sampler"].endswith("StepSampler")
    with RaySampler(sampler_factory=factory(batch_size=6), n_workers=1) as r:
        with pytest.raises(ValueError, match="batch_size is 8 in the state, 6 here"):
            r.load_state_dict(state)


# -- what the caller gets --------------------------------------------------------------

def test_batches_from_the_object_store_are_read_only_views_unless_copied():
    data = ToBackendOrDeviceBatch(replay_buffer(100, img=(3, 64, 64)),
                                  backend=NumpyComputeBackend)
    with RaySampler(StepSampler(data, 16, seed=0), n_workers=1, local_slots=False) as r:
        b = r.sample()
        assert not b["image"].flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            b["image"][0] = 1
        assert "plasma" in mapping_of(b["image"].__array_interface__["data"][0])
    rb = replay_buffer(100, img=(3, 64, 64))
    with RaySampler(StepSampler(rb, 16, seed=0), n_workers=1, local_slots=False) as r:
        t = r.sample()["image"]
        assert "plasma" in mapping_of(t.data_ptr())
    with RaySampler(StepSampler(rb, 16, seed=0), n_workers=1, copy=True,
                    local_slots=False) as r:
        b = r.sample()
        assert mapping_of(b["image"].data_ptr()) == ""
        b["image"].add_(1)   # its own memory
        assert torch.equal(b["image"], t + 1)
    # batches stay valid after close
    assert indices_of({"state": t.float()[:, 0, 0, :1].repeat(1, 10)}) is not None


def test_batches_from_an_actor_on_this_node_are_views_of_its_slots():
    rb = replay_buffer(100, img=(3, 64, 64))
    with RaySampler(StepSampler(rb, 16, seed=0), n_workers=1, n_buffers=2) as r:
        b = r.sample()
        where = mapping_of(b["image"].data_ptr())
        assert "ray-slot0" in where and "plasma" not in where
        b["image"].add_(1)   # the batch's own slot until it is collected
        kept = [r.sample() for _ in range(20)]   # held: each has a slot of its own
        ptrs = {k["image"].data_ptr() for k in kept} | {b["image"].data_ptr()}
        assert len(ptrs) == 21
        want = [indices_of(k) for k in kept]
        del kept, b
        import gc
        gc.collect()
        # slots given back are written again
        again = {r.sample()["image"].data_ptr() for _ in range(30)}
        assert again & ptrs
        t = r.sample()["image"]
    with RaySampler(StepSampler(rb, 16, seed=0), n_workers=1, n_buffers=2) as r:
        r.sample()
        assert [indices_of(r.sample()) for _ in range(20)] == want
    # batches stay valid after close
    assert "ray-slot0" in mapping_of(t.data_ptr())
    assert indices_of({"state": t.float()[:, 0, 0, :1].repeat(1, 10)}) is not None


def _large_tensors_mapped_from(actor, min_numel):
    """In the actor: where each large tensor's memory is mapped from."""
    import gc
    paths = []
    for t in gc.get_objects():
        if isinstance(t, torch.Tensor) and t.numel() >= min_numel:
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split()
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    if lo <= t.data_ptr() < hi:
                        paths.append(fields[5] if len(fields) > 5 else "(anonymous)")
                        break
    return paths


def test_actors_read_a_shipped_buffer_from_the_object_store_without_a_copy():
    rb = replay_buffer(2000, img=(3, 32, 32))   # the image storage: 6 MB
    with RaySampler(StepSampler(rb, 8, seed=0), n_workers=2) as r:
        want = take(r, 3)
        for actor in r.workers:
            paths = ray.get(actor.__ray_call__.remote(_large_tensors_mapped_from,
                                                      2000 * 3 * 32 * 32))
            assert paths and all("plasma" in p for p in paths), paths
    with MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=2) as m:
        for a, b in zip(take(m, 3), want):
            same(a, b)


def test_where_this_process_cannot_map_an_actors_slots_batches_take_the_object_store(
        monkeypatch):
    from unienv_mp.ray import _batch

    def refused(*args, **kwargs):
        raise PermissionError(13, "not allowed to open the actor's descriptors")
    monkeypatch.setattr(_batch, "segment_from_peer", refused)
    rb = replay_buffer(100, img=(3, 32, 32))
    with MultiprocessingSampler(StepSampler(rb, 8, seed=9), n_workers=2, ctx="fork") as m:
        want = take(m, 40)
    with RaySampler(StepSampler(rb, 8, seed=9), n_workers=2, tasks_per_call=2) as r:
        for a, b in zip(want, take(r, 40)):
            same(a, b)
        lanes = r._actors._lanes
        assert [lane.local for lane in lanes] == [False, False]   # (for good)
        _slots_accounted(r)
        assert "plasma" in mapping_of(r.sample()["image"].data_ptr())


def _slots_accounted(r):
    """Every slot number an actor was given is free once, held by a task in flight (or
    cancelled and not answered yet), or by a batch alive (a lease)."""
    gc.collect()
    tasks = r._actors._tasks
    for lane in r._actors._lanes:
        sent = [tasks[t].sent for t in lane.inflight if tasks[t].sent is not None]
        sent += [t.sent for t in lane.cancelled]
        held = [s[2] for s in sent if s[2] is not None]
        slots = lane.slots
        free = slots.free + list(slots.released)
        assert len(free) == len(set(free)), free
        assert not set(held) & set(free)
        assert len(slots.free) + len(held) + slots.leases == slots.next
        if not slots.leases:   # (every slot number taken is free, or a task's in flight)
            assert set(slots.free) | set(held) == set(range(slots.next))


def test_a_call_refused_while_moving_to_the_object_store_loses_no_slot(monkeypatch):
    from unienv_mp.ray import _batch, _calls

    def refused(*args, **kwargs):
        raise PermissionError(13, "not allowed to open the actor's descriptors")
    monkeypatch.setattr(_batch, "segment_from_peer", refused)
    flush, armed = _calls.Lane.flush, [True]

    def refusing(self, tasks=None):
        if tasks is not None and armed[0]:   # (the task sent again, by the object store)
            armed[0] = False
            raise RuntimeError("Ray refused the call")
        return flush(self, tasks)
    monkeypatch.setattr(_calls.Lane, "flush", refusing)
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=9), n_workers=2, ctx="fork",
                                batches_per_task=1) as m:
        want = take(m, 30)
    with RaySampler(StepSampler(rb, 8, seed=9), n_workers=2, n_buffers=4,
                    batches_per_task=1) as r:
        with pytest.raises(RuntimeError, match="refused"):
            r.sample()
        for a in want:   # (the batch of the call that raised comes again)
            same(a, r.sample())
        _slots_accounted(r)


def test_a_sizing_that_raises_leaves_the_defaults_and_loses_nothing():
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=9), n_workers=2, ctx="fork") as m:
        want = take(m, 30)
    with RaySampler(StepSampler(rb, 8, seed=9), n_workers=2, direct_gather=False) as r:
        def broken(work, nbytes):
            raise ValueError("cannot size")
        r._actors.sized = broken
        before = (r.n_buffers, r.tasks_per_call)
        with pytest.warns(RuntimeWarning, match="could not size"):
            for a in want:
                same(a, r.sample())
        assert (r.n_buffers, r.tasks_per_call) == before and r._actors.sized is None
        _slots_accounted(r)


def test_threads_from_the_start_while_the_first_batch_sizes_the_defaults():
    import threading
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=9), n_workers=2, ctx="fork",
                                batches_per_task=1) as m:
        want = sorted(tuple(indices_of(m.sample())) for _ in range(150))
    got, errors = [], []

    def run():
        try:
            for _ in range(50):
                got.append(tuple(indices_of(r.sample())))
        except BaseException as e:   # (reported below)
            errors.append(e)
    with RaySampler(StepSampler(rb, 8, seed=9), n_workers=3, direct_gather=False,
                    batches_per_task=1, num_cpus_per_worker=0.5) as r:
        threads = [threading.Thread(target=run) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert r._actors.group == r.tasks_per_call > 2   # (sized once)
        _slots_accounted(r)
    assert sorted(got) == want   # (each batch of the stream once, whichever thread)


def test_a_slot_is_mapped_again_for_another_process_with_the_same_generation():
    from unienv_mp import Segment
    a, b = Segment.create(4096, "a"), Segment.create(4096, "b")
    memoryview(a)[:1] = b"a"
    memoryview(b)[:1] = b"b"
    import subprocess
    import sys
    # (another process holding b's descriptor, as a restarted actor holds its own; not a
    # fork of this one, which is a Ray driver)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            pass_fds=[b.fd])
    child = proc.pid
    try:
        slots = LaneSlots()
        first = slots.segment(0, os.getpid(), (1, a.fd, a.ino, a.size))
        assert bytes(memoryview(first)[:1]) == b"a"
        try:
            again = slots.segment(0, child, (1, b.fd, b.ino, b.size))
            assert again is not first and bytes(memoryview(again)[:1]) == b"b"
        finally:
            slots.close()
    finally:
        proc.kill()
        proc.wait()
        a.close()
        b.close()


def test_a_frame_travels_whole_through_a_buffer_or_a_slot():
    value = {"x": torch.randn(5, 3).to(torch.bfloat16),
             "n": (torch.arange(3), None, "text", np.arange(4.0))}
    frames = ActorFrames(0)
    buf = frames.write(value, None)
    # (Ray hands the caller a read-only copy of the buffer)
    frame = np.frombuffer(pickle.loads(pickle.dumps(buf)).tobytes(), np.uint8)
    assert not frame.flags.writeable
    back = read_frame(frame, copy=False)
    same(back, value)
    assert back["x"].data_ptr() >= frame.ctypes.data   # a view of the frame
    assert not back["n"][3].flags.writeable
    same(read_frame(frame, copy=True), value)
    assert read_frame(frame, copy=True)["n"][3].flags.writeable
    # into a slot: mapped by a reader through /proc (here, this same process)
    slots = LaneSlots()
    slot = slots.take()
    gen, fd, ino, size, nbytes = frames.write(value, slot)
    seg = slots.segment(slot, os.getpid(), (gen, fd, ino, size))
    batch = _codec.decode(slots.lease(slot, seg, nbytes))
    same(batch, value)
    assert slots.take() != slot   # (not free while the batch lives)
    del batch
    import gc
    gc.collect()
    assert slots.take() == slot   # given back by the last view
    frames.slots.close()
    slots.close()


# -- input and lifecycle ----------------------------------------------------------------

def test_bad_input_is_refused():
    rb = replay_buffer(20)
    with pytest.raises(TypeError, match="a sampler or a sampler_factory"):
        RaySampler()
    with pytest.raises(TypeError, match="a sampler or a sampler_factory"):
        RaySampler(StepSampler(rb, 4), sampler_factory=factory())
    with pytest.raises(TypeError, match="BatchSampler"):
        RaySampler(rb)
    with pytest.raises(TypeError, match="sampler_factory must be callable"):
        RaySampler(sampler_factory=3)
    with pytest.raises(ValueError, match="n_workers must be >= 1"):
        RaySampler(StepSampler(rb, 4), n_workers=0)
    with pytest.raises(ValueError, match="num_cpus_per_worker"):
        RaySampler(StepSampler(rb, 4), num_cpus_per_worker=-1)
    for bad, error in ((0, ValueError), (1.5, TypeError), ("2", TypeError)):
        with pytest.raises(error, match="tasks_per_call"):
            RaySampler(StepSampler(rb, 4), tasks_per_call=bad)
    with pytest.raises(TypeError, match="local_slots"):
        RaySampler(StepSampler(rb, 4), local_slots="no")
    with pytest.raises(ValueError, match="finite"):
        RaySampler(StepSampler(rb, 4), num_cpus_per_worker=float("inf"))
    # (the manager replaces actors itself; an actor runs one call at a time)
    for key in ("max_restarts", "max_task_retries", "max_concurrency", "concurrency_groups"):
        with pytest.raises(ValueError, match=f"may not set '{key}'"):
            RaySampler(StepSampler(rb, 4), actor_options={key: 2})
    with pytest.raises(TypeError, match="direct_gather"):
        RaySampler(StepSampler(rb, 4), direct_gather="yes")
    # a buffer shared with multiprocessing=True holds a lock that cannot travel
    shared = replay_buffer(20, multiprocessing=True)
    with pytest.raises(TypeError, match="sampler_factory"):
        RaySampler(StepSampler(shared, 4), n_workers=1)


def test_close_kills_the_actors_and_keeps_the_ray_it_joined():
    rb = replay_buffer(20)
    r = RaySampler(StepSampler(rb, 4, seed=0), n_workers=2)
    r.sample()
    actors = r.workers
    r.close()
    r.close()
    for a in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(a.describe.remote(), timeout=30)
    assert ray.is_initialized()
    with pytest.raises(RuntimeError, match="closed"):
        r.sample()
    with pytest.raises(RuntimeError, match="closed"):
        next(r.epoch_iter())
    assert r.state_dict()["streams"]["sample"]["low"] == 0


def test_stats_count_what_was_sampled():
    rb = replay_buffer(100)
    with RaySampler(StepSampler(rb, 8, seed=0), n_workers=2, batches_per_task=2) as r:
        take(r, 10)
        s = r.stats(reset=True)
        assert s.batches == 10 and s.gather_path == "direct"
        assert 0 < s.wait_seconds <= s.wall_seconds and 0 < s.wait_fraction <= 1
        assert sum(w.batches for w in s.workers) >= 10
        assert all(w.pid is not None and w.seconds_per_batch_mean for w in s.workers)
        assert all(0 <= w.cpu_fraction <= 1 for w in s.workers)
        assert s.machine_idle_fraction is not None   # (the local Ray is this machine)
        assert r.stats().batches == 0


def test_actors_that_do_not_fit_in_the_cluster_are_warned_about():
    rb = replay_buffer(20)
    with pytest.warns(RuntimeWarning, match="3 actors of 1 CPU each do not fit in the Ray "
                                            "cluster's 2 CPUs"):
        r = RaySampler(StepSampler(rb, 4, seed=0), n_workers=3)
    r.close()
    # fractions of a CPU (or none) fit
    with RaySampler(StepSampler(rb, 4, seed=0), n_workers=3, num_cpus_per_worker=0.5) as r:
        assert len(take(r, 10)) == 10


def test_an_actor_that_cannot_start_leaves_its_batches_to_the_others():
    # 3 actors of a CPU on 2 CPUs: one waits for a CPU for ever, and its share of the
    # stream and of the epochs is made by the other two, bit for bit the same
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=3), n_workers=2, ctx="fork") as m:
        want = take(m, 40)
        want_index = take(m, 10, "sample_index")
        want_epoch = list(m.epoch_iter())
    with pytest.warns(RuntimeWarning, match="do not fit"):
        r = RaySampler(StepSampler(rb, 8, seed=3), n_workers=3, n_buffers=6, timeout=120)
    with r:
        for a, b in zip(want, take(r, 40), strict=True):
            same(a, b)
        for a, b in zip(want_index, take(r, 10, "sample_index"), strict=True):
            same(a, b)
        for a, b in zip(want_epoch, list(r.epoch_iter()), strict=True):
            same(a, b)
        started = [w.pid is not None for w in r.stats().workers]
        assert 1 <= sum(started) <= 2, started


def late_factory(late_worker, gate):
    """A sampler_factory whose actor ``late_worker`` waits until the file ``gate`` exists
    (the actor's index is read from the frame that calls the factory:
    SamplerActor.__init__)."""
    base = factory(40, 4, 0)

    def make():
        import os as o
        import sys
        import time as t
        if sys._getframe(1).f_locals.get("index") == late_worker:
            while not o.path.exists(gate):
                t.sleep(0.01)
        return base()
    return make


def opened_later(gate, seconds):
    """A started timer that creates the file ``gate`` after ``seconds``."""
    import threading
    timer = threading.Timer(seconds, lambda: open(gate, "w").close())
    timer.start()
    return timer


def test_the_first_batch_waits_until_every_actor_has_started(monkeypatch, tmp_path):
    # (a stream stops at a not-started actor's first task anyway: the first wait does all
    # that waiting at once.  No actor is ever late here, so the wait is for all of them)
    from unienv_mp.ray import _calls
    monkeypatch.setattr(_calls, "LATE_NS", 600 * 10**9)
    gate = str(tmp_path / "gate")
    with RaySampler(sampler_factory=late_factory(2, gate), n_workers=3, timeout=120,
                    num_cpus_per_worker=0) as r:
        lanes = r.sampler._manager._lanes
        timer = opened_later(gate, 1.5)   # (while the first batch is waited for)
        try:
            r.sample()
        finally:
            timer.cancel()
        assert all(lane.up and lane.ok for lane in lanes)
        assert len(take(r, 20)) == 20


def test_a_result_already_in_is_not_held_for_the_first_wait(monkeypatch, tmp_path):
    from unienv_mp.ray import _calls
    from unienv_mp.ray.manager import RayManager
    monkeypatch.setattr(_calls, "LATE_NS", 600 * 10**9)
    gate = str(tmp_path / "gate")
    m = RayManager(2, factory=late_factory(1, gate), num_cpus_per_worker=0, timeout=120)
    timer = opened_later(gate, 60)   # (if the result waited for worker 1 after all)
    try:
        ticket = m.submit(("sample", 1, 1), worker=0)
        while not m.ready(ticket):
            time.sleep(0.01)
        assert m.result(ticket) is not None
        assert not m._lanes[1].up and not m._all_up   # (it is left for a later wait)
        with pytest.raises(KeyError):
            m.wait_any([ticket])   # (no ticket pending: at once, no first wait)
        assert not m._lanes[1].up
        # once every actor has answered, the first wait is over, even if no result was
        # ever waited for (it costs no more Ray calls from then on)
        open(gate, "w").close()
        for worker in (1, 0):
            ticket = m.submit(("sample", 1, 1), worker=worker)
            while not m.ready(ticket):
                time.sleep(0.01)
            assert m.result(ticket) is not None
        assert m._all_up
    finally:
        timer.cancel()
        m.close()


def test_a_first_wait_cut_short_by_its_timeout_is_waited_again(monkeypatch, tmp_path):
    from unienv_mp.ray import _calls
    from unienv_mp.ray.manager import RayManager
    monkeypatch.setattr(_calls, "LATE_NS", 600 * 10**9)
    gate = str(tmp_path / "gate")
    m = RayManager(2, factory=late_factory(0, gate), num_cpus_per_worker=0, timeout=120)
    try:
        ticket = m.submit(("sample", 1, 1), worker=0)   # (worker 0 waits at its gate)
        with pytest.raises(TimeoutError):
            m.result(ticket, timeout=0.5)
        assert not m._all_up and ticket in m._tasks
        open(gate, "w").close()
        assert m.result(ticket) is not None
        assert m._all_up and all(lane.up for lane in m._lanes)
    finally:
        m.close()


def test_a_ctrl_c_in_the_first_wait_loses_nothing(monkeypatch, tmp_path):
    import _thread
    import threading
    from unienv_mp.ray import _calls
    monkeypatch.setattr(_calls, "LATE_NS", 600 * 10**9)
    with RaySampler(sampler_factory=factory(40, 4, 0), n_workers=2) as r:
        want = [indices_of(b) for b in take(r, 30)]
    gate = str(tmp_path / "gate")
    with RaySampler(sampler_factory=late_factory(1, gate), n_workers=2, timeout=120,
                    num_cpus_per_worker=0) as r:
        lanes = r.sampler._manager._lanes
        timer = threading.Timer(1.0, _thread.interrupt_main)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                r.sample()   # (waits for worker 1, held at its gate)
        finally:
            timer.cancel()
        assert not lanes[1].up
        open(gate, "w").close()
        assert [indices_of(b) for b in take(r, 30)] == want
        assert all(lane.up for lane in lanes)


def test_the_first_wait_does_not_wait_for_a_late_actor(monkeypatch, tmp_path):
    # (once an actor is late, the first batch comes without it; its tasks move)
    from unienv_mp.ray import _calls
    monkeypatch.setattr(_calls, "LATE_NS", 0)
    with RaySampler(sampler_factory=late_factory(2, str(tmp_path / "gate")), n_workers=3,
                    timeout=120, num_cpus_per_worker=0) as r:
        lanes = r.sampler._manager._lanes
        assert len(take(r, 20)) == 20
        assert not lanes[2].up


def test_out_of_order_an_actor_that_cannot_start_holds_no_batch_back(monkeypatch):
    # (results are waited for in any order here: the tasks dealt to the actor that never
    # starts must move all the same, or the epoch never ends; and what moved is still
    # whole chunks of the stream.  Once the first batch is in, the next three chunks are
    # dealt one to each actor; then a late actor is one that has not started at all, so
    # that its chunk moves at once, among the chunks taken here)
    from unienv_mp.ray import _calls
    rb = replay_buffer(100)
    with pytest.warns(RuntimeWarning, match="do not fit"):
        r = RaySampler(StepSampler(rb, 8, seed=3), n_workers=3, n_buffers=24, timeout=120,
                       in_order=False)
    with r:
        k = r.chunk_size("sample")
        got = [indices_of(r.sample())]
        monkeypatch.setattr(_calls, "LATE_NS", 0)
        got += [indices_of(b) for b in take(r, 12 * k - 1)]
        with MultiprocessingSampler(StepSampler(rb, 8, seed=3), n_workers=1,
                                    batches_per_task=k, ctx="fork") as m:
            want = [indices_of(b) for b in take(m, 13 * k + r.n_buffers)]
        assert len(set(whole_chunks(got, want, k))) == 12
        for _ in range(2):
            rows = sorted(i for b in r.epoch_iter() for i in indices_of(b))
            assert rows == list(range(100))


def test_the_main_jobs_ray_row():
    from unienv_mp.bench import config, data, measure
    cfg = config.case_config("state", quick=True, seconds=0.3, workers=2)
    res = measure.measure("ray", data.build_buffer(cfg), cfg)
    assert res.error is None and res.batches >= cfg.min_batches
    assert res.label == "unienv_mp RaySampler (local Ray, 512 buffers)"   # (its default)
    assert res.stats.gather_path == "direct" and len(res.stats.workers) == 2


def test_the_actor_cost_script_refuses_counts_and_times_of_zero(capsys):
    import importlib.util
    path = os.path.join(os.path.dirname(TESTS), "benchmarks", "ray_actor_cost.py")
    spec = importlib.util.spec_from_file_location("ray_actor_cost", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for argv in (["--rounds", "0"], ["--batches", "-1"], ["--seconds", "0"]):
        with pytest.raises(SystemExit):
            script.main(argv)
        assert "must be more than 0" in capsys.readouterr().err
