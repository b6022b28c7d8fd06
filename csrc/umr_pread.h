/*
 * umr_pread.h - read rows of a file straight into their places in a batch (see
 * umr_pread.c).  Knows nothing of Python.
 */
#ifndef UMR_PREAD_H
#define UMR_PREAD_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One batch row to read: file row `row` into batch position `pos`. */
typedef struct {
    int64_t row;
    int64_t pos;
} umr_row_pos;

/* Read rows[i] of a table of n_rows rows of row_bytes that starts at byte `base` of the
 * file `fd` into dst + i * row_bytes, for every i < n.  The reads are sorted by row and
 * coalesced: rows that follow each other in the file, or lie at most gap_bytes apart
 * (the bytes between them read into `gap`, a scratch buffer of gap_bytes), are one
 * preadv.  A row asked for twice is read once and copied.  Bytes past the end of the file
 * read as zeros (as HDF5's sec2 driver reads them).  `pairs` is scratch of n entries.
 *
 * Returns 0 when done; -1 - i when rows[i] is not in [0, n_rows), having read nothing;
 * or INT64_MIN + errno when a read failed (dst then holds what was read so far). */
int64_t umr_pread_rows(int fd, uint64_t base, uint64_t row_bytes, uint64_t n_rows,
                       const int64_t *rows, uint64_t n, unsigned char *dst,
                       umr_row_pos *pairs, unsigned char *gap, uint64_t gap_bytes);

#ifdef __cplusplus
}
#endif

#endif
