"""The README's runnable code blocks run, and print what the README says they print."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _scripts():
    """(line, code, expected output or None) of every ```python block that is a whole
    program (it has a main guard); the others are fragments.  The expected output is the
    `...` quoted after "it prints" in the sentence that introduces or follows the block."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    out = []
    for m in re.finditer(r"```python\n(.*?)```", text, re.S):
        code = m.group(1)
        if 'if __name__ == "__main__":' not in code:
            continue
        around = text[max(0, m.start() - 300):m.start()] + text[m.end():m.end() + 300]
        said = re.search(r"[Ii]t prints `([^`]*)`", around)
        line = text.count("\n", 0, m.start()) + 1
        out.append((line, code, None if said is None else said.group(1)))
    return out


SCRIPTS = _scripts()


def test_the_readme_has_the_scripts_it_promises():
    # the quick start's complete script, and the RingBuffer and ShmQueue round trips
    assert len(SCRIPTS) >= 3
    assert all(expected is not None for _, _, expected in SCRIPTS)


@pytest.mark.parametrize("line,code,expected", SCRIPTS,
                         ids=[f"README line {line}" for line, _, _ in SCRIPTS])
def test_a_readme_script_runs_and_prints_what_the_readme_says(tmp_path, line, code,
                                                               expected):
    path = tmp_path / "script.py"
    path.write_text(code)
    p = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    printed = " ".join(p.stdout.split())
    assert printed == " ".join(expected.split()), (printed, expected)
