"""Never silently wrong: every row a sampler hands out is a row the buffer holds
(as it is now, or as the pool's one copy held it, where that is what the stream promises),
whatever changed the data, whichever worker died and however it was replaced.

Every key of every row encodes its step (see `_step_rows`), so a torn row (fields from two
copies) or a stale one (a copy the buffer no longer holds) is told by its contents.  The
private parts reached into are in `_hooks`.
"""
import os
import warnings

import pytest
import torch
from unienv_data.samplers import StepSampler

import _hooks as hooks
import _step_rows as sr
from conftest import process_running, wait_until
from unienv_mp import MultiprocessingSampler, WorkerDiedError

BATCH = 8


def make(rb, ctx, seed=0, n_workers=2, **kwargs):
    return MultiprocessingSampler(StepSampler(rb, BATCH, seed=seed), n_workers=n_workers,
                                  ctx=ctx, **kwargs)


def epoch(m):
    """One whole epoch of ``m``, its batches copied."""
    return [sr.clone(b) for b in m.epoch_iter()]


def assert_epoch_is_buffer(batches, rb, what):
    """The epoch handed out every row ``rb`` holds now, once, bit for bit."""
    got, want = sr.epoch_rows(batches), sr.buffer_rows(rb)
    stale = sum((got - want).values())
    assert got == want, (f"{what}: {stale} of {sum(got.values())} rows handed out are not "
                         f"rows the buffer holds now")


# -- a buffer shared between processes ---------------------------------------------------

def _replace_shared(rb, key="obs"):
    """Replace a storage tensor of a shared buffer by a new shared one (+1000)."""
    st = rb.storage.storage_map[key]
    st.data = (st.data + 1000).share_memory_()


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
@pytest.mark.parametrize("persistent", [None, False])
def test_a_replaced_shared_tensor_is_served_by_the_next_epoch_on_new_workers(
        ctx, persistent):
    rb = sr.buffer(40, multiprocessing=True)
    with make(rb, ctx, persistent_workers=persistent) as m:
        m.sample()   # (the sample* workers run)
        assert_epoch_is_buffer(epoch(m), rb, "epoch 1")
        _replace_shared(rb)
        batches = epoch(m)
        assert_epoch_is_buffer(batches, rb, "the epoch after the tensor was replaced")
        assert m.epoch_workers == "new", (m.epoch_workers, m.epoch_workers_reason)


def test_persistent_workers_false_starts_new_workers_for_every_epoch_of_a_shared_buffer():
    rb = sr.buffer(40, multiprocessing=True)
    with make(rb, "fork", persistent_workers=False) as m:
        m.sample()
        firsts = []
        for _ in range(3):
            it = m.epoch_iter()
            batches = [sr.clone(next(it))]
            (manager,) = hooks.epoch_managers(m)
            firsts.append(hooks.worker_pids(manager)[0])
            batches += [sr.clone(b) for b in it]
            assert_epoch_is_buffer(batches, rb, "epoch")
            assert m.epoch_workers == "new", (m.epoch_workers, m.epoch_workers_reason)
        assert len(set(firsts)) == 3, f"workers kept across epochs: {firsts}"
        assert hooks.worker_pids(hooks.sample_manager(m))[0] not in firsts


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_an_append_to_a_shared_buffer_stays_live(ctx):
    """The sample* workers read a shared buffer as it is now, and an epoch covers it."""
    rb = sr.buffer(40, capacity=80, multiprocessing=True)
    with make(rb, ctx) as m:
        first = sr.steps_of(m.sample())
        assert max(first) < 40
        rb.extend(sr.rows(40, 40))
        seen = set()
        for _ in range(30):
            seen.update(sr.steps_of(m.sample()))
        assert max(seen) >= 40, "the sample* workers did not see the append"
        assert_epoch_is_buffer(epoch(m), rb, "the epoch after the append")


# -- spawn / forkserver, a buffer with some tensors in shared memory ---------------------

def _partly_shared(n, capacity):
    """A buffer (not multiprocessing=True) whose ``obs`` tensor alone is in shared memory:
    workers read ``obs`` live, the other keys from their copy."""
    rb = sr.buffer(n, capacity)
    sr.tensor(rb, "obs").share_memory_()
    return rb


def assert_same_stream(m, twin, n, below=None):
    """The next ``n`` batches of ``m.sample()`` are ``twin``'s, bit for bit, and every row
    is whole (every key tells the same step; below ``below``, if given)."""
    for j in range(n):
        a, b = sr.clone(m.sample()), sr.clone(twin.sample())
        steps = sr.steps_of(a)
        if below is not None:
            assert max(steps) < below, f"batch {j}: steps {steps}, the copy held < {below}"
        assert sr.same_batch(a, b), (f"batch {j} differs from the twin's: "
                                     f"{steps} != {sr.steps_of(b)}")


@pytest.mark.parametrize("ctx", ["spawn", "forkserver"])
@pytest.mark.parametrize("later", ["deferred", "replacement"])
def test_a_partly_shared_buffer_extended_goes_on_from_new_workers_over_the_data_now(
        ctx, later):
    """Worker 1 starts after the extend (``deferred``), or worker 0 is SIGKILLed after it
    and replaced (``replacement``): no torn row is handed out.  The write is seen at the
    next call (data partly in shared memory, written): the batches made ahead are dropped
    and the stream goes on in order from new workers over the buffer as it is now, the
    stream of a twin over those 120 steps."""
    rb = _partly_shared(60, 120)
    with make(rb, ctx, batches_per_task=1) as m, \
            make(sr.buffer(60, 120), "fork", batches_per_task=1) as twin, \
            make(sr.buffer(120, 120), "fork", batches_per_task=1) as twin_now:
        assert_same_stream(m, twin, 1, below=60)
        twin_now.sample()
        manager = hooks.sample_manager(m)
        if later == "replacement":
            hooks.start_all(manager)
        rb.extend(sr.rows(60, 60))
        if later == "deferred":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                hooks.start_all(manager)
            # (it may start, from the first one's copy, or not at all)
        else:
            assert wait_until(lambda: hooks.worker_started(manager, 1), timeout=120)
            hooks.kill(hooks.worker_pids(manager)[0])
        with pytest.warns(RuntimeWarning, match="moved away"):
            assert_same_stream(m, twin_now, 40)
        assert hooks.sample_manager(m) is not manager


# -- fork, the snapshot process gone --------------------------------------------------------

SNAPSHOT_GONE = ["killed", "refused"]


def _fork_sampler(rb, how, monkeypatch):
    """A fork sampler over ``rb`` (one batch per task, two ahead); with ``how="refused"``
    no snapshot process of it can start."""
    if how == "refused":
        hooks.refuse_snapshot(monkeypatch)
    return make(rb, "fork", batches_per_task=1, n_buffers=2)


def _without_snapshot(manager, how):
    """Start every worker of ``manager``, then take its snapshot process away: SIGKILLed
    (``how="killed"``), or it never started (``"refused"``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        hooks.start_all(manager)
    assert len(hooks.worker_pids(manager)) == 2
    if how == "killed":
        snapshot = hooks.snapshot_process(manager)
        assert snapshot is not None, "no snapshot process to kill"
        hooks.kill(snapshot.pid)
    else:
        assert hooks.snapshot_process(manager) is None


def _sampler_without_snapshot(rb, how, monkeypatch):
    """A fork sampler over ``rb`` whose sample* pool has both workers started and no
    snapshot process (see `_without_snapshot`): ``(sampler, its first batch)``."""
    m = _fork_sampler(rb, how, monkeypatch)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # (refused: said here)
            first = sr.clone(m.sample())
        _without_snapshot(hooks.sample_manager(m), how)
    except BaseException:
        m.close()
        raise
    return m, first


def _epoch_without_snapshot(m, how):
    """An epoch of ``m`` begun (its first batch handed out), its pool's every worker
    started and its snapshot process taken away: ``(iterator, [first batch], pool)``."""
    it = m.epoch_iter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # (refused: said here)
        batches = [sr.clone(next(it))]
    (manager,) = hooks.epoch_managers(m)
    _without_snapshot(manager, how)
    return it, batches, manager


def _plus_1000(rb, key="obs"):
    """Replace ``key``'s tensor of an unshared buffer by a new one, + 1000: rows no copy
    of the data before holds (and torn ones: only that key moved).  Returns the old
    tensor, to put back."""
    st = rb.storage.storage_map[key]
    old = st.data
    st.data = old + 1000
    return old


@pytest.mark.parametrize("how", SNAPSHOT_GONE)
def test_a_dead_worker_is_not_replaced_from_changed_memory(how, monkeypatch):
    rb = sr.buffer(60, 120)
    with make(sr.buffer(60, 120), "fork", batches_per_task=1, n_buffers=2) as twin:
        twin_first = sr.clone(twin.sample())   # (its workers start before any refusal)
        m, first = _sampler_without_snapshot(rb, how, monkeypatch)
        with m:
            assert sr.same_batch(first, twin_first)
            _plus_1000(rb)
            hooks.kill(hooks.worker_pids(hooks.sample_manager(m))[0])
            with pytest.warns(RuntimeWarning):
                assert_same_stream(m, twin, 30)


@pytest.mark.parametrize("how", SNAPSHOT_GONE)
def test_the_next_epoch_serves_the_buffer_as_it_is_now(how, monkeypatch):
    """A worker died after the data changed: an epoch while the data differs from the
    pool's copy is not 'kept'; once the data is put back as the pool's copy holds it,
    an epoch serves the rows put back (a pool with a worker forked from the changed
    memory would serve some changed ones, under the pool's old fingerprint)."""
    rb = sr.buffer(60, 120)
    m, _ = _sampler_without_snapshot(rb, how, monkeypatch)
    with m:
        old = _plus_1000(rb)
        hooks.kill(hooks.worker_pids(hooks.sample_manager(m))[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for _ in range(10):
                m.sample()
            batches = epoch(m)
            assert_epoch_is_buffer(batches, rb, "the epoch while the data is changed")
            assert m.epoch_workers != "kept", m.epoch_workers_reason
            rb.storage.storage_map["obs"].data = old   # (the data the pool started from)
            batches = epoch(m)
        assert_epoch_is_buffer(batches, rb, f"the epoch after the data was put back "
                                            f"({m.epoch_workers}: {m.epoch_workers_reason})")


@pytest.mark.parametrize("how", SNAPSHOT_GONE)
def test_an_epoch_in_progress_never_serves_rows_changed_after_it_started(how,
                                                                             monkeypatch):
    rb = sr.buffer(400)
    with _fork_sampler(rb, how, monkeypatch) as m:
        at_start = sr.buffer_rows(rb)
        it, batches, manager = _epoch_without_snapshot(m, how)
        _plus_1000(rb)
        hooks.kill(hooks.worker_pids(manager)[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            batches += [sr.clone(b) for b in it]
        got = sr.epoch_rows(batches)
        changed = sum((got - at_start).values())
        assert got == at_start, (f"{changed} of {sum(got.values())} rows of the epoch are "
                                 f"not the rows the buffer held when it started")


def _prefix_then_suffix(got, old, new, what):
    """``got`` (batches) is a few batches of ``old`` (requested before), then ``new``'s."""
    kinds = []
    for j, (g, o, n) in enumerate(zip(got, old, new)):
        kinds.append("old" if sr.same_batch(g, o) else "new" if sr.same_batch(g, n)
                     else "neither")
    assert "neither" not in kinds, f"{what}: batches of neither stream: {kinds}"
    switch = kinds.index("new") if "new" in kinds else len(kinds)
    assert kinds[switch:] == ["new"] * (len(kinds) - switch), f"{what}: {kinds}"
    assert switch <= 4, f"{what}: the old copy served {switch} batches: {kinds}"


@pytest.mark.parametrize("how", SNAPSHOT_GONE)
def test_every_worker_gone_the_stream_goes_on_from_new_workers_over_the_data_now(
        how, monkeypatch):
    rb = sr.buffer(60, 120)
    now = sr.buffer(60, 120)
    now.storage.storage_map["obs"].data = now.storage.storage_map["obs"].data + 1000
    opts = {"batches_per_task": 1, "n_buffers": 2}
    with make(sr.buffer(60, 120), "fork", **opts) as old_twin, \
            make(now, "fork", **opts) as new_twin:
        old_first = sr.clone(old_twin.sample())   # (their workers start before any refusal)
        new_twin.sample()
        m, first = _sampler_without_snapshot(rb, how, monkeypatch)
        with m:
            assert sr.same_batch(first, old_first)
            _plus_1000(rb)
            for pid in hooks.worker_pids(hooks.sample_manager(m)):
                hooks.kill(pid)
            with pytest.warns(RuntimeWarning):
                got = [sr.clone(m.sample()) for _ in range(20)]
            old = [sr.clone(old_twin.sample()) for _ in range(20)]
            new = [sr.clone(new_twin.sample()) for _ in range(20)]
            _prefix_then_suffix(got, old, new, "sample() after every worker died")


@pytest.mark.parametrize("how", SNAPSHOT_GONE)
def test_every_worker_of_an_epoch_gone_the_epoch_raises(how, monkeypatch):
    rb = sr.buffer(400)
    with _fork_sampler(rb, how, monkeypatch) as m:
        at_start = sr.buffer_rows(rb)
        it, batches, manager = _epoch_without_snapshot(m, how)
        _plus_1000(rb)
        for pid in hooks.worker_pids(manager):
            hooks.kill(pid)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with pytest.raises(WorkerDiedError):
                for b in it:
                    batches.append(sr.clone(b))
        got = sr.epoch_rows(batches)
        assert not got - at_start, (f"{sum((got - at_start).values())} rows of the epoch "
                                    f"are not the rows the buffer held when it started")


# -- a worker killed while it starts ---------------------------------------------------------

@pytest.mark.parametrize("ctx", ["spawn", "forkserver"])
def test_a_worker_killed_while_it_starts_is_noticed_and_replaced(ctx):
    opts = {"batches_per_task": 1, "n_buffers": 2}
    with make(sr.buffer(60), ctx, **opts) as m, make(sr.buffer(60), "fork", **opts) as twin:
        assert_same_stream(m, twin, 1)
        manager = hooks.sample_manager(m)
        hooks.start_all(manager)
        pid = hooks.worker_pids(manager)[1]
        starting = not hooks.worker_started(manager, 1)
        hooks.kill(pid)
        assert starting, "worker 1 was past its start: the test did not kill it starting"
        assert_same_stream(m, twin, 30)   # (each call waits on worker 0's next result)
        pids = hooks.worker_pids(manager)
        assert len(pids) == 2 and pid not in pids, f"not replaced: {pids}, killed {pid}"
        assert all(process_running(p) for p in pids), pids
        assert not os.path.exists(f"/proc/{pid}"), f"the killed worker {pid} is a zombie"
        assert_same_stream(m, twin, 10)


# -- writes that bypass torch's version counter ----------------------------------------------

WRITES = {"numpy": "tensor.numpy()", "data": "tensor.data",
          "alias": "another tensor over the same memory (set_)"}


def _write_past_the_counter(rb, how, rows):
    """Add 1000 to ``obs`` of ``rows`` through ``tensor.numpy()``, ``tensor.data`` or
    another tensor over the same memory, none of which moves the tensor's version
    counter."""
    t = sr.tensor(rb, "obs")
    version = t._version
    if how == "numpy":
        t.numpy()[rows] += 1000
    elif how == "data":
        t.data[rows] += 1000
    else:
        alias = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(),
                                                   t.shape, t.stride())
        alias[rows] += 1000
    assert t._version == version   # (the write the fingerprint cannot see)


@pytest.mark.parametrize("how", ["numpy", "data", "alias"])
def test_fork_a_write_past_the_version_counter_is_seen_by_the_next_epoch(how):
    rb = sr.buffer(60)
    with make(rb, "fork") as m:
        m.sample()
        assert_epoch_is_buffer(epoch(m), rb, "epoch 1")
        _write_past_the_counter(rb, how, slice(10, 13))   # (3 rows of 60)
        batches = epoch(m)
        assert_epoch_is_buffer(batches, rb, f"the epoch after a write through {WRITES[how]} "
                                            f"({m.epoch_workers}: {m.epoch_workers_reason})")
        assert m.epoch_workers == "new", m.epoch_workers_reason


def test_spawn_the_reason_never_says_the_data_is_unchanged():
    """Under spawn no write past the version counter can be seen, so no epoch's reason may
    claim the data is unchanged (it says what was checked and what was not)."""
    rb = sr.buffer(60)
    with make(rb, "spawn") as m:
        for i in range(3):
            assert_epoch_is_buffer(epoch(m), rb, f"epoch {i + 1}")
            reason = m.epoch_workers_reason or ""
            assert "the data is unchanged" not in reason, (i + 1, m.epoch_workers, reason)


@pytest.mark.parametrize("how", ["numpy", "data"])
def test_spawn_a_bulk_write_past_the_version_counter_is_seen(how):
    rb = sr.buffer(60)
    with make(rb, "spawn") as m:
        assert_epoch_is_buffer(epoch(m), rb, "epoch 1")
        _write_past_the_counter(rb, how, slice(None))   # (every row)
        batches = epoch(m)
        assert_epoch_is_buffer(batches, rb, f"the epoch after a write of every row through "
                                            f"{WRITES[how]} ({m.epoch_workers}: "
                                            f"{m.epoch_workers_reason})")
