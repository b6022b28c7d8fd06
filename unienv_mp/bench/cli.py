"""``python -m unienv_mp``: how much faster is unienv_mp here, on this machine?

Runs one case of ``config.CASES`` (``--case``; ``--case all`` runs every one), timing its
rows one after the other, in one run, over the same data, and prints one table per case:

* ``image``, ``state``: batches/s of ``sample()`` from an in-memory UniEnv ReplayBuffer:
  unienv_mp's MultiprocessingSampler (and the same with ``direct_gather=False``), UniEnv's
  MultiprocessingSampler (with and without ``shared_memory``), sampling in-process with
  UniEnv's StepSampler, a torch DataLoader with the same number of workers,
  ``torch.index_select`` of the StepSampler's indices into reused output tensors in
  process (the speed limit of in-process sampling), and a TorchRL ReplayBuffer with 4
  prefetch threads (skipped if torchrl is not installed);
* ``jpeg``: the same where every row decodes a JPEG file (UniEnv's ImageStorage);
* ``online``: a loop that appends to a shared buffer before every ``sample()``: ms per
  step, and how stale the batches are;
* ``latency``: the time to one batch when nothing was prefetched;
* ``epoch``: seconds per epoch of ``epoch_iter()``, the first and the later ones;
* ``windows``: an observation history and an action chunk of one step per element
  (``WindowedBatch``), against the ways users make it today;
* ``storages``: a row per UniEnv storage backend on disk (``unienv_mp.bench.storages``).

``--workers 1,2,4,8`` times every worker count (a sweep).
"""
import argparse
import importlib.util
import json
import sys
import textwrap

from . import peers
from .config import CASES, DEFAULT_IMPLEMENTATIONS, IMPLEMENTATIONS, Case, case_config
from .plots import plot_path, pyplot, save_figure
from .progress import Progress
from .runner import config_dict, run_case


def _cases_epilog():
    lines = ["cases:"]
    for name, case in list(CASES.items()) + [
            ("all", Case("all", "", (), "every case but storages and cuda, one after the "
                                        "other")),
            ("cuda", Case("cuda", "", (), "image batches taken to a GPU, every way side by "
                                          "side (needs CUDA; says so and exits 0 without)"))]:
        lines += textwrap.wrap(case.summary, width=88, initial_indent=f"  {name:<9}",
                               subsequent_indent=" " * 11, break_on_hyphens=False)
    return "\n".join(lines)


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


def _counts(text):
    """``4`` or ``1,2,4,8``: worker counts, in the order given, without repeats."""
    counts = []
    for part in text.split(","):
        n = _positive(int)(part.strip())
        if n not in counts:
            counts.append(n)
    return counts


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m unienv_mp",
        description="Time unienv_mp's MultiprocessingSampler against UniEnv's, in-process "
                    "sampling, a torch DataLoader, index_select into reused memory and "
                    "TorchRL's ReplayBuffer, on the workloads of --case.",
        epilog=_cases_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=tuple(CASES) + ("all", "cuda"), default="image",
                   help="the workload (see below; default image)")
    p.add_argument("--transitions", type=_positive(int), help="steps in the buffer "
                   "(default 20000; jpeg 4000; online: the capacity, half filled at "
                   "the start; fewer if memory is short)")
    p.add_argument("--batch-size", type=_positive(int),
                   help="default 256 (image, online, latency), 32 (state), 64 (jpeg)")
    p.add_argument("--image-shape", type=_shape, help="e.g. 3x128x128; 'none' for no image "
                   "(jpeg: 3xHxW, stored and sampled as HxWx3; online has no image)")
    p.add_argument("--workers", type=_counts, default=[4],
                   help="worker processes (default 4); a comma-separated list such as "
                        "1,2,4,8 times each count: batches/s against workers for image, "
                        "state and jpeg (rows without workers run once), a row per "
                        "count for online and latency")
    p.add_argument("--buffers", type=_positive(int), default=None,
                   help="batches requested ahead, every row (default 8; the ray row: "
                        "RaySampler's default)")
    p.add_argument("--append", type=_positive(int), default=4,
                   help="online: transitions appended per loop step (default 4)")
    p.add_argument("--epochs", type=_positive(int), default=4,
                   help="epoch: epochs timed per row, the first then the later (default 4)")
    p.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default="fork")
    p.add_argument("--impl", default=",".join(DEFAULT_IMPLEMENTATIONS),
                   help="comma-separated subset of: " + ", ".join(IMPLEMENTATIONS)
                   + " (default: all but ray; each case runs those of its rows that are "
                   "listed; index_select: torch.index_select of the StepSampler's "
                   "indices into reused tensors, in process; torchrl: TorchRL "
                   "ReplayBuffer(prefetch=4), skipped if torchrl is not installed; ray: "
                   "unienv_mp's RaySampler on a local Ray, in the image, state and jpeg "
                   "cases, skipped if ray is not installed.  --impl ray alone adds the "
                   "ray row to the default rows)")
    p.add_argument("--seconds", type=_positive(float), default=6.0,
                   help="measuring time per row (default 6)")
    p.add_argument("--quick", action="store_true",
                   help="a small buffer and 1.5 s per row: a smoke run")
    p.add_argument("--json", action="store_true", help="print machine-readable results")
    p.add_argument("--plot", metavar="FILE.png",
                   help="save a chart (needs matplotlib): ms and main CPU per batch, or "
                        "batches/s against workers with --workers 1,2,...; with --case "
                        "all, one file per case, named FILE-CASE.png")
    p.add_argument("--no-progress", action="store_true",
                   help="say nothing while working (by default: a bar per row on a "
                        "terminal, else a line as each row starts and finishes)")
    args = p.parse_args(argv)
    impls = [x.strip() for x in args.impl.split(",") if x.strip()]
    # the rows asked for by name (the default list's are skipped where they cannot run)
    args.named = [] if args.impl == ",".join(DEFAULT_IMPLEMENTATIONS) else impls
    if impls == ["ray"]:
        impls = list(DEFAULT_IMPLEMENTATIONS) + impls
    bad = [x for x in impls if x not in IMPLEMENTATIONS]
    if bad or not impls:
        p.error(f"--impl: unknown {bad}; choose from {', '.join(IMPLEMENTATIONS)}")
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


def make_config(args, case=None):
    """(``Config`` for ``case`` (default ``args.case``) from the options, a note
    to print or None).  The first of ``--workers`` is the config's worker count."""
    case = case or args.case
    buffers = {} if args.buffers is None else {"buffers": args.buffers,
                                                "ray_buffers": args.buffers}
    cfg = case_config(case, quick=args.quick, workers=args.workers[0],
                      start_method=args.start_method, append=args.append,
                      epochs=args.epochs, **buffers)
    if not args.quick:
        cfg.seconds = args.seconds
    if args.batch_size:
        cfg.batch_size = args.batch_size
    if args.image_shape is not None and case != "online":
        cfg.image_shape = args.image_shape
    if args.transitions:
        cfg.transitions = args.transitions
    cfg.transitions = max(cfg.transitions, cfg.batch_size)
    # jpeg: images on disk; online: none; views: the buffer and its two halves, twice it
    in_memory = case in ("image", "state", "latency", "views", "epoch", "windows")
    row = 17 * 4 + (int(_prod(cfg.image_shape)) if cfg.image_shape and in_memory else 0)
    row *= 2 if case == "views" else 1
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


def missing_dependencies(args, missing):
    """What the options ask for that this machine lacks, each with its install command:
    matplotlib for ``--plot``, and the rows named in ``--impl`` (torchrl, ray); checked
    before anything is measured.  (Rows of the default list that cannot run here are
    skipped instead, saying so.)"""
    out = []
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        out.append("--plot needs matplotlib: pip install 'unienv_mp[plot]'")
    out += [f"--impl {name}: {missing[name]}" for name in args.named
            if name in _OPTIONAL_ROWS and name in missing]
    return out


#: The rows that need an optional dependency (the extras of the docs' "Installing").
_OPTIONAL_ROWS = ("torchrl", "ray")


def main(argv=None):
    """The main job: measure the cases asked for, print their tables (or ``--json``),
    draw their charts (``--plot``); 2 where nothing ran or an option cannot be met
    here, 1 where a row failed."""
    args = parse_args(argv)
    if args.case == "cuda":
        from . import cuda, data
        cfg, _ = make_config(args, "image")
        return cuda.run(cfg, args.workers[0], args.quick, data.build_buffer)
    missing = peers.available()
    lacking = missing_dependencies(args, missing)
    if lacking:
        for line in lacking:
            print(line, file=sys.stderr)
        return 2
    cases = [c for c in CASES if CASES[c].in_all] if args.case == "all" else [args.case]
    runs = _run_cases(args, cases, missing)
    if not runs:
        return 2
    if args.json:
        print(json.dumps(runs[0].payload if len(cases) == 1 else
                         {"cases": [r.payload for r in runs]}, indent=2))
    if args.plot:
        _save_plots(args.plot, runs, len(cases) > 1)
    return 1 if any(r.failed for r in runs) else 0


def _say_once():
    """``say(message)``: print ``message`` on stderr, once however often it is said."""
    said = set()

    def say(message):
        if message not in said:
            said.add(message)
            print(message, file=sys.stderr)
    return say


def _run_cases(args, cases, missing):
    """Run each of ``cases`` with the options ``args``: their ``CaseRun``s, each with its
    JSON payload complete, each table printed as its case ends (unless ``--json``)."""
    progress = Progress(not args.no_progress and not args.json)
    say = _say_once()
    runs = []
    for case in cases:
        cfg, note = make_config(args, case)
        if note:
            say(note)
        run = run_case(case, cfg, args.impls, args.workers, missing, progress, say)
        if run is None:
            continue
        config = config_dict(run.cfg)
        if len(args.workers) > 1:
            config["workers"] = list(args.workers)
        run.payload = {"case": case, "config": config, **run.payload, "skipped": run.skipped}
        runs.append(run)
        if not args.json:
            if len(cases) > 1:
                print(f"== {case} ==")
            print(run.table.format())
            if len(cases) > 1:
                print()
    return runs


def _save_plots(path, runs, several):
    plt = pyplot()
    if plt is None:
        return
    for run in runs:
        if run.figure is None:
            print(f"no chart for case {run.case}", file=sys.stderr)
            continue
        where = plot_path(path, run.case, several)
        save_figure(plt, run.figure(plt), where)
        print(f"plot saved to {where}", file=sys.stderr)
