"""The page-table witness (unienv_mp._sampling.pages): which writes by this process since a
fork it sees, and what it answers where it cannot tell."""
import os

import numpy as np
import pytest
import torch

from unienv_mp._sampling import pages
from unienv_mp._sampling.pages import PageWitness

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"),
                                reason="no /proc/self/pagemap here")


class _Holder:
    """A child forked now, which keeps this process's pages until `end`."""

    def __init__(self):
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:   # (the child waits for its end of the pipe to close)
            os.close(w)
            try:
                os.read(r, 1)
            finally:
                os._exit(0)
        os.close(r)
        self._w = w

    def end(self):
        os.close(self._w)
        os.waitpid(self.pid, 0)


def _ranges(*tensors):
    return [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors]


@pytest.fixture
def data():
    # (large enough for pages of its own; filled, so every page is present)
    return torch.arange(1 << 20, dtype=torch.int64)


def test_nothing_written_since_the_fork_is_told(data):
    holder = _Holder()
    try:
        w = PageWitness(_ranges(data), lambda: [holder.pid])
        assert w.written() is False
        # reads, and writes to other memory, are no writes to the data
        assert int(data.sum()) > 0
        other = torch.zeros(1 << 18)
        other += 1
        assert w.written() is False
    finally:
        holder.end()


@pytest.mark.parametrize("how", ["numpy", "data", "torch", "ctypes"])
def test_a_write_to_one_element_is_seen_whatever_wrote_it(data, how):
    holder = _Holder()
    try:
        w = PageWitness(_ranges(data), lambda: [holder.pid])
        i = 123_457
        if how == "numpy":
            data.numpy()[i] = -1
        elif how == "data":
            data.data[i] = -1
        elif how == "torch":
            data[i] = -1
        else:
            import ctypes
            ctypes.c_int64.from_address(data.data_ptr() + 8 * i).value = -1
        assert w.written() is True
        assert w.written() is True   # (for good)
    finally:
        holder.end()


def test_a_page_written_with_the_same_bytes_is_not_a_change(data):
    holder = _Holder()
    try:
        w = PageWitness(_ranges(data), lambda: [holder.pid])
        data.numpy()[5000:6000] = data.numpy()[5000:6000].copy()   # (the pages are ours now)
        assert w.written() is False
    finally:
        holder.end()


def test_a_small_tensor_on_a_shared_heap_page_is_compared_byte_for_byte():
    small = torch.tensor([1.0, 2.0, 3.0])
    holder = _Holder()
    try:
        w = PageWitness(_ranges(small), lambda: [holder.pid])
        junk = [bytearray(64) for _ in range(1000)]   # (writes all over the heap)
        del junk
        assert w.written() is False
        small.numpy()[1] = 7.0
        assert w.written() is True
    finally:
        holder.end()


def test_a_write_a_later_fork_would_hide_is_seen_before_that_fork(data):
    holder = _Holder()
    try:
        w = PageWitness(_ranges(data), lambda: [holder.pid])
        data.numpy()[99] = -5
        later = _Holder()          # (maps the written page again: the hook looked first)
        later.end()
        assert w.written() is True
    finally:
        holder.end()


def test_without_a_holder_it_cannot_tell(data):
    holder = _Holder()
    w = PageWitness(_ranges(data), lambda: [holder.pid])
    holder.end()                   # (every page is this process's alone now)
    assert w.written() is None
    assert PageWitness(_ranges(data), lambda: []).written() in (None, False)


def test_a_holder_that_cannot_be_read_is_passed_over(data):
    holder = _Holder()
    try:
        gone = holder.pid + 10_000_000   # (no such process)
        w = PageWitness(_ranges(data), lambda: [gone, holder.pid])
        data.numpy()[7] = -7
        assert w.written() is True
    finally:
        holder.end()


def test_a_forked_child_watches_nothing_of_its_parent(data):
    holder = _Holder()
    try:
        PageWitness(_ranges(data), lambda: [holder.pid])
        r, w_ = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w_, b"%d" % len(pages._live))
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(r, 16) == b"0"
        os.close(r)
        os.close(w_)
    finally:
        holder.end()


def test_a_swapped_or_missing_page_table_answers_none(data, monkeypatch):
    holder = _Holder()
    try:
        w = PageWitness(_ranges(data), lambda: [holder.pid])
        real_open = os.open

        def no_pagemap(path, *args, **kwargs):
            if path == "/proc/self/pagemap":
                raise PermissionError(13, "denied")
            return real_open(path, *args, **kwargs)
        monkeypatch.setattr(os, "open", no_pagemap)
        assert w.written() is None
    finally:
        holder.end()


def test_pages_in_shared_memory_are_not_watched():
    shared = torch.zeros(1 << 16).share_memory_()
    from unienv_mp._sampling import fingerprint
    from unienv_data.samplers import StepSampler
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from _data import replay_buffer
    rb = replay_buffer(50, multiprocessing=True)
    fp = fingerprint.take(StepSampler(rb, 4, seed=0))
    ptrs = {a for a, _ in fp.ranges}
    for t in rb.storage.storage_map.values():
        assert t.data.untyped_storage().data_ptr() not in ptrs
    del shared
