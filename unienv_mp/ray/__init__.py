"""The sampler with its workers on a Ray cluster:

```python
from unienv_mp.ray import RaySampler   # instead of: from unienv_mp import MultiprocessingSampler

sampler = RaySampler(StepSampler(rb, 256, seed=0), n_workers=8)
```

[`RaySampler`][unienv_mp.ray.RaySampler] has
[`MultiprocessingSampler`][unienv_mp.MultiprocessingSampler]'s API and gives the same
batches for the same seed; its workers are Ray actors.  Needs Ray (``pip install
"unienv_mp[ray]"``).  Nothing else in the package imports ray.
"""
try:
    import ray  # noqa: F401
except ImportError as e:   # pragma: no cover - depends on the environment
    raise ImportError(
        "unienv_mp.ray needs Ray, which is not installed: pip install \"unienv_mp[ray]\" "
        "(or pip install ray)") from e

from .manager import RayManager
from .sampler import RaySampler, RemoteData, RemoteSampler

__all__ = ["RaySampler", "RayManager", "RemoteSampler", "RemoteData"]
