"""The main job, python -m unienv_mp: options, output, and what happens when a piece is
missing."""
import json
import subprocess
import sys

import pytest

from unienv_mp import __main__ as main_mod
from unienv_mp import compare

SMALL = ["--transitions", "300", "--image-shape", "3x8x8", "--batch-size", "16",
         "--workers", "2", "--buffers", "2", "--seconds", "0.3", "--no-progress"]


def test_json_output_compares_side_by_side(capsys):
    rc = main_mod.main(SMALL + ["--impl", "unienv_mp,in_process,unienv_shm", "--json"])
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
    assert main_mod.main(SMALL + ["--impl", "unienv_mp,dataloader"]) == 0
    text = capsys.readouterr().out
    assert "ms/batch" in text and "batches/s" in text and "MB/s" in text
    assert "unienv_mp MultiprocessingSampler" in text and "torch DataLoader" in text
    assert "faster" in text or "n/a" in text


def test_state_case_and_quick(capsys):
    args = main_mod.parse_args(["--case", "state", "--quick"])
    cfg, _ = main_mod.make_config(args)
    assert cfg.batch_size == 32 and cfg.image_shape == () and cfg.seconds < 2


def test_missing_implementation_is_reported_and_skipped(monkeypatch, capsys):
    monkeypatch.setattr(compare, "available",
                        lambda: {"unienv": "this unienv has no MultiprocessingSampler"})
    assert main_mod.main(SMALL + ["--impl", "unienv,in_process", "--json"]) == 0
    captured = capsys.readouterr()
    assert "skipping UniEnv MultiprocessingSampler" in captured.err
    out = json.loads(captured.out)
    assert [r["name"] for r in out["results"]] == ["in_process"]
    assert out["skipped"] == {"unienv": "this unienv has no MultiprocessingSampler"}


def test_nothing_to_compare(monkeypatch, capsys):
    monkeypatch.setattr(compare, "available",
                        lambda: {k: "torch is not installed" for k in compare.IMPLEMENTATIONS})
    assert main_mod.main(SMALL) == 2
    assert "torch is not installed" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main_mod.main(SMALL + ["--impl", "in_process", "--plot",
                                  str(tmp_path / "p.png")]) == 0
    assert "pip install 'unienv_mp[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("bad", [["--impl", "nope"], ["--workers", "0"],
                                 ["--image-shape", "3xAx4"], ["--seconds", "-1"]])
def test_bad_options_are_refused(bad):
    p = subprocess.run([sys.executable, "-m", "unienv_mp"] + bad, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "error" in p.stderr


def test_plot_writes_a_png(tmp_path, capsys):
    path = tmp_path / "bars.png"
    assert main_mod.main(SMALL + ["--impl", "unienv_mp,in_process", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot saved" in capsys.readouterr().err
