/*
 * umr_shm.c - anonymous shared-memory segments (memfd) and handing them to other processes.
 */
#define _GNU_SOURCE
#include "umr.h"

#include <errno.h>
#include <fcntl.h>
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

int umr_shm_create(const char *name, uint64_t size) {
    if (size == 0)
        return -EINVAL;
    /* CLOEXEC: a worker started by exec (spawn, forkserver) receives the descriptor
     * explicitly; nothing else we start should inherit it. */
    int fd = (int)memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return -errno;
    if (ftruncate(fd, (off_t)size) != 0 || fcntl(fd, F_ADD_SEALS, UMR_SEALS) != 0) {
        int err = errno;
        close(fd);
        return -err;
    }
    return fd;
}

void *umr_shm_map(int fd, uint64_t size) {
    void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
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
