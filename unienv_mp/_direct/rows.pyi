"""Row gathering for the direct gather (`unienv_mp._direct.gather`): the rows a batch samples,
copied from a table of rows into a slot, with the GIL released and streaming stores for
large rows (see ``csrc/umr_rows.c`` for why), or read from a file straight into the slot
(``csrc/umr_pread.c``); the row table of a stacked view's batch, its window, valid mask
and fill (`unienv_mp._direct.views`, ``csrc/umr_window.c``); and the windows view's
episode spans and per-key rows (``unienv_mp.windows``)."""
from typing import Any

import numpy as np
import numpy.typing as npt
from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = ["gather_rows", "scatter_rows", "gather_cast_u8", "pread_rows", "PREAD_GAP", "window", "window_mask",
           "window_fill", "window_rows", "episode_span", "span_rows", "EPISODE_ID",
           "EPISODE_END", "KEY_TYPES", "SPAN_LIMIT"]

# (numpy arrays are buffers for type checkers only from Python 3.12: hence the unions)
def gather_rows(table: npt.NDArray[Any] | ReadableBuffer, row_bytes: int,
                rows: npt.NDArray[np.int64] | ReadableBuffer,
                out: npt.NDArray[Any] | WriteableBuffer, offset: int = 0) -> None:
    """Copy row ``rows[i]`` of ``table`` (a contiguous bytes-like object holding whole rows
    of ``row_bytes``) to bytes ``[offset + i * row_bytes, offset + (i + 1) * row_bytes)``
    of the writable buffer ``out``, for every ``i``.  Raises ``IndexError`` (having written
    nothing) if a row is not in the table, ``ValueError`` if ``out`` is too short."""

def scatter_rows(table: npt.NDArray[Any] | ReadableBuffer, row_bytes: int,
                 rows: npt.NDArray[np.int64] | ReadableBuffer,
                 positions: npt.NDArray[np.int64] | ReadableBuffer,
                 out: npt.NDArray[Any] | WriteableBuffer, offset: int, n_out: int) -> None:
    """Copy row ``rows[i]`` of ``table`` (as in `gather_rows`) to row ``positions[i]`` of
    the ``n_out`` rows of ``row_bytes`` that start at byte ``offset`` of the writable buffer
    ``out``, for every ``i``.  Raises ``IndexError`` (having written nothing) if a row is
    not in the table or a position not in ``[0, n_out)``, ``ValueError`` if ``out`` is too
    short or the two index arrays differ in length."""

def gather_cast_u8(table: npt.NDArray[Any] | ReadableBuffer, item_bytes: int, row_items: int,
                   col: int, width: int, rows: npt.NDArray[np.int64] | ReadableBuffer,
                   out: npt.NDArray[Any] | WriteableBuffer, offset: int = 0) -> bool:
    """Cast to uint8 the items ``[col, col + width)`` of row ``rows[i]`` of ``table`` (a
    contiguous bytes-like object of rows of ``row_items`` float32 or float64 items:
    ``item_bytes`` 4 or 8) into bytes ``[offset + i * width, offset + (i + 1) * width)``
    of the writable buffer ``out``, for every ``i``, as C casts (truncation).  Returns True
    when done; False, having written part of ``out``, where an item is NaN or not in
    ``(-1, 256)`` (whose cast C leaves undefined: the caller casts them its own way).
    Raises ``IndexError`` (having written nothing) if a row is not in the table,
    ``ValueError`` on a bad shape or an ``out`` too short."""

#: `pread_rows`'s default: rows at most this many bytes apart in the file are read in one
#: call, the bytes between them read and dropped (a read call costs about as much as
#: copying a few KiB from the page cache).
PREAD_GAP: int

def pread_rows(fd: int, base: int, row_bytes: int, n_rows: int,
               rows: npt.NDArray[np.int64] | ReadableBuffer,
               out: npt.NDArray[Any] | WriteableBuffer, offset: int = 0,
               gap_bytes: int = ...) -> None:
    """Read row ``rows[i]`` of a table of ``n_rows`` rows of ``row_bytes`` that starts at
    byte ``base`` of the open file ``fd`` into bytes ``[offset + i * row_bytes, offset +
    (i + 1) * row_bytes)`` of the writable buffer ``out``, for every ``i``: sorted by row,
    rows at most ``gap_bytes`` apart read in one call, a row asked for twice read once.
    Bytes past the end of the file read as zeros.  Raises ``IndexError`` (having read
    nothing) if a row is not in the table, ``ValueError`` if ``out`` is too short, and
    ``OSError`` if a read fails."""

#: `window_mask`'s kinds: UniEnv's episode-id and episode-end mask helpers.
EPISODE_ID: int
EPISODE_END: int
#: `window_rows`'s episode column types, by numpy dtype name.
KEY_TYPES: dict[str, int]

def window(idx: npt.NDArray[np.int64] | ReadableBuffer,
           offsets: npt.NDArray[np.int64] | ReadableBuffer, n: int,
           out: npt.NDArray[np.int64] | WriteableBuffer) -> None:
    """UniEnv's ``SliceStackedBatch.expand_index`` for ``m = len(idx)`` indices and
    ``t = len(offsets)`` offsets into the ``m * t`` (row-major) ``out``: each index, plus
    ``n`` if negative, plus each offset, clipped to ``[0, n - 1]`` as ``torch.clip``
    clips (so ``n = 0`` gives -1)."""

def window_mask(key: npt.NDArray[np.int64] | ReadableBuffer, t: int, anchor: int, kind: int,
                mask: npt.NDArray[np.uint8] | WriteableBuffer) -> int:
    """The valid mask of a window of ``t`` frames per row (``key``: the episode column
    at every frame, row-major, as int64) into ``mask`` (one byte per frame, 0 or 1):
    kind `EPISODE_ID`, the frames whose id is the anchor's; `EPISODE_END`, the frames with
    as many episode ends before them as before the anchor.  Returns the number of invalid
    frames."""

def window_fill(rows: npt.NDArray[np.int64] | WriteableBuffer,
                mask: npt.NDArray[np.uint8] | ReadableBuffer, t: int, anchor: int) -> None:
    """Fill a window in place as UniEnv's ``fill_data_with_stack_mask`` fills the data:
    each invalid frame before the anchor takes the frame ``anchor - (valid frames before
    it)``, each after it ``anchor + (valid frames after it)``."""

def window_rows(idx: npt.NDArray[np.int64] | ReadableBuffer,
                offsets: npt.NDArray[np.int64] | ReadableBuffer, anchor: int, count: int,
                offset: int, key: npt.NDArray[np.uint8] | ReadableBuffer, key_type: int,
                kind: int, ends_bits: int, fill: bool,
                rows: npt.NDArray[np.int64] | WriteableBuffer,
                mask: npt.NDArray[np.uint8] | WriteableBuffer) -> int:
    """`window`, `window_mask` and `window_fill` for a stack straight over a ReplayBuffer of
    ``count`` rows at ``offset``: the storage rows of the filled window (``(i + offset) %
    count`` of its indices) into ``rows``, its valid mask into ``mask``.  ``key``: the bytes
    of the episode column's storage, one value of ``key_type`` (`KEY_TYPES`) per storage
    row; ``kind`` 0 (no mask), `EPISODE_ID` or `EPISODE_END` (whose values are first
    converted to an integer of ``ends_bits``, 32 or 64, as UniEnv converts them).  Returns
    the number of invalid frames; raises ``IndexError`` if a row is not in the key's
    storage."""

#: The largest step count, window reach and offset `episode_span` and `span_rows` take
#: (their sums stay below 2**63).
SPAN_LIMIT: int

def episode_span(idx: npt.NDArray[np.int64] | ReadableBuffer, back: int, fwd: int,
                 count: int, offset: int, key: npt.NDArray[np.uint8] | ReadableBuffer,
                 key_type: int, kind: int, t: npt.NDArray[np.int64] | WriteableBuffer,
                 lo: npt.NDArray[np.int64] | WriteableBuffer,
                 hi: npt.NDArray[np.int64] | WriteableBuffer) -> None:
    """The episode of each step of ``idx`` (plus ``count`` where negative) in a ReplayBuffer
    of ``count`` rows at ``offset``, as far as windows reaching ``back`` steps before it
    and ``fwd`` after it can see: the step into ``t``, the first and last steps of its
    episode within that reach and within the data into ``lo`` and ``hi``.  ``kind`` 0 (the
    data is one episode), `EPISODE_ID` (an episode is a run of equal ids) or `EPISODE_END`
    (an episode ends at a step whose flag is not zero); ``key``: the bytes of the episode
    column's storage, one value of ``key_type`` (`KEY_TYPES`) per storage row.  Raises
    ``IndexError`` for an index outside ``[-count, count)`` or a row not in the key's
    storage."""

def span_rows(t: npt.NDArray[np.int64] | ReadableBuffer,
              lo: npt.NDArray[np.int64] | ReadableBuffer,
              hi: npt.NDArray[np.int64] | ReadableBuffer,
              offsets: npt.NDArray[np.int64] | ReadableBuffer, count: int, offset: int,
              rows: npt.NDArray[np.int64] | WriteableBuffer,
              pad: npt.NDArray[np.uint8] | WriteableBuffer | None = None) -> None:
    """One key's window over the spans of `episode_span`: for each step ``t[i]`` and each
    offset, the step ``t[i] + offset`` clamped to ``[lo[i], hi[i]]``, as its storage row
    ``(step + offset) % count``, into ``rows`` (row-major, one row per step); and, if
    ``pad`` (a writable buffer of as many bytes) is given, 1 where the clamp moved the step
    (padding), else 0."""
