"""What an adversarial run broke: a sampler that gives up and never comes back, bad
arguments taken and then harmful, a forked child reusing its parent's sampler, close() from
another thread, two threads sampling, a stopped worker, corrupt rings, and Ctrl-C at
start-up."""
import ctypes
import math
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import torch
import pytest
from unienv_data.samplers import StepSampler

from unienv_mp import CodecError, MultiprocessingSampler, WorkerDiedError
from unienv_mp._transport import protocol as P
from unienv_mp import stats as _stats
from unienv_mp._process.manager import MultiProcessingSampleManager

import _data
from _data import indices_of, replay_buffer
from conftest import wait_until


def _lane_processes_alive(sampler):
    """For every lane of the sampler's manager: it has no process, or a live one."""
    lanes = sampler._pools.sample._lanes
    return all(not lane.worker.has_process or not lane.worker.has_exited() for lane in lanes)


# -- after giving up, the next call works --------------------------------------------------

@pytest.mark.parametrize("respawn", [True, False])
def test_the_call_after_giving_up_starts_a_fresh_worker(tmp_path, respawn):
    marker = tmp_path / "die"
    marker.write_text("")
    rb = replay_buffer(40)
    s = _data.DiesWhileMarked(rb, 4, seed=0, marker=str(marker))
    with MultiprocessingSampler(s, n_workers=1, n_buffers=2, ctx="fork", doze_time=0.01,
                                respawn=respawn) as m:
        for _ in range(2):   # giving up again starts from a fresh budget
            with pytest.raises(WorkerDiedError, match="giving up" if respawn else "respawn"):
                m.sample()
            assert _lane_processes_alive(m)   # no dead process kept
        marker.unlink()
        batch = m.sample()
        assert len(batch["state"]) == 4
        reference = MultiprocessingSampler(StepSampler(replay_buffer(40), 4, seed=0),
                                           n_workers=1, n_buffers=2, ctx="fork")
        with reference:
            expected = reference.sample()
        # the stream starts where it stood: the first batch, as from a sampler never broken
        assert indices_of(batch) == indices_of(expected)


def test_a_manager_that_gave_up_keeps_the_unfinished_work(tmp_path):
    marker = tmp_path / "die"
    marker.write_text("")

    def work(x):
        if os.path.exists(marker):
            os.kill(os.getpid(), 9)
        return x * 2

    with MultiProcessingSampleManager(work, n_workers=1, ctx="fork", doze_time=0.01,
                                      max_respawns=1) as pool:
        tickets = [pool.submit(i) for i in range(3)]
        with pytest.raises(WorkerDiedError, match="giving up"):
            pool.result(tickets[0])
        lane = pool._lanes[0]
        assert not lane.worker.has_process and lane.deaths_in_a_row == 0
        marker.unlink()
        assert [pool.result(t) for t in tickets] == [0, 2, 4]


# -- arguments -----------------------------------------------------------------------------

def _sampler():
    return StepSampler(replay_buffer(20), 4, seed=0)


@pytest.mark.parametrize("option, value, error, text", [
    ("stall_timeout", math.inf, ValueError, "finite"),
    ("stall_timeout", math.nan, TypeError, "number of seconds"),
    ("timeout", math.inf, ValueError, "finite"),
    ("timeout", 1e12, ValueError, "at most"),
    ("doze_time", math.inf, ValueError, "finite"),
    ("doze_time", 1e9, ValueError, "at most"),
    ("doze_time", 0, ValueError, "> 0"),
    ("n_workers", 10 ** 6, ValueError, "CPUs"),
    ("n_workers", 0, ValueError, ">= 1"),
    ("n_workers", 2.0, TypeError, "int"),
    ("n_buffers", 10 ** 7, ValueError, "at most"),
    ("batches_per_task", 10 ** 9, ValueError, "at most"),
    ("in_order", "no", TypeError, "bool"),
    ("respawn", None, TypeError, "bool"),
    ("copy", 1, TypeError, "bool"),
    ("daemon", "yes", TypeError, "None, True or False"),
])
def test_bad_options_are_refused_at_construction(option, value, error, text):
    with pytest.raises(error, match=text):
        MultiprocessingSampler(_sampler(), ctx="fork", **{option: value})


@pytest.mark.parametrize("options, error, text", [
    ({"worker_seeds": "ab", "worker_init_fn": print}, TypeError, "integers, got 'a'"),
    ({"worker_seeds": 7, "worker_init_fn": print}, TypeError, "sequence of n_workers"),
    ({"worker_seeds": [1, True], "worker_init_fn": print}, TypeError, "integers, got True"),
    ({"worker_seeds": [1], "worker_init_fn": print}, ValueError, "n_workers=2 entries"),
    ({"worker_init_fn": "seed me"}, TypeError, "worker_init_fn must be None or callable"),
    ({"start_later": 3}, TypeError, "start_later must be None or callable"),
])
def test_bad_manager_options_are_refused_at_construction(options, error, text):
    with pytest.raises(error, match=text):
        MultiProcessingSampleManager(print, n_workers=2, ctx="fork", **options)


def _probe(calls):
    """{name: "works" or the type of the exception raised} for each call."""
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "works"
        except Exception as e:
            out[name] = type(e).__name__
    return out


def _after_close_calls(m, mm, state):
    """The sampler's and the manager's calls, as the Reliability guide lists them."""
    return {
        "sample": m.sample, "sample_index": m.sample_index,
        "epoch_iter": lambda: next(iter(m.epoch_iter())),
        "stats": m.stats, "state_dict": m.state_dict,
        "load_state_dict": lambda: m.load_state_dict(state),
        "manual_seed": lambda: m.manual_seed(1), "len": lambda: len(m),
        "submit": lambda: mm.submit(1), "add_work": lambda: mm.add_work(1),
        "fetch": mm.fetch, "result": lambda: mm.result(0), "ready": lambda: mm.ready(0),
        "wait_any": lambda: mm.wait_any([0]), "start_all": mm.start_all,
        "cancel": lambda: mm.cancel(0), "manager stats": mm.stats,
        "reset_order": mm.reset_order, "remaining_work": lambda: mm.remaining_work,
    }


#: What the Reliability guide promises of a closed sampler or manager, and of one a forked
#: child inherited: the calls that raise RuntimeError, and those that keep working.
_AFTER_CLOSE = {
    **{name: "RuntimeError" for name in (
        "sample", "sample_index", "epoch_iter", "submit", "add_work", "fetch", "result",
        "ready", "wait_any", "start_all")},
    **{name: "works" for name in (
        "stats", "state_dict", "load_state_dict", "manual_seed", "len", "cancel",
        "manager stats", "reset_order", "remaining_work")},
}


def _double(x):
    return np.full(2, 2 * x)


def test_what_works_after_close_and_in_a_forked_child_is_what_the_guide_says():
    expected = _reference_stream(6)
    m = MultiprocessingSampler(StepSampler(replay_buffer(100), 4, seed=0), n_workers=1,
                               ctx="fork", batches_per_task=1)
    mm = MultiProcessingSampleManager(_double, n_workers=1, ctx="fork")
    with m, mm:
        m.sample()
        state = m.state_dict()
        ticket = mm.submit(3)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child calls everything, then the parent checks it lost nothing
            try:
                os.write(write, repr(_probe(_after_close_calls(m, mm, state))).encode())
                m.close()
                mm.close()
            finally:
                os._exit(0)
        os.close(write)
        child = eval(os.read(read, 1 << 16).decode())
        os.close(read)
        os.waitpid(pid, 0)
        assert child == _AFTER_CLOSE
        assert mm.result(ticket).tolist() == [6, 6]
        assert [indices_of(m.sample()) for _ in range(5)] == expected[1:]
    assert _probe(_after_close_calls(m, mm, state)) == _AFTER_CLOSE


def test_buffers_that_would_not_fit_in_memory_are_refused():
    # ~6.3 MB a batch: 4000 of them requested ahead would need 25 GB
    rb = replay_buffer(20, img=(3, 256, 256))
    with pytest.raises(ValueError, match="memory"):
        MultiprocessingSampler(StepSampler(rb, 32, seed=0), n_buffers=4000, ctx="fork")


@pytest.mark.parametrize("option, value, text", [
    ("stall_timeout", math.inf, "finite"), ("doze_time", 1e9, "at most"),
    ("n_workers", 10 ** 6, "CPUs"), ("in_order", "no", "bool"),
    ("respawn", None, "bool"), ("max_respawns", 10 ** 10, "at most"),
])
def test_the_manager_refuses_them_too(option, value, text):
    with pytest.raises((TypeError, ValueError), match=text):
        MultiProcessingSampleManager(abs, ctx="fork", **{option: value})


def test_numpy_booleans_and_integers_are_taken():
    with MultiprocessingSampler(_sampler(), n_workers=np.int64(1), n_buffers=np.int32(2),
                                in_order=np.bool_(True), copy=np.False_, ctx="fork") as m:
        assert len(m.sample()["state"]) == 4


# -- a forked child ------------------------------------------------------------------------

def test_a_forked_child_gets_no_batch_and_the_parent_loses_none():
    rb = replay_buffer(400)
    with MultiprocessingSampler(StepSampler(rb, 4, seed=0), n_workers=1, n_buffers=4,
                                ctx="fork", batches_per_task=8) as m:
        first = m.sample()   # now 7 more batches of its task are ready in the parent
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child
            code = 1
            try:
                m.sample()
            except RuntimeError as e:
                code = 0 if "forked child" in str(e) else 2
            except BaseException:
                code = 3
            os.write(w, bytes([code]))
            os._exit(0)
        os.close(w)
        got = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert got == bytes([0])
        rest = [m.sample() for _ in range(7)]
    with MultiprocessingSampler(StepSampler(replay_buffer(400), 4, seed=0), n_workers=1,
                                n_buffers=4, ctx="fork", batches_per_task=8) as ref:
        expected = [ref.sample() for _ in range(8)]
    assert [indices_of(b) for b in [first, *rest]] == [indices_of(b) for b in expected]


@pytest.mark.parametrize("copy", [False, True])
def test_a_batch_held_across_a_fork_stays_unchanged_while_the_parent_holds_it(copy):
    rb = replay_buffer(400)
    with MultiprocessingSampler(StepSampler(rb, 16, seed=0), n_workers=2, n_buffers=4,
                                ctx="fork", copy=copy, batches_per_task=1) as m:
        held = m.sample()
        before = held["image"].clone()
        go_r, go_w = os.pipe()
        res_r, res_w = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child: waits until the parent recycled its slots many times
            os.read(go_r, 1)
            same = bool(torch.equal(held["image"], before))
            os.write(res_w, b"1" if same else b"0")
            os._exit(0)
        for _ in range(64):   # every other slot goes round many times meanwhile
            m.sample()
        os.write(go_w, b"x")
        got = os.read(res_r, 1)
        os.waitpid(pid, 0)
        for fd in (go_r, go_w, res_r, res_w):
            os.close(fd)
        assert got == b"1"
        assert torch.equal(held["image"], before)


# -- Ctrl-C in a terminal at start-up ------------------------------------------------------

CTRL_C_AT_START = """
import sys
sys.path.insert(0, {tests!r})
from unienv_data.samplers import StepSampler
from unienv_mp import MultiprocessingSampler
import _data

if __name__ == "__main__":
    import signal
    m = MultiprocessingSampler(StepSampler(_data.replay_buffer(64), 4, seed=0),
                               n_workers=2, n_buffers=4, ctx={method!r}, doze_time=0.01)
    # A Ctrl-C raises KeyboardInterrupt only inside the sampler's calls below, once each
    # time they are begun: one landing in this script's own lines (the print, the
    # except clause) is counted and dropped, so the script cannot die of its own ordering.
    armed = [False]
    interrupted = 0

    def on_sigint(signum, frame):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    print("start", flush=True)
    for _ in range(50):
        try:
            armed[0] = True
            m.sample()
            m._pools.sample.start_all()
            armed[0] = False
            break
        except KeyboardInterrupt:
            interrupted += 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # (started: the test's next ones)
    print("interrupted", interrupted, flush=True)
    for _ in range(20):
        m.sample()
    m.close()
    print("ok", flush=True)
"""


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_ctrl_c_to_the_process_group_at_start_up_reaches_only_the_parent(tmp_path, method):
    script = tmp_path / "main.py"
    script.write_text(CTRL_C_AT_START.format(tests=os.path.dirname(__file__), method=method))
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout.readline().strip() == "start"
    # a terminal's Ctrl-C goes to the whole process group: workers being started included
    for delay in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5):
        time.sleep(delay)
        if p.poll() is not None:
            break
        os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert out.split()[-1] == "ok"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_workers_killed_by_sigint_are_not_a_crash_loop(tmp_path):
    marker = tmp_path / "deaths"

    def work(x):
        deaths = marker.read_text().count("x") if marker.exists() else 0
        if deaths < 4:   # more deaths in a row than max_respawns allows crashes
            with open(marker, "a") as f:
                f.write("x")
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return x + 1

    with MultiProcessingSampleManager(work, n_workers=1, ctx="fork", doze_time=0.01,
                                      max_respawns=1) as pool:
        assert pool.result(pool.submit(1)) == 2
    assert marker.read_text() == "xxxx"


# -- threads -------------------------------------------------------------------------------

def _in_two_threads(run):
    """Run ``run(0)`` and ``run(1)`` in two threads at once, and wait for both."""
    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive()


def test_two_threads_sampling_share_one_stream_without_errors():
    n = 400
    errors, got = [], {0: [], 1: []}

    with MultiprocessingSampler(StepSampler(replay_buffer(300), 8, seed=3), n_workers=2,
                                n_buffers=4, ctx="fork", doze_time=0.01) as m:
        def run(i):
            try:
                for _ in range(n // 2):
                    got[i].append(tuple(indices_of(m.sample())))
                    if len(got[i]) % 50 == 0:
                        m.stats()
            except BaseException as e:   # (any error at all fails the test)
                errors.append(e)

        _in_two_threads(run)
    assert errors == []
    with MultiprocessingSampler(StepSampler(replay_buffer(300), 8, seed=3), n_workers=2,
                                n_buffers=4, ctx="fork") as ref:
        expected = [tuple(indices_of(ref.sample())) for _ in range(n)]
    # every batch of the stream went to exactly one thread, each thread's in stream order
    assert sorted(got[0] + got[1]) == sorted(expected)
    for i in (0, 1):
        positions = [expected.index(b) for b in got[i]]
        assert positions == sorted(positions)


def test_two_threads_running_epochs_each_get_a_whole_epoch():
    errors, seen = [], {0: [], 1: []}
    with MultiprocessingSampler(StepSampler(replay_buffer(200), 8, seed=0), n_workers=2,
                                n_buffers=4, ctx="fork", doze_time=0.01) as m:
        def run(i):
            try:
                for b in m.epoch_iter():
                    seen[i] += indices_of(b)
            except BaseException as e:
                errors.append(e)

        _in_two_threads(run)
    assert errors == []
    assert sorted(seen[0]) == sorted(seen[1]) == list(range(200))


@pytest.mark.parametrize("delay", [0.0, 0.002, 0.02])
def test_close_from_another_thread_while_sampling(delay):
    import multiprocessing as mp
    for attempt in range(5):
        s = _data.SlowSampler(replay_buffer(80), 4, seed=attempt, delay=0.005)
        m = MultiprocessingSampler(s, n_workers=2, n_buffers=4, ctx="fork", doze_time=0.01,
                                   batches_per_task=1)
        outcome = []

        def run():
            try:
                while True:
                    m.sample()
            except RuntimeError as e:
                outcome.append(str(e))
            except BaseException as e:
                outcome.append(e)

        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.05 + delay * attempt)
        m.close()
        t.join(30)
        assert not t.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], str) and "closed" in outcome[0]
        # nothing started after close() returned, nothing left running
        assert wait_until(lambda: not mp.active_children(), timeout=5)


def _identity(x):
    return x


@pytest.mark.parametrize("through", ["manager", "sampler"])
def test_close_from_another_thread_as_a_task_is_pushed_raises_runtime_error(
        monkeypatch, through):
    """close() shuts the task ring just before the call pushes its task: the call raises
    RuntimeError, as every call that close() cuts short does (it raised RingClosed)."""
    from unienv_mp._process.handle import WorkerHandle
    if through == "manager":
        obj = MultiProcessingSampleManager(_identity, n_workers=1, ctx="fork")
        obj.result(obj.submit(1))
        call = lambda: obj.submit(2)   # noqa: E731
    else:
        obj = MultiprocessingSampler(StepSampler(replay_buffer(40), 4, seed=0), n_workers=1,
                                     n_buffers=1, ctx="fork", batches_per_task=1)
        obj.sample()
        call = obj.sample
    real = WorkerHandle.push_task
    closer = []

    def close_first(self, *args, **kwargs):
        if not closer:
            closer.append(threading.Thread(target=obj.close))
            closer[0].start()
            assert wait_until(lambda: self.shut_down, 10)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(WorkerHandle, "push_task", close_first)
    try:
        with pytest.raises(RuntimeError, match="closed"):
            for _ in range(20):   # (the sampler pushes once its requests ahead are in)
                call()
        assert closer, "no task was pushed"
    finally:
        for t in closer:
            t.join(30)
        obj.close()


def test_workers_killed_meanwhile_start_no_process_after_close():
    """The sampling thread finds a worker dead while close() runs in another: it must not
    start a replacement."""
    import multiprocessing as mp
    for attempt in range(5):
        m = MultiprocessingSampler(_data.SlowSampler(replay_buffer(80), 4, seed=0,
                                                     delay=0.01),
                                   n_workers=2, n_buffers=4, ctx="fork", doze_time=0.005,
                                   batches_per_task=1)
        m.sample()
        pids = [p.pid for p in m._pools.sample.workers]
        done = []

        def run():
            try:
                while True:
                    m.sample()
            except BaseException as e:
                done.append(e)

        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.02)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        m.close()
        t.join(30)
        assert not t.is_alive() and len(done) == 1
        assert isinstance(done[0], RuntimeError), repr(done[0])
        assert wait_until(lambda: not mp.active_children(), timeout=5)


CLOSE_FROM_A_THREAD = """
import sys, threading, time
sys.path.insert(0, {tests!r})
from unienv_mp import MultiprocessingSampler
import _data

if __name__ == "__main__":
    m = MultiprocessingSampler(_data.SlowSampler(_data.replay_buffer(80), 4, seed=0,
                                                 delay=0.002),
                               n_workers=2, n_buffers=4, ctx="fork", doze_time=0.005,
                               batches_per_task=1)
    def run():
        try:
            while True:
                m.sample()
        except RuntimeError:
            pass
    threads = [threading.Thread(target=run, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    threading.Thread(target=m.close).start()
    print("closing", flush=True)
"""


def test_the_interpreter_exits_after_close_from_another_thread(tmp_path):
    script = tmp_path / "main.py"
    script.write_text(CLOSE_FROM_A_THREAD.format(tests=os.path.dirname(__file__)))
    for _ in range(3):
        p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0, p.stderr
        assert "Traceback" not in p.stderr, p.stderr


# -- a stopped worker ----------------------------------------------------------------------

def _idle(worker):
    """True once the worker waits for a task, with none on its ring."""
    counters = worker.counters()
    return counters is not None and not counters[_stats.TASK_SINCE] and not len(worker._tasks)


def _reference_stream(n):
    with MultiprocessingSampler(StepSampler(replay_buffer(100), 4, seed=0), n_workers=1,
                                n_buffers=2, ctx="fork", batches_per_task=1) as m:
        return [indices_of(m.sample()) for _ in range(n)]


@pytest.mark.parametrize("respawn", [True, False])
def test_a_worker_stopped_between_tasks_is_replaced(respawn):
    expected = _reference_stream(10)
    with MultiprocessingSampler(StepSampler(replay_buffer(100), 4, seed=0), n_workers=1,
                                n_buffers=2, ctx="fork", batches_per_task=1,
                                stall_timeout=0.5, respawn=respawn, timeout=30) as m:
        got = [indices_of(m.sample()) for _ in range(3)]
        worker = m._pools.sample._lanes[0].worker
        assert wait_until(lambda: _idle(worker))
        pid = worker.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.warns(RuntimeWarning, match="took none of the tasks") as record:
                got += [indices_of(m.sample()) for _ in range(7)]
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert "the process is stopped" in str(record[0].message)
        assert worker.pid != pid and m.stats().workers[0].respawns == 1
    assert got == expected      # its tasks went to the replacement: the same stream


class StopsItselfOnFifth(StepSampler):
    """Its 5th sample_index() call in a process stops that process (SIGSTOP)."""

    def __init__(self, data, batch_size, seed=None):
        super().__init__(data, batch_size, seed=seed)
        self.calls = 0

    def sample_index(self):
        self.calls += 1
        if self.calls == 5:
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().sample_index()


def test_a_worker_stopped_on_a_task_is_not_waited_on_for_its_stacks():
    expected = _reference_stream(8)
    with MultiprocessingSampler(StopsItselfOnFifth(replay_buffer(100), 4, seed=0),
                                n_workers=1, n_buffers=2, ctx="fork", batches_per_task=1,
                                stall_timeout=0.5, timeout=30) as m:
        with pytest.warns(RuntimeWarning, match="was on one task") as record:
            got = [indices_of(m.sample()) for _ in range(8)]
    assert "the process is stopped" in str(record[0].message)
    assert got == expected


def test_the_time_worker_init_fn_takes_is_not_a_stall():
    def init(seed):
        time.sleep(1.5)

    with MultiProcessingSampleManager(lambda x: x + 1, n_workers=1, ctx="fork",
                                      worker_init_fn=init, stall_timeout=0.3) as pool:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            assert [pool.result(pool.submit(i)) for i in range(3)] == [1, 2, 3]
        assert pool.stats().workers[0].respawns == 0


# -- a worker that corrupts its own ring or slot descriptors --------------------------------

def _worker_locals():
    """The local variables of the worker's task loop, from inside the work function it
    runs."""
    frame = sys._getframe()
    while frame.f_code.co_name != "_serve":
        frame = frame.f_back
    return frame.f_locals


def _scribble_on_next_cell(ring):
    """Write, as a stray pointer might, a sequence number far ahead into the cell the
    parent pops next (see the layout at the top of csrc/umr_ring.c)."""
    base = ring.segment.address + ring.offset
    header = (ctypes.c_uint64 * 4).from_address(base)   # magic, version|entry, cap, stride
    capacity, stride = header[2], header[3]
    tail = ctypes.c_uint64.from_address(base + 2 * 64).value
    cell = base + 5 * 64 + (tail % capacity) * stride
    ctypes.c_uint64.from_address(cell).value = 2 * (tail + 10 * capacity) + 1


def _corrupt(kind):
    """Push onto this worker's result ring an entry it could not have written (or, for
    "ring", break the ring), before the result of the task in hand."""
    loc = _worker_locals()
    ring, slot, ticket = loc["out"].ring, loc["slot"], loc["ticket"]
    ok_inline, ok_slot = P.tag(P.ST_OK, P.AT_INLINE), P.tag(P.ST_OK, P.AT_SLOT)
    if kind == "ring":
        _scribble_on_next_cell(ring)
        time.sleep(60)   # (it is killed long before)
    elif kind in ("tail shut down", "head shut down", "tail back a lap"):
        # the counters the parent reads (layout: see csrc/umr_ring.c)
        base = ring.segment.address + ring.offset
        capacity = ctypes.c_uint64.from_address(base + 16).value
        counter = ctypes.c_uint64.from_address(base + (64 if kind.startswith("head") else 128))
        if kind == "tail back a lap":
            counter.value = (counter.value - capacity) % 2 ** 64
        else:
            counter.value |= 1 << 63
        time.sleep(60)   # (it is killed long before)
    elif kind == "tag":
        ring.push_tagged(0x7F7F, slot, ticket, b"")
    elif kind == "unknown ticket":
        ring.push_tagged(ok_inline, slot, 2 ** 40, b"x")
    elif kind == "earlier ticket":
        ring.push_tagged(ok_inline, slot, ticket - 1, b"x")
    elif kind == "other slot":
        ring.push_tagged(ok_slot, slot + 1000, ticket, P.SLOT_DESC.pack(0, 3, 1, 4096, 8))
    elif kind == "short descriptor":
        ring.push_tagged(ok_slot, slot, ticket, b"\0" * 8)
    elif kind == "descriptor fd":
        ring.push_tagged(ok_slot, slot, ticket, P.SLOT_DESC.pack(2 ** 32 - 1, 987, 1, 4096, 8))
    elif kind == "descriptor of stdout":
        ring.push_tagged(ok_slot, slot, ticket, P.SLOT_DESC.pack(2 ** 32 - 1, 1, 1, 4096, 8))
    elif kind == "descriptor size":
        ring.push_tagged(ok_slot, slot, ticket,
                         P.SLOT_DESC.pack(2 ** 32 - 1, 1, 1, 4096, 2 ** 40))
    else:
        raise AssertionError(kind)


class CorruptsItsResults(StepSampler):
    """On its ``on``-th sample_index() call in a process, corrupts that worker's result
    ring (see _corrupt): once in all, taking the marker file away, or every time
    (``marker`` None)."""

    def __init__(self, data, batch_size, kind, on=3, marker=None, seed=None):
        super().__init__(data, batch_size, seed=seed)
        self.kind, self.on, self.marker = kind, on, marker
        self.calls = 0

    def sample_index(self):
        self.calls += 1
        if self.calls == self.on:
            try:
                if self.marker is not None:
                    os.unlink(self.marker)
            except FileNotFoundError:
                pass
            else:
                _corrupt(self.kind)
        return super().sample_index()


_CORRUPTIONS = {
    "ring": "its result ring: ring memory is corrupt",
    "tail shut down": "its result ring: it is shut down",
    "head shut down": "its result ring: it is shut down",
    "tail back a lap": "its result ring: it is shut down",
    "tag": "tag 0x7f7f",
    "unknown ticket": "was not given to it",
    "earlier ticket": "ticket",
    "other slot": "slot 10",
    "short descriptor": "a payload of 8 bytes",
    "descriptor fd": "as its descriptor 987",
    "descriptor of stdout": "as its descriptor 1",
    "descriptor size": "holds a result of 1099511627776 bytes",
}


def _corrupting_sampler(tmp_path, cls, kind, **options):
    """A sampler whose one worker, made of ``cls``, corrupts ``kind`` once."""
    marker = tmp_path / "corrupt"
    marker.write_text("")
    s = cls(replay_buffer(100), 4, kind, marker=str(marker), seed=0)
    return MultiprocessingSampler(s, n_workers=1, n_buffers=2, ctx="fork",
                                  batches_per_task=1, timeout=30, **options)


def _check_replaced_and_goes_on(m, wrote, said):
    """``m``'s worker, once it corrupted what it ``wrote``, is killed and replaced with a
    warning that says ``said``, and its stream goes on: nothing lost, nothing repeated."""
    expected = _reference_stream(8)
    with m:
        got = [indices_of(m.sample())]
        first_pid = m._pools.sample._lanes[0].worker.pid
        with pytest.warns(RuntimeWarning, match=wrote) as record:
            got += [indices_of(m.sample()) for _ in range(7)]
        message = str(record[0].message)
        assert said in message, message
        assert f"pid {first_pid}" in message and "killed and replaced" in message
        assert record[0].filename == __file__   # (the caller's sample(), not the package)
        worker = m._pools.sample._lanes[0].worker
        assert worker.incarnation == 2 and worker.pid != first_pid
        assert m.stats().workers[0].respawns == 1
    assert got == expected
    assert wait_until(lambda: not os.path.exists(f"/proc/{first_pid}"))


class _CorruptOnce:
    """Work ``w`` -> 8 int64 equal to ``w``; the worker corrupts its result ring once, at
    work 1, if the file ``marker`` exists."""

    def __init__(self, marker):
        self.marker = marker

    def __call__(self, w):
        if w == 1 and os.path.exists(self.marker):
            os.unlink(self.marker)
            _corrupt("tag")
        return np.full(8, w, dtype=np.int64)


@pytest.mark.parametrize("call", ["result", "ready", "fetch(block=False)"])
def test_the_warning_of_a_worker_replaced_points_at_the_callers_line(tmp_path, call):
    """However deep in the package the corrupt ring is found (waiting for one result,
    polling every worker), the warning is the caller's, where it can be filtered."""
    marker = tmp_path / "corrupt"
    with MultiProcessingSampleManager(_CorruptOnce(str(marker)), n_workers=1,
                                      ctx="fork", timeout=30) as mgr:
        assert (mgr.result(mgr.submit(0)) == 0).all()
        marker.write_text("")
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            if call == "result":
                value = mgr.result(mgr.submit(1))
            elif call == "ready":
                t = mgr.submit(1)
                deadline = time.monotonic() + 30
                while not mgr.ready(t) and time.monotonic() < deadline:
                    time.sleep(0.01)
                value = mgr.result(t)
            else:
                mgr.add_work(1)
                deadline = time.monotonic() + 30
                value = None
                while value is None and time.monotonic() < deadline:
                    value = mgr.fetch(block=False)
                    time.sleep(0.01)
        assert (value == 1).all()
        replaced = [w for w in ws if "killed and replaced" in str(w.message)]
        assert len(replaced) == 1, [str(w.message) for w in ws]
        assert replaced[0].filename == __file__, replaced[0].filename


def _check_one_codec_error(m, match):
    """``m`` (``respawn=False``) raises one CodecError matching ``match``, keeps its
    worker, and its stream goes on: nothing lost, nothing repeated."""
    expected = _reference_stream(8)
    got = []
    with m:
        with pytest.raises(CodecError, match=match):
            while True:
                got.append(indices_of(m.sample()))
        assert len(got) < 8 and _lane_processes_alive(m)
        got += [indices_of(m.sample()) for _ in range(8 - len(got))]
    assert got == expected


@pytest.mark.parametrize("kind", sorted(_CORRUPTIONS))
def test_a_worker_that_corrupts_its_results_is_replaced_and_the_stream_goes_on(tmp_path, kind):
    m = _corrupting_sampler(tmp_path, CorruptsItsResults, kind)
    _check_replaced_and_goes_on(m, "wrote a corrupt result entry", _CORRUPTIONS[kind])


@pytest.mark.parametrize("kind", ["ring", "descriptor fd", "unknown ticket", "tail shut down"])
def test_without_respawn_the_caller_gets_one_codec_error_and_nothing_is_lost(tmp_path, kind):
    m = _corrupting_sampler(tmp_path, CorruptsItsResults, kind, respawn=False)
    _check_one_codec_error(m, "corrupt result entry.*respawn=False")


def test_a_worker_that_keeps_corrupting_them_is_given_up(tmp_path):
    s = CorruptsItsResults(replay_buffer(100), 4, "descriptor fd", on=1, seed=0)
    with MultiprocessingSampler(s, n_workers=1, n_buffers=2, ctx="fork", batches_per_task=1,
                                timeout=30) as m:
        with pytest.warns(RuntimeWarning, match="wrote a corrupt result entry"):
            with pytest.raises(CodecError, match="4 times in a row.*giving up"):
                m.sample()
        assert _lane_processes_alive(m)


def _scribble_on_task_ring(kind):
    """Write, as a stray pointer might, over the counter or the next cell of this worker's
    task ring, where the parent pushes its next task (layout: see csrc/umr_ring.c)."""
    ring = _worker_locals()["tasks"]
    base = ring.segment.address + ring.offset
    header = (ctypes.c_uint64 * 4).from_address(base)   # magic, version|entry, cap, stride
    capacity, stride = header[2], header[3]
    head = ctypes.c_uint64.from_address(base + 64)
    if kind == "head ahead":
        head.value += capacity
    elif kind == "head behind":
        head.value -= 1
    elif kind == "head shut down":
        head.value |= 1 << 63
    elif kind == "cell ahead":
        pos = head.value
        cell = base + 5 * 64 + (pos % capacity) * stride
        ctypes.c_uint64.from_address(cell).value = 2 * (pos + 10 * capacity)
    elif kind == "tail ahead":   # (its own counter: it skips the next task)
        ctypes.c_uint64.from_address(base + 128).value += 1
    elif kind == "next task rewritten":
        # the task the parent pushed after this one becomes a copy of this one (its work
        # info: the chunk this worker is making now), as a stray write might make it
        tail = ctypes.c_uint64.from_address(base + 128).value
        cell = base + 5 * 64 + (tail % capacity) * stride
        seq = ctypes.c_uint64.from_address(cell)
        deadline = time.monotonic() + 20
        while seq.value != 2 * tail + 1:   # (until the parent has pushed it)
            assert time.monotonic() < deadline, "the next task never came"
            time.sleep(0.001)
        mine = _worker_locals()["payload"]
        ctypes.memmove(cell + 16 + P.ENTRY_HEADER, mine, len(mine))   # {seq, len, pad}
    else:
        raise AssertionError(kind)


class CorruptsItsTasks(CorruptsItsResults):
    """CorruptsItsResults, writing over the task ring instead (see _scribble_on_task_ring),
    then going on with its task."""

    def sample_index(self):
        self.calls += 1
        if self.calls == self.on:
            try:
                os.unlink(self.marker)
            except FileNotFoundError:
                pass
            else:
                _scribble_on_task_ring(self.kind)
        return StepSampler.sample_index(self)


_TASK_RING_CORRUPTIONS = {
    "head ahead": "the ring of 64 tasks is full with",
    "head behind": "ring memory is corrupt",
    "head shut down": "it is shut down",
    "cell ahead": "ring memory is corrupt",
}


@pytest.mark.parametrize("kind", sorted(_TASK_RING_CORRUPTIONS))
def test_a_worker_that_corrupts_its_task_ring_is_replaced_and_the_stream_goes_on(
        tmp_path, kind):
    m = _corrupting_sampler(tmp_path, CorruptsItsTasks, kind)
    _check_replaced_and_goes_on(m, "wrote into its task ring", _TASK_RING_CORRUPTIONS[kind])


@pytest.mark.parametrize("kind", ["head ahead", "head shut down"])
def test_a_corrupt_task_ring_without_respawn_is_one_codec_error(tmp_path, kind):
    m = _corrupting_sampler(tmp_path, CorruptsItsTasks, kind, respawn=False)
    _check_one_codec_error(m, "wrote into its task ring.*respawn=False")


def test_a_task_rewritten_in_its_ring_is_refused_and_the_stream_goes_on(tmp_path):
    """A task carries a check of its entry: a worker that finds its next task rewritten
    (here, into a copy of the one in hand, which would repeat a chunk of the stream)
    exits instead of running it, and is replaced; the task goes to the replacement."""
    m = _corrupting_sampler(tmp_path, CorruptsItsTasks, "next task rewritten")
    _check_replaced_and_goes_on(m, "found a task in its ring rewritten",
                                "did not match its check")


def test_a_task_rewritten_in_its_ring_without_respawn_is_one_codec_error(tmp_path):
    m = _corrupting_sampler(tmp_path, CorruptsItsTasks, "next task rewritten",
                            respawn=False)
    _check_one_codec_error(m, "found a task in its ring rewritten.*respawn=False")


def _hides_a_result(work):
    """The work function of the tests below: ``("hide", marker)`` makes the entry of the
    first result this worker published look unwritten (as a stray write into its result
    ring might), once: while ``marker`` exists, which it removes.  Any other work comes
    back as an array."""
    if isinstance(work, tuple) and work[0] == "hide":
        try:
            os.unlink(work[1])
        except FileNotFoundError:
            pass
        else:
            ring = _worker_locals()["out"].ring
            base = ring.segment.address + ring.offset
            ctypes.c_uint64.from_address(base + 5 * 64).value = 0   # cell 0: "free"
        return np.zeros(1)
    if work == "slow":
        time.sleep(0.4)
    return np.full(3, sum(map(ord, work)))


def _wait_for_tasks(m, worker, n):
    assert wait_until(lambda: m.stats().workers[worker].tasks == n, timeout=20)


@pytest.mark.parametrize("respawn", [True, False])
def test_a_worker_that_hides_a_result_it_published_is_replaced(tmp_path, respawn):
    """The stall watchdog compares the tasks a worker counts as answered with the answers
    that reached the parent: a worker idle with fewer answers read than it published hid
    one, and is replaced (its tasks go to the replacement) instead of leaving the call
    to wait until its timeout."""
    marker = tmp_path / "hide"
    marker.write_text("")
    with MultiProcessingSampleManager(_hides_a_result, n_workers=1, ctx="fork",
                                      stall_timeout=0.5, timeout=20,
                                      respawn=respawn) as m:
        first = m.submit("a")
        _wait_for_tasks(m, 0, 1)   # (published, not read: nothing waited for it yet)
        hiding = m.submit(("hide", str(marker)))
        _wait_for_tasks(m, 0, 2)
        pid = m.workers[0].pid
        if respawn:
            with pytest.warns(RuntimeWarning, match="over a result it had published"):
                assert m.result(first).tolist() == [97] * 3
            assert m.result(hiding).tolist() == [0.0]
        else:
            with pytest.raises(CodecError, match="over a result it had published.*"
                                                 "respawn=False"):
                m.result(first)
            assert m.result(first).tolist() == [97] * 3   # (asked again)
        assert m.workers[0].pid != pid


def test_a_ctrl_c_while_a_result_is_recorded_never_loses_it_from_the_count():
    """The stall watchdog counts the answers read as ``_received`` plus the entries still
    in ``_popped``: a KeyboardInterrupt at any line of result_recorded must not leave an
    entry in neither (the watchdog would then take a healthy worker for one hiding a
    result).  Found by a review: the count came after the entry was dropped."""
    import collections
    from unienv_mp._process.handle import WorkerHandle
    code = WorkerHandle.result_recorded.__code__
    lines = sorted({line for _, _, line in code.co_lines() if line is not None})
    for stop_at in lines:
        w = WorkerHandle.__new__(WorkerHandle)
        w._received, w._popped = 0, collections.deque(["entry"])

        def tracer(frame, event, arg, stop_at=stop_at):
            if frame.f_code is code:
                if event == "line" and frame.f_lineno == stop_at:
                    raise KeyboardInterrupt
                return tracer
            return None

        sys.settrace(tracer)
        try:
            w.result_recorded()
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        assert w._received + len(w._popped) >= 1, stop_at


def test_results_left_unread_while_the_caller_waits_on_another_worker_are_kept():
    """A result a worker published and nobody asked for yet is not one it hid: the
    caller may wait on the other workers far longer than the stall timeout meanwhile."""
    with MultiProcessingSampleManager(_hides_a_result, n_workers=2, ctx="fork",
                                      stall_timeout=0.5, timeout=20) as m:
        left = m.submit("b", worker=1)
        _wait_for_tasks(m, 1, 1)
        pids = [w.pid for w in m.workers]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(4):   # 1.6 s in all
                m.result(m.submit("slow", worker=0))
            assert m.result(left).tolist() == [98] * 3
        assert [w.pid for w in m.workers] == pids


def test_a_worker_that_skips_a_task_of_its_ring_is_a_stall(tmp_path):
    """A worker that moves its own task ring's tail on skips a task and waits, alive and
    idle, for one that never comes: nothing it wrote can be told from a worker taking its
    time, so the stall watchdog replaces it (without stall_timeout the call waits, as for
    any stalled worker), and the skipped task goes to the replacement."""
    m = _corrupting_sampler(tmp_path, CorruptsItsTasks, "tail ahead",
                            stall_timeout=1)
    _check_replaced_and_goes_on(m, "took none of the tasks waiting for it",
                                "longer than stall_timeout=1.0 s")
