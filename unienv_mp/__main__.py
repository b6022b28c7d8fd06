"""``python -m unienv_mp``: how much faster is unienv_mp here, on this machine?

Runs one case of ``compare.CASES`` (``--case``; ``--case all`` runs every one), timing its
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
* ``epoch``: seconds per epoch of ``epoch_iter()``, the first and the later ones.

``--workers 1,2,4,8`` times every worker count (a sweep).
"""
import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import textwrap
import time
from dataclasses import dataclass, field, replace
from typing import List

from . import compare

def _cases_epilog():
    lines = ["cases:"]
    for name, case in list(compare.CASES.items()) + [
            ("all", compare.Case("all", "", (), "every case, one after the other"))]:
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
    p.add_argument("--case", choices=tuple(compare.CASES) + ("all",), default="image",
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
    p.add_argument("--buffers", type=_positive(int), default=8, help="batches in flight")
    p.add_argument("--append", type=_positive(int), default=4,
                   help="online: transitions appended per loop step (default 4)")
    p.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default="fork")
    p.add_argument("--impl", default=",".join(compare.DEFAULT_IMPLEMENTATIONS),
                   help="comma-separated subset of: " + ", ".join(compare.IMPLEMENTATIONS)
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
    args.named = [] if args.impl == ",".join(compare.DEFAULT_IMPLEMENTATIONS) else impls
    if impls == ["ray"]:
        impls = list(compare.DEFAULT_IMPLEMENTATIONS) + impls
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


def make_config(args, case=None):
    """(``compare.Config`` for ``case`` (default ``args.case``) from the options, a note
    to print or None).  The first of ``--workers`` is the config's worker count."""
    case = case or args.case
    cfg = compare.case_config(case, quick=args.quick, workers=args.workers[0],
                              buffers=args.buffers, start_method=args.start_method,
                              append=args.append)
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
    in_memory = case in ("image", "state", "latency", "views", "epoch")
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


class _Progress:
    """What the main job says while it works, on stderr: a bar per row where stderr is a
    terminal (and tqdm is installed), else a line as each row starts and one as it
    finishes (a CI log, ``| tee``, a notebook); nothing at all when not ``enabled``
    (``--no-progress``, ``--json``)."""

    def __init__(self, enabled):
        self.enabled = enabled
        self.tqdm = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.tqdm = tqdm
            except ImportError:
                pass

    def bar(self, total, desc, unit):
        if not self.enabled:
            return _NoBar()
        if self.tqdm is None:
            return _LineBar(desc)
        return self.tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr,
                         bar_format="{desc:<44} {bar} {percentage:3.0f}%")

    def timing(self, desc):
        """A bar for one measurement: ``(advance(fraction done), close())``."""
        bar = self.bar(100, desc, "%")
        last = [0]

        def advance(fraction):
            step = int(fraction * 100)
            if step > last[0]:
                bar.update(step - last[0])
                last[0] = step
        return advance, bar.close


class _LineBar:
    """A line when it starts, one when it is closed (with the seconds between)."""

    def __init__(self, desc):
        self.desc = desc
        self.start = time.perf_counter()
        print(f"{desc} ...", file=sys.stderr, flush=True)

    def update(self, n=1):
        pass

    def close(self):
        print(f"{self.desc}: done in {time.perf_counter() - self.start:.1f} s",
              file=sys.stderr, flush=True)


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


# ---------------------------------------------------------------------------------------
# tables: one per case, each a title, a header, rows and the notes printed under it
# ---------------------------------------------------------------------------------------

@dataclass
class Table:
    title: str
    head: List[str]
    rows: List[List[str]]
    notes: List[str] = field(default_factory=list)

    def format(self):
        widths = [max(len(str(x[i])) for x in self.rows + [self.head])
                  for i in range(len(self.head))]
        line = "  ".join("-" * w for w in widths)

        def fmt(cells):
            return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths)))
        out = [self.title, fmt(self.head), line] + [fmt(r) for r in self.rows]
        return "\n".join(out + ([""] + self.notes if self.notes else []))


_TOUCH = "each batch touched once per 4 KiB"
_MAIN_CPU = ("main CPU: CPU time of this process (all its threads) per batch, i.e. what the "
             "training loop gives up to sampling; workers' CPU is not counted.")


def _setup(cfg, workers=True):
    w = f"{cfg.workers} workers, " if workers else ""
    return f"{w}{cfg.buffers} buffers, {cfg.start_method}"


def throughput_table(results, cfg, case="image"):
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
    title = (f"{cfg.transitions} transitions, batches of {cfg.batch_size} "
             f"({compare.describe(case, cfg)}), {_setup(cfg)}; {_TOUCH}")
    notes = ["ms/batch: wall-clock time per batch in a loop that only reads batches.  "
             + _MAIN_CPU]
    return Table(title, head, rows, notes + where_time_went(results))


def where_time_went(results):
    """Lines saying where unienv_mp's time went in the measured batches (from its
    ``stats()``): the workers' busy and CPU time, the caller's waiting, the bottleneck and
    one line of advice."""
    out = []
    for r in results:
        st = r.stats
        if st is None or r.error or not st.workers:
            continue
        cpu = [w.cpu_fraction for w in st.workers if w.cpu_fraction is not None]
        cpu_text = f" (on a CPU {100 * sum(cpu) / len(cpu):.0f} %)" if cpu else ""
        out.append(f"Where {r.label}'s time went: workers busy "
                   f"{100 * st.busy_fraction:.0f} % of the time{cpu_text}, the caller "
                   f"waiting {100 * st.wait_fraction:.0f} %; bottleneck: {st.bottleneck}.  "
                   f"{st.advice()[0].upper()}{st.advice()[1:]}.")
    return out


def render_table(results, cfg, case="image"):
    return throughput_table(results, cfg, case).format()


def _workers_cell(workers):
    return "-" if workers is None else str(workers)


def _unienv_mp_is(points, w, r, value, swept, same=lambda ref, r: True):
    """The "unienv_mp is" cell of row ``r`` (run with ``w`` workers) of a table of
    (workers, result) ``points``: ``value`` (lower is better) against unienv_mp's rows
    with as many workers (all of them, for a row without workers in a sweep) for which
    ``same(ref, r)``."""
    if r.name == "unienv_mp":
        return "-"
    refs = sorted(((v, ref) for v, ref in points
                   if ref.name == "unienv_mp" and not ref.error and same(ref, r)
                   and (w is None or v == w) and value(ref) > 0),
                  key=lambda p: p[0] or 0)
    return "; ".join(_versus(value(r) / value(ref))
                     + (f" (vs {v} workers)" if swept and w is None else "")
                     for v, ref in refs) or "n/a"


def online_table(points, cfg):
    """``points``: (worker count or None, ``compare.OnlineResult``) pairs."""
    swept = len({w for w, _ in points if w is not None}) > 1
    head = (["implementation"] + (["workers"] if swept else [])
            + ["ms/step", "steps/s", "main CPU ms/step", "stale mean", "p50", "p99", "max",
               "unienv_mp is"])
    rows = []
    for w, r in points:
        lead = [r.label] + ([_workers_cell(w)] if swept else [])
        if r.error:
            rows.append(lead + ["-"] * 7 + ["failed: " + r.error[:60]])
            continue
        st = r.staleness_stats()
        up = _unienv_mp_is(points, w, r, lambda x: x.ms_per_batch, swept)
        rows.append(lead + [f"{r.ms_per_batch:.3f}", f"{r.batches_per_s:,.0f}",
                            f"{r.main_cpu_ms_per_batch:.3f}", f"{st['mean']:.1f}",
                            f"{st['p50']:.0f}", f"{st['p99']:.0f}", str(st["max"]), up])
    title = (f"online: a buffer of capacity {cfg.transitions} shared between processes "
             f"(multiprocessing=True), half full at the start; each loop step appends "
             f"{cfg.append} transitions, then samples a batch of {cfg.batch_size} "
             f"({compare.describe('online', cfg)}); "
             f"{_setup(cfg, workers=not swept)}; {_TOUCH}")
    notes = [f"ms/step: wall-clock time per loop step (append {cfg.append} transitions, "
             f"set the clock column, sample(), read the batch).  main CPU: as ms/step, "
             f"CPU time of this process.",
             "stale: loop steps between the newest step written (t, this step) and the "
             "newest step the batch could contain: the largest clock among its rows, i.e. "
             "the last step whose writes had landed when its rows were read (0: read "
             f"after this step's writes; x {cfg.append} for transitions)."]
    return Table(title, head, rows, notes)


def latency_table(points, cfg):
    """``points``: (worker count or None, ``compare.LatencyResult``) pairs."""
    swept = len({w for w, _ in points if w is not None}) > 1
    head = (["implementation"] + (["workers"] if swept else [])
            + ["asked for by", "runs", "p50 ms", "p99 ms", "unienv_mp is"])
    rows = []
    for w, r in points:
        lead = [r.label] + ([_workers_cell(w)] if swept else []) + [r.trigger_label]
        if r.skipped:
            rows.append(lead + ["-", "-", "-", "n/a (see below)"])
            continue
        if r.error:
            rows.append(lead + ["-", "-", "-", "failed: " + r.error[:60]])
            continue
        up = _unienv_mp_is(points, w, r, lambda x: x.p50_ms if x.times else 0.0, swept,
                           lambda ref, x: ref.trigger == x.trigger)
        rows.append(lead + [str(len(r.times)), f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}", up])
    title = (f"latency: one batch of {cfg.batch_size} ({compare.describe('latency', cfg)}) "
             f"from {cfg.transitions} transitions in memory, with nothing prefetched; "
             f"{_setup(cfg, workers=not swept)}; {_TOUCH}")
    notes = [f"Time from asking for the batch to having read it, p50 and p99 over the runs "
             f"(with fewer than 100 runs, p99 lies between the two slowest); each run "
             f"follows a {compare.LATENCY_PAUSE_S * 1e3:.0f} ms pause, so that workers "
             f"are idle.  unienv_mp is: by p50, against the same way of asking.",
             "manual_seed(), then sample(): the sampler already runs; "
             "first batch of a new epoch_iter(): over data not shared between processes, "
             "UniEnv's sampler starts workers for each epoch, unienv_mp runs it on the "
             "workers it kept (the data is unchanged); first sample() of a new sampler: "
             "includes starting the workers."]
    notes += list(dict.fromkeys(f"{r.label}, {r.trigger_label}: n/a: {r.skipped}."
                                for _, r in points if r.skipped))
    return Table(title, head, rows, notes)


_VIEW_PEERS = (("in_process", "in process"), ("unienv_shm", "UniEnv shm"),
               ("index_select", "bare limit"))


def views_table(results, cfg):
    """``results``: {view name: {implementation: ``compare.Result`` or None}}: a row per
    view, a column of ms/batch per implementation, then how unienv_mp compares."""
    names = list(dict.fromkeys(n for row in results.values() for n, r in row.items()
                               if r is not None))
    short = {"unienv_mp": "unienv_mp", "unienv_mp_generic": "generic path",
             "unienv_shm": "UniEnv shm", "in_process": "in process",
             "index_select": "bare limit", "torchrl": "TorchRL SliceSampler"}
    head = (["view"] + [f"{short.get(n, n)} ms" for n in names]
            + [f"unienv_mp vs {label}" for key, label in _VIEW_PEERS if key in names])
    rows = []
    failed = []
    for view, row in results.items():
        cells = [compare.VIEWS[view].label]
        for n in names:
            r = row.get(n)
            if r is None:
                cells.append("-")
            elif r.error:
                cells.append("failed")
                failed.append(f"{compare.VIEWS[view].label}, {compare.LABELS[n]}: {r.error}")
            else:
                cells.append(f"{r.ms_per_batch:.3f}")
        ours = row.get("unienv_mp")
        for key, _ in _VIEW_PEERS:
            if key not in names:
                continue
            other = row.get(key)
            if (ours is None or other is None or ours.error or other.error
                    or not ours.batches or not other.batches):
                cells.append("n/a")
            else:
                cells.append(_versus(other.ms_per_batch / ours.ms_per_batch))
        rows.append(cells)
    title = (f"views: batches of {cfg.batch_size} from {cfg.transitions} steps "
             f"({compare.describe('views', cfg)}), {_setup(cfg)}; {_TOUCH}")
    notes = ["ms/batch: wall-clock time per batch of sample() in a loop that only reads "
             "batches.  bare limit: the view's final rows and valid mask worked out in this "
             "process as unienv_mp's workers work them out, then torch.index_select into "
             "memory allocated once (a batch valid until the next).  TorchRL SliceSampler: "
             "ReplayBuffer(prefetch=4) over the action and episode_id columns, slices of 16 "
             "within an episode (its only row)."]
    ours = [dataclasses.replace(row["unienv_mp"], label=f"{view}: unienv_mp")
            for view, row in results.items() if row.get("unienv_mp") is not None]
    return Table(title, head, rows, notes + [f"failed: {x}" for x in failed]
                 + where_time_went(ours))


def epoch_table(points, cfg):
    """``points``: (worker count or None, ``compare.EpochResult``) pairs."""
    swept = len({w for w, _ in points if w is not None}) > 1
    head = (["implementation"] + (["workers"] if swept else [])
            + ["first epoch s", "later epochs s", "first batch ms, first epoch",
               "first batch ms, later epochs", "unienv_mp is (later epochs)"])
    rows = []
    for w, r in points:
        lead = [r.label] + ([_workers_cell(w)] if swept else [])
        if r.error:
            rows.append(lead + ["-"] * 4 + ["failed: " + r.error[:60]])
            continue
        up = _unienv_mp_is(points, w, r, lambda x: x.later_epoch_s if x.seconds else 0.0,
                           swept)
        if r.name == "unienv_mp_sample":
            rows.append(lead + ["-", f"{r.later_epoch_s:.3f}", "-", "-", up])
            continue
        rows.append(lead + [f"{r.first_epoch_s:.3f}", f"{r.later_epoch_s:.3f}",
                            f"{r.first_batch_first_ms:.1f}", f"{r.first_batch_later_ms:.1f}",
                            up])
    batches = next((r.batches for _, r in points if r.batches), 0)
    title = (f"epoch: seconds per epoch of epoch_iter(), {batches} batches of "
             f"{cfg.batch_size} ({compare.describe('epoch', cfg)}) over {cfg.transitions} "
             f"transitions in memory, {cfg.epochs} epochs per row; "
             f"{_setup(cfg, workers=not swept)}; {_TOUCH}")
    notes = ["first epoch: includes starting the workers where the row starts them then "
             "(unienv_mp and UniEnv's sampler: at the epoch; the DataLoader: at its first "
             "iter()).  later epochs: the median of the others.  UniEnv's sampler starts "
             "new workers for every epoch over unshared data; unienv_mp runs later epochs "
             "on the workers it kept while the data is unchanged (persistent_workers).",
             f"{compare.LABELS['unienv_mp_sample']}: as many sample() batches of a "
             f"running unienv_mp sampler as an epoch has (the steady state an epoch is "
             f"compared with), timed {cfg.epochs - 1} times after as many untimed."]
    return Table(title, head, rows, notes)


def sweep_table(points, cfg, case):
    """``points``: (worker count or None, ``compare.Result``) pairs; None for rows that
    use no workers (run once)."""
    counts = sorted({w for w, _ in points if w is not None})
    names = list(dict.fromkeys(r.name for _, r in points))
    head = (["implementation"] + [f"{w} worker{'s' if w > 1 else ''}" for w in counts]
            + ["no workers"])
    rows = []
    for name in names:
        cells = {w: r for w, r in points if r.name == name}
        label = next(r.label for _, r in points if r.name == name)

        def cell(w):
            r = cells.get(w)
            if r is None:
                return ""
            return "failed" if r.error else f"{r.batches_per_s:,.0f}"
        rows.append([label] + [cell(w) for w in counts] + [cell(None)])
    title = (f"{case}: batches/s against workers; {cfg.transitions} transitions, batches of "
             f"{cfg.batch_size} ({compare.describe(case, cfg)}), {_setup(cfg, workers=False)}; "
             f"{_TOUCH}")
    notes = ["batches/s: in a loop that only reads batches; rows without workers "
             "(in process, TorchRL's threads) run once, in the last column."]
    failed = [f"{r.label} ({w} workers): {r.error}" for w, r in points if r.error]
    return Table(title, head, rows, notes + [f"failed: {x}" for x in failed])


# ---------------------------------------------------------------------------------------
# charts
# ---------------------------------------------------------------------------------------

def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install 'unienv_mp[plot]'", file=sys.stderr)
        return None
    return plt


def _bar_panels(plt, labels, highlight, panels, title):
    """One horizontal bar chart per panel (x label, values), side by side, sharing the
    row labels; the ``highlight`` rows in green."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 3,
                                                      0.5 * len(labels) + 1.8),
                             sharey=True, squeeze=False)
    colors = ["tab:green" if h else "tab:gray" for h in highlight]
    for ax, (xlabel, values) in zip(axes[0], panels):
        ax.barh(range(len(labels)), values, color=colors)
        if _spans_decade(values):   # (a linear axis would hide the short bars)
            ax.set_xscale("log")
            xlabel += ", log scale"
        ax.set_xlabel(xlabel)
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.3g}", va="center", fontsize=8)
        ax.margins(x=0.25)
    axes[0][0].set_yticks(range(len(labels)))
    axes[0][0].set_yticklabels(labels)
    axes[0][0].invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _spans_decade(values):
    """Whether positive ``values`` span more than 10x (then an axis is drawn log scale)."""
    positive = [v for v in values if v and v > 0]
    return bool(positive) and max(positive) > 10 * min(positive)


def _chart_title(case, cfg):
    """A chart's title: the case, with its batch size and worker count where known."""
    if cfg is None:
        return case
    return f"{case}: batches of {cfg.batch_size}, {cfg.workers} workers, {cfg.start_method}"


def table_figure(plt, results, case, cfg=None):
    ok = [r for r in results if r.batches and not r.error]
    return _bar_panels(plt, [r.label for r in ok], [r.name == "unienv_mp" for r in ok],
                       [("ms per batch (lower is better)", [r.ms_per_batch for r in ok]),
                        ("main CPU ms per batch (lower is better)",
                         [r.main_cpu_ms_per_batch for r in ok])], _chart_title(case, cfg))


def views_figure(plt, results):
    """ms per batch of each view (a group of bars per view), log scale: the rows span
    several orders of magnitude."""
    names = list(dict.fromkeys(n for row in results.values() for n, r in row.items()
                               if r is not None and not r.error and r.batches))
    views = list(results)
    fig, ax = plt.subplots(figsize=(11, 0.9 * len(views) * max(1, len(names)) / 3 + 2))
    height = 0.8 / max(1, len(names))
    cmap = plt.get_cmap("tab10")
    for j, n in enumerate(names):
        ys, xs = [], []
        for i, v in enumerate(views):
            r = results[v].get(n)
            if r is not None and not r.error and r.batches:
                ys.append(i + j * height)
                xs.append(r.ms_per_batch)
        ax.barh(ys, xs, height=height, label=compare.LABELS[n],
                color="tab:green" if n == "unienv_mp" else cmap(j % 10))
    ax.set_xscale("log")
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(views))])
    ax.set_yticklabels([compare.VIEWS[v].label for v in views], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per batch (log scale; lower is better)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("views: batches of 256", fontsize=10)
    fig.tight_layout()
    return fig


def online_figure(plt, points):
    ok = [(w, r) for w, r in points if r.batches and not r.error]
    swept = len({w for w, _ in ok if w is not None}) > 1
    labels = [r.label + (f" ({w})" if swept and w is not None else "") for w, r in ok]
    return _bar_panels(plt, labels, [r.name == "unienv_mp" for _, r in ok],
                       [("ms per loop step (lower is better)", [r.ms_per_batch for _, r in ok]),
                        ("mean staleness, loop steps", [r.staleness_stats()["mean"]
                                                        for _, r in ok])], "online")


def latency_figure(plt, points):
    ok = [(w, r) for w, r in points if r.times and not r.error]
    swept = len({w for w, _ in ok if w is not None}) > 1
    labels = [f"{r.label}: {r.trigger_label}" + (f" ({w})" if swept and w is not None else "")
              for w, r in ok]
    return _bar_panels(plt, labels, [r.name == "unienv_mp" for _, r in ok],
                       [("p50 ms", [r.p50_ms for _, r in ok]),
                        ("p99 ms", [r.p99_ms for _, r in ok])], "latency")


def epoch_figure(plt, points):
    ok = [(w, r) for w, r in points if r.seconds and not r.error]
    swept = len({w for w, _ in ok if w is not None}) > 1
    labels = [r.label + (f" ({w})" if swept and w is not None else "") for w, r in ok]
    return _bar_panels(plt, labels, [r.name == "unienv_mp" for _, r in ok],
                       [("first epoch s", [r.first_epoch_s for _, r in ok]),
                        ("later epochs s", [r.later_epoch_s for _, r in ok])], "epoch")


def sweep_figure(plt, points, case, cfg=None):
    """batches/s against workers, a line per implementation; rows without workers as
    horizontal lines; the legend beside the data, a log axis where rows span more than
    10x (so that the slow rows' lines stay apart)."""
    fig, ax = plt.subplots(figsize=(11, 5))
    counts = sorted({w for w, _ in points if w is not None})
    names = list(dict.fromkeys(r.name for _, r in points))
    for name in names:
        mine = sorted(((w, r) for w, r in points if r.name == name and not r.error
                       and r.batches), key=lambda p: p[0] or 0)
        if not mine:
            continue
        label = mine[0][1].label
        if mine[0][0] is None:
            ax.axhline(mine[0][1].batches_per_s, linestyle="--", label=label,
                       color="black" if name == "in_process" else None)
        else:
            ax.plot([w for w, _ in mine], [r.batches_per_s for _, r in mine], marker="o",
                    label=label, linewidth=2.5 if name == "unienv_mp" else 1.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts)
    ax.set_xticklabels([str(w) for w in counts])
    ax.set_xlabel("workers")
    rates = [r.batches_per_s for _, r in points if not r.error and r.batches]
    if _spans_decade(rates):
        ax.set_yscale("log")
        ax.set_ylabel("batches/s (higher is better), log scale")
    else:
        ax.set_ylabel("batches/s (higher is better)")
        ax.set_ylim(bottom=0)
    ax.set_title(_chart_title(case, None if cfg is None else replace(cfg, workers="1-" + str(
        max([w for w, _ in points if w is not None], default=cfg.workers)))))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def _save(plt, fig, path):
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_path(path, case, several):
    if not several:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}-{case}{ext or '.png'}"


# ---------------------------------------------------------------------------------------
# running the cases
# ---------------------------------------------------------------------------------------

@dataclass
class CaseRun:
    """What one case produced: its table, its results for the JSON output, its chart (a
    function of pyplot that returns a figure), whether a row failed, and the rows skipped
    here (name: why)."""
    case: str
    cfg: compare.Config
    table: Table
    payload: dict
    figure: object
    failed: bool
    skipped: dict


def _config_dict(cfg):
    return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}


def _row_dict(w, r):
    d = r.as_dict()
    d["workers"] = w
    return d


def _points(names, counts, measure_one):
    """(workers, result) for every row: rows that use workers at every count, the others
    once (workers None); a row that cannot be measured is asked once."""
    out = []
    for name in names:
        for w in (counts if name in compare.USES_WORKERS else [None]):
            r = measure_one(name, w)
            out.append((w, r))
            if getattr(r, "skipped", None):
                break
    return out


def _run_case(case, args, missing, progress, say):
    spec = compare.CASES[case]
    cfg, note = make_config(args, case)
    if note:
        say(note)
    names = []
    # (the epoch case's extra rows come with the implementation they belong to)
    impls = [x for name in args.impls
             for x in [name] + [r for r, of in compare.EPOCH_ROW_OF.items() if of == name]]
    for name in impls:
        if name not in spec.rows:
            continue
        if name in missing:
            say(f"skipping {compare.LABELS[name]}: {missing[name]}")
        else:
            names.append(name)
    if not names:
        listed = [n for n in impls if n in spec.rows]
        why = ("; ".join(sorted({missing[n] for n in listed})) if listed else
               f"--impl lists none of its rows ({', '.join(spec.rows)})")
        say(f"nothing to compare here in case {case}: {why}")
        return None
    reason = compare.case_missing(case, cfg)
    if reason is not None:
        say(f"skipping case {case}: {reason}")
        return None
    counts = args.workers
    swept = len(counts) > 1
    skipped = {k: missing[k] for k in impls if k in missing and k in spec.rows}

    def timed(name, w, fn, suffix=""):
        where = (f" ({w} worker{'s' if w > 1 else ''})" if swept and w is not None
                 else "")
        advance, close = progress.timing(f"{case}: {compare.LABELS[name]}{suffix}{where}")
        try:
            return fn(advance)
        finally:
            close()

    def at(w):
        return cfg if w is None else replace(cfg, workers=w)

    if spec.kind == "online":
        points = _points(names, counts, lambda n, w: timed(
            n, w, lambda adv: compare.measure_online(n, at(w), adv)))
        payload = {"results": [_row_dict(w, r) for w, r in points]}
        return CaseRun(case, cfg, online_table(points, cfg), payload,
                       lambda plt: online_figure(plt, points),
                       any(r.error for _, r in points), skipped)

    steps = cfg.transitions * (2 if spec.kind == "views" else 1)
    bar = progress.bar(steps, f"{case}: building the replay buffer", "steps")
    with compare.case_data(case, cfg, bar.update) as rb:
        bar.close()
        if spec.kind == "views":
            if swept:
                say("the views case runs with the first of --workers only")
            results = {}
            for view in compare.VIEWS:
                results[view] = {}
                for n in names:
                    if n == "torchrl" and compare.VIEWS[view].torchrl_slice is None:
                        continue
                    results[view][n] = timed(n, None, lambda adv: compare.measure_view(
                        n, view, rb, cfg, adv), f", {view}")
            payload = {"results": {v: {n: _row_dict(cfg.workers if n in compare.USES_WORKERS
                                                    else None, r)
                                       for n, r in row.items() if r is not None}
                                   for v, row in results.items()}}
            return CaseRun(case, cfg, views_table(results, cfg), payload,
                           lambda plt: views_figure(plt, results),
                           any(r.error for row in results.values() for r in row.values()
                               if r is not None), skipped)
        if spec.kind == "latency":
            points = []
            for name in names:
                for trigger in compare.TRIGGERS:
                    points.extend(_points([name], counts, lambda n, w: timed(
                        n, w, lambda adv: compare.measure_latency(n, trigger, rb, at(w), adv),
                        f", {trigger}")))
            payload = {"results": [_row_dict(w, r) for w, r in points]}
            return CaseRun(case, cfg, latency_table(points, cfg), payload,
                           lambda plt: latency_figure(plt, points),
                           any(r.error for _, r in points), skipped)
        if spec.kind == "epoch":
            points = _points(names, counts, lambda n, w: timed(
                n, w, lambda adv: compare.measure_epochs(n, rb, at(w), adv)))
            payload = {"results": [_row_dict(w, r) for w, r in points]}
            return CaseRun(case, cfg, epoch_table(points, cfg), payload,
                           lambda plt: epoch_figure(plt, points),
                           any(r.error for _, r in points), skipped)
        if swept:
            points = _points(names, counts, lambda n, w: timed(
                n, w, lambda adv: compare.measure(n, rb, at(w), adv)))
            by_count = {str(w): compare.speedups([r for v, r in points if v in (w, None)])
                        for w in counts}
            payload = {"results": [_row_dict(w, r) for w, r in points],
                       "speedup_of_unienv_mp": by_count}
            return CaseRun(case, cfg, sweep_table(points, cfg, case), payload,
                           lambda plt: sweep_figure(plt, points, case, cfg),
                           any(r.error for _, r in points), skipped)
        results = [timed(n, None, lambda adv: compare.measure(n, rb, cfg, adv))
                   for n in names]
    payload = {"results": [_row_dict(cfg.workers if r.name in compare.USES_WORKERS else None,
                                     r) for r in results],
               "speedup_of_unienv_mp": compare.speedups(results)}
    return CaseRun(case, cfg, throughput_table(results, cfg, case), payload,
                   lambda plt: table_figure(plt, results, case, cfg),
                   any(r.error for r in results), skipped)


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


#: The rows that need an optional dependency (the extras of the README's "Installing").
_OPTIONAL_ROWS = ("torchrl", "ray")


def main(argv=None):
    args = parse_args(argv)
    missing = compare.available()
    lacking = missing_dependencies(args, missing)
    if lacking:
        for line in lacking:
            print(line, file=sys.stderr)
        return 2
    cases = list(compare.CASES) if args.case == "all" else [args.case]
    progress = _Progress(not args.no_progress and not args.json)
    said = set()

    def say(message):
        if message not in said:
            said.add(message)
            print(message, file=sys.stderr)

    runs = []
    for case in cases:
        run = _run_case(case, args, missing, progress, say)
        if run is None:
            continue
        config = _config_dict(run.cfg)
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
    if not runs:
        return 2
    if args.json:
        print(json.dumps(runs[0].payload if len(cases) == 1 else
                         {"cases": [r.payload for r in runs]}, indent=2))
    if args.plot:
        plt = _pyplot()
        if plt is not None:
            for run in runs:
                path = _plot_path(args.plot, run.case, len(cases) > 1)
                _save(plt, run.figure(plt), path)
                print(f"plot saved to {path}", file=sys.stderr)
    return 1 if any(r.failed for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
