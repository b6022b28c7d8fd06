"""Row gathering for the direct gather (:mod:`unienv_mp.gather`): the rows a batch samples,
copied from a table of rows into a slot, with the GIL released and streaming stores for
large rows (see ``csrc/umr_rows.c`` for why)."""
from typing import Any

import numpy as np
import numpy.typing as npt
from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = ["gather_rows", "scatter_rows"]

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
    """Copy row ``rows[i]`` of ``table`` (as in :func:`gather_rows`) to row
    ``positions[i]`` of the ``n_out`` rows of ``row_bytes`` that start at byte ``offset``
    of the writable buffer ``out``, for every ``i``.  Raises ``IndexError`` (having
    written nothing) if a row is not in the table or a position not in ``[0, n_out)``,
    ``ValueError`` if ``out`` is too short or the two index arrays differ in length."""
