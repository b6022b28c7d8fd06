# cython: language_level=3, boundscheck=False, wraparound=False
"""Row gathering for the direct gather (`unienv_mp._direct.gather`): the rows a batch samples,
copied from a table of rows into a slot, with the GIL released and streaming stores for
large rows (see ``csrc/umr_rows.c`` for why), or read from a file straight into the slot
(``csrc/umr_pread.c``); the row table of a stacked view's batch, its window, valid mask
and fill (`unienv_mp._direct.views`, ``csrc/umr_window.c``); and the windows view's
episode spans and per-key rows (``unienv_mp.windows``)."""
from libc.stdint cimport int64_t, uint64_t, uint8_t, INT64_MIN, INT64_MAX
from libc.stdlib cimport malloc, free
import os

from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE,
                             PyBUF_WRITABLE)

__all__ = ["gather_rows", "scatter_rows", "gather_cast_u8", "pread_rows", "PREAD_GAP", "window", "window_mask",
           "window_fill", "window_rows", "episode_span", "span_rows", "EPISODE_ID",
           "EPISODE_END", "KEY_TYPES", "SPAN_LIMIT"]

cdef extern from "umr_rows.h" nogil:
    int64_t umr_gather_rows(const unsigned char *src, uint64_t n_src, uint64_t row_bytes,
                            const int64_t *rows, uint64_t n, unsigned char *dst)
    int64_t umr_scatter_rows(const unsigned char *src, uint64_t n_src, uint64_t row_bytes,
                             const int64_t *rows, const int64_t *pos, uint64_t n,
                             unsigned char *dst, uint64_t n_dst)
    int64_t umr_gather_cast_u8(const unsigned char *src, int src_type, uint64_t n_src,
                               uint64_t row_items, uint64_t col, uint64_t width,
                               const int64_t *rows, uint64_t n, uint8_t *dst)
    enum:
        UMR_CAST_OUT_OF_RANGE

cdef extern from "umr_pread.h" nogil:
    ctypedef struct umr_row_pos:
        int64_t row
        int64_t pos
    int64_t umr_pread_rows(int fd, uint64_t base, uint64_t row_bytes, uint64_t n_rows,
                           const int64_t *rows, uint64_t n, unsigned char *dst,
                           umr_row_pos *pairs, unsigned char *gap, uint64_t gap_bytes)

cdef extern from "umr_window.h" nogil:
    void umr_window(const int64_t *idx, uint64_t m, const int64_t *off, uint64_t t,
                    int64_t n, int64_t *out)
    uint64_t umr_window_mask(const int64_t *key, uint64_t m, uint64_t t, uint64_t z,
                             int kind, uint8_t *mask)
    void umr_window_fill(int64_t *rows, const uint8_t *mask, uint64_t m, uint64_t t,
                         uint64_t z)
    int64_t umr_window_rows(const int64_t *idx, uint64_t m, const int64_t *off, uint64_t t,
                            uint64_t z, int64_t count, int64_t offset, const void *key,
                            uint64_t key_rows, int key_type, int kind, int ends_bits,
                            int fill, int64_t *rows, uint8_t *mask)
    int64_t umr_episode_span(const int64_t *idx, uint64_t m, int64_t back, int64_t fwd,
                             int64_t count, int64_t offset, const void *key,
                             uint64_t key_rows, int key_type, int kind, int64_t *t,
                             int64_t *lo, int64_t *hi)
    void umr_span_rows(const int64_t *t, const int64_t *lo, const int64_t *hi, uint64_t m,
                       const int64_t *off, uint64_t n_off, int64_t count, int64_t offset,
                       int64_t *rows, uint8_t *pad)
    enum:
        UMR_SPAN_OK
        UMR_SPAN_NOT_IN_TABLE
        UMR_EPISODE_ID
        UMR_EPISODE_END
        UMR_KEY_I64
        UMR_KEY_I32
        UMR_KEY_I16
        UMR_KEY_I8
        UMR_KEY_U8
        UMR_KEY_BOOL

#: `window_mask`'s kinds: UniEnv's episode-id and episode-end mask helpers.
EPISODE_ID = UMR_EPISODE_ID
EPISODE_END = UMR_EPISODE_END
#: `window_rows`'s episode column types, by numpy dtype name.
KEY_TYPES = {"int64": UMR_KEY_I64, "int32": UMR_KEY_I32, "int16": UMR_KEY_I16,
             "int8": UMR_KEY_I8, "uint8": UMR_KEY_U8, "bool": UMR_KEY_BOOL}
_KEY_SIZES = {UMR_KEY_I64: 8, UMR_KEY_I32: 4, UMR_KEY_I16: 2, UMR_KEY_I8: 1,
              UMR_KEY_U8: 1, UMR_KEY_BOOL: 1}


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
    """Copy row ``rows[i]`` of ``table`` (as in `gather_rows`) to row ``positions[i]`` of
    the ``n_out`` rows of ``row_bytes`` that start at byte ``offset`` of the writable buffer
    ``out``, for every ``i``.  Raises ``IndexError`` (having written nothing) if a row is
    not in the table or a position not in ``[0, n_out)``, ``ValueError`` if ``out`` is too
    short or the two index arrays differ in length."""
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


def gather_cast_u8(table, Py_ssize_t item_bytes, Py_ssize_t row_items, Py_ssize_t col,
                   Py_ssize_t width, const int64_t[::1] rows, out, Py_ssize_t offset=0):
    """Cast to uint8 the items ``[col, col + width)`` of row ``rows[i]`` of ``table`` (a
    contiguous bytes-like object of rows of ``row_items`` float32 or float64 items:
    ``item_bytes`` 4 or 8) into bytes ``[offset + i * width, offset + (i + 1) * width)``
    of the writable buffer ``out``, for every ``i``, as C casts (truncation).  Returns True
    when done; False, having written part of ``out``, where an item is NaN or not in
    ``(-1, 256)`` (whose cast C leaves undefined: the caller casts them its own way).
    Raises ``IndexError`` (having written nothing) if a row is not in the table,
    ``ValueError`` on a bad shape or an ``out`` too short."""
    cdef Py_buffer src, dst
    cdef uint64_t n = rows.shape[0], n_src
    cdef int64_t res
    cdef const int64_t *r = &rows[0] if n else NULL
    if item_bytes != 4 and item_bytes != 8:
        raise ValueError(f"item_bytes must be 4 or 8, got {item_bytes}")
    if row_items <= 0 or width < 0 or col < 0 or col + width > row_items:
        raise ValueError(f"items [{col}, {col + width}) are not in rows of {row_items}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    PyObject_GetBuffer(table, &src, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(out, &dst, PyBUF_WRITABLE)
        try:
            if src.len % (row_items * item_bytes):
                raise ValueError(f"the table's {src.len} bytes are not whole rows of "
                                 f"{row_items} items of {item_bytes} bytes")
            if dst.len < offset or (width and
                                    n > <uint64_t>(dst.len - offset) // <uint64_t>width):
                raise ValueError(f"{n} rows of {width} bytes at offset {offset} do not "
                                 f"fit in {dst.len} bytes")
            n_src = src.len // (row_items * item_bytes)
            if width == 0:
                n = 0
            with nogil:
                res = umr_gather_cast_u8(<const unsigned char *>src.buf, item_bytes, n_src,
                                         row_items, col, width, r, n,
                                         <uint8_t *>dst.buf + offset)
            if res >= 0:
                raise IndexError(f"row {rows[res]} is out of bounds for a table of "
                                 f"{n_src} rows")
            return res != UMR_CAST_OUT_OF_RANGE
        finally:
            PyBuffer_Release(&dst)
    finally:
        PyBuffer_Release(&src)


#: `pread_rows`'s default: rows at most this many bytes apart in the file are read in one
#: call, the bytes between them read and dropped (a read call costs about as much as
#: copying a few KiB from the page cache).
PREAD_GAP = 16384


def pread_rows(int fd, Py_ssize_t base, Py_ssize_t row_bytes, Py_ssize_t n_rows,
               const int64_t[::1] rows, out, Py_ssize_t offset=0,
               Py_ssize_t gap_bytes=PREAD_GAP):
    """Read row ``rows[i]`` of a table of ``n_rows`` rows of ``row_bytes`` that starts at
    byte ``base`` of the open file ``fd`` into bytes ``[offset + i * row_bytes, offset +
    (i + 1) * row_bytes)`` of the writable buffer ``out``, for every ``i``: sorted by row,
    rows at most ``gap_bytes`` apart read in one call, a row asked for twice read once.
    Bytes past the end of the file read as zeros.  Raises ``IndexError`` (having read
    nothing) if a row is not in the table, ``ValueError`` if ``out`` is too short, and
    ``OSError`` if a read fails."""
    cdef Py_buffer dst
    cdef uint64_t n = rows.shape[0]
    cdef int64_t res
    cdef const int64_t *r = &rows[0] if n else NULL
    cdef umr_row_pos *pairs = NULL
    cdef unsigned char *gap = NULL
    if row_bytes <= 0 or base < 0 or n_rows < 0 or offset < 0 or gap_bytes < 0:
        raise ValueError(f"row_bytes must be > 0 and base, n_rows, offset and gap_bytes "
                         f">= 0, got {row_bytes}, {base}, {n_rows}, {offset}, {gap_bytes}")
    if n_rows and <uint64_t>n_rows > <uint64_t>(INT64_MAX - base) // <uint64_t>row_bytes:
        raise ValueError(f"{n_rows} rows of {row_bytes} bytes from byte {base} do not fit "
                         f"in a file")
    if fd < 0:
        raise ValueError(f"not a file descriptor: {fd}")
    PyObject_GetBuffer(out, &dst, PyBUF_WRITABLE)
    try:
        if dst.len < offset or n > <uint64_t>(dst.len - offset) // <uint64_t>row_bytes:
            raise ValueError(f"{n} rows of {row_bytes} bytes at offset {offset} do not "
                             f"fit in {dst.len} bytes")
        if n == 0:
            return
        pairs = <umr_row_pos *>malloc(n * sizeof(umr_row_pos))
        gap = <unsigned char *>malloc(gap_bytes if gap_bytes else 1)
        if pairs == NULL or gap == NULL:
            raise MemoryError()
        with nogil:
            res = umr_pread_rows(fd, base, row_bytes, n_rows, r, n,
                                 <unsigned char *>dst.buf + offset, pairs, gap, gap_bytes)
        if res == 0:
            return
        if res > INT64_MIN + 65536 and res < 0 and -1 - res < <int64_t>n:
            raise IndexError(f"row {rows[-1 - res]} is out of bounds for a table of "
                             f"{n_rows} rows")
        err = <int>(res - INT64_MIN)
        raise OSError(err, f"reading rows of a file: {os.strerror(err)}")
    finally:
        free(pairs)
        free(gap)
        PyBuffer_Release(&dst)


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
    kind `EPISODE_ID`, the frames whose id is the anchor's; `EPISODE_END`, the frames with
    as many episode ends before them as before the anchor.  Returns the number of invalid
    frames."""
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


def window_rows(const int64_t[::1] idx, const int64_t[::1] offsets, Py_ssize_t anchor,
                int64_t count, int64_t offset, const unsigned char[::1] key, int key_type,
                int kind, int ends_bits, bint fill, int64_t[::1] rows, uint8_t[::1] mask):
    """`window`, `window_mask` and `window_fill` for a stack straight over a ReplayBuffer of
    ``count`` rows at ``offset``: the storage rows of the filled window (``(i + offset) %
    count`` of its indices) into ``rows``, its valid mask into ``mask``.  ``key``: the bytes
    of the episode column's storage, one value of ``key_type`` (`KEY_TYPES`) per storage
    row; ``kind`` 0 (no mask), `EPISODE_ID` or `EPISODE_END` (whose values are first
    converted to an integer of ``ends_bits``, 32 or 64, as UniEnv converts them).  Returns
    the number of invalid frames; raises ``IndexError`` if a row is not in the key's
    storage."""
    cdef uint64_t m = idx.shape[0], t = offsets.shape[0], key_rows
    cdef int64_t out
    cdef const void *k = NULL
    if t == 0 or not 0 <= anchor < <Py_ssize_t>t:
        raise ValueError(f"the anchor {anchor} is not one of {t} offsets")
    if <uint64_t>rows.shape[0] != m * t or <uint64_t>mask.shape[0] != m * t:
        raise ValueError(f"rows and mask hold {rows.shape[0]} and {mask.shape[0]} frames, "
                         f"not {m} x {t}")
    if count <= 0 or offset < 0:
        raise ValueError(f"a buffer of {count} rows at offset {offset}")
    if kind != 0 and kind != UMR_EPISODE_ID and kind != UMR_EPISODE_END:
        raise ValueError(f"unknown mask kind {kind}")
    if ends_bits != 32 and ends_bits != 64:
        raise ValueError(f"ends_bits must be 32 or 64, not {ends_bits}")
    size = _KEY_SIZES.get(key_type)
    if size is None:
        raise ValueError(f"unknown key type {key_type}")
    key_rows = key.shape[0] // <uint64_t>size
    if key_rows:
        k = &key[0]
    if m == 0:
        return 0
    with nogil:
        out = umr_window_rows(&idx[0], m, &offsets[0], t, anchor, count, offset, k,
                              key_rows if kind else <uint64_t>count, key_type, kind,
                              ends_bits, fill, &rows[0], &mask[0])
    if out < 0:
        raise IndexError(f"a window row is not in the episode column's {key_rows} rows")
    return out


#: The largest step count, window reach and offset `episode_span` and `span_rows` take
#: (their sums stay below 2**63).
SPAN_LIMIT = 2 ** 62


def episode_span(const int64_t[::1] idx, int64_t back, int64_t fwd, int64_t count,
                 int64_t offset, const unsigned char[::1] key, int key_type, int kind,
                 int64_t[::1] t, int64_t[::1] lo, int64_t[::1] hi):
    """The episode of each step of ``idx`` (plus ``count`` where negative) in a ReplayBuffer
    of ``count`` rows at ``offset``, as far as windows reaching ``back`` steps before it
    and ``fwd`` after it can see: the step into ``t``, the first and last steps of its
    episode within that reach and within the data into ``lo`` and ``hi``.  ``kind`` 0 (the
    data is one episode), `EPISODE_ID` (an episode is a run of equal ids) or `EPISODE_END`
    (an episode ends at a step whose flag is not zero); ``key``: the bytes of the episode
    column's storage, one value of ``key_type`` (`KEY_TYPES`) per storage row.  Raises
    ``IndexError`` for an index outside ``[-count, count)`` or a row not in the key's
    storage."""
    cdef uint64_t m = idx.shape[0], key_rows = 0
    cdef int64_t out
    cdef const void *k = NULL
    if <uint64_t>t.shape[0] != m or <uint64_t>lo.shape[0] != m or <uint64_t>hi.shape[0] != m:
        raise ValueError(f"t, lo and hi hold {t.shape[0]}, {lo.shape[0]} and {hi.shape[0]} "
                         f"steps, not {m}")
    if not (0 <= back < SPAN_LIMIT and 0 <= fwd < SPAN_LIMIT and 0 <= count < SPAN_LIMIT
            and 0 <= offset < SPAN_LIMIT):
        raise ValueError(f"a reach of {back} and {fwd} steps over {count} rows at offset "
                         f"{offset}")
    if kind != 0 and kind != UMR_EPISODE_ID and kind != UMR_EPISODE_END:
        raise ValueError(f"unknown episode kind {kind}")
    if kind != 0:
        size = _KEY_SIZES.get(key_type)
        if size is None:
            raise ValueError(f"unknown key type {key_type}")
        key_rows = key.shape[0] // <uint64_t>size
        if key_rows:
            k = &key[0]
    if m == 0:
        return
    with nogil:
        out = umr_episode_span(&idx[0], m, back, fwd, count, offset, k, key_rows, key_type,
                               kind, &t[0], &lo[0], &hi[0])
    if out == UMR_SPAN_NOT_IN_TABLE:
        raise IndexError(f"a step's row is not in the episode column's {key_rows} rows")
    if out != UMR_SPAN_OK:
        raise IndexError(f"index {idx[out]} is out of range for {count} steps")


def span_rows(const int64_t[::1] t, const int64_t[::1] lo, const int64_t[::1] hi,
              const int64_t[::1] offsets, int64_t count, int64_t offset, int64_t[::1] rows,
              pad=None):
    """One key's window over the spans of `episode_span`: for each step ``t[i]`` and each
    offset, the step ``t[i] + offset`` clamped to ``[lo[i], hi[i]]``, as its storage row
    ``(step + offset) % count``, into ``rows`` (row-major, one row per step); and, if
    ``pad`` (a writable buffer of as many bytes) is given, 1 where the clamp moved the step
    (padding), else 0."""
    cdef uint64_t m = t.shape[0], n = offsets.shape[0], i
    cdef uint8_t[::1] p
    cdef uint8_t *pp = NULL
    if <uint64_t>lo.shape[0] != m or <uint64_t>hi.shape[0] != m:
        raise ValueError(f"lo and hi hold {lo.shape[0]} and {hi.shape[0]} steps, not {m}")
    if <uint64_t>rows.shape[0] != m * n:
        raise ValueError(f"rows holds {rows.shape[0]} frames, not {m} x {n}")
    if not (0 < count < SPAN_LIMIT and 0 <= offset < SPAN_LIMIT):
        raise ValueError(f"a buffer of {count} rows at offset {offset}")
    for i in range(m):
        if not (0 <= lo[i] <= t[i] <= hi[i] < count):
            raise ValueError(f"step {t[i]} and its span [{lo[i]}, {hi[i]}] are not in "
                             f"[0, {count})")
    for i in range(n):
        if not -SPAN_LIMIT < offsets[i] < SPAN_LIMIT:
            raise ValueError(f"offset {offsets[i]} is out of range")
    if pad is not None:
        p = pad
        if <uint64_t>p.shape[0] != m * n:
            raise ValueError(f"pad holds {p.shape[0]} frames, not {m} x {n}")
        if m * n:
            pp = &p[0]
    if m == 0 or n == 0:
        return
    with nogil:
        umr_span_rows(&t[0], &lo[0], &hi[0], m, &offsets[0], n, count, offset, &rows[0], pp)
