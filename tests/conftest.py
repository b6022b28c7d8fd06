"""Shared test fixtures: every test runs with Python's own Ctrl-C handler, and is checked
for leaked shared memory, descriptors and child processes."""
import gc
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

START_METHODS = ["fork", "spawn", "forkserver"]


def shm_files():
    """unienv_mp_ files under /dev/shm (the package must never leave any)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("unienv_mp_")}
    except FileNotFoundError:
        return set()


def own_segment_fds():
    """This process's open descriptors on unienv_mp_ memfds."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "unienv_mp_" in target:
            out.add((int(fd), target))
    return out


def own_segment_maps():
    """This process's mappings of unienv_mp_ memfds."""
    with open("/proc/self/maps") as f:
        return [line.split(None, 5)[-1].strip() for line in f if "unienv_mp_" in line]


def in_shared_memory(array):
    """True if ``array`` (numpy array or torch tensor) lies in a unienv_mp segment."""
    ptr = array.data_ptr() if hasattr(array, "data_ptr") else array.__array_interface__["data"][0]
    with open("/proc/self/maps") as f:
        for line in f:
            if "unienv_mp_" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= ptr < hi:
                    return True
    return False


def process_running(pid):
    """True if process ``pid`` exists and is not a zombie (reaped or not, it has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(predicate, timeout=5.0, interval=0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture(autouse=True)
def default_sigint():
    """Each test runs with Python's own SIGINT handler (a KeyboardInterrupt), whatever the
    run inherited: a background job of a non-interactive shell, or ``nohup``, starts with
    SIGINT ignored, and the Ctrl-C tests would see no KeyboardInterrupt.  The handler the
    run had is put back after the test."""
    if threading.current_thread() is not threading.main_thread():
        yield   # (signal handlers are set from the main thread only)
        return
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves /dev/shm files, memfd descriptors or mappings, or children."""
    shm_before = shm_files()
    fds_before = own_segment_fds()
    yield
    gc.collect()
    for p in mp.active_children():
        p.join(5)
    assert wait_until(lambda: shm_files() <= shm_before), (
        f"/dev/shm leaked: {shm_files() - shm_before}")
    assert wait_until(lambda: not (own_segment_fds() - fds_before), timeout=2), (
        f"descriptors leaked: {own_segment_fds() - fds_before}")
    assert not mp.active_children(), f"children left running: {mp.active_children()}"


@pytest.fixture(params=START_METHODS)
def ctx(request):
    return mp.get_context(request.param)
