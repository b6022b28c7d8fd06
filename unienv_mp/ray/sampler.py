"""RaySampler: `MultiprocessingSampler`'s API and stream of batches, with its workers on a
Ray cluster."""
import dataclasses
import math
import os
import threading
import weakref
from typing import Any, Callable, Dict, Optional

import ray
from unienv_data.base import BatchSampler

from .._direct import gather as _gather
from .._sampling import state as _state
from .._sampling.pools import check_persistent
from .._sampling.sampler import SamplerBase, default_chunk
from .._sampling.target import SamplerTarget
from .._validate import MAX_BATCHES_PER_TASK, MAX_BUFFERS, check_bool, check_int
from .manager import RayManager, check_cpus

__all__ = ["RaySampler", "RemoteSampler", "RemoteData"]

#: A Ray call carries tasks of up to about this many bytes of batches (at least 2 tasks
#: where they are smaller than _CALL_PAIR, and _CALL_FEW where the batches requested
#: ahead still make one call for each actor and one more) ...
_CALL_BYTES = 1 << 20
_CALL_PAIR = 64 << 20
_CALL_FEW = 4
#: ... and at most this many tasks.
_CALL_TASKS = 8
#: The default n_buffers keeps at most about this many bytes of batches requested (but
#: never fewer than 8 batches).
_AHEAD_BYTES = 256 << 20


# -- which Ray ------------------------------------------------------------------------------

_own_ray = threading.Lock()
_own_ray_users = 0   # open RaySamplers on the Ray this module started (0: none runs)
_own_ray_started = 0  # how many Rays this module started: names the one running


def _connect(address, cpus):
    """Make sure this process is connected to Ray: the one it is connected to already, the
    cluster at ``address``, a running cluster found as ``ray.init(address="auto")``
    finds one (``RAY_ADDRESS``, or one running on this machine), or else a new local
    Ray with ``cpus`` CPUs, or the machine's if it has more.  Returns a token for `_release`: the number of the Ray this module started
    if it is connected to that one (the caller is then one of its users), else None."""
    global _own_ray_users, _own_ray_started
    with _own_ray:
        if ray.is_initialized():
            if _own_ray_users:
                _own_ray_users += 1
                return _own_ray_started
            return None
        if address is not None:
            ray.init(address=address)
            return None
        try:
            ray.init(address="auto")
            return None
        except ConnectionError:
            ray.init(num_cpus=max(os.cpu_count() or 1, cpus), include_dashboard=False)
            _own_ray_started += 1
            _own_ray_users = 1
            return _own_ray_started


def _release(token):
    """A RaySampler whose ``_connect`` gave ``token`` is closed: shut the Ray this module
    started down once no open RaySampler uses it (unless it is gone: shut down by someone
    else, and maybe started again)."""
    global _own_ray_users
    if token is None:
        return
    with _own_ray:
        if token != _own_ray_started or not ray.is_initialized():
            return
        _own_ray_users -= 1
        if _own_ray_users == 0:
            ray.shutdown()


# -- the wrapped sampler, when it lives in the workers only --------------------------------

class RemoteData:
    """Stands in for the data of a sampler made by a ``sampler_factory``: its length and
    device (what epochs are drawn from).  The data itself is in the workers.

    Args:
        length: rows in the data (as the first actor's sampler has them).
        device: the data's device.
    """

    def __init__(self, length, device):
        self.length = length
        self.device = device

    def __len__(self):
        return self.length

    def __repr__(self):
        return (f"<RemoteData: {self.length} rows on {self.device}, held by the "
                f"RaySampler's workers>")


class RemoteSampler(BatchSampler):
    """Stands in, in the training process, for the sampler that a RaySampler's
    ``sampler_factory`` makes in each worker: its spaces, batch size, device and data
    length ([`RemoteData`][unienv_mp.ray.RemoteData]), and its random number generators,
    from which epochs draw their permutations.  ``manual_seed`` seeds the first worker's
    sampler and takes its generators from there (every worker reseeds its own per chunk);
    the ``get*_at`` methods run on a worker.

    Args:
        description: what the first actor says of its sampler: its spaces, batch size and
            device, its data's length and device, its random number generators, its
            methods and their bytes per row, and the configuration a checkpoint must match.
        manager: the [`RayManager`][unienv_mp.ray.RayManager] of the actors, which runs
            ``manual_seed`` and the ``get*_at`` methods.
        lock: held while the actors are asked (a RaySampler gives its own, so that these
            calls and its batches' do not interleave on the same actors); None: a new one.
    """

    def __init__(self, description, manager, lock=None):
        super().__init__(description["single_space"], description["single_metadata_space"],
                         description["batch_size"])
        self.description = description
        self.data = RemoteData(description["data_length"], description["data_device"])
        self._manager = manager
        self.lock = threading.RLock() if lock is None else lock
        _state.restore_rngs(self, description["rngs"])

    @property
    def device(self):
        return self.description["device"]

    @property
    def sampled_space(self):
        return self.description["sampled_space"]

    @property
    def sampled_metadata_space(self):
        return self.description["sampled_metadata_space"]

    def manual_seed(self, seed):
        with self.lock:
            rngs = self._manager.seeded_rngs(seed)
        _state.restore_rngs(self, rngs)

    def _on_a_worker(self, method, arg):
        manager, tickets = self._manager, []
        with self.lock:
            try:
                manager.submit((method, arg), record=tickets)
                return manager.result(tickets[0])
            except BaseException:
                for ticket in tickets:   # (cut short: its actor's slot goes back)
                    manager.cancel(ticket)
                raise

    def get_at(self, idx):
        return self._on_a_worker("get_at", idx)

    def get_at_with_metadata(self, idx):
        return self._on_a_worker("get_at_with_metadata", idx)

    def get_flattened_at(self, idx):
        return self._on_a_worker("get_flattened_at", idx)

    def get_flattened_at_with_metadata(self, idx):
        return self._on_a_worker("get_flattened_at_with_metadata", idx)

    def __len__(self):
        return len(self.data)


def _calls(sampler, batches_per_task, n_workers, n_buffers, tasks_per_call):
    """``(n_buffers, tasks_per_call)`` by default (see `RaySampler`), for the batches of
    ``sampler`` gathered directly (None: not gathered directly, their size not known)."""
    row = None
    if isinstance(sampler, RemoteSampler):
        row = sampler.description["rows"].get("sample")
    elif sampler is not None:
        row = _gather.row_nbytes(sampler, "sample")
    batch_size = 1 if sampler is None else sampler.batch_size
    k = batches_per_task if batches_per_task is not None else default_chunk(row, batch_size)
    if row is None:   # (the size of a batch is not known yet: see RaySampler._sized)
        return (8 if n_buffers is None else n_buffers), tasks_per_call or 2
    return _defaults(max(1, row * batch_size) * k, k, n_workers, n_buffers, tasks_per_call)


def _defaults(task_bytes, k, n_workers, n_buffers, tasks_per_call):
    """``(n_buffers, tasks_per_call)`` for tasks of ``k`` batches and ``task_bytes`` bytes:
    each given (not None) kept, the others by default (see `RaySampler`).  A default
    ``tasks_per_call`` is no more than the tasks ``n_buffers`` requests ahead give each
    actor: a call goes once its actor has that many waiting (or one is asked for), so a
    larger one would send nothing ahead."""
    group = tasks_per_call or _group(task_bytes, k, n_workers)
    if n_buffers is None:
        n_buffers = _depth(task_bytes, k, n_workers, group)
    if tasks_per_call is None:
        tasks_per_call = max(1, min(group, n_buffers // k // n_workers))
    return n_buffers, tasks_per_call


def _group(task_bytes, k, n_workers):
    """The default ``tasks_per_call`` for tasks of ``k`` batches and ``task_bytes`` bytes
    (see `RaySampler`)."""
    group = max(2 if task_bytes <= _CALL_PAIR else 1,
                min(_CALL_TASKS, _CALL_BYTES // task_bytes))
    if group < _CALL_FEW and (
            _depth(task_bytes, k, n_workers, _CALL_FEW) // (_CALL_FEW * k) > n_workers):
        group = _CALL_FEW   # (each call costs the caller ~0.4 ms of CPU)
    return group


def _weakly(method):
    """A callable that calls ``method`` (a ``WeakMethod``) if its object still lives."""
    def call(*args):
        bound = method()
        if bound is not None:
            bound(*args)
    return call


def _depth(task_bytes, k, n_workers, tasks_per_call):
    """The default ``n_buffers`` for tasks of ``k`` batches and ``task_bytes`` bytes:
    four calls per actor (with fewer, an actor's next call is at times sent too late, and
    the caller waits), up to ``_AHEAD_BYTES`` of batches, at least 8."""
    batch = max(1, task_bytes // k)
    return min(MAX_BUFFERS, max(8, min(4 * n_workers * tasks_per_call * k,
                                       _AHEAD_BYTES // batch)))


def _check_input(sampler, sampler_factory, direct_gather, batches_per_task, tasks_per_call):
    """Refuse a bad ``sampler``, ``sampler_factory``, ``direct_gather``,
    ``batches_per_task`` or ``tasks_per_call``; returns why the direct gather does not
    serve the sampler (None if it does, or if the factory's sampler is not known yet)."""
    if (sampler is None) == (sampler_factory is None):
        raise TypeError("RaySampler takes a sampler or a sampler_factory (one of them)")
    if sampler is not None and not isinstance(sampler, BatchSampler):
        raise TypeError(f"sampler must be a unienv_data BatchSampler (e.g. StepSampler), "
                        f"got {type(sampler).__module__}.{type(sampler).__qualname__}")
    if sampler_factory is not None and not callable(sampler_factory):
        raise TypeError(f"sampler_factory must be callable, got "
                        f"{type(sampler_factory).__name__}")
    for value, what in ((batches_per_task, "batches_per_task"),
                        (tasks_per_call, "tasks_per_call")):
        if value is not None:
            check_int(value, what, 1, MAX_BATCHES_PER_TASK)
    if direct_gather not in (None, True, False):
        raise TypeError(f"direct_gather must be None, True or False, got "
                        f"{direct_gather!r}")
    if direct_gather is False:
        return "direct_gather=False"
    if sampler is None:
        return None
    return _direct_refused(_gather.why_not(sampler), direct_gather)


def _direct_refused(reason, direct_gather):
    """``reason`` (why the direct gather does not serve the sampler, or None), unless
    ``direct_gather=True`` asked for it: then ``ValueError``."""
    if direct_gather and reason is not None:
        raise ValueError(f"direct_gather=True, but batches of this sampler cannot be "
                         f"gathered directly: {reason}")
    return reason


# -- the sampler ---------------------------------------------------------------------------

class RaySampler(SamplerBase):
    """[`MultiprocessingSampler`][unienv_mp.MultiprocessingSampler]'s API, with its workers
    on a Ray cluster: Ray actors instead of processes, object references instead of rings.

    For the same seed, the ``j``-th batch of each ``sample*`` method, and every epoch, is
    the same as [`MultiprocessingSampler`][unienv_mp.MultiprocessingSampler]'s (see its
    ``in_order``), for any ``n_workers`` and whatever actors die and are replaced; a
    ``state_dict()`` of either loads into the other.

    Args:
        sampler: the ``BatchSampler`` to run (e.g. a ``StepSampler``), put into Ray's
            object store once and read by every actor, replacements included ...
        n_workers: actors.
        n_buffers: batches requested ahead of the caller, per method.  By default
            enough for four calls per actor (see ``tasks_per_call``), up to 256 MiB of
            batches, and at least 8: for batches gathered directly, whose size is known,
            from the start; for others, 8 until the first batch comes, which tells their
            size.  It does not change the batches.
        sampler_factory: ... or, instead of ``sampler``, a callable (picklable by Ray)
            that each actor calls to make its own sampler: a dataset too large to ship is
            opened by each actor where it is (shared storage), never sent.  The training
            process then holds a [`RemoteSampler`][unienv_mp.ray.RemoteSampler], described
            by the first actor.
        num_cpus_per_worker: the CPUs Ray reserves for each actor.
        in_order: as for [`MultiprocessingSampler`][unienv_mp.MultiprocessingSampler].
        timeout: as for [`MultiprocessingSampler`][unienv_mp.MultiprocessingSampler];
            the wait for an actor's start counts (actors take a second or more), also
            here, with a ``sampler_factory``, for the first actor's description.
        respawn: as for [`MultiprocessingSampler`][unienv_mp.MultiprocessingSampler] (an
            actor that dies, ``ray.kill``-ed or with its node, is replaced and its
            outstanding tasks sent to the replacement; ``respawn=False`` raises
            [`WorkerDiedError`][unienv_mp.WorkerDiedError]).
        batches_per_task: as for
            [`MultiprocessingSampler`][unienv_mp.MultiprocessingSampler].
        copy: ``False`` (default): a batch's arrays are read zero-copy where they were
            made.  From an actor on this node, as from
            [`MultiprocessingSampler`][unienv_mp.MultiprocessingSampler]'s workers: views
            of the actor's result slot, which goes back to it once the batch is garbage
            collected.  From an actor on another node: views of Ray's object store, and
            **read-only**: numpy arrays are marked read-only (writing raises), and torch
            tensors, which cannot be marked, must not be written into (copy them first,
            e.g. ``.clone()``, or an in-place op such as ``div_`` changes Ray's stored
            object).  ``True``: every array is copied into memory of its own, writable,
            at the cost of a copy in the training process.
        max_respawns: replacements of one actor without a result in between before its
            next death raises [`WorkerDiedError`][unienv_mp.WorkerDiedError].
        address: the Ray cluster to join when this process is not connected to one yet
            (see below).
        actor_options: more options for the actors (Ray's ``ActorClass.options``), e.g.
            ``{"scheduling_strategy": ...}`` or ``{"resources": {...}}`` to place them on
            certain nodes, or a ``runtime_env``.
        tasks_per_call: tasks of one actor that travel together in one Ray call (and
            come back in one answer): Ray costs the training process a few hundred
            microseconds of CPU per call, whatever it carries.  By default, for batches
            gathered directly, as many as make up to 1 MiB, at most 8, and at least 4
            where the default ``n_buffers`` then still holds a call for every actor and
            one more, else at least 2 (1 for tasks over 64 MiB); for other batches,
            2 until the first batch's size is known, then the same rule; and never more
            than the tasks ``n_buffers`` requests ahead for each actor (a call waits for
            that many).  It does not change the batches.
        persistent_workers: as for
            [`MultiprocessingSampler`][unienv_mp.MultiprocessingSampler]: an epoch runs
            on actors that exist (the ``sample*`` actors, or those of an earlier epoch)
            while their copy of the data is the data as it is now, else on new actors
            sent the data as it is then, kept for the next epochs unless ``False``.
            Those reserve no CPUs in Ray (the ``sample*`` actors hold the sampler's
            reservation; an epoch waiting for CPUs they hold would wait for ever).  With
            a ``sampler_factory``, every epoch runs on the ``sample*`` actors (their data
            cannot be told from here).
        direct_gather: as for
            [`MultiprocessingSampler`][unienv_mp.MultiprocessingSampler]: ``None``
            (default) gathers batches directly where the sampler allows it (see
            ``gather_path``), ``False`` never, ``True`` raises ``ValueError`` where it
            cannot (checked in the first actor for a ``sampler_factory``).
        local_slots: ``True`` (default): actors on this node write batches into result
            slots that this process maps, as the process workers do, and Ray's object
            store carries only the batches of other nodes.  ``False``: every batch travels
            through the object store (e.g. where this process may not open the actors'
            descriptors through ``/proc``; that is also detected, and those batches then
            take the object store).

    Which Ray: the one this process is connected to (``ray.init(...)`` done by you); else
    the cluster at ``address``; else a running cluster as ``ray.init(address="auto")``
    finds one (``RAY_ADDRESS``, or the latest cluster started on this machine with ``ray
    start``); else a new local Ray, started for the samplers (with a CPU for each actor,
    or the machine's CPUs if it has more) and shut down when the last of them is closed.
    A Ray it did not start is never shut down.  Actors that do not fit in the cluster's
    CPUs wait until CPUs are free or nodes join (a ``RuntimeWarning`` says so when the
    cluster has fewer CPUs than the actors ask for).  An actor that has not started a
    second after another did is passed over: its batches are made by the actors that
    have started, and are the same.

    Workers see the data as it was when the sampler was made (or as ``sampler_factory``
    opens it): a buffer made with ``multiprocessing=True`` is not shared with them (its
    lock cannot travel to another machine; use a ``sampler_factory``).  The actors gather batches as the process
    workers do: straight into their place where the direct gather serves the sampler
    (``gather_path`` ``"direct"``), else by calling the wrapped sampler's methods.
    ``stall_timeout`` is not available.
    """

    def __init__(
        self,
        sampler: Optional[BatchSampler] = None,
        n_workers: int = 4,
        n_buffers: Optional[int] = None,
        *,
        sampler_factory: Optional[Callable[[], BatchSampler]] = None,
        num_cpus_per_worker: float = 1,
        in_order: bool = True,
        copy: bool = False,
        timeout: Optional[float] = None,
        respawn: bool = True,
        max_respawns: int = 3,
        batches_per_task: Optional[int] = None,
        address: Optional[str] = None,
        actor_options: Optional[Dict[str, Any]] = None,
        direct_gather: Optional[bool] = None,
        local_slots: bool = True,
        tasks_per_call: Optional[int] = None,
        persistent_workers: Optional[bool] = None,
    ):
        self._actors = None   # the RayManager (the sample* manager too, until close())
        self._ray_token = None
        not_direct = _check_input(sampler, sampler_factory, direct_gather,
                                  batches_per_task, tasks_per_call)
        n_workers = check_int(n_workers, "n_workers")
        num_cpus_per_worker = check_cpus(num_cpus_per_worker)
        local_slots = check_bool(local_slots, "local_slots")
        # (checked before the actors start; the property checks it again when it is set)
        check_persistent(persistent_workers)
        self._ray_token = _connect(address, math.ceil(n_workers * num_cpus_per_worker))
        self._manager_options = dict(
            factory=sampler_factory, in_order=in_order, copy=copy, timeout=timeout,
            respawn=respawn, max_respawns=max_respawns,
            num_cpus_per_worker=num_cpus_per_worker, actor_options=actor_options,
            direct=direct_gather is not False, local_slots=local_slots)
        try:
            manager = self._actors = self._new_actors(sampler, not_direct is None, n_workers)
            if sampler is None:
                sampler = RemoteSampler(manager.describe(), manager)
                not_direct = _direct_refused(sampler.description["not_direct"],
                                             direct_gather)
            self.sampler_factory = sampler_factory
            self.num_cpus_per_worker = num_cpus_per_worker
            self.max_respawns = max_respawns
            self.address = address
            self.actor_options = actor_options
            self.local_slots = local_slots
            self.direct_gather = direct_gather
            self._asked = (n_buffers, tasks_per_call)   # (see _sized)
            n_buffers, manager.group = _calls(
                sampler if not_direct is None else None, batches_per_task, n_workers,
                n_buffers, tasks_per_call)
            self.tasks_per_call = manager.group
            super().__init__(sampler, n_workers, n_buffers, in_order=in_order, copy=copy,
                             timeout=timeout, respawn=respawn,
                             batches_per_task=batches_per_task,
                             not_direct=not_direct, manager=manager,
                             persistent_workers=persistent_workers)
            if isinstance(sampler, RemoteSampler):
                sampler.lock = self.lock
            if not_direct is not None and None in self._asked:   # (weakly: no cycle)
                manager.sized = _weakly(weakref.WeakMethod(self._sized))
            if sampler_factory is None:   # (the data the actors were sent)
                self.sample_workers_have_current_data()
        except BaseException:
            self._close_actors()
            raise

    def _sized(self, work, task_bytes):
        """The answer of task ``work`` was ``task_bytes`` long: at the first chunk of a
        ``sample*`` stream, the default ``tasks_per_call`` and ``n_buffers`` (those the
        caller left out) for batches of that size (they are not gathered directly, so
        their size was not known before)."""
        if len(work) < 3 or work[0] == "sample_index":   # (not a chunk of batches)
            return
        self.n_buffers, self.tasks_per_call = _defaults(
            max(1, task_bytes), work[-1], self.n_workers, *self._asked)
        if self._actors is not None:
            self._actors.group = self.tasks_per_call
            self._actors.sized = None

    def _new_actors(self, sampler, direct, n_workers, **more):
        """A new `RayManager` of ``n_workers`` actors: each sent ``sampler`` as it is now
        (``direct``: gathering its batches directly), or, with a ``sampler_factory``, each
        making its own; ``more`` options replace the sampler's."""
        options = dict(self._manager_options, **more)
        target = None
        if options["factory"] is None:
            target = SamplerTarget(sampler, direct=direct)
        manager = RayManager(n_workers, target=target, **options)
        manager.group = getattr(self, "tasks_per_call", 1)
        return manager

    @property
    def workers(self):
        """The Ray actor handles (replacements included, after a respawn)."""
        return [] if self._actors is None else self._actors.workers

    def new_manager(self):
        # (an epoch's actors, sent the sampler as it is now: see epoch_manager)
        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")
        return self._new_actors(self.sampler, self.gather_path == "direct", self.n_workers,
                                num_cpus_per_worker=0)

    def epoch_manager(self):
        if self.sampler_factory is not None:   # (their data cannot be told from here)
            return super().epoch_manager()   # (every epoch on the sample* workers)
        return self.kept_epoch_manager()

    def sampler_methods(self):
        if isinstance(self.sampler, RemoteSampler):
            return list(self.sampler.description["methods"])
        return super().sampler_methods()

    def row_nbytes(self, name):
        if isinstance(self.sampler, RemoteSampler):
            return self.sampler.description["rows"].get(name)
        return super().row_nbytes(name)

    def configuration(self, methods):
        if not isinstance(self.sampler, RemoteSampler):
            return super().configuration(methods)
        methods = set(methods) | {n for n in self.sampler_methods() if n.startswith("sample")}
        out = dict(self.sampler.description["configuration"])
        out["chunks"] = {m: self.chunk_size(m) for m in methods}
        return out

    def stats(self, reset: bool = False):
        """As [`MultiprocessingSampler.stats`][unienv_mp.MultiprocessingSampler.stats];
        ``machine_idle_fraction`` is this machine's only while the Ray cluster is this
        machine alone (else None: the actors' machines are not measured)."""
        out = super().stats(reset)
        try:
            alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
            here = alive == [ray.get_runtime_context().get_node_id()]
        except Exception:   # (not connected to Ray any more)
            here = False
        return out if here else dataclasses.replace(out, machine_idle_fraction=None)

    def _close_actors(self):
        manager, self._actors = self._actors, None
        if manager is not None:
            manager.close()
        token, self._ray_token = self._ray_token, None
        _release(token)

    def close(self):
        """Kill the actors; batches already returned stay valid.  Shuts down a Ray that
        the samplers started once none of them is open.  Idempotent."""
        super().close()
        self._close_actors()

    def __repr__(self):
        state = "closed" if self.closed else f"{self.n_workers} Ray actors"
        return f"<{type(self).__name__} {state}>"
