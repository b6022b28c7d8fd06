/*
 * umr_ring.c - bounded MPMC ring in shared memory, futex events, blocking waits.
 *
 * Shared layout (all offsets from the start of the ring's memory, 64-byte lines):
 *
 *   line 0   magic, version, entry_size, capacity, stride, footprint
 *            (written once by init, read-only afterwards)
 *   line 1   head: count of positions ever claimed by producers; its top bit is the
 *            "shut down" mark (so that shutting down and claiming are one atomic order)
 *   line 2   tail: count of positions ever claimed by consumers
 *   line 3   not_empty event: consumers sleep here, producers notify
 *   line 4   not_full event: producers sleep here, consumers notify
 *   line 5+  `capacity` cells of `stride` bytes: { seq (u64), len (u32), pad, data[] }
 *
 * head and tail are 64-bit and never wrap in practice (2^64 entries), the cell of position p
 * is p % capacity.  Producers and consumers each write only their own counter line, so the
 * two sides never share a written cache line except through the cells themselves.
 *
 * Cell protocol (Vyukov's bounded MPMC queue, with the sequence doubled so that a ring of
 * one cell is unambiguous).  For the position p that maps to a cell:
 *   seq == 2p             the cell is free for the producer of position p
 *   seq == 2p + 1         the producer of p has published its entry
 *   seq == 2(p + cap)     the consumer of p is done with it: free for position p + cap
 * (With Vyukov's original p / p + 1 / p + cap, "published for p" and "free for p + 1"
 * coincide when cap == 1.)
 * A producer never reads `tail` and a consumer never reads `head` on the fast path: the
 * cell's own seq says whether the other side is done with it (the role that rigtorp's and
 * folly's SPSC queues give to a cached copy of the other index).
 */
#define _GNU_SOURCE
#include "umr.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define UMR_LINE 64
#define UMR_MAGIC 0x31474e49524d4e55ULL /* "UNMRING1" little-endian */
#define UMR_VERSION 2u
#define UMR_MARK (1ULL << 63) /* in head: the ring was shut down */
#define UMR_CELL_HDR 16u
#define UMR_MAX_CAPACITY (1ULL << 32)
#define UMR_MAX_ENTRY (1u << 30)

struct umr_event {
    /* The futex word.  Bit 0: "someone may be asleep here", set by every waiter before it
     * re-checks its condition; bits 1..31: a counter bumped (and bit 0 cleared) by every
     * notify that finds bit 0 set.  A flag rather than a count of waiters, so that a waiter
     * killed while asleep costs one spurious wake-up, not a syscall on every operation. */
    _Atomic uint32_t word;
    char pad[UMR_LINE - 4];
};

struct umr_ring_hdr {
    uint64_t magic;
    uint32_t version;
    uint32_t entry_size;
    uint64_t capacity;
    uint64_t stride;
    uint64_t footprint;
    uint64_t reserved;
    char pad0[UMR_LINE - 48];
    _Atomic uint64_t head;
    char pad1[UMR_LINE - 8];
    _Atomic uint64_t tail;
    char pad2[UMR_LINE - 8];
    struct umr_event not_empty;
    struct umr_event not_full;
};

typedef struct {
    _Atomic uint64_t seq;
    uint32_t len;
    uint32_t reserved;
    unsigned char data[];
} umr_cell_t;

_Static_assert(sizeof(struct umr_event) == UMR_LINE, "event must fill one cache line");
_Static_assert(sizeof(struct umr_ring_hdr) == 5 * UMR_LINE, "ring header is five lines");
_Static_assert(sizeof(umr_cell_t) == UMR_CELL_HDR, "cell header is 16 bytes");
_Static_assert(sizeof(_Atomic uint64_t) == 8 && sizeof(_Atomic uint32_t) == 4,
               "atomics must have the size of their plain types: the layout is shared");

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

/* The seq_cst fence of the wake-up argument below. */
static inline void full_fence(void) { atomic_thread_fence(memory_order_seq_cst); }

int64_t umr_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline umr_cell_t *cell_at(const umr_ring_t *r, uint64_t pos) {
    return (umr_cell_t *)(r->cells + (size_t)(pos % r->capacity) * r->stride);
}

/* ------------------------------------------------------------------------------------ */
/* Events                                                                               */
/*                                                                                      */
/* Why no wake-up is lost.  A waiter W runs, until cond() holds,                        */
/*     s = fetch_or(&word, 1) | 1 ; fence Y ; if (cond()) break ; futex_wait(&word, s)  */
/* and a notifier N, after making cond() true with a store A (release), runs            */
/*     fence X ; w = word ; while (w & 1) if CAS(&word, w, (w + 2) & ~1) { wake all }   */
/* X and Y are seq_cst fences, so one precedes the other in the single total order S    */
/* (C11 [atomics.fences]: for A sequenced before X, X before Y in S, and a load B        */
/* sequenced after Y, B observes A or a later value).                                   */
/*  - X before Y: W's cond(), after Y, observes A and W does not sleep.                 */
/*  - Y before X: N's load of the word, after X, observes W's fetch_or or a later value. */
/*    If bit 0 is set there, N's CAS bumps the word and N wakes every sleeper; if a      */
/*    later value has bit 0 clear, another notifier bumped the word after W registered.  */
/*    Either way the word no longer equals W's `s`: the kernel compares it under the     */
/*    futex bucket lock, so W's futex_wait returns at once, or W is already queued and   */
/*    the wake-all that follows the bump finds it.  W then loops: re-registers, re-checks.*/
/* A notifier whose CAS loses to another notifier's clearing bump does not wake anyone:  */
/* by the same argument applied to the waiters that re-register after that wake-all,    */
/* either they observe its store, or its CAS reads their fresh bit 0 and it wakes them.  */
/* cond() may read several locations (cells, counters): any "not ready" it observes      */
/* means the store that would make it ready comes with a notify whose fence follows Y.   */
/* The counter wraps at 2^31; a waiter that misses exactly 2^31 bumps between its        */
/* registration and its sleep would oversleep until its poll deadline, no further.       */
/* ------------------------------------------------------------------------------------ */

static long sys_futex(_Atomic uint32_t *uaddr, int op, uint32_t val,
                      const struct timespec *timeout) {
    /* Shared (not FUTEX_PRIVATE) so that waiters and wakers in different processes that
     * map the same page meet: the kernel keys shared futexes by the page, not the address. */
    return syscall(SYS_futex, (uint32_t *)uaddr, op, val, timeout, NULL, 0);
}

void umr_event_init(umr_event_t *ev) {
    memset(ev, 0, sizeof(*ev));
}

void umr_event_notify(umr_event_t *ev) {
    full_fence(); /* fence X of the argument above */
    uint32_t w = atomic_load_explicit(&ev->word, memory_order_relaxed);
    while (w & 1u) {
        /* release: a waiter that reads the bumped word (acquire, in its fetch_or) also
         * sees the store that made its condition true. */
        if (atomic_compare_exchange_weak_explicit(&ev->word, &w, (w + 2u) & ~1u,
                                                  memory_order_release,
                                                  memory_order_relaxed)) {
            sys_futex(&ev->word, FUTEX_WAKE, INT_MAX, NULL);
            return;
        }
    }
}

void umr_event_notify_all(umr_event_t *ev) {
    atomic_fetch_add_explicit(&ev->word, 2u, memory_order_seq_cst);
    sys_futex(&ev->word, FUTEX_WAKE, INT_MAX, NULL);
}

uint32_t umr_event_prepare(umr_event_t *ev) {
    uint32_t seen = atomic_fetch_or_explicit(&ev->word, 1u, memory_order_acq_rel) | 1u;
    full_fence(); /* fence Y of the argument above */
    return seen;
}

int umr_event_wait(umr_event_t *ev, uint32_t seen, int64_t deadline_ns) {
    struct timespec ts, *tsp = NULL;
    if (deadline_ns != UMR_NO_DEADLINE) {
        int64_t left = deadline_ns - umr_now_ns();
        if (left <= 0)
            return UMR_TIMEOUT;
        ts.tv_sec = (time_t)(left / 1000000000LL);
        ts.tv_nsec = (long)(left % 1000000000LL);
        tsp = &ts;
    }
    /* FUTEX_WAIT's timeout is relative and measured on CLOCK_MONOTONIC. */
    if (sys_futex(&ev->word, FUTEX_WAIT, seen, tsp) == 0)
        return UMR_OK;
    switch (errno) {
    case EINTR:
        return UMR_INTR;
    case ETIMEDOUT:
        return UMR_TIMEOUT;
    case EAGAIN: /* the word changed before we slept */
        return UMR_OK;
    default: /* ENOSYS, EPERM (seccomp), EFAULT: sleeping is impossible; say so */
        return UMR_SYSERR;
    }
}

/* ------------------------------------------------------------------------------------ */
/* Ring geometry                                                                        */
/* ------------------------------------------------------------------------------------ */

static uint64_t stride_for(uint32_t entry_size) {
    /* Whole cache lines per cell: a producer filling cell i + 1 never invalidates the line
     * a consumer is reading cell i from (false sharing halves streaming throughput). */
    return ((uint64_t)UMR_CELL_HDR + entry_size + UMR_LINE - 1) & ~(uint64_t)(UMR_LINE - 1);
}

size_t umr_ring_footprint(uint64_t capacity, uint32_t entry_size) {
    if (capacity == 0 || capacity > UMR_MAX_CAPACITY || entry_size == 0 ||
        entry_size > UMR_MAX_ENTRY)
        return 0;
    uint64_t stride = stride_for(entry_size);
    if (capacity > (SIZE_MAX - sizeof(struct umr_ring_hdr) - UMR_LINE) / stride)
        return 0;
    uint64_t total = sizeof(struct umr_ring_hdr) + capacity * stride;
    return (size_t)((total + UMR_LINE - 1) & ~(uint64_t)(UMR_LINE - 1));
}

static void fill_handle(umr_ring_t *r, void *mem, uint64_t capacity, uint32_t entry_size,
                        uint64_t stride) {
    r->hdr = (umr_ring_hdr_t *)mem;
    r->cells = (unsigned char *)mem + sizeof(struct umr_ring_hdr);
    r->capacity = capacity;
    r->entry_size = entry_size;
    r->stride = (uint32_t)stride;
}

int umr_ring_init(umr_ring_t *r, void *mem, size_t mem_size, uint64_t capacity,
                  uint32_t entry_size) {
    size_t need = umr_ring_footprint(capacity, entry_size);
    if (need == 0 || mem == NULL || mem_size < need || ((uintptr_t)mem % UMR_LINE) != 0)
        return UMR_BADARG;
    struct umr_ring_hdr *h = (struct umr_ring_hdr *)mem;
    memset(h, 0, sizeof(*h));
    h->magic = UMR_MAGIC;
    h->version = UMR_VERSION;
    h->entry_size = entry_size;
    h->capacity = capacity;
    h->stride = stride_for(entry_size);
    h->footprint = need;
    fill_handle(r, mem, capacity, entry_size, h->stride);
    for (uint64_t i = 0; i < capacity; i++) {
        umr_cell_t *c = cell_at(r, i);
        c->len = 0;
        c->reserved = 0;
        atomic_init(&c->seq, 2 * i);
    }
    umr_event_init(&h->not_empty);
    umr_event_init(&h->not_full);
    atomic_init(&h->tail, 0);
    /* Another process only starts using the ring after it learns of it through some
     * synchronizing channel (process start, a pipe, another ring), which orders these
     * initialising stores before its first access. */
    atomic_store_explicit(&h->head, 0, memory_order_release);
    return UMR_OK;
}

int umr_ring_attach(umr_ring_t *r, void *mem, size_t mem_size) {
    if (mem == NULL || ((uintptr_t)mem % UMR_LINE) != 0 ||
        mem_size < sizeof(struct umr_ring_hdr))
        return UMR_CORRUPT;
    const struct umr_ring_hdr *h = (const struct umr_ring_hdr *)mem;
    uint64_t capacity = h->capacity, stride = h->stride;
    uint32_t entry_size = h->entry_size;
    if (h->magic != UMR_MAGIC || h->version != UMR_VERSION)
        return UMR_CORRUPT;
    size_t need = umr_ring_footprint(capacity, entry_size);
    if (need == 0 || stride != stride_for(entry_size) || h->footprint != need ||
        need > mem_size)
        return UMR_CORRUPT;
    fill_handle(r, mem, capacity, entry_size, stride);
    return UMR_OK;
}

uint64_t umr_ring_count(const umr_ring_t *r) {
    /* Positions claimed by producers and not yet by consumers.  A snapshot of two
     * counters read one after the other: clamped to [0, capacity]. */
    uint64_t tail = atomic_load_explicit(&r->hdr->tail, memory_order_acquire);
    uint64_t head = atomic_load_explicit(&r->hdr->head, memory_order_acquire) & ~UMR_MARK;
    int64_t n = (int64_t)(head - tail);
    if (n < 0)
        return 0;
    return (uint64_t)n > r->capacity ? r->capacity : (uint64_t)n;
}

int umr_ring_is_closed(const umr_ring_t *r) {
    return (atomic_load_explicit(&r->hdr->head, memory_order_acquire) & UMR_MARK) != 0;
}

void umr_ring_shutdown(umr_ring_t *r) {
    /* The mark goes into head itself: a producer's claim is a CAS on head, so every claim
     * is ordered either before the mark (and its entry will be published and can be
     * popped) or after it (and fails with UMR_CLOSED).  A consumer reports UMR_CLOSED only
     * when it has popped every position claimed before the mark (see pop_empty): no entry
     * whose push succeeded is ever stranded.  Sleepers are woken to re-check. */
    atomic_fetch_or_explicit(&r->hdr->head, UMR_MARK, memory_order_seq_cst);
    umr_event_notify_all(&r->hdr->not_empty);
    umr_event_notify_all(&r->hdr->not_full);
}

/* ------------------------------------------------------------------------------------ */
/* Claims.  A producer claims `k` consecutive positions from `pos` by moving head from    */
/* pos to pos + k with one CAS, after checking that each of their cells is free for this */
/* lap (seq == 2 * position).  No other producer can claim a position >= pos while head  */
/* == pos, so a cell checked free stays free until the CAS; head only grows, so the CAS  */
/* has no ABA.  Consumers do the same on tail with "published" (seq == 2 * position + 1).*/
/* ------------------------------------------------------------------------------------ */

/* Returns the number claimed (>= 1), 0 when the first cell is not ready, UMR_CLOSED when
 * a producer finds the ring shut down, UMR_CORRUPT when the cells contradict the counter. */
static int64_t claim(umr_ring_t *r, _Atomic uint64_t *counter, uint64_t want, uint64_t ready,
                     uint64_t *start) {
    uint64_t pos = atomic_load_explicit(counter, memory_order_relaxed);
    if (want > r->capacity)
        want = r->capacity;
    for (;;) {
        if (pos & UMR_MARK)
            return UMR_CLOSED; /* only head carries the mark */
        uint64_t k = 0;
        int64_t dif = 0;
        while (k < want) {
            /* acquire: pairs with the release store that made the cell ready (a consumer's
             * free for producers, a producer's publish for consumers), so what that side
             * did to the cell's bytes happens-before what we do to them next. */
            uint64_t seq =
                atomic_load_explicit(&cell_at(r, pos + k)->seq, memory_order_acquire);
            dif = (int64_t)(seq - (2 * (pos + k) + ready));
            if (dif != 0)
                break;
            k++;
        }
        if (k > 0) {
            /* relaxed: ownership of the cells comes from the acquire loads above; the CAS
             * only decides which claimer gets them (and fails if shutdown marked head). */
            if (atomic_compare_exchange_weak_explicit(counter, &pos, pos + k,
                                                      memory_order_relaxed,
                                                      memory_order_relaxed)) {
                *start = pos;
                return (int64_t)k;
            }
            continue; /* pos was reloaded by the failed CAS */
        }
        uint64_t now = atomic_load_explicit(counter, memory_order_relaxed);
        if (dif < 0) {
            /* The first cell still belongs to the previous lap (producers) or has not been
             * published yet (consumers): full / empty, unless our pos is stale. */
            if (now == pos)
                return 0;
        } else if (now == pos) {
            /* The cell is ahead of the counter, yet the counter has not moved: whoever took
             * the cell moved the counter before its (release) store that we read with
             * acquire, so a consistent ring cannot get here.  A peer scribbled on it. */
            return UMR_CORRUPT;
        }
        pos = now;
    }
}

static inline void publish(umr_ring_t *r, uint64_t pos, const void *data, uint32_t len) {
    umr_cell_t *c = cell_at(r, pos);
    memcpy(c->data, data, len);
    c->len = len;
    /* release: the payload written above happens-before the consumer's acquire load that
     * sees 2 pos + 1 (in claim()). */
    atomic_store_explicit(&c->seq, 2 * pos + 1, memory_order_release);
}

static inline uint32_t consume(umr_ring_t *r, uint64_t pos, void *out) {
    umr_cell_t *c = cell_at(r, pos);
    /* one load: a length that a peer scribbles on cannot change between check and use */
    uint32_t len = __atomic_load_n(&c->len, __ATOMIC_RELAXED);
    if (len > r->entry_size) /* only a peer scribbling on the ring can cause this */
        len = r->entry_size;
    memcpy(out, c->data, len);
    /* release: our reads of the payload happen-before the acquire load by which the
     * producer of position pos + capacity finds the cell free, so it cannot overwrite
     * bytes we are still reading. */
    atomic_store_explicit(&c->seq, 2 * (pos + r->capacity), memory_order_release);
    return len;
}

int umr_ring_try_push(umr_ring_t *r, const void *data, uint32_t len) {
    if (len > r->entry_size)
        return UMR_TOOBIG;
    uint64_t pos;
    int64_t k = claim(r, &r->hdr->head, 1, 0, &pos);
    if (k <= 0)
        return k == 0 ? UMR_FULL : (int)k;
    publish(r, pos, data, len);
    umr_event_notify(&r->hdr->not_empty);
    return UMR_OK;
}

int64_t umr_ring_try_push_many(umr_ring_t *r, const void *const *datas, const uint32_t *lens,
                               uint64_t n) {
    for (uint64_t i = 0; i < n; i++)
        if (lens[i] > r->entry_size)
            return UMR_TOOBIG;
    if (n == 0)
        return umr_ring_is_closed(r) ? UMR_CLOSED : 0;
    uint64_t pos;
    int64_t k = claim(r, &r->hdr->head, n, 0, &pos);
    if (k <= 0)
        return k;
    for (int64_t i = 0; i < k; i++)
        publish(r, pos + (uint64_t)i, datas[i], lens[i]);
    umr_event_notify(&r->hdr->not_empty);
    return k;
}

/* Nothing to pop: UMR_CLOSED if the ring is shut down and every position claimed before
 * the mark has been claimed by a consumer too, else UMR_EMPTY.  While a producer that
 * claimed before the mark has not published yet, consumers keep waiting for it (a
 * producer that died there is noticed by the caller's liveness check). */
static int pop_empty(umr_ring_t *r) {
    uint64_t head = atomic_load_explicit(&r->hdr->head, memory_order_acquire);
    if (!(head & UMR_MARK))
        return UMR_EMPTY;
    uint64_t tail = atomic_load_explicit(&r->hdr->tail, memory_order_acquire);
    return tail == (head & ~UMR_MARK) ? UMR_CLOSED : UMR_EMPTY;
}

int umr_ring_try_pop(umr_ring_t *r, void *out, uint32_t out_cap, uint32_t *len) {
    if (out_cap < r->entry_size)
        return UMR_BADARG;
    uint64_t pos;
    int64_t k = claim(r, &r->hdr->tail, 1, 1, &pos);
    if (k < 0)
        return (int)k;
    if (k == 0)
        return pop_empty(r);
    *len = consume(r, pos, out);
    umr_event_notify(&r->hdr->not_full);
    return UMR_OK;
}

int64_t umr_ring_try_pop_many(umr_ring_t *r, void *out, size_t out_stride, uint32_t *lens,
                              uint64_t n) {
    if (out_stride < r->entry_size)
        return UMR_BADARG;
    if (n == 0)
        return 0;
    uint64_t pos;
    int64_t k = claim(r, &r->hdr->tail, n, 1, &pos);
    if (k < 0)
        return k;
    if (k == 0)
        return pop_empty(r) == UMR_CLOSED ? UMR_CLOSED : 0;
    for (int64_t i = 0; i < k; i++)
        lens[i] = consume(r, pos + (uint64_t)i, (unsigned char *)out + (size_t)i * out_stride);
    umr_event_notify(&r->hdr->not_full);
    return k;
}

/* ------------------------------------------------------------------------------------ */
/* Blocking: spin, then sleep on an event until the attempt succeeds.                    */
/* ------------------------------------------------------------------------------------ */

typedef struct {
    umr_ring_t *r;
    const void *data; /* push */
    void *out;        /* pop */
    size_t out_stride;
    uint32_t len;
    uint32_t *lens;
    uint64_t n;
    int many;
} attempt_t;

/* > 0 or UMR_OK: done; UMR_FULL / UMR_EMPTY: not yet; other < 0: error to return. */
static int64_t attempt_push(attempt_t *a) { return umr_ring_try_push(a->r, a->data, a->len); }

static int64_t attempt_pop(attempt_t *a) {
    if (a->many) {
        int64_t k = umr_ring_try_pop_many(a->r, a->out, a->out_stride, a->lens, a->n);
        return k == 0 ? UMR_EMPTY : k;
    }
    return umr_ring_try_pop(a->r, a->out, (uint32_t)a->out_stride, a->lens);
}

static int64_t wait_for(int64_t (*attempt)(attempt_t *), attempt_t *a, umr_event_t *ev,
                        int64_t not_yet, int64_t deadline_ns, int64_t poll_ns,
                        int64_t spin_ns) {
    int64_t rc = attempt(a);
    if (rc != not_yet)
        return rc;
    int64_t now = umr_now_ns();
    if (deadline_ns != UMR_NO_DEADLINE && now >= deadline_ns)
        return UMR_TIMEOUT;
    if (spin_ns > 0) {
        /* The peer is usually a few hundred nanoseconds away from making progress: polling
         * the cell costs far less than a futex sleep and wake (two context switches). */
        int64_t spin_end = now + spin_ns;
        if (deadline_ns != UMR_NO_DEADLINE && spin_end > deadline_ns)
            spin_end = deadline_ns;
        for (unsigned i = 1;; i++) {
            cpu_relax();
            rc = attempt(a);
            if (rc != not_yet)
                return rc;
            if ((i & 63u) == 0 && umr_now_ns() >= spin_end)
                break;
        }
        now = umr_now_ns();
    }
    int64_t poll_end = poll_ns > 0 ? now + poll_ns : UMR_NO_DEADLINE;
    int64_t wake_at = deadline_ns;
    if (poll_end != UMR_NO_DEADLINE && (wake_at == UMR_NO_DEADLINE || poll_end < wake_at))
        wake_at = poll_end;

    for (;;) {
        /* register (sets bit 0 of the word), fence, then re-check: see the proof above */
        uint32_t seen = umr_event_prepare(ev);
        rc = attempt(a);
        if (rc != not_yet)
            break;
        now = umr_now_ns();
        if (deadline_ns != UMR_NO_DEADLINE && now >= deadline_ns) {
            rc = UMR_TIMEOUT;
            break;
        }
        if (poll_end != UMR_NO_DEADLINE && now >= poll_end) {
            rc = UMR_POLL;
            break;
        }
        int w = umr_event_wait(ev, seen, wake_at);
        if (w == UMR_INTR || w == UMR_SYSERR) {
            rc = w;
            break;
        }
    }
    return rc;
}

int umr_ring_push_wait(umr_ring_t *r, const void *data, uint32_t len, int64_t deadline_ns,
                       int64_t poll_ns, int64_t spin_ns) {
    if (len > r->entry_size)
        return UMR_TOOBIG;
    attempt_t a = {.r = r, .data = data, .len = len};
    return (int)wait_for(attempt_push, &a, &r->hdr->not_full, UMR_FULL, deadline_ns, poll_ns,
                         spin_ns);
}

int umr_ring_pop_wait(umr_ring_t *r, void *out, uint32_t out_cap, uint32_t *len,
                      int64_t deadline_ns, int64_t poll_ns, int64_t spin_ns) {
    if (out_cap < r->entry_size)
        return UMR_BADARG;
    attempt_t a = {.r = r, .out = out, .out_stride = out_cap, .lens = len};
    return (int)wait_for(attempt_pop, &a, &r->hdr->not_empty, UMR_EMPTY, deadline_ns, poll_ns,
                         spin_ns);
}

int64_t umr_ring_pop_many_wait(umr_ring_t *r, void *out, size_t out_stride, uint32_t *lens,
                               uint64_t n, int64_t deadline_ns, int64_t poll_ns,
                               int64_t spin_ns) {
    if (out_stride < r->entry_size)
        return UMR_BADARG;
    if (n == 0)
        return 0;
    attempt_t a = {.r = r, .out = out, .out_stride = out_stride, .lens = lens, .n = n, .many = 1};
    return wait_for(attempt_pop, &a, &r->hdr->not_empty, UMR_EMPTY, deadline_ns, poll_ns,
                    spin_ns);
}
