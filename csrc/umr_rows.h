/*
 * umr_rows.h - gather rows of a table into a contiguous destination (see umr_rows.c).
 * Knows nothing of Python.
 */
#ifndef UMR_ROWS_H
#define UMR_ROWS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Copy rows[0..n) of the table src (n_src rows of row_bytes each) to dst, one after the
 * other: dst[i] = src[rows[i]].  Returns -1 when done, or, when rows[i] is not in
 * [0, n_src), the first such i, having written nothing.  Large rows are written with
 * streaming stores, fenced before returning. */
int64_t umr_gather_rows(const unsigned char *src, uint64_t n_src, uint64_t row_bytes,
                        const int64_t *rows, uint64_t n, unsigned char *dst);

/* The same with a destination position per row: dst[pos[i]] = src[rows[i]], for a dst of
 * n_dst rows (pos NULL: dst[i], as umr_gather_rows).  Returns -1 when done, or the first i
 * whose row is not in [0, n_src) or whose position is not in [0, n_dst), having written
 * nothing. */
int64_t umr_scatter_rows(const unsigned char *src, uint64_t n_src, uint64_t row_bytes,
                         const int64_t *rows, const int64_t *pos, uint64_t n,
                         unsigned char *dst, uint64_t n_dst);

/* Copy n bytes from src to dst, which do not overlap, as a row of umr_gather_rows would
 * be: with streaming stores, fenced before returning, when dst is 16-byte aligned and n
 * is at least UMR_STREAM_MIN_COPY; with memcpy otherwise.  For a destination that another
 * process reads next (a slot of shared memory), not this core. */
#define UMR_STREAM_MIN_COPY 65536
void umr_copy_stream(unsigned char *dst, const unsigned char *src, uint64_t n);

/* Cast to uint8 columns [col, col + width) of rows[0..n) of the table src (n_src rows of
 * row_items items of src_type each, UMR_CAST_F32 or UMR_CAST_F64), one row after the
 * other: dst[i * width + j] = (uint8_t)src[rows[i]][col + j].  Returns -1 when done; when
 * rows[i] is not in [0, n_src), the first such i, having written nothing; and
 * UMR_CAST_OUT_OF_RANGE, having written part of dst, when it meets a value whose cast C
 * does not define (NaN, or not in (-1, 256)).  Large rows are written with streaming
 * stores, fenced before returning, whatever it returns.  The caller checks that
 * col + width <= row_items. */
#define UMR_CAST_F32 4
#define UMR_CAST_F64 8
#define UMR_CAST_OUT_OF_RANGE (-2)
int64_t umr_gather_cast_u8(const unsigned char *src, int src_type, uint64_t n_src,
                           uint64_t row_items, uint64_t col, uint64_t width,
                           const int64_t *rows, uint64_t n, uint8_t *dst);

#ifdef __cplusplus
}
#endif

#endif
