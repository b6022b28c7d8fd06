"""Epochs on workers that outlive them (``persistent_workers``): the exact "data unchanged"
fingerprint, kept workers giving the same batches bit for bit as new ones, and every kind
of change to the data between epochs seen by the next epoch."""
import pytest
import torch

import _data
from _data import indices_of, replay_buffer
from test_gather import assert_identical
from unienv_data.samplers import StepSampler

from unienv_mp import MultiprocessingSampler
from unienv_mp._process.launch import Launch
from unienv_mp._sampling import fingerprint as _fingerprint

EPOCHS = ("epoch_iter", "epoch_iter_with_metadata", "epoch_flat_iter",
          "epoch_flat_iter_with_metadata")


def clone(tree):
    """A copy of a batch that holds no slot."""
    if isinstance(tree, dict):
        return {k: clone(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(clone(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    return tree


def run_epoch(m, method="epoch_iter"):
    """``(batches, pid)``: one epoch's batches (copied) and the pid of the first worker of
    the pool that made them (which always starts with its pool; the others may start
    later, see the manager's ``start_later``)."""
    batches, pids = [], None
    before = dict(m._pools.users)   # manager -> epochs running on it
    for b in getattr(m, method)():
        if pids is None:
            (pool,) = [p for p, n in m._pools.users.items() if n > before.get(p, 0)]
            pids = pool.workers[0].pid
        batches.append(clone(b))
    return batches, pids


def same_epochs(a, b):
    assert len(a) == len(b), f"{len(a)} batches != {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        assert_identical(x, y, f"batch {i}")


def sampler(rb, persistent, ctx="fork", seed=0, batch=16, **kwargs):
    return MultiprocessingSampler(StepSampler(rb, batch, seed=seed), n_workers=2,
                                  n_buffers=3, ctx=ctx, persistent_workers=persistent,
                                  **kwargs)


# -- the option -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, 1, "yes", "False", 1.0, [True]])
def test_persistent_workers_accepts_only_none_true_false(bad):
    rb = replay_buffer(20)
    with pytest.raises(TypeError, match="persistent_workers must be None, True or False"):
        MultiprocessingSampler(StepSampler(rb, 4, seed=0), persistent_workers=bad)


@pytest.mark.parametrize("value", [None, True, False])
def test_persistent_workers_is_kept_as_given(value):
    rb = replay_buffer(20)
    with MultiprocessingSampler(StepSampler(rb, 4, seed=0), persistent_workers=value) as m:
        assert m.persistent_workers is value


# -- the fingerprint ------------------------------------------------------------------------

def test_fingerprint_of_unchanged_data_is_the_same_and_every_change_is_seen():
    rb = replay_buffer(50, capacity=60)
    s = StepSampler(rb, 8, seed=0)
    fp = _fingerprint.take(s)
    assert fp is not None
    assert _fingerprint.same(fp, _fingerprint.take(s))
    s.data_rng.manual_seed(5)    # (get*_at draw nothing: the RNG is no part of it)
    assert _fingerprint.same(fp, _fingerprint.take(s))
    storage = rb.storage.storage_map

    def changed(change):
        before = _fingerprint.take(s)
        change()
        after = _fingerprint.take(s)
        assert after is not None
        assert not _fingerprint.same(before, after), "a change was not seen"
        assert _fingerprint.same(after, _fingerprint.take(s))

    changed(lambda: rb.extend(_data.transitions(50, 3)))                     # count
    changed(lambda: rb.set_at(2, {k: v[0] for k, v in _data.transitions(9, 1).items()}))
    changed(lambda: storage["image"].data[4].add_(1))                         # in place
    changed(lambda: storage["state"].data.__setitem__(1, 7.0))
    data = storage["action"].data
    changed(lambda: setattr(storage["action"], "data", data.clone()))        # replaced, equal
    changed(lambda: rb.extend(_data.transitions(53, 20)))                     # wraps: offset
    changed(lambda: setattr(rb._ring_state, "offset", (rb._ring_state.offset + 1) % 60))
    changed(lambda: setattr(s, "batch_size", 9))
    changed(lambda: setattr(s, "batch_size", 9.0))                           # same ==, not same
    changed(lambda: setattr(rb, "_flag", 0.0))
    changed(lambda: setattr(rb, "_flag", -0.0))
    changed(lambda: storage.pop("state"))                                    # a dict changes


def test_fingerprint_holds_no_tensor_alive_and_a_dead_one_is_not_the_same():
    rb = replay_buffer(30)
    s = StepSampler(rb, 8, seed=0)
    fp = _fingerprint.take(s)
    st = rb.storage.storage_map["image"]
    old = st.data
    st.data = old.clone()
    del old
    st.data = st.data   # (the clone stays)
    assert not _fingerprint.same(fp, _fingerprint.take(s))


def test_fingerprint_cannot_be_told_for_other_samplers_and_storages(tmp_path):
    rb = replay_buffer(30)
    assert _fingerprint.take(_data.SlowSampler(rb, 8, seed=0)) is None   # a subclass
    # memory-mapped: known by the files it maps (tests/test_persistent_files.py)
    fp = _fingerprint.take(StepSampler(replay_buffer(30, memmap_dir=str(tmp_path)), 8))
    assert fp is not None and len(fp.maps) == 3
    # numpy arrays have no versions: by value up to 1 MiB (a space's bounds), not beyond
    rb.storage.storage_map["image"].data = rb.storage.storage_map["image"].data.numpy()
    assert _fingerprint.take(StepSampler(rb, 8)) is not None
    big = replay_buffer(30, img=(3, 128, 128))
    big.storage.storage_map["image"].data = big.storage.storage_map["image"].data.numpy()
    fp, why = _fingerprint.check(StepSampler(big, 8))
    assert fp is None and "numpy array of 1474560 bytes" in why


# -- kept workers: the same batches, bit for bit ---------------------------------------------

@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_epochs_on_kept_workers_are_bit_identical_to_epochs_on_new_workers(ctx):
    rb = replay_buffer(90, capacity=100)
    with sampler(rb, None, ctx) as kept, sampler(rb, False, ctx) as new, \
            sampler(rb, True, ctx) as promised:
        kept_pids, promised_pids, new_pids = set(), set(), []
        for method in EPOCHS + ("epoch_iter",):
            a, a_pids = run_epoch(kept, method)
            b, b_pids = run_epoch(new, method)
            c, c_pids = run_epoch(promised, method)
            same_epochs(a, b)
            same_epochs(c, b)
            kept_pids.add(a_pids)
            promised_pids.add(c_pids)
            new_pids.append(b_pids)
        assert len(kept_pids) == 1 and len(promised_pids) == 1, "the workers were not kept"
        assert len(set(new_pids)) == len(new_pids), "persistent_workers=False kept workers"
        assert not new._pools.users and new._pools.kept is None and not new._pools.own
        (first,) = kept_pids
        # sample() then runs on the same workers: one pool
        kept.sample()
        assert kept._pools.sample.workers[0].pid == first
        assert kept._pools.kept is None
        a, pids = run_epoch(kept)
        assert pids == first
        same_epochs(a, run_epoch(new)[0])


def test_an_epoch_runs_on_the_sample_workers_while_the_data_is_unchanged():
    rb = replay_buffer(60)
    with sampler(rb, None) as m, sampler(rb, False) as ref:
        m.sample()
        ref.sample()
        pids = m._pools.sample.workers[0].pid
        for _ in range(2):
            a, a_pids = run_epoch(m)
            assert a_pids == pids
            same_epochs(a, run_epoch(ref)[0])
        assert m._pools.kept is None and not m._pools.own
        # the stream of sample() is unaffected by the epochs that ran on its workers
        assert_identical(clone(m.sample()), clone(ref.sample()))


# -- changes between epochs are seen -----------------------------------------------------------

def _row(i):
    return {k: v[0] for k, v in _data.transitions(i, 1).items()}


CHANGES = {
    "extend": lambda rb: rb.extend(_data.transitions(80, 10)),
    "extend, full: wraps": lambda rb: rb.extend(_data.transitions(500, 30)),
    "set_at": lambda rb: [rb.set_at(i, _row(1000 + i)) for i in range(0, 80, 3)],
    "in-place tensor write": lambda rb: rb.storage.storage_map["image"].data[::2].add_(7),
    "tensor replaced": lambda rb: setattr(
        rb.storage.storage_map["state"], "data", rb.storage.storage_map["state"].data + 1),
}


@pytest.mark.parametrize("change,ctx", [(c, "fork") for c in CHANGES] + [
    ("extend", "spawn"), ("in-place tensor write", "spawn")])
def test_a_change_between_epochs_is_seen_by_the_next_epoch(change, ctx):
    capacity = 80 if "full" in change else 100
    rb = replay_buffer(80, capacity=capacity)
    with sampler(rb, None, ctx) as kept, sampler(rb, False, ctx) as new, \
            sampler(rb, True, ctx) as promised:
        a1, pids1 = run_epoch(kept)
        same_epochs(a1, run_epoch(new)[0])
        run_epoch(promised)
        CHANGES[change](rb)
        a2, pids2 = run_epoch(kept)
        b2, _ = run_epoch(new)
        same_epochs(a2, b2)
        assert pids2 != pids1, "the workers holding the old data were kept"
        if len(rb) != 80:
            # a change of length is seen even under the promise: new workers
            same_epochs(run_epoch(promised)[0], b2)
        else:
            # stale workers would have given other batches: this test can fail
            try:
                c2, _ = run_epoch(promised)
            except Exception:
                pass   # (stale workers may also fail: the promise was broken)
            else:
                with pytest.raises(AssertionError):
                    same_epochs(c2, b2)
        # and the new workers are kept from then on
        a3, pids3 = run_epoch(kept)
        assert pids3 == pids2
        same_epochs(a3, run_epoch(new)[0])


def test_an_epoch_still_running_on_workers_that_are_no_longer_current_finishes_on_them():
    rb = replay_buffer(64, capacity=100)
    with sampler(rb, None) as kept, sampler(rb, False) as new:
        run_epoch(kept)
        run_epoch(new)
        it_a, it_b = kept.epoch_iter(), new.epoch_iter()
        first = [(clone(next(it_a)), clone(next(it_b))) for _ in range(2)]
        (old_pool,) = kept._pools.users
        rb.extend(_data.transitions(64, 20))
        # a second epoch over the new data, while the first is still running
        a2, pids2 = run_epoch(kept)
        same_epochs(a2, run_epoch(new)[0])
        assert pids2 != old_pool.workers[0].pid
        assert not old_pool.closed and old_pool in kept._pools.own
        # the first epoch finishes, on the data as it was when it started
        rest_a, rest_b = [clone(b) for b in it_a], [clone(b) for b in it_b]
        same_epochs([x for x, _ in first] + rest_a, [y for _, y in first] + rest_b)
        assert sorted(i for b in rest_a for i in indices_of(b)) == sorted(
            set(range(64)) - {i for x, _ in first for i in indices_of(x)})
        assert old_pool.closed and not kept._pools.own


def test_sample_workers_keep_their_snapshot_and_a_changed_epoch_gets_its_own_pool():
    """UniEnv's semantics stay: sample() sees the data as it was at its first call."""
    rb = replay_buffer(50, capacity=100)
    with sampler(rb, None, batch=32) as m:
        run_epoch(m)
        m.sample()
        assert m._pools.kept is None          # the epoch's workers became the sample() workers
        rb.extend(_data.transitions(50, 50))
        seen = sorted(i for b in run_epoch(m)[0] for i in indices_of(b))
        assert seen == list(range(100))
        assert m._pools.kept is not None
        assert max(max(indices_of(m.sample())) for _ in range(5)) < 50


def test_persistent_workers_false_starts_new_workers_for_every_epoch():
    rb = replay_buffer(40)
    with sampler(rb, False) as m:
        pids = {run_epoch(m)[1] for _ in range(3)}
        assert len(pids) == 3
        assert m._pools.kept is None and not m._pools.own and not m._pools.users


def test_a_sampler_that_cannot_be_told_starts_new_workers_unless_promised():
    rb = replay_buffer(40)
    s = _data.SlowSampler(rb, 8, seed=0, delay=0.0)
    with MultiprocessingSampler(s, n_workers=2, ctx="fork") as m:
        assert len({run_epoch(m)[1] for _ in range(2)}) == 2
    s = _data.SlowSampler(rb, 8, seed=0, delay=0.0)
    with MultiprocessingSampler(s, n_workers=2, ctx="fork", persistent_workers=True) as m:
        assert len({run_epoch(m)[1] for _ in range(2)}) == 1


def test_promised_data_whose_length_changed_gets_new_workers():
    """persistent_workers=True promises the data does not change; a change of its length
    is seen anyway (it costs nothing), and the next epoch runs on workers that hold it."""
    rb = replay_buffer(40, capacity=80)
    s = _data.SlowSampler(rb, 8, seed=0, delay=0.0)   # (no fingerprint: the promise alone)
    with MultiprocessingSampler(s, n_workers=2, ctx="fork", persistent_workers=True) as m:
        batches, first = run_epoch(m)
        assert sorted(i for b in batches for i in indices_of(b)) == list(range(40))
        rb.extend(_data.transitions(40, 20))
        batches, second = run_epoch(m)
        assert sorted(i for b in batches for i in indices_of(b)) == list(range(60))
        assert second != first
        assert run_epoch(m)[1] == second   # (kept again while the length stays)


def test_close_ends_kept_workers():
    rb = replay_buffer(40)
    m = sampler(rb, None)
    run_epoch(m)
    pool = m._pools.kept
    assert pool is not None and not pool.closed
    m.close()
    assert pool.closed and m._pools.kept is None


# -- workers started after the first: only while the data is the first one's copy -------------

@pytest.mark.parametrize("snapshot", [True, False])
def test_a_new_pool_starts_one_worker_and_the_rest_from_the_first_ones_copy(snapshot,
                                                                             monkeypatch):
    # under fork later workers come from the snapshot process, which holds the first
    # worker's copy; without it, they start only while the data is unchanged
    if not snapshot:
        monkeypatch.setattr(Launch, "keep_snapshot", lambda self: None)
    rb = replay_buffer(200, capacity=400)
    with sampler(rb, None, batch=8) as lazy, sampler(rb, False, batch=8) as eager:
        first = [clone(lazy.sample()), clone(eager.sample())]
        assert len(lazy._pools.sample.workers) == 1 and len(eager._pools.sample.workers) == 2
        assert_identical(*first)
        rb.extend(_data.transitions(200, 100))   # the second worker would copy this
        for _ in range(30):
            assert_identical(clone(lazy.sample()), clone(eager.sample()))
        lazy._pools.sample.start_all()
        assert len(lazy._pools.sample.workers) == (2 if snapshot else 1)
        for _ in range(10):
            batch = clone(lazy.sample())
            assert_identical(batch, clone(eager.sample()))
            assert max(indices_of(batch)) < 200


def test_a_new_pool_over_unchanged_data_starts_its_other_workers():
    rb = replay_buffer(64)
    with sampler(rb, None) as m:
        m.sample()
        m._pools.sample.start_all()
        assert len({p.pid for p in m._pools.sample.workers}) == 2
