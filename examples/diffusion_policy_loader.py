"""A diffusion-policy style loader: 2 stacked camera frames plus the next 8 actions.

The observation is a FrameStackedBatch (frames t-1 and t) and the action chunk a
SliceStackedBatch over actions t .. t+7, each sampled by its own MultiprocessingSampler.
Run: python examples/diffusion_policy_loader.py [--steps N]
"""
import argparse

import torch
from unienv_data.batches.framestack_batch import FrameStackedBatch
from unienv_data.batches.slicestack_batch import SliceStackedBatch
from unienv_data.replay_buffer import ReplayBuffer
from unienv_data.samplers import StepSampler
from unienv_data.storages.dict_storage import DictStorage
from unienv_data.storages.pytorch import PytorchTensorStorage
from unienv_interface.backends.pytorch import PyTorchComputeBackend as B
from unienv_interface.space import BoxSpace, DictSpace

from unienv_mp import MultiprocessingSampler

N_EPISODES, EPISODE_LEN = 20, 50   # 1000 steps of demonstrations
BATCH = 32
HISTORY = 1                        # frames before t: 2 frames in all
CHUNK = 8                          # actions t .. t+7


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
    # A window must not reach into another episode: UniEnv's helper marks the steps whose
    # episode_id differs from step t's as invalid, and the view (fill_invalid_data, on by
    # default) repeats the nearest valid step in their place: the episode's first frame
    # before it starts, its last action after it ends, as diffusion policy pads.
    same_episode = SliceStackedBatch.get_valid_mask_function_with_episodeid_key("episode_id")
    # Observation: every key of steps t-1 and t (image (2, 3, 32, 32), action (2, 7), ...).
    frames = FrameStackedBatch(rb, prefetch_horizon=HISTORY,
                               get_valid_mask_function=same_episode)
    # Action chunk: only the action column of steps t .. t+CHUNK-1, shape (CHUNK, 7).
    chunks = SliceStackedBatch(rb, torch.arange(CHUNK),
                               get_valid_mask_function=same_episode).get_column(["action"])

    # How the two are matched: both views have one element per step of rb, and both
    # samplers draw the same steps t for the same seed. A MultiprocessingSampler's j-th
    # batch depends only on the seed, j and batches_per_task, whose default depends on
    # the batch's size in bytes, so it is set to the same value for both. The stream
    # also depends on the method: call the same one on both (here sample_with_metadata).
    obs_sampler = MultiprocessingSampler(StepSampler(frames, BATCH, seed=0), n_workers=2,
                                         batches_per_task=4)
    act_sampler = MultiprocessingSampler(StepSampler(chunks, BATCH, seed=0), n_workers=1,
                                         batches_per_task=4)
    with obs_sampler, act_sampler:
        for _ in range(args.steps):
            obs, _ = obs_sampler.sample_with_metadata()
            actions, meta = act_sampler.sample_with_metadata()
            # meta["slice_valid_mask"] (B, CHUNK): False where the chunk ran past the end of
            # its episode and was padded, for a loss that leaves those actions out
            valid = meta["slice_valid_mask"]
            # The check that they are matched: the last stacked frame is step t, and so
            # is the chunk's first action.
            assert torch.equal(obs["action"][:, -1], actions[:, 0])
            images = obs["image"].float() / 255   # a model's input: (B, 2, 3, 32, 32)
            # ... a diffusion policy's training step on (images, actions) goes here
        print(f"{args.steps} batches, observation and action chunk of the same steps")
        print("image history:", tuple(images.shape), images.dtype)
        print("action chunk: ", tuple(actions.shape), actions.dtype)
        print("valid mask:   ", tuple(valid.shape), valid.dtype,
              f"({int((~valid).sum())} of {valid.numel()} actions padded in the last batch)")
        print("gather paths: ", obs_sampler.gather_path, act_sampler.gather_path)


if __name__ == "__main__":
    main()
