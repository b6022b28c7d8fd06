"""Exhaustive model checks of the ring's push / pop / sleep / wake protocol (csrc/umr_ring.c).

Always: the pure-Python interleaving checker (models/interleave.py) explores every
interleaving of small configurations of the protocol, must find no violation in the
protocol as written, and must find the violation in each deliberately broken variant.
In addition, when `spin` (and gcc) are installed: models/check.sh --quick runs the Promela
model (models/ring.pml) through spin.  See models/README.md.
"""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
sys.path.insert(0, MODELS)

import interleave  # noqa: E402
from interleave import BROKEN, CORRECT, Config, explore  # noqa: E402


@pytest.mark.parametrize("cfg", CORRECT, ids=[c.name() for c in CORRECT])
def test_protocol_has_no_violation(cfg):
    r = explore(cfg)
    assert r.error is None, f"{r.summary()}\n" + "\n".join(r.trace)
    assert r.states > 1


@pytest.mark.parametrize("cfg,expect", BROKEN, ids=[c.name() for c, _ in BROKEN])
def test_broken_variant_is_caught(cfg, expect):
    r = explore(cfg)
    assert r.error is not None, f"broken variant not caught: {r.summary()}"
    assert expect in r.error, r.error
    assert r.trace, "a violation comes with its interleaving"


def test_shortest_trace_of_lost_wakeup():
    r = interleave.shortest_trace(Config(cap=1, items=(1,), pops=(1,), broken=3))
    assert r.error and "lost wake-up" in r.error
    assert r.trace[-1] == "(no thread can move)"
    assert any("FUTEX_WAIT" in line for line in r.trace)


def test_futex_word_reduction_is_exact():
    """The checker stores the futex word as 'seen is current or stale' (exact because the
    word only grows); the plain encoding must reach the same verdicts."""
    for cfg in (Config(cap=1, items=(2,), pops=(1, 1)),
                Config(cap=2, items=(1, 1), pops=(0,), shut=True)):
        a, b = explore(cfg, canonical=True), explore(cfg, canonical=False)
        assert a.error is None and b.error is None
        assert a.states <= b.states
    for cfg, expect in BROKEN[:5]:
        r = explore(cfg, canonical=False)
        assert r.error is not None and expect in r.error


def test_spin_model():
    """The Promela model through spin (models/check.sh --quick), when spin is installed."""
    if shutil.which("spin") is None or shutil.which("gcc") is None:
        pytest.skip("spin or gcc not installed (apt-get install -y spin); the pure-Python "
                    "interleaving checker above covered the same protocol")
    p = subprocess.run(["bash", os.path.join(MODELS, "check.sh"), "--quick"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
    assert "all" in p.stdout and "runs as expected" in p.stdout
