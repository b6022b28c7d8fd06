"""The bounds on the sampler's and the manager's arguments: each computed as documented,
named in its error with the real number, and listed in one place (the section "Bounds on the
options" of docs/limitations.md, which MultiprocessingSampler's docstring links)."""
import os
import re

import pathlib

import pytest
from unienv_data.samplers import StepSampler

from _data import replay_buffer
from unienv_mp import MultiprocessingSampler, _validate
from unienv_mp._process.manager import MultiProcessingSampleManager


def _identity(x):
    return x


@pytest.mark.parametrize("cpus,most", [(1, 64), (2, 64), (8, 64), (9, 72), (16, 128)])
def test_the_most_workers_is_the_larger_of_64_and_8_per_cpu(monkeypatch, cpus, most):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert _validate.check_workers(most) == most
    with pytest.raises(ValueError) as info:
        _validate.check_workers(most + 1)
    message = str(info.value)
    assert f"n_workers must be at most {most} here, got {most + 1}" in message
    assert f"{cpus} CPUs here" in message
    # every number the message gives is true: no "8 per CPU ... so at most 64" for 2 CPUs
    assert set(re.findall(r"\d+", message)) <= {str(most), str(most + 1), str(cpus), "8",
                                                 "64"}


def test_the_sampler_and_the_manager_refuse_too_many_workers(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    rb = replay_buffer(20)
    with pytest.raises(ValueError, match="n_workers must be at most 64 here, got 65"):
        MultiprocessingSampler(StepSampler(rb, 4), n_workers=65)
    with pytest.raises(ValueError, match="n_workers must be at most 64 here, got 65"):
        MultiProcessingSampleManager(_identity, n_workers=65)


@pytest.mark.parametrize("arg,most", [("n_buffers", _validate.MAX_BUFFERS),
                                      ("batches_per_task", _validate.MAX_BATCHES_PER_TASK)])
def test_the_sampler_names_its_bounds_with_their_numbers(arg, most):
    rb = replay_buffer(20)
    with pytest.raises(ValueError, match=f"{arg} must be at most {most}, got {most + 1}"):
        MultiprocessingSampler(StepSampler(rb, 4), **{arg: most + 1})


@pytest.mark.parametrize("arg", ["timeout", "stall_timeout"])
def test_the_longest_wait_is_named_as_the_docstring_names_it(arg):
    rb = replay_buffer(20)
    with pytest.raises(ValueError, match=f"{arg} must be at most 10,000,000 s"):
        MultiprocessingSampler(StepSampler(rb, 4), **{arg: 2e7})


def test_the_limits_are_listed_in_one_place_with_the_numbers_the_code_uses():
    # (the docstring links the page's section; the section names every bound)
    assert "limitations.md#bounds-on-the-options" in MultiprocessingSampler.__doc__
    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "limitations.md")
    text = page.read_text()
    section = text.split("## Bounds on the options", 1)[1].split("\n## ", 1)[0]
    limits = " ".join(section.split())
    v = _validate
    for needle in (f"max({v.MIN_MAX_WORKERS}, {v.WORKERS_PER_CPU} * CPUs)",
                   f"`n_buffers` at most {v.MAX_BUFFERS}",
                   f"`batches_per_task` at most {v.MAX_BATCHES_PER_TASK}",
                   f"`doze_time` at most {v.MAX_DOZE:g} s",
                   f"at most {int(v.MAX_SECONDS):,} s",
                   f"`max_respawns` up to {v.MAX_RESPAWNS:.0e}".replace("e+0", "e"),
                   f"`max_leases` up to {v.MAX_LEASES:,}",
                   "half of the machine's memory"):
        assert needle in limits, needle
