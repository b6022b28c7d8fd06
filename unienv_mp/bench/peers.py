"""The samplers the main job compares (``make_sampler``: ``(next_batch, close)`` of each
implementation of ``config.IMPLEMENTATIONS``), and which of them can run here
(``available``)."""
import importlib.util
import multiprocessing as mp

from .config import IMPLEMENTATIONS, Config
from .index_select import index_select_sampler
from .torchrl_peer import torchrl_sampler


def available():
    """Which implementations can run here, and why not for the others."""
    missing = {}
    if importlib.util.find_spec("torch") is None:
        missing.update({k: "torch is not installed" for k in IMPLEMENTATIONS})
        return missing
    if importlib.util.find_spec("unienv_data") is None:
        missing.update({k: "unienv is not installed" for k in IMPLEMENTATIONS})
        return missing
    try:
        from unienv_data.samplers import MultiprocessingSampler  # noqa: F401
    except ImportError:
        missing["unienv"] = missing["unienv_shm"] = (
            "this unienv has no unienv_data.samplers.MultiprocessingSampler")
    # find_spec only: importing torchrl takes seconds, and it is optional
    if importlib.util.find_spec("torchrl") is None:
        missing["torchrl"] = "torchrl is not installed (pip install torchrl)"
    elif importlib.util.find_spec("tensordict") is None:
        missing["torchrl"] = "tensordict (needed by torchrl) is not installed"
    if importlib.util.find_spec("unienv_data.integrations.pytorch") is None:
        missing["dataloader_epoch"] = "this unienv has no UniEnvAsPyTorchDataset"
    if importlib.util.find_spec("ray") is None:
        missing["ray"] = "ray is not installed (pip install \"unienv_mp[ray]\")"
    return missing


class _SampleDataset:
    """A torch IterableDataset yielding ``sampler.sample()`` forever (one worker's share)."""

    def __init__(self, sampler):
        import torch.utils.data as tud
        self.sampler = sampler
        self.__class__ = type("SampleDataset", (_SampleDataset, tud.IterableDataset), {})

    def __iter__(self):
        import torch.utils.data as tud
        info = tud.get_worker_info()
        if info is not None:
            self.sampler.manual_seed(info.seed % (2 ** 31))
        while True:
            yield self.sampler.sample()


def sampler_object(name: str, rb, cfg: Config, seed: int = 0):
    """The sampler object of implementation ``name`` (one of the UniEnv-API samplers:
    ``unienv_mp``, ``unienv_mp_generic``, ``unienv``, ``unienv_shm``, ``in_process``)
    over a StepSampler of ``rb`` seeded with ``seed``.  Workers start at its first call."""
    from unienv_data.samplers import StepSampler
    base = StepSampler(rb, cfg.batch_size, seed=seed)
    ctx = mp.get_context(cfg.start_method)
    if name in ("unienv_mp", "unienv_mp_generic"):
        from .._sampling.sampler import MultiprocessingSampler
        return MultiprocessingSampler(
            base, n_workers=cfg.workers, n_buffers=cfg.buffers, ctx=ctx,
            direct_gather=False if name == "unienv_mp_generic" else None)
    if name in ("unienv", "unienv_shm"):
        from unienv_data.samplers import MultiprocessingSampler as UniEnvSampler
        return UniEnvSampler(base, n_workers=cfg.workers, n_buffers=cfg.buffers, ctx=ctx,
                             shared_memory=name == "unienv_shm")
    if name == "in_process":
        return base
    if name == "ray":
        # (a RaySampler starts a local Ray, with a CPU for each actor, unless this
        # process is connected to one; it shuts it down when closed)
        from ..ray import RaySampler
        return RaySampler(base, n_workers=cfg.workers, n_buffers=cfg.ray_buffers)
    raise ValueError(f"{name!r} is not one of the UniEnv-API samplers")


def close_sampler(sampler):
    close = getattr(sampler, "close", None)    # (a StepSampler has none)
    if close is not None:
        close()


def make_sampler(name: str, rb, cfg: Config, seed: int = 0):
    """(next_batch, close) for implementation ``name``."""
    if name in ("unienv_mp", "unienv_mp_generic", "unienv", "unienv_shm", "ray"):
        s = sampler_object(name, rb, cfg, seed)
        return s.sample, s.close
    from unienv_data.samplers import StepSampler
    base = StepSampler(rb, cfg.batch_size, seed=seed)
    ctx = mp.get_context(cfg.start_method)
    if name == "in_process":
        return base.sample, lambda: None
    if name == "dataloader":
        return _dataloader_sampler(base, cfg, ctx)
    if name == "index_select":
        return index_select_sampler(base, rb, cfg)
    if name == "torchrl":
        return torchrl_sampler(rb, cfg, seed)
    raise ValueError(f"unknown implementation {name!r}; expected one of {IMPLEMENTATIONS}")


def _dataloader_sampler(base, cfg: Config, ctx):
    """(next_batch, close) of a torch DataLoader over ``base`` with ``cfg.workers``
    persistent workers, each calling ``sample()``."""
    import warnings

    import torch.utils.data as tud

    # (torch warns when workers outnumber cores; the comparison uses the same count)
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    loader = tud.DataLoader(_SampleDataset(base), batch_size=None,
                            num_workers=cfg.workers, multiprocessing_context=ctx,
                            prefetch_factor=max(2, cfg.buffers // cfg.workers),
                            persistent_workers=True)
    held = {"loader": loader, "it": iter(loader)}

    def next_batch():
        return next(held["it"])
    return next_batch, lambda: drop_dataloader(held)


def drop_dataloader(held: dict):
    """Stop a DataLoader's workers the way torch offers: by dropping every reference to it
    and to its iterators (a worker iterator shuts its workers down when it is deleted; with
    ``persistent_workers`` the loader holds its iterator).  ``held`` is the only holder."""
    held.clear()
