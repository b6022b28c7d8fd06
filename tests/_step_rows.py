"""Replay buffers whose every row tells, in every key, which step it holds, and the checks
that a row handed out is one the buffer holds (importable by spawned workers).

Step ``s`` is written into every key of its row: ``step`` = s; ``obs`` (6 float32) all
s; ``action`` (3 float32) all -s - 0.5; ``episode`` = s // EPISODE; ``image`` (uint8)
the 8 bytes of s (little-endian int64), then s % 251 in every other byte.  A row whose
keys tell different steps is torn (its fields come from different copies of the data);
`step_of` finds it.  A change of the data (``+ 1000`` on one key, say) makes rows that
no copy of the unchanged data holds, so a stale row is told by its contents too
(`rows_of` and `buffer_rows` compare them bit for bit).
"""
import collections

import numpy as np
import torch
from unienv_data.replay_buffer import ReplayBuffer
from unienv_data.storages.dict_storage import DictStorage
from unienv_data.storages.pytorch import PytorchTensorStorage
from unienv_interface.backends.pytorch import PyTorchComputeBackend as TB
from unienv_interface.space import BoxSpace, DictSpace

KEYS = ("action", "episode", "image", "obs", "step")
EPISODE = 10
IMG = (8,)


def space(img=IMG):
    return DictSpace(TB, {
        "step": BoxSpace(TB, 0, 2 ** 40, torch.int64, shape=()),
        "obs": BoxSpace(TB, -1e9, 1e9, torch.float32, shape=(6,)),
        "action": BoxSpace(TB, -1e9, 1e9, torch.float32, shape=(3,)),
        "episode": BoxSpace(TB, 0, 2 ** 40, torch.int64, shape=()),
        "image": BoxSpace(TB, 0, 255, torch.uint8, shape=img),
    })


def rows(start, count, img=IMG):
    """The rows of steps ``start`` to ``start + count - 1``."""
    s = torch.arange(start, start + count, dtype=torch.int64)
    image = (s % 251).to(torch.uint8).view(-1, *([1] * len(img))).expand(
        count, *img).contiguous()
    head = np.frombuffer(s.numpy().astype("<i8").tobytes(), dtype=np.uint8)
    image.view(count, -1)[:, :8] = torch.from_numpy(head.reshape(count, 8).copy())
    f = s.to(torch.float32).view(-1, 1)
    return {"step": s.clone(), "obs": f.expand(count, 6).contiguous(),
            "action": (-f - 0.5).expand(count, 3).contiguous(),
            "episode": s // EPISODE, "image": image}


def buffer(n, capacity=None, img=IMG, multiprocessing=False):
    """A ReplayBuffer of steps 0 to ``n - 1`` (room for ``capacity``)."""
    rb = ReplayBuffer.create(DictStorage, space(img),
                             {k: PytorchTensorStorage for k in KEYS},
                             capacity=capacity or n, multiprocessing=multiprocessing,
                             is_memmap=False)
    if n:
        rb.extend(rows(0, n, img))
    return rb


def tensor(rb, key):
    """The tensor that holds ``key`` in ``rb``'s storage."""
    return rb.storage.storage_map[key].data


def step_of(row):
    """The step a row (a dict of one row's tensors) holds; AssertionError if its keys tell
    different steps (a torn row)."""
    told = {}
    told["step"] = int(row["step"])
    obs = row["obs"].reshape(-1)
    assert bool((obs == obs[0]).all()), f"obs not uniform: {obs.tolist()}"
    told["obs"] = float(obs[0])
    action = row["action"].reshape(-1)
    assert bool((action == action[0]).all()), f"action not uniform: {action.tolist()}"
    told["action"] = -float(action[0]) - 0.5
    image = row["image"].reshape(-1).numpy()
    head = int(np.frombuffer(image[:8].tobytes(), dtype="<i8")[0])
    told["image"] = head
    assert bool((image[8:] == head % 251).all()), f"image of step {head}: a torn image"
    s = told["step"]
    assert all(v == s for v in told.values()) and int(row["episode"]) == s // EPISODE, (
        f"a torn row (its keys tell different steps): {told}, episode "
        f"{int(row['episode'])}")
    return s


def batch_rows(batch):
    """The rows of a dict batch, as dicts of one row's tensors (copies)."""
    n = batch["step"].shape[0]
    return [{k: batch[k][i].clone() for k in KEYS} for i in range(n)]


def steps_of(batch):
    """The step of every row of ``batch``, each row checked whole (`step_of`)."""
    return [step_of(r) for r in batch_rows(batch)]


def row_bytes(row):
    return b"".join(row[k].contiguous().numpy().tobytes() for k in KEYS)


def rows_of(batch):
    """The rows of ``batch`` as bytes, bit for bit."""
    n = batch["step"].shape[0]
    parts = [batch[k].reshape(n, -1).contiguous().numpy().view(np.uint8).reshape(n, -1)
             for k in KEYS]
    whole = np.concatenate(parts, axis=1)
    return [bytes(r) for r in whole]


def buffer_rows(rb):
    """Every row ``rb`` holds now, as bytes (as `rows_of` makes them), read in this
    process: a Counter (an epoch hands out each exactly once)."""
    return collections.Counter(rows_of(rb.get_at(torch.arange(len(rb)))))


def epoch_rows(batches):
    """The rows of an epoch's batches, as a Counter of bytes."""
    return collections.Counter(r for b in batches for r in rows_of(b))


def clone(tree):
    """A copy of a batch that holds no slot."""
    if isinstance(tree, dict):
        return {k: clone(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(clone(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    return tree


def same_batch(a, b):
    """Bit for bit (dicts, tuples, tensors)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_batch(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_batch(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and bytes(a.contiguous().numpy().view(np.uint8)) ==
                bytes(b.contiguous().numpy().view(np.uint8)))
    return a == b
