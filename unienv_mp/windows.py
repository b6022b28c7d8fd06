"""Windows per key over one index stream: an observation history and an action chunk of
the same step in one batch, padded at episode ends, with a mask per key saying where
(`WindowedBatch`), as LeRobot's ``delta_timestamps`` gives them.

The view computes its batches with tensor operations (its own ``get_at``, which UniEnv's
samplers and unienv_mp's generic path call); unienv_mp's workers gather the same batches
straight into their slots (`unienv_mp._direct.views`).  This module imports UniEnv and
torch, and nothing else of the package.
"""
import math
import numbers

import torch
from unienv_data.base.common import BatchBase, convert_index_to_backendarray
from unienv_data.batches.slicestack_batch import SliceStackedBatch
from unienv_interface.backends.pytorch import PyTorchComputeBackend
from unienv_interface.space import BinarySpace, BoxSpace, DictSpace
from unienv_interface.space.space_utils import batch_utils as sbu

__all__ = ["WindowedBatch"]

#: The largest offset, in steps, either way (the window's arithmetic stays far from
#: int64's limits).
MAX_OFFSET = 2 ** 40

_ANCHOR = ("anchor",)


class WindowedBatch(BatchBase):
    """A view of a batch whose keys are windows of steps around one step: for each index
    ``t``, each named key holds the steps ``t + offset`` of its own offsets (an
    observation history ``[-1, 0]``, an action chunk ``range(16)``), and every other key
    the step ``t`` itself (or nothing, with ``keep_other_keys=False``).  One index, one
    step: every key of an element comes from the same step ``t``.

    Padding is LeRobot's: a step outside ``t``'s episode, or outside the data, is replaced
    by the nearest step of the episode (its first before it, its last after it), and
    ``"<key>_is_pad"`` in the metadata (``get_at_with_metadata``,
    ``sample_with_metadata``) is True there.  An episode is a run of consecutive steps
    with the same id (``episode_id_key``), or ends at a step whose end flag is set
    (``episode_end_key``); the window of a step is never cut short, so an episode of any
    length can be sampled (the anchor step is always real; a one-step episode gives
    windows of it alone, padding elsewhere).

    It is a UniEnv batch (read-only), so UniEnv's ``StepSampler``, its epochs, and
    [`MultiprocessingSampler`][unienv_mp.MultiprocessingSampler] take it as they take
    UniEnv's own views; the latter's workers gather it straight into shared memory where
    its data is a ReplayBuffer of tensors, in memory or memory-mapped (see the guide
    "Frame stacks, action chunks: direct gather").  Over files it needs torch arrays:
    ``WindowedBatch(ToBackendOrDeviceBatch(rb, backend=PyTorchComputeBackend,
    device="cpu"), ...)`` over an HDF5 buffer ``rb``, say, which the workers sample the
    generic way (see the guide "Data on disk").

    Example:
        ``WindowedBatch(rb, {"obs/image": [-1, 0], "obs/state": [-1, 0],
        "action": range(16)})``; or in seconds, as LeRobot's ``delta_timestamps``:
        ``WindowedBatch(rb, delta_timestamps={"obs/image": [-0.1, 0.0], "action":
        [i / 10 for i in range(16)]}, fps=10)``.

    Args:
        batch: a UniEnv batch (a ``ReplayBuffer``, or a view of one) of torch arrays whose
            elements are dicts, nested or not.
        offsets: ``{key: offsets}``: for each key, its window as whole steps relative to
            ``t``, sorted, without repeats, negative (the past), zero or positive (the
            future); ``0`` need not be among them.  A key is a key of the data, nested
            keys joined by ``/`` as UniEnv's storages spell them (``"obs/image"``), or a
            tuple of keys; a key naming a sub-dict windows all its arrays alike.
        delta_timestamps: instead of ``offsets``, ``{key: seconds}``, as LeRobot's
            argument of that name: each time must be a multiple of the frame period
            ``1 / fps`` (within ``tolerance_s``).
        fps: the data's frames per second, for ``delta_timestamps``; by default the
            batch's ``fps`` attribute (a LeRobot dataset's), or the ``fps`` its spaces'
            metadata agree on.
        episode_id_key: the key of the episode ids (one integer, boolean or float per
            step), if the data has it; None for data that is one episode.
        episode_end_key: tell episodes by this key's end flags instead (one value per
            step, not zero at an episode's last step).
        get_valid_mask_function: instead, UniEnv's own helper
            (``SliceStackedBatch.get_valid_mask_function_with_episodeid_key(key)`` or
            ``..._with_episode_end_key(key)``), as given to UniEnv's stacked views.
        keep_other_keys: whether the keys without a window are kept (the step ``t``
            itself, with no window dimension), or left out.
        tolerance_s: how far from a multiple of the frame period a time may be, in
            seconds (LeRobot's default).

    Raises:
        ValueError: for a key the data does not have, keys that overlap, offsets that are
            empty, unsorted, repeated or too large, a time that is not a multiple of the
            frame period, or an episode key that is missing or not one value per step.
        TypeError: for data that is not a UniEnv batch of torch arrays in dicts, or
            offsets that are not whole numbers.
    """

    is_mutable = False
    #: What the view only caches, derived from its spaces: no part of its data (the
    #: fingerprint of kept workers leaves them out).
    CACHE_ATTRIBUTES = frozenset(("_batched_space", "_batched_metadata_space"))

    def __init__(self, batch, offsets=None, *, delta_timestamps=None, fps=None,
                 episode_id_key="episode_id", episode_end_key=None,
                 get_valid_mask_function=None, keep_other_keys=True, tolerance_s=1e-4):
        if not isinstance(batch, BatchBase):
            raise TypeError(f"a WindowedBatch is a view of a UniEnv batch, not of a "
                            f"{type(batch).__name__}")
        if batch.backend is not PyTorchComputeBackend:
            raise TypeError(f"a WindowedBatch needs a batch of torch arrays, not of "
                            f"{getattr(batch.backend, '__name__', batch.backend)}: wrap it "
                            f"in UniEnv's ToBackendOrDeviceBatch(batch, "
                            f"backend=PyTorchComputeBackend, device='cpu')")
        space = batch.single_space
        if not isinstance(space, DictSpace):
            raise TypeError(f"a WindowedBatch windows the keys of dict elements; this "
                            f"batch's elements are a {type(space).__name__}")
        if not isinstance(keep_other_keys, bool):
            raise TypeError(f"keep_other_keys must be True or False, not {keep_other_keys!r}")
        if (offsets is None) == (delta_timestamps is None):
            raise ValueError("give either offsets (in steps) or delta_timestamps (in "
                             "seconds)")
        if delta_timestamps is not None:
            fps = _fps_of(batch, fps)
            offsets = _steps_of(delta_timestamps, fps, tolerance_s)
        else:
            fps = None if fps is None else _positive("fps", fps)
        windows = _windows_of(offsets, space)
        episodes = _episodes_of(space, episode_id_key, episode_end_key,
                                get_valid_mask_function)
        layout = _layout(space, windows, keep_other_keys)
        meta = batch.single_metadata_space
        clash = [f"{name}_is_pad" for name in windows
                 if meta is not None and f"{name}_is_pad" in meta.spaces]
        if clash:
            raise ValueError(f"the batch's metadata already has {clash}")
        data_space = _space_of(space, layout, windows)
        pads = {} if meta is None else dict(meta.spaces)
        for name in sorted(windows):
            pads[f"{name}_is_pad"] = BinarySpace(batch.backend, shape=(len(windows[name]),),
                                                 device=batch.device)
        super().__init__(data_space, DictSpace(batch.backend, pads, device=batch.device))
        self.batch = batch
        self._windows = {name: offs for name, offs in windows.items()}
        self._episodes = episodes
        self._keep_other_keys = keep_other_keys
        self._fps = fps
        # (UniEnv's batched spaces, cached now rather than at the first flattened read:
        # a view's attributes stay the same set while it is read)
        self._batched_space, self._batched_metadata_space   # noqa: B018

    @property
    def backend(self):
        return self.batch.backend

    @property
    def device(self):
        return self.batch.device

    @property
    def offsets(self):
        """``{key: offsets}``: each windowed key (spelled with ``/``) and its window in
        steps relative to ``t`` (a tuple of ints; from ``delta_timestamps``, the times
        times ``fps``)."""
        return dict(self._windows)

    @property
    def episode_id_key(self):
        """The key episodes are told by as runs of equal ids, or None."""
        return self._episodes[1] if self._episodes and self._episodes[0] == "id" else None

    @property
    def episode_end_key(self):
        """The key episodes are told by as end flags, or None."""
        return self._episodes[1] if self._episodes and self._episodes[0] == "end" else None

    @property
    def keep_other_keys(self):
        """Whether keys without a window are kept (at the step ``t``)."""
        return self._keep_other_keys

    @property
    def fps(self):
        """The frames per second ``delta_timestamps`` were read with (None for offsets
        given in steps without ``fps``)."""
        return self._fps

    def __len__(self):
        return len(self.batch)

    def get_at(self, idx):
        return self.get_at_with_metadata(idx)[0]

    def get_at_with_metadata(self, idx):
        """The elements at ``idx`` (an int, a slice, ``...``, or a 1-D tensor of indices
        or a boolean mask): the data, and the metadata with ``"<key>_is_pad"`` (``(n,
        len(offsets))`` booleans) for every windowed key."""
        if isinstance(idx, numbers.Integral) and not isinstance(idx, bool):
            data, meta = self.get_at_with_metadata(
                torch.tensor([int(idx)], dtype=torch.int64, device=self.device))
            return _first(data), _first(meta)
        n = len(self.batch)
        t = self._indices(idx, n)
        lo, hi = self._spans(t, n)
        space = self.batch.single_space
        got = {}
        pads = {}
        for name, offs in self._windows.items():
            off = torch.tensor(offs, dtype=torch.int64, device=t.device)
            q = t[:, None] + off[None, :]
            steps = torch.minimum(torch.maximum(q, lo[:, None]), hi[:, None])
            pads[f"{name}_is_pad"] = steps != q
            value = self._fetch(_find(space, name, "key"), _path(name), steps.reshape(-1))
            got[name] = _map(value, lambda x, k=len(offs): x.reshape(t.shape[0], k,
                                                                     *x.shape[1:]))
        data = self._assemble(space, _layout(space, self._windows, self._keep_other_keys),
                              got, t, [])
        meta = {}
        if self.batch.single_metadata_space is not None:
            meta.update(self.batch.get_at_with_metadata(t)[1] or {})
        for key in self.single_metadata_space.spaces:
            if key in pads:
                meta[key] = pads[key]
        return data, meta

    def _assemble(self, space, layout, got, t, path):
        """The element dicts, in the order of this view's space: the windows fetched
        (``got``), and the keys without one at the steps ``t``."""
        out = {}
        for key, entry in layout.items():
            sub = space.spaces[key]
            if entry == _ANCHOR:
                out[key] = self._fetch(sub, path + [key], t)
            elif isinstance(entry, dict):
                out[key] = self._assemble(sub, entry, got, t, path + [key])
            else:
                out[key] = got[entry[1]]
        return out

    def _fetch(self, space, path, steps):
        """The arrays under key ``path`` (of ``space``) at ``steps``, one column at a time
        (UniEnv's storages give columns of arrays, not of sub-dicts)."""
        if isinstance(space, DictSpace):
            return {k: self._fetch(sub, path + [k], steps) for k, sub in space.spaces.items()}
        return self.batch.get_column(path).get_at(steps)

    def _indices(self, idx, n):
        """``idx`` as a 1-D int64 tensor of indices in ``[0, n)`` (negative ones counted
        from the end, as UniEnv counts them)."""
        if isinstance(idx, slice) or idx is Ellipsis:
            idx = convert_index_to_backendarray(self.backend, idx, n, self.device)
        t = torch.as_tensor(idx, device=self.device)
        if t.dim() != 1:
            raise IndexError(f"indices must be one-dimensional, got shape {tuple(t.shape)}")
        if t.dtype == torch.bool:
            if t.shape[0] != n:
                raise IndexError(f"a boolean mask of {t.shape[0]} for {n} elements")
            return torch.nonzero(t)[:, 0]
        if t.dtype.is_floating_point or t.dtype.is_complex:
            raise IndexError(f"indices must be integers, got {t.dtype}")
        t = t.to(torch.int64)
        t = torch.where(t < 0, t + n, t)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
            bad = t[(t < 0) | (t >= n)][0]
            raise IndexError(f"index {int(bad)} is out of range for a WindowedBatch of "
                             f"{n} steps")
        return t

    def _spans(self, t, n):
        """``(lo, hi)``: the first and last step of each step's episode, as far as the
        windows reach and within the data (the arithmetic of ``umr_episode_span`` in
        ``csrc/umr_window.c``, as tensor operations)."""
        reach = [o for offs in self._windows.values() for o in offs]
        back, fwd = max(0, -min(reach)), max(0, max(reach))
        if self._episodes is None or t.numel() == 0:
            return (torch.clamp(t - back, min=0), torch.clamp(t + fwd, max=max(n - 1, 0)))
        kind, name = self._episodes
        column = self.batch.get_column(_path(name))
        anchor = column.get_at(t) if kind == "id" else None
        return (t - self._joined(t, n, back, -1, column, anchor),
                t + self._joined(t, n, fwd, 1, column, anchor))

    def _joined(self, t, n, reach, way, column, anchor):
        """How many steps one after the other from each step ``t`` (``way`` -1: before
        it, 1: after it), at most ``reach``, are in ``t``'s episode and in the data: read
        in chunks growing fourfold, each for the steps still walking."""
        joined = torch.zeros_like(t)
        walking = torch.arange(t.shape[0], device=t.device)
        done, chunk = 0, 16
        while done < reach and walking.numel():
            k = min(chunk, reach - done)
            steps = t[walking, None] + way * torch.arange(done + 1, done + k + 1,
                                                          device=t.device)[None, :]
            inside = (steps >= 0) & (steps < n)
            # the value that says whether a step joins: ids, its own; end flags, before
            # it, the flag of the step that comes first (an end ends its own step's
            # episode)
            at = steps - 1 if (anchor is None and way > 0) else steps
            values = column.get_at(at.clamp(0, n - 1).reshape(-1)).reshape(steps.shape)
            ok = inside & (values == anchor[walking, None] if anchor is not None
                           else values == 0)
            run = ok.to(torch.int64).cumprod(1).sum(1)
            joined[walking] += run
            walking = walking[run == k]
            done += k
            chunk *= 4
        return joined

    def set_at(self, idx, value):
        raise TypeError("a WindowedBatch is read-only: write to its batch")

    def extend(self, value):
        raise TypeError("a WindowedBatch is read-only: write to its batch")

    def set_flattened_at(self, idx, value):
        raise TypeError("a WindowedBatch is read-only: write to its batch")

    def extend_flattened(self, value):
        raise TypeError("a WindowedBatch is read-only: write to its batch")

    def remove_at(self, idx):
        raise TypeError("a WindowedBatch is read-only: write to its batch")

    def close(self):
        """Release this view; its batch is not its own, and stays open."""

    def __repr__(self):
        windows = ", ".join(f"{k!r}: {list(v)}" for k, v in self._windows.items())
        episodes = ("one episode" if self._episodes is None else
                    f"episode_{self._episodes[0]}_key={self._episodes[1]!r}")
        return f"WindowedBatch({{{windows}}}, {episodes}, over a {type(self.batch).__name__})"


# -- construction ----------------------------------------------------------------------------

def _path(name):
    return name.split("/")


def _key_name(key):
    if isinstance(key, str):
        parts = key.split("/")
    elif isinstance(key, tuple) and key and all(isinstance(k, str) for k in key):
        parts = list(key)
    else:
        raise TypeError(f"a key is a string ('obs/image') or a tuple of strings, not {key!r}")
    if not all(parts):
        raise ValueError(f"key {key!r} has an empty part")
    return "/".join(parts)


def _all_keys(space, prefix=""):
    out = []
    for k, sub in space.spaces.items():
        out.append(prefix + k)
        if isinstance(sub, DictSpace):
            out.extend(_all_keys(sub, prefix + k + "/"))
    return out


def _find(space, name, what):
    """The space at key ``name`` of the data's ``space``."""
    sub = space
    for part in _path(name):
        if not isinstance(sub, DictSpace) or part not in sub.spaces:
            raise ValueError(f"{what} {name!r} is not a key of the data, whose keys are "
                             f"{_all_keys(space)}")
        sub = sub.spaces[part]
    return sub


def _whole(value, where):
    """``value`` as an int, if it is a whole number of a type that says so."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, torch.Tensor) and value.dim() == 0 and not (
                value.dtype.is_floating_point or value.dtype.is_complex
                or value.dtype == torch.bool):
            return int(value)
        raise TypeError(f"{where}: offsets are whole steps, got {value!r} (for times in "
                        f"seconds, give delta_timestamps)")
    return int(value)


def _windows_of(offsets, space):
    """``{key name: tuple of offsets}``, checked against the data's ``space``."""
    if not hasattr(offsets, "items"):
        raise TypeError(f"offsets must be a mapping {{key: offsets}}, not a "
                        f"{type(offsets).__name__}")
    if not offsets:
        raise ValueError("no key to window: offsets is empty")
    windows = {}
    for key, offs in offsets.items():
        name = _key_name(key)
        if name in windows:
            raise ValueError(f"key {name!r} is given twice")
        _find(space, name, "key")
        if isinstance(offs, torch.Tensor):
            offs = offs.tolist() if offs.dim() == 1 else [offs]
        try:
            values = [_whole(o, f"key {name!r}") for o in offs]
        except TypeError as e:
            if "offsets are whole steps" in str(e):
                raise
            raise TypeError(f"key {name!r}: offsets must be a sequence of whole steps, "
                            f"not {offs!r}") from None
        if not values:
            raise ValueError(f"key {name!r}: no offsets")
        for a, b in zip(values, values[1:]):
            if a == b:
                raise ValueError(f"key {name!r}: offset {a} is repeated")
            if a > b:
                raise ValueError(f"key {name!r}: offsets must be sorted, and {a} comes "
                                 f"before {b}")
        if max(abs(values[0]), abs(values[-1])) > MAX_OFFSET:
            raise ValueError(f"key {name!r}: offsets beyond {MAX_OFFSET} steps")
        windows[name] = tuple(values)
    names = sorted(windows)
    for a, b in zip(names, names[1:]):
        if b.startswith(a + "/"):
            raise ValueError(f"keys {a!r} and {b!r} overlap: give one window per array")
    return windows


def _positive(what, value):
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, not {value!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{what} must be positive and finite, not {value!r}")
    return v


def _fps_of(batch, fps):
    """The frames per second of ``delta_timestamps``: ``fps``, or the batch's ``fps``
    attribute, or the ``fps`` its spaces' metadata agree on."""
    if fps is not None:
        return _positive("fps", fps)
    own = getattr(batch, "fps", None)
    if own is not None:
        return _positive("the batch's fps", own)
    found = set()
    stack = [batch.single_space]
    while stack:
        sp = stack.pop()
        meta = getattr(sp, "metadata", None) or {}
        if "fps" in meta:
            found.add(float(meta["fps"]))
        if isinstance(sp, DictSpace):
            stack.extend(sp.spaces.values())
    if len(found) == 1:
        return _positive("the fps of the data's spaces", found.pop())
    if found:
        raise ValueError(f"the data's spaces declare several fps {sorted(found)}: pass fps=")
    raise ValueError("delta_timestamps needs the data's frames per second: pass fps= (the "
                     "batch has no fps attribute, and its spaces' metadata declare none)")


def _steps_of(delta_timestamps, fps, tolerance_s):
    """``{key: offsets in steps}`` of ``{key: times in seconds}``."""
    if not hasattr(delta_timestamps, "items"):
        raise TypeError(f"delta_timestamps must be a mapping {{key: seconds}}, not a "
                        f"{type(delta_timestamps).__name__}")
    tolerance_s = float(tolerance_s)
    if not (math.isfinite(tolerance_s) and tolerance_s >= 0):
        raise ValueError(f"tolerance_s must be 0 or more, not {tolerance_s!r}")
    out = {}
    for key, times in delta_timestamps.items():
        steps = []
        for s in (times.tolist() if isinstance(times, torch.Tensor) else times):
            if isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s):
                raise TypeError(f"key {key!r}: times are finite numbers of seconds, not "
                                f"{s!r}")
            k = round(s * fps)
            if abs(s - k / fps) > tolerance_s:
                raise ValueError(f"key {key!r}: {s} s is not a multiple of the frame period "
                                 f"1/{fps:g} s (the nearest are {math.floor(s * fps) / fps:g} "
                                 f"and {math.ceil(s * fps) / fps:g} s)")
            steps.append(k)
        out[key] = steps
    return out


def _episodes_of(space, id_key, end_key, mask_function):
    """``("id", key)``, ``("end", key)`` or None (the data is one episode)."""
    if mask_function is not None:
        if end_key is not None or id_key not in (None, "episode_id"):
            raise ValueError("tell episodes one way: get_valid_mask_function, or an "
                             "episode key")
        kind, key = _from_helper(mask_function)
        what = "get_valid_mask_function's key"
    elif end_key is not None:
        if id_key not in (None, "episode_id"):
            raise ValueError(f"tell episodes one way: episode_id_key={id_key!r} or "
                             f"episode_end_key={end_key!r}")
        kind, key, what = "end", end_key, "episode_end_key"
    elif id_key is not None:
        kind, key, what = "id", id_key, "episode_id_key"
    else:
        return None
    name = _key_name(key) if isinstance(key, (str, tuple)) else str(key)
    try:
        sub = _find(space, name, what)
    except ValueError as e:
        hint = (" (pass episode_id_key=None for data that is one episode, or "
                "episode_end_key=...)" if what == "episode_id_key" else "")
        raise ValueError(f"{e}{hint}") from None
    if not isinstance(sub, (BoxSpace, BinarySpace)) or tuple(sub.shape) != ():
        raise ValueError(f"{what} {name!r} must hold one value per step, not a {sub}")
    return kind, name


def _from_helper(fn):
    func = getattr(fn, "func", None)
    keywords = getattr(fn, "keywords", None) or {}
    if func is SliceStackedBatch._valid_mask_function_episodeid_key:
        kind, arg = "id", "episode_id_key"
    elif func is SliceStackedBatch._valid_mask_function_episode_end_key:
        kind, arg = "end", "episode_end_key"
    else:
        raise ValueError("get_valid_mask_function must be one of UniEnv's helpers "
                         "(SliceStackedBatch.get_valid_mask_function_with_episodeid_key or "
                         "..._with_episode_end_key): a WindowedBatch reads nothing else")
    if getattr(fn, "args", ()) or keywords.get("is_in_metadata", False):
        raise ValueError("get_valid_mask_function: episodes read from metadata (or a helper "
                         "with extra arguments) are not supported; give the data's key")
    return kind, keywords.get(arg, "episode_id" if kind == "id" else "episode_end")


def _layout(space, windows, keep, prefix=""):
    """``{key: ("window", name) | _ANCHOR | {nested}}``: what each key of ``space`` holds
    in the view (the keys left out are not in it)."""
    out = {}
    for key, sub in space.spaces.items():
        name = prefix + key
        if name in windows:
            out[key] = ("window", name)
        elif any(w.startswith(name + "/") for w in windows):
            out[key] = _layout(sub, windows, keep, name + "/")
        elif keep:
            out[key] = _ANCHOR
    return out


def _space_of(space, layout, windows):
    out = {}
    for key, entry in layout.items():
        sub = space.spaces[key]
        if entry == _ANCHOR:
            out[key] = sub
        elif isinstance(entry, dict):
            out[key] = _space_of(sub, entry, windows)
        else:
            out[key] = sbu.batch_space(sub, len(windows[entry[1]]))
    return DictSpace(space.backend, out, device=space.device)


def _map(tree, fn):
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_map(v, fn) for v in tree)
    return fn(tree)


def _first(tree):
    return _map(tree, lambda x: x[0])
