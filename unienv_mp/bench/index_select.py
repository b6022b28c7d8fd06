"""The speed limit of in-process sampling (the ``index_select`` row): a StepSampler's own
indices mapped to storage rows as the core's workers map them, every array gathered by
``torch.index_select`` into output tensors allocated once and returned for every batch."""
from .._direct.base import sampled_rows
from .._direct.gather import Planner
from .config import Config
from .data import dict_storage_tensors


def index_select_sampler(base, rb, cfg: Config):
    """The speed limit of in-process sampling: ``base``'s own indices, mapped to storage
    rows as the core's direct gather maps them (``sampled_rows``: the ReplayBuffer's
    arithmetic on one snapshot of its ring state, without the bounds check of its own
    mapping, which costs more than the gather of a small batch; ``sample_index()`` draws
    in ``[0, len)`` by construction), gathered by ``torch.index_select`` into output
    tensors allocated once here and returned (the same ones) for every batch."""
    import torch
    data = dict_storage_tensors(rb)
    out = {k: torch.empty((cfg.batch_size, *d.shape[1:]), dtype=d.dtype, device=d.device)
           for k, d in data.items()}

    def next_batch():
        rows = sampled_rows(rb, base.sample_index())
        for k, d in data.items():
            torch.index_select(d, 0, rows, out=out[k])
        return out
    return next_batch, lambda: None


def view_limit_sampler(base, cfg: Config, with_metadata: bool = False):
    """The speed limit of in-process sampling of a view: ``base``'s own indices, the
    view's final storage rows and valid mask computed as unienv_mp's workers compute them
    (``unienv_mp._direct.views``, the same table of rows), and every array gathered by
    ``torch.index_select`` into output tensors allocated once here and returned (the same
    ones) for every batch: the data, or ``(data, metadata)`` ``with_metadata`` (the
    metadata the workers compute, such as valid or pad masks, copied likewise)."""
    root = Planner(base).view
    if root is None:
        raise TypeError("not a view")
    n = cfg.batch_size

    def out_of(spec):
        import torch
        return torch.empty((n * spec.per_element, *spec.unit), dtype=spec.dtype)

    specs = root.specs() if with_metadata else root.specs()[0]
    outs = _tree_map(out_of, specs)
    batch = _tree_map(lambda o, s: o.view(n, *s.shape), outs, specs)

    def next_batch():
        values = root.evaluate(base.sample_index(), with_metadata)
        _tree_map(_gather_parts, values if with_metadata else values[0], outs)
        return batch
    return next_batch, lambda: None


def _gather_parts(parts, out):
    """Gather each part's rows into ``out`` with ``index_select``; the rows of a part
    that go to some positions only (a combined dataset's) go to the next rows of ``out``
    instead, in one ``index_select`` too: the same rows moved, in another order, which is
    what the speed limit is about."""
    import torch
    at = 0
    for part in parts:
        if part.source is None:   # (values made in the worker: a mask)
            if part.pos is None:
                out.copy_(part.data.reshape(out.shape))
            else:
                out.index_copy_(0, part.pos, part.data)
            continue
        if part.pos is None:
            torch.index_select(part.source.tensor, 0, part.data, out=out)
            continue
        n = int(part.data.shape[0])
        torch.index_select(part.source.tensor, 0, part.data, out=out[at:at + n])
        at += n


def _tree_map(fn, tree, *others):
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v, *(o[k] for o in others)) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_tree_map(fn, v, *(o[i] for o in others)) for i, v in enumerate(tree))
    return fn(tree, *others)
