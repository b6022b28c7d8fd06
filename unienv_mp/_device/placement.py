"""Where a wrapped sampler's batches are made, and where they are handed out.

* Data and batches on the CPU: workers make them, as always (``"cpu"``).
* Data on the CPU, batches asked for on a CUDA device (``StepSampler(rb, B,
  device="cuda")``, which gathers on the CPU and then moves the batch): workers run a copy
  of the wrapped sampler that keeps its batches on the CPU (`cpu_twin`), and the training
  process copies each batch to the device (``"copy"``, see `.feed`).  The batches are the
  same as the wrapped sampler's would be: its indices are drawn on the data's device, the
  CPU, either way.
* Data on a CUDA device: worker processes cannot help (they would each need the GPU, and a
  forked child cannot use CUDA), so the wrapped sampler runs in the calling process
  (``"in_process"``, see `.resident`).
"""
import copy as _copy

__all__ = ["Placement", "place", "cpu_twin", "device_type"]


def device_type(device):
    """``"cpu"``, ``"cuda"``, ... of a device given as None (the CPU), a string or a
    ``torch.device``."""
    if device is None:
        return "cpu"
    t = getattr(device, "type", None)
    if isinstance(t, str):
        return t
    return str(device).split(":")[0]


class Placement:
    """``kind`` (``"cpu"``, ``"copy"`` or ``"in_process"``), the ``device`` batches are
    handed out on (None for the CPU), the sampler the workers run (``worker_sampler``),
    and, for ``"in_process"``, why (``reason``)."""
    __slots__ = ("kind", "device", "worker_sampler", "reason")

    def __init__(self, kind, device, worker_sampler, reason=None):
        self.kind = kind
        self.device = device
        self.worker_sampler = worker_sampler
        self.reason = reason

    def __repr__(self):
        return f"<Placement {self.kind} on {self.device}>"


def place(sampler, who):
    """The `Placement` of ``sampler`` for a sampler class named ``who``; raises
    ``ValueError`` for devices other than the CPU and CUDA, or a CUDA sampler whose batches
    cannot be made on the CPU."""
    data = getattr(sampler, "data", None)
    data_device = getattr(data, "device", None)
    device = sampler.device
    if device_type(data_device) == "cuda":
        return Placement("in_process", _torch_device(data_device if device is None
                                                     else device), None,
                         f"the data is on {data_device}: worker processes cannot gather "
                         f"it, so batches are made in this process")
    if device_type(data_device) != "cpu":
        raise ValueError(f"{who} takes data on the CPU or on a CUDA device, but "
                         f"sampler.data.device is {data_device!r}")
    kind = device_type(device)
    if kind == "cpu":
        return Placement("cpu", None, sampler)
    if kind != "cuda":
        raise ValueError(f"{who} hands out batches on the CPU or on a CUDA device, but "
                         f"sampler.device is {device!r}")
    twin = cpu_twin(sampler)
    if twin is None:
        raise ValueError(
            f"{who} makes batches in worker processes, on the CPU, and copies them to "
            f"{device!r}; it cannot make this {type(sampler).__qualname__}'s batches on the "
            f"CPU (it knows how for UniEnv's StepSampler(..., device=...)).  Wrap a sampler "
            f"whose batches are on the CPU and pass device= to it, or move batches in the "
            f"training loop")
    return Placement("copy", _torch_device(device), twin)


def cpu_twin(sampler):
    """A shallow copy of ``sampler`` that keeps its batches on the CPU (its data's
    device), for the workers; None where that is not known to be the same batches on the
    CPU.  For UniEnv's ``StepSampler`` (and subclasses that leave its ``device`` alone),
    whose ``device=`` only moves each batch after gathering it (``_device``, which its
    ``device`` reads; its RNGs live on the data's device either way)."""
    from unienv_data.samplers.step_sampler import StepSampler
    if not isinstance(sampler, StepSampler) or "_device" not in vars(sampler):
        return None
    if type(sampler).device is not StepSampler.device:
        return None   # (a subclass that says where its batches are its own way)
    twin = _copy.copy(sampler)
    attrs = vars(twin)
    attrs["_device"] = None
    data = sampler.data
    attrs["single_space"] = data.single_space
    attrs["single_metadata_space"] = data.single_metadata_space
    for cached in ("_batched_space", "_batched_metadata_space"):
        attrs.pop(cached, None)   # (functools.cached_property values of the device spaces)
    return twin


def _torch_device(device):
    import torch
    return torch.device(device)
