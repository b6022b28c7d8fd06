"""The package's metadata: one version, the license, what the wheel carries.  (CI builds
the sdist and the wheel and checks them file by file: .ci/check_dist.py.)"""
import importlib.metadata
import os
import sys

import unienv_mp

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_the_version_is_written_once_and_is_the_installed_one():
    project = _pyproject()
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "unienv_mp.__version__"}
    assert unienv_mp.__version__ == importlib.metadata.version("unienv_mp")
    parts = unienv_mp.__version__.split(".")
    assert len(parts) == 3 and all(p.isdigit() for p in parts), unienv_mp.__version__


def test_the_license_is_mit_as_an_spdx_string_with_its_file():
    project = _pyproject()["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project["classifiers"])
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert text.startswith("MIT License\n\nCopyright (c) 2026 the unienv_mp developers\n")
    assert 'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND' in text


def test_the_wheel_carries_the_stubs_and_every_subpackage():
    setuptools = _pyproject()["tool"]["setuptools"]
    # every unienv_mp.* package, not a fixed list, so a new subpackage is shipped
    assert setuptools["packages"]["find"]["include"] == ["unienv_mp", "unienv_mp.*"]
    data = setuptools["package-data"]["*"]
    assert {"py.typed", "*.pyi"} <= set(data)
    assert setuptools["exclude-package-data"]["*"] == ["*.c"]


def test_tqdm_is_no_dependency():
    """The main job's progress bars use tqdm where it is installed, a line per row where
    it is not (tests/test_layout.py): installing the package does not pull it in."""
    required = _pyproject()["project"]["dependencies"]
    assert not [d for d in required if d.lower().startswith("tqdm")]


def test_classifiers_say_linux_cpython_and_cython():
    project = _pyproject()["project"]
    classifiers = set(project["classifiers"])
    assert {"Operating System :: POSIX :: Linux",
            "Programming Language :: Python :: Implementation :: CPython",
            "Programming Language :: Cython", "Typing :: Typed"} <= classifiers
    low = project["requires-python"].removeprefix(">=")
    versions = sorted(c.rsplit(" ", 1)[1] for c in classifiers
                      if c.startswith("Programming Language :: Python :: 3.")
                      and c.count("::") == 2)
    assert versions[0] == low and project["keywords"]


def test_only_unienv_mp_ray_imports_ray():
    """ray is optional: every other module imports without it, and no other module
    imports it (the main job's Ray row included, until it runs)."""
    import subprocess
    code = (
        "import importlib, pkgutil, sys, unienv_mp\n"
        "names, todo = [], [unienv_mp]\n"
        "while todo:   # (every module and subpackage but unienv_mp.ray)\n"
        "    package = todo.pop()\n"
        "    for m in pkgutil.iter_modules(package.__path__, package.__name__ + '.'):\n"
        "        if m.name != 'unienv_mp.ray':\n"
        "            names.append(m.name)\n"
        "            module = importlib.import_module(m.name)\n"
        "            if m.ispkg:\n"
        "                todo.append(module)\n"
        "assert {'unienv_mp.bench.peers', 'unienv_mp._sampling.sampler',\n"
        "        'unienv_mp._process.manager', 'unienv_mp.sampler'} <= set(names), names\n"
        "print('ray' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_a_failed_run_can_be_resumed_with_lf_and_ff(tmp_path):
    """The project's pytest options keep pytest's cache, so that ``--lf`` reruns only the
    tests that failed and ``--ff`` runs them first."""
    import subprocess
    (tmp_path / "test_two.py").write_text(
        "def test_passes():\n    pass\n\ndef test_fails():\n    assert False\n")

    def run(*args):
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-c", os.path.join(ROOT, "pyproject.toml"),
             "--rootdir", str(tmp_path), "-p", "no:randomly", "-v", *args,
             str(tmp_path / "test_two.py")],
            cwd=tmp_path, capture_output=True, text=True, timeout=120)
        return out.stdout
    first = run()
    assert "test_passes PASSED" in first and "test_fails FAILED" in first
    again = run("--lf")
    assert "test_fails FAILED" in again and "test_passes" not in again
    ordered = run("--ff")
    assert ordered.index("test_fails") < ordered.index("test_passes")


def test_the_ctrl_c_tests_pass_when_the_run_starts_with_sigint_ignored():
    """A background job of a non-interactive shell (or ``nohup``) starts with SIGINT
    ignored: the tests that send a Ctrl-C install Python's handler themselves
    (conftest's ``default_sigint``)."""
    import signal
    import subprocess

    def ignore_sigint():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         os.path.join(ROOT, "tests", "test_reproducible.py"), "-k",
         "a_state_taken_after_an_epoch_failed_to_start"],
        cwd=ROOT, preexec_fn=ignore_sigint, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-2000:]


def test_the_backend_contract_runs_without_ray():
    """The contract's tests check the process manager and the in-process fake where Ray
    is not installed (it is made unimportable here), and skip only Ray's cases."""
    import subprocess
    code = ("import sys; sys.modules['ray'] = None\n"
            "import pytest\n"
            "sys.exit(pytest.main(['tests/test_backend_contract.py', '-q', '-p',\n"
            "                      'no:cacheprovider', '-k', 'not ray']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
