"""Smoke test of an installed unienv_mp, run by .ci/run in a fresh virtual environment
outside the source tree, where the wheel is the only unienv_mp there is.

    python smoke.py transport   # before torch is installed
    python smoke.py sampler     # after `pip install torch==2.13.0`

transport: the package is the installed one (its version, compiled modules, stubs,
py.typed and license all where they belong); a ShmQueue round trip and a RingBuffer under
spawn, bit for bit, with messages inline, in a slot and spilled; and all of it without
torch.  sampler: the README's MultiprocessingSampler under spawn: batches of rows of the
buffer, the same bit for bit from the direct and the generic gather.
"""
import importlib
import importlib.metadata
import importlib.util
import multiprocessing as mp
import os
import sys
import sysconfig

import numpy as np

COMPILED = ("_transport.ring", "_transport.codec", "_direct.rows")
TIMEOUT = 120


def check_installed():
    import unienv_mp
    package = os.path.dirname(os.path.realpath(unienv_mp.__file__))
    site = os.path.realpath(sysconfig.get_paths()["platlib"])
    assert package == os.path.join(site, "unienv_mp"), (package, site)
    version = importlib.metadata.version("unienv_mp")
    assert unienv_mp.__version__ == version, (unienv_mp.__version__, version)
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    for name in COMPILED:
        module = importlib.import_module(f"unienv_mp.{name}")
        path = os.path.join(package, *name.split("."))
        assert module.__file__ == path + ext, module.__file__
        assert os.path.isfile(path + ".pyi"), name
    assert os.path.isfile(os.path.join(package, "py.typed"))
    dist = importlib.metadata.distribution("unienv_mp")
    assert dist.metadata["License-Expression"] == "MIT"
    licenses = [f for f in dist.files if f.name == "LICENSE"]
    assert licenses and "MIT License" in licenses[0].read_text(), licenses
    print(f"smoke: unienv_mp {version} installed at {package}")


def echo(q_in, q_out):
    while True:
        msg = q_in.get()
        if msg is None:
            return
        q_out.put(msg)


def pusher(ring, n):
    for i in range(n):
        ring.push_tagged(7, i, i * i, i.to_bytes(4, "little"))


def same(a, b):
    """Equal bit for bit: the same types, dtypes, shapes and bytes, all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def check_transport():
    assert importlib.util.find_spec("torch") is None, "this stage runs without torch"
    from unienv_mp import RingBuffer, ShmQueue
    ctx = mp.get_context("spawn")
    rng = np.random.default_rng(0)
    messages = [
        b"bytes", "text", 42, {"inline": np.arange(5, dtype=np.int16)},
        {"slot": rng.random(4096), "meta": ("x", 1)},            # 32 KiB: in a slot
        [rng.integers(0, 255, 1 << 18, dtype=np.uint8)],          # 256 KiB: spilled
        (np.float32(1.5), {"nested": [np.eye(3, dtype=np.float32)]}),
    ]
    q_in = ShmQueue(ctx=ctx, slot_size=1 << 16)
    q_out = ShmQueue(ctx=ctx, slot_size=1 << 16)
    child = ctx.Process(target=echo, args=(q_in, q_out))
    child.start()
    for m in messages:
        q_in.put(m)
    q_in.put(None)
    for m in messages:
        got = q_out.get(timeout=TIMEOUT)
        assert same(got, m), (m, got)
    child.join(TIMEOUT)
    assert child.exitcode == 0, child.exitcode

    ring = RingBuffer(16, 64)
    child = ctx.Process(target=pusher, args=(ring, 100))
    child.start()
    got = [ring.pop_tagged(timeout=TIMEOUT) for _ in range(100)]
    child.join(TIMEOUT)
    assert child.exitcode == 0, child.exitcode
    assert got == [(7, i, i * i, i.to_bytes(4, "little")) for i in range(100)]
    ring.close()
    assert "torch" not in sys.modules
    print(f"smoke: ShmQueue and RingBuffer round trips under spawn: {len(messages)} "
          f"messages and 100 entries, bit for bit, without torch")


def check_sampler():
    import torch
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.samplers import StepSampler
    from unienv_data.storages.dict_storage import DictStorage
    from unienv_data.storages.pytorch import PytorchTensorStorage
    from unienv_interface.backends.pytorch import PyTorchComputeBackend as B
    from unienv_interface.space import BoxSpace, DictSpace

    from unienv_mp import MultiprocessingSampler

    n = 2000
    space = DictSpace(B, {"obs": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(10,)),
                          "action": BoxSpace(B, -1.0, 1.0, torch.float32, shape=(7,))})
    rb = ReplayBuffer.create(DictStorage, space, {"obs": PytorchTensorStorage,
                             "action": PytorchTensorStorage}, capacity=n, is_memmap=False)
    obs = torch.rand(n, 10) * 2 - 1
    obs[:, 0] = torch.arange(n) / n   # row i of obs says i
    action = torch.rand(n, 7) * 2 - 1
    rb.extend({"obs": obs, "action": action})

    streams = {}
    for direct in (True, False):
        sampler = MultiprocessingSampler(StepSampler(rb, 64, seed=0), n_workers=2,
                                         ctx="spawn", direct_gather=direct)
        with sampler:
            streams[direct] = [sampler.sample() for _ in range(12)]
            assert sampler.gather_path == ("direct" if direct else "generic")
    for batch in streams[True]:
        assert isinstance(batch["obs"], torch.Tensor) and batch["obs"].shape == (64, 10)
        assert batch["obs"].dtype == torch.float32 and batch["action"].shape == (64, 7)
        rows = (batch["obs"][:, 0] * n).round().long()
        assert torch.equal(batch["obs"], obs[rows]) and torch.equal(batch["action"],
                                                                   action[rows])
    for a, b in zip(streams[True], streams[False]):
        for key in ("obs", "action"):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert not mp.active_children(), mp.active_children()
    print("smoke: MultiprocessingSampler under spawn: 12 batches of rows of the buffer, "
          "the same from the direct and the generic gather")


if __name__ == "__main__":
    stages = {"transport": check_transport, "sampler": check_sampler}
    if len(sys.argv) != 2 or sys.argv[1] not in stages:
        raise SystemExit(__doc__)
    if os.path.exists(os.path.join(os.getcwd(), "unienv_mp")):
        raise SystemExit("smoke: run me outside the source tree")
    check_installed()
    stages[sys.argv[1]]()
