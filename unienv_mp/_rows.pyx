# cython: language_level=3, boundscheck=False, wraparound=False
"""Row gathering for the direct gather (:mod:`unienv_mp.gather`): the rows a batch samples,
copied from a table of rows into a slot, with the GIL released and streaming stores for
large rows (see ``csrc/umr_rows.c`` for why); and the row table of a stacked view's batch,
its window, valid mask and fill (:mod:`unienv_mp._views`, ``csrc/umr_window.c``)."""
from libc.stdint cimport int64_t, uint64_t, uint8_t
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE,
                             PyBUF_WRITABLE)

__all__ = ["gather_rows", "scatter_rows", "window", "window_mask", "window_fill",
           "EPISODE_ID", "EPISODE_END"]

cdef extern from "umr_rows.h" nogil:
    int64_t umr_gather_rows(const unsigned char *src, uint64_t n_src, uint64_t row_bytes,
                            const int64_t *rows, uint64_t n, unsigned char *dst)
    int64_t umr_scatter_rows(const unsigned char *src, uint64_t n_src, uint64_t row_bytes,
                             const int64_t *rows, const int64_t *pos, uint64_t n,
                             unsigned char *dst, uint64_t n_dst)

cdef extern from "umr_window.h" nogil:
    void umr_window(const int64_t *idx, uint64_t m, const int64_t *off, uint64_t t,
                    int64_t n, int64_t *out)
    uint64_t umr_window_mask(const int64_t *key, uint64_t m, uint64_t t, uint64_t z,
                             int kind, uint8_t *mask)
    void umr_window_fill(int64_t *rows, const uint8_t *mask, uint64_t m, uint64_t t,
                         uint64_t z)
    enum:
        UMR_EPISODE_ID
        UMR_EPISODE_END

#: :func:`window_mask`'s kinds: UniEnv's episode-id and episode-end mask helpers.
EPISODE_ID = UMR_EPISODE_ID
EPISODE_END = UMR_EPISODE_END


def gather_rows(table, Py_ssize_t row_bytes, const int64_t[::1] rows, out,
                Py_ssize_t offset=0):
    """Copy row ``rows[i]`` of ``table`` (a contiguous bytes-like object holding whole rows
    of ``row_bytes``) to bytes ``[offset + i * row_bytes, offset + (i + 1) * row_bytes)``
    of the writable buffer ``out``, for every ``i``.  Raises ``IndexError`` (having written
    nothing) if a row is not in the table, ``ValueError`` if ``out`` is too short."""
    cdef Py_buffer src, dst
    cdef uint64_t n = rows.shape[0], n_src
    cdef int64_t bad
    cdef const int64_t *r = &rows[0] if n else NULL
    if row_bytes <= 0:
        raise ValueError(f"row_bytes must be > 0, got {row_bytes}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    PyObject_GetBuffer(table, &src, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(out, &dst, PyBUF_WRITABLE)
        try:
            if src.len % row_bytes:
                raise ValueError(f"the table's {src.len} bytes are not whole rows of "
                                 f"{row_bytes}")
            if dst.len < offset or n > <uint64_t>(dst.len - offset) // <uint64_t>row_bytes:
                raise ValueError(f"{n} rows of {row_bytes} bytes at offset {offset} do not "
                                 f"fit in {dst.len} bytes")
            n_src = src.len // row_bytes
            with nogil:
                bad = umr_gather_rows(<const unsigned char *>src.buf, n_src, row_bytes, r,
                                      n, <unsigned char *>dst.buf + offset)
            if bad >= 0:
                raise IndexError(f"row {rows[bad]} is out of bounds for a table of "
                                 f"{n_src} rows")
        finally:
            PyBuffer_Release(&dst)
    finally:
        PyBuffer_Release(&src)


def scatter_rows(table, Py_ssize_t row_bytes, const int64_t[::1] rows,
                 const int64_t[::1] positions, out, Py_ssize_t offset, Py_ssize_t n_out):
    """Copy row ``rows[i]`` of ``table`` (as in :func:`gather_rows`) to row
    ``positions[i]`` of the ``n_out`` rows of ``row_bytes`` that start at byte ``offset``
    of the writable buffer ``out``, for every ``i``.  Raises ``IndexError`` (having
    written nothing) if a row is not in the table or a position not in ``[0, n_out)``,
    ``ValueError`` if ``out`` is too short or the two index arrays differ in length."""
    cdef Py_buffer src, dst
    cdef uint64_t n = rows.shape[0], n_src
    cdef int64_t bad
    cdef const int64_t *r = &rows[0] if n else NULL
    cdef const int64_t *p = &positions[0] if positions.shape[0] else NULL
    if row_bytes <= 0:
        raise ValueError(f"row_bytes must be > 0, got {row_bytes}")
    if offset < 0 or n_out < 0:
        raise ValueError(f"offset and n_out must be >= 0, got {offset} and {n_out}")
    if <uint64_t>positions.shape[0] != n:
        raise ValueError(f"{n} rows but {positions.shape[0]} positions")
    PyObject_GetBuffer(table, &src, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(out, &dst, PyBUF_WRITABLE)
        try:
            if src.len % row_bytes:
                raise ValueError(f"the table's {src.len} bytes are not whole rows of "
                                 f"{row_bytes}")
            if dst.len < offset or <uint64_t>n_out > <uint64_t>(dst.len - offset) // <uint64_t>row_bytes:
                raise ValueError(f"{n_out} rows of {row_bytes} bytes at offset {offset} do "
                                 f"not fit in {dst.len} bytes")
            n_src = src.len // row_bytes
            with nogil:
                bad = umr_scatter_rows(<const unsigned char *>src.buf, n_src, row_bytes, r,
                                       p, n, <unsigned char *>dst.buf + offset, n_out)
            if bad >= 0:
                raise IndexError(f"row {rows[bad]} (of a table of {n_src} rows) to position "
                                 f"{positions[bad]} (of {n_out}): out of bounds")
        finally:
            PyBuffer_Release(&dst)
    finally:
        PyBuffer_Release(&src)


def window(const int64_t[::1] idx, const int64_t[::1] offsets, int64_t n, int64_t[::1] out):
    """UniEnv's ``SliceStackedBatch.expand_index`` for ``m = len(idx)`` indices and
    ``t = len(offsets)`` offsets into the ``m * t`` (row-major) ``out``: each index, plus
    ``n`` if negative, plus each offset, clipped to ``[0, n - 1]`` as ``torch.clip``
    clips (so ``n = 0`` gives -1)."""
    cdef uint64_t m = idx.shape[0], t = offsets.shape[0]
    if <uint64_t>out.shape[0] != m * t:
        raise ValueError(f"out holds {out.shape[0]} rows, not {m} x {t}")
    if m == 0 or t == 0:
        return
    with nogil:
        umr_window(&idx[0], m, &offsets[0], t, n, &out[0])


def window_mask(const int64_t[::1] key, Py_ssize_t t, Py_ssize_t anchor, int kind,
                uint8_t[::1] mask):
    """The valid mask of a window of ``t`` frames per row (``key``: the episode column
    at every frame, row-major, as int64) into ``mask`` (one byte per frame, 0 or 1):
    kind :data:`EPISODE_ID`, the frames whose id is the anchor's; :data:`EPISODE_END`, the
    frames with as many episode ends before them as before the anchor.  Returns the
    number of invalid frames."""
    cdef uint64_t n = key.shape[0]
    if t <= 0 or n % <uint64_t>t or not 0 <= anchor < t:
        raise ValueError(f"{n} frames are not rows of {t} with the anchor {anchor} in them")
    if <uint64_t>mask.shape[0] != n:
        raise ValueError(f"mask holds {mask.shape[0]} frames, not {n}")
    if kind != UMR_EPISODE_ID and kind != UMR_EPISODE_END:
        raise ValueError(f"unknown mask kind {kind}")
    if n == 0:
        return 0
    with nogil:
        n = umr_window_mask(&key[0], n // t, t, anchor, kind, &mask[0])
    return n


def window_fill(int64_t[::1] rows, const uint8_t[::1] mask, Py_ssize_t t,
                Py_ssize_t anchor):
    """Fill a window in place as UniEnv's ``fill_data_with_stack_mask`` fills the data:
    each invalid frame before the anchor takes the frame ``anchor - (valid frames before
    it)``, each after it ``anchor + (valid frames after it)``."""
    cdef uint64_t n = rows.shape[0]
    if t <= 0 or n % <uint64_t>t or not 0 <= anchor < t:
        raise ValueError(f"{n} frames are not rows of {t} with the anchor {anchor} in them")
    if <uint64_t>mask.shape[0] != n:
        raise ValueError(f"mask holds {mask.shape[0]} frames, not {n}")
    if n == 0:
        return
    with nogil:
        umr_window_fill(&rows[0], &mask[0], n // t, t, anchor)
