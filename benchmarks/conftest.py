"""Shared machinery of the transport benchmarks.

Run everything (one table per group, implementations side by side)::

    pytest benchmarks/ --benchmark-only

* The files are named ``bench_*.py``; this conftest makes pytest collect them (the
  project's ``testpaths`` only covers ``tests/``).  ``benchmarks/`` is a package so that
  this conftest does not shadow ``tests/conftest.py`` (which the tests import by name)
  when both folders are collected in one run.
* Without ``--benchmark-only`` the same benchmarks run (pytest-benchmark only skips
  non-benchmark tests with it); ``--benchmark-disable`` runs every test's round once,
  without warm-ups, as a quick smoke test (~30 s here).
* Every worker process is forked (``multiprocessing.get_context("fork")``) once per test
  and per implementation, lives for all rounds of that test and takes its orders through a
  ``Pipe`` (``Worker.order``); every test checks that no child process is left behind.
* Every round moves a fixed number of messages; ``record_rates`` turns the mean time of a
  round into per-message figures (msgs/s, us per message, MB/s) in ``extra_info``.
"""
import gc
import multiprocessing as mp
import time
from pathlib import Path

import pytest

from .benchutil import Worker, close_queue, make_queue

HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------
# collection of bench_*.py
# ---------------------------------------------------------------------------------------

def pytest_collect_file(file_path, parent):
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and file_path.parent == HERE
            # a file named on the command line is collected by pytest itself
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


@pytest.fixture
def spawn_worker():
    """``spawn_worker(target, *args)`` starts a Worker that is stopped (and reaped) when
    the test ends, whatever happened.  ``on_stop(fn)`` runs ``fn`` first (e.g. to send a
    sentinel through a queue so that an echo loop ends)."""
    workers, hooks = [], []

    def start(target, *args):
        w = Worker(target, *args)
        workers.append(w)
        return w

    start.on_stop = hooks.append
    yield start
    for fn in hooks:
        try:
            fn()
        except Exception:
            pass
    for w in reversed(workers):
        w.stop()


@pytest.fixture
def queues():
    """``queues(impl, **kw)`` makes a queue closed at the end of the test."""
    made = []

    def make(impl, **kw):
        q = make_queue(impl, **kw)
        made.append((q, impl))
        return q

    yield make
    gc.collect()  # drop zero-copy views first so that shm slots are returned
    for q, impl in made:
        close_queue(q, impl)


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    deadline = time.monotonic() + 5
    while mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.01)
    left = mp.active_children()
    for p in left:
        p.kill()
        p.join()
    assert not left, f"children left running: {left}"


def pytest_terminal_summary(terminalreporter, config):
    """After the tables: the derived figures, one line per benchmark, and each one's speed
    relative to multiprocessing.Queue in the same group (per message, from the means)."""
    bs = getattr(config, "_benchmarksession", None)
    if bs is None or not getattr(bs, "benchmarks", None):
        return
    keys = ["us_per_msg", "us_per_msg_best", "msgs_per_s",
            "us_per_round_trip", "us_per_round_trip_best", "round_trips_per_s",
            "us_per_batch", "us_per_batch_best", "batches_per_s", "MB_per_s",
            "median_get_us", "median_touch_us", "median_drop_us", "median_touch_again_us",
            "ms_per_step", "staleness_mean", "staleness_max"]

    def per_msg(b):
        return b.stats.mean / b.extra_info.get("msgs_per_round", 1)

    mp_per = {b.group: per_msg(b) for b in bs.benchmarks
              if "[mp]" in b.name or "[mp-" in b.name}
    tr = terminalreporter
    tr.section("derived figures (extra_info; per message from the mean round, _best from "
               "the fastest round)")
    for b in sorted(bs.benchmarks, key=lambda b: (b.group or "", b.name)):
        info = b.extra_info
        parts = [f"{k}={info[k]}" for k in keys if k in info]
        if b.group in mp_per:
            parts.append(f"speed_vs_mp=x{mp_per[b.group] / per_msg(b):.2f}")
        if parts:
            tr.write_line(f"{(b.group or ''):30s} {b.name:42s} {' '.join(parts)}")
