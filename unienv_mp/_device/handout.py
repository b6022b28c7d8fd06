"""The sampler's hand-out of batches on a device (or page-locked): the batch its stream
gives, passed through the device feed (`.feed.DeviceFeed.give`), and the copy of the
stream's next batch issued ahead when it is here already (rule 6 of `.feed`; for
page-locked batches, only its slot is page-locked ahead, rule 7).

**The look-ahead changes nothing in the stream.**  When the stream's next batch is in its
``ready`` chunk, its copy is started; when it is in the next task, which has arrived, the
task's result is taken from the manager and kept here (``_early``) with its copy
started, and the stream collects it only at the next call, as that call would have.  So the position between calls is what the caller was handed, a ``state_dict()``
taken then is exact, and a Ctrl-C anywhere in the look-ahead puts the batch being handed
out back (nothing else moved): the next call hands it out again.
"""
from .. import _os
from ..errors import WorkerError

__all__ = ["DeviceHandOut"]


class _Taken:
    """The result of a task taken ahead: its ``value``, or the ``error`` it raised;
    `result` gives it to `Stream.collect` as the manager would have."""
    __slots__ = ("value", "error")

    def __init__(self, value, error):
        self.value = value
        self.error = error

    def result(self, ticket):
        if self.error is not None:
            raise self.error
        return self.value


class DeviceHandOut:
    """How a sampler whose batches go through ``feed`` (a `.feed.DeviceFeed`) hands them
    out: its ``sample*`` calls hand out what `sample` returns, and epochs pass their
    batches through `epoch_batch`.  Chosen once, when the sampler is made; it holds no
    reference to the sampler: each call is handed what it works on."""

    def __init__(self, feed):
        self.feed = feed
        # method -> (its stream, ticket, result or _Failed) collected ahead; used only by
        # the same stream while that ticket is still its request (manual_seed,
        # load_state_dict and close make new streams; a reset forgets the requests)
        self._early = {}

    def sample(self, name, take, streams, caller, pools, in_order):
        """The next batch of ``name``'s stream, on the device (or page-locked), called with
        the sampler's lock held.  ``take(name)``: the stream's next CPU batch (the
        sampler's); ``streams``: the sampler's streams by method; ``caller``: its count of
        batches handed out; ``pools``: its managers (the ``sample*`` one as
        ``take`` leaves it); ``in_order``: its option.  ``sample_index`` stays on the data's device, as UniEnv's
        does: ordered on the caller's stream where it was made on the device; page-locked
        and kept as the batches are with ``pin_memory``; else copied out of its slot,
        which is page-locked (a copy the caller makes of it then cannot outlive the slot,
        see `.keep`)."""
        feed = self.feed
        if name == "sample_index":
            index = take(name)
            mode = feed.mode
            if mode == "resident":
                return feed.resident(index)
            if mode == "pinned":
                return feed.pinned(index)
            return _clone(index)
        if name in self._early:
            # (one step: the task collected ahead joins its stream, or is dropped)
            with _os.interrupts_deferred():
                _arrive(streams.get(name), self._early.pop(name))
        cpu = take(name)
        # The batch is off the stream now, and nothing below changes the stream: a
        # device error or a Ctrl-C puts it back, so that nothing is lost and the
        # position does not move.
        try:
            out = feed.give(cpu)
            if feed.copying:
                self._look_ahead(name, streams[name], feed, pools.sample, in_order)
            elif feed.mode == "pinned":
                ready = streams[name].ready
                if ready:
                    feed.notice(ready[0])
        except BaseException:
            streams[name].ready.appendleft(cpu)
            caller.batches -= 1
            raise
        return out

    def _look_ahead(self, name, stream, feed, manager, in_order):
        """Issue the copy of ``name``'s next batch if it is here (see the module's
        docstring).  What fails here (but a Ctrl-C) is met again by the next call."""
        try:
            ready = stream.ready
            if ready:
                feed.start(ready[0])
                return
            tickets = stream.tickets
            if not tickets or not in_order or manager is None \
                    or not manager.ready(tickets[0]):
                return
            ticket = tickets[0]
            # (one step: a result taken is a result kept)
            with _os.interrupts_deferred():
                try:
                    taken = _Taken(manager.result(ticket), None)
                except WorkerError as e:
                    taken = _Taken(None, e)
                self._early[name] = (stream, ticket, taken)
            if taken.error is None and taken.value:
                feed.start(taken.value[0])
        except Exception:
            pass

    def epoch_batch(self, value):
        """An epoch's batch, handed out as `sample` hands out batches."""
        return self.feed.give(value)


def _clone(tree):
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(v) for v in tree)
    clone = getattr(tree, "clone", None)
    return tree if clone is None else clone()


def _arrive(stream, early):
    """``stream`` collects the task taken ahead, as the next call would have, if it is
    still that stream's request; a task that raised raises now, its chunk skipped."""
    owner, ticket, taken = early
    if owner is not stream or ticket not in stream.chunk_of:
        return   # (a new stream, or requests forgotten: asked for again, or dropped)
    stream.collect(ticket, taken.result)
