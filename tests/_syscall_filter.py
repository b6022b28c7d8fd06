"""Make the kernel refuse fallocate in this process (and the processes it starts), for the
tests of what a refused reservation looks like: a seccomp filter, installed with ctypes,
that answers fallocate calls asking for more than a given length with an errno.

Only for x86-64, whose syscall numbers the filter uses.  A filter cannot be removed, so
it is installed in a child: :func:`run` runs code there.
"""
import ctypes
import os
import platform
import subprocess
import sys
import textwrap

import pytest

__all__ = ["run", "refuse_fallocate"]

HERE = os.path.dirname(os.path.abspath(__file__))

_AUDIT_ARCH_X86_64 = 0xC000003E
_NR_FALLOCATE = 285
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
# BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGT_K = 0x25
_RET_K = 0x06
# offsets in struct seccomp_data: nr, arch, instruction pointer, then args[6] (8 bytes each)
_NR, _ARCH, _LEN_LO, _LEN_HI = 0, 4, 16 + 3 * 8, 16 + 3 * 8 + 4


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


def run(code, timeout=120):
    """Run ``code`` (dedented) with ``python -c`` in the tests' directory, with ``errno``,
    ``os``, ``sys`` and this module imported; it installs the filter it needs with
    :func:`refuse_fallocate`.  Returns its stdout; fails the test if it exits with an
    error, skips it where the filter cannot work."""
    if not (platform.machine() == "x86_64" and platform.system() == "Linux"):
        pytest.skip("the seccomp filter of these tests uses x86-64 system call numbers")
    script = "import errno, os, sys\nimport _syscall_filter\n" + textwrap.dedent(code)
    r = subprocess.run([sys.executable, "-c", script], cwd=HERE, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def refuse_fallocate(errno_value, longer_than=0):
    """From now on, fallocate calls of more than ``longer_than`` bytes (below 4 GiB) fail
    with ``errno_value``; all other system calls are untouched."""
    assert 0 <= longer_than < 1 << 32
    code = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 0, 7, _AUDIT_ARCH_X86_64),      # another ABI: allow
        (_LD_W_ABS, 0, 0, _NR),
        (_JEQ_K, 0, 5, _NR_FALLOCATE),           # not fallocate: allow
        (_LD_W_ABS, 0, 0, _LEN_HI),
        (_JEQ_K, 0, 2, 0),                       # 4 GiB or more: refuse
        (_LD_W_ABS, 0, 0, _LEN_LO),
        (_JGT_K, 0, 1, longer_than),             # not longer than that: allow
        (_RET_K, 0, 0, _RET_ERRNO | errno_value),
        (_RET_K, 0, 0, _RET_ALLOW),
    ]
    insns = (_Insn * len(code))(*[_Insn(*c) for c in code])
    prog = _Prog(len(code), insns)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.prctl(
            _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "cannot install the seccomp filter")
