"""A manager with no workers, for data that already lives on a GPU: each task runs in the
calling process when its result is asked for.

Worker processes cannot help there (each would need the GPU, and a forked child cannot use
CUDA), and the GPU gathers a batch in a fraction of the time a process hand-over takes.  So
the sampler keeps its streams, epochs and checkpoints (`SamplerBase`), and this manager runs
the work function of a worker (``SamplerTarget``) in place: ``submit`` only queues,
``result`` runs the task.  The stream of batches is the one a sampler with workers gives for
the same seed and chunks (``batches_per_task``; by default 8 here, so that the generators
are reseeded once per 8 batches); the work function runs on its own copy of the wrapped
sampler, so the wrapped sampler's RNG in this process is touched only by the epochs'
permutations, as with workers.  `ResidentTarget` makes the batches of a StepSampler over a
ReplayBuffer of tensors as one index draw and one ``index_select`` per array.

A chunk is gathered on the stream current when its task runs, and its later batches are
handed out at later calls, maybe while the caller has another stream current: each batch
comes tagged with where it was gathered (`unienv_mp._device.feed.Gathered`), and the feed's
hand-out orders the caller's stream after it (rule 10 of `unienv_mp._device.feed`).
"""
import time
from typing import Optional

from .. import stats as _stats
from .._direct import base as _base
from .._direct import gather as _gather
from .._direct import storages as _storages
from .._direct import unienv as _unienv
from ..backend import TicketTable, none_pending
from ..errors import WorkerError, error_payload
from .feed import Gathered

__all__ = ["InProcessManager", "own_target", "ResidentTarget"]


def own_target(target):
    """``target`` (a ``SamplerTarget``) as a worker process would get it: a shallow copy of
    its sampler whose RNGs are made afresh at the first task (see
    ``SamplerTarget.__getstate__``)."""
    twin = type(target).__new__(type(target))
    twin.__dict__.update(target.__getstate__())
    return twin


class ResidentTarget:
    """``target`` (a ``SamplerTarget``, see `own_target`), with ``sample`` and ``get_at`` of
    a StepSampler over a ReplayBuffer of tensors (on any device) made as one draw of indices
    and one ``index_select`` per array: what the wrapped sampler computes, without its
    layers.  Every other task, and samplers it cannot read (views, storages that compute
    their rows, ``device=`` on the sampler), run ``target`` itself.  The batches are the
    same either way, bit for bit (the same RNG draws, the same rows).

    ``mark``: None, or a function called once a task's batches are made, returning
    ``(stream, event)`` (`unienv_mp._device.feed.DeviceFeed.gathered_on`): each batch then
    comes back as a `unienv_mp._device.feed.Gathered`."""

    def __init__(self, target, mark=None):
        self.target = target
        self.batches_in = target.batches_in
        self.mark = mark
        self._trees = None   # getter -> tree of source tensors (None: not planned yet)

    def _tree(self, getter):
        trees = self._trees
        if trees is None:
            trees = self._trees = {}
            try:
                planner = _gather.Planner(self.target.sampler, on_device=True)
                if planner.buffer is not None:
                    trees["get_at"] = _sources(planner.structure("get_at"))
            except Exception:
                pass   # (NotDirect, or anything the planner trips on: the target's way)
        return trees.get(getter)

    def __call__(self, work):
        value = self._make(work)
        mark = self.mark
        if mark is None:
            return value
        stream, event = mark()
        if len(work) > 2:   # (a chunk: a tuple of batches, see chunk_work)
            return tuple([Gathered(b, stream, event) for b in value])
        return Gathered(value, stream, event)

    def _make(self, work):
        name = work[0]
        if name == "sample" and len(work) > 2:
            tree = self._tree("get_at")
            if tree is not None:
                target = self.target
                _, seeds, k = target.chunk_of(work)
                sample_index = target.sampler.sample_index
                buffer = target.sampler.data
                out = []
                for i in range(k):
                    target.reseed_for(seeds, i)
                    out.append(_gather_rows(tree, _base.sampled_rows(buffer,
                                                                     sample_index())))
                return tuple(out)
        elif name == "get_at" and len(work) == 2 and _base.is_index_tensor(work[1]):
            tree = self._tree("get_at")
            if tree is not None:
                rows = _unienv.logical_to_physical(self.target.sampler.data, work[1])
                return _gather_rows(tree, rows)
        return self.target(work)


def _sources(tree):
    """The source tensor of each leaf of a planned structure; NotDirect unless every leaf
    is one whole source of its own row shape and dtype."""
    if isinstance(tree, dict):
        return {k: _sources(v) for k, v in tree.items()}
    if isinstance(tree, _storages.Leaf) and tree.direct and tree.columns is None:
        return tree.parts[0][0]
    raise _base.NotDirect("a leaf that is not one whole tensor")


def _gather_rows(tree, rows):
    if isinstance(tree, dict):
        return {k: _gather_rows(v, rows) for k, v in tree.items()}
    return tree.index_select(0, rows)


class _Task:
    __slots__ = ("ticket", "work", "cancelled")

    def __init__(self, work):
        self.ticket = None
        self.work = work
        self.cancelled = False


class InProcessManager:
    """The manager contract (`Manager`) with no workers: ``target_fn(work)`` runs in this
    process at `result`.  A task that raises gives `WorkerError` carrying its traceback, as
    from a worker."""
    n_workers = 0

    def __init__(self, target_fn, *, in_order=True):
        self.target_fn = target_fn
        self.in_order = in_order
        self.closed = False
        self._tasks = TicketTable()
        self._batches_in = getattr(target_fn, "batches_in", None)
        self._caller = _stats.CallerRecord()

    def _ensure_open(self):
        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")

    def submit(self, work, worker: Optional[int] = None, *, record=None) -> int:
        self._ensure_open()
        if worker is not None:
            raise ValueError("this manager has no workers to choose from")
        if self._caller.since_ns is None:
            self._caller.begin()
        ticket = self._tasks.issue(_Task(work))
        if record is not None:
            record.append(ticket)
        return ticket

    def ready(self, ticket: int) -> bool:
        self._ensure_open()
        self._tasks.pending(ticket)
        return True   # (made when it is asked for)

    def wait_any(self, tickets, timeout: Optional[float] = None) -> int:
        self._ensure_open()
        for t in tickets:
            task = self._tasks.get(t)
            if task is not None and not task.cancelled:
                return t
        raise none_pending(tickets)

    def result(self, ticket: int, timeout: Optional[float] = None):
        self._ensure_open()
        task = self._tasks.pending(ticket)
        t0 = time.monotonic_ns()
        try:
            value = self.target_fn(task.work)
        except Exception as e:
            del self._tasks[ticket]
            raise WorkerError.from_payload(error_payload(e), 0, "(in this process) ") from e
        finally:
            self._caller.waited(t0, time.monotonic_ns(), 0)
        del self._tasks[ticket]
        batches_in = self._batches_in
        self._caller.batches += 1 if batches_in is None else batches_in(task.work)
        return value

    def cancel(self, ticket: int) -> None:
        self._tasks.pop(ticket, None)

    def reset_order(self) -> None:
        pass   # (no workers to deal to)

    def stats(self, reset: bool = False):
        return self._caller.report(0, [], time.monotonic_ns(), reset)

    def close(self) -> None:
        self.closed = True
        self._tasks.clear()

    def __repr__(self):
        state = "closed" if self.closed else f"{len(self._tasks)} pending"
        return f"<{type(self).__name__} in this process, {state}>"

