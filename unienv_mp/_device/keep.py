"""Page-locked batches handed out (``pin_memory=True``), kept until the caller's copies of
them are done: what torch's host allocator does for its own pinned memory, done for the
slots.

The loop everyone writes drops the CPU batch as soon as its copy is queued::

    x = sampler.sample()["obs"].to("cuda", non_blocking=True)   # or: batch = batch.to(...)

The copy reads the slot later, when the device gets to it; the batch's last array is gone
at once, and its slot would go back to its worker at the sampler's next call, to be written
while the device still reads it.  torch protects its own pinned blocks by recording an
event at each copy and reusing a block only once those events completed; memory registered
with ``cudaHostRegister`` (the slots) is not its own, and it records nothing for it.

**The rule.**  The feed keeps each batch it hands out (a reference to the storage of each
array, which keeps its slot) until

1. the caller has let go of it: no tensor but the feed's own reference uses any of its
   storages (torch counts the users of a storage, views and ``.numpy()`` arrays included),
   seen at a later call of the sampler; and
2. an event recorded on the caller's current stream at that call has completed.

A copy of the batch that the caller queued on its current stream, or on a stream ordered
before it, before letting go of the batch, was queued before that event: when the event
completes, the copy has.  So the slot goes back only after every such copy has read it,
however long the caller kept the batch.  A copy queued on another stream that the current
stream does not wait for is not covered: order it first
(``torch.cuda.current_stream().wait_stream(side)``) or keep the batch until it completed.
Where this torch cannot count a storage's users, a batch counts as let go at the next call
(so copies queued before that call are covered).  With calls from several threads, the
event goes on the current stream of the thread that makes the call: a copy another thread
queued is covered where that thread's current stream is the same (the default stream,
unless a thread set another) or is waited for by it.

**Only what a copy could outlive.**  An array outside a page-locked range (a small batch
that travelled in its ring entry, one the manager copied out of its slot because the caller
held too many, a slot whose registration was refused) is pageable memory: CUDA has read it
into a buffer of its own before the copy call returns, so nothing of it is kept.

**Bounded.**  At most ``limit`` batches let go wait for their events; a caller further ahead
of the device waits for the oldest (as for the feed's own copies, rule 5).  The batches the
caller still holds are its own: they hold their slots anyway, and the manager copies a
batch out of its slot when the caller holds too many, so they are few.  Each call looks at
most at `_SCAN` of them: the newest, which a loop lets go first, and a turn of the older.

Events recorded on different streams (the caller changed its current stream between calls)
may complete out of order: a batch goes once the events of all batches let go before it
have completed, never earlier.
"""
import collections

__all__ = ["KeptBatches"]

#: Batches still held by the caller looked at per call (see "Bounded").
_SCAN = 8


class KeptBatches:
    """The page-locked batches handed out by a feed on ``ops``'s device and not let go yet
    (see the module's docstring).  Not thread-safe: the feed calls it under the sampler's
    lock."""

    def __init__(self, ops, limit):
        import torch
        self._ops = ops
        self._limit = limit
        self._held = []                     # [storages] the caller may still use, in order
        self._going = collections.deque()   # ([storages], event), let go, in that order
        self._turn = 0                      # where the look at the older held ones goes on
        self._uses = getattr(torch._C, "_storage_Use_Count", None)

    def __len__(self):
        """The batches let go whose event has not been seen complete."""
        return len(self._going)

    def step(self):
        """At a hand-out, before the new batch is added: the batches the caller has let go
        since get an event recorded now on its current stream; those whose event completed
        go (and their slots with them); then the bound."""
        held = self._held
        if held:
            gone = self._let_go(held)
            if gone:
                ops = self._ops
                event = ops.record(ops.current_stream())
                # (in this order: a Ctrl-C between the two leaves a batch in both lists,
                # which the next call lets go again, never in neither)
                self._going.extend((k, event) for k in gone)
                ids = {id(k) for k in gone}
                self._held = [k for k in held if id(k) not in ids]
        going = self._going
        if going:
            ops = self._ops
            while going and ops.done(going[0][1]):
                going.popleft()
            while len(going) > self._limit:
                ops.synchronize(going[0][1])
                going.popleft()

    def _let_go(self, held):
        """The batches of ``held`` looked at now (see "Bounded") that the caller let go."""
        n = len(held)
        if n <= _SCAN:
            look = held
        else:
            newest = _SCAN // 2
            older = n - newest
            start = self._turn % older
            look = held[start:min(older, start + _SCAN - newest)] + held[older:]
            self._turn = start + _SCAN - newest
        uses = self._uses
        if uses is None:
            return list(look)
        return [k for k in look if all(uses(s._cdata) <= 1 for s in k)]

    def add(self, leaves):
        """Keep the batch whose page-locked tensors are ``leaves`` (handed out now)."""
        storages = {}
        for t in leaves:
            s = t.untyped_storage()
            storages[id(s)] = s
        if storages:
            self._held.append(list(storages.values()))

    def events(self):
        """The events of the batches let go (what a forked child must keep)."""
        return [event for _, event in self._going]

    def close(self):
        """Wait for the copies of every batch kept: those queued on the caller's current
        stream until now (an event recorded now) and those the events of the batches let go
        cover; then let go of every batch (those the caller still holds stay valid: they
        hold their slots).  Raises the first device error met, after letting go of
        everything."""
        error = None
        going = self._going
        if self._held or going:
            ops = self._ops
            try:
                ops.synchronize(ops.record(ops.current_stream()))
            except Exception as e:   # (a device gone bad: nothing more to wait for)
                error = e
        while going:
            try:
                self._ops.synchronize(going[0][1])
            except Exception as e:   # (a device gone bad: nothing more to wait for)
                error = error or e
            going.popleft()
        self._held = []
        if error is not None:
            raise error

    def forget(self):
        """Let go of every batch without a device call (in a forked child); the events are
        the caller's to keep (see `events`)."""
        self._held = []
        self._going = collections.deque()
