"""Slot codec: a pytree of numpy arrays / torch tensors written straight into a slot, and
read back as views of it.

Slot format, version 1 (all integers little-endian):

    0   u32 magic 'UMPC'        4  u16 version      6  u16 flags (0)
    8   u64 total_len           bytes of the slot this encoding uses
    16  u32 meta_len            bytes of the tree description that starts at 64
    20  u32 n_arrays            24  u32 n_objects    28  u32 reserved
    32  u64 blob_off            40  u64 blob_len     (pickled list of non-array leaves)
    48  16 reserved bytes
    64  meta                    the tree description (grammar below)
    ..  blob, then each array's data, every one at a 64-byte aligned offset

Tree description, one token per node:

    'N'                                     None
    'D' u32 n  { u32 len, utf-8 key, node } a dict (str keys, order kept)
    'L' u32 n  node*                        a list
    'T' u32 n  node*                        a tuple
    'M' u32 len, "module:qualname", u32 n, node*   a namedtuple
    'A' u8 kind, u8 dtype, u8 ndim, u64 shape[ndim], u64 offset, u64 nbytes
                                            an array (kind 0: numpy, 1: torch)
    'O' u32 index                           the index-th object of the pickled blob

The description holds shapes and offsets but no data, so a stream of same-shaped batches
repeats the same description byte for byte: the decoder keys its cache of parsed plans on
those bytes and, on a hit, only makes the views.  Everything read from a slot is checked
against the slot's bounds before use; a slot that is not a valid encoding raises
`CodecError`.  (The blob is unpickled: like ``multiprocessing``, the codec trusts the
processes it shares memory with not to send hostile pickles.)
"""
from collections.abc import Callable
from typing import Any, Final

from _typeshed import ReadableBuffer, WriteableBuffer
from typing_extensions import Self, disjoint_base

__all__ = ["MAGIC", "VERSION", "HEADER_SIZE", "ALIGN", "Prepared", "prepare", "encode",
           "decode", "encode_prepared", "write", "write_frame", "SlotLease", "clear_plan_cache",
           "plan_cache_size"]

MAGIC: Final[int]
VERSION: Final[int]
HEADER_SIZE: Final[int]
ALIGN: Final[int]

@disjoint_base
class Prepared:
    """An object walked and laid out, ready to be written into a slot of ``nbytes``."""

    @property
    def nbytes(self) -> int: ...
    def array_layout(self) -> list[tuple[Any, int, int]]:
        """``[(leaf, offset, nbytes)]`` for every array leaf, in encoding order: where
        `write` copies each leaf, and where `write_frame` leaves room for it (``leaf`` is
        the object given to `prepare`)."""

def prepare(obj: object) -> Prepared:
    """Walk ``obj`` and lay out its encoding; returns a `Prepared` whose ``nbytes`` says how
    large a slot must be.  Raises `CodecError` for tensors that are not on the CPU, and
    whatever pickling raises for an unpicklable non-array leaf."""

def write(p: Prepared, buffer: WriteableBuffer) -> int:
    """Write a prepared encoding at the start of the writable ``buffer`` (at least
    ``p.nbytes`` bytes long: a slot, a ``bytearray``, a ``memoryview``...)."""

def write_frame(p: Prepared, buffer: WriteableBuffer) -> int:
    """Write everything of a prepared encoding but its array data: the header, the tree
    description and the pickled leaves.  The caller fills each array's bytes itself, at
    the offsets of `Prepared.array_layout` (e.g. gathering rows straight into the slot);
    until it has, the encoding decodes to whatever those bytes hold."""

def encode_prepared(p: Prepared) -> bytearray:
    """Write a prepared encoding into a new ``bytearray`` of ``p.nbytes``."""

def encode(obj: object) -> bytearray:
    """Encode ``obj`` into a new ``bytearray`` (convenience; slots use prepare + write)."""

@disjoint_base
class SlotLease:
    """Keeps ``length`` bytes at ``offset`` of ``source`` (a Segment, or any object with the
    buffer protocol) alive and exposes them through the buffer protocol.

    Decoded arrays hold the lease as their ``base``; when the last of them is garbage
    collected the lease is freed, releases its hold on ``source`` and calls
    ``on_release(token)``: that is how a slot goes back to its free list only once nothing
    can see it any more.
    """

    def __new__(cls, source: ReadableBuffer, offset: int = 0, length: int | None = None,
                on_release: Callable[[Any], object] | None = None,
                token: object = None) -> Self: ...
    @property
    def length(self) -> int: ...
    @property
    def readonly(self) -> bool: ...
    @property
    def token(self) -> Any: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

def decode(buffer: ReadableBuffer, copy: bool = False, share_readonly: bool = False) -> Any:
    """Decode the encoding at the start of ``buffer`` (a `SlotLease`, or any bytes-like
    object).

    With ``copy=False`` every array of the result is a view of ``buffer`` and holds it (its
    ``base``, through ``torch.from_numpy`` for tensors): a lease is released only when the
    last view is gone.  With ``copy=True`` the arrays own their memory and nothing refers to
    ``buffer`` afterwards.  Raises `CodecError` when the bytes are not a valid encoding;
    never reads outside ``buffer``.

    A read-only ``buffer`` gives read-only numpy arrays, and torch tensors copied out of it
    (torch has no read-only tensors); with ``share_readonly=True`` the tensors are views of
    it all the same, and the caller must never write into them.
    """

def clear_plan_cache() -> None:
    """Forget every cached decode plan."""

def plan_cache_size() -> int:
    """Number of decode plans cached (one per distinct tree description)."""
