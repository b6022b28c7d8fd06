"""Soak: a minute of mixed sampling and epochs while workers are killed at random.

Deselected by default (``-m "not soak"`` in pyproject); run with ``pytest tests -m soak``.
``UNIENV_MP_SOAK_SECONDS`` changes its length (default 60).
"""
import os
import random
import signal
import threading
import time

import pytest
from unienv_data.samplers import StepSampler

from unienv_mp import MultiprocessingSampler

from _data import indices_of, replay_buffer
from conftest import own_segment_fds, shm_files


def _rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@pytest.mark.soak
def test_soak_mixed_work_with_random_worker_kills():
    duration = float(os.environ.get("UNIENV_MP_SOAK_SECONDS", "60"))
    rb = replay_buffer(600, img=(3, 16, 16))
    m = MultiprocessingSampler(StepSampler(rb, 25, seed=0), n_workers=3, n_buffers=4,
                               ctx="fork", doze_time=0.01)
    stop = threading.Event()
    kills = []
    rng = random.Random(1)

    def killer():
        while not stop.wait(rng.uniform(0.2, 1.0)):
            try:
                # the sampling workers, or those of the epoch running now
                pools = [p for p in (m._manager, m._kept, *list(m._epoch_managers))
                         if p is not None]
            except RuntimeError:   # the set changed while we copied it
                continue
            if not pools:
                continue
            try:
                pid = rng.choice(rng.choice(pools).workers).pid
                os.kill(pid, signal.SIGKILL)
                kills.append(pid)
            except (ProcessLookupError, ValueError, TypeError):
                pass

    t = threading.Thread(target=killer, daemon=True)
    start = time.monotonic()
    samples = epochs = 0
    rss = []
    m.sample()
    t.start()
    try:
        while time.monotonic() - start < duration:
            for _ in range(20):
                b = m.sample()
                assert m.sampled_space.contains(b)
                samples += 1
            early = rng.random() < 0.3
            seen = []
            for i, b in enumerate(m.epoch_iter()):
                seen += indices_of(b)
                if early and i == 5:
                    break
            if not early:
                assert sorted(seen) == list(range(600)), "an epoch lost or repeated an index"
                epochs += 1
            assert not shm_files()
            rss.append(_rss_kib())
    finally:
        stop.set()
        t.join()
        m.close()
    assert len(kills) >= 10 and epochs >= 3 and samples >= 100
    third = len(rss) // 3
    # memory is flat: the last third of the run uses no more than the first third, give or
    # take allocator noise
    assert max(rss[-third:]) <= max(rss[:third]) * 1.3 + 20_000, rss
    assert not own_segment_fds()
