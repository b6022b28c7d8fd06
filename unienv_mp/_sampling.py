"""What the sampler and UniEnv's helpers (:mod:`unienv_mp.compat`) share: the work function
their workers run, and what they draw in the parent with the wrapped sampler's RNG (the
workers' seeds, an epoch's permutation)."""
import copy as _copy

from unienv_interface.utils.seed_util import next_seed_rng

from . import gather as _gather

__all__ = ["NO_ARG", "RESEED", "SamplerTarget", "draw_worker_seeds", "epoch_batches"]

#: The argument of a task for a method that takes none (``sample*``; ``get*_at`` methods
#: take an index array).
NO_ARG = None
#: The method name of a task that reseeds the worker's sampler: ``(RESEED, seed)``.
RESEED = "__unienv_mp_reseed__"


class SamplerTarget:
    """The work function the workers run: ``(method name, argument)`` -> result, calling
    the wrapped sampler's method (or ``fn``, for a name of ``None``).  The argument is
    ``NO_ARG`` for a method that takes none, a number ``k`` of batches for a ``sample*``
    method (a tuple of ``k`` batches comes back), or the method's argument (e.g. the
    indices of a ``get*_at`` method).  ``(RESEED, seed)`` reseeds the worker's sampler.

    With ``direct=True`` the methods a direct plan serves (see :mod:`unienv_mp.gather`)
    return a batch that the worker gathers straight into its slot; the plan is made in the
    worker, from the worker's own sampler, at the first such task.

    Picklable for spawn and forkserver: the sampler travels as a shallow copy without its
    random number generators (their state is replaced in the worker by :meth:`reseed`).
    """
    _RNG_ATTRS = ("rng", "data_rng")

    def __init__(self, sampler, fn=None, direct=False):
        self.sampler = sampler
        self.fn = fn
        self.direct = direct
        self._gatherer = None
        self._stripped = ()

    def __call__(self, work):
        name, arg = work
        if name == RESEED:
            self.reseed(arg)
            return None
        if self.direct:
            gatherer = self._gatherer
            if gatherer is None:
                try:
                    gatherer = self._gatherer = _gather.Gatherer(self.sampler)
                except Exception:
                    # the sampler changed since it was checked: the generic path, for good
                    self.direct = False
            if gatherer is not None:
                batch = gatherer(name, arg)
                if batch is not None:
                    return batch
        fn = self.fn if name is None else getattr(self.sampler, name)
        if arg is NO_ARG:
            return fn()
        if type(arg) is int and name is not None and name.startswith("sample"):
            return tuple([fn() for _ in range(arg)])   # a group (see batches_per_task)
        return fn(arg)

    def reseed(self, seed):
        sampler = self.sampler
        if not self._stripped:
            sampler.manual_seed(seed)
            return
        for name in self._stripped:
            device = sampler.device if name == "rng" else sampler.data.device
            setattr(sampler, name,
                    sampler.backend.random.random_number_generator(seed, device=device))

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


def epoch_batches(sampler):
    """Draw one random permutation of ``sampler.data`` with the sampler's RNG (advancing
    it, as ``BatchSampler.epoch_iter`` does) and split it into batches of
    ``sampler.batch_size``, the last one partial."""
    n = len(sampler.data)
    if sampler.data_rng is not None:
        sampler.data_rng, idx = sampler.backend.random.random_permutation(
            n, rng=sampler.data_rng, device=sampler.data.device)
    else:
        sampler.rng, idx = sampler.backend.random.random_permutation(
            n, rng=sampler.rng, device=sampler.data.device)
    bs = sampler.batch_size
    return [idx[s:s + bs] for s in range(0, n, bs)]
