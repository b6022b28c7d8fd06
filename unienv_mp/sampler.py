"""``unienv_mp.sampler``, kept for code that imports the samplers from here; they live in
`unienv_mp._sampling.sampler` (import ``from unienv_mp import MultiprocessingSampler``;
``SamplerBase``, the base of a sampler for a new backend, and ``SamplerTarget``, the work
function its workers run, from here: see [`unienv_mp.backend`][unienv_mp.backend])."""
from ._sampling.sampler import MultiprocessingSampler, SamplerBase
from ._sampling.target import SamplerTarget

__all__ = ["SamplerBase", "MultiprocessingSampler", "SamplerTarget"]
