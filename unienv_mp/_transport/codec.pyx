# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Slot codec: a pytree of numpy arrays / torch tensors written straight into a slot, and
read back as views of it.

Slot format, version 1 (all integers little-endian):

    0   u32 magic 'UMPC'        4  u16 version      6  u16 flags (0)
    8   u64 total_len           bytes of the slot this encoding uses
    16  u32 meta_len            bytes of the tree description that starts at 64
    20  u32 n_arrays            24  u32 n_objects    28  u32 reserved
    32  u64 blob_off            40  u64 blob_len     (pickled list of non-array leaves)
    48  16 reserved bytes
    64  meta                    the tree description (grammar below)
    ..  blob, then each array's data, every one at a 64-byte aligned offset

Tree description, one token per node:

    'N'                                     None
    'D' u32 n  { u32 len, utf-8 key, node } a dict (str keys, order kept)
    'L' u32 n  node*                        a list
    'T' u32 n  node*                        a tuple
    'M' u32 len, "module:qualname", u32 n, node*   a namedtuple
    'A' u8 kind, u8 dtype, u8 ndim, u64 shape[ndim], u64 offset, u64 nbytes
                                            an array (kind 0: numpy, 1: torch)
    'O' u32 index                           the index-th object of the pickled blob

The description holds shapes and offsets but no data, so a stream of same-shaped batches
repeats the same description byte for byte: the decoder keys its cache of parsed plans on
those bytes and, on a hit, only makes the views.  Everything read from a slot is checked
against the slot's bounds before use; a slot that is not a valid encoding raises
`CodecError`.  (The blob is unpickled: like ``multiprocessing``, the codec trusts the
processes it shares memory with not to send hostile pickles.)
"""
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t
from libc.string cimport memcmp, memcpy, memset
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.ref cimport Py_INCREF
from cpython.object cimport PyObject, PyTypeObject

cimport numpy as cnp

import importlib as _importlib
import pickle as _pickle
import sys as _sys

import numpy as _np

from ..errors import CodecError

cnp.import_array()

__all__ = ["MAGIC", "VERSION", "HEADER_SIZE", "ALIGN", "Prepared", "prepare", "encode",
           "decode", "encode_prepared", "write", "write_frame", "SlotLease", "clear_plan_cache",
           "plan_cache_size"]

cdef extern from "umr_rows.h":
    void umr_copy_stream(unsigned char *dst, const unsigned char *src, uint64_t n) nogil

cdef extern from "numpy/arrayobject.h":
    ctypedef struct _Descr "PyArray_Descr":
        pass
    ctypedef struct _ArrayObject "PyArrayObject":
        pass
    object PyArray_NewFromDescr_raw "PyArray_NewFromDescr" (
        PyTypeObject *subtype, _Descr *descr, int nd, cnp.npy_intp *dims,
        cnp.npy_intp *strides, void *data, int flags, PyObject *obj)
    int PyArray_SetBaseObject_raw "PyArray_SetBaseObject" (_ArrayObject *arr,
                                                            PyObject *obj) except -1

DEF C_HEADER = 64
DEF C_ALIGN = 64
MAGIC = 0x43504D55  # b"UMPC"
VERSION = 1
HEADER_SIZE = C_HEADER
ALIGN = C_ALIGN
DEF MAX_NDIM = 32
DEF MAX_DEPTH = 100
DEF PLAN_CACHE_MAX = 256
DEF BIG_COPY = 1 << 16  # release the GIL for copies at least this large

cdef uint32_t C_MAGIC = 0x43504D55
cdef uint16_t C_VERSION = 1

cdef enum:
    KIND_NUMPY = 0
    KIND_TORCH = 1

# dtype codes: numpy name, and the torch dtype name when torch has one.  bfloat16 has no
# numpy dtype: its bits travel as uint16.
_DTYPES = [
    ("bool", "bool"), ("int8", "int8"), ("uint8", "uint8"), ("int16", "int16"),
    ("uint16", "uint16"), ("int32", "int32"), ("uint32", "uint32"), ("int64", "int64"),
    ("uint64", "uint64"), ("float16", "float16"), ("float32", "float32"),
    ("float64", "float64"), ("complex64", "complex64"), ("complex128", "complex128"),
    ("uint16", "bfloat16"),
]
cdef list _NP_DESCRS = [_np.dtype(n) for n, _ in _DTYPES]
cdef dict _NP_CODE = {}
for _i, (_n, _t) in enumerate(_DTYPES):
    if _t != "bfloat16":
        _NP_CODE[_np.dtype(_n)] = _i
cdef int CODE_BFLOAT16 = len(_DTYPES) - 1
cdef list _TORCH_DTYPES = None   # filled on first use of torch
cdef dict _TORCH_CODE = None
cdef object _torch_from_numpy = None


cdef object _torch_module():
    return _sys.modules.get("torch")


cdef int _init_torch(torch) except -1:
    global _TORCH_DTYPES, _TORCH_CODE, _torch_from_numpy
    if _TORCH_DTYPES is not None:
        return 0
    _torch_from_numpy = torch.from_numpy
    dts = []
    codes = {}
    for i, (_, tname) in enumerate(_DTYPES):
        dt = getattr(torch, tname, None)
        dts.append(dt)
        if dt is not None:
            codes[dt] = i
    _TORCH_DTYPES = dts
    _TORCH_CODE = codes
    return 0


cdef inline uint64_t _align(uint64_t n):
    return (n + C_ALIGN - 1) & ~(<uint64_t>C_ALIGN - 1)


# ---------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------

cdef class Prepared:
    """An object walked and laid out, ready to be written into a slot of ``nbytes``."""
    cdef readonly uint64_t nbytes
    cdef bytes meta
    cdef bytes blob
    cdef uint64_t blob_off
    cdef list arrays       # per array leaf: (source, kind, offset, nbytes)
    cdef uint32_t n_objects

    def __repr__(self):
        return (f"<Prepared {self.nbytes} bytes, {len(self.arrays)} arrays, "
                f"{self.n_objects} pickled objects>")

    def array_layout(self):
        """``[(leaf, offset, nbytes)]`` for every array leaf, in encoding order: where
        `write` copies each leaf, and where `write_frame` leaves room for it (``leaf`` is
        the object given to `prepare`)."""
        if self.arrays is None:
            raise CodecError("not a prepared encoding: use prepare()")
        return [(source, off, nbytes) for source, kind, off, nbytes in self.arrays]


cdef class _Walker:
    cdef bytearray meta
    cdef list arrays        # [source, kind, nbytes, meta position of the offset field]
    cdef list objects
    cdef object torch
    cdef object torch_tensor

    def __cinit__(self):
        self.meta = bytearray()
        self.arrays = []
        self.objects = []
        self.torch = _torch_module()
        self.torch_tensor = None if self.torch is None else self.torch.Tensor
        if self.torch is not None:
            _init_torch(self.torch)

    cdef inline void u8(self, uint8_t v):
        self.meta.append(v)

    cdef inline void u32(self, uint32_t v):
        self.meta += (<char *>&v)[:4]

    cdef inline void u64(self, uint64_t v):
        self.meta += (<char *>&v)[:8]

    cdef int obj(self, x) except -1:
        self.u8(ord('O'))
        self.u32(len(self.objects))
        self.objects.append(x)
        return 0

    cdef int walk(self, x, int depth) except -1:
        cdef type t = type(x)
        if depth > MAX_DEPTH:
            raise CodecError(f"tree is nested more than {MAX_DEPTH} levels deep")
        if x is None:
            self.u8(ord('N'))
        elif t is cnp.ndarray:
            self.numpy_leaf(x)
        elif self.torch_tensor is not None and isinstance(x, self.torch_tensor):
            self.torch_leaf(x)
        elif t is dict:
            for k in (<dict>x):
                if type(k) is not str:
                    return self.obj(x)   # non-str keys: the whole dict is pickled
            self.u8(ord('D'))
            self.u32(len(<dict>x))
            for k, v in (<dict>x).items():
                kb = (<str>k).encode("utf-8", "surrogatepass")
                self.u32(len(kb))
                self.meta += kb
                self.walk(v, depth + 1)
        elif t is list:
            self.u8(ord('L'))
            self.u32(len(<list>x))
            for v in <list>x:
                self.walk(v, depth + 1)
        elif t is tuple:
            self.u8(ord('T'))
            self.u32(len(<tuple>x))
            for v in <tuple>x:
                self.walk(v, depth + 1)
        elif isinstance(x, tuple) and hasattr(t, "_fields") and hasattr(t, "_make"):
            name = _class_name(t)
            if name is None:
                return self.obj(x)
            nb = name.encode()
            self.u8(ord('M'))
            self.u32(len(nb))
            self.meta += nb
            self.u32(len(x))
            for v in x:
                self.walk(v, depth + 1)
        else:
            self.obj(x)
        return 0

    cdef int array_token(self, int kind, int code, tuple shape, source,
                         uint64_t nbytes) except -1:
        self.u8(ord('A'))
        self.u8(kind)
        self.u8(code)
        self.u8(len(shape))
        for d in shape:
            self.u64(d)
        self.arrays.append([source, kind, nbytes, len(self.meta)])
        self.u64(0)      # offset, filled in by prepare()
        self.u64(nbytes)
        return 0

    cdef int numpy_leaf(self, cnp.ndarray a) except -1:
        code = _NP_CODE.get(a.dtype)
        if code is None or a.ndim > MAX_NDIM:
            # object, string, datetime, structured, non-native byte order ... : pickled
            return self.obj(a)
        return self.array_token(KIND_NUMPY, code, (<object>a).shape, a, (<object>a).nbytes)

    cdef int torch_leaf(self, t) except -1:
        torch = self.torch
        if t.device.type != "cpu":
            raise CodecError(
                f"expected tensors on the CPU, got a tensor on {t.device} "
                f"(shape {tuple(t.shape)}, {t.dtype}); move results to the CPU in the "
                f"worker, or to the device after they arrive")
        code = _TORCH_CODE.get(t.dtype)
        if t.layout != torch.strided or t.is_quantized or t.dim() > MAX_NDIM:
            return self.obj(t)   # sparse, quantized, ...: torch's own pickling
        if code is None:
            # float8, complex32, sub-byte integers: torch cannot reliably pickle these
            # either, so say so now rather than fail to decode later
            raise CodecError(
                f"torch dtype {t.dtype} is not supported in batches; supported: "
                + ", ".join(sorted({str(d) for d in _TORCH_CODE})))
        if t.requires_grad:
            t = t.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        return self.array_token(KIND_TORCH, code, tuple(t.shape), t,
                                t.numel() * t.element_size())


cdef object _class_name(type t):
    """``module:qualname`` for a class that can be found again by name, else None."""
    module = getattr(t, "__module__", None)
    qualname = getattr(t, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return None
    return f"{module}:{qualname}"


def prepare(obj):
    """Walk ``obj`` and lay out its encoding; returns a `Prepared` whose ``nbytes`` says how
    large a slot must be.  Raises `CodecError` for tensors that are not on the CPU, and
    whatever pickling raises for an unpicklable non-array leaf."""
    cdef _Walker w = _Walker()
    w.walk(obj, 0)
    cdef Prepared p = Prepared.__new__(Prepared)
    cdef uint64_t meta_len = len(w.meta)
    if meta_len > 0xFFFFFFFF:
        raise CodecError("tree description larger than 4 GiB")
    cdef uint64_t pos = _align(C_HEADER + meta_len)
    p.blob = None
    p.blob_off = 0
    p.n_objects = len(w.objects)
    if w.objects:
        p.blob = _pickle.dumps(w.objects, protocol=_pickle.HIGHEST_PROTOCOL)
        p.blob_off = pos
        pos = _align(pos + len(p.blob))
    cdef bytearray meta = w.meta
    cdef char *m = meta
    cdef uint64_t off
    arrays = []
    for source, kind, nbytes, at in w.arrays:
        off = pos
        memcpy(m + <Py_ssize_t>at, &off, 8)
        arrays.append((source, kind, off, nbytes))
        pos = _align(pos + <uint64_t>nbytes)
    p.meta = bytes(meta)
    p.arrays = arrays
    p.nbytes = pos
    return p


cdef inline void _copy(char *dst, const char *src, uint64_t n, bint stream) noexcept:
    # stream: the destination is a slot that another process reads next (see
    # csrc/umr_rows.c on streaming stores); not a buffer of this process's own
    if n >= BIG_COPY:
        with nogil:
            if stream:
                umr_copy_stream(<unsigned char *>dst, <const unsigned char *>src, n)
            else:
                memcpy(dst, src, n)
    else:
        memcpy(dst, src, n)


cdef int _write_array(char *base, Py_ssize_t buflen, object dest_owner, source, int kind,
                      uint64_t off, uint64_t nbytes, bint stream) except -1:
    cdef cnp.ndarray a
    cdef uintptr_t ptr
    # The source may have been resized since prepare() (ndarray.resize(refcheck=False),
    # Tensor.set_/resize_): copying the recorded nbytes from it would read out of bounds
    # (a segfault for a tensor set_ to an empty storage).
    if kind == KIND_NUMPY:
        current = cnp.PyArray_NBYTES(<cnp.ndarray>source)
    else:
        current = source.numel() * source.element_size()
    if <uint64_t>current != nbytes:
        raise CodecError(f"an array leaf changed size between prepare() ({nbytes} bytes) "
                         f"and write() ({current} bytes)")
    if nbytes == 0:
        return 0
    if kind == KIND_NUMPY:
        a = <cnp.ndarray>source
        if cnp.PyArray_IS_C_CONTIGUOUS(a):
            _copy(base + off, <const char *>cnp.PyArray_DATA(a), nbytes, stream)
        else:
            dest = _np.frombuffer(dest_owner, dtype=a.dtype, count=a.size,
                                  offset=off).reshape((<object>a).shape)
            _np.copyto(dest, a)
        return 0
    t = source
    if t.is_contiguous():
        ptr = t.data_ptr()
        _copy(base + off, <const char *>ptr, nbytes, stream)
    else:
        torch = _torch_module()
        dest = torch.frombuffer(dest_owner, dtype=t.dtype, count=t.numel(),
                                offset=off).view(t.shape)
        dest.copy_(t)
    return 0


ctypedef size_t uintptr_t


def write(Prepared p, buffer):
    """Write a prepared encoding at the start of the writable ``buffer`` (at least
    ``p.nbytes`` bytes long: a slot, a ``bytearray``, a ``memoryview``...)."""
    return _write(p, buffer, True, True)


def write_frame(Prepared p, buffer):
    """Write everything of a prepared encoding but its array data: the header, the tree
    description and the pickled leaves.  The caller fills each array's bytes itself, at
    the offsets of `Prepared.array_layout` (e.g. gathering rows straight into the slot);
    until it has, the encoding decodes to whatever those bytes hold."""
    return _write(p, buffer, False, False)


cdef _write(Prepared p, buffer, bint arrays, bint stream):
    cdef Py_buffer view
    if p.meta is None or p.arrays is None:
        # a Prepared() made directly rather than by prepare(): refused here, before the
        # buffer is exported (len(p.meta) below, outside the try, would leak the export)
        raise CodecError("not a prepared encoding: use prepare()")
    PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE)
    cdef char *base = <char *>view.buf
    cdef uint64_t meta_len = len(p.meta)
    cdef uint32_t u32
    cdef uint64_t u64
    try:
        if <uint64_t>view.len < p.nbytes:
            raise CodecError(f"encoding needs {p.nbytes} bytes, the slot has {view.len}")
        memset(base, 0, C_HEADER)
        memcpy(base, &C_MAGIC, 4)
        memcpy(base + 4, &C_VERSION, 2)
        memcpy(base + 8, &p.nbytes, 8)
        u32 = <uint32_t>meta_len
        memcpy(base + 16, &u32, 4)
        u32 = <uint32_t>len(p.arrays)
        memcpy(base + 20, &u32, 4)
        memcpy(base + 24, &p.n_objects, 4)
        memcpy(base + C_HEADER, <char *>p.meta, meta_len)
        if p.blob is not None:
            u64 = len(p.blob)
            memcpy(base + 32, &p.blob_off, 8)
            memcpy(base + 40, &u64, 8)
            memcpy(base + p.blob_off, <char *>p.blob, u64)
        if arrays:
            for source, kind, off, nbytes in p.arrays:
                _write_array(base, view.len, buffer, source, kind, off, nbytes, stream)
    finally:
        PyBuffer_Release(&view)
    return p.nbytes


def encode_prepared(Prepared p):
    """Write a prepared encoding into a new ``bytearray`` of ``p.nbytes``."""
    out = bytearray(p.nbytes)
    _write(p, out, True, False)   # (read by this process next: no streaming stores)
    return out


def encode(obj):
    """Encode ``obj`` into a new ``bytearray`` (convenience; slots use prepare + write)."""
    return encode_prepared(prepare(obj))


# ---------------------------------------------------------------------------------------
# Leases: the owner that keeps a slot's memory (and the slot itself) for its views
# ---------------------------------------------------------------------------------------

cdef class SlotLease:
    """Keeps ``length`` bytes at ``offset`` of ``source`` (a Segment, or any object with the
    buffer protocol) alive and exposes them through the buffer protocol.

    Decoded arrays hold the lease as their ``base``; when the last of them is garbage
    collected the lease is freed, releases its hold on ``source`` and calls
    ``on_release(token)``: that is how a slot goes back to its free list only once nothing
    can see it any more.
    """
    cdef Py_buffer _src
    cdef bint _held
    cdef char *ptr
    cdef readonly Py_ssize_t length
    cdef readonly bint readonly
    cdef object on_release
    cdef readonly object token
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _strides[1]
    cdef object __weakref__

    def __cinit__(self, source, Py_ssize_t offset=0, length=None, on_release=None,
                  token=None):
        self._held = False
        try:
            PyObject_GetBuffer(source, &self._src, PyBUF_WRITABLE)
        except BufferError:
            PyObject_GetBuffer(source, &self._src, PyBUF_SIMPLE)
        self._held = True
        cdef Py_ssize_t n = self._src.len - offset if length is None else length
        # Compare n with len - offset, not offset + n with len: offset + n can overflow
        # Py_ssize_t (offset=1, length=sys.maxsize) and pass, leasing memory past the end.
        if offset < 0 or n < 0 or offset > self._src.len or n > self._src.len - offset:
            raise ValueError(f"lease [{offset}, {<object>offset + <object>n}) is outside a "
                             f"buffer of {self._src.len} bytes")
        self.ptr = <char *>self._src.buf + offset
        self.length = n
        self.readonly = self._src.readonly
        self.on_release = on_release
        self.token = token

    def __getbuffer__(self, Py_buffer *buf, int flags):
        if (flags & PyBUF_WRITABLE) and self.readonly:
            raise BufferError("lease is read-only")
        self._shape[0] = self.length
        self._strides[0] = 1
        buf.buf = self.ptr
        buf.obj = self
        buf.len = self.length
        buf.readonly = self.readonly
        buf.itemsize = 1
        if flags & 0x0004:
            buf.format = b"B"
        else:
            buf.format = NULL
        buf.ndim = 1
        buf.shape = self._shape
        buf.strides = self._strides
        buf.suboffsets = NULL
        buf.internal = NULL

    def __releasebuffer__(self, Py_buffer *buf):
        pass

    def __dealloc__(self):
        # The callback first, while the memory is still held: it may need the mapping.
        cb = self.on_release
        try:
            if cb is not None:
                self.on_release = None
                cb(self.token)
        finally:
            # In a finally: an exception from on_release (reported as unraisable) must not
            # skip this, or the export of source would leak for good (a bytearray would
            # stay locked, a Segment mapped).
            if self._held:
                PyBuffer_Release(&self._src)
                self._held = False


# ---------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------

cdef enum:
    P_NONE = 0
    P_DICT = 1
    P_LIST = 2
    P_TUPLE = 3
    P_NAMED = 4
    P_ARRAY = 5
    P_OBJECT = 6


cdef class _Reader:
    cdef const unsigned char *p
    cdef uint64_t pos
    cdef uint64_t end

    cdef int need(self, uint64_t n) except -1:
        if n > self.end - self.pos:
            raise CodecError(f"corrupt slot: tree description truncated at byte "
                             f"{C_HEADER + self.pos} (needs {n} more bytes)")
        return 0

    cdef uint8_t u8(self) except? 0xFF:
        self.need(1)
        self.pos += 1
        return self.p[self.pos - 1]

    cdef uint32_t u32(self) except? 0xFFFFFFFF:
        cdef uint32_t v
        self.need(4)
        memcpy(&v, self.p + self.pos, 4)
        self.pos += 4
        return v

    cdef uint64_t u64(self) except? 0xFFFFFFFFFFFFFFFF:
        cdef uint64_t v
        self.need(8)
        memcpy(&v, self.p + self.pos, 8)
        self.pos += 8
        return v

    cdef bytes take(self, uint64_t n):
        self.need(n)
        self.pos += n
        return PyBytes_FromStringAndSize(<const char *>self.p + self.pos - n, n)


cdef class _Plan:
    cdef object root
    cdef uint32_t n_objects
    cdef uint64_t max_end
    cdef bytes meta         # the tree description it was parsed from


cdef object _resolve_namedtuple(str name, Py_ssize_t n):
    module_name, _, qualname = name.partition(":")
    module = _sys.modules.get(module_name)
    if module is None:
        try:
            module = _importlib.import_module(module_name)
        except Exception as e:
            raise CodecError(f"namedtuple class {name!r} cannot be imported: {e}") from None
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise CodecError(f"namedtuple class {name!r} not found")
    if not (isinstance(obj, type) and issubclass(obj, tuple) and hasattr(obj, "_make")
            and len(getattr(obj, "_fields", ())) == n):
        raise CodecError(f"corrupt slot: {name!r} is not a namedtuple of {n} fields")
    return obj


cdef object _parse_node(_Reader r, _Plan plan, uint64_t total_len, int depth,
                        uint64_t data_start):
    cdef uint8_t tag
    cdef uint32_t n, i
    cdef uint8_t kind, code, ndim
    cdef uint64_t d, count, off, nbytes, itemsize, nonzero
    if depth > MAX_DEPTH:
        raise CodecError(f"corrupt slot: tree nested more than {MAX_DEPTH} levels")
    tag = r.u8()
    if tag == ord('N'):
        return (P_NONE,)
    if tag == ord('D') or tag == ord('L') or tag == ord('T'):
        n = r.u32()
        # every node takes at least one byte: a count beyond what is left is corrupt
        if n > r.end - r.pos:
            raise CodecError(f"corrupt slot: container claims {n} children")
        if tag == ord('D'):
            keys = []
            children = []
            for i in range(n):
                kb = r.take(r.u32())
                try:
                    keys.append(kb.decode("utf-8", "surrogatepass"))
                except UnicodeDecodeError:
                    raise CodecError("corrupt slot: dict key is not UTF-8") from None
                children.append(_parse_node(r, plan, total_len, depth + 1, data_start))
            return (P_DICT, tuple(keys), tuple(children))
        children = [_parse_node(r, plan, total_len, depth + 1, data_start) for i in range(n)]
        return (P_LIST if tag == ord('L') else P_TUPLE, tuple(children))
    if tag == ord('M'):
        nb = r.take(r.u32())
        n = r.u32()
        if n > r.end - r.pos:
            raise CodecError(f"corrupt slot: namedtuple claims {n} fields")
        try:
            name = nb.decode("utf-8")
        except UnicodeDecodeError:
            raise CodecError("corrupt slot: namedtuple name is not UTF-8") from None
        cls = _resolve_namedtuple(name, n)
        children = [_parse_node(r, plan, total_len, depth + 1, data_start) for i in range(n)]
        return (P_NAMED, cls, tuple(children))
    if tag == ord('A'):
        kind = r.u8()
        code = r.u8()
        ndim = r.u8()
        if kind > KIND_TORCH:
            raise CodecError(f"corrupt slot: unknown array kind {kind}")
        if code >= len(_DTYPES) or (code == CODE_BFLOAT16 and kind != KIND_TORCH):
            raise CodecError(f"corrupt slot: unknown dtype code {code}")
        if ndim > MAX_NDIM:
            raise CodecError(f"corrupt slot: {ndim} dimensions (at most {MAX_NDIM})")
        descr = _NP_DESCRS[code]
        itemsize = (<cnp.dtype>descr).itemsize
        count = 1
        nonzero = itemsize
        shape = []
        for i in range(ndim):
            d = r.u64()
            # The product of the non-zero dimensions, times the item size, must fit in an
            # npy_intp (numpy and torch compute it even for empty arrays); the bytes the array
            # does use are checked against the slot below.  A single dimension may exceed
            # the slot: an empty array such as shape (0, 1000) fits in a 128-byte slot.
            if d != 0:
                if d > <uint64_t>0x7FFFFFFFFFFFFFFF // nonzero:
                    raise CodecError(f"corrupt slot: array shape overflows at dimension "
                                     f"{i} ({d})")
                nonzero *= d
            count *= d   # <= nonzero // itemsize, or 0: cannot overflow
            shape.append(d)
        off = r.u64()
        nbytes = r.u64()
        if count > total_len // itemsize + 1 or nbytes != count * itemsize:
            raise CodecError(f"corrupt slot: array of shape {tuple(shape)} and "
                             f"{descr} does not have {nbytes} bytes")
        if off < data_start or off > total_len or nbytes > total_len - off:
            raise CodecError(f"corrupt slot: array bytes [{off}, {off + nbytes}) outside "
                             f"the slot's data [{data_start}, {total_len})")
        if off % itemsize:
            raise CodecError(f"corrupt slot: array offset {off} is not aligned")
        if off + nbytes > plan.max_end:
            plan.max_end = off + nbytes
        dims = tuple(shape)
        torch_dtype = None
        if kind == KIND_TORCH:
            torch = _torch_module()
            if torch is None:
                torch = _importlib.import_module("torch")
            _init_torch(torch)
            torch_dtype = _TORCH_DTYPES[code]
            if torch_dtype is None:
                raise CodecError(f"this torch has no dtype {_DTYPES[code][1]}")
        return (P_ARRAY, kind, descr, dims, off, nbytes, code == CODE_BFLOAT16, torch_dtype)
    if tag == ord('O'):
        n = r.u32()
        if n != plan.n_objects:
            raise CodecError(f"corrupt slot: object index {n}, expected {plan.n_objects}")
        plan.n_objects += 1
        return (P_OBJECT, n)
    raise CodecError(f"corrupt slot: unknown tree token {tag!r} at byte "
                     f"{C_HEADER + r.pos - 1}")


cdef dict _plans = {}
# The plan used last: a stream of same-shaped batches finds it by comparing the slot's tree
# description with its bytes, without making a bytes object and hashing it for _plans.
cdef _Plan _last_plan = None


def clear_plan_cache():
    """Forget every cached decode plan."""
    global _last_plan
    _plans.clear()
    _last_plan = None


def plan_cache_size():
    """Number of decode plans cached (one per distinct tree description)."""
    return len(_plans)


cdef _Plan _plan_for(const char *m, uint64_t meta_len, uint64_t total_len,
                     uint64_t data_start, uint32_t n_arrays, uint32_t n_objects):
    global _last_plan
    cdef _Plan plan = _last_plan
    if (plan is None or <uint64_t>PyBytes_GET_SIZE(plan.meta) != meta_len
            or memcmp(PyBytes_AS_STRING(plan.meta), m, meta_len) != 0):
        meta = PyBytes_FromStringAndSize(m, meta_len)
        plan = _plans.get(meta)
        if plan is None:
            plan = _parse_plan(meta, total_len, data_start, n_objects)
        _last_plan = plan
    # (a plan parsed from an earlier slot: its arrays must fit in this one too)
    if plan.max_end > total_len or plan.n_objects != n_objects:
        raise CodecError("corrupt slot: header does not match its tree description")
    return plan


cdef _Plan _parse_plan(bytes meta, uint64_t total_len, uint64_t data_start,
                       uint32_t n_objects):
    cdef _Plan plan = _Plan.__new__(_Plan)
    plan.n_objects = 0
    plan.max_end = 0
    cdef _Reader r = _Reader.__new__(_Reader)
    r.p = <const unsigned char *>PyBytes_AS_STRING(meta)
    r.pos = 0
    r.end = len(meta)
    plan.root = _parse_node(r, plan, total_len, 0, data_start)
    if r.pos != r.end:
        raise CodecError(f"corrupt slot: {r.end - r.pos} stray bytes after the tree")
    if plan.n_objects != n_objects:
        raise CodecError(f"corrupt slot: header says {n_objects} objects, tree has "
                         f"{plan.n_objects}")
    plan.meta = meta
    if len(_plans) >= PLAN_CACHE_MAX:
        _plans.clear()
    _plans[meta] = plan
    return plan


cdef object _make_array(tuple node, char *base, bint readonly, object owner, bint copy,
                        bint share):
    cdef cnp.npy_intp dims[MAX_NDIM]
    cdef tuple shape = <tuple>node[3]
    cdef int nd = len(shape), i
    cdef uint64_t off = node[4]
    cdef uint64_t nbytes
    descr = node[2]
    for i in range(nd):
        dims[i] = shape[i]
    Py_INCREF(descr)  # PyArray_NewFromDescr steals a reference to the descriptor
    if copy:
        # An array of its own, filled straight from the slot: C-contiguous, aligned and
        # writeable, as ndarray.copy() of a view would be, without making the view.
        arr = PyArray_NewFromDescr_raw(<PyTypeObject *>cnp.ndarray, <_Descr *>descr, nd, dims,
                                       NULL, NULL, 0, NULL)
        nbytes = node[5]
        _copy(<char *>cnp.PyArray_DATA(<cnp.ndarray>arr), base + off, nbytes, False)
    else:
        # (a tensor shared over read-only memory is made from a writeable array: torch
        # has no read-only tensors, and the array itself is never handed out)
        arr = PyArray_NewFromDescr_raw(<PyTypeObject *>cnp.ndarray, <_Descr *>descr, nd, dims,
                                       NULL, base + off,
                                       cnp.NPY_ARRAY_WRITEABLE if not readonly or (
                                           share and node[1] == KIND_TORCH) else 0, NULL)
        # let numpy work out contiguity and alignment from the pointer and the shape
        cnp.PyArray_UpdateFlags(<cnp.ndarray>arr, cnp.NPY_ARRAY_UPDATE_ALL)
        Py_INCREF(owner)  # PyArray_SetBaseObject steals a reference to the base
        PyArray_SetBaseObject_raw(<_ArrayObject *>arr, <PyObject *>owner)
    if node[1] == KIND_TORCH:
        # (_parse_node initialised torch, _torch_from_numpy included, to make this node)
        if readonly and not copy and not share:
            t = _torch_from_numpy(arr.copy())  # torch has no read-only tensors
        else:
            t = _torch_from_numpy(arr)
        if node[6]:
            t = t.view(node[7])   # bfloat16
        return t
    return arr


cdef object _build(tuple node, char *base, bint readonly, object owner, bint copy,
                   bint share, list objects):
    cdef int tag = node[0]
    cdef tuple keys, children
    cdef Py_ssize_t i
    if tag == P_ARRAY:
        return _make_array(node, base, readonly, owner, copy, share)
    if tag == P_DICT:
        keys = <tuple>node[1]
        children = <tuple>node[2]
        out = {}
        for i in range(len(keys)):
            out[keys[i]] = _build(<tuple>children[i], base, readonly, owner, copy, share,
                                  objects)
        return out
    if tag == P_LIST:
        return [_build(child, base, readonly, owner, copy, share, objects) for child in node[1]]
    if tag == P_TUPLE:
        return tuple([_build(child, base, readonly, owner, copy, share, objects)
                      for child in node[1]])
    if tag == P_NAMED:
        return node[1]._make([_build(child, base, readonly, owner, copy, share, objects)
                              for child in node[2]])
    if tag == P_OBJECT:
        return objects[node[1]]
    return None


def decode(buffer, copy=False, share_readonly=False):
    """Decode the encoding at the start of ``buffer`` (a `SlotLease`, or any bytes-like
    object).

    With ``copy=False`` every array of the result is a view of ``buffer`` and holds it (its
    ``base``, through ``torch.from_numpy`` for tensors): a lease is released only when the
    last view is gone.  With ``copy=True`` the arrays own their memory and nothing refers to
    ``buffer`` afterwards.  Raises `CodecError` when the bytes are not a valid encoding;
    never reads outside ``buffer``.

    A read-only ``buffer`` gives read-only numpy arrays, and torch tensors copied out of it
    (torch has no read-only tensors); with ``share_readonly=True`` the tensors are views of
    it all the same, and the caller must never write into them.
    """
    cdef Py_buffer view
    cdef uint32_t magic, meta_len, n_arrays, n_objects
    cdef uint16_t version
    cdef uint64_t total_len, blob_off, blob_len, data_start
    cdef char *base
    owner = buffer if isinstance(buffer, SlotLease) else None
    PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE)
    try:
        base = <char *>view.buf
        if view.len < C_HEADER:
            raise CodecError(f"corrupt slot: {view.len} bytes, shorter than the "
                             f"{C_HEADER}-byte header")
        memcpy(&magic, base, 4)
        memcpy(&version, base + 4, 2)
        if magic != C_MAGIC:
            raise CodecError(f"corrupt slot: magic {magic:#010x}, expected {C_MAGIC:#010x}")
        if version != C_VERSION:
            raise CodecError(f"slot encoded with codec version {version}, this is "
                             f"version {C_VERSION}")
        memcpy(&total_len, base + 8, 8)
        memcpy(&meta_len, base + 16, 4)
        memcpy(&n_arrays, base + 20, 4)
        memcpy(&n_objects, base + 24, 4)
        memcpy(&blob_off, base + 32, 8)
        memcpy(&blob_len, base + 40, 8)
        if total_len > <uint64_t>view.len or total_len < C_HEADER:
            raise CodecError(f"corrupt slot: encoding claims {total_len} bytes, the slot "
                             f"holds {view.len}")
        if meta_len > total_len - C_HEADER:
            raise CodecError(f"corrupt slot: tree description of {meta_len} bytes does not "
                             f"fit in {total_len}")
        data_start = C_HEADER + meta_len
        if n_objects:
            if blob_off < data_start or blob_off > total_len or blob_len > total_len - blob_off:
                raise CodecError(f"corrupt slot: object blob [{blob_off}, "
                                 f"{blob_off + blob_len}) outside [{data_start}, {total_len})")
        plan = _plan_for(base + C_HEADER, meta_len, total_len, data_start, n_arrays,
                         n_objects)
        objects = None
        if n_objects:
            try:
                objects = _pickle.loads(PyBytes_FromStringAndSize(base + blob_off, blob_len))
            except Exception as e:
                raise CodecError(f"corrupt slot: the pickled objects do not load "
                                 f"({type(e).__name__}: {e})") from e
            if type(objects) is not list or len(<list>objects) != n_objects:
                raise CodecError(f"corrupt slot: object blob is not a list of {n_objects}")
        if owner is None and not copy and (<_Plan>plan).max_end > 0:
            owner = memoryview(buffer)  # holds an export of buffer for as long as views live
        return _build((<_Plan>plan).root, base, view.readonly, owner, copy, share_readonly,
                      objects)
    finally:
        PyBuffer_Release(&view)
