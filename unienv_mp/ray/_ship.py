"""How the wrapped sampler travels to the actors: once, through Ray's object store, with
the data of its large arrays and tensors out of the pickle.

Ray keeps a numpy array's bytes out of band: an actor on the node maps them from the
object store, read-only, with no copy.  A torch tensor it pickles whole, into the stream,
and every actor that reads it makes a private copy (a 200 MB buffer costs each actor
200 MB).  So `Shipped` pickles the sampler itself, handing every CPU tensor's storage and
every numpy array of at least ``OUT_OF_BAND`` bytes to Ray as a numpy array beside the
pickle; the actor makes the tensors again over those arrays (views of the object store,
which sampling only reads).  Tensors that share a storage share it again.
"""
import io
import pickle
import sys
import warnings

import numpy as np
from ray import cloudpickle

__all__ = ["Shipped", "OUT_OF_BAND"]

#: Arrays and tensor storages at least this large travel beside the pickle.
OUT_OF_BAND = 64 * 1024


class _Pickler(cloudpickle.CloudPickler):
    def __init__(self, file):
        super().__init__(file, protocol=5)
        self.arrays = []
        self.storages = {}   # data_ptr -> index in arrays

    def persistent_id(self, obj):
        t = type(obj)
        if t is np.ndarray:
            if obj.nbytes < OUT_OF_BAND or obj.dtype.hasobject:
                return None
            self.arrays.append(obj)
            return ("array", len(self.arrays) - 1)
        torch = sys.modules.get("torch")
        if torch is None or t is not torch.Tensor:
            return None
        if obj.device.type != "cpu" or obj.requires_grad or obj.is_sparse \
                or obj.is_quantized or obj.is_conj() or obj.is_neg():
            return None
        storage = obj.untyped_storage()
        if storage.nbytes() < OUT_OF_BAND:
            return None
        index = self.storages.get(storage.data_ptr())
        if index is None:
            raw = torch.empty(0, dtype=torch.uint8).set_(storage)
            self.arrays.append(raw.numpy())
            index = self.storages[storage.data_ptr()] = len(self.arrays) - 1
        return ("tensor", index, str(obj.dtype).split(".")[1], tuple(obj.shape),
                obj.stride(), obj.storage_offset())


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, arrays):
        super().__init__(file)
        self.arrays = arrays
        self.storages = {}

    def persistent_load(self, pid):
        if pid[0] == "array":
            return self.arrays[pid[1]]
        import torch
        _, index, dtype, shape, stride, offset = pid
        storage = self.storages.get(index)
        if storage is None:
            with warnings.catch_warnings():
                # (a read-only view of the object store: sampling never writes into it)
                warnings.filterwarnings("ignore", message="The given NumPy array is not "
                                                          "writable")
                storage = torch.from_numpy(self.arrays[index]).untyped_storage()
            self.storages[index] = storage
        out = torch.empty(0, dtype=getattr(torch, dtype))
        return out.set_(storage, offset, shape, stride)


def _rebuild(payload, arrays):
    return _Unpickler(io.BytesIO(payload), arrays).load()


class Shipped:
    """``obj`` on its way to the actors (``ray.put(Shipped(obj))``); an actor gets
    ``obj`` itself back, its large arrays and tensors views of the object store.

    Args:
        obj: what to ship (e.g. a ``SamplerTarget``).
    """

    def __init__(self, obj):
        self.obj = obj

    def __reduce__(self):
        f = io.BytesIO()
        p = _Pickler(f)
        p.dump(self.obj)
        return _rebuild, (f.getvalue(), p.arrays)
