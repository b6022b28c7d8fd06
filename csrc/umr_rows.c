/*
 * umr_rows.c - gather rows of a table into a contiguous destination.
 *
 * This is the inner loop of a direct gather (unienv_mp/gather.py): a worker copies the
 * rows a batch samples, at random from a replay buffer of up to gigabytes, into a slot of
 * shared memory that the training process reads next.  It is torch.index_select's loop
 * for contiguous rows, with one difference that matters here: large rows are written with
 * streaming (non-temporal) stores.
 *
 * Why streaming stores.  A worker writes each batch into one of several slots that it
 * cycles through (batches in flight need distinct memory), so a slot's lines are no longer
 * in any cache when it is written again.  An ordinary store to such a line first reads it
 * from memory (read-for-ownership), then writes it back later: three memory transfers per
 * byte of batch (source read, destination read, destination write-back).  A streaming store
 * writes whole lines through write-combining buffers without reading them: two transfers.
 * Measured on the project's 2-core machine, 256 rows of 48 KiB into 9 rotating 12.6 MB
 * slots: 2.3-2.8 ms per batch with memcpy, 1.5 ms with streaming stores.  Nobody reads the
 * slot from this core's cache afterwards (the consumer is another process, usually on
 * another core), so nothing is lost by bypassing it.  Small rows are copied with memcpy:
 * below a few cache lines, partial lines and the fence cost more than they save.
 *
 * Ordering.  Streaming stores are weakly ordered: x86's total store order does not cover
 * them, so the release store that later publishes the slot on a ring (umr_ring.c) would
 * not be enough to make them visible first.  umr_gather_rows therefore ends with an
 * sfence, after which every streaming store is globally visible before any later store
 * (in particular the ring's publishing store).
 *
 * umr_copy_stream is one such row: the slot codec's copy of a large array into a slot (a
 * ShmQueue's message, a generic batch), for the same reason.  Only large copies: a
 * message of a few pages may still be in this core's cache when its slot comes round
 * again, and then an ordinary store costs less.
 *
 * umr_scatter_rows is the same copy with a destination position per row: dst[pos[i]] =
 * src[rows[i]].  A batch of a combined dataset (UniEnv's CombinedBatch) takes each of its
 * rows from one of several tables; each table's rows go to the positions of the batch that
 * belong to it.
 */
#include "umr_rows.h"

#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#define UMR_HAVE_STREAM 1
#else
#define UMR_HAVE_STREAM 0
#endif

/* Rows at least this long are streamed (when the destination row is 16-byte aligned). */
#define STREAM_MIN_ROW 1024

#if UMR_HAVE_STREAM
static void stream_row(unsigned char *d, const unsigned char *s, uint64_t n)
{
    uint64_t k = 0;
    /* d is 16-byte aligned (checked by the caller); s may not be: unaligned loads. */
    for (; k + 64 <= n; k += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + k));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + k + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + k + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + k + 48));
        _mm_stream_si128((__m128i *)(d + k), a);
        _mm_stream_si128((__m128i *)(d + k + 16), b);
        _mm_stream_si128((__m128i *)(d + k + 32), c);
        _mm_stream_si128((__m128i *)(d + k + 48), e);
    }
    if (k < n)
        memcpy(d + k, s + k, n - k);
}
#endif

int64_t umr_gather_rows(const unsigned char *src, uint64_t n_src, uint64_t row_bytes,
                        const int64_t *rows, uint64_t n, unsigned char *dst)
{
    return umr_scatter_rows(src, n_src, row_bytes, rows, NULL, n, dst, n);
}

int64_t umr_scatter_rows(const unsigned char *src, uint64_t n_src, uint64_t row_bytes,
                         const int64_t *rows, const int64_t *pos, uint64_t n,
                         unsigned char *dst, uint64_t n_dst)
{
    uint64_t i;
    /* Every index is checked before anything is written: a bad index writes nothing.
     * (pos NULL: row i goes to position i, umr_gather_rows.) */
    for (i = 0; i < n; i++)
        if (rows[i] < 0 || (uint64_t)rows[i] >= n_src
                || (pos != NULL && (pos[i] < 0 || (uint64_t)pos[i] >= n_dst)))
            return (int64_t)i;
    if (row_bytes == 0)
        return -1;
#define DST(i) (dst + (pos != NULL ? (uint64_t)pos[i] : (i)) * row_bytes)
#if UMR_HAVE_STREAM
    if (row_bytes >= STREAM_MIN_ROW && ((uintptr_t)dst & 15) == 0 && (row_bytes & 15) == 0) {
        for (i = 0; i < n; i++)
            stream_row(DST(i), src + (uint64_t)rows[i] * row_bytes, row_bytes);
        _mm_sfence();   /* see "Ordering" above */
        return -1;
    }
#endif
    for (i = 0; i < n; i++)
        memcpy(DST(i), src + (uint64_t)rows[i] * row_bytes, row_bytes);
#undef DST
    return -1;
}

void umr_copy_stream(unsigned char *dst, const unsigned char *src, uint64_t n)
{
#if UMR_HAVE_STREAM
    if (n >= UMR_STREAM_MIN_COPY && ((uintptr_t)dst & 15) == 0) {
        stream_row(dst, src, n);   /* (its tail, past the last 64 bytes, by memcpy) */
        _mm_sfence();              /* see "Ordering" above */
        return;
    }
#endif
    memcpy(dst, src, n);
}

/*
 * umr_gather_cast_u8: a flattened storage's uint8 leaf (UniEnv's FlattenedStorage keeps
 * every key of a step in one row of the promoted dtype: an image of uint8 beside float32
 * keys is stored as float32).  UniEnv gathers whole rows, then casts the image's columns
 * to uint8; torch's cast runs at about 2 G items/s on one core, more than the gather
 * itself for a row that is mostly image.  This gathers and casts each row in one pass,
 * 16 items at a time (truncating conversion, then saturating packs that saturate nothing
 * in range), and writes a quarter (an eighth from float64) of the bytes that a gather of
 * the whole rows writes.
 *
 * Exactness.  Where C defines the cast (a value in (-1, 256): truncation toward zero),
 * every correct implementation gives the same byte, torch's included.  Elsewhere (NaN,
 * out of range) C leaves it undefined and torch's answer depends on its code path, so
 * this stops (UMR_CAST_OUT_OF_RANGE) and the caller casts the leaf as UniEnv does.
 */
#define CAST_OK(v) ((v) > -1.0 && (v) < 256.0)   /* false for NaN */

#if UMR_HAVE_STREAM
/* 16 items of the row at s (unaligned) as 16 bytes; clears *ok's lanes out of range. */
static inline __m128i cast16_f32(const float *s, __m128 *ok)
{
    const __m128 lo = _mm_set1_ps(-1.0f), hi = _mm_set1_ps(256.0f);
    __m128 a = _mm_loadu_ps(s), b = _mm_loadu_ps(s + 4);
    __m128 c = _mm_loadu_ps(s + 8), d = _mm_loadu_ps(s + 12);
    __m128 m = _mm_and_ps(_mm_and_ps(_mm_cmpgt_ps(a, lo), _mm_cmplt_ps(a, hi)),
                          _mm_and_ps(_mm_cmpgt_ps(b, lo), _mm_cmplt_ps(b, hi)));
    m = _mm_and_ps(m, _mm_and_ps(_mm_cmpgt_ps(c, lo), _mm_cmplt_ps(c, hi)));
    m = _mm_and_ps(m, _mm_and_ps(_mm_cmpgt_ps(d, lo), _mm_cmplt_ps(d, hi)));
    *ok = _mm_and_ps(*ok, m);
    __m128i ab = _mm_packs_epi32(_mm_cvttps_epi32(a), _mm_cvttps_epi32(b));
    __m128i cd = _mm_packs_epi32(_mm_cvttps_epi32(c), _mm_cvttps_epi32(d));
    return _mm_packus_epi16(ab, cd);
}

static inline __m128i cast4_f64(const double *s, __m128d *ok)
{
    const __m128d lo = _mm_set1_pd(-1.0), hi = _mm_set1_pd(256.0);
    __m128d a = _mm_loadu_pd(s), b = _mm_loadu_pd(s + 2);
    __m128d m = _mm_and_pd(_mm_and_pd(_mm_cmpgt_pd(a, lo), _mm_cmplt_pd(a, hi)),
                           _mm_and_pd(_mm_cmpgt_pd(b, lo), _mm_cmplt_pd(b, hi)));
    *ok = _mm_and_pd(*ok, m);
    return _mm_unpacklo_epi64(_mm_cvttpd_epi32(a), _mm_cvttpd_epi32(b));
}

static inline __m128i cast16_f64(const double *s, __m128d *ok)
{
    __m128i a = cast4_f64(s, ok), b = cast4_f64(s + 4, ok);
    __m128i c = cast4_f64(s + 8, ok), d = cast4_f64(s + 12, ok);
    return _mm_packus_epi16(_mm_packs_epi32(a, b), _mm_packs_epi32(c, d));
}
#endif

/* One row: width items at s to d; 0 if every item was in range. */
static int cast_row(const unsigned char *s, int src_type, uint64_t width, uint8_t *d,
                    int stream)
{
    uint64_t k = 0;
#if UMR_HAVE_STREAM
    if (src_type == UMR_CAST_F32) {
        __m128 ok = _mm_castsi128_ps(_mm_set1_epi32(-1));
        for (; k + 16 <= width; k += 16) {
            __m128i v = cast16_f32((const float *)s + k, &ok);
            if (stream)
                _mm_stream_si128((__m128i *)(d + k), v);
            else
                _mm_storeu_si128((__m128i *)(d + k), v);
        }
        if (_mm_movemask_ps(ok) != 0xF)
            return -1;
    } else {
        __m128d ok = _mm_castsi128_pd(_mm_set1_epi32(-1));
        for (; k + 16 <= width; k += 16) {
            __m128i v = cast16_f64((const double *)s + k, &ok);
            if (stream)
                _mm_stream_si128((__m128i *)(d + k), v);
            else
                _mm_storeu_si128((__m128i *)(d + k), v);
        }
        if (_mm_movemask_pd(ok) != 0x3)
            return -1;
    }
#else
    (void)stream;
#endif
    for (; k < width; k++) {
        double v = src_type == UMR_CAST_F32 ? (double)((const float *)s)[k]
                                            : ((const double *)s)[k];
        if (!CAST_OK(v))
            return -1;
        d[k] = (uint8_t)(int32_t)v;   /* (a float's value is exact as a double) */
    }
    return 0;
}

int64_t umr_gather_cast_u8(const unsigned char *src, int src_type, uint64_t n_src,
                           uint64_t row_items, uint64_t col, uint64_t width,
                           const int64_t *rows, uint64_t n, uint8_t *dst)
{
    uint64_t i, row_bytes = row_items * (uint64_t)src_type;
    int64_t res = -1;
    for (i = 0; i < n; i++)
        if (rows[i] < 0 || (uint64_t)rows[i] >= n_src)
            return (int64_t)i;
    /* (streaming as umr_gather_rows streams, for rows of at least STREAM_MIN_ROW bytes) */
    int stream = width >= STREAM_MIN_ROW && ((uintptr_t)dst & 15) == 0 && (width & 15) == 0;
    for (i = 0; i < n; i++)
        if (cast_row(src + (uint64_t)rows[i] * row_bytes + col * (uint64_t)src_type,
                     src_type, width, dst + i * width, stream) != 0) {
            res = UMR_CAST_OUT_OF_RANGE;
            break;
        }
#if UMR_HAVE_STREAM
    if (stream)
        _mm_sfence();   /* see "Ordering" above: also before the caller's own cast */
#endif
    return res;
}
