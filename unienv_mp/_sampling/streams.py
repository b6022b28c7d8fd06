"""Where the caller is in each stream of batches: the stream of a ``sample*`` method (its
chunks, their seeds, what is requested from the workers) and an epoch.

**Chunks.** A method's stream is cut into chunks of ``k`` batches: chunk ``c`` holds the
stream's batches ``c*k`` to ``c*k + k - 1``.  One task makes one chunk: for each of its
batches the worker seeds the wrapped sampler's random number generators with that batch's
seed, as ``manual_seed(seed)`` would, then draws the batch, as one call would.  So batch
``j`` of a stream is a function of the stream's base seed, the method and ``j`` alone: not
of ``k`` (``batches_per_task``, whose default depends on the size of a batch's rows), of
which worker made it, how many workers there are, whether one died and its chunk was made
again, how many batches are requested ahead, or which path (direct or generic) made it.
Two samplers over views of one buffer, with the same seed and batch size, draw the same
steps.  (unienv_mp 0.1 seeded each chunk once and drew its ``k`` batches one after the
other; a stream restored from a state it saved goes on that way: `Stream`'s
``per_batch``.)

**Seeds.**  The base is taken from the wrapped sampler's RNG state without drawing from it
(`base_seed`), so a sampler's epochs, drawn from that RNG in the parent, stay UniEnv's.  A
stream's key is ``mix(mix(base) ^ crc32(method))``, with ``mix`` SplitMix64's finaliser
(Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014).
Batch ``j``'s seed (`chunk_seed` of ``j``) is a 32-bit number: a keyed bijection of ``j``
modulo 2**32 (the key's low half added, MurmurHash3's 32-bit finaliser, the key's high half
xored in).  32 bits because torch's CPU generator, which UniEnv's torch samplers use, keeps
only the low 32 bits of a seed (mt19937's seeding): with wider seeds, two batches of a long
stream would share a seed by the birthday bound (one pair expected among some 77,000) and
repeat each other.  A bijection gives the first 2**32 batches of a stream distinct seeds;
the finaliser decorrelates the seeds of neighbouring batches, and the key those of
different methods and base seeds.  (With ``k = 1`` a batch is a chunk, and the stream is
the one unienv_mp 0.1 made.)

**Position.** What the caller has been handed is a set of whole chunks and a part of one:
every chunk below ``low``, the chunks in ``done`` (above ``low``: handed out out of order,
with ``in_order=False``), and the first ``k - len(ready)`` batches of ``ready_chunk``.
Chunks whose task raised count as handed out (their batches are skipped).  Batches
requested ahead are not part of the position: `Stream.position` and `Stream.from_position`
save and restore it, and `Stream.reset` forgets what was requested, to be asked for again.

**With a manager.**  `forget_requests` drops every request of a call cut short, to be asked
for again.
"""
import collections
import hashlib
import pickle
import sys
import zlib

from .. import _os
from ..errors import WorkerError

__all__ = ["Stream", "EpochProgress", "base_seed", "stream_key", "chunk_seed", "chunk_seeds",
           "forget_requests", "forget_all"]

_MASK = (1 << 64) - 1
_MASK32 = (1 << 32) - 1


def _mix(z):
    """SplitMix64's finaliser (a bijection of 64-bit integers)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def stream_key(base, method):
    """The key of ``method``'s stream for base seed ``base``."""
    return _mix(_mix(base & _MASK) ^ zlib.crc32(method.encode()))


def chunk_seeds(key, first, k):
    """The seeds of batches ``first`` to ``first + k - 1`` of the stream with key ``key``
    (a tuple): each a 32-bit number, MurmurHash3's 32-bit finaliser (a bijection) of the
    batch number plus the key's low half, then xor its high half; distinct for the batches
    ``0`` to ``2**32 - 1`` of one stream (see the module's docstring).  Written out in one
    loop: a worker makes a chunk's seeds at every task."""
    lo = key & _MASK32
    hi = (key >> 32) & _MASK32
    out = []
    for z in range(first + lo, first + lo + k):
        z &= _MASK32
        z ^= z >> 16
        z = (z * 0x85EBCA6B) & _MASK32
        z ^= z >> 13
        z = (z * 0xC2B2AE35) & _MASK32
        out.append(z ^ (z >> 16) ^ hi)
    return tuple(out)


def chunk_seed(key, chunk):
    """The seed of batch (or, for a stream seeded per chunk, chunk) ``chunk`` of the stream
    with key ``key`` (see `chunk_seeds`)."""
    return chunk_seeds(key, chunk, 1)[0]


def _state_bytes(rng):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(rng, torch.Generator):
        return bytes(rng.get_state().numpy())
    bit_generator = getattr(rng, "bit_generator", None)   # numpy.random.Generator
    if bit_generator is not None:
        return pickle.dumps(bit_generator.state, protocol=4)
    return pickle.dumps(rng, protocol=4)


def base_seed(sampler):
    """A 64-bit number that stands for the current state of ``sampler``'s random number
    generators (``data_rng`` and ``rng``), read without drawing from them: two samplers
    seeded alike (``seed=s``, or ``manual_seed(s)``) give the same number.  0 for a sampler
    without one."""
    h = hashlib.blake2b(digest_size=8)
    for name in ("data_rng", "rng"):
        rng = getattr(sampler, name, None)
        h.update(name.encode())
        if rng is not None:
            h.update(_state_bytes(rng))
    if getattr(sampler, "data_rng", None) is None and getattr(sampler, "rng", None) is None:
        return 0
    return int.from_bytes(h.digest(), "little")


class Stream:
    """The chunks of ``method``'s stream (``k`` batches each) for base seed ``base``: what
    was requested (``tickets``, in the order of their chunks, and ``chunk_of``; see
    `top_up`), the batches of the chunk being handed out (``ready``, from ``ready_chunk``),
    and the position (see the module's docstring).  ``per_batch``: each batch is seeded
    (False: each chunk, as unienv_mp 0.1 did).

    Cut short anywhere by a Ctrl-C, the requests may be out of step with ``tickets``: the
    caller then cancels ``tickets`` and calls `reset`.  The position is safe at every step:
    it is read from ``low``, ``done`` and what is left in ``ready``."""
    __slots__ = ("method", "k", "key", "per_batch", "tickets", "chunk_of", "ready",
                 "ready_chunk", "low", "done", "next_new", "retry", "skip", "filling")

    def __init__(self, method, k, base, per_batch=True):
        self.method = method
        self.k = k
        self.key = stream_key(base, method)
        self.per_batch = per_batch
        self.tickets = collections.deque()   # of the tasks requested, chunks in order
        self.chunk_of = {}                   # ticket -> chunk
        self.ready = collections.deque()     # batches of ready_chunk not handed out yet
        self.ready_chunk = None
        self.low = 0           # every chunk below is handed out
        self.done = set()      # chunks above low handed out
        self.next_new = 0      # chunks from here on were never requested
        self.retry = []        # chunks below next_new to request (again), ascending
        self.skip = {}         # chunk -> batches of it handed out before (a restored position)
        self.filling = None    # the chunk whose batches arrived() is putting in ready

    # -- requesting ---------------------------------------------------------------------

    def top_up(self, submit, n_buffers):
        """Request chunks, lowest first, until more than ``n_buffers`` batches are
        requested ahead: ``submit(work, record=tickets)`` submits the task of one (a
        manager's ``submit``, which appends the ticket to ``tickets``)."""
        tickets = self.tickets
        k = self.k
        ready = self.ready
        while len(ready) + k * len(tickets) <= n_buffers:
            retry = self.retry
            chunk = retry[0] if retry else self.next_new
            submit(self.work(chunk), record=tickets)
            self.chunk_of[tickets[-1]] = chunk
            if retry:
                del retry[0]
            else:
                self.next_new = chunk + 1

    def work(self, chunk):
        """The work item of ``chunk``'s task (see `unienv_mp._sampling.target.chunk_work`):
        ``(method, key, first batch, k)``, each batch seeded with its own seed, which the
        worker derives (`chunk_seeds`); without ``per_batch``, ``(method, seed, k)``."""
        k = self.k
        if not self.per_batch:
            return self.method, chunk_seed(self.key, chunk), k
        return self.method, self.key, chunk * k, k

    # -- handing out ----------------------------------------------------------------------

    def collect(self, ticket, result):
        """Take the task of ``ticket`` off ``tickets`` with its result, ``result(ticket)``
        (a manager's ``result``): its batches are handed out next (`arrived`); if the work
        raised a ``WorkerError``, its chunk is skipped (`failed`) and the error raised.  Any
        other exception (a timeout, a Ctrl-C) leaves the ticket requested."""
        try:
            batches = result(ticket)
        except WorkerError:
            self.tickets.remove(ticket)
            self.failed(ticket)
            raise
        self.tickets.remove(ticket)
        self.arrived(ticket, batches)

    def arrived(self, ticket, batches):
        """The task of ``ticket`` came back with ``batches`` (a tuple of ``k``): they are
        handed out next (the ones a restored position says were handed out are dropped).
        The ticket must already be off ``tickets``."""
        # (ordered so that a KeyboardInterrupt between any two steps leaves a position
        # that reset() and position() read right: ``filling`` marks batches in ``ready``
        # whose chunk is not ready_chunk yet, and skip goes only once they are there)
        chunk = self.chunk_of[ticket]
        self.finish_ready()   # (the caller collects a chunk once the last one is out)
        skip = self.skip.get(chunk, 0)
        self.filling = chunk
        self.ready.extend(batches[skip:] if skip else batches)
        self.ready_chunk = chunk
        self.filling = None
        self.skip.pop(chunk, None)
        del self.chunk_of[ticket]
        if not self.ready:
            self.finish_ready()

    def failed(self, ticket):
        """The task of ``ticket`` raised: its chunk counts as handed out."""
        chunk = self.chunk_of.get(ticket)
        if chunk is not None:
            self._handed_out(chunk)
            self.skip.pop(chunk, None)
            del self.chunk_of[ticket]

    def finish_ready(self):
        """If every batch of ``ready_chunk`` is handed out, it joins the handed-out chunks."""
        chunk = self.ready_chunk
        if chunk is not None and not self.ready:
            self._handed_out(chunk)   # (first, and it may run twice: cut short, no loss)
            self.ready_chunk = None

    def _handed_out(self, chunk):
        if chunk == self.low:
            low = chunk + 1
            done = self.done
            while low in done:
                low += 1
            self.low = low          # first: chunks below low left in done are harmless
            for c in range(chunk + 1, low):
                done.discard(c)
        elif chunk > self.low:
            self.done.add(chunk)

    # -- position ---------------------------------------------------------------------------

    def reset(self):
        """Forget every request (the caller cancels ``tickets`` first): the chunks not
        handed out are requested again, from the lowest."""
        self.tickets.clear()
        self.chunk_of.clear()
        self._drop_filling()
        self.finish_ready()
        missing = [c for c in range(self.low, self.next_new)
                   if c not in self.done and c != self.ready_chunk]
        self.retry = missing

    def drop_ready(self):
        """Forget the batches in ``ready`` (made from a copy of the data that is no longer
        current): their chunk is asked for again, less those already handed out.  The
        caller calls `reset` next."""
        self._drop_filling()
        self.finish_ready()
        chunk = self.ready_chunk
        if chunk is not None:
            self.skip[chunk] = self.k - len(self.ready)
            self.ready.clear()
            self.ready_chunk = None

    def _drop_filling(self):
        """arrived() was cut short putting a chunk's batches in ``ready``: drop them (the
        chunk is not handed out, and is asked for again)."""
        if self.filling is not None:
            if self.ready_chunk != self.filling:
                self.ready.clear()
            self.filling = None

    def position(self):
        """The position as plain data (see `from_position`)."""
        self._drop_filling()
        self.finish_ready()
        partial = dict(self.skip)
        if self.ready_chunk is not None:
            partial[self.ready_chunk] = self.k - len(self.ready)
        return {"k": self.k, "low": self.low, "done": sorted(self.done), "partial": partial}

    @classmethod
    def from_position(cls, method, base, position, per_batch=True):
        """A stream of ``method`` for ``base`` whose caller has been handed what
        ``position`` (from `position`) says; nothing requested yet."""
        s = cls(method, position["k"], base, per_batch)
        s.low = position["low"]
        s.done = set(position["done"])
        s.skip = {int(c): int(n) for c, n in position["partial"].items()}
        top = max([s.low - 1, *s.done, *s.skip], default=-1)
        s.next_new = top + 1
        s.retry = [c for c in range(s.low, s.next_new) if c not in s.done]
        return s


def forget_requests(manager, stream):
    """A call on ``stream`` was cut short (Ctrl-C, a timeout, a worker that died for good):
    its requests are cancelled on ``manager`` and asked for again next time, and the
    position stays where it is."""
    with _os.interrupts_deferred():
        for t in stream.tickets:
            manager.cancel(t)
        stream.reset()


def forget_all(manager, streams, ready=False):
    """Every request of ``streams`` on ``manager`` is cancelled and asked for again next
    time (the manager's workers can make no more batches that are right); ``ready``: the
    batches already made are dropped too, and asked for again."""
    with _os.interrupts_deferred():
        for stream in streams:
            for t in stream.tickets:
                manager.cancel(t)
            if ready:
                stream.drop_ready()
            stream.reset()


class EpochProgress:
    """Where the caller is in an epoch over the permutation ``order``, in ``batch_size``
    batches: every batch below ``low`` and those in ``done`` are handed out (``done`` is
    empty unless batches come back out of order)."""
    __slots__ = ("getter", "order", "batch_size", "low", "done")

    def __init__(self, getter, order, batch_size, low=0, done=()):
        self.getter = getter
        self.order = order
        self.batch_size = batch_size
        self.low = low
        self.done = set(done)

    def n_batches(self):
        return -(-len(self.order) // self.batch_size)

    def remaining(self):
        """The numbers of the batches not handed out yet, in order."""
        return [i for i in range(self.low, self.n_batches()) if i not in self.done]

    def handed_out(self, i):
        if i == self.low:
            low = i + 1
            while low in self.done:
                self.done.discard(low)
                low += 1
            self.low = low
        elif i > self.low:
            self.done.add(i)

    def position(self):
        return {"getter": self.getter, "order": self.order, "batch_size": self.batch_size,
                "low": self.low, "done": sorted(self.done)}

    @classmethod
    def from_position(cls, position):
        return cls(position["getter"], position["order"], position["batch_size"],
                   position["low"], position["done"])
