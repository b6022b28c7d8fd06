"""Direct gather of UniEnv's views (frame stacks, action chunks, columns, combined
datasets): the same batches as UniEnv's own methods, bit for bit."""
import copy

import numpy as np
import pytest
import torch
from unienv_data.batches.combined_batch import CombinedBatch
from unienv_data.batches.framestack_batch import FrameStackedBatch
from unienv_data.batches.slicestack_batch import SliceStackedBatch
from unienv_data.batches.subitem_batch import SubItemBatch

from unienv_mp import MultiprocessingSampler
from unienv_mp._transport import codec as _codec
from unienv_mp._direct import rows as _rows, views as _views, gather
from unienv_mp._transport.protocol import SlotWriter

import _views_data as vd
from test_gather import assert_identical, getters_refused

# -- the window's loops against UniEnv's tensor code ------------------------------------------


def _uniEnv_window(n_data, offsets, idx, mask_kind, key, fill):
    """What a SliceStackedBatch over ``n_data`` rows computes for ``idx``: its expanded
    indices, valid mask (from the episode column ``key`` at the expanded rows) and filled
    indices, by UniEnv's own methods."""
    view = _stub(n_data, offsets)
    expanded = SliceStackedBatch.expand_index(view, idx)
    if mask_kind is None:
        mask = torch.ones_like(expanded, dtype=torch.bool)
    else:
        fn = vd.EPISODE_ID if mask_kind == _rows.EPISODE_ID else vd.EPISODE_END
        name = "episode_id" if mask_kind == _rows.EPISODE_ID else "episode_end"
        mask = fn(view, expanded, {name: key[expanded]}, None)
    filled = view.fill_data_with_stack_mask(None, expanded.clone(), mask) if fill else None
    return expanded, mask, filled


@pytest.mark.parametrize("seed", range(40))
def test_the_window_loops_compute_what_uniEnv_computes(seed):
    g = np.random.default_rng(seed)
    n = int(g.integers(0, 30)) if seed else 0
    offsets = torch.tensor(sorted(set(g.integers(-6, 7, size=int(g.integers(1, 8))).tolist())
                                  | {0}), dtype=torch.int64)
    t, z = len(offsets), int(torch.nonzero(offsets == 0)[0])
    idx = torch.tensor(g.integers(-max(n, 1), max(n, 1), size=int(g.integers(0, 20))),
                       dtype=torch.int64)
    out = torch.empty(len(idx) * t, dtype=torch.int64)
    _rows.window(idx.numpy(), offsets.numpy(), n, out.numpy())
    expanded = (SliceStackedBatch.expand_index(_stub(n, offsets), idx) if len(idx)
                else torch.empty((0, t), dtype=torch.int64))
    assert torch.equal(out.view(-1, t), expanded)
    if n == 0 or not len(idx):
        return
    ids = torch.tensor(np.sort(g.integers(0, 6, size=n)), dtype=torch.int64)
    ends = torch.tensor(g.random(n) < 0.3)
    for kind, key in ((_rows.EPISODE_ID, ids), (_rows.EPISODE_END, ends)):
        for fill in (True, False):
            exp, mask, filled = _uniEnv_window(n, offsets, idx, kind, key, fill)
            ours = torch.empty(exp.numel(), dtype=torch.bool)
            values = key[exp].reshape(-1).to(torch.int32 if kind == _rows.EPISODE_END
                                              else torch.int64).to(torch.int64)
            invalid = _rows.window_mask(values.numpy(), t, z, kind,
                                        ours.view(torch.uint8).numpy())
            assert torch.equal(ours.view(exp.shape), mask)
            assert invalid == int((~mask).sum())
            if fill:
                rows = exp.clone().reshape(-1)
                _rows.window_fill(rows.numpy(), mask.reshape(-1).view(torch.uint8).numpy(),
                                  t, z)
                assert torch.equal(rows.view(exp.shape), filled)


def test_the_fill_follows_uniEnv_also_for_masks_with_holes():
    """UniEnv fills an invalid frame from a count of valid frames, not from the nearest
    valid one: a mask with a hole gives what UniEnv gives."""
    offsets = torch.arange(-3, 4)
    mask = torch.tensor([[True, False, True, True, False, True, False]])
    rows = torch.arange(10, 17)
    expected = _stub(20, offsets).fill_data_with_stack_mask(None, rows.clone().view(1, -1),
                                                             mask)
    _rows.window_fill(rows.numpy(), mask.view(-1).view(torch.uint8).numpy(), 7, 3)
    assert torch.equal(rows.view(1, -1), expected)


def test_the_window_loops_refuse_what_does_not_fit():
    key = np.zeros(6, dtype=np.int64)
    mask = np.zeros(6, dtype=np.uint8)
    with pytest.raises(ValueError, match="not rows of 4"):
        _rows.window_mask(key, 4, 0, _rows.EPISODE_ID, mask)
    with pytest.raises(ValueError, match="anchor 3"):
        _rows.window_fill(key, mask, 3, 3)
    with pytest.raises(ValueError, match="mask kind"):
        _rows.window_mask(key, 3, 0, 7, mask)
    with pytest.raises(ValueError, match="not 2 x 2"):
        _rows.window(np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64), 5,
                     np.zeros(3, dtype=np.int64))
    with pytest.raises(IndexError):
        _rows.scatter_rows(np.zeros((4, 8), np.uint8), 8, np.array([1, 4]),
                           np.array([0, 1]), bytearray(16), 0, 2)
    with pytest.raises(IndexError):
        _rows.scatter_rows(np.zeros((4, 8), np.uint8), 8, np.array([1, 2]),
                           np.array([0, 2]), bytearray(16), 0, 2)
    out = bytearray(24)
    _rows.scatter_rows(np.arange(32, dtype=np.uint8).reshape(4, 8), 8, np.array([3, 1]),
                       np.array([2, 0]), out, 0, 3)
    assert bytes(out[:8]) == bytes(range(8, 16)) and bytes(out[16:]) == bytes(range(24, 32))
    assert bytes(out[8:16]) == bytes(8)


def _stub(n, offsets):
    from unienv_interface.backends.pytorch import PyTorchComputeBackend as TB
    view = SliceStackedBatch.__new__(SliceStackedBatch)
    view.fixed_offset = offsets
    view._idx_zero = int(torch.nonzero(offsets == 0)[0])
    view.batch = type("B", (), {"__len__": lambda self: n, "backend": TB, "device": None})()
    return view


# -- in one process: the plan against UniEnv, over many random views -----------------------

def _direct(gatherer, name, arg):
    """What a worker's direct path puts in its slot for the task, decoded."""
    writer = gatherer(name, arg)
    assert isinstance(writer, SlotWriter), f"{name}: not gathered directly"
    buf = bytearray(writer.nbytes)
    writer.write_into(buf, {})
    return _codec.decode(buf, copy=True)


@pytest.mark.parametrize("seed", range(60))
def test_random_views_are_gathered_as_uniEnv_gives_them(seed):
    view = vd.random_view(seed)
    sampler = vd.sampler_of(view, batch_size=int(np.random.default_rng(seed).integers(1, 9)),
                            seed=seed)
    gather.check(sampler)
    reference = copy.deepcopy(sampler)
    g = gather.Gatherer(sampler)
    for name in ("sample", "sample_with_metadata"):
        for _ in range(3):
            assert_identical(_direct(g, name, None), getattr(reference, name)(), name)
        assert_identical(_direct(g, name, 3),
                         tuple(getattr(reference, name)() for _ in range(3)), name)
    for name in ("sample_flat", "sample_flat_with_metadata"):
        # gathered directly for a column stack or a field view of one array, else generic
        if g.structure(gather.DIRECT_METHODS[name]) is None:
            assert g(name, None) is None
            getattr(reference, name)()
            continue
        assert_identical(_direct(g, name, None), getattr(reference, name)(), name)
    order = torch.randperm(len(view), generator=torch.Generator().manual_seed(seed))
    for getter in ("get_at", "get_at_with_metadata", "get_flattened_at",
                   "get_flattened_at_with_metadata"):
        if g.structure(getter) is None:
            continue
        for part in (order[:5], order[5:], order[-1:]):   # the epoch's partial last batch
            if len(part):
                assert_identical(_direct(g, getter, part.clone()),
                                 getattr(view, getter)(part.clone()), getter)


def test_the_issue_views_are_planned_directly():
    rb = vd.buffer()
    views = {
        "frame stack": vd.frame_stack(rb, 1),
        "its image column": vd.frame_stack(rb, 1).get_column(["obs", "image"]),
        "action chunk": vd.action_chunk(rb),
        "state history": vd.state_history(rb),
        "combined stacks": vd.combined_stacks(vd.buffer(), vd.buffer(start=1000)),
    }
    for name, view in views.items():
        sampler = vd.sampler_of(view, 16, seed=3)
        gather.check(sampler)
        reference = copy.deepcopy(sampler)
        g = gather.Gatherer(sampler)
        for method in ("sample", "sample_with_metadata"):
            assert_identical(_direct(g, method, None), getattr(reference, method)(),
                             f"{name}: {method}")


@pytest.mark.parametrize("mask", [vd.EPISODE_ID, vd.EPISODE_END], ids=["ids", "ends"])
def test_windows_of_one_step_episodes_and_an_episode_across_the_wrap(mask):
    """Episodes of one step: every frame of a window but the anchor is invalid.  And a
    buffer that has wrapped around with an episode (of 9) across the wrap."""
    one_step = vd.buffer((1,) * 30)
    wrapped = vd.buffer((5, 9, 7, 6, 9, 4), capacity=33)   # 40 steps into 33 rows
    assert wrapped.offset != 0
    for rb in (one_step, wrapped):
        for view in (vd.frame_stack(rb, 3, 2, mask=mask),
                     SliceStackedBatch(rb, torch.tensor([-4, -1, 0, 2, 5]),
                                       get_valid_mask_function=mask),
                     vd.frame_stack(rb, 3, 2, mask=mask, fill_invalid_data=False,
                                    stack_metadata=True)):
            sampler = vd.sampler_of(view, 12, seed=2)
            reference = copy.deepcopy(sampler)
            g = gather.Gatherer(sampler)
            for _ in range(4):
                batch = _direct(g, "sample_with_metadata", None)
                assert_identical(batch, reference.sample_with_metadata())
            if rb is one_step:   # only the anchor is valid (or frames clipped onto it)
                valid = batch[1]["slice_valid_mask"]
                anchor = int(torch.nonzero(view.fixed_offset == 0)[0])
                assert valid[:, anchor].all() and bool((valid.sum(1) == 1).any())
    everything = torch.arange(len(wrapped))
    view = vd.frame_stack(wrapped, 3, 2, mask=mask)
    assert_identical(_direct(gather.Gatherer(vd.sampler_of(view)), "get_at", everything),
                     view.get_at(everything))


def _typed_episodes(id_dtype, end_dtype, capacity):
    """A wrapped buffer whose episode columns are of the given dtypes; episode ends are
    multiples of 2**32 (or of 2) where they can be, so that UniEnv's conversion to its
    default integer type (int32) truncates them."""
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    from unienv_interface.backends.pytorch import PyTorchComputeBackend as TB
    from unienv_interface.space import BoxSpace, DictSpace
    box = lambda dt, lo, hi: BoxSpace(TB, lo, hi, dt, shape=())  # noqa: E731
    big = (1 if end_dtype == torch.bool else torch.finfo(end_dtype).max
           if end_dtype.is_floating_point else torch.iinfo(end_dtype).max)
    space = DictSpace(TB, {"action": BoxSpace(TB, -1.0, 1.0, torch.float32, shape=(3,)),
                           "episode_id": box(id_dtype, 0, 100),
                           "episode_end": (BoxSpace(TB, 0, big, end_dtype, shape=())
                                           if end_dtype != torch.bool else
                                           vd.space()["episode_end"])})
    rb = ReplayBuffer.create(DictStorage, space, {k: PytorchTensorStorage for k in space.spaces},
                             capacity=capacity, is_memmap=False)
    g = torch.Generator().manual_seed(3)
    n = capacity + 11
    ids = torch.cumsum((torch.rand(n, generator=g) < 0.2).to(torch.int64), 0)
    ends = torch.zeros(n, dtype=torch.int64)
    ends[:-1] = (ids[1:] != ids[:-1]).to(torch.int64)
    if end_dtype == torch.int64:
        ends = ends * (2 ** 32) + (torch.rand(n, generator=g) < 0.1).to(torch.int64) * 2 ** 33
    data = {"action": torch.rand(n, 3, generator=g), "episode_id": ids.to(id_dtype),
            "episode_end": ends.to(end_dtype)}
    rb.extend({k: v[:capacity] for k, v in data.items()})
    rb.extend({k: v[capacity:] for k, v in data.items()})
    return rb


@pytest.mark.parametrize("id_dtype,end_dtype", [
    (torch.int32, torch.int64), (torch.int16, torch.int32), (torch.uint8, torch.uint8),
    (torch.int8, torch.bool), (torch.float32, torch.float64)])
def test_episode_columns_of_every_type_mask_as_uniEnv_masks(id_dtype, end_dtype):
    """The window's one-call path reads episode ids of any integer type, and episode
    ends converted as UniEnv converts them (int64 ends truncated to int32); float ids
    take UniEnv's own mask function."""
    rb = _typed_episodes(id_dtype, end_dtype, 40)
    assert rb.offset != 0
    for mask in (SliceStackedBatch.get_valid_mask_function_with_episodeid_key("episode_id"),
                 SliceStackedBatch.get_valid_mask_function_with_episode_end_key(
                     "episode_end")):
        for view in (SliceStackedBatch(rb, torch.arange(-3, 6), get_valid_mask_function=mask),
                     SliceStackedBatch(rb, torch.arange(-3, 6), get_valid_mask_function=mask
                                       ).get_column(["action"])):
            sampler = vd.sampler_of(view, 16, seed=1)
            reference = copy.deepcopy(sampler)
            g = gather.Gatherer(sampler)
            for _ in range(5):
                assert_identical(_direct(g, "sample_with_metadata", None),
                                 reference.sample_with_metadata())


def test_a_window_of_a_million_offsets():
    """(The one-call path keeps nothing per frame on its stack.)"""
    t = 1_200_000
    offsets = torch.arange(-t + 1, 1)
    key = torch.zeros(50, dtype=torch.int64)
    key[30:] = 1
    rows = torch.empty(2 * t, dtype=torch.int64)
    mask = torch.empty(2 * t, dtype=torch.uint8)
    invalid = _rows.window_rows(torch.tensor([10, 40]).numpy(), offsets.numpy(), t - 1, 50, 0,
                                key.view(torch.uint8).numpy(), _rows.KEY_TYPES["int64"],
                                _rows.EPISODE_ID, 64, True, rows.numpy(), mask.numpy())
    # window 10: every frame clipped into row 0..10, ids 0: all valid; window 40: rows
    # 0..29 of episode 0 are invalid, filled with the first valid row, 30
    assert invalid == t - 11
    assert int(mask[:t].sum()) == t and int(mask[t:].sum()) == 11
    assert int(rows[t:2 * t - 11].min()) == int(rows[t:2 * t - 11].max()) == 30


def test_a_view_uniEnv_cannot_give_element_0_of_still_samples_directly():
    """The construction's layout check asks UniEnv for element 0; where UniEnv cannot
    give it, the workers decide from the batches UniEnv gives, and a batch it cannot give
    raises UniEnv's error."""
    from unienv_data.batches.subindex_batch import SubIndexedBatch
    rb = vd.buffer((5, 3, 1, 7, 2), capacity=9)
    view = vd.frame_stack(SubIndexedBatch(rb, torch.tensor([100] + list(range(9)))), 1, 1)
    with MultiprocessingSampler(vd.sampler_of(view, 4, seed=0), n_workers=1) as m:
        assert m.gather_path == "direct"
        with pytest.raises(Exception, match="out of bounds"):
            for _ in range(50):
                m.sample()
    g = gather.Gatherer(vd.sampler_of(view))
    assert isinstance(g("get_at", torch.tensor([3, 5, 9])), SlotWriter)


def test_a_view_whose_indices_leave_the_data_raises_uniEnvs_error():
    """Indices outside the data are UniEnv's to refuse: the generic getter runs them."""
    view = CombinedBatch([vd.buffer(), vd.buffer(start=1000)])
    g = gather.Gatherer(vd.sampler_of(view))
    with pytest.raises(AssertionError, match="out of bounds"):
        g("get_at", torch.tensor([0, len(view)]))
    ok = g("get_at", torch.tensor([0, len(view) - 1]))
    assert isinstance(ok, SlotWriter)


# -- what takes the generic path, and why -----------------------------------------------------

def _custom_mask(batch, expanded_idx, data, metadata):
    return torch.ones_like(expanded_idx, dtype=torch.bool)


def _reasons():
    rb = vd.buffer()
    in_meta = SliceStackedBatch.get_valid_mask_function_with_episodeid_key(
        "episode_id", is_in_metadata=True)
    return [
        (FrameStackedBatch(rb, 1, get_valid_mask_function=_custom_mask),
         "FrameStackedBatch > a custom valid mask function"),
        (FrameStackedBatch(CombinedBatch([rb, vd.buffer(start=500)]), 1,
                           get_valid_mask_function=in_meta),
         "FrameStackedBatch > a valid mask read from metadata"),
        (CombinedBatch([vd.frame_stack(rb), FrameStackedBatch(
            vd.buffer(start=500), 1, get_valid_mask_function=_custom_mask)]),
         "CombinedBatch > part 1: FrameStackedBatch > a custom valid mask function"),
        (SubItemBatch(FrameStackedBatch(_Unknown(rb), 1), ["obs"]),
         "SubItemBatch > FrameStackedBatch > test_views._Unknown is not a batch"),
    ]


class _Unknown(SubItemBatch):
    """A batch of a type the direct path does not know."""

    def __init__(self, rb):
        super().__init__(rb, [])


@pytest.mark.parametrize("case", range(4))
def test_what_the_direct_path_cannot_reproduce_takes_the_generic_path_and_says_where(case):
    view, words = _reasons()[case]
    sampler = vd.sampler_of(view)
    with pytest.raises(gather.NotDirect) as e:
        gather.check(sampler)
    assert str(e.value).startswith(words), str(e.value)
    m = MultiprocessingSampler(sampler, n_workers=1)
    try:
        assert m.gather_path == "generic" and m.gather_path_reason.startswith(words)
    finally:
        m.close()


def test_flattened_batches_of_a_column_stack_are_gathered_other_views_generic():
    """A column stack flattens its own batch of one array (a reshape): gathered directly,
    for the action chunks a policy flattens; a frame stack's flat rows are its buffer's,
    flattened per frame and promoted: generic."""
    sampler = vd.sampler_of(vd.frame_stack(vd.buffer()), seed=1)
    assert gather.Gatherer(sampler)("sample_flat", None) is None
    assert gather.Gatherer(sampler)("get_flattened_at", torch.arange(3)) is None
    for view in (vd.action_chunk(vd.buffer((3, 1, 20, 6))),
                 SubItemBatch(vd.frame_stack(vd.buffer()), ["obs", "image"])):
        sampler = vd.sampler_of(view, 8, seed=1)
        reference = copy.deepcopy(sampler)
        g = gather.Gatherer(sampler)
        for name in ("sample_flat", "sample_flat_with_metadata"):
            batch = _direct(g, name, 2)
            assert_identical(batch, tuple(getattr(reference, name)() for _ in range(2)))
    assert batch[0][0].shape == (8, 2 * 3 * 4 * 4)


# -- through the sampler: workers, start methods, epochs, a growing buffer --------------------

def view_getters_refused(active=True):
    """StepSampler's get_at and get_at_with_metadata raise while this lasts: the getters a
    view's direct path replaces for every view (its flattened getters only for some)."""
    return getters_refused(active, _views.GETTERS)


def _through_sampler(make_view, direct, ctx="fork", batches_per_task=None, rounds=3):
    refuse = direct is None and ctx == "fork"
    with view_getters_refused(refuse), MultiprocessingSampler(
            vd.sampler_of(make_view(), 7, seed=11), n_workers=2, n_buffers=3, ctx=ctx,
            direct_gather=direct, batches_per_task=batches_per_task) as m:
        assert m.gather_path == ("direct" if direct is None else "generic"), (
            m.gather_path_reason)
        out = []
        for _ in range(rounds):
            out += [m.sample(), m.sample_with_metadata(), m.sample_flat()]
        out += list(m.epoch_iter()) + list(m.epoch_iter_with_metadata())
        return out


def _issue_combined():
    return vd.combined_stacks(vd.buffer((7, 1, 12, 3)), vd.buffer((5, 5, 1), start=100))


def _wrapped_chunk():
    return vd.action_chunk(vd.buffer((9, 1, 14, 6, 2), capacity=25), horizon=5)


@pytest.mark.parametrize("make_view,ctx", [
    (_issue_combined, "fork"), (_wrapped_chunk, "fork"), (_issue_combined, "spawn"),
    (_issue_combined, "forkserver")],
    ids=["combined-fork", "wrapped_chunk-fork", "combined-spawn", "combined-forkserver"])
def test_the_sampler_gives_the_same_batches_both_ways(make_view, ctx):
    """Every start method (with a combined dataset of frame stacks: its plan is made in
    the worker, from the sampler it received); epochs of 7 over 31 or 25 rows end with a
    partial batch."""
    direct = _through_sampler(make_view, None, ctx)
    generic = _through_sampler(make_view, False, ctx)
    assert len(direct) == len(generic)
    for i, (a, b) in enumerate(zip(direct, generic)):
        assert_identical(a, b, f"batch {i}")


@pytest.mark.parametrize("batches_per_task", [1, 4])
def test_views_are_grouped_by_the_same_rule_on_both_paths(batches_per_task):
    make = lambda: vd.state_history(vd.buffer((4, 1, 9, 30)))  # noqa: E731
    for a, b in zip(_through_sampler(make, None, batches_per_task=batches_per_task, rounds=5),
                    _through_sampler(make, False, batches_per_task=batches_per_task,
                                     rounds=5)):
        assert_identical(a, b)
    sampler = vd.sampler_of(make(), 7)
    assert gather.row_nbytes(sampler, "sample") == 16 * 10 * 4
    assert gather.row_nbytes(sampler, "sample_with_metadata") == 16 * 10 * 4 + 16


def test_a_view_of_a_buffer_the_parent_appends_to_while_workers_sample():
    """multiprocessing=True: the workers' stacks see the rows the parent appends, and the
    batches are UniEnv's for the buffer as it is (the buffer grows, then wraps)."""
    chunks = [vd.steps(s, [3, 1, 6, 5]) for s in range(15, 150, 15)]

    def batches(direct):
        rb = vd.buffer((5, 1, 9), capacity=60, multiprocessing=True)
        view = vd.frame_stack(rb, 2, 1)
        out = []
        with view_getters_refused(direct is None), MultiprocessingSampler(
                vd.sampler_of(view, 6, seed=0), n_workers=2, n_buffers=3, ctx="fork",
                direct_gather=direct) as m:
            for k, chunk in enumerate(chunks):
                rb.extend(chunk)
                m.manual_seed(k)
                out += [m.sample_with_metadata() for _ in range(3)]
                out.append(list(m.epoch_iter()))
            assert rb.offset != 0
        return out

    for a, b in zip(batches(None), batches(False)):
        assert_identical(a, b)


def test_worker_memory_stays_flat_over_many_view_batches():
    """No per-batch allocation that lasts: a worker's RSS after 10,000 more batches (of
    a combined dataset of frame stacks, with their metadata) is what it was after the
    first 500 (within a few pages of allocator noise)."""
    import psutil
    view = vd.combined_stacks(vd.buffer((50,) * 20, img=(3, 16, 16)),
                              vd.buffer((7,) * 40, img=(3, 16, 16), start=5000))
    with MultiprocessingSampler(vd.sampler_of(view, 16, seed=0), n_workers=1,
                                ctx="fork", batches_per_task=1) as m:
        for _ in range(500):
            m.sample_with_metadata()
        pid = m.stats().workers[0].pid
        before = psutil.Process(pid).memory_info().rss
        for _ in range(10_000):
            m.sample_with_metadata()
        after = psutil.Process(pid).memory_info().rss
    assert after - before < 4 << 20, (before, after)


def test_a_view_of_an_empty_or_cleared_buffer_raises_what_uniEnv_raises():
    rb = vd.buffer((5, 5))
    sampler = vd.sampler_of(vd.frame_stack(rb), 4)
    g = gather.Gatherer(sampler)
    assert isinstance(g("sample", None), SlotWriter)   # planned while the buffer had rows
    rb.clear()
    with pytest.raises(Exception) as direct:
        g("sample", None)
    with pytest.raises(Exception) as generic:
        copy.deepcopy(sampler).sample()
    assert type(direct.value) is type(generic.value)
