# cython: language_level=3, boundscheck=False, wraparound=False
"""Row gathering for the direct gather (:mod:`unienv_mp.gather`): the rows a batch samples,
copied from a table of rows into a slot, with the GIL released and streaming stores for
large rows (see ``csrc/umr_rows.c`` for why)."""
from libc.stdint cimport int64_t, uint64_t
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE,
                             PyBUF_WRITABLE)

__all__ = ["gather_rows"]

cdef extern from "umr_rows.h" nogil:
    int64_t umr_gather_rows(const unsigned char *src, uint64_t n_src, uint64_t row_bytes,
                            const int64_t *rows, uint64_t n, unsigned char *dst)


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
