"""unienv_mp: shared-memory ring buffers, a multiprocessing.Queue replacement, and a
drop-in, faster MultiprocessingSampler for UniEnv.

    from unienv_mp import MultiprocessingSampler   # was: from unienv_data.samplers import ...

The sampler names (which import UniEnv) are loaded on first use, so that the transport
(``RingBuffer``, ``ShmQueue``) can be used without importing UniEnv.  Type checkers and
IDEs see them as ordinary imports.
"""
import sys
from typing import TYPE_CHECKING

from ._sampling import state as _state_format
from ._transport.ring import RingBuffer, Segment
from ._transport.shm_queue import ShmQueue
from .errors import (CodecError, PeerGoneError, RingClosed, WorkerDiedError, WorkerError,
                     WorkerStalledError)
from .stats import DeviceStats, SamplerStats, WorkerStats

if TYPE_CHECKING:
    from ._process.manager import \
        MultiProcessingSampleManager as MultiProcessingSampleManager
    from ._sampling.sampler import MultiprocessingSampler as MultiprocessingSampler
    from .windows import WindowedBatch as WindowedBatch
    from .compat import worker_loop as worker_loop
    from .compat import wrap_epoch_iter_function as wrap_epoch_iter_function
    from .compat import wrap_sample_function as wrap_sample_function

# A state_dict() saved by unienv_mp 0.1 pickled its torch.Generator as an object of the
# module ``unienv_mp._state``, which is now ``unienv_mp._sampling.state``.
sys.modules.setdefault(__name__ + "._state", _state_format)

#: The package's version, and the only place it is written (pyproject.toml reads it).
__version__ = "0.1.0"

_LAZY = {
    "MultiprocessingSampler": "sampler",
    "MultiProcessingSampleManager": "manager",
    "WindowedBatch": "windows",
    "worker_loop": "compat",
    "wrap_sample_function": "compat",
    "wrap_epoch_iter_function": "compat",
}

__all__ = ["RingBuffer", "Segment", "ShmQueue", "RingClosed", "CodecError", "PeerGoneError",
           "WorkerError", "WorkerStalledError", "WorkerDiedError", "SamplerStats",
           "WorkerStats", "DeviceStats", *_LAZY]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'unienv_mp' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
