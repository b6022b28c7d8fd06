"""The managers of workers that a sampler owns (`Pools`): the one its ``sample*`` methods
use, one kept for the next epochs, those of epochs that close with them, the fingerprints of
the data each holds a copy of, and the ``persistent_workers`` rule that decides which of
them an epoch runs on.

A manager is any `Manager`; new ones are made by the sampler's ``new_manager()`` hook.
Every call here is made with the sampler's lock held (but `Pools.close`, as ``close()`` is).
"""
import collections
import multiprocessing as _mp

from . import fingerprint as _fingerprint

__all__ = ["Pools", "data_is_shared"]


def data_is_shared(sampler):
    """True if worker processes see changes the parent makes to the sampler's data (e.g. a
    ReplayBuffer made with ``multiprocessing=True``)."""
    try:
        return bool(getattr(sampler.data, "is_multiprocessing_safe", False))
    except Exception:
        return False


def _always():
    return True


class Pools:
    """A sampler's managers.  ``owner``: the sampler, through a weak proxy (it owns this);
    its ``new_manager()`` makes a manager, ``_ensure_manager()`` opens the ``sample*``
    one, and its ``persistent_workers`` option (False if it has none: no workers are kept
    for epochs) is read each time it is needed.

    ``sample``: the ``sample*`` manager (None until the first call); ``kept``: one kept for
    the next epochs (``persistent_workers``); ``own``: the managers epochs run on besides
    those two, an epoch's own and managers no longer kept (see `retire`), each closed by the
    last epoch on it; ``users``: how many epoch iterators run on each manager.
    ``sample_fp`` and ``kept_fp``: the fingerprints of the data that ``sample`` and ``kept``
    hold a copy of (see `unienv_mp._sampling.fingerprint`)."""

    def __init__(self, owner, sample=None):
        self.owner = owner
        self.sample = sample
        self.sample_fp = None
        self.kept = None
        self.kept_fp = None
        self.own = set()
        self.users = collections.Counter()
        self.epoch_workers = (None, None)   # (see the sampler's epoch_workers)
        self.ended_wait_ns = 0      # the waits of epoch managers closed since
        self.ended_startup_ns = 0   # (and their start-up part)

    def _persistent(self):
        return getattr(self.owner, "persistent_workers", False)

    # -- the sample* manager ---------------------------------------------------------------

    def sample_manager(self):
        """The ``sample*`` manager, made now if there is none (see `_new_sample`)."""
        sample = self.sample
        if sample is None:
            # (no worker seeds: every task carries the seed of its chunk)
            sample = self.sample = self._new_sample()
        return sample

    def _new_sample(self):
        # The workers kept for epochs become the sample* workers if their copy of the data
        # is the data as it is now (what new workers would copy): one pool.
        kept = self.kept
        persistent = self._persistent()
        if kept is not None and not data_is_shared(self.owner.sampler):
            now = self.data_now()[0]
            self.kept = None
            if not kept.closed and self.holds_data_now(self.kept_fp, now):
                self.sample_fp = self.kept_fp
                return kept
            self.retire(kept)   # (older data: no use to anything)
        now = None if persistent is False else self.data_now()[0]
        manager = self.owner.new_manager()
        self.sample_fp = now
        return manager

    # -- the persistent_workers rule -------------------------------------------------------

    def data_now(self):
        """``(now, why)``: the fingerprint of the data as it is now (see
        `unienv_mp._sampling.fingerprint`), or None where it cannot be told (``why`` says
        why) or ``persistent_workers=False``; with ``persistent_workers=True``, the data's
        length (the caller promises the rest)."""
        persistent = self._persistent()
        if persistent is None:
            return _fingerprint.check(self.owner.sampler)
        if persistent is True:
            return len(self.owner.sampler.data), None
        return None, None

    def holds_data_now(self, held, now):
        """Whether workers started when the data's fingerprint was ``held`` hold the data
        as it is now (``now``): ``persistent_workers=True`` promises it, as long as its
        length is the same."""
        if self._persistent() is True:
            return held == now
        return _fingerprint.same(held, now)

    def start_later(self, ctx):
        """A process manager's ``start_later``: whether its workers after the first may
        start later, when they would copy the same data as the first (a first batch then
        costs one process start, not ``n_workers``).  Under spawn and forkserver they map
        the snapshot the first one's start made, and shared data is the same for all;
        under fork they copy the data as it is when they start, so only while its
        fingerprint is the one taken now (``persistent_workers=True``: the caller's
        promise).  None (all start now) where that cannot be told."""
        sampler = self.owner.sampler
        persistent = self._persistent()
        ctx = ctx if ctx is not None else _mp.get_context()
        if ctx.get_start_method() != "fork" or data_is_shared(sampler):
            return _always
        if persistent is False:
            return None
        then = _fingerprint.take(sampler)
        if then is None:
            if persistent is not True:
                return None
            length = len(sampler.data)   # (the promise, but for a change of length)
            return lambda: len(sampler.data) == length

        def unchanged():
            return _fingerprint.same(then, _fingerprint.take(sampler))
        return unchanged

    # -- the managers of epochs ------------------------------------------------------------

    def on_sample_workers(self, workers):
        """``(the sample* manager, False)`` for an epoch, ``workers`` noted as the
        ``(kind, reason)`` of the sampler's ``epoch_workers``."""
        self.epoch_workers = workers
        return self.owner._ensure_manager(), False

    def every_epoch_on_sample_workers(self):
        """The rule of a sampler that keeps no other workers: every epoch runs on the
        ``sample*`` workers."""
        sample = self.sample
        running = sample is not None and not sample.closed
        return self.on_sample_workers(
            ("kept", "the sample* workers serve every epoch") if running
            else ("new", "no workers were running yet (they serve every epoch)"))

    def epoch_manager(self):
        """``(manager, own)`` for an epoch starting now, by the ``persistent_workers``
        rule: the ``sample*`` workers when the data is shared, else workers that exist if
        their copy of the data is the data as it is now, else new ones (kept for the next
        epochs unless ``persistent_workers=False``; otherwise the epoch's own)."""
        owner = self.owner
        if data_is_shared(owner.sampler):
            return self.on_sample_workers(
                ("kept", "the data is shared between processes") if self.sample is not None
                else ("new", "no workers were running yet (they are kept for later "
                             "epochs: the data is shared between processes)"))
        # Workers hold a copy of unshared data as it was when they started: this epoch
        # runs on workers that exist only if that copy is the data as it is now, and
        # otherwise needs workers started now.
        persistent = self._persistent()
        keep = persistent is not False
        now, why = self.data_now()
        if not keep:
            why = "persistent_workers=False"
        elif now is None:
            keep = False   # (cannot be told: new workers, as without persistent_workers)
            why = (f"whether the data changed cannot be told: {why} (persistent_workers="
                   f"True promises that it does not)")
        if keep:
            for pool, held in ((self.sample, self.sample_fp), (self.kept, self.kept_fp)):
                if pool is not None and not pool.closed and self.holds_data_now(held, now):
                    self.epoch_workers = ("kept", "persistent_workers=True" if persistent
                                          else "the data is unchanged since they started")
                    return pool, False
            running = any(pool is not None and not pool.closed
                          for pool in (self.sample, self.kept))
            why = ("no workers were running yet" if not running else
                   "the data's length changed since the workers started"
                   if persistent else "the data changed since the workers started")
            # (the workers kept so far hold older data: they go)
            kept, self.kept = self.kept, None
            self.retire(kept)
        manager = owner.new_manager()
        self.epoch_workers = ("new", why)
        if keep:
            self.kept, self.kept_fp = manager, now
            return manager, False
        self.own.add(manager)
        return manager, True

    def retire(self, manager):
        """``manager`` is no longer kept for anything: closed now, or, while epochs still
        run on it, by the last of them (it waits in ``own``)."""
        if manager is None or manager.closed:
            return
        if self.users.get(manager, 0) > 0:
            self.own.add(manager)
        else:
            manager.close()

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
        for epoch_manager in list(self.own):
            epoch_manager.close()
            self.own.discard(epoch_manager)
