"""The main job's storages case as pytest-benchmark groups, with the same columns
(``unienv_mp.bench.storages``): one group per UniEnv storage backend, its buffer built by
UniEnv's own storage benchmark code (shipped in UniEnv's wheel) with 4000 steps of
{joint_pos 7, ee_pos 3, image 128x128x3 u8, action 7, reward, terminated}, saved and
loaded back read-only; batches of 256, 4 workers, 8 buffers, fork; the consumer touches
one byte per 4 KiB page of every batch.  A round is one batch.

* ``UniEnv in process`` (torch and UniEnv's I/O threads at their defaults) and ``..., 1
  thread`` (one decoder);
* ``bare read``: the same rows into reused memory in process, for the backends read
  directly (contiguous HDF5 read with preadv; memory maps with index_select);
* UniEnv's MultiprocessingSampler and unienv_mp's.

``storages, hdf5 epochs under spawn``: a round is one whole epoch over the HDF5 buffer
under spawn; ``first`` on a new sampler each round, ``later`` on one sampler's kept
workers (the files settled first, see ``unienv_mp._sampling.files``).

Each backend is skipped, saying why, where a library it needs is missing (the ``disk``
extra brings them).  The same as one table: ``python -m unienv_mp --case storages``.
"""
import multiprocessing as mp
import tempfile

import pytest

from unienv_mp.bench import config, measure, storages

CFG = config.case_config("storages")
ROUNDS, WARMUP = 60, 8
EPOCH_ROUNDS = {"first": 3, "later": 4}


@pytest.fixture(scope="module")
def root():
    with tempfile.TemporaryDirectory(prefix="unienv_mp-bench-storages-") as path:
        yield path


@pytest.fixture(scope="module")
def built(root):
    made = {}

    def get(name):
        why = storages.missing_for(name)
        if why is not None:
            pytest.skip(f"{name}: {why}")
        if name not in made:
            made[name] = storages.build_buffer(name, root, CFG)
        return made[name]
    yield get
    for rb in made.values():
        storages.close_buffer(rb)


def _maker(name, col, rb):
    from unienv_mp.bench.peers import sampler_object
    if col == "bare":
        made = storages.bare_reader(name, rb, CFG)
        if made is None:
            pytest.skip(f"{name} has no bare read (its rows are decoded)")
        return made
    s = sampler_object("in_process" if col.startswith("in_process") else col, rb, CFG)
    return s.sample, getattr(s, "close", lambda: None)


@pytest.mark.parametrize("col", storages.COLUMNS)
@pytest.mark.parametrize("name", storages.BACKENDS)
def test_storage(benchmark, built, name, col):
    rb = built(name)
    benchmark.group = (f"storages, {name}: B={CFG.batch_size}, {CFG.workers} workers, "
                       f"fork")
    next_batch, close = _maker(name, col, rb)
    import contextlib
    try:
        with (storages.one_thread() if col == "in_process_1" else contextlib.nullcontext()):
            benchmark.pedantic(lambda: measure.touch(next_batch()), rounds=ROUNDS,
                               iterations=1, warmup_rounds=WARMUP)
    finally:
        close()
    benchmark.extra_info["implementation"] = storages.COLUMN_LABELS[col]


@pytest.mark.parametrize("which", ["first", "later"])
def test_hdf5_epochs_under_spawn(benchmark, built, which):
    from unienv_data.samplers import StepSampler

    from unienv_mp import MultiprocessingSampler
    rb = built("hdf5")
    storages.settle(rb)
    benchmark.group = "storages, hdf5 epochs under spawn"

    def sampler():
        return MultiprocessingSampler(StepSampler(rb, CFG.batch_size, seed=0),
                                      n_workers=CFG.workers, n_buffers=CFG.buffers,
                                      ctx=mp.get_context("spawn"))

    def epoch(s):
        for batch in s.epoch_iter():
            measure.touch(batch)
        return s.epoch_workers

    if which == "first":
        def one():
            with sampler() as s:
                return epoch(s)
        benchmark.pedantic(one, rounds=EPOCH_ROUNDS["first"], iterations=1)
    else:
        with sampler() as s:
            epoch(s)
            benchmark.pedantic(lambda: epoch(s), rounds=EPOCH_ROUNDS["later"], iterations=1)
            assert s.epoch_workers == "kept", s.epoch_workers_reason
    benchmark.extra_info["implementation"] = f"unienv_mp, {which} epoch"
