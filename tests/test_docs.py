"""The README's and the docs' runnable code blocks run, and print what the text around them
says they print; the Design page's module graph is the code's."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pages():
    """README.md and every Markdown page under docs/, as paths relative to the root."""
    pages = ["README.md"]
    for folder, _, files in sorted(os.walk(os.path.join(ROOT, "docs"))):
        pages += sorted(os.path.relpath(os.path.join(folder, f), ROOT)
                        for f in files if f.endswith(".md"))
    return pages


def _scripts():
    """(where, code, expected output or None) of every ```python block that is a whole
    program (it has a main guard); the others are fragments.  The expected output is the
    `...` quoted after "it prints" in the sentence that introduces or follows the block."""
    out = []
    for page in _pages():
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            code = m.group(1)
            if 'if __name__ == "__main__":' not in code:
                continue
            around = text[max(0, m.start() - 300):m.start()] + text[m.end():m.end() + 300]
            said = re.search(r"[Ii]t prints `([^`]*)`", around)
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{page} line {line}", code, None if said is None else said.group(1)))
    return out


SCRIPTS = _scripts()


def test_the_docs_have_the_scripts_they_promise():
    # Getting started's complete script, and the RingBuffer and ShmQueue round trips
    assert len(SCRIPTS) >= 3
    assert all(expected is not None for _, _, expected in SCRIPTS)


@pytest.mark.parametrize("where,code,expected", SCRIPTS, ids=[w for w, _, _ in SCRIPTS])
def test_a_script_of_the_docs_runs_and_prints_what_they_say(tmp_path, where, code,
                                                             expected):
    path = tmp_path / "script.py"
    path.write_text(code)
    p = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    printed = " ".join(p.stdout.split())
    assert printed == " ".join(expected.split()), (printed, expected)


def _module_graph():
    """tools/module_graph.py, loaded as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "module_graph", os.path.join(ROOT, "tools", "module_graph.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _design():
    with open(os.path.join(ROOT, "docs", "design.md")) as f:
        return f.read()


def test_the_design_pages_module_graph_is_the_codes():
    graph = _module_graph()
    diff = graph.differences(_design())
    assert not diff, "run `python tools/module_graph.py --write`:\n" + diff


def test_the_module_graph_check_sees_each_kind_of_disagreement():
    graph = _module_graph()
    text = _design()
    # an import the code has and the page lacks
    dropped = text.replace("SamplerStats  <- _os\n", "SamplerStats\n", 1)
    assert dropped != text
    assert "_os" in graph.differences(dropped)
    # a module with no entry, and an entry for no module
    line = next(l for l in text.splitlines(True) if l.startswith("compat.py "))
    with pytest.raises(graph.GraphError, match="no entry.*compat.py"):
        graph.differences(text.replace(line, "", 1))
    with pytest.raises(graph.GraphError, match="for no module: _gone.py"):
        graph.differences(text.replace(line, line + "_gone.py a module that is not\n", 1))
    # the layout is the script's: an entry wrapped otherwise differs, and is rewritten
    # to the same graph
    start, end, want = graph.expected(text)
    squashed = text[:start] + want.replace("\n" + " " * 18, " ", 3) + text[end:]
    assert graph.differences(squashed)
    assert graph.expected(squashed)[2] == want

def test_the_module_graph_script_checks_the_page_from_the_command_line():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "module_graph.py"),
                           "--check"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _reference_modules():
    """docs/public_api.py's MODULES, read without importing it."""
    import ast
    with open(os.path.join(ROOT, "docs", "public_api.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["MODULES"]:
            return ast.literal_eval(node.value)
    raise AssertionError("docs/public_api.py has no MODULES")


def test_the_api_reference_covers_the_public_modules():
    from test_layout import PUBLIC_MODULES
    assert set(_reference_modules()) == set(PUBLIC_MODULES)


def test_every_public_class_and_function_has_a_docstring():
    import importlib
    import inspect
    missing = []
    for name in _reference_modules():
        try:
            module = importlib.import_module(name)
        except ImportError:   # (unienv_mp.ray, without ray)
            continue
        assert module.__doc__, name
        for attr in module.__all__:
            value = getattr(module, attr)
            if (inspect.isclass(value) or inspect.isroutine(value)) and not value.__doc__:
                missing.append(f"{name}.{attr}")
    assert not missing, missing


def test_the_readme_fits_on_a_few_screens():
    with open(os.path.join(ROOT, "README.md")) as f:
        assert len(f.read().splitlines()) <= 200
