"""What a sampler's ``state_dict()`` holds besides the positions of its streams: the format
tag, the configuration the state only fits (compared on load), and the wrapped sampler's
random number generators in the parent (epochs draw their permutations from them).

The state is a small dict of plain values and the sampler's own RNG and index objects, so
it pickles (``torch.save`` and ``pickle`` both work)::

    {"format": "unienv_mp.MultiprocessingSampler", "version": 2,
     "configuration": {...},     # see configuration()
     "base_seed": int,           # of the sample* streams (see unienv_mp._streams)
     "rngs": {"rng": ..., "data_rng": ...},
     "streams": {method: {"k", "low", "done", "partial"}},
     "epochs": [{"getter", "order", "batch_size", "low", "done"}]}
"""
import copy
import pickle
import sys

__all__ = ["FORMAT", "VERSION", "configuration", "check", "capture_rngs", "restore_rngs"]

FORMAT = "unienv_mp.MultiprocessingSampler"
VERSION = 2

_RNGS = ("rng", "data_rng")


def _structure(space):
    """A space's structure as text: the kind, shape and dtype of every leaf, in order."""
    if space is None:
        return "None"
    spaces = getattr(space, "spaces", None)
    if isinstance(spaces, dict):
        inner = ", ".join(f"{k}: {_structure(v)}" for k, v in spaces.items())
        return f"{type(space).__name__}({inner})"
    if isinstance(spaces, (tuple, list)):
        return f"{type(space).__name__}({', '.join(_structure(v) for v in spaces)})"
    shape = getattr(space, "shape", None)
    shape = "" if shape is None else str(tuple(int(d) for d in shape))
    return f"{type(space).__name__}{shape} {getattr(space, 'dtype', '')}".rstrip()


def configuration(sampler, chunk_sizes):
    """What a state must have been taken with to be loaded into a sampler wrapping
    ``sampler``; ``chunk_sizes``: method -> batches per chunk, for the streams to
    compare."""
    t = type(sampler)
    return {
        "sampler": f"{t.__module__}.{t.__qualname__}",
        "batch_size": int(sampler.batch_size),
        "data_length": len(sampler.data),
        "structure": _structure(sampler.sampled_space),
        "metadata_structure": _structure(sampler.sampled_metadata_space),
        "chunks": dict(chunk_sizes),
    }


def check(state, here):
    """Raise ``ValueError`` unless ``state`` is a state of this format whose configuration
    matches ``here`` (see :func:`configuration`); the message says what differs."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"not a state_dict() of a unienv_mp MultiprocessingSampler: "
                         f"{type(state).__name__} without format {FORMAT!r}")
    if state.get("version") != VERSION:
        raise ValueError(f"state_dict format version {state.get('version')!r}; this "
                         f"version of unienv_mp reads version {VERSION}")
    saved = state["configuration"]
    differ = []
    for key in ("sampler", "batch_size", "data_length", "structure", "metadata_structure"):
        if saved.get(key) != here[key]:
            differ.append(f"{key} is {saved.get(key)!r} in the state, {here[key]!r} here")
    for method, k in saved.get("chunks", {}).items():
        mine = here["chunks"].get(method)   # (every sample* method of both)
        if mine is not None and mine != k:
            differ.append(f"{method}() makes {k} batches per task in the state, {mine} here "
                          f"(batches_per_task)")
    if differ:
        raise ValueError("this state was taken from a sampler configured differently: "
                         + "; ".join(differ))


def capture_rngs(sampler):
    """The wrapped sampler's RNGs as they are now, as picklable values: a
    ``torch.Generator`` as its device and state (torch before 2.4 could not pickle
    generators), anything else (numpy's, JAX keys) as a copy."""
    return {name: _saved_rng(getattr(sampler, name, None)) for name in _RNGS}


def restore_rngs(sampler, rngs):
    """Give the wrapped sampler RNGs in the states of ``rngs`` (see :func:`capture_rngs`)."""
    for name in _RNGS:
        if name in rngs:
            setattr(sampler, name, _restored_rng(rngs[name]))


class _TorchGenerator:
    """A ``torch.Generator``'s device and state."""

    def __init__(self, device, state):
        self.device = device
        self.state = state


def _saved_rng(rng):
    if rng is None:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(rng, torch.Generator):
        return _TorchGenerator(str(rng.device), rng.get_state())
    try:
        return copy.deepcopy(rng)
    except Exception:
        return pickle.loads(pickle.dumps(rng))


def _restored_rng(saved):
    if isinstance(saved, _TorchGenerator):
        import torch
        rng = torch.Generator(device=saved.device)
        rng.set_state(saved.state)
        return rng
    return _saved_rng(saved)   # (a copy: the state stays as it was for another load)
