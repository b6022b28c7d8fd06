"""The sampler's hand-out of batches on a device (or page-locked): the CPU batch its stream
gives, passed through the device feed, and the copy of the stream's next batch issued
ahead when it is here already (rule 6 of :mod:`.feed`)."""
from .._streams import forget_requests, take_chunk
from ..errors import WorkerError

__all__ = ["DeviceHandOut"]


class DeviceHandOut:
    """Owned by a sampler whose batches go through a feed (``sampler._feed``): its
    :meth:`sample` is the sampler's ``_sample``, and epochs pass their batches through
    :meth:`epoch_batch`.  ``cpu_sample(sampler, name)``: the sampler's own ``_sample``,
    which hands out the stream's CPU batch.  Works on the sampler's streams, manager and
    lock, as ``_sample`` does."""

    def __init__(self, sampler, cpu_sample):
        self._sampler = sampler
        self._cpu_sample = cpu_sample
        self._deferred = {}   # method -> a WorkerError met looking ahead, for its next call

    def sample(self, name):
        """The next batch of ``name``'s stream, on the device (or page-locked).
        ``sample_index`` stays as the wrapped sampler gives it (on the data's device), as
        UniEnv's does."""
        s = self._sampler
        if name == "sample_index":
            return self._cpu_sample(s, name)
        with s._lock:
            error = self._deferred.pop(name, None)
            if error is not None:
                raise error
            cpu = self._cpu_sample(s, name)
            feed = s._feed
            stream = s._streams[name]
            # The batch is off the stream now: a device error (or a Ctrl-C) in its copy puts
            # it back, so that nothing is lost and the position does not move.
            try:
                out = feed.hand_out(cpu) if feed.copying else feed.pinned(cpu)
            except BaseException:
                stream.ready.appendleft(cpu)
                s._caller.batches -= 1
                raise
            if feed.copying:
                try:
                    self._look_ahead(name, stream, feed)
                except Exception:
                    pass   # (what failed is met again, and raised, by the next call)
            return out

    def _look_ahead(self, name, stream, feed):
        """Issue the copy of ``name``'s next batch if it is here (rule 6 of the feed's
        rules): collects its task if it has arrived, as the next call would
        (``take_chunk``).  A task that raised is skipped, and its error kept for the next
        call."""
        ready = stream.ready
        if not ready:
            s = self._sampler
            tickets = stream.tickets
            manager = s._manager
            if not tickets or not s.in_order or manager is None \
                    or not manager.ready(tickets[0]):
                return
            try:
                take_chunk(manager, stream, tickets[0])
            except WorkerError as e:
                self._deferred[name] = e
                return
            except BaseException:
                forget_requests(manager, stream)
                raise
            if not ready:
                return
        feed.start(ready[0])

    def epoch_batch(self, value):
        """An epoch's CPU batch, handed out as :meth:`sample` hands out batches."""
        feed = self._sampler._feed
        return feed.hand_out(value) if feed.copying else feed.pinned(value)
