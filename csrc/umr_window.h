/*
 * umr_window.h - the row table of a stacked view's batch (see umr_window.c).
 * Knows nothing of Python.
 */
#ifndef UMR_WINDOW_H
#define UMR_WINDOW_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* out[i * t + j] = clip(x + off[j], 0, n - 1) where x = idx[i] + n if idx[i] < 0, else
 * idx[i]; clip(v, lo, hi) = min(max(v, lo), hi), as torch.clip computes it (so n = 0
 * gives -1 everywhere). */
void umr_window(const int64_t *idx, uint64_t m, const int64_t *off, uint64_t t, int64_t n,
                int64_t *out);

/* The valid mask of an m x t window from its episode column `key` (m x t, row-major):
 * kind UMR_EPISODE_ID: mask[i][j] = key[i][j] == key[i][z];
 * kind UMR_EPISODE_END: mask[i][j] = before[i][j] == before[i][z], where before[i][j] is
 * the sum of key[i][0..j) (the episode ends before frame j).
 * Returns the number of invalid frames. */
enum { UMR_EPISODE_ID = 1, UMR_EPISODE_END = 2 };
uint64_t umr_window_mask(const int64_t *key, uint64_t m, uint64_t t, uint64_t z, int kind,
                         uint8_t *mask);

/* The filled window: rows[i][j] = rows[i][k] with k = j for a valid frame; for an
 * invalid frame before the anchor z, k = z - (valid frames before z); after it,
 * k = z + (valid frames after z).  In place. */
void umr_window_fill(int64_t *rows, const uint8_t *mask, uint64_t m, uint64_t t,
                     uint64_t z);

#ifdef __cplusplus
}
#endif

#endif
