"""What the sampler and UniEnv's helpers (`unienv_mp.compat`) share: the work function their
workers run, and what they draw in the parent with the wrapped sampler's RNG (the workers'
seeds, an epoch's permutation)."""
import copy as _copy
import sys

from unienv_data.base import BatchSampler
from unienv_interface.utils.seed_util import next_seed_rng

from .._direct import gather as _gather
from .streams import chunk_seeds

__all__ = ["NO_ARG", "SamplerTarget", "chunk_work", "draw_worker_seeds", "epoch_order",
           "epoch_batches", "split_epoch"]

#: The argument of a task for a method that takes none (``sample*``; ``get*_at`` methods
#: take an index array).
NO_ARG = None


def chunk_work(work):
    """``(method, seeds, k)`` of a work item that is a chunk of a ``sample*`` method's
    stream (see `unienv_mp._sampling.streams`), else None (one call).  A chunk's ``k``
    batches are drawn one after the other, each after the sampler's RNGs are seeded as
    ``manual_seed(seed)`` would seed them: its work item is

    * ``(method, key, first, k)``: batch ``i`` with the seed of batch ``first + i`` of the
      stream whose key is ``key`` (``seeds``: the tuple of the ``k``, `chunk_seeds`, made
      here, in the worker); or
    * ``(method, seed, k)``: with ``seed`` (``seeds``: that int) once, before the first
      batch (a stream restored from a state of unienv_mp 0.1)."""
    n = len(work)
    if n == 4:
        name, key, first, k = work
        return name, chunk_seeds(key, first, k), k
    if n == 3:
        return work
    return None


class SamplerTarget:
    """The work function the workers run, calling the wrapped sampler's methods (or
    ``fn``, for a method name of ``None``).  A work item is either

    * a chunk of a ``sample*`` method's stream (see `chunk_work`): ``k`` batches drawn
      one after the other, which come back as a tuple; or
    * ``(method, argument)``: one call, ``method()`` for an argument of ``NO_ARG`` or
      ``method(argument)`` (e.g. the indices of a ``get*_at`` method).

    With ``direct=True`` the methods a direct plan serves (see `unienv_mp._direct.gather`)
    return a batch that the worker gathers straight into its slot; the plan is made in the
    worker, from the worker's own sampler, at its first task of any kind (if that fails,
    the worker gathers nothing directly); a method's slot layout, at its first task.

    Picklable for spawn and forkserver: the sampler travels as a shallow copy without its
    random number generators (made again in the worker by
    [`reseed`][unienv_mp.sampler.SamplerTarget.reseed]).

    Args:
        sampler: the wrapped sampler (a ``BatchSampler``), whose methods the work items
            name.
        fn: what a work item whose method name is ``None`` calls instead.
        direct: gather the batches that a direct plan serves straight into the slot (see
            above); where the worker's sampler cannot be planned, every task takes the
            generic path.
    """
    _RNG_ATTRS = ("rng", "data_rng")

    def __init__(self, sampler, fn=None, direct=False):
        self.sampler = sampler
        self.fn = fn
        self.direct = direct
        self._gatherer = None
        self._stripped = ()
        self._in_place = None   # reseed in place (see reseed): decided at the first call

    def __call__(self, work):
        before = None
        chunk = chunk_work(work)
        if chunk is not None:
            name, seeds, k = chunk
            arg = k

            def before(i):
                self.reseed_for(seeds, i)
        else:
            name, arg = work
        if self.direct:
            gatherer = self._gatherer
            if gatherer is None:
                try:
                    gatherer = self._gatherer = _gather.Gatherer(self.sampler)
                except Exception:
                    # the sampler changed since it was checked: the generic path, for good
                    self.direct = False
            if gatherer is not None:
                batch = gatherer(name, arg, before)
                if batch is not None:
                    return batch
        fn = self.fn if name is None else getattr(self.sampler, name)
        if arg is NO_ARG:
            return fn()
        if before is not None:   # a chunk
            out = []
            for i in range(arg):
                before(i)
                out.append(fn())
            return tuple(out)
        return fn(arg)

    def reseed_for(self, seeds, i):
        """Seed the sampler for batch ``i`` of a chunk whose seeds are ``seeds`` (see the
        class's docstring): with ``seeds[i]``, or, for one int, with it before batch 0."""
        if type(seeds) is tuple:
            self.reseed(seeds[i])
        elif i == 0:
            self.reseed(seeds)

    @staticmethod
    def chunk_of(work):
        """``(method, seeds, k)`` of a work item that is a chunk of a ``sample*`` stream,
        else None (see `unienv_mp._sampling.target.chunk_work`)."""
        return chunk_work(work)

    @staticmethod
    def batches_in(work):
        """How many batches the task of ``work`` makes (a chunk's ``k``; 1 otherwise), for
        the manager's statistics."""
        return work[-1] if len(work) > 2 else 1

    def reseed(self, seed):
        """Seed the worker's sampler as ``sampler.manual_seed(seed)`` does, putting back
        the RNGs that were left behind when it was pickled.  A CPU ``torch.Generator`` is
        reseeded in place (a new one costs several microseconds): the same state as the
        new generator ``manual_seed`` would make, since ``Generator.manual_seed`` resets
        all of it."""
        sampler = self.sampler
        if self._stripped:
            for name in self._stripped:
                device = sampler.device if name == "rng" else sampler.data.device
                setattr(sampler, name,
                        sampler.backend.random.random_number_generator(seed, device=device))
            self._stripped = ()
        in_place = self._in_place
        if in_place is None:
            in_place = self._in_place = self._can_reseed_in_place()
        if not in_place:
            sampler.manual_seed(seed)
            return
        for name in self._RNG_ATTRS:
            rng = getattr(sampler, name)
            if rng is not None:
                rng.manual_seed(seed)

    def _can_reseed_in_place(self):
        """True if the sampler's ``manual_seed`` is UniEnv's own and every RNG it has is a
        CPU ``torch.Generator``."""
        sampler = self.sampler
        if getattr(type(sampler), "manual_seed", None) is not BatchSampler.manual_seed \
                or "manual_seed" in getattr(sampler, "__dict__", {}):
            return False
        torch = sys.modules.get("torch")
        for name in self._RNG_ATTRS:
            rng = getattr(sampler, name, None)
            if rng is not None and (torch is None or type(rng) is not torch.Generator
                                    or rng.device.type != "cpu"):
                return False
        return True

    def __getstate__(self):
        state = self.__dict__.copy()
        sampler = _copy.copy(self.sampler)
        attrs = vars(sampler)
        stripped = tuple(n for n in self._RNG_ATTRS if attrs.get(n) is not None)
        for n in stripped:
            attrs[n] = None
        state["sampler"] = sampler
        state["_stripped"] = stripped
        state["_gatherer"] = None   # made again from the sampler where it is needed
        return state


def draw_worker_seeds(sampler, n):
    """One seed per worker from the sampler's RNG (advancing it), as UniEnv does; None if
    the sampler has no RNG."""
    use_data_rng = sampler.data_rng is not None
    rng = sampler.data_rng if use_data_rng else sampler.rng
    if rng is None:
        return None
    seeds = []
    for _ in range(n):
        rng, seed = next_seed_rng(rng, sampler.backend)
        seeds.append(seed % (2 ** 31))
    if use_data_rng:
        sampler.data_rng = rng
    else:
        sampler.rng = rng
    return seeds


def epoch_order(sampler):
    """Draw one random permutation of ``sampler.data`` with the sampler's RNG (advancing
    it, as ``BatchSampler.epoch_iter`` does)."""
    n = len(sampler.data)
    if sampler.data_rng is not None:
        sampler.data_rng, idx = sampler.backend.random.random_permutation(
            n, rng=sampler.data_rng, device=sampler.data.device)
    else:
        sampler.rng, idx = sampler.backend.random.random_permutation(
            n, rng=sampler.rng, device=sampler.data.device)
    return idx


def epoch_batches(sampler):
    """`epoch_order` split into batches of ``sampler.batch_size``, the last one partial."""
    return split_epoch(epoch_order(sampler), sampler.batch_size)


def split_epoch(order, batch_size):
    """The batches of an epoch over the permutation ``order``: ``batch_size`` indices
    each, the last one partial."""
    return [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
