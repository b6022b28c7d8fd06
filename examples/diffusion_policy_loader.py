"""A diffusion-policy style loader: 2 camera frames plus the next 8 actions, of one step.

One sampler over a WindowedBatch: the image at steps t-1 and t, the actions t .. t+7,
padded where the window leaves the episode, with a mask per key the loss uses.
Run: python examples/diffusion_policy_loader.py [--steps N]
"""
import argparse

import torch
from unienv_data.replay_buffer import ReplayBuffer
from unienv_data.samplers import StepSampler
from unienv_data.storages.dict_storage import DictStorage
from unienv_data.storages.pytorch import PytorchTensorStorage
from unienv_interface.backends.pytorch import PyTorchComputeBackend as B
from unienv_interface.space import BoxSpace, DictSpace

from unienv_mp import MultiprocessingSampler, WindowedBatch

N_EPISODES, EPISODE_LEN = 20, 50   # 1000 steps of demonstrations
BATCH = 32
HISTORY = [-1, 0]                  # the image at steps t-1 and t
CHUNK = list(range(8))             # actions t .. t+7


def make_buffer():
    """A ReplayBuffer of demonstrations: a 3x32x32 camera image, a 7-d action and the
    episode each step belongs to."""
    space = DictSpace(B, {
        "image": BoxSpace(B, 0, 255, torch.uint8, shape=(3, 32, 32)),
        "action": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(7,)),
        "episode_id": BoxSpace(B, 0, 2 ** 31, torch.int64, shape=()),
    })
    n = N_EPISODES * EPISODE_LEN
    rb = ReplayBuffer.create(DictStorage, space,
                             {k: PytorchTensorStorage for k in space.spaces},
                             capacity=n, is_memmap=False)
    rb.extend({"image": torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8),
               "action": torch.rand(n, 7) * 2 - 1,
               "episode_id": torch.arange(N_EPISODES).repeat_interleave(EPISODE_LEN)})
    return rb


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps (batches)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be 1 or more")

    rb = make_buffer()
    # One element per step t: each key's own window of steps around t.  A step outside
    # t's episode (told by episode_id) repeats the episode's nearest step, as diffusion
    # policy and LeRobot pad: its first frame before it starts, its last action after
    # it ends; meta["<key>_is_pad"] says which.  In seconds, as LeRobot's
    # delta_timestamps: WindowedBatch(rb, delta_timestamps={...}, fps=...).
    view = WindowedBatch(rb, {"image": HISTORY, "action": CHUNK},
                         episode_id_key="episode_id", keep_other_keys=False)
    sampler = MultiprocessingSampler(StepSampler(view, BATCH, seed=0), n_workers=2)
    padded = total = 0
    with sampler:
        for _ in range(args.steps):
            batch, meta = sampler.sample_with_metadata()
            images = batch["image"].float() / 255     # a model's input: (B, 2, 3, 32, 32)
            actions = batch["action"]                 # the target: (B, 8, 7)
            pad = meta["action_is_pad"]               # (B, 8): True past the episode's end
            # A diffusion policy's loss over the actions the episode really has: a
            # stand-in prediction here, the padded actions left out.
            prediction = torch.zeros_like(actions)
            error = ((prediction - actions) ** 2).mean(-1)        # (B, 8)
            loss = (error * ~pad).sum() / (~pad).sum().clamp(min=1)
            padded += int(pad.sum())
            total += pad.numel()
            # ... the model's training step on (images, actions, loss) goes here
        print(f"{args.steps} batches of one sampler, image history and action chunk of "
              f"the same steps")
        print("image history:", tuple(images.shape), images.dtype)
        print("action chunk: ", tuple(actions.shape), actions.dtype)
        print("pad masks:    ", tuple(meta["image_is_pad"].shape),
              tuple(pad.shape), pad.dtype,
              f"({padded} of {total} actions padded, left out of the loss)")
        print("last loss:    ", f"{float(loss):.3f}")
        print("gather path:  ", sampler.gather_path)


if __name__ == "__main__":
    main()
