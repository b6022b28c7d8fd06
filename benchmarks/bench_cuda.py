"""The main job's ``cuda`` case as a pytest-benchmark group (``cuda``): an image batch of
256 taken to the GPU, each way side by side (see ``unienv_mp.bench.cuda``); a round is one
training step (get the batch, move it, a small GPU op that reads it).  unienv_mp's ways
are timed once a window of steps saw no slot page-locked (``unienv_mp.bench.cuda.warm_up``).
Skipped without CUDA."""
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA (torch.cuda.is_available() is False)")

WAYS = ["device batches", "CPU batches + .to", "pin_memory + .to non_blocking",
        "UniEnv in process, device="]


@pytest.fixture(scope="module")
def buffers():
    from unienv_mp.bench import cuda, data
    from unienv_mp.bench.config import case_config
    cfg = case_config("image")
    rb = data.build_buffer(cfg)
    return cfg, rb


@pytest.mark.parametrize("way", WAYS)
def test_cuda(benchmark, buffers, way):
    from unienv_data.samplers import StepSampler

    from unienv_mp import MultiprocessingSampler
    from unienv_mp.bench.cuda import _consume, warm_up
    cfg, rb = buffers
    benchmark.group = "cuda"
    acc = torch.zeros((), device="cuda")
    if way == "UniEnv in process, device=":
        s = StepSampler(rb, cfg.batch_size, seed=0, device="cuda")
        benchmark(lambda: _consume(torch, s.sample(), acc))
        return
    device = "cuda" if way == "device batches" else None
    pin = way == "pin_memory + .to non_blocking"
    with MultiprocessingSampler(StepSampler(rb, cfg.batch_size, seed=0, device=device),
                                n_workers=4, pin_memory=pin) as m:
        if device is not None:
            step = lambda: _consume(torch, m.sample(), acc)
        else:
            step = lambda: _consume(torch, {k: v.to("cuda", non_blocking=pin)
                                            for k, v in m.sample().items()}, acc)
        warm_up(m, step)
        benchmark(step)
        assert m.stats().device is None or m.stats().device.pageable_leaves == 0
    torch.cuda.synchronize()
