"""Batches handed out on the GPU: StepSampler(rb, batch_size, device="cuda"), wrapped.

Workers gather each batch on the CPU; the training process copies it to the GPU from
page-locked memory while the previous training step runs. Needs a CUDA device; without
one, this script says so and exits.
Run: python examples/gpu_feed.py [--steps N]
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

N, BATCH = 5000, 256


def make_buffer():
    """A ReplayBuffer on the CPU of {image 3x32x32 uint8, action 7 float32}."""
    space = DictSpace(B, {"image": BoxSpace(B, 0, 255, torch.uint8, shape=(3, 32, 32)),
                          "action": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(7,))})
    rb = ReplayBuffer.create(DictStorage, space,
                             {k: PytorchTensorStorage for k in space.spaces},
                             capacity=N, is_memmap=False)
    rb.extend({"image": torch.randint(0, 256, (N, 3, 32, 32), dtype=torch.uint8),
               "action": torch.rand(N, 7) * 2 - 1})
    return rb


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be 1 or more")
    if not torch.cuda.is_available():
        print("no CUDA device here: skipped (this example needs torch.cuda.is_available())")
        return

    rb = make_buffer()   # the data stays on the CPU
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 7)).to("cuda")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    # device="cuda" on the wrapped sampler: batches come out as tensors on cuda:0, ready on
    # the current CUDA stream. The workers never touch CUDA. (Data already on the GPU
    # would be sampled in this process instead, with no workers: docs/guides/gpu.md.)
    sampler = MultiprocessingSampler(StepSampler(rb, BATCH, seed=0, device="cuda"),
                                     n_workers=2)
    with sampler:
        for _ in range(args.steps):
            batch = sampler.sample()
            images = batch["image"].float() / 255
            loss = torch.nn.functional.mse_loss(model(images), batch["action"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"{args.steps} steps; last batch:",
              {k: (tuple(v.shape), str(v.device)) for k, v in batch.items()},
              f"loss {loss.item():.4f}")
        stats = sampler.stats().device
        print(f"{stats.copies} copies to {stats.device}, "
              f"{stats.copy_seconds * 1e3:.1f} ms of device time; "
              f"{stats.pinned_bytes / 2 ** 20:.1f} MiB page-locked, "
              f"{stats.pageable_leaves} arrays copied from pageable memory")


if __name__ == "__main__":
    main()
