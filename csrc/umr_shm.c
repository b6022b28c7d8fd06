/*
 * umr_shm.c - anonymous shared-memory segments (memfd) and handing them to other processes.
 */
#define _GNU_SOURCE
#include "umr.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 0x0002U
#endif

/* A segment's size never changes: sealing it means no process holding it (or opening it
 * through /proc) can shrink it under the others, whose accesses would then fault. */
#define UMR_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

/* Give `fd` its `size` bytes, and the memory behind them, now.
 *
 * A memfd sized with ftruncate alone is sparse: each page is allocated when something
 * first writes it.  If that page cannot be had then (strict overcommit's commit limit),
 * the kernel has no way to fail a plain store and sends the writer SIGBUS, which kills a
 * worker in the middle of a batch, or the training process in the middle of a put.
 * fallocate allocates every page up front instead, so the shortage is an error returned
 * here, to the call that asked for the memory, which can say how much it wanted and what
 * for.  (In a memory cgroup at its limit the kernel first reclaims and may call the OOM
 * killer, as it would for the first write: that, too, now happens here and not later.
 * The pages stay swappable like any other shmem.)
 *
 * A kernel that cannot fallocate a memfd (before Linux 3.5, or a sandbox that filters the
 * call) says EOPNOTSUPP or ENOSYS: then the segment is sized without the reservation and
 * pages are taken when first written, as on any sparse file.  EINTR (a signal arrived
 * during a long reservation) goes back to the caller, which runs the signal handlers and
 * asks again; umr_shm_create closes the memfd on any error, so nothing stays allocated. */
static int umr_shm_reserve(int fd, uint64_t size) {
    if (fallocate(fd, 0, 0, (off_t)size) == 0)
        return 0;
    int err = errno;
    if (err != EOPNOTSUPP && err != ENOSYS)
        return -err;
    return ftruncate(fd, (off_t)size) == 0 ? 0 : -errno;
}

int umr_shm_create(const char *name, uint64_t size) {
    if (size == 0 || size > (uint64_t)INT64_MAX)
        return -EINVAL;
    /* CLOEXEC: a worker started by exec (spawn, forkserver) receives the descriptor
     * explicitly; nothing else we start should inherit it. */
    int fd = (int)memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return -errno;
    /* Reserved before sealing: F_SEAL_GROW would refuse fallocate's growing the file. */
    int rc = umr_shm_reserve(fd, size);
    if (rc == 0 && fcntl(fd, F_ADD_SEALS, UMR_SEALS) != 0)
        rc = -errno;
    if (rc != 0) {
        close(fd);
        return rc;
    }
    return fd;
}

void *umr_shm_map(int fd, uint64_t size, int copy_on_write) {
    /* Copy-on-write (MAP_PRIVATE) for a receiver of data written once by its creator:
     * pages it only reads are the segment's own, shared with every other process mapping
     * it, and a page it writes becomes its private copy, so no other process sees the
     * write (as after fork).  Under strict overcommit the kernel counts such a mapping
     * against the commit limit in full, since every page could be copied. */
    int flags = copy_on_write ? MAP_PRIVATE : MAP_SHARED;
    void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, flags, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

int umr_shm_unmap(void *addr, uint64_t size) {
    return munmap(addr, (size_t)size) == 0 ? 0 : -errno;
}

int umr_shm_identity(int fd, uint64_t *ino, uint64_t *size) {
    struct stat st;
    if (fstat(fd, &st) != 0)
        return -errno;
    *ino = (uint64_t)st.st_ino;
    *size = (uint64_t)st.st_size;
    return 0;
}

int umr_shm_open_peer(int64_t pid, int fd, uint64_t ino, uint64_t size) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%lld/fd/%d", (long long)pid, fd);
    /* Opening /proc/PID/fd/N re-opens the file itself (not a dup of the peer's open file
     * description), which needs the same permission as reading the peer's memory map:
     * same user, or privileges. */
    int ours = open(path, O_RDWR | O_CLOEXEC);
    if (ours < 0)
        return -errno;
    uint64_t got_ino = 0, got_size = 0;
    int rc = umr_shm_identity(ours, &got_ino, &got_size);
    if (rc != 0) {
        close(ours);
        return rc;
    }
    /* The peer may have closed `fd` and reused the number for another file since it told
     * us about it: the inode, and our seals (only our memfds carry them), tell. */
    int seals = fcntl(ours, F_GET_SEALS);
    if (got_ino != ino || got_size < size || seals < 0 || (seals & UMR_SEALS) != UMR_SEALS) {
        close(ours);
        return -ESTALE;
    }
    return ours;
}
