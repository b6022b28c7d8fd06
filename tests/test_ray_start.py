"""RaySampler in a process not connected to Ray, on a machine where no Ray runs: it starts
a local Ray, and shuts it down when the last sampler using it is closed."""
import os
import subprocess
import sys
import textwrap

import psutil
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' "
                                        "(CI installs it)")

TESTS = os.path.dirname(os.path.abspath(__file__))


def ray_running_here():
    """True if a Ray cluster runs on this machine (ray.init(address="auto") finds its GCS
    server among the processes)."""
    for p in psutil.process_iter(["name"]):
        if p.info["name"] == "gcs_server":
            return True
    return False


def wait_for_no_ray(timeout=30.0):
    import time
    deadline = time.monotonic() + timeout
    while ray_running_here() and time.monotonic() < deadline:
        time.sleep(0.2)
    return not ray_running_here()


def test_without_a_running_ray_it_starts_one_and_shuts_it_down(tmp_path):
    if not wait_for_no_ray():
        pytest.skip("a Ray cluster runs on this machine: RaySampler would join it")
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import ray, _data
        from unienv_data.samplers import StepSampler
        from unienv_mp.ray import RaySampler
        assert not ray.is_initialized()
        r = RaySampler(StepSampler(_data.replay_buffer(20), 4, seed=0), n_workers=1,
                       num_cpus_per_worker=0)
        a = RaySampler(StepSampler(_data.replay_buffer(20), 4, seed=0), n_workers=1,
                       num_cpus_per_worker=0)
        batch = r.sample()
        assert ray.is_initialized()
        r.close()
        assert ray.is_initialized()   # (a still uses it)
        a.close()
        assert not ray.is_initialized()
        print("ok", int(batch["state"][:, 0].sum()))
    """)
    env = dict(os.environ, PYTHONPATH=TESTS)
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")
