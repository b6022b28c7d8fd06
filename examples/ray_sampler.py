"""RaySampler: the same sampler with its workers on Ray actors, here on a local Ray.

It gives the same batches as MultiprocessingSampler for the same seed. Needs Ray
(pip install "unienv_mp[ray]"); without it, this script says so and exits.
Run: python examples/ray_sampler.py [--steps N]
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

N, BATCH = 2000, 64


def make_buffer():
    space = DictSpace(B, {"obs": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(10,)),
                          "action": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(7,))})
    rb = ReplayBuffer.create(DictStorage, space, {"obs": PytorchTensorStorage,
                             "action": PytorchTensorStorage}, capacity=N, is_memmap=False)
    rb.extend({"obs": torch.rand(N, 10) * 2 - 1, "action": torch.rand(N, 7) * 2 - 1})
    return rb


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="batches to sample")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be 1 or more")
    try:
        import ray
        from unienv_mp.ray import RaySampler
    except ImportError:
        print('RaySampler needs Ray: pip install "unienv_mp[ray]". Skipped.')
        return

    rb = make_buffer()
    # For comparison: the first batches of a MultiprocessingSampler with seed 0.
    with MultiprocessingSampler(StepSampler(rb, BATCH, seed=0), n_workers=2) as sampler:
        local = [sampler.sample() for _ in range(args.steps)]

    # Without ray.init() here, RaySampler would join a running cluster or start a local
    # Ray of its own (docs/guides/ray.md); on a cluster, ray.init(address=...) instead.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        # The sampler, with rb inside, goes into Ray's object store once, and the actors
        # of a node map its tensors from there, without a copy each. (For data too big
        # to ship, each actor can open its own: sampler_factory, in docs/guides/ray.md.)
        with RaySampler(StepSampler(rb, BATCH, seed=0), n_workers=2) as sampler:
            for j in range(args.steps):
                batch = sampler.sample()
                # The same seed gives the same batches as with worker processes.
                assert torch.equal(batch["obs"], local[j]["obs"])
                assert torch.equal(batch["action"], local[j]["action"])
            shapes = {k: tuple(v.shape) for k, v in batch.items()}
            print(f"{args.steps} batches from {len(sampler.workers)} Ray actors, "
                  f"the same as MultiprocessingSampler's: {shapes}")
            # Batches made on this node are views of an actor's result slot, as the
            # process workers' are. Those made on other nodes are read zero-copy from
            # Ray's object store, where writing into one would change the stored object:
            # numpy arrays are marked read-only; torch tensors cannot be, so do not write
            # into a batch in place unless it is yours: .clone() first, or make the
            # sampler with copy=True.
            obs = batch["obs"].clone()
            obs.mul_(2)   # fine: the clone is ours
    finally:
        ray.shutdown()   # we started this Ray, so we stop it
    print("Ray shut down")


if __name__ == "__main__":
    main()
