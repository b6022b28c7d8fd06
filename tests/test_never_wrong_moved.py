"""Never silently wrong when the data moves away from what the ``sample*`` workers read in
shared memory: a shared tensor of a ``multiprocessing=True`` buffer replaced (then the
buffer grown), or a buffer only partly in shared memory written.  Those workers would hand
out torn rows (keys from two copies); the next call starts a new pool instead, over the
data as it is now, drops the batches made ahead, and says so once.  And when the
``sample*`` workers are lost in one method's call, every other method goes on with its own
stream (their requests were to the lost workers too).

Every key of every row encodes its step (see `_step_rows`).  The private parts reached
into are in `_hooks`.
"""
import os
import signal
import warnings

import pytest
import torch
from unienv_data.samplers import StepSampler

import _hooks as hooks
import _step_rows as sr
from conftest import process_running, wait_until
from unienv_mp import MultiprocessingSampler

BATCH = 8


def make(rb, ctx, seed=0, **kwargs):
    kwargs.setdefault("n_workers", 2)
    return MultiprocessingSampler(StepSampler(rb, BATCH, seed=seed), ctx=ctx, **kwargs)


def assert_rows_held(m, rb, n, what):
    """The next ``n`` batches of ``m.sample()`` hold only rows ``rb`` holds now, bit for
    bit (a torn row is none of them)."""
    held = sr.buffer_rows(rb)
    for j in range(n):
        batch = m.sample()
        rows = sr.rows_of(batch)
        bad = sum(r not in held for r in rows)
        assert not bad, f"{what}: batch {j} has {bad} of {len(rows)} rows the buffer " \
                        f"does not hold"


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_a_shared_tensor_replaced_then_the_buffer_grown_hands_out_only_its_rows(ctx):
    rb = sr.buffer(40, capacity=80, multiprocessing=True)
    with make(rb, ctx, batches_per_task=1, n_buffers=4) as m:
        m.sample()   # (and batches made ahead, over the old tensor)
        st = rb.storage.storage_map["obs"]
        st.data = (st.data + 1000).share_memory_()
        rb.extend(sr.rows(40, 40))
        new = rb.storage.storage_map["obs"].data
        new[40:] += 1000   # (every row of the buffer now has obs + 1000)
        with pytest.warns(RuntimeWarning, match="moved away"):
            assert_rows_held(m, rb, 20, "after the replace and the extend")


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_a_shared_tensor_replaced_keeps_the_stream_of_a_sampler_over_the_new_data(ctx):
    rb = sr.buffer(40, capacity=80, multiprocessing=True)
    twin_rb = sr.buffer(40, capacity=80, multiprocessing=True)
    st = twin_rb.storage.storage_map["obs"]
    st.data = (st.data + 1000).share_memory_()
    opts = {"batches_per_task": 2, "n_buffers": 4}
    with make(rb, ctx, **opts) as m, make(twin_rb, ctx, **opts) as twin:
        for _ in range(3):
            m.sample()
            twin.sample()
        st = rb.storage.storage_map["obs"]
        st.data = (st.data + 1000).share_memory_()
        with pytest.warns(RuntimeWarning, match="moved away"):
            for j in range(12):
                a, b = sr.clone(m.sample()), sr.clone(twin.sample())
                assert sr.same_batch(a, b), (f"batch {3 + j}: {a['step'].tolist()} != "
                                             f"{b['step'].tolist()}")


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
@pytest.mark.parametrize("write", ["set_at", "wrap"])
def test_a_partly_shared_buffer_written_hands_out_only_its_rows(ctx, write):
    rb = sr.buffer(40, capacity=40)
    sr.tensor(rb, "obs").share_memory_()
    with make(rb, ctx, batches_per_task=1, n_buffers=4) as m:
        m.sample()
        if write == "set_at":
            rb.set_at(torch.arange(0, 40, 2), sr.rows(100, 20))
        else:   # (a full buffer: the extend overwrites the oldest rows)
            rb.extend(sr.rows(40, 20))
        with pytest.warns(RuntimeWarning, match="moved away"):
            assert_rows_held(m, rb, 20, f"after {write}")


def test_a_whole_buffer_in_shared_memory_grown_keeps_its_workers():
    rb = sr.buffer(40, capacity=80, multiprocessing=True)
    with make(rb, "fork") as m:
        m.sample()
        manager = hooks.sample_manager(m)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            for i in range(10):
                rb.extend(sr.rows(40 + 4 * i, 4))
                sr.steps_of(m.sample())
        assert hooks.sample_manager(m) is manager


def test_after_the_sample_workers_are_lost_each_method_goes_on_with_its_own_stream():
    rb = sr.buffer(40, capacity=120)
    opts = {"batches_per_task": 1, "n_buffers": 4, "n_workers": 1}
    with make(rb, "fork", seed=1, **opts) as m, make(rb, "fork", seed=1, **opts) as old:
        m.sample()
        m.sample_index()   # (both streams request batches ahead)
        want_old = [old.sample_index().tolist() for _ in range(2)][1]
        manager = hooks.sample_manager(m)
        os.kill(hooks.snapshot_process(manager).pid, signal.SIGKILL)
        rb.extend(sr.rows(40, 10))   # (the data the workers copied is gone)
        worker = hooks.worker_pids(manager)[0]
        os.kill(worker, signal.SIGKILL)
        assert wait_until(lambda: not process_running(worker))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for _ in range(8):
                m.sample()
            assert hooks.sample_manager(m) is not manager   # (the sample* workers are new)
            idx = m.sample_index()
        with make(rb, "fork", seed=1, **opts) as new:
            want_new = [new.sample_index().tolist() for _ in range(2)][1]
    assert isinstance(idx, torch.Tensor), f"sample_index() handed out a {type(idx)}"
    assert idx.tolist() in (want_old, want_new), (
        f"sample_index() handed out {idx.tolist()}, not its batch 1 "
        f"({want_old} or {want_new})")
