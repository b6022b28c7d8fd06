"""The backend contract (unienv_mp.backend.Manager), run against the process manager, the
Ray manager and an in-process fake built on the same shared parts: ordering, cancel,
timeouts, errors, the respawn budget, worker indices and close; and a Ctrl-C at every
bytecode of the Ray manager's cancel."""
import os
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from types import SimpleNamespace

import pytest

import _data
from _data import GoneOnSeed, indices_of, replay_buffer
from unienv_mp import MultiProcessingSampleManager, WorkerDiedError, WorkerError
from unienv_mp import stats as _stats
from unienv_mp.backend import Dealer, Manager, TicketTable, no_result, none_pending, respawn_refusal
from unienv_mp._sampling.target import SamplerTarget
from unienv_mp._validate import check_index
from unienv_mp.errors import error_payload

try:
    import ray
except ImportError:   # the process manager and the fake are checked without it
    ray = None
NO_RAY = pytest.mark.skipif(ray is None, reason="Ray is not installed: pip install -e "
                                                "'.[ray]' (CI installs it)")

TESTS = os.path.dirname(os.path.abspath(__file__))


class FakeManager:
    """The contract in process, on the shared parts: each worker a thread, a death the
    sampler raising WorkerGone."""

    def __init__(self, target, n_workers, in_order=True, timeout=None, respawn=True,
                 max_respawns=3):
        self.closed, self.in_order, self.timeout = False, in_order, timeout
        self.respawn, self.max_respawns = respawn, max_respawns
        self._tasks, self._dealer, blob = TicketTable(), Dealer(), pickle.dumps(target)
        self._lanes = [SimpleNamespace(index=i, pool=ThreadPoolExecutor(1), deaths=0,
                                       target=pickle.loads(blob), inflight=[])
                       for i in range(n_workers)]

    n_workers = property(lambda self: len(self._lanes))

    def _open(self):
        if self.closed:
            raise RuntimeError("this FakeManager is closed")

    def submit(self, work, worker=None, *, record=None):
        self._open()
        lane = (self._lanes[check_index(worker, "worker", self.n_workers)] if worker is not None
                else self._dealer.pick(self._lanes, self.in_order, lambda x: len(x.inflight)))
        task = SimpleNamespace(work=work, lane=lane, cancelled=False,
                               future=lane.pool.submit(lane.target, work))
        ticket = self._tasks.issue(task)
        lane.inflight.append(ticket)
        if record is not None:
            record.append(ticket)
        return ticket

    def result(self, ticket, timeout=None):
        self._open()
        task, limit = self._tasks.pending(ticket), self.timeout if timeout is None else timeout
        lane = task.lane
        while True:
            if task.future is None:   # (given up: the next call starts afresh)
                task.future = lane.pool.submit(lane.target, task.work)
            try:
                value = task.future.result(limit)
            except FutureTimeout:
                raise no_result(limit) from None
            except _data.WorkerGone:
                lane.deaths += 1
                verdict = respawn_refusal(self.respawn, lane.deaths, self.max_respawns)
                task.future = None   # (a replacement takes it, now or on the next call)
                if verdict is not None:
                    lane.deaths = 0
                    raise WorkerDiedError(f"worker {lane.index} died; {verdict}") from None
                continue
            except Exception as e:
                self.cancel(ticket)
                raise WorkerError.from_payload(error_payload(e), lane.index) from None
            lane.deaths = 0
            self.cancel(ticket)
            return value

    def ready(self, ticket):
        self._open()
        future = self._tasks.pending(ticket).future
        return future is not None and future.done()

    def wait_any(self, tickets, timeout=None):
        self._open()
        pending = [t for t in tickets if t in self._tasks]
        if not pending:
            raise none_pending(tickets)
        limit = self.timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        while deadline is None or time.monotonic() < deadline:
            for t in pending:
                if self._tasks[t].future is not None and self._tasks[t].future.done():
                    return t
            time.sleep(0.001)
        raise no_result(limit)

    def cancel(self, ticket):
        task = self._tasks.get(ticket)
        if task is not None:
            task.cancelled = True
            task.lane.inflight.remove(ticket)   # (out of flight first)
            del self._tasks[ticket]

    def reset_order(self):
        self._dealer.reset()

    def stats(self, reset=False):
        return _stats.CallerRecord().report(0, [], time.monotonic_ns())

    def close(self):
        self.closed = True
        for lane in self._lanes:
            lane.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": TESTS}})
    yield
    ray.shutdown()


@pytest.fixture(params=["process", pytest.param("ray", marks=NO_RAY), "fake"])
def make(request):
    made = []
    if request.param == "ray":
        request.getfixturevalue("local_ray")

    def make(sampler, **options):
        target = SamplerTarget(sampler)
        if request.param == "process":
            m = MultiProcessingSampleManager(target, n_workers=2, ctx="fork", doze_time=0.01,
                                             **options)
        elif request.param == "ray":
            from unienv_mp.ray.manager import RayManager
            m = RayManager(2, target=target, num_cpus_per_worker=0, **options)
        else:
            m = FakeManager(target, 2, **options)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def _sampler(**options):
    return GoneOnSeed(replay_buffer(100), 4, seed=0, **options)


def _rows(value):
    return [indices_of(batch) for batch in value]


def _expected(work, **options):
    return _rows(SamplerTarget(_sampler(**options))(work))


def test_it_is_a_manager(make):
    m = make(_sampler())
    assert isinstance(m, Manager) and not m.closed and m.n_workers == 2


def test_results_by_ticket_in_any_order(make):
    m = make(_sampler())
    works = [("sample", seed, 2) for seed in range(6)]
    record = []
    tickets = [m.submit(w, record=record) for w in works]
    assert tickets == record == sorted(set(tickets))
    got = {t: _rows(m.result(t, timeout=30)) for t in reversed(tickets)}
    assert [got[t] for t in tickets] == [_expected(w) for w in works]


def test_wait_any_and_ready(make):
    m = make(_sampler())
    tickets = [m.submit(("sample", seed, 1)) for seed in range(3)]
    t = m.wait_any(tickets, timeout=30)
    assert t in tickets and m.ready(t)
    assert _rows(m.result(t)) == _expected(("sample", tickets.index(t), 1))
    for t in tickets:
        if t in m._tasks:
            m.result(t, timeout=30)


def test_cancel(make):
    m = make(_sampler())
    tickets = [m.submit(("sample", seed, 1)) for seed in range(3)]
    m.cancel(tickets[1])
    m.cancel(tickets[1])      # (again: nothing)
    m.cancel(10 ** 6)         # (unknown: nothing)
    with pytest.raises(KeyError, match="unknown, cancelled or already collected ticket"):
        m.result(tickets[1])
    with pytest.raises(KeyError, match="none of the tickets"):
        m.wait_any([tickets[1]])
    assert _rows(m.result(tickets[2], timeout=30)) == _expected(("sample", 2, 1))
    assert _rows(m.result(tickets[0], timeout=30)) == _expected(("sample", 0, 1))
    with pytest.raises(KeyError, match="already collected"):
        m.result(tickets[0])


def test_a_timeout_leaves_the_result_to_collect(make):
    m = make(_data.SlowSampler(replay_buffer(100), 4, seed=0, delay=0.5))
    t = m.submit(("sample", 0, 1))
    with pytest.raises(TimeoutError, match="no result"):
        m.result(t, timeout=0.05)
    assert len(m.result(t, timeout=30)) == 1


def test_an_error_in_the_work_comes_back_and_the_worker_goes_on(make):
    m = make(_sampler(bad_seed=1))
    tickets = [m.submit(("sample", seed, 1), worker=0) for seed in range(3)]
    assert _rows(m.result(tickets[0], timeout=30)) == _expected(("sample", 0, 1))
    with pytest.raises(WorkerError, match="bad seed 1") as info:
        m.result(tickets[1], timeout=30)
    assert info.value.exc_type == "builtins.ValueError" and info.value.worker == 0
    assert _rows(m.result(tickets[2], timeout=30)) == _expected(("sample", 2, 1))


@pytest.mark.parametrize("respawn", [True, False])
def test_the_respawn_budget_and_the_call_after_it(make, tmp_path, respawn):
    marker = tmp_path / "die"
    marker.write_text("")
    m = make(_sampler(marker=str(marker)), respawn=respawn, max_respawns=1)
    t = m.submit(("sample", 3, 1), worker=1)
    text = "respawn=False" if not respawn else "died 2 times in a row .* giving up"
    with pytest.raises(WorkerDiedError, match=text):
        m.result(t, timeout=60)
    marker.unlink()
    # a fresh worker, the work kept: the next call has the result
    assert _rows(m.result(t, timeout=60)) == _expected(("sample", 3, 1))


def test_worker_indices_are_checked_and_the_deal_starts_again(make):
    m = make(_sampler())
    for bad in (2, -1, "0", 1.5):
        with pytest.raises(ValueError, match="worker must be an index below 2"):
            m.submit(("sample", 0, 1), worker=bad)
    first = [m.submit(("sample", seed, 1)) for seed in range(3)]
    m.reset_order()
    again = m.submit(("sample", 9, 1))
    for t in first + [again]:
        m.result(t, timeout=30)


def test_close(make):
    m = make(_sampler())
    t = m.submit(("sample", 0, 1))
    m.close()
    m.close()
    assert m.closed
    with pytest.raises(RuntimeError, match="closed"):
        m.submit(("sample", 0, 1))
    for call in (lambda: m.result(t), lambda: m.ready(t), lambda: m.wait_any([t])):
        with pytest.raises(RuntimeError, match="closed"):
            call()


# -- a Ctrl-C in the Ray manager's cancel -------------------------------------------------

@NO_RAY
def test_a_ctrl_c_anywhere_in_cancel_leaves_no_ticket_in_flight_without_its_task(
        local_ray):
    from test_interrupts import Interrupter, interrupt_everywhere
    from unienv_mp.ray.manager import RayManager
    from unienv_mp import backend as _backend
    from unienv_mp.ray import manager as ray_manager

    m = RayManager(2, target=SamplerTarget(_sampler()), num_cpus_per_worker=0)
    try:
        tickets = []

        def submit():
            tickets[:] = [m.submit(("sample", seed, 1)) for seed in range(3)]

        def round_():   # (only the cancel runs traced: Ray's own code is slow to trace)
            m.cancel(tickets[1])

        def recover():
            m.cancel(tickets[1])   # (the cancel cut short, done again)
            for lane in m._lanes:
                for ticket in lane.inflight:
                    assert ticket in m._tasks, f"ticket {ticket} in flight without its task"
            for t in (tickets[0], tickets[2]):
                m.result(t, timeout=60)
            submit()

        submit()

        interrupter = Interrupter({ray_manager.__file__, _backend.__file__},
                                  within=("cancel",))
        assert interrupt_everywhere(interrupter, round_, recover) > 5
        # and a replacement finds every task it is sent
        ray.kill(m._lanes[0].actor, no_restart=True)
        t = m.submit(("sample", 5, 1), worker=0)
        assert _rows(m.result(t, timeout=60)) == _expected(("sample", 5, 1))
    finally:
        m.close()


@NO_RAY
@pytest.mark.parametrize("stand_ins", [False, True])
def test_a_ctrl_c_anywhere_in_the_ray_managers_calls_and_slots_loses_and_overwrites_nothing(
        local_ray, stand_ins):
    from test_interrupts import Interrupter, interrupt_everywhere
    from unienv_mp.ray import _batch, _calls
    from unienv_mp.ray import manager as ray_manager
    from unienv_mp.ray.manager import RayManager

    if stand_ins:
        # 3 actors of a CPU on 2 CPUs: one never starts, and every task dealt to it
        # (round-robin: the deal that skips it is turned off) moves to one that has
        with pytest.warns(RuntimeWarning, match="do not fit"):
            m = RayManager(3, target=SamplerTarget(_sampler()), num_cpus_per_worker=1,
                           group=2)
        m._dealer.up = None
    else:
        m = RayManager(2, target=SamplerTarget(_sampler()), num_cpus_per_worker=0, group=2)
    held = []   # (batch, its rows when it arrived): a slot written again would change it
    seeds = iter(range(10 ** 6))
    try:
        pending, work_of = [], {}

        def round_():
            if not pending:
                for _ in range(3):
                    work = ("sample", next(seeds), 1)
                    work_of[m.submit(work, record=pending)] = work
            while pending:
                value = m.result(pending[0], timeout=60)
                held.append((value, _expected(work_of[pending[0]])))
                del pending[0]

        def recover():
            for ticket in pending:
                m.cancel(ticket)   # (as the sampler does after an interruption)
            pending.clear()
            for lane in m._lanes:   # (every ticket issued was recorded, and is gone now)
                assert not lane.inflight and not lane.outbox, (lane.inflight, lane.outbox)
            for value, rows in held[-40:]:
                assert _rows(value) == rows   # (no slot given to two tasks)
            del held[:-40]   # (the older ones go: their slots come back)

        round_()   # (actors started, slots mapped)
        files = {ray_manager.__file__, _calls.__file__, _batch.__file__}
        interrupter = Interrupter(files, within=("submit", "result"))
        assert interrupt_everywhere(interrupter, round_, recover) > 20
        del held[:]
        for lane in m._lanes:   # (no slot number lost: a lost one holds a segment for good)
            if not lane.up:
                continue   # (its slots are the moved tasks', whose calls never run)
            lane.slots.take()   # (the leases given back since: free again)
            # every slot number is free, held by a cancelled task whose call may still
            # run, or the one just taken
            assert lane.slots.leases == 0 and lane.slots.next == (
                len(lane.slots.free) + len(lane.cancelled) + 1), (
                lane.slots.next, len(lane.slots.free), len(lane.cancelled))
            assert stand_ins or lane.slots.next <= 40, lane.slots.next
        if stand_ins:   # (a third of the tasks were dealt to the one that never started)
            assert sorted(lane.up for lane in m._lanes) == [False, True, True]
    finally:
        m.close()


# -- a new backend, as unienv_mp.backend's docstring says -------------------------------

def test_a_sampler_on_a_new_backend_gives_the_process_samplers_stream_and_epochs():
    """SamplerBase with only new_manager() overridden, on the in-process fake: the same
    batches, epochs and states as MultiprocessingSampler for the same seed."""
    import copy
    from unienv_data.samplers import StepSampler
    from unienv_mp import MultiprocessingSampler
    from unienv_mp.sampler import SamplerBase
    from unienv_mp.sampler import SamplerTarget as Target

    class FakeSampler(SamplerBase):
        def __init__(self, sampler):
            super().__init__(sampler, 2, 4, in_order=True, copy=False, timeout=30,
                             respawn=True, batches_per_task=None,
                             not_direct="the fake backend calls the wrapped sampler")

        def new_manager(self):
            return FakeManager(Target(copy.deepcopy(self.sampler)), self.n_workers)

    rb = replay_buffer(100)
    with FakeSampler(StepSampler(rb, 4, seed=3)) as fake, MultiprocessingSampler(
            StepSampler(rb, 4, seed=3), n_workers=2, ctx="fork") as real:
        for source in (fake, real):
            source.batches = [indices_of(source.sample()) for _ in range(5)]
            source.epochs = [[indices_of(b) for b in source.epoch_iter()] for _ in range(2)]
            source.state = source.state_dict()
            source.after = [indices_of(source.sample()) for _ in range(3)]
        assert fake.batches == real.batches and fake.epochs == real.epochs
        assert sorted(i for b in fake.epochs[0] for i in b) == list(range(100))
        real.load_state_dict(fake.state)   # (a state of one backend loads into the other)
        assert [indices_of(real.sample()) for _ in range(3)] == fake.after == real.after
