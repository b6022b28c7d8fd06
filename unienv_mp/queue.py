"""``unienv_mp.queue``, kept for code that imports ``ShmQueue`` from here; it lives in
`unienv_mp._transport.shm_queue` (import it as ``from unienv_mp import ShmQueue``)."""
from ._transport.shm_queue import ShmQueue

__all__ = ["ShmQueue"]
