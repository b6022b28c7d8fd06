"""The main job's workload cases (jpeg, online, latency, --case all), the worker sweep and
the charts: what each produces, not how fast."""
import collections
import dataclasses
import glob
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from unienv_mp.bench import cli, config, data, epochs, index_select, latency, measure, online, peers, plots, tables, views, windows

SMALL = ["--transitions", "300", "--image-shape", "3x8x8", "--batch-size", "16",
         "--workers", "2", "--buffers", "2", "--seconds", "0.3", "--no-progress"]
TINY = dict(transitions=300, batch_size=16, image_shape=(3, 8, 8), workers=2, buffers=2,
            seconds=0.3, warmup=2)
needs_pillow = pytest.mark.skipif(
    config.case_missing("jpeg", config.Config()) is not None, reason="Pillow is missing")


def _json_run(capsys, argv):
    rc = cli.main(argv + ["--json"])
    return rc, json.loads(capsys.readouterr().out)


# --- online: staleness -------------------------------------------------------------------

def test_staleness_is_the_newest_step_written_minus_the_newest_clock_in_the_batch():
    assert online.staleness(10, {"clock": torch.tensor([3, 9, 7])}) == 1
    assert online.staleness(10, {"clock": np.array([10, 2])}) == 0
    assert online.staleness(12, {"clock": torch.tensor([4])}) == 8


def _delayed(next_batch, depth):
    """A sampler that hands out each batch ``depth`` calls after it was read: a prefetch
    queue ``depth`` deep."""
    queue = collections.deque()

    def sample():
        while len(queue) <= depth:
            queue.append(next_batch())
        return queue.popleft()
    return sample


@pytest.mark.parametrize("depth", [0, 3])
def test_online_loop_measures_how_many_steps_a_batch_was_read_before(depth):
    cfg = config.Config(**{**TINY, "seconds": 0.1})
    assert online.online_warmup(cfg) > depth     # the queue is full when measuring starts
    rb = data.build_online_buffer(cfg)
    next_batch, close = peers.make_sampler("in_process", rb, cfg)
    res = online.run_online(_delayed(next_batch, depth), rb, cfg)
    close()
    assert res.batches >= cfg.min_batches and len(res.staleness) == res.batches
    assert set(res.staleness) == {depth}
    assert res.staleness_stats() == {"mean": depth, "p50": depth, "p99": depth, "max": depth}
    # every step appended cfg.append rows and stamped the whole clock column
    steps = online.online_warmup(cfg) + res.batches
    assert len(rb) == min(cfg.transitions, cfg.transitions // 2 + steps * cfg.append)
    assert (rb.get_at(torch.arange(len(rb)))["clock"] == steps).all()


def test_online_case_reports_ms_per_step_and_staleness(capsys):
    rc, out = _json_run(capsys, SMALL + ["--case", "online"])
    assert rc == 0 and out["case"] == "online"
    rows = {r["name"]: r for r in out["results"]}
    assert list(rows) == ["unienv_mp", "unienv", "in_process"]
    for r in rows.values():
        assert r["error"] is None and r["batches"] >= 5 and r["ms_per_step"] > 0
        assert r["batch_bytes"] == 16 * (17 * 4 + 8)     # state, action, clock
        assert r["staleness_steps"]["max"] >= r["staleness_steps"]["p50"] >= 0
    assert rows["in_process"]["staleness_steps"]["max"] == 0
    # in order, n_buffers (2) ahead and 8 small batches to a task: a batch is consumed at
    # most 2 + 8 - 1 steps after the step that asked for it (plus one for the clock fill)
    assert rows["unienv_mp"]["staleness_steps"]["max"] <= 10
    assert rows["unienv_mp"]["workers"] == 2 and rows["in_process"]["workers"] is None


def test_online_table():
    cfg = config.Config(**TINY)
    points = [(2, online.OnlineResult("unienv_mp", config.LABELS["unienv_mp"], batches=100,
                                       seconds=1.0, staleness=[2, 3, 3, 4])),
              (2, online.OnlineResult("unienv", config.LABELS["unienv"], batches=10,
                                       seconds=1.0, staleness=[8] * 4)),
              (None, online.OnlineResult("in_process", config.LABELS["in_process"],
                                          batches=50, seconds=1.0, staleness=[0] * 4))]
    text = tables.online_table(points, cfg).format()
    lines = {line.split("  ")[0]: line.split() for line in text.splitlines()}
    mp_row = lines[config.LABELS["unienv_mp"]][-8:]
    assert mp_row == ["10.000", "100", "0.000", "3.0", "3", "4", "4", "-"]
    assert lines[config.LABELS["unienv"]][-3:] == ["8", "10.0x", "faster"]
    assert lines[config.LABELS["in_process"]][-6:] == ["0.0", "0", "0", "0", "2.0x", "faster"]
    assert "newest step the batch could contain" in text


# --- jpeg ----------------------------------------------------------------------------------

@needs_pillow
def test_jpeg_buffer_keeps_its_images_as_jpeg_files(tmp_path):
    cfg = config.Config(**{**TINY, "transitions": 40, "image_shape": (3, 16, 24)})
    rb = data.build_jpeg_buffer(cfg, tmp_path)
    files = glob.glob(os.path.join(tmp_path, "**", "*.jpeg"), recursive=True)
    assert len(files) == 40
    with open(files[0], "rb") as f:
        assert f.read(2) == b"\xff\xd8"          # a JPEG stream
    batch = rb.get_at(torch.arange(5))
    assert batch["image"].shape == (5, 16, 24, 3) and batch["image"].dtype == torch.uint8
    assert batch["image"].float().std() > 10     # decoded pictures, not the zeros of a miss


@needs_pillow
def test_jpeg_case_runs_its_rows_and_decodes_in_the_workers(capsys):
    rc, out = _json_run(capsys, SMALL + ["--case", "jpeg"])
    assert rc == 0 and out["case"] == "jpeg"
    names = [r["name"] for r in out["results"]]
    assert names == ["unienv_mp", "unienv", "unienv_shm", "in_process", "dataloader"]
    for r in out["results"]:
        assert r["error"] is None and r["batches"] >= 5
        assert r["batch_bytes"] == 16 * (17 * 4 + 8 * 8 * 3)
    cfg = config.Config(**TINY)
    with data.case_data("jpeg", cfg) as rb:
        directory = rb.storage.storage_map["image"].cache_filename
        assert os.path.isdir(directory)
        next_batch, close = peers.make_sampler("unienv_mp", rb, cfg)
        try:
            # the worker calls the storage's get(), which decodes
            assert next_batch.__self__.gather_path == "generic"
            assert next_batch()["image"].shape == (16, 8, 8, 3)
        finally:
            close()
    assert not os.path.exists(directory)


def test_jpeg_case_needs_an_rgb_image_shape(capsys):
    assert "RGB" in config.case_missing("jpeg", config.Config(image_shape=(1, 8, 8)))
    assert cli.main(SMALL + ["--case", "jpeg", "--image-shape", "none"]) == 2
    assert "skipping case jpeg: the jpeg case needs an RGB image shape" in (
        capsys.readouterr().err)


def test_without_pillow_all_cases_but_jpeg_run():
    code = ("import sys; sys.modules['PIL'] = None\n"
            "from unienv_mp.bench import cli as m\n"
            f"sys.exit(m.main({SMALL + ['--case', 'all', '--impl', 'in_process', '--json']!r}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert ("skipping case jpeg: Pillow, which UniEnv's ImageStorage needs, is not "
            "installed (pip install pillow)") in p.stderr
    out = json.loads(p.stdout)
    assert [c["case"] for c in out["cases"]] == [c for c in config.CASES if c != "jpeg"
                                                 and config.CASES[c].in_all]
    for c in out["cases"]:
        rows = (c["results"] if c["case"] != "views" else
                [r for view in c["results"].values() for r in view.values()])
        # (--impl in_process brings the epoch case's frame-stack row of its own, and the
        # windows case's paired samplers)
        assert {r["name"] for r in rows} == {"in_process", *{
            "epoch": {"in_process_view"}, "windows": {"paired_in_process"}}.get(c["case"], ())}


# --- latency -------------------------------------------------------------------------------

def test_latency_case_times_each_way_of_asking(capsys):
    rc, out = _json_run(capsys, SMALL + ["--case", "latency"])
    assert rc == 0 and out["case"] == "latency"
    got = [(r["name"], r["trigger"]) for r in out["results"]]
    assert got == [(n, t) for n in ("unienv_mp", "unienv", "in_process")
                   for t in ("reseed", "epoch", "start")]
    for r in out["results"]:
        assert r["error"] is None
        if (r["name"], r["trigger"]) == ("unienv", "reseed"):
            assert r["runs"] == 0 and "manual_seed" in r["skipped"]
            continue
        assert r["skipped"] is None and r["runs"] >= 5 and len(r["times_s"]) == r["runs"]
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= 1e3 * max(r["times_s"])


def _copy(batch):
    return {k: v.clone() for k, v in batch.items()}


def test_reseed_probe_returns_a_batch_of_the_new_seed():
    """manual_seed(s) then sample(): the batch comes from seed s, so it was made after the
    call, not taken from what was prefetched."""
    cfg = config.Config(**TINY)
    rb = data.build_buffer(cfg)
    prepare, first_batch, close = latency.latency_probe("unienv_mp", "reseed", rb, cfg)
    try:
        got = []
        for _ in range(2):
            prepare()
            got.append(_copy(first_batch()))
    finally:
        close()
    for seed, batch in enumerate(got, start=1):
        next_batch, close = peers.make_sampler("unienv_mp", rb, cfg, seed=seed)
        try:
            want = _copy(next_batch())
        finally:
            close()
        assert all(torch.equal(batch[k], want[k]) for k in want), seed


def test_latency_probes_close_what_they_start():
    cfg = config.Config(**TINY)
    rb = data.build_buffer(cfg)
    for trigger in ("epoch", "start"):
        prepare, first_batch, close = latency.latency_probe("unienv_mp", trigger, rb, cfg)
        for _ in range(2):
            prepare()
            assert first_batch()["image"].shape == (16, 3, 8, 8)
        close()
        assert not mp.active_children()
    with pytest.raises(latency.NotMeasurable, match="manual_seed"):
        latency.latency_probe("unienv", "reseed", rb, cfg)
    with pytest.raises(ValueError, match="trigger"):
        latency.latency_probe("unienv_mp", "soon", rb, cfg)


def test_latency_table_compares_by_p50_with_the_same_trigger():
    cfg = config.Config(**TINY)
    r = latency.LatencyResult
    points = [(2, r("unienv_mp", config.LABELS["unienv_mp"], "epoch", [0.010, 0.020, 0.030])),
              (2, r("unienv", config.LABELS["unienv"], "epoch", [0.040, 0.040, 0.050])),
              (2, r("unienv", config.LABELS["unienv"], "reseed", skipped="no such call")),
              (None, r("in_process", config.LABELS["in_process"], "epoch", [0.005] * 3))]
    text = tables.latency_table(points, cfg).format()
    rows = [line for line in text.splitlines() if "first batch of a new epoch_iter()" in line]
    assert rows[0].split()[-4:] == ["3", "20.00", "29.80", "-"]
    assert rows[1].rstrip().endswith("2.0x faster")
    assert rows[2].rstrip().endswith("4.0x slower")
    assert "n/a (see below)" in text and "manual_seed(), then sample(): n/a: no such call" in text


# --- epoch ---------------------------------------------------------------------------------

def test_epoch_case_times_every_epoch_of_each_row(capsys):
    rc, out = _json_run(capsys, SMALL + ["--case", "epoch"])
    assert rc == 0 and out["case"] == "epoch"
    assert [r["name"] for r in out["results"]] == [
        "unienv_mp", "unienv_mp_sample", "unienv_shm", "in_process", "dataloader_epoch",
        "unienv_mp_view", "unienv_mp_view_spawn", "in_process_view"]
    epochs = out["config"]["epochs"]
    for r in out["results"]:
        assert r["error"] is None, r
        assert r["batches"] == -(-300 // 16)       # every index once, the last batch partial
        assert len(r["epoch_s"]) == len(r["first_batch_s"]) == epochs
        assert all(0 < f <= e for f, e in zip(r["first_batch_s"], r["epoch_s"]))
        assert r["first_epoch_s"] == r["epoch_s"][0]
        assert r["later_epoch_s"] == pytest.approx(float(np.median(r["epoch_s"][1:])))
    rc = cli.main(SMALL + ["--case", "epoch", "--impl", "unienv_mp,in_process"])
    text = capsys.readouterr().out
    assert rc == 0 and "later epochs s" in text
    assert config.LABELS["unienv_mp_sample"] in text
    assert config.LABELS["dataloader_epoch"] not in text
    # the frame-stack rows: the in-process one against unienv_mp under each start method
    (line,) = [x for x in text.splitlines() if x.startswith(config.LABELS["in_process_view"])]
    assert re.search(r"x (faster|slower) \(fork\); .*x (faster|slower) \(spawn\)", line)


def test_the_view_rows_of_the_epoch_case_run_epochs_over_a_frame_stack():
    cfg = config.Config(**TINY)
    rb = data.build_episodic_buffer(cfg.transitions, cfg)
    for name in config.VIEW_EPOCH_ROWS:
        epoch, close = epochs.epoch_runner(name, rb, cfg)
        try:
            for _ in range(2):
                batches = list(epoch())
                assert len(batches) == -(-300 // 16)
                assert batches[0]["obs"]["image"].shape[:2] == (16, 2)   # 2 frames
        finally:
            close()


@pytest.mark.parametrize("name", ["unienv_mp", "in_process", "dataloader_epoch"])
def test_epoch_rows_cover_every_index_once_per_epoch(name):
    cfg = config.Config(**TINY)
    rb = data.build_buffer(cfg)
    epoch, close = epochs.epoch_runner(name, rb, cfg)
    try:
        for _ in range(2):
            seen = [int(round(float(x))) for b in epoch() for x in b["state"][:, 0]]
            assert len(seen) == 300
    finally:
        close()
    assert not mp.active_children()


def test_epoch_table_compares_later_epochs():
    cfg = config.Config(**TINY)
    r = epochs.EpochResult
    points = [(2, r("unienv_mp", config.LABELS["unienv_mp"], [0.5, 0.1, 0.1, 0.3],
                    [0.2, 0.01, 0.01, 0.02], 19)),
              (2, r("unienv_mp_sample", config.LABELS["unienv_mp_sample"], [0.1, 0.05],
                    [0.001, 0.001], 19)),
              (None, r("in_process", config.LABELS["in_process"], [0.3, 0.3, 0.4, 0.3],
                       [0.01] * 4, 19)),
              (2, r("unienv_shm", config.LABELS["unienv_shm"], error="boom"))]
    text = tables.epoch_table(points, cfg).format()
    line = {row.split("  ")[0]: row for row in text.splitlines()}
    assert line[config.LABELS["unienv_mp"]].split()[-5:] == [
        "0.500", "0.100", "200.0", "10.0", "-"]
    assert line[config.LABELS["in_process"]].rstrip().endswith("3.0x faster")
    assert line[config.LABELS["unienv_mp_sample"]].rstrip().endswith("2.0x slower")
    assert "failed: boom" in text and "19 batches of 16" in text


# --- the worker sweep, --case all, charts ----------------------------------------------------

def test_workers_option_parses_a_list():
    assert cli.parse_args(["--workers", "1,2,4,8"]).workers == [1, 2, 4, 8]
    assert cli.parse_args(["--workers", "4"]).workers == [4]
    assert cli.parse_args(["--workers", "2,1,2"]).workers == [2, 1]
    cfg, _ = cli.make_config(cli.parse_args(["--workers", "3,5"]))
    assert cfg.workers == 3


@pytest.mark.parametrize("bad", ["0,2", "1,x", ""])
def test_bad_worker_lists_are_refused(bad, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--workers", bad])
    assert e.value.code == 2 and "--workers" in capsys.readouterr().err


def test_sweep_times_worker_rows_at_every_count_and_the_others_once(capsys):
    rc, out = _json_run(capsys, SMALL + ["--workers", "1,2", "--impl", "unienv_mp,in_process"])
    assert rc == 0 and out["config"]["workers"] == [1, 2]
    got = [(r["name"], r["workers"]) for r in out["results"]]
    assert got == [("unienv_mp", 1), ("unienv_mp", 2), ("in_process", None)]
    assert all(r["error"] is None and r["batches"] >= 5 for r in out["results"])
    assert set(out["speedup_of_unienv_mp"]) == {"1", "2"}
    assert set(out["speedup_of_unienv_mp"]["1"]) == {"in_process"}


def test_sweep_table():
    cfg = config.Config(**TINY)
    res = measure.Result
    points = [(1, res("unienv_mp", config.LABELS["unienv_mp"], 100, 1.0)),
              (2, res("unienv_mp", config.LABELS["unienv_mp"], 180, 1.0)),
              (1, res("unienv", config.LABELS["unienv"], error="boom")),
              (None, res("in_process", config.LABELS["in_process"], 150, 1.0))]
    text = tables.sweep_table(points, cfg, "image").format()
    lines = text.splitlines()
    assert lines[1].split() == ["implementation", "1", "worker", "2", "workers", "no",
                                "workers"]
    assert lines[3].split()[-2:] == ["100", "180"]
    assert lines[4].split()[-1] == "failed"
    assert lines[5].split()[-1] == "150"
    assert "failed: UniEnv MultiprocessingSampler (1 workers): boom" in text


def _pyplot():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def test_sweep_chart_draws_a_line_per_implementation_and_in_process_flat():
    plt = _pyplot()
    res = measure.Result
    points = [(w, res("unienv_mp", config.LABELS["unienv_mp"], n, 1.0))
              for w, n in ((1, 100), (2, 180), (4, 300))]
    points += [(w, res("unienv", config.LABELS["unienv"], n, 1.0))
               for w, n in ((1, 50), (2, 60), (4, 70))]
    points.append((None, res("in_process", config.LABELS["in_process"], 150, 1.0)))
    fig = plots.sweep_figure(plt, points, "image")
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    mp_line = lines[config.LABELS["unienv_mp"]]
    assert list(mp_line.get_xdata()) == [1, 2, 4]
    assert list(mp_line.get_ydata()) == [100, 180, 300]
    flat = lines[config.LABELS["in_process"]]
    assert list(flat.get_ydata()) == [150, 150]
    assert fig.axes[0].get_xlabel() == "workers"
    plt.close(fig)


def test_table_chart_has_a_panel_for_time_and_one_for_main_cpu():
    plt = _pyplot()
    res = measure.Result
    results = [res("unienv_mp", config.LABELS["unienv_mp"], 10, 0.02, main_cpu_s=0.001),
               res("in_process", config.LABELS["in_process"], 10, 0.05, main_cpu_s=0.05),
               res("unienv", config.LABELS["unienv"], error="boom")]
    fig = plots.table_figure(plt, results, "image")
    # (the second panel's bars span 50x: a log axis)
    assert [ax.get_xlabel() for ax in fig.axes] == [
        "ms per batch (lower is better)",
        "main CPU ms per batch (lower is better), log scale"]
    widths = [[round(p.get_width(), 6) for p in ax.patches] for ax in fig.axes]
    assert widths == [[2.0, 5.0], [0.1, 5.0]]
    plt.close(fig)


def test_case_all_plots_one_file_per_case(tmp_path, capsys):
    path = tmp_path / "chart.png"
    argv = SMALL + ["--case", "all", "--impl", "in_process,unienv_mp", "--plot", str(path),
                    "--seconds", "0.1"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    for case in (c for c in config.CASES if config.CASES[c].in_all):
        assert f"== {case} ==" in captured.out
        png = tmp_path / f"chart-{case}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plot saved to {png}" in captured.err
    assert not path.exists()


def test_impl_list_without_rows_of_a_case_says_so(capsys):
    assert cli.main(SMALL + ["--case", "online", "--impl", "index_select"]) == 2
    assert "--impl lists none of its rows (unienv_mp, unienv, in_process)" in (
        capsys.readouterr().err)


def test_ci_runs_every_case_quickly():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, ".ci", "run")) as f:
        ci = [line.strip() for line in f]
    assert "python -m unienv_mp --case all --quick" in ci
    assert "python -m unienv_mp --quick" not in ci


# --- views --------------------------------------------------------------------------------

def test_views_case_times_every_view_and_torchrl_on_the_action_chunks(capsys):
    argv = SMALL + ["--case", "views", "--impl", "unienv_mp,in_process,index_select,torchrl"]
    rc, out = _json_run(capsys, argv)
    assert rc == 0
    assert list(out["results"]) == list(views.VIEWS)
    for view, row in out["results"].items():
        expected = ["unienv_mp", "in_process", "index_select"]
        if view == "action_chunk" and "torchrl" not in peers.available():
            expected.append("torchrl")
        assert list(row) == expected, view
        for r in row.values():
            assert r["error"] is None and r["batches"] > 0, (view, r)
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    for spec in views.VIEWS.values():
        assert spec.label in table
    assert "unienv_mp vs bare limit" in table and "episodes of 200" in table


def test_the_bare_limit_of_a_view_gathers_uniEnvs_batch():
    """(In another order for a combined dataset, whose parts' rows it gathers one after
    the other.)"""
    from unienv_data.samplers import StepSampler
    from test_gather import assert_identical
    cfg = dataclasses.replace(config.case_config("views"), **TINY)
    with data.case_data("views", cfg) as (rb, halves):
        for name, spec in views.VIEWS.items():
            if name == "combined":
                continue
            view = spec.build(rb, halves)
            limit, close = index_select.view_limit_sampler(StepSampler(view, 16, seed=4), cfg)
            reference = StepSampler(view, 16, seed=4)
            for _ in range(3):
                assert_identical(limit(), reference.sample(), name)
            close()


# --- windows ------------------------------------------------------------------------------

def test_windows_case_times_each_way_of_making_the_batch(capsys):
    rc, out = _json_run(capsys, SMALL + ["--case", "windows"])
    assert rc == 0 and out["case"] == "windows"
    rows = {r["name"]: r for r in out["results"]}
    assert list(rows) == list(config.CASES["windows"].rows)
    for r in rows.values():
        assert r["error"] is None and r["batches"] >= 5, r
    # the same bytes (image and state at 2 steps, 16 actions, a pad mask each), but for
    # the paired samplers, whose frame stack stacks every key
    same = 16 * (2 * (3 * 8 * 8 + 10 * 4) + 16 * 7 * 4 + 2 + 2 + 16)
    for name in ("unienv_mp", "unienv_mp_generic", "in_process", "dataloader_map",
                 "index_select"):
        assert rows[name]["batch_bytes"] == same, name
    assert rows["paired_in_process"]["batch_bytes"] > same
    assert rows["unienv_mp"]["workers"] == 2 and rows["in_process"]["workers"] is None
    assert set(out["speedup_of_unienv_mp"]) == set(rows) - {"unienv_mp"}
    assert cli.main(SMALL + ["--case", "windows", "--impl", "in_process,dataloader"]) == 0
    table = capsys.readouterr().out
    assert config.LABELS["paired_in_process"] in table
    assert config.LABELS["dataloader_map"] in table and "unienv_mp is" in table
    assert "at 0..15" in table and "episode_data_index" in table


def test_every_row_of_the_windows_case_makes_the_views_batch():
    """The rows compared make the same batch: the DataLoader's dataset, collated, and the
    bare gather give the view's own batch for the same steps, and the paired samplers
    draw the same steps in process."""
    from unienv_data.samplers import StepSampler
    from test_gather import assert_identical
    cfg = dataclasses.replace(config.case_config("windows"), **TINY)
    with data.case_data("windows", cfg) as rb:
        view = windows.windowed_view(rb)
        dataset = windows.WindowDataset(rb)
        steps = [0, 1, 150, 199, 200, 201, 299, 17]
        collated = torch.utils.data.default_collate([dataset[t] for t in steps])
        data_, meta = view.get_at_with_metadata(torch.tensor(steps))
        assert_identical({k: collated[k] for k in data_}, data_)
        assert_identical({k: collated[k] for k in meta}, meta)
        assert len(collated) == len(data_) + len(meta)
        assert meta["action_is_pad"][3].sum() == 15 and not meta["action_is_pad"][4].any()
        limit, close = index_select.view_limit_sampler(StepSampler(view, 16, seed=4), cfg,
                                                       with_metadata=True)
        reference = StepSampler(view, 16, seed=4)
        for _ in range(3):
            assert_identical(limit(), reference.sample_with_metadata())
        close()
        next_batch, close = windows.make_window_sampler("paired_in_process", rb, cfg)
        for _ in range(3):
            (obs, _), (actions, valid) = next_batch()
            assert torch.equal(obs["action"][:, -1], actions[:, 0])
        close()


# --- what the main job says ---------------------------------------------------------------

def test_missing_optional_dependencies_stop_the_main_job_before_it_measures():
    code = ("import sys; sys.modules['matplotlib'] = None; sys.modules['torchrl'] = None\n"
            "import importlib.util\n"
            "real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda n, *a: None if n in ('matplotlib', 'torchrl')"
            " else real(n, *a)\n"
            "from unienv_mp.bench import cli as m\n"
            "sys.exit(m.main(sys.argv[1:]))")
    for argv, said in ((["--plot", "x.png"], "--plot needs matplotlib: pip install "
                                             "'unienv_mp[plot]'"),
                       (["--impl", "unienv_mp,torchrl"], "--impl torchrl: torchrl is not "
                                                         "installed (pip install torchrl)")):
        p = subprocess.run([sys.executable, "-c", code] + SMALL + argv, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2 and said in p.stderr, p.stderr
        assert "building" not in p.stderr and p.stdout == ""
    # the default rows are skipped where they cannot run, saying so
    p = subprocess.run([sys.executable, "-c", code] + SMALL[:-1] + ["--impl", "ray", "--case",
                                                                   "state", "--seconds", "0.1"],
                       capture_output=True, text=True, timeout=300)
    if "ray" in peers.available():
        assert p.returncode == 2 and "--impl ray:" in p.stderr
    else:
        assert p.returncode == 0, p.stderr
        assert "skipping TorchRL ReplayBuffer(prefetch=4): torchrl is not installed" in p.stderr


def test_progress_is_a_line_per_row_without_a_terminal_and_nothing_with_no_progress(capsys):
    argv = [a for a in SMALL if a != "--no-progress"] + ["--case", "state", "--impl",
                                                        "in_process,unienv_mp"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    for label in (config.LABELS["in_process"], config.LABELS["unienv_mp"]):
        assert f"state: {label} ..." in err
        assert any(line.startswith(f"state: {label}: done in ") for line in err), err
    assert cli.main(argv + ["--no-progress"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert config.describe("state", config.case_config("state")) == (
        "state 10 f32, action 7 f32")   # (not "image no image")


def test_charts_use_a_log_axis_where_rows_span_more_than_10x_and_keep_the_legend_aside():
    plt = _pyplot()
    res = measure.Result
    cfg = config.case_config("state")
    points = [(w, res("unienv_mp", config.LABELS["unienv_mp"], n, 1.0))
              for w, n in ((1, 20000), (2, 30000))]
    points += [(w, res("unienv", config.LABELS["unienv"], n, 1.0)) for w, n in ((1, 500),
                                                                               (2, 600))]
    fig = plots.sweep_figure(plt, points, "state", cfg)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and "log scale" in ax.get_ylabel()
    assert "batches of 32" in ax.get_title() and "1-2 workers" in ax.get_title()
    legend = ax.get_legend()
    fig.canvas.draw()
    # the legend lies right of the axes, over no line
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1
    plt.close(fig)
    close = [(None, res("a", "a", 10, 1.0)), (None, res("b", "b", 20, 1.0))]
    fig = plots.sweep_figure(plt, close, "state", cfg)
    assert fig.axes[0].get_yscale() == "linear"
    plt.close(fig)
    results = [res("unienv_mp", config.LABELS["unienv_mp"], 100, 0.01),
               res("in_process", config.LABELS["in_process"], 10, 0.05)]
    fig = plots.table_figure(plt, results, "state", cfg)
    assert fig.axes[0].get_xscale() == "log" and "batches of 32" in fig._suptitle.get_text()
    plt.close(fig)


def test_the_epoch_case_times_as_many_epochs_as_asked(capsys):
    rc, out = _json_run(capsys, SMALL + ["--case", "epoch", "--impl", "in_process",
                                         "--epochs", "3"])
    assert rc == 0 and out["config"]["epochs"] == 3
    assert [len(r["epoch_s"]) for r in out["results"]] == [3, 3]
