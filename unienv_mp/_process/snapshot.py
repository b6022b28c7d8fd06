"""Under fork: a process that keeps the training process's memory as it was when a
manager's first workers started, and forks the manager's later workers from it.

A worker started with fork copies the training process's memory as it is when it
starts.  The first workers copy the data as it is then.  A worker started later (a
replacement, or one started after the first batch) would copy the data as it is *then*:
after an append to a buffer not shared between processes it would draw its rows over
another length, and the stream would change where a worker died.  So a `Snapshot`
process is forked from the training process right after the first workers (or, where
the manager can tell that the data has not changed since, after its first task is
pushed, so that the fork runs while the first worker makes the first result: see
`WorkerPool.push`).  It holds the same copy of the memory, idle, and every later worker
of the manager is forked from it,
so every worker of a manager starts from one snapshot, as under spawn and forkserver
(see `unienv_mp._process.transfer`).  Its memory costs what a worker's does: pages shared
with the training process until one of the two writes to them.

How a worker is started through it (`Snapshot.process`): as multiprocessing's forkserver
start method does, with the snapshot process in the fork server's place.

* The parent pickles the ``Process`` object.  Its descriptors (the worker's segment, its
  stack pipe) are collected on the Popen, as forkserver's are, and sent over a socket
  with ``SCM_RIGHTS``, with two pipe ends: the status pipe's write end and the data
  pipe's read end.
* The snapshot process forks, writes the child's pid to the status pipe, watches the
  child through a pidfd, and when it ends, reaps it and writes its exit code there.
  forkserver's Popen reads both, so the parent watches the worker as one started with
  forkserver: its pidfd, its sentinel, its exit code.
* The child reads the ``Process`` object from the data pipe and runs it.  What is not
  pickled: the work function, the init function and the stop event, which the snapshot
  process holds.  `Held` names them in the arguments.

The snapshot process ends when the manager lets it go (`Snapshot.close`), or when the
training process ends (a pidfd of it).  Where it cannot run (no pidfds, or the fork
failed), or if it was killed, later workers are forked from the training process, with one
``RuntimeWarning``, and only while the data is provably what the first workers copied
(`unienv_mp._process.launch`).

Waiting for its answer (the new child's pid) is bounded three ways: by the caller's
deadline (the request is then given up, and the child, which reads no ``Process`` object,
exits; the snapshot process is kept); by `ANSWER_TIMEOUT` seconds of silence in all,
counted over the requests it left unanswered, or at once if it is found stopped (SIGSTOP,
a debugger): it is then killed, and lost; and by `Snapshot.wake`, which a ``close()`` in
another thread calls.
"""
import io
import os
import select
import signal
import socket
import threading
import time
from multiprocessing import connection, forkserver, popen_forkserver, process, util
from multiprocessing.context import reduction, set_spawning_popen

from .. import _os

__all__ = ["Snapshot", "SnapshotLost", "Held"]

#: The objects the snapshot process holds for its children (set in that process only).
_HELD = {}

_MAX_FDS = 64   # (a worker's arguments hand it 3)


class SnapshotLost(OSError):
    """The snapshot process cannot start a worker (it ended, or does not answer)."""


class SnapshotClosed(RuntimeError):
    """The manager let the snapshot process go: no process of it starts any more."""


class SnapshotLate(TimeoutError):
    """The caller's deadline came before the snapshot process said a new child's pid: the
    request was given up (the snapshot process is kept)."""


#: Seconds of silence the snapshot process is allowed in all, over the requests it left
#: unanswered, to say a new child's pid (it forks at once; past this it is hung: it is
#: killed, and lost).  One found stopped is killed at once.
ANSWER_TIMEOUT = 10.0
#: Seconds between two looks at whether the snapshot process is stopped, while waiting.
_LOOK = 0.1


class Held:
    """An object of the snapshot process's memory, named in a worker's arguments."""
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return (_held, (self.name,))


def _held(name):
    return _HELD[name]


class Snapshot:
    """The snapshot process of one manager (see the module's docstring).  ``held``: the
    objects its workers get by name (`Held`); ``daemon``: the workers' (a daemonic one is
    terminated by multiprocessing when a process forked from the training process exits).
    Raises ``OSError`` where it cannot run."""

    def __init__(self, ctx, held, daemon):
        os.close(os.pidfd_open(os.getpid()))   # (it needs pidfds: OSError, AttributeError)
        self._lock = threading.Lock()
        self._silent_since = None   # monotonic s of the oldest request it left unanswered
        self._wake_r = self._wake_w = None
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = None
        pdeathsig = threading.current_thread() is threading.main_thread()
        try:
            self.proc = ctx.Process(
                target=_serve, args=(theirs, self._sock.fileno(), held, os.getpid(),
                                     pdeathsig),
                daemon=daemon, name="unienv_mp-snapshot")
            with _os.interrupts_deferred(), _os.sigint_held_from_children():
                self.proc.start()
                _os.open_pidfd(self.proc)
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        except BaseException:
            self._sock.close()
            if self.proc is not None:
                _os.stop_half_started(self.proc)
            raise
        finally:
            theirs.close()

    def process(self, target, args, daemon, name, deadline=None):
        """A ``Process`` (not started) that this snapshot process starts: its ``start()``
        raises `SnapshotLost` if it cannot, `SnapshotClosed` once it was closed,
        `SnapshotLate` if ``deadline`` (``time.monotonic()`` seconds, or None) comes
        first."""
        return _SnapshotProcess((self, deadline), target=target, args=args, daemon=daemon,
                                name=name)

    def request(self, fds):
        """Ask for a child: returns ``(status_r, data_w)``, as forkserver's
        ``connect_to_new_process`` does."""
        mine = []   # (closed if anything below fails, a second os.pipe() included)
        theirs = []
        try:
            status_r, status_w = os.pipe()
            mine.append(status_r)
            theirs.append(status_w)
            data_r, data_w = os.pipe()
            mine.append(data_w)
            theirs.append(data_r)
            with self._lock:
                if self._sock is None:
                    raise SnapshotClosed("this manager was closed: no process starts now")
                socket.send_fds(self._sock, [b"S"], [status_w, data_r, *fds])
            mine = []
        except BaseException as e:
            if isinstance(e, OSError) and not isinstance(e, SnapshotLost) and len(mine) == 2:
                raise SnapshotLost(f"the snapshot process is gone ({e})") from e
            raise
        finally:
            for fd in mine + theirs:
                os.close(fd)
        return status_r, data_w

    def read_pid(self, status_r, deadline=None):
        """The pid the snapshot process writes on ``status_r`` for a new child.  Raises
        `SnapshotLost` if it ends, or has been silent for `ANSWER_TIMEOUT` seconds in all
        or is found stopped (then it is killed); `SnapshotLate` if ``deadline`` comes
        first; `SnapshotClosed` if `wake` is called meanwhile."""
        poller = select.poll()
        poller.register(status_r, select.POLLIN)
        wake = self._wake_r
        if wake is not None:
            poller.register(wake, select.POLLIN)
        now = time.monotonic()
        if self._silent_since is None:
            self._silent_since = now
        give_up = self._silent_since + ANSWER_TIMEOUT
        while True:
            if self._sock is None:
                raise SnapshotClosed("this manager was closed: no process starts now")
            end = give_up if deadline is None else min(give_up, deadline)
            wait = max(0.0, min(_LOOK, end - now))
            ready = [fd for fd, _ in poller.poll(int(wait * 1000) + (wait > 0))]
            if status_r in ready:
                break
            if ready:   # (the wake pipe)
                raise SnapshotClosed("this manager was closed: no process starts now")
            now = time.monotonic()
            stopped = _os.is_stopped(self.proc.pid)
            if now >= give_up or stopped:
                _os.send_signal(self.proc, signal.SIGKILL)
                why = "is stopped" if stopped else f"did not answer in {ANSWER_TIMEOUT} s"
                raise SnapshotLost(f"the snapshot process {why}: killed")
            if deadline is not None and now >= deadline:
                raise SnapshotLate("the snapshot process has not started the worker in the "
                                   "time the call allowed")
        try:
            pid = forkserver.read_signed(status_r)
        except (OSError, EOFError) as e:
            raise SnapshotLost(f"the snapshot process ended ({e})") from None
        self._silent_since = None
        return pid

    def wake(self):
        """Make a `read_pid` waiting in another thread raise `SnapshotClosed` (no lock is
        taken: a close() calls this while a call may hold the manager's lock)."""
        w = self._wake_w
        if w is not None:
            try:
                os.write(w, b"x")
            except OSError:
                pass   # (full: a wake is pending anyway; or closed)

    def close(self, join_timeout=2.0):
        """End the snapshot process (its children, the workers, are not its to end)."""
        with self._lock:
            sock, self._sock = self._sock, None
        self.wake()
        if sock is not None:
            sock.close()
        if self.proc is not None:
            # (it keeps nothing that needs a graceful end, and would not see end of file
            # on its socket while another process holds this end)
            _os.send_signal(self.proc, signal.SIGKILL)
            _os.stop_processes([self.proc], join_timeout)
        with self._lock:
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), None, None
        for fd in fds:
            if fd is not None:
                os.close(fd)


class _SnapshotProcess(process.BaseProcess):
    """A ``Process`` started by the snapshot process ``snapshot[0]`` (its popen takes
    ``snapshot`` off the object before the object is sent)."""
    _start_method = "fork"   # (what the child's default start method becomes)

    def __init__(self, snapshot, **kwargs):
        super().__init__(**kwargs)
        self._unienv_mp_snapshot = snapshot

    @staticmethod
    def _Popen(process_obj):
        return _SnapshotPopen(process_obj)


class _SnapshotPopen(popen_forkserver.Popen):
    """forkserver's Popen, with a snapshot process in the fork server's place.  It also
    keeps a pidfd of the child (``pidfd``), opened while the child waits for its
    ``Process`` object, so it is surely the child's: `unienv_mp._os.open_pidfd` uses it,
    and if the snapshot process ends before the child, the child's end is told by it (its
    exit code is then unknown: 255, as forkserver says when its server is gone)."""

    pidfd = None

    def _launch(self, process_obj):
        snapshot, deadline = process_obj.__dict__.pop("_unienv_mp_snapshot")
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = snapshot.request(self._fds)
        # (as forkserver's: a duplicate of the data pipe's write end is the child's
        # sentinel of this process)
        parent_w = os.dup(w)
        # (finalizers run multiprocessing's own code: a Ctrl-C in one would be dropped)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            # The pid first: if the snapshot process ends before it says it, a child it
            # forked meanwhile reads no Process object (end of file) and exits.
            try:
                self.pid = snapshot.read_pid(self.sentinel, deadline)
                self.pidfd = os.pidfd_open(self.pid)
            except BaseException:
                self.finalizer()
                raise
            self.finalizer.cancel()   # (replaced: one finalizer closes each descriptor)
            self.finalizer = util.Finalize(self, util.close_fds,
                                           (parent_w, self.sentinel, self.pidfd))
            f.write(buf.getbuffer())

    def wait(self, timeout=None):
        # (popen_fork's wait would hand poll a blocking flag once the status pipe is at
        # its end; here a timeout is kept whichever descriptor tells the end)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not connection.wait([self.sentinel], left):
                return None
            self.poll()
        return self.returncode

    def poll(self, flag=os.WNOHANG):
        if self.returncode is None:
            timeout = 0 if flag == os.WNOHANG else None
            if not connection.wait([self.sentinel], timeout):
                return None
            try:
                self.returncode = forkserver.read_signed(self.sentinel)
            except (OSError, EOFError):
                # the snapshot process is gone: the child's end is the pidfd's to tell
                if self.sentinel != self.pidfd:
                    self.sentinel = self.pidfd
                    return self.poll(flag)
                self.returncode = 255
        return self.returncode


# -- in the snapshot process ----------------------------------------------------------------

def _serve(sock, theirs, held, parent_pid, pdeathsig):
    """The snapshot process: fork a child for each request on ``sock``; end with the
    training process ``parent_pid`` (``theirs``: its end of the socket, inherited)."""
    os.close(theirs)
    _HELD.update(held)
    _os.exit_with_parent(parent_pid, pdeathsig, watch=False)
    for sig in signal.valid_signals():   # (the training process's handlers are not ours)
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # (its children inherit "ignore")
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # (its children are reaped here)
    parent = os.pidfd_open(parent_pid)
    poller = select.poll()
    poller.register(parent, select.POLLIN)
    poller.register(sock, select.POLLIN)
    children = {}   # pidfd -> (pid, status_w)
    while True:
        for fd, _ in poller.poll():
            if fd == parent:
                os._exit(0)
            if fd != sock.fileno():
                pid, status_w = children.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _write_status(status_w, os.waitstatus_to_exitcode(status), last=True)
                continue
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 1, _MAX_FDS)
            except OSError:
                msg = None
            if not msg:
                os._exit(0)    # (the manager closed its end)
            status_w, data_r, *inherited = fds
            try:
                pid = os.fork()
            except OSError:
                pid = None     # (the training process reads EOF: SnapshotLost)
            if pid == 0:
                _child(data_r, inherited, [sock.fileno(), parent, status_w, *children,
                                           *(w for _, w in children.values())])
            for fd_ in (data_r, *inherited):
                os.close(fd_)
            if pid is None:
                os.close(status_w)
                continue
            pidfd = os.pidfd_open(pid)
            children[pidfd] = (pid, status_w)
            poller.register(pidfd, select.POLLIN)
            _write_status(status_w, pid)


def _write_status(fd, value, last=False):
    try:
        forkserver.write_signed(fd, value)
    except OSError:
        pass   # (the training process closed its end)
    if last:
        os.close(fd)


def _child(data_r, inherited, unused):
    code = 1
    try:
        for fd in unused:
            os.close(fd)
        forkserver._forkserver._inherited_fds = inherited
        parent_sentinel = os.dup(data_r)
        with os.fdopen(data_r, "rb", closefd=True) as f:
            process.current_process()._inheriting = True
            try:
                proc = reduction.pickle.load(f)
            finally:
                del process.current_process()._inheriting
        code = proc._bootstrap(parent_sentinel)
    finally:
        os._exit(code)

