/*
 * umr_window.c - the row table of a stacked view's batch.
 *
 * UniEnv's SliceStackedBatch (and FrameStackedBatch, its sliding-window case) turns each
 * sampled index into a window of frames at fixed offsets, clipped to the data, marks the
 * frames of another episode invalid, and (fill_invalid_data) replaces each invalid frame
 * by the last valid one on its side of the anchor.  UniEnv does it on the data: it gathers
 * every frame, then the episode column, then computes the mask and gathers the invalid
 * frames' replacements again.  unienv_mp._views does the same arithmetic on the table of
 * indices first, so that each frame is gathered once, from its final row, straight into
 * the slot.  These three loops are that arithmetic; each is a few nanoseconds per frame
 * where the same steps as tensor operations cost microseconds each, per batch.
 *
 * Exactness.  Each function computes exactly what UniEnv's tensor code computes, in the
 * same integer arithmetic:
 *   umr_window       SliceStackedBatch.expand_index: where(idx < 0, idx + n, idx), plus
 *                    the offsets, then clip(., 0, n - 1).
 *   umr_window_mask  UniEnv's two valid-mask helpers: episode ids equal to the anchor's
 *                    (the caller passes ids of an integer or bool type, converted to
 *                    int64, which keeps equality), or the same number of episode ends
 *                    before the frame as before the anchor (cumulative sum, rolled by one,
 *                    of the ends converted as UniEnv converts them).
 *   umr_window_fill  SliceStackedBatch.fill_data_with_stack_mask's time index: before the
 *                    anchor, first_valid = z - (valid frames before z); after it,
 *                    last_valid = z + (valid frames after z); note that these are counts,
 *                    not positions, so a mask with a hole gives what UniEnv gives, not the
 *                    nearest valid frame.
 * umr_window_rows does all three for the commonest view, a stack straight over a
 * ReplayBuffer (or over one of its columns, with the mask read from another), and maps the
 * filled window to storage rows as the buffer does: one call per batch instead of a dozen
 * tensor operations.
 * unienv_mp's tests compare the result with UniEnv's bit for bit over random windows.
 *
 * The windows view (unienv_mp.windows.WindowedBatch) pads as LeRobot pads: a frame outside
 * the anchor's episode (or outside the data) repeats the nearest frame of the episode,
 * and is marked as padding.  Its episode is found once per sampled step, whatever the
 * number of keys and windows: umr_episode_span walks from the step to the first and last
 * step of its episode that any window can reach, and umr_span_rows clamps each key's
 * window to that span.  The view's own get_at (the generic path) computes the same spans
 * with tensor operations; the tests hold the two equal, and both equal to UniEnv's own
 * SliceStackedBatch over each key with the same indices.
 */
#include "umr_window.h"

void umr_window(const int64_t *idx, uint64_t m, const int64_t *off, uint64_t t, int64_t n,
                int64_t *out)
{
    uint64_t i, j;
    /* (the sums wrap around as torch's do, in unsigned arithmetic, where signed overflow
     * would be undefined; gcc converts back to int64 modulo 2^64) */
    for (i = 0; i < m; i++) {
        int64_t x = idx[i] < 0 ? (int64_t)((uint64_t)idx[i] + (uint64_t)n) : idx[i];
        for (j = 0; j < t; j++) {
            int64_t v = (int64_t)((uint64_t)x + (uint64_t)off[j]);
            if (v < 0)
                v = 0;
            if (v > n - 1)
                v = n - 1;
            out[i * t + j] = v;
        }
    }
}

uint64_t umr_window_mask(const int64_t *key, uint64_t m, uint64_t t, uint64_t z, int kind,
                         uint8_t *mask)
{
    uint64_t i, j, invalid = 0;
    for (i = 0; i < m; i++) {
        const int64_t *k = key + i * t;
        uint8_t *row = mask + i * t;
        if (kind == UMR_EPISODE_ID) {
            for (j = 0; j < t; j++) {
                row[j] = k[j] == k[z];
                invalid += !row[j];
            }
        } else {
            /* before[j] = k[0] + ... + k[j-1]; the anchor's first.  (Unsigned: the sums
             * wrap around as torch's cumulative sum does, and compare equal when its do.) */
            uint64_t anchor = 0, before = 0;
            for (j = 0; j < z; j++)
                anchor += (uint64_t)k[j];
            for (j = 0; j < t; j++) {
                row[j] = before == anchor;
                invalid += !row[j];
                before += (uint64_t)k[j];
            }
        }
    }
    return invalid;
}

void umr_window_fill(int64_t *rows, const uint8_t *mask, uint64_t m, uint64_t t,
                     uint64_t z)
{
    uint64_t i, j;
    for (i = 0; i < m; i++) {
        int64_t *r = rows + i * t;
        const uint8_t *v = mask + i * t;
        uint64_t before = 0, after = 0;
        for (j = 0; j < z; j++)
            before += v[j];
        for (j = z + 1; j < t; j++)
            after += v[j];
        if (before == z && after == t - z - 1)
            continue;   /* every frame valid */
        /* both sources are read before anything is written, as UniEnv gathers the
         * replacements from the window before filling it */
        int64_t first = r[z - before], last = r[z + after];
        for (j = 0; j < z; j++)
            if (!v[j])
                r[j] = first;
        for (j = z + 1; j < t; j++)
            if (!v[j])
                r[j] = last;
    }
}

static int64_t key_value(const void *key, int key_type, int ends_bits, int64_t row)
{
    int64_t v;
    switch (key_type) {
    case UMR_KEY_I64: v = ((const int64_t *)key)[row]; break;
    case UMR_KEY_I32: v = ((const int32_t *)key)[row]; break;
    case UMR_KEY_I16: v = ((const int16_t *)key)[row]; break;
    case UMR_KEY_I8: v = ((const int8_t *)key)[row]; break;
    case UMR_KEY_U8: v = ((const uint8_t *)key)[row]; break;
    default: v = ((const uint8_t *)key)[row] != 0; break;   /* bool */
    }
    /* (two's complement truncation, as torch converts int64 to int32) */
    return ends_bits == 32 ? (int64_t)(int32_t)(uint32_t)(uint64_t)v : v;
}

int64_t umr_window_rows(const int64_t *idx, uint64_t m, const int64_t *off, uint64_t t,
                        uint64_t z, int64_t count, int64_t offset, const void *key,
                        uint64_t key_rows, int key_type, int kind, int ends_bits, int fill,
                        int64_t *rows, uint8_t *mask)
{
    uint64_t i, j, invalid = 0;
    int bits = kind == UMR_EPISODE_END ? ends_bits : 64;
    if (count <= 0)
        return -1;
    /* the logical window, then (further down) the storage rows */
    umr_window(idx, m, off, t, count, rows);
    for (i = 0; i < m * t; i++) {
        /* 0 <= rows[i] < count and 0 <= offset: no overflow below 2^63 */
        uint64_t r = (uint64_t)rows[i] + (uint64_t)offset;
        rows[i] = (int64_t)(r >= (uint64_t)count ? r % (uint64_t)count : r);
        if (rows[i] < 0 || (uint64_t)rows[i] >= key_rows)
            return -1;
    }
    if (kind == 0) {
        for (i = 0; i < m * t; i++)
            mask[i] = 1;
        return 0;
    }
    /* umr_window_mask's arithmetic, each frame's key read from its storage row */
    for (i = 0; i < m; i++) {
        const int64_t *r = rows + i * t;
        uint8_t *v = mask + i * t;
        if (kind == UMR_EPISODE_ID) {
            int64_t anchor = key_value(key, key_type, bits, r[z]);
            for (j = 0; j < t; j++) {
                v[j] = key_value(key, key_type, bits, r[j]) == anchor;
                invalid += !v[j];
            }
        } else {
            uint64_t anchor = 0, before = 0;   /* (unsigned: as above) */
            for (j = 0; j < z; j++)
                anchor += (uint64_t)key_value(key, key_type, bits, r[j]);
            for (j = 0; j < t; j++) {
                v[j] = before == anchor;
                invalid += !v[j];
                before += (uint64_t)key_value(key, key_type, bits, r[j]);
            }
        }
    }
    if (fill && invalid)
        umr_window_fill(rows, mask, m, t, z);
    return (int64_t)invalid;
}

/* The storage row of logical step l (0 <= l < count, 0 <= offset): the buffer's own
 * (l + offset) % count, with no overflow below 2^63. */
static int64_t storage_row(int64_t l, int64_t count, int64_t offset)
{
    uint64_t r = (uint64_t)l + (uint64_t)offset;
    return (int64_t)(r >= (uint64_t)count ? r % (uint64_t)count : r);
}

int64_t umr_episode_span(const int64_t *idx, uint64_t m, int64_t back, int64_t fwd,
                         int64_t count, int64_t offset, const void *key, uint64_t key_rows,
                         int key_type, int kind, int64_t *t, int64_t *lo, int64_t *hi)
{
    uint64_t i;
    for (i = 0; i < m; i++) {
        int64_t x = idx[i], a, b, first, last, r, anchor;
        if (x < 0) {
            if (count <= 0 || x < -count)
                return (int64_t)i;
            x += count;
        }
        if (x >= count)
            return (int64_t)i;
        /* the steps any window can reach: [max(0, x - back), min(count - 1, x + fwd)] */
        first = back < x ? x - back : 0;
        last = fwd < count - 1 - x ? x + fwd : count - 1;
        a = b = x;
        if (kind == 0) {
            a = first;
            b = last;
        } else if (kind == UMR_EPISODE_ID) {
            /* a run of equal ids around x: compared with x's own (the same as with each
             * neighbour, as the run is walked outwards from x) */
            r = storage_row(x, count, offset);
            if ((uint64_t)r >= key_rows)
                return UMR_SPAN_NOT_IN_TABLE;
            anchor = key_value(key, key_type, 64, r);
            while (a > first) {
                r = storage_row(a - 1, count, offset);
                if ((uint64_t)r >= key_rows)
                    return UMR_SPAN_NOT_IN_TABLE;
                if (key_value(key, key_type, 64, r) != anchor)
                    break;
                a--;
            }
            while (b < last) {
                r = storage_row(b + 1, count, offset);
                if ((uint64_t)r >= key_rows)
                    return UMR_SPAN_NOT_IN_TABLE;
                if (key_value(key, key_type, 64, r) != anchor)
                    break;
                b++;
            }
        } else {
            /* an end flag at step l ends l's episode: step a - 1 must not end one for a - 1
             * to be in x's episode, and step b must not end one for b + 1 to be */
            while (a > first) {
                r = storage_row(a - 1, count, offset);
                if ((uint64_t)r >= key_rows)
                    return UMR_SPAN_NOT_IN_TABLE;
                if (key_value(key, key_type, 64, r) != 0)
                    break;
                a--;
            }
            while (b < last) {
                r = storage_row(b, count, offset);
                if ((uint64_t)r >= key_rows)
                    return UMR_SPAN_NOT_IN_TABLE;
                if (key_value(key, key_type, 64, r) != 0)
                    break;
                b++;
            }
        }
        t[i] = x;
        lo[i] = a;
        hi[i] = b;
    }
    return UMR_SPAN_OK;
}

void umr_span_rows(const int64_t *t, const int64_t *lo, const int64_t *hi, uint64_t m,
                   const int64_t *off, uint64_t n_off, int64_t count, int64_t offset,
                   int64_t *rows, uint8_t *pad)
{
    uint64_t i, j;
    for (i = 0; i < m; i++) {
        for (j = 0; j < n_off; j++) {
            /* |t| < 2^62 and |off| < 2^62: no overflow */
            int64_t q = t[i] + off[j];
            int64_t c = q < lo[i] ? lo[i] : (q > hi[i] ? hi[i] : q);
            rows[i * n_off + j] = storage_row(c, count, offset);
            if (pad)
                pad[i * n_off + j] = c != q;
        }
    }
}
