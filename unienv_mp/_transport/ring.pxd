# Cython declarations of csrc/umr.h, and of the extension types other Cython modules use.
from libc.stdint cimport uint32_t, uint64_t, int64_t

cdef extern from "umr.h" nogil:
    int UMR_OK, UMR_FULL, UMR_EMPTY, UMR_CLOSED, UMR_TIMEOUT, UMR_POLL, UMR_INTR
    int UMR_TOOBIG, UMR_BADARG, UMR_CORRUPT, UMR_SYSERR
    int64_t UMR_NO_DEADLINE

    ctypedef struct umr_event_t:
        pass
    ctypedef struct umr_ring_hdr_t:
        pass
    ctypedef struct umr_ring_t:
        umr_ring_hdr_t *hdr
        unsigned char *cells
        uint64_t capacity
        uint32_t entry_size
        uint32_t stride

    void umr_event_init(umr_event_t *ev)
    void umr_event_notify(umr_event_t *ev)
    void umr_event_notify_all(umr_event_t *ev)
    uint32_t umr_event_prepare(umr_event_t *ev)
    int umr_event_wait(umr_event_t *ev, uint32_t seen, int64_t deadline_ns)

    size_t umr_ring_footprint(uint64_t capacity, uint32_t entry_size)
    int umr_ring_init(umr_ring_t *r, void *mem, size_t mem_size, uint64_t capacity,
                      uint32_t entry_size)
    int umr_ring_attach(umr_ring_t *r, void *mem, size_t mem_size)
    uint64_t umr_ring_count(const umr_ring_t *r)
    int umr_ring_is_closed(const umr_ring_t *r)
    void umr_ring_shutdown(umr_ring_t *r)
    int umr_ring_try_push(umr_ring_t *r, const void *data, uint32_t len)
    int umr_ring_try_pop(umr_ring_t *r, void *out, uint32_t out_cap, uint32_t *len)
    int64_t umr_ring_try_push_many(umr_ring_t *r, const void *const *datas,
                                   const uint32_t *lens, uint64_t n)
    int64_t umr_ring_try_pop_many(umr_ring_t *r, void *out, size_t out_stride,
                                  uint32_t *lens, uint64_t n)
    int umr_ring_push_wait(umr_ring_t *r, const void *data, uint32_t len, int64_t deadline_ns,
                           int64_t poll_ns, int64_t spin_ns)
    int umr_ring_pop_wait(umr_ring_t *r, void *out, uint32_t out_cap, uint32_t *len,
                          int64_t deadline_ns, int64_t poll_ns, int64_t spin_ns)
    int64_t umr_ring_pop_many_wait(umr_ring_t *r, void *out, size_t out_stride,
                                   uint32_t *lens, uint64_t n, int64_t deadline_ns,
                                   int64_t poll_ns, int64_t spin_ns)

    int umr_shm_create(const char *name, uint64_t size)
    void *umr_shm_map(int fd, uint64_t size, int copy_on_write)
    int umr_shm_unmap(void *addr, uint64_t size)
    int umr_shm_open_peer(int64_t pid, int fd, uint64_t ino, uint64_t size)
    int umr_shm_identity(int fd, uint64_t *ino, uint64_t *size)
    int64_t umr_now_ns()


cdef class Segment:
    cdef readonly int fd
    cdef readonly uint64_t size
    cdef readonly uint64_t ino
    cdef readonly str name
    cdef readonly bint copy_on_write
    cdef unsigned char *addr
    cdef Py_ssize_t _users
    cdef bint _closing
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _strides[1]
    cdef int _unmap(self) except -1
    cdef unsigned char *enter(self, uint64_t offset, uint64_t length) except NULL
    cdef void leave(self) noexcept


cdef class RingBuffer:
    cdef umr_ring_t r
    cdef readonly Segment segment
    cdef readonly uint64_t offset
    cdef int64_t _poll_ns
    cdef int64_t _spin_ns
    cdef int _ensure_open(self) except -1
    cdef int _push(self, const char *p, Py_ssize_t n, bint block, object timeout,
                   object check) except -1
    cdef int _pop(self, char *buf, uint32_t *length, bint block, object timeout,
                  object check) except -1
    cdef int _raise_rc(self, int rc) except -1
