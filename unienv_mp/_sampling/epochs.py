"""Epochs on the training process's side of a sampler: one pass over a permutation drawn in
this process, its batches requested ahead from a manager and handed out in order (or as they
arrive, with ``in_order=False``); which manager an epoch runs on, and which epoch closes it.

:class:`Epochs` is a base class of :class:`unienv_mp._sampling.sampler.SamplerBase` and works on that
class's state: ``_lock`` (held by each step of an epoch, never across a ``yield``: see
"Threads" in :class:`~unienv_mp.MultiprocessingSampler`), ``_epoch_users`` (how many epoch
iterators run on each manager), ``_epoch_managers`` (managers closed by the last epoch on
them), ``_open_epochs`` (the epochs being iterated) and ``_resume`` (epochs restored by
``load_state_dict``).
"""
import collections

from .. import _os
from .target import epoch_order, split_epoch
from .streams import EpochProgress

__all__ = ["Epochs"]


class Epochs:
    """``epoch_iter`` and its siblings, and the choice of an epoch's manager (which
    :class:`~unienv_mp.MultiprocessingSampler` overrides to keep workers between epochs)."""

    def _epoch_manager(self):
        """``(manager, own)``: the manager an epoch starting now runs on, and whether it
        is the epoch's own (closed when the epoch ends; it is in ``_epoch_managers`` from
        the moment it is made) or one that outlives the epoch (the ``sample*`` manager,
        or one kept in ``_kept`` for the next epochs).  It sets ``_epoch_workers`` (see
        ``epoch_workers``)."""
        running = self._manager is not None and not self._manager.closed
        self._epoch_workers = (("kept", "the sample* workers serve every epoch") if running
                               else ("new", "no workers were running yet (they serve "
                                            "every epoch)"))
        return self._ensure_manager(), False

    @property
    def epoch_workers(self):
        """Which workers the latest epoch began on: ``"kept"`` (workers that were already
        running: the ``sample*`` workers, or those of an earlier epoch), ``"new"``
        (workers started for it), ``"in_process"`` (no workers: the data is on a GPU), or
        None before the first epoch.  :attr:`epoch_workers_reason` says why (see
        ``persistent_workers``)."""
        return self._epoch_workers[0]

    @property
    def epoch_workers_reason(self):
        """Why the latest epoch began on :attr:`epoch_workers`, in words: for example
        ``"the data is unchanged since they started"``, ``"the data changed since the
        workers started"``, or ``"whether the data changed cannot be told: a custom
        function (my_mask), which may read anything (persistent_workers=True promises that
        it does not)"``.  None before the first epoch."""
        return self._epoch_workers[1]

    def _retire(self, manager):
        """``manager`` is no longer kept for anything: closed now, or, while epochs still
        run on it, by the last of them (it waits in ``_epoch_managers``)."""
        if manager is None or manager.closed:
            return
        if self._epoch_users.get(manager, 0) > 0:
            self._epoch_managers.add(manager)
        else:
            manager.close()

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

    def _epoch(self, getter):
        # (each step holds the lock, none across a yield: see "Threads")
        run = _Run()
        interrupt = None   # (a Ctrl-C in the epoch's end, raised once it ended)
        try:
            progress = self._begin_epoch(getter, run)
            manager = run.manager
            batches = split_epoch(progress.order, progress.batch_size)
            todo = progress.remaining()
            pending = run.pending
            number = {}   # ticket -> batch number
            nxt = 0
            # The first batch is asked for alone, so that it has a worker, and the CPUs, to
            # itself (it is waited for at once); the rest from the second on.
            ahead = 1
            early = None   # (ticket, result) collected ahead, on a device (see _early)
            while nxt < len(todo) or pending or early:
                with self._lock:
                    if self._closed:
                        raise RuntimeError(f"this {type(self).__name__} is closed")
                    while nxt < len(todo) and len(pending) + bool(early) < ahead:
                        manager.submit((getter, batches[todo[nxt]]), record=pending)
                        number[pending[-1]] = todo[nxt]
                        nxt += 1
                    if early is not None:
                        (ticket, value), early = early, None
                        if type(value) is _Raise:
                            raise value.error
                    else:
                        ticket = pending[0] if self.in_order else manager.wait_any(pending)
                        value = self._collect(manager, pending, ticket)
                    if self._feed is not None:
                        value = self._hand_out.epoch_batch(value)
                        early = self._early(manager, pending)
                    progress.handed_out(number.pop(ticket))
                    self._caller.batches += 1
                    if ahead == 1:
                        # the rest, while the caller uses this batch
                        ahead = self.n_buffers
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
                    with self._lock:
                        self._end_epoch(run)
                    break
                except KeyboardInterrupt as e:
                    interrupt = e
            if interrupt is not None:
                raise interrupt

    def _early(self, manager, pending):
        """``(ticket, result)`` of the epoch's next batch if it has arrived, its copy
        issued ahead (rule 6 of :mod:`unienv_mp._device.feed`), else None.  A result that
        raises is raised when its batch is due."""
        if not (self.in_order and pending and self._feed.copying
                and manager.ready(pending[0])):
            return None
        ticket = pending[0]
        try:
            value = self._collect(manager, pending, ticket)
        except Exception as e:
            return ticket, _Raise(e)
        try:
            self._feed.start(value)
        except Exception:
            pass   # (tried again, and raised, at its hand-out)
        return ticket, value

    def _begin_epoch(self, getter, run):
        """Start an epoch of ``getter`` for ``run``: its manager and its progress, the
        permutation drawn as UniEnv draws it (or an epoch restored by ``load_state_dict``).
        A Ctrl-C before the epoch holds its manager loses the permutation drawn: the next
        epoch draws a new one."""
        with self._lock:
            self._ensure_open()
            restored = self._resume.get(getter)
            if restored:
                progress = restored[0]
            else:
                # The permutation first, as UniEnv draws it.
                progress = EpochProgress(getter, epoch_order(self.sampler), self.batch_size)
            self._start_clock()
            manager, _ = self._epoch_manager()   # (an own manager: in _epoch_managers)
            # (one step: the epoch holds its manager, is open, and has taken its restored
            # state, or none of these)
            with _os.interrupts_deferred():
                if restored:
                    restored.popleft()
                    if not restored:
                        del self._resume[getter]
                self._epoch_users[manager] += 1
                self._open_epochs.append(progress)
                run.manager, run.progress = manager, progress
            self._close_unused_epoch_managers()
        return progress

    def _end_epoch(self, run):
        """The epoch of ``run`` ended: it lets go of its manager (cancelling its tickets in
        flight, or closing the manager if it is the last epoch on one that nothing else
        keeps).  Done in steps that each happen once, so that an end cut short is
        finished by calling this again."""
        manager = run.manager
        if manager is None:
            return   # (it never began)
        if not run.ended:
            users = self._epoch_users
            # (one step: a Ctrl-C cannot leave tickets behind on a manager that lives on)
            with _os.interrupts_deferred():
                open_epochs = self._open_epochs
                for i, p in enumerate(open_epochs):
                    if p is run.progress:
                        del open_epochs[i]
                        break
                users[manager] -= 1
                if users[manager] <= 0:
                    del users[manager]
                # its own, or retired (see _retire) while this epoch ran: the last epoch
                # on it closes it
                run.closes = manager in self._epoch_managers and manager not in users
                if not run.closes and not manager.closed:
                    for t in run.pending:
                        manager.cancel(t)
                run.ended = True
        if run.closes:
            if not manager.closed and not run.counted:
                part = manager.stats()
                with _os.interrupts_deferred():
                    self._ended_wait_ns += int(part.wait_seconds * 1e9)
                    self._ended_startup_ns += int(part.startup_seconds * 1e9)
                    run.counted = True
            manager.close()
            self._epoch_managers.discard(manager)

    def _close_unused_epoch_managers(self):
        """Close the managers in ``_epoch_managers`` that no epoch runs on (one made for
        an epoch that a Ctrl-C cut short before it began)."""
        for manager in [m for m in self._epoch_managers if m not in self._epoch_users]:
            manager.close()
            self._epoch_managers.discard(manager)

    def epoch_iter(self):
        """One pass over a random permutation of the data (drawn here, with the wrapped
        sampler's RNG), each batch gathered by a worker with ``get_at``; every index
        exactly once, the last partial batch included."""
        return self._epoch("get_at")

    def epoch_iter_with_metadata(self):
        """As :meth:`epoch_iter`, with ``get_at_with_metadata``."""
        return self._epoch("get_at_with_metadata")

    def epoch_flat_iter(self):
        """As :meth:`epoch_iter`, with ``get_flattened_at``."""
        return self._epoch("get_flattened_at")

    def epoch_flat_iter_with_metadata(self):
        """As :meth:`epoch_iter`, with ``get_flattened_at_with_metadata``."""
        return self._epoch("get_flattened_at_with_metadata")

    def __iter__(self):
        return self.epoch_iter()


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
