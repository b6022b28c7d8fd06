"""The operating system's side of worker processes: noticing that one ended, signalling
and stopping them, making a worker end with its parent, CPU time, and the fork guard
(`pid`).

The parent keeps a pidfd of every worker it starts (`open_pidfd`, closed by
`stop_processes`).  A pidfd tells that the child ended even when something else reaped it (a
SIGCHLD handler, an ``os.wait()`` elsewhere: ``Process.is_alive()`` then stays True) or when
a grandchild holds the sentinel pipe open, and a signal sent through it cannot reach another
process that reused the pid.  Where pidfds are not available, everything here falls back to
the ``Process`` object's own methods and sentinel.

A worker calls `exit_with_parent` first thing, so that it never outlives the parent, however
the parent ends.  A `PipeEnd` hands a child one end of a pipe (the manager reads a stalled
worker's stacks through one).
"""
import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time
from multiprocessing import context as _mp_context
from multiprocessing import process as _mp_process
from multiprocessing import reduction as _mp_reduction
from multiprocessing.connection import wait as _wait_ready

__all__ = ["open_pidfd", "has_exited", "exit_code", "describe_exit", "send_signal",
           "stop_processes", "stop_half_started", "exit_with_parent", "interrupts_deferred",
           "PipeEnd", "read_available", "pid", "refuse_child", "cpu_seconds", "is_stopped",
           "machine_cpu_ticks", "sigint_held_from_children", "ignore_sigint", "limit_threads"]

# The pidfd of a started process, kept on its Process object: an int >= 0, -1 once it is
# closed or when the process was already gone when started, None where there are none.
#: The pid of this process, read on every call of a manager or a sampler: an object
#: made in one process refuses to be used in a forked child of it (its workers answer only
#: their parent), by comparing this with the pid it was made in (see `refuse_child`).
#: ``os.getpid()`` is a system call; this is kept current by an at-fork hook instead.
#: Every way of going on running Python in a forked child runs those hooks (``os.fork()``,
#: hence multiprocessing's fork and forkserver; C code must call
#: ``PyOS_AfterFork_Child``, which runs them too), so a forked child sees its own pid here.
pid = os.getpid()


def _after_fork_in_child():
    global pid
    pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def refuse_child(obj, owner_pid, more=""):
    """Raise the ``RuntimeError`` of an ``obj`` made in process ``owner_pid`` and used in
    a forked child of it (the caller has compared `pid`); ``more``: what else the user
    should hear."""
    raise RuntimeError(
        f"this {type(obj).__name__} belongs to process {owner_pid} and cannot be used in "
        f"process {os.getpid()} (a forked child): its workers answer only their parent"
        f"{more}")


_PIDFD = "_unienv_mp_pidfd"


class PipeEnd:
    """One end of a pipe (descriptor ``fd``), given to a child process in its ``Process``
    arguments: inherited as it is under fork, handed over by multiprocessing under spawn
    and forkserver (as a Segment's descriptor is)."""

    def __init__(self, fd):
        self.fd = fd

    def __reduce__(self):
        if _mp_context.get_spawning_popen() is None:
            raise ValueError("a PipeEnd can only be sent to a process being started")
        return (_pipe_end_from_dupfd, (_mp_reduction.DupFd(self.fd),))


def _pipe_end_from_dupfd(dupfd):
    return PipeEnd(dupfd.detach())


def read_available(fd, timeout, quiet=0.05):
    """What can be read from the non-blocking descriptor ``fd``: waits up to ``timeout``
    seconds for the first bytes, then reads until none come for ``quiet`` seconds."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    out = []
    wait = timeout
    while True:
        if not poller.poll(max(0, int(wait * 1000))):
            break
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            continue
        if not chunk:
            break
        out.append(chunk)
        wait = quiet
    return b"".join(out)


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """CPU time (user and system) that process ``pid`` has used, from ``/proc``; None if it
    cannot be read (gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK   # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def is_stopped(pid):
    """True if process ``pid`` is stopped (state ``T``: SIGSTOP, SIGTSTP; ``t``: by a
    tracer), from ``/proc``; False if it runs, sleeps, or cannot be read (gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split(None, 1)[0]
        return state in (b"T", b"t")
    except (OSError, IndexError):
        return False


def machine_cpu_ticks():
    """``(idle, total)`` CPU time of the whole machine since boot, in clock ticks, from
    ``/proc/stat`` (idle counts iowait too); None if it cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields[:8])   # idle + iowait; up to steal
    except (OSError, IndexError, ValueError):
        return None


def _poll_pidfd(fd, timeout_ms):
    """The poll events of pidfd ``fd`` (POLLIN: the process ended) within ``timeout_ms``
    (-1: wait).  ``select.poll``, not ``select.select``: that fails on descriptors >= 1024."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    events = 0
    for _, ev in poller.poll(timeout_ms):
        events |= ev
    return events


def open_pidfd(proc):
    """Keep a pidfd of the started process ``proc`` on it (see `has_exited`): a copy of
    its Popen's own where it keeps one (`unienv_mp._process.snapshot`)."""
    try:
        own = getattr(getattr(proc, "_popen", None), "pidfd", None)
        fd = os.dup(own) if own is not None else os.pidfd_open(proc.pid)
    except ProcessLookupError:
        fd = -1           # already gone (and reaped: SIGCHLD ignored)
    except (AttributeError, OSError):
        fd = None         # no pidfds here: fall back to the sentinel
    setattr(proc, _PIDFD, fd)


def _close_pidfd(proc):
    fd = getattr(proc, _PIDFD, None)
    setattr(proc, _PIDFD, -1 if fd is not None else None)
    if fd is not None and fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def has_exited(proc, wait=0.0):
    """True if the started process ``proc`` has ended, or ends within ``wait`` seconds: its
    pidfd says so; without one, ``is_alive()`` and then the sentinel do."""
    fd = getattr(proc, _PIDFD, None)
    try:
        if fd is not None:
            return fd < 0 or _poll_pidfd(fd, int(wait * 1000)) != 0
        if not proc.is_alive():
            return True
        return bool(_wait_ready([proc.sentinel], wait))
    except (ValueError, OSError):
        return True   # the Process object was closed


def exit_code(proc, wait=0.0):
    """``proc``'s exit code, waiting up to ``wait`` seconds for its exit status to arrive
    (a pidfd may tell that it ended before that, e.g. under forkserver, which sends it);
    None if it is unknown (collected elsewhere, or not there yet)."""
    try:
        code = proc.exitcode
        if code is None and wait > 0:
            proc.join(wait)
            code = proc.exitcode
        return code
    except (ValueError, AssertionError, OSError):
        return None


#: The exit code of a process that was about to start workers while it was itself being
#: started with spawn or forkserver: it was importing the main module (as every such
#: process does), and the main module's top level starts a sampler.  Repeating the start
#: would repeat this, so the parent raises instead of starting a replacement.
EXIT_MAIN_REIMPORTED = 86

#: The exit code of a worker that found a task in its ring that does not match its check
#: (see `unienv_mp._transport.protocol`'s task entries): something in the worker wrote
#: into its task ring.  The parent replaces it, as it does a worker that wrote garbage
#: into its result ring, and gives the task to the replacement.  (A work function that
#: exits with this code itself is taken for such a worker.)
EXIT_TASK_REWRITTEN = 87

_MAIN_REIMPORTED = (
    "unienv_mp: this process was started with spawn or forkserver and, while importing "
    "the main module, was about to start a sampler's workers itself: the script does "
    "that at its top level.  Put its work under `if __name__ == \"__main__\":` (see "
    "unienv_mp's docs, Getting started).  Exiting with code {code}.\n")


def exit_if_reimporting_main():
    """Exit at once, with `EXIT_MAIN_REIMPORTED` and one line on stderr, if this process is
    being started with spawn or forkserver and is importing the main module
    (multiprocessing's bootstrapping phase): starting workers from there is the guard-less
    script's mistake, which multiprocessing would answer with a traceback in every such
    process, and the parent with a replacement that makes it again."""
    if getattr(_mp_process.current_process(), "_inheriting", False):
        try:
            os.write(2, _MAIN_REIMPORTED.format(code=EXIT_MAIN_REIMPORTED).encode())
        except OSError:
            pass
        os._exit(EXIT_MAIN_REIMPORTED)


def describe_exit(code):
    """How a process with exit code ``code`` (see `exit_code`) ended, in words."""
    if code is None:
        return "ended (its exit status was collected elsewhere)"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def send_signal(proc, sig):
    """Send ``sig`` to ``proc`` if it has not exited, through its pidfd when it has one (a
    pid alone may have been reused once the child was reaped)."""
    fd = getattr(proc, _PIDFD, None)
    try:
        if fd is None:
            if proc.exitcode is None:
                os.kill(proc.pid, sig)
        elif fd >= 0:
            signal.pidfd_send_signal(fd, sig)
    except (ValueError, AssertionError, OSError):
        pass   # closed, not started, or already gone


def _call(proc, method, *args):
    try:
        return getattr(proc, method)(*args)
    except (ValueError, AssertionError, OSError):
        return None   # closed, not started, or already reaped


def stop_processes(procs, join_timeout):
    """Wait up to ``join_timeout`` seconds for ``procs`` to end, then terminate (and then
    kill) those still running; collect their exit status and close their pidfds.
    Tolerates Process objects never started or already closed.  Cut short (a Ctrl-C while
    it waits), it kills those still running before it raises."""
    started = [p for p in procs if _call(p, "is_alive") is not None]
    try:
        deadline = time.monotonic() + join_timeout
        for p in started:
            if not has_exited(p):
                _call(p, "join", max(0.0, deadline - time.monotonic()))
        for p in started:
            if not has_exited(p):
                send_signal(p, signal.SIGTERM)
        for p in started:
            if not has_exited(p):
                _call(p, "join", 1.0)
            if not has_exited(p):
                send_signal(p, signal.SIGKILL)
                _call(p, "join", 1.0)
        for p in started:
            if not has_exited(p):
                continue   # still dying: multiprocessing reaps it later
            _call(p, "join", 0.1)   # collect the exit status
            if _call(p, "is_alive"):
                # Ended, but reaped by someone else (its exit status is gone):
                # multiprocessing would count it among active_children() for ever.
                _mp_process._children.discard(p)
            else:
                _call(p, "close")
    except BaseException:
        for p in started:
            send_signal(p, signal.SIGKILL)
        for p in started:
            _call(p, "join", 0.1)
        raise
    finally:
        for p in procs:
            _close_pidfd(p)


def stop_half_started(proc):
    """Stop ``proc`` if its ``start()`` got as far as making the process (it was
    interrupted or failed after that), leaving no orphan."""
    if getattr(proc, "_popen", None) is not None:
        if getattr(proc, _PIDFD, None) is None:
            open_pidfd(proc)
        stop_processes([proc], 0.0)


def exit_with_parent(parent_pid, use_pdeathsig, watch=True):
    """Make this process end when process ``parent_pid`` ends, however it ends.

    ``use_pdeathsig``: ask the kernel to SIGKILL this process when the *thread* that
    started it exits (immediate; only worth it when that was the parent's main thread).
    Besides (``watch``), a daemon thread sleeps on a pidfd of the parent and exits the
    process when it ends (forkserver, a parent thread that has ended).  Exits at once if
    the parent is already gone."""
    if use_pdeathsig:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):
        return
    if not watch:
        os.close(pidfd)
        return

    def watch():
        while True:
            events = _poll_pidfd(pidfd, -1)
            if events & select.POLLIN:
                os._exit(0)      # the parent ended
            if events & select.POLLNVAL:
                return           # the work function closed our descriptor

    threading.Thread(target=watch, name="unienv_mp parent watchdog", daemon=True).start()


@contextlib.contextmanager
def sigint_held_from_children(exec_child=False):
    """For the ``with`` block, in which a worker process is started: SIGINT is blocked in
    this thread, so that a Ctrl-C arriving meanwhile stays pending and is taken when the
    block ends (nothing is lost), and the child starts with it blocked (see
    `ignore_sigint`).  SIGINT's disposition is left alone, so a Ctrl-C that the kernel
    hands another thread meanwhile is raised as usual.

    ``exec_child``: the child is exec'd (spawn, forkserver).  The signal mask survives
    fork and exec, and the forkserver's children inherit the server's (the server is
    started by the first start under this block).  The one thing that clears it is
    multiprocessing itself: the first start of a process that needs its resource tracker
    starts the tracker, blocks SIGINT around that, then unblocks it in the calling thread.
    So the tracker is started here first, and SIGINT blocked again after."""
    try:
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    except (AttributeError, OSError, ValueError):
        old_mask = None
    try:
        if exec_child and old_mask is not None:
            from multiprocessing import resource_tracker
            resource_tracker.ensure_running()
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        yield
    finally:
        if old_mask is not None and signal.SIGINT not in old_mask:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def limit_threads():
    """Run torch ops single-threaded in a worker, as torch's DataLoader does: a forked
    child inherits the parent's OpenMP pool state but not its threads, and the first
    parallel op would wait forever for them.  The workers are the parallelism."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def ignore_sigint():
    """In a worker: ignore SIGINT, then unblock it.  A worker is started with SIGINT
    blocked (`sigint_held_from_children`), so a terminal's Ctrl-C, which reaches
    the whole process group, never interrupts multiprocessing bootstrapping it (imports,
    unpickling); one pending is discarded here.  Ctrl-C is the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    except (AttributeError, OSError, ValueError):
        pass


@contextlib.contextmanager
def interrupts_deferred():
    """Hold back Ctrl-C (SIGINT) for the duration of the ``with`` block: a SIGINT that
    arrives meanwhile is handed to the handler that was installed (by default: raise
    ``KeyboardInterrupt``) when the block ends, so a ``KeyboardInterrupt`` cannot land
    between two statements of it.  Signals are only handled in the main thread; elsewhere
    (and when Python's own handler is not in place) this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):   # SIG_IGN, SIG_DFL or a handler not installed from Python
        yield
        return
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            previous(signal.SIGINT, held[0])
