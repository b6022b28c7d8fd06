"""Epochs with epoch_iter(), and a checkpoint taken in the middle of one.

The sampler's state_dict() is saved with torch.save; a new sampler loads it and finishes
the epoch with exactly the batches the first one went on to hand out.
Run: python examples/epochs_checkpoint_resume.py [--steps N]
"""
import argparse
import os
import tempfile

import torch
from unienv_data.replay_buffer import ReplayBuffer
from unienv_data.samplers import StepSampler
from unienv_data.storages.dict_storage import DictStorage
from unienv_data.storages.pytorch import PytorchTensorStorage
from unienv_interface.backends.pytorch import PyTorchComputeBackend as B
from unienv_interface.space import BoxSpace, DictSpace

from unienv_mp import MultiprocessingSampler

N, BATCH = 1000, 64   # 16 batches per epoch, the last one of 40 rows


def make_buffer():
    space = DictSpace(B, {"obs": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(10,)),
                          "action": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(7,))})
    rb = ReplayBuffer.create(DictStorage, space, {"obs": PytorchTensorStorage,
                             "action": PytorchTensorStorage}, capacity=N, is_memmap=False)
    rb.extend({"obs": torch.rand(N, 10) * 2 - 1, "action": torch.rand(N, 7) * 2 - 1})
    return rb


def same_batches(a, b):
    return len(a) == len(b) and all(
        torch.equal(x["obs"], y["obs"]) and torch.equal(x["action"], y["action"])
        for x, y in zip(a, b))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5,
                        help="batches of the second epoch taken before the checkpoint")
    args = parser.parse_args()
    batches_per_epoch = -(-N // BATCH)
    if not 1 <= args.steps < batches_per_epoch:
        parser.error(f"--steps must be between 1 and {batches_per_epoch - 1}")

    rb = make_buffer()
    tmp = tempfile.TemporaryDirectory()
    path = os.path.join(tmp.name, "sampler.pt")

    with MultiprocessingSampler(StepSampler(rb, BATCH, seed=0), n_workers=2) as sampler:
        # A whole epoch: every row once, in a random order.
        rows = sum(len(batch["obs"]) for batch in sampler.epoch_iter())
        print(f"epoch 1: {rows} rows in {batches_per_epoch} batches")

        # The second epoch, interrupted after --steps batches by a checkpoint, as a
        # training job saves one with its model's weights.
        epoch = sampler.epoch_iter()
        for _ in range(args.steps):
            next(epoch)
        torch.save({"sampler": sampler.state_dict()}, path)   # a small dict
        print(f"epoch 2: checkpoint after {args.steps} batches")

        # What the original goes on to hand out: the rest of this epoch, then epoch 3.
        # (Batches are views of shared memory; keeping them is safe, see
        # docs/guides/zero-copy.md.)
        rest = list(epoch)
        third = list(sampler.epoch_iter())

    # Later, in a new process or the same one: a sampler built the same way (the same
    # kind of sampler, batch size and data; n_workers may differ) picks up from there.
    state = torch.load(path)["sampler"]
    with MultiprocessingSampler(StepSampler(rb, BATCH, seed=123), n_workers=1) as resumed:
        resumed.load_state_dict(state)          # replaces the seed given above too
        resumed_rest = list(resumed.epoch_iter())    # the rest of epoch 2
        resumed_third = list(resumed.epoch_iter())   # a new epoch: epoch 3
    tmp.cleanup()

    assert same_batches(resumed_rest, rest), "the resumed epoch differs"
    assert same_batches(resumed_third, third), "the epoch after it differs"
    print(f"resumed: the remaining {len(resumed_rest)} batches of epoch 2 and the "
          f"{len(resumed_third)} of epoch 3 equal the original's")


if __name__ == "__main__":
    main()
