"""Whether a wrapped sampler's data is still what a pool of workers holds a copy of: an exact
fingerprint of everything the sampler's ``get*_at`` methods read, or None where that
cannot be told.

Workers hold a copy of data that is not shared between processes (fork's copy-on-write
image, or the spawn transfer's snapshot, see `unienv_mp._process.transfer`) as it was when
they started.  An epoch must cover the data as it is when the epoch starts, so it may run
on workers that already exist only if nothing the epoch's batches depend on has changed
since those workers started.  `take` walks the sampler's object graph and records (about
0.25 ms for a ``DictStorage`` of three tensors, on a 2-core VM):

* every torch tensor: its identity, data pointer, shape, strides, storage offset, dtype,
  and its version counter (``Tensor._version``, which torch moves on by one on every
  in-place write to the tensor or any view of it: ``set_at``, ``extend``,
  ``t[i] = x``, ``t.add_(...)``);
* every other attribute (the ReplayBuffer's count and offset, the storages' key maps, the
  spaces' shapes) by value, and every object by identity (so a storage or tensor that
  was replaced is seen, even if the new one looks the same).

Two fingerprints compare equal (`same`) only if every object recorded in the older one is
still alive and is the same object, and every value and version is the same.

The walk is exact only for classes whose ``get*_at`` methods read nothing but their
attributes: UniEnv's ``StepSampler``, ``ReplayBuffer`` (with its in-process ring state),
``DictStorage``, ``FlattenedStorage`` and ``PytorchTensorStorage``, the views
``FrameStackedBatch``, ``SliceStackedBatch`` (and the column stacks its ``get_column``
makes), ``CombinedBatch``, ``SubItemBatch``, ``SubIndexedBatch`` and
``ToBackendOrDeviceBatch`` (which converts a batch's arrays to another backend: how a
torch view such as ``WindowedBatch`` is put over an HDF5 file's numpy arrays), exactly
those classes, not subclasses; UniEnv's spaces, UniEnv's two valid-mask helpers
(``get_valid_mask_function_with_episodeid_key`` / ``..._with_episode_end_key``),
unienv_mp's ``WindowedBatch``, and plain containers, scalars and CPU tensors.  In a
ReplayBuffer made with ``multiprocessing=True``, workers read the ring state and the
tensors in shared memory as they are now: those count by identity (a tensor by where its
memory is, not by its version), the rest as in any buffer.  UniEnv's file-backed storages
(``HDF5Storage``, ``ImageStorage``, ``NPZStorage``, ``VideoStorage``, a read-only
``ParquetStorage``) count by the identity of every file they read
(`unienv_mp._sampling.files`: device, inode, size, modification and change times; a file
open for writing is flushed first), and a memory-mapped tensor by the inode of the file it
maps, which every process reads as it is; small numpy arrays (a space's bounds) count by
value.  A view is a pure function of its parameters
and the buffers under it, so its fingerprint is theirs: a view parameter changed
(``fill_invalid_data``, ``fixed_offset``, a part added to a ``CombinedBatch``) is seen as
a change of the data.  What a view only caches (a ``CombinedBatch``'s thread pool and its
memo of batched spaces) is left out.  Anything else (a custom sampler, storage or valid
mask function, a numpy array over 1 MiB, which has no version to compare, a transformation
holding a function) makes `take` return None, and `check` says why: the sampler then starts new workers for each
epoch, as before.  What the version counter cannot see either: writes that bypass torch's
counter: through a numpy view from ``Tensor.numpy()``, ctypes or another process; and within
torch, through ``tensor.data`` (a tensor with a counter of its own), through the storage
(``tensor.untyped_storage()``), or through another tensor made over the same memory
(``set_``, DLPack).  That is why ``persistent_workers=False`` exists.

This module is one of those that know UniEnv's classes (see `unienv_mp._direct.gather`).
"""
import functools
import time
import weakref

import numpy as np

from .._direct import unienv as _unienv
from . import files as _files

__all__ = ["take", "check", "same", "moved"]

# The walk gives up past this many objects (a fingerprint should cost microseconds; a
# graph this large is not a replay buffer of tensors).
_MAX_OBJECTS = 20000

_SCALARS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))

# A numpy array (a space's bounds) is recorded by value up to this size; a larger one has
# no version to compare and is not vouched for.
_MAX_ARRAY_BYTES = 1 << 20

#: UniEnv's file-backed storages, by class name: how the files each reads are listed (see
#: `unienv_mp._sampling.files`).
_FILE_KINDS = {"HDF5Storage": "hdf5", "ImageStorage": "rows", "NPZStorage": "rows",
               "VideoStorage": "episodes", "ParquetStorage": "pieces"}


class Fingerprint:
    """What `take` recorded: ``tokens`` (a tuple, compared by value), weak references to
    the objects whose identities the tokens hold (so that an identity cannot be reused by a
    new object while the fingerprint lives without being noticed), and ``ranges``, the
    ``(address, nbytes)`` of the memory of every tensor that is not shared between
    processes (what `unienv_mp._sampling.pages` watches for writes torch does not count).
    ``files``: the paths of the files the data reads, whose identities the tokens hold;
    ``racy``: the first of them whose identity was taken too soon after it changed to be
    trusted (`unienv_mp._sampling.files.racy`), or None; ``maps``: the files of the
    memory-mapped tensors, which every process reads as they are; ``tensors``: how many
    torch tensors it met (whose writes outside torch's count the copy's page witness or spot
    check looks for); ``watch``: what `moved` looks at (see there)."""
    __slots__ = ("tokens", "refs", "ranges", "files", "racy", "maps", "tensors", "watch")

    def __init__(self, tokens, refs, ranges=(), files=(), racy=None, maps=(), tensors=None,
                 watch=()):
        self.tokens = tokens
        self.refs = refs
        self.ranges = ranges
        self.files = files
        self.racy = racy
        self.maps = maps
        self.tensors = tensors
        self.watch = watch

    def alive(self):
        """True if every object recorded is still alive."""
        for r in self.refs:
            if r() is None:
                return False
        return True


def same(old, new):
    """True if fingerprints ``old`` and ``new`` (either may be None) tell that the data is
    the same: both known, equal, and every object ``old`` recorded is still alive."""
    if old is None or new is None or old.racy is not None:
        return False
    return old.tokens == new.tokens and old.alive()


def moved(watch):
    """True if the data moved away from what workers that read shared memory as it is now
    can serve whole rows of: a tensor in shared memory that they read was replaced (its
    holder holds another), or, in data only partly in shared memory, a tensor was written
    (its version moved on: they read the shared tensors as they are now and the rest as it
    was, so a row written since would be torn).  ``watch``: a fingerprint's, cheap to
    look at (a few attribute reads per tensor), so the ``sample*`` calls look at it each
    time."""
    for holder, key, is_dict, ref, version in watch:
        t = ref()
        now = holder.get(key) if is_dict else getattr(holder, key, None)
        if t is None or now is not t or (version >= 0 and t._version != version):
            return True
    return False


def _watch(held):
    """``watch`` (see `moved`) of the tensors a walk met as ``(holder, key, tensor,
    in_shared)``: none where no tensor is in shared memory; else every tensor in shared
    memory inside a buffer made with ``multiprocessing=True`` by identity, and, where the
    tensors outside such buffers are some in shared memory and some not (data partly
    shared), each of those by its version."""
    outside = {t.is_shared() for _, _, t, in_shared in held if not in_shared}
    partly = len(outside) == 2
    out = []
    for holder, key, t, in_shared in held:
        if in_shared:
            if t.is_shared():
                out.append((holder, key, type(holder) is dict, weakref.ref(t), -1))
        elif partly:
            out.append((holder, key, type(holder) is dict, weakref.ref(t), t._version))
    return tuple(out)


def _classes():
    from unienv_data.batches.backend_compat import ToBackendOrDeviceBatch
    from unienv_data.batches.combined_batch import CombinedBatch
    from unienv_data.batches.framestack_batch import FrameStackedBatch
    from unienv_data.batches.slicestack_batch import SliceStackedBatch
    from unienv_data.batches.subindex_batch import SubIndexedBatch
    from unienv_data.batches.subitem_batch import SubItemBatch
    from unienv_data.replay_buffer import replay_buffer as rbm
    from unienv_data.samplers.step_sampler import StepSampler
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.flattened import FlattenedStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    from unienv_interface.space import Space
    from unienv_interface.space.spaces import dict as dict_space
    known = {rbm.ReplayBuffer, rbm._LocalRingState, DictStorage, FlattenedStorage,
             PytorchTensorStorage, FrameStackedBatch, SliceStackedBatch,
             _unienv.column_stack_class(), CombinedBatch, SubItemBatch, SubIndexedBatch,
             ToBackendOrDeviceBatch}
    space_dict = getattr(dict_space, "_SpaceDict", None)
    if space_dict is not None:
        known.add(space_dict)
    # class -> the attributes left out of its fingerprint (see the module's docstring)
    known = {cls: _unienv.cache_attributes(cls) for cls in known}
    from ..windows import WindowedBatch
    known[WindowedBatch] = WindowedBatch.CACHE_ATTRIBUTES
    return StepSampler, known, Space, frozenset(_unienv.mask_helpers()), rbm.ReplayBuffer


_cache = None


class _Unknown(Exception):
    """The walk met something it cannot vouch for; its argument says what."""


class _Strong:
    """A strong reference with a weak reference's call."""
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __call__(self):
        return self.obj


_MISSING = "<unset slot>"


def _slots(cls):
    slots = cls.__dict__.get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _name(obj):
    t = obj if isinstance(obj, type) else type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _custom(fn):
    return _Unknown(f"a custom function ({getattr(fn, '__qualname__', _name(fn))}), which "
                    f"may read anything")


class _Walk:
    """One walk over a sampler's object graph: the tokens it recorded, and references to
    the objects whose identities they hold."""

    def __init__(self, torch, known, space, helpers, buffer_t):
        self.tokens = []
        self.refs = []
        self.seen = {}   # id -> the object's number, in the order first met
        self.ranges = {}   # address -> nbytes of the storages not shared between processes
        self.add = self.tokens.append
        self.tensor_t = torch.Tensor
        self.generator_t = torch.Generator
        self.dtype_t = (torch.dtype, torch.device)
        self.memmap_t = _memmap_class()
        # UniEnv's file-backed storages whose modules are imported: class -> kind
        self.file_kinds = {}
        for name, kind in _FILE_KINDS.items():
            cls = _unienv.storage_class(name)
            if cls is not None:
                self.file_kinds[cls] = kind
        if self.file_kinds:
            known = dict(known)
            known.update((cls, _unienv.cache_attributes(cls)) for cls in self.file_kinds)
        self.files = []   # (path, Identity) of every file read
        self.maps = []    # the path of every file mapped
        self.tensors = 0  # torch tensors met
        self.known = known
        self.space = space
        self.helpers = helpers
        self.buffer_t = buffer_t
        self.in_shared = 0   # (inside a buffer made with multiprocessing=True)
        self.held = []   # (holder, key, tensor, in_shared) of every tensor met (see _watch)

    def hold(self, holder, key, value):
        if type(value) is self.tensor_t:
            self.held.append((holder, key, value, self.in_shared > 0))

    def sampler(self, sampler):
        add = self.add
        self.refs.append(weakref.ref(sampler))
        add(("sampler", id(sampler)))
        self.seen[id(sampler)] = 0
        for k, v in vars(sampler).items():
            add(k)
            if k in ("rng", "data_rng") and (v is None or type(v) is self.generator_t
                                             or type(v) is np.random.Generator):
                # StepSampler's get*_at draw nothing: its RNGs do not change an epoch's
                # batches (and every sample* task reseeds them)
                continue
            self.visit(v)

    def visit(self, obj):
        add = self.add
        t = type(obj)
        if t in _SCALARS:
            # by type and value (1, True and 1.0 are equal in Python; -0.0 and 0.0 too,
            # and NaN is not equal to itself: floats by their bits)
            add((t, obj.hex() if t is float else obj))
            return
        if t in self.dtype_t or isinstance(obj, np.dtype):
            add(obj)
            return
        if isinstance(obj, np.generic):   # (a numpy scalar: by type and bits)
            add((t, obj.tobytes()))
            return
        seen = self.seen
        key = id(obj)
        if key in seen:
            add(("again", seen[key]))
            return
        if len(seen) >= _MAX_OBJECTS:
            raise _Unknown(f"the data holds more than {_MAX_OBJECTS} objects")
        seen[key] = len(seen)
        if t is self.tensor_t:
            if obj.device.type != "cpu":
                raise _Unknown(f"a tensor on {obj.device}")
            if obj.is_inference():
                raise _Unknown("an inference tensor (torch keeps no version counter "
                               "for it)")
            self.refs.append(weakref.ref(obj))
            self.tensors += 1
            # (a tensor in shared memory under a shared buffer: by its memory, which
            # workers read as it is now; any other by its version too)
            shared = obj.is_shared()
            version = -1 if self.in_shared and shared else obj._version
            if not shared:
                storage = obj.untyped_storage()
                where = storage.data_ptr()
                self.ranges[where] = max(self.ranges.get(where, 0), storage.nbytes())
            add((key, obj.data_ptr(), version, tuple(obj.shape), obj.stride(),
                 obj.storage_offset(), obj.dtype))
        elif t is self.memmap_t:
            self.memmap(obj, key)
        elif t is np.ndarray:
            if obj.dtype.hasobject or obj.nbytes > _MAX_ARRAY_BYTES:
                raise _Unknown(f"a numpy array of {obj.nbytes} bytes (numpy keeps no "
                               f"version of an array to compare)")
            self.refs.append(_Strong(obj))
            add((np.ndarray, key, obj.dtype, obj.shape, obj.tobytes()))
        elif t is tuple or t is list:
            add((t, len(obj)))
            for x in obj:
                self.visit(x)
        elif t is set or t is frozenset:
            add((t, len(obj)))
            for x in sorted(obj, key=repr):
                self.visit(x)
        elif t is dict:
            add((dict, len(obj)))
            self.items(obj)
        elif isinstance(obj, type):
            # a class (a compute backend is one): by identity; classes live for good
            add(("class", key))
        elif t is functools.partial:
            self.partial(obj, key)
        elif t in self.known or isinstance(obj, self.space):
            self.instance(obj, t, key)
        elif callable(obj):
            raise _custom(obj)
        else:
            raise _Unknown(f"a {_name(obj)}, which the fingerprint cannot vouch for "
                           f"(see unienv_mp._sampling.fingerprint)")

    def memmap(self, obj, key):
        """UniEnv's ``MemoryMappedTensor``: its place in memory, shape and strides, and the
        file it maps by device and inode (which the path must still name: workers started
        with spawn open it by name).  Workers read the file as this process does (the same
        pages), so its version counts only where this process maps it privately (loaded
        read-only: what it writes stays here, and the page table watches it too)."""
        filename = getattr(obj, "filename", None)
        if obj.device.type != "cpu" or filename is None:
            raise _Unknown("a memory-mapped tensor with no file")
        self.refs.append(weakref.ref(obj))
        self.tensors += 1
        private = _unienv.memmap_readonly(obj)
        if private:
            storage = obj.untyped_storage()
            where = storage.data_ptr()
            self.ranges[where] = max(self.ranges.get(where, 0), storage.nbytes())
        try:
            inode = _files.mapped(obj.data_ptr(), str(filename))
        except LookupError as e:
            raise _Unknown(str(e)) from None
        self.maps.append(str(filename))
        self.add((key, obj.data_ptr(), obj._version if private else -1, tuple(obj.shape),
                  obj.stride(), obj.storage_offset(), obj.dtype, "maps", inode))

    def storage_files(self, obj, kind):
        """The identities of the files that a file-backed storage ``obj`` reads."""
        add = self.add
        if kind == "hdf5":
            root, path = _unienv.hdf5_file(obj)
            try:
                idents = _files.hdf5(root, path)
            except LookupError as e:
                raise _Unknown(str(e)) from None
            if root is not None:
                add(("h5", root.name, root.file.mode))
        else:
            paths = {"rows": _unienv.row_files, "episodes": _unienv.episode_files,
                     "pieces": _unienv.parquet_files}[kind](obj)
            if paths is None:
                raise _Unknown(f"a {_name(obj)} that holds rows in memory (a video "
                               f"segment open, or a writable parquet storage's pieces)")
            idents = [_files.identity(p) for p in paths]
        add(("files", len(idents)))
        for ident in idents:
            add(ident)
            self.files.append((ident.path, ident))

    def items(self, mapping):
        for k, v in mapping.items():
            self.visit(k)
            self.visit(v)
            self.hold(mapping, k, v)

    def shared_buffer(self, rb, key):
        """A ReplayBuffer made with ``multiprocessing=True``: workers read its shared ring
        state and the tensors of its storage in shared memory as they are now, so those
        count by identity (a tensor by its memory, not its version); everything else as in
        any buffer, so that a storage or tensor replaced by one that is not shared is
        seen.  Its per-process bookkeeping of segments, which reads do not use, is left
        out."""
        add = self.add
        add(("shared", key))
        self.in_shared += 1
        try:
            for k, v in vars(rb).items():
                add(k)
                if k in _unienv.SHARED_BUFFER_LOCAL:
                    continue
                if k in _unienv.SHARED_BUFFER_LIVE and type(v) not in self.known:
                    self.refs.append(_Strong(v))
                    add(("live", type(v), id(v)))
                    continue
                self.visit(v)
                self.hold(rb, k, v)
        finally:
            self.in_shared -= 1

    def partial(self, obj, key):
        """A valid-mask helper of UniEnv: the function (which lives for good) by
        identity, then its arguments."""
        if obj.func not in self.helpers:
            raise _custom(obj.func)
        self.refs.append(weakref.ref(obj))
        self.add(("partial", key, id(obj.func)))
        self.visit(obj.args)
        self.visit(obj.keywords)

    def instance(self, obj, t, key):
        """An object of one of the known classes: by identity, then every attribute but
        those it only caches."""
        add = self.add
        if t not in self.known and not t.__module__.startswith(("unienv_data.",
                                                                 "unienv_interface.")):
            raise _Unknown(f"a {_name(obj)}, a subclass of UniEnv's Space defined "
                           f"elsewhere")
        try:
            self.refs.append(weakref.ref(obj))
        except TypeError:
            # (no weak references, e.g. a class with __slots__: held strongly, as a
            # function returning it, so that its identity stays its own)
            self.refs.append(_Strong(obj))
        if t is self.buffer_t and obj.is_multiprocessing_safe:
            self.shared_buffer(obj, key)
            return
        add(("object", t, key))
        if isinstance(obj, dict):
            add(len(obj))
            self.items(obj)
        names = [n for c in t.__mro__ for n in _slots(c)
                 if n not in ("__dict__", "__weakref__")]
        for n in names:
            add(n)
            v = getattr(obj, n, _MISSING)
            self.visit(v)
            self.hold(obj, n, v)
        attrs = getattr(obj, "__dict__", None)
        if attrs is not None:
            skip = self.known.get(t, ())
            add(len(attrs))
            for k, v in attrs.items():
                add(k)
                if k not in skip:
                    self.visit(v)
                    self.hold(obj, k, v)
        kind = self.file_kinds.get(t)
        if kind is not None:
            self.storage_files(obj, kind)


def take(sampler):
    """The fingerprint of ``sampler`` and its data, or None if it cannot be told exactly
    (see the module's docstring)."""
    return check(sampler)[0]


def check(sampler):
    """``(fingerprint, None)``, or ``(None, why)`` where the fingerprint of ``sampler``
    cannot be told exactly: ``why`` names what the walk cannot vouch for."""
    global _cache
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if _cache is None:
        try:
            _cache = _classes()
        except Exception:   # (another UniEnv: nothing is known)
            _cache = (None, {}, None, frozenset(), None)
    step_sampler, known, space, helpers, buffer_t = _cache
    if step_sampler is None:
        return None, "this UniEnv's classes are not those the fingerprint knows"
    if type(sampler) is not step_sampler:
        return None, f"the sampler is a {_name(sampler)}, not UniEnv's StepSampler"
    walk = _Walk(torch, known, space, helpers, buffer_t)
    try:
        walk.sampler(sampler)
    except _Unknown as e:
        return None, str(e)
    except Exception as e:
        return None, f"reading the data raised {type(e).__name__}: {e}"
    now = time.time_ns()
    racy = next((path for path, ident in walk.files if _files.racy(ident, now)), None)
    return Fingerprint(tuple(walk.tokens), walk.refs, tuple(walk.ranges.items()),
                       tuple(dict.fromkeys(path for path, _ in walk.files)), racy,
                       tuple(dict.fromkeys(walk.maps)), walk.tensors,
                       _watch(walk.held)), None


def _memmap_class():
    """UniEnv's ``MemoryMappedTensor``, or None where its module is not imported (no
    such tensor exists then)."""
    import sys
    module = sys.modules.get("unienv_data.third_party.tensordict.memmap_tensor")
    return getattr(module, "MemoryMappedTensor", None)
