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


def _public_api():
    """docs/public_api.py, loaded as a module, its MODULES cut to those that import here
    (``unienv_mp.ray`` needs ray, an optional dependency)."""
    import importlib
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "public_api", os.path.join(ROOT, "docs", "public_api.py"))
    api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api)
    importable = []
    for name in api.MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        importable.append(name)
    api.MODULES = tuple(importable)
    return api


def _stub_parameters(obj):
    """The parameters of a compiled class's ``__init__`` (or a compiled function), read
    from the ``.pyi`` stub beside its module; None if it has no stub."""
    import ast
    import importlib
    module = importlib.import_module(obj.__module__)
    path = getattr(module, "__file__", None) or ""
    folder, base = os.path.split(path)
    stub = os.path.join(folder, base.split(".")[0] + ".pyi")
    if not os.path.exists(stub):
        return None
    with open(stub) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if getattr(node, "name", None) != obj.__name__:
            continue
        if isinstance(node, ast.ClassDef):
            node = next((d for d in node.body if isinstance(d, ast.FunctionDef)
                         and d.name == "__init__"), None)
            if node is None:
                return []
        a = node.args
        return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg != "self"]
    return None


def _parameters(obj):
    """The names of ``obj``'s parameters, less self, ``*args`` and ``**kwargs``."""
    import inspect
    try:
        sig = inspect.signature(obj)
    except ValueError:
        # a compiled class (its stub says), or a subclass of a builtin exception with
        # no __init__ of its own: no parameters of its own
        return _stub_parameters(obj) or []
    return [p.name for p in sig.parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"]


def _section_entries(doc, header):
    """The names of the entries of ``doc``'s ``header`` section (``"Args"``), or None if it
    has none: the lines indented one level (4 spaces) deeper than the header that start
    with ``name:`` (or ``name (type):``)."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != header + ":":
            continue
        indent = len(line) - len(line.lstrip())
        names = []
        for entry in lines[i + 1:]:
            if not entry.strip():
                continue
            depth = len(entry) - len(entry.lstrip())
            if depth <= indent:
                break
            m = re.match(r"(\w+)(\s*\([^)]*\))?:(\s|$)", entry.strip())
            if depth == indent + 4 and m:
                names.append(m.group(1))
        return names
    return None


#: Public callables with parameters and no parameter table, and why.
NO_PARAMETER_TABLE = {
    # its Args would make it long; its docstring says its
    # constructor takes MultiprocessingSampler's options less the process backend's
    "unienv_mp.sampler.SamplerBase",
}


def _parameter_table_gaps(api):
    """What every public class and function documented at its own path lacks: for one
    with parameters, an ``Args:`` section (or, for a class whose docstring has none, an
    ``Attributes:`` section: a dataclass, or a class that keeps its parameters as
    attributes) in its docstring or its ``__init__``'s, with an entry for each parameter."""
    import importlib
    import inspect
    gaps = []
    for module_name, rows in api.public_names().items():
        module = importlib.import_module(module_name)
        for name, is_class, at in rows:
            value = getattr(module, name)
            if at != f"{module_name}.{name}" or at in NO_PARAMETER_TABLE:
                continue
            if not (inspect.isclass(value) or inspect.isroutine(value)):
                continue
            params = _parameters(value)
            if not params:
                continue
            docs = [inspect.cleandoc(value.__doc__ or "")]
            init = vars(value).get("__init__") if is_class else None
            if init is not None and init.__doc__:
                docs.append(inspect.cleandoc(init.__doc__))
            entries = None
            for header in ("Args", "Attributes") if is_class else ("Args",):
                for doc in docs:
                    entries = _section_entries(doc, header)
                    if entries is not None:
                        break
                if entries is not None:
                    break
            if entries is None:
                gaps.append(f"{at}: no Args section")
                continue
            missing = [p for p in params if p not in entries]
            if missing:
                gaps.append(f"{at}: no entry for {', '.join(missing)}")
    return gaps


def test_every_public_callable_with_parameters_has_a_parameter_table():
    gaps = _parameter_table_gaps(_public_api())
    assert not gaps, "\n".join(gaps)


def test_the_parameter_table_check_reads_the_entries_of_a_section():
    import inspect
    doc = inspect.cleandoc('''Summary.

        Args:
            first: what it is, over
                two lines: not an entry.
            second (int): typed.

        Returns:
            nothing: not an entry.''')
    assert _section_entries(doc, "Args") == ["first", "second"]
    assert _section_entries(doc, "Attributes") is None


def _list_problems(text):
    """Lines where Python-Markdown (which builds the site) would read a list otherwise
    than GitHub does: an item nested by fewer than four spaces, an item right after a
    paragraph line (no blank line between), and an item right after a later paragraph of
    an item (which Python-Markdown runs into that paragraph)."""
    item = re.compile(r"^( *)([-*+]|\d+\.) ")
    problems, fence, after_blank, in_list, para_in_item = [], False, False, False, False
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.strip().startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        if not line.strip():
            after_blank = True
            continue
        indent = len(line) - len(line.lstrip())
        m = item.match(line)
        prev = lines[i - 1] if i else ""
        if m:
            if indent % 4:
                problems.append((i + 1, "nested by fewer than four spaces"))
            elif prev.strip() and not item.match(prev) and not in_list and prev[0] not in "|#":
                problems.append((i + 1, "no blank line after the paragraph before it"))
            elif prev.strip() and not item.match(prev) and para_in_item:
                problems.append((i + 1, "no blank line after an item's later paragraph"))
            in_list, para_in_item = True, False
        elif after_blank:
            in_list = indent > 0 and in_list
            para_in_item = in_list
        after_blank = False
    return problems


@pytest.mark.parametrize("page", _pages() + ["models/README.md", "benchmarks/README.md"])
def test_the_pages_lists_nest_as_the_site_reads_them(page):
    # (the last two are pages of the site too, included as they are)
    with open(os.path.join(ROOT, page)) as f:
        assert _list_problems(f.read()) == []


def test_the_list_check_sees_each_problem():
    assert _list_problems("- a\n  - b\n") == [(2, "nested by fewer than four spaces")]
    assert _list_problems("text:\n- a\n") == [(2, "no blank line after the paragraph "
                                                    "before it")]
    assert _list_problems("- a\n\n    more\n- b\n") == [
        (4, "no blank line after an item's later paragraph")]
    assert _list_problems("text:\n\n- a\n    - b\n\n    more\n\n- c\n") == []


def test_the_gpu_guide_says_which_stream_waits_and_claims_no_gpu_number():
    # Only the stream current at the hand-out waits for a copy: the guide must not say the
    # batches may be read on any stream, and must say what another stream needs.  Nothing
    # has run on a GPU: its speed table holds no number, and it says so.
    with open(os.path.join(ROOT, "docs", "guides", "gpu.md")) as f:
        text = f.read()
    flat = " ".join(text.split())
    assert "on any stream" not in flat
    assert "Only that stream waits" in flat and "wait_stream(" in flat
    assert "record_stream(" in flat
    assert "Nothing in this table has run on a GPU yet" in flat
    table = text[text.index("| goal | measured |"):]
    table = table[:table.index("\n\n")]
    assert not re.search(r"\d+(\.\d+)? ?ms", table)
    assert all(row.rstrip().endswith("| not yet |") for row in table.splitlines()[2:])
