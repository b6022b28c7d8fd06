/*
 * umr.h - a bounded lock-free ring of fixed-size entries in shared memory, and the futex
 * events that blocking callers sleep on.  Knows nothing of Python.
 *
 * The ring lives entirely inside caller-provided memory (a shared mapping), so every process
 * that maps the same bytes operates on the same ring.  It is multi-producer multi-consumer
 * (D. Vyukov's bounded MPMC queue: one sequence number per cell), which makes the common
 * single-producer single-consumer use just as correct and nearly as cheap.  See umr_ring.c
 * for the layout and for the memory-ordering argument at each atomic.
 *
 * Return codes are small negative numbers so that "count" results can share the type.
 */
#ifndef UMR_H
#define UMR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define UMR_OK 0
#define UMR_FULL (-1)     /* try_push: no free cell                              */
#define UMR_EMPTY (-2)    /* try_pop: no published cell                          */
#define UMR_CLOSED (-3)   /* the ring was shut down (and, for pop, is drained)   */
#define UMR_TIMEOUT (-4)  /* the absolute deadline passed                        */
#define UMR_POLL (-5)     /* the poll interval passed; caller re-checks liveness */
#define UMR_INTR (-6)     /* a signal interrupted the sleep; caller checks it    */
#define UMR_TOOBIG (-7)   /* entry longer than the ring's entry size             */
#define UMR_BADARG (-8)   /* invalid capacity / entry size / memory size         */
#define UMR_CORRUPT (-9)  /* the ring's memory is not a consistent ring          */
#define UMR_SYSERR (-10)  /* the futex syscall failed unexpectedly (seccomp?)    */

#define UMR_NO_DEADLINE (-1)

typedef struct umr_event umr_event_t;   /* 64 bytes in shared memory */
typedef struct umr_ring_hdr umr_ring_hdr_t;  /* the ring's header in shared memory */

/* A process-local handle on a ring: the geometry is copied out of the shared header once,
 * when the handle is made, so that nothing another process writes later can send an index
 * or a length computation out of the mapping. */
typedef struct umr_ring {
    umr_ring_hdr_t *hdr;
    unsigned char *cells;
    uint64_t capacity;
    uint32_t entry_size;
    uint32_t stride;
} umr_ring_t;

/* ---- events: a futex word with a "may be asleep" flag, 64 bytes, in shared memory ---- */

void umr_event_init(umr_event_t *ev);
/* Wake every sleeper if any is registered.  Cheap (one fence, one load) when none is. */
void umr_event_notify(umr_event_t *ev);
/* Wake every sleeper unconditionally (used by shutdown). */
void umr_event_notify_all(umr_event_t *ev);
/* Register as a waiter and return the word to pass to umr_event_wait: call it before every
 * check of the condition, then sleep only if the condition is still false. */
uint32_t umr_event_prepare(umr_event_t *ev);
/* Sleep while the word still equals `seen`, until `deadline_ns` (CLOCK_MONOTONIC, or
 * UMR_NO_DEADLINE).  Returns UMR_OK (woken or word changed), UMR_TIMEOUT, UMR_INTR, or
 * UMR_SYSERR (the kernel refused the futex call). */
int umr_event_wait(umr_event_t *ev, uint32_t seen, int64_t deadline_ns);

/* ---- the ring ---- */

/* Bytes of shared memory a ring of `capacity` entries of up to `entry_size` bytes needs
 * (0 when the arguments are out of range).  Always a multiple of 64. */
size_t umr_ring_footprint(uint64_t capacity, uint32_t entry_size);
/* Lay out a new, empty ring in `mem` (64-byte aligned, `mem_size` >= footprint) and fill
 * the handle `r`.  UMR_OK or UMR_BADARG. */
int umr_ring_init(umr_ring_t *r, void *mem, size_t mem_size, uint64_t capacity,
                  uint32_t entry_size);
/* Fill the handle `r` for the ring that `mem` already holds, checking that its header is
 * a ring's and that it fits in `mem_size` bytes.  UMR_OK or UMR_CORRUPT. */
int umr_ring_attach(umr_ring_t *r, void *mem, size_t mem_size);

/* Entries published and not yet claimed by a consumer: exact when nobody is mid-operation. */
uint64_t umr_ring_count(const umr_ring_t *r);
int umr_ring_is_closed(const umr_ring_t *r);
/* Mark the ring closed and wake every sleeper.  Pushes then fail with UMR_CLOSED; pops
 * still return what was published, then UMR_CLOSED once the ring is empty. */
void umr_ring_shutdown(umr_ring_t *r);

/* Non-blocking.  UMR_OK, UMR_FULL / UMR_EMPTY, UMR_CLOSED, UMR_TOOBIG. */
int umr_ring_try_push(umr_ring_t *r, const void *data, uint32_t len);
int umr_ring_try_pop(umr_ring_t *r, void *out, uint32_t out_cap, uint32_t *len);

/* Batch variants: move up to `n` entries with one claim of the shared counter.  Entry i is
 * read from datas[i] (lens[i] bytes) / written to out + i * out_stride (lens[i] set).
 * Return the number moved (>= 0), or UMR_CLOSED / UMR_TOOBIG when nothing was moved. */
int64_t umr_ring_try_push_many(umr_ring_t *r, const void *const *datas,
                               const uint32_t *lens, uint64_t n);
int64_t umr_ring_try_pop_many(umr_ring_t *r, void *out, size_t out_stride,
                              uint32_t *lens, uint64_t n);

/* Blocking variants.  Spin for up to `spin_ns`, then sleep on the ring's event.  They return
 * UMR_POLL once `poll_ns` has passed without success (so that the caller can check that
 * its peer is alive, then call again with spin_ns = 0), UMR_INTR on a signal, UMR_TIMEOUT
 * at `deadline_ns` (CLOCK_MONOTONIC ns, or UMR_NO_DEADLINE), UMR_CLOSED. */
int umr_ring_push_wait(umr_ring_t *r, const void *data, uint32_t len, int64_t deadline_ns,
                       int64_t poll_ns, int64_t spin_ns);
int umr_ring_pop_wait(umr_ring_t *r, void *out, uint32_t out_cap, uint32_t *len,
                      int64_t deadline_ns, int64_t poll_ns, int64_t spin_ns);
int64_t umr_ring_pop_many_wait(umr_ring_t *r, void *out, size_t out_stride, uint32_t *lens,
                               uint64_t n, int64_t deadline_ns, int64_t poll_ns,
                               int64_t spin_ns);

/* ---- shared-memory segments (umr_shm.c) ----
 * Segments are anonymous memfds: nothing ever appears under /dev/shm, and the memory is
 * freed by the kernel once the last descriptor and mapping are gone, however the processes
 * holding them ended.  Errors are returned as -errno. */

/* Create a memfd named `name` (shown as /memfd:name in /proc/PID/fd) of `size` bytes,
 * with its memory reserved (-ENOMEM or -ENOSPC: there is none to reserve; -EINTR: a signal
 * came first, try again). */
int umr_shm_create(const char *name, uint64_t size);
/* Map `size` bytes of `fd` read-write, shared, or copy-on-write if `copy_on_write`; NULL
 * with errno set on failure. */
void *umr_shm_map(int fd, uint64_t size, int copy_on_write);
int umr_shm_unmap(void *addr, uint64_t size);
/* Open another live process's descriptor `fd` through /proc/PID/fd and check that it is
 * the same file (inode `ino`, at least `size` bytes); returns our new descriptor. */
int umr_shm_open_peer(int64_t pid, int fd, uint64_t ino, uint64_t size);
/* Inode and size of `fd`, to tell a peer which file to expect. */
int umr_shm_identity(int fd, uint64_t *ino, uint64_t *size);

/* CLOCK_MONOTONIC in nanoseconds. */
int64_t umr_now_ns(void);

#ifdef __cplusplus
}
#endif
#endif /* UMR_H */
