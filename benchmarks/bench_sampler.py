"""The main job's cases as pytest-benchmark groups, with the same rows (its modules are
those of ``unienv_mp.bench``: ``config.CASES``); 4 workers, 8 buffers, fork; the consumer
touches one byte per 4 KiB page of every batch.

* ``sampler image`` / ``sampler state``: MultiprocessingSampler side by side: unienv_mp's,
  UniEnv's (``shared_memory`` False and True), UniEnv's StepSampler in process, a torch
  DataLoader with as many workers, ``torch.index_select`` of the StepSampler's indices
  into reused output tensors in process (the speed limit of in-process sampling), and a
  TorchRL ReplayBuffer with 4 prefetch threads (skipped without torchrl), over one
  in-memory ReplayBuffer of 20k transitions: batches of 256 {state 10 f32, action 7 f32,
  image 3x128x128 u8} (12.6 MB), and of 32 {state 10 f32, action 7 f32}.  A round is one
  batch.
* ``sampler jpeg``: batches of 64 from 4000 transitions whose 128x128x3 images are JPEG
  files in UniEnv's ImageStorage, decoded for every batch (skipped without Pillow).  A
  round is one batch.
* ``online``: a round is one step of a loop that appends 4 transitions to a shared
  (``multiprocessing=True``) buffer, then samples 256 {state, action, clock};
  ``extra_info`` holds the batches' staleness in loop steps (``online.online_stepper``).
* ``views, ...``: one group per view of the main job's views case (``views.VIEWS``:
  frame stacks, action chunks, columns, a combined dataset, batches of 256 over 20k steps
  in episodes of 200): unienv_mp (and its generic path), UniEnv's sampler with
  ``shared_memory=True``, UniEnv's StepSampler in process, the view's bare limit
  (``index_select`` of its final rows, mask included, into reused memory), and TorchRL's
  ``SliceSampler`` on the action chunks.  A round is one batch.
* ``windows, ...``: the main job's windows case (an observation history and an action
  chunk of one step per element, with pad masks: ``unienv_mp.WindowedBatch``), batches of
  256 over 20k steps in episodes of 200: unienv_mp (and its generic path), the same view
  in process, two UniEnv samplers paired by seed in process, a torch DataLoader over a
  map-style dataset doing the same indexing, and the bare gather.  A round is one batch.
* ``latency, ...``: one group per way of asking for a batch with nothing prefetched
  (``latency.TRIGGERS``); a round is one such batch, its set-up (a pause, closing the
  previous epoch or sampler) untimed.  UniEnv's ``manual_seed()`` keeps the batches its
  workers made, so that row is skipped.
* ``epoch, first`` / ``epoch, later``: a round is one whole epoch of ``epoch_iter()`` over
  the image case's buffer (79 batches of 256); ``first``: each round on a new sampler (its
  first epoch, starting its workers; for the DataLoader, its first ``iter()``),
  ``later``: the rounds on one sampler after a first, untimed epoch.  The rows of
  ``config.CASES["epoch"]``: unienv_mp, as many steady-state ``sample()`` batches of
  unienv_mp, UniEnv's sampler (``shared_memory=True``), UniEnv in process, and a torch
  DataLoader over ``UniEnvAsPyTorchDataset`` (4 workers, ``persistent_workers=True``).

The mean round time is the time per batch (or loop step).  The same comparisons, as one
command with a table each: ``python -m unienv_mp --case all``.
"""
import numpy as np
import pytest

from unienv_mp.bench import config, data, epochs, latency, measure, online, peers, views, windows

CASES = {
    "image": config.Config(transitions=20_000, batch_size=256, image_shape=(3, 128, 128)),
    "state": config.Config(transitions=20_000, batch_size=32, image_shape=()),
}
JPEG = config.case_config("jpeg")
ONLINE = config.case_config("online")
LATENCY = config.case_config("latency")
# Enough rounds, after a warm-up as long as the deepest pipeline (n_buffers batches in flight,
# each in a slot made and first touched on its first use), for the steady state to dominate
ROUNDS = {"image": 200, "state": 2000, "jpeg": 100, "online": 2000, "view": 2000,
          "view_images": 60}
WARMUP = {"image": 20, "state": 200, "jpeg": 10, "view": 200, "view_images": 10}
LATENCY_ROUNDS = {"reseed": 40, "epoch": 15, "start": 10}
VIEWS = config.case_config("views")
VIEW_IMAGES = ("framestack", "framestack_image", "combined")   # 25 MB a batch
WINDOWS = config.case_config("windows")
EPOCH = config.case_config("epoch")
EPOCH_ROUNDS = {"first": 3, "later": 5}
MISSING = peers.available()


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    cfg = CASES[request.param]
    return request.param, cfg, data.build_buffer(cfg)


@pytest.fixture(scope="module")
def jpeg_rb():
    reason = config.case_missing("jpeg", JPEG)
    if reason is not None:
        pytest.skip(reason)
    with data.case_data("jpeg", JPEG) as rb:
        yield rb


@pytest.fixture(scope="module")
def views_data():
    with data.case_data("views", VIEWS) as made:
        yield made


@pytest.fixture(scope="module")
def latency_rb():
    return data.build_buffer(LATENCY)


def _skip_missing(impl):
    if impl in MISSING:
        pytest.skip(MISSING[impl])


def _bench_batches(benchmark, impl, rb, cfg, name, made=None):
    next_batch, close = made or peers.make_sampler(impl, rb, cfg)
    try:
        first = next_batch()
        nbytes = measure.batch_nbytes(first)
        del first
        benchmark.pedantic(lambda: measure.touch(next_batch()), rounds=ROUNDS[name],
                           iterations=1, warmup_rounds=WARMUP[name])
    finally:
        close()
    benchmark.extra_info["implementation"] = config.LABELS[impl]
    mean = _mean(benchmark)
    if mean is not None:
        benchmark.extra_info.update({"ms_per_batch": mean * 1e3, "batches_per_s": 1 / mean,
                                     "MB_per_s": nbytes / mean / 1e6})


def _mean(benchmark):
    """The mean round time, None when benchmarks are disabled (``--benchmark-disable``)."""
    stats = getattr(benchmark, "stats", None)
    return None if stats is None else stats.stats.mean


@pytest.mark.parametrize("impl", config.IMPLEMENTATIONS)
def test_sampler(benchmark, case, impl):
    name, cfg, rb = case
    _skip_missing(impl)
    benchmark.group = f"sampler {name}: B={cfg.batch_size}, 4 workers, fork"
    _bench_batches(benchmark, impl, rb, cfg, name)


@pytest.mark.parametrize("impl", config.CASES["jpeg"].rows)
def test_jpeg(benchmark, jpeg_rb, impl):
    _skip_missing(impl)
    benchmark.group = f"sampler jpeg: B={JPEG.batch_size}, decoded per batch, 4 workers, fork"
    _bench_batches(benchmark, impl, jpeg_rb, JPEG, "jpeg")


@pytest.mark.parametrize("impl", config.CASES["views"].rows)
@pytest.mark.parametrize("view", views.VIEWS)
def test_views(benchmark, views_data, view, impl):
    _skip_missing(impl)
    made = views.make_view_sampler(impl, view, views_data, VIEWS)
    if made is None:
        pytest.skip(f"{config.LABELS[impl]} has no sampler for this view")
    benchmark.group = f"views, {views.VIEWS[view].label}: B={VIEWS.batch_size}, 4 workers, fork"
    _bench_batches(benchmark, impl, None, VIEWS,
                   "view_images" if view in VIEW_IMAGES else "view", made)


@pytest.fixture(scope="module")
def windows_rb():
    with data.case_data("windows", WINDOWS) as rb:
        yield rb


@pytest.mark.parametrize("impl", config.CASES["windows"].rows)
def test_windows(benchmark, windows_rb, impl):
    _skip_missing(impl)
    benchmark.group = (f"windows, image and state at [-1, 0], actions at 0..15, pad masks: "
                       f"B={WINDOWS.batch_size}, 4 workers, fork")
    _bench_batches(benchmark, impl, None, WINDOWS, "view_images",
                   windows.make_window_sampler(impl, windows_rb, WINDOWS))


@pytest.mark.parametrize("impl", config.CASES["online"].rows)
def test_online(benchmark, impl):
    _skip_missing(impl)
    benchmark.group = (f"online: append {ONLINE.append}, then sample B={ONLINE.batch_size}, "
                       f"4 workers, fork")
    rb = data.build_online_buffer(ONLINE)
    next_batch, close = peers.make_sampler(impl, rb, ONLINE)
    stale = []
    try:
        step = online.online_stepper(next_batch, rb, ONLINE)
        benchmark.pedantic(lambda: stale.append(step()[0]), rounds=ROUNDS["online"],
                           iterations=1, warmup_rounds=online.online_warmup(ONLINE))
    finally:
        close()
    result = online.OnlineResult(impl, config.LABELS[impl],
                                  staleness=stale[-ROUNDS["online"]:])
    benchmark.extra_info.update({"implementation": result.label,
                                 **{f"staleness_{k}": v
                                    for k, v in result.staleness_stats().items()}})
    mean = _mean(benchmark)
    if mean is not None:
        benchmark.extra_info["ms_per_step"] = mean * 1e3


@pytest.mark.parametrize("trigger", latency.TRIGGERS)
@pytest.mark.parametrize("impl", config.CASES["latency"].rows)
def test_latency(benchmark, latency_rb, impl, trigger):
    _skip_missing(impl)
    benchmark.group = (f"latency, {latency.TRIGGERS[trigger]}: B={LATENCY.batch_size}, "
                       f"4 workers, fork")
    try:
        prepare, first_batch, close = latency.latency_probe(impl, trigger, latency_rb, LATENCY)
    except latency.NotMeasurable as e:
        pytest.skip(str(e))
    try:
        benchmark.pedantic(lambda: measure.touch(first_batch()), setup=prepare,
                           rounds=LATENCY_ROUNDS[trigger], iterations=1)
    finally:
        close()
    benchmark.extra_info.update({"implementation": config.LABELS[impl],
                                 "asked_for_by": latency.TRIGGERS[trigger]})
    stats = getattr(benchmark, "stats", None)
    if stats is not None:   # (the main job's latency table gives p50 and p99)
        times = sorted(stats.stats.data)
        benchmark.extra_info["p50_ms"] = float(np.percentile(times, 50)) * 1e3
        benchmark.extra_info["p99_ms"] = float(np.percentile(times, 99)) * 1e3


@pytest.fixture(scope="module")
def epoch_rb():
    return data.build_buffer(EPOCH)


@pytest.mark.parametrize("which", ["first", "later"])
@pytest.mark.parametrize("impl", config.CASES["epoch"].rows)
def test_epoch(benchmark, epoch_rb, impl, which):
    _skip_missing(impl)
    if which == "first" and impl == "unienv_mp_sample":
        pytest.skip("the steady state has no first epoch")
    benchmark.group = (f"epoch, {which}: {-(-len(epoch_rb) // EPOCH.batch_size)} batches of "
                       f"B={EPOCH.batch_size}, 4 workers, fork")
    runners = []

    def run_epoch(epoch):
        for batch in epoch():
            measure.touch(batch)

    def close_all():
        while runners:
            runners.pop()[1]()

    try:
        if which == "first":
            def setup():
                close_all()
                runners.append(epochs.epoch_runner(impl, epoch_rb, EPOCH))
            benchmark.pedantic(lambda: run_epoch(runners[-1][0]), setup=setup,
                               rounds=EPOCH_ROUNDS[which], iterations=1)
        else:
            runners.append(epochs.epoch_runner(impl, epoch_rb, EPOCH))
            run_epoch(runners[-1][0])
            benchmark.pedantic(lambda: run_epoch(runners[-1][0]),
                               rounds=EPOCH_ROUNDS[which], iterations=1)
    finally:
        close_all()
    benchmark.extra_info["implementation"] = config.LABELS[impl]
