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

/* The three steps above for a stack straight over a buffer, in one pass, with the
 * buffer's mapping of logical indices to storage rows, (i + offset) % count, applied: for
 * m indices and t offsets, the storage rows of the filled window (rows, m x t) and its
 * valid mask (mask, one byte per frame).  The window is clipped to [0, count - 1] (count
 * > 0).  kind 0: no mask (every frame valid); UMR_EPISODE_ID / UMR_EPISODE_END: from the
 * episode column `key`, a table of key_rows storage rows of one value each, of key_type
 * (UMR_KEY_*), converted to int64 (episode ends: first to int32 when ends_bits is 32, as
 * UniEnv converts them to its default integer type).  fill: replace invalid frames as
 * umr_window_fill does.  Returns the number of invalid frames, or -1 (having written
 * nothing usable) if a storage row is not in [0, key_rows). */
enum { UMR_KEY_I64 = 1, UMR_KEY_I32, UMR_KEY_I16, UMR_KEY_I8, UMR_KEY_U8, UMR_KEY_BOOL };
int64_t umr_window_rows(const int64_t *idx, uint64_t m, const int64_t *off, uint64_t t,
                        uint64_t z, int64_t count, int64_t offset, const void *key,
                        uint64_t key_rows, int key_type, int kind, int ends_bits, int fill,
                        int64_t *rows, uint8_t *mask);

/* The windows view (unienv_mp.windows.WindowedBatch): each sampled step t's episode, as
 * the span [lo, hi] of logical indices around it that the view's windows may read, and
 * each key's window clamped to that span.
 *
 * umr_episode_span: for each of the m indices idx[i] (plus count if negative, as UniEnv
 * reads a negative index; each must then be in [0, count)), t[i] = that index, and lo[i]
 * and hi[i] the first and last step of t[i]'s episode within [t - back, t + fwd] and
 * within the data [0, count - 1].  kind 0: every step is one episode; UMR_EPISODE_ID:
 * an episode is a run of consecutive steps whose ids (`key`) equal t's; UMR_EPISODE_END:
 * an episode ends at a step whose end flag (`key`) is not zero.  The episode column is
 * read at storage row (l + offset) % count of step l: a table of key_rows values of
 * key_type (UMR_KEY_*).  Returns -1 when every index is in range and every row read is
 * in the table; else the position i of the first index out of range, or -2 for a row
 * not in the table.  (0 <= back, fwd < 2^62.) */
enum { UMR_SPAN_OK = -1, UMR_SPAN_NOT_IN_TABLE = -2 };
int64_t umr_episode_span(const int64_t *idx, uint64_t m, int64_t back, int64_t fwd,
                         int64_t count, int64_t offset, const void *key, uint64_t key_rows,
                         int key_type, int kind, int64_t *t, int64_t *lo, int64_t *hi);

/* One key's window over the spans: for each i and each of the n_off offsets, q = t[i] +
 * off[j] clamped to [lo[i], hi[i]], as the storage row (q + offset) % count, into
 * rows[i * n_off + j]; pad[i * n_off + j] (unless pad is NULL) = 1 where the clamp moved
 * q (a step outside the episode or the data: padding), else 0.  Every lo <= t <= hi must
 * lie in [0, count), and |off[j]| < 2^62. */
void umr_span_rows(const int64_t *t, const int64_t *lo, const int64_t *hi, uint64_t m,
                   const int64_t *off, uint64_t n_off, int64_t count, int64_t offset,
                   int64_t *rows, uint8_t *pad);

#ifdef __cplusplus
}
#endif

#endif
