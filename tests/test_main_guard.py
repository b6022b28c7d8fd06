"""A script without a main guard, run with spawn or forkserver: its workers re-run its top
level, which starts workers again.  The caller gets one error that says so and names the
fix, and no replacement makes the mistake again."""
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from unienv_data.replay_buffer import ReplayBuffer
    from unienv_data.samplers import StepSampler
    from unienv_data.storages.pytorch import PytorchTensorStorage
    from unienv_interface.backends.pytorch import PyTorchComputeBackend as B
    from unienv_interface.space import BoxSpace
    from unienv_mp import MultiprocessingSampler

    rb = ReplayBuffer.create(PytorchTensorStorage,
                             BoxSpace(B, -1.0, 1.0, torch.float32, shape=(4,)),
                             capacity=100, is_memmap=False)
    rb.extend(torch.rand(100, 4))
    with MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=2,
                                ctx=sys.argv[1]) as sampler:
        print(sampler.sample().shape)
""")


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_script_without_a_main_guard_fails_once_and_says_how_to_fix_it(tmp_path, method):
    path = tmp_path / "no_guard.py"
    path.write_text(SCRIPT)
    p = subprocess.run([sys.executable, str(path), method], capture_output=True, text=True,
                       timeout=180, cwd=tmp_path)
    assert p.returncode == 1 and p.stdout == ""
    err = p.stderr.splitlines()
    assert p.stderr.count("Traceback (most recent call last)") == 1, p.stderr
    last = err[-1]
    assert last.startswith("unienv_mp.errors.WorkerDiedError: worker ")
    assert f"started with '{method}'" in last and 'if __name__ == "__main__":' in last
    assert "times in a row" not in p.stderr   # (not the respawn loop's giving up)
    trace = err[err.index("Traceback (most recent call last):"):]
    frames = [line for line in trace if line.startswith("  File ")]
    # (short: the script's line, then the sampler's few calls down to the worker's death)
    assert len(frames) <= 9 and len(set(frames)) == len(frames), p.stderr
    # each worker started says one line, and no replacement was started
    child = [line for line in err if line.startswith("unienv_mp: this process was started")]
    assert 1 <= len(child) <= 2, p.stderr


def test_the_same_script_with_a_guard_runs(tmp_path):
    path = tmp_path / "guarded.py"
    path.write_text("def main():\n" + textwrap.indent(SCRIPT, "    ")
                    + "\n\nif __name__ == '__main__':\n    main()\n")
    p = subprocess.run([sys.executable, str(path), "spawn"], capture_output=True,
                       text=True, timeout=180, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "torch.Size([8, 4])"
