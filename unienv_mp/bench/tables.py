"""The main job's tables: one per case, each a title, a header, rows and the notes printed
under it (``Table``)."""
import dataclasses
from dataclasses import dataclass, field
from typing import List

from .config import LABELS, VIEW_EPOCH_ROWS, describe
from .latency import LATENCY_PAUSE_S
from .measure import speedups
from .views import VIEWS


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


def _versus(ratio):
    """How unienv_mp compares, from ``ratio`` = other's ms/batch / unienv_mp's: "2.3x faster",
    or "1.3x slower" where unienv_mp loses (never "0.8x faster")."""
    factor, word = (ratio, "faster") if ratio >= 1 else (1 / ratio, "slower")
    # two decimals near 1, where one would read "1.0x" for both a win and a loss
    return f"{factor:.2f}x {word}" if factor < 1.05 else f"{factor:.1f}x {word}"


#: (the storages case's table says it the same way: `unienv_mp.bench.storages`)
versus = _versus


_TOUCH = "each batch touched once per 4 KiB"


_MAIN_CPU = ("main CPU: CPU time of this process (all its threads) per batch, i.e. what the "
             "training loop gives up to sampling; workers' CPU is not counted.")


def _setup(cfg, workers=True):
    w = f"{cfg.workers} workers, " if workers else ""
    return f"{w}{cfg.buffers} buffers, {cfg.start_method}"


def throughput_table(results, cfg, case="image"):
    ups = speedups(results)
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
             f"({describe(case, cfg)}), {_setup(cfg)}; {_TOUCH}")
    notes = ["ms/batch: wall-clock time per batch in a loop that only reads batches.  "
             + _MAIN_CPU]
    return Table(title, head, rows, notes + where_time_went(results))


def windows_table(results, cfg):
    """The windows case: a row per way of making the batch, as ``throughput_table``, with
    notes saying what each row does."""
    table = throughput_table(results, cfg, "windows")
    table.notes[1:1] = [
        "unienv_mp: WindowedBatch(rb, {obs/image: [-1, 0], obs/state: [-1, 0], action: "
        "0..15}) under unienv_mp's MultiprocessingSampler, sample_with_metadata() (the "
        "data and a pad mask per key); its generic path: the same, direct_gather=False; "
        "in process: the same view under UniEnv's StepSampler.",
        f"{LABELS['paired_in_process']}: what a user wrote before this view: a "
        "FrameStackedBatch(rb, 1) (every key stacked) and SliceStackedBatch(rb, arange(16))"
        ".get_column(['action']), each masked by UniEnv's episode-id helper, each under "
        "its own StepSampler with the same seed (in process they draw the same steps).",
        f"{LABELS['dataloader_map']}: {cfg.workers} workers, persistent, over a map-style "
        "dataset whose __getitem__(t) clamps each key's window to t's episode (its bounds "
        "found once, as LeRobot's episode_data_index) and indexes the buffer's tensors; "
        "torch's default collate.  index_select: the view's rows and pad masks worked out "
        "in this process as the workers work them out, then torch.index_select per key "
        "into memory allocated once (the bare gather of the same bytes)."]
    return table


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
    """``points``: (worker count or None, ``OnlineResult``) pairs."""
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
             f"({describe('online', cfg)}); "
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
    """``points``: (worker count or None, ``LatencyResult``) pairs."""
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
    title = (f"latency: one batch of {cfg.batch_size} ({describe('latency', cfg)}) "
             f"from {cfg.transitions} transitions in memory, with nothing prefetched; "
             f"{_setup(cfg, workers=not swept)}; {_TOUCH}")
    notes = [f"Time from asking for the batch to having read it, p50 and p99 over the runs "
             f"(with fewer than 100 runs, p99 lies between the two slowest); each run "
             f"follows a {LATENCY_PAUSE_S * 1e3:.0f} ms pause, so that workers "
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
    """``results``: {view name: {implementation: ``Result`` or None}}: a row per
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
        cells = [VIEWS[view].label]
        for n in names:
            r = row.get(n)
            if r is None:
                cells.append("-")
            elif r.error:
                cells.append("failed")
                failed.append(f"{VIEWS[view].label}, {LABELS[n]}: {r.error}")
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
             f"({describe('views', cfg)}), {_setup(cfg)}; {_TOUCH}")
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
    """``points``: (worker count or None, ``EpochResult``) pairs."""
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
        up = (_view_versus(points, w, r, _later_epochs, cfg) if r.name in VIEW_EPOCH_ROWS
              else _unienv_mp_is(points, w, r, _later_epochs, swept))
        if r.name == "unienv_mp_sample":
            rows.append(lead + ["-", f"{r.later_epoch_s:.3f}", "-", "-", up])
            continue
        rows.append(lead + [f"{r.first_epoch_s:.3f}", f"{r.later_epoch_s:.3f}",
                            f"{r.first_batch_first_ms:.1f}", f"{r.first_batch_later_ms:.1f}",
                            up])
    batches = next((r.batches for _, r in points if r.batches), 0)
    title = (f"epoch: seconds per epoch of epoch_iter(), {batches} batches of "
             f"{cfg.batch_size} ({describe('epoch', cfg)}) over {cfg.transitions} "
             f"transitions in memory, {cfg.epochs} epochs per row; "
             f"{_setup(cfg, workers=not swept)}; {_TOUCH}")
    notes = ["first epoch: includes starting the workers where the row starts them then "
             "(unienv_mp and UniEnv's sampler: at the epoch; the DataLoader: at its first "
             "iter()).  later epochs: the median of the others.  UniEnv's sampler starts "
             "new workers for every epoch over unshared data; unienv_mp runs later epochs "
             "on the workers it kept while the data is unchanged (persistent_workers).",
             f"{LABELS['unienv_mp_sample']}: as many sample() batches of a "
             f"running unienv_mp sampler as an epoch has (the steady state an epoch is "
             f"compared with), timed {cfg.epochs - 1} times after as many untimed."]
    if any(r.name in VIEW_EPOCH_ROWS for _, r in points):
        notes.append("frame stack: epochs over FrameStackedBatch(rb, 1) (2 frames, "
                     "episode_id mask) of an episodic buffer of as many steps (the views "
                     "case's: obs.state, obs.image, action, reward, episode_id, "
                     "episode_end); its in-process row is compared with the unienv_mp "
                     "rows over the same view, under each start method.")
    return Table(title, head, rows, notes)


def _later_epochs(r):
    return r.later_epoch_s if r.seconds else 0.0


def _view_versus(points, w, r, value, cfg):
    """The "unienv_mp is" cell of a frame-stack row of the epoch case: for the in-process
    one, unienv_mp's rows over the same view against it, each with its start method."""
    if r.name != "in_process_view" or not value(r) > 0:
        return "-"
    cells = []
    for ref_name, method in (("unienv_mp_view", cfg.start_method),
                             ("unienv_mp_view_spawn", "spawn")):
        for v, ref in points:
            if ref.name == ref_name and not ref.error and value(ref) > 0 \
                    and (w is None or v is None or v == w):
                cells.append(f"{_versus(value(r) / value(ref))} ({method})")
    return "; ".join(cells) or "n/a"


def sweep_table(points, cfg, case):
    """``points``: (worker count or None, ``Result``) pairs; None for rows that
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
             f"{cfg.batch_size} ({describe(case, cfg)}), {_setup(cfg, workers=False)}; "
             f"{_TOUCH}")
    notes = ["batches/s: in a loop that only reads batches; rows without workers "
             "(in process, TorchRL's threads) run once, in the last column."]
    failed = [f"{r.label} ({w} workers): {r.error}" for w, r in points if r.error]
    return Table(title, head, rows, notes + [f"failed: {x}" for x in failed])
