"""An online RL loop: the training process appends new transitions to a ReplayBuffer
while worker processes sample batches from it.

The buffer is made with multiprocessing=True, so the workers see every append.
Run: python examples/online_rl_loop.py [--steps N]
"""
import argparse

import torch
from unienv_data.replay_buffer import ReplayBuffer
from unienv_data.samplers import StepSampler
from unienv_data.storages.dict_storage import DictStorage
from unienv_data.storages.pytorch import PytorchTensorStorage
from unienv_interface.backends.pytorch import PyTorchComputeBackend as B
from unienv_interface.space import BoxSpace, DictSpace

from unienv_mp import MultiprocessingSampler

CAPACITY = 10_000
WARMUP = 256        # random transitions before training starts
PER_STEP = 16       # transitions the agent collects per loop step
BATCH = 64


def make_buffer():
    """A shared ReplayBuffer of {obs, action, reward, step}; ``step`` is the loop step
    that added the transition, so a batch tells how new its data is."""
    space = DictSpace(B, {
        "obs": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(10,)),
        "action": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(7,)),
        "reward": BoxSpace(B, -1e9, 1e9, torch.float32, shape=()),
        "step": BoxSpace(B, 0, 2 ** 62, torch.int64, shape=()),
    })
    # multiprocessing=True: the tensors, and the count of rows, live in shared memory,
    # so the workers sample what the training process appended, not a copy.
    return ReplayBuffer.create(DictStorage, space,
                               {k: PytorchTensorStorage for k in space.spaces},
                               capacity=CAPACITY, is_memmap=False, multiprocessing=True)


def collect(n, step):
    """Stands for n steps of an environment: random transitions, marked with ``step``."""
    return {"obs": torch.rand(n, 10) * 2 - 1, "action": torch.rand(n, 7) * 2 - 1,
            "reward": torch.rand(n), "step": torch.full((n,), step, dtype=torch.int64)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="loop steps")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be 1 or more")

    rb = make_buffer()
    rb.extend(collect(WARMUP, 0))
    # A prefetching sampler's batches were asked for a few steps ahead, so they can miss
    # the newest appends. n_buffers=2 and batches_per_task=1 keep that lag short: at most
    # 2 loop steps (the defaults, n_buffers=8 and up to 8 batches per task, allow 15).
    sampler = MultiprocessingSampler(StepSampler(rb, BATCH, seed=0), n_workers=2,
                                     n_buffers=2, batches_per_task=1)
    with sampler:
        for step in range(1, args.steps + 1):
            rb.extend(collect(PER_STEP, step))   # the agent acts, the buffer grows
            batch = sampler.sample()             # made by a worker from the shared buffer
            # ... an update of the agent on batch goes here
            if step % max(1, args.steps // 5) == 0 or step == args.steps:
                # Rows are drawn uniformly from all the buffer holds, so the share of
                # rows collected while training (step > 0) grows as the buffer does.
                new = int((batch["step"] > 0).sum())
                print(f"step {step:4d}: buffer holds {len(rb):5d} transitions; batch: "
                      f"{new:2d} of {len(batch['step'])} rows collected while training, "
                      f"the newest at step {int(batch['step'].max())}")


if __name__ == "__main__":
    main()
