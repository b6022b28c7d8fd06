"""Launch: what every process of a manager's workers is started with, and how it starts.

Every worker of a manager starts from one snapshot of the work function, taken when the
first workers start, whatever the training process changes later:

* under spawn and forkserver the work function travels as a `Parcel`
  (`unienv_mp._process.transfer`): its arrays are copied into shared memory at the first
  start, and that start's pickle serves every later one;
* under fork the first workers are forked from the training process, and every later
  one from a `Snapshot` process forked right after them (`unienv_mp._process.snapshot`).

A process started after the first ones that cannot start from that snapshot (under fork
once the snapshot process is gone, or under spawn where the work function must be pickled
again at each start) would copy the data as it is when it starts.  It starts only if the
manager's ``same_copy()`` says that this is still what the first workers copied; otherwise
`CopyGone` is raised, and the process does not start (see `WorkerPool` for what then
becomes of a worker's tasks).  Where the data is read from files that a spawned process
opens by name (``same_copy.every_start`` is True), the first start's pickle holds their
names, not the files: every process after the first ones opens them as they are when it
starts, so every such start asks ``same_copy()``.

Both are released when the last worker handle has released its memory
(`WorkerHandle.release_memory`), since no process of the manager starts after that.
"""
import os
import pickle
import threading
import time

from .. import _os
from .deaths import warn_user
from .snapshot import Held, Snapshot, SnapshotLost
from .transfer import Parcel, ParcelChanged
from .worker import worker_main

__all__ = ["Launch", "CopyGone"]


class CopyGone(Exception):
    """A process cannot start from the copy of the data that the manager's first workers
    started from (the message says why): it was not started."""


class Launch:
    """What every process of a manager's workers is started with (``stall_timeout``:
    seconds, or None; ``same_copy``: see the module's docstring, None: always the same).
    `first_done` marks the end of the first starts."""

    def __init__(self, target_fn, init_fn, ctx, daemon, doorbell_seg, done_event,
                 poll_interval, spin, stall_timeout=None, same_copy=None):
        self.target_fn = target_fn
        self.init_fn = init_fn
        self.ctx = ctx
        self.daemon = daemon
        self.doorbell_seg = doorbell_seg
        self.done_event = done_event
        self.poll_interval = poll_interval
        self.spin = spin
        self.stall_ns = None if stall_timeout is None else int(stall_timeout * 1e9)
        self.fork = ctx.get_start_method() == "fork"
        self.same_copy = same_copy
        self._parcel = None
        self._snapshot = None
        self._first_done = False   # the first starts are done: later ones need the copy
        self._holders = set()   # indices of the handles that may still start a process

    def first_done(self):
        """The first processes are started: they took the copy every later one needs."""
        self._first_done = True

    def _check_same(self, how, also=None):
        """Raise `CopyGone` unless a process that starts ``how`` now gets what the first
        ones got: the first starts, a reused pickle and the snapshot process give it; else
        ``same_copy()`` must vouch for it (and ``also()``, if given; what either raises
        is raised)."""
        if not self._first_done:
            return
        for check in (self.same_copy, also):
            if check is not None and not check():
                raise CopyGone(f"it would be {how}, and the data may have changed since "
                               f"the first workers started")

    def keep_snapshot(self):
        """Under fork, once the first workers are started: fork the `Snapshot` process
        that later workers are forked from.  If that cannot be done, they are forked from
        this process (one ``RuntimeWarning``)."""
        if not self.fork or self._snapshot is not None or not self._holders:
            return
        try:
            # (forked later than the first workers: only with the copy they took)
            self._check_same("forked from the training process")
        except Exception:   # (CopyGone, or a same_copy that raised)
            return   # (later processes are then checked one by one)
        try:
            # (one step: a Ctrl-C cannot leave a snapshot process nobody holds)
            with _os.interrupts_deferred():
                self._snapshot = Snapshot(self.ctx, {"target": self.target_fn,
                                                     "init": self.init_fn,
                                                     "done_event": self.done_event},
                                          self.daemon)
        except Exception as e:   # (no pidfds: AttributeError, OSError)
            _warn_no_snapshot(f"it could not be started ({type(e).__name__}: {e})")

    @property
    def from_snapshot(self):
        """True while later processes start from a snapshot that the training process's
        changes since the first start cannot reach: under fork while the `Snapshot`
        process is up, under spawn and forkserver once the first start's pickle serves
        the later ones (see `Parcel`)."""
        if self.fork:
            return self._snapshot is not None
        return self._parcel is not None and self._parcel.reused

    def start_process(self, index, seg, seed, stack_w, deadline=None, also=None):
        """Start a process for worker ``index`` (``seg``: its segment; ``stack_w``: the
        write end of its stack pipe): returns it, with the monotonic ns of its start.  A
        process half started when this raises is stopped.  Raises ``TypeError`` if the
        work function cannot be sent to the process, `CopyGone` if the process could not
        start from the first ones' copy of the data, ``TimeoutError`` if the snapshot
        process has not answered by ``deadline`` (``time.monotonic()`` seconds, or
        None); ``also``: asked too, with ``same_copy``, where the process cannot start
        from the snapshot."""
        if not self._holders:
            raise RuntimeError("this manager was closed: no process starts now")
        snapshot = self._snapshot
        if self.fork and snapshot is None:
            self._check_same("forked from the training process", also)
        elif not self.fork and self._parcel is not None and not self._parcel.reused:
            self._check_same("sent the work function pickled again", also)
        elif getattr(self.same_copy, "every_start", False):
            self._check_same("reading the files the data reads as they are now", also)
        proc = self._process(index, seg, seed, stack_w, snapshot, deadline)
        try:
            # (started with SIGINT blocked, the process never takes a Ctrl-C; one
            # arriving here meanwhile is raised after the start, also one that another
            # thread took: held back, it is not raised inside an at-fork hook, where
            # Python would drop it)
            with _os.interrupts_deferred(), _os.sigint_held_from_children(not self.fork):
                launched = time.monotonic_ns()
                proc.start()
        except SnapshotLost as e:
            with _os.interrupts_deferred():
                closed = self._snapshot is not snapshot or not self._holders
                if not closed:
                    self._snapshot = None
            if closed:   # (let go meanwhile: the manager was closed)
                raise RuntimeError("this manager was closed: no process starts now") \
                    from None
            snapshot.close(0.5)
            _warn_no_snapshot(f"it ended ({e})")
            return self.start_process(index, seg, seed, stack_w, deadline, also)
        except ParcelChanged as e:
            _os.stop_half_started(proc)
            raise CopyGone(str(e)) from None
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            _os.stop_half_started(proc)
            raise _not_picklable(self.ctx.get_start_method(), e) from e
        except BaseException:
            _os.stop_half_started(proc)   # e.g. Ctrl-C after the fork
            raise
        return proc, launched

    def _process(self, index, seg, seed, stack_w, snapshot, deadline):
        held = snapshot is not None
        options = {"poll_interval": self.poll_interval, "spin": self.spin,
                   "done_event": Held("done_event") if held else self.done_event,
                   # PR_SET_PDEATHSIG fires when the *thread* that started the worker ends:
                   # only worth it from the main thread (a watchdog covers the rest)
                   "pdeathsig": (not held and threading.current_thread()
                                 is threading.main_thread()),
                   "stack_pipe": _os.PipeEnd(stack_w)}
        args = (index, Held("target") if held else self._target(), seg, self.doorbell_seg,
                os.getpid(), Held("init") if held else self.init_fn, seed, options)
        name = f"unienv_mp-worker-{index}"
        if held:
            return snapshot.process(worker_main, args, self.daemon, name, deadline)
        return self.ctx.Process(target=worker_main, args=args, daemon=self.daemon,
                                name=name)

    def _target(self):
        """The work function as a ``Process`` argument: itself under fork (the child
        inherits it), else the manager's Parcel of it."""
        if self.fork:
            return self.target_fn
        if self._parcel is None:
            self._parcel = Parcel(self.target_fn)
        return self._parcel

    def hold(self, index):
        """Handle ``index`` may start processes with this launch."""
        self._holders.add(index)

    def let_go(self, index):
        """Handle ``index`` starts no more processes; once no handle holds the launch, the
        snapshot is released."""
        if index in self._holders:   # (after release(), which lets every handle go: no-op)
            self._holders.discard(index)
            if not self._holders:
                self.release()

    def snapshot_pids(self):
        """The snapshot process's pid, in a list, while it is up (under fork); else none."""
        snapshot = self._snapshot
        proc = None if snapshot is None else snapshot.proc
        if proc is None or proc.pid is None or _os.has_exited(proc):
            return []
        return [proc.pid]

    def spot_check(self, blocks, rng):
        """See `Parcel.spot_check`; None where no data was copied for the workers (fork)."""
        parcel = self._parcel
        if parcel is None or parcel.closed:
            return None
        return parcel.spot_check(blocks, rng)

    def wake(self):
        """Wake a start waiting for the snapshot process in another thread (the manager is
        being closed): it raises."""
        snapshot = self._snapshot
        if snapshot is not None:
            snapshot.wake()

    def release(self):
        """Release the snapshot: no process of the manager starts any more."""
        self._holders.clear()
        with _os.interrupts_deferred():
            if self._parcel is not None:
                self._parcel.close()
            snapshot, self._snapshot = self._snapshot, None
            if snapshot is not None:
                snapshot.close()


def _warn_no_snapshot(why):
    warn_user(f"unienv_mp: the process that keeps the workers' snapshot of the data (fork) "
              f"is not there: {why}; a worker started from now on is forked from this "
              f"process, and only while the data is provably what the first workers copied")


def _not_picklable(method, error):
    """The TypeError for a work function that could not be sent to a new process."""
    return TypeError(
        f"cannot start workers with the {method!r} start method: the work function (and "
        f"everything it refers to, e.g. the wrapped sampler) must be picklable, but "
        f"pickling failed with {type(error).__name__}: {error}")
