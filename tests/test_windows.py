"""WindowedBatch: windows per key over one index stream, padded at episode ends as LeRobot
pads them, with a mask per key.  Every row and every mask is checked, bit for bit, against
three things: the buffer itself (each step's number is in ``obs.state[:, 0]`` and its
episode in ``episode_id``, so a row tells which step it is), UniEnv's own views composed per
key with the same indices (the reference below), and the other path (the view's own
``get_at`` against the workers' direct gather), in process, under fork and spawn, and across
a resume mid-epoch."""
import copy

import numpy as np
import pytest
import torch
from unienv_data.batches.combined_batch import CombinedBatch
from unienv_data.batches.slicestack_batch import SliceStackedBatch
from unienv_data.samplers import StepSampler

import _views_data as vd
from test_gather import assert_identical
from test_views import _direct

from unienv_mp import MultiprocessingSampler, WindowedBatch
from unienv_mp._direct import gather
from unienv_mp._direct import rows as _rows
from unienv_mp._transport.protocol import SlotWriter

ISSUE = {"obs/image": [-1, 0], "obs/state": [-1, 0], "action": range(16)}


# -- the oracle: the buffer's own rows, by plain Python ------------------------------------

def _logical(rb):
    """Every step of ``rb`` in logical order: step numbers, episode ids, end flags, and
    the whole rows."""
    rows = rb.get_at(torch.arange(len(rb)))
    return rows, [int(x) for x in rows["obs"]["state"][:, 0]], rows["episode_id"].tolist(), \
        rows["episode_end"].tolist()


def expected_steps(rb, t, offsets, episodes):
    """For index ``t`` and a key's ``offsets``: the logical index each frame comes from and
    whether it is padding, as LeRobot defines them: ``t + o`` clamped to the first and last
    step of ``t``'s episode in the data (an episode: a run of equal ids, or ending at a step
    whose end flag is set; None: the data is one episode)."""
    _, _, ids, ends = _logical(rb)
    n = len(ids)
    same_as_prev = [False] + [
        (ids[i] == ids[i - 1]) if episodes == "id" else
        (not ends[i - 1]) if episodes == "end" else True for i in range(1, n)]
    lo = t
    while lo > 0 and same_as_prev[lo]:
        lo -= 1
    hi = t
    while hi < n - 1 and same_as_prev[hi + 1]:
        hi += 1
    frames = [min(max(t + o, lo), hi) for o in offsets]
    return frames, [f != t + o for f, o in zip(frames, offsets)]


def check_against_the_buffer(rb, view, idx, data, meta, episodes):
    """Every row and pad of the batch ``(data, meta)`` of ``view`` at ``idx`` is the
    buffer's: each windowed key's frame ``j`` of element ``i`` is the logical row
    ``expected_steps`` names (its step number in ``obs.state[:, 0]`` included), and each
    other key is the row at ``idx[i]`` itself."""
    rows, steps, _, _ = _logical(rb)
    n = len(steps)
    for i, t in enumerate(int(x) % n for x in idx):
        for name, offs in view.offsets.items():
            frames, pads = expected_steps(rb, t, offs, episodes)
            got = data
            want = rows
            for k in name.split("/"):
                got, want = got[k], want[k]
            for leaf_got, leaf_want in _leaves(got, want):
                assert torch.equal(leaf_got[i], leaf_want[frames]), (name, t)
            assert meta[f"{name}_is_pad"][i].tolist() == pads, (name, t)
        if "obs/state" in view.offsets:   # (the step numbers themselves)
            assert [int(x) for x in data["obs"]["state"][i, :, 0]] == [
                steps[f] for f in expected_steps(rb, t, view.offsets["obs/state"],
                                                 episodes)[0]]
        if view.keep_other_keys:
            for key in ("reward", "episode_id"):
                if key not in view.offsets:
                    assert torch.equal(data[key][i], rows[key][t]), key
        else:
            assert set(data) == {k.split("/")[0] for k in view.offsets}


def _leaves(a, b):
    if isinstance(a, dict):
        for k in a:
            yield from _leaves(a[k], b[k])
    else:
        yield a, b


def test_padding_is_lerobots_on_a_hand_made_example():
    """Episodes of 3, 1 and 2 steps (steps 0-2, 3, 4-5), actions at t-1 .. t+2: a frame
    outside t's episode repeats its nearest step and is marked; so does a frame outside
    the data."""
    rb = vd.buffer((3, 1, 2))
    view = WindowedBatch(rb, {"action": [-1, 0, 1, 2]}, keep_other_keys=False)
    data, meta = view.get_at_with_metadata(torch.arange(6))
    steps = (data["action"][..., None, :] == rb.get_at(torch.arange(6))["action"][None, None]
             ).all(-1).int().argmax(-1)
    assert steps.tolist() == [[0, 0, 1, 2], [0, 1, 2, 2], [1, 2, 2, 2],
                              [3, 3, 3, 3], [4, 4, 5, 5], [4, 5, 5, 5]]
    assert meta["action_is_pad"].int().tolist() == [[1, 0, 0, 0], [0, 0, 0, 1],
                                                    [0, 0, 1, 1], [1, 0, 1, 1],
                                                    [1, 0, 0, 1], [0, 0, 1, 1]]
    assert list(data) == ["action"] and list(meta) == ["action_is_pad"]


# -- the reference: UniEnv's own views, per key ------------------------------------------------

def uniEnv_reference(rb, view, idx, helper):
    """What UniEnv's own views give for the same indices, composed per key: for each
    windowed key, ``SliceStackedBatch(rb, dense, get_valid_mask_function=helper)
    .get_column(key)`` over the dense window ``dense`` (every step from the key's first
    offset to its last, with 0), its frames at the key's offsets; the pad mask is
    ``~slice_valid_mask`` at those frames, or a frame outside the data (which UniEnv
    clips onto the data's edge and counts as valid where the edge is in the episode).
    Each other key: the buffer's row at the index.  (Dense, because UniEnv's fill repeats
    the frame a count of valid frames away, which is the nearest valid one when the valid
    frames are contiguous around the anchor, as they are in a dense window of
    contiguous episodes.)"""
    n = len(rb)
    data, meta = {}, {}
    for name, offs in view.offsets.items():
        lo, hi = min(min(offs), 0), max(max(offs), 0)
        dense = torch.arange(lo, hi + 1)
        stack = SliceStackedBatch(rb, dense, get_valid_mask_function=helper)
        got, m = stack.get_column(name.split("/")).get_at_with_metadata(idx.clone())
        cols = torch.tensor(offs) - lo
        t = torch.where(idx < 0, idx + n, idx)
        outside = (t[:, None] + torch.tensor(offs)[None] < 0) | (
            t[:, None] + torch.tensor(offs)[None] >= n)
        data[name] = _select(got, cols)
        meta[f"{name}_is_pad"] = ~m["slice_valid_mask"][:, cols] | outside
    return data, meta


def _select(tree, cols):
    if isinstance(tree, dict):
        return {k: _select(v, cols) for k, v in tree.items()}
    return tree[:, cols]


def _view_part(data, name):
    for k in name.split("/"):
        data = data[k]
    return data


def _random_view(seed, **kwargs):
    g = np.random.default_rng(seed)
    lengths = [int(x) for x in g.choice([1, 1, 2, 3, 5, 8, 13, 20], size=int(g.integers(2, 12)))]
    total = sum(lengths)
    capacity = (int(g.integers(max(2, total // 2), total)) if g.random() < 0.4 and total > 3
                else None)
    rb = vd.buffer(lengths, capacity=capacity, seed=seed)
    keys = list(g.permutation(["obs/image", "obs/state", "action", "reward"])[
        :int(g.integers(1, 4))])
    if g.random() < 0.2:
        keys = ["obs"] + [k for k in keys if not k.startswith("obs")]
    offsets = {}
    for k in keys:
        lo, hi = int(g.integers(-7, 3)), int(g.integers(-2, 9))
        pool = np.arange(min(lo, hi), max(lo, hi) + 1)
        keep = sorted(set(pool[g.random(len(pool)) < 0.6].tolist()) or {int(pool[0])})
        offsets[k] = keep
    episodes = ["id", "end", None][int(g.integers(0, 3))]
    kw = {"id": {}, "end": {"episode_end_key": "episode_end"},
          None: {"episode_id_key": None}}[episodes]
    kw.update(kwargs)
    view = WindowedBatch(rb, offsets, keep_other_keys=bool(g.random() < 0.7), **kw)
    return rb, view, episodes


@pytest.mark.parametrize("seed", range(40))
def test_random_windows_are_the_buffers_rows_and_uniEnvs_views_composed(seed):
    rb, view, episodes = _random_view(seed)
    n = len(rb)
    idx = torch.tensor(np.random.default_rng(seed).integers(-n, n, size=12))
    data, meta = view.get_at_with_metadata(idx)
    check_against_the_buffer(rb, view, idx, data, meta, episodes)
    if episodes is not None:
        helper = (vd.EPISODE_ID if episodes == "id" else vd.EPISODE_END)
        ref, ref_meta = uniEnv_reference(rb, view, idx, helper)
        for name in view.offsets:
            assert_identical(_view_part(data, name), ref[name], name)
            assert_identical(meta[f"{name}_is_pad"], ref_meta[f"{name}_is_pad"], name)


@pytest.mark.parametrize("seed", range(40))
def test_the_direct_gather_gives_the_views_own_batches(seed):
    """The workers' plan against the view's own ``get_at``: every sampling method, tasks of
    several batches, and the epoch getters on given indices, bit for bit; and the latter
    against the buffer."""
    rb, view, episodes = _random_view(seed)
    sampler = StepSampler(view, int(np.random.default_rng(seed).integers(1, 9)), seed=seed)
    gather.check(sampler)
    reference = copy.deepcopy(sampler)
    g = gather.Gatherer(sampler)
    for name in ("sample", "sample_with_metadata"):
        for _ in range(3):
            assert_identical(_direct(g, name, None), getattr(reference, name)(), name)
        assert_identical(_direct(g, name, 3),
                         tuple(getattr(reference, name)() for _ in range(3)), name)
    for name in ("sample_flat", "sample_flat_with_metadata"):
        assert g(name, None) is None      # (flattened batches: the generic path)
        getattr(reference, name)()
    order = torch.randperm(len(view), generator=torch.Generator().manual_seed(seed))
    for part in (order[:5], order[5:], order[-1:]):
        if len(part):
            assert_identical(_direct(g, "get_at", part.clone()), view.get_at(part.clone()))
            batch = _direct(g, "get_at_with_metadata", part.clone())
            assert_identical(batch, view.get_at_with_metadata(part.clone()))
            check_against_the_buffer(rb, view, part, *batch, episodes)


@pytest.mark.parametrize("episodes", ["id", "end", None])
def test_windows_reaching_far_beyond_the_data_cost_what_the_episodes_hold(episodes):
    """Offsets of a billion steps either way: both paths walk each step's episode only as
    far as it goes (in chunks, or step by step), never the whole reach."""
    rb = vd.buffer((5, 3, 1, 7, 40), capacity=50)
    kw = {"id": {}, "end": {"episode_end_key": "episode_end"},
          None: {"episode_id_key": None}}[episodes]
    view = WindowedBatch(rb, {"obs/state": [-10 ** 9, -1, 0, 3, 10 ** 9]}, **kw)
    idx = torch.arange(len(rb))
    data, meta = view.get_at_with_metadata(idx)
    check_against_the_buffer(rb, view, idx, data, meta, episodes)
    g = gather.Gatherer(StepSampler(view, 8))
    assert_identical(_direct(g, "get_at_with_metadata", idx), (data, meta))


def test_the_issues_request_is_gathered_directly_and_matches_uniEnv():
    """Image and state at [-1, 0], actions at 0..15, over episodes of 20 in a buffer
    that has wrapped around, with UniEnv's own helper telling the episodes."""
    rb = vd.buffer((20,) * 12, capacity=200)
    assert rb.offset != 0
    view = WindowedBatch(rb, ISSUE, get_valid_mask_function=vd.EPISODE_ID)
    sampler = StepSampler(view, 32, seed=5)
    assert gather.why_not(sampler) is None
    idx = torch.arange(len(rb))
    data, meta = view.get_at_with_metadata(idx)
    ref, ref_meta = uniEnv_reference(rb, view, idx, vd.EPISODE_ID)
    for name in ISSUE:
        assert_identical(_view_part(data, name), ref[name], name)
        assert_identical(meta[f"{name}_is_pad"], ref_meta[f"{name}_is_pad"], name)
    check_against_the_buffer(rb, view, idx, data, meta, "id")
    assert_identical(_direct(gather.Gatherer(sampler), "get_at_with_metadata", idx),
                     (data, meta))
    assert data["obs"]["image"].shape == (200, 2, *vd.IMG)
    assert data["action"].shape == (200, 16, 7)
    assert meta["action_is_pad"].shape == (200, 16)


# -- through the sampler: fork and spawn, epochs, a resume mid-epoch ------------------------

def _issue_view():
    return WindowedBatch(vd.buffer((9, 1, 14, 6, 2, 30), capacity=50), ISSUE,
                         episode_end_key="episode_end")


def _all_batches(view, direct, ctx, rounds=4):
    with MultiprocessingSampler(StepSampler(view, 7, seed=11), n_workers=2, n_buffers=3,
                                ctx=ctx, direct_gather=direct) as m:
        assert m.gather_path == ("direct" if direct is None else "generic"), (
            m.gather_path_reason)
        out = []
        for _ in range(rounds):
            out += [m.sample(), m.sample_with_metadata()]
        out += list(m.epoch_iter_with_metadata()) + list(m.epoch_iter())
        return [copy.deepcopy(b) for b in out]


def _anchor_steps(rb, batch):
    """The index each element of a batch was drawn at: its state history's last frame (at
    offset 0) is the step itself, which the buffer numbers."""
    _, steps, _, _ = _logical(rb)
    return [steps.index(int(x)) for x in batch["obs"]["state"][:, -1, 0]]


@pytest.mark.parametrize("ctx", ["fork", "spawn", "forkserver"])
def test_the_sampler_gives_the_buffers_rows_both_ways(ctx):
    view = _issue_view()
    rb = view.batch
    direct = _all_batches(view, None, ctx)
    generic = _all_batches(view, False, "fork")
    assert len(direct) == len(generic) == 8 + 2 * 8
    for i, (a, b) in enumerate(zip(direct, generic)):
        assert_identical(a, b, f"batch {i}")
        data, meta = a if isinstance(a, tuple) else (a, None)
        if meta is None:
            meta = view.get_at_with_metadata(torch.tensor(_anchor_steps(rb, data)))[1]
        check_against_the_buffer(rb, view, torch.tensor(_anchor_steps(rb, data)), data,
                                 meta, "end")
    # each epoch covers every step once
    epoch = [i for b in direct[8:16] for i in _anchor_steps(rb, b[0])]
    assert sorted(epoch) == list(range(len(rb)))


def test_a_state_taken_mid_epoch_resumes_with_the_same_batches():
    view = _issue_view()

    def sampler():
        return MultiprocessingSampler(StepSampler(view, 6, seed=3), n_workers=2,
                                      n_buffers=3, ctx="fork")

    with sampler() as m:
        [m.sample_with_metadata() for _ in range(3)]
        epoch = m.epoch_iter_with_metadata()
        first = [copy.deepcopy(next(epoch)) for _ in range(4)]
        state = m.state_dict()
        rest = [copy.deepcopy(b) for b in epoch]
        after = [copy.deepcopy(m.sample_with_metadata()) for _ in range(5)]
    with sampler() as m:
        m.load_state_dict(state)
        assert m.gather_path == "direct"
        got = [copy.deepcopy(b) for b in m.epoch_iter_with_metadata()]
        got_after = [copy.deepcopy(m.sample_with_metadata()) for _ in range(5)]
    assert len(got) == len(rest) and len(first) + len(rest) == -(-len(view) // 6)
    for a, b in zip(got + got_after, rest + after):
        assert_identical(a, b)
    steps = [i for b in first + rest for i in _anchor_steps(view.batch, b[0])]
    assert sorted(steps) == list(range(len(view)))
    for b in got:
        check_against_the_buffer(view.batch, view,
                                 torch.tensor(_anchor_steps(view.batch, b[0])), *b, "end")


def test_windows_of_a_buffer_the_parent_appends_to_while_workers_sample():
    """multiprocessing=True: the workers' windows see the steps the parent appends (the
    buffer grows, then wraps), each batch read on one snapshot of the ring: both paths
    give the same batches, and each is the buffer's as it was then."""
    chunks = [vd.steps(s, [3, 1, 6, 5]) for s in range(15, 150, 15)]

    def batches(direct):
        rb = vd.buffer((5, 1, 9), capacity=60, multiprocessing=True)
        view = WindowedBatch(rb, {"obs/state": [-2, 0], "action": [0, 1, 2, 3]})
        out = []
        with MultiprocessingSampler(StepSampler(view, 6, seed=0), n_workers=2, n_buffers=3,
                                    ctx="fork", direct_gather=direct) as m:
            for k, chunk in enumerate(chunks):
                rb.extend(chunk)
                m.manual_seed(k)
                for _ in range(3):
                    data, meta = copy.deepcopy(m.sample_with_metadata())
                    check_against_the_buffer(rb, view, torch.tensor(_anchor_steps(rb, data)),
                                             data, meta, "id")
                    out.append((data, meta))
            assert rb.offset != 0
        return out

    for a, b in zip(batches(None), batches(False)):
        assert_identical(a, b)


def test_windows_of_a_cleared_buffer_raise_what_the_view_raises():
    rb = vd.buffer((5, 5))
    view = WindowedBatch(rb, {"action": [0, 1]})
    g = gather.Gatherer(StepSampler(view, 4))
    assert isinstance(g("sample", None), SlotWriter)
    rb.clear()
    with pytest.raises(Exception) as direct:
        g("sample", None)
    with pytest.raises(Exception) as generic:
        StepSampler(view, 4).sample()
    assert type(direct.value) is type(generic.value)
    with pytest.raises(IndexError, match="out of range for a WindowedBatch of 0 steps"):
        view.get_at(torch.tensor([0]))
    assert view.get_at(torch.tensor([], dtype=torch.int64))["action"].shape == (0, 2, 7)


def test_one_sampler_pairs_what_two_paired_samplers_did_not():
    """The observation history and the action chunk of one element are of one step,
    whatever ``batches_per_task``: the pairing by seed that this view replaces drew
    different steps where the two samplers' defaults differed."""
    view = _issue_view()
    rb = view.batch
    with MultiprocessingSampler(StepSampler(view, 16, seed=0), n_workers=2) as m:
        for _ in range(20):
            data, meta = m.sample_with_metadata()
            t = torch.tensor(_anchor_steps(rb, data))
            check_against_the_buffer(rb, view, t, data, meta, "end")


def test_threads_reading_one_view_get_what_one_thread_gets():
    """The view keeps nothing between calls: eight threads reading it at once get the
    batches one thread gets."""
    import threading
    view = _issue_view()
    parts = [torch.randperm(len(view), generator=torch.Generator().manual_seed(i))[:20]
             for i in range(8)]
    expected = [view.get_at_with_metadata(p) for p in parts]
    got = [None] * 8
    start = threading.Barrier(8)

    def read(i):
        start.wait()
        for _ in range(5):
            got[i] = view.get_at_with_metadata(parts[i])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for a, b in zip(got, expected):
        assert_identical(a, b)


# -- time-based windows ------------------------------------------------------------------------

def test_delta_timestamps_are_offsets_in_frame_periods():
    rb = vd.buffer()
    by_time = WindowedBatch(rb, delta_timestamps={"obs/state": [-0.1, 0.0],
                                                  "action": [i / 10 for i in range(16)]},
                            fps=10)
    by_step = WindowedBatch(rb, {"obs/state": [-1, 0], "action": range(16)})
    assert by_time.offsets == by_step.offsets and by_time.fps == 10.0
    idx = torch.arange(len(rb))
    assert_identical(by_time.get_at_with_metadata(idx), by_step.get_at_with_metadata(idx))
    # (within LeRobot's tolerance of 1e-4 s: float times such as 0.30000000000000004)
    assert WindowedBatch(rb, delta_timestamps={"action": [0.1 * 3]}, fps=10).offsets == {
        "action": (3,)}


def test_fps_comes_from_the_batch_or_its_spaces():
    rb = vd.buffer()

    class WithFps(vd.SubItemBatch):
        fps = 20

    assert WindowedBatch(WithFps(rb, []), delta_timestamps={"action": [0, 0.05]}
                         ).offsets == {"action": (0, 1)}
    space = vd.space()
    meta_space = vd.DictSpace(vd.TB, {
        k: (s.with_metadata({"fps": 30}) if k == "action" else s)
        for k, s in space.spaces.items()})
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    rb30 = ReplayBuffer.create(DictStorage, meta_space,
                               {k: PytorchTensorStorage for k in vd.KEYS}, capacity=20,
                               is_memmap=False)
    rb30.extend(vd.steps(0, [20]))
    view = WindowedBatch(rb30, delta_timestamps={"action": [-1 / 30, 0, 2 / 30]})
    assert view.offsets == {"action": (-1, 0, 2)} and view.fps == 30.0


# -- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,words", [
    ({"offsets": {"obs/imag": [0]}}, ValueError, "'obs/imag' is not a key of the data"),
    ({"offsets": {"camera": [0]}}, ValueError, "whose keys are ['action'"),
    ({"offsets": {"action": [0, 2, 1]}}, ValueError, "must be sorted, and 2 comes before 1"),
    ({"offsets": {"action": [-1, 0, 0, 1]}}, ValueError, "offset 0 is repeated"),
    ({"offsets": {"action": []}}, ValueError, "no offsets"),
    ({"offsets": {}}, ValueError, "offsets is empty"),
    ({"offsets": {"action": [0, 0.5]}}, TypeError, "offsets are whole steps"),
    ({"offsets": {"action": [0, 1.0]}}, TypeError, "give delta_timestamps"),
    ({"offsets": {"action": [True]}}, TypeError, "offsets are whole steps"),
    ({"offsets": {"action": 3}}, TypeError, "a sequence of whole steps"),
    ({"offsets": {"action": [0, 2 ** 50]}}, ValueError, "beyond"),
    ({"offsets": {"obs": [0], "obs/image": [-1, 0]}}, ValueError, "overlap"),
    ({"offsets": {"action": [0]}, "delta_timestamps": {"action": [0.0]}}, ValueError,
     "either offsets"),
    ({}, ValueError, "either offsets"),
    ({"delta_timestamps": {"action": [0, 0.05]}, "fps": 10}, ValueError,
     "0.05 s is not a multiple of the frame period 1/10 s"),
    ({"delta_timestamps": {"action": [0, 0.1]}}, ValueError, "pass fps="),
    ({"delta_timestamps": {"action": [0, 0.1]}, "fps": 0}, ValueError, "positive"),
    ({"delta_timestamps": {"action": [0.2, 0.1]}, "fps": 10}, ValueError, "must be sorted"),
    ({"delta_timestamps": {"action": ["0.1"]}, "fps": 10}, TypeError, "seconds"),
    ({"offsets": {"action": [0]}, "episode_id_key": "episode"}, ValueError,
     "episode_id_key 'episode' is not a key of the data"),
    ({"offsets": {"action": [0]}, "episode_id_key": "obs/state"}, ValueError,
     "one value per step"),
    ({"offsets": {"action": [0]}, "episode_id_key": "ep", "episode_end_key": "episode_end"},
     ValueError, "one way"),
    ({"offsets": {"action": [0]}, "get_valid_mask_function": lambda *a: None}, ValueError,
     "one of UniEnv's helpers"),
    ({"offsets": {"action": [0]}, "get_valid_mask_function":
      SliceStackedBatch.get_valid_mask_function_with_episodeid_key("episode_id", True)},
     ValueError, "read from metadata"),
    ({"offsets": {"action": [0]}, "keep_other_keys": 1}, TypeError, "True or False"),
    ({"offsets": {("obs", 3): [0]}}, TypeError, "a tuple of strings"),
    ({"offsets": {"obs//image": [0]}}, ValueError, "empty part"),
])
def test_bad_input_gets_a_clear_error_at_construction(kwargs, error, words):
    with pytest.raises(error) as e:
        WindowedBatch(vd.buffer(), **kwargs)
    assert words in str(e.value), str(e.value)


def test_data_without_episode_ids_says_how_to_tell_episodes():
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    space = vd.DictSpace(vd.TB, {"action": vd.space()["action"]})
    rb = ReplayBuffer.create(DictStorage, space, {"action": PytorchTensorStorage},
                             capacity=10, is_memmap=False)
    rb.extend({"action": torch.rand(10, 7)})
    with pytest.raises(ValueError, match="episode_id_key=None for data that is one episode"):
        WindowedBatch(rb, {"action": range(4)})
    view = WindowedBatch(rb, {"action": range(4)}, episode_id_key=None)
    data, meta = view.get_at_with_metadata(torch.tensor([0, 8]))
    assert meta["action_is_pad"].int().tolist() == [[0, 0, 0, 0], [0, 0, 1, 1]]
    assert torch.equal(data["action"][1], rb.get_at(torch.tensor([8, 9, 9, 9]))["action"])
    with pytest.raises(TypeError, match="dict elements"):
        WindowedBatch(rb.get_column(["action"]), {"action": [0]})
    with pytest.raises(TypeError, match="UniEnv batch"):
        WindowedBatch({"action": torch.zeros(3)}, {"action": [0]})


def test_the_view_is_read_only_and_refuses_bad_indices():
    rb = vd.buffer()
    view = WindowedBatch(rb, {"action": [0, 1]})
    for call in (lambda: view.set_at(0, {}), lambda: view.extend({}),
                 lambda: view.remove_at(0), lambda: view.extend_flattened(torch.zeros(1)),
                 lambda: view.set_flattened_at(0, torch.zeros(1))):
        with pytest.raises(TypeError, match="read-only"):
            call()
    with pytest.raises(IndexError, match="out of range"):
        view.get_at(torch.tensor([0, len(rb)]))
    with pytest.raises(IndexError, match="out of range"):
        view.get_at(torch.tensor([-len(rb) - 1]))
    with pytest.raises(IndexError, match="integers"):
        view.get_at(torch.tensor([0.0]))
    with pytest.raises(IndexError, match="boolean mask of 3"):
        view.get_at(torch.tensor([True, False, True]))
    mask = torch.zeros(len(rb), dtype=torch.bool)
    mask[[2, 7]] = True
    assert_identical(view.get_at(mask), view.get_at(torch.tensor([2, 7])))
    assert_identical(view.get_at(slice(3, 6)), view.get_at(torch.arange(3, 6)))
    one, one_meta = view.get_at_with_metadata(-1)
    assert one["action"].shape == (2, 7) and one_meta["action_is_pad"].tolist() == [False, True]
    assert view.get_flattened_at(torch.arange(3)).shape[0] == 3


def test_the_direct_path_says_why_it_does_not_take_a_view():
    """Windows over a combined dataset, or with float episode ids: the generic path,
    saying why; their batches are still the buffer's."""
    combined = WindowedBatch(CombinedBatch([vd.buffer(), vd.buffer(start=1000)]),
                             {"action": [0, 1]}, keep_other_keys=False)
    rb = vd.buffer((4, 6, 3))
    rb.storage.storage_map["episode_id"].data = rb.storage.storage_map[
        "episode_id"].data.to(torch.float32)
    floats = WindowedBatch(rb, {"action": [-1, 0, 1]})
    for view, words in ((combined, "WindowedBatch > its data is a CombinedBatch"),
                        (floats, "WindowedBatch > its episode column 'episode_id' is "
                                 "torch.float32")):
        assert gather.why_not(StepSampler(view, 4)).startswith(words)
        with MultiprocessingSampler(StepSampler(view, 4, seed=1), n_workers=1) as m:
            assert m.gather_path == "generic" and m.gather_path_reason.startswith(words)
            m.sample_with_metadata()
    idx = torch.arange(len(rb))
    check_against_the_buffer(rb, floats, idx, *floats.get_at_with_metadata(idx), "id")


def test_an_index_outside_the_data_raises_the_views_error_on_the_direct_path():
    view = WindowedBatch(vd.buffer(), {"action": [0, 1]})
    g = gather.Gatherer(StepSampler(view, 4))
    assert isinstance(g("get_at", torch.tensor([0, len(view) - 1])), SlotWriter)
    with pytest.raises(IndexError, match="out of range"):
        g("get_at", torch.tensor([0, len(view)]))


# -- the span loops --------------------------------------------------------------------------

def test_the_span_loops_refuse_what_does_not_fit():
    z = np.zeros(2, np.int64)
    key = np.zeros(1, np.int64).view(np.uint8)   # (one row)
    i64 = _rows.KEY_TYPES["int64"]
    with pytest.raises(IndexError, match="index 5 is out of range for 5 steps"):
        _rows.episode_span(np.array([1, 5]), 1, 1, 5, 0, key, i64, 0, z, z.copy(), z.copy())
    with pytest.raises(IndexError, match="not in the episode column's 1 rows"):
        _rows.episode_span(np.array([1, 0]), 1, 1, 5, 0, key, i64, _rows.EPISODE_ID, z,
                           z.copy(), z.copy())
    with pytest.raises(ValueError, match="not 2"):
        _rows.episode_span(np.array([1, 0]), 1, 1, 5, 0, key, i64, 0, z[:1], z, z)
    with pytest.raises(ValueError, match="unknown episode kind"):
        _rows.episode_span(np.array([1, 0]), 1, 1, 5, 0, key, i64, 9, z, z.copy(), z.copy())
    with pytest.raises(ValueError, match="a reach of"):
        _rows.episode_span(np.array([1, 0]), -1, 1, 5, 0, key, i64, 0, z, z.copy(), z.copy())
    t, lo, hi = np.array([2, 2]), np.array([1, 3]), np.array([3, 3])
    with pytest.raises(ValueError, match=r"span \[3, 3\]"):
        _rows.span_rows(t, lo, hi, np.array([0]), 5, 0, np.zeros(2, np.int64))
    lo = np.array([1, 1])
    with pytest.raises(ValueError, match="not 2 x 2"):
        _rows.span_rows(t, lo, hi, np.array([0, 1]), 5, 0, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="offset 4611686018427387904"):
        _rows.span_rows(t, lo, hi, np.array([2 ** 62]), 5, 0, np.zeros(2, np.int64))


def test_the_span_loops_walk_the_ring_in_storage_order():
    """A buffer of 6 steps at offset 4 (storage rows 4, 5, 0, 1, 2, 3 in logical order)
    with episodes [0 0 1 1 1 2] in logical order."""
    ids = np.array([1, 1, 1, 2, 0, 0], np.int64)   # storage order
    t, lo, hi = (np.zeros(4, np.int64) for _ in range(3))
    _rows.episode_span(np.array([0, 2, 4, -1]), 5, 5, 6, 4, ids.view(np.uint8),
                       _rows.KEY_TYPES["int64"], _rows.EPISODE_ID, t, lo, hi)
    assert (t.tolist(), lo.tolist(), hi.tolist()) == ([0, 2, 4, 5], [0, 2, 2, 5],
                                                      [1, 4, 4, 5])
    rows = np.zeros(12, np.int64)
    pad = np.zeros(12, np.uint8)
    _rows.span_rows(t, lo, hi, np.array([-1, 0, 2]), 6, 4, rows, pad)
    assert rows.reshape(4, 3).tolist() == [[4, 4, 5], [0, 0, 2], [1, 2, 2], [3, 3, 3]]
    assert pad.reshape(4, 3).tolist() == [[1, 0, 1], [1, 0, 0], [0, 0, 1], [1, 0, 1]]
    ends = np.array([0, 0, 1, 1, 0, 1], np.uint8)   # (the same episodes, by end flags)
    _rows.episode_span(np.array([0, 2, 4, -1]), 5, 5, 6, 4, ends, _rows.KEY_TYPES["uint8"],
                       _rows.EPISODE_END, t, lo, hi)
    assert (t.tolist(), lo.tolist(), hi.tolist()) == ([0, 2, 4, 5], [0, 2, 2, 5],
                                                      [1, 4, 4, 5])
    # within a reach of 1 step back and none forward
    _rows.episode_span(np.array([0, 2, 4, -1]), 1, 0, 6, 4, ends, _rows.KEY_TYPES["uint8"],
                       _rows.EPISODE_END, t, lo, hi)
    assert (lo.tolist(), hi.tolist()) == ([0, 2, 3, 5], [0, 2, 4, 5])
