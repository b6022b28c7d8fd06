"""MultiprocessingSampler side by side: unienv_mp's, UniEnv's
(``shared_memory`` False and True), UniEnv's StepSampler in process, a torch DataLoader
with as many workers, ``torch.index_select`` of the StepSampler's indices into reused
output tensors in process (the speed limit of in-process sampling), and a TorchRL
ReplayBuffer with 4 prefetch threads (skipped without torchrl), over one in-memory
ReplayBuffer of 20k transitions; 4 workers, fork; the consumer touches one byte per 4 KiB
page of every batch.

* image: batches of 256 {state 10 f32, action 7 f32, image 3x128x128 u8} (12.6 MB)
* state: batches of 32 {state 10 f32, action 7 f32}

Each round is one batch; the mean round time is the time per batch.  The same comparison,
as one command with a table: ``python -m unienv_mp`` (``--case state`` for the second).
"""
import pytest

from unienv_mp import compare

CASES = {
    "image": compare.Config(transitions=20_000, batch_size=256, image_shape=(3, 128, 128)),
    "state": compare.Config(transitions=20_000, batch_size=32, image_shape=()),
}
# Enough rounds, after a warm-up as long as the deepest pipeline (n_buffers batches in flight,
# each in a slot made and first touched on its first use), for the steady state to dominate
ROUNDS = {"image": 200, "state": 2000}
WARMUP = {"image": 20, "state": 200}
MISSING = compare.available()


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    cfg = CASES[request.param]
    return request.param, cfg, compare.build_buffer(cfg)


@pytest.mark.parametrize("impl", compare.IMPLEMENTATIONS)
def test_sampler(benchmark, case, impl):
    name, cfg, rb = case
    if impl in MISSING:
        pytest.skip(MISSING[impl])
    benchmark.group = f"sampler {name}: B={cfg.batch_size}, 4 workers, fork"
    next_batch, close = compare.make_sampler(impl, rb, cfg)
    try:
        first = next_batch()
        nbytes = compare.batch_nbytes(first)
        del first
        benchmark.pedantic(lambda: compare.touch(next_batch()), rounds=ROUNDS[name],
                           iterations=1, warmup_rounds=WARMUP[name])
    finally:
        close()
    mean = benchmark.stats.stats.mean
    benchmark.extra_info.update({"ms_per_batch": mean * 1e3, "batches_per_s": 1 / mean,
                                 "MB_per_s": nbytes / mean / 1e6,
                                 "implementation": compare.LABELS[impl]})
