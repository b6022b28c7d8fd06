"""Epochs on the training process's side of a sampler: one pass over a permutation drawn in
this process, its batches requested ahead from a manager and handed out in order (or as they
arrive, with ``in_order=False``), and which epoch closes the manager it ran on.

`Epochs` is owned by a `unienv_mp._sampling.sampler.SamplerBase` (its ``_epochs``): it holds
the epochs being iterated and those restored by ``load_state_dict``, and works on the
sampler's managers (its `Pools`).  Each step of an epoch holds the sampler's lock, never
across a ``yield`` (see "Threads" in `MultiprocessingSampler`).
"""
import collections

from .. import _os
from . import ahead as _ahead
from .streams import EpochProgress
from .target import epoch_order, split_epoch

__all__ = ["Epochs"]


class Epochs:
    """A sampler's epochs: ``open``, the epochs being iterated (as they started), and
    ``resume``, getter -> deque of epochs restored by ``load_state_dict``, to finish.
    Handed the sampler's parts: ``pools``, its managers; ``lock``, its lock; ``caller``,
    its count of batches handed out; ``hand_out``, its `DeviceHandOut` (None: CPU
    batches).  The methods that run an epoch take the sampler (``s``) for its options and
    its ``epoch_manager()`` hook."""

    def __init__(self, pools, lock, caller, hand_out):
        self.pools = pools
        self.lock = lock
        self.caller = caller
        self.hand_out = hand_out
        self.open = []
        self.resume = {}

    @staticmethod
    def _collect(manager, tickets, ticket):
        """The result of ``ticket``, taken off ``tickets`` (a ticket leaves it once its
        result is delivered, or dropped: a Ctrl-C anywhere leaves no ticket behind that is
        not pending)."""
        try:
            value = manager.result(ticket)
        except BaseException:
            # interrupted or timed out: nobody will ask for this ticket again
            manager.cancel(ticket)
            tickets.remove(ticket)
            raise
        tickets.remove(ticket)
        return value

    def run(self, s, getter, ensure_open):
        """An epoch of ``getter`` on sampler ``s``, as a generator of batches.
        ``ensure_open()``: the sampler's check that it is open, in its own process."""
        # (each step holds the lock, none across a yield: see "Threads")
        run = _Run()
        interrupt = None   # (a Ctrl-C in the epoch's end, raised once it ended)
        try:
            progress = self.begin(s, getter, run, ensure_open)
            hand_out = self.hand_out
            manager = run.manager
            batches = split_epoch(progress.order, progress.batch_size)
            todo = progress.remaining()
            pending = run.pending
            number = {}   # ticket -> batch number
            nxt = 0
            first = True   # (see ahead.depth: the first batch alone)
            ahead = max(1, _ahead.depth(s.n_buffers, first))
            early = None   # (ticket, result) collected ahead, on a device (see _early)
            while nxt < len(todo) or pending or early:
                with self.lock:
                    if s.closed:
                        raise RuntimeError(f"this {type(s).__name__} is closed")
                    while nxt < len(todo) and len(pending) + bool(early) < ahead:
                        manager.submit((getter, batches[todo[nxt]]), record=pending)
                        number[pending[-1]] = todo[nxt]
                        nxt += 1
                    if early is not None:
                        (ticket, value), early = early, None
                        if type(value) is _Raise:
                            raise value.error
                    else:
                        ticket = pending[0] if s.in_order else manager.wait_any(pending)
                        value = self._collect(manager, pending, ticket)
                    if hand_out is not None:
                        value = hand_out.epoch_batch(value)
                        early = self._early(hand_out.feed, s.in_order, manager, pending)
                    progress.handed_out(number.pop(ticket))
                    self.caller.batches += 1
                    if first:
                        # the rest, while the caller uses this batch
                        first = False
                        ahead = max(1, _ahead.depth(s.n_buffers, first))
                        while nxt < len(todo) and len(pending) < ahead - 1:
                            manager.submit((getter, batches[todo[nxt]]), record=pending)
                            number[pending[-1]] = todo[nxt]
                            nxt += 1
                yield value
        finally:
            # Also on an early break (generator closed) or an error: drop what is in flight.
            # (The epoch is over: the next one draws a new permutation.)  A Ctrl-C does
            # not cut the end short: it is tried again until it is done, and the
            # KeyboardInterrupt raised then.  (The loop's first call is its first bytecode
            # where a signal is acted on, and it is inside the try.)
            while True:
                try:
                    with self.lock:
                        self.end(run)
                    break
                except KeyboardInterrupt as e:
                    interrupt = e
            if interrupt is not None:
                raise interrupt

    @classmethod
    def _early(cls, feed, in_order, manager, pending):
        """``(ticket, result)`` of the epoch's next batch if it has arrived, its copy
        issued ahead on ``feed`` (rule 6 of `unienv_mp._device.feed`), else None.  A result
        that raises is raised when its batch is due."""
        if not (in_order and pending and feed.copying
                and manager.ready(pending[0])):
            return None
        ticket = pending[0]
        try:
            value = cls._collect(manager, pending, ticket)
        except Exception as e:
            return ticket, _Raise(e)
        try:
            feed.start(value)
        except Exception:
            pass   # (tried again, and raised, at its hand-out)
        return ticket, value

    def begin(self, s, getter, run, ensure_open):
        """Start an epoch of ``getter`` for ``run``: its manager (``s.epoch_manager()``)
        and its progress, the permutation drawn as UniEnv draws it (or an epoch restored
        by ``load_state_dict``).  A Ctrl-C before the epoch holds its manager loses the
        permutation drawn: the next epoch draws a new one."""
        with self.lock:
            ensure_open()
            restored = self.resume.get(getter)
            if restored:
                progress = restored[0]
            else:
                # The permutation first, as UniEnv draws it.
                progress = EpochProgress(getter, epoch_order(s.sampler), s.batch_size)
            if self.caller.since_ns is None:
                self.caller.begin()   # (stats() counts from the first request)
            manager, _ = s.epoch_manager()   # (an own manager: in pools.own)
            # (one step: the epoch holds its manager, is open, and has taken its restored
            # state, or none of these)
            with _os.interrupts_deferred():
                if restored:
                    restored.popleft()
                    if not restored:
                        del self.resume[getter]
                self.pools.users[manager] += 1
                self.open.append(progress)
                run.manager, run.progress = manager, progress
            self.pools.close_unused()
        return progress

    def end(self, run):
        """The epoch of ``run`` ended: it lets go of its manager (cancelling its tickets in
        flight, or closing the manager if it is the last epoch on one that nothing else
        keeps).  Done in steps that each happen once, so that an end cut short is
        finished by calling this again."""
        manager = run.manager
        if manager is None:
            return   # (it never began)
        pools = self.pools
        if not run.ended:
            users = pools.users
            # (one step: a Ctrl-C cannot leave tickets behind on a manager that lives on)
            with _os.interrupts_deferred():
                open_epochs = self.open
                for i, p in enumerate(open_epochs):
                    if p is run.progress:
                        del open_epochs[i]
                        break
                users[manager] -= 1
                if users[manager] <= 0:
                    del users[manager]
                # its own, or retired (see Pools.retire) while this epoch ran: the last
                # epoch on it closes it
                run.closes = manager in pools.own and manager not in users
                if not run.closes and not manager.closed:
                    for t in run.pending:
                        manager.cancel(t)
                run.ended = True
        if run.closes:
            if not manager.closed and not run.counted:
                part = manager.stats()
                with _os.interrupts_deferred():
                    pools.ended_wait_ns += int(part.wait_seconds * 1e9)
                    pools.ended_startup_ns += int(part.startup_seconds * 1e9)
                    run.counted = True
            manager.close()
            pools.own.discard(manager)


class _Raise:
    """An error met collecting a batch ahead, raised when the batch is due."""
    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error


class _Run:
    """One epoch iterator's hold on the sampler: the manager it runs on (None until the
    epoch began), its epoch, its tickets in flight, and how far its end got."""
    __slots__ = ("manager", "progress", "pending", "ended", "closes", "counted")

    def __init__(self):
        self.manager = None
        self.progress = None
        self.pending = collections.deque()
        self.ended = False     # it let go of its manager
        self.closes = False    # ... and closes it
        self.counted = False   # ... whose wait is counted in the sampler's stats
