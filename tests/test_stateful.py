"""Model-based test of ``MultiprocessingSampler`` under faults (hypothesis's
``RuleBasedStateMachine``).

A machine drives one sampler (and the samplers that replace it) with random calls and
faults, and checks every batch it is handed against a model of what the package promises
(the docs' guides: "Reproducible and resumable", "Epochs", "Zero-copy", "Reliability"):

* the ``j``-th batch of each ``sample*`` method depends only on the seed and ``j``: not on
  ``n_workers``, ``n_buffers``, ``copy``, ``direct_gather``, the start method, workers
  SIGKILLed or SIGSTOPped (``respawn=True``), nor on the other methods' calls;
* ``epoch_iter()`` (and ``epoch_iter_with_metadata()``) is a shuffled permutation drawn
  with the wrapped sampler's RNG, every index once, the last batch partial;
* ``state_dict()`` / ``load_state_dict()`` into a NEW sampler (another ``n_workers``,
  ``n_buffers``, ``copy``, ``direct_gather``, a pickle round trip, before or after the old
  one's ``close()``) goes on with the same streams and the same epochs (mid-epoch resume,
  in the order they started), and a state holding an epoch of another data length is
  refused with ``ValueError``;
* ``manual_seed(s)`` restarts the streams and the epochs' RNG as a fresh sampler seeded
  with ``s`` would (epochs already begun go on with their permutation);
* a Ctrl-C (a real SIGINT, from a timer thread, at a random moment of a loop of calls)
  raises ``KeyboardInterrupt``; it moves a stream by at most the batch being handed out,
  ends the epoch it cuts short, and the sampler goes on.  (One that CPython drops, raised
  in an at-fork hook of another library while a worker is forked, is sent again and
  counted: see :class:`_Interrupt`);
* batches kept (``copy=False``: views of shared slots) never change while held, through
  later calls, faults, ``close()`` and replacement;
* after ``close()`` no worker process of the sampler is running and no descriptor of a
  unienv_mp segment is open here.

The rules (operations), with random arguments: ``sample`` / ``sample_with_metadata`` /
``sample_flat`` / ``sample_index`` (some batches held); an epoch iterator started,
advanced ``k`` batches, closed or dropped (garbage collected); ``manual_seed``; the state
into a new sampler that replaces this one; ``close()`` then a new sampler, fresh or
going on from the closed one's state; rows appended to a shared buffer; a worker (of the
``sample*`` pool or an epoch's) SIGKILLed, or SIGSTOPped and continued by a timer or a
later rule (past ``stall_timeout`` only where one is set); a Ctrl-C; held batches let go.
Each example draws the data (shared or not, its length), the batch size,
``batches_per_task``, ``stall_timeout`` (None or 1 s) and the start method: fork in
:func:`test_model_fork`, spawn or forkserver in :func:`test_model_spawn_and_forkserver`.
Not covered: ``in_order=False``, calls from several threads, a Ctrl-C during
``state_dict`` / ``load_state_dict`` / ``manual_seed`` / ``close``, devices, Ray.

The model
---------
The model is computed in this process, from the docs' definition of the streams and
with no code of the package:

* A stream's base seed stands for the wrapped sampler's RNG state "read without drawing
  from it" (the docs).  The exact function is ``streams.base_seed``: BLAKE2b (8 bytes) of
  ``b"data_rng"`` + the bytes of the ``data_rng`` generator's state + ``b"rng"`` (a
  ``StepSampler`` has no ``rng``).  :func:`model_base` re-implements it over a fresh
  ``torch.Generator().manual_seed(seed)``: this is the one place where the model follows
  the package's code rather than the docs, which do not give the hash.
* Batch ``j``'s seed: the docs' "keyed bijection of j onto 32-bit numbers (MurmurHash3's
  finaliser), keyed by a mix of the stream's base seed and the method's name"; the key is
  ``splitmix64(splitmix64(base) ^ crc32(method))`` (the docstring of
  ``unienv_mp/_sampling/streams.py``), re-implemented in :func:`model_chunk_seed`.
* Batch ``j`` is the first draw after the wrapped sampler is seeded for batch ``j``,
  whatever ``batches_per_task`` is: the model draws it as UniEnv's
  ``StepSampler.sample_index`` does, with torch directly
  (``torch.randint(0, len(data), (B,), generator=Generator(seed))``).
* An epoch's order is ``torch.randperm(len(data), generator=rng)`` of a model generator
  seeded as the wrapped sampler is (UniEnv's ``epoch_iter``), drawn when the epoch begins
  (its iterator's first ``next()``).
* A batch is reduced to its row indices (rows encode their own index, ``_data.indices_of``)
  and compared bit for bit with the model's; its full contents are compared with UniEnv's
  ``ReplayBuffer.get_at`` / ``get_flattened_at`` of those indices (torch.equal), and held
  batches with a deep copy taken when they were handed out.

Where the promise allows more than one outcome, the model keeps every allowed one and the
next observation decides: after a Ctrl-C a stream is at its old position or one on (a
range of positions); a Ctrl-C that may have landed in an epoch's start before or after
its permutation was drawn leaves two candidate RNG states; over a buffer shared between
processes (``multiprocessing=True``) that the parent appends to, a ``sample*`` batch may be
drawn over any length the buffer had since its stream was (re)started (a chunk is drawn
when a worker takes its task), so the model accepts ``randint`` over any of those lengths
(the epochs, drawn in the parent, stay exact).  A ``WorkerDiedError`` ("giving up") is
accepted only after more than ``max_respawns`` faults in that sampler's life, and moves
no stream; a ``WorkerStalledError``, likewise and only with a ``stall_timeout``, skips the
rest of the chunk (docs: "Stalled workers").

This machine leaves out appends to a buffer NOT shared between processes, and every other
change of the data but appends to a shared one: which copy of the data a pool's workers
hold is the second machine's business.

The second machine: data that changes under the pools
-----------------------------------------------------
:class:`DataModel` drives a sampler over a ReplayBuffer that the test changes between
calls, and faults of the processes behind the pools, and holds the package to the rule of
the epochs guide ("One copy per pool"): every worker of a pool serves batches from one
copy of the data, the copy taken when the pool's first worker started, and an epoch runs
on an existing pool only while that copy is the data as it is now.  Every key of every row
tells its step (:func:`step_rows`: ``state[:, 0]``, ``action[:, 0]`` and the image's first
two channels), and the generation of the tensor it was written into, so a torn row (keys
from different steps) is told by its contents, before the bit-for-bit comparison.

The rules: ``sample*`` calls; epoch iterators started, advanced, closed; rows appended (to
a shared buffer or not; never wrapping around); a storage tensor of a
``multiprocessing=True`` buffer replaced by another one in shared memory, every row one
generation on (``st.data = next_generation(st.data).share_memory_()``); one storage tensor
of a buffer not shared moved to shared memory (``share_memory_()``: "sharing part of a
buffer"); a worker SIGKILLed; a worker of the ``sample*`` pool SIGKILLed while it has not
begun taking tasks (under spawn and forkserver: still importing; the workers left to start
later are started first, or not), then calls until one waits on the pool; the snapshot
process of a pool (fork) SIGKILLed, or SIGSTOPped until a later rule continues it; every
worker of the ``sample*`` pool started and up (as after a while of training);
``close()`` and a new sampler.  Each example draws whether the buffer is shared, its
length, the batch size, ``batches_per_task``, ``persistent_workers`` (None or False), the
sampler's options and the start method: fork in :func:`test_data_model_fork`, spawn or
forkserver in :func:`test_data_model_spawn_and_forkserver`.

Its model is UniEnv in this process, over copies of the data that the model takes itself
(:class:`PoolCopy`), with no code of the package:

* an epoch is the permutation of the stream model above, over the buffer as it was when
  the epoch began (its first ``next()``): every batch is UniEnv's ``get_at`` (or
  ``get_at_with_metadata``) of its rows over a copy of the buffer taken then, whichever
  workers the package ran it on, and whatever changed or died since;
* the ``sample*`` streams are those of the stream model, drawn over the copy of the pool
  that serves them: the buffer as it was when the pool started (the first ``sample*``
  call, or the epoch that started it), but for what is shared between processes, which
  the workers read as it is now: a storage tensor in shared memory, and the count of a
  buffer made with ``multiprocessing=True`` (any length since);
* where the data moved away from what a pool's workers can serve whole rows of (the
  epochs guide, "One copy per pool": a storage tensor of a ``multiprocessing=True``
  buffer replaced; a buffer with some storage tensors ``share_memory_()``'d written),
  the next ``sample*`` call, of any method, starts a new pool over the data as it is
  then: from there on every method's batches come from it (none made ahead by the old
  pool comes out), each stream going on at its position; one ``RuntimeWarning`` in the
  sampler's life says "moved away", and none where nothing moved.  (A buffer not made
  with ``multiprocessing=True`` whose every storage tensor is in shared memory, written:
  its rows stay whole either way, and the package counts it as partly shared, since the
  bounds of its spaces are not; the model allows a new pool there or none);
* any other new ``sample*`` pool in the middle of a sampler's life is allowed only where
  every worker of the old one may be gone for good (fork, its snapshot process killed or
  stopped, a worker killed, the data changed since its copy) and a ``RuntimeWarning``
  says so; every method's batches go on from the new pool, over the data as it is now,
  but those the old pool had made, which may still come first;
* a ``WorkerDiedError`` ends an epoch only where its workers' copy may be lost likewise
  (or after more than ``max_respawns`` kills: "giving up"), and a ``sample*`` call only
  after more than ``max_respawns`` kills;
* a worker killed while it started is no longer among the pool's workers, nor left a
  zombie, once it has ended (every thread of it) and then a call waited on the pool
  (calls are made until one does; where none does in 64 calls, nothing is asserted),
  and the streams go on unchanged;
* after ``close()`` no worker or snapshot process of the sampler runs, and no descriptor
  of a unienv_mp segment is open here.

The default run is bounded (about two to three minutes on 2 cores, for the whole file).
``-m soak`` runs :func:`test_model_soak`, which keeps running new examples of both
machines for ``UNIENV_MP_MODEL_SECONDS`` (default 60) and prints the operations and faults
survived (also written as JSON to ``UNIENV_MP_MODEL_REPORT`` if that names a file).
"""
import collections
import gc
import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import warnings
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)
from unienv_data.samplers import StepSampler

from unienv_mp import MultiprocessingSampler, WorkerDiedError, WorkerStalledError

from _data import indices_of, replay_buffer, transitions
from conftest import own_segment_fds, process_running, wait_until

IMG = (3, 8, 8)
METHODS = ("sample", "sample_with_metadata", "sample_flat", "sample_index")
GETTERS = {"epoch_iter": "get_at", "epoch_iter_with_metadata": "get_at_with_metadata"}
#: Default batches per task (docs: "Small batches"): batches here are at most 16 rows of
#: 836 bytes, so 8 fit in 1 MiB for the methods that can be gathered directly.
DEFAULT_K = {"sample": 8, "sample_with_metadata": 8, "sample_flat": 8, "sample_index": 1}
MAX_RESPAWNS = 3          # the manager's default: give up after 4 deaths in a row
STALL_TIMEOUT = 1.0       # when an example sets one (generous: a task takes microseconds)
TIMEOUT = 120.0           # a hang fails the test with TimeoutError instead of hanging it
MAX_HELD = 8

#: What the machines survived, over every example of the session (see the soak test).
COUNTS = collections.Counter()


# -- the model (no code of the package) ----------------------------------------------------

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1


def _splitmix64_final(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _murmur3_final(z):
    z ^= z >> 16
    z = (z * 0x85EBCA6B) & _M32
    z ^= z >> 13
    z = (z * 0xC2B2AE35) & _M32
    return z ^ (z >> 16)


def model_base(seed):
    """The base seed of a StepSampler seeded with ``seed`` (see the module docstring)."""
    state = torch.Generator().manual_seed(seed).get_state()
    h = hashlib.blake2b(digest_size=8)
    h.update(b"data_rng")
    h.update(bytes(state.numpy()))
    h.update(b"rng")
    return int.from_bytes(h.digest(), "little")


def model_chunk_seed(base, method, chunk):
    key = _splitmix64_final(_splitmix64_final(base) ^ zlib.crc32(method.encode()))
    return _murmur3_final((chunk + key) & _M32) ^ ((key >> 32) & _M32)


class StreamModel:
    """The row indices of batch ``j`` of ``method``'s stream for base seed ``base``, drawn
    over ``n`` rows, as UniEnv's StepSampler draws them after ``manual_seed(batch seed)``
    (whatever ``k``, the batches per task)."""

    def __init__(self, base, method, k, batch_size):
        self.base, self.method, self.k, self.batch_size = base, method, k, batch_size
        self._batches = {}

    def batch(self, j, n):
        batch = self._batches.get((j, n))
        if batch is None:
            if len(self._batches) > 4096:
                self._batches.clear()
            g = torch.Generator().manual_seed(model_chunk_seed(self.base, self.method, j))
            batch = self._batches[(j, n)] = torch.randint(
                0, n, (self.batch_size,), generator=g).tolist()
        return batch


class EpochModel:
    """An epoch of ``getter``: its candidate orders until the first batch tells which (each
    with the RNG state it leaves), then one; ``pos``: batches handed out."""

    def __init__(self, getter, candidates, batch_size):
        self.getter = getter
        self.candidates = candidates   # [(order, rng state after it)]
        self.batch_size = batch_size
        self.pos = 0

    @property
    def order(self):
        return self.candidates[0][0]

    def n_batches(self):
        return -(-len(self.order) // self.batch_size)

    def __repr__(self):
        return (f"<epoch {self.getter} of {len(self.order)} rows, {self.pos}/"
                f"{self.n_batches()} handed out, {len(self.candidates)} candidate(s)>")


# -- helpers -------------------------------------------------------------------------------

def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    return x


def _same(a, b):
    """Bit-for-bit equality of two batches: types, structure, key order, dtypes, values."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _indices(method, batch):
    if method == "sample_index":
        return batch.tolist()
    return indices_of(batch, img=IMG)


def _expected_rows(rb, how, idx):
    """UniEnv's own answer for rows ``idx``: what the batch must hold."""
    idx = torch.tensor(idx, dtype=torch.int64)
    if how in ("sample", "get_at"):
        return rb.get_at(idx)
    if how in ("sample_with_metadata", "get_at_with_metadata"):
        return rb.get_at_with_metadata(idx)
    if how == "sample_flat":
        return rb.get_flattened_at(idx)
    return None


def _worker_pids(s):
    """pids of the running workers of every live manager of sampler ``s``."""
    out = []
    try:
        for manager in list(s._pools.live()):
            for proc in manager.workers:
                pid = getattr(proc, "pid", None)
                if pid is not None and process_running(pid):
                    out.append(pid)
    except (RuntimeError, AttributeError, ReferenceError):
        pass
    return out


def _send(pid, sig):
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _landed_in_package(exc):
    """True if ``exc`` was raised in a call into the sampler (a Ctrl-C that cut a call
    short: the package's code, or what it calls), not in this test's own loop."""
    tb = exc.__traceback__
    files = []
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return any(f"{os.sep}unienv_mp{os.sep}" in f for f in files)


class _Interrupt:
    """Sends this process one SIGINT after ``delay`` seconds (from a timer thread).

    CPython drops a KeyboardInterrupt raised in a callback whose exceptions it ignores (a
    ``__del__``, an ``os.register_at_fork`` hook such as logging's, run when a worker is
    forked): "Exception ignored in ...".  :meth:`resend_if_lost` sees when the SIGINT came more than a second ago
    and no KeyboardInterrupt followed; the loop then sends another itself (from the main
    thread, so that none can arrive once the loop is left)."""

    def __init__(self, delay):
        self.fired_at = None
        self.fired = threading.Event()
        self.timer = threading.Timer(delay, self._fire)
        self.timer.daemon = True
        self.resent = 0

    def _fire(self):
        self.fired_at = time.monotonic()
        self.fired.set()
        os.kill(os.getpid(), signal.SIGINT)

    def start(self):
        self.timer.start()

    def resend_if_lost(self, before=None):
        if self.fired.is_set() and time.monotonic() - self.fired_at > 1.0:
            if before is not None:
                before()
            self.fired_at = time.monotonic()
            self.resent += 1
            os.kill(os.getpid(), signal.SIGINT)


def _options():
    return st.fixed_dictionaries({
        "n_workers": st.integers(1, 3),
        "n_buffers": st.integers(1, 6),
        "copy": st.booleans(),
        "direct_gather": st.sampled_from([None, False]),
        "seed": st.integers(0, 2 ** 31 - 1),
    })


# -- the machine ---------------------------------------------------------------------------

class SamplerModel(RuleBasedStateMachine):
    """One sampler (replaced now and then) against the model; see the module docstring.
    Subclasses set ``CTXS``, the start methods drawn from."""

    CTXS = ("fork",)

    def __init__(self):
        super().__init__()
        self.s = None
        self.timers = []
        self.stopped = set()
        self.iters = []          # [iterator, method name, EpochModel or None (not begun)]
        self.held = []           # (batch, deep copy)
        self.pids = set()        # every worker pid seen of the current sampler
        self.counts = collections.Counter()
        self.fds_before = own_segment_fds()
        self.caught = warnings.catch_warnings(record=True)
        self.warned = self.caught.__enter__()
        warnings.simplefilter("always", RuntimeWarning)

    # -- set-up ------------------------------------------------------------------------

    @initialize(shared=st.booleans(), n=st.sampled_from([37, 64]),
                batch_size=st.sampled_from([5, 8, 16]),
                batches_per_task=st.sampled_from([None, 1, 2, 3]),
                stall=st.booleans(), options=_options(), data=st.data())
    def init(self, shared, n, batch_size, batches_per_task, stall, options, data):
        self.ctx = data.draw(st.sampled_from(self.CTXS), label="ctx")
        self.shared = shared
        self.capacity = n + 96 if shared else n
        self.rb = replay_buffer(n, capacity=self.capacity, multiprocessing=shared, img=IMG)
        self.n = n
        self.batch_size = batch_size
        self.bpt = batches_per_task
        self.stall_timeout = STALL_TIMEOUT if stall else None
        self._fresh(options)

    def _k(self, method):
        return self.bpt if self.bpt is not None else DEFAULT_K[method]

    def _make(self, options):
        """A sampler of this example's data, batch size, chunks, start method and stall
        timeout, with ``options`` (which a saved state may differ in)."""
        self.counts["samplers"] += 1
        return MultiprocessingSampler(
            StepSampler(self.rb, self.batch_size, seed=options["seed"]),
            n_workers=options["n_workers"], n_buffers=options["n_buffers"], ctx=self.ctx,
            copy=options["copy"], direct_gather=options["direct_gather"],
            batches_per_task=self.bpt, stall_timeout=self.stall_timeout, timeout=TIMEOUT)

    def _new_sampler(self, options):
        """A new sampler replaces the current one (closed already)."""
        self.pids = set()
        self.faults_here = 0
        self.lengths = {self.n}   # lengths since the streams were (re)started
        self.s = self._make(options)
        return self.s

    def _reseed_model(self, seed):
        base = model_base(seed)
        self.streams = {m: StreamModel(base, m, self._k(m), self.batch_size) for m in METHODS}
        self.pos = {m: [0, 0] for m in METHODS}
        self.rng_states = [torch.Generator().manual_seed(seed).get_state()]
        self.resume = {g: collections.deque() for g in GETTERS.values()}
        self.lengths = {self.n}

    def _fresh(self, options):
        """A new sampler seeded with options["seed"], and a fresh model."""
        self._new_sampler(options)
        self._reseed_model(options["seed"])
        self.open = []   # EpochModels begun and not over, in the order they began

    # -- checking batches ----------------------------------------------------------------

    def _note_pids(self):
        self.pids.update(_worker_pids(self.s))

    def _hold(self, batch):
        self.held.append((batch, _clone(batch)))
        if len(self.held) > MAX_HELD:
            del self.held[0]

    def _check_stream_batch(self, method, batch):
        idx = _indices(method, batch)
        lo, hi = self.pos[method]
        model = self.streams[method]
        for j in range(lo, hi + 1):
            if any(model.batch(j, n) == idx for n in sorted(self.lengths)):
                self.pos[method] = [j + 1, j + 1]
                break
        else:
            raise AssertionError(
                f"{method}() handed out rows {idx}; the model allows batches {lo}..{hi} "
                f"of the stream over lengths {sorted(self.lengths)}: "
                f"{[model.batch(j, n) for j in range(lo, hi + 1) for n in sorted(self.lengths)]}")
        expected = _expected_rows(self.rb, method, idx)
        if expected is not None:
            assert _same(batch, expected), f"{method}() batch of rows {idx} holds other data"
        self.counts["batches"] += 1

    def _stream_error(self, method, e):
        """A call of ``method`` raised ``e``: allowed, and what it does to the model."""
        if isinstance(e, WorkerStalledError):
            # the chunk of the batch due is given up (docs: "Stalled workers"), after
            # max_respawns + 1 stalls in a row
            assert self.stall_timeout is not None and self.faults_here > MAX_RESPAWNS, e
            lo, hi = self.pos[method]
            k = self._k(method)
            self.pos[method] = [lo, (hi // k + 1) * k]
            self.counts["stall_give_ups"] += 1
        elif isinstance(e, WorkerDiedError):
            assert self.faults_here > MAX_RESPAWNS, (
                f"WorkerDiedError after {self.faults_here} faults: {e}")
            assert "giving up" in str(e) or "could not" in str(e), e
            self.counts["died_give_ups"] += 1
        else:
            raise e

    def _begin_epoch(self, getter):
        """The model's epoch that an iterator of ``getter`` begins now."""
        if self.resume[getter]:
            ep = self.resume[getter].popleft()
            self.counts["epochs_resumed"] += 1
            if 0 < ep.pos < ep.n_batches():
                self.counts["epochs_resumed_mid_epoch"] += 1
        else:
            candidates = []
            for state in self.rng_states:
                g = torch.Generator()
                g.set_state(state)
                order = torch.randperm(self.n, generator=g).tolist()
                candidates.append((order, g.get_state()))
            self.rng_states = [after for _, after in candidates]
            ep = EpochModel(getter, candidates, self.batch_size)
        self.open.append(ep)
        return ep

    def _check_epoch_batch(self, ep, batch):
        idx = indices_of(batch, img=IMG)
        b = self.batch_size
        if len(ep.candidates) > 1:
            self.counts["epoch_rng_doubts_resolved"] += 1
            fits = [c for c in ep.candidates if c[0][:b] == idx]
            assert fits, f"the epoch's first batch {idx} is none of {ep.candidates}"
            ep.candidates = fits[:1]
            self.rng_states = [fits[0][1]]
        want = ep.order[ep.pos * b:(ep.pos + 1) * b]
        assert ep.pos < ep.n_batches(), f"{ep} handed out one batch too many: {idx}"
        assert idx == want, f"{ep}: batch {ep.pos} holds rows {idx}, the model says {want}"
        assert _same(batch, _expected_rows(self.rb, ep.getter, idx)), (
            f"{ep}: batch {ep.pos} of rows {idx} holds other data")
        ep.pos += 1
        self.counts["epoch_batches"] += 1

    def _end_epoch(self, ep):
        if ep is not None and ep in self.open:
            self.open.remove(ep)

    def _next(self, entry):
        """One ``next()`` of the iterator of ``entry``, checked: the batch, or None once
        the epoch is over (finished, or ended by a worker's error)."""
        it, name, ep = entry
        getter = GETTERS[name]
        try:
            batch = next(it)
        except StopIteration:
            if ep is None:
                ep = entry[2] = self._begin_epoch(getter)   # (a restored epoch, done)
            assert ep.pos == ep.n_batches(), f"{ep} stopped early"
            self._end_epoch(ep)
            self.counts["epochs_finished"] += 1
            return None
        except (WorkerDiedError, WorkerStalledError) as e:
            # the epoch is over (the error went through its generator)
            if ep is None:
                ep = entry[2] = self._begin_epoch(getter)
            self._end_epoch(ep)
            assert self.faults_here > MAX_RESPAWNS, e
            if isinstance(e, WorkerStalledError):
                assert self.stall_timeout is not None, e
            self.counts["epoch_errors"] += 1
            return None
        if ep is None:
            ep = entry[2] = self._begin_epoch(getter)
        self._check_epoch_batch(ep, batch)
        return batch

    # -- rules: sampling -----------------------------------------------------------------

    @rule(method=st.sampled_from(METHODS), n=st.integers(1, 12), hold=st.booleans())
    def sample(self, method, n, hold):
        fn = getattr(self.s, method)
        batch = None
        for _ in range(n):
            try:
                batch = fn()
            except (WorkerDiedError, WorkerStalledError) as e:
                self._stream_error(method, e)
                continue
            self._check_stream_batch(method, batch)
        self.counts["ops"] += 1
        self._note_pids()
        if hold and batch is not None:
            self._hold(batch)

    @precondition(lambda self: len(self.iters) < 3)
    @rule(name=st.sampled_from(sorted(GETTERS)))
    def start_epoch(self, name):
        self.iters.append([getattr(self.s, name)(), name, None])
        self.counts["ops"] += 1

    @rule(which=st.integers(0, 2), k=st.integers(1, 6), hold=st.booleans(),
          name=st.sampled_from(sorted(GETTERS)))
    def advance_epoch(self, which, k, hold, name):
        """``k`` batches of an epoch iterator (of a new one of ``name`` if there is none)."""
        if not self.iters:
            self.start_epoch(name)
        entry = self.iters[which % len(self.iters)]
        batch = None
        for _ in range(k):
            batch = self._next(entry)
            if batch is None:
                self.iters.remove(entry)
                break
        if hold and batch is not None:
            self._hold(batch)
        self.counts["ops"] += 1
        self._note_pids()

    @precondition(lambda self: self.iters)
    @rule(which=st.integers(0, 2), how=st.sampled_from(["close", "drop"]))
    def abandon_epoch(self, which, how):
        entry = self.iters.pop(which % len(self.iters))
        it, ep = entry[0], entry[2]
        del entry[:]
        if how == "close":
            it.close()
        else:
            del it
            gc.collect()   # (the generator's end runs when it is collected)
        self._end_epoch(ep)
        self.counts["ops"] += 1

    @rule(which=st.integers(0, 7))
    def release_held(self, which):
        if self.held:
            del self.held[which % len(self.held)]

    # -- rules: seeds, states, appends, close ---------------------------------------------

    @rule(seed=st.integers(0, 2 ** 31 - 1))
    def manual_seed(self, seed):
        self.s.manual_seed(seed)
        # the streams and the next epochs' RNG restart; epochs begun go on
        self._reseed_model(seed)
        self.counts["manual_seeds"] += 1
        self.counts["ops"] += 1

    def _into_an_epoch(self, k, name):
        """``k`` batches of an epoch begun (of a new one of ``name`` if none is)."""
        if k == 0:
            return
        begun = [i for i, entry in enumerate(self.iters) if entry[2] is not None]
        if not begun and len(self.iters) >= 3:
            return
        if not begun:
            self.start_epoch(name)
            begun = [len(self.iters) - 1]
        self.advance_epoch(begun[0], k, False, name)

    def _drop_iterators(self):
        """Close every epoch iterator: their epochs are over."""
        for entry in self.iters:
            entry[0].close()
            self._end_epoch(entry[2])
        self.iters = []

    def _continue_stopped(self):
        """SIGCONT every worker stopped, those a timer would continue later too."""
        for timer, pid in self.timers:
            timer.cancel()
            self.stopped.add(pid)
        self.timers = []
        for pid in list(self.stopped):
            _send(pid, signal.SIGCONT)
        self.stopped.clear()

    def _close_and_check(self):
        """Close the sampler: no worker of it keeps running, and no segment descriptor
        stays open here (held batches are mappings, not descriptors)."""
        s = self.s
        self._note_pids()
        pids = set(self.pids)
        s.close()
        assert wait_until(lambda: not [p for p in pids if process_running(p)], timeout=10), (
            f"workers left running after close(): "
            f"{[p for p in pids if process_running(p)]}")
        self.stopped -= pids
        with pytest.raises(RuntimeError, match="closed"):
            s.sample()
        self.counts["closes"] += 1

    def _check_no_descriptors(self):
        assert wait_until(lambda: not (own_segment_fds() - self.fds_before), timeout=5), (
            f"descriptors left open: {own_segment_fds() - self.fds_before}")

    @rule(options=_options(), pickled=st.booleans(),
          order=st.sampled_from(["state, close", "close, state"]),
          stop_first=st.sampled_from([True, True, True, False]),
          mid_epoch=st.integers(0, 4), name=st.sampled_from(sorted(GETTERS)))
    def replace_from_state(self, options, pickled, order, stop_first, mid_epoch, name):
        """state_dict() into a NEW sampler (other options), which replaces this one;
        ``mid_epoch``: first, ``mid_epoch`` batches of an epoch (a new one of ``name`` if
        none was begun), so that the state holds an epoch being iterated."""
        self._into_an_epoch(mid_epoch, name)
        old = self.s
        if stop_first:
            self._continue_stopped()
        if order == "close, state":
            self._close_and_check()   # (state_dict() works after close())
        state = old.state_dict()
        if pickled:
            state = pickle.loads(pickle.dumps(state))
        epochs = self.open + [ep for g in GETTERS.values() for ep in self.resume[g]]
        refused = any(len(ep.order) != self.n for ep in epochs)
        new = self._make(options)
        if refused:
            # an epoch of another data length cannot be resumed: refused, and the new
            # sampler is as it was (docs: "Reproducible and resumable")
            with pytest.raises(ValueError, match="permutation"):
                new.load_state_dict(state)
            new.close()
            self.counts["states_refused"] += 1
            if order == "close, state":
                # the old one is closed: go on with a fresh sampler
                self._drop_iterators()
                self._fresh(options)
            return
        new.load_state_dict(state)
        # the old sampler's iterators die with it; their epochs go on in the new one
        for entry in self.iters:
            entry[0].close()
        self.iters = []
        if order == "state, close":
            self._close_and_check()
        self.counts["states_with_epochs"] += bool(epochs)
        by_getter = {g: collections.deque(ep for ep in epochs if ep.getter == g)
                     for g in GETTERS.values()}
        self.resume = by_getter
        self.open = []
        self.s = new
        self.pids = set()
        self.faults_here = 0
        self.lengths = {self.n}
        self.counts["replacements"] += 1
        self.counts["ops"] += 1

    @rule(resume=st.booleans(), drop_first=st.booleans(), options=_options(),
          stop_first=st.sampled_from([True, True, True, False]),
          mid_epoch=st.integers(0, 4), name=st.sampled_from(sorted(GETTERS)))
    def close(self, resume, drop_first, options, stop_first, mid_epoch, name):
        """close(); then a new sampler: fresh, or going on from the closed one's state
        (``mid_epoch``: as in :meth:`replace_from_state`)."""
        self._into_an_epoch(mid_epoch, name)
        if stop_first:
            self._continue_stopped()
        if drop_first:
            self._drop_iterators()   # (their epochs are over: not in the state)
        self._close_and_check()
        epochs_in_state = self.open + [ep for g in GETTERS.values() for ep in self.resume[g]]
        state = self.s.state_dict() if resume else None
        self._drop_iterators()
        self._continue_stopped()
        self._check_no_descriptors()
        refused = any(len(ep.order) != self.n for ep in epochs_in_state)
        if state is not None and refused:
            new = self._make(options)
            with pytest.raises(ValueError, match="permutation"):
                new.load_state_dict(state)
            self.counts["states_refused"] += 1
            state = None
            new.close()
        if state is None:
            self._fresh(options)
        else:
            self._new_sampler(options)
            self.s.load_state_dict(state)
            self.resume = {g: collections.deque(ep for ep in epochs_in_state
                                                if ep.getter == g) for g in GETTERS.values()}
            self.open = []
        self.counts["ops"] += 1

    @precondition(lambda self: self.shared and self.n < self.capacity)
    @rule(m=st.integers(1, 24))
    def append(self, m):
        """Rows appended to the shared buffer: later sample* chunks may be drawn over the
        new length; epochs begun keep their permutation."""
        m = min(m, self.capacity - self.n)
        self.rb.extend(transitions(self.n, m, img=IMG))
        self.n += m
        self.lengths.add(self.n)
        self.counts["appends"] += 1
        self.counts["ops"] += 1

    # -- rules: faults -------------------------------------------------------------------

    @rule(which=st.integers(0, 20))
    def kill_worker(self, which):
        pids = _worker_pids(self.s)
        if not pids:
            return
        pid = pids[which % len(pids)]
        self.pids.add(pid)
        if _send(pid, signal.SIGKILL):
            self.stopped.discard(pid)
            self.faults_here += 1
            self.counts["kills"] += 1

    @rule(which=st.integers(0, 20),
          how=st.sampled_from(["short", "short", "long", "until continued"]),
          delay=st.floats(0.005, 0.3))
    def stop_worker(self, which, how, delay):
        """SIGSTOP a worker; SIGCONT from a timer after ``delay`` (short), after the stall
        timeout (long), or in a later rule (until continued).  The last two only where the
        stall watchdog is on (without it, a caller would wait for the stopped worker)."""
        if how != "short" and self.stall_timeout is None:
            how = "short"
        pids = [p for p in _worker_pids(self.s) if p not in self.stopped]
        if not pids:
            return
        pid = pids[which % len(pids)]
        self.pids.add(pid)
        if not _send(pid, signal.SIGSTOP):
            return
        self.faults_here += 1
        self.counts["stops"] += 1
        if how == "until continued":
            self.stopped.add(pid)
            return
        t = threading.Timer(delay if how == "short" else self.stall_timeout + 0.5,
                            _send, (pid, signal.SIGCONT))
        t.daemon = True
        t.start()
        self.timers.append((t, pid))

    @precondition(lambda self: self.stopped)
    @rule()
    def continue_workers(self):
        self._continue_stopped()

    @rule(where=st.sampled_from(["sample", "epoch", "epoch start"]),
          method=st.sampled_from(METHODS), delay=st.floats(0.0, 0.03))
    def interrupt(self, where, method, delay):
        """A Ctrl-C at a random moment of a loop of calls: of ``method`` (``where``
        "sample"), of an epoch begun ("epoch"), or from a new epoch's first next()
        ("epoch start"; only where no restored epoch waits, so that only the RNG is in
        doubt).  After an epoch's end, calls of ``method`` until the SIGINT comes."""
        entry = None
        if where == "epoch" and self.iters and self.iters[0][2] is not None:
            entry = self.iters[0]
        elif where == "epoch start" and not self.resume["get_at"]:
            entry = [self.s.epoch_iter(), "epoch_iter", None]
            self.iters.append(entry)
        events = []   # ("epoch", batch) | ("end",) | ("stream", batch) | ("error", phase, e)
        fn = getattr(self.s, method)
        rng_before = list(self.rng_states)
        interrupt = _Interrupt(delay)
        unraisable = sys.unraisablehook
        raised = []   # where each KeyboardInterrupt was raised; None: dropped by CPython

        def ignored(u):
            # a KeyboardInterrupt that CPython drops (see _Interrupt): counted, the SIGINT
            # sent again; anything else goes to the hook in place (pytest's)
            if u.exc_type is not None and issubclass(u.exc_type, KeyboardInterrupt):
                raised.append(None)
                self.counts["interrupts_dropped_by_cpython"] += 1
                self.counts[f"dropped in {getattr(u.object, '__qualname__', u.object)}"] += 1
            else:
                unraisable(u)

        def ctrl_c(signum, frame):
            # Python's own handler, noting where the KeyboardInterrupt is raised
            raised.append(f"{os.path.basename(frame.f_code.co_filename)}:"
                          f"{frame.f_code.co_name}" if frame is not None else "?")
            raise KeyboardInterrupt

        def lost():
            # no KeyboardInterrupt came of the SIGINT: dropped by CPython (counted
            # above), or raised somewhere and swallowed
            if raised and raised[-1] is not None:
                self.counts[f"interrupts_swallowed after raised in {raised[-1]}"] += 1
            elif not raised:
                self.counts["interrupts_never_handled"] += 1

        sys.unraisablehook = ignored
        handler = signal.signal(signal.SIGINT, ctrl_c)
        try:
            interrupt.start()   # (inside the try: a SIGINT at once is caught too)
            if entry is not None:
                it = entry[0]
                while True:
                    interrupt.resend_if_lost(lost)
                    try:
                        events.append(("epoch", next(it)))
                    except StopIteration:
                        events.append(("end",))
                        break
                    except (WorkerDiedError, WorkerStalledError) as e:
                        events.append(("error", "epoch", e))
                        break
            while True:
                try:
                    events.append(("stream", fn()))
                except (WorkerDiedError, WorkerStalledError) as e:
                    events.append(("error", "stream", e))
                interrupt.resend_if_lost(lost)
                if len(events) > 20000:
                    interrupt.fired.wait()
        except KeyboardInterrupt as e:
            inside = _landed_in_package(e)
        finally:
            signal.signal(signal.SIGINT, handler)
            sys.unraisablehook = unraisable
        interrupt.timer.join()
        self.counts["interrupts"] += 1
        self.counts["interrupts_sent_again"] += interrupt.resent
        self.counts["interrupts_in_calls" if inside else "interrupts_between_calls"] += 1
        # the calls of ``method`` began once the epoch was over (or at once)
        stream_phase = entry is None or any(ev[0] in ("end", "error") and
                                            (ev[0] == "end" or ev[1] == "epoch")
                                            for ev in events)
        # replay what was handed out through the model
        for ev in events:
            if ev[0] in ("epoch", "end") or ev[0] == "error" and ev[1] == "epoch":
                if entry[2] is None:
                    entry[2] = self._begin_epoch("get_at")
                if ev[0] == "epoch":
                    self._check_epoch_batch(entry[2], ev[1])
                elif ev[0] == "end":
                    assert entry[2].pos == entry[2].n_batches(), f"{entry[2]} stopped early"
            elif ev[0] == "stream":
                self._check_stream_batch(method, ev[1])
            else:
                self._stream_error(method, ev[2])
        del events
        if entry is not None:
            if entry[2] is None:
                # no batch came: the Ctrl-C landed in its start, before or after the
                # permutation was drawn (README: "A Ctrl-C before the epoch holds its
                # manager loses the permutation drawn")
                assert where == "epoch start"
                advanced = []
                for state in rng_before:
                    g = torch.Generator()
                    g.set_state(state)
                    torch.randperm(self.n, generator=g)
                    advanced.append(g.get_state())
                self.rng_states = rng_before + advanced
                self.counts["epoch_starts_cut_short"] += 1
            # cut short (or, if the SIGINT landed in this loop, dropped here): over
            entry[0].close()
            if entry in self.iters:
                self.iters.remove(entry)
            self._end_epoch(entry[2])
        if stream_phase:
            # the SIGINT came during the calls of ``method``: at most the batch being
            # handed out is gone
            self.pos[method][1] += 1
        self._note_pids()

    # -- invariants and teardown ---------------------------------------------------------

    @invariant()
    def held_batches_unchanged(self):
        for i, (batch, copy) in enumerate(self.held):
            assert _same(batch, copy), f"held batch {i} changed while held"

    def teardown(self):
        try:
            self._continue_stopped()
            if self.s is not None:
                self._drop_iterators()
                self._close_and_check()
                self.held_batches_unchanged()
                self.held.clear()
                gc.collect()
                self._check_no_descriptors()
        finally:
            self._continue_stopped()
            self.caught.__exit__(None, None, None)
            self.counts["stalled_workers_replaced"] += sum(
                "killed and replaced" in str(w.message) or "stall" in str(w.message)
                for w in self.warned)
            self.counts["examples"] += 1
            COUNTS.update(self.counts)


class SamplerModelFork(SamplerModel):
    CTXS = ("fork",)


class SamplerModelOtherStarts(SamplerModel):
    CTXS = ("spawn", "forkserver")


# -- the second machine: data that changes under the pools -------------------------------------

ROW_KEYS = ("action", "image", "state")
#: ``batches_per_task`` the second machine draws from.
DATA_BATCHES_PER_TASK = (None, 1, 2, 3)


def step_rows(start, count, gens):
    """Rows ``start`` to ``start + count - 1`` whose every key tells the row's step ``i``
    and the generation ``gens[key]`` of the tensor it was written into: ``state[:, 0]`` =
    ``i`` (what ``indices_of`` reads), ``state[:, 1]`` = g; ``action[:, 0]`` = ``i / 1024``,
    ``action[:, 1]`` = ``g / 1024``; ``image[0]`` = ``i % 251``, ``image[1]`` = ``i // 251``,
    ``image[2]`` = ``g % 251``."""
    i = torch.arange(start, start + count)
    state = torch.zeros(count, 10)
    state[:, 0] = i.float()
    state[:, 1] = gens["state"]
    state[:, 2:] = (i % 7).float().view(-1, 1) / 8
    action = torch.full((count, 7), -0.5)
    action[:, 0] = i.float() / 1024
    action[:, 1] = gens["action"] / 1024
    image = torch.empty(count, *IMG, dtype=torch.uint8)
    image[:, 0] = (i % 251).to(torch.uint8).view(-1, 1, 1)
    image[:, 1] = (i // 251).to(torch.uint8).view(-1, 1, 1)
    image[:, 2] = gens["image"] % 251
    return {"state": state, "action": action, "image": image}


def next_generation(key, t):
    """A copy of storage tensor ``t`` of ``key`` with every row one generation on (the
    step each row tells is kept)."""
    new = t.clone()
    if key == "state":
        new[:, 1] += 1
    elif key == "action":
        new[:, 1] += 1 / 1024
    else:
        new[:, 2] = ((new[:, 2].to(torch.int16) + 1) % 251).to(torch.uint8)
    return new


def steps_told(batch):
    """``{key: [the step each row's key tells]}`` of a batch: a dict, a (dict, metadata)
    pair or a flat batch (the keys flattened in sorted order: action, image, state)."""
    if isinstance(batch, tuple):
        batch = batch[0]
    if not isinstance(batch, dict):
        a, b = 7, 7 + int(np.prod(IMG))
        batch = {"action": batch[:, :a], "image": batch[:, a:b].reshape(-1, *IMG),
                 "state": batch[:, b:]}
    image = batch["image"].to(torch.float64)
    told = {"state": batch["state"][:, 0].to(torch.float64),
            "action": batch["action"][:, 0].to(torch.float64) * 1024,
            "image": image[:, 0, 0, 0] + 251 * image[:, 1, 0, 0]}
    return {k: v.round().long().tolist() for k, v in told.items()}


def torn_rows(batch):
    """The rows of ``batch`` whose keys tell different steps, as ``(row, {key: step})``."""
    told = steps_told(batch)
    out = []
    for r, steps in enumerate(zip(*(told[k] for k in ROW_KEYS))):
        if len(set(steps)) > 1:
            out.append((r, dict(zip(ROW_KEYS, steps))))
    return out


class PoolCopy:
    """The model of the data that a pool's workers hold: the buffer as it was when the pool
    started, but for what is shared between processes, which they read as it is now: a
    storage tensor in shared memory, and the count of a buffer made with
    ``multiprocessing=True`` (any length it had since: ``lengths``).  ``whole``: all of it
    as it is now (the data an epoch covers).  ``version``: the changes made to the data
    before it was taken; ``writes``: the writes (appends) made before it was taken.
    `rows` answers as UniEnv does, in this process, over a ReplayBuffer of those tensors.

    `moved` says when the data moved away from what such workers can serve whole rows of
    (the epochs guide: "One copy per pool", its last point): then the next ``sample*``
    call starts a new pool over the data as it is then."""

    def __init__(self, rb, capacity, version, writes, whole=False):
        self.version = version
        self.writes = writes
        self.multiprocessing = bool(rb.is_multiprocessing_safe)
        self.live_count = self.multiprocessing and not whole
        self.lengths = {len(rb)}
        self.tensors = {}
        self.live = set()
        for key in ROW_KEYS:
            t = rb.storage.storage_map[key].data
            if t.is_shared() and not whole:
                self.tensors[key] = t
                self.live.add(key)
            else:
                self.tensors[key] = t.clone()
        self.buffer = replay_buffer(0, capacity=capacity, img=IMG)
        for key, t in self.tensors.items():
            self.buffer.storage.storage_map[key].data = t
        self.buffer.count = len(rb)

    def grew(self, length):
        """The buffer has ``length`` rows now (seen by the workers if the count is live)."""
        if self.live_count:
            self.lengths.add(length)

    def moved(self, rb, writes):
        """Whether the data moved away from this copy, as the ``sample*`` calls look
        (docs: a tensor in shared memory of a ``multiprocessing=True`` buffer replaced,
        or a buffer only partly in shared memory written through torch): "must" (the
        next ``sample*`` call starts a new pool), "may" (a buffer none of whose storage
        tensors the workers read from their copy, written: its rows stay whole either
        way; a new pool is allowed, see below), or None.

        (The package counts the bounds of the buffer's spaces, which are never in shared
        memory, among the tensors that are not: to it a buffer whose every storage tensor
        was ``share_memory_()``'d is still partly shared, and it starts a new pool after
        a write.  The docs do not say which; the model allows both.)"""
        if self.multiprocessing:
            replaced = any(self.tensors[k] is not rb.storage.storage_map[k].data
                           for k in self.live)
            return "must" if replaced else None
        if not self.live or writes == self.writes:
            return None
        return "must" if len(self.live) < len(ROW_KEYS) else "may"

    def rows(self, how, idx):
        self.buffer.count = max(self.lengths)
        return _expected_rows(self.buffer, how, idx)


# The private parts of the package the second machine reaches into (the rest is the API):
# which manager serves the sample* methods, a manager's lanes and the snapshot process.

def _sample_manager(s):
    """The manager of the ``sample*`` workers of ``s`` (None before its first call)."""
    manager = s._pools.sample
    return None if manager is None or manager.closed else manager


def _lanes(manager):
    return list(manager._pool.lanes)


def _starting_pids(manager):
    """The pids of the workers of ``manager`` whose process runs and has not begun taking
    tasks yet (under spawn: still importing)."""
    out = []
    for lane in _lanes(manager):
        w = lane.worker
        proc = w.proc
        if proc is not None and proc.pid is not None and process_running(proc.pid) \
                and not w.started_ns:
            out.append(proc.pid)
    return out


def _began(manager, pid):
    """True if the worker of ``manager`` whose process is ``pid`` began taking tasks."""
    for lane in _lanes(manager):
        proc = lane.worker.proc
        if proc is not None and proc.pid == pid:
            return bool(lane.worker.started_ns)
    return False


def _lane_of(manager, pid):
    """What the pool of ``manager`` knows of the worker whose process is ``pid`` (for
    messages)."""
    from unienv_mp import _os as os_
    pool = manager._pool
    for lane in _lanes(manager):
        proc = lane.worker.proc
        if proc is not None and proc.pid == pid:
            return (f"began: {bool(lane.worker.started_ns)}, seen starting: "
                    f"{lane in getattr(pool, 'starting', ())}, exited: "
                    f"{os_.has_exited(proc)}, snapshot stopped: "
                    f"{[_stopped(p) for p in _snapshot_pids_of(manager)]}")
    return "not a worker"


def _all_began(manager):
    for lane in _lanes(manager):
        w = lane.worker
        proc = w.proc
        if (proc is not None and proc.pid is not None and process_running(proc.pid)
                and not w.started_ns):
            return False
    return True


def _snapshot_pids_of(manager):
    """The snapshot process (fork) of ``manager``, in a list, if it runs."""
    launch = manager._pool.launch
    snapshot = None if launch is None else launch._snapshot
    proc = None if snapshot is None else snapshot.proc
    if proc is not None and proc.pid is not None and process_running(proc.pid):
        return [proc.pid]
    return []


def _snapshot_pids(s):
    """The running snapshot processes (fork) of the live managers of ``s``."""
    return [pid for manager in list(s._pools.live()) for pid in _snapshot_pids_of(manager)]


def _waits(manager):
    """How long callers have waited on ``manager`` (grows with every wait)."""
    stats = manager.stats()
    return (stats.wait_seconds, stats.startup_seconds)


def _ended(pid):
    """True if process ``pid`` has ended, every thread of it: gone, or a zombie with no
    other thread left.  (After a SIGKILL the first thread is a zombie at once, while the
    others may still be exiting, the last one freeing the memory: a pidfd, which the
    package watches, tells the end only once they are all gone.)"""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z" and threads == [str(pid)]


def _our_zombie(pid):
    """True if ``pid`` is a child of this process that ended and was not reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] == "Z" and int(fields[1]) == os.getpid()


def _stopped(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "tT"
    except FileNotFoundError:
        return True


class DataModel(RuleBasedStateMachine):
    """One sampler (replaced now and then) over a ReplayBuffer that changes under it, and
    faults of the processes behind its pools, against the model of the copy each pool
    holds (see the module docstring).  Subclasses set ``CTXS``."""

    CTXS = ("fork",)

    def __init__(self):
        super().__init__()
        self.s = None
        self.iters = []          # [iterator, getter, EpochModel or None (not begun)]
        self.stopped = set()     # snapshot processes SIGSTOPped and not continued yet
        self.pids = set()        # every worker and snapshot pid seen of the current sampler
        self.counts = collections.Counter()
        self.fds_before = own_segment_fds()
        self.caught = warnings.catch_warnings(record=True)
        self.warned = self.caught.__enter__()
        warnings.simplefilter("always", RuntimeWarning)

    @initialize(shared=st.booleans(), n=st.sampled_from([29, 48]),
                batch_size=st.sampled_from([5, 8]),
                batches_per_task=st.sampled_from(DATA_BATCHES_PER_TASK),
                persistent=st.sampled_from([None, False]), options=_options(),
                data=st.data())
    def init(self, shared, n, batch_size, batches_per_task, persistent, options, data):
        self.ctx = data.draw(st.sampled_from(self.CTXS), label="ctx")
        self.shared = shared
        self.capacity = n + 72   # (appends never wrap around)
        self.gens = dict.fromkeys(ROW_KEYS, 0)
        self.rb = replay_buffer(0, capacity=self.capacity, multiprocessing=shared, img=IMG)
        self.rb.extend(step_rows(0, n, self.gens))
        self.n = n
        self.changes = 0         # changes made to the data so far
        self.writes = 0          # of which writes to its tensors (appends)
        self.batch_size = batch_size
        self.bpt = batches_per_task
        self.persistent = persistent
        self._fresh(options)

    def _fresh(self, options):
        """A new sampler seeded with ``options["seed"]``, and a fresh model of it."""
        self.counts["samplers"] += 1
        self.s = MultiprocessingSampler(
            StepSampler(self.rb, self.batch_size, seed=options["seed"]),
            n_workers=options["n_workers"], n_buffers=options["n_buffers"], ctx=self.ctx,
            copy=options["copy"], direct_gather=options["direct_gather"],
            batches_per_task=self.bpt, persistent_workers=self.persistent, timeout=TIMEOUT)
        base = model_base(options["seed"])
        self.streams = {m: StreamModel(base, m, self.bpt, self.batch_size) for m in METHODS}
        self.pos = dict.fromkeys(METHODS, 0)
        self.rng = torch.Generator().manual_seed(options["seed"])
        self.pools = []      # [(manager, PoolCopy)] of the sample* workers, oldest first
        self.oldest = dict.fromkeys(METHODS, 0)   # the oldest a method's batch may be from
        self.kills = 0
        self.snapshot_faults = 0
        self.pids = set()
        self.warned_from = len(self.warned)   # (the warnings of this sampler's life)
        self.lost_by = None   # the method whose call found the sample* workers' copy lost

    def _note_pids(self):
        self.pids.update(_worker_pids(self.s))
        self.pids.update(_snapshot_pids(self.s))

    def _note_sample_workers(self):
        """The copy the ``sample*`` workers hold where an epoch started them (an epoch
        over a buffer made with multiprocessing=True may run on them): the data as it was
        when the rule began (no rule that calls the sampler changes the data)."""
        manager = _sample_manager(self.s)
        if manager is not None and all(m is not manager for m, _ in self.pools):
            self.pools.append((manager, self._copy()))
            self.counts["sample_workers_started_by_an_epoch"] += 1

    def _copy(self, whole=False):
        return PoolCopy(self.rb, self.capacity, self.changes, self.writes, whole)

    def _copy_of(self, manager):
        """The model's copy of the data that ``manager``'s workers hold."""
        for m, copy in reversed(self.pools):
            if m is manager:
                return copy
        raise AssertionError(f"the model has no copy for the sample* workers {manager}")

    def _copy_may_be_lost(self, copy):
        """Whether the workers holding ``copy`` may all be gone for good (the package may
        raise `CopyLost` for them): under fork, a snapshot process killed or stopped, a
        worker killed, and the data changed since the copy was taken."""
        return (self.ctx == "fork" and self.snapshot_faults > 0 and self.kills > 0
                and self.changes > copy.version)

    # -- checking batches ----------------------------------------------------------------

    def _assert_whole_rows(self, what, batch):
        torn = torn_rows(batch)
        assert not torn, (f"{what} handed out {len(torn)} torn row(s) (keys from different "
                          f"steps), e.g. {torn[:3]}")

    def _sample_once(self, method):
        """One call of ``method``, checked; the batch (None if it raised)."""
        s = self.s
        if self.lost_by not in (None, method):
            self.counts["calls_of_other_methods_after_a_lost_pool"] += 1
        before = _sample_manager(s)
        if before is None:
            copy, moved = self._copy(), None   # (what a pool made now copies)
        else:
            copy, moved = None, self._copy_of(before).moved(self.rb, self.writes)
        mark = len(self.warned)
        try:
            batch = getattr(s, method)()
        except WorkerDiedError as e:
            self._sample_workers_after(method, before, copy, moved, mark)
            self._died(e, None)
            return None
        went_on = self._sample_workers_after(method, before, copy, moved, mark)
        # (the batch first: where the call went on with workers the data moved away from,
        # what they handed out, torn or stale rows, tells more than that they did)
        self._check_stream_batch(method, batch)
        assert not went_on, (
            "the data moved away from what the sample* workers read in shared memory (a "
            "shared tensor replaced, or data partly in shared memory written), and the "
            "call went on with them")
        self._note_pids()
        return batch

    def _said(self, words, since):
        return [str(w.message) for w in self.warned[since:] if words in str(w.message)]

    def _sample_workers_after(self, method, before, copy, moved, mark):
        """Note the ``sample*`` workers after a call of ``method`` that began with
        ``before`` (None: none; ``copy``: the data then; ``moved``: whether the data
        moved away from ``before``'s copy, see `PoolCopy.moved`); ``mark``: the warnings
        before the call.  True if the data moved away from ``before``'s workers and the
        call went on with them."""
        after = _sample_manager(self.s)
        replaced = after is not None and before is not None and after is not before
        if moved and replaced:
            self._sample_pool_moved(after, mark)
            return False
        assert not self._said("moved away", mark), (
            f"a warning that the data moved away, where it did not: "
            f"{self._said('moved away', mark)}")
        if after is None or after is before:
            return moved == "must"
        if before is None:
            self.pools.append((after, copy))
        else:
            self._sample_pool_replaced(before, after, mark)
            self.lost_by = method
        return False

    def _sample_pool_moved(self, after, mark):
        """The ``sample*`` workers were replaced by new ones over the data as it is now,
        the data having moved away from them: no batch they made comes out any more, and
        one warning per sampler says so."""
        said = self._said("moved away", self.warned_from)
        assert len(said) == 1, (
            f"{len(said)} warnings that the data moved away in this sampler's life, not "
            f"one: {said}")
        self.pools.append((after, self._copy()))
        self.oldest = dict.fromkeys(METHODS, len(self.pools) - 1)
        self.lost_by = None
        self.counts["sample_pools_moved"] += 1

    def _sample_pool_replaced(self, before, after, mark):
        """The ``sample*`` workers were replaced by new ones in the call just made: only
        where none was left that could start from their copy, and with a warning.  Every
        method's batches go on from them (but those already made, which may come first)."""
        said = self._said("go on from new workers", mark)
        assert said, "the sample* workers were replaced, with no warning"
        assert self._copy_may_be_lost(self._copy_of(before)), (
            f"the sample* workers were replaced where their copy could not be lost: {said}")
        self.pools.append((after, self._copy()))
        self.counts["sample_pools_lost"] += 1

    def _check_stream_batch(self, method, batch):
        """Batch ``j`` of ``method``'s stream is the model's, drawn over a length of the
        copy of a pool that served the stream, and holds that copy's rows, whole."""
        idx = _indices(method, batch)
        if method != "sample_index":
            self._assert_whole_rows(f"{method}()", batch)
        j = self.pos[method]
        model = self.streams[method]
        fits, stale = [], []
        for i in range(self.oldest[method], len(self.pools)):
            copy = self.pools[i][1]
            if not any(model.batch(j, length) == idx for length in sorted(copy.lengths)):
                continue
            expected = copy.rows(method, idx)
            (fits if expected is None or _same(batch, expected) else stale).append(i)
        if not fits:
            copies = self.pools[self.oldest[method]:]
            assert not stale, (f"{method}() batch {j} of rows {idx}: not the rows the "
                               f"sample* workers' copy of the data holds")
            raise AssertionError(
                f"{method}() batch {j} holds rows {idx}; the model draws "
                f"{[(n, model.batch(j, n)) for _, c in copies for n in sorted(c.lengths)]}"
                f" (length, rows) over the copies the sample* workers hold")
        self.oldest[method] = fits[0]
        self.pos[method] = j + 1
        self.counts["batches"] += 1

    def _died(self, e, ep):
        """A ``WorkerDiedError`` ``e`` ended a call (``ep``: the epoch it ended, or None for
        a ``sample*`` call): allowed after more than ``max_respawns`` kills (giving up),
        and for an epoch whose workers' copy may be lost."""
        if self.kills > MAX_RESPAWNS and ("giving up" in str(e) or "could not" in str(e)):
            self.counts["died_give_ups"] += 1
            return
        assert ep is not None and self._copy_may_be_lost(ep.copy), (
            f"WorkerDiedError after {self.kills} kill(s) and {self.snapshot_faults} "
            f"snapshot fault(s): {e}")
        self.counts["epochs_lost_with_their_copy"] += 1

    def _begin_epoch(self, getter):
        """The model's epoch that an iterator of ``getter`` begins now: a permutation of
        the data as it is now, drawn with the wrapped sampler's RNG."""
        order = torch.randperm(self.n, generator=self.rng).tolist()
        ep = EpochModel(getter, [(order, None)], self.batch_size)
        ep.copy = self._copy(whole=True)
        return ep

    def _next(self, entry):
        """One ``next()`` of the iterator of ``entry``, checked against UniEnv over the
        buffer as it was when the epoch began; None once the epoch is over."""
        it, getter, ep = entry
        try:
            batch = next(it)
        except StopIteration:
            if ep is None:   # (an epoch of no batch: impossible here, the data is not empty)
                raise AssertionError("an epoch ended before its first batch") from None
            assert ep.pos == ep.n_batches(), f"{ep} stopped early"
            self.counts["epochs_finished"] += 1
            return None
        except WorkerDiedError as e:
            if ep is None:
                ep = entry[2] = self._begin_epoch(getter)
            self._died(e, ep)
            return None
        if ep is None:
            ep = entry[2] = self._begin_epoch(getter)
        idx = indices_of(batch, img=IMG)
        want = ep.order[ep.pos * self.batch_size:(ep.pos + 1) * self.batch_size]
        assert ep.pos < ep.n_batches(), f"{ep} handed out one batch too many: {idx}"
        assert idx == want, f"{ep}: batch {ep.pos} holds rows {idx}, the model says {want}"
        self._assert_whole_rows(f"{ep}, batch {ep.pos},", batch)
        assert _same(batch, ep.copy.rows(getter, idx)), (
            f"{ep}: batch {ep.pos} of rows {idx} is not the data as it was when the epoch "
            f"began (epoch_workers={self.s.epoch_workers!r}: "
            f"{self.s.epoch_workers_reason})")
        ep.pos += 1
        self.counts["epoch_batches"] += 1
        return batch

    # -- rules: sampling -----------------------------------------------------------------

    @rule(method=st.sampled_from(METHODS), n=st.integers(1, 8))
    def sample(self, method, n):
        for _ in range(n):
            self._sample_once(method)
        self.counts["ops"] += 1

    @rule(name=st.sampled_from(sorted(GETTERS)))
    def start_epoch(self, name):
        if len(self.iters) >= 2:
            return
        self.iters.append([getattr(self.s, name)(), GETTERS[name], None])
        self.counts["ops"] += 1

    @rule(which=st.integers(0, 1), k=st.integers(1, 8),
          name=st.sampled_from(sorted(GETTERS)))
    def advance_epoch(self, which, k, name):
        """``k`` batches of an epoch iterator (of a new one of ``name`` if there is none)."""
        if not self.iters:
            self.start_epoch(name)
        if not self.iters:
            return
        entry = self.iters[which % len(self.iters)]
        for _ in range(k):
            if self._next(entry) is None:
                self.iters.remove(entry)
                break
        self._note_sample_workers()
        self._note_pids()
        self.counts["ops"] += 1

    @rule(which=st.integers(0, 1))
    def abandon_epoch(self, which):
        if not self.iters:
            return
        self.iters.pop(which % len(self.iters))[0].close()
        self.counts["ops"] += 1

    @rule(method=st.sampled_from(METHODS), n=st.integers(0, 8))
    def workers_up(self, method, n):
        """Every worker of the ``sample*`` pool (started by a call of ``method`` if there
        is none) started and taking tasks, as after a while of training (the workers left
        to start later are started now); then ``n`` calls of ``method``."""
        if _sample_manager(self.s) is None:
            self._sample_once(method)
        manager = _sample_manager(self.s)
        if manager is None:
            return
        manager.start_all()
        wait_until(lambda: _all_began(manager), timeout=60)
        self._note_pids()
        self.counts["workers_up"] += 1
        for _ in range(n):
            self._sample_once(method)

    # -- rules: the data changes ---------------------------------------------------------

    @rule(m=st.integers(1, 24))
    def append(self, m):
        """Rows appended (to a shared buffer, or not): the workers that do not share the
        count keep drawing over the length their copy has."""
        if self.n >= self.capacity:
            return
        m = min(m, self.capacity - self.n)
        self.rb.extend(step_rows(self.n, m, self.gens))
        self.n += m
        self.changes += 1
        self.writes += 1
        for _, copy in self.pools:
            copy.grew(self.n)
        self.counts["appends"] += 1

    @precondition(lambda self: self.shared)
    @rule(key=st.sampled_from(ROW_KEYS))
    def replace_shared_tensor(self, key):
        """A storage tensor of the multiprocessing=True buffer replaced by another one in
        shared memory, with other contents (every row one generation on)."""
        storage = self.rb.storage.storage_map[key]
        storage.data = next_generation(key, storage.data).share_memory_()
        self.gens[key] += 1
        self.changes += 1
        self.counts["shared_tensors_replaced"] += 1

    @precondition(lambda self: not self.shared)
    @rule(key=st.sampled_from(ROW_KEYS))
    def share_part(self, key):
        """One storage tensor of the buffer (not multiprocessing=True) moved to shared
        memory: the workers of pools started from now on read it as it is."""
        t = self.rb.storage.storage_map[key].data
        if t.is_shared():
            return
        t.share_memory_()
        self.changes += 1
        self.counts["tensors_shared"] += 1

    # -- rules: faults -------------------------------------------------------------------

    @rule(which=st.integers(0, 20))
    def kill_worker(self, which):
        pids = _worker_pids(self.s)
        if not pids:
            return
        pid = pids[which % len(pids)]
        self.pids.add(pid)
        if _send(pid, signal.SIGKILL):
            self.kills += 1
            self.counts["kills"] += 1

    @rule(which=st.integers(0, 20), method=st.sampled_from(METHODS), start=st.booleans())
    def kill_starting_worker(self, which, method, start):
        """SIGKILL a worker of the ``sample*`` pool that has not begun taking tasks (under
        spawn: still importing; ``start``: the workers left to start later are started
        first), then call ``method`` until a call waits on the pool: that wait notices the
        death (docs: "A worker killed while it is still starting is noticed at the next
        wait and replaced"), and the stream goes on unchanged.  (A call of ``method``
        starts the pool first if there is none, or a new one if the data moved away from
        it: see `PoolCopy.moved`.)"""
        manager = _sample_manager(self.s)
        if manager is None or self._copy_of(manager).moved(self.rb, self.writes):
            self._sample_once(method)
        manager = _sample_manager(self.s)
        if manager is None:
            return
        if start:
            manager.start_all()
        pids = _starting_pids(manager)
        if not pids:
            return
        pid = pids[which % len(pids)]
        self.pids.add(pid)
        # stopped first, so that it cannot begin taking tasks between the look and the kill
        if not _send(pid, signal.SIGSTOP):
            return
        wait_until(lambda: _stopped(pid), timeout=10)
        if _began(manager, pid):
            _send(pid, signal.SIGCONT)
            self.counts["starting_workers_missed"] += 1
            return
        _send(pid, signal.SIGKILL)
        assert wait_until(lambda: _ended(pid), timeout=30), pid
        self.kills += 1
        self.counts["starting_workers_killed"] += 1
        waits = _waits(manager)
        for _ in range(64):
            self._sample_once(method)
            if _sample_manager(self.s) is not manager or _waits(manager) != waits:
                break
        if _sample_manager(self.s) is not manager or _waits(manager) == waits:
            return   # (no call waited on the pool)
        workers = [p.pid for p in manager.workers if p is not None]
        assert pid not in workers, (
            f"worker {pid}, SIGKILLed while it started, is still one of the pool's "
            f"{workers} after a wait: its death was not noticed ({_lane_of(manager, pid)})")
        # (under fork a worker forked by the snapshot process is that process's to reap)
        assert wait_until(lambda: not _our_zombie(pid), timeout=5), (
            f"worker {pid} is left a zombie")
        self.counts["starting_workers_replaced"] += 1

    @precondition(lambda self: self.ctx == "fork")
    @rule(which=st.integers(0, 5), how=st.sampled_from(["kill", "stop"]))
    def snapshot_fault(self, which, how):
        """SIGKILL or SIGSTOP (until a later rule) the snapshot process of a pool (fork):
        a worker started from then on cannot start from it."""
        pids = [p for p in _snapshot_pids(self.s) if p not in self.stopped]
        if not pids:
            return
        pid = pids[which % len(pids)]
        self.pids.add(pid)
        if _send(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP):
            if how == "stop":
                self.stopped.add(pid)
            self.snapshot_faults += 1
            self.counts[f"snapshot_{how}s"] += 1

    @precondition(lambda self: self.ctx == "fork")
    @rule()
    def continue_snapshots(self):
        self._continue_stopped()

    def _continue_stopped(self):
        for pid in self.stopped:
            _send(pid, signal.SIGCONT)
        self.stopped.clear()

    # -- rules: a new sampler --------------------------------------------------------------

    def _close_and_check(self):
        """Close the sampler: no worker or snapshot process of it keeps running."""
        for entry in self.iters:
            entry[0].close()
        self.iters = []
        self._note_pids()
        pids = set(self.pids)
        self.s.close()
        assert wait_until(lambda: not [p for p in pids if process_running(p)], timeout=10), (
            f"processes left running after close(): "
            f"{[p for p in pids if process_running(p)]}")
        self.counts["closes"] += 1

    @rule(options=_options(), now=st.sampled_from([False, False, False, True]))
    def close(self, options, now):
        """close(), then a new sampler over the buffer as it is now (one time in four: the
        longer a sampler lives, the more can happen to it)."""
        if not now:
            return
        self._continue_stopped()
        self._close_and_check()
        assert wait_until(lambda: not (own_segment_fds() - self.fds_before), timeout=5), (
            f"descriptors left open: {own_segment_fds() - self.fds_before}")
        self._fresh(options)
        self.counts["ops"] += 1

    def teardown(self):
        try:
            self._continue_stopped()
            if self.s is not None:
                self._close_and_check()
                gc.collect()
                assert wait_until(lambda: not (own_segment_fds() - self.fds_before),
                                  timeout=5), (
                    f"descriptors left open: {own_segment_fds() - self.fds_before}")
        finally:
            self._continue_stopped()
            self.caught.__exit__(None, None, None)
            self.counts["examples"] += 1
            COUNTS.update({f"data: {k}": v for k, v in self.counts.items()})


class DataModelFork(DataModel):
    CTXS = ("fork",)


class DataModelOtherStarts(DataModel):
    CTXS = ("spawn", "forkserver")


_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]


def _settings(examples, steps):
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                    database=None, suppress_health_check=_HEALTH)


def test_model_fork():
    run_state_machine_as_test(SamplerModelFork, settings=_settings(50, 40))


def test_model_spawn_and_forkserver():
    run_state_machine_as_test(SamplerModelOtherStarts, settings=_settings(4, 20))


def test_data_model_fork():
    run_state_machine_as_test(DataModelFork, settings=_settings(12, 30))


def test_data_model_spawn_and_forkserver():
    run_state_machine_as_test(DataModelOtherStarts, settings=_settings(3, 15))


@pytest.mark.soak
def test_model_soak():
    """New examples until ``UNIENV_MP_MODEL_SECONDS`` (default 60) are up, of both
    machines, under fork, and one round in eight under spawn or forkserver; prints the
    operations and faults survived (and writes them, as JSON, to
    ``UNIENV_MP_MODEL_REPORT`` if it is set)."""
    seconds = float(os.environ.get("UNIENV_MP_MODEL_SECONDS", "60"))
    before = COUNTS.copy()
    start = time.monotonic()
    rounds = 0
    while time.monotonic() - start < seconds:
        data = rounds % 2 == 1
        if rounds % 8 >= 6:
            run_state_machine_as_test(DataModelOtherStarts if data else SamplerModelOtherStarts,
                                      settings=_settings(2, 25))
        elif data:
            run_state_machine_as_test(DataModelFork, settings=_settings(10, 40))
        else:
            run_state_machine_as_test(SamplerModelFork, settings=_settings(5, 50))
        rounds += 1
    counts = COUNTS - before
    faults = ("kills", "stops", "interrupts", "data: kills", "data: snapshot_kills",
              "data: snapshot_stops")
    report = {"seconds": round(time.monotonic() - start, 1), "rounds": rounds,
              "faults": sum(counts[k] for k in faults), **dict(sorted(counts.items()))}
    print("\nmodel soak:", json.dumps(report, indent=1))
    path = os.environ.get("UNIENV_MP_MODEL_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


# -- failures the machine found, minimized ---------------------------------------------------

@pytest.mark.parametrize("ctx", ["fork", "spawn", "forkserver"])
def test_a_worker_replaced_after_an_append_to_unshared_data_keeps_the_stream(ctx):
    # (found with the model's appends to unshared data: under fork the replacement copied
    # the grown buffer and drew over the new length; under spawn and forkserver it got
    # the new count but the arrays' first snapshot, and handed out rows of zeros)
    rb = replay_buffer(60, capacity=200, img=IMG)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=5), n_workers=1, n_buffers=1,
                                ctx=ctx, batches_per_task=1) as m:
        got = [m.sample() for _ in range(3)]
        rb.extend(transitions(60, 40, img=IMG))   # not seen by sample() (docs: Epochs)
        proc = m._pools.sample.workers[0]
        os.kill(proc.pid, signal.SIGKILL)
        assert wait_until(lambda: not proc.is_alive())
        got += [m.sample() for _ in range(6)]
    for j, batch in enumerate(got):
        # every batch holds the rows it says it holds (the buffer's rows)
        assert _same(batch, _expected_rows(rb, "sample", _indices("sample", batch))), j
    model = StreamModel(model_base(5), "sample", 1, 8)
    assert [_indices("sample", b) for b in got] == [model.batch(j, 60) for j in range(9)]


_FORK_WITH_SIGINT = r"""
import os, select, signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
from unienv_data.samplers import StepSampler
from _data import replay_buffer
from unienv_mp import MultiprocessingSampler

signal.signal(signal.SIGINT, signal.default_int_handler)
r, w = os.pipe()
os.set_blocking(w, False)
signal.set_wakeup_fd(w)   # (written to once Python's C handler has run)
helper = threading.Thread(target=threading.Event().wait, daemon=True)   # any other thread
helper.start()
m = MultiprocessingSampler(StepSampler(replay_buffer(64), 8, seed=0), n_workers=1, ctx="fork")
armed = [True]


def ctrl_c_during_fork():
    # A Ctrl-C arrives while the first worker is forked.  The start blocks SIGINT in this
    # thread, so the kernel hands it to another one (here: the helper); the handler runs
    # there, and the KeyboardInterrupt is raised in this thread's next bytecode.
    if armed:
        armed.clear()
        signal.pthread_kill(helper.ident, signal.SIGINT)
        select.select([r], [], [], 5.0)


os.register_at_fork(before=ctrl_c_during_fork)
try:
    m.sample()
    time.sleep(0.5)
    print("LOST")
except KeyboardInterrupt:
    print("RAISED")
m.close()
"""


def test_a_ctrl_c_while_a_worker_is_forked_raises_keyboard_interrupt():
    """A Ctrl-C that another thread takes while a worker is forked would be handled in an
    at-fork hook (logging's, or any), where CPython drops the exception: the start holds
    it back (_os.interrupts_deferred) and raises it after."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _FORK_WITH_SIGINT, here], check=False,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "RAISED", out.stdout + out.stderr


_START_WITH_SIGINT = r"""
import os, signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
from unienv_data.samplers import StepSampler
from _data import replay_buffer
from unienv_mp import MultiprocessingSampler


def starting(main):
    frame = sys._current_frames().get(main)
    while frame is not None:
        if frame.f_code.co_name == "_launch" and "popen" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def ctrl_c_during_start(main, stop):
    # A Ctrl-C arrives while the first worker is started (spawn or forkserver), and the
    # kernel hands it to a thread that does not block SIGINT: this one.
    while not stop.is_set():
        if starting(main):
            fired.append(True)
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
            return
        time.sleep(0.0001)


fired = []


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    m = MultiprocessingSampler(StepSampler(replay_buffer(64), 8, seed=0), n_workers=1,
                               ctx=sys.argv[2])
    stop = threading.Event()
    threading.Thread(target=ctrl_c_during_start, args=(threading.get_ident(), stop),
                     daemon=True).start()
    try:
        m.sample()
        time.sleep(0.5)
        print("LOST" if fired else "MISSED")   # (MISSED: the start was not seen)
    except KeyboardInterrupt:
        print("RAISED")
    stop.set()
    m.close()
"""


@pytest.mark.parametrize("ctx", ["spawn", "forkserver"])
def test_a_ctrl_c_while_a_worker_is_spawned_raises_keyboard_interrupt(ctx, tmp_path):
    script = tmp_path / "start_with_sigint.py"   # (a file: spawn imports the main module)
    script.write_text(_START_WITH_SIGINT)
    here = os.path.dirname(os.path.abspath(__file__))
    for _ in range(3):
        out = subprocess.run([sys.executable, str(script), here, ctx], check=False,
                             capture_output=True, text=True, timeout=120)
        last = (out.stdout.strip().splitlines() or ["?"])[-1]
        if last != "MISSED":
            break
    assert last == "RAISED", out.stdout + out.stderr
