"""MultiprocessingSampler under faults: workers that die, a parent that ends, Ctrl-C, close
and timeouts; errors surfaced, nothing leaked, nothing hangs.  The manager's own fault
handling is in test_manager.py."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from unienv_data.samplers import StepSampler

from unienv_mp import MultiprocessingSampler, WorkerDiedError

import _data
from _data import indices_of, replay_buffer
from conftest import shm_files, wait_until

TESTS = os.path.dirname(os.path.abspath(__file__))


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


# -- a worker dies -------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["kill", "segfault"])
def test_worker_dying_mid_batch_is_replaced_without_a_gap(tmp_path, how):
    rb = replay_buffer(120)
    s = _data.DyingSampler(rb, 10, seed=0, marker=str(tmp_path / "deaths"), deaths=2, how=how)
    with MultiprocessingSampler(s, n_workers=2, n_buffers=4, ctx="fork", doze_time=0.01) as m:
        for _ in range(2):
            seen = [i for b in m.epoch_iter() for i in indices_of(b)]
            assert sorted(seen) == list(range(120))   # nothing lost, nothing twice
        assert len(m.sample()["state"]) == 10
        with open(tmp_path / "deaths") as f:
            assert len(f.read().split()) == 2          # the workers really died


def _epoch_pool(m):
    """The manager running ``m``'s current epoch: its own over unshared data, else the
    one kept for epochs, else the sampler's."""
    if m._pools.own:
        return next(iter(m._pools.own))
    return m._pools.kept if m._pools.kept is not None else m._pools.sample


@pytest.mark.parametrize("shared", [False, True])
def test_worker_killed_from_outside_during_an_epoch(shared):
    rb = replay_buffer(150, multiprocessing=shared)
    s = _data.SlowSampler(rb, 10, seed=0, delay=0.05)
    with MultiprocessingSampler(s, n_workers=3, n_buffers=6, ctx="fork", doze_time=0.01) as m:
        seen = []
        for i, b in enumerate(m.epoch_iter()):
            seen += indices_of(b)
            if i in (2, 7):
                pool = _epoch_pool(m)
                # (a custom sampler, shared data or not: whether its data changed cannot be
                # told, so each epoch has workers of its own)
                assert pool is not m._pools.sample
                os.kill(pool.workers[i % 3].pid, signal.SIGKILL)
        assert sorted(seen) == list(range(150))
        if shared:
            # A killed worker that had published all its work is noticed when it is next
            # waited on: after a round of work for every worker, all are alive again.
            for _ in range(6):
                m.sample()
            assert all(w.is_alive() for w in m._pools.sample.workers)


def test_respawn_false_raises_worker_died_error(tmp_path):
    rb = replay_buffer(60)
    s = _data.DyingSampler(rb, 6, seed=0, marker=str(tmp_path / "d"), deaths=1, every=1)
    with MultiprocessingSampler(s, n_workers=1, n_buffers=2, ctx="fork", doze_time=0.01,
                                respawn=False) as m:
        with pytest.raises(WorkerDiedError, match="killed by signal 9") as info:
            list(m.epoch_iter())
        assert info.value.worker == 0 and info.value.exitcode == -9


def test_a_worker_that_keeps_dying_raises():
    rb = replay_buffer(20)
    with MultiprocessingSampler(_data.CrashAtStart(StepSampler(rb, 4, seed=0)), n_workers=1,
                                n_buffers=1, ctx="fork", doze_time=0.01) as m:
        with pytest.raises(WorkerDiedError, match="in a row") as info:
            m.sample()   # (every replacement dies as it seeds the sampler for the chunk)
        assert info.value.exitcode == 7


# -- the parent ends -----------------------------------------------------------------------

def _run_script(body, **popen):
    code = f"import sys; sys.path.insert(0, {TESTS!r})\n" + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


PARENT = """
    import os, sys, time
    from unienv_data.samplers import StepSampler
    from unienv_mp import MultiprocessingSampler
    import _data
    rb = _data.replay_buffer(50)
    sampler = _data.SlowSampler(rb, 5, seed=0, delay={delay})
    m = MultiprocessingSampler(sampler, n_workers=2, n_buffers=2, ctx={method!r})
    m.sample() if {delay} < 1 else None
    m._ensure_manager().start_all()
    print(" ".join(str(p.pid) for p in m._pools.sample.workers), flush=True)
    {then}
"""


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_parent_sigkilled_workers_exit_and_nothing_is_left(method):
    p = _run_script(PARENT.format(delay=0.01, method=method, then="time.sleep(120)"))
    pids = [int(x) for x in p.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(30)
    # (promptly on an idle machine; a loaded one may take seconds to run them to their end)
    assert wait_until(lambda: not any(_alive(pid) for pid in pids), timeout=30.0)
    assert not shm_files()
    p.stdout.close()
    p.stderr.close()


def test_exit_without_close_does_not_hang_leak_or_warn():
    p = _run_script(PARENT.format(delay=0.01, method="fork", then="m.sample()"))
    out, err = p.communicate(timeout=60)
    pids = [int(x) for x in out.split()]
    assert p.returncode == 0, err
    assert err == ""
    assert wait_until(lambda: not any(_alive(pid) for pid in pids), timeout=5)
    assert not shm_files()


# -- Ctrl-C --------------------------------------------------------------------------------

def test_ctrl_c_during_sample_is_a_clean_keyboard_interrupt():
    p = _run_script(PARENT.format(delay=30, method="fork", then="m.sample()"))
    pids = [int(x) for x in p.stdout.readline().split()]
    time.sleep(0.5)
    os.kill(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0
    assert err.rstrip().endswith("KeyboardInterrupt")
    assert "Error" not in err.replace("KeyboardInterrupt", "")   # no worker tracebacks
    assert wait_until(lambda: not any(_alive(pid) for pid in pids), timeout=10)


# -- close and timeouts --------------------------------------------------------------------

def test_timeout_for_one_batch():
    rb = replay_buffer(20)
    s = _data.SlowSampler(rb, 4, seed=0, delay=3)
    with MultiprocessingSampler(s, n_workers=1, n_buffers=1, ctx="fork", timeout=0.3) as m:
        with pytest.raises(TimeoutError, match="0.3"):
            next(m.epoch_iter())


def test_an_interrupted_wait_does_not_leak_its_task():
    rb = replay_buffer(20)
    s = _data.SlowSampler(rb, 4, seed=0, delay=2)
    with MultiprocessingSampler(s, n_workers=1, n_buffers=1, ctx="fork", timeout=0.2) as m:
        pool = m._ensure_manager()
        first = pool._tasks.next_ticket        # the ticket that sample() will wait for
        with pytest.raises(TimeoutError):
            m.sample()
        assert pool._tasks[first].cancelled  # given up on, not left behind
        assert wait_until(lambda: pool._pool.poll_all() or first not in pool._tasks, timeout=30)


def test_close_while_work_is_in_flight():
    rb = replay_buffer(40)
    s = _data.SlowSampler(rb, 4, seed=0, delay=1.0)
    m = MultiprocessingSampler(s, n_workers=2, n_buffers=4, ctx="fork")
    it = m.epoch_iter()
    next(it)                      # now every worker is in the middle of a slow batch
    pids = [p.pid for p in _epoch_pool(m).workers]
    t = time.monotonic()
    m.close()
    assert time.monotonic() - t < 30   # a hang detector, not a speed requirement
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        next(it)
    m.close()
