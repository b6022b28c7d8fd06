"""Checkpoints of a sampler: what its ``state_dict`` holds, and a state read back and
checked for ``load_state_dict`` (the format: `unienv_mp._sampling.state`; the positions of
the streams in it: `unienv_mp._sampling.streams`).

The sampler calls them with its lock held and hands them what they read (``s``: the
sampler, of which they use public names only; ``chunk_size(name)``: batches per task of a
method's stream).  They change nothing: the sampler then changes its state in one step that
a Ctrl-C cannot cut in two.
"""
import collections

from .._validate import MAX_BUFFERS
from . import state as _state
from .streams import EpochProgress, Stream

__all__ = ["state_of", "read_state", "configuration"]


def state_of(s, streams, base, per_batch, epochs):
    """The ``state_dict()`` of sampler ``s`` (see its docstring), whose ``streams`` (method
    -> `Stream`) were seeded from ``base`` (``per_batch``: see `read_state`) and whose
    ``epochs`` (`unienv_mp._sampling.epochs.Epochs`) are open or to resume."""
    restored = [p for queue in epochs.resume.values() for p in queue]
    return {
        # (a sampler going on from a state of unienv_mp 0.1 saves one its streams fit)
        "format": _state.FORMAT, "version": _state.VERSION if per_batch else 2,
        "configuration": s.configuration(streams),
        "base_seed": base,
        "rngs": _state.capture_rngs(s.sampler),
        "streams": {name: st.position() for name, st in streams.items()},
        "epochs": [p.position() for p in (*epochs.open, *restored)],
    }


def read_state(s, state, chunk_size):
    """``(base seed, per_batch, RNGs, streams, epochs to resume by getter)`` of ``state``,
    every part checked against sampler ``s``, nothing changed yet (``per_batch``: whether
    its streams seed each batch, see `unienv_mp._sampling.streams`).  Raises ``ValueError``
    (saying what differs) for a state of another configuration, or one that is not a
    whole state."""
    try:
        return _read(s, state, chunk_size)
    except _state.Refused as e:
        # (a ValueError, as the docs say, not the private class that says why)
        raise ValueError(str(e)) from None
    except Exception as e:
        raise ValueError(f"not a whole state_dict(): {type(e).__name__}: {e}") from e


def _read(s, state, chunk_size):
    saved = state.get("streams", {}) if isinstance(state, dict) else {}
    _state.check(state, s.configuration(saved))
    base = state["base_seed"]
    per_batch = state["version"] >= 3
    rngs = _state.rebuilt_rngs(state["rngs"], s.sampler)
    methods = {n for n in s.sampler_methods() if n.startswith("sample")}
    streams = {}
    for name, pos in saved.items():
        _state.check_stream(name, pos, methods, chunk_size(name), MAX_BUFFERS)
        streams[name] = Stream.from_position(name, base, pos, per_batch)
    getters = {n for n in s.sampler_methods() if n.startswith("get")}
    resume = {}
    for position in state["epochs"]:
        p = EpochProgress.from_position(position)
        _state.check_epoch(p, getters, len(s.sampler.data), s.batch_size,
                           s.sampler.backend)
        resume.setdefault(p.getter, collections.deque()).append(p)
    return base, per_batch, rngs, streams, resume


def configuration(s, methods, chunk_size):
    """What a state must match to load into sampler ``s``, with the chunk sizes
    (``chunk_size(name)``) of ``methods`` and of every ``sample*`` method of the wrapped
    sampler."""
    methods = set(methods) | {n for n in s.sampler_methods() if n.startswith("sample")}
    return _state.configuration(s.sampler, {m: chunk_size(m) for m in methods})
