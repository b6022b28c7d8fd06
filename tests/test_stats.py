"""stats(): counts that agree with what was sampled, fractions that move the right way, the
histogram, reset; the stall watchdog: a stuck worker reported with its stack, replaced,
and a task that keeps stalling given up."""
import os
import time
import warnings

import pytest
from unienv_data.samplers import StepSampler

import _data
from _data import replay_buffer
from conftest import wait_until
from test_interrupts import interrupt_at, interrupted, line_of
from unienv_mp import MultiProcessingSampleManager, MultiprocessingSampler, SamplerStats, WorkerError, WorkerStalledError, stats as S
from unienv_mp._sampling.streams import base_seed, chunk_seed, stream_key


# -- the counters ----------------------------------------------------------------------------

def test_histogram_buckets_cover_every_time_once():
    assert S.bucket_of(0) == 0 and S.bucket_of(1023) == 0
    for i in range(S.N_BUCKETS):
        lo, hi = S.bucket_edge(i), S.bucket_edge(i + 1)
        assert S.bucket_of(lo) == i and S.bucket_of(hi - 1) == i
        assert hi / lo <= 1.25
    assert S.bucket_of(10 ** 12) == S.N_BUCKETS - 1       # 1000 s: the last bucket


def test_quantiles_from_the_histogram_are_within_their_bucket():
    counters = [0] * S.COUNTERS
    for ns, n in ((50_000, 98), (2_000_000, 1), (9_000_000, 1)):   # 50 µs, 2 ms, 9 ms
        counters[S.HIST + S.bucket_of(ns)] += n
    assert S.quantile(counters, 0.5) == pytest.approx(50e-6, rel=0.12)
    assert S.quantile(counters, 0.99) == pytest.approx(2e-3, rel=0.12)
    assert S.quantile(counters, 1.0) == pytest.approx(9e-3, rel=0.12)
    assert S.quantile([0] * S.COUNTERS, 0.99) is None


def test_the_bottleneck_rule():
    assert S.bottleneck(0.9, 0.9, 10) == "workers"
    assert S.bottleneck(0.05, 0.2, 10) == "consumer"
    assert S.bottleneck(0.3, 0.6, 10) == "balanced"
    assert S.bottleneck(0.9, 0.3, 10) == "balanced"     # waits, but the workers idle
    assert S.bottleneck(0.0, 0.0, 0) is None


# -- stats() of a sampler --------------------------------------------------------------------

@pytest.mark.parametrize("persistent", [False, None])
def test_counts_agree_with_what_was_sampled(persistent):
    rb = replay_buffer(200)
    with MultiprocessingSampler(StepSampler(rb, 5, seed=0), n_workers=2, n_buffers=4,
                                ctx="fork", batches_per_task=3,
                                persistent_workers=persistent) as m:
        assert m.stats().batches == 0 and m.stats().bottleneck is None
        for _ in range(20):
            m.sample()
        for _ in range(4):
            m.sample_index()
        # 40 batches: on workers of its own (False), or on the sample() workers, since the
        # data did not change (None)
        epoch = sum(1 for _ in m.epoch_iter())
        assert epoch == 40
        on_them = 40 if persistent is None else 0
        st = m.stats()
        assert isinstance(st, SamplerStats)
        assert st.batches == 20 + 4 + 40
        assert st.gather_path == "direct" and len(st.workers) == 2
        # once the workers are done, everything requested ahead is ready: the rest of a
        # chunk being handed out, and the chunks asked for (3 batches, or 1, each)
        ahead = sum(len(x.ready) + x.k * len(x.tickets) for x in m._streams.values())
        assert wait_until(lambda: m.stats().ready == ahead), (m.stats().ready, ahead)
        assert wait_until(
            lambda: sum(w.batches for w in m.stats().workers) == 20 + 4 + on_them + ahead)
        st = m.stats()
        # (a worker started later gets tasks once it is up: on a loaded machine the first
        # one may have made them all)
        assert st.workers[0].tasks > 0
        for w in st.workers:
            assert w.pid is not None and w.respawns == 0 and w.errors == 0
            assert w.batches >= w.tasks
            if not w.tasks:
                continue
            assert 0 < w.busy_fraction <= 1
            assert 0 < w.seconds_per_batch_mean <= w.seconds_per_batch_p99 * 1.25 + 1e-3
            assert w.task_seconds is None or w.task_seconds >= 0
        assert 0 <= st.wait_fraction <= 1 and st.wall_seconds > 0


def test_errors_and_respawns_are_counted(tmp_path):
    rb = replay_buffer(100)
    s = _data.FailingSampler(rb, 4, seed=0, fail_every=2)
    with MultiprocessingSampler(s, n_workers=1, n_buffers=2, ctx="fork",
                                batches_per_task=1) as m:
        errors = 0
        for _ in range(10):
            try:
                m.sample()
            except WorkerError:
                errors += 1
        st = m.stats()
        assert errors >= 4 and st.batches == 10 - errors
        # (a worker counts a task once it has published its result: a moment later)
        assert wait_until(lambda: m.stats().workers[0].errors >= errors)
    s = _data.DyingSampler(rb, 4, seed=0, marker=str(tmp_path / "d"), deaths=2, every=2)
    with MultiprocessingSampler(s, n_workers=1, n_buffers=1, ctx="fork", doze_time=0.01,
                                batches_per_task=1) as m:
        for _ in range(8):
            m.sample()
        st = m.stats()
        assert st.workers[0].respawns == 2 and st.batches == 8
        # the dead processes' batches are kept: at least the 8 handed out were made
        assert wait_until(lambda: m.stats().workers[0].batches >= 8)


def test_a_slow_sampler_makes_the_workers_the_bottleneck():
    rb = replay_buffer(100)
    s = _data.SlowSampler(rb, 4, seed=0, delay=0.03)   # sleeps: busy, but off the CPU
    with MultiprocessingSampler(s, n_workers=2, n_buffers=2, ctx="fork") as m:
        for _ in range(4):
            m.sample()
        m.stats(reset=True)          # (from here on: the workers started long ago)
        for _ in range(20):
            m.sample()
        st = m.stats()
    assert st.wait_fraction > 0.6
    assert all(w.busy_fraction > 0.6 for w in st.workers)
    assert all(w.cpu_fraction is not None and w.cpu_fraction < 0.5 for w in st.workers)
    assert all(w.seconds_per_batch_p99 >= 0.03 / 1.25 for w in st.workers)
    assert st.bottleneck == "workers"
    assert st.advice().startswith("workers are the bottleneck")


def _stats(wait, busy, cpu, idle, n=2):
    workers = [S.WorkerStats(i, 1, 10, 10, busy, 1e-3, 1e-3, 0, 0, None, cpu)
               for i in range(n)]
    return SamplerStats(100, wait, 1.0, wait, 0, workers, None,
                        S.bottleneck(wait, busy, 100), idle)


def test_the_advice():
    # waiting 75 %: 4x the workers would keep up; the idle CPUs can run that many
    assert _stats(0.75, 0.9, 0.1, 0.9).advice(cpus=8) == \
        "workers are the bottleneck: try n_workers=8"
    # ... but with 1 of 2 CPUs idle, only 2 more workers of 0.5 CPU each
    assert _stats(0.75, 0.9, 0.5, 0.5).advice(cpus=2) == \
        "workers are the bottleneck: try n_workers=4"
    assert "the machine's CPUs are busy (5 % idle): more workers would not help" in \
        _stats(0.75, 0.9, 0.9, 0.05).advice(cpus=2)
    assert "more workers will not help" in _stats(0.02, 0.1, 0.1, 0.5).advice()
    assert _stats(0.3, 0.6, 0.5, 0.5).advice().startswith("balanced")


def test_a_slow_caller_makes_the_caller_the_bottleneck():
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 4, seed=0), n_workers=2, n_buffers=2,
                                ctx="fork") as m:
        m.sample()
        time.sleep(0.2)
        for _ in range(30):
            m.sample()
            time.sleep(0.02)    # the training step
        st = m.stats()
    assert st.wait_fraction < 0.1
    assert all(w.busy_fraction < 0.3 for w in st.workers)
    assert st.bottleneck == "consumer"
    assert "more workers will not help" in st.advice()


def test_waiting_for_a_worker_still_starting_is_start_up():
    c = S.CallerRecord()
    c.since_ns = 0
    c.waited(0, 3_000, 2_000)     # started 2 us into a 3 us wait
    c.waited(4_000, 5_000, 2_000)   # started before: all of it the pipeline's
    c.waited(6_000, 7_000, 0)     # not started at all (e.g. the wait timed out)
    assert (c.startup_ns, c.wait_ns) == (3_000, 2_000)
    st = c.report(0, [], 10_000)
    assert st.startup_seconds == 3e-6 and st.wait_seconds == 2e-6
    assert st.wait_fraction == pytest.approx(2 / 7)   # of the 7 us the workers ran


def test_the_cpu_time_a_worker_took_to_start_is_not_in_its_cpu_fraction():
    record = S.WorkerRecord(0)
    counters = [0] * S.COUNTERS
    counters[S.STARTED] = 10 * 10 ** 9
    counters[S.START_CPU] = 2 * 10 ** 9           # 2 s of imports before it started
    st = record.report(0, 1, counters, 20 * 10 ** 9, cpu_seconds=3.0,
                       launched_ns=7 * 10 ** 9)
    assert st.cpu_fraction == pytest.approx(0.1)   # 1 s of CPU in its 10 s alive
    assert st.startup_seconds == pytest.approx(3.0)


@pytest.mark.parametrize("slow", ["consumer", "workers"])
def test_the_advice_on_a_spawn_run_leaves_the_start_up_out(slow):
    rb = replay_buffer(100)
    s = (StepSampler(rb, 4, seed=0) if slow == "consumer"
         else _data.SlowSampler(rb, 4, seed=0, delay=0.03))
    with MultiprocessingSampler(s, n_workers=2, n_buffers=2, ctx="spawn") as m:
        # (30 batches once the worker started later is up too: tasks go only to workers
        # that are up)
        n = up = 0
        while up < 30 and n < 3000:
            m.sample()
            n += 1
            workers = m.stats().workers
            if up or (len(workers) == 2
                      and all(w.startup_seconds is not None for w in workers)):
                up += 1
            if slow == "consumer":
                time.sleep(0.02)    # the training step
        st = m.stats()
    # most of the time went to starting the workers (importing torch, unpickling)
    assert st.startup_seconds > 0.2 and st.wall_seconds > st.startup_seconds
    assert all(w.startup_seconds > 0.2 for w in st.workers)
    assert all(w.cpu_fraction is not None and w.cpu_fraction < 0.5 for w in st.workers)
    if slow == "consumer":
        assert st.wait_fraction < 0.1 and st.bottleneck == "consumer", st
        assert "more workers will not help" in st.advice()
    else:
        assert st.wait_fraction > 0.6 and st.bottleneck == "workers", st
        # (on a machine busy with other work, more workers would not help: said so)
        assert st.advice().startswith(("workers are the bottleneck: try n_workers=",
                                       "workers are the bottleneck, and the machine's "
                                       "CPUs are busy")), st.advice()


def test_reset_starts_the_counters_again():
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 4, seed=0), n_workers=2, ctx="fork",
                                batches_per_task=1) as m:
        for _ in range(10):
            m.sample()
        # (the workers finish what was asked ahead first: then nothing moves meanwhile)
        ahead = sum(len(x.ready) + x.k * len(x.tickets) for x in m._streams.values())
        assert wait_until(lambda: m.stats().ready == ahead
                          and sum(w.batches for w in m.stats().workers) == 10 + ahead)
        before = m.stats(reset=True)
        assert before.batches == 10
        after = m.stats()
        assert after.batches == 0 and after.wait_seconds == 0
        assert all(w.batches == 0 and w.tasks == 0 for w in after.workers)
        for _ in range(5):
            m.sample()
        assert m.stats().batches == 5
        # the batches made since: those asked for to keep n_buffers ahead (at most 5)
        assert wait_until(lambda: sum(w.batches for w in m.stats().workers) == 5)


class Echo:
    def __call__(self, x):
        return x

    @staticmethod
    def batches_in(work):
        return 2


def test_a_manager_counts_results_as_its_work_function_says():
    with MultiProcessingSampleManager(Echo(), n_workers=2, ctx="fork") as mgr:
        for i in range(6):
            mgr.add_work(i)
        assert [mgr.fetch() for _ in range(6)] == list(range(6))
        st = mgr.stats()
        assert st.batches == 12 and st.gather_path is None
        assert wait_until(lambda: sum(w.tasks for w in mgr.stats().workers) == 6)
        assert sum(w.batches for w in mgr.stats().workers) == 12


# -- the stall watchdog ---------------------------------------------------------------------

class StuckOnFifth(StepSampler):
    """Its 5th sample_index() call in a process sleeps (or spins) for a minute."""

    def __init__(self, data, batch_size, seed=None, spin=False):
        super().__init__(data, batch_size, seed=seed)
        self.calls = 0
        self.spin = spin

    def sample_index(self):
        self.calls += 1
        if self.calls == 5:
            self.stuck_here()
        return super().sample_index()

    def stuck_here(self):
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if not self.spin:
                time.sleep(60)


@pytest.mark.parametrize("spin", [False, True])
def test_a_stuck_worker_raises_with_its_stack_and_is_replaced(spin):
    rb = replay_buffer(100)
    with MultiprocessingSampler(StuckOnFifth(rb, 4, seed=0, spin=spin), n_workers=1,
                                n_buffers=2, ctx="fork", batches_per_task=1,
                                stall_timeout=0.5, respawn=False) as m:
        got = 0
        with pytest.raises(WorkerStalledError) as info:
            for _ in range(10):
                m.sample()
                got += 1
        e = info.value
        assert got == 4 and e.worker == 0 and e.seconds > 0.5
        assert "in stuck_here" in e.worker_stack and "in sample_index" in e.worker_stack
        assert isinstance(e, WorkerError)
        old = e.worker_stack
        for _ in range(3):              # the sampler goes on, with a new worker
            m.sample()
        assert m.stats().workers[0].respawns == 1
    assert old


def test_with_respawn_a_stuck_worker_warns_with_its_stack_and_its_task_goes_on():
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 4, seed=0), n_workers=1, ctx="fork",
                                batches_per_task=1) as m:
        expected = [_data.indices_of(m.sample()) for _ in range(8)]
    with MultiprocessingSampler(StuckOnFifth(rb, 4, seed=0), n_workers=1, n_buffers=2,
                                ctx="fork", batches_per_task=1, stall_timeout=0.5) as m:
        with pytest.warns(RuntimeWarning, match="stall_timeout") as record:
            got = [_data.indices_of(m.sample()) for _ in range(8)]
        assert "in stuck_here" in str(record[0].message)
        assert m.stats().workers[0].respawns == 1
    assert got == expected     # the stalled chunk made again: nothing lost, same stream


class StuckOnChunk(StepSampler):
    """Sleeps whenever it is seeded for one given chunk."""

    def __init__(self, data, batch_size, seed=None, bad_seed=None):
        super().__init__(data, batch_size, seed=seed)
        self.bad_seed = bad_seed

    def sample_index(self):
        if self.data_rng.initial_seed() == self.bad_seed:
            time.sleep(60)
        return super().sample_index()


def test_a_task_that_stalls_every_time_ends_in_worker_stalled_error():
    rb = replay_buffer(100)
    bad = chunk_seed(stream_key(base_seed(StepSampler(rb, 4, seed=3)), "sample"), 2)
    with MultiprocessingSampler(StuckOnChunk(rb, 4, seed=3, bad_seed=bad), n_workers=2,
                                n_buffers=2, ctx="fork", batches_per_task=1,
                                stall_timeout=0.3) as m:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            m.sample()
            m.sample()
            with pytest.raises(WorkerStalledError) as info:
                m.sample()                  # chunk 2: 3 tries (max_respawns=3: 4)
        assert "in sample_index" in info.value.worker_stack
        assert m.stats().workers[info.value.worker].respawns == 4
        assert len(m.sample()["state"]) == 4    # and the stream goes on past it


# -- the main job ------------------------------------------------------------------------------

def test_the_main_job_says_where_the_time_went(capsys):
    import json
    from unienv_mp.bench import cli
    small = ["--case", "state", "--transitions", "300", "--workers", "2", "--buffers", "2",
             "--seconds", "0.3", "--no-progress", "--impl", "unienv_mp,in_process"]
    assert cli.main(small) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("Where unienv_mp"))
    assert "workers busy" in line and "the caller waiting" in line and "bottleneck:" in line
    bottleneck = line.split("bottleneck: ")[1].split(".")[0]
    advice = {"workers": "Workers are the bottleneck", "balanced": "Balanced: the workers",
              "consumer": "The caller is the bottleneck"}[bottleneck]
    assert line.split(".  ", 1)[1].startswith(advice)   # one line of advice, after the figures
    assert cli.main(small + ["--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    st = rows["unienv_mp"]["stats"]
    assert st["batches"] == rows["unienv_mp"]["batches"]     # the measured batches only
    assert len(st["workers"]) == 2 and st["bottleneck"] in ("workers", "consumer", "balanced")
    assert rows["in_process"]["stats"] is None


# -- the stall watchdog: awkward moments -------------------------------------------------

def test_a_stuck_worker_gives_its_stacks_where_there_are_no_pidfds(monkeypatch):
    """Where pidfds are not available (_process falls back to the Process object), the
    stacks are asked for with SIGUSR1 all the same."""
    from test_stats import StuckOnFifth

    def no_pidfds(pid):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    rb = replay_buffer(100)
    with MultiprocessingSampler(StuckOnFifth(rb, 4, seed=0), n_workers=1, n_buffers=2,
                                ctx="fork", batches_per_task=1, stall_timeout=0.5,
                                respawn=False) as m:
        with pytest.raises(WorkerStalledError) as info:
            for _ in range(10):
                m.sample()
    assert "in stuck_here" in info.value.worker_stack, info.value.worker_stack


class StuckOnceAtZero:
    """Work ``w`` -> 4 int64 equal to ``w``; work 0 hangs once if the file ``flag``
    exists."""

    def __init__(self, flag):
        self.flag = flag

    def __call__(self, w):
        import numpy as np
        if w == 0 and os.path.exists(self.flag):
            os.remove(self.flag)
            time.sleep(60)
        return np.full(4, w)


def test_a_submit_that_buries_a_slow_stalled_worker_still_starts_its_replacement(
        tmp_path, monkeypatch):
    """A submit that must make room on a worker (64 tasks in flight) finds it stalled; its
    stacks take longer than ``timeout`` to come.  The replacement's start is given the
    whole ``timeout`` from the end of the burial, not what was left of it before."""
    from unienv_mp._process.handle import WorkerHandle
    real_stacks = WorkerHandle.stacks

    def slow_stacks(self, timeout=2.0):
        time.sleep(3.5)
        return real_stacks(self, timeout)
    monkeypatch.setattr(WorkerHandle, "stacks", slow_stacks)
    flag = tmp_path / "stall"
    with MultiProcessingSampleManager(StuckOnceAtZero(str(flag)), n_workers=1, ctx="fork",
                                      timeout=3.0, stall_timeout=0.3) as mgr:
        assert (mgr.result(mgr.submit(5)) == 5).all()
        flag.write_text("")
        tickets = [mgr.submit(i) for i in range(64)]
        with pytest.warns(RuntimeWarning, match="was on one task"):
            tickets.append(mgr.submit(64))   # (makes room: the stall is found here)
        values = [mgr.result(t) for t in tickets]
    assert [int(v[0]) for v in values] == list(range(65))
    assert all((v == i).all() for i, v in enumerate(values))


def test_a_ctrl_c_while_a_stalled_worker_is_killed_leaves_the_sampler_working():
    """respawn=False: "that call raises WorkerStalledError at the first stall, and the next
    call works (with a new worker)".  A Ctrl-C right after the SIGKILL (as the manager
    waits for the exit status) must not turn the stall into a death that respawn=False
    never recovers from."""
    from test_stats import StuckOnFifth
    from unienv_mp import WorkerDiedError
    from unienv_mp._process.handle import WorkerHandle
    rb = replay_buffer(100)
    with MultiprocessingSampler(StuckOnFifth(rb, 4, seed=0), n_workers=1, n_buffers=2,
                                ctx="fork", batches_per_task=1, stall_timeout=0.5,
                                respawn=False) as m:
        for _ in range(4):
            m.sample()
        killed = line_of(WorkerHandle.end, "code = None if proc is None")
        with interrupt_at(WorkerHandle.end, killed) as i:
            assert interrupted(m.sample)
        assert i.fired
        worker = m._pools.sample._lanes[0].worker
        assert wait_until(worker.has_exited)       # (SIGKILL takes a moment)
        outcomes = []
        for _ in range(3):
            try:
                m.sample()
                outcomes.append("ok")
            except WorkerStalledError:
                outcomes.append("stalled")
            except WorkerDiedError:
                outcomes.append("died")
    assert "died" not in outcomes and outcomes[-1] == "ok", outcomes


class Sticky:
    """A leaf whose destructor hangs in a worker, for the ``n``-th batch."""

    def __init__(self, n, parent):
        self.n = n
        self.parent = parent

    def __del__(self):
        if self.n == 3 and os.getpid() != self.parent:
            time.sleep(60)


class StickyBatches(StepSampler):
    """Each batch carries a Sticky: the worker hangs as it drops its 3rd batch, after
    publishing it."""

    def __init__(self, data, batch_size, seed=None):
        super().__init__(data, batch_size, seed=seed)
        self.count = 0
        self.parent = os.getpid()

    def sample(self):
        self.count += 1
        batch = super().sample()
        batch["tag"] = Sticky(self.count, self.parent)
        return batch


def test_a_worker_that_hangs_after_publishing_a_result_is_found_stalled():
    """The worker counts its task as done (TASK_SINCE = 0) before it drops the task's
    work and value: a worker that hangs there (a destructor) is on no task, so
    stall_timeout never fires, and the tasks queued behind wait for ever (here, until
    ``timeout``)."""
    rb = replay_buffer(100)
    with MultiprocessingSampler(StickyBatches(rb, 4, seed=0), n_workers=1, n_buffers=1,
                                ctx="fork", batches_per_task=1, direct_gather=False,
                                stall_timeout=0.5, timeout=8) as m:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for _ in range(6):
                batch = m.sample()
                assert batch["state"].shape == (4, 10)


class SleepOnBig:
    """Sleeps a minute on work of more than 1000 items (which travels in a spill
    segment), returns the length of any other."""

    def __call__(self, work):
        if len(work) > 1000:
            time.sleep(60)
        return len(work)


def test_a_task_given_up_after_a_stall_releases_its_spill_segment():
    """Work info over TASK_INLINE travels in a one-off segment, closed when the task's
    result arrives (_accept) or the task is dropped.  A stalled task given up gets its
    WorkerStalledError as its result: its segment must go too, not stay until close()."""
    import numpy as np
    from unienv_mp._process.manager import MultiProcessingSampleManager as Manager
    with Manager(SleepOnBig(), n_workers=1, ctx="fork", stall_timeout=0.3,
                 respawn=False) as mgr:
        t = mgr.submit(np.zeros(2000, dtype=np.int64))     # 16 KiB: a spill segment
        assert len(mgr._resources.spills) == 1
        with pytest.raises(WorkerStalledError):
            mgr.result(t)
        assert mgr.result(mgr.submit(np.zeros(10))) == 10  # (the replacement works)
        assert mgr._resources.spills == [], "the spill segment is kept until close()"


# -- the counters: what they must not count ----------------------------------------------

class SlowToFail(StepSampler):
    """Every other batch takes 0.1 s and then raises; the others take no time."""

    def __init__(self, data, batch_size, seed=None):
        super().__init__(data, batch_size, seed=seed)
        self.count = 0

    def get_at(self, idx):
        self.count += 1
        if self.count % 2 == 0:
            time.sleep(0.1)
            raise KeyError("no such row")
        return super().get_at(idx)


def test_the_mean_time_per_batch_counts_only_the_batches_made():
    """seconds_per_batch_mean is "a task's time over its batches", as the histogram's
    p99 is: the time of tasks that raised (which made no batch) must not be spread over
    the batches of the others (the mean then exceeds every batch's time)."""
    rb = replay_buffer(100)
    with MultiprocessingSampler(SlowToFail(rb, 4, seed=0), n_workers=1, n_buffers=1,
                                ctx="fork", batches_per_task=1, direct_gather=False) as m:
        for _ in range(10):
            try:
                m.sample()
            except WorkerError:
                pass
        assert wait_until(lambda: m.stats().workers[0].errors >= 5)
        w = m.stats().workers[0]
    assert w.batches >= 5
    assert w.seconds_per_batch_mean <= w.seconds_per_batch_p99 * 1.25, w


def test_a_replacement_that_has_not_started_yet_adds_no_time_alive():
    """Between a replacement's start() and its first instructions (seconds under spawn),
    its counter block is all zeros: STARTED = 0.  The worker's time alive must not count
    the whole time since the reset again (busy_fraction halves), nor its CPU fraction
    take the time since boot."""
    from unienv_mp import stats as S
    s = 10 ** 9
    record = S.WorkerRecord(1 * s)                  # the lane made at t = 1 s
    first = [0] * S.COUNTERS
    first[S.STARTED], first[S.TASKS], first[S.BATCHES], first[S.BUSY] = 1 * s, 10, 10, 9 * s
    record.process_ended(first, 11 * s)             # busy 9 of its 10 s, then died
    fresh = [0] * S.COUNTERS                        # the replacement, not started yet
    w = record.report(0, 1234, fresh, 11 * s + s // 2, cpu_seconds=0.0)
    assert w.busy_fraction >= 0.8, w                # 9 s busy of 10.5 s
    assert w.cpu_fraction is None or w.cpu_fraction == 0.0


def test_a_worker_just_started_under_spawn_has_no_cpu_fraction_yet():
    """The same with a real process: under spawn a worker's STARTED stays 0 for as long
    as the new interpreter takes to start; its cpu_fraction is then unknown (None), not
    its CPU time over the time since boot."""
    from unienv_mp import stats as S
    from unienv_mp._process.manager import MultiProcessingSampleManager as Manager
    from test_stats import Echo
    with Manager(Echo(), n_workers=1, ctx="spawn") as mgr:
        started = mgr._lanes[0].worker.counters()[S.STARTED]
        w = mgr.stats().workers[0]
        assert wait_until(lambda: mgr._lanes[0].worker.counters()[S.STARTED] != 0, 30)
    assert started == 0
    assert w.cpu_fraction is None, w
