"""The main job's storages case: a row per UniEnv storage backend, its buffer built by
UniEnv's own benchmark code; what it produces, not how fast."""
import importlib.util

import pytest

from unienv_mp.bench import config, progress, storages

TINY = dict(transitions=300, batch_size=16, image_shape=(3, 16, 16), workers=2, buffers=2,
            seconds=0.2, warmup=1, epochs=3)


def _say(lines):
    return lines.append


def test_each_backend_built_by_unienv_is_timed_in_every_column():
    for name in ("hdf5", "dict-png+hdf5"):
        if storages.missing_for(name):
            pytest.skip(storages.missing_for(name))
    cfg = config.case_config("storages", **TINY)
    said = []
    runs = storages.run_all(cfg, None, storages.COLUMNS, progress.Progress(False),
                            _say(said), backends=["torch-memmap", "hdf5", "dict-png+hdf5"])
    by = {run.name: run for run in runs}
    for name in ("torch-memmap", "hdf5", "dict-png+hdf5"):
        run = by[name]
        assert run.skipped is None and run.gather_path == ("direct", None)
        cols = set(storages.COLUMNS) - ({"bare"} if name == "dict-png+hdf5" else set())
        if name == "hdf5":
            cols |= {"cold_in_process", "cold_bare"}
        assert set(run.results) == cols, name
        assert all(r.error is None and r.batches > 0 for r in run.results.values()), name
    epochs = by["hdf5"].epochs
    assert epochs["workers"] == ["new", "kept", "kept"], epochs
    assert "storage.hdf5" in epochs["reason"]
    text = storages.storages_table(runs, cfg).format()
    assert "hdf5" in text and "cold page cache" in text and "epochs under spawn" in text


def test_a_backend_whose_library_is_missing_is_skipped_saying_why(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "av" else real(name, *a))
    why = storages.missing_for("dict-video+hdf5")
    assert why == "av is not installed (pip install -e '.[disk]')"
    assert storages.missing_for("lerobot") == why
    cfg = config.case_config("storages", **TINY)
    said = []
    runs = storages.run_all(cfg, None, ("in_process",), progress.Progress(False),
                            _say(said), backends=["dict-video+hdf5"])
    assert runs[0].skipped == why and not runs[0].results
    assert said == [f"storages: skipping dict-video+hdf5: {why}"]
    assert "skipped" in storages.storages_table(runs, cfg).format()


def test_the_storages_case_runs_alone():
    assert not config.CASES["storages"].in_all
    quick = config.case_config("storages", quick=True)
    assert quick.transitions == 1024 and quick.image_shape == (3, 32, 32)


def test_building_a_video_buffer_prints_nothing_from_the_encoder(capfd):
    """UniEnv's VideoStorage gives libav's logging back to libav after every clip: the
    encoder's statistics (pages of them) stay out of the case's output."""
    if storages.missing_for("dict-video+hdf5"):
        pytest.skip(storages.missing_for("dict-video+hdf5"))
    cfg = config.case_config("storages", **TINY)
    runs = storages.run_all(cfg, None, ("in_process",), progress.Progress(False),
                            _say([]), backends=["dict-video+hdf5"])
    assert runs[0].skipped is None and runs[0].results["in_process"].error is None
    err = capfd.readouterr().err
    assert "libx264" not in err, err[:500]
