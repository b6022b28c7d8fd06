"""The Ray actor that makes batches: one per worker of a
`RaySampler`, made into an actor class by `RayManager`."""
import os
import time

from unienv_data.base import BatchSampler

from .. import _os
from .._direct import gather as _gather
from .._sampling import state as _state
from .._sampling.streams import base_seed
from .._sampling.target import SamplerTarget
from ..errors import error_payload
from ._batch import ActorFrames

__all__ = ["SamplerActor", "OK", "ERROR", "COULD_NOT_START"]

#: The status of a result (see `SamplerActor.run`).
OK, ERROR, COULD_NOT_START = 0, 1, 2


class SamplerActor:
    """Runs a `SamplerTarget` (the work function of `MultiprocessingSampler`'s workers) on
    the tasks it is sent.

    Args:
        index: the worker's index.
        target: the ``SamplerTarget`` (shipped once through the object store), or None.
        factory: with ``target=None``, a callable that returns the ``BatchSampler`` to run
            (called here, once).
        home: the id of the caller's Ray node: an actor there writes results into slots
            that the caller maps (see `unienv_mp.ray._batch`).
        direct: with ``factory``, whether its sampler's batches are gathered directly
            where they can be (see `unienv_mp._direct.gather`).

    An exception raised while the sampler is made is kept: every call then answers
    ``COULD_NOT_START`` with it, so that the caller gets the error and its traceback
    rather than a dead actor.
    """

    def __init__(self, index, target, factory, home=None, direct=True):
        import ray
        _os.limit_threads()   # (the actors are the parallelism, as worker processes are)
        self.index = index
        self.target = None
        self.failure = None
        self.frames = ActorFrames(index)
        self.local = home is not None and ray.get_runtime_context().get_node_id() == home
        try:
            if target is None:
                sampler = factory()
                if not isinstance(sampler, BatchSampler):
                    raise TypeError(
                        f"sampler_factory must return a unienv_data BatchSampler, got "
                        f"{type(sampler).__module__}.{type(sampler).__qualname__}")
                target = SamplerTarget(sampler, direct=direct)
            self.target = target
        except Exception as e:
            self.failure = error_payload(e)

    def run(self, items):
        """``(results, pid, cpu)``: for each ``(work, slot)`` of ``items``, ``(status,
        value, ns)``: the work function's result on ``work`` as a frame for the trip
        (status ``OK``; written into result slot ``slot`` if it is not None and this actor
        is on the caller's node, see `unienv_mp.ray._batch.ActorFrames`), or its exception
        as ``errors.error_payload`` describes it (``ERROR``), and how long that took, in
        nanoseconds; then this process's id and its CPU seconds so far."""
        return ([self._one(work, slot, i) for i, (work, slot) in enumerate(items)],
                os.getpid(), time.process_time())

    def _one(self, work, slot, place):
        start = time.monotonic_ns()
        if self.failure is not None:
            return COULD_NOT_START, self.failure, 0
        try:
            status, value = OK, self.frames.write(self.target(work),
                                                  slot if self.local else None, place)
        except Exception as e:
            status, value = ERROR, error_payload(e)
        return status, value, time.monotonic_ns() - start

    def describe(self):
        """What the training process needs to know of a sampler made by ``factory``: its
        spaces, batch size, data length and device, its RNGs, its methods and the bytes
        per row of each, and the configuration a checkpoint of it must match."""
        if self.failure is not None:
            return COULD_NOT_START, self.failure
        s = self.target.sampler
        methods = [n for n in dir(s) if n.startswith(("sample", "get_at", "get_flattened_at"))
                   and callable(getattr(s, n, None))]
        return OK, {
            "single_space": s.single_space,
            "single_metadata_space": s.single_metadata_space,
            "sampled_space": s.sampled_space,
            "sampled_metadata_space": s.sampled_metadata_space,
            "batch_size": s.batch_size,
            "device": s.device,
            "data_length": len(s.data),
            "data_device": getattr(s.data, "device", None),
            "rngs": _state.capture_rngs(s),
            "base_seed": base_seed(s),
            "methods": methods,
            "rows": {n: _gather.row_nbytes(s, n) for n in methods if n.startswith("sample")},
            "configuration": _state.configuration(s, {}),
            "not_direct": _gather.why_not(s) if self.target.direct else "direct_gather=False",
        }

    def made(self):
        """Whether this actor made its sampler (False: every call answers
        ``COULD_NOT_START``)."""
        return self.failure is None

    def where(self):
        """``(node id, pid)``: where this actor runs."""
        import ray
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def seeded_rngs(self, seed):
        """The sampler's RNGs after its ``manual_seed(seed)`` (the chunks seed it anew)."""
        if self.failure is not None:
            return COULD_NOT_START, self.failure
        sampler = self.target.sampler
        try:
            sampler.manual_seed(seed)
        except Exception as e:
            return ERROR, error_payload(e)
        return OK, _state.capture_rngs(sampler)
