"""Every worker of a manager starts from one snapshot of the work function, taken when the
first workers start, under every start method: a replacement started after the parent
changed the work function's state sees the state the first workers saw.  Under fork the
later workers come from the snapshot process; what happens when it is gone; nothing is
left running after close() or the parent's death."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest

from unienv_mp import _os

from unienv_mp._process.manager import MultiProcessingSampleManager
from unienv_mp._process.snapshot import Snapshot

from conftest import process_running, wait_until


class Reader:
    """A work function whose answer is state the parent may change: ``(value, list)``."""

    def __init__(self):
        self.value = "first"
        self.rows = [1, 2, 3]

    def __call__(self, _):
        return (self.value, list(self.rows), os.getpid())


def _kill_and_wait(mgr, index=0):
    proc = mgr.workers[index]
    os.kill(proc.pid, signal.SIGKILL)
    assert wait_until(lambda: not process_running(proc.pid) or proc.exitcode is not None)
    return proc.pid


@pytest.mark.parametrize("ctx", ["fork", "spawn", "forkserver"])
def test_a_replacement_sees_the_state_the_first_workers_saw(ctx):
    reader = Reader()
    with MultiProcessingSampleManager(reader, n_workers=1, ctx=ctx) as mgr:
        first = mgr.result(mgr.submit(0))
        assert first[:2] == ("first", [1, 2, 3])
        reader.value = "changed"
        reader.rows.append(4)
        dead = _kill_and_wait(mgr)
        again = mgr.result(mgr.submit(1))
        assert again[2] != dead                        # (a new process answered)
        assert again[:2] == ("first", [1, 2, 3])


def test_under_fork_later_workers_come_from_the_snapshot_process():
    with MultiProcessingSampleManager(Reader(), n_workers=1, ctx="fork") as mgr:
        mgr.result(mgr.submit(0))
        snapshot = mgr._pool.resources.workers[0]._launch._snapshot
        snapshot_pid = snapshot.proc.pid
        assert isinstance(snapshot, Snapshot) and process_running(snapshot_pid)
        _kill_and_wait(mgr, 0)
        mgr.result(mgr.submit(1))
        new = mgr.workers[0]
        # the replacement is the snapshot process's child, not this process's
        with open(f"/proc/{new.pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == snapshot_pid
        # its exit code comes through the snapshot process
        os.kill(new.pid, signal.SIGKILL)
        new.join(5)
        assert new.exitcode == -signal.SIGKILL
    assert not process_running(snapshot_pid)


def test_with_the_snapshot_process_gone_a_worker_is_forked_from_here_with_a_warning():
    reader = Reader()
    with MultiProcessingSampleManager(reader, n_workers=1, ctx="fork") as mgr:
        mgr.result(mgr.submit(0))
        snapshot = mgr._pool.resources.workers[0]._launch._snapshot
        os.kill(snapshot.proc.pid, signal.SIGKILL)
        snapshot.proc.join(5)
        reader.value = "changed"
        _kill_and_wait(mgr)
        with pytest.warns(RuntimeWarning, match="snapshot.*it ended") as record:
            again = mgr.result(mgr.submit(1))
        assert record[0].filename == __file__   # (the caller's line, not the package's)
        assert again[0] == "changed"   # (as the warning says: this process's memory now)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _kill_and_wait(mgr)
            assert mgr.result(mgr.submit(2))[0] == "changed"


_PARENT_DIES = textwrap.dedent(r"""
    import os, signal, sys, time
    from unienv_mp._process.manager import MultiProcessingSampleManager

    def pid(_):
        return os.getpid()

    if __name__ == "__main__":
        mgr = MultiProcessingSampleManager(pid, n_workers=2, ctx="fork")
        mgr.result(mgr.submit(0))
        os.kill(mgr.workers[0].pid, signal.SIGKILL)
        while mgr.workers[0].exitcode is None:
            time.sleep(0.01)
        mgr.result(mgr.submit(1))     # (worker 0 again: from the snapshot process)
        mgr.result(mgr.submit(2))
        snap = mgr._pool.resources.workers[0]._launch._snapshot.proc.pid
        print(" ".join(str(p) for p in [snap] + [w.pid for w in mgr.workers]), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
""")


def test_the_parents_death_ends_the_snapshot_process_and_its_workers(tmp_path):
    script = tmp_path / "parent_dies.py"
    script.write_text(_PARENT_DIES)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 3
    assert wait_until(lambda: not any(process_running(p) for p in pids), timeout=10), pids


@pytest.mark.parametrize("seen_stopped", [True, False])
def test_a_stopped_snapshot_process_is_killed_and_workers_are_forked_from_here(
        monkeypatch, seen_stopped):
    """Found stopped, it is killed at once; where that cannot be seen, after
    ANSWER_TIMEOUT seconds of silence."""
    from unienv_mp._process import snapshot as _snapshot
    monkeypatch.setattr(_snapshot, "ANSWER_TIMEOUT", 0.5 if not seen_stopped else 600)
    if not seen_stopped:
        monkeypatch.setattr(_snapshot._os, "is_stopped", lambda pid: False)
    with MultiProcessingSampleManager(Reader(), n_workers=1, ctx="fork") as mgr:
        mgr.result(mgr.submit(0))
        snapshot = mgr._pool.launch._snapshot
        os.kill(snapshot.proc.pid, signal.SIGSTOP)
        _kill_and_wait(mgr)
        with pytest.warns(RuntimeWarning, match="is stopped" if seen_stopped
                          else "did not answer"):
            assert mgr.result(mgr.submit(1), timeout=30)[0] == "first"
        assert mgr._pool.launch._snapshot is None


def test_a_worker_outlives_its_snapshot_process_and_is_still_watched():
    with MultiProcessingSampleManager(Reader(), n_workers=1, ctx="fork") as mgr:
        mgr.result(mgr.submit(0))
        _kill_and_wait(mgr)
        mgr.result(mgr.submit(1))
        born = mgr.workers[0]                  # (forked by the snapshot process)
        snapshot = mgr._pool.launch._snapshot
        os.kill(snapshot.proc.pid, signal.SIGKILL)
        snapshot.proc.join(5)
        # a timed join returns though the status pipe is at its end (the worker lives on)
        joiner = threading.Thread(target=born.join, args=(0.3,), daemon=True)
        joiner.start()
        joiner.join(30)
        assert not joiner.is_alive()
        assert born.is_alive() and born.exitcode is None     # (its status pipe is gone)
        assert mgr.result(mgr.submit(2))[2] == born.pid      # and it still works
        os.kill(born.pid, signal.SIGKILL)
        assert wait_until(lambda: not born.is_alive())
        assert born.exitcode == 255                           # (unknown, as forkserver's)


class ParameterReader(Reader):
    def __init__(self):
        import torch
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3))


class PipeReader(Reader):
    """Hands each new process a descriptor as its pickling runs (multiprocessing's DupFd)."""

    def __init__(self):
        super().__init__()
        r, w = os.pipe()
        os.close(w)
        self.end = _os.PipeEnd(r)


def _bound(reader):
    return reader.__call__


@pytest.mark.parametrize("make, reused", [(Reader, True), (lambda: _bound(Reader()), True),
                                          (ParameterReader, True), (PipeReader, False)])
def test_a_pickle_bound_to_its_start_is_not_reused(make, reused):
    # torch moves a parameter into shared memory and reduces it per pickling: the Parcel
    # holds it and pickles it anew for each start, and keeps the rest of the first pickle;
    # a pickling that hands a descriptor over itself is made again for each worker, and
    # later workers then start only while same_copy says so; a bound method is no such thing
    target = make()
    try:
        with MultiProcessingSampleManager(target, n_workers=1, ctx="spawn") as mgr:
            assert mgr.result(mgr.submit(0))[0] == "first"
            launch = mgr._pool.launch
            assert launch._parcel.reused is reused and launch.from_snapshot is reused
    finally:
        if isinstance(target, PipeReader):
            os.close(target.end.fd)


def test_a_worker_started_later_without_its_snapshot_starts_only_while_allowed():
    same = [True]
    with MultiProcessingSampleManager(Reader(), n_workers=2, ctx="fork",
                                      start_later=lambda: same[0]) as mgr:
        mgr.result(mgr.submit(0))              # (the snapshot process forks at this push)
        snapshot = mgr._pool.launch._snapshot
        os.kill(snapshot.proc.pid, signal.SIGKILL)
        snapshot.proc.join(5)
        same[0] = False                        # the data changed: no copy of it may start
        with pytest.warns(RuntimeWarning, match="snapshot"):
            mgr.start_all()                    # (as far as start_later allows: none)
        assert len(mgr.workers) == 1 and mgr.result(mgr.submit(1))[0] == "first"
        assert not mgr._pool.deferred


def test_a_child_forked_from_the_training_process_leaves_the_snapshot_process_alone():
    # (multiprocessing's exit handler in such a child terminated it while it was daemonic)
    with MultiProcessingSampleManager(Reader(), n_workers=1, ctx="fork") as mgr:
        mgr.result(mgr.submit(0))
        snapshot_pid = mgr._pool.launch._snapshot.proc.pid
        pid = os.fork()
        if pid == 0:
            try:
                mgr.close()
                # (what a child's normal end runs: multiprocessing's exit handler)
                from multiprocessing import util
                util._exit_function()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert process_running(snapshot_pid)
        _kill_and_wait(mgr)
        with warnings.catch_warnings():
            warnings.simplefilter("error")        # (no fallback: it is still there)
            assert mgr.result(mgr.submit(1))[0] == "first"
