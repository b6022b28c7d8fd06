"""The managers of workers that a sampler owns (`Pools`): the one its ``sample*`` methods
use, one kept for the next epochs, those of epochs that close with them, the copy of the
data each holds (`unienv_mp._sampling.copies`), and the ``persistent_workers`` rule that
decides which of them an epoch runs on.

A manager is any `Manager`; new ones are made by the sampler's ``new_manager()`` hook.
Every call here is made with the sampler's lock held (but `Pools.close`, as ``close()`` is).
"""
import collections
import multiprocessing as _mp
import warnings

from . import fingerprint as _fingerprint
from .copies import DataCopy, warn_untracked

__all__ = ["Pools", "check_persistent"]


def check_persistent(value):
    """``value``, a ``persistent_workers`` option: None, True or False, else TypeError."""
    if value is not None and type(value) is not bool:
        raise TypeError(f"persistent_workers must be None, True or False, got {value!r}")
    return value


def _always():
    return True


def _watch_of(copy):
    fp = None if copy is None else copy.fp
    return fp.watch if isinstance(fp, _fingerprint.Fingerprint) else ()


class _EveryStart:
    """A ``same_copy`` that the launch asks before every process started after the first
    ones (``every_start``), not only before those that cannot start from the snapshot: the
    data is read from files that a process started with spawn opens by name (see
    `unienv_mp._process.launch`)."""
    every_start = True
    __slots__ = ("same_copy",)

    def __init__(self, same_copy):
        self.same_copy = same_copy

    def __call__(self):
        return self.same_copy()


class Pools:
    """A sampler's managers.  ``sampler``: the wrapped sampler (whose data the workers
    copy).  A method that may make a manager is handed ``new_manager``, the sampler's
    hook that makes one (this holds nothing of the sampler's but the wrapped sampler).
    ``persistent``: the sampler's
    ``persistent_workers`` option (None, True or False; False for a backend without it: no
    workers are kept for epochs), set by the sampler whenever it changes.

    ``sample``: the ``sample*`` manager (None until the first call); ``kept``: one kept for
    the next epochs (``persistent_workers``); ``own``: the managers epochs run on besides
    those two, an epoch's own and managers no longer kept (see `retire`), each closed by the
    last epoch on it; ``users``: how many epoch iterators run on each manager.
    ``sample_copy`` and ``kept_copy``: the copies of the data that ``sample`` and ``kept``
    hold (`unienv_mp._sampling.copies.DataCopy`); ``watch``: what the ``sample*`` calls
    look at each time (see `sample_moved`)."""

    def __init__(self, sampler, sample=None):
        self.sampler = sampler
        self.persistent = False
        self.sample = sample
        self.sample_copy = None
        self.watch = ()
        self.kept = None
        self.kept_copy = None
        self.own = set()
        self.users = collections.Counter()
        self.epoch_workers = (None, None)   # (see the sampler's epoch_workers)
        self.ended_wait_ns = 0      # the waits of epoch managers closed since
        self.ended_startup_ns = 0   # (and their start-up part)
        self._next_copy = None      # the copy of a manager being made (see launch_options)
        self._warned = False        # of a write torch does not count (warn_untracked)
        self._warned_moved = False  # (see retire_moved)

    def _new(self, new_manager):
        """``(manager, copy)``: a new manager from ``new_manager()``, and the copy of the
        data its workers hold."""
        self._next_copy = None
        manager = new_manager()
        copy, self._next_copy = self._next_copy, None
        if copy is None:   # (a manager made without launch_options: its copy is now's)
            copy = DataCopy(self.sampler, self.persistent, False)
        copy.started(manager)
        return manager, copy

    def note_sample_copy(self):
        """The ``sample*`` manager given to the constructor holds the data as it is now."""
        if self.sample is not None:
            self.sample_copy = DataCopy(self.sampler, self.persistent, False)
            self.sample_copy.started(self.sample)
            self.watch = _watch_of(self.sample_copy)

    # -- the sample* manager ---------------------------------------------------------------

    def sample_manager(self, new_manager):
        """The ``sample*`` manager, made now if there is none (see `_new_sample`)."""
        sample = self.sample
        if sample is None:
            # (no worker seeds: every task carries the seed of its chunk)
            sample, copy = self._new_sample(new_manager)
            self.sample = sample
            self.sample_copy = copy   # (second: a pool without one only costs new workers)
            self.watch = _watch_of(copy)
        return sample

    def _new_sample(self, new_manager):
        # The workers kept for epochs become the sample* workers if their copy of the data
        # is the data as it is now (what new workers would copy): one pool.
        kept, copy = self.kept, self.kept_copy
        if kept is not None:
            self.kept = self.kept_copy = None
            if not kept.closed and self._current(copy)[0]:
                return kept, copy
            self.retire(kept, copy)   # (older data: no use to anything)
        return self._new(new_manager)

    def retire_sample(self):
        """The ``sample*`` manager can make no more batches from its copy of the data
        (`CopyLost`): the next call makes a new one."""
        sample, copy = self.sample, self.sample_copy
        self.watch = ()
        self.sample = self.sample_copy = None
        self.retire(sample, copy)

    def sample_moved(self):
        """Whether the data moved away from what the ``sample*`` workers can serve whole
        rows of, reading part of it in shared memory as it is now (see
        `unienv_mp._sampling.fingerprint.moved`): a tensor in shared memory replaced, or
        data partly in shared memory written.  Then the next call makes a new pool."""
        return _fingerprint.moved(self.watch)

    def retire_moved(self):
        """`retire_sample`, the data having moved (`sample_moved`); says so once."""
        self.retire_sample()
        if not self._warned_moved:
            self._warned_moved = True
            warnings.warn(
                "unienv_mp: the data moved away from what the sample* workers read in "
                "shared memory (a shared tensor was replaced, or data only partly in "
                "shared memory was written): new workers start, over the data as it is "
                "now, and the streams go on in order.  That costs a pool start each time: "
                "keep the whole buffer in shared memory (multiprocessing=True) or none of "
                "it, and write to its tensors in place", RuntimeWarning, stacklevel=5)

    # -- the persistent_workers rule -------------------------------------------------------

    def data_now(self):
        """``(now, why)``: the fingerprint of the data as it is now (see
        `unienv_mp._sampling.fingerprint`), or None where it cannot be told (``why`` says
        why) or ``persistent_workers=False``; with ``persistent_workers=True``, the data's
        length (the caller promises the rest)."""
        persistent = self.persistent
        if persistent is None:
            return _fingerprint.check(self.sampler)
        if persistent is True:
            return len(self.sampler.data), None
        return None, None

    def _current(self, copy, now=None):
        """``(ok, reason)``: whether the workers holding ``copy`` hold the data as it is
        now (see `DataCopy.current`); ``now``: the fingerprint just taken, if it was."""
        if copy is None:
            return False, "whether the data changed since they started cannot be told"
        if now is None:
            now, why = self.data_now()
            if now is None:
                return False, why or "persistent_workers=False"
        ok, reason = copy.current(now)
        if copy.untracked is not None and not self._warned:
            self._warned = True
            warn_untracked(copy.untracked)
        return ok, reason

    def launch_options(self, ctx):
        """A process manager's ``start_later`` and ``same_copy`` for a new pool (the
        manager's docstring says what each is): its workers after the first may start
        later (a first batch then costs one process start, not ``n_workers``), except
        under fork where whether the data changed cannot be told (all start now), or with
        ``persistent_workers=False`` (UniEnv's way); and a later process that cannot start
        from the first ones' snapshot starts only if the data is still what they copied
        (`DataCopy.same_copy`)."""
        sampler = self.sampler
        persistent = self.persistent
        ctx = ctx if ctx is not None else _mp.get_context()
        fork = ctx.get_start_method() == "fork"
        copy = self._next_copy = DataCopy(sampler, persistent, fork)
        later = _always
        if persistent is False or (fork and copy.fp is None):
            later = None
        same = copy.same_copy
        if copy.reads_files and not fork:
            # (a process started with spawn opens the files by name, as they are then, not
            # the ones the first workers opened: every later start is asked.  Under fork
            # the snapshot process holds the first workers' open files and maps, and
            # later workers inherit them.)
            same = _EveryStart(same)
        return {"start_later": later, "same_copy": same}

    # -- the managers of epochs ------------------------------------------------------------

    def every_epoch_on_sample_workers(self):
        """The rule of a sampler that keeps no other workers: every epoch runs on the
        ``sample*`` workers (noted in ``epoch_workers``; the sampler hands them out)."""
        sample = self.sample
        running = sample is not None and not sample.closed
        self.epoch_workers = (
            ("kept", "the sample* workers serve every epoch") if running
            else ("new", "no workers were running yet (they serve every epoch)"))

    def epoch_manager(self, new_manager):
        """``(manager, own)`` for an epoch starting now, by the ``persistent_workers``
        rule: workers that exist if their copy of the data is the data as it is now (see
        `DataCopy.current`), else new ones (kept for the next epochs, unless
        ``persistent_workers=False``, or whether the data changed cannot be told: then
        the epoch's own)."""
        persistent = self.persistent
        keep = persistent is not False
        now, why = self.data_now()
        if not keep:
            why = "persistent_workers=False"
        elif now is None:
            keep = False   # (cannot be told: new workers, as without persistent_workers)
            why = (f"whether the data changed cannot be told: {why} (persistent_workers="
                   f"True promises that it does not)")
        if keep:
            why = None
            for pool, copy in ((self.sample, self.sample_copy),
                               (self.kept, self.kept_copy)):
                if pool is None or pool.closed:
                    continue
                ok, reason = self._current(copy, now)
                if ok:
                    self.epoch_workers = ("kept", reason)
                    return pool, False
                why = why or reason
            why = why or "no workers were running yet"
            # (the workers kept so far hold older data: they go)
            kept, copy = self.kept, self.kept_copy
            self.kept = self.kept_copy = None
            self.retire(kept, copy)
        manager, copy = self._new(new_manager)
        self.epoch_workers = ("new", why)
        if keep:
            self.kept, self.kept_copy = manager, copy
            return manager, False
        self.own.add(manager)
        return manager, True

    def retire(self, manager, copy=None):
        """``manager`` (holding ``copy``) is no longer kept for anything: closed now, or,
        while epochs still run on it, by the last of them (it waits in ``own``)."""
        if copy is not None:
            copy.close()
        if manager is None or manager.closed:
            return
        if self.users.get(manager, 0) > 0:
            self.own.add(manager)
        else:
            try:
                manager.close()
            except BaseException:
                self.own.add(manager)   # (a close cut short: finished by the sampler's)
                raise

    def close_unused(self):
        """Close the managers in ``own`` that no epoch runs on (one made for an epoch that
        a Ctrl-C cut short before it began)."""
        for manager in [m for m in self.own if m not in self.users]:
            manager.close()
            self.own.discard(manager)

    # -- all of them -----------------------------------------------------------------------

    def live(self):
        """The managers not closed: ``sample``, ``kept``, then the epochs' own."""
        for manager in (self.sample, self.kept, *self.own):
            if manager is not None and not manager.closed:
                yield manager

    def slot_segments(self):
        """The slot segments of every live manager (what the device feed page-locks)."""
        out = []
        for manager in self.live():
            segments = getattr(manager, "slot_segments", None)
            if segments is not None:
                out.extend(segments())
        return out

    def stats(self, reset=False):
        """``(wait_ns, startup_ns, ready, workers)`` of every live manager together, the
        waits of epoch managers closed since the last reset included; ``workers``: the
        first live manager's (None if there is none)."""
        wait_ns, startup_ns = self.ended_wait_ns, self.ended_startup_ns
        ready = 0
        workers = None
        for manager in self.live():
            part = manager.stats(reset=reset)
            wait_ns += int(part.wait_seconds * 1e9)
            startup_ns += int(part.startup_seconds * 1e9)
            ready += part.ready
            if workers is None:
                workers = part.workers
        return wait_ns, startup_ns, ready, workers

    def empty(self):
        """True if no manager is held (closed or not)."""
        return self.sample is None and self.kept is None and not self.own

    def close(self):
        """Close every manager.  Each is dropped once closed: a close cut short is
        finished by the next."""
        manager = self.sample
        if manager is not None:
            manager.close()
            if self.sample is manager:
                self.sample = None
        kept = self.kept
        if kept is not None:
            kept.close()
            if self.kept is kept:
                self.kept = None
        for copy in (self.sample_copy, self.kept_copy):
            if copy is not None:
                copy.close()
        for epoch_manager in list(self.own):
            epoch_manager.close()
            self.own.discard(epoch_manager)
