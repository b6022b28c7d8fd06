"""The few private parts of unienv_mp that the "never silently wrong" tests reach into, in
one place: when the internals move, this file changes, not the tests.  Everything else
the tests use is the public API."""
import os
import signal
import sys

from conftest import process_running, wait_until


def sample_manager(m):
    """The manager of a sampler's ``sample*`` workers (None before the first call)."""
    return m._pools.sample


def epoch_managers(m):
    """The managers that epochs of ``m`` run on now."""
    return list(m._pools.users)


def start_all(manager):
    """Start every worker the manager left to start later (its public ``start_all``)."""
    manager.start_all()


def worker_pids(manager):
    """The pids of the manager's workers started (its public ``workers``); None for one
    whose process could not be started again yet."""
    return [None if p is None else p.pid for p in manager.workers]


def worker_started(manager, index):
    """Whether worker ``index``'s process began serving tasks (it is past its start:
    under spawn, past its imports)."""
    return manager._pool.lanes[index].worker.started_ns != 0


def snapshot_process(manager):
    """The fork snapshot process of a manager (None if it has none)."""
    snapshot = manager._pool.launch._snapshot
    return None if snapshot is None else snapshot.proc


def refuse_snapshot(monkeypatch):
    """Make every snapshot process fail to start (as where pidfds are missing)."""
    from unienv_mp._process import launch

    def refused(*args, **kwargs):
        raise OSError("refused by the test")
    monkeypatch.setattr(launch, "Snapshot", refused)


def in_snapshot_wait(thread):
    """True while ``thread`` runs code of the snapshot module (waiting for the snapshot
    process to answer)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("_process", "snapshot.py")):
            return True
        frame = frame.f_back
    return False


def kill(pid):
    """SIGKILL ``pid`` and wait until it has ended (a zombie counts as ended)."""
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not process_running(pid), timeout=10), f"{pid} still runs"


class InterruptInPoolClose:
    """Sends SIGINT to this process (a Ctrl-C) as soon as the main thread is inside the
    function that stops a pool's worker processes as the pool closes: a watcher thread
    polls the main thread's stack.  ``stop()`` ends the watcher."""

    NAME = "stop_processes"   # (unienv_mp._os.stop_processes)

    def __init__(self):
        import threading
        import time
        self._stop = threading.Event()
        main = threading.main_thread()

        def watch():
            while not self._stop.is_set():
                frame = sys._current_frames().get(main.ident)
                while frame is not None:
                    if frame.f_code.co_name == self.NAME:
                        os.kill(os.getpid(), signal.SIGINT)
                        return
                    frame = frame.f_back
                time.sleep(0.0005)

        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()


def kept_manager(m):
    """The manager of the workers a sampler keeps for its next epochs (or None)."""
    return m._pools.kept
