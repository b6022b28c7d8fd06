"""Launch: what every process of a manager's workers is started with, and how it starts.

Every worker of a manager starts from one snapshot of the work function, taken when the
first workers start, whatever the training process changes later:

* under spawn and forkserver the work function travels as a `Parcel`
  (`unienv_mp._process.transfer`): its arrays are copied into shared memory at the first
  start, and that start's pickle serves every later one;
* under fork the first workers are forked from the training process, and every later
  one from a `Snapshot` process forked right after them (`unienv_mp._process.snapshot`).

Both are released when the last worker handle has released its memory
(`WorkerHandle.release_memory`), since no process of the manager starts after that.
"""
import os
import pickle
import threading
import time
import warnings

from .. import _os
from .snapshot import Held, Snapshot, SnapshotLost
from .transfer import Parcel
from .worker import worker_main

__all__ = ["Launch"]


class Launch:
    """What every process of a manager's workers is started with (``stall_timeout``:
    seconds, or None), see the module's docstring."""

    def __init__(self, target_fn, init_fn, ctx, daemon, doorbell_seg, done_event,
                 poll_interval, spin, stall_timeout=None):
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
        self._parcel = None
        self._snapshot = None
        self.later = None   # start_later, while a worker after the first starts (see pool)
        self._holders = set()   # indices of the handles that may still start a process

    def keep_snapshot(self):
        """Under fork, once the first workers are started: fork the `Snapshot` process
        that later workers are forked from.  If that cannot be done, they are forked from
        this process (one ``RuntimeWarning``)."""
        if not self.fork or self._snapshot is not None or not self._holders:
            return
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

    def start_process(self, index, seg, seed, stack_w):
        """Start a process for worker ``index`` (``seg``: its segment; ``stack_w``: the
        write end of its stack pipe): returns it, with the monotonic ns of its start.  A
        process half started when this raises is stopped.  Raises ``TypeError`` if the
        work function cannot be sent to the process."""
        if not self._holders:
            raise RuntimeError("this manager was closed: no process starts now")
        snapshot = self._snapshot
        proc = self._process(index, seg, seed, stack_w, snapshot)
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
            if self.later is not None and not self.later():
                raise   # (a worker started later copies this process only while allowed)
            return self.start_process(index, seg, seed, stack_w)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            _os.stop_half_started(proc)
            raise _not_picklable(self.ctx.get_start_method(), e) from e
        except BaseException:
            _os.stop_half_started(proc)   # e.g. Ctrl-C after the fork
            raise
        return proc, launched

    def _process(self, index, seg, seed, stack_w, snapshot):
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
            return snapshot.process(worker_main, args, self.daemon, name)
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
    warnings.warn(f"unienv_mp: the process that keeps the workers' snapshot of the data "
                  f"(fork) is not there: {why}; workers started from now on copy this "
                  f"process's memory as it is when they start", RuntimeWarning,
                  stacklevel=4)


def _not_picklable(method, error):
    """The TypeError for a work function that could not be sent to a new process."""
    return TypeError(
        f"cannot start workers with the {method!r} start method: the work function (and "
        f"everything it refers to, e.g. the wrapped sampler) must be picklable, but "
        f"pickling failed with {type(error).__name__}: {error}")
