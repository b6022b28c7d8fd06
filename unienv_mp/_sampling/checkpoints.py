"""Seeds and checkpoints on the training process's side of a sampler: ``manual_seed``,
``state_dict`` and ``load_state_dict`` (what the state holds: :mod:`unienv_mp._sampling.state`; the
positions of the streams in it: :mod:`unienv_mp._sampling.streams`).

:class:`Checkpoints` is a base class of :class:`unienv_mp._sampling.sampler.SamplerBase` and works on
that class's state: ``_lock``, the ``sample*`` streams (``_streams``, ``_base``), the epoch
being handed out (``_open_epochs``) and those restored (``_resume``).  Each change of that
state is one step that a Ctrl-C cannot cut in two.
"""
import collections

from .. import _os
from . import state as _state
from .streams import EpochProgress, Stream, base_seed
from .._validate import MAX_BUFFERS

__all__ = ["Checkpoints"]


class Checkpoints:
    """Seeding a sampler, and saving and restoring where its streams and epochs are."""

    def manual_seed(self, seed):
        """Seed the wrapped sampler.  Batches already requested are dropped, so that what
        follows is the same as from a fresh sampler seeded with ``seed``: the ``sample*``
        streams start again from their first batch, and the next epoch draws its
        permutation from the new seed."""
        with self._lock:
            with _os.interrupts_deferred():   # (one step: a Ctrl-C cannot cut it in two)
                self.sampler.manual_seed(seed)
                self._drop_streams()
                self._base = base_seed(self.sampler)
                self._resume = {}

    def _drop_streams(self):
        """Cancel what every stream requested and forget the streams (the batches of a
        chunk not handed out yet go with them)."""
        manager = self._manager
        streams, self._streams = self._streams, {}
        if manager is not None and not manager.closed:
            for stream in streams.values():
                for t in stream.tickets:
                    manager.cancel(t)

    def state_dict(self):
        """Everything needed to go on from here, as a small picklable dict: the seed of
        the ``sample*`` streams and how far each was handed out, the wrapped sampler's
        RNGs (from which the next epochs' permutations are drawn), and the epochs being
        iterated, in the order they started (each one's permutation and which of its
        batches were handed out).  Batches requested ahead but not handed out yet are not
        part of it.  See :meth:`load_state_dict`."""
        with self._lock:
            restored = [p for queue in self._resume.values() for p in queue]
            return {
                "format": _state.FORMAT, "version": _state.VERSION,
                "configuration": self._configuration(self._streams),
                "base_seed": self._base,
                "rngs": _state.capture_rngs(self.sampler),
                "streams": {name: st.position() for name, st in self._streams.items()},
                "epochs": [p.position() for p in (*self._open_epochs, *restored)],
            }

    def load_state_dict(self, state):
        """Go on from ``state`` (from :meth:`state_dict` of a sampler built the same way:
        the same kind of wrapped sampler, batch size, data length, batch structure and
        ``batches_per_task``; ``n_workers``, ``n_buffers``, the start method and
        ``direct_gather`` may differ, in this process or another).  The next batches of
        each ``sample*`` method are those the original sampler would have handed out
        next.  If epochs were being iterated, the next epoch iterators of the same kind
        yield exactly the rest of each, in the order they started, and the one after
        them starts a new epoch as the original's would have.  Raises ``ValueError``
        (saying what differs) for a state of another configuration, or one that is not a
        whole state; the sampler is then as it was."""
        with self._lock:
            try:
                base, rngs, streams, resume = self._read_state(state)
            except _state.Refused:
                raise
            except Exception as e:
                raise ValueError(f"not a whole state_dict(): {type(e).__name__}: {e}") from e
            with _os.interrupts_deferred():   # (one step: a Ctrl-C cannot cut it in two)
                self._drop_streams()
                self._base = base
                _state.give_rngs(self.sampler, rngs)
                self._streams = streams
                self._open_epochs = []
                self._resume = resume

    def _read_state(self, state):
        """``(base seed, RNGs, streams, epochs to resume by getter)`` of ``state``, every
        part checked against this sampler (raises Refused), nothing changed yet."""
        saved = state.get("streams", {}) if isinstance(state, dict) else {}
        _state.check(state, self._configuration(saved))
        base = state["base_seed"]
        rngs = _state.rebuilt_rngs(state["rngs"], self.sampler)
        methods = {n for n in self._sampler_methods() if n.startswith("sample")}
        streams = {}
        for name, pos in saved.items():
            _state.check_stream(name, pos, methods, self._chunk_size(name), MAX_BUFFERS)
            streams[name] = Stream.from_position(name, base, pos)
        getters = {n for n in self._sampler_methods() if n.startswith("get")}
        resume = {}
        for position in state["epochs"]:
            p = EpochProgress.from_position(position)
            _state.check_epoch(p, getters, len(self.sampler.data), self.batch_size,
                               self.sampler.backend)
            resume.setdefault(p.getter, collections.deque()).append(p)
        return base, rngs, streams, resume

    def _configuration(self, methods):
        methods = set(methods) | {n for n in self._sampler_methods() if n.startswith("sample")}
        return _state.configuration(self.sampler, {m: self._chunk_size(m) for m in methods})
