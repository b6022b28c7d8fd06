"""The files a wrapped sampler's data reads, known by their identity: what the fingerprint
(`unienv_mp._sampling.fingerprint`) records of UniEnv's file-backed storages.

A worker over a file-backed storage does not hold a copy of its rows: it reads the files
(through its HDF5 library's caches, its decoders), or maps them (a memory-mapped tensor).
So the copy a pool of workers holds is the files as they were when the pool started, and it
is still the data as it is now while the files are unchanged.  A file is known by its
identity (`Identity`): device, inode, size, and modification and status-change times in
nanoseconds.  A write to a file (through the buffer or by anyone) changes its modification
and change times; a file replaced by another, even of the same size, has another inode or
change time; a touch, even one that sets the modification time back (``touch -d``,
``cp -p``, ``rsync -t``), changes the change time, which no user can set.

What identity cannot see, and how this module stays exact there:

* **A write within the clock's tick.**  The kernel stamps a file with a coarse clock (one
  tick: 1 to 10 ms on Linux's local file systems, 1 or 2 s on some others), so a write in
  the same tick as the moment the identity was taken may leave the times as they were.  An
  identity taken less than `RACY_NS` (2 s) after the file's last change is therefore not
  trusted (`racy`): the pool that started then is not used for a later epoch, whose new
  workers take the identity again (Git's "racily clean" entries, the same problem).
* **Writes that do not stamp the file**: a write through a shared memory mapping of
  another process (Linux stamps the file at the first write after each write-back, not at
  every write), a file system whose server's clock is behind this machine's (NFS), a
  write by a process that sets both times back with privileges.  Write such files with
  ``persistent_workers=False``.
* **What HDF5 holds in memory.**  A file open for writing may hold rows written through
  the buffer in HDF5's caches, not yet in the file: `hdf5` flushes it before taking its
  identity, so that the file is what this process reads.

Memory-mapped tensors (UniEnv's ``MemoryMappedTensor``) are read by the workers as the
file is now, as this process reads them (the same pages of the same inode): there only
the inode counts (`mapped`), and that the path the workers open (under spawn) still names
it.
"""
import os
import time

__all__ = ["RACY_NS", "Identity", "identity", "racy", "hdf5", "mapped"]

#: An identity taken less than this long after the file last changed is not trusted (see
#: the module's docstring).
RACY_NS = 2_000_000_000


class Identity(tuple):
    """``(path, device, inode, size, mtime_ns, ctime_ns)`` of a file; ``(path, None, ...)``
    where there is none.  Compared by value."""
    __slots__ = ()

    @property
    def path(self):
        return self[0]


def identity(path, st=None):
    """The `Identity` of the file at ``path`` now (``st``: its ``os.stat``, if taken)."""
    try:
        if st is None:
            st = os.stat(path)
    except OSError:
        return Identity((path, None, None, None, None, None))
    return Identity((path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                     st.st_ctime_ns))


def racy(ident, now_ns=None):
    """True if ``ident`` was taken too soon after its file last changed to tell a later
    change (see the module's docstring); ``now_ns``: ``time.time_ns()`` after it was
    taken."""
    if ident[1] is None:
        return False
    if now_ns is None:
        now_ns = time.time_ns()
    return max(ident[4], ident[5]) > now_ns - RACY_NS


def hdf5(root, path):
    """The identities of the file an ``HDF5Storage`` reads: the file its open handle
    ``root`` (an h5py object, or None where it opens the file when it first reads) reads,
    and the file at ``path``, which a worker started with spawn opens.  A file open for
    writing is flushed first (see the module's docstring).  Raises ``LookupError`` where
    the two are not one file (the path names another file now)."""
    if root is None:
        return (identity(path),)
    f = root.file
    if f.mode != "r":
        f.flush()
    fd = int(f.id.get_vfd_handle())
    mine = identity(path, os.fstat(fd))
    named = identity(path)
    if named[1:3] != mine[1:3]:
        raise LookupError(f"{path} is not the file the buffer has open (it was replaced "
                          f"since it was opened)")
    return (mine,)


def mapped(address, path):
    """``(device, inode)`` of the file mapped at ``address`` in this process, which must
    be the file at ``path`` now; raises ``LookupError`` where it is not (or where the
    mapping is not found)."""
    found = None
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                found = (os.makedev(major, minor), int(fields[4]))
                break
    if found is None or found[1] == 0:
        raise LookupError(f"no file is mapped where the tensor of {path} lies")
    try:
        st = os.stat(path)
    except OSError:
        raise LookupError(f"{path}, which the buffer maps, is gone") from None
    if (st.st_dev, st.st_ino) != found:
        raise LookupError(f"{path} is not the file the buffer maps (it was replaced since "
                          f"it was mapped)")
    return found
