"""gather_rows: the row copy of the direct gather (csrc/umr_rows.c); gather_cast_u8, its
uint8 columns of float rows; pread_rows, rows of a file (csrc/umr_pread.c)."""
import os

import numpy as np
import pytest

from unienv_mp import Segment
from unienv_mp._direct.rows import gather_cast_u8, gather_rows, pread_rows


@pytest.mark.parametrize("row_bytes", [1, 12, 1000, 1024, 1040, 4096, 49152, 49160])
def test_rows_land_where_take_puts_them(row_bytes):
    """Small rows (memcpy), large aligned rows (streaming stores) and large rows that are
    not a multiple of 16 bytes (memcpy again) all give numpy's take, byte for byte."""
    rng = np.random.default_rng(row_bytes)
    table = rng.integers(0, 256, (37, row_bytes), dtype=np.uint8)
    rows = rng.integers(0, 37, 50).astype(np.int64)
    rows[:3] = [0, 36, 0]
    out = bytearray(64 + 50 * row_bytes + 7)
    gather_rows(table, row_bytes, rows, out, 64)
    expect = np.take(table, rows, axis=0).tobytes()
    assert bytes(out[64:64 + len(expect)]) == expect
    assert out[:64] == bytearray(64) and out[64 + len(expect):] == bytearray(7)


def test_into_a_segment_at_an_unaligned_offset():
    table = np.arange(8 * 2048, dtype=np.uint8).reshape(8, 2048) ^ 0x5A
    rows = np.array([7, 1, 1, 3], dtype=np.int64)
    seg = Segment.create(4 * 2048 + 8, "rows")
    try:
        with memoryview(seg) as mv:
            gather_rows(table, 2048, rows, mv, 8)   # not 16-byte aligned: plain copies
            assert bytes(mv[8:8 + 4 * 2048]) == table[rows].tobytes()
    finally:
        seg.close()


def test_bad_rows_write_nothing_and_say_which():
    table = np.ones((5, 2048), dtype=np.uint8)
    out = bytearray(3 * 2048)
    for bad in (5, -1, 1 << 40):
        with pytest.raises(IndexError, match=f"row {bad} is out of bounds for a table of 5"):
            gather_rows(table, 2048, np.array([0, 1, bad], dtype=np.int64), out)
        assert out == bytearray(3 * 2048)


def test_bad_arguments():
    table = np.zeros((4, 16), dtype=np.uint8)
    rows = np.array([1, 2], dtype=np.int64)
    with pytest.raises(ValueError, match="do not fit"):
        gather_rows(table, 16, rows, bytearray(31))
    with pytest.raises(ValueError, match="do not fit"):
        gather_rows(table, 16, rows, bytearray(40), 100)
    with pytest.raises(ValueError, match="whole rows"):
        gather_rows(table, 24, rows, bytearray(64))
    with pytest.raises(ValueError, match="row_bytes"):
        gather_rows(table, 0, rows, bytearray(64))
    with pytest.raises(ValueError, match="offset"):
        gather_rows(table, 16, rows, bytearray(64), -1)
    with pytest.raises((BufferError, TypeError)):
        gather_rows(table, 16, rows, bytes(64))                      # not writable
    with pytest.raises(ValueError):
        gather_rows(table, 16, rows.astype(np.int32), bytearray(64))  # not int64
    gather_rows(table, 16, np.zeros(0, dtype=np.int64), bytearray(0))  # nothing to do



# -- gather_cast_u8: a flattened storage's uint8 columns, gathered and cast -----------------

def _float_rows(dtype, n_rows, row_items, seed):
    """Rows of values whose cast to uint8 C defines: in (-1, 256), integers and fractions,
    the edges (-0.0, just above -1, just below 256) included."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (n_rows, row_items), generator=gen).to(torch.float64)
    frac = torch.rand(n_rows, row_items, generator=gen, dtype=torch.float64)
    t = torch.where(frac < 0.5, t, frac * 256.9 - 0.9)
    t = t.to(dtype)
    edges = torch.tensor([-0.0, 0.0, -0.99999, 255.99998, 255.0, 0.5, 1.0, 254.5])
    t.view(-1)[:edges.numel()] = edges.to(dtype)
    t.view(-1)[-edges.numel():] = edges.to(dtype)
    return t


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("col,width,offset", [(0, 1, 64), (3, 15, 64), (5, 16, 8),
                                              (7, 17, 64), (1, 1024, 64), (2, 1024, 8),
                                              (0, 1040, 64), (9, 1031, 64), (0, 1200, 0)])
def test_cast_columns_give_torchs_cast_byte_for_byte(dtype, col, width, offset):
    """What UniEnv computes (the whole rows gathered, the columns cast by torch), for
    every width: 16 at a time and the tail, streamed (1024 and up, 16-byte aligned) or not."""
    import torch
    row_items = 1200
    t = _float_rows(getattr(torch, dtype), 23, row_items, width + col)
    rng = np.random.default_rng(width)
    rows = rng.integers(0, 23, 40).astype(np.int64)
    rows[:3] = [0, 22, 0]
    out = bytearray(offset + 40 * width + 5)
    assert gather_cast_u8(t.view(torch.uint8).numpy(), t.element_size(), row_items, col,
                          width, rows, out, offset) is True
    expect = t[torch.from_numpy(rows)][:, col:col + width].to(torch.uint8).numpy()
    assert bytes(out[offset:offset + 40 * width]) == expect.tobytes()
    assert out[:offset] == bytearray(offset) and out[offset + 40 * width:] == bytearray(5)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("where", [0, 17, 1023, 1039])   # (16 at a time, or the tail)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), -1.0, 256.0,
                                 -1e10, 1e10])
def test_cast_stops_where_c_leaves_the_cast_undefined(dtype, where, bad):
    """NaN or a value not in (-1, 256): False, for the caller to cast them as torch does;
    columns that do not hold it are still cast."""
    import torch
    t = _float_rows(getattr(torch, dtype), 6, 1040, 1)
    t[4, where] = bad
    rows = np.array([1, 2, 4, 0], dtype=np.int64)
    table = t.view(torch.uint8).numpy()
    out = bytearray(4 * 1040 + 64)
    assert gather_cast_u8(table, t.element_size(), 1040, 0, 1040, rows, out, 64) is False
    assert gather_cast_u8(table, t.element_size(), 1040, 0, 1040, rows[:2], out, 64) is True
    if where:
        assert gather_cast_u8(table, t.element_size(), 1040, 0, where, rows, out) is True
    assert gather_cast_u8(table, t.element_size(), 1040, where + 1, 1039 - where, rows,
                          out) is True


def test_cast_refuses_bad_rows_and_arguments():
    table = np.zeros((5, 64), dtype=np.float32)
    rows = np.array([0, 4], dtype=np.int64)
    out = bytearray(3 * 64)
    for bad in (5, -1, 1 << 40):
        with pytest.raises(IndexError, match=f"row {bad} is out of bounds for a table of 5"):
            gather_cast_u8(table, 4, 64, 0, 64, np.array([0, 1, bad], dtype=np.int64), out)
        assert out == bytearray(3 * 64)
    with pytest.raises(ValueError, match="item_bytes"):
        gather_cast_u8(table, 2, 128, 0, 64, rows, out)
    with pytest.raises(ValueError, match="not in rows"):
        gather_cast_u8(table, 4, 64, 1, 64, rows, out)
    with pytest.raises(ValueError, match="not in rows"):
        gather_cast_u8(table, 4, 64, -1, 2, rows, out)
    with pytest.raises(ValueError, match="whole rows"):
        gather_cast_u8(table, 4, 48, 0, 8, rows, out)
    with pytest.raises(ValueError, match="do not fit"):
        gather_cast_u8(table, 4, 64, 0, 64, rows, bytearray(127))
    with pytest.raises(ValueError, match="do not fit"):
        gather_cast_u8(table, 4, 64, 0, 64, rows, out, 65)
    with pytest.raises(ValueError, match="offset"):
        gather_cast_u8(table, 4, 64, 0, 64, rows, out, -1)
    with pytest.raises((BufferError, TypeError)):
        gather_cast_u8(table, 4, 64, 0, 64, rows, bytes(128))          # not writable
    assert gather_cast_u8(table, 4, 64, 0, 0, rows, bytearray(0)) is True
    assert gather_cast_u8(table, 4, 64, 0, 64, np.zeros(0, dtype=np.int64), bytearray(0))

# -- pread_rows: rows of a file read straight into their places (csrc/umr_pread.c) ----------

def _file_of(tmp_path, table, head=100):
    path = tmp_path / "rows.bin"
    path.write_bytes(b"h" * head + table.tobytes())
    return os.open(path, os.O_RDONLY)


@pytest.mark.parametrize("row_bytes,gap", [(28, 0), (28, 16384), (49152, 16384),
                                           (4096, 4096), (3, 1)])
def test_pread_rows_give_take_in_batch_order(tmp_path, row_bytes, gap):
    """Rows read sorted and coalesced (with and without reading the bytes between them)
    land in batch order, duplicates and the first and last rows included."""
    rng = np.random.default_rng(row_bytes + gap)
    table = rng.integers(0, 256, (300, row_bytes), dtype=np.uint8)
    rows = rng.integers(0, 300, 257).astype(np.int64)
    rows[:4] = [0, 299, 0, 5]
    fd = _file_of(tmp_path, table)
    try:
        out = bytearray(64 + 257 * row_bytes + 7)
        pread_rows(fd, 100, row_bytes, 300, rows, out, 64, gap)
    finally:
        os.close(fd)
    expect = np.take(table, rows, axis=0).tobytes()
    assert bytes(out[64:64 + len(expect)]) == expect
    assert out[:64] == bytearray(64) and out[64 + len(expect):] == bytearray(7)


def test_pread_rows_of_more_than_one_call(tmp_path):
    """More coalesced rows than one preadv takes (1024 iovecs) are read in several."""
    table = np.arange(5000 * 2, dtype=np.uint16).reshape(5000, 2).view(np.uint8)
    rows = np.arange(0, 5000, 2, dtype=np.int64)[::-1].copy()
    fd = _file_of(tmp_path, table)
    try:
        out = np.empty((len(rows), 4), np.uint8)
        pread_rows(fd, 100, 4, 5000, rows, out, 0, 8)
    finally:
        os.close(fd)
    assert np.array_equal(out, table[rows])


def test_pread_rows_past_the_end_of_the_file_read_zeros(tmp_path):
    """A table that runs past the end of the file (allocated, never written) reads as zeros
    there, as HDF5's sec2 driver reads it."""
    table = np.full((10, 8), 7, np.uint8)
    fd = _file_of(tmp_path, table)
    try:
        rows = np.array([12, 3, 9, 10, 15], np.int64)
        out = np.full((5, 8), 255, np.uint8)
        pread_rows(fd, 100, 8, 16, rows, out)
    finally:
        os.close(fd)
    assert np.array_equal(out, np.array([[0] * 8, [7] * 8, [7] * 8, [0] * 8, [0] * 8],
                                        np.uint8))


def test_pread_rows_refuse_bad_rows_and_report_failed_reads(tmp_path):
    table = np.ones((5, 16), np.uint8)
    fd = _file_of(tmp_path, table)
    out = np.zeros((2, 16), np.uint8)
    try:
        for bad in (5, -1):
            with pytest.raises(IndexError, match=f"row {bad} is out of bounds for a table "
                                                 f"of 5"):
                pread_rows(fd, 100, 16, 5, np.array([1, bad], np.int64), out)
            assert not out.any()
        with pytest.raises(ValueError, match="do not fit"):
            pread_rows(fd, 100, 16, 5, np.array([1, 2, 3], np.int64), out)
        with pytest.raises(ValueError, match="row_bytes must be > 0"):
            pread_rows(fd, 100, 0, 5, np.array([1], np.int64), out)
    finally:
        os.close(fd)
    fd = os.open(tmp_path, os.O_RDONLY)   # (a directory: every read fails, EISDIR)
    try:
        with pytest.raises(IsADirectoryError, match="reading rows of a file"):
            pread_rows(fd, 100, 16, 5, np.array([1], np.int64), out)
    finally:
        os.close(fd)
