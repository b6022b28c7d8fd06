"""The main job's charts (``--plot``): a figure per case from its results, drawn with
matplotlib (optional: imported by ``pyplot()`` only)."""
import os
import sys
from dataclasses import replace

from .config import LABELS
from .views import VIEWS


def pyplot():
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
        ax.barh(ys, xs, height=height, label=LABELS[n],
                color="tab:green" if n == "unienv_mp" else cmap(j % 10))
    ax.set_xscale("log")
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(views))])
    ax.set_yticklabels([VIEWS[v].label for v in views], fontsize=8)
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


def save_figure(plt, fig, path):
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_path(path, case, several):
    if not several:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}-{case}{ext or '.png'}"
