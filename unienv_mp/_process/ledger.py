"""The work in flight of a MultiProcessingSampleManager, in one place: the tickets and
their tasks, each worker's tasks in flight and waiting, and the result slots they hold.

`WorkLedger` is the one owner of that state: the manager drives it (issue, deliver,
cancel), and the worker pool asks it for the tasks to push to a process and hands it a
dead process's work to queue again; neither changes a task or a worker's lists itself.
The ledger puts a task on a worker's task ring (`WorkLedger.push`) and takes its results
off the result ring (`WorkLedger.take`), so that what is on the rings and what it records
change together.
A worker writes each result into a slot, a segment of its own numbered per process; a
slot number is given to one task at a time, and goes back to its worker once the task's
result was read or dropped and no zero-copy view of it (a lease) is alive.

Its rules against a Ctrl-C (the others are at the top of `unienv_mp._process.manager`):

* A slot number is given back only through `WorkLedger.give_back_slot`, which clears
  ``task.slot`` first: an interruption can at worst leak a slot number (the worker makes
  another slot), never give one back twice (two tasks writing into one slot).
* The ticket goes into its worker's in-flight list if and only if the push happens (the
  ring appends it, inside the call: `WorkLedger.push`).
* A result is recorded (`WorkLedger.accept`) so that every step gives the same state when
  run twice; ``arrived`` is set before the ticket leaves the in-flight list.
* A waiting task leaves its list only after it was pushed (then it is in flight, and
  skipped), dropped, or moved in one step that holds SIGINT back (the pool's).
"""
import collections

from .._transport import codec as _codec
from .._transport import protocol as P
from .._transport.codec import SlotLease
from ..backend import TicketTable
from ..errors import WorkerError
from .encoder import spill_entry
from .handle import WorkerCorrupt

__all__ = ["Task", "WorkLedger"]

# (globals: the per-batch path reads them once per batch)
_ST_OK = P.ST_OK
_ST_ERROR = P.ST_ERROR
_ST_FATAL = P.ST_FATAL
_decode = _codec.decode
_AT_SLOT = P.AT_SLOT
_untag = P.untag


class Task:
    """One submitted work item.  One is made per batch: the constructor sets ``work``
    alone, and every other field starts as the class attribute below until the ledger
    sets it."""
    ticket = None
    work = None
    worker = None       # index of the worker it was given to
    incarnation = None  # of that worker's process: the slot number belongs to it
    slot = None
    spill = None        # parent segment carrying large work info
    cancelled = False
    leases = 0          # zero-copy results of it alive (see WorkLedger.lease)
    # Its result, set by WorkLedger.accept; ``arrived`` is set last.
    arrived = False
    status = None       # ST_OK, or ST_ERROR: the target raised, the value describes it
    inline = None       # the encoded value, if it came inside the entry; else it is in
    seg = None          # the worker's slot segment, mapped here,
    nbytes = 0          # in its first nbytes bytes
    error = None        # an exception met here receiving it, raised in place of the value

    def __init__(self, work):
        self.work = work


class WorkLedger:
    """The tasks of one manager's ``n_workers`` workers.

    ``tasks``: the ticket table (`unienv_mp.backend.TicketTable`: ticket -> `Task`, for
    every task submitted and not delivered or cancelled).  ``inflight[i]``: the tickets
    pushed to worker ``i``'s process, in the order given; ``waiting[i]``: the tasks waiting
    for a (new) process of worker ``i``.  Both are read by the pool and the manager and
    changed only here.  ``workers``: the worker handles, by index (their slots are given
    back through them); ``encoder`` puts work on a ring, large work into a spill segment
    kept in ``spills`` until its task's result came.  ``caller`` (the manager's
    `CallerRecord`) counts the batches handed out, ``batches_in(work)`` of them a task
    (one if ``batches_in`` is None).  ``leases`` counts the zero-copy
    results alive; ``released`` holds the tasks whose leases the garbage collector gave
    back since (see `give_back_released`)."""

    def __init__(self, n_workers, workers, encoder, spills, caller, batches_in):
        self.tasks = TicketTable()
        self.inflight = [collections.deque() for _ in range(n_workers)]
        self.waiting = [[] for _ in range(n_workers)]
        self.workers = workers
        self.encoder = encoder
        self.spills = spills
        self.caller = caller
        self.batches_in = batches_in
        self.leases = 0
        self.released = collections.deque()

    # -- how busy a worker is -------------------------------------------------------------

    def load(self, i):
        """Tasks in flight on or waiting for worker ``i``."""
        return len(self.inflight[i]) + len(self.waiting[i])

    def in_flight(self, i):
        """Tasks pushed to worker ``i``'s process and without a result yet."""
        return len(self.inflight[i])

    # -- onto a worker's ring -------------------------------------------------------------

    def enqueue(self, task, i):
        """``task`` waits for worker ``i``'s (new) process (see `next_waiting`)."""
        self.waiting[i].append(task)

    def push(self, task, w):
        """Push ``task`` onto the task ring of worker handle ``w``; it is in
        ``inflight[w.index]`` once pushed.  Raises WorkerCorrupt, a WorkerDied (not
        pushed), if the process wrote into its task ring.  Whether it was pushed or not,
        the task keeps the slot number it was given, for the next try (or for `drop`)."""
        seg = task.spill
        if seg is None:
            tag, payload, seg = self.encoder.encode(task.work)
            if seg is not None:
                task.spill = seg
                self.spills.append(seg)
        else:
            tag, payload = spill_entry(seg)   # (work given again, to a new process)
        index = w.index
        task.worker = index
        task.incarnation = w.incarnation
        if task.slot is None:
            task.slot = w.take_slot()
        # (the ticket goes into inflight if and only if the push happens)
        w.push_task(tag, task.slot, task.ticket, payload, self.inflight[index])

    def next_waiting(self, i):
        """The first task waiting for worker ``i``'s process that is still to be pushed,
        or None: those cancelled are dropped, and those arrived or pushed already (by a
        step a Ctrl-C cut short) leave the list.  Once it is pushed, `pushed_waiting`
        takes it off the list."""
        waiting = self.waiting[i]
        while waiting:
            task = waiting[0]
            if task.cancelled and not task.arrived:
                self.drop(task)   # (nobody waits for it any more)
            elif not task.arrived and task.ticket not in self.inflight[i]:
                return task
            del waiting[0]
        return None

    def pushed_waiting(self, i):
        """The task `next_waiting` returned was pushed: it leaves worker ``i``'s list."""
        del self.waiting[i][0]

    # -- a process that ended, a worker retired -------------------------------------------

    def requeue(self, i, failed=None):
        """Worker ``i``'s process ended: hand out the result of ``failed`` (``(task,
        error)``, or None), and queue its unfinished tasks for the next process, before
        anything queued for it meanwhile.  Runs with SIGINT held back (the pool's bury)."""
        if failed is not None:
            task, error = failed
            task.error = error
            self.arrived(task)
        unfinished = []
        tasks = self.tasks
        inflight = self.inflight[i]
        waiting = self.waiting[i]
        for t in inflight:
            task = tasks.get(t)
            if task is None or task.arrived:
                continue
            task.slot = None   # (the slot numbers of the dead process are void)
            if task.cancelled:
                self.drop(task)
            elif task not in waiting:
                unfinished.append(task)
        inflight.clear()
        waiting[0:0] = unfinished

    def shed_finished(self, i):
        """Take the first task waiting for worker ``i`` off its list if it needs no
        worker (it arrived, or was cancelled: then it is dropped); True if one was."""
        waiting = self.waiting[i]
        task = waiting[0]
        if task.arrived:
            del waiting[0]
            return True
        if task.cancelled:
            del waiting[0]
            self.drop(task)   # (nobody waits for it any more)
            return True
        return False

    def hand_over(self, i, j):
        """Move the first task waiting for worker ``i`` to the end of worker ``j``'s list
        (``i`` is retired; the caller holds SIGINT back)."""
        task = self.waiting[i].pop(0)
        task.slot = None   # (a slot number belongs to one process)
        task.worker = j
        self.waiting[j].append(task)

    # -- results --------------------------------------------------------------------------

    def take(self, w, timeout):
        """Take the oldest result entry of worker handle ``w`` not recorded yet off its
        result ring and record it (`accept`), waiting up to ``timeout`` seconds for one
        (see ``WorkerHandle.next_result``, which raises what ends the wait).  Interrupted
        anywhere, the entry stays with the handle and is recorded again next time."""
        self.accept(w, w.next_result(timeout))
        w.result_recorded()

    def accept(self, w, entry):
        """Record a result entry that worker handle ``w`` published (hand nothing out
        yet).  The caller then tells the handle it is recorded; an entry whose recording
        was cut short is recorded again, so every step below gives the same state when it
        runs twice.  A result the process made sets the handle's ``made_result`` before
        the task is marked arrived (its worker's count of deaths in a row starts again,
        see `unienv_mp._process.deaths`), so no Ctrl-C can lose it."""
        t, slot, ticket, payload = entry
        status, where = _untag(t)
        if status == _ST_FATAL:
            w.result_recorded()   # (the worker exits; a replacement starts afresh)
            info = _codec.decode(payload, copy=True)
            raise WorkerError.from_payload(info, w.index, "could not start: ")
        inflight = self.inflight[w.index]
        task = self.tasks.get(ticket)
        if task is None:
            # no longer wanted (dropped, or delivered by a recording cut short)
            try:
                inflight.remove(ticket)
            except ValueError:
                if not w.repeated:   # (a recording cut short removed it already)
                    raise WorkerCorrupt(w, f"ticket {ticket} was not given to it") from None
            return
        if task.arrived:
            if task.worker != w.index or not w.repeated:
                raise WorkerCorrupt(w, f"ticket {ticket}: its result came already")
            self.arrived(task)   # (finish a recording cut short)
            return
        # (pushed to this process is exactly: in its inflight, see the top)
        if task.worker != w.index or ticket not in inflight or (
                where == _AT_SLOT and slot != task.slot):
            raise WorkerCorrupt(w, f"ticket {ticket}, slot {slot}: no such task was given "
                                   f"to it")
        if where == _AT_SLOT:
            try:
                task.seg, task.nbytes = w.map_slot(slot, payload)
            except OSError as e:
                # e.g. out of descriptors: this result is lost; its caller hears why.
                # (WorkerDied: the task stays in flight, and is redone by the replacement.)
                task.error = e
                self.arrived(task)
                return
        else:
            task.inline = payload
        if task.spill is not None:
            self.release_spill(task)
        task.status = status
        w.made_result = True
        self.arrived(task)

    def arrived(self, task):
        """The result of ``task`` is recorded: it is no longer in flight.  (``arrived``
        first: a task whose ticket is still in flight meanwhile is not re-issued.)"""
        task.arrived = True
        try:
            self.inflight[task.worker].remove(task.ticket)
        except ValueError:
            pass   # (removed already, by a recording cut short)
        if task.cancelled:
            self.drop(task)

    def deliver(self, task, copy, max_leases):
        """The value of an arrived ``task``'s result, handed out: zero-copy views of its
        slot (a lease on it, see `lease`), or a copy with ``copy``, beyond ``max_leases``
        leases alive, or for an error.  The task leaves the ledger once the value is made
        (`delivered`): cut short before, it can be delivered again (from the slot, which
        it still holds) or cancelled.  Raises `WorkerError` if the work raised, or the
        error met receiving the result."""
        status = task.status
        seg = task.seg
        try:
            if task.error is not None:
                raise task.error
            if seg is None:
                value = _decode(task.inline, True)   # (copy)
            elif copy or self.leases >= max_leases or status != _ST_OK:
                with memoryview(seg) as mv:
                    value = _decode(mv[:task.nbytes], True)   # (copy)
            else:
                lease = self.lease(task, seg)
                value = _decode(lease)
                del lease
        except Exception:
            self.delivered(task)   # (the caller hears why instead)
            raise
        self.delivered(task)
        if status == _ST_ERROR:
            raise WorkerError.from_payload(value, task.worker)
        batches_in = self.batches_in
        self.caller.batches += 1 if batches_in is None else batches_in(task.work)
        return value

    def lease(self, task, seg):
        """A zero-copy lease on ``task``'s slot segment ``seg``: the slot goes back once
        the task was delivered and the last lease on it is garbage collected."""
        task.leases += 1
        self.leases += 1
        return SlotLease(seg, 0, task.nbytes, self.released.append, task)

    def delivered(self, task):
        """``task``'s result was handed out (or its error raised): it leaves the table,
        and its slot goes back now, or once the last lease on it is garbage collected (see
        `give_back_released`).  Cut short before, it can be delivered again."""
        self.tasks.pop(task.ticket, None)
        if task.spill is not None:
            self.release_spill(task)
        if not task.leases:
            self.give_back_slot(task)

    # -- giving up on a task --------------------------------------------------------------

    def cancel(self, ticket):
        """Forget ``ticket``: its task is dropped now if its result came, else when it
        comes.  Nothing if it is unknown."""
        task = self.tasks.get(ticket)
        if task is None:
            return
        task.cancelled = True
        if task.arrived:
            self.drop(task)

    def abandon(self, task, i):
        """``submit`` of ``task`` (dealt to worker ``i``) raised: its caller has no ticket.
        Drop the task, or, if it reached the worker, let it be dropped when its result
        arrives."""
        task.cancelled = True
        waiting = self.waiting[i]
        while task in waiting:
            waiting.remove(task)
        if task.arrived or task.ticket not in self.inflight[i]:
            self.drop(task)

    def release_spill(self, task):
        """Close the segment that carried ``task``'s work info, if any."""
        if task.spill is not None:
            try:
                self.spills.remove(task.spill)
            except ValueError:
                pass
            task.spill.close()
            task.spill = None

    def drop(self, task):
        """Forget ``task`` (cancelled, or abandoned by submit) and release what it holds:
        its spill, and its slot unless the worker may still write into it (pushed, and no
        result yet: then the slot goes back when the result arrives, see `abandon`)."""
        self.tasks.pop(task.ticket, None)
        self.release_spill(task)
        if task.worker is None:
            return
        inflight = self.inflight[task.worker]
        if task.arrived:
            try:
                inflight.remove(task.ticket)   # (a recording cut short left it there)
            except ValueError:
                pass
        if task.slot is not None and not task.leases and (
                task.arrived or task.ticket not in inflight):
            self.give_back_slot(task)

    # -- slots ----------------------------------------------------------------------------

    def give_back_slot(self, task):
        """The slot of ``task``, whose result was read or dropped, can take new work.  At
        most once: ``task.slot`` is cleared first (cut short in between, the slot number
        is lost, never given back twice)."""
        slot = task.slot
        if slot is not None:
            task.slot = None
            self.workers[task.worker].give_back_slot(slot, task.incarnation)

    def give_back_released(self):
        """The leases garbage collected since (their tasks, on ``released``) are gone;
        a delivered task whose last lease this was gives its slot back."""
        released = self.released
        tasks = self.tasks
        while released:
            task = released.popleft()
            self.leases -= 1
            task.leases -= 1
            if not task.leases and task.ticket not in tasks:
                self.give_back_slot(task)

    # -- what is ready --------------------------------------------------------------------

    def ready(self, published):
        """Batches ready to hand out (``batches_in(work)`` a task): those of the results
        collected, and of the first ``published[i]`` tickets in flight on each worker
        ``i`` (published, not yet taken off its ring)."""
        batches_in = self.batches_in
        count = (lambda work: 1) if batches_in is None else batches_in
        tasks = self.tasks
        n = sum(count(task.work) for task in tasks.values()
                if task.arrived and not task.cancelled and task.status == P.ST_OK
                and task.error is None)
        for i, k in published:
            for ticket in list(self.inflight[i])[:k]:
                task = tasks.get(ticket)
                if task is not None and not task.arrived and not task.cancelled:
                    n += count(task.work)
        return n
