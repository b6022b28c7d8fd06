"""Direct gather: workers gather rows straight into the slot.  The contract is that it
returns exactly what the generic path (the wrapped sampler's own methods) returns."""
import contextlib

import numpy as np
import pytest
import torch
from unienv_data.batches.backend_compat import ToBackendOrDeviceBatch
from unienv_data.replay_buffer import ReplayBuffer
from unienv_data.samplers import StepSampler
from unienv_data.storages.dict_storage import DictStorage
from unienv_data.storages.flattened import FlattenedStorage
from unienv_data.storages.pytorch import PytorchTensorStorage
from unienv_interface.backends.numpy import NumpyComputeBackend
from unienv_interface.backends.pytorch import PyTorchComputeBackend as TB
from unienv_interface.space import BinarySpace, BoxSpace, DictSpace

from unienv_mp import MultiprocessingSampler, WorkerError
from unienv_mp._direct import gather

import _data
from conftest import in_shared_memory
from _data import indices_of, replay_buffer

SAMPLE_METHODS = ("sample", "sample_flat", "sample_with_metadata",
                  "sample_flat_with_metadata", "sample_index")
GETTERS = ("get_at", "get_at_with_metadata", "get_flattened_at",
           "get_flattened_at_with_metadata")
EPOCH_METHODS = ("epoch_iter", "epoch_iter_with_metadata", "epoch_flat_iter",
                 "epoch_flat_iter_with_metadata")


def assert_identical(a, b, where="batch"):
    """Same structure, key order, container and array types, dtypes, shapes and bytes."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
        # (a copy: a contiguous tensor may keep any stride on a dimension of size 1)
        x, y = (t.clone(memory_format=torch.contiguous_format).reshape(-1) for t in (a, b))
        if x.dtype == torch.bool:
            x, y = x.to(torch.uint8), y.to(torch.uint8)
        assert torch.equal(x.view(torch.uint8) if x.numel() else x,
                           y.view(torch.uint8) if y.numel() else y), f"{where}: bytes differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes(), f"{where}: bytes differ"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def run(make_sampler, direct, methods=SAMPLE_METHODS, epochs=EPOCH_METHODS, rounds=3,
        ctx="fork", n_workers=2, n_buffers=3, expect="direct", batches_per_task=None):
    """Every method's batches from a fresh MultiprocessingSampler over ``make_sampler()``.
    With ``direct=None`` and ``expect="direct"`` under fork, StepSampler's getters refuse
    to run in the workers: every batch must be gathered directly."""
    refuse = direct is None and expect == "direct" and ctx == "fork"
    with getters_refused(refuse), MultiprocessingSampler(
            make_sampler(), n_workers=n_workers, n_buffers=n_buffers, ctx=ctx,
            direct_gather=direct, batches_per_task=batches_per_task) as m:
        assert m.gather_path == (expect if direct is not False else "generic"), (
            m.gather_path_reason)
        out = []
        for _ in range(rounds):
            for name in methods:
                out.append((name, getattr(m, name)()))
        for name in epochs:
            out.append((name, list(getattr(m, name)())))
        return out


@contextlib.contextmanager
def getters_refused(active=True, names=GETTERS):
    """StepSampler's getters (``names``) raise while this lasts, in this process and in
    workers forked meanwhile (patched on the class, which the direct path's checks then see
    as StepSampler's own; a patch on an instance is an override, and takes the generic
    path)."""
    saved = {name: StepSampler.__dict__[name] for name in names}
    if active:
        for name in names:
            setattr(StepSampler, name, _data.refuse)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(StepSampler, name, fn)


def assert_same_both_ways(make_sampler, **kwargs):
    direct = run(make_sampler, None, **kwargs)
    generic = run(make_sampler, False, **kwargs)
    assert [n for n, _ in direct] == [n for n, _ in generic]
    for (name, a), (_, b) in zip(direct, generic):
        assert_identical(a, b, name)
    return direct


# -- the configurations ---------------------------------------------------------------------

def _box_buffer(n=60, dtype=torch.float32, shape=(5,), capacity=None, **kwargs):
    space = BoxSpace(TB, -100, 100, dtype, shape=shape)
    rb = ReplayBuffer.create(PytorchTensorStorage, space, capacity=capacity or n,
                             is_memmap=False, **kwargs)
    gen = torch.Generator().manual_seed(1)
    rb.extend((torch.rand(n, *shape, generator=gen) * 200 - 100).to(dtype))
    return rb


def _mixed_space():
    """Nested keys, unsorted insertion order, and dtypes that promote when flattened."""
    return DictSpace(TB, {
        "obs": DictSpace(TB, {
            "pos": BoxSpace(TB, -1e6, 1e6, torch.float64, shape=(3,)),
            "cam": BoxSpace(TB, 0, 255, torch.uint8, shape=(2, 4, 4)),
        }),
        "reward": BoxSpace(TB, -1e6, 1e6, torch.float32, shape=()),
        "count": BoxSpace(TB, -1000, 1000, torch.int16, shape=(2,)),
    })


def _mixed_rows(n, start=0):
    gen = torch.Generator().manual_seed(start + 7)
    return {"obs": {"pos": torch.randn(n, 3, generator=gen, dtype=torch.float64) * 1e3,
                    "cam": torch.randint(0, 256, (n, 2, 4, 4), generator=gen,
                                         dtype=torch.uint8)},
            "reward": torch.arange(start, start + n, dtype=torch.float32) + 0.1,
            "count": torch.randint(-1000, 1000, (n, 2), generator=gen, dtype=torch.int16)}


def _nested_dict_buffer(n=70):
    storages = {"obs/pos": PytorchTensorStorage, "obs/cam": PytorchTensorStorage,
                "reward": PytorchTensorStorage, "count": PytorchTensorStorage}
    rb = ReplayBuffer.create(DictStorage, _mixed_space(), storages, capacity=n,
                             is_memmap=False)
    rb.extend(_mixed_rows(n))
    return rb


def _flattened_buffer(n=70):
    rb = ReplayBuffer.create(FlattenedStorage, _mixed_space(), PytorchTensorStorage,
                             capacity=n, is_memmap=False)
    rb.extend(_mixed_rows(n))
    return rb


def _flattened_nan_buffer(n=40):
    """bfloat16 keys in float64 flat rows, NaNs included: a cast whose NaN bits depend on
    how torch is asked to cast."""
    space = DictSpace(TB, {"a": BoxSpace(TB, -1e3, 1e3, torch.bfloat16, shape=(8,)),
                           "b": BoxSpace(TB, -1e3, 1e3, torch.float64, shape=(2,))})
    rb = ReplayBuffer.create(FlattenedStorage, space, PytorchTensorStorage, capacity=n,
                             is_memmap=False)
    a = torch.randn(n, 8).to(torch.bfloat16)
    a[::3] = float("nan")
    rb.extend({"a": a, "b": torch.randn(n, 2, dtype=torch.float64)})
    return rb


def _image_space():
    """uint8 images (a multiple of 16 bytes, streamed, and not) beside float32 and bool keys:
    flat rows of float32, as in UniEnv's benchmark of flattened storages."""
    return DictSpace(TB, {
        "cam": BoxSpace(TB, 0, 255, torch.uint8, shape=(4, 16, 16)),
        "depth": BoxSpace(TB, 0, 255, torch.uint8, shape=(3, 7, 7)),
        "pos": BoxSpace(TB, -10.0, 10.0, torch.float32, shape=(3,)),
        "done": BinarySpace(TB, shape=(), dtype=torch.bool),
    })


def _flattened_images_buffer(n=60, out_of_range=False):
    rb = ReplayBuffer.create(FlattenedStorage, _image_space(), PytorchTensorStorage,
                             capacity=n, is_memmap=False)
    gen = torch.Generator().manual_seed(3)
    rb.extend({"cam": torch.randint(0, 256, (n, 4, 16, 16), generator=gen,
                                    dtype=torch.uint8),
               "depth": torch.randint(0, 256, (n, 3, 7, 7), generator=gen,
                                      dtype=torch.uint8),
               "pos": torch.randn(n, 3, generator=gen),
               "done": torch.rand(n, generator=gen) < 0.3})
    if out_of_range:
        # flat rows written by someone else: values whose cast to uint8 C leaves undefined
        # (torch's cast gives its own bytes), in some rows of each image
        flat = rb.storage.inner_storage.data
        assert flat.dtype == torch.float32 and flat.shape[1] == 1024 + 147 + 3 + 1
        for row, col, value in ((5, 0, float("nan")), (11, 700, 300.0), (17, 1023, -7.0),
                                (23, 1030, float("inf")), (29, 1170, -1.0),
                                (31, 3, 255.5), (37, 1100, 1e12)):
            flat[row, col] = value
    return rb


def _wrapped_buffer():
    rb = replay_buffer(0, capacity=50)
    for start in range(0, 130, 20):   # 130 rows through 50 places: full, offset 30
        rb.extend(_data.transitions(start, 20))
    assert len(rb) == 50 and rb.offset != 0
    return rb


CONFIGS = {
    "dict": lambda: replay_buffer(83),
    "box": lambda: _box_buffer(),
    "box_float64_matrix": lambda: _box_buffer(dtype=torch.float64, shape=(2, 3)),
    "nested_dict_mixed_dtypes": _nested_dict_buffer,
    "flattened": _flattened_buffer,
    "flattened_nan_casts": _flattened_nan_buffer,
    "flattened_float32_images": _flattened_images_buffer,
    "flattened_images_out_of_range": lambda: _flattened_images_buffer(out_of_range=True),
    "wrapped_around": _wrapped_buffer,
    "shared": lambda: replay_buffer(64, multiprocessing=True),
    "column_view": lambda: replay_buffer(64).get_column(["image"]),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_direct_and_generic_give_identical_batches(config):
    rb = CONFIGS[config]()
    assert_same_both_ways(lambda: StepSampler(rb, 9, seed=5))


@pytest.mark.parametrize("batches_per_task", [1, 5])
@pytest.mark.parametrize("config", ["nested_dict_mixed_dtypes", "flattened_nan_casts"])
def test_identical_one_batch_per_task_and_in_groups(config, batches_per_task):
    """(By default these small batches go 8 to a task.)"""
    rb = CONFIGS[config]()
    assert_same_both_ways(lambda: StepSampler(rb, 9, seed=5), rounds=7,
                          batches_per_task=batches_per_task)


@pytest.mark.parametrize("config", ["flattened", "flattened_float32_images"])
def test_uint8_leaves_of_float_flat_rows_are_cast_in_one_pass(config):
    """The images of float64 and float32 flat rows take the one-pass cast
    (rows.gather_cast_u8), which the identity tests above then check."""
    rb = CONFIGS[config]()
    plan = gather.Gatherer(StepSampler(rb, 9, seed=5))("sample", None).plan
    cast = sorted(plan.leaves[i][2].columns[1] for i in plan.casts)
    assert cast == ([2] if config == "flattened" else [0, 1024])   # (sorted keys)


def test_groups_are_planned_by_the_same_rule_on_both_paths():
    rb = replay_buffer(40)
    row = gather.row_nbytes(StepSampler(rb, 4), "sample")
    assert row == 4 * (10 + 7) + int(np.prod(_data.IMG))
    assert gather.row_nbytes(StepSampler(rb, 4), "sample_index") is None
    assert gather.row_nbytes(_data.FailingSampler(rb, 4, fail_every=2), "sample") is None
    for direct in (None, False):
        with MultiprocessingSampler(StepSampler(rb, 4, seed=0), n_workers=1, n_buffers=6,
                                    ctx="fork", direct_gather=direct) as m:
            m.sample()
            m.sample_index()
            # (small rows: as many as fit in 1 MiB, at most 8, whatever n_buffers)
            assert m._streams["sample"].k == 8
            assert m._streams["sample_index"].k == 1


def test_a_method_the_planner_trips_on_keeps_the_rng_in_step():
    """sample_flat of dtypes torch cannot promote fails on both paths, after drawing the
    indices: the batches that follow are the same."""
    box, i16 = (BoxSpace(TB, 0, 1000, dt, shape=(2,)) for dt in (torch.int32, torch.int16))
    n = 30
    storage = DictStorage(DictSpace(TB, {"u": box, "i": i16}), {
        # (BoxSpace refuses uint16: the storage holds a uint16 tensor under an int32 space)
        "u": PytorchTensorStorage(box, torch.arange(2 * n).view(n, 2).to(torch.uint16)),
        "i": PytorchTensorStorage(i16, torch.arange(2 * n).view(n, 2).to(torch.int16))})
    rb = ReplayBuffer(storage, "x", n, 0)

    def batches(direct):
        with MultiprocessingSampler(StepSampler(rb, 4, seed=0), n_workers=1, ctx="fork",
                                    direct_gather=direct) as m:
            out = []
            for _ in range(3):
                with pytest.raises(WorkerError):
                    m.sample_flat()
                out.append(m.sample())
            return out

    for a, b in zip(batches(None), batches(False)):
        assert_identical(a, b)


def test_memmap_storage_identical_under_every_start_method(tmp_path, ctx):
    rb = replay_buffer(45, memmap_dir=str(tmp_path / "rb"))
    assert isinstance(rb.storage.storage_map["image"].data, torch.Tensor)
    assert type(rb.storage.storage_map["image"].data) is not torch.Tensor  # memory-mapped
    assert_same_both_ways(lambda: StepSampler(rb, 8, seed=2), ctx=ctx, rounds=2)


def test_identical_under_every_start_method(ctx):
    rb = _wrapped_buffer()
    assert_same_both_ways(lambda: StepSampler(rb, 7, seed=11), ctx=ctx, rounds=2,
                          n_workers=3)


def test_large_rows_go_through_slots_as_zero_copy_views():
    rb = replay_buffer(300, img=(3, 32, 32))   # 3 KiB image rows: streaming stores
    out = assert_same_both_ways(lambda: StepSampler(rb, 64, seed=0), methods=("sample",),
                                epochs=("epoch_iter",), rounds=4)
    batch = out[0][1]
    assert batch["image"].nbytes > 4096 and in_shared_memory(batch["image"])


def test_a_buffer_appended_to_between_reseeds_gives_identical_batches():
    """A shared buffer grows in the parent while the workers run; after each append the
    sampler is reseeded, so both paths draw from the same, known data."""
    first = _data.transitions(0, 20)
    chunks = [_data.transitions(start, 15) for start in range(20, 140, 15)]

    def batches(direct):
        rb = replay_buffer(0, capacity=60, multiprocessing=True)
        rb.extend(first)
        out = []
        with MultiprocessingSampler(StepSampler(rb, 6, seed=0), n_workers=2, n_buffers=3,
                                    ctx="fork", direct_gather=direct) as m:
            for k, chunk in enumerate(chunks):   # grows, then wraps around
                rb.extend(chunk)
                m.manual_seed(k)
                out += [m.sample() for _ in range(3)]
                out.append(list(m.epoch_iter()))
            assert rb.offset != 0
        return out

    for a, b in zip(batches(None), batches(False)):
        assert_identical(a, b)


def test_workers_see_rows_the_parent_appends_while_they_sample():
    rb = replay_buffer(10, capacity=400, multiprocessing=True)
    seen = set()
    with MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=2, n_buffers=2,
                                ctx="fork", direct_gather=True) as m:
        for start in range(10, 400, 30):
            rb.extend(_data.transitions(start, 30))
            for _ in range(4):
                b = m.sample()
                ids = indices_of(b)
                # every row is whole: its image holds its own index
                assert b["image"][:, 0, 0, 0].tolist() == [i % 251 for i in ids]
                seen.update(ids)
    assert max(seen) >= 300


def test_the_direct_path_does_not_call_the_wrapped_getters():
    rb = replay_buffer(40)
    with getters_refused():
        with MultiprocessingSampler(StepSampler(rb, 5, seed=0), n_workers=1, n_buffers=2,
                                    ctx="fork") as m:
            assert m.gather_path == "direct"
            assert set(m.sample()) == {"state", "action", "image"}
            assert m.sample_flat().shape == (5, 17 + int(np.prod(_data.IMG)))
            assert sum(len(indices_of(b)) for b in m.epoch_iter()) == 40
        with MultiprocessingSampler(StepSampler(rb, 5, seed=0), n_workers=1, n_buffers=2,
                                    ctx="fork", direct_gather=False) as m:
            with pytest.raises(WorkerError, match="refused"):
                m.sample()


def test_methods_replaced_on_an_instance_are_run_by_the_generic_path():
    rb = replay_buffer(40)
    s = StepSampler(rb, 5, seed=0)
    s.get_at = _data.refuse
    with MultiprocessingSampler(s, n_workers=1, n_buffers=2, ctx="fork") as m:
        assert m.gather_path == "generic" and "get_at" in m.gather_path_reason
        with pytest.raises(WorkerError, match="refused"):
            m.sample()
    rb.storage.storage_map["image"].get = _data.refuse
    with pytest.raises(gather.NotDirect, match="overrides get"):
        gather.check(StepSampler(rb, 5))


def test_a_tensor_subclass_in_a_storage_takes_the_generic_path():
    rb = replay_buffer(40)
    storage = rb.storage.storage_map["state"]
    storage.data = storage.data.as_subclass(_data.ScaledTensor)
    with pytest.raises(gather.NotDirect, match="ScaledTensor, not a plain"):
        gather.check(StepSampler(rb, 5))
    with MultiprocessingSampler(StepSampler(rb, 5, seed=0), n_workers=1, ctx="fork") as m:
        assert m.gather_path == "generic"
        ids = m.sample()["state"][:, 0]   # row i holds i: the subclass's indexing gives i / 10
        assert ids.max() < 4 and torch.allclose(ids * 10, (ids * 10).round())


def test_direct_gather_true_refuses_what_it_cannot_gather_and_says_why():
    rb = replay_buffer(30)
    cases = [
        (_data.SlowSampler(rb, 4), "overrides get_at"),
        (_data.VaryingSampler(rb, 4), "overrides sample"),
        (StepSampler(ToBackendOrDeviceBatch(rb, backend=NumpyComputeBackend), 4),
         "not a batch that the direct path reproduces"),
    ]
    for sampler, words in cases:
        with pytest.raises(ValueError, match=words):
            MultiprocessingSampler(sampler, n_workers=1, direct_gather=True)
        m = MultiprocessingSampler(sampler, n_workers=1)
        assert m.gather_path == "generic" and words.split()[-1] in m.gather_path_reason
        m.close()
    for bad in ("yes", 0, 1, 0.0, np.False_):
        with pytest.raises(TypeError, match="direct_gather"):
            MultiprocessingSampler(StepSampler(rb, 4), n_workers=1, direct_gather=bad)
    m = MultiprocessingSampler(StepSampler(rb, 4), n_workers=1, direct_gather=False)
    assert m.gather_path == "generic" and m.gather_path_reason == "direct_gather=False"
    m.close()


def test_storages_that_change_their_rows_take_the_generic_path():
    """A storage that computes its rows (here: a subclass overriding get()) is refused,
    also as one key of a DictStorage, and the generic path returns its rows."""
    storages = {"state": _data.NegatedStorage, "action": PytorchTensorStorage,
                "image": PytorchTensorStorage}
    rb = ReplayBuffer.create(DictStorage, _data.space(), storages, capacity=30,
                             is_memmap=False)
    rb.extend(_data.transitions(0, 30))
    with pytest.raises(gather.NotDirect, match="NegatedStorage overrides get"):
        gather.check(StepSampler(rb, 4))
    with MultiprocessingSampler(StepSampler(rb, 4, seed=0), n_workers=1, ctx="fork") as m:
        assert m.gather_path == "generic"
        assert (m.sample()["state"][:, 0] <= 0).all()


def test_rows_out_of_range_raise_in_the_caller_like_the_generic_path():
    rb = replay_buffer(30)
    for direct in (True, False):
        with MultiprocessingSampler(StepSampler(rb, 4), n_workers=1, ctx="fork",
                                    direct_gather=direct) as m:
            pool = m._ensure_manager()
            t = pool.submit(("get_at", torch.tensor([1, 2, 99])))
            with pytest.raises(WorkerError):
                pool.result(t)
            assert len(indices_of(m.sample())) == 4   # and the worker goes on


@pytest.mark.slow
def test_worker_memory_stays_flat_over_10k_direct_batches():
    psutil = pytest.importorskip("psutil")
    rb = replay_buffer(500, img=(3, 16, 16))
    with MultiprocessingSampler(StepSampler(rb, 32, seed=0), n_workers=2, n_buffers=4,
                                ctx="fork", direct_gather=True) as m:
        m.sample()
        procs = [psutil.Process(p.pid) for p in m._pools.sample.workers]

        def rss():
            return sum(p.memory_info().rss for p in procs)

        for _ in range(500):
            m.sample()
            m.sample_flat()
        before = rss()
        for i in range(10_000):
            b = m.sample() if i % 2 else m.sample_flat_with_metadata()
            del b
        after = rss()
    assert after - before < 8 * 2 ** 20, f"workers grew by {(after - before) / 2**20:.1f} MiB"
