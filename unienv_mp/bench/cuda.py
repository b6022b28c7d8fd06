"""The ``cuda`` case: image batches taken all the way to a GPU, side by side, in one run.

Each step gets a batch, moves every tensor to the GPU (if it is not there already) and runs
a small GPU op that reads it (a sum per tensor into one accumulator, no host sync); the
time of ``steps`` steps ends with one ``torch.cuda.synchronize``.  Rows:

* ``device batches``: unienv_mp over ``StepSampler(rb, B, device="cuda")`` (page-locked
  slots, copies issued ahead on its own stream);
* ``CPU batches + .to``: unienv_mp over a CPU ``StepSampler``, then ``.to("cuda")``;
* ``pin_memory + .to``: unienv_mp with ``pin_memory=True``, then ``.to("cuda",
  non_blocking=True)``, the CPU batch dropped at once (the loop DataLoader users write);
* ``UniEnv in process, device=``: UniEnv's ``StepSampler(rb, B, device="cuda")``;
* ``UniEnv MP shm + .to``: UniEnv's ``MultiprocessingSampler(shared_memory=True)``;
* ``DataLoader pin_memory``: torch's DataLoader (``pin_memory=True``), then
  ``.to("cuda", non_blocking=True)``;
* ``sampler alone``: unienv_mp's CPU batches, no copy;
* ``a pinned batch copied alone``: one ``pin_memory()`` batch copied each step;
* ``GPU-resident rows``: unienv_mp over a ReplayBuffer whose storages are on the GPU (in
  this process), and UniEnv's ``StepSampler`` over the same buffer.

unienv_mp's rows are timed once its slots are made and page-locked: it warms up until a
window of steps saw no registration (`warm_up`), as a training loop's first steps would.

Without CUDA it says so in one line and returns 0.
"""
import time

__all__ = ["run", "warm_up"]

#: Steps in a warm-up window, and the most steps a warm-up takes.
WINDOW = 50
WARM_UP_LIMIT = 4000


def _available():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def _consume(torch, batch, acc):
    for t in _tensors(batch):
        acc += t.sum(dtype=torch.float32)


def _tensors(batch):
    if isinstance(batch, dict):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)
    elif hasattr(batch, "data_ptr"):
        yield batch


def warm_up(sampler, step, window=WINDOW, limit=WARM_UP_LIMIT):
    """Call ``step()`` in windows of ``window`` steps until one saw no slot page-locked
    (``sampler.stats().device.registrations``: slots are made while the pipeline fills),
    at most ``limit`` steps; the steps taken.  For a sampler with no device feed, one
    window."""
    steps = 0
    sampler.stats(reset=True)
    while True:
        for _ in range(window):
            step()
        steps += window
        device = sampler.stats(reset=True).device
        if device is None or device.registrations == 0 or steps >= limit:
            return steps


def _time(torch, next_batch, steps, move, sampler=None):
    acc = torch.zeros((), device="cuda")
    if sampler is None:
        for _ in range(3):   # (warm-up)
            _consume(torch, move(next_batch()), acc)
    else:
        warm_up(sampler, lambda: _consume(torch, move(next_batch()), acc))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        _consume(torch, move(next_batch()), acc)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def _to_cuda(torch, non_blocking=False):
    def move(batch):
        if isinstance(batch, dict):
            return {k: move(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(move(v) for v in batch)
        return batch.to("cuda", non_blocking=non_blocking)
    return move


def _rows(torch, rb, rb_gpu, batch, workers, steps):
    """(name, ms per step or None, error or None, what the device feed did or None) of
    every row, one after the other."""
    from unienv_data.samplers import MultiprocessingSampler as UniEnvMP
    from unienv_data.samplers import StepSampler

    from unienv_mp import MultiprocessingSampler
    keep = lambda b: b   # noqa: E731
    to = _to_cuda(torch)
    out = []

    notes = {}

    def row(name, fn):
        try:
            out.append((name, fn(), None, notes.pop("device", None)))
        except Exception as e:   # (one row failing does not hide the others)
            out.append((name, None, f"{type(e).__name__}: {e}", None))

    def ours(sampler, move, **kw):
        with MultiprocessingSampler(sampler, n_workers=workers, **kw) as m:
            ms = _time(torch, m.sample, steps, move, sampler=m)
            notes["device"] = _device_note(m.stats().device)
            return ms

    def unienv_mp():
        u = UniEnvMP(StepSampler(rb, batch, seed=0), n_workers=workers, shared_memory=True)
        try:
            return _time(torch, u.sample, max(1, steps // 4), to)
        finally:
            u.close()

    def pinned():
        b = {k: v.pin_memory() for k, v in StepSampler(rb, batch, seed=0).sample().items()}
        return _time(torch, lambda: b, steps, _to_cuda(torch, True))

    row("device batches (unienv_mp)",
        lambda: ours(StepSampler(rb, batch, seed=0, device="cuda"), keep))
    row("CPU batches + .to (unienv_mp)", lambda: ours(StepSampler(rb, batch, seed=0), to))
    row("pin_memory + .to non_blocking (unienv_mp)",
        lambda: ours(StepSampler(rb, batch, seed=0), _to_cuda(torch, True), pin_memory=True))
    row("sampler alone (unienv_mp, no copy)",
        lambda: ours(StepSampler(rb, batch, seed=0), lambda b: {}))
    row("UniEnv in process, device=",
        lambda: _time(torch, StepSampler(rb, batch, seed=0, device="cuda").sample, steps, keep))
    row("UniEnv MP shm + .to", unienv_mp)
    row("DataLoader pin_memory + .to", lambda: _dataloader(torch, rb, batch, workers, steps))
    row("a pinned batch copied alone", pinned)
    row("GPU-resident rows (unienv_mp, in process)",
        lambda: ours(StepSampler(rb_gpu, batch, seed=0), keep))
    row("GPU-resident rows (UniEnv in process)",
        lambda: _time(torch, StepSampler(rb_gpu, batch, seed=0).sample, steps, keep))
    return out


def _device_note(stats):
    """What the feed did per batch (``stats()``'s device part), or None."""
    if stats is None or not (stats.copies or stats.pinned_slots):
        return None
    n = max(1, stats.copies)
    copies = (f"copy {stats.copy_seconds / n * 1e3:.3f} ms on the device, the caller spent "
              f"{stats.wait_seconds / n * 1e3:.3f} ms issuing and waiting, "
              if stats.copies else "")
    return (f"{copies}{stats.pinned_slots} slots ({stats.pinned_bytes / 2**20:.0f} MiB) "
            f"page-locked, {stats.registrations} registered while timed, "
            f"{stats.pageable_leaves} arrays copied from pageable memory")


def _dataloader(torch, rb, batch, workers, steps):
    from unienv_data.samplers import StepSampler

    class Batches(torch.utils.data.IterableDataset):
        def __iter__(self):
            s = StepSampler(rb, batch, seed=0)
            while True:
                yield s.sample()

    loader = torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=workers,
                                         pin_memory=True)
    it = iter(loader)
    try:
        return _time(torch, lambda: next(it), steps, _to_cuda(torch, True))
    finally:
        del it


def gpu_copy(rb):
    """The rows of ``rb`` (a ReplayBuffer of PytorchTensorStorage in a DictStorage) in a new
    ReplayBuffer whose storages are on the GPU."""
    import torch
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    space = rb.single_space.to(device="cuda")
    out = ReplayBuffer.create(DictStorage, space,
                              {k: PytorchTensorStorage for k in space.spaces},
                              capacity=len(rb), is_memmap=False)
    for start in range(0, len(rb), 1000):
        rows = rb.get_at(torch.arange(start, min(len(rb), start + 1000)))
        out.extend({k: v.to("cuda") for k, v in rows.items()})
    return out


def run(cfg, workers, quick, build_buffer):
    """Print the case's table; 0.  ``build_buffer(cfg)``: the image buffer on the CPU."""
    why = _available()
    if why is not None:
        print(f"cuda case: skipped, no CUDA here ({why})")
        return 0
    import torch
    rb = build_buffer(cfg)
    rb_gpu = gpu_copy(rb)
    steps = 50 if quick else 400
    rows = _rows(torch, rb, rb_gpu, cfg.batch_size, workers, steps)
    print(f"== cuda == {torch.cuda.get_device_name()}, B={cfg.batch_size}, "
          f"{workers} workers, {steps} steps, {time.strftime('%Y-%m-%d')}")
    width = max(len(r[0]) for r in rows)
    for name, ms, error, note in rows:
        shown = f"{ms:8.3f} ms/step" if error is None else f"failed: {error}"
        print(f"  {name:<{width}}  {shown}")
        if note:
            print(f"  {'':<{width}}    ({note})")
    return 0
