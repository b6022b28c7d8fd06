/*
 * umr_pread.c - read the rows a batch samples from a file straight into the batch.
 *
 * A direct gather over a file-backed storage (unienv_mp/_direct/files.py) whose rows lie
 * in the file one after the other (an HDF5 dataset stored contiguously and unfiltered)
 * reads each row from the file into its place in the slot: no intermediate array, no
 * copy out of one.  h5py's own readers cost far more per row: a fancy selection builds a
 * hyperslab per row (about 0.2 ms each), and UniEnv's reader, which coalesces the sorted
 * rows into slices, reads them into an array that is then indexed into batch order (a
 * second copy of the batch) and costs a few tens of microseconds of Python per slice.
 *
 * The reads are sorted by file row and coalesced, as UniEnv's HDF5 storage sorts and
 * coalesces them: rows that follow each other in the file are one preadv whose iovecs
 * point at their places in the batch (which need not follow each other); rows at most
 * gap_bytes apart are one preadv too, the bytes between them read into a scratch buffer
 * (one syscall costs about as much as copying a few KiB from the page cache, so small
 * rows, such as a 7-float state, are read many to a call).  A row that the batch holds
 * twice is read once and copied.
 *
 * What HDF5 would read.  For a contiguous, unfiltered dataset HDF5 reads the bytes of
 * [address, address + rows * row_bytes) of the file (its sec2 driver with pread), and
 * where the file ends before that range does (space allocated but never written), the
 * rest reads as zeros: preadv returning 0 here fills the rest of the call's iovecs with
 * zeros, for the same bytes.
 *
 * Ordering: nothing to argue.  The kernel copies into the destination with ordinary
 * stores, which the release store publishing the slot on its ring (umr_ring.c) orders
 * after them.
 */
#define _GNU_SOURCE
#include "umr_pread.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

/* iovecs per preadv: Linux's UIO_MAXIOV. */
#define IOVS 1024

static int by_row_then_pos(const void *a, const void *b)
{
    const umr_row_pos *x = (const umr_row_pos *)a, *y = (const umr_row_pos *)b;
    if (x->row != y->row)
        return x->row < y->row ? -1 : 1;
    return x->pos < y->pos ? -1 : (x->pos > y->pos);
}

/* preadv the whole of iov[0..cnt) from offset off: short reads are continued, EINTR
 * retried, and the end of the file fills the rest with zeros.  Returns 0 or -errno. */
static int read_all(int fd, struct iovec *iov, int cnt, int64_t off)
{
    int i = 0;
    while (i < cnt) {
        ssize_t got = preadv(fd, iov + i, cnt - i, (off_t)off);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (got == 0) {
            for (; i < cnt; i++)
                memset(iov[i].iov_base, 0, iov[i].iov_len);
            return 0;
        }
        off += got;
        while (i < cnt && (size_t)got >= iov[i].iov_len) {
            got -= (ssize_t)iov[i].iov_len;
            i++;
        }
        if (i < cnt && got > 0) {
            iov[i].iov_base = (unsigned char *)iov[i].iov_base + got;
            iov[i].iov_len -= (size_t)got;
        }
    }
    return 0;
}

int64_t umr_pread_rows(int fd, uint64_t base, uint64_t row_bytes, uint64_t n_rows,
                       const int64_t *rows, uint64_t n, unsigned char *dst,
                       umr_row_pos *pairs, unsigned char *gap, uint64_t gap_bytes)
{
    struct iovec iov[IOVS];
    uint64_t i;
    for (i = 0; i < n; i++) {
        if (rows[i] < 0 || (uint64_t)rows[i] >= n_rows)
            return -1 - (int64_t)i;
        pairs[i].row = rows[i];
        pairs[i].pos = (int64_t)i;
    }
    qsort(pairs, n, sizeof *pairs, by_row_then_pos);

    i = 0;
    while (i < n) {
        int cnt = 0;
        int64_t last = pairs[i].row;
        int64_t start = (int64_t)(base + (uint64_t)last * row_bytes);
        iov[cnt].iov_base = dst + (uint64_t)pairs[i].pos * row_bytes;
        iov[cnt++].iov_len = row_bytes;
        for (i++; i < n; i++) {
            int64_t row = pairs[i].row;
            uint64_t between;
            if (row == last)
                continue;   /* (a row asked for again: copied below) */
            between = (uint64_t)(row - last - 1) * row_bytes;
            if (between > gap_bytes || cnt + (between ? 2 : 1) > IOVS)
                break;
            if (between) {
                iov[cnt].iov_base = gap;
                iov[cnt++].iov_len = between;
            }
            iov[cnt].iov_base = dst + (uint64_t)pairs[i].pos * row_bytes;
            iov[cnt++].iov_len = row_bytes;
            last = row;
        }
        int err = read_all(fd, iov, cnt, start);
        if (err)
            return INT64_MIN - err;   /* (err is -errno: INT64_MIN + errno) */
    }
    for (i = 1; i < n; i++) {
        if (pairs[i].row == pairs[i - 1].row)
            memcpy(dst + (uint64_t)pairs[i].pos * row_bytes,
                   dst + (uint64_t)pairs[i - 1].pos * row_bytes, row_bytes);
    }
    return 0;
}
