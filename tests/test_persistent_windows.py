"""Epochs over a WindowedBatch keep their workers while the data is unchanged: the view is
one the fingerprint knows (its windows, episode key and options by value, the buffer under
it as any buffer), so that reading it changes nothing, every change to it or under it is
seen, and kept workers give the batches new ones give, bit for bit."""
import pytest
import torch

import _views_data as vd
from test_gather import assert_identical
from test_persistent import run_epoch, same_epochs

from unienv_mp import MultiprocessingSampler, WindowedBatch
from unienv_mp._sampling import fingerprint as _fingerprint

WINDOWS = {"obs/image": [-1, 0], "obs/state": [-2, -1, 0], "action": range(5)}


def _view(rb=None, **kwargs):
    return WindowedBatch(vd.buffer(capacity=170) if rb is None else rb, WINDOWS, **kwargs)


def mp_sampler(view, persistent=None, ctx="fork", batch=8):
    return MultiprocessingSampler(vd.sampler_of(view, batch), n_workers=2, n_buffers=3,
                                  ctx=ctx, persistent_workers=persistent)


def test_the_fingerprint_is_told_for_windows_and_reading_them_changes_nothing():
    for kwargs in ({}, {"episode_end_key": "episode_end"}, {"episode_id_key": None},
                   {"keep_other_keys": False},
                   {"get_valid_mask_function": vd.EPISODE_ID}):
        s = vd.sampler_of(_view(**kwargs), 16)
        fp, why = _fingerprint.check(s)
        assert fp is not None, (kwargs, why)
        for _ in range(2):
            s.sample()
            s.sample_with_metadata()
            s.sample_flat()   # (UniEnv caches the batched spaces in the view: a cache)
            s.data.get_at(3)
        assert "_batched_space" in vars(s.data)
        assert _fingerprint.same(fp, _fingerprint.take(s)), kwargs
    # the same windows over other data, or of another time, are a view of their own
    timed = WindowedBatch(vd.buffer(), delta_timestamps={"action": [0, 0.1]}, fps=10)
    assert _fingerprint.check(vd.sampler_of(timed))[0] is not None


def _changes():
    """name -> change(view, rb): a change to the buffer under a view, or to the view's
    own parameters."""
    def write(rb):
        rb.storage.storage_map["action"].data[5].add_(1)

    return {
        "an append to the buffer": lambda v, rb: rb.extend(vd.steps(2000, [4, 3])),
        "a write to a row": lambda v, rb: write(rb),
        "a storage's tensor replaced": lambda v, rb: setattr(
            rb.storage.storage_map["obs/image"], "data",
            rb.storage.storage_map["obs/image"].data.clone()),
        "a window's offsets": lambda v, rb: v._windows.update(action=(0, 1, 2, 3, 6)),
        "a window added": lambda v, rb: v._windows.update(reward=(-1, 0)),
        "episodes told by another key": lambda v, rb: setattr(
            v, "_episodes", ("end", "episode_end")),
        "keys without a window left out": lambda v, rb: setattr(v, "_keep_other_keys",
                                                                 False),
        "the view's data replaced": lambda v, rb: setattr(v, "batch", vd.buffer(seed=3)),
    }


CHANGES = _changes()


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_change_to_windows_or_under_them_is_seen(change):
    rb = vd.buffer(capacity=170)
    view = _view(rb)
    s = vd.sampler_of(view)
    before = _fingerprint.take(s)
    assert before is not None
    CHANGES[change](view, rb)
    after = _fingerprint.take(s)
    assert not _fingerprint.same(before, after), "a change was not seen"


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_epochs_over_windows_on_kept_workers_are_bit_identical_to_new_workers(ctx):
    view = _view()
    kept, new = mp_sampler(view, None, ctx), mp_sampler(view, False, "fork")
    with kept, new:
        assert kept.gather_path == "direct"
        pids = set()
        for method in ("epoch_iter", "epoch_iter_with_metadata", "epoch_iter"):
            a, a_pid = run_epoch(kept, method)
            same_epochs(a, run_epoch(new, method)[0])
            pids.add(a_pid)
        assert len(pids) == 1, "the workers were not kept"
        assert kept.epoch_workers == "kept"
        # (exact under fork; under spawn the reason says what was checked)
        assert kept.epoch_workers_reason == (
            "the data is unchanged since they started" if ctx == "fork" else
            "torch counts no change to the data since they started, and samples of it "
            "match their copy (a write to a few rows through tensor.numpy(), tensor.data "
            "or ctypes is not seen: persistent_workers=False if the data is written that "
            "way)")
        assert new.epoch_workers == "new"


@pytest.mark.parametrize("change", ["an append to the buffer", "a window's offsets"])
def test_a_change_between_epochs_gets_new_workers_that_see_it(change):
    rb = vd.buffer(capacity=170)
    view = _view(rb)
    kept, new = mp_sampler(view), mp_sampler(view, False)
    with kept, new:
        a1, pid1 = run_epoch(kept, "epoch_iter_with_metadata")
        same_epochs(a1, run_epoch(new, "epoch_iter_with_metadata")[0])
        CHANGES[change](view, rb)
        a2, pid2 = run_epoch(kept, "epoch_iter_with_metadata")
        same_epochs(a2, run_epoch(new, "epoch_iter_with_metadata")[0])
        assert pid2 != pid1, "the workers holding the old data were kept"
        assert kept.epoch_workers == "new" and "changed" in kept.epoch_workers_reason
        # the new epoch is of the data and windows as they are now: the view's own
        # answer for the steps it drew (its state history's last frame is the step)
        steps = [int(x) for x in rb.get_at(torch.arange(len(rb)))["obs"]["state"][:, 0]]
        for batch in a2:
            t = torch.tensor([steps.index(int(x)) for x in batch[0]["obs"]["state"][:, -1, 0]])
            assert_identical(batch, view.get_at_with_metadata(t))
        assert sum(len(b[0]["action"]) for b in a2) == len(view)
        a3, pid3 = run_epoch(kept, "epoch_iter_with_metadata")
        assert pid3 == pid2 and kept.epoch_workers == "kept"
        same_epochs(a3, run_epoch(new, "epoch_iter_with_metadata")[0])
