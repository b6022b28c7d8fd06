"""gather_rows: the row copy of the direct gather (csrc/umr_rows.c)."""
import numpy as np
import pytest

from unienv_mp import Segment
from unienv_mp._direct.rows import gather_rows


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
