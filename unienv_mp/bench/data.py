"""The main job's data: the ReplayBuffers of its cases (``case_data``), each filled with
seeded random steps, and ``dict_storage_tensors``, the tensors behind a flat buffer."""
import contextlib
import os
import tempfile
from typing import Callable

from .config import EPISODE_STEPS, Config, case_missing


def build_buffer(cfg: Config, progress: Callable[[int], None] = lambda n: None):
    """An in-memory ReplayBuffer of ``cfg.transitions`` steps of
    {state: 10 f32, action: 7 f32, image: ``cfg.image_shape`` u8} (or no image if the
    shape is empty)."""
    import torch
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    from unienv_interface.backends.pytorch import PyTorchComputeBackend as B
    from unienv_interface.space import BoxSpace, DictSpace

    spaces = {"state": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(10,)),
              "action": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(7,))}
    if cfg.image_shape:
        spaces["image"] = BoxSpace(B, 0, 255, torch.uint8, shape=tuple(cfg.image_shape))
    rb = ReplayBuffer.create(DictStorage, DictSpace(B, spaces),
                             {k: PytorchTensorStorage for k in spaces},
                             capacity=cfg.transitions, is_memmap=False)
    gen = torch.Generator().manual_seed(0)
    chunk = 500
    for start in range(0, cfg.transitions, chunk):
        n = min(chunk, cfg.transitions - start)
        rows = {"state": torch.rand(n, 10, generator=gen) * 2 - 1,
                "action": torch.rand(n, 7, generator=gen) * 2 - 1}
        if cfg.image_shape:
            rows["image"] = torch.randint(0, 256, (n, *cfg.image_shape), dtype=torch.uint8,
                                          generator=gen)
        rb.extend(rows)
        progress(n)
    return rb


JPEG_QUALITY = 75


def _photo_like(n, shape, gen):
    """``n`` H x W x 3 uint8 images that compress about as well as photographs: smooth
    random colour fields (bicubic upsampling of a coarse random grid) with a little
    noise.  Uniform noise would make files several times larger and slower to decode
    than a camera's frames."""
    import torch
    import torch.nn.functional as F
    _, h, w = shape
    coarse = torch.rand(n, 3, max(2, h // 16), max(2, w // 16), generator=gen) * 255
    img = F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False)
    img = img + torch.randn(n, 3, h, w, generator=gen) * 6
    return img.clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def build_episodic_buffer(n, cfg: Config, progress: Callable[[int], None] = lambda n: None,
                          start: int = 0):
    """An in-memory ReplayBuffer of ``n`` steps numbered from ``start``, in episodes of
    ``EPISODE_STEPS``: {obs: {state 10 f32, image ``cfg.image_shape`` u8}, action 7 f32,
    reward f32, episode_id i64, episode_end bool} (the layout of UniEnv's own
    ``benchmarks/batches/bench_pipeline.py``)."""
    import torch
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    from unienv_interface.backends.pytorch import PyTorchComputeBackend as B
    from unienv_interface.space import BinarySpace, BoxSpace, DictSpace

    obs = {"state": BoxSpace(B, -1e6, 1e6, torch.float32, shape=(10,))}
    if cfg.image_shape:
        obs["image"] = BoxSpace(B, 0, 255, torch.uint8, shape=tuple(cfg.image_shape))
    space = DictSpace(B, {
        "obs": DictSpace(B, obs),
        "action": BoxSpace(B, -1, 1, torch.float32, shape=(7,)),
        "reward": BoxSpace(B, -1e6, 1e6, torch.float32, shape=()),
        "episode_id": BoxSpace(B, 0, 10 ** 9, torch.int64, shape=()),
        "episode_end": BinarySpace(B, shape=()),
    })
    keys = [f"obs/{k}" for k in obs] + ["action", "reward", "episode_id", "episode_end"]
    rb = ReplayBuffer.create(DictStorage, space, {k: PytorchTensorStorage for k in keys},
                             capacity=n, is_memmap=False)
    gen = torch.Generator().manual_seed(start)
    chunk = 500
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        i = torch.arange(start + s, start + s + m)
        o = {"state": torch.randn(m, 10, generator=gen)}
        if cfg.image_shape:
            o["image"] = torch.randint(0, 256, (m, *cfg.image_shape), dtype=torch.uint8,
                                       generator=gen)
        rb.extend({"obs": o, "action": torch.rand(m, 7, generator=gen) * 2 - 1,
                   "reward": torch.randn(m, generator=gen),
                   "episode_id": i // EPISODE_STEPS,
                   "episode_end": (i % EPISODE_STEPS) == EPISODE_STEPS - 1})
        progress(m)
    return rb


def build_jpeg_buffer(cfg: Config, directory, progress: Callable[[int], None] = lambda n: None):
    """A ReplayBuffer of ``cfg.transitions`` steps of {state: 10 f32, action: 7 f32,
    image: H x W x 3 u8} whose images are JPEG files (quality ``JPEG_QUALITY``), one per
    step, in UniEnv's ``ImageStorage`` under ``directory/replay``; state and action are
    in memory.  ``cfg.image_shape`` is 3 x H x W; the images are stored and sampled as
    H x W x 3, ImageStorage's layout.  Every ``get`` of a row opens and decodes its file
    (on UniEnv's per-process pool of IO threads)."""
    import torch
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.image_storage import ImageStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    from unienv_interface.backends.pytorch import PyTorchComputeBackend as B
    from unienv_interface.space import BoxSpace, DictSpace

    reason = case_missing("jpeg", cfg)
    if reason is not None:
        raise ValueError(reason)
    _, h, w = cfg.image_shape
    spaces = {"state": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(10,)),
              "action": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(7,)),
              "image": BoxSpace(B, 0, 255, torch.uint8, shape=(h, w, 3))}
    rb = ReplayBuffer.create(
        DictStorage, DictSpace(B, spaces),
        {"state": PytorchTensorStorage, "action": PytorchTensorStorage, "image": ImageStorage},
        cache_path=os.path.join(directory, "replay"), capacity=cfg.transitions,
        type_kwargs={PytorchTensorStorage: {"is_memmap": False},
                     ImageStorage: {"format": "JPEG", "quality": JPEG_QUALITY}})
    gen = torch.Generator().manual_seed(0)
    chunk = 250
    for start in range(0, cfg.transitions, chunk):
        n = min(chunk, cfg.transitions - start)
        rb.extend({"state": torch.rand(n, 10, generator=gen) * 2 - 1,
                   "action": torch.rand(n, 7, generator=gen) * 2 - 1,
                   "image": _photo_like(n, cfg.image_shape, gen)})
        progress(n)
    return rb


def build_online_buffer(cfg: Config, progress: Callable[[int], None] = lambda n: None):
    """A ReplayBuffer shared between processes (``multiprocessing=True``, tensors in
    shared memory) of capacity ``cfg.transitions``, of {state: 10 f32, action: 7 f32,
    clock: i64}, filled to half with ``clock`` 0 (see ``run_online``)."""
    import torch
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    from unienv_interface.backends.pytorch import PyTorchComputeBackend as B
    from unienv_interface.space import BoxSpace, DictSpace

    spaces = {"state": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(10,)),
              "action": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(7,)),
              "clock": BoxSpace(B, 0, 2 ** 62, torch.int64, shape=())}
    rb = ReplayBuffer.create(DictStorage, DictSpace(B, spaces),
                             {k: PytorchTensorStorage for k in spaces},
                             capacity=cfg.transitions, is_memmap=False, multiprocessing=True)
    gen = torch.Generator().manual_seed(0)
    n = max(cfg.batch_size, cfg.transitions // 2)
    rb.extend({"state": torch.rand(n, 10, generator=gen) * 2 - 1,
               "action": torch.rand(n, 7, generator=gen) * 2 - 1,
               "clock": torch.zeros(n, dtype=torch.int64)})
    progress(n)
    return rb


@contextlib.contextmanager
def case_data(case: str, cfg: Config, progress: Callable[[int], None] = lambda n: None):
    """The ReplayBuffer of ``case`` (``with case_data(...) as rb``; the windows case's is
    episodic, ``build_episodic_buffer``); the jpeg case's files live in a temporary
    directory removed on exit.  The online case makes a fresh buffer for every row
    instead (``measure_online``): this yields None for it."""
    if case == "online":
        yield None
    elif case == "windows":
        yield build_episodic_buffer(cfg.transitions, cfg, progress)
    elif case == "views":
        # the buffer, and two halves of as many steps for the combined dataset
        half = cfg.transitions // 2
        yield (build_episodic_buffer(cfg.transitions, cfg, progress),
               [build_episodic_buffer(half, cfg, progress, start=i * half) for i in (0, 1)])
    elif case == "jpeg":
        with tempfile.TemporaryDirectory(prefix="unienv_mp-jpeg-") as directory:
            yield build_jpeg_buffer(cfg, directory, progress)
    else:
        yield build_buffer(cfg, progress)


def dict_storage_tensors(rb):
    """{key: the torch tensor holding every row of that key} of a ReplayBuffer over a flat
    DictStorage of tensor storages (what ``build_buffer`` makes)."""
    storage_map = getattr(rb.storage, "storage_map", None)
    if storage_map is None:
        raise TypeError(f"needs a ReplayBuffer over a DictStorage, not "
                        f"{type(rb.storage).__name__}")
    out = {}
    for key, storage in storage_map.items():
        data = getattr(storage, "data", None)
        if data is None or not hasattr(data, "index_select"):
            raise TypeError(f"needs tensor storages; {key!r} is a {type(storage).__name__}")
        out[key] = data
    return out
