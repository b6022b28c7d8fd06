"""How much memory a new shared-memory segment can still get, checked before it is reserved.

A segment's memory is reserved when it is made (``fallocate``, see ``csrc/umr_shm.c``).
Under Linux's default overcommit policy the kernel does not refuse a reservation that is
larger than the memory left: it reclaims, then calls the OOM killer, which kills the
largest process on the machine (or in the memory cgroup), perhaps not this one.  So
`check` refuses, with a ``MemoryError`` that says how much was asked for and how much is
left, a segment larger than the kernel's own estimate of what is available:

* the machine's ``MemAvailable`` plus free swap (``/proc/meminfo``), and
* for each memory cgroup above this process that has a limit (a container's, a job's):
  the limit less what the cgroup uses, not counting its file cache, which the kernel
  reclaims before it runs out (cgroup v2 ``memory.max``, v1's hierarchical limit).

It is an estimate taken at one moment: memory that other processes take right after is
not foreseen.  Reading ``/proc/meminfo`` costs about 0.1 ms, so the free memory that
``sysconf`` reports cheaply is asked first, and the rest is read only when that does not
suffice.
"""
import os

__all__ = ["check", "available"]

# Where the files are; tests point these at a made-up tree.
PROC = "/proc"
CGROUP_ROOT = "/sys/fs/cgroup"

_UNLIMITED = 1 << 60     # cgroup v1 writes "no limit" as a huge number (2**63 - 4096)
_limited = None          # (pid, [(kind, directory)]) of the cgroups with a memory limit


def _read(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode()
    except OSError:
        return None


def _stat_fields(text, *names):
    """The values of ``names`` in a ``memory.stat``/``meminfo``-style text (0 if absent)."""
    want = dict.fromkeys(names, 0)
    for line in (text or "").splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[0] in want:
            want[parts[0]] = int(parts[1])
    return want


def _memory_cgroups():
    """``[(kind, directory)]``: this process's memory cgroup (v1) or its cgroup and each
    ancestor (v2) that has a memory limit, looked up once per process."""
    global _limited
    pid = os.getpid()
    if _limited is not None and _limited[0] == pid:
        return _limited[1]
    found = []
    for line in (_read(f"{PROC}/self/cgroup") or "").splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        path = path.strip("/")
        if hid == "0" and controllers == "":
            # v2: the cgroup and every ancestor up to the root visible here
            parts = path.split("/") if path else []
            for i in range(len(parts), -1, -1):
                d = os.path.join(CGROUP_ROOT, *parts[:i])
                limit = (_read(os.path.join(d, "memory.max")) or "max").strip()
                if limit != "max" and int(limit) < _UNLIMITED:
                    found.append(("v2", d))
        elif "memory" in controllers.split(","):
            # v1: the hierarchical limit folds the ancestors in; inside a container the
            # cgroup's own directory is often the mount's root
            for d in (os.path.join(CGROUP_ROOT, "memory", path),
                      os.path.join(CGROUP_ROOT, "memory")):
                stat = _read(os.path.join(d, "memory.stat"))
                if stat is not None:
                    limit = _stat_fields(stat, "hierarchical_memory_limit")[
                        "hierarchical_memory_limit"]
                    if 0 < limit < _UNLIMITED:
                        found.append(("v1", d))
                    break
    _limited = (pid, found)
    return found


def _cgroup_room(kind, d):
    """``(room, limit)`` in bytes of the cgroup at ``d``; None if it cannot be read."""
    if kind == "v2":
        limit = _read(os.path.join(d, "memory.max"))
        used = _read(os.path.join(d, "memory.current"))
        stat = _stat_fields(_read(os.path.join(d, "memory.stat")),
                            "active_file", "inactive_file")
        cache = stat["active_file"] + stat["inactive_file"]
    else:
        used = _read(os.path.join(d, "memory.usage_in_bytes"))
        stat = _stat_fields(_read(os.path.join(d, "memory.stat")),
                            "hierarchical_memory_limit", "total_active_file",
                            "total_inactive_file")
        limit = stat["hierarchical_memory_limit"]
        cache = stat["total_active_file"] + stat["total_inactive_file"]
    try:
        limit, used = int(limit), int(used)
    except (TypeError, ValueError):
        return None
    return limit - max(0, used - cache), limit


def available():
    """``(bytes, where)``: the memory a new segment can get, and what limits it (a phrase
    for an error message); ``(None, None)`` where none of it can be read."""
    room = where = None
    meminfo = _read(f"{PROC}/meminfo")
    if meminfo is not None and "MemAvailable:" in meminfo:
        info = _stat_fields(meminfo, "MemAvailable", "SwapFree")
        room = (info["MemAvailable"] + info["SwapFree"]) * 1024
        where = "the machine's available memory and free swap"
    for kind, d in _memory_cgroups():
        got = _cgroup_room(kind, d)
        if got is not None and (room is None or got[0] < room):
            room = max(0, got[0])
            where = (f"the memory cgroup {d} (limit {_mib(got[1])}, less what it uses "
                     f"beyond its file cache)")
    return room, where


def _mib(n):
    return f"{n / 1048576:.1f} MiB"


def check(size, what):
    """Raise ``MemoryError`` if a segment of ``size`` bytes (``what`` says which, for the
    message) would not fit in the memory left (see the module's docstring)."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        free = 0
    limited = _memory_cgroups()
    if size <= free and not limited:
        return
    room, where = available()
    if room is not None and size > room:
        raise MemoryError(
            f"cannot reserve {size} bytes ({_mib(size)}) of memory for shared-memory "
            f"segment {what}: only {_mib(room)} left in {where}")
