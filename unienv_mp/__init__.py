"""unienv_mp: shared-memory ring buffers and a drop-in, faster MultiprocessingSampler for UniEnv."""
from ._ring import RingBuffer, Segment
from .errors import CodecError, PeerGoneError, RingClosed, WorkerDiedError, WorkerError

__version__ = "0.1.0"
__all__ = ["RingBuffer", "Segment", "RingClosed", "CodecError", "PeerGoneError",
           "WorkerError", "WorkerDiedError"]
