"""Soak: a minute of mixed sampling and epochs while workers are killed at random; then a
minute of kill bursts, samplers closed from another thread, and workers stopped and
continued.

Deselected by default (``-m "not soak"`` in pyproject); run with ``pytest tests -m soak``.
``UNIENV_MP_SOAK_SECONDS`` changes its length (default 60).
"""
import os
import random
import signal
import threading
import time
import warnings

import pytest
from unienv_data.samplers import StepSampler

from unienv_mp import MultiprocessingSampler, WorkerDiedError

from _data import SlowSampler, indices_of, replay_buffer
from conftest import own_segment_fds, shm_files, wait_until


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
                pools = [p for p in (m._pools.sample, m._pools.kept, *list(m._pools.own))
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


def _reference(n, delay, **options):
    """The first ``n`` batches (their row indices) of a sampler nothing happens to."""
    with MultiprocessingSampler(SlowSampler(replay_buffer(600, img=(3, 8, 8)), 8, seed=0,
                                            delay=delay), **options) as m:
        return [indices_of(m.sample(), img=(3, 8, 8)) for _ in range(n)]


def _children():
    """pids of this process's children, zombies included (from /proc)."""
    me = str(os.getpid())
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        out.append(int(pid))
            except (OSError, IndexError):
                pass
    return out


def _kill_bursts(seconds, rng):
    """Bursts of SIGKILLs, each replacement killed before it can make a batch, so that the
    sampler gives up; after each burst, the next call must start afresh and the stream
    goes on: every batch returned is the reference's next one."""
    options = dict(n_workers=2, n_buffers=4, ctx="fork", doze_time=0.005, batches_per_task=1)
    m = MultiprocessingSampler(SlowSampler(replay_buffer(600, img=(3, 8, 8)), 8, seed=0,
                                           delay=0.03), **options)
    got, give_ups, kills = [], 0, []
    burst = threading.Event()
    stop = threading.Event()

    def killer():
        while not stop.wait(rng.uniform(0.5, 1.5)):
            burst.set()
            lane = m._pools.sample._lanes[rng.randrange(2)]
            end = time.monotonic() + 0.6
            killed = None
            while time.monotonic() < end:
                pid = lane.worker.pid
                if pid is not None and pid != killed:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        kills.append(pid)
                    except ProcessLookupError:
                        pass
                    killed = pid
                time.sleep(0.002)
            burst.clear()

    got.append(indices_of(m.sample(), img=(3, 8, 8)))   # (the workers exist)
    t = threading.Thread(target=killer, daemon=True)
    t.start()
    start = time.monotonic()
    try:
        while time.monotonic() - start < seconds or burst.is_set():
            try:
                got.append(indices_of(m.sample(), img=(3, 8, 8)))
            except WorkerDiedError as e:
                assert "giving up" in str(e), e
                give_ups += 1
    finally:
        stop.set()
        t.join()
        m.close()
    expected = _reference(len(got), 0.0, **options)
    assert got == expected, "a batch was lost or repeated"
    assert len(kills) >= 8 and give_ups >= 1, (len(kills), give_ups)
    return len(got), len(kills), give_ups


def _close_from_other_threads(seconds, rng):
    """Samplers closed by another thread at random moments of sampling (with a worker
    killed just before, half the time): the sampling thread gets RuntimeError, the batches
    before it are the reference's, and nothing is left running."""
    options = dict(n_workers=2, n_buffers=4, ctx="fork", doze_time=0.005, batches_per_task=1)
    expected = _reference(400, 0.0, **options)
    rounds = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        m = MultiprocessingSampler(SlowSampler(replay_buffer(600, img=(3, 8, 8)), 8, seed=0,
                                               delay=0.0), **options)
        got = [indices_of(m.sample(), img=(3, 8, 8))]
        delay, kill = rng.uniform(0, 0.02), rng.random() < 0.5

        def closer():
            time.sleep(delay)
            if kill:
                try:
                    os.kill(m._pools.sample._lanes[rng.randrange(2)].worker.pid, signal.SIGKILL)
                except (ProcessLookupError, TypeError):
                    pass
            m.close()

        t = threading.Thread(target=closer)
        t.start()
        with pytest.raises(RuntimeError, match="closed"):
            while len(got) < len(expected):
                got.append(indices_of(m.sample(), img=(3, 8, 8)))
        t.join()
        assert got == expected[:len(got)]
        assert wait_until(lambda: not _children()), _children()
        rounds += 1
    assert rounds >= 10
    return rounds


def _stop_and_continue(seconds, rng):
    """Workers stopped (SIGSTOP) for a moment or for longer than ``stall_timeout``, on a
    task or between tasks, then continued: the long stops are replaced, the stream is the
    reference's."""
    options = dict(n_workers=2, n_buffers=4, ctx="fork", doze_time=0.005, batches_per_task=1,
                   stall_timeout=0.3)
    m = MultiprocessingSampler(SlowSampler(replay_buffer(600, img=(3, 8, 8)), 8, seed=0,
                                           delay=0.002), **options)
    stop = threading.Event()
    stops = []

    def stopper():
        while not stop.wait(rng.uniform(0.3, 0.8)):
            pid = m._pools.sample._lanes[rng.randrange(2)].worker.pid
            try:
                os.kill(pid, signal.SIGSTOP)
            except (ProcessLookupError, TypeError):
                continue
            stops.append(pid)
            time.sleep(rng.choice([rng.uniform(0.01, 0.1), rng.uniform(0.5, 1.0)]))
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    got = [indices_of(m.sample(), img=(3, 8, 8))]
    t = threading.Thread(target=stopper, daemon=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        t.start()
        start = time.monotonic()
        try:
            while time.monotonic() - start < seconds:
                got.append(indices_of(m.sample(), img=(3, 8, 8)))
        finally:
            stop.set()
            t.join()
            m.close()
    replaced = [w for w in caught if "killed and replaced" in str(w.message)
                or "given to the replacement" in str(w.message)]
    expected = _reference(len(got), 0.0, **{k: v for k, v in options.items()
                                            if k != "stall_timeout"})
    assert got == expected, "a batch was lost or repeated"
    assert len(stops) >= 5 and replaced, (len(stops), [str(w.message) for w in caught])
    return len(got), len(stops), len(replaced)


@pytest.mark.soak
def test_soak_kill_bursts_close_from_threads_and_stopped_workers():
    seconds = float(os.environ.get("UNIENV_MP_SOAK_SECONDS", "60")) / 3
    rng = random.Random(2)
    fds = own_segment_fds()
    print("kill bursts: batches, kills, give-ups", _kill_bursts(seconds, rng))
    print("close from another thread: rounds", _close_from_other_threads(seconds, rng))
    print("stop/continue: batches, stops, replaced", _stop_and_continue(seconds, rng))
    assert wait_until(lambda: not _children()), _children()
    assert not shm_files() and own_segment_fds() <= fds
