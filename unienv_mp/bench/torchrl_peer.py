"""The ``torchrl`` row: a TorchRL ``ReplayBuffer(prefetch=TORCHRL_PREFETCH)`` over the same
rows as UniEnv's buffer (uniform, or slices of an episode for the views case).  torchrl is
optional: it is imported when a sampler is made."""
from .._direct.base import sampled_rows
from .config import TORCHRL_PREFETCH, Config
from .data import dict_storage_tensors


def torchrl_sampler(rb, cfg: Config, seed: int = 0):
    """A TorchRL ``ReplayBuffer(prefetch=TORCHRL_PREFETCH)`` over the same rows, sampled
    uniformly with replacement (``RandomSampler``), as an RL user of TorchRL would.

    Its storage is a ``TensorStorage`` over a TensorDict of the UniEnv buffer's tensors
    in logical order: views of them (no copy) when the buffer's logical rows are its
    physical rows ``0..len-1`` (a buffer filled once, as ``build_buffer`` makes), else a
    copy made here.  Sampling reads it exactly as a filled ``LazyTensorStorage``."""
    import torch
    from tensordict import TensorDict
    from torchrl.data import ReplayBuffer, TensorStorage
    from torchrl.data.replay_buffers.samplers import RandomSampler
    data = dict_storage_tensors(rb)
    n = len(rb)
    rows = sampled_rows(rb, torch.arange(n))   # (the core's mapping)
    in_place = bool(torch.equal(torch.as_tensor(rows), torch.arange(n)))
    td = TensorDict({k: d[:n] if in_place else d.index_select(0, torch.as_tensor(rows))
                     for k, d in data.items()}, batch_size=[n])
    trb = ReplayBuffer(storage=TensorStorage(td), sampler=RandomSampler(),
                       batch_size=cfg.batch_size, prefetch=TORCHRL_PREFETCH,
                       generator=torch.Generator().manual_seed(seed))

    return trb.sample, lambda: _shutdown_torchrl(trb)


def torchrl_slice_sampler(rb, cfg: Config, slice_len: int):
    """TorchRL's ``ReplayBuffer(prefetch=TORCHRL_PREFETCH)`` with its ``SliceSampler``:
    ``cfg.batch_size`` slices of ``slice_len`` consecutive steps of one episode (by the
    ``episode_id`` key) of the ``action`` column, as a TorchRL user samples action
    chunks.  (TorchRL only samples slices that fit in their episode, where UniEnv's view
    pads the last steps of an episode with its last action and masks them.)"""
    import torch
    from tensordict import TensorDict
    from torchrl.data import ReplayBuffer, TensorStorage
    from torchrl.data.replay_buffers.samplers import SliceSampler
    data = dict_storage_tensors(rb)
    n = len(rb)
    td = TensorDict({"action": data["action"][:n], "episode_id": data["episode_id"][:n]},
                    batch_size=[n])
    trb = ReplayBuffer(storage=TensorStorage(td),
                       sampler=SliceSampler(slice_len=slice_len, traj_key="episode_id"),
                       batch_size=cfg.batch_size * slice_len, prefetch=TORCHRL_PREFETCH,
                       generator=torch.Generator().manual_seed(0))
    return trb.sample, lambda: _shutdown_torchrl(trb)


def _shutdown_torchrl(trb):
    """Stop a TorchRL ReplayBuffer's prefetch thread pool (after its pending samples):
    its public ``shutdown()``."""
    shutdown = getattr(trb, "shutdown", None)
    if shutdown is not None:
        shutdown()
        return
    # No public API exists before torchrl's shutdown(): stop its prefetch pool directly.
    executor = getattr(trb, "_prefetch_executor", None)
    if executor is not None:
        executor.shutdown(wait=True)
