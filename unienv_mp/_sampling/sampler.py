"""MultiprocessingSampler: the drop-in for ``unienv_data.samplers.MultiprocessingSampler``.

    from unienv_mp import MultiprocessingSampler   # was: from unienv_data.samplers import ...

With `unienv_mp._sampling.target` and `unienv_mp._direct.gather`, the only modules of the
package that know UniEnv (with `unienv_mp._sampling.fingerprint`).  One manager of worker
processes serves every ``sample*`` method of the wrapped sampler (UniEnv starts one per
method), and epochs too when the data is shared between processes, or when its copy of
the data is still the data as it is now; otherwise an epoch runs on a manager started
when the epoch starts, so that it sees the data as it is then (as UniEnv's epochs do),
and kept for the next epochs while the data does not change (``persistent_workers``).  Batches come
back through shared-memory slots as zero-copy views (see
`MultiProcessingSampleManager`).
"""
import dataclasses
import os
import threading
import time
import warnings
from typing import Any, Optional

from unienv_data.base import BatchSampler

from .. import _os
from .. import stats as _stats
from .._device.feed import keep_in_forked_child, make_feed
from .._device.handout import DeviceHandOut
from .._device.placement import device_type, place
from .._device.resident import InProcessManager, ResidentTarget, own_target
from .._direct import gather as _gather
from .._process.manager import CLOSE_WAIT, CopyLost, MultiProcessingSampleManager
from .._validate import (MAX_BATCHES_PER_TASK, MAX_BUFFERS, check_bool, check_context,
                         check_doze_time, check_int, check_seconds, check_workers,
                         physical_memory)
from ..errors import WorkerError
from . import checkpoints as _checkpoints
from .ahead import depth
from .delegates import forwarded, passed_on
from .epochs import Epochs
from .pools import Pools, check_persistent
from .state import give_rngs
from .streams import Stream, base_seed, forget_all, forget_requests
from .target import SamplerTarget

__all__ = ["SamplerBase", "MultiprocessingSampler"]

#: Batches smaller than this are made several to a task (see ``batches_per_task``) ...
_CHUNK_BYTES = 1 << 20
#: ... at most this many.
_CHUNK_MAX = 8


def check_batch_sampler(sampler):
    """Raise TypeError unless ``sampler`` is a UniEnv BatchSampler."""
    if not isinstance(sampler, BatchSampler):
        raise TypeError(f"sampler must be a unienv_data BatchSampler (e.g. StepSampler), "
                        f"got {type(sampler).__module__}.{type(sampler).__qualname__}")


def _check_cpu(sampler, who):
    """Raise ValueError unless ``sampler``'s batches and data are on the CPU."""
    data_device = getattr(getattr(sampler, "data", None), "device", None)
    for what, dev in (("sampler.device", sampler.device),
                      ("sampler.data.device", data_device)):
        if device_type(dev) != "cpu":
            raise ValueError(
                f"{who} returns CPU batches from its workers, but {what} is {dev!r}: wrap "
                f"a sampler whose data and batches are on the CPU and move batches to "
                f"{dev!r} in the training loop")


def _checked(n_buffers, timeout, in_order, copy, respawn, pin_memory, batches_per_task):
    """The options every backend has, checked, in this order (``n_workers`` is checked by
    the backend, which bounds it its own way)."""
    n_buffers = check_int(n_buffers, "n_buffers", 1, MAX_BUFFERS,
                          "batches requested ahead, each holding shared memory")
    timeout = check_seconds(timeout, "timeout")
    in_order = check_bool(in_order, "in_order")
    copy = check_bool(copy, "copy")
    respawn = check_bool(respawn, "respawn")
    pin_memory = check_bool(pin_memory, "pin_memory")
    if batches_per_task is not None:
        batches_per_task = check_int(
            batches_per_task, "batches_per_task", 1, MAX_BATCHES_PER_TASK,
            "a worker holds a task's batches together, in one slot")
    return n_buffers, timeout, in_order, copy, respawn, pin_memory, batches_per_task


def _extra_methods(s):
    """Every other sample* / get*_at method of the wrapped sampler runs in the workers
    too (as UniEnv does): sample_x() directly, get_at_x as epoch_iter_x(), and
    get_flattened_at_x as epoch_flat_iter_x().  Made on access (see
    ``SamplerBase.__getattr__``), so that the sampler holds no reference to itself."""
    extra = {}
    for name in s.sampler_methods():
        if name.startswith("sample"):
            new, kind = name, _StreamMethod
        elif name.startswith("get_at"):
            new, kind = "epoch_iter" + name[len("get_at"):], _EpochMethod
        else:
            new, kind = "epoch_flat_iter" + name[len("get_flattened_at"):], _EpochMethod
        if not hasattr(type(s), new):
            extra[new] = (kind, name)
    return extra


def default_chunk(row, batch_size):
    """Batches per task where ``batches_per_task`` is not given: for batches gathered
    directly, ``row`` bytes per row, as many as fit in 1 MiB (at most 8); else (``row``
    None) 1."""
    if row is None:
        return 1
    return max(1, min(_CHUNK_MAX, _CHUNK_BYTES // max(1, row * batch_size)))


def _warn_copy_lost(error):
    warnings.warn(f"unienv_mp: {error}; the sample* batches go on from new workers, over "
                  f"the data as it is now (from here on they differ from those of a "
                  f"sampler whose workers had not died)", RuntimeWarning, stacklevel=4)


def _sampling(name, doc):
    """The sampler's method ``name()``: the next batch of ``name``'s stream."""
    def method(self):
        if self._hand_out is None:   # (CPU batches: one call less per batch)
            return self._sample(name)
        return self._next(name)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = doc
    return method


def _epoch_of(name, getter):
    """The sampler's method ``name()``: an epoch iterator over ``getter``."""
    def method(self):
        return self._epoch(getter)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = (f"As [`epoch_iter`][unienv_mp.sampler.SamplerBase.epoch_iter], with "
                      f"``{getter}``.")
    return method


def _check_memory(s, k):
    """Refuse ``n_buffers`` and ``batches_per_task`` of sampler ``s`` (tasks of ``k``
    batches) whose batches in flight would need more than half of this machine's memory,
    where their size is known before any is made (batches gathered directly)."""
    row = s.row_nbytes("sample")
    memory = physical_memory()
    if row is None or memory is None:
        return
    batch = row * s.batch_size
    need = (s.n_buffers + k) * batch
    if need > memory // 2:
        raise ValueError(
            f"n_buffers={s.n_buffers} batches requested ahead (and tasks of {k}) of "
            f"{batch / 1e6:.3g} MB each would need {need / 1e9:.3g} GB of shared "
            f"memory, more than half of this machine's {memory / 1e9:.3g} GB")


class SamplerBase(BatchSampler):
    """The training process's side of a sampler whose batches are made by workers: the
    ``sample*`` streams and their chunks, epochs, seeds and checkpoints,
    [`stats`][unienv_mp.sampler.SamplerBase.stats] and the lifecycle.  It owns its parts:
    its managers of workers (a `Pools`), its epochs (an `Epochs`), and the wrapped sampler,
    whose properties it passes on.  A manager runs the workers: a
    [`MultiProcessingSampleManager`][unienv_mp.MultiProcessingSampleManager], or any
    [`Manager`][unienv_mp.backend.Manager].
    [`MultiprocessingSampler`][unienv_mp.MultiprocessingSampler] runs them as processes,
    [`unienv_mp.ray.RaySampler`][unienv_mp.ray.RaySampler] as Ray actors; both give the same
    stream of batches for the same seed.

    Its constructor takes [`MultiprocessingSampler`][unienv_mp.MultiprocessingSampler]'s
    options less the process backend's (``ctx``, ``doze_time``, ``daemon``,
    ``shared_memory``, ``direct_gather``, ``stall_timeout``), ``n_workers`` checked already
    (each backend bounds it its own way, where it enters), ``persistent_workers``
    defaulting to False (a backend that keeps no workers for epochs), and ``not_direct``: None if the workers gather batches directly (see
    `unienv_mp._direct.gather`), else why not; ``manager``: the ``sample*`` workers'
    manager, if the subclass made it already (any [`Manager`][unienv_mp.backend.Manager]);
    ``placement``: where batches go (`unienv_mp._device.placement`; None: the CPU only).

    Extending (the methods a backend overrides; nothing else is meant to be):
    [`new_manager`][unienv_mp.sampler.SamplerBase.new_manager] returns a new manager of
    workers running ``SamplerTarget(self.sampler)`` (required);
    [`sampler_methods`][unienv_mp.sampler.SamplerBase.sampler_methods] the wrapped sampler's
    method names; [`row_nbytes`][unienv_mp.sampler.SamplerBase.row_nbytes] a batch row's
    size in bytes, or None; [`configuration`][unienv_mp.sampler.SamplerBase.configuration]
    what a saved state must match;
    [`epoch_manager`][unienv_mp.sampler.SamplerBase.epoch_manager] the manager an epoch runs
    on; [`check_epoch`][unienv_mp.sampler.SamplerBase.check_epoch] refuses an epoch (by
    raising); [`chunk_size`][unienv_mp.sampler.SamplerBase.chunk_size] the batches per
    task of a method.  What a backend may use:
    [`kept_epoch_manager`][unienv_mp.sampler.SamplerBase.kept_epoch_manager] (epochs by the
    ``persistent_workers`` rule),
    [`sample_workers_have_current_data`][unienv_mp.sampler.SamplerBase.sample_workers_have_current_data],
    [`lock`][unienv_mp.sampler.SamplerBase.lock],
    [`gather_path`][unienv_mp.sampler.SamplerBase.gather_path] and
    [`closed`][unienv_mp.sampler.SamplerBase.closed].
    """

    def __init__(self, sampler, n_workers, n_buffers, *, in_order, copy, timeout, respawn,
                 batches_per_task, not_direct, manager=None, placement=None,
                 pin_memory=False, persistent_workers=False):
        self._closed = True   # first: __del__ -> close() must work on a half-built sampler
        # (the sample* manager made on first use, if None)
        self._pools = Pools(sampler, manager)
        self._feed = None        # (see _choose_hand_out)
        self._hand_out = None
        self._owner_pid = os.getpid()
        # Held by every call but close() (see "Threads" in MultiprocessingSampler's
        # docstring); re-entrant, for a call from a signal handler in the middle of one.
        self._lock = threading.RLock()
        check_batch_sampler(sampler)
        (n_buffers, timeout, in_order, copy, respawn, pin_memory,
         batches_per_task) = _checked(n_buffers, timeout, in_order, copy, respawn,
                                      pin_memory, batches_per_task)
        super().__init__(sampler.single_space, sampler.single_metadata_space,
                         sampler.batch_size)
        self._direct = not_direct is None
        self._not_direct = not_direct
        self.sampler = sampler
        self._placement, self.pin_memory = placement, pin_memory
        self.n_workers = n_workers
        self.n_buffers = n_buffers
        self.in_order = in_order
        self.copy = copy
        self.timeout = timeout
        self.respawn = respawn
        self.batches_per_task = batches_per_task
        _check_memory(self, self.chunk_size("sample"))
        self._feed, self._hand_out = self._choose_hand_out()
        self._caller = _stats.CallerRecord()   # batches handed out (see stats)
        self._epochs = Epochs(self._pools, self._lock, self._caller, self._hand_out)
        self._base = base_seed(sampler)
        self._per_batch = True      # (False: streams of a state of unienv_mp 0.1)
        self._streams = {}          # method -> Stream
        self._extra = _extra_methods(self)   # (the wrapped sampler's other methods)
        self._pools.persistent = check_persistent(persistent_workers)
        self._closed = False

    def __getattr__(self, attr):
        # only reached for attributes not found the normal way
        extra = self.__dict__.get("_extra")
        if extra is not None and attr in extra:
            kind, name = extra[attr]
            return kind(self, name, self._next if kind is _StreamMethod else self._epoch)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self.__dict__.get("_extra", ())))

    # -- the hooks of a backend (see "Extending") ------------------------------------------

    def new_manager(self):
        """A new [`Manager`][unienv_mp.backend.Manager] whose workers each run
        ``SamplerTarget(self.sampler)`` on a copy of the sampler of their own, even in the
        caller's process (e.g. ``copy.deepcopy(self.sampler)``).  Required."""
        raise NotImplementedError

    def sampler_methods(self):
        """The wrapped sampler's ``sample*``, ``get_at*`` and ``get_flattened_at*``
        methods, by name."""
        sampler = self.sampler
        return [name for name in dir(sampler)
                if name.startswith(("sample", "get_at", "get_flattened_at"))
                and callable(getattr(sampler, name, None))]

    def row_nbytes(self, name):
        """Bytes per batch row of ``name``'s batches if they can be gathered directly,
        else None (see [`unienv_mp.gather.row_nbytes`][unienv_mp.gather.row_nbytes]): what
        the default chunk size is made from."""
        return _gather.row_nbytes(self.sampler, name)

    def configuration(self, methods):
        """What a state must match to be loaded (see
        [`load_state_dict`][unienv_mp.sampler.SamplerBase.load_state_dict]): the wrapped
        sampler's configuration and the batches per task of ``methods`` and of every
        ``sample*`` method."""
        return _checkpoints.configuration(self, methods, self.chunk_size)

    def epoch_manager(self):
        """``(manager, own)``: the manager an epoch starting now runs on, and whether it
        is the epoch's own (closed when the epoch ends) or one that outlives it.  It
        notes why (see [`epoch_workers`][unienv_mp.sampler.SamplerBase.epoch_workers]).
        Here: the ``sample*`` manager."""
        self._pools.every_epoch_on_sample_workers()
        return self._ensure_manager(), False

    def kept_epoch_manager(self):
        """``(manager, own)`` for an epoch starting now, by the ``persistent_workers``
        rule: workers that exist if their copy of the data is the data as it is now,
        else new ones (kept for the next epochs unless ``persistent_workers=False`` or
        whether the data changed cannot be told: then the epoch's own).  For an
        [`epoch_manager`][unienv_mp.sampler.SamplerBase.epoch_manager] that keeps
        workers between epochs."""
        return self._pools.epoch_manager(self.new_manager)

    def sample_workers_have_current_data(self):
        """Note that the ``sample*`` manager given to the constructor was handed the data
        as it is now, so that epochs may run on its workers while the data stays so (see
        [`kept_epoch_manager`][unienv_mp.sampler.SamplerBase.kept_epoch_manager])."""
        self._pools.note_sample_copy()

    def check_epoch(self, getter):
        """Called when an epoch iterator of ``getter`` is made, before it starts: raise to
        refuse it.  Here: nothing."""

    # -- the manager -----------------------------------------------------------------------

    def _ensure_open(self):
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")
        if _os.pid != self._owner_pid:
            # (its batches ready here are the parent's too: none is handed out)
            _os.refuse_child(self, self._owner_pid, ", and its batches ready are the "
                                  "parent's.  Make a new sampler in the child")

    def _ensure_manager(self):
        self._ensure_open()
        self._start_clock()
        return self._pools.sample_manager(self.new_manager)

    def _start_clock(self):
        """stats() counts from the first request."""
        if self._caller.since_ns is None:
            self._caller.begin()

    def _sample(self, name):
        # Runs once per batch.  Every attribute read on this class goes through
        # __getattribute__ and then its __getattr__ hook: each is read once here.
        with self._lock:
            pools = self._pools
            manager = pools.sample
            if manager is None or self._closed or _os.pid != self._owner_pid:
                manager = self._ensure_manager()
            elif pools.watch and pools.sample_moved():
                manager = self._sample_pool_moved(manager)
            stream = self._streams.get(name)
            if stream is None:
                stream = Stream(name, self.chunk_size(name), self._base, self._per_batch)
                self._streams[name] = stream
            ready = stream.ready
            tickets = stream.tickets
            k = stream.k
            # (how many are kept requested ahead, and why: see ahead.depth)
            n_buffers = self.n_buffers
            if ready and len(ready) + k * len(tickets) > n_buffers:
                self._caller.batches += 1
                return ready.popleft()
            if self._caller.since_ns is None:
                self._start_clock()   # (a manager made before the first request)
            try:
                first = not (ready or tickets)   # (nothing requested yet)
                stream.top_up(manager.submit, depth(n_buffers, first))
                if ready:
                    self._caller.batches += 1
                    return ready.popleft()
                ticket = tickets[0] if self.in_order else manager.wait_any(tickets)
                # (a WorkerError skips the chunk's batches; the other requests stand)
                stream.collect(ticket, manager.result)
                if first:
                    stream.top_up(manager.submit, depth(n_buffers, False))
                self._caller.batches += 1
                return ready.popleft()
            except WorkerError:
                raise
            except CopyLost as e:
                # (every worker gone, none can start from their copy: the stream goes on,
                # from new workers over the data as it is now)
                # (every method's requests were to those workers)
                forget_all(manager, self._streams.values())
                self._pools.retire_sample()
                _warn_copy_lost(e)
                return SamplerBase._sample(self, name)
            except BaseException:
                forget_requests(manager, stream)
                raise

    def _sample_pool_moved(self, manager):
        """The ``sample*`` workers read data that moved away from them (see
        `Pools.sample_moved`): every batch they made or will make is dropped and asked for
        again from a new pool, over the data as it is now; the streams go on in order."""
        forget_all(manager, self._streams.values(), ready=True)
        self._pools.retire_moved()
        return self._ensure_manager()

    def chunk_size(self, name):
        """How many batches of the ``sample*`` method ``name`` a worker makes per task:
        ``batches_per_task`` if given, else as many as fit in 1 MiB (at most 8) for
        batches gathered directly, else 1.  It depends on the wrapped sampler and the
        options alone (not on ``n_workers`` or ``n_buffers``), since the stream of
        batches does; a checkpoint records it."""
        k = self.batches_per_task
        if k is not None:
            return k
        return default_chunk(self.row_nbytes(name), self.batch_size)

    def _choose_hand_out(self):
        """``(feed, hand-out)``: where batches are handed out on a device or page-locked,
        the device feed and the `DeviceHandOut` that passes every batch through it; else
        ``(None, None)``: CPU batches, handed out as they come (a sampler with no placement,
        Ray's, takes CPU batches only)."""
        if self._placement is None:
            _check_cpu(self.sampler, type(self).__name__)
        if self.pin_memory and self.copy:
            raise ValueError("pin_memory=True hands out batches in their page-locked "
                             "slots, and copy=True copies them out of their slots: "
                             "choose one")
        # (the feed asks the pools, which hold no reference to the sampler: nothing here
        # refers back to the sampler, which a user's last reference then frees)
        feed = make_feed(self._placement, self.pin_memory, self._pools.slot_segments)
        return feed, (None if feed is None else DeviceHandOut(feed))

    def _next(self, name):
        """The next batch of ``name``'s stream, as this sampler hands batches out."""
        hand_out = self._hand_out
        if hand_out is None:
            return self._sample(name)
        with self._lock:
            return hand_out.sample(name, self._sample, self._streams, self._caller,
                                   self._pools, self.in_order)

    def stats(self, reset: bool = False):
        """Where the time went since the first request (or the last ``stats(reset=True)``),
        as a [`SamplerStats`][unienv_mp.SamplerStats]: batches handed out, the time spent
        waiting for them, the batches ready, each worker's counters, and the bottleneck.
        The workers are the ``sample*`` workers (or, before there are any, those kept for
        epochs, or those of the epoch being iterated).  ``reset=True``: the counters start
        again from zero once this is read."""
        with self._lock:
            now = time.monotonic_ns()
            pools = self._pools
            ready = sum(len(st.ready) for st in self._streams.values())
            wait_ns, startup_ns, in_flight, workers = pools.stats(reset)
            caller = self._caller
            caller.wait_ns = wait_ns
            caller.startup_ns = startup_ns
            out = caller.report(ready + in_flight, workers or [], now, reset)
            if reset:
                pools.ended_wait_ns = 0
                pools.ended_startup_ns = 0
            feed = self._feed
            device = None if feed is None else feed.stats(reset=reset)
            return dataclasses.replace(out, gather_path=self.gather_path, device=device,
                                       epoch_workers=self.epoch_workers,
                                       epoch_workers_reason=self.epoch_workers_reason)

    @property
    def gather_path(self):
        """``"direct"``: workers gather ``sample()`` and epoch batches straight into the
        shared slots (see ``direct_gather``); ``"generic"``: they call the wrapped
        sampler's methods
        ([`gather_path_reason`][unienv_mp.sampler.SamplerBase.gather_path_reason] says why);
        ``"in_process"``: the data is on a GPU, and batches are made in this process (no
        workers)."""
        placement = self._placement
        if placement is not None and placement.kind == "in_process":
            return "in_process"
        return "direct" if self._direct else "generic"

    @property
    def gather_path_reason(self):
        """Why [`gather_path`][unienv_mp.sampler.SamplerBase.gather_path] is ``"generic"``
        (None when it is ``"direct"``)."""
        return self._not_direct

    # -- sampling -------------------------------------------------------------------------

    sample = _sampling("sample", "A batch from the wrapped sampler's ``sample()``, "
                                 "produced by a worker.")
    sample_flat = _sampling("sample_flat", "A batch from the wrapped sampler's "
                                           "``sample_flat()``, produced by a worker.")
    sample_with_metadata = _sampling("sample_with_metadata", "``(batch, metadata)`` from "
                                     "the wrapped sampler, produced by a worker.")
    sample_flat_with_metadata = _sampling("sample_flat_with_metadata", "``(flat batch, "
                                          "metadata)`` from the wrapped sampler, produced "
                                          "by a worker.")
    sample_index = _sampling("sample_index", "Indices from the wrapped sampler's "
                                             "``sample_index()``, drawn by a worker.")

    # -- epochs (see unienv_mp._sampling.epochs) -------------------------------------------

    def _epoch(self, getter):
        self.check_epoch(getter)
        return self._epochs.run(self, getter, self._ensure_open)

    def epoch_iter(self):
        """One pass over a random permutation of the data (drawn here, with the wrapped
        sampler's RNG), each batch gathered by a worker with ``get_at``; every index
        exactly once, the last partial batch included."""
        return self._epoch("get_at")

    epoch_iter_with_metadata = _epoch_of("epoch_iter_with_metadata", "get_at_with_metadata")
    epoch_flat_iter = _epoch_of("epoch_flat_iter", "get_flattened_at")
    epoch_flat_iter_with_metadata = _epoch_of("epoch_flat_iter_with_metadata",
                                              "get_flattened_at_with_metadata")

    def __iter__(self):
        return self.epoch_iter()

    @property
    def epoch_workers(self):
        """Which workers the latest epoch began on: ``"kept"`` (workers that were already
        running: the ``sample*`` workers, or those of an earlier epoch), ``"new"``
        (workers started for it), ``"in_process"`` (no workers: the data is on a GPU), or
        None before the first epoch.
        [`epoch_workers_reason`][unienv_mp.sampler.SamplerBase.epoch_workers_reason] says
        why (see ``persistent_workers``)."""
        return self._pools.epoch_workers[0]

    @property
    def epoch_workers_reason(self):
        """Why the latest epoch began on
        [`epoch_workers`][unienv_mp.sampler.SamplerBase.epoch_workers], in words: for
        example ``"the data is unchanged since they started"``, ``"the data changed since
        the workers started"``, or ``"whether the data changed cannot be told: a custom
        function (my_mask), which may read anything (persistent_workers=True promises that
        it does not)"``.  None before the first epoch."""
        return self._pools.epoch_workers[1]

    # -- seeds and checkpoints (see unienv_mp._sampling.checkpoints) -----------------------

    def manual_seed(self, seed):
        """Seed the wrapped sampler.  Batches already requested are dropped, so that what
        follows is the same as from a fresh sampler seeded with ``seed``: the ``sample*``
        streams start again from their first batch, and the next epoch draws its
        permutation from the new seed."""
        with self._lock:
            with _os.interrupts_deferred():   # (one step: a Ctrl-C cannot cut it in two)
                self.sampler.manual_seed(seed)
                self._drop_streams()
                self._base = base_seed(self.sampler)
                self._per_batch = True
                self._epochs.resume = {}

    def _drop_streams(self):
        """Cancel what every stream requested and forget the streams (the batches of a
        chunk not handed out yet go with them)."""
        manager = self._pools.sample
        streams, self._streams = self._streams, {}
        if manager is not None and not manager.closed:
            for stream in streams.values():
                for t in stream.tickets:
                    manager.cancel(t)

    def state_dict(self):
        """Everything needed to go on from here, as a small picklable dict: the seed of
        the ``sample*`` streams and how far each was handed out, the wrapped sampler's
        RNGs (from which the next epochs' permutations are drawn), and the epochs being
        iterated, in the order they started (each one's permutation and which of its
        batches were handed out).  Batches requested ahead but not handed out yet are not
        part of it.  See
        [`load_state_dict`][unienv_mp.sampler.SamplerBase.load_state_dict]."""
        with self._lock:
            return _checkpoints.state_of(self, self._streams, self._base, self._per_batch,
                                          self._epochs)

    def load_state_dict(self, state):
        """Go on from ``state`` (from
        [`state_dict`][unienv_mp.sampler.SamplerBase.state_dict] of a sampler built the same
        way: the same kind of wrapped sampler, batch size, data length, batch structure and
        ``batches_per_task``; ``n_workers``, ``n_buffers``, the start method and
        ``direct_gather`` may differ, in this process or another).  The next batches of each
        ``sample*`` method are those the original sampler would have handed out next.  If
        epochs were being iterated, the next epoch iterators of the same kind yield exactly
        the rest of each, in the order they started, and the one after them starts a new
        epoch as the original's would have.  Raises ``ValueError`` (saying what differs) for
        a state of another configuration, or one that is not a whole state; the sampler is
        then as it was."""
        with self._lock:
            base, per_batch, rngs, streams, resume = _checkpoints.read_state(
                self, state, self.chunk_size)
            with _os.interrupts_deferred():   # (one step: a Ctrl-C cannot cut it in two)
                self._drop_streams()
                self._base = base
                self._per_batch = per_batch
                give_rngs(self.sampler, rngs)
                self._streams = streams
                epochs = self._epochs
                epochs.open = []
                epochs.resume = resume

    # -- the wrapped sampler's, passed on --------------------------------------------------

    sampled_space = forwarded("sampler", "sampled_space", "The wrapped sampler's batch space.")
    sampled_metadata_space = forwarded("sampler", "sampled_metadata_space",
                                       "The wrapped sampler's batch metadata space (or None).")
    backend = forwarded("sampler", "backend", "The wrapped sampler's compute backend.")
    device = forwarded("sampler", "device", "The wrapped sampler's device: where batches "
                                            "are handed out.")
    data = forwarded("sampler", "data", "The wrapped sampler's data (e.g. the ReplayBuffer).")
    rng = forwarded("sampler", "rng", """The wrapped sampler's RNG in this process.  The
        ``sample*`` streams' seed is read from its state when this sampler is made and by
        [`manual_seed`][unienv_mp.sampler.SamplerBase.manual_seed]; setting it does not
        change the streams.""", settable=True)
    data_rng = forwarded("sampler", "data_rng", """The wrapped sampler's data RNG in this
        process: epoch permutations are drawn from it.  The ``sample*`` streams' seed is
        read from its state when this sampler is made and by
        [`manual_seed`][unienv_mp.sampler.SamplerBase.manual_seed]; setting it does not
        change the streams.""", settable=True)
    get_at = passed_on("get_at", "``get_at`` of the wrapped sampler, in this process.")
    get_at_with_metadata = passed_on("get_at_with_metadata", "``get_at_with_metadata`` of "
                                     "the wrapped sampler, in this process.")
    get_flattened_at = passed_on("get_flattened_at", "``get_flattened_at`` of the wrapped "
                                 "sampler, in this process.")
    get_flattened_at_with_metadata = passed_on(
        "get_flattened_at_with_metadata", "``get_flattened_at_with_metadata`` of the "
        "wrapped sampler, in this process.")

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def closed(self):
        """True once [`close`][unienv_mp.sampler.SamplerBase.close] was called (or
        before the constructor finished)."""
        return self.__dict__.get("_closed", True)

    @property
    def persistent_workers(self) -> Optional[bool]:
        """Which workers epochs run on (see
        [`kept_epoch_manager`][unienv_mp.sampler.SamplerBase.kept_epoch_manager]): None,
        True or False, read at each epoch's start; False where a backend keeps no workers
        for epochs."""
        return self._pools.persistent

    @persistent_workers.setter
    def persistent_workers(self, value):
        self._pools.persistent = check_persistent(value)

    @property
    def lock(self):
        """The re-entrant lock that every call of this sampler holds but
        [`close`][unienv_mp.sampler.SamplerBase.close]: a subclass holds it where its own
        code shares state with those calls."""
        return self._lock

    def close(self):
        """End the workers and release the shared memory; batches already returned stay
        valid.  Idempotent, and safe from any thread at any moment: a call running in
        another thread meanwhile raises ``RuntimeError``, and no worker starts after this
        returns."""
        feed = getattr(self, "_feed", None)
        pools = self.__dict__.get("_pools")
        if (getattr(self, "_closed", True) and (pools is None or pools.empty())
                and (feed is None or feed.closed)):
            return
        self._closed = True
        self._close_parts(pools, feed)

    def _close_parts(self, pools, feed):
        """The end of `close`, once the sampler is marked closed."""
        # First without the lock, which a call in another thread may hold while it waits
        # on a manager: closing the managers wakes it.  Then again with it, for a manager
        # that such a call made meanwhile.
        if pools is not None:
            pools.close()
        lock = getattr(self, "_lock", None)
        got = lock is not None and lock.acquire(timeout=CLOSE_WAIT)
        try:
            if feed is not None and got:
                # (its pins keep the slots mapped until now: rule 8 of the feed; without
                # the lock, a call in another thread may be using it: closed at the next
                # close)
                feed.close()
            if pools is not None:
                pools.close()
            streams = getattr(self, "_streams", {})
            if feed is not None and feed.mode == "resident" and _os.pid != self._owner_pid:
                # (a forked child: the batches ready are the parent's, made on its device:
                # freeing them here would call CUDA; rule 8 of unienv_mp._device.feed)
                keep_in_forked_child(dict(streams))
            # (positions kept, for a state_dict() after close(); requests dropped)
            self._streams = {
                name: Stream.from_position(name, self._base, st.position(), st.per_batch)
                for name, st in streams.items()}
        finally:
            if got:
                lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class MultiprocessingSampler(SamplerBase):
    """Run ``sampler``'s ``sample*`` methods, and epochs over its ``get*_at`` methods, in
    ``n_workers`` processes, keeping ``n_buffers`` batches in flight per method.

    A drop-in for UniEnv's ``unienv_data.samplers.MultiprocessingSampler``: the same
    constructor, methods and properties, with batches passed through shared memory instead
    of pickles.  As in UniEnv, the workers start at the first call and see the data as it
    was then, unless it is shared between processes (a ReplayBuffer made with
    ``multiprocessing=True``); an epoch covers the data as it is when it starts (see
    ``persistent_workers``).

    [`stats`][unienv_mp.MultiprocessingSampler.stats] says where the time goes;
    [`state_dict`][unienv_mp.MultiprocessingSampler.state_dict] and
    [`load_state_dict`][unienv_mp.MultiprocessingSampler.load_state_dict] save and restore
    the position of every stream and of an epoch in progress.  A call cut short (Ctrl-C,
    ``timeout``) does not move the position.  A worker that raises does not end the
    sampler: the call that needed its batch raises [`WorkerError`][unienv_mp.WorkerError]
    (with the worker's traceback) and later calls work.  After
    [`close`][unienv_mp.MultiprocessingSampler.close] every method raises ``RuntimeError``.

    The guides say more: [what it wraps](../../guides/direct-gather.md#what-the-sampler-wraps)
    (UniEnv's views, frame stacks, action chunks),
    [batches on the GPU](../../guides/gpu.md), [epochs](../../guides/epochs.md),
    [reliability](../../guides/reliability.md) (errors, Ctrl-C, threads, forked
    children), [reproducible and resumable](../../guides/reproducible.md) and
    [the bounds on its options](../../limitations.md#bounds-on-the-options).

    Args:
        sampler: the ``BatchSampler`` to run in the workers: a ``StepSampler`` over a
            ``ReplayBuffer`` or a view of one, its batches on the CPU or on a CUDA device
            (see the guides above).
        n_workers: worker processes.
        n_buffers: batches requested ahead of the caller, per method.
        ctx: multiprocessing context or start method name (``"fork"``, ``"spawn"``,
            ``"forkserver"``); default: the current default context.  Under spawn and
            forkserver the sampler (and its data) must be picklable.
        doze_time: how often, in seconds, a waiting side checks that the other is alive.
            Nothing sleeps for it on the hot path: waits are woken by the other side.
        daemon: passed to ``Process``.
        shared_memory: accepted for compatibility with UniEnv and ignored: batches always
            travel through shared memory here.
        in_order: ``True`` (default): batches come back in the order of the stream (the
            ``j``-th batch of a ``sample*`` method depends only on the seed and ``j``:
            not on ``n_workers``, ``n_buffers``, the start method, ``direct_gather`` or
            workers dying; see `unienv_mp._sampling.streams`).  ``False``: each call returns
            the first batch ready; the same batches come, possibly in another order.
        copy: ``False`` (default): arrays of a batch are zero-copy views of a shared slot.
            They are safe to keep: the slot is reused only after every array of the batch
            (of every batch of its task, see ``batches_per_task``) is garbage collected
            (when many slots are held at once, later ones are copied instead).  ``True``:
            every batch is copied out of its slot.
        timeout: seconds to wait for one batch before raising ``TimeoutError`` (default:
            wait as long as the workers are alive).
        respawn: ``True`` (default): a worker that dies is replaced and its unfinished
            batches are requested again, so the caller sees no gap; ``False``: raise
            [`WorkerDiedError`][unienv_mp.WorkerDiedError].
        direct_gather: ``None`` (default): where the wrapped sampler's batches are rows of
            tensors held in memory (a ``StepSampler`` over a ``ReplayBuffer`` of
            ``PytorchTensorStorage``, ``DictStorage`` or ``FlattenedStorage``; see
            `unienv_mp._direct.gather`), workers draw the indices with the wrapped sampler's
            own RNG and gather the rows straight into the shared slot, with no
            intermediate batch; everything else runs the wrapped sampler's methods.
            ``True``: require that, raising ``ValueError`` (saying why) if it does not
            apply.  ``False``: always run the wrapped sampler's methods.  Both paths give
            the same batches, bit for bit, for the same seed;
            [`gather_path`][unienv_mp.MultiprocessingSampler.gather_path] says which one
            ``sample()`` and ``epoch_iter()`` take.
        batches_per_task: how many batches of a ``sample*`` method one task makes: a
            chunk of the method's stream, which the worker draws one batch after the
            other after seeding the wrapped sampler for that chunk.  ``None`` (default):
            for methods that can be gathered directly, as many as fit in 1 MiB, at most
            8; one for every other method.  Small batches cost little to gather but a
            lot to hand over one by one (a worker's wake-up, two ring operations and a
            decode each): several to a task make that cost theirs together.  The stream
            of batches for a seed does not depend on it: each batch is drawn after the
            wrapped sampler is seeded for that batch.
            If the wrapped sampler raises while making a task, the call that needed the
            task's first batch raises, and the rest of that task's batches are skipped.
            On the generic path a worker keeps the ``k`` results of the wrapped sampler
            until the task is written: a sampler that reuses its output memory from one
            call to the next needs ``batches_per_task=1``.  Batches of one task share one
            slot (see ``copy``), and ``timeout`` is the wait for a whole task.
        stall_timeout: seconds a worker may spend on one task (default: no limit).  A
            worker found on one task for longer is killed and replaced, after its Python
            stacks are taken; with ``respawn`` a ``RuntimeWarning`` carries them and the
            task is made again (given up, with
            [`WorkerStalledError`][unienv_mp.WorkerStalledError], after ``max_respawns + 1``
            stalls in a row), without, the call raises ``WorkerStalledError``.  One that
            takes none of the tasks waiting for it for longer (stopped, say) is replaced,
            with the warning (see the manager's ``stall_timeout``).
        persistent_workers: whether epochs run on workers that already exist (DataLoader's
            name).  Workers hold a copy of the data as it was when they started, and an
            epoch covers the data as it is when it starts.  ``None`` (default): an epoch
            runs on existing workers (the ``sample*`` workers, or those of an earlier
            epoch, which are kept for the next) exactly when their copy is still the data
            as it is now: every change torch counts is told by an exact fingerprint of the
            data, and writes it does not count (through ``tensor.numpy()``,
            ``tensor.data``, ctypes) by the page table under fork (exact), by comparing
            samples of the data with the workers' copy under spawn and forkserver (a write
            to a few rows may go unseen there).  Where it cannot be told (a custom sampler
            or storage, memory-mapped or file-backed data), each epoch starts workers of
            its own.
            [`epoch_workers_reason`][unienv_mp.MultiprocessingSampler.epoch_workers_reason]
            says which, and what was checked.  ``True``: the caller promises that the data
            does not change: epochs run on the existing workers whatever the storage,
            unless the data's length changed.  ``False``: each epoch starts workers of its
            own, and they end with it (UniEnv's behaviour).  The batches are the same in
            every case, bit for bit, as long as the promise of ``True`` holds.  See the
            Epochs guide for the rule every worker of a pool follows.
        pin_memory: ``True``: CPU batches are handed out from page-locked slots (each
            slot registered with CUDA once, on a thread of the sampler's own), as torch's
            ``DataLoader(pin_memory=True)`` hands out pinned batches, so that the caller's
            own ``.to("cuda", non_blocking=True)`` runs asynchronously.  Safe as it is
            usually written, the CPU batch dropped at once: each batch (and its slot) is
            kept until the caller has let go of it (no tensor, view or ``.numpy()`` array
            of it left) and an event recorded on the current CUDA stream at a later call
            has completed, so every copy of it queued on that stream (or on one it waits
            for) before letting go of it has read the slot before a worker writes it
            again.  A copy on another stream: make the current stream wait for it, or keep
            the batch until it is done.  At most 4 batches let go wait so; a caller further
            ahead of the GPU waits for the oldest.  Without CUDA here: one
            ``RuntimeWarning``, and plain slots.  Not with a sampler whose batches go to a
            device already, nor with ``copy=True`` (``ValueError``).  A batch that is not
            in a slot is not page-locked: a small one (4 KiB or less travels inside its
            ring entry), or one copied out because the caller holds more than ``2 *
            n_workers + 8`` slots' batches at once (``stats().device.pageable_leaves``
            counts them).  [`close`][unienv_mp.MultiprocessingSampler.close] waits for the
            copies queued until then, then unregisters the slots: batches held after it
            are ordinary memory.
    """

    def __init__(
        self,
        sampler: BatchSampler,
        n_workers: int = 4,
        n_buffers: int = 8,
        ctx: Optional[Any] = None,
        doze_time: float = 0.005,
        daemon: Optional[bool] = None,
        shared_memory: bool = False,
        *,
        in_order: bool = True,
        copy: bool = False,
        timeout: Optional[float] = None,
        respawn: bool = True,
        direct_gather: Optional[bool] = None,
        batches_per_task: Optional[int] = None,
        stall_timeout: Optional[float] = None,
        persistent_workers: Optional[bool] = None,
        pin_memory: bool = False,
    ):
        self._closed = True   # first: __del__ -> close() must work on a half-built sampler
        n_workers = check_workers(n_workers)
        doze_time = check_doze_time(doze_time)
        stall_timeout = check_seconds(stall_timeout, "stall_timeout")
        daemon = check_bool(daemon, "daemon", allow_none=True)
        shared_memory = check_bool(shared_memory, "shared_memory")
        if ctx is not None:
            ctx = check_context(ctx)
        if direct_gather is not None and type(direct_gather) is not bool:
            raise TypeError(f"direct_gather must be None, True or False, got {direct_gather!r}")
        check_batch_sampler(sampler)   # (before place() reads its device)
        placement = place(sampler, type(self).__name__)
        self._worker_sampler = placement.worker_sampler
        not_direct = "direct_gather=False" if direct_gather is False else None
        if placement.kind == "in_process":
            if direct_gather:
                raise ValueError(f"direct_gather=True, but {placement.reason}")
            not_direct = placement.reason
        if not_direct is None:
            try:
                _gather.check(self._worker_sampler)
            except _gather.NotDirect as e:
                not_direct = str(e)
                if direct_gather:
                    raise ValueError(f"direct_gather=True, but batches of this sampler cannot "
                                     f"be gathered directly: {e}") from None
        self.mp_ctx = ctx
        self.doze_time = doze_time
        self.daemon = daemon
        self.shared_memory = shared_memory
        self.stall_timeout = stall_timeout
        super().__init__(sampler, n_workers, n_buffers, in_order=in_order, copy=copy,
                         timeout=timeout, respawn=respawn, batches_per_task=batches_per_task,
                         not_direct=not_direct, placement=placement, pin_memory=pin_memory,
                         persistent_workers=persistent_workers)

    def chunk_size(self, name):
        if self._placement.kind == "in_process" and self.batches_per_task is None:
            return _CHUNK_MAX   # (no slot to fill: chunks only save reseeding the RNGs)
        return super().chunk_size(name)

    def row_nbytes(self, name):
        worker_sampler = self._worker_sampler
        if worker_sampler is None:
            return None   # (in this process: nothing gathered into slots)
        return _gather.row_nbytes(worker_sampler, name)

    def new_manager(self):
        if self._placement.kind == "in_process":
            feed = self._feed
            mark = None if feed is None else feed.gathered_on
            return InProcessManager(
                ResidentTarget(own_target(SamplerTarget(self.sampler)), mark=mark),
                in_order=self.in_order)
        return MultiProcessingSampleManager(
            SamplerTarget(self._worker_sampler, direct=self._direct), n_workers=self.n_workers,
            ctx=self.mp_ctx, doze_time=self.doze_time, daemon=self.daemon,
            # (a device batch is a copy already: its CPU batch stays in the slot)
            in_order=self.in_order, copy=self.copy and self._placement.kind != "copy",
            timeout=self.timeout,
            respawn=self.respawn, stall_timeout=self.stall_timeout,
            **self._pools.launch_options(self.mp_ctx))

    def epoch_manager(self):
        # (by the persistent_workers rule: see unienv_mp._sampling.pools)
        if self._placement.kind == "in_process":
            self._pools.epoch_workers = (
                "in_process", "the data is on a GPU: batches are made in this process, "
                              "by no workers")
            return self._ensure_manager(), False
        return self.kept_epoch_manager()


class _StreamMethod:
    """An extra ``sample*`` method of the wrapped sampler, run in the workers (made on
    each attribute access, like a bound method: it keeps its sampler alive)."""
    __slots__ = ("__self__", "__name__", "_call")

    def __init__(self, owner, name, call):
        self.__self__ = owner
        self.__name__ = name
        self._call = call   # (the owner's method that makes the batch, or the epoch)

    def __call__(self):
        return self._call(self.__name__)

    def __repr__(self):
        return f"<worker method {self.__name__} of {self.__self__!r}>"


class _EpochMethod(_StreamMethod):
    """An extra ``get*_at`` method of the wrapped sampler, as an epoch iterator."""
    __slots__ = ()

