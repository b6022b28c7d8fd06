"""A Ctrl-C can land between any two bytecodes of the manager and the sampler, which run as
plain Python: whatever it cuts short, no result is lost, no ticket is left behind, no slot
is used by two results at once, and the manager and sampler go on working.

The interrupter delivers a real SIGINT before the n-th bytecode executed in the package's
modules, for every n of a round of work in turn.  CPython 3.11 and later act on a signal
only at some bytecodes (after a call returns, at a loop's backward jump, on entering a
function); 3.10 at nearly all.  This tries every bytecode but three kinds, where no
version delivers one: the NOP where a ``try`` block begins, and the PUSH_EXC_INFO and
POP_EXCEPT that enter and leave an ``except`` block (raised there from a trace function,
an exception would leave the one being handled in place for good).  A step that holds SIGINT back
(``_process.interrupts_deferred``) holds these back too.
"""
import collections
import dis
import os
import signal
import sys

import numpy as np
import torch
from conftest import wait_until

import _data

from unienv_mp import _process, _work_encoder, _worker_handle, manager as M

_NEVER_INTERRUPTED = {dis.opmap[name] for name in ("NOP", "PUSH_EXC_INFO", "POP_EXCEPT")}
PACKAGE_FILES = {M.__file__, _worker_handle.__file__, _work_encoder.__file__,
                 _process.__file__}


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
                and frame.f_code.co_code[frame.f_lasti] not in _NEVER_INTERRUPTED):
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
    """No slot number is free twice, or free while a pending task holds it."""
    for lane in mgr._lanes:
        w = lane.worker
        free = w.free_slots
        assert len(free) == len(set(free)), f"worker {w.index}: a slot is free twice: {free}"
        taken = {t.slot for t in mgr._tasks.values()
                 if t.worker == w.index and t.slot is not None
                 and t.incarnation == w.incarnation}
        assert not taken & set(free), f"worker {w.index}: slots {taken & set(free)} are " \
                                      f"free and held by a pending task"
        for ticket in lane.inflight:
            assert ticket in mgr._tasks, f"ticket {ticket} in flight but unknown"


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
            if proc is not None and not _process.has_exited(proc):
                # (not yet replaced after the last run's, whose replacement was cut short)
                _process.send_signal(proc, signal.SIGKILL)
                assert wait_until(lambda: _process.has_exited(proc), interval=0.0005)
            caller.round()

        def recover():
            caller.recover()
            check_slots(mgr)

        # every bytecode of noticing the death and replacing the worker (the rest of the
        # round is the test above)
        interrupter = Interrupter(PACKAGE_FILES, within=("_bury", "_restart"))
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


def test_a_ctrl_c_anywhere_in_sample_loses_nothing():
    from unienv_data.samplers import StepSampler
    from unienv_mp import MultiprocessingSampler
    from unienv_mp import sampler as S
    rb = _data.replay_buffer(100)
    sampler = MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=2, n_buffers=4,
                                     ctx="fork", batches_per_task=3)
    held = collections.deque(maxlen=8)

    def sample_round():
        for _ in range(7):
            batch = sampler.sample()
            held.append((batch, check_batch(batch)))

    def recover():
        for batch, idx in held:
            assert check_batch(batch) == idx, "a batch kept by the caller changed"
        mgr = sampler._manager
        stream = sampler._streams["sample"]
        # what the sampler asked for and no longer holds was cancelled, nothing more
        for ticket, task in mgr._tasks.items():
            assert ticket in stream.tickets or task.cancelled, f"orphan ticket {ticket}"
        for ticket in stream.tickets:
            assert ticket in mgr._tasks and not mgr._tasks[ticket].cancelled
        assert len(stream.ready) + 3 * len(stream.tickets) <= 4 + 3
        check_slots(mgr)

    with sampler:
        sample_round()
        interrupter = Interrupter(PACKAGE_FILES | {S.__file__})
        runs = interrupt_everywhere(interrupter, sample_round, recover)
        assert runs > 300
        for _ in range(3):
            sample_round()
        recover()
