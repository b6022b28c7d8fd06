"""Tests of the slot codec (unienv_mp/_codec.pyx).

Round trips of random pytrees (hypothesis), the tensors refused (off the CPU, unsupported
dtypes), a fuzzed and a hand-crafted set of corrupt slots (in process and in a child process,
so that a crash shows as an exit code), zero-copy views and the lease release protocol, the
plan cache, and a memory soak through a small pool of slots.
"""
import collections
import contextlib
import ctypes
import fractions
import gc
import io
import mmap
import multiprocessing as mp
import os
import pickle
import random
import struct
import sys
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from unienv_mp import Segment
from unienv_mp._transport import codec as _codec
from unienv_mp.errors import CodecError

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy < 2
    byte_bounds = np.byte_bounds

# -----------------------------------------------------------------------------------------
# Shared definitions
# -----------------------------------------------------------------------------------------

Point = collections.namedtuple("Point", ["x", "y"])


class Step(NamedTuple):
    obs: object
    reward: object
    done: object


NP_DTYPES = [np.dtype(n) for n in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128")]
TORCH_DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.float32,
                torch.float64, torch.complex64, torch.complex128, torch.bfloat16]
TORCH_TO_NP = {t: np.dtype(str(t).split(".")[1]) for t in TORCH_DTYPES if t != torch.bfloat16}
SIGNED_TORCH = {torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                torch.float32, torch.float64, torch.complex64, torch.complex128,
                torch.bfloat16}
FLOAT_TORCH = {torch.float16, torch.float32, torch.float64, torch.complex64,
               torch.complex128, torch.bfloat16}

HYPO = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                  HealthCheck.too_slow,
                                                  HealthCheck.data_too_large])


@pytest.fixture(autouse=True)
def fresh_plans():
    _codec.clear_plan_cache()
    yield
    _codec.clear_plan_cache()


def codec_numpy(x):
    """True when the codec carries this numpy array as raw bytes (not pickled)."""
    return type(x) is np.ndarray and x.dtype in NP_DTYPES and x.ndim <= 32


def codec_torch(x):
    return isinstance(x, torch.Tensor) and x.dtype in TORCH_DTYPES and x.dim() <= 32


def buffer_range(buf):
    """[lo, hi) addresses of a bytes-like object or a Segment."""
    if isinstance(buf, Segment):
        return buf.address, buf.address + buf.size
    a = np.frombuffer(buf, np.uint8)
    lo = a.ctypes.data
    return lo, lo + a.size


def array_range(x):
    if isinstance(x, torch.Tensor):
        lo = x.data_ptr()
        return lo, lo + x.numel() * x.element_size()  # decoded tensors are C-contiguous
    lo, hi = byte_bounds(x)
    return lo, hi


def canonical_tensor(t):
    return t.detach().resolve_conj().resolve_neg().contiguous()


def tensor_bits(t):
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    # a fresh tensor: .contiguous() keeps odd strides of size-1 dimensions
    fresh = torch.empty(t.shape, dtype=t.dtype).copy_(canonical_tensor(t))
    return fresh.reshape(-1).view(torch.uint8)


def same_bits(a, b):
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


# -----------------------------------------------------------------------------------------
# 1. Property-based round trips
# -----------------------------------------------------------------------------------------

def np_layout(a, how):
    """A copy of ``a``'s values with the layout ``how`` (often not C-contiguous)."""
    if how == "transpose":
        return a.T
    if how == "strided" and a.ndim:
        return np.repeat(a, 2, axis=0)[::2]
    if how == "reversed" and a.ndim:
        return a[::-1]
    if how == "fortran":
        return np.asfortranarray(a)
    if how == "broadcast":
        return np.broadcast_to(a, (2,) + a.shape)
    if how == "unaligned":
        raw = np.zeros(a.nbytes + 1, np.uint8)
        out = raw[1:].view(a.dtype).reshape(a.shape)
        out[...] = a
        return out
    return a


LAYOUTS = ["plain", "transpose", "strided", "reversed", "fortran", "broadcast", "unaligned"]
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)


@st.composite
def np_arrays(draw):
    dtype = draw(st.sampled_from(NP_DTYPES))
    a = draw(hnp.arrays(dtype, draw(shapes)))
    return np_layout(a, draw(st.sampled_from(LAYOUTS)))


@st.composite
def torch_tensors(draw):
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(shapes)
    if dtype == torch.bfloat16:
        t = torch.from_numpy(draw(hnp.arrays(np.float32, shape))).to(torch.bfloat16)
    else:
        t = torch.from_numpy(draw(hnp.arrays(TORCH_TO_NP[dtype], shape)).copy())
    how = draw(st.sampled_from(["plain", "transpose", "strided", "expand", "offset", "conj",
                                "neg", "grad"]))
    if how == "transpose" and t.dim() >= 2:
        t = t.transpose(0, -1)
    elif how == "strided" and t.dim():
        t = t.repeat_interleave(2, dim=0)[::2]
    elif how == "expand":
        t = t.expand(2, *t.shape)
    elif how == "offset" and t.dim() and t.shape[0]:
        t = torch.cat([t[:1], t])[1:]  # contiguous, at a storage offset
    elif how == "conj" and t.is_complex():
        t = t.conj()
    elif how == "neg" and dtype in SIGNED_TORCH:
        t = torch._neg_view(t)
    elif how == "grad" and dtype in FLOAT_TORCH:
        t = t.clone().requires_grad_(True)
    return t


np_scalars = st.sampled_from(NP_DTYPES).flatmap(
    lambda d: hnp.from_dtype(d).map(lambda v, d=d: d.type(v)))

pickled_arrays = st.sampled_from([
    np.array(["2020-01-01", "NaT"], dtype="datetime64[s]"),
    np.array([1, "a", None], dtype=object),
    np.array(["abc", "\u00e9"]),
    np.arange(6, dtype=">i4").reshape(2, 3),        # non-native byte order
    np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]),  # structured
    np.zeros((1,) * 33, np.float32),                 # more dimensions than the codec carries
])

other_objects = st.one_of(
    st.integers(), st.booleans(), st.floats(), st.complex_numbers(),
    st.text(max_size=8), st.binary(max_size=8), st.none(),
    st.fractions(), st.decimals(allow_nan=False), st.datetimes(),
    st.sets(st.integers(), max_size=3), st.frozensets(st.text(max_size=2), max_size=3),
    st.dictionaries(st.integers(), st.integers(), min_size=1, max_size=3),  # non-str keys
    st.builds(collections.OrderedDict, st.dictionaries(st.text(max_size=2), st.integers(),
                                                       max_size=2)),
    st.builds(bytearray, st.binary(max_size=4)), st.builds(range, st.integers(0, 9)),
    pickled_arrays,
    st.just(torch.zeros((1,) * 33)),                 # a pickled tensor
)

leaves = st.one_of(np_arrays(), torch_tensors(), np_scalars, other_objects)
keys = st.one_of(st.text(max_size=6), st.just("\ud800lone surrogate"))


def extend(children):
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.builds(Point, children, children),
        st.builds(Step, children, children, children),
    )


pytrees = st.recursive(leaves, extend, max_leaves=10)


def assert_same(exp, got, mode=None, rng=None, where="root"):
    """``got`` is ``exp`` decoded: same containers, key order, leaf types, dtypes, shapes
    and values (bitwise, so NaN-aware).  ``mode`` says where array data must live:
    "view" (inside [rng) and writable), "readonly" (numpy inside [rng) read-only, torch
    copied), "copy" (outside [rng), owning its data)."""
    te = type(exp)
    if isinstance(exp, torch.Tensor):
        assert type(got) is torch.Tensor, where
        assert got.dtype == exp.dtype and got.shape == exp.shape, where
        assert got.device.type == "cpu" and not got.requires_grad, where
        assert torch.equal(tensor_bits(exp), tensor_bits(got)), where
        if codec_torch(exp) and got.numel():
            lo, hi = array_range(got)
            inside = rng[0] <= lo and hi <= rng[1]
            assert inside == (mode == "view"), (where, mode)
        return
    assert type(got) is te, (where, te, type(got))
    if te is np.ndarray:
        assert got.dtype == exp.dtype and got.shape == exp.shape, where
        if exp.dtype.hasobject:
            assert got.tolist() == exp.tolist(), where
        else:
            assert same_bits(exp, got), where
            if exp.dtype.kind in "biufc":
                assert np.array_equal(exp, got, equal_nan=exp.dtype.kind in "fc"), where
        if codec_numpy(exp):
            if mode == "copy":
                assert got.flags.owndata and got.flags.writeable, where
            else:
                assert got.base is not None, where
                assert got.flags.writeable == (mode == "view"), where
            if got.size:
                lo, hi = array_range(got)
                inside = rng[0] <= lo and hi <= rng[1]
                assert inside == (mode != "copy"), (where, mode)
        return
    if te is dict:
        assert list(got) == list(exp), where
        for k in exp:
            assert_same(exp[k], got[k], mode, rng, f"{where}[{k!r}]")
        return
    if te in (list, tuple, Point, Step):
        assert len(got) == len(exp), where
        for i, (e, g) in enumerate(zip(exp, got)):
            assert_same(e, g, mode, rng, f"{where}[{i}]")
        return
    if isinstance(exp, np.generic):
        assert got.dtype == exp.dtype and same_bits(exp, got), where
        return
    if te is float:
        assert struct.pack("<d", exp) == struct.pack("<d", got), where
        return
    if te is complex:
        assert struct.pack("<dd", exp.real, exp.imag) == struct.pack("<dd", got.real,
                                                                      got.imag), where
        return
    assert got == exp, where


def roundtrip_everywhere(obj):
    """Round trip ``obj`` through plain bytes, a lease over a bytearray and a lease over a
    Segment, with copy=False and copy=True; checks every result and the lease releases."""
    p = _codec.prepare(obj)
    enc = _codec.encode_prepared(p)
    assert len(enc) == p.nbytes == _codec.write(p, bytearray(p.nbytes + 7))
    assert p.nbytes % _codec.ALIGN == 0
    assert enc == _codec.encode(obj)  # deterministic
    data = bytes(enc)

    # plain bytes (read-only) and a plain bytearray
    for copy in (False, True):
        assert_same(obj, _codec.decode(data, copy=copy), "copy" if copy else "readonly",
                    buffer_range(data))
    ba = bytearray(enc)
    assert_same(obj, _codec.decode(ba, copy=False), "view", buffer_range(ba))

    # a lease over a bytearray, at an offset
    released = []
    for copy in (False, True):
        released.clear()
        slot = bytearray(b"\xee" * 64) + bytearray(p.nbytes + 64)
        lease = _codec.SlotLease(slot, 64, p.nbytes, released.append, "tok")
        assert _codec.write(p, lease) == p.nbytes
        out = _codec.decode(lease, copy=copy)
        rng = buffer_range(slot)
        del lease
        assert_same(obj, out, "copy" if copy else "view", rng)
        del out  # decoded trees hold no cycles: freed (and the lease released) at once
        assert released == ["tok"]
        slot.extend(b"x")  # every export of the slot is gone: it can be resized

    # a lease over a shared-memory Segment
    seg = Segment.create(p.nbytes + 128)
    try:
        for copy in (False, True):
            released.clear()
            lease = _codec.SlotLease(seg, 128, p.nbytes, released.append, 5)
            _codec.write(p, lease)
            out = _codec.decode(lease, copy=copy)
            del lease
            assert_same(obj, out, "copy" if copy else "view", buffer_range(seg))
            del out
            assert released == [5]
    finally:
        seg.close()


@settings(max_examples=200, **HYPO)
@given(pytrees)
def test_roundtrip_random_pytrees(obj):
    roundtrip_everywhere(obj)


@settings(max_examples=100, **HYPO)
@given(st.lists(st.one_of(np_arrays(), torch_tensors()), min_size=1, max_size=6))
def test_roundtrip_array_leaves(arrays):
    """Many array leaves side by side: each lands at its own aligned offset."""
    roundtrip_everywhere({f"k{i}": a for i, a in enumerate(arrays)})
    roundtrip_everywhere(arrays[0])  # an array as the whole tree


def test_roundtrip_every_numpy_dtype():
    for dtype in NP_DTYPES:
        a = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
        tree = {"c": a, "t": a.transpose(2, 0, 1), "s": a[:, ::2, 1:], "z": a[:0],
                "0d": np.array(a.flat[5]), "scalar": a.flat[3]}
        roundtrip_everywhere(tree)
        out = _codec.decode(_codec.encode(tree))
        assert [type(v) for v in out.values()] == [np.ndarray] * 5 + [type(a.flat[3])]
        assert all(v.dtype == dtype for v in out.values()), dtype


def test_roundtrip_every_torch_dtype():
    for dtype in TORCH_DTYPES:
        t = (torch.arange(24) % 7).to(dtype).reshape(2, 3, 4)
        tree = [t, t.permute(2, 0, 1), t[:, ::2, 1:], t[:0], t[1, 2, 3], t.expand(2, 2, 3, 4)]
        roundtrip_everywhere(tree)
        out = _codec.decode(_codec.encode(tree))
        assert all(type(x) is torch.Tensor and x.dtype == dtype for x in out), dtype


def test_roundtrip_special_values():
    nan_payload = np.frombuffer(struct.pack("<Q", 0x7FF8DEADBEEF0001), np.float64)
    tree = {
        "nan": np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0]),
        "payload": nan_payload.copy(),
        "f16": np.array([np.nan, 65504, -0.0], np.float16),
        "cnan": torch.tensor([complex(float("nan"), 1)]),
        "bf16": torch.tensor([float("nan"), float("inf"), -0.0], dtype=torch.bfloat16),
        "ints": np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max]),
        "u64": np.array([2 ** 64 - 1], np.uint64), "pyf": float("nan"), "big": 10 ** 40,
        "": None, "\ud800": "key with a lone surrogate", "é": b"\x00",
    }
    roundtrip_everywhere(tree)
    out = _codec.decode(_codec.encode(tree))
    assert out["payload"].view(np.uint64)[0] == 0x7FF8DEADBEEF0001


def test_roundtrip_empty_arrays_with_large_dimensions():
    # A dimension may be larger than the slot when another one is 0: shape (0, 1000) is a
    # 128-byte encoding and must decode.
    tree = [np.empty((0, 1000)), np.empty((1000, 0, 7), np.int8), torch.empty(0, 5000),
            torch.empty(3000, 0, dtype=torch.bfloat16), np.empty((0, 2 ** 40), np.uint8)]
    assert len(_codec.encode(tree)) < 1000
    roundtrip_everywhere(tree)


def test_roundtrip_containers_and_order():
    tree = {"z": 1, "a": [Point(1, (2, [3])), Step({}, [], ())], "m": {"y": None, "b": ()}}
    out = _codec.decode(_codec.encode(tree))
    assert out == tree and list(out) == ["z", "a", "m"] and list(out["m"]) == ["y", "b"]
    assert type(out["a"][0]) is Point and type(out["a"][1]) is Step
    assert type(out["a"][0].y) is tuple and type(out["a"][0].y[1]) is list
    # dict subclasses and dicts with non-str keys travel pickled, with their type
    odd = [collections.OrderedDict(b=1, a=2), {1: "x", "s": np.arange(3)},
           collections.defaultdict(list, a=[1])]
    out = _codec.decode(_codec.encode(odd))
    assert [type(x) for x in out] == [type(x) for x in odd]
    assert list(out[0]) == ["b", "a"] and np.array_equal(out[1]["s"], np.arange(3))


def test_nesting_limit():
    deep = None
    for _ in range(100):
        deep = [deep]
    assert _codec.decode(_codec.encode(deep)) == deep  # 100 levels: allowed
    with pytest.raises(CodecError, match="nested"):
        _codec.prepare([deep])
    cyclic = []
    cyclic.append(cyclic)
    with pytest.raises(CodecError, match="nested"):
        _codec.prepare({"a": cyclic})


def test_write_checks_the_slot_size():
    p = _codec.prepare({"a": np.zeros(100)})
    with pytest.raises(CodecError, match="needs"):
        _codec.write(p, bytearray(p.nbytes - 1))
    with pytest.raises((BufferError, TypeError)):
        _codec.write(p, bytes(p.nbytes))  # not writable
    assert "bytes" in repr(p)
    # A Prepared() not made by prepare() is refused with the buffer released again (an
    # export left behind would lock the bytearray for good).
    buf = bytearray(4096)
    with pytest.raises(CodecError, match="prepare"):
        _codec.write(_codec.Prepared(), buf)
    buf.extend(b"x")


def test_a_frame_filled_in_place_decodes_like_a_written_encoding():
    """write_frame writes all but the arrays; filling them at array_layout's offsets gives
    the bytes write() gives, and the same decoded tree."""
    tree = {"b": torch.arange(12, dtype=torch.int16).view(3, 4), "meta": None,
            "a": (np.linspace(0, 1, 5), "text", torch.ones(2, dtype=torch.bfloat16))}
    p = _codec.prepare(tree)
    written = bytearray(p.nbytes)
    _codec.write(p, written)
    layout = p.array_layout()
    assert [type(leaf) for leaf, _, _ in layout] == [torch.Tensor, np.ndarray, torch.Tensor]
    framed = bytearray(p.nbytes)
    for _, off, nbytes in layout:
        framed[off:off + nbytes] = b"\xee" * nbytes   # garbage where the arrays go
    _codec.write_frame(p, framed)
    for _, off, nbytes in layout:   # the frame leaves the arrays' bytes alone
        assert framed[off:off + nbytes] == b"\xee" * nbytes
    for leaf, off, nbytes in layout:
        src = leaf if isinstance(leaf, np.ndarray) else leaf.view(torch.int16).numpy()
        assert src.nbytes == nbytes and off % _codec.ALIGN == 0
        framed[off:off + nbytes] = src.tobytes()
    assert framed == written
    out = _codec.decode(framed, copy=True)
    assert list(out) == ["b", "meta", "a"] and out["meta"] is None and out["a"][1] == "text"
    assert torch.equal(out["b"], tree["b"]) and np.array_equal(out["a"][0], tree["a"][0])
    assert out["a"][2].dtype == torch.bfloat16 and torch.equal(out["a"][2], tree["a"][2])
    with pytest.raises(CodecError, match="needs"):
        _codec.write_frame(p, bytearray(p.nbytes - 1))
    with pytest.raises(CodecError, match="prepare"):
        _codec.Prepared().array_layout()


def test_write_rejects_sources_resized_after_prepare():
    # write() copies the byte count recorded by prepare() from the source's current data
    # pointer, so it must refuse a source that shrank since: a tensor set_ to an empty
    # storage would make it read address 0 (a segfault), a shrunken ndarray past its buffer.
    t = torch.arange(1 << 16, dtype=torch.float64)
    p = _codec.prepare({"t": t})
    t.set_(torch.empty(0, dtype=torch.float64))
    with pytest.raises(CodecError, match="changed size"):
        _codec.write(p, bytearray(p.nbytes))
    a = np.arange(1 << 16, dtype=np.float64)
    p = _codec.prepare([a])
    a.resize(0, refcheck=False)
    with pytest.raises(CodecError, match="changed size"):
        _codec.encode_prepared(p)
    # values changed in place (same size) are simply written as they are at write()
    b = np.zeros(4)
    p = _codec.prepare(b)
    b[:] = 7
    assert np.array_equal(_codec.decode(_codec.encode_prepared(p)), np.full(4, 7.0))


# -----------------------------------------------------------------------------------------
# 2. Tensors the codec refuses: off the CPU, or of a dtype it cannot carry
# -----------------------------------------------------------------------------------------

def test_tensor_on_another_device_is_refused():
    t = torch.empty(3, device="meta")
    for obj in (t, {"obs": [1, (t,)]}, Point(np.zeros(2), t)):
        with pytest.raises(CodecError, match="meta"):
            _codec.prepare(obj)
        with pytest.raises(CodecError, match="on meta"):
            _codec.encode(obj)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_unsupported_torch_dtypes_are_refused_when_encoding():
    for name in ("float8_e4m3fn", "complex32", "uint4"):
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        t = torch.zeros(4, dtype=torch.uint8).view(dt) if name != "complex32" else \
            torch.zeros(4, dtype=torch.complex32)
        with pytest.raises(CodecError, match=f"{name}.*not supported"):
            _codec.prepare({"x": t})


# -----------------------------------------------------------------------------------------
# 3. Corrupt slots: hand-crafted dangerous cases, then fuzzing (in process and in a child)
# -----------------------------------------------------------------------------------------

HEADER_FIELDS = {"magic": (0, 4), "version": (4, 2), "flags": (6, 2), "total_len": (8, 8),
                 "meta_len": (16, 4), "n_arrays": (20, 4), "n_objects": (24, 4),
                 "blob_off": (32, 8), "blob_len": (40, 8)}


def header(buf):
    return {k: int.from_bytes(buf[o:o + n], "little") for k, (o, n) in HEADER_FIELDS.items()}


def set_field(buf, pos, size, value):
    buf[pos:pos + size] = (value & ((1 << (8 * size)) - 1)).to_bytes(size, "little")


def set_header(buf, **fields):
    for k, v in fields.items():
        set_field(buf, *HEADER_FIELDS[k], v)
    return buf


def craft(meta, data_len=256, objects=None):
    """A slot holding tree description ``meta`` (consistent header), ``data_len`` bytes of
    data after it, and optionally a pickled list of ``objects``."""
    data_start = 64 + len(meta)
    blob = pickle.dumps(objects) if objects is not None else b""
    total = data_start + len(blob) + data_len
    buf = bytearray(total)
    set_header(buf, magic=_codec.MAGIC, version=1, total_len=total, meta_len=len(meta),
               n_objects=len(objects or ()))
    if objects is not None:
        set_header(buf, blob_off=data_start, blob_len=len(blob))
        buf[data_start:data_start + len(blob)] = blob
    buf[64:data_start] = meta
    return buf


def tok_array(shape, off, nbytes, kind=0, code=10, ndim=None):
    return (b"A" + bytes([kind, code, len(shape) if ndim is None else ndim])
            + b"".join(struct.pack("<Q", d) for d in shape) + struct.pack("<QQ", off, nbytes))


def tok_count(tag, n):
    return tag + struct.pack("<I", n)


def tok_named(name, n):
    nb = name.encode() if isinstance(name, str) else name
    return b"M" + struct.pack("<I", len(nb)) + nb + struct.pack("<I", n)


# (meta, data_len, objects, header overrides, buffer length change)
_M = 64 + 64  # the first 64-aligned data offset after a short tree description
DANGEROUS = {
    "array past the end": (tok_array((100,), _M, 400), 256, None, {}, 0),
    "array straddles the end": (tok_array((20,), _M + 192, 80), 256, None, {}, 0),
    "array offset+nbytes wraps": (tok_array((2,), 2 ** 64 - 4, 8), 256, None, {}, 0),
    "array offset huge": (tok_array((0,), 2 ** 63, 0), 256, None, {}, 0),
    "array inside the header": (tok_array((4,), 0, 16), 256, None, {}, 0),
    "array inside the description": (tok_array((1,), 64, 4), 256, None, {}, 0),
    "nbytes disagrees with shape": (tok_array((4,), _M, 8), 256, None, {}, 0),
    "nbytes larger than shape": (tok_array((4,), _M, 2 ** 64 - 1), 256, None, {}, 0),
    "shape product overflows 64 bits": (tok_array((2 ** 32, 2 ** 32, 16), _M, 0), 256, None,
                                        {}, 0),
    "shape product wraps to small": (tok_array((2 ** 62, 4, 4), _M, 0), 256, None, {}, 0),
    "overflowing shape with a zero": (tok_array((2 ** 40, 2 ** 40, 0), _M, 0), 256, None, {},
                                      0),
    "dimension 2**64-1": (tok_array((2 ** 64 - 1,), _M, 0), 256, None, {}, 0),
    "ndim 33": (tok_array((1,) * 33, 64 + 284 + 36, 4), 256, None, {}, 0),  # else valid
    "ndim 255 (truncated dims)": (tok_array((1,), _M, 4, ndim=255), 256, None, {}, 0),
    "dtype code 15": (tok_array((1,), _M, 4, code=15), 256, None, {}, 0),
    "dtype code 255": (tok_array((1,), _M, 4, code=255), 256, None, {}, 0),
    "bfloat16 code for numpy": (tok_array((1,), _M, 2, code=14), 256, None, {}, 0),
    "array kind 2": (tok_array((1,), _M, 4, kind=2), 256, None, {}, 0),
    "misaligned offset": (tok_array((1,), _M + 1, 4), 256, None, {}, 0),
    "dict count 2**31": (tok_count(b"D", 2 ** 31), 256, None, {}, 0),
    "list count 2**32-1": (tok_count(b"L", 2 ** 32 - 1), 256, None, {}, 0),
    "tuple count > bytes left": (tok_count(b"T", 3) + b"NN", 256, None, {}, 0),
    "dict key length 2**32-1": (tok_count(b"D", 1) + struct.pack("<I", 2 ** 32 - 1), 256,
                                None, {}, 0),
    "dict key not utf-8": (tok_count(b"D", 1) + struct.pack("<I", 1) + b"\xff" + b"N", 256,
                           None, {}, 0),
    "nesting 101 deep": (tok_count(b"L", 1) * 101 + b"N", 256, None, {}, 0),
    "nesting 100000 deep": (tok_count(b"T", 1) * 100000 + b"N", 256, None, {}, 0),
    "unknown tag": (b"Z", 256, None, {}, 0),
    "tag 0": (b"\x00", 256, None, {}, 0),
    "stray bytes after the tree": (b"NN", 256, None, {}, 0),
    "truncated token": (tok_array((3,), _M, 12)[:-5], 256, None, {}, 0),
    "empty description": (b"", 256, None, {}, 0),
    "namedtuple module missing": (tok_named("no_such_module_xyz:Point", 2) + b"NN", 256,
                                  None, {}, 0),
    "namedtuple class missing": (tok_named(f"{__name__}:Nope", 2) + b"NN", 256, None, {},
                                 0),
    "namedtuple not a namedtuple": (tok_named("os:path", 1) + b"N", 256, None, {}, 0),
    "namedtuple wrong field count": (tok_named(f"{__name__}:Point", 3) + b"NNN", 256, None,
                                     {}, 0),
    "namedtuple empty name": (tok_named("", 0), 256, None, {}, 0),
    "namedtuple name not utf-8": (tok_named(b"\xff\xfe", 0), 256, None, {}, 0),
    "namedtuple field count 2**31": (tok_named(f"{__name__}:Point", 2 ** 31), 256, None, {},
                                     0),
    "object index out of order": (b"O" + struct.pack("<I", 1), 256, [1, 2], {}, 0),
    "object index 2**32-1": (b"O" + struct.pack("<I", 2 ** 32 - 1), 256, [1], {}, 0),
    "objects but header says none": (b"O\0\0\0\0", 256, [1], {"n_objects": 0}, 0),
    "more objects in header": (b"O\0\0\0\0", 256, [1], {"n_objects": 2}, 0),
    "blob past the end": (b"O\0\0\0\0", 256, [1], {"blob_off": 2 ** 20}, 0),
    "blob length wraps": (b"O\0\0\0\0", 256, [1], {"blob_len": 2 ** 64 - 1}, 0),
    "blob inside the header": (b"O\0\0\0\0", 256, [1], {"blob_off": 8}, 0),
    "blob not a pickle": (b"O\0\0\0\0", 256, [1], {"blob_off": 128 + 16}, 0),
    "blob not a list": (b"O\0\0\0\0", 256, None, {}, 0),  # blob fields set below
    "bad magic": (b"N", 0, None, {"magic": 0x12345678}, 0),
    "bad version": (b"N", 0, None, {"version": 2}, 0),
    "total_len larger than the buffer": (b"N", 0, None, {}, -1),
    "total_len 2**64-1": (b"N", 0, None, {"total_len": 2 ** 64 - 1}, 0),
    "total_len smaller than the header": (b"N", 0, None, {"total_len": 10}, 0),
    "meta_len larger than the buffer": (b"N", 0, None, {"meta_len": 10 ** 6}, 0),
    "meta_len 2**32-1": (b"N", 0, None, {"meta_len": 2 ** 32 - 1}, 0),
    "meta_len past total_len": (b"N", 100, None, {"meta_len": 100, "total_len": 100}, 0),
}


def build_dangerous(name):
    meta, data_len, objects, fields, shrink = DANGEROUS[name]
    buf = craft(meta, data_len, objects)
    if name == "blob not a list":
        blob = pickle.dumps({"not": "a list"})
        set_header(buf, n_objects=1, blob_off=64 + len(meta), blob_len=len(blob))
        buf[64 + len(meta):64 + len(meta) + len(blob)] = blob
        buf[64:64 + len(meta)] = b"O\0\0\0\0"
    set_header(buf, **fields)
    if shrink:
        del buf[shrink:]  # total_len now says more than the buffer holds
    return buf


def test_dangerous_slots_raise_codec_error():
    # one test, not one per case: the leak check of conftest costs a gc.collect per test
    wrong = []
    for name in DANGEROUS:
        buf = build_dangerous(name)
        for copy in (False, True):
            for view in (bytes(buf), bytearray(buf), _codec.SlotLease(bytearray(buf))):
                _codec.clear_plan_cache()
                try:
                    _codec.decode(view, copy=copy)
                except CodecError:
                    pass
                except Exception as e:  # noqa: BLE001
                    wrong.append((name, f"raised {type(e).__name__}: {e}"))
                else:
                    wrong.append((name, "decoded"))
        # nothing invalid is cached (a bad blob comes after a valid description)
        assert _codec.plan_cache_size() == (name in ("blob not a pickle", "blob not a list")), name
    assert not wrong, wrong


def test_short_buffers_raise_codec_error():
    valid = _codec.encode({"a": np.arange(10)})
    for n in (0, 1, 4, 63, 64, len(valid) - 1):
        with pytest.raises(CodecError):
            _codec.decode(valid[:n])
        with pytest.raises(CodecError):
            _codec.decode(_codec.SlotLease(valid, 0, n))


def test_crafted_valid_slots_decode():
    """The crafting helpers are right: the same layouts with sane values decode."""
    buf = craft(tok_array((3, 2), _M, 24, code=10), 256)
    out = _codec.decode(buf)
    assert out.shape == (3, 2) and out.dtype == np.float32
    buf = craft(tok_named(f"{__name__}:Point", 2) + b"O\0\0\0\0" + b"N", 0, ["obj"])
    assert _codec.decode(buf) == Point("obj", None)
    buf = craft(tok_array((0, 2 ** 40, 2 ** 20), _M, 0, code=1), 64)  # empty, huge dims
    assert _codec.decode(buf).shape == (0, 2 ** 40, 2 ** 20)
    buf = craft(tok_count(b"L", 1) * 100 + b"N", 0)
    assert _codec.decode(buf) is not None


def test_cached_plan_is_still_checked_against_the_slot():
    enc = _codec.encode({"a": np.arange(100.0)})
    _codec.decode(enc)
    assert _codec.plan_cache_size() == 1
    # same tree description, but the slot is now too short for the array: a cache hit
    short = enc[:len(enc) - 64]
    set_header(short, total_len=len(short))
    with pytest.raises(CodecError):
        _codec.decode(short)
    obj_enc = _codec.encode([1, "x"])
    _codec.decode(obj_enc)
    set_header(obj_enc, n_objects=1)
    with pytest.raises(CodecError):
        _codec.decode(obj_enc)
    assert _codec.plan_cache_size() == 2


def test_corrupt_pickle_blob_raises_codec_error():
    enc = _codec.encode({"s": "hello", "n": 12345})
    h = header(enc)
    blob = bytearray(enc)
    blob[h["blob_off"]:h["blob_off"] + h["blob_len"]] = b"\xff" * h["blob_len"]
    with pytest.raises(CodecError, match="pickled"):
        _codec.decode(blob)
    cut = set_header(bytearray(enc), blob_len=h["blob_len"] - 3)
    with pytest.raises(CodecError, match="pickled"):
        _codec.decode(cut)


# -- fuzzing ------------------------------------------------------------------------------

# The blob is a pickle, which the codec trusts (see its docstring).  CPython's C unpickler
# sizes its memo table from an opcode argument, so a random byte can make it allocate
# gigabytes; and a random GLOBAL could name any callable.  The fuzz therefore decodes with
# pickle.loads replaced by the pure-Python unpickler (memo in a dict) restricted to the few
# classes the corpus pickles.  Everything the codec itself parses is fuzzed as is.
_FUZZ_GLOBALS = {("fractions", "Fraction"), ("builtins", "complex"), ("builtins", "set"),
                 ("builtins", "frozenset")}


class _FuzzUnpickler(pickle._Unpickler):
    def find_class(self, module, name):
        if (module, name) in _FUZZ_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"fuzz: global {module}.{name} refused")


def _fuzz_loads(data):
    return _FuzzUnpickler(io.BytesIO(bytes(data))).load()


@contextlib.contextmanager
def guarded_pickle():
    saved = pickle.loads
    pickle.loads = _fuzz_loads
    try:
        yield
    finally:
        pickle.loads = saved


def fuzz_corpus():
    trees = [
        {"obs": np.arange(12, dtype=np.float32).reshape(3, 4), "act": torch.arange(5),
         "info": {"name": "ep", "n": 3, "f": fractions.Fraction(1, 3)},
         "pt": Point(3, [None, b"xy"])},
        [np.zeros((2, 0)), np.ones((), np.complex128), (None, b"xy"),
         torch.ones(2, 2, dtype=torch.bfloat16), torch.tensor([True, False])],
        Point(x=np.arange(6, dtype=np.int16)[::2], y=[{"a": None, "b": {1, 2}}]),
        np.arange(40, dtype=np.float64).reshape(2, 4, 5),
        [[[[np.arange(3, dtype=np.uint64)]]]],
        Step(obs={"img": np.zeros((4, 4, 3), np.uint8), "v": torch.zeros(3, 2).t()},
             reward=1.5, done=complex(1, 2)),
        {"e": np.empty((0, 100)), "t": torch.empty(7, 0, dtype=torch.float16), "s": "x"},
    ]
    return [bytes(_codec.encode(t)) for t in trees]


def tree_fields(buf):
    """(integer fields as (position, size), tag positions) of a valid slot's tree."""
    fields, tags = [], []
    pos = 64
    u32 = lambda p: struct.unpack_from("<I", buf, p)[0]  # noqa: E731

    def node():
        nonlocal pos
        tag = buf[pos]
        tags.append(pos)
        pos += 1
        if tag == ord("N"):
            return
        if tag in b"DLT":
            fields.append((pos, 4))
            n = u32(pos)
            pos += 4
            for _ in range(n):
                if tag == ord("D"):
                    fields.append((pos, 4))
                    pos += 4 + u32(pos)
                node()
        elif tag == ord("M"):
            fields.append((pos, 4))
            pos += 4 + u32(pos)
            fields.append((pos, 4))
            n = u32(pos)
            pos += 4
            for _ in range(n):
                node()
        elif tag == ord("A"):
            fields.extend([(pos, 1), (pos + 1, 1), (pos + 2, 1)])
            ndim = buf[pos + 2]
            pos += 3
            for _ in range(ndim + 2):  # the dimensions, the offset, nbytes
                fields.append((pos, 8))
                pos += 8
        elif tag == ord("O"):
            fields.append((pos, 4))
            pos += 4
        else:
            raise AssertionError(f"bad tag {tag}")

    node()
    assert pos == 64 + header(buf)["meta_len"]
    return fields, tags


SPECIAL_VALUES = [0, 1, 2, 3, 7, 8, 15, 16, 31, 32, 33, 63, 64, 65, 100, 101, 127, 128, 255,
                  256, 2 ** 15, 2 ** 16 - 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32,
                  2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 64, 2 ** 64 - 1]
TAG_VALUES = list(b"NDLTMAO") + [0, 0x5A, 0xFF]


def resolve_value(v, buf):
    if isinstance(v, tuple):  # ("len", delta): relative to the buffer's length
        return max(0, len(buf) + v[1])
    return v


def apply_mutation(buf, mut, fields, tags):
    kind = mut[0]
    if kind == "truncate":
        del buf[mut[1] % (len(buf) + 1):]
    elif not buf:
        return
    elif kind == "flip":
        buf[mut[1] % len(buf)] ^= mut[2]
    elif kind == "byte":
        buf[mut[1] % len(buf)] = mut[2]
    elif kind == "header":
        pos, size = HEADER_FIELDS[mut[1]]
        if pos + size <= len(buf):
            set_field(buf, pos, size, resolve_value(mut[2], buf))
    elif kind == "token" and fields:
        pos, size = fields[mut[1] % len(fields)]
        if pos + size <= len(buf):
            set_field(buf, pos, size, resolve_value(mut[2], buf))
    elif kind == "tag" and tags:
        pos = tags[mut[1] % len(tags)]
        if pos < len(buf):
            buf[pos] = mut[2]


values_st = st.one_of(st.sampled_from(SPECIAL_VALUES), st.integers(0, 2 ** 64 - 1),
                      st.tuples(st.just("len"), st.integers(-130, 130)))
mutations_st = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 2 ** 16)),
    st.tuples(st.just("flip"), st.integers(0, 2 ** 16), st.integers(1, 255)),
    st.tuples(st.just("byte"), st.integers(0, 2 ** 16), st.integers(0, 255)),
    st.tuples(st.just("header"), st.sampled_from(sorted(HEADER_FIELDS)), values_st),
    st.tuples(st.just("token"), st.integers(0, 2 ** 16), values_st),
    st.tuples(st.just("tag"), st.integers(0, 2 ** 16), st.sampled_from(TAG_VALUES)),
)


def random_mutation(rng):
    kind = rng.choice(["truncate", "flip", "byte", "header", "header", "token", "token",
                       "token", "tag"])
    r = rng.random()
    value = (rng.choice(SPECIAL_VALUES) if r < 0.5 else
             ("len", rng.randint(-130, 130)) if r < 0.7 else rng.getrandbits(64))
    if kind == "truncate":
        return (kind, rng.getrandbits(16))
    if kind == "flip":
        return (kind, rng.getrandbits(16), rng.randint(1, 255))
    if kind == "byte":
        return (kind, rng.getrandbits(16), rng.randint(0, 255))
    if kind == "header":
        return (kind, rng.choice(sorted(HEADER_FIELDS)), value)
    if kind == "token":
        return (kind, rng.getrandbits(16), value)
    return (kind, rng.getrandbits(16), rng.choice(TAG_VALUES))


def check_decoded(out, lo, hi, copy):
    """Every array view of the slot lies inside it; read every byte of every array."""
    stack = [out]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, (np.ndarray, torch.Tensor)):
            if (x.numel() if isinstance(x, torch.Tensor) else x.size) == 0:
                continue
            a, b = array_range(x)
            if not copy:
                assert lo <= a and b <= hi, f"array [{a:#x}, {b:#x}) outside [{lo:#x}, {hi:#x})"
            else:
                assert b <= lo or a >= hi, "copy=True returned a view of the slot"
            if isinstance(x, torch.Tensor):
                x.clone()
            else:
                x.tobytes()


def fuzz_one(original, muts, fields, tags, mode, copy, use_cache, guard=None):
    """Decode one corrupted copy of ``original``; True if it decoded, False if it raised
    CodecError; anything else fails.  ``guard``: an mmap whose last bytes hold the slot,
    followed by an inaccessible page."""
    buf = bytearray(original)
    for m in muts:
        apply_mutation(buf, m, fields, tags)
    if use_cache:
        _codec.decode(original)  # a cached plan for the original description
    else:
        _codec.clear_plan_cache()
    if guard is not None:
        mem, end = guard
        start = end - len(buf)
        mem[start:end] = buf
        view = _codec.SlotLease(mem, start, len(buf))
        mode = "lease"
    elif mode == "bytes":
        view = bytes(buf)
    elif mode == "lease":
        view = _codec.SlotLease(buf)
    else:
        view = buf
    lo, hi = buffer_range(view) if len(buf) else (0, 0)
    try:
        out = _codec.decode(view, copy=copy)
    except CodecError:
        return False
    if mode != "bytes" or copy:
        check_decoded(out, lo, hi, copy)
    return True


CORPUS = None


def corpus_with_fields():
    global CORPUS
    if CORPUS is None:
        CORPUS = [(enc,) + tree_fields(enc) for enc in fuzz_corpus()]
    return CORPUS


@settings(max_examples=800, **HYPO)
@given(which=st.integers(0, 6), muts=st.lists(mutations_st, min_size=1, max_size=4),
       mode=st.sampled_from(["bytearray", "bytes", "lease"]), copy=st.booleans(),
       use_cache=st.booleans())
def test_fuzz_corrupted_slots(which, muts, mode, copy, use_cache):
    original, fields, tags = corpus_with_fields()[which]
    with guarded_pickle():
        fuzz_one(original, muts, fields, tags, mode, copy, use_cache)


def test_fuzz_corpus_is_valid():
    for enc, fields, tags in corpus_with_fields():
        assert fields and tags
        _codec.decode(enc)
        # a mutation that changes nothing keeps it valid; a zero magic never is
        assert fuzz_one(enc, [("truncate", len(enc))], fields, tags, "lease", False, False)
        assert not fuzz_one(enc, [("header", "magic", 0)], fields, tags, "lease", False,
                            False)


def _guarded_mapping():
    """An mmap whose last page is made inaccessible: returns (mmap, end of usable bytes)."""
    page = mmap.PAGESIZE
    mem = mmap.mmap(-1, 64 * page)
    addr = np.frombuffer(mem, np.uint8).ctypes.data
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(ctypes.c_void_p(addr + 63 * page), page, 0) != 0:  # PROT_NONE
        raise OSError(ctypes.get_errno(), "mprotect")
    return mem, 63 * page


def _fuzz_child(seed, n):
    """Run in a spawned process: ``n`` random corruptions, each decoded from the end of a
    mapping followed by a guard page (an out-of-bounds read would crash the process)."""
    rng = random.Random(seed)
    corpus = corpus_with_fields()
    mem, end = _guarded_mapping()
    decoded = 0
    with guarded_pickle():
        for i in range(n):
            original, fields, tags = rng.choice(corpus)
            muts = [random_mutation(rng) for _ in range(rng.randint(1, 4))]
            copy = rng.random() < 0.3
            use_cache = rng.random() < 0.3
            guard = (mem, end) if i % 2 == 0 else None
            decoded += fuzz_one(original, muts, fields, tags, rng.choice(
                ["bytearray", "bytes", "lease"]), copy, use_cache, guard)
    assert 0 < decoded < n, decoded  # some corruptions decode, most do not


def test_fuzz_in_a_child_process_does_not_crash():
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_fuzz_child, args=(12345, 4000))
    p.start()
    p.join(120)
    if p.is_alive():
        p.kill()
        p.join()
        pytest.fail("the fuzz child did not finish in 120 s")
    assert p.exitcode == 0, f"fuzz child exited with {p.exitcode} (-11 is a segfault)"


def test_guard_page_would_catch_an_out_of_bounds_read():
    """The child's guard page really faults: reading past the slot kills a process."""
    import subprocess
    code = ("import ctypes, numpy as np, test_codec as t; mem, end = t._guarded_mapping(); "
            "ctypes.string_at(np.frombuffer(mem, np.uint8).ctypes.data + end - 1, 1); "
            "print('inside ok', flush=True); "
            "ctypes.string_at(np.frombuffer(mem, np.uint8).ctypes.data + end, 1)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       cwd=os.path.dirname(__file__), timeout=60)
    assert b"inside ok" in r.stdout, r.stderr[-2000:]
    assert r.returncode == -11, (r.returncode, r.stderr[-500:])


# -----------------------------------------------------------------------------------------
# 4. Zero-copy views and safe recycling of slots
# -----------------------------------------------------------------------------------------

def _encode_into(obj, buf, offset=0, on_release=None, token=None):
    p = _codec.prepare(obj)
    _codec.write(p, _codec.SlotLease(buf, offset, p.nbytes))
    return _codec.SlotLease(buf, offset, p.nbytes, on_release, token)


def test_views_share_memory_with_the_slot():
    slot = bytearray(1 << 16)
    lease = _encode_into({"a": np.arange(10, dtype=np.int32), "t": torch.zeros(4, 2)}, slot,
                         128)
    out = _codec.decode(lease)
    del lease
    whole = np.frombuffer(slot, np.uint8)
    assert np.shares_memory(out["a"], whole)
    a_off = out["a"].ctypes.data - whole.ctypes.data
    t_off = out["t"].data_ptr() - whole.ctypes.data
    assert 128 <= a_off < len(slot) and 128 <= t_off < len(slot)
    assert (a_off - 128) % _codec.ALIGN == 0 == (t_off - 128) % _codec.ALIGN
    out["a"][3] = -7
    assert struct.unpack_from("<i", slot, a_off + 12)[0] == -7
    out["t"][1, 1] = 2.5
    assert struct.unpack_from("<f", slot, t_off + 12)[0] == 2.5
    # and the other way round: writes into the slot show through the views
    struct.pack_into("<i", slot, a_off, 99)
    struct.pack_into("<f", slot, t_off, -1.5)
    assert out["a"][0] == 99 and out["t"][0, 0].item() == -1.5
    del whole


def test_lease_released_after_the_last_view_exactly_once():
    released = []
    seg = Segment.create(1 << 16)
    try:
        lease = _encode_into({"a": np.arange(8.0), "t": torch.arange(6).reshape(2, 3),
                              "o": "pickled"}, seg, 4096, released.append, 17)
        out = _codec.decode(lease)
        del lease
        a, t, o = out["a"], out["t"], out["o"]
        from_a = torch.from_numpy(a)  # a torch tensor made from a view
        part = a[2:5]                 # a numpy view of a view
        del out
        assert released == []
        del a
        assert released == []  # t, part and from_a hold the slot
        del t
        assert released == []  # part and from_a
        del part, o
        gc.collect()
        assert released == []  # from_a still holds the slot, even through a collection
        from_a += 1
        del from_a
        assert released == [17]
        gc.collect()
        assert released == [17]
    finally:
        seg.close()


def test_lease_released_at_once_with_copy_true():
    released = []
    slot = bytearray(1 << 14)
    p = _codec.prepare({"a": np.arange(8.0), "t": torch.arange(6), "b": torch.ones(2).bool()})
    _codec.write(p, slot)
    out = _codec.decode(_codec.SlotLease(slot, 0, p.nbytes, released.append, "t"), copy=True)
    assert released == ["t"]
    assert out["a"].flags.owndata and out["a"].flags.writeable
    slot[:] = bytes(len(slot))  # the slot is reused: the results must not change
    slot.extend(b"!")           # nothing exports the bytearray any more
    assert np.array_equal(out["a"], np.arange(8.0))
    assert torch.equal(out["t"], torch.arange(6)) and out["b"].all()


def test_lease_without_arrays_is_released_at_once():
    released = []
    lease = _encode_into({"x": [1, 2], "y": None}, bytearray(4096), 0, released.append, 1)
    out = _codec.decode(lease)
    del lease
    assert released == [1] and out == {"x": [1, 2], "y": None}


def test_lease_bounds():
    buf = bytearray(100)
    assert _codec.SlotLease(buf, 10).length == 90
    assert _codec.SlotLease(buf, 100).length == 0
    assert _codec.SlotLease(buf, 10, 90).length == 90
    # including offset + length past Py_ssize_t (an overflow must not pass the check)
    for offset, length in [(-1, None), (101, None), (0, 101), (10, 91), (1, -1),
                           (1, sys.maxsize), (sys.maxsize, 1), (sys.maxsize, None)]:
        with pytest.raises(ValueError):
            _codec.SlotLease(buf, offset, length)
    buf.extend(b"x")  # failed leases released their export


def test_lease_read_only_source():
    data = bytes(_codec.encode({"a": np.arange(4), "t": torch.ones(3)}))
    lease = _codec.SlotLease(data)
    assert lease.readonly
    with pytest.raises(BufferError):
        _codec.write(_codec.prepare(None), lease)
    out = _codec.decode(lease)
    assert not out["a"].flags.writeable
    out["t"] += 1  # tensors of read-only memory are copies


def test_tensors_of_read_only_memory_are_shared_when_asked():
    value = {"a": np.arange(4), "t": torch.arange(3.0), "b": torch.ones(2, dtype=torch.bfloat16)}
    data = bytes(_codec.encode(value))
    base = np.frombuffer(data, np.uint8).ctypes.data
    out = _codec.decode(data, share_readonly=True)
    assert not out["a"].flags.writeable
    for k in ("t", "b"):   # views of the read-only bytes, bit for bit
        assert base <= out[k].data_ptr() < base + len(data)
        assert out[k].dtype == value[k].dtype and torch.equal(out[k], value[k])
    copied = _codec.decode(data, copy=True, share_readonly=True)
    assert not base <= copied["t"].data_ptr() < base + len(data)
    assert copied["a"].flags.writeable
    writable = bytearray(data)
    assert _codec.decode(writable, share_readonly=True)["a"].flags.writeable


def test_raising_callback_still_releases_the_source(monkeypatch):
    # An exception from on_release must not skip PyBuffer_Release in __dealloc__: the
    # source would stay exported (locked bytearray, pinned Segment mapping) for good.
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    buf = bytearray(4096)
    calls = []

    def boom(token):
        calls.append(token)
        raise RuntimeError("boom")

    out = _codec.decode(_encode_into(np.arange(3), buf, 0, boom, 3))
    del out
    assert calls == [3] and len(unraisable) == 1
    buf.extend(b"x")  # no export left


def test_held_batches_never_change_while_slots_are_recycled():
    n_slots, slot_size = 8, 8192
    seg = Segment.create(n_slots * slot_size)
    free = collections.deque(range(n_slots))
    in_use = set()

    def release(slot):
        assert slot in in_use, "a slot was released twice"
        in_use.discard(slot)
        free.append(slot)

    def send(i):
        batch = {"obs": np.full((8, 16), i, np.float32), "t": torch.full((5,), i),
                 "p": Point(np.arange(4) + i, i), "s": f"batch {i}"}
        slot = free.popleft()
        assert slot not in in_use
        in_use.add(slot)
        lease = _encode_into(batch, seg, slot * slot_size, release, slot)
        return _codec.decode(lease), batch

    try:
        held = [send(i) for i in range(5)]  # held for the whole test: 5 slots pinned
        recent = collections.deque(maxlen=2)
        for i in range(5, 400):
            out, batch = send(i)
            assert_same(batch, out, "view", buffer_range(seg))
            recent.append(out)
            assert len(in_use) == 5 + len(recent)
        for out, batch in held:
            assert_same(batch, out, "view", buffer_range(seg))
        del out, batch, held
        recent.clear()
        gc.collect()
        assert sorted(free) == list(range(n_slots)) and not in_use
    finally:
        seg.close()


# -----------------------------------------------------------------------------------------
# 5. The plan cache
# -----------------------------------------------------------------------------------------

def test_plan_cache_one_plan_per_tree_shape():
    assert _codec.plan_cache_size() == 0
    for i in range(50):
        out = _codec.decode(_codec.encode({"obs": np.full((4, 3), i), "r": float(i),
                                           "info": Point(i, f"s{i}")}))
        assert out["obs"][0, 0] == i and out["info"] == Point(i, f"s{i}")
    assert _codec.plan_cache_size() == 1
    _codec.decode(_codec.encode({"obs": np.zeros((5, 3), int), "r": 0.0, "info": Point(0, "")}))
    assert _codec.plan_cache_size() == 2
    _codec.decode(_codec.encode({"obs": np.zeros((4, 3), np.float32), "r": 0.0,
                                 "info": Point(0, "")}))
    assert _codec.plan_cache_size() == 3
    _codec.decode(_codec.encode({"obs": np.zeros((4, 3)), "r": 0.0, "info": Point(0, "")}))
    assert _codec.plan_cache_size() == 4  # the dtype is part of the description
    _codec.clear_plan_cache()
    assert _codec.plan_cache_size() == 0


def test_plan_cache_is_bounded():
    sizes = []
    for n in range(1, 600):
        out = _codec.decode(_codec.encode([np.zeros(n, np.uint8)]))
        assert out[0].shape == (n,)
        sizes.append(_codec.plan_cache_size())
    assert max(sizes) == 256
    assert sizes[:256] == list(range(1, 257))
    assert sizes[256] == 1  # full: cleared, then the new plan added
    assert all(s <= 256 for s in sizes)


# -----------------------------------------------------------------------------------------
# 6. Memory stays flat over many batches
# -----------------------------------------------------------------------------------------

def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_memory_is_flat_over_many_batches():
    n_slots, slot_size, n_batches = 6, 1 << 15, 10_000
    seg = Segment.create(n_slots * slot_size)
    free = collections.deque(range(n_slots))
    held = collections.deque(maxlen=3)
    samples = []
    try:
        for i in range(n_batches):
            batch = {"obs": np.full((32, 32), i % 251, np.uint8),
                     "state": torch.full((64,), float(i)),
                     "extra": [np.arange(16) * i, (i, "step")],
                     "p": Point(np.float32(i), None)}
            if i % 100 == 0:
                batch["shape"] = np.zeros(i % 7 + 1)  # a few distinct tree shapes too
            p = _codec.prepare(batch)
            slot = free.popleft()
            _codec.write(p, _codec.SlotLease(seg, slot * slot_size, slot_size))
            out = _codec.decode(_codec.SlotLease(seg, slot * slot_size, p.nbytes,
                                                 free.append, slot))
            assert out["obs"][0, 0] == i % 251 and out["extra"][1] == (i, "step")
            held.append(out)
            assert len(free) == n_slots - len(held)  # exactly the held batches pin slots
            if i % 250 == 249:
                samples.append(rss_bytes())
        held.clear()
        del out
        assert sorted(free) == list(range(n_slots))
        assert _codec.plan_cache_size() <= 10
    finally:
        seg.close()
    half = len(samples) // 2
    first, second = samples[1:half], samples[half:]
    growth = sum(second) / len(second) - sum(first) / len(first)
    assert growth < 8 << 20, f"RSS grew by {growth / 2**20:.1f} MiB over {n_batches // 2} batches"
    assert max(second) - min(second) < 16 << 20
