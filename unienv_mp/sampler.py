"""``unienv_mp.sampler``, kept for code that imports the samplers from here; they live in
:mod:`unienv_mp._sampling.sampler` (import them as ``from unienv_mp import
MultiprocessingSampler``, and ``SamplerBase`` from :mod:`unienv_mp.backend`)."""
from ._sampling.sampler import MultiprocessingSampler, SamplerBase

__all__ = ["SamplerBase", "MultiprocessingSampler"]
