"""Epochs over UniEnv's views keep their workers while the data is unchanged: the
fingerprint covers frame stacks, action chunks, column stacks, combined datasets, field and
index views, nested as users nest them; every change to a buffer under a view, or to a
view's parameters, is seen; and the sampler says which workers an epoch began on, and why.
"""
import pytest
import torch

import _views_data as vd
from test_persistent import run_epoch, same_epochs

from unienv_mp import MultiprocessingSampler
from unienv_mp._sampling import fingerprint as _fingerprint


def mp_sampler(view, persistent=None, ctx="fork", batch=8, **kwargs):
    return MultiprocessingSampler(vd.sampler_of(view, batch), n_workers=2, n_buffers=3,
                                  ctx=ctx, persistent_workers=persistent, **kwargs)


def pair(view, ctx="fork", **kwargs):
    """A sampler that keeps its workers (the default) and one that starts new ones for
    every epoch, over ``view``."""
    return mp_sampler(view, None, ctx, **kwargs), mp_sampler(view, False, ctx, **kwargs)


# -- the fingerprint of a view ----------------------------------------------------------------

def test_the_fingerprint_is_told_for_every_kind_of_view():
    for seed in range(60):
        view = vd.random_view(seed)
        s = vd.sampler_of(view)
        fp, why = _fingerprint.check(s)
        assert fp is not None, f"seed {seed}, {type(view).__name__}: {why}"
        assert _fingerprint.same(fp, _fingerprint.take(s))


def test_reading_a_view_in_this_process_changes_nothing_in_its_fingerprint():
    """What a view only caches (a CombinedBatch's thread pool, its memo of spaces) is no
    part of its data."""
    a, b = vd.buffer(), vd.buffer(start=1000)
    view = vd.CombinedBatch([vd.frame_stack(a, 2), vd.frame_stack(b, 2)], use_thread_pool=True)
    s = vd.sampler_of(view, 16)
    fp = _fingerprint.take(s)
    for _ in range(3):
        s.sample()
        s.sample_with_metadata()
    assert view._executor is not None   # (the pool exists now)
    assert _fingerprint.same(fp, _fingerprint.take(s))


def test_a_custom_valid_mask_function_cannot_be_vouched_for():
    def my_mask(batch, idx, data, meta):
        return data["episode_id"] == data["episode_id"][:, -1:]
    view = vd.frame_stack(vd.buffer(), mask=my_mask)
    fp, why = _fingerprint.check(vd.sampler_of(view))
    assert fp is None and "my_mask" in why


def _view_changes():
    """name -> (make, change): ``make()`` returns ``(view, parts)``; ``change(view, parts)``
    changes it as users do (a buffer under it, or one of its parameters)."""
    def stack():
        rb = vd.buffer(capacity=300)
        # (a helper of its own: a change writes its keywords)
        mask = vd.SliceStackedBatch.get_valid_mask_function_with_episodeid_key("episode_id")
        return vd.frame_stack(rb, 2, mask=mask), {"rb": rb}

    def combined():
        a, b = vd.buffer(capacity=300), vd.buffer(capacity=300, start=1000)
        return vd.combined_stacks(a, b), {"a": a, "b": b}

    def nested():
        rb = vd.buffer(capacity=300)
        sub = vd.SubIndexedBatch(rb, torch.arange(0, 150))
        view = vd.SubItemBatch(vd.frame_stack(sub, 1), ["obs"])
        return view, {"rb": rb, "sub": sub}

    def chunk():
        rb = vd.buffer(capacity=300)
        return vd.action_chunk(rb), {"rb": rb}

    def more(rb, start=2000):
        rb.extend(vd.steps(start, [5, 3]))

    def image(rb):
        return rb.storage.storage_map["obs/image"]

    return {
        "append to part 0 of a CombinedBatch": (combined, lambda v, p: more(p["a"])),
        "append to part 1 of a CombinedBatch": (combined, lambda v, p: more(p["b"])),
        "append under an action chunk": (chunk, lambda v, p: more(p["rb"])),
        "set_at under a stack": (stack, lambda v, p: p["rb"].set_at(
            3, {k: (x[0] if not isinstance(x, dict) else {j: y[0] for j, y in x.items()})
                for k, x in vd.steps(7000, [1]).items()})),
        "in-place write under nested views": (nested, lambda v, p: image(p["rb"]).data[5].add_(1)),
        "a tensor replaced by an equal one": (stack, lambda v, p: setattr(
            image(p["rb"]), "data", image(p["rb"]).data.clone())),
        "fill_invalid_data changed": (stack, lambda v, p: setattr(v, "fill_invalid_data", False)),
        "fixed_offset written in place": (stack, lambda v, p: v.fixed_offset.sub_(1)),
        "the valid mask function replaced": (
            stack, lambda v, p: setattr(v, "get_valid_mask_function", vd.EPISODE_END)),
        "a valid mask helper's key changed": (
            stack, lambda v, p: v.get_valid_mask_function.keywords.update(
                episode_id_key="reward")),
        "a part of a CombinedBatch replaced": (
            combined, lambda v, p: v.batches.__setitem__(1, vd.frame_stack(p["b"], 2))),
        "a SubIndexedBatch's index written": (nested, lambda v, p: p["sub"].sub_indexes.add_(1)),
        "a SubItemBatch's keys changed": (
            nested, lambda v, p: setattr(v, "sub_indexes", ["action"])),
    }


VIEW_CHANGES = _view_changes()


@pytest.mark.parametrize("change", list(VIEW_CHANGES))
def test_every_change_to_a_view_or_under_it_is_seen(change):
    make, act = VIEW_CHANGES[change]
    view, parts = make()
    s = vd.sampler_of(view)
    before = _fingerprint.take(s)
    assert before is not None
    act(view, parts)
    after = _fingerprint.take(s)
    assert not _fingerprint.same(before, after), "a change was not seen"


# -- kept workers: the same batches, bit for bit ----------------------------------------------

def _views():
    a, b = vd.buffer(capacity=170), vd.buffer(start=1000, lengths=(7, 13, 1, 9) * 5)
    return {
        "frame stack": vd.frame_stack(a, 2),
        "action chunk": vd.action_chunk(a),
        "state history": vd.state_history(a),
        "combined stacks": vd.combined_stacks(a, b),
        "field of a stack of an index view": vd.SubItemBatch(
            vd.frame_stack(vd.SubIndexedBatch(a, torch.arange(160, -1, -3)), 1,
                           mask=vd.EPISODE_END), ["obs", "image"]),
        "stack of a combined": vd.frame_stack(vd.CombinedBatch([a, b]), 1, 1),
    }


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_epochs_over_views_on_kept_workers_are_bit_identical_to_new_workers(ctx):
    for name, view in _views().items():
        # (new workers for every epoch under fork: the stream does not depend on the
        # start method, and each spawn costs a second and more)
        kept, new = mp_sampler(view, None, ctx), mp_sampler(view, False, "fork")
        with kept, new:
            pids = set()
            for method in ("epoch_iter", "epoch_iter_with_metadata", "epoch_iter"):
                a, a_pid = run_epoch(kept, method)
                b, _ = run_epoch(new, method)
                same_epochs(a, b)
                pids.add(a_pid)
            assert len(pids) == 1, f"{name}: the workers were not kept"
            assert kept.epoch_workers == "kept", name
            assert new.epoch_workers == "new", name


@pytest.mark.parametrize("change", ["append to part 1 of a CombinedBatch",
                                    "fill_invalid_data changed",
                                    "a valid mask helper's key changed"])
def test_a_change_to_a_view_between_epochs_gets_new_workers_that_see_it(change):
    make, act = VIEW_CHANGES[change]
    view, parts = make()
    kept, new = pair(view)
    with kept, new:
        a1, pid1 = run_epoch(kept)
        same_epochs(a1, run_epoch(new)[0])
        act(view, parts)
        a2, pid2 = run_epoch(kept)
        b2, _ = run_epoch(new)
        same_epochs(a2, b2)
        assert pid2 != pid1, "the workers holding the old data were kept"
        assert kept.epoch_workers == "new"
        assert "changed" in kept.epoch_workers_reason
        a3, pid3 = run_epoch(kept)
        assert pid3 == pid2 and kept.epoch_workers == "kept"
        same_epochs(a3, run_epoch(new)[0])


# -- saying why ---------------------------------------------------------------------------------

def test_the_sampler_says_which_workers_an_epoch_began_on_and_why():
    rb = vd.buffer()
    with mp_sampler(vd.frame_stack(rb, 2)) as m:
        assert (m.epoch_workers, m.epoch_workers_reason) == (None, None)
        run_epoch(m)
        assert (m.epoch_workers, m.epoch_workers_reason) == ("new", "no workers were running yet")
        run_epoch(m)
        st = m.stats()
        assert (m.epoch_workers, st.epoch_workers) == ("kept", "kept")
        assert st.epoch_workers_reason == m.epoch_workers_reason == \
            "the data is unchanged since they started"
    with mp_sampler(vd.frame_stack(rb, 2), persistent=False) as m:
        run_epoch(m)
        run_epoch(m)
        assert (m.epoch_workers, m.epoch_workers_reason) == ("new", "persistent_workers=False")
    with mp_sampler(vd.frame_stack(rb, 2), persistent=True) as m:
        run_epoch(m)
        run_epoch(m)
        assert (m.epoch_workers, m.epoch_workers_reason) == ("kept", "persistent_workers=True")


def test_a_view_that_cannot_be_vouched_for_says_so_and_gets_new_workers():
    def my_mask(batch, idx, data, meta):
        return data["episode_id"] == data["episode_id"][:, -1:]
    with mp_sampler(vd.frame_stack(vd.buffer(), mask=my_mask)) as m:
        pids = {run_epoch(m)[1] for _ in range(2)}
        assert len(pids) == 2
        assert m.epoch_workers == "new"
        assert "cannot be told" in m.epoch_workers_reason
        assert "my_mask" in m.epoch_workers_reason
        assert m.stats().epoch_workers_reason == m.epoch_workers_reason


def test_epochs_over_shared_data_and_views_of_it_keep_their_workers():
    rb = vd.buffer(multiprocessing=True)
    with mp_sampler(rb) as m:
        run_epoch(m)
        assert m.epoch_workers == "new"
        run_epoch(m)
        assert m.epoch_workers == "kept"
        assert m.epoch_workers_reason.startswith("the data is shared between processes")
    # a view over it: the buffer by its identity (workers read it as it is now), the
    # view's parameters by value
    view = vd.frame_stack(rb, 2)
    kept, new = pair(view)
    with kept, new:
        a1, pid1 = run_epoch(kept)
        same_epochs(a1, run_epoch(new)[0])
        rb.extend(vd.steps(3000, [4, 6]))
        a2, pid2 = run_epoch(kept)
        assert (kept.epoch_workers, pid2) == ("kept", pid1)
        same_epochs(a2, run_epoch(new)[0])
        view.fill_invalid_data = False
        a3, pid3 = run_epoch(kept)
        assert kept.epoch_workers == "new" and pid3 != pid1
        same_epochs(a3, run_epoch(new)[0])
        # a storage's tensor replaced by one that is not shared: the workers would not
        # see it
        action = rb.storage.storage_map["action"]
        action.data = action.data.clone() + 1
        assert not action.data.is_shared()
        a4, pid4 = run_epoch(kept)
        assert kept.epoch_workers == "new" and pid4 != pid3
        same_epochs(a4, run_epoch(new)[0])


def test_a_shared_buffer_with_a_storage_replaced_is_a_change():
    rb, other = vd.buffer(multiprocessing=True), vd.buffer(multiprocessing=True, seed=5)
    s = vd.sampler_of(vd.frame_stack(rb, 1))
    fp = _fingerprint.take(s)
    rb.extend(vd.steps(3000, [4, 6]))          # (seen by the workers as it is)
    assert _fingerprint.same(fp, _fingerprint.take(s))
    rb.storage = other.storage
    assert not _fingerprint.same(fp, _fingerprint.take(s))
