"""How a batch travels from a Ray actor to the caller.

Ray's serializer carries numpy arrays out of band: a reader on the same node maps them
from the object store without a copy, read-only.  torch tensors it pickles whole (a copy
on each side).  So an actor sends each tensor of a batch as a `TensorLeaf` around a numpy
view of it (`pack`), and the caller makes the tensor again over that array (`unpack`).
Dicts, tuples and lists are walked; any other value travels as Ray pickles it.
"""
import sys
import warnings

import numpy as np

__all__ = ["TensorLeaf", "pack", "unpack"]

#: integer dtypes by size, for tensors whose dtype numpy lacks (bfloat16, float8, ...):
#: their bits travel as these and are viewed back
_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


class TensorLeaf:
    """A torch tensor on its way: its data as a numpy array, and its torch dtype where
    numpy has none (the array then holds the bits, as integers of the same size)."""
    __slots__ = ("array", "dtype")

    def __init__(self, array, dtype=None):
        self.array = array
        self.dtype = dtype

    def __reduce__(self):
        return (TensorLeaf, (self.array, self.dtype))


def _walk(v, leaf):
    """``v`` with ``leaf`` applied to everything in its dicts, tuples and lists."""
    t = type(v)
    if t is dict:
        return {k: _walk(x, leaf) for k, x in v.items()}
    if t is tuple:
        return tuple([_walk(x, leaf) for x in v])
    if t is list:
        return [_walk(x, leaf) for x in v]
    return leaf(v)


def pack(value):
    """``value`` with every torch tensor in its dicts, tuples and lists replaced by a
    `TensorLeaf` (in the actor)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    return _walk(value, lambda v: _leaf(v, torch) if isinstance(v, torch.Tensor) else v)


def _leaf(tensor, torch):
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        raise ValueError(f"a batch holds a tensor on {tensor.device}: RaySampler carries "
                         f"CPU batches (move them to the device in the training loop)")
    tensor = tensor.resolve_conj().resolve_neg()
    try:
        return TensorLeaf(tensor.numpy())
    except TypeError:   # a dtype numpy lacks: send the bits
        bits = getattr(torch, _BITS[tensor.element_size()])
        return TensorLeaf(tensor.view(bits).numpy(), tensor.dtype)


def unpack(value, copy):
    """``value`` as the caller gets it (after ``ray.get``): every `TensorLeaf` a torch
    tensor again.  ``copy=False``: arrays and tensors are views of the object store,
    read-only (numpy arrays are marked so; tensors cannot be, see `RaySampler`).
    ``copy=True``: each is copied into memory of its own, writable."""
    if copy:
        return _walk(value, _copied)
    with warnings.catch_warnings():
        # torch warns (once per process) that a tensor over a read-only array is writable
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return _walk(value, _as_is)


def _as_is(v):
    if type(v) is TensorLeaf:
        import torch
        tensor = torch.from_numpy(v.array)
        return tensor if v.dtype is None else tensor.view(v.dtype)
    return v


def _copied(v):
    t = type(v)
    if t is TensorLeaf:
        import torch
        tensor = torch.from_numpy(v.array.copy())
        return tensor if v.dtype is None else tensor.view(v.dtype)
    if t is np.ndarray:
        return v.copy()
    return v
