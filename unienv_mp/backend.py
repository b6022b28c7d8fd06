"""The backend contract: what
[`unienv_mp.sampler.SamplerBase`][unienv_mp.sampler.SamplerBase] needs from the manager that
runs its workers, and the parts every manager shares.

A manager runs work items on workers and hands their results back by ticket:
[`unienv_mp.MultiProcessingSampleManager`][unienv_mp.MultiProcessingSampleManager] on
processes, [`RayManager`][unienv_mp.ray.RayManager] on Ray actors.
[`Manager`][unienv_mp.backend.Manager] is the interface (a ``typing.Protocol``); a new
backend implements it, on the shared parts here:

* [`TicketTable`][unienv_mp.backend.TicketTable]: ticket -> task, for every task submitted
  and not yet delivered or cancelled.
* [`Dealer`][unienv_mp.backend.Dealer]: which worker gets a task submitted without one.
* [`respawn_refusal`][unienv_mp.backend.respawn_refusal]: the respawn budget: why a dead
  worker is not replaced, or None.
* [`unknown_ticket`][unienv_mp.backend.unknown_ticket],
  [`none_pending`][unienv_mp.backend.none_pending],
  [`no_result`][unienv_mp.backend.no_result]: the errors of the ticket calls; `check_index`
  checks a worker index.

The rules every manager keeps, so that a ``KeyboardInterrupt`` landing between any two
bytecodes loses nothing (``tests/test_interrupts.py`` checks the process manager's and
the Ray manager's code, and this module's, at every bytecode):

* ``submit`` hands its ticket over last: appending it to the caller's ``record`` is its
  last step; if it raises before, the task is dropped (or dropped when its result comes).
* A ticket in flight always has its task (a replacement worker is sent every task in
  flight): ``cancel`` takes the ticket off its worker's in-flight list before the task
  leaves the table, or does both in one step that a Ctrl-C does not cut.
* A worker given up (respawn=False, or its budget spent) is taken off its lane before the
  error is raised: the next call starts a fresh worker, with the whole budget, for the
  work left waiting.  A lane never keeps a dead worker.

A sampler for a new backend: subclass ``unienv_mp.sampler.SamplerBase``, call its
``__init__`` with the common options, and override its hooks (nothing else is meant to
be overridden):

* ``new_manager()`` (required): a new manager, keeping
  [`Manager`][unienv_mp.backend.Manager], whose workers run
  ``unienv_mp.sampler.SamplerTarget(sampler)`` (the work function: a task's method name and
  argument in, its batches out) on a copy of ``self.sampler`` of their own, as a worker
  process has: the target reseeds its sampler's random number generators, and epochs draw
  their orders from the caller's.  A manager that runs tasks in the caller's process passes
  ``SamplerTarget(copy.deepcopy(self.sampler))``.
* ``sampler_methods()``: the wrapped sampler's ``sample*`` and ``get*_at`` method names.
* ``row_nbytes(name)``: bytes per batch row of ``name``, or None (sets the default
  batches per task).
* ``configuration(methods)``: what a saved state must match to be loaded.
* ``epoch_manager()``: ``(manager, own)``, the manager an epoch runs on and whether it
  is the epoch's own (the default: the ``sample*`` manager).
* ``check_epoch(getter)``: raise to refuse an epoch when its iterator is made.

``unienv_mp.ray.RaySampler`` is one.
"""
from typing import Iterable, Optional, Protocol, TypeVar, runtime_checkable

from .stats import SamplerStats

__all__ = ["Manager", "TicketTable", "Dealer", "respawn_refusal", "unknown_ticket",
           "none_pending", "no_result", "TaskInfoT", "ResultT", "CLOSED_WHILE_WAITING"]

#: The types of a manager's work items and of their results.
TaskInfoT = TypeVar("TaskInfoT")
ResultT = TypeVar("ResultT")

#: What a call raises (``RuntimeError``) when a ``close()`` from another thread ends it.
CLOSED_WHILE_WAITING = "this manager was closed (from another thread) during the call"


@runtime_checkable
class Manager(Protocol):
    """What [`unienv_mp.sampler.SamplerBase`][unienv_mp.sampler.SamplerBase] calls on its
    managers.

    ``closed`` is True once [`close`][unienv_mp.backend.Manager.close] was called.  Every
    other call raises ``RuntimeError`` then."""
    closed: bool
    in_order: bool

    @property
    def n_workers(self) -> int:
        """Number of workers."""

    def submit(self, work, worker: Optional[int] = None, *, record=None) -> int:
        """Queue ``work`` (on worker ``worker``, or as [`Dealer`][unienv_mp.backend.Dealer]
        picks) and return its ticket; ``record``: a list the ticket is appended to, as the
        last step."""

    def result(self, ticket: int, timeout: Optional[float] = None):
        """The result of ``ticket``, waiting up to ``timeout`` seconds (default: the
        manager's); ``WorkerError`` if the work raised, ``TimeoutError``, ``KeyError``
        ([`unknown_ticket`][unienv_mp.backend.unknown_ticket]), ``WorkerDiedError`` if its
        worker is given up."""

    def ready(self, ticket: int) -> bool:
        """True if the result of ``ticket`` has arrived."""

    def wait_any(self, tickets: Iterable[int], timeout: Optional[float] = None) -> int:
        """One of ``tickets`` whose result has arrived, waiting for one; ``KeyError``
        ([`none_pending`][unienv_mp.backend.none_pending]) if none is pending,
        ``TimeoutError``."""

    def cancel(self, ticket: int) -> None:
        """Forget ``ticket`` (nothing if it is unknown)."""

    def reset_order(self) -> None:
        """Deal the next task to worker 0 (see [`Dealer`][unienv_mp.backend.Dealer])."""

    def stats(self, reset: bool = False) -> SamplerStats:
        """Where the time went (see [`SamplerStats`][unienv_mp.SamplerStats])."""

    def close(self) -> None:
        """Stop the workers; idempotent."""


class TicketTable(dict):
    """ticket -> task, for every task submitted and not delivered or cancelled yet.
    Tickets are issued in increasing order from 0 and never reused.  A task is any object
    with ``ticket`` and ``cancelled`` attributes."""
    __slots__ = ("next_ticket",)

    def __init__(self):
        super().__init__()
        self.next_ticket = 0

    def issue(self, task):
        """Give ``task`` the next ticket and enter it; returns the ticket.  (Cut short,
        the ticket number may be lost, never issued twice.)"""
        ticket = self.next_ticket
        self.next_ticket = ticket + 1
        task.ticket = ticket
        self[ticket] = task
        return ticket

    def pending(self, ticket):
        """The task of ``ticket``; [`unknown_ticket`][unienv_mp.backend.unknown_ticket] if
        it is not in the table or was cancelled."""
        task = self.get(ticket)
        if task is None or task.cancelled:
            raise unknown_ticket(ticket)
        return task


class Dealer:
    """Which worker gets a task submitted without one: with ``in_order``, round-robin from
    worker 0 ([`reset`][unienv_mp.backend.Dealer.reset] starts again there), else the least
    loaded.

    Args:
        up: ``up(lane)``: whether a lane's worker is taking tasks; None: every worker is.
            A worker that is not taking tasks is passed over while another is: a task
            dealt to it would make the caller wait for its start (a worker started under
            spawn imports torch for a second or more).  Each manager says when its
            workers take tasks.
    """
    __slots__ = ("next", "up")

    def __init__(self, up=None):
        self.next = 0
        self.up = up

    def pick(self, lanes, in_order, load):
        """The lane for the next task, of ``lanes`` (a sequence, which may have grown
        since the last call); ``load(lane)``: how busy a lane is."""
        n, up = len(lanes), self.up
        if in_order:
            i = self.next % n
            if up is not None and not up(lanes[i]):
                for k in range(1, n):
                    if up(lanes[(i + k) % n]):
                        i = (i + k) % n
                        break
            self.next = (i + 1) % n
            return lanes[i]
        if up is None:
            return min(lanes, key=load)
        return min(lanes, key=lambda lane: (not up(lane), load(lane)))

    def reset(self):
        """Deal the next task to worker 0."""
        self.next = 0


def respawn_refusal(respawn, deaths, max_respawns):
    """Why a worker that has now died ``deaths`` times in a row without producing a result
    is not to be replaced, as the end of its error message; None if it is to be.

    Args:
        respawn: the manager's ``respawn``: False refuses every replacement.
        deaths: the worker's deaths in a row without a result, this one included.
        max_respawns: the replacements allowed in a row without a result: the next death
            is refused.
    """
    if not respawn:
        return "respawn=False"
    if deaths > max_respawns:
        return (f"it died {deaths} times in a row without producing a result "
                f"({max_respawns} replacements), giving up")
    return None


def unknown_ticket(ticket):
    """The error of a ticket call given a ticket that is not pending.

    Args:
        ticket: the ticket given.

    Returns:
        The ``KeyError`` to raise.
    """
    return KeyError(f"unknown, cancelled or already collected ticket {ticket}")


def none_pending(tickets):
    """The error of ``wait_any`` given no pending ticket.

    Args:
        tickets: the tickets waited on, named in the message.

    Returns:
        The ``KeyError`` to raise.
    """
    return KeyError(f"none of the tickets {list(tickets)!r} is pending")


def no_result(limit, worker=None):
    """The error of a wait that got no result within ``limit`` seconds (from ``worker``,
    if one is named).

    Args:
        limit: the seconds waited.
        worker: index of the worker waited on, or None.

    Returns:
        The ``TimeoutError`` to raise.
    """
    source = "" if worker is None else f" from worker {worker}"
    return TimeoutError(f"no result{source} within {limit} s")
