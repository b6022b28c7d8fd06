"""What a sampler's ``state_dict()`` holds besides the positions of its streams: the format
tag, the configuration the state only fits (compared on load), and the wrapped sampler's
random number generators in the parent (epochs draw their permutations from them).

The state is a small dict of plain values and the sampler's own RNG and index objects, so
it pickles (``torch.save`` and ``pickle`` both work)::

    {"format": "unienv_mp.MultiprocessingSampler", "version": 3,
     "configuration": {...},     # see configuration()
     "base_seed": int,           # of the sample* streams (see unienv_mp._sampling.streams)
     "rngs": {"rng": ..., "data_rng": ...},
     "streams": {method: {"k", "low", "done", "partial"}},
     "epochs": [{"getter", "order", "batch_size", "low", "done"}]}
"""
import copy
import pickle
import sys

import numpy as np

__all__ = ["FORMAT", "VERSION", "Refused", "configuration", "check", "check_stream",
           "check_epoch", "capture_rngs", "rebuilt_rngs", "give_rngs", "restore_rngs"]

FORMAT = "unienv_mp.MultiprocessingSampler"
#: Version 3: each batch of a stream is seeded (see `unienv_mp._sampling.streams`);
#: version 2, of unienv_mp 0.1, seeded each chunk, and a state of it still loads and goes
#: on that way.
VERSION = 3
READS = (2, 3)

_RNGS = ("rng", "data_rng")

#: Chunk numbers, and seeds, are below this.
_TOP = 2 ** 64


class Refused(ValueError):
    """A state this sampler cannot go on from; the message says why."""


def _is_int(x, low=0, high=_TOP):
    """True if ``x`` is a Python int (not a bool) with ``low <= x < high``."""
    return type(x) is int and low <= x < high


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
    """Raise Refused (a ``ValueError``) unless ``state`` is a state of this format whose
    configuration matches ``here`` (see `configuration`) and whose base seed is a 64-bit
    number; the message says what differs."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise Refused(f"not a state_dict() of a unienv_mp MultiprocessingSampler: "
                      f"{type(state).__name__} without format {FORMAT!r}")
    if state.get("version") not in READS or type(state.get("version")) is not int:
        raise Refused(f"state_dict format version {state.get('version')!r}; this "
                      f"version of unienv_mp reads versions {', '.join(map(str, READS))}")
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
        raise Refused("this state was taken from a sampler configured differently: "
                      + "; ".join(differ))
    if not _is_int(state.get("base_seed")):
        raise Refused(f"not a whole state_dict(): its base seed {state.get('base_seed')!r} "
                      f"is not a 64-bit number")


def capture_rngs(sampler):
    """The wrapped sampler's RNGs as they are now, as picklable values: a
    ``torch.Generator`` as its device and state (torch before 2.4 could not pickle
    generators), anything else (numpy's, JAX keys) as a copy."""
    return {name: _saved_rng(getattr(sampler, name, None)) for name in _RNGS}


def rebuilt_rngs(rngs, sampler=None):
    """``{name: RNG}`` in the states of ``rngs`` (see `capture_rngs`), for `give_rngs`;
    raises (and changes nothing) for what is not such a value, or, given the wrapped
    ``sampler``, an RNG of another type than the one it has (or one where it has none, or
    none where it has one)."""
    if not isinstance(rngs, dict):
        raise TypeError(f"rngs is a {type(rngs).__name__}, not a dict")
    out = {name: _restored_rng(rngs[name]) for name in _RNGS if name in rngs}
    for name, rng in out.items():
        if sampler is None:
            break
        mine = getattr(sampler, name, None)
        if type(rng) is not type(mine):   # (None too: a sampler built the same way)
            raise TypeError(f"rngs[{name!r}] is a {type(rng).__name__}, the sampler's "
                            f"{name} a {type(mine).__name__}")
    return out


def give_rngs(sampler, rebuilt):
    """Give the wrapped sampler the RNGs of `rebuilt_rngs`."""
    for name, rng in rebuilt.items():
        setattr(sampler, name, rng)


def restore_rngs(sampler, rngs):
    """Give the wrapped sampler RNGs in the states of ``rngs`` (see `capture_rngs`)."""
    give_rngs(sampler, rebuilt_rngs(rngs))


def check_stream(name, position, methods, k, ahead):
    """Raise Refused unless ``position`` (a stream's, read from a state) is one of a
    ``sample*`` method in ``methods`` that makes ``k`` batches per task: chunk numbers
    and counts that can be (see `unienv_mp._sampling.streams.Stream.position`), chunks
    handed out ahead of the first one not handed out at most ``ahead`` chunks on."""
    if name not in methods:
        raise Refused(f"the state has a stream of {name!r}, which the wrapped sampler "
                      f"does not have")
    if not isinstance(position, dict):
        raise Refused(f"the state's stream of {name} is a {type(position).__name__}")
    if position.get("k") != k or type(position.get("k")) is not int:
        raise Refused(f"the state's stream of {name} makes {position.get('k')!r} batches "
                      f"per task, this sampler {k}")
    low, done, partial = position.get("low"), position.get("done"), position.get("partial")
    top = low + ahead + 1 if _is_int(low) else None
    if (top is None or not isinstance(done, (list, tuple))
            or not all(_is_int(c, low + 1, top) for c in done)
            or not isinstance(partial, dict)
            or not all(_is_int(c, low, top) and c not in done and _is_int(n, 0, k + 1)
                       for c, n in partial.items())):
        raise Refused(f"the state's stream of {name} is at a position that cannot be: "
                      f"low {low!r}, done {done!r}, partial {partial!r}")


def check_epoch(progress, getters, length, batch_size, backend):
    """Raise Refused unless ``progress`` (an ``EpochProgress`` read from a state) is an
    epoch this sampler could be in: a ``get*_at`` method of the wrapped sampler, a
    permutation of its ``length`` rows as a signed integer array of its ``backend``,
    its ``batch_size``, and batches handed out that exist."""
    if not isinstance(progress.getter, str) or progress.getter not in getters:
        raise Refused(f"the state's epoch is of {progress.getter!r}, which the wrapped "
                      f"sampler does not have")
    if type(progress.batch_size) is not int or progress.batch_size != batch_size:
        raise Refused(f"the state's epoch has batches of {progress.batch_size!r}, this "
                      f"sampler of {batch_size}")
    order = progress.order
    if not backend.is_backendarray(order):
        raise Refused(f"the state's epoch order is a {type(order).__name__}, not an "
                      f"array of the sampler's backend")
    numpy_of = getattr(order, "numpy", None)
    values = np.asarray(numpy_of() if callable(numpy_of) else order)
    if (values.shape != (length,) or values.dtype.kind != "i"
            or not np.array_equal(np.sort(values), np.arange(length))):
        raise Refused(f"the state's epoch is not a permutation of this sampler's "
                      f"{length} rows")
    n = progress.n_batches()
    low, done = progress.low, progress.done
    if not _is_int(low, 0, n + 1):
        raise Refused(f"the state's epoch has handed out its batches below {low!r}, "
                      f"of {n}")
    if not all(_is_int(i, low + 1, n) for i in done):
        raise Refused(f"the state's epoch has handed out batches {sorted(done, key=str)} "
                      f"out of order, which do not lie between {low} and {n}")


#: How a ``torch.Generator`` is saved: ``{TORCH_GENERATOR: device, "state": ByteTensor}``,
#: plain values that name no class of this package.
TORCH_GENERATOR = "torch.Generator"


class _TorchGenerator:
    """A ``torch.Generator``'s device and state, as a state of unienv_mp 0.1 pickled it
    (under the module name ``unienv_mp._state``, which the package's ``__init__`` keeps
    pointing here); loaded, never made."""

    def __init__(self, device, state):
        self.device = device
        self.state = state


def _saved_rng(rng):
    if rng is None:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(rng, torch.Generator):
        return {TORCH_GENERATOR: str(rng.device), "state": rng.get_state()}
    try:
        return copy.deepcopy(rng)
    except Exception:
        return pickle.loads(pickle.dumps(rng))


def _restored_rng(saved):
    if isinstance(saved, _TorchGenerator):
        saved = {TORCH_GENERATOR: saved.device, "state": saved.state}
    if isinstance(saved, dict) and TORCH_GENERATOR in saved:
        import torch
        rng = torch.Generator(device=saved[TORCH_GENERATOR])
        rng.set_state(saved["state"])
        return rng
    return _saved_rng(saved)   # (a copy: the state stays as it was for another load)
