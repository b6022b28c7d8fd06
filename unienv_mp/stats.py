"""Where a sampler's time goes: [`SamplerStats`][unienv_mp.SamplerStats] and
[`WorkerStats`][unienv_mp.WorkerStats], returned by ``MultiprocessingSampler.stats()`` and
``MultiProcessingSampleManager.stats()``.

**How they are counted.**  Each worker keeps its counters in its own shared segment, in the
block laid out below, written with plain stores by that worker alone and read by the
parent whenever ``stats()`` is called: no system call, lock or message per batch.  A
64-bit aligned store is a single store on the machines this runs on (x86-64, aarch64),
so the parent reads each counter whole, possibly a task out of date.  The caller's side
(batches handed out, time spent waiting) is counted in the calling process, in a
`CallerRecord`.  Counters of a worker's earlier processes (before it was replaced) are kept
by the parent, in a `WorkerRecord` per worker index, and added.

The counter block (``COUNTERS`` 64-bit words at ``_protocol.STATS_AT`` of a worker's
segment):

```text
STARTED      monotonic ns at which the worker began taking tasks (after its
             worker_init_fn; 0 before)
TASKS        tasks done
BATCHES      batches made (a task of k batches counts k)
ERRORS       tasks whose work function raised
BUSY         ns spent on tasks (making the result and writing it into its slot)
TASK_SINCE   monotonic ns at which the task in hand began (0: waiting for one)
TICKET       the ticket of the task in hand
START_CPU    CPU ns the process had used at STARTED (imports, unpickling, init)
HIST + i     batches whose time (the task's time over its batches) fell in bucket i
```

Bucket ``i`` holds times in ``[bucket_edge(i), bucket_edge(i + 1))`` nanoseconds: four
buckets per doubling from 1 µs, none more than 25 % wide (the first also takes anything
shorter, the last anything longer than about 15 s), so a quantile read as the middle of
its bucket is within 12 % of the true one.
"""
import math
import time
from dataclasses import dataclass, field
from typing import List, Optional

from . import _os

__all__ = ["SamplerStats", "WorkerStats", "DeviceStats"]

# -- the counter block ---------------------------------------------------------------------

# (WorkerCounters writes these indices out)
STARTED, TASKS, BATCHES, ERRORS, BUSY, TASK_SINCE, TICKET, MADE, START_CPU = range(9)
HIST = 9
N_BUCKETS = 96
COUNTERS = HIST + N_BUCKETS
_SUMMED = (TASKS, BATCHES, ERRORS, BUSY, MADE)


def bucket_of(ns):
    """The histogram bucket of a batch that took ``ns`` nanoseconds (see the module's
    docstring): 4 per doubling from 1024 ns."""
    b = ns.bit_length()
    if b <= 10:
        return 0
    i = 4 * (b - 11) + ((ns >> (b - 3)) & 3)
    return i if i < N_BUCKETS else N_BUCKETS - 1


def bucket_edge(i):
    """The lower edge, in ns, of bucket ``i`` (``bucket_of(bucket_edge(i)) == i``)."""
    octave, quarter = divmod(i, 4)
    return (4 + quarter) << (octave + 8)


class WorkerCounters:
    """A worker's own side of its counter block: ``view`` is a memoryview of the block
    cast to unsigned 64-bit words (the worker is its only writer).  All zero until
    `started` (``now_ns`` given: started now)."""
    __slots__ = ("view",)

    def __init__(self, view, now_ns=None):
        self.view = view
        for i in range(COUNTERS):
            view[i] = 0
        if now_ns is not None:
            self.started(now_ns, 0)

    def started(self, now_ns, cpu_ns):
        """The worker begins taking tasks at ``now_ns``, having used ``cpu_ns`` of CPU
        time to get there.  (STARTED last: the parent reads it first.)"""
        self.view[START_CPU] = cpu_ns
        self.view[STARTED] = now_ns

    def begin(self, ticket, now_ns):
        """A task (``ticket``) begins, at ``now_ns``."""
        view = self.view
        view[6] = ticket      # TICKET
        view[5] = now_ns      # TASK_SINCE

    def end(self, batches, failed, elapsed_ns):
        """The task in hand ended after ``elapsed_ns``, having made ``batches`` batches
        (or raised: ``failed``).  (Indices written out: this runs once per task.)"""
        view = self.view
        view[5] = 0           # TASK_SINCE
        view[1] += 1          # TASKS
        view[4] += elapsed_ns # BUSY
        if failed:
            view[3] += 1      # ERRORS
            return
        view[2] += batches    # BATCHES
        view[7] += elapsed_ns # MADE (the time of the tasks that made batches)
        ns = elapsed_ns // batches
        b = ns.bit_length()   # (bucket_of, inlined)
        i = 0 if b <= 10 else 4 * (b - 11) + ((ns >> (b - 3)) & 3)
        view[HIST + (i if i < N_BUCKETS else N_BUCKETS - 1)] += batches


def read(view):
    """A copy of a counter block (a list of ``COUNTERS`` ints)."""
    return view.tolist()


def since(now, then):
    """Counters ``now`` less a baseline ``then`` taken earlier from the same block: the
    sums and the histogram (``STARTED`` and the task in hand are ``now``'s)."""
    if then is None:
        return list(now)
    out = list(now)
    for i in _SUMMED:
        out[i] -= then[i]
    for i in range(HIST, COUNTERS):
        out[i] -= then[i]
    return out


def added(a, b):
    """The sums and histograms of two counter blocks (of one worker's processes)."""
    if a is None:
        return list(b)
    out = list(b)
    for i in _SUMMED:
        out[i] += a[i]
    for i in range(HIST, COUNTERS):
        out[i] += a[i]
    return out


def quantile(counters, q):
    """The ``q``-quantile of the per-batch times in ``counters``' histogram, in seconds
    (the middle of the bucket it falls in, on a log scale), or None without batches."""
    hist = counters[HIST:COUNTERS]
    total = sum(hist)
    if not total:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(hist):
        seen += n
        if seen >= rank:
            return math.sqrt(bucket_edge(i) * bucket_edge(i + 1)) / 1e9
    return bucket_edge(N_BUCKETS) / 1e9


class WorkerRecord:
    """What the parent keeps of one worker index across its processes: the counters of
    the processes that ended (since the last reset), the current process's counters at
    the last reset (the baseline), their time alive, and the replacements."""
    __slots__ = ("totals", "baseline", "alive_ns", "respawns", "reset_ns", "cpu_baseline")

    def __init__(self, now_ns):
        self.totals = None
        self.baseline = None
        self.alive_ns = 0
        self.respawns = 0
        self.reset_ns = now_ns
        self.cpu_baseline = None   # (STARTED of the process, its CPU seconds) at the reset

    def process_ended(self, counters, now_ns):
        """The current process ended (its last ``counters``, or None if unknown)."""
        if counters is not None:
            self.totals = added(self.totals, since(counters, self.baseline))
            self.alive_ns += now_ns - max(counters[STARTED], self.reset_ns)
        self.baseline = None

    def reset(self, counters, now_ns, cpu_seconds=None):
        self.totals = None
        self.baseline = counters
        self.alive_ns = 0
        self.respawns = 0
        self.reset_ns = now_ns
        self.cpu_baseline = (None if counters is None or cpu_seconds is None
                             else (counters[STARTED], cpu_seconds))

    def read(self, index, pid, counters, now_ns, reset=False, launched_ns=None):
        """`report`, with the CPU time of process ``pid`` (None: it has none now) read from
        ``/proc``; ``reset=True``: then `reset`, so that the counters start again from
        zero."""
        cpu = None if pid is None else _os.cpu_seconds(pid)
        out = self.report(index, pid, counters, now_ns, cpu, launched_ns)
        if reset:
            self.reset(counters, now_ns, cpu)
        return out

    def report(self, index, pid, counters, now_ns, cpu_seconds=None, launched_ns=None):
        """The `WorkerStats` of this index, its current process's ``counters`` being as
        given (None: it has none now), the CPU time that process used since it started
        (None: unknown), and when the parent started it (``launched_ns``, monotonic; None:
        unknown)."""
        alive = self.alive_ns
        c = self.totals
        if counters is not None and not counters[STARTED]:
            counters = None   # (a process not started yet: nothing of it to count)
        task_seconds = cpu_fraction = startup = None
        if counters is not None and launched_ns is not None:
            startup = max(0, counters[STARTED] - launched_ns) / 1e9
        if counters is not None and cpu_seconds is not None:
            # (the CPU time it took to start is not part of its time alive)
            since_ns, used = counters[STARTED], cpu_seconds - counters[START_CPU] / 1e9
            base = self.cpu_baseline
            if base is not None and base[0] == counters[STARTED]:   # (the same process)
                since_ns, used = self.reset_ns, cpu_seconds - base[1]
            lived = now_ns - max(since_ns, counters[STARTED])
            cpu_fraction = max(0.0, min(1.0, used * 1e9 / lived)) if lived > 0 else 0.0
        if counters is not None:
            c = added(c, since(counters, self.baseline))
            alive += now_ns - max(counters[STARTED], self.reset_ns)
            if counters[TASK_SINCE]:
                task_seconds = max(0, now_ns - counters[TASK_SINCE]) / 1e9
        if c is None:
            c = [0] * COUNTERS
        batches = c[BATCHES]
        return WorkerStats(
            index=index, pid=pid, batches=batches, tasks=c[TASKS],
            busy_fraction=min(1.0, c[BUSY] / alive) if alive > 0 else 0.0,
            seconds_per_batch_mean=c[MADE] / batches / 1e9 if batches else None,
            seconds_per_batch_p99=quantile(c, 0.99), respawns=self.respawns,
            errors=c[ERRORS], task_seconds=task_seconds, cpu_fraction=cpu_fraction,
            startup_seconds=startup)


class CallerRecord:
    """What a manager counts of the caller's side: ``batches`` handed out, ``wait_ns`` spent
    waiting for them, less ``startup_ns`` spent waiting for workers still starting, since
    the first request (`begin`) or the last reset."""
    __slots__ = ("batches", "wait_ns", "startup_ns", "since_ns", "machine_since")

    def __init__(self):
        self.batches = 0
        self.wait_ns = 0
        self.startup_ns = 0
        self.since_ns = None        # monotonic ns of the first request (None: none yet)
        self.machine_since = None   # the machine's CPU ticks then (machine_cpu_ticks)

    def begin(self):
        """The first request is made now (call it once, while ``since_ns`` is None)."""
        self.since_ns = time.monotonic_ns()
        self.machine_since = _os.machine_cpu_ticks()

    def waited(self, t0_ns, t1_ns, started_ns):
        """The caller waited from ``t0_ns`` to ``t1_ns`` for a worker whose process began
        taking tasks at ``started_ns`` (0: not yet): the part before that is start-up."""
        if started_ns == 0 or started_ns > t0_ns:
            startup = (t1_ns if started_ns == 0 else min(started_ns, t1_ns)) - t0_ns
            self.startup_ns += startup
            self.wait_ns += t1_ns - t0_ns - startup
        else:
            self.wait_ns += t1_ns - t0_ns

    def report(self, ready, workers, now_ns, reset=False):
        """The `SamplerStats` of the caller's side and ``workers`` (their `WorkerStats`),
        ``ready`` batches waiting to be handed out; ``reset=True``: then the counts start
        again from zero, from now."""
        since = self.since_ns
        wall = 0.0 if since is None else (now_ns - since) / 1e9
        wait = self.wait_ns / 1e9
        startup = self.startup_ns / 1e9
        running = wall - startup
        wait_fraction = min(1.0, wait / running) if running > 0 else 0.0
        busy = sum(x.busy_fraction for x in workers) / len(workers) if workers else 0.0
        machine = _os.machine_cpu_ticks()
        out = SamplerStats(
            batches=self.batches, wait_seconds=wait, wall_seconds=wall,
            wait_fraction=wait_fraction, ready=ready, workers=workers,
            startup_seconds=startup,
            bottleneck=bottleneck(wait_fraction, busy, self.batches),
            machine_idle_fraction=idle_between(self.machine_since, machine))
        if reset:
            self.batches = 0
            self.wait_ns = 0
            self.startup_ns = 0
            self.since_ns = now_ns
            self.machine_since = machine
        return out


# -- what stats() returns ------------------------------------------------------------------

#: The bottleneck rule's thresholds (see `SamplerStats.bottleneck`).
CALLER_WAITS = 0.5      # "workers": the caller waits at least this fraction of the time...
WORKERS_BUSY = 0.5      # ... and the workers are busy at least this fraction of theirs
WORKERS_IDLE = 0.5      # "consumer": the workers are busy less than this fraction...
CALLER_FLOWS = 0.1      # ... and the caller waits less than this fraction


@dataclass
class WorkerStats:
    """One worker (one index: its replacements included) since the start or the last
    ``stats(reset=True)``.  A worker counts a task just after it has published its result:
    a moment after the caller may have it.

    Attributes:
        index: the worker's index.
        pid: the process running now (None between a death and its replacement).
        batches: batches it made (a task of ``k`` batches counts ``k``).
        tasks: tasks it finished.
        busy_fraction: time spent on tasks over time alive (0 to 1).  A process waiting
            for a CPU while on a task counts as busy.
        seconds_per_batch_mean: mean time per batch (a task's time over its batches).
        seconds_per_batch_p99: the 99th percentile of that, from a fixed histogram (four
            buckets per doubling: within 12 %).
        respawns: how many times it was replaced (after dying, or stalling).
        errors: tasks whose work function raised.
        task_seconds: how long the task in hand has been running (None: waiting).
        cpu_fraction: CPU time the current process used over its time alive since the
            reset (0 to 1, None if unknown; read from ``/proc`` in clock ticks), its
            start-up not counted.  Busy but not on a CPU: it waits for something else
            (I/O, a sleep, a lock, or a CPU the machine does not have free).
        startup_seconds: how long the current process took to start: from the parent's
            start of it until it could take tasks (the process's start, imports and
            unpickling the sampler under spawn and forkserver, ``worker_init_fn``).
            Not part of its time alive.  None without a process, before it has
            started, or where unknown (Ray).
    """
    index: int
    pid: Optional[int]
    batches: int
    tasks: int
    busy_fraction: float
    seconds_per_batch_mean: Optional[float]
    seconds_per_batch_p99: Optional[float]
    respawns: int
    errors: int
    task_seconds: Optional[float] = None
    cpu_fraction: Optional[float] = None
    startup_seconds: Optional[float] = None


@dataclass
class DeviceStats:
    """What a sampler did to hand batches out on a device (``device="cuda"``, or data on a
    GPU) or from page-locked slots (``pin_memory=True``), since the first request or the
    last reset.

    Attributes:
        device: where batches go (``"cuda:0"``), or ``"cpu (pinned)"`` with ``pin_memory``.
        copies: batches copied to the device.
        copy_seconds: device time of the copies completed (timed on the sampler's copy
            stream; the caller's stream waits for them, the caller does not).
        wait_seconds: time the caller spent issuing copies, and blocked while the device
            caught up (a copy from pageable memory, more copies in flight than the feed
            holds, or a slot still being page-locked when its batch was needed): the
            caller's own cost of the last hop.
        pinned_bytes: host memory page-locked now (the registered slots).
        pinned_slots: slot segments page-locked now.
        pageable_leaves: arrays copied from memory that was not page-locked (a batch
            copied out of its slot, a registration refused, or an array that is not
            contiguous, which is copied through a pageable temporary).
        in_flight: copies not known to have completed (with ``pin_memory``: batches the
            caller let go of, kept until the caller's copies of them are known to be done).
        registrations: slot segments page-locked (each once, on a thread of the sampler's
            own, never the caller's).  Slots are made while the pipeline fills: a timed
            loop starts once a window of steps saw none.
        registration_seconds: the time those registrations took on that thread.
    """
    device: str
    copies: int = 0
    copy_seconds: float = 0.0
    wait_seconds: float = 0.0
    pinned_bytes: int = 0
    pinned_slots: int = 0
    pageable_leaves: int = 0
    in_flight: int = 0
    registrations: int = 0
    registration_seconds: float = 0.0


@dataclass
class SamplerStats:
    """Where a sampler's (or a manager's) time went, since its first request or the last
    ``stats(reset=True)``.

    Attributes:
        batches: batches handed to the caller (for a manager: results, each counted as
            its work function's ``batches_in(work)``, 1 by default).
        wait_seconds: time the caller spent blocked waiting for them, less
            ``startup_seconds``.
        device: a [`DeviceStats`][unienv_mp.DeviceStats] where batches are handed out on a
            device or from page-locked slots, else None.
        startup_seconds: time the caller spent blocked waiting for workers that were
            still starting (see `WorkerStats.startup_seconds`): neither the caller waiting
            on a slow pipeline nor the workers' busy time.  (0 for Ray.)
        wall_seconds: time since the first request (or the reset).
        wait_fraction: ``wait_seconds / (wall_seconds - startup_seconds)``: how much of
            the time the workers were running the caller waited for them.
        ready: batches finished and waiting to be handed out right now.
        workers: one [`WorkerStats`][unienv_mp.WorkerStats] per worker index.
        gather_path: ``"direct"``, ``"generic"`` or ``"in_process"`` for a sampler (None for
            a manager).
        epoch_workers: which workers the sampler's latest epoch began on, ``"kept"``,
            ``"new"`` or ``"in_process"`` (None for a manager, or before the first
            epoch).
        epoch_workers_reason: why, in words (see the sampler's ``persistent_workers``).
        machine_idle_fraction: how much of the machine's CPU time went unused meanwhile
            (``/proc/stat``; None if unknown): with little left, more workers cannot run
            faster.
        bottleneck: ``"workers"`` when the caller waits at least half of the time and the
            workers are busy at least half of theirs (more, or faster, workers would help);
            ``"consumer"`` when the workers are busy less than half of their time and the
            caller waits less than 10 % (they wait for the caller: more workers would not
            help); ``"balanced"`` otherwise.  ``None`` before anything was asked for.
    """
    batches: int
    wait_seconds: float
    wall_seconds: float
    wait_fraction: float
    ready: int
    workers: List[WorkerStats] = field(default_factory=list)
    gather_path: Optional[str] = None
    bottleneck: Optional[str] = None
    machine_idle_fraction: Optional[float] = None
    startup_seconds: float = 0.0
    device: Optional[DeviceStats] = None
    epoch_workers: Optional[str] = None
    epoch_workers_reason: Optional[str] = None

    @property
    def busy_fraction(self):
        """The workers' mean busy fraction."""
        if not self.workers:
            return 0.0
        return sum(w.busy_fraction for w in self.workers) / len(self.workers)

    def advice(self, cpus=None):
        """One line on what to change, from `bottleneck`: with the workers the bottleneck,
        how many workers would keep up (the workers deliver ``1 - wait_fraction`` of what
        the caller takes), as many as the machine's idle CPU time can run (``cpus``: the
        CPUs this process may use, by default ``os.sched_getaffinity``)."""
        import os
        n = len(self.workers)
        if cpus is None:
            cpus = len(os.sched_getaffinity(0))
        if self.bottleneck == "workers":
            want = math.ceil(n / max(0.05, 1.0 - self.wait_fraction))
            idle = self.machine_idle_fraction
            per_worker = [w.cpu_fraction for w in self.workers if w.cpu_fraction is not None]
            if idle is not None and per_worker:
                cpu = max(0.05, sum(per_worker) / len(per_worker))
                room = int(idle * cpus / cpu)      # more workers the idle CPUs can run
                if room < 1:
                    return (f"workers are the bottleneck, and the machine's CPUs are busy "
                            f"({100 * idle:.0f} % idle): more workers would not help; a "
                            f"faster sampler, or more CPUs, would")
                want = min(want, n + room)
            return f"workers are the bottleneck: try n_workers={max(n + 1, want)}"
        if self.bottleneck == "consumer":
            return ("the caller is the bottleneck (the workers wait for it): more workers "
                    "will not help")
        if self.bottleneck == "balanced":
            return "balanced: the workers keep up with the caller"
        return "nothing measured yet"


def idle_between(then, now):
    """The idle fraction of the machine's CPU time between two ``machine_cpu_ticks()``
    readings (None if either is unknown or no time passed)."""
    if then is None or now is None or now[1] <= then[1]:
        return None
    return max(0.0, min(1.0, (now[0] - then[0]) / (now[1] - then[1])))


def bottleneck(wait_fraction, busy_fraction, batches):
    """The rule of `SamplerStats.bottleneck`."""
    if not batches:
        return None
    if wait_fraction >= CALLER_WAITS and busy_fraction >= WORKERS_BUSY:
        return "workers"
    if busy_fraction < WORKERS_IDLE and wait_fraction < CALLER_FLOWS:
        return "consumer"
    return "balanced"
