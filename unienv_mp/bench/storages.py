"""The storages case: UniEnv's own storage backends and a LeRobot dataset, a row per backend.

The buffers are built by UniEnv's own storage benchmark code, which its wheel ships
(``benchmarks/storages/bench_storages.py``'s ``build`` makes each backend's buffer,
``bench_common.make_frames`` its camera frames; ``benchmarks/batches/bench_lerobot.py``'s
``build`` writes the synthetic LeRobot v3.0 dataset): imported from where UniEnv is
installed, never copied.  Each buffer is filled, saved and loaded back read-only, as a user
loads a data set, and sampled in batches of ``cfg.batch_size`` by:

* ``in_process``: UniEnv's StepSampler in this process, with torch's and UniEnv's I/O
  threads at their defaults, and again with one thread of each ("one decoder");
* ``bare``: the same rows read into reused memory in this process at one thread, as one
  worker reads them, for the backends whose rows lie in memory or in a file one after the
  other (contiguous HDF5: the rows read from the file with ``preadv``, sorted and
  coalesced; memory-mapped tensors: ``torch.index_select`` into reused tensors, a
  flattened storage's flat rows once): the read limit;
* ``unienv``: UniEnv's MultiprocessingSampler; ``unienv_mp``: ours (and its training
  process's CPU per batch).

For the HDF5 buffer it also times, with its file dropped from the page cache before every
batch (``posix_fadvise(DONTNEED)``, which cannot drop the pages of a memory map), UniEnv in
process and the bare read (cold).  And it times epochs over the HDF5 buffer under spawn: the first (which starts the
workers) and the later ones (on the kept workers).
"""
import contextlib
import importlib
import importlib.util
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field, replace
from typing import Dict, Optional

import numpy as np

from .config import Config
from .measure import Result, measure

#: UniEnv's backends, in its table's order, each with the libraries it needs beyond
#: UniEnv's own: ``build`` imports h5py, Pillow and pyarrow for every backend.
BACKENDS = {
    "torch-ram": (), "torch-memmap": (), "flattened-memmap": (), "hdf5": (),
    "hdf5-gzip": (), "hdf5-per-step-lzf": (), "parquet": (), "dict-video+hdf5": ("av",),
    "dict-png+hdf5": (), "dict-jpeg+hdf5": (), "dict-npz+hdf5": (), "lerobot": ("av",),
}
#: What UniEnv's builders import, whatever the backend.
BUILDERS_NEED = ("h5py", "PIL", "pyarrow")
#: The backends whose rows are read straight into the slot (the goal's "direct reads").
DIRECT_READS = ("hdf5", "torch-memmap", "flattened-memmap")
#: The backends also timed with a cold page cache: posix_fadvise cannot drop the pages a
#: process maps, so a memory-mapped buffer's are not.
COLD = ("hdf5",)
#: The backends whose batches are decoded (the goal's "decode-bound").
DECODED = ("hdf5-gzip", "hdf5-per-step-lzf", "dict-video+hdf5", "dict-png+hdf5",
           "dict-jpeg+hdf5", "dict-npz+hdf5", "lerobot")

COLUMNS = ("in_process", "in_process_1", "bare", "unienv", "unienv_mp")
COLUMN_LABELS = {
    "in_process": "UniEnv in process", "in_process_1": "UniEnv in process, 1 thread",
    "bare": "bare read", "unienv": "UniEnv MultiprocessingSampler",
    "unienv_mp": "unienv_mp", "cold_in_process": "UniEnv in process, cold",
    "cold_bare": "bare read, cold",
}


def missing_for(name):
    """Why backend ``name`` cannot be built here (None if it can)."""
    for lib in BUILDERS_NEED + BACKENDS[name]:
        if importlib.util.find_spec(lib) is None:
            pip = {"PIL": "pillow"}.get(lib, lib)
            return f"{pip} is not installed (pip install -e '.[disk]')"
    for script in _scripts(name):
        if _find_script(*script) is None:
            return (f"UniEnv's benchmarks/{'/'.join(script)} is not installed (it ships in "
                    f"UniEnv's wheel)")
    return None


def _scripts(name):
    if name == "lerobot":
        return [("batches", "bench_lerobot.py")]
    return [("storages", "bench_storages.py")]


def _find_script(folder, script):
    """The folder of UniEnv's ``benchmarks/<folder>/<script>`` where UniEnv is installed,
    or None."""
    spec = importlib.util.find_spec("unienv_data")
    if spec is None or spec.origin is None:
        return None
    site = os.path.dirname(os.path.dirname(spec.origin))
    where = os.path.join(site, "benchmarks", folder)
    return where if os.path.isfile(os.path.join(where, script)) else None


def _import_script(folder, module):
    """UniEnv's ``benchmarks/<folder>/<module>.py``, imported from where UniEnv is
    installed (its folder on ``sys.path``, as the script expects; ``bench_lerobot`` reads
    ``sys.argv`` when imported: it is given none)."""
    where = _find_script(folder, module + ".py")
    if where not in sys.path:
        sys.path.insert(0, where)
    argv = sys.argv
    sys.argv = [module]
    try:
        return importlib.import_module(module)
    finally:
        sys.argv = argv


# -- building the buffers ------------------------------------------------------------------

def build_buffer(name, root, cfg: Config, progress=lambda n: None):
    """The buffer of backend ``name`` under ``root``, built by UniEnv's builders with
    ``cfg.transitions`` steps and images of ``cfg.image_shape``'s side, saved and loaded
    back read-only."""
    if name == "lerobot":
        return _lerobot(root, cfg, progress)
    import torch
    from unienv_interface.backends.pytorch import PyTorchComputeBackend as TB
    from unienv_data.replay_buffer import ReplayBuffer
    bench_storages = _import_script("storages", "bench_storages")
    bench_common = _import_script("storages", "bench_common")
    side = int(cfg.image_shape[-1]) if cfg.image_shape else 64
    backends, space_fn = bench_storages.build(types.SimpleNamespace(img=side))
    backend, create, load_kwargs = backends[name]
    space = space_fn(backend)
    frames = bench_common.make_frames(256, side, chw=backend is TB)
    rng = np.random.default_rng(0)
    path = os.path.join(root, name)
    rb = create(path, cfg.transitions)
    chunk = 256
    for start in range(0, cfg.transitions, chunk):
        n = min(chunk, cfg.transitions - start)
        batch = {}
        for key, sub in space.spaces.items():
            if key == "image":
                value = frames[np.arange(start, start + n) % len(frames)]
            elif key == "terminated":
                value = rng.random(n) < 0.01
            else:
                value = rng.uniform(-1, 1, (n, *sub.shape)).astype(np.float32)
            value = np.ascontiguousarray(value)
            batch[key] = torch.from_numpy(value) if backend is TB else value
        rb.extend(batch)
        progress(n)
    rb.dumps(path)
    close_buffer(rb)
    return ReplayBuffer.load_from(path, backend=backend,
                                  device="cpu" if backend is TB else None, **load_kwargs)


def _lerobot(root, cfg, progress):
    from pathlib import Path

    from unienv_data.integrations.lerobot import LeRobotAsUniEnvDataset
    from unienv_interface.backends.numpy import NumpyComputeBackend as NB
    bench_lerobot = _import_script("batches", "bench_lerobot")
    ep_len = 100
    episodes = max(2, cfg.transitions // ep_len)
    side = int(cfg.image_shape[-1]) if cfg.image_shape else 96
    path = Path(root) / "lerobot"
    bench_lerobot.build(path, episodes, ep_len, eps_per_file=50, eps_per_video=10, hw=side)
    progress(episodes * ep_len)
    return LeRobotAsUniEnvDataset.from_local(str(path), NB, decode_video=True,
                                             video_backend="pyav")


def close_buffer(rb):
    storage = getattr(rb, "storage", None)
    rb.close()
    if storage is not None:
        storage.close()


def data_files(rb):
    """Every file under the buffer's folders (what a cold read drops from the page
    cache)."""
    roots = set()
    stack = [getattr(rb, "storage", None)]
    while stack:
        st = stack.pop()
        if st is None:
            continue
        stack.extend(getattr(st, "storage_map", {}).values())
        inner = getattr(st, "inner_storage", None)
        if inner is not None:
            stack.append(inner)
        name = getattr(st, "cache_filename", None)
        if name:
            roots.add(str(name))
    out = []
    for r in roots:
        if os.path.isfile(r):
            out.append(r)
        for folder, _, names in os.walk(r):
            out.extend(os.path.join(folder, n) for n in names)
    return sorted(set(out))


def drop_cache(paths):
    """Drop the files' pages from the page cache (clean pages only: the files were
    written and synced before)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- what each column times ----------------------------------------------------------------

@contextlib.contextmanager
def one_thread():
    """torch at one intra-op thread, and UniEnv's pool of I/O threads at one (its storages
    decode their files one at a time)."""
    import torch

    from .._direct import unienv as _unienv
    threads, pool = torch.get_num_threads(), _unienv.io_threads()
    torch.set_num_threads(1)
    _unienv.io_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _unienv.io_threads(pool)


def bare_reader(name, rb, cfg):
    """``(next_batch, close)``: the rows a StepSampler draws, read into reused memory in
    this process, for the backends of `DIRECT_READS`; None for the others."""
    from unienv_data.samplers import StepSampler

    from .._direct.base import sampled_rows
    from .._direct.gather import Planner
    base = StepSampler(rb, cfg.batch_size, seed=0)
    if name not in DIRECT_READS:
        return None
    tree = Planner(base, bind=True).structure("get_at")
    leaves = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        else:
            leaves.append(node)
    import torch
    outs = {}
    for leaf in leaves:
        if leaf.reader is not None:
            outs[id(leaf)] = np.empty((cfg.batch_size, *leaf.tail), leaf.dtype)
        elif leaf.columns is not None:   # (a flattened storage: its flat rows, once)
            flat = leaf.columns[0]
            outs[id(flat)] = torch.empty((cfg.batch_size, flat.shape[1]), dtype=flat.dtype)
        else:
            src = leaf.parts[0][0]
            outs[id(leaf)] = torch.empty((cfg.batch_size, *src.shape[1:]), dtype=src.dtype)

    def next_batch():
        rows = sampled_rows(rb, base.sample_index())
        rows_np = None
        done = set()
        for leaf in leaves:
            if leaf.reader is not None:
                if rows_np is None:
                    rows_np = np.ascontiguousarray(rows, dtype=np.int64)
                out = outs[id(leaf)]
                leaf.reader.fill(rows_np, out, 0, out, {})
            elif leaf.columns is not None:
                flat = leaf.columns[0]
                if id(flat) not in done:
                    done.add(id(flat))
                    torch.index_select(flat, 0, rows, out=outs[id(flat)])
            else:
                torch.index_select(leaf.parts[0][0], 0, rows, out=outs[id(leaf)])
        return list(outs.values())
    return next_batch, lambda: None


@dataclass
class BackendRun:
    """One backend's row: its results by column, why it was skipped, its epochs."""
    name: str
    results: Dict[str, Result] = field(default_factory=dict)
    skipped: Optional[str] = None
    gather_path: Optional[str] = None
    epochs: Optional[dict] = None


def measure_backend(name, rb, cfg, columns, advance=lambda f: None):
    """Time ``columns`` over backend ``name``'s buffer ``rb``."""
    from .peers import sampler_object
    run = BackendRun(name)
    files = data_files(rb)
    for col in columns:
        if col == "bare" or col == "cold_bare":
            if bare_reader(name, rb, cfg) is None:
                continue
        if col in ("in_process", "in_process_1", "cold_in_process"):
            def make():
                s = sampler_object("in_process", rb, cfg)
                return s.sample, lambda: None
        elif col in ("bare", "cold_bare"):
            def make():
                return bare_reader(name, rb, cfg)
        else:
            def make(col=col):
                s = sampler_object(col, rb, cfg)
                if col == "unienv_mp":
                    run.gather_path = (s.gather_path, s.gather_path_reason)
                return s.sample, s.close
        if col.startswith("cold_"):
            inner = make

            def make(inner=inner):
                next_batch, close = inner()

                def cold_batch():
                    drop_cache(files)
                    return next_batch()
                return cold_batch, close
        # (the bare read at one thread, as one worker reads: the read limit per core)
        threads = col in ("in_process_1", "bare", "cold_bare")
        with (one_thread() if threads else contextlib.nullcontext()):
            res = measure(col, rb, cfg, advance, make=make)
        res.label = COLUMN_LABELS[col]
        run.results[col] = res
    return run


def measure_epochs(rb, cfg, epochs=4):
    """Seconds of each of ``epochs`` epochs over ``rb`` under spawn (the first starts the
    workers), and the workers each ran on (with the reason)."""
    from unienv_data.samplers import StepSampler

    from .._sampling.sampler import MultiprocessingSampler
    out = {"seconds": [], "workers": [], "reason": None}
    s = MultiprocessingSampler(StepSampler(rb, cfg.batch_size, seed=0), n_workers=cfg.workers,
                               n_buffers=cfg.buffers, ctx=mp.get_context("spawn"))
    with s:
        for _ in range(epochs):
            t0 = time.perf_counter()
            for batch in s.epoch_iter():
                del batch
            out["seconds"].append(time.perf_counter() - t0)
            out["workers"].append(s.epoch_workers)
            out["reason"] = s.epoch_workers_reason
    return out


def settle(rb):
    """Wait until the buffer's files last changed long enough ago for kept workers to
    trust their identity (`unienv_mp._sampling.files.RACY_NS`)."""
    from .._sampling.files import RACY_NS
    newest = 0
    for p in data_files(rb):
        st = os.stat(p)
        newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
    wait = (newest + RACY_NS) / 1e9 + 0.05 - time.time()
    if wait > 0:
        time.sleep(wait)


def run_all(cfg, names, columns, progress, say, backends=None):
    """Build and time every backend of ``backends`` (default all), one at a time (each
    buffer removed once timed): a list of `BackendRun`."""
    runs = []
    root = tempfile.mkdtemp(prefix="unienv_mp-storages-")
    try:
        for name in backends or BACKENDS:
            why = missing_for(name)
            if why is not None:
                say(f"storages: skipping {name}: {why}")
                runs.append(BackendRun(name, skipped=why))
                continue
            bar = progress.bar(cfg.transitions, f"storages: building {name}", "steps")
            try:
                with _quiet_av():
                    rb = build_buffer(name, root, cfg, bar.update)
            except Exception as e:
                bar.close()
                runs.append(BackendRun(name, skipped=f"building it failed: "
                                                     f"{type(e).__name__}: {e}"))
                continue
            bar.close()
            try:
                cols = list(columns)
                if name in COLD:
                    cols += [c for c in ("cold_in_process", "cold_bare") if
                             c.replace("cold_", "") in columns]

                def timed(col, rb=rb, name=name):
                    advance, close = progress.timing(f"storages: {name}: "
                                                     f"{COLUMN_LABELS[col]}")
                    try:
                        return measure_backend(name, rb, cfg, [col], advance)
                    finally:
                        close()
                run = BackendRun(name)
                for col in cols:
                    part = timed(col)
                    run.results.update(part.results)
                    run.gather_path = run.gather_path or part.gather_path
                if name == "hdf5" and "unienv_mp" in columns:
                    settle(rb)
                    advance, close = progress.timing("storages: hdf5: epochs under spawn")
                    try:
                        run.epochs = measure_epochs(rb, cfg, cfg.epochs)
                    except Exception as e:
                        run.epochs = {"error": f"{type(e).__name__}: {e}"}
                    finally:
                        close()
                runs.append(run)
            finally:
                close_buffer(rb)
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return runs


@contextlib.contextmanager
def _quiet_av():
    """PyAV's encoders print their statistics on stderr: quiet while building.  UniEnv's
    VideoStorage hands libav's logging back to libav's own printer after every clip
    (``restore_default_callback``), so libav's level is set too, not only PyAV's."""
    try:
        import av
    except ImportError:
        yield
        return
    level = av.logging.get_level()
    av.logging.set_level(av.logging.ERROR)
    av.logging.set_libav_level(av.logging.ERROR)
    try:
        yield
    finally:
        # (libav's own default level, which nothing here can read back)
        av.logging.set_libav_level(av.logging.INFO)
        av.logging.set_level(level)


# -- the table -----------------------------------------------------------------------------

def _ms(r):
    if r is None:
        return "-"
    if r.error:
        return "failed"
    return f"{r.ms_per_batch:.2f}"


def goals(run, cfg):
    """The issue's goals for this backend, as text: direct reads at least 3x UniEnv in
    process and within 1.3x of the bare read; decoded batches at least 0.8 x min(workers,
    cores) x one in-process decoder; the training process's CPU per batch at most 2 % of
    in process."""
    r = run.results
    ours, ip, one = r.get("unienv_mp"), r.get("in_process"), r.get("in_process_1")
    bare = r.get("bare")
    out = []

    def ok(x):
        return x is not None and not x.error and x.batches

    if ok(ours) and ok(ip):
        cpu = ours.main_cpu_ms_per_batch / ip.main_cpu_ms_per_batch
        out.append(f"CPU {100 * cpu:.1f}% {'ok' if cpu <= 0.02 else 'MISSED'}")
    if run.name in DIRECT_READS and ok(ours) and ok(ip):
        x = ip.ms_per_batch / ours.ms_per_batch
        out.append(f"{x:.1f}x in-process {'ok' if x >= 3 else 'MISSED'}")
        if ok(bare):
            y = ours.ms_per_batch / bare.ms_per_batch
            out.append(f"{y:.2f}x bare {'ok' if y <= 1.3 else 'MISSED'}")
    if run.name in DECODED and ok(ours) and ok(one):
        need = 0.8 * min(cfg.workers, os.cpu_count() or 1)
        x = one.ms_per_batch / ours.ms_per_batch
        out.append(f"{x:.2f}x one decoder (goal {need:.1f}x) {'ok' if x >= need else 'MISSED'}")
    return "; ".join(out) or "-"


def storages_table(runs, cfg):
    from .tables import Table, versus
    head = ["backend", "path"] + [COLUMN_LABELS[c] for c in COLUMNS] + [
        "unienv_mp main CPU", "unienv_mp vs in process", "goals"]
    rows = []
    notes = []
    for run in runs:
        if run.skipped:
            rows.append([run.name, "skipped"] + ["-"] * (len(head) - 3) + [run.skipped[:60]])
            continue
        r = run.results
        ours, ip = r.get("unienv_mp"), r.get("in_process")
        versus_cell = "-"
        if ours is not None and ip is not None and not ours.error and not ip.error \
                and ours.batches and ip.batches:
            versus_cell = versus(ip.ms_per_batch / ours.ms_per_batch)
        path = run.gather_path[0] if run.gather_path else "-"
        rows.append([run.name, path] + [_ms(r.get(c)) for c in COLUMNS] + [
            "-" if ours is None or ours.error else f"{ours.main_cpu_ms_per_batch:.3f}",
            versus_cell, goals(run, cfg)])
        for col, res in r.items():
            if res.error:
                notes.append(f"{run.name}, {COLUMN_LABELS[col]}: {res.error[:200]}")
        if run.gather_path and run.gather_path[1]:
            notes.append(f"{run.name}: generic path: {run.gather_path[1]}")
    cold = [run for run in runs if any(c.startswith("cold_") for c in run.results)]
    for run in cold:
        r = run.results
        notes.append(f"{run.name}, cold page cache (files dropped before every batch): "
                     + ", ".join(f"{COLUMN_LABELS[c]} {_ms(r.get(c))} ms"
                                 for c in ("cold_in_process", "cold_bare") if c in r))
    for run in runs:
        if run.epochs:
            e = run.epochs
            if "error" in e:
                notes.append(f"{run.name} epochs under spawn: failed: {e['error']}")
                continue
            secs = e["seconds"]
            later = secs[1:]
            ratio = secs[0] / (sum(later) / len(later)) if later else float("nan")
            notes.append(
                f"{run.name} epochs under spawn, {cfg.workers} workers: "
                + ", ".join(f"{s:.2f} s ({w})" for s, w in zip(secs, e["workers"]))
                + f"; the first / the later: {ratio:.1f}x "
                + ("ok" if ratio >= 3 and e["workers"][-1] == "kept" else "(goal 3x)")
                + f"; the last's reason: {e['reason']}")
    title = (f"{cfg.transitions} steps per backend (images {cfg.image_shape[-1]}x"
             f"{cfg.image_shape[-1]}x3), batches of {cfg.batch_size}, {cfg.workers} "
             f"workers, {cfg.buffers} buffers, {cfg.start_method}; ms per batch, each "
             f"batch touched once per 4 KiB")
    notes.insert(0, "Buffers built by UniEnv's own benchmarks/storages/bench_storages.py "
                    "(and bench_lerobot.py), saved and loaded back read-only.  bare read: "
                    "the same rows into reused memory in process at one thread (contiguous "
                    "HDF5: preadv, sorted and coalesced; memory maps: index_select).  1 thread: torch and "
                    "UniEnv's I/O pool at one thread (one decoder).  main CPU: ms of this "
                    "process's CPU per batch.")
    return Table(title, head, rows, notes)


def payload(runs):
    return {"results": {run.name: {"skipped": run.skipped,
                                   "gather_path": run.gather_path,
                                   "epochs": run.epochs,
                                   "columns": {c: r.as_dict() for c, r in run.results.items()}}
                        for run in runs}}


def config_for(cfg, quick):
    """The case's settings: 4000 steps of 128x128 images (quick: 1024 of 32x32, the least
    UniEnv's per-step-lzf backend takes), batches of 256."""
    if quick:
        return replace(cfg, transitions=max(cfg.transitions, 1024),
                       image_shape=(3, 32, 32) if cfg.image_shape == (3, 128, 128)
                       else cfg.image_shape)
    return cfg
