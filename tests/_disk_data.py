"""Small buffers on UniEnv's file-backed storages, for the tests of data on disk (importable
by spawned workers).  Every row says which step it is: ``state[0]`` is the step's number,
the images' pixels are a function of it."""
import importlib.util
import os

import numpy as np
import torch
from unienv_data.replay_buffer import ReplayBuffer
from unienv_interface.backends.numpy import NumpyComputeBackend as NB
from unienv_interface.backends.pytorch import PyTorchComputeBackend as TB
from unienv_interface.space import BinarySpace, BoxSpace, DictSpace

ROWS = 96
HW = 16

#: The libraries each kind of buffer needs (the `disk` extra brings them).
NEEDS = {
    "hdf5": ("h5py",), "hdf5-writable": ("h5py",), "hdf5-gzip": ("h5py",),
    "hdf5-unbounded": ("h5py",), "memmap": (), "flattened": (), "parquet": ("pyarrow",),
    "images": ("h5py", "PIL"), "video": ("h5py", "av"),
}
KINDS = tuple(NEEDS)


def missing(kind):
    """The first library ``kind`` needs that is not installed, or None."""
    for lib in NEEDS[kind]:
        if importlib.util.find_spec(lib) is None:
            return lib
    return None


def np_space(image_keys=("image",)):
    spaces = {
        "state": BoxSpace(NB, -1e9, 1e9, np.float32, shape=(5,)),
        "action": BoxSpace(NB, -1.0, 1.0, np.float32, shape=(3,)),
        "done": BinarySpace(NB, shape=(), dtype=np.bool_),
    }
    for key in image_keys:
        spaces[key] = BoxSpace(NB, 0, 255, np.uint8, shape=(HW, HW, 3))
    return DictSpace(NB, spaces)


def torch_space():
    return DictSpace(TB, {
        "state": BoxSpace(TB, -1e9, 1e9, torch.float32, shape=(5,), device="cpu"),
        "image": BoxSpace(TB, 0, 255, torch.uint8, shape=(3, HW, HW), device="cpu"),
        "done": BinarySpace(TB, shape=(), dtype=torch.bool, device="cpu"),
    }, device="cpu")


def steps(start, n, space, seed=0):
    """Rows ``start`` to ``start + n`` of ``space``: state[0] the step, images smooth (so
    that lossy codecs keep them near) and a function of the step."""
    rng = np.random.default_rng(seed + start)
    ids = np.arange(start, start + n)
    out = {}
    for key, sub in space.spaces.items():
        if key == "state":
            v = rng.uniform(-1, 1, (n, 5)).astype(np.float32)
            v[:, 0] = ids
        elif key == "action":
            v = rng.uniform(-1, 1, (n, 3)).astype(np.float32)
        elif key == "done":
            v = ids % 7 == 6
        else:
            shape = tuple(sub.shape)
            yy, xx = np.mgrid[0:HW, 0:HW]
            base = ((xx + yy) * 4)[None, :, :] + 3 * ids[:, None, None]
            v = np.stack([base, base * 2, base + 40], -1) % 256
            v = v.astype(np.uint8)
            if shape[0] == 3:
                v = np.ascontiguousarray(v.transpose(0, 3, 1, 2))
        if space.backend is TB:
            v = torch.from_numpy(np.ascontiguousarray(v))
        out[key] = v
    return out


def _fill(rb, space, n=ROWS):
    for s in range(0, n, 32):
        rb.extend(steps(s, min(32, n - s), space))


def build(kind, root, rows=ROWS):
    """A ReplayBuffer of ``rows`` steps of ``kind`` under the folder ``root``: written,
    saved and loaded back read-only as a user loads a data set, except
    ``hdf5-writable`` and ``hdf5-unbounded`` (the buffer that wrote them, its file open
    for writing)."""
    from unienv_data.storages.dict_storage import DictStorage
    path = os.path.join(root, kind)
    if kind in ("memmap", "flattened"):
        from unienv_data.storages.flattened import FlattenedStorage
        from unienv_data.storages.pytorch import PytorchTensorStorage
        space = torch_space()
        if kind == "memmap":
            rb = ReplayBuffer.create(DictStorage, space,
                                     storage_cls_map={k: PytorchTensorStorage
                                                      for k in space.spaces},
                                     cache_path=path, capacity=rows, is_memmap=True)
        else:
            rb = ReplayBuffer.create(FlattenedStorage, space,
                                     inner_storage_cls=PytorchTensorStorage,
                                     cache_path=path, capacity=rows, is_memmap=True)
        _fill(rb, space, rows)
        rb.dumps(path)
        rb.close()
        return ReplayBuffer.load_from(path, backend=TB, device="cpu", is_memmap=True)
    if kind == "parquet":
        from unienv_data.storages.parquet import ParquetStorage
        space = np_space()
        rb = ReplayBuffer.create(ParquetStorage, space, cache_path=path, capacity=rows,
                                 piece_size=32)
        _fill(rb, space, rows)
        rb.dumps(path)
        rb.close()
        return ReplayBuffer.load_from(path, backend=NB)
    from unienv_data.storages.hdf5 import HDF5Storage
    if kind.startswith("hdf5"):
        space = np_space()
        kwargs = {"capacity": rows}
        if kind == "hdf5-gzip":
            kwargs.update(chunks=True, compression="gzip")
        if kind == "hdf5-unbounded":
            kwargs = {"capacity": None}
        rb = ReplayBuffer.create(HDF5Storage, space, cache_path=path, **kwargs)
        _fill(rb, space, rows)
        if kind in ("hdf5-writable", "hdf5-unbounded"):
            return rb
        rb.dumps(path)
        rb.close()
        return ReplayBuffer.load_from(path, backend=NB)
    if kind == "images":
        from unienv_data.storages.image_storage import ImageStorage
        from unienv_data.storages.npz_storage import NPZStorage
        space = np_space(("png", "jpeg", "npz"))
        rb = ReplayBuffer.create(
            DictStorage, space, cache_path=path, capacity=rows,
            storage_cls_map={"png": ImageStorage, "jpeg": ImageStorage, "npz": NPZStorage,
                             "*": HDF5Storage},
            key_kwargs={"png": {"format": "PNG"}, "jpeg": {"format": "JPEG",
                                                           "quality": 90}})
        _fill(rb, space, rows)
        rb.dumps(path)
        rb.close()
        return ReplayBuffer.load_from(path, backend=NB)
    if kind == "video":
        from unienv_data.storages.video_storage import VideoStorage
        space = np_space()
        video = {"codec": "libx264", "file_ext": "mp4", "hardware_acceleration": None,
                 "decode_backend": "pyav", "encoder_options": {"crf": "23", "g": "8"}}
        rb = ReplayBuffer.create(DictStorage, space, cache_path=path, capacity=rows,
                                 storage_cls_map={"image": VideoStorage, "*": HDF5Storage},
                                 key_kwargs={"image": video})
        _fill(rb, space, rows)
        rb.dumps(path)
        rb.close()
        return ReplayBuffer.load_from(
            path, backend=NB, key_kwargs={"image": {"hardware_acceleration": None,
                                                    "decode_backend": "pyav",
                                                    "codec": "libx264"}})
    raise ValueError(kind)


def close(rb):
    storage = rb.storage
    rb.close()
    if storage is not None:
        storage.close()


def same_batch(a, b):
    """Bit for bit: the same structure, key order, array types, dtypes, shapes and bytes."""
    if isinstance(a, dict):
        return (type(b) is dict and list(a) == list(b)
                and all(same_batch(a[k], b[k]) for k in a))
    if isinstance(a, (tuple, list)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same_batch(x, y) for x, y in zip(a, b)))
    if isinstance(a, (np.ndarray, torch.Tensor)):
        if type(a) is not type(b):
            return False
        if isinstance(a, torch.Tensor):
            a, b = a.numpy(), b.numpy()
        return (a.dtype == b.dtype and a.shape == b.shape
                and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())
    return a == b


def step_ids(batch):
    """The steps a batch holds (state[:, 0], or for a flattened buffer its first
    column... see torch_space's key order)."""
    state = batch["state"]
    if isinstance(state, torch.Tensor):
        state = state.numpy()
    return np.asarray(state)[:, 0].round().astype(np.int64).tolist()
