"""The main job, python -m unienv_mp: options, output, and what happens when a piece is
missing."""
import importlib.util
import json
import subprocess
import sys
import threading

import pytest

from unienv_mp.bench import cli, config, data, measure, peers, tables

SMALL = ["--transitions", "300", "--image-shape", "3x8x8", "--batch-size", "16",
         "--workers", "2", "--buffers", "2", "--seconds", "0.3", "--no-progress"]


def test_json_output_compares_side_by_side(capsys):
    rc = cli.main(SMALL + ["--impl", "unienv_mp,in_process,unienv_shm", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    names = [r["name"] for r in out["results"]]
    assert names == ["unienv_mp", "in_process", "unienv_shm"]
    for r in out["results"]:
        assert r["error"] is None and r["batches"] >= 5 and r["ms_per_batch"] > 0
        assert r["batch_bytes"] == 16 * (17 * 4 + 3 * 8 * 8)
    assert set(out["speedup_of_unienv_mp"]) == {"in_process", "unienv_shm"}
    assert out["config"]["transitions"] == 300


def test_table_output(capsys):
    assert cli.main(SMALL + ["--impl", "unienv_mp,dataloader"]) == 0
    text = capsys.readouterr().out
    assert "ms/batch" in text and "batches/s" in text and "MB/s" in text
    assert "unienv_mp MultiprocessingSampler" in text and "torch DataLoader" in text
    assert "faster" in text or "n/a" in text


def test_state_case_and_quick(capsys):
    args = cli.parse_args(["--case", "state", "--quick"])
    cfg, _ = cli.make_config(args)
    assert cfg.batch_size == 32 and cfg.image_shape == () and cfg.seconds < 2


def test_missing_implementation_is_reported_and_skipped(monkeypatch, capsys):
    monkeypatch.setattr(peers, "available",
                        lambda: {"unienv": "this unienv has no MultiprocessingSampler"})
    assert cli.main(SMALL + ["--impl", "unienv,in_process", "--json"]) == 0
    captured = capsys.readouterr()
    assert "skipping UniEnv MultiprocessingSampler" in captured.err
    out = json.loads(captured.out)
    assert [r["name"] for r in out["results"]] == ["in_process"]
    assert out["skipped"] == {"unienv": "this unienv has no MultiprocessingSampler"}


def test_nothing_to_compare(monkeypatch, capsys):
    monkeypatch.setattr(peers, "available",
                        lambda: {k: "torch is not installed" for k in config.IMPLEMENTATIONS})
    assert cli.main(SMALL) == 2
    assert "torch is not installed" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_get_it_before_measuring(monkeypatch, tmp_path,
                                                                     capsys):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.main(SMALL + ["--impl", "in_process", "--plot",
                                  str(tmp_path / "p.png")]) == 2
    captured = capsys.readouterr()
    assert "pip install 'unienv_mp[plot]'" in captured.err and captured.out == ""
    assert not (tmp_path / "p.png").exists()
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("bad", [["--impl", "nope"], ["--workers", "0"],
                                 ["--image-shape", "3xAx4"], ["--seconds", "-1"]])
def test_bad_options_are_refused(bad):
    p = subprocess.run([sys.executable, "-m", "unienv_mp"] + bad, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "error" in p.stderr


def test_plot_writes_a_png(tmp_path, capsys):
    path = tmp_path / "bars.png"
    assert cli.main(SMALL + ["--impl", "unienv_mp,in_process", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot saved" in capsys.readouterr().err


# The in-process speed limit and TorchRL's ReplayBuffer: rows in the same comparison.

TINY = config.Config(transitions=300, batch_size=16, image_shape=(3, 8, 8), workers=2,
                      buffers=2)
needs_torchrl = pytest.mark.skipif("torchrl" in peers.available(),
                                   reason="torchrl is not installed")


@pytest.fixture(scope="module")
def tiny_rb():
    return data.build_buffer(TINY)


@pytest.fixture(scope="module")
def wrapped_rb():
    """A full ring whose logical row 0 is physical row 37 (logical and physical differ)."""
    import torch
    rb = data.build_buffer(TINY)
    g = torch.Generator().manual_seed(1)
    rb.extend({"state": torch.rand(37, 10, generator=g) + 2,
               "action": torch.rand(37, 7, generator=g),
               "image": torch.randint(0, 256, (37, 3, 8, 8), dtype=torch.uint8, generator=g)})
    assert len(rb) == TINY.transitions and rb._ring_state.read()[1] == 37
    return rb


@pytest.fixture(params=["tiny_rb", "wrapped_rb"])
def any_rb(request):
    return request.getfixturevalue(request.param)


def _take(name, rb, n=3, seed=0):
    """``n`` batches of implementation ``name``, each as {key: a copy of its tensor}."""
    next_batch, close = peers.make_sampler(name, rb, TINY, seed=seed)
    try:
        out = []
        for _ in range(n):
            b = next_batch()
            out.append({k: b[k].clone() for k in b.keys()})
        return out
    finally:
        close()


def _assert_rows_of_the_buffer(rb, batch):
    """Every row of ``batch`` is one transition of ``rb``: all keys from the same row."""
    tensors = data.dict_storage_tensors(rb)
    for i in range(TINY.batch_size):
        match = (tensors["state"] == batch["state"][i]).all(dim=1).nonzero().flatten()
        assert len(match) >= 1, "a sampled state is not in the buffer"
        j = int(match[0])
        for k in tensors:
            assert (batch[k][i] == tensors[k][j]).all(), k


@pytest.mark.parametrize("name", ["index_select",
                                  pytest.param("torchrl", marks=needs_torchrl)])
def test_new_rows_give_batches_like_in_process(any_rb, name):
    [ref] = _take("in_process", any_rb, n=1)
    batches = _take(name, any_rb)
    for b in batches:
        assert set(b) == set(ref) == {"state", "action", "image"}
        for k in ref:
            assert b[k].shape == ref[k].shape and b[k].dtype == ref[k].dtype, k
        _assert_rows_of_the_buffer(any_rb, b)
    assert not all((batches[0]["state"] == b["state"]).all() for b in batches[1:]), (
        "every batch was the same")


def test_index_select_draws_the_step_samplers_indices_into_reused_memory(any_rb):
    # Same StepSampler seed: the same rows as sampling in process, batch for batch
    # (also where the ring's logical rows are not its physical rows).
    for mine, ref in zip(_take("index_select", any_rb, n=5, seed=7),
                         _take("in_process", any_rb, n=5, seed=7)):
        for k in ref:
            assert (mine[k] == ref[k]).all(), k
    next_batch, close = peers.make_sampler("index_select", any_rb, TINY)
    first = next_batch()
    ptrs = {k: v.data_ptr() for k, v in first.items()}
    second = next_batch()
    assert {k: v.data_ptr() for k, v in second.items()} == ptrs
    close()


@needs_torchrl
def test_torchrl_batches_can_be_touched_and_close_stops_its_threads(tiny_rb):
    before = set(threading.enumerate())
    next_batch, close = peers.make_sampler("torchrl", tiny_rb, TINY)
    b = next_batch()
    assert type(b).__name__ == "TensorDict"     # walked as is, not converted
    assert measure.batch_nbytes(b) == 16 * (17 * 4 + 3 * 8 * 8)
    assert measure.touch(b) == measure.touch({k: b[k] for k in b.keys()})
    for _ in range(5):
        next_batch()
    assert set(threading.enumerate()) - before, "no prefetch threads"
    close()
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()]


def test_new_rows_in_the_same_run(capsys):
    impls = ["unienv_mp", "in_process", "index_select", "torchrl"]
    rc = cli.main(SMALL + ["--impl", ",".join(impls), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    ran = [r["name"] for r in out["results"]]
    if "torchrl" in peers.available():
        impls.remove("torchrl")
        assert "torchrl" in out["skipped"]
    assert ran == impls
    for r in out["results"]:
        assert r["error"] is None and r["batches"] >= 5 and r["ms_per_batch"] > 0
        assert r["batch_bytes"] == 16 * (17 * 4 + 3 * 8 * 8)
    assert set(out["speedup_of_unienv_mp"]) == set(impls) - {"unienv_mp"}


def test_default_run_includes_every_row():
    args = cli.parse_args([])
    assert args.impls == ["unienv_mp", "unienv_mp_generic", "unienv", "unienv_shm",
                          "in_process", "dataloader", "index_select", "torchrl"]
    assert config.LABELS["index_select"] == "index_select into reused memory, in process"
    assert config.LABELS["torchrl"] == "TorchRL ReplayBuffer(prefetch=4)"


def test_impl_ray_adds_the_ray_row_to_the_default_rows():
    assert cli.parse_args(["--impl", "ray"]).impls == [*config.DEFAULT_IMPLEMENTATIONS,
                                                            "ray"]
    assert cli.parse_args(["--impl", "unienv_mp,ray"]).impls == ["unienv_mp", "ray"]
    assert config.LABELS["ray"] == "unienv_mp RaySampler (local Ray)"
    assert "ray" in config.CASES["image"].rows and "ray" in config.CASES["jpeg"].rows


def test_table_says_slower_where_unienv_mp_loses():
    cfg = config.Config(transitions=300, batch_size=16, image_shape=())
    # (name, batches, seconds): unienv_mp takes 100 ms a batch
    timings = [("unienv_mp", 10, 1.0), ("index_select", 25, 1.0), ("torchrl", 4, 1.0),
               ("in_process", 10, 1.03), ("dataloader", 10, 0.98)]
    results = [measure.Result(n, config.LABELS[n], b, s) for n, b, s in timings]
    lines = tables.render_table(results, cfg).splitlines()
    verdict = {n: next(line for line in lines if line.startswith(config.LABELS[n]))
               .rsplit("  ", 1)[-1].strip() for n, _, _ in timings}
    assert verdict == {"unienv_mp": "-", "index_select": "2.5x slower",
                       "torchrl": "2.5x faster", "in_process": "1.03x faster",
                       "dataloader": "1.02x slower"}


def test_without_torchrl_asking_for_its_row_says_how_to_install_it():
    # torchrl made unimportable: nothing at import time needs it; asked for by name, its
    # row stops the main job before it measures (in the default rows it is skipped: see
    # test_main_cases)
    code = ("import sys; sys.modules['torchrl'] = sys.modules['tensordict'] = None\n"
            "import importlib.util; real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda n, *a: None if n == 'torchrl' else real(n, *a)\n"
            "from unienv_mp.bench import cli as m\n"
            f"sys.exit(m.main({SMALL + ['--impl', 'in_process,torchrl', '--json']!r}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2, p.stderr
    assert "--impl torchrl: torchrl is not installed (pip install torchrl)" in p.stderr
    assert p.stdout == ""


def test_available_reports_missing_torchrl(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchrl" else real(name, *a))
    missing = peers.available()
    assert "torchrl" in missing and "torchrl" in missing["torchrl"]
    assert "index_select" not in missing


def test_the_generic_path_row_runs_the_wrapped_sampler(capsys):
    rc = cli.main(SMALL + ["--impl", "unienv_mp,unienv_mp_generic", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in out["results"]}
    assert set(rows) == {"unienv_mp", "unienv_mp_generic"}
    assert all(r["batches"] > 0 and r["error"] is None for r in rows.values())
    assert rows["unienv_mp"]["batch_bytes"] == rows["unienv_mp_generic"]["batch_bytes"]


def test_the_two_unienv_mp_rows_take_the_two_paths():
    cfg = config.Config(transitions=300, batch_size=16, image_shape=(3, 8, 8))
    rb = data.build_buffer(cfg)
    for name, path in (("unienv_mp", "direct"), ("unienv_mp_generic", "generic")):
        next_batch, close = peers.make_sampler(name, rb, cfg)
        try:
            assert next_batch.__self__.gather_path == path
            assert next_batch()["image"].shape == (16, 3, 8, 8)
        finally:
            close()


def test_ci_runs_the_readme_test_command():
    """.ci/run keeps a copy of the README's quick-start test command: the two agree."""
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(root, ".ci", "run")) as f:
        ci = [line.strip() for line in f]
    command = 'pip install torch==2.13.0 && pip install -e ".[test,ray]" && python -m pytest tests'
    assert "    " + command + "\n" in readme
    assert command in ci
    assert "    pip install torch==2.13.0 && pip install -e . && python -m unienv_mp\n" in readme
