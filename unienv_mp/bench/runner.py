"""Running one case of the main job (``run_case``): its rows, each measured with a
progress bar, into a ``CaseRun``: its table, its JSON payload and its chart."""
from dataclasses import dataclass, replace

from . import plots, tables
from .config import (CASES, LABELS, ROW_OF, USES_WORKERS, VIEW_EPOCH_ROWS, Config,
                     case_missing)
from .data import build_episodic_buffer, case_data
from .epochs import measure_epochs
from .latency import TRIGGERS, measure_latency
from .measure import measure, speedups
from .online import measure_online
from .views import VIEWS, measure_view
from .windows import measure_windows


@dataclass
class CaseRun:
    """What one case produced: its table, its results for the JSON output, its chart (a
    function of pyplot that returns a figure), whether a row failed, and the rows skipped
    here (name: why)."""
    case: str
    cfg: Config
    table: tables.Table
    payload: dict
    figure: object
    failed: bool
    skipped: dict


def config_dict(cfg):
    return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}


def _row_dict(w, r):
    d = r.as_dict()
    d["workers"] = w
    return d


def _points_payload(points):
    return {"results": [_row_dict(w, r) for w, r in points]}


@dataclass
class _Rows:
    """The rows of one case to measure (``names``, in table order) at the worker
    ``counts``, each with a bar of ``progress``."""
    case: str
    cfg: Config
    names: list
    counts: list
    progress: object
    skipped: dict

    @property
    def swept(self):
        return len(self.counts) > 1

    def at(self, w):
        """The config with ``w`` workers (``cfg`` itself for a row without workers)."""
        return self.cfg if w is None else replace(self.cfg, workers=w)

    def timed(self, name, w, fn, suffix=""):
        """``fn(advance)``, under a bar for row ``name`` with ``w`` workers."""
        where = (f" ({w} worker{'s' if w > 1 else ''})" if self.swept and w is not None
                 else "")
        advance, close = self.progress.timing(f"{self.case}: {LABELS[name]}{suffix}{where}")
        try:
            return fn(advance)
        finally:
            close()

    def points(self, measure_one, names=None, suffix=""):
        """(workers, result) for every row of ``names`` (default: all): rows that use
        workers at every count, the others once (workers None); a row that cannot be
        measured is asked once.  ``measure_one(name, cfg, advance)`` measures one."""
        out = []
        for name in self.names if names is None else names:
            for w in (self.counts if name in USES_WORKERS else [None]):
                r = self.timed(name, w, lambda adv: measure_one(name, self.at(w), adv), suffix)
                out.append((w, r))
                if getattr(r, "skipped", None):
                    break
        return out

    def done(self, table, payload, figure, failed):
        return CaseRun(self.case, self.cfg, table, payload, figure, failed, self.skipped)


def rows_to_run(case, impls, missing, say):
    """(the rows of ``case`` among ``impls`` that can run here, in the order asked for;
    those that cannot, name: why), saying which are skipped, and why nothing runs when
    none can."""
    spec = CASES[case]
    # (the epoch and windows cases' extra rows come with the implementation they belong to)
    impls = [x for name in impls
             for x in [name] + [r for r, of in ROW_OF.items() if of == name]]
    listed = [n for n in impls if n in spec.rows]
    for name in listed:
        if name in missing:
            say(f"skipping {LABELS[name]}: {missing[name]}")
    # (the frame-stack rows of the epoch case last, together)
    names = sorted((n for n in listed if n not in missing), key=lambda n: n in VIEW_EPOCH_ROWS)
    if not names:
        why = ("; ".join(sorted({missing[n] for n in listed})) if listed else
               f"--impl lists none of its rows ({', '.join(spec.rows)})")
        say(f"nothing to compare here in case {case}: {why}")
    return names, {k: missing[k] for k in listed if k in missing}


def run_case(case, cfg, impls, counts, missing, progress, say):
    """Measure the rows of ``case`` among ``impls`` (``--impl``) with ``cfg``, at each
    of the worker ``counts``: a ``CaseRun``, or None where nothing can run (said why)."""
    names, skipped = rows_to_run(case, impls, missing, say)
    if not names:
        return None
    reason = case_missing(case, cfg)
    if reason is not None:
        say(f"skipping case {case}: {reason}")
        return None
    rows = _Rows(case, cfg, names, counts, progress, skipped)
    kind = CASES[case].kind
    if kind == "online":
        return _online(rows)
    if kind == "storages":
        return _storages(rows, say)
    steps = cfg.transitions * (2 if kind == "views" else 1)
    bar = progress.bar(steps, f"{case}: building the replay buffer", "steps")
    with case_data(case, cfg, bar.update) as data:
        bar.close()
        if kind == "views":
            if rows.swept:
                say("the views case runs with the first of --workers only")
            return _views(rows, data)
        if kind == "windows" and rows.swept:
            say("the windows case runs with the first of --workers only")
        run = {"latency": _latency, "epoch": _epochs, "windows": _windows}.get(kind)
        return (run or (_sweep if rows.swept else _throughput))(rows, data)


def _online(rows):
    points = rows.points(measure_online)
    return rows.done(tables.online_table(points, rows.cfg), _points_payload(points),
                     lambda plt: plots.online_figure(plt, points),
                     any(r.error for _, r in points))


def _views(rows, data):
    cfg = rows.cfg
    results = {}
    for view in VIEWS:
        results[view] = {}
        for n in rows.names:
            if n == "torchrl" and VIEWS[view].torchrl_slice is None:
                continue
            results[view][n] = rows.timed(n, None, lambda adv: measure_view(
                n, view, data, cfg, adv), f", {view}")
    payload = {"results": {v: {n: _row_dict(cfg.workers if n in USES_WORKERS else None, r)
                               for n, r in row.items() if r is not None}
                           for v, row in results.items()}}
    return rows.done(tables.views_table(results, cfg), payload,
                     lambda plt: plots.views_figure(plt, results),
                     any(r.error for row in results.values() for r in row.values()
                         if r is not None))


def _windows(rows, rb):
    """windows: a row per way of making the batch, in the order asked for."""
    cfg = rows.cfg
    results = [rows.timed(n, None, lambda adv: measure_windows(n, rb, cfg, adv))
               for n in rows.names]
    payload = {"results": [_row_dict(cfg.workers if r.name in USES_WORKERS else None, r)
                           for r in results],
               "speedup_of_unienv_mp": speedups(results)}
    return rows.done(tables.windows_table(results, cfg), payload,
                     lambda plt: plots.table_figure(plt, results, "windows", cfg),
                     any(r.error for r in results))


def _latency(rows, rb):
    points = []
    for name in rows.names:
        for trigger in TRIGGERS:
            points.extend(rows.points(
                lambda n, cfg, adv: measure_latency(n, trigger, rb, cfg, adv), [name],
                f", {trigger}"))
    return rows.done(tables.latency_table(points, rows.cfg), _points_payload(points),
                     lambda plt: plots.latency_figure(plt, points),
                     any(r.error for _, r in points))


def _epochs(rows, rb):
    episodic = None
    if any(n in VIEW_EPOCH_ROWS for n in rows.names):
        bar = rows.progress.bar(rows.cfg.transitions, "epoch: building the episodic buffer",
                                "steps")
        episodic = build_episodic_buffer(rows.cfg.transitions, rows.cfg, bar.update)
        bar.close()
    points = rows.points(lambda n, cfg, adv: measure_epochs(
        n, episodic if n in VIEW_EPOCH_ROWS else rb, cfg, adv))
    return rows.done(tables.epoch_table(points, rows.cfg), _points_payload(points),
                     lambda plt: plots.epoch_figure(plt, points),
                     any(r.error for _, r in points))


def _sweep(rows, rb):
    """image, state, jpeg with several worker counts: batches/s against workers."""
    case, cfg = rows.case, rows.cfg
    points = rows.points(lambda n, at, adv: measure(n, rb, at, adv))
    by_count = {str(w): speedups([r for v, r in points if v in (w, None)])
                for w in rows.counts}
    payload = {**_points_payload(points), "speedup_of_unienv_mp": by_count}
    return rows.done(tables.sweep_table(points, cfg, case), payload,
                     lambda plt: plots.sweep_figure(plt, points, case, cfg),
                     any(r.error for _, r in points))


def _throughput(rows, rb):
    """image, state, jpeg with one worker count: a row per implementation."""
    case, cfg = rows.case, rows.cfg
    results = [rows.timed(n, None, lambda adv: measure(n, rb, cfg, adv)) for n in rows.names]
    payload = {"results": [_row_dict(cfg.workers if r.name in USES_WORKERS else None, r)
                           for r in results],
               "speedup_of_unienv_mp": speedups(results)}
    return rows.done(tables.throughput_table(results, cfg, case), payload,
                     lambda plt: plots.table_figure(plt, results, case, cfg),
                     any(r.error for r in results))


def _storages(rows, say):
    """A row per storage backend (``unienv_mp.bench.storages``); the case's rows are its
    columns (in_process also at one thread; index_select: the bare read)."""
    from . import storages
    if rows.swept:
        say("the storages case runs with the first of --workers only")
    columns = [c for c in storages.COLUMNS
               if {"in_process_1": "in_process", "bare": "index_select"}.get(c, c)
               in rows.names]
    runs = storages.run_all(rows.cfg, rows.names, columns, rows.progress, say)
    table = storages.storages_table(runs, rows.cfg)
    failed = any(r.error for run in runs for r in run.results.values())
    return rows.done(table, storages.payload(runs), None, failed)
