"""The scripts in examples/ run, each as a user runs it, and print something."""
import ast
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))
EXPECTED = {"diffusion_policy_loader.py", "epochs_checkpoint_resume.py",
            "online_rl_loop.py", "shm_queue.py", "ray_sampler.py", "gpu_feed.py"}


def _run(args, cwd, env=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=240, cwd=cwd, env=env)


def test_the_examples_are_those_promised():
    assert {os.path.basename(p) for p in EXAMPLES} == EXPECTED


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_an_example_has_a_docstring_a_main_and_a_main_guard(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    doc = ast.get_docstring(tree)
    assert doc and 2 <= len(doc.splitlines()) <= 6, doc
    assert any(isinstance(node, ast.FunctionDef) and node.name == "main"
               for node in tree.body)
    assert any(isinstance(node, ast.If)
               and ast.unparse(node.test) == "__name__ == '__main__'" for node in tree.body)


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_an_example_runs(tmp_path, path):
    p = _run([path, "--steps", "3"], cwd=tmp_path)   # (--steps: a short run)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip(), p.stderr
    assert "Traceback" not in p.stderr, p.stderr


def test_the_ray_example_without_ray_says_what_to_install(tmp_path):
    # (ray made unimportable, as where it is not installed)
    code = ("import runpy, sys; sys.modules['ray'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    p = _run(["-c", code, os.path.join(ROOT, "examples", "ray_sampler.py")], cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert 'pip install "unienv_mp[ray]"' in p.stdout


def test_the_gpu_example_without_cuda_says_it_skipped(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = _run([os.path.join(ROOT, "examples", "gpu_feed.py")], cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "skipped" in p.stdout
