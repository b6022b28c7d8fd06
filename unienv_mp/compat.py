"""UniEnv's module-level helpers, with UniEnv's signatures, on unienv_mp's transport:
``worker_loop``, ``wrap_sample_function`` and ``wrap_epoch_iter_function``.  Code that
imported them from ``unienv_data.samplers.multiprocessing_sampler`` keeps working."""
import queue as _queue

from ._os import limit_threads
from ._process.manager import MultiProcessingSampleManager
from ._sampling.target import NO_ARG, SamplerTarget, draw_worker_seeds, epoch_batches
from .errors import CodecError, RingClosed, WorkerError, error_payload

__all__ = ["worker_loop", "wrap_sample_function", "wrap_epoch_iter_function"]


def worker_loop(fetch_fn, workid_queue, result_queue, done_event, doze_time=0.005,
                init_fn=None, seed=None):
    """UniEnv's worker loop, for code that runs its own workers with it: put
    ``fetch_fn(work)`` on ``result_queue`` for every ``work`` taken from ``workid_queue``
    until ``done_event`` is set or the work queue is closed.  Works with
    ``multiprocessing.Queue`` and [`ShmQueue`][unienv_mp.ShmQueue] alike.

    Unlike UniEnv's loop, an exception raised by ``fetch_fn`` does not kill the worker
    (leaving the consumer waiting forever): a [`WorkerError`][unienv_mp.WorkerError]
    describing it is put on ``result_queue`` instead, and the loop goes on.

    Args:
        fetch_fn: called on each work item, in this process.
        workid_queue: the queue the work items are taken from.
        result_queue: the queue the results are put on.
        done_event: a multiprocessing Event: the loop ends once it is set.
        doze_time: how long, in seconds, one wait for work lasts before the loop checks
            ``done_event`` again.
        init_fn: ``init_fn(seed)`` runs first, when both it and ``seed`` are given.
        seed: the seed given to ``init_fn``.
    """
    limit_threads()
    if init_fn is not None and seed is not None:
        init_fn(seed)
    try:
        while not done_event.is_set():
            try:
                work = workid_queue.get(timeout=doze_time)
            except _queue.Empty:
                continue
            except CodecError as e:   # one message that cannot be read: report it, go on
                result_queue.put(_as_worker_error(e))
                continue
            except (ValueError, OSError, EOFError, RingClosed):
                break   # the work queue was closed
            try:
                result = fetch_fn(work)
            except Exception as e:
                result = _as_worker_error(e)
            result_queue.put(result)
            del result
    except KeyboardInterrupt:
        pass
    finally:
        cancel = getattr(result_queue, "cancel_join_thread", None)
        if cancel is not None:
            cancel()


def _as_worker_error(e):
    info = error_payload(e)
    return WorkerError(info["type"], info["message"], info["traceback"],
                       e if info["exception"] is not None else None)


def _target_for(sampler, fn):
    if getattr(fn, "__self__", None) is sampler:
        return SamplerTarget(sampler), fn.__name__
    return SamplerTarget(sampler, fn), None


def _close_fn(wrapped):
    def close():
        manager = getattr(wrapped, "sample_manager", None)
        if manager is not None:
            manager.close()
            wrapped.sample_manager = None
    return close


def wrap_sample_function(sampler, n_workers, n_buffers, fn, ctx=None, doze_time=0.001,
                         daemon=None, done_event=None, exemplar_fn=None):
    """Return a function that, called with no argument, returns ``fn()`` computed by one of
    ``n_workers`` workers, ``n_buffers`` calls ahead (UniEnv's signature).  The workers
    start on the first call; ``.close()`` ends them.  ``exemplar_fn`` is accepted for
    compatibility and not needed: every result travels through shared memory.

    Args:
        sampler: the sampler whose method ``fn`` is, or whose data ``fn`` reads; it is
            sent to the workers.
        n_workers: worker processes.
        n_buffers: calls made ahead of the caller.
        fn: the function to run, with no argument (a method of ``sampler``, e.g.
            ``sampler.sample``).
        ctx: multiprocessing context or start method name; default: the current default.
        doze_time: how often a waiting side checks that the other is alive.
        daemon: passed to ``Process``.
        done_event: a multiprocessing Event: the workers stop when it is set.
        exemplar_fn: ignored.
    """
    target, name = _target_for(sampler, fn)

    def wrapped():
        manager = wrapped.sample_manager
        if manager is None:
            manager = MultiProcessingSampleManager(
                target, n_workers=n_workers, ctx=ctx, done_event=done_event,
                doze_time=doze_time, daemon=daemon, worker_init_fn=target.reseed,
                worker_seeds=draw_worker_seeds(sampler, n_workers))
            wrapped.sample_manager = manager
            for _ in range(n_buffers):
                manager.add_work((name, NO_ARG))
        manager.add_work((name, NO_ARG))
        return manager.fetch()

    wrapped.sample_manager = None
    wrapped.close = _close_fn(wrapped)
    return wrapped


def wrap_epoch_iter_function(sampler, n_workers, n_buffers, getter_fn, ctx=None,
                             doze_time=0.005, daemon=None, done_event=None):
    """Return a function that, called with no argument, iterates once over a random
    permutation of ``sampler.data`` in batches of ``sampler.batch_size``, each computed as
    ``getter_fn(indices)`` by a worker (UniEnv's signature: a new set of workers per
    epoch, ended when the epoch ends or the iteration is abandoned).

    Args:
        sampler: the sampler whose data is iterated; it is sent to the workers.
        n_workers: worker processes.
        n_buffers: batches requested ahead of the caller.
        getter_fn: ``getter_fn(indices)`` makes one batch (e.g. ``sampler.get_at``).
        ctx: multiprocessing context or start method name; default: the current default.
        doze_time: how often a waiting side checks that the other is alive.
        daemon: passed to ``Process``.
        done_event: a multiprocessing Event: the workers stop when it is set.
    """
    target, name = _target_for(sampler, getter_fn)

    def wrapped():
        manager = MultiProcessingSampleManager(
            target, n_workers=n_workers, ctx=ctx, done_event=done_event,
            doze_time=doze_time, daemon=daemon)
        wrapped.sample_manager = manager
        try:
            batches = epoch_batches(sampler)
            added = 0
            for _ in range(len(batches)):
                while added < len(batches) and manager.remaining_work <= n_buffers:
                    manager.add_work((name, batches[added]))
                    added += 1
                yield manager.fetch()
        finally:
            manager.close()
            if getattr(wrapped, "sample_manager", None) is manager:
                wrapped.sample_manager = None

    wrapped.sample_manager = None
    wrapped.close = _close_fn(wrapped)
    return wrapped
