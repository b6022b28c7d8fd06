"""Episodic data sets and UniEnv views over them, for the view tests (importable by spawned
workers): {obs: {state, image}, action, reward, episode_id, episode_end}, as robot
learners store demonstrations."""
import numpy as np
import torch
from unienv_data.batches.combined_batch import CombinedBatch
from unienv_data.batches.framestack_batch import FrameStackedBatch
from unienv_data.batches.slicestack_batch import SliceStackedBatch
from unienv_data.batches.subindex_batch import SubIndexedBatch
from unienv_data.batches.subitem_batch import SubItemBatch
from unienv_data.replay_buffer import ReplayBuffer
from unienv_data.samplers import StepSampler
from unienv_data.storages.dict_storage import DictStorage
from unienv_data.storages.pytorch import PytorchTensorStorage
from unienv_interface.backends.pytorch import PyTorchComputeBackend as TB
from unienv_interface.space import BinarySpace, BoxSpace, DictSpace

IMG = (3, 4, 4)
KEYS = ("obs/state", "obs/image", "action", "reward", "episode_id", "episode_end")
EPISODE_ID = SliceStackedBatch.get_valid_mask_function_with_episodeid_key("episode_id")
EPISODE_END = SliceStackedBatch.get_valid_mask_function_with_episode_end_key("episode_end")


def space(img=IMG):
    return DictSpace(TB, {
        "obs": DictSpace(TB, {
            "state": BoxSpace(TB, -1e9, 1e9, torch.float32, shape=(10,)),
            "image": BoxSpace(TB, 0, 255, torch.uint8, shape=img),
        }),
        "action": BoxSpace(TB, -1.0, 1.0, torch.float32, shape=(7,)),
        "reward": BoxSpace(TB, -1e9, 1e9, torch.float32, shape=()),
        "episode_id": BoxSpace(TB, 0, 2 ** 40, torch.int64, shape=()),
        "episode_end": BinarySpace(TB, shape=()),
    })


def steps(start, lengths, img=IMG, seed=0):
    """Consecutive episodes of the given lengths, numbered from ``start``'s episode on;
    ``obs.state[:, 0]`` is the step's number, so a batch tells which steps it holds."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    n = int(ids.shape[0])
    first = torch.cumsum(torch.tensor([0] + list(lengths[:-1])), 0)
    pos = torch.arange(n) - first[ids]
    end = pos == torch.tensor(lengths)[ids] - 1
    i = torch.arange(start, start + n)
    state = torch.rand(n, 10, generator=gen)
    state[:, 0] = i.to(torch.float32)
    return {"obs": {"state": state,
                    "image": torch.randint(0, 256, (n, *img), generator=gen,
                                           dtype=torch.uint8)},
            "action": torch.rand(n, 7, generator=gen) * 2 - 1,
            "reward": torch.rand(n, generator=gen),
            "episode_id": ids + start,
            "episode_end": end}


def buffer(lengths=(20,) * 10, capacity=None, multiprocessing=False, img=IMG, start=0,
           seed=0):
    """A ReplayBuffer of the episodes; with a ``capacity`` below their total length it
    has wrapped around (an episode may cross the wrap)."""
    total = int(sum(lengths))
    rb = ReplayBuffer.create(DictStorage, space(img), {k: PytorchTensorStorage for k in KEYS},
                             capacity=capacity or total, is_memmap=False,
                             multiprocessing=multiprocessing)
    data = steps(start, list(lengths), img, seed)
    cap = capacity or total
    for a in range(0, total, cap):   # extend() takes at most a capacity at a time
        rb.extend(_rows(data, a, min(total, a + cap)))
    return rb


def _rows(tree, a, b):
    if isinstance(tree, dict):
        return {k: _rows(v, a, b) for k, v in tree.items()}
    return tree[a:b]


def frame_stack(rb, pre=1, post=0, mask=EPISODE_ID, **kwargs):
    return FrameStackedBatch(rb, pre, post, get_valid_mask_function=mask, **kwargs)


def action_chunk(rb, horizon=16, mask=EPISODE_ID):
    return SliceStackedBatch(rb, torch.arange(horizon),
                             get_valid_mask_function=mask).get_column(["action"])


def state_history(rb, mask=EPISODE_END):
    return SliceStackedBatch(rb, torch.arange(-1, 15),
                             get_valid_mask_function=mask).get_column(["obs", "state"])


def combined_stacks(a, b, pre=2):
    return CombinedBatch([frame_stack(a, pre), frame_stack(b, pre)])


def random_view(seed):
    """A random view over random episodic data, from ``seed``: the same view for the same
    seed, in any process."""
    g = np.random.default_rng(seed)
    lengths = [int(x) for x in g.choice([1, 1, 2, 3, 5, 8, 13], size=int(g.integers(3, 12)))]
    total = sum(lengths)
    wrap = g.random() < 0.4 and total > 4
    capacity = int(g.integers(max(2, total // 2), total)) if wrap else None

    def rb(start=0):
        return buffer(lengths, capacity=capacity, start=start, seed=seed + start)

    def offsets():
        lo, hi = int(g.integers(-6, 1)), int(g.integers(0, 7))
        pool = np.arange(lo, hi + 1)
        keep = pool[g.random(len(pool)) < 0.6]   # gaps
        return torch.tensor(sorted(set(keep.tolist()) | {0}), dtype=torch.int64)

    def stack(inner, meta=None, masked=True):
        mask = [None, EPISODE_ID, EPISODE_END][int(g.integers(0, 3))] if masked else None
        fill = bool(g.random() < 0.7)
        meta = bool(g.random() < 0.5) if meta is None else meta
        if g.random() < 0.3:
            pre, post = int(g.integers(0, 4)), int(g.integers(0, 4))
            if pre == post == 0:
                pre = 1
            return FrameStackedBatch(inner, pre, post, get_valid_mask_function=mask,
                                     fill_invalid_data=fill, stack_metadata=meta)
        return SliceStackedBatch(inner, offsets(), get_valid_mask_function=mask,
                                 fill_invalid_data=fill, stack_metadata=meta)

    kind = int(g.integers(0, 8))
    if kind == 0:
        view = stack(rb())
    elif kind == 1:
        view = stack(rb()).get_column([["action"], ["obs", "state"], ["episode_id"]][
            int(g.integers(0, 3))])
    elif kind == 2:
        view = SubItemBatch(stack(rb()), ["obs"])
    elif kind == 3:
        inner = rb()
        n = len(inner)
        sub = torch.tensor(g.integers(-n, n, size=int(g.integers(1, 2 * n))),
                           dtype=torch.int64)
        view = stack(SubIndexedBatch(inner, sub))
    elif kind == 4:
        view = _combined_of_stacks(stack, rb)
    elif kind == 5:
        view = stack(CombinedBatch([rb(), rb(1000)]))
    elif kind == 6:
        # (UniEnv cannot stack the metadata of a stack, nor mask a stack of one: its fill
        # wants a 2-D mask)
        view = stack(stack(rb()), meta=False, masked=False)
    else:
        view = _combined_of_stacks(stack, rb).get_column(["obs", "image"])
    return view


def _combined_of_stacks(stack, rb):
    """Two stacks over two buffers, with the same offsets and options (CombinedBatch
    wants the same spaces)."""
    a = stack(rb())
    b = SliceStackedBatch(rb(1000), a.fixed_offset,
                          get_valid_mask_function=a.get_valid_mask_function,
                          fill_invalid_data=a.fill_invalid_data,
                          stack_metadata=a.stack_metadata)
    return CombinedBatch([a, b])


def sampler_of(view, batch_size=8, seed=0):
    return StepSampler(view, batch_size, seed=seed)
