"""Whether a wrapped sampler's data is still what a pool of workers holds a copy of: an exact
fingerprint of everything the sampler's ``get*_at`` methods read, or None where that
cannot be told.

Workers hold a copy of data that is not shared between processes (fork's copy-on-write
image, or the spawn transfer's snapshot, see :mod:`unienv_mp._transfer`) as it was when
they started.  An epoch must cover the data as it is when the epoch starts, so it may run
on workers that already exist only if nothing the epoch's batches depend on has changed
since those workers started.  :func:`take` walks the sampler's object graph and records
(about 0.25 ms for a ``DictStorage`` of three tensors, on a 2-core VM):

* every torch tensor: its identity, data pointer, shape, strides, storage offset, dtype,
  and its version counter (``Tensor._version``, which torch moves on by one on every
  in-place write to the tensor or any view of it: ``set_at``, ``extend``,
  ``t[i] = x``, ``t.add_(...)``);
* every other attribute (the ReplayBuffer's count and offset, the storages' key maps, the
  spaces' shapes) by value, and every object by identity (so a storage or tensor that
  was replaced is seen, even if the new one looks the same).

Two fingerprints compare equal (:func:`same`) only if every object recorded in the older
one is still alive and is the same object, and every value and version is the same.

The walk is exact only for classes whose ``get*_at`` methods read nothing but their
attributes: UniEnv's ``StepSampler``, ``ReplayBuffer`` (with its in-process ring state),
``DictStorage``, ``FlattenedStorage`` and ``PytorchTensorStorage`` (exactly those classes,
not subclasses), UniEnv's spaces, and plain containers, scalars and CPU tensors.  Anything
else (a custom sampler or storage, a memory-mapped tensor or numpy array, which torch
does not version, an image or HDF5 storage reading files, a transformation holding a
function) makes :func:`take` return None: the sampler then starts new workers for each
epoch, as before.  What the version counter cannot see either: writes that bypass torch
(through a numpy view from ``Tensor.numpy()``, ctypes, or another process), which is
why ``persistent_workers=False`` exists.

This module is one of those that know UniEnv's classes (see :mod:`unienv_mp.gather`).
"""
import weakref

__all__ = ["take", "same"]

# The walk gives up past this many objects (a fingerprint should cost microseconds; a
# graph this large is not a replay buffer of tensors).
_MAX_OBJECTS = 20000

_SCALARS = (type(None), bool, int, float, complex, str, bytes)


class Fingerprint:
    """What :func:`take` recorded: ``tokens`` (a tuple, compared by value) and weak
    references to the objects whose identities the tokens hold (so that an identity cannot
    be reused by a new object while the fingerprint lives without being noticed)."""
    __slots__ = ("tokens", "refs")

    def __init__(self, tokens, refs):
        self.tokens = tokens
        self.refs = refs

    def alive(self):
        """True if every object recorded is still alive."""
        for r in self.refs:
            if r() is None:
                return False
        return True


def same(old, new):
    """True if fingerprints ``old`` and ``new`` (either may be None) tell that the data is
    the same: both known, equal, and every object ``old`` recorded is still alive."""
    if old is None or new is None:
        return False
    return old.tokens == new.tokens and old.alive()


def _classes():
    from unienv_data.replay_buffer import replay_buffer as rbm
    from unienv_data.samplers.step_sampler import StepSampler
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.flattened import FlattenedStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    from unienv_interface.space import Space
    from unienv_interface.space.spaces import dict as dict_space
    known = {rbm.ReplayBuffer, rbm._LocalRingState, DictStorage, FlattenedStorage,
             PytorchTensorStorage}
    space_dict = getattr(dict_space, "_SpaceDict", None)
    if space_dict is not None:
        known.add(space_dict)
    return StepSampler, frozenset(known), Space


_cache = None


class _Unknown(Exception):
    pass


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


class _Walk:
    """One walk over a sampler's object graph: the tokens it recorded, and references to
    the objects whose identities they hold."""

    def __init__(self, torch, known, space):
        self.tokens = []
        self.refs = []
        self.seen = {}   # id -> the object's number, in the order first met
        self.add = self.tokens.append
        self.tensor_t = torch.Tensor
        self.generator_t = torch.Generator
        self.dtype_t = (torch.dtype, torch.device)
        self.known = known
        self.space = space

    def sampler(self, sampler):
        add = self.add
        self.refs.append(weakref.ref(sampler))
        add(("sampler", id(sampler)))
        self.seen[id(sampler)] = 0
        for k, v in vars(sampler).items():
            add(k)
            if k in ("rng", "data_rng") and (v is None or type(v) is self.generator_t):
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
        if t in self.dtype_t:
            add(obj)
            return
        seen = self.seen
        key = id(obj)
        if key in seen:
            add(("again", seen[key]))
            return
        if len(seen) >= _MAX_OBJECTS:
            raise _Unknown
        seen[key] = len(seen)
        if t is self.tensor_t:
            if obj.device.type != "cpu" or obj.is_inference():
                raise _Unknown
            self.refs.append(weakref.ref(obj))
            add((key, obj.data_ptr(), obj._version, tuple(obj.shape), obj.stride(),
                 obj.storage_offset(), obj.dtype))
        elif t is tuple or t is list:
            add((t, len(obj)))
            for x in obj:
                self.visit(x)
        elif t is dict:
            add((dict, len(obj)))
            self.items(obj)
        elif isinstance(obj, type):
            # a class (a compute backend is one): by identity; classes live for good
            add(("class", key))
        elif t in self.known or isinstance(obj, self.space):
            self.instance(obj, t, key)
        else:
            raise _Unknown

    def items(self, mapping):
        for k, v in mapping.items():
            self.visit(k)
            self.visit(v)

    def instance(self, obj, t, key):
        """An object of one of the known classes: by identity, then every attribute."""
        add = self.add
        if not (t.__module__.startswith(("unienv_data.", "unienv_interface."))):
            raise _Unknown   # (a subclass of a space defined elsewhere)
        try:
            self.refs.append(weakref.ref(obj))
        except TypeError:
            # (no weak references, e.g. a class with __slots__: held strongly, as a
            # function returning it, so that its identity stays its own)
            self.refs.append(_Strong(obj))
        add(("object", t, key))
        if isinstance(obj, dict):
            add(len(obj))
            self.items(obj)
        names = [n for c in t.__mro__ for n in _slots(c)
                 if n not in ("__dict__", "__weakref__")]
        for n in names:
            add(n)
            self.visit(getattr(obj, n, _MISSING))
        attrs = getattr(obj, "__dict__", None)
        if attrs is not None:
            add(len(attrs))
            for k, v in attrs.items():
                add(k)
                self.visit(v)


def take(sampler):
    """The fingerprint of ``sampler`` and its data, or None if it cannot be told exactly
    (see the module's docstring)."""
    global _cache
    try:
        import torch
    except ImportError:
        return None
    if _cache is None:
        try:
            _cache = _classes()
        except Exception:   # (another UniEnv: nothing is known)
            _cache = (None, frozenset(), None)
    step_sampler, known, space = _cache
    if step_sampler is None or type(sampler) is not step_sampler:
        return None
    walk = _Walk(torch, known, space)
    try:
        walk.sampler(sampler)
    except _Unknown:
        return None
    except Exception:
        return None
    return Fingerprint(tuple(walk.tokens), walk.refs)
