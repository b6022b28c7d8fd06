"""Run Python code in a mount namespace whose /dev/shm is a 1 MiB tmpfs: a container's
/dev/shm, only smaller (Docker's default is 64 MiB).

The child makes the namespace itself (``unshare(CLONE_NEWNS)``), makes every mount in it
private first, so that nothing it mounts propagates back to this namespace, then mounts
the tmpfs.  That needs root (or CAP_SYS_ADMIN); where it is refused, :func:`run` skips the
calling test and says why.
"""
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SIZE = 1 << 20
_NO_NAMESPACE = 77

_PRELUDE = f"""
import ctypes, os, sys
_libc = ctypes.CDLL(None, use_errno=True)
def _fail(what):
    print(f"cannot make a mount namespace with a small /dev/shm here: {{what}}: "
          f"{{os.strerror(ctypes.get_errno())}}", file=sys.stderr)
    sys.exit({_NO_NAMESPACE})
if _libc.unshare(0x00020000) != 0:                                   # CLONE_NEWNS
    _fail("unshare(CLONE_NEWNS)")
if _libc.mount(b"none", b"/", None, 16384 | (1 << 18), None) != 0:    # MS_REC | MS_PRIVATE
    _fail("making the mounts private")
if _libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, b"size={SIZE}") != 0:
    _fail("mounting a tmpfs on /dev/shm")
_st = os.statvfs("/dev/shm")
assert _st.f_blocks * _st.f_frsize == {SIZE}, "the tmpfs is not 1 MiB"
del _libc, _fail, _st


def dev_shm_used():
    '''Bytes in use on /dev/shm, and the names there.'''
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize, sorted(os.listdir("/dev/shm"))
"""


def host_dev_shm_size():
    st = os.statvfs("/dev/shm")
    return st.f_blocks * st.f_frsize


def run(code, timeout=240):
    """Run ``code`` (dedented) with ``python -c`` in the tests' directory, in its own mount
    namespace with a 1 MiB /dev/shm; ``dev_shm_used()`` is defined for it.  Returns its
    stdout; fails the test if it exits with an error."""
    r = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(code)], cwd=HERE,
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode == _NO_NAMESPACE:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0, f"child failed:\n{r.stdout}\n{r.stderr}"
    # the namespace's tmpfs never reached this one
    assert host_dev_shm_size() != SIZE
    return r.stdout
