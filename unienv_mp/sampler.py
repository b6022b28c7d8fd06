"""``unienv_mp.sampler``, kept for code that imports the samplers from here; they live in
:mod:`unienv_mp._sampling.sampler` (import ``from unienv_mp import
MultiprocessingSampler``; ``SamplerBase``, the base of a sampler for a new backend, from
here: see :mod:`unienv_mp.backend`)."""
from ._sampling.sampler import MultiprocessingSampler, SamplerBase

__all__ = ["SamplerBase", "MultiprocessingSampler"]
