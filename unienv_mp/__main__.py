"""``python -m unienv_mp``: how much faster is unienv_mp here, on this machine?

Builds an in-memory UniEnv ReplayBuffer, then times, one after the other and in one run,
unienv_mp's MultiprocessingSampler (and the same with ``direct_gather=False``), UniEnv's MultiprocessingSampler (with and without
``shared_memory``), sampling in-process with UniEnv's StepSampler, a torch DataLoader
with the same number of workers, ``torch.index_select`` of the StepSampler's indices into
reused output tensors in process (the speed limit of in-process sampling), and a TorchRL
ReplayBuffer with 4 prefetch threads (skipped if torchrl is not installed), all over the
same data; prints a table.
"""
import argparse
import json
import sys

from . import compare


def _shape(text):
    if text.lower() in ("", "none", "0"):
        return ()
    try:
        dims = tuple(int(x) for x in text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an image shape like 3x128x128, got {text!r}")
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"expected positive dimensions, got {text!r}")
    return dims


def _positive(kind):
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}")
        if v <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return v
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m unienv_mp",
        description="Time unienv_mp's MultiprocessingSampler against UniEnv's, in-process "
                    "sampling, a torch DataLoader, index_select into reused memory and "
                    "TorchRL's ReplayBuffer over one in-memory ReplayBuffer.")
    p.add_argument("--case", choices=("image", "state"), default="image",
                   help="image: batches of 256 {state, action, 3x128x128 uint8 image} "
                        "(default); state: batches of 32 {state, action}")
    p.add_argument("--transitions", type=_positive(int), help="steps in the buffer "
                   "(default 20000, fewer if memory is short)")
    p.add_argument("--batch-size", type=_positive(int), help="default 256 (image), 32 (state)")
    p.add_argument("--image-shape", type=_shape, help="e.g. 3x128x128; 'none' for no image")
    p.add_argument("--workers", type=_positive(int), default=4)
    p.add_argument("--buffers", type=_positive(int), default=8, help="batches in flight")
    p.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default="fork")
    p.add_argument("--impl", default=",".join(compare.IMPLEMENTATIONS),
                   help="comma-separated subset of: " + ", ".join(compare.IMPLEMENTATIONS)
                   + " (default: all; index_select: torch.index_select of the StepSampler's "
                   "indices into reused tensors, in process; torchrl: TorchRL "
                   "ReplayBuffer(prefetch=4), skipped if torchrl is not installed)")
    p.add_argument("--seconds", type=_positive(float), default=6.0,
                   help="measuring time per implementation (default 6)")
    p.add_argument("--quick", action="store_true",
                   help="a small buffer and 1.5 s per implementation: a smoke run")
    p.add_argument("--json", action="store_true", help="print machine-readable results")
    p.add_argument("--plot", metavar="FILE.png", help="save a bar chart (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    impls = [x.strip() for x in args.impl.split(",") if x.strip()]
    bad = [x for x in impls if x not in compare.IMPLEMENTATIONS]
    if bad or not impls:
        p.error(f"--impl: unknown {bad}; choose from {', '.join(compare.IMPLEMENTATIONS)}")
    args.impls = impls
    return args


def _available_memory():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def make_config(args):
    cfg = compare.Config(workers=args.workers, buffers=args.buffers,
                         start_method=args.start_method, seconds=args.seconds)
    if args.case == "state":
        cfg.batch_size, cfg.image_shape = 32, ()
    if args.batch_size:
        cfg.batch_size = args.batch_size
    if args.image_shape is not None:
        cfg.image_shape = args.image_shape
    if args.quick:
        cfg.transitions, cfg.seconds, cfg.warmup = 2000, 1.5, 2
    if args.transitions:
        cfg.transitions = args.transitions
    cfg.transitions = max(cfg.transitions, cfg.batch_size)
    row = 17 * 4 + (int(_prod(cfg.image_shape)) if cfg.image_shape else 0)
    mem = _available_memory()
    note = None
    if mem is not None and args.transitions is None and row * cfg.transitions > mem // 4:
        # The buffer, plus what samplers and workers allocate, must fit comfortably.
        fit = max(cfg.batch_size * 4, mem // 4 // row)
        note = (f"only {mem / 2**30:.1f} GiB of memory available: using {fit} transitions "
                f"instead of {cfg.transitions}")
        cfg.transitions = fit
    return cfg, note


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


class _Progress:
    def __init__(self, enabled):
        self.tqdm = None
        if enabled:
            try:
                from tqdm import tqdm
                self.tqdm = tqdm
            except ImportError:
                pass

    def bar(self, total, desc, unit):
        if self.tqdm is None:
            print(desc + " ...", file=sys.stderr, flush=True)
            return _NoBar()
        # disable=None: no bar when stderr is not a terminal (logs, CI)
        return self.tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr,
                         disable=None, bar_format="{desc:<44} {bar} {percentage:3.0f}%")


class _NoBar:
    n = 0

    def update(self, n=1):
        pass

    def close(self):
        pass


def _versus(ratio):
    """How unienv_mp compares, from ``ratio`` = other's ms/batch / unienv_mp's: "2.3x faster",
    or "1.3x slower" where unienv_mp loses (never "0.8x faster")."""
    factor, word = (ratio, "faster") if ratio >= 1 else (1 / ratio, "slower")
    # two decimals near 1, where one would read "1.0x" for both a win and a loss
    return f"{factor:.2f}x {word}" if factor < 1.05 else f"{factor:.1f}x {word}"


def render_table(results, cfg):
    ups = compare.speedups(results)
    head = ["implementation", "ms/batch", "batches/s", "MB/s", "main CPU ms/batch",
            "unienv_mp is"]
    rows = []
    for r in results:
        if r.error:
            rows.append([r.label, "-", "-", "-", "-", "failed: " + r.error[:60]])
            continue
        up = "-" if r.name == "unienv_mp" else (
            _versus(ups[r.name]) if r.name in ups else "n/a")
        rows.append([r.label, f"{r.ms_per_batch:.3f}", f"{r.batches_per_s:,.0f}",
                     f"{r.mb_per_s:,.0f}", f"{r.main_cpu_ms_per_batch:.3f}", up])
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    line = "  ".join("-" * w for w in widths)
    fmt = lambda cells: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    img = "x".join(map(str, cfg.image_shape)) if cfg.image_shape else "no image"
    title = (f"{cfg.transitions} transitions, batches of {cfg.batch_size} "
             f"(state 10 f32, action 7 f32, image {img}), {cfg.workers} workers, "
             f"{cfg.buffers} buffers, {cfg.start_method}; each batch touched once per 4 KiB")
    notes = ("ms/batch: wall-clock time per batch in a loop that only reads batches.  "
             "main CPU: CPU time of this process (all its threads) per batch, i.e. what the "
             "training loop gives up to sampling; workers' CPU is not counted.")
    return "\n".join([title, fmt(head), line] + [fmt(r) for r in rows] + ["", notes])


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install 'unienv_mp[plot]'", file=sys.stderr)
        return False
    ok = [r for r in results if r.batches]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(ok) + 1.5))
    ax.barh([r.label for r in ok], [r.ms_per_batch for r in ok],
            color=["tab:green" if r.name == "unienv_mp" else "tab:gray" for r in ok])
    ax.invert_yaxis()
    ax.set_xlabel("ms per batch (lower is better)")
    for i, r in enumerate(ok):
        ax.text(r.ms_per_batch, i, f" {r.ms_per_batch:.3g}", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None):
    args = parse_args(argv)
    missing = compare.available()
    impls = []
    for name in args.impls:
        if name in missing:
            print(f"skipping {compare.LABELS[name]}: {missing[name]}", file=sys.stderr)
        else:
            impls.append(name)
    if not impls:
        print("nothing to compare here: " + "; ".join(sorted(set(missing.values()))),
              file=sys.stderr)
        return 2
    cfg, note = make_config(args)
    if note:
        print(note, file=sys.stderr)
    progress = _Progress(not args.no_progress and not args.json)
    bar = progress.bar(cfg.transitions, "building the replay buffer", "steps")
    rb = compare.build_buffer(cfg, bar.update)
    bar.close()
    results = []
    for name in impls:
        bar = progress.bar(100, f"timing {compare.LABELS[name]}", "%")
        last = [0]

        def advance(fraction, bar=bar, last=last):
            step = int(fraction * 100)
            if step > last[0]:
                bar.update(step - last[0])
                last[0] = step

        results.append(compare.measure(name, rb, cfg, advance))
        bar.close()
    if args.json:
        print(json.dumps({"config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
                          "results": [r.as_dict() for r in results],
                          "speedup_of_unienv_mp": compare.speedups(results),
                          "skipped": {k: missing[k] for k in args.impls if k in missing}},
                         indent=2))
    else:
        print(render_table(results, cfg))
    if args.plot and plot(results, args.plot):
        print(f"plot saved to {args.plot}", file=sys.stderr)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
