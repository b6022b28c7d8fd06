"""A Ctrl-C can land between any two bytecodes of the manager and the sampler, which run as
plain Python: whatever it cuts short, no result is lost, no ticket is left behind, no slot
is used by two results at once, and the manager and sampler go on working.

The interrupter delivers a real SIGINT before the n-th bytecode executed in the package's
modules, for every n of a round of work in turn.  CPython 3.11 and later act on a signal
only at some bytecodes (after a call returns, at a loop's backward jump, on entering a
function); 3.10 at nearly all.  This tries every bytecode but those where no version
delivers one: the NOP where a ``try`` block begins, the first bytecode of an exception
handler (where the exception table sends an exception) and the POP_EXCEPT that leaves an
``except`` block (raised there from a trace function, an exception would leave the one
being handled in place for good).  A step that holds SIGINT back
(``_os.interrupts_deferred``) holds these back too.
"""
import collections
import dis
import gc
import inspect
import os
import signal
import sys
import time

import numpy as np
import pytest

import unienv_mp
import torch
from conftest import wait_until

import _data
from unienv_data.samplers import StepSampler

from unienv_mp import MultiprocessingSampler
from unienv_mp import backend as _backend, _os
from unienv_mp._sampling import epochs as _epochs, pools as _pools, ahead as _ahead
from unienv_mp._process import polling as _polling, ledger as _ledger, deaths as _deaths, pool as _supervision, unienv_queue as _unienv_queue, encoder as _work_encoder, handle as _worker_handle, manager as M, launch as _launch, snapshot as _snapshot
from unienv_mp._sampling.epochs import Epochs
from unienv_mp._sampling.streams import Stream

_NEVER_INTERRUPTED = {dis.opmap[name] for name in ("NOP", "PUSH_EXC_INFO", "POP_EXCEPT")}
_handlers = {}   # code object -> offsets where its exception handlers start


def never_interrupted(code, offset):
    """True at a bytecode where no Python version acts on a signal (see above)."""
    if code.co_code[offset] in _NEVER_INTERRUPTED:
        return True
    targets = _handlers.get(code)
    if targets is None:
        entries = getattr(dis.Bytecode(code), "exception_entries", ())   # (3.11+)
        targets = _handlers[code] = {e.target for e in entries}
    return offset in targets
PACKAGE_FILES = {M.__file__, _supervision.__file__, _ledger.__file__, _polling.__file__,
                 _unienv_queue.__file__, _worker_handle.__file__, _work_encoder.__file__,
                 _os.__file__, _backend.__file__, _deaths.__file__, _launch.__file__,
                 _snapshot.__file__}


class Interrupter:
    """``arm(n)``: send this process a SIGINT just before the n-th bytecode that runs in
    ``files`` from now on (1: the first), counting only in calls of the functions named in
    ``within`` (and what they call) if it is given.  ``fired`` says whether it came to
    that."""

    def __init__(self, files, within=None):
        self.files = set(files)
        self.within = None if within is None else set(within)
        self.left = 0
        self.fired = False
        self.pid = os.getpid()

    def arm(self, n):
        self.left = n
        self.fired = False
        sys.settrace(self._call)

    def disarm(self):
        sys.settrace(None)

    def _call(self, frame, event, arg):
        if os.getpid() != self.pid:   # a forked child inherits the trace function
            sys.settrace(None)
            return None
        if frame.f_code.co_filename not in self.files:
            return None
        if self.within is not None:
            f = frame
            while f is not None and f.f_code.co_name not in self.within:
                f = f.f_back
            if f is None:
                return None
        frame.f_trace_lines = False
        frame.f_trace_opcodes = True
        return self._opcode

    def _opcode(self, frame, event, arg):
        if (event == "opcode" and self.left > 0
                and not never_interrupted(frame.f_code, frame.f_lasti)):
            self.left -= 1
            if self.left == 0:
                self.fired = True
                sys.settrace(None)
                signal.raise_signal(signal.SIGINT)   # KeyboardInterrupt, unless held back
        return self._opcode


class Fill:
    """Work ``w`` -> 2048 int64 equal to ``w`` (16 KiB: the result travels in a slot)."""

    def __call__(self, w):
        return np.full(2048, w, dtype=np.int64)


class Caller:
    """Uses a manager as the sampler does (tickets recorded through ``record``, a result
    taken off the list once delivered or dropped), and checks every result it gets."""

    def __init__(self, mgr):
        self.mgr = mgr
        self.tickets = collections.deque()
        self.work_of = {}
        self.next_work = 0
        self.held = collections.deque(maxlen=6)   # zero-copy results kept a while
        self.delivered = set()

    def submit(self):
        self.next_work += 1
        before = len(self.tickets)
        try:
            self.mgr.submit(self.next_work, record=self.tickets)
        finally:
            if len(self.tickets) > before:
                self.work_of[self.tickets[-1]] = self.next_work

    def collect(self):
        t = self.tickets[0]
        try:
            value = self.mgr.result(t, timeout=20)
        except BaseException:
            self.mgr.cancel(t)
            self.tickets.remove(t)
            raise
        self.tickets.remove(t)
        w = self.work_of.pop(t)
        assert w not in self.delivered
        self.delivered.add(w)
        assert value.shape == (2048,) and (value == w).all(), (
            f"ticket {t} (work {w}) came back as {np.unique(value)}")
        self.held.append((w, value))

    def check_held(self):
        for w, value in self.held:
            assert (value == w).all(), f"a result kept by the caller changed: {w} -> " \
                                       f"{np.unique(value)}"

    def round(self, n_tasks=3):
        for _ in range(n_tasks):
            self.submit()
        while self.tickets:
            self.collect()

    def recover(self):
        """Collect what is pending (a KeyboardInterrupt here would be the test's own
        failure: the interrupter fires once per run)."""
        while self.tickets:
            self.collect()
        self.check_held()


def check_slots(mgr):
    """No slot number is free twice, or free while a pending task holds it; a ticket in
    flight is pending, unless its result entry, taken off the ring, is still to be
    recorded (a recording cut short: the next one takes it out of flight)."""
    for lane in mgr._lanes:
        w = lane.worker
        free = w.free_slots
        assert len(free) == len(set(free)), f"worker {w.index}: a slot is free twice: {free}"
        taken = {t.slot for t in mgr._tasks.values()
                 if t.worker == w.index and t.slot is not None
                 and t.incarnation == w.incarnation}
        assert not taken & set(free), f"worker {w.index}: slots {taken & set(free)} are " \
                                      f"free and held by a pending task"
        unrecorded = {entry[2] for entry in w._popped}
        for ticket in mgr._ledger.inflight[w.index]:
            assert ticket in mgr._tasks or ticket in unrecorded, (
                f"ticket {ticket} in flight but unknown")


def interrupt_everywhere(interrupter, run_once, recover, limit=20000):
    """Call ``run_once()`` with a SIGINT before its 1st, 2nd, ... bytecode in the package,
    ``recover()`` after each, until a run ends before its bytecode count is reached.
    Returns the number of runs that were interrupted."""
    n = 0
    while True:
        n += 1
        assert n < limit, "the round never ends"
        interrupted = False
        interrupter.arm(n)
        try:
            run_once()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            interrupter.disarm()
        assert interrupted == interrupter.fired, (
            f"run {n}: a KeyboardInterrupt was {'raised' if interrupted else 'lost'}")
        assert sys.exc_info()[1] is None, f"run {n} left {sys.exc_info()[1]!r} being handled"
        recover()
        if not interrupter.fired:
            return n - 1


def test_a_ctrl_c_anywhere_in_submit_and_result_loses_nothing():
    mgr = M.MultiProcessingSampleManager(Fill(), n_workers=2, ctx="fork", max_leases=4)
    try:
        caller = Caller(mgr)
        caller.round()   # workers started, slots mapped

        def recover():
            caller.recover()
            check_slots(mgr)

        runs = interrupt_everywhere(Interrupter(PACKAGE_FILES), caller.round, recover)
        assert runs > 300   # (the round is a few hundred bytecodes long)
        # and afterwards everything works as before, slots reused
        for _ in range(20):
            caller.round()
        caller.check_held()
        check_slots(mgr)
    finally:
        mgr.close()


def test_a_ctrl_c_anywhere_while_a_dead_worker_is_replaced_loses_nothing():
    mgr = M.MultiProcessingSampleManager(Fill(), n_workers=2, ctx="fork", max_leases=4,
                                         max_respawns=10 ** 6)
    try:
        caller = Caller(mgr)
        caller.round()

        def kill_then_round():
            # worker 0 dies with work queued: the round replaces it and redoes that work
            caller.submit()
            caller.submit()
            proc = mgr.workers[0]
            if proc is not None and not _os.has_exited(proc):
                # (not yet replaced after the last run's, whose replacement was cut short)
                _os.send_signal(proc, signal.SIGKILL)
                assert wait_until(lambda: _os.has_exited(proc), interval=0.0005)
            caller.round()

        def recover():
            caller.recover()
            check_slots(mgr)

        # every bytecode of noticing the death and replacing the worker (the rest of the
        # round is the test above)
        interrupter = Interrupter(PACKAGE_FILES, within=("bury", "restart"))
        runs = interrupt_everywhere(interrupter, kill_then_round, recover)
        assert runs > 300
        for _ in range(5):
            caller.round()
        caller.check_held()
        check_slots(mgr)
    finally:
        mgr.close()


def check_batch(batch):
    """The rows of a batch of _data.transitions are whole: each row's image is its index
    (mod 251).  Returns the indices."""
    idx = torch.as_tensor(batch["state"][:, 0]).round().to(torch.int64)
    image = torch.as_tensor(batch["image"])
    assert (image == (idx % 251).to(torch.uint8).view(-1, 1, 1, 1)).all(), "a torn batch"
    return idx.tolist()


@pytest.mark.parametrize("in_order", [True, False])
def test_a_ctrl_c_anywhere_in_sample_loses_nothing(in_order):
    """Each round: manual_seed(0), then 7 batches.  Every batch handed out is the stream's
    batch at some position, each position once a round (in order with ``in_order``): a
    Ctrl-C drops at most the batch of the call it cuts short."""
    from unienv_data.samplers import StepSampler
    from unienv_mp import MultiprocessingSampler
    from unienv_mp._sampling import streams as _streams, sampler as S
    rb = _data.replay_buffer(100)

    def make(in_order):
        return MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=2, n_buffers=4,
                                      ctx="fork", batches_per_task=3, in_order=in_order)

    with make(True) as reference:
        reference.manual_seed(0)
        position = {tuple(check_batch(reference.sample())): j for j in range(60)}
    sampler = make(in_order)
    held = collections.deque(maxlen=8)

    def sample_round():
        sampler.manual_seed(0)
        seen = []
        try:
            for _ in range(7):
                batch = sampler.sample()
                idx = check_batch(batch)
                held.append((batch, idx))
                seen.append(position[tuple(idx)])
        finally:
            assert len(set(seen)) == len(seen), f"a batch came twice: {seen}"
            if in_order:
                assert seen == sorted(seen), f"out of order: {seen}"

    def recover():
        for batch, idx in held:
            assert check_batch(batch) == idx, "a batch kept by the caller changed"
        mgr = sampler._pools.sample
        stream = sampler._streams.get("sample")
        tickets = () if stream is None else stream.tickets
        # what the sampler asked for and no longer holds was cancelled, nothing more
        for ticket, task in mgr._tasks.items():
            assert ticket in tickets or task.cancelled, f"orphan ticket {ticket}"
        if stream is None:
            return
        for ticket in stream.tickets:
            assert ticket in mgr._tasks and not mgr._tasks[ticket].cancelled
            assert ticket in stream.chunk_of
        assert len(stream.ready) + 3 * len(stream.tickets) <= 4 + 3
        check_slots(mgr)

    with sampler:
        sample_round()
        interrupter = Interrupter(PACKAGE_FILES | {S.__file__, _streams.__file__,
                                                   _pools.__file__, _ahead.__file__})
        runs = interrupt_everywhere(interrupter, sample_round, recover)
        assert runs > 300
        for _ in range(3):
            sample_round()
        recover()


@pytest.mark.parametrize("mode", ["copy", "pinned"])
def test_a_ctrl_c_anywhere_in_a_device_sample_loses_nothing(monkeypatch, mode):
    """As above, with batches handed out on a (fake) device, or page-locked for the
    caller's own copies (which it makes and drops at once): the feed, its pins and the
    batches it keeps are interrupted too.  Every batch is the stream's, once, in order; the
    device never reads a slot given back, nor one unregistered; close() leaves nothing
    registered."""
    from _fake_device import FakeOps
    from unienv_mp._sampling import streams as _streams, sampler as S
    from unienv_mp._device import feed, handout, keep, ops as device_ops, pins
    fake = FakeOps(speed=1)
    monkeypatch.setattr(device_ops, "for_device", lambda device: fake)
    monkeypatch.setattr(device_ops, "cuda_unavailable", lambda device: None)
    rb = _data.replay_buffer(100)

    def make(device, pin_memory=False):
        s = StepSampler(rb, 8, seed=0)
        s._device = device
        return MultiprocessingSampler(s, n_workers=1, n_buffers=2, ctx="fork",
                                      batches_per_task=1, pin_memory=pin_memory)

    with make(None) as reference:
        reference.manual_seed(0)
        position = {tuple(check_batch(reference.sample())): j for j in range(60)}
    if mode == "copy":
        sampler = make(torch.device("cuda"))
        get = sampler.sample
    else:
        sampler = make(None, pin_memory=True)

        def get():
            return fake.user_copy(sampler.sample())   # (the CPU batch dropped at once)
    held = collections.deque(maxlen=8)

    def sample_round():
        sampler.manual_seed(0)
        seen = []
        cut = None
        try:
            while len(seen) < 2:
                try:
                    batch = get()
                except KeyboardInterrupt as e:   # (the caller goes on: what is lost?)
                    cut = e
                    continue
                fake.run_all()   # (the caller reads it: its copy has completed)
                idx = check_batch(batch)
                held.append((batch, idx))
                seen.append(position[tuple(idx)])
        finally:
            assert len(set(seen)) == len(seen), f"a batch came twice: {seen}"
            assert seen == sorted(seen), f"out of order: {seen}"
            lost = seen[-1] + 1 - len(seen) if seen else 0
            # at most the batch of the call cut short, as on the CPU (a Ctrl-C between
            # its hand-out from the stream and the device hand-out's first step)
            assert lost <= 1, f"{lost} batches lost: {seen}"
            lost_in.append(lost)
        if cut is not None:
            raise cut

    def recover():
        for batch, idx in held:
            assert check_batch(batch) == idx, "a batch kept by the caller changed"
        assert not fake.violations, fake.violations
        check_slots(sampler._pools.sample)

    lost_in = []

    with sampler:
        sample_round()
        # (the device rooms and the sampler's hand-out; the manager's code under them is
        # interrupted everywhere by the tests above)
        interrupter = Interrupter({S.__file__, _streams.__file__, feed.__file__,
                                   pins.__file__, handout.__file__, keep.__file__,
                                   _pools.__file__, _ahead.__file__})
        runs = interrupt_everywhere(interrupter, sample_round, recover)
        assert runs > 300
        print(f"batches lost per round, of {runs}:", collections.Counter(lost_in))
        sample_round()
        recover()
    fake.run_all()
    assert fake.registered == {} and not fake.violations


# -- a Ctrl-C at one chosen line, then the caller going on as a user would -----------------

def line_of(func, marker, after=0, nth=1):
    """The line number ``after`` lines below the ``nth`` line of ``func`` containing
    ``marker``."""
    lines, start = inspect.getsourcelines(func)
    hits = [i for i, text in enumerate(lines) if marker in text]
    return start + hits[nth - 1] + after


class interrupt_at:
    """Within the block, a real SIGINT just before line ``lineno`` of ``func`` runs for the
    first time (a KeyboardInterrupt there, unless SIGINT is held back); with ``when``, the
    first time it runs while ``when()`` is true."""

    def __init__(self, func, lineno, when=None):
        self.code = func.__code__
        self.lineno = lineno
        self.when = when
        self.fired = False
        self.pid = os.getpid()

    def _call(self, frame, event, arg):
        if os.getpid() != self.pid:
            sys.settrace(None)
            return None
        return self._line if frame.f_code is self.code else None

    def _line(self, frame, event, arg):
        if event == "line" and frame.f_lineno == self.lineno and not self.fired and (
                self.when is None or self.when()):
            self.fired = True
            sys.settrace(None)
            frame.f_trace = None
            signal.raise_signal(signal.SIGINT)
        return self._line

    def __enter__(self):
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        return False


def interrupted(call, *args, **kwargs):
    try:
        call(*args, **kwargs)
    except KeyboardInterrupt:
        return True
    return False


Manager = M.MultiProcessingSampleManager
Deliver = _ledger.WorkLedger.deliver
DELIVERED = line_of(Deliver, "self.delivered(task)", nth=2)


@pytest.mark.parametrize("copy", [False, True])
def test_a_result_asked_for_again_after_a_ctrl_c_in_its_delivery(copy):
    mgr = Manager(Fill(), n_workers=1, ctx="fork", copy=copy)
    try:
        t1 = mgr.submit(1)
        with interrupt_at(Deliver, DELIVERED) as i:
            assert interrupted(mgr.result, t1)
        assert i.fired
        gc.collect()
        t2 = mgr.submit(2)
        assert wait_until(lambda: mgr.ready(t2))
        v1 = mgr.result(t1)                    # asked for again: still there, intact
        assert (v1 == 1).all()
        for w in range(3, 8):                  # slots reused meanwhile
            assert (mgr.result(mgr.submit(w)) == w).all()
        assert (mgr.result(t2) == 2).all()
        assert (v1 == 1).all(), f"the result of work 1 became {np.unique(v1)}"
        check_slots(mgr)
    finally:
        mgr.close()


def _kill_worker(mgr, i):
    proc = mgr.workers[i]
    _os.send_signal(proc, signal.SIGKILL)
    assert wait_until(lambda: _os.has_exited(proc))


Take = _ledger.WorkLedger.take
Accept = _ledger.WorkLedger.accept
RECORDING = [(Take, line_of(Take, "self.accept(w, w.next_result(timeout))")),
             (Take, line_of(Take, "w.result_recorded()")),
             (Accept, line_of(Accept, "w.made_result = True")),
             (Accept, line_of(Accept, "self.arrived(task)", nth=3))]


@pytest.mark.parametrize("func, lineno", RECORDING,
                         ids=[f"{f.__name__}:{n - f.__code__.co_firstlineno}"
                              for f, n in RECORDING])
def test_a_ctrl_c_as_a_replacements_first_result_is_recorded_still_resets_its_deaths(
        func, lineno):
    """max_respawns=1: a worker whose replacement made a result may die once more and be
    replaced again, wherever a Ctrl-C cut the recording of that result short."""
    mgr = Manager(Fill(), n_workers=1, ctx="fork", max_respawns=1)
    try:
        assert (mgr.result(mgr.submit(1)) == 1).all()
        _kill_worker(mgr, 0)
        t = mgr.submit(2)
        handle = mgr._lanes[0].worker   # (the replacement's handle is the same object)
        with interrupt_at(func, lineno, when=lambda: handle.incarnation == 2) as i:
            try:
                value = mgr.result(t)
            except KeyboardInterrupt:
                value = mgr.result(t)   # asked for again
        assert i.fired
        assert (value == 2).all()
        _kill_worker(mgr, 0)   # the replacement made a result, then dies
        assert (mgr.result(mgr.submit(3)) == 3).all()   # replaced, not given up
    finally:
        mgr.close()


def test_a_fetch_again_after_a_ctrl_c_in_its_delivery():
    mgr = Manager(Fill(), n_workers=1, ctx="fork")
    try:
        mgr.add_work(1)
        with interrupt_at(Deliver, DELIVERED) as i:
            assert interrupted(mgr.fetch)
        assert i.fired
        assert mgr.remaining_work == 1
        v1 = mgr.fetch()
        mgr.add_work(2)
        assert (mgr.fetch() == 2).all() and (v1 == 1).all()
        assert mgr.remaining_work == 0
    finally:
        mgr.close()


class Fetcher:
    """Uses add_work/fetch as UniEnv's users do, fetching on after a Ctrl-C: a result cut
    off by it may be missing; none may come twice, out of order (``in_order``), or change
    later."""

    def __init__(self, mgr, in_order):
        self.mgr = mgr
        self.in_order = in_order
        self.next_work = 0
        self.delivered = []
        self.held = collections.deque(maxlen=6)

    def take(self, value):
        w = int(value[0])
        assert value.shape == (2048,) and (value == w).all(), f"a torn result {np.unique(value)}"
        assert w not in self.delivered, f"work {w} came back twice"
        if self.in_order and self.delivered:
            assert w > self.delivered[-1], f"work {w} after {self.delivered[-1]}"
        self.delivered.append(w)
        self.held.append((w, value))

    def round(self, n_tasks=3):
        for _ in range(n_tasks):
            self.next_work += 1
            self.mgr.add_work(self.next_work)
        while self.mgr.remaining_work:
            self.take(self.mgr.fetch(timeout=20))

    def recover(self):
        self.round(0)
        for w, value in self.held:
            assert (value == w).all(), f"a result kept changed: {w} -> {np.unique(value)}"
        check_slots(self.mgr)


@pytest.mark.parametrize("in_order", [True, False])
def test_a_ctrl_c_anywhere_in_add_work_and_fetch_loses_nothing(in_order):
    mgr = Manager(Fill(), n_workers=2, ctx="fork", max_leases=4, in_order=in_order)
    try:
        f = Fetcher(mgr, in_order)
        f.round()
        runs = interrupt_everywhere(Interrupter(PACKAGE_FILES), f.round, f.recover)
        assert runs > 300
    finally:
        mgr.close()


def test_wait_any_on_cancelled_tickets_refuses_to_wait():
    mgr = Manager(Fill(), n_workers=1, ctx="fork")
    try:
        t = mgr.submit(1)
        mgr.cancel(t)
        with pytest.raises(KeyError):          # as result(t) and ready(t) do
            mgr.wait_any([t], timeout=3)
    finally:
        mgr.close()


class Sleep:
    def __call__(self, seconds):
        time.sleep(seconds)
        return seconds


def test_close_cut_short_still_ends_the_workers():
    mgr = Manager(Sleep(), n_workers=1, ctx="fork")
    procs = list(mgr.workers)
    try:
        mgr.submit(3.0)        # the worker is busy for 3 s: close() waits for it
        time.sleep(0.3)
        joining = line_of(_os.stop_processes, '_call(p, "join", max(0.0,')
        with interrupt_at(_os.stop_processes, joining) as i:
            assert interrupted(mgr.close)
        assert i.fired
        assert not [p for p in procs if p.is_alive()], "workers left running"
        mgr.close()            # finishes what the first left: the processes are closed
        for p in procs:
            with pytest.raises(ValueError, match="closed"):
                p.is_alive()
    finally:
        for p in procs:
            try:
                alive = p.is_alive()
            except ValueError:
                continue       # (closed)
            if alive:
                p.kill()
                p.join(5)


def pidfds():
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]":
                out.add(int(fd))
        except OSError:
            pass
    return out


def test_a_ctrl_c_as_a_worker_starts_leaves_no_descriptor():
    before = pidfds()
    kept = line_of(_os.open_pidfd, "setattr(proc, _PIDFD, fd)")
    with interrupt_at(_os.open_pidfd, kept) as i:
        assert interrupted(Manager, Fill(), n_workers=1, ctx="fork")
    assert i.fired
    gc.collect()
    assert pidfds() <= before, f"pidfds left open: {pidfds() - before}"


def _sampler(rows=100, n_workers=2, **kwargs):
    from unienv_data.samplers import StepSampler
    from unienv_mp import MultiprocessingSampler
    rb = _data.replay_buffer(rows, multiprocessing=kwargs.pop("shared", False))
    return MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=n_workers, n_buffers=4,
                                  ctx="fork", batches_per_task=1, **kwargs)


def no_orphans(s):
    """Every task the manager holds is one a stream waits for, or cancelled."""
    mgr = s._pools.sample
    waited = {t for st in s._streams.values() for t in st.tickets}
    orphans = [t for t, task in mgr._tasks.items() if t not in waited and not task.cancelled]
    assert not orphans, f"tasks nobody will collect or cancel: {orphans}"
    stale = [t for t in waited if t not in mgr._tasks or mgr._tasks[t].cancelled]
    assert not stale, f"the streams wait for tickets {stale} of dropped tasks"


@pytest.mark.parametrize("in_order", [True, False])
def test_sampling_goes_on_after_a_ctrl_c_in_manual_seed(in_order):
    from unienv_mp import MultiprocessingSampler as MS
    with _sampler(in_order=in_order, timeout=20) as s:
        s.sample()
        with interrupt_at(MS.manual_seed, line_of(MS.manual_seed, "self._drop_streams()")) as i:
            assert interrupted(s.manual_seed, 1)
        assert i.fired
        for _ in range(6):
            s.sample()
        no_orphans(s)


@pytest.mark.parametrize("in_order", [True, False])
def test_sampling_goes_on_after_ctrl_cs_right_after_results_arrived(in_order):
    from unienv_mp._sampling.streams import Stream
    taken = line_of(Stream.collect, "self.tickets.remove(ticket)", nth=2)
    with _sampler(in_order=in_order, timeout=20) as s:
        s.sample()
        fired = 0
        for _ in range(8):
            with interrupt_at(Stream.collect, taken) as i:
                interrupted(s.sample)
            fired += i.fired
        assert fired
        for _ in range(6):
            s.sample()
        no_orphans(s)


def test_an_epoch_closed_by_a_ctrl_c_leaves_no_task_behind():
    from unienv_mp import MultiprocessingSampler as MS
    with _sampler(shared=True) as s:
        s.sample()
        it = s.epoch_iter()
        next(it)
        with interrupt_at(Epochs.end, line_of(Epochs.end, "manager.cancel(t)")) as i:
            assert interrupted(it.close)
        assert i.fired
        no_orphans(s)


def test_an_epoch_on_kept_workers_closed_by_a_ctrl_c_leaves_no_task_behind():
    """Over unshared data that does not change, epochs run on kept workers: one cut short
    by a Ctrl-C must not leave its tasks on them."""
    from unienv_mp import MultiprocessingSampler as MS
    with _sampler() as s:
        assert len(list(s.epoch_iter())) == 13
        kept = s._pools.kept
        assert kept is not None
        it = s.epoch_iter()
        next(it)
        with interrupt_at(Epochs.end, line_of(Epochs.end, "manager.cancel(t)")) as i:
            assert interrupted(it.close)
        assert i.fired
        orphans = [t for t, task in kept._tasks.items() if not task.cancelled]
        assert not orphans, f"tasks nobody will collect or cancel: {orphans}"
        assert not s._pools.users
        seen = sorted(j for b in s.epoch_iter() for j in _data.indices_of(b))
        assert seen == list(range(100)) and s._pools.kept is kept


@pytest.mark.parametrize("workers", ["sample", "kept", "own"])
def test_a_ctrl_c_anywhere_in_an_epoch_leaves_nothing_held(workers):
    """A Ctrl-C before any bytecode of the epoch code, on each kind of manager an epoch runs
    on (the sample* workers over shared data, workers kept between epochs, an epoch's own):
    the epoch cut short lets go of its manager (no epoch counted on it, none current, none
    of its tickets left, its own manager closed), and the next epoch is whole."""
    options = {"shared": True} if workers == "sample" else {}
    rows = 100
    if workers == "own":
        # (each run starts workers: a shorter epoch, on one)
        options.update(persistent_workers=False, n_workers=1)
        rows = 24
    with _sampler(rows, **options) as s:
        if workers != "kept":
            s.sample()   # (with no sample* workers, unshared data's epochs keep theirs)
        assert len(list(s.epoch_iter())) == -(-rows // 8)

        def epoch_round():
            it = s.epoch_iter()
            try:
                for _ in it:
                    pass
            finally:
                it.close()

        def recover():
            assert not s._pools.users, f"epochs still counted: {dict(s._pools.users)}"
            assert not s._epochs.open
            for mgr in {s._pools.sample, s._pools.kept} - {None}:
                waited = {t for st in s._streams.values() for t in st.tickets}
                orphans = [t for t, task in mgr._tasks.items()
                           if t not in waited and not task.cancelled]
                assert not orphans, f"tasks nobody will collect or cancel: {orphans}"
            seen = sorted(j for b in s.epoch_iter() for j in _data.indices_of(b))
            assert seen == list(range(rows))
            assert not s._pools.own and not s._pools.users

        runs = interrupt_everywhere(
            Interrupter({_epochs.__file__, _pools.__file__, _ahead.__file__}), epoch_round,
            recover)
        assert runs > 250
        assert (s._pools.kept is not None) == (workers == "kept")


def take(m, n, method="sample"):
    fn = getattr(m, method)
    return [_data.indices_of(fn()) for _ in range(n)]


def reference(n, seed=0, **kwargs):
    """The first ``n`` batches of a sampler of 100 rows, batches of 8, one worker."""
    from unienv_data.samplers import StepSampler
    from unienv_mp import MultiprocessingSampler
    rb = _data.replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=seed), n_workers=1, ctx="fork",
                                **kwargs) as m:
        return take(m, n)


def positions(got, expected):
    """Where in the stream each batch handed out lies."""
    return [expected.index(b) if b in expected else None for b in got]


# -- the stream's position and Ctrl-C ----------------------------------------------------


def test_a_ctrl_c_as_a_chunk_arrives_hands_out_no_batch_twice():
    """A Ctrl-C right after ``self.ready.extend(...)`` returns in Stream.arrived (after a
    call is where CPython acts on a signal): ``ready`` holds the chunk's batches but
    ``ready_chunk`` is not set, so reset() asks for the chunk again and its batches are
    handed out twice."""
    marker = "self.ready_chunk = chunk"
    expected = reference(30, batches_per_task=3)
    rb = _data.replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=2, n_buffers=4,
                                ctx="fork", batches_per_task=3, timeout=20) as m:
        got = take(m, 3)                        # chunk 0
        with interrupt_at(Stream.arrived, line_of(Stream.arrived, marker)) as i:
            assert interrupted(m.sample)        # chunk 1 arriving
        assert i.fired
        got += take(m, 9)
    where = positions(got, expected)
    assert where == list(range(12)), f"stream positions handed out: {where}"


def test_a_ctrl_c_as_a_restored_partial_chunk_arrives_hands_out_no_batch_twice():
    """The same, just after the restored position's count of batches to skip was taken
    off (Stream.skip is part of the position)."""
    expected = reference(30, batches_per_task=3)
    rb = _data.replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=2, ctx="fork",
                                batches_per_task=3) as m:
        take(m, 4)
        state = m.state_dict()                  # chunk 1: 1 of 3 handed out
    assert state["streams"]["sample"]["partial"] == {1: 1}
    with MultiprocessingSampler(StepSampler(rb, 8, seed=5), n_workers=2, n_buffers=4,
                                ctx="fork", batches_per_task=3, timeout=20) as m:
        m.load_state_dict(state)
        extending = line_of(Stream.arrived, "self.ready.extend(")
        with interrupt_at(Stream.arrived, extending) as i:
            assert interrupted(m.sample)
        assert i.fired
        got = take(m, 8)
    where = positions(got, expected)
    assert where == list(range(4, 12)), f"stream positions handed out: {where}"


def test_a_ctrl_c_as_low_moves_up_keeps_the_position():
    """Out of order (in_order=False), handing out the lowest chunk moves ``low`` past the
    chunks in ``done``.  A Ctrl-C in that loop (right after ``done.discard`` returns) must
    not lose them: _sample then calls reset(), which asks again for every chunk the
    position does not hold, so they would be handed out twice."""
    s = Stream("sample", 2, 0)
    tickets = iter(range(100))
    s.top_up(lambda work, record: record.append(next(tickets)), 6)   # chunks 0..3
    assert list(s.tickets) == [0, 1, 2, 3]
    for t in (1, 2, 0):                     # chunk 0 arrives last
        s.tickets.remove(t)
        s.arrived(t, ("a", "b"))
        s.ready.popleft(), s.ready.popleft()
    assert (s.low, s.done, s.ready_chunk, len(s.ready)) == (0, {1, 2}, 0, 0)
    s.tickets.remove(3)
    with interrupt_at(Stream._handed_out, line_of(Stream._handed_out, "low += 1")) as i:
        try:
            s.arrived(3, ("a", "b"))        # chunk 0 joins the handed-out ones
        except KeyboardInterrupt:
            pass
    assert i.fired
    s.reset()                               # (as _sample does after a KeyboardInterrupt)
    assert s.position()["low"] >= 3 and 0 not in s.retry and 1 not in s.retry, (
        s.position(), s.retry)


def test_a_ctrl_c_while_sample_cleans_up_after_a_timeout_leaves_no_cancelled_ticket():
    """sample() timed out; as it cancels what it requested, a Ctrl-C comes (before
    Stream.reset).  The stream still holds the cancelled tickets: the next sample()
    asks the manager for one and raises KeyError."""
    from test_reproducible import _SlowOnce
    rb = _data.replay_buffer(100)
    with MultiprocessingSampler(_SlowOnce(rb, 4, seed=3), n_workers=1, n_buffers=1,
                                ctx="fork", batches_per_task=1, timeout=0.5,
                                direct_gather=False) as m:
        take(m, 3)
        from unienv_mp._sampling.streams import forget_requests
        cleanup = line_of(forget_requests, "stream.reset()")
        with interrupt_at(forget_requests, cleanup) as i:
            with pytest.raises(KeyboardInterrupt):
                m.sample()                  # the 4th batch takes 2 s: a timeout first
        assert i.fired
        time.sleep(2)
        m.sample()                          # KeyError: unknown, cancelled ... ticket


def test_a_ctrl_c_anywhere_in_sample_drops_at_most_the_batch_it_was_handing_out():
    """A SIGINT before every bytecode of one sample() call in turn, the calls going on
    along the stream: a call cut short drops at most the batch it was handing out (the
    next call hands out that batch or the one after it), and never hands one out twice."""
    from test_interrupts import Interrupter
    from unienv_mp._sampling import streams as _streams, sampler as S
    expected = reference(2000, batches_per_task=4)
    rb = _data.replay_buffer(100)
    moved = []
    with MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=2, n_buffers=4,
                                ctx="fork", batches_per_task=4, timeout=20) as m:
        j = len(take(m, 1))
        interrupter = Interrupter({S.__file__, _streams.__file__, _pools.__file__,
                                   _ahead.__file__}, within=("_sample",))
        n = 0
        while j < 1900:
            n += 1
            interrupter.arm(n)
            try:
                batch = _data.indices_of(m.sample())
                cut = False
            except KeyboardInterrupt:
                cut = True
            finally:
                interrupter.disarm()
            if not cut:
                assert batch == expected[j]
                j += 1
                if not interrupter.fired:
                    break              # the call is shorter than n bytecodes: all tried
                continue
            nxt = _data.indices_of(m.sample())
            if nxt != expected[j]:
                moved.append((n, positions([nxt], expected)[0] - j))
                j = expected.index(nxt)
            j += 1
    assert moved and all(skipped == 1 for _, skipped in moved), (
        f"(bytecode, batches skipped (+) or repeated (-)): {moved}")


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("restored", [False, True])
def test_a_ctrl_c_before_any_bytecode_of_the_stream_keeps_its_position(in_order, restored):
    """Stream alone, driven as _sample drives it (a KeyboardInterrupt: reset()), with a
    SIGINT before its 1st, 2nd, ... bytecode in turn: every batch is handed out at most
    once, and what was handed out is what position() says."""
    import random
    from test_interrupts import Interrupter
    from unienv_mp._sampling import streams as _streams
    from unienv_mp._sampling.streams import stream_key
    k, n_buffers = 3, 4
    key = stream_key(0, "sample")
    start = {"k": k, "low": 0, "done": [], "partial": {0: 1}} if restored else None
    before = {(0, 0)} if restored else set()

    def run(interrupter, n):
        s = Stream.from_position("sample", 0, start) if restored else Stream("sample", k, 0)
        results = {}
        counter = iter(range(10 ** 6))
        rng = random.Random(n)

        def submit(work, record):
            t = next(counter)
            _, work_key, first, work_k = work   # (see chunk_work)
            assert work_key == key and work_k == k and first % k == 0
            results[t] = tuple((first // k, i) for i in range(k))
            record.append(t)

        def one():
            ready, tickets = s.ready, s.tickets
            if ready and len(ready) + k * len(tickets) > n_buffers:
                return ready.popleft()
            s.top_up(submit, n_buffers)
            if ready:
                return ready.popleft()
            t = tickets[0] if in_order else rng.choice(list(tickets))
            tickets.remove(t)
            s.arrived(t, results[t])
            return ready.popleft()

        handed = []
        interrupter.arm(n)
        try:
            while len(handed) < 20:
                try:
                    handed.append(one())
                except KeyboardInterrupt:
                    s.reset()
        finally:
            interrupter.disarm()
        return s, handed

    interrupter = Interrupter({_streams.__file__})
    n = 0
    while True:
        n += 1
        s, handed = run(interrupter, n)
        assert len(set(handed)) == len(handed), f"bytecode {n}: a batch came twice: {handed}"
        pos = s.position()
        held = {(c, i) for c in range(pos["low"]) for i in range(k)}
        held |= {(c, i) for c in pos["done"] for i in range(k)}
        held |= {(c, i) for c, m in pos["partial"].items() for i in range(m)}
        assert held == set(handed) | before, (
            f"bytecode {n}: handed out {sorted(set(handed) | before)}, position {pos}")
        if not interrupter.fired:
            break
    assert n > 100


# -- which code is interrupted at every bytecode --------------------------------------------

#: The package's modules whose code the tests here (and tests/test_backend_contract.py, for
#: the Ray manager) interrupt at every bytecode.
ROOT = os.path.dirname(unienv_mp.__file__)
INTERRUPTED = {os.path.relpath(f, ROOT) for f in PACKAGE_FILES} | {
    os.path.join("_sampling", "sampler.py"), os.path.join("_sampling", "streams.py"), os.path.join("_sampling", "epochs.py"), os.path.join("ray", "manager.py"),
    os.path.join("_sampling", "pools.py"), os.path.join("_sampling", "ahead.py"),
    os.path.join("_device", "feed.py"), os.path.join("_device", "pins.py"),
    os.path.join("_device", "handout.py"), os.path.join("_device", "keep.py")}

#: Every other module of the package, and why a Ctrl-C in it needs no such test.
NOT_INTERRUPTED = {
    "__init__.py": "re-exports",
    "gather.py": "re-exports",
    "manager.py": "re-exports",
    "queue.py": "re-exports",
    "sampler.py": "re-exports",
    os.path.join("_direct", "__init__.py"): "a docstring",
    os.path.join("_direct", "base.py"): "constants, checks and the slot writer (run in the "
                                        "workers)",
    os.path.join("_direct", "storages.py"): "plans storages and fills their slots: in the "
                                            "workers, and once at construction",
    os.path.join("_direct", "files.py"): "plans file-backed storages and reads their rows "
                                         "into slots: in the workers, and once at "
                                         "construction",
    os.path.join("_process", "__init__.py"): "a docstring",
    os.path.join("_sampling", "__init__.py"): "a docstring",
    os.path.join("_transport", "__init__.py"): "a docstring",
    "__main__.py": "the main job's entry point (the benchmark harness, not the library)",
    os.path.join("_sampling", "checkpoints.py"): "reads a state and checks it, and builds a "
                                                "state_dict: returns or raises (the "
                                                "sampler's load_state_dict changes itself "
                                                "in one step that holds SIGINT back)",
    os.path.join("_transport", "codec.pyx"): "compiled: a signal is acted on once it returns to its (tested) caller",
    os.path.join("_transport", "ring.pyx"): "compiled: as _codec; what a ring does is recorded inside the call",
    os.path.join("_direct", "rows.pyx"): "compiled: as _codec",
    os.path.join("_sampling", "delegates.py"): "the wrapped sampler's properties and get*_at, forwarded: nothing kept",
    os.path.join("_device", "__init__.py"): "a docstring",
    os.path.join("_device", "ops.py"): "each call is one device call that returns or "
                                       "raises (CudaOps runs on a fake torch.cuda in "
                                       "test_device_ops.py, and with CUDA in test_cuda.py; "
                                       "the feed and pins that call it are interrupted)",
    os.path.join("_device", "placement.py"): "decides at construction: returns or raises",
    os.path.join("_device", "resident.py"): "submit hands its ticket over last; result "
                                            "drops the task after running it, so a Ctrl-C "
                                            "leaves it pending, and the sampler cancels its "
                                            "tickets after any interruption (tested in "
                                            "sampler.py's code)",
    os.path.join("_sampling", "fingerprint.py"): "reads the data and returns a value: nothing kept across a call",
    os.path.join("_sampling", "files.py"): "stats files and returns values (a file open "
                                           "for writing flushed: flushed again next time)",
    os.path.join("_sampling", "pages.py"): "reads the page table and a holder's bytes and "
                                           "returns a value; what it keeps (written) is "
                                           "one assignment",
    os.path.join("_sampling", "copies.py"): "a pool's record of its copy, made before the "
                                            "pool starts: its checks return values, and an "
                                            "interrupted one only answers again next time",
    os.path.join("_transport", "headroom.py"): "a memory check before a segment is made: returns or raises",
    os.path.join("_transport", "protocol.py"): "constants of the wire format, and SlotWriter (run in the workers)",
    os.path.join("_sampling", "target.py"): "the work function runs in the workers (SIGINT ignored); the parent's "
                    "draws return values the tested sampler code records",
    os.path.join("_sampling", "state.py"): "builds and checks state_dict values: returns or raises",
    os.path.join("_process", "transfer.py"): "the Parcel, made before a worker's start, which is tested "
                    "(test_a_ctrl_c_as_a_worker_starts_leaves_no_descriptor)",
    os.path.join("_direct", "unienv.py"): "reads UniEnv's internals: returns or raises",
    "_validate.py": "argument checks at construction",
    os.path.join("_direct", "views.py"): "plans views: in the workers, and once at construction",
    "windows.py": "a view that computes each batch and returns it: nothing kept across a call",
    "compat.py": "UniEnv's helpers on the manager's add_work/fetch, which are tested "
                 "(test_a_ctrl_c_anywhere_in_add_work_and_fetch_loses_nothing)",
    "errors.py": "exception classes",
    os.path.join("_direct", "gather.py"): "runs in the workers, which ignore SIGINT",
    os.path.join("_transport", "shm_queue.py"): "ShmQueue, the transport on its own, which promises no more than "
                "multiprocessing.Queue does when a Ctrl-C lands in put or get",
    "stats.py": "counters read into new objects: returns or raises",
    os.path.join("_process", "worker.py"): "runs in the workers, which ignore SIGINT",
    os.path.join("ray", "__init__.py"): "re-exports",
    os.path.join("ray", "_actor.py"): "runs in the Ray actors",
    os.path.join("ray", "_batch.py"): "the actors' frames (in the actors), and the caller's "
                                      "record of their slots, which a Ctrl-C can make lose "
                                      "a slot number (the actor makes another slot) but never "
                                      "give one slot to two tasks: a number is given back "
                                      "only after its actor answered, and taken off its task "
                                      "first",
    os.path.join("_transport", "result_slots.py"): "runs in the workers and the Ray actors",
    os.path.join("ray", "_ship.py"): "pickles the sampler once, as the RayManager is made, "
                                     "and unpickles it in the actors: returns or raises",
    os.path.join("ray", "_calls.py"): "the RayManager's records; flush and move, "
                                      "the steps that change several, hold SIGINT back "
                                      "(withdraw runs inside move and the manager's "
                                      "cancel, which do), and mark_up is ordered so that "
                                      "a cut is harmless (the manager's code around them is "
                                      "interrupted in test_backend_contract.py)",
    os.path.join("ray", "sampler.py"): "RaySampler's own code builds and closes; its "
                                       "sampling is SamplerBase's (sampler.py)",
}


def test_every_module_of_the_package_is_interrupted_or_says_why_not():
    root = ROOT
    modules = set()
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        if rel.split(os.sep)[0] in ("bench", "__pycache__"):
            continue   # (the benchmark harness, which the library never imports)
        for name in files:
            if name.endswith((".py", ".pyx")):
                modules.add(os.path.normpath(os.path.join(rel, name)))
    assert not INTERRUPTED & set(NOT_INTERRUPTED)
    missing = modules - INTERRUPTED - set(NOT_INTERRUPTED)
    assert not missing, f"modules neither interrupted by a test nor exempt: {sorted(missing)}"
    gone = (INTERRUPTED | set(NOT_INTERRUPTED)) - modules
    assert not gone, f"listed, but not in the package: {sorted(gone)}"
