"""What a pool of workers holds a copy of, and whether it is still the data as it is now.

Workers hold the data as it was when their pool's first worker started (fork's copy-on-write
image, the spawn transfer's snapshot; see `unienv_mp._process.launch`), and every later
worker of the pool starts from that copy, or not at all.  A `DataCopy` is the sampler's
record of one pool's copy: the data's fingerprint then (`unienv_mp._sampling.fingerprint`,
which sees every change torch counts), and what tells of writes torch does not count:

* under fork, the page table (`unienv_mp._sampling.pages`): exact, for every write by the
  training process;
* under spawn and forkserver, a comparison of samples of the data with the workers' copy
  (the manager's ``spot_check``): a write to many rows is seen, a write to a few may not
  be.

It answers two questions: `same_copy` (may a process that copies the data as it is now
join the pool: the manager asks it before such a start) and `current` (may an epoch
starting now run on the pool).  ``persistent_workers`` decides how far each is asked (see
`unienv_mp._sampling.pools`).
"""
import warnings
import weakref

from . import files as _files
from . import fingerprint as _fingerprint
from .pages import PageWitness

__all__ = ["DataCopy", "warn_untracked"]

#: Random 4 KiB blocks of each array that a spot check compares (see the manager's
#: ``spot_check``).
SPOT_BLOCKS = 64

#: The reason an epoch over a buffer made with ``multiprocessing=True`` keeps its workers.
SHARED = ("the data is shared between processes (the workers read it as it is now), and "
          "nothing else changed since they started")

_UNCOUNTED = ("a write torch does not count, through tensor.numpy(), tensor.data or "
              "ctypes")


def warn_untracked(how):
    """The one warning of a sampler that found the data written in a way torch does not
    count (``how``: how it was found)."""
    warnings.warn(
        f"unienv_mp: the data was changed by {_UNCOUNTED}, since the workers started "
        f"({how}); the next epoch starts new workers.  Such writes are seen exactly under "
        f"fork, and only by sampling under spawn and forkserver: pass "
        f"persistent_workers=False if you write the data that way",
        RuntimeWarning, stacklevel=5)


def _names(paths, show=3):
    more = f" and {len(paths) - show} more" if len(paths) > show else ""
    return ", ".join(paths[:show]) + more


def _files_note(files, maps):
    """What a reason adds for data read from ``files`` and memory-mapped ``maps``."""
    note = ""
    if files:
        note += (f"; the files it reads ({_names(files)}) have the device, inode, size "
                 f"and times they had then")
    if maps:
        note += (f"; the files it maps ({_names(maps)}) are the ones the workers map, "
                 f"which they read as they are now, as this process does")
    return note


def _holders(ref):
    """The pids of the processes holding a pool's copy (its manager's ``copy_holders``),
    none once the manager is gone."""
    manager = ref()
    return () if manager is None else manager.copy_holders()


class DataCopy:
    """The copy of ``sampler``'s data that one pool's workers hold, taken as the pool
    starts (see the module's docstring).  ``persistent``: the sampler's
    ``persistent_workers``; ``fork``: whether the pool's workers are forked from this
    process.  Made just before the pool's first worker starts; `started` once it has."""

    def __init__(self, sampler, persistent, fork):
        self._sampler = sampler
        self.persistent = persistent
        self.fork = fork
        if persistent is True:
            self.fp, self.why = len(sampler.data), None
        else:
            self.fp, self.why = _fingerprint.check(sampler)
        try:   # (a buffer made with multiprocessing=True: workers read it as it is now)
            self.shared = bool(getattr(sampler.data, "is_multiprocessing_safe", False))
        except Exception:
            self.shared = False
        self.witness = None
        self.untracked = None   # how a write torch did not count was found, if one was
        self._manager = lambda: None

    @property
    def reads_files(self):
        """True where the data is read from files (whose identities the fingerprint
        holds), which no snapshot of the workers' copy holds."""
        fp = self.fp
        return isinstance(fp, _fingerprint.Fingerprint) and bool(fp.files or fp.maps)

    def started(self, manager):
        """The pool's first workers started (``manager``'s): under fork, the page table
        watches the data's memory from now on."""
        ref = self._manager = weakref.ref(manager)
        fp = self.fp
        if (self.fork and isinstance(fp, _fingerprint.Fingerprint) and fp.ranges
                and hasattr(manager, "copy_holders")):
            self.witness = PageWitness(fp.ranges, lambda: _holders(ref))

    def close(self):
        if self.witness is not None:
            self.witness.close()

    def _same_as_now(self):
        """``(same, now, why)``: whether the data's fingerprint now is the one taken, the
        fingerprint now, and why it cannot be told (or None)."""
        if self.persistent is True:
            now = len(self._sampler.data)
            return now == self.fp, now, None
        now, why = _fingerprint.check(self._sampler)
        return _fingerprint.same(self.fp, now), now, why

    def same_copy(self):
        """Whether a process that copies the data as it is now would copy what the pool's
        first workers copied: the fingerprint is the same and (under fork) the page table
        knows of no write since (where it cannot be read, torch's count alone); with
        ``persistent_workers=True``, the caller's promise."""
        same, _, _ = self._same_as_now()
        if not same or self.persistent is True:
            return same
        return self.witness is None or self.witness.written() is not True

    def current(self, now):
        """``(True, reason)`` if an epoch starting now may run on the pool (its copy is the
        data as it is now: ``now``, the fingerprint just taken), else ``(False, why)``.
        Where a write torch did not count was found, ``untracked`` says how."""
        if self.persistent is True:
            if now == self.fp:
                return True, "persistent_workers=True"
            return False, "the data's length changed since the workers started"
        ok, reason = self._current(now)
        if ok and isinstance(self.fp, _fingerprint.Fingerprint):
            reason += _files_note(self.fp.files, self.fp.maps)
        return ok, reason

    def _current(self, now):
        racy = getattr(self.fp, "racy", None)
        if racy is not None:
            return False, (f"whether the data changed since the workers started cannot be "
                           f"told: {racy} had changed less than "
                           f"{_files.RACY_NS // 10**9} s before they started (a later "
                           f"write within the file system's clock tick leaves its times "
                           f"as they were)")
        if not _fingerprint.same(self.fp, now):
            return False, "the data changed since the workers started"
        if self.shared:
            unchanged = SHARED
        else:
            unchanged = "the data is unchanged since they started"
        if self.fork:
            if self.witness is None:   # (all its memory is shared: read as it is)
                return True, unchanged
            written = self.witness.written()
            if written is True:
                self.untracked = "the page table tells"
                return False, ("the data was written since the workers started (the page "
                               "table tells: " + _UNCOUNTED + ")")
            if written is False:
                return True, unchanged
            return True, ("torch counts no change to the data since they started (the "
                          "page table cannot tell here of " + _UNCOUNTED + ")")
        if getattr(self.fp, "tensors", None) == 0 and not self.shared:
            # (no tensor: every array of the data was recorded by value, every file by its
            # identity, so the fingerprint alone tells)
            return True, unchanged
        manager = self._manager()
        spot = getattr(manager, "spot_check", None)
        matches = None if spot is None else spot(SPOT_BLOCKS)
        if matches is False:
            self.untracked = "a sample of it differs from the workers' copy"
            return False, ("the data differs from the workers' copy (" + _UNCOUNTED + ")")
        if matches is None:
            return True, (SHARED if self.shared
                          else "torch counts no change to the data since they started")
        return True, ("torch counts no change to the data since they started, and samples "
                      "of it match their copy (a write to a few rows through "
                      "tensor.numpy(), tensor.data or ctypes is not seen: "
                      "persistent_workers=False if the data is written that way)")
