"""MultiProcessingSampleManager used directly: tickets and order, work items, waiting,
worker errors and unreadable results, Ctrl-C, worker start failures, supervision of workers."""
import os
import signal
import sys
import time

import pytest
import torch
from unienv_data.samplers import StepSampler

from unienv_mp import CodecError, MultiprocessingSampler, WorkerDiedError
from unienv_mp._process.handle import WorkerHandle
from unienv_mp._process.launch import Launch
from unienv_mp._process.manager import MultiProcessingSampleManager

from _data import replay_buffer
from conftest import process_running, wait_until


def _identity(x):
    return x


def _slow_identity(x):
    time.sleep(0.3)
    return x


# -- tickets and order ---------------------------------------------------------------------

def _sleep_then_pid(seconds):
    time.sleep(seconds)
    return os.getpid()


def test_reset_order_deals_the_next_task_to_worker_0():
    with MultiProcessingSampleManager(_sleep_then_pid, n_workers=2, ctx="fork",
                                      timeout=30) as mgr:
        pids = [p.pid for p in mgr.workers]
        assert mgr.result(mgr.submit(0.0)) == pids[0]
        mgr.reset_order()
        assert [mgr.result(mgr.submit(0.0)) for _ in range(3)] == [pids[0], pids[1], pids[0]]


# -- work items ----------------------------------------------------------------------------

def _type_name(x):
    return type(x).__name__ if not isinstance(x, tuple) else [type(v).__name__ for v in x]


def test_small_work_items_keep_their_type():
    with MultiProcessingSampleManager(_type_name, n_workers=1, ctx="fork") as mgr:
        got = [mgr.result(mgr.submit(x)) for x in (1, True, 1.0, ("a", 0), ("a", False))]
    assert got == ["int", "bool", "float", ["str", "int"], ["str", "bool"]]


def test_work_items_larger_than_a_task_entry_of_every_kind():
    big = "x" * 100_000
    with MultiProcessingSampleManager(len, n_workers=1, ctx="fork", timeout=30) as mgr:
        assert mgr.result(mgr.submit(big)) == 100_000
        assert mgr.result(mgr.submit((big, 1))) == 2
        assert mgr.result(mgr.submit(list(big[:50_000]))) == 50_000
        assert mgr.result(mgr.submit("small")) == 5


def test_more_work_than_the_rings_hold_does_not_deadlock():
    # 200 tasks on one worker before anything is collected: the parent must collect
    # results to make room instead of waiting for a worker that waits for it.
    with MultiProcessingSampleManager(_identity, n_workers=1, ctx="fork", timeout=60) as mgr:
        for i in range(200):
            mgr.add_work(i)
        assert [mgr.fetch() for _ in range(200)] == list(range(200))
    rb = replay_buffer(30)
    with MultiprocessingSampler(StepSampler(rb, 3, seed=0), n_workers=1, n_buffers=150,
                                ctx="fork", timeout=60) as m:
        assert len(m.sample()["state"]) == 3


# -- waiting and spinning ------------------------------------------------------------------

def test_wait_any_returns_the_first_ticket_to_arrive():
    with MultiProcessingSampleManager(_sleep_then_pid, n_workers=2, ctx="fork",
                                      timeout=30) as mgr:
        slow = mgr.submit(5.0, worker=0)
        fast = mgr.submit(0.0, worker=1)
        assert mgr.wait_any([slow, fast]) == fast
        assert mgr.result(fast) == mgr.workers[1].pid
        with pytest.raises(TimeoutError):
            mgr.wait_any([slow], timeout=0.1)
        with pytest.raises(KeyError):
            mgr.wait_any([fast])              # collected already
        mgr.cancel(slow)


def test_waits_spin_only_where_a_cpu_is_left_to_spin_on(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    for n_workers, spin in ((1, 20e-6), (2, 0.0), (4, 0.0)):
        with MultiProcessingSampleManager(_identity, n_workers=n_workers, ctx="fork") as mgr:
            assert mgr.spin == spin
            assert mgr.result(mgr.submit(n_workers)) == n_workers
    with MultiProcessingSampleManager(_identity, n_workers=4, ctx="fork", spin=5e-6) as mgr:
        assert mgr.spin == 5e-6 and mgr.result(mgr.submit("x")) == "x"


# -- worker errors and unreadable results --------------------------------------------------

class _TwoArgError(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


def _raise_two_arg(x):
    raise _TwoArgError(x, "b")


def test_an_exception_that_does_not_unpickle_still_reaches_the_caller():
    from unienv_mp import WorkerError
    with MultiProcessingSampleManager(_raise_two_arg, n_workers=1, ctx="fork") as mgr:
        with pytest.raises(WorkerError, match="_TwoArgError: 7/b") as info:
            mgr.result(mgr.submit(7))
    assert info.value.original is None and "raise _TwoArgError" in info.value.worker_traceback


_PLUGIN = """
class PluginError(Exception):
    pass
"""


def _add_plugin_path(seed):
    sys.path.insert(0, os.environ["UNIENV_MP_TEST_PLUGIN_DIR"])


def _raise_plugin_error(x):
    import unienv_mp_test_plugin
    raise unienv_mp_test_plugin.PluginError(f"bad input {x}")


def test_an_exception_the_parent_cannot_import_still_arrives_as_text(tmp_path, monkeypatch):
    from unienv_mp import WorkerError
    (tmp_path / "unienv_mp_test_plugin.py").write_text(_PLUGIN)
    monkeypatch.setenv("UNIENV_MP_TEST_PLUGIN_DIR", str(tmp_path))
    with MultiProcessingSampleManager(_raise_plugin_error, n_workers=1, ctx="fork",
                                      worker_init_fn=_add_plugin_path, worker_seeds=[0],
                                      timeout=30) as mgr:
        with pytest.raises(WorkerError, match="PluginError: bad input 7") as info:
            mgr.result(mgr.submit(7))
        assert info.value.original is None          # its class is not importable here
        assert info.value.exc_type == "unienv_mp_test_plugin.PluginError"
        assert "_raise_plugin_error" in info.value.worker_traceback
        pid = mgr.workers[0].pid
        with pytest.raises(WorkerError, match="bad input 8"):
            mgr.result(mgr.submit(8))
        assert mgr.workers[0].pid == pid            # the worker goes on
    assert "unienv_mp_test_plugin" not in sys.modules


def _big_result(x):
    return {"x": torch.full((10_000,), x)}


def test_corrupt_slot_is_a_clear_exception_in_the_parent():
    with MultiProcessingSampleManager(_big_result, n_workers=1, ctx="fork") as mgr:
        t = mgr.submit(7)
        assert wait_until(lambda: mgr.ready(t), timeout=30)
        seg = mgr._tasks[t].seg
        with memoryview(seg) as mv:
            mv[64:72] = b"\xff" * 8    # scribble over the tree description
        with pytest.raises(CodecError, match="corrupt slot"):
            mgr.result(t)
        assert mgr.result(mgr.submit(8))["x"][0] == 8   # and the manager goes on


def _no_more_descriptors(seed):
    import resource
    n = os.open("/dev/null", os.O_RDONLY)   # the lowest free descriptor number
    os.close(n)
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def test_a_result_the_worker_cannot_put_in_a_slot_is_an_error_not_a_death():
    from unienv_mp import WorkerError
    with MultiProcessingSampleManager(_big_result, n_workers=1, ctx="fork",
                                      worker_init_fn=_no_more_descriptors, worker_seeds=[0],
                                      timeout=30) as mgr:
        pid = mgr.workers[0].pid
        with pytest.raises(WorkerError, match="OSError") as info:
            mgr.result(mgr.submit(1))
        assert "Too many open files" in str(info.value)
        with pytest.raises(WorkerError, match="OSError"):
            mgr.result(mgr.submit(2))
        assert mgr.workers[0].pid == pid           # not killed, not replaced


# -- Ctrl-C --------------------------------------------------------------------------------

def test_interrupts_deferred_holds_ctrl_c_until_the_block_ends():
    import unienv_mp._os as M
    done = []
    with pytest.raises(KeyboardInterrupt):
        with M.interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):   # bytecode boundaries where a KeyboardInterrupt could land
                done.append(1)
    assert len(done) == 1000
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_while_a_result_is_recorded_keeps_the_result(monkeypatch):
    from unienv_mp._process.ledger import WorkLedger
    with MultiProcessingSampleManager(_identity, n_workers=1, ctx="fork",
                                      timeout=30) as mgr:
        real = WorkLedger.accept
        armed = [True]

        def interrupted(ledger, w, entry):
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt
            return real(ledger, w, entry)

        monkeypatch.setattr(WorkLedger, "accept", interrupted)
        mgr.add_work("a")
        mgr.add_work("b")
        with pytest.raises(KeyboardInterrupt):
            mgr.fetch()
        assert not armed[0]
        assert [mgr.fetch(), mgr.fetch()] == ["a", "b"]
        assert not mgr._ledger.inflight[0]


def test_ctrl_c_while_a_dead_worker_is_being_replaced(monkeypatch):
    import unienv_mp._os as M
    real = M.stop_processes
    armed = [True]

    def interrupted(procs, timeout):
        real(procs, timeout)
        if armed[0] and procs:
            armed[0] = False
            raise KeyboardInterrupt

    with MultiProcessingSampleManager(_slow_identity, n_workers=1, ctx="fork",
                                      doze_time=0.01, timeout=30) as mgr:
        for i in range(3):
            mgr.add_work(i)
        os.kill(mgr.workers[0].pid, signal.SIGKILL)
        monkeypatch.setattr(M, "stop_processes", interrupted)
        with pytest.raises(KeyboardInterrupt):
            mgr.fetch()
        assert not armed[0]
        assert [mgr.fetch() for _ in range(3)] == [0, 1, 2]


# -- worker start failures -----------------------------------------------------------------

def _init_with_a_long_error(seed):
    raise ValueError("x" * 20_000)


def test_a_long_error_at_worker_start_is_reported_not_lost():
    from unienv_mp import WorkerError
    with MultiProcessingSampleManager(_identity, n_workers=1, ctx="fork",
                                      worker_init_fn=_init_with_a_long_error,
                                      worker_seeds=[1]) as mgr:
        with pytest.raises(WorkerError, match="could not start: xxx") as info:
            mgr.result(mgr.submit(1))
    assert info.value.exc_type == "builtins.ValueError"


def test_a_replacement_that_fails_to_start_is_retried_later(monkeypatch):
    with MultiProcessingSampleManager(_slow_identity, n_workers=1, ctx="fork",
                                      doze_time=0.01) as mgr:
        tickets = [mgr.submit(i) for i in range(5)]
        assert mgr.result(tickets[0]) == 0
        os.kill(mgr.workers[0].pid, signal.SIGKILL)   # 1..4 are still to do
        real = WorkerHandle.start
        calls = []

        def flaky(self, seed, *args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise OSError(24, "Too many open files (simulated)")
            return real(self, seed, *args, **kwargs)

        monkeypatch.setattr(WorkerHandle, "start", flaky)
        with pytest.raises(OSError, match="simulated"):
            mgr.result(tickets[1])
        # the next call finishes the replacement, and no work is lost or repeated
        assert [mgr.result(t) for t in tickets[1:]] == [1, 2, 3, 4]
        assert mgr.result(mgr.submit(9)) == 9 and len(calls) == 2


# -- supervision: dead workers noticed and replaced ----------------------------------------

def test_slots_of_a_replaced_worker_never_return_to_its_successor():
    # A result from a worker that then died, handed out after its replacement started,
    # must not give its slot number to the replacement (whose slots are numbered anew):
    # two tasks would share a slot and one batch would overwrite another.
    with MultiProcessingSampleManager(_identity, n_workers=1, ctx="fork",
                                      doze_time=0.01) as mgr:
        t1 = mgr.submit(torch.zeros(10))
        assert wait_until(lambda: mgr.ready(t1), timeout=30)   # arrived, not handed out
        os.kill(mgr.workers[0].pid, signal.SIGKILL)
        t2 = mgr.submit(torch.ones(10))
        assert mgr.result(t2)[0] == 1          # the worker was replaced on the way
        busy = [mgr.submit(torch.full((10,), i)) for i in range(3)]
        assert mgr.result(t1)[0] == 0          # frees a slot number of the dead process
        w = mgr._lanes[0].worker
        in_use = [mgr._tasks[t].slot for t in busy]
        assert len(set(in_use)) == 3 and not set(in_use) & set(w.free_slots)
        more = [mgr.submit(torch.full((10,), 10 + i)) for i in range(3)]
        in_use += [mgr._tasks[t].slot for t in more]
        assert len(set(in_use)) == 6
        assert [int(mgr.result(t)[0]) for t in busy + more] == [0, 1, 2, 10, 11, 12]


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("respawn", [True, False])
def test_polling_without_blocking_notices_a_dead_worker(in_order, respawn):
    with MultiProcessingSampleManager(_slow_identity, n_workers=1, ctx="fork",
                                      doze_time=0.01, in_order=in_order,
                                      respawn=respawn) as mgr:
        assert mgr.result(mgr.submit(0)) == 0
        mgr.add_work(1)
        ticket = mgr.submit(2)
        os.kill(mgr.workers[0].pid, signal.SIGKILL)
        mgr.workers[0].join(10)
        got = []

        def poll():
            if not mgr.ready(ticket):
                return False
            got.append(mgr.fetch(block=False))
            return got[-1] is not None

        if respawn:
            assert wait_until(poll, timeout=30)
            assert got[-1] == 1 and mgr.result(ticket) == 2
        else:
            with pytest.raises(WorkerDiedError):
                wait_until(poll, timeout=30)


def test_a_worker_reaped_by_someone_else_is_still_noticed():
    # os.waitpid here (as a SIGCHLD handler or os.wait() elsewhere would) collects the exit
    # status behind multiprocessing's back: Process.is_alive() then stays True.
    with MultiProcessingSampleManager(_slow_identity, n_workers=1, ctx="fork",
                                      doze_time=0.01, timeout=30) as mgr:
        assert mgr.result(mgr.submit(0)) == 0
        mgr.add_work(1)
        pid = mgr.workers[0].pid
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert mgr.fetch() == 1                  # replaced, and the work redone
        assert mgr.workers[0].pid != pid


def _fork_grandchild_then(x):
    if x == "fork":
        pid = os.fork()
        if pid == 0:                       # holds the worker's inherited descriptors
            time.sleep(30)
            os._exit(0)
        return pid
    return x


def test_a_dead_worker_is_noticed_while_its_grandchild_lives_and_its_pid_is_not_signalled(
        monkeypatch):
    # The grandchild keeps multiprocessing's sentinel pipe open; waitpid here collects the
    # worker's exit status behind multiprocessing's back.  Neither is_alive() nor the
    # sentinel can tell: the pidfd can.  And a reaped pid may be reused: never signal it.
    with MultiProcessingSampleManager(_fork_grandchild_then, n_workers=1, ctx="fork",
                                      doze_time=0.01, timeout=20) as mgr:
        grandchild = mgr.result(mgr.submit("fork"))
        try:
            pid = mgr.workers[0].pid
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            sent = []
            real_kill = os.kill
            monkeypatch.setattr(os, "kill", lambda p, s: (sent.append((p, s)), real_kill(p, s)))
            assert mgr.result(mgr.submit(5)) == 5
            assert mgr.workers[0].pid != pid
            assert not [s for p, s in sent if p == pid]
        finally:
            os.kill(grandchild, signal.SIGKILL)


def test_workers_are_watched_correctly_with_descriptors_above_1024():
    # select() cannot watch descriptors >= FD_SETSIZE: a live worker must not look dead.
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2048:
        pytest.skip(f"the descriptor limit here ({hard}) is too low for this check")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    fillers = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        with MultiProcessingSampleManager(_slow_identity, n_workers=2, ctx="fork",
                                          doze_time=0.01, timeout=30) as mgr:
            pids = [p.pid for p in mgr.workers]
            for i in range(6):
                mgr.add_work(i)
            assert [mgr.fetch() for _ in range(6)] == list(range(6))
            assert [p.pid for p in mgr.workers] == pids    # nobody was taken for dead
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- use from another process --------------------------------------------------------------

def test_a_forked_child_cannot_use_its_parents_manager():
    import multiprocessing as mp
    with MultiProcessingSampleManager(_identity, n_workers=1, ctx="fork") as mgr:
        assert mgr.result(mgr.submit(1)) == 1
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        p = ctx.Process(target=_use_in_child, args=(mgr, out))
        p.start()
        assert "cannot be used in process" in out.get(timeout=30)
        p.join(30)
        assert mgr.result(mgr.submit(2)) == 2   # the parent's results were not taken


def _use_in_child(mgr, out):
    try:
        mgr.submit(5)
        out.put("used it")
    except RuntimeError as e:
        out.put(str(e))


# -- workers started later (start_later) -----------------------------------------------------

@pytest.mark.parametrize("snapshot", [True, False])
def test_start_later_starts_one_worker_then_the_others_when_the_caller_would_wait(
        snapshot, monkeypatch):
    # start_later() is asked when the snapshot process would start (at the first push),
    # and for each later start only where there is no snapshot process
    if not snapshot:
        monkeypatch.setattr(Launch, "keep_snapshot", lambda self: None)
    asked = []

    def allowed():
        asked.append(True)
        return True
    with MultiProcessingSampleManager(_sleep_then_pid, n_workers=3, ctx="fork", timeout=30,
                                      start_later=allowed) as mgr:
        assert mgr.n_workers == 3 and len(mgr.workers) == 1 and not asked
        first = mgr.workers[0].pid
        assert mgr.result(mgr.submit(0.0)) == first   # no other starts before the first
        assert len(mgr.workers) == 1 and len(asked) == 1
        assert mgr._pool.launch.from_snapshot == snapshot
        t = mgr.submit(0.2)                            # dealt to the one started
        assert mgr.result(t) == first                  # the caller waits: one more starts
        assert len(mgr.workers) == 2 and len(asked) == 1 + (not snapshot)
        mgr.start_all()
        assert len(mgr.workers) == 3 and len(asked) == 1 + 2 * (not snapshot)
        pids = [p.pid for p in mgr.workers]
        assert len(set(pids)) == 3
        # (round-robin over the workers that are up: once all are)
        wait_until(lambda: all(w.startup_seconds is not None
                               for w in mgr.stats().workers), 60)
        mgr.reset_order()
        assert [mgr.result(mgr.submit(0.0)) for _ in range(3)] == pids
        assert len(mgr.stats().workers) == 3


def _slow_start_of_worker_1(seed):
    if seed == 1:
        time.sleep(5)


def test_tasks_started_later_go_to_the_workers_that_are_up_while_another_starts():
    with MultiProcessingSampleManager(_sleep_then_pid, n_workers=2, ctx="fork", timeout=30,
                                      worker_init_fn=_slow_start_of_worker_1,
                                      worker_seeds=[0, 1], start_later=lambda: True) as mgr:
        first = mgr.result(mgr.submit(0.0))
        t = mgr.submit(0.2)
        assert mgr.result(t) == first          # the caller waited: worker 1 started
        assert len(mgr.workers) == 2 and mgr.stats().workers[1].startup_seconds is None
        pids = {mgr.result(mgr.submit(0.0)) for _ in range(20)}
        assert pids == {first}, "a task went to the worker still starting"


def test_start_later_false_keeps_the_others_from_ever_starting():
    with MultiProcessingSampleManager(_sleep_then_pid, n_workers=3, ctx="fork", timeout=30,
                                      start_later=lambda: False) as mgr:
        tickets = [mgr.submit(0.05) for _ in range(4)]
        assert {mgr.result(t) for t in tickets} == {mgr.workers[0].pid}
        mgr.start_all()
        assert len(mgr.workers) == 1 and len(mgr.stats().workers) == 1
        assert mgr.result(mgr.submit(0.0), timeout=10) == mgr.workers[0].pid


def test_start_later_must_be_callable():
    with pytest.raises(TypeError, match="start_later must be None or callable"):
        MultiProcessingSampleManager(_identity, n_workers=1, ctx="fork", start_later=True)


def test_a_worker_that_cannot_start_later_leaves_the_started_ones_working():
    calls = []

    def refuse_once_started():
        calls.append(1)
        raise OSError("no more processes")
    with MultiProcessingSampleManager(_sleep_then_pid, n_workers=3, ctx="fork", timeout=30,
                                      start_later=refuse_once_started) as mgr:
        assert mgr.result(mgr.submit(0.0)) == mgr.workers[0].pid
        with pytest.warns(RuntimeWarning, match="could not start a worker after the first"):
            assert mgr.result(mgr.submit(0.2)) == mgr.workers[0].pid
        # (asked at the first push, for the snapshot process, then for the later start)
        assert len(mgr.workers) == 1 and calls == [1, 1]
        assert mgr.result(mgr.submit(0.1)) == mgr.workers[0].pid   # none tried again
        assert calls == [1, 1]


def _pid(x):
    return os.getpid()


def test_a_manager_dropped_without_close_ends_its_workers_at_once():
    """Nothing the manager owns refers back to it: dropped, it is freed by reference
    counting (no garbage collection needed), and its finalizer ends the workers."""
    import gc
    gc.disable()
    try:
        mgr = MultiProcessingSampleManager(_pid, n_workers=2, ctx="fork")
        mgr.add_work(0)
        assert mgr.fetch() in {p.pid for p in mgr.workers}
        pids = [p.pid for p in mgr.workers]
        del mgr

        assert wait_until(lambda: not any(process_running(pid) for pid in pids),
                          timeout=30)
    finally:
        gc.enable()


def test_settings_changed_after_construction_are_the_ones_used():
    """``respawn`` and ``max_respawns`` are read when a worker dies, not copied when
    the manager is made."""
    with MultiProcessingSampleManager(_pid, n_workers=1, ctx="fork", timeout=30) as mgr:
        pid = mgr.result(mgr.submit(0))
        mgr.respawn = False
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not mgr.workers[0].is_alive(), timeout=30)
        with pytest.raises(WorkerDiedError, match="respawn=False"):
            mgr.result(mgr.submit(1))
