"""The package in small rooms: in the library and in the benchmark harness
(``unienv_mp.bench``, the main job), no class over 600 lines, no function over 100 (a
sanity check on size, not a target: objects own their parts), no
private name imported from one module of the package into another (a private *module*,
``from . import _codec``, is a module's public face).  The harness stays apart: the
library never imports it, and tqdm is optional."""
import ast
import os
import subprocess
import sys

import pytest

import unienv_mp

PACKAGE = os.path.dirname(unienv_mp.__file__)
BENCH = os.path.join(PACKAGE, "bench")
MAX_CLASS_LINES = 600
MAX_FUNCTION_LINES = 100


def _modules(folder, recurse=True):
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__" and recurse]
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(root, name)


def _parse(path):
    with open(path) as f:
        return ast.parse(f.read(), path)


def _rel(path):
    return os.path.relpath(path, os.path.dirname(PACKAGE))


HARNESS = sorted(_modules(BENCH)) + [os.path.join(PACKAGE, "__main__.py")]
CORE = sorted(p for p in _modules(PACKAGE)
              if not p.startswith(BENCH + os.sep) and os.path.basename(p) != "__main__.py")


def too_long(tree):
    """``(kind, name, line, lines)`` of every class over ``MAX_CLASS_LINES`` and every
    function or method (nested ones too) over ``MAX_FUNCTION_LINES`` in ``tree``."""
    out = []
    for node in ast.walk(tree):
        lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
            out.append(("class", node.name, node.lineno, lines))
        elif (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
              and lines > MAX_FUNCTION_LINES):
            out.append(("function", node.name, node.lineno, lines))
    return out


def _is_module(node, name, path):
    """True if ``from <node> import name``, in the module at ``path``, names a module of
    the package (a ``.py`` or ``.pyx`` file, or a subpackage)."""
    if path is None:
        return False
    if node.level:
        folder = os.path.dirname(path)
        for _ in range(node.level - 1):
            folder = os.path.dirname(folder)
        parts = (node.module or "").split(".") if node.module else []
    else:
        folder = os.path.dirname(PACKAGE)
        parts = node.module.split(".")
    base = os.path.join(folder, *parts, name)
    return (os.path.isdir(base) or os.path.exists(base + ".py")
            or os.path.exists(base + ".pyx"))


def private_imports(tree, path=None):
    """``(module, name, line)`` of every private name (a leading underscore) imported from
    a module of the package: ``from .x import _y``, ``from unienv_mp.x import _y`` (not a
    private module of the package, for a module at ``path``: ``from . import _codec``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            inside = node.level > 0 or (node.module or "").split(".")[0] == "unienv_mp"
            for alias in node.names:
                if (inside and alias.name.startswith("_") and alias.name != "__version__"
                        and not _is_module(node, alias.name, path)):
                    out.append((node.module or "." * node.level, alias.name, node.lineno))
    return out


def imports_bench(tree, path):
    """Lines of ``tree`` (a module at ``path`` in the package) that import
    ``unienv_mp.bench``, absolutely or relatively."""
    package = os.path.relpath(os.path.dirname(path), os.path.dirname(PACKAGE)).split(os.sep)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        if any(n == "unienv_mp.bench" or n.startswith("unienv_mp.bench.") for n in names):
            out.append(node.lineno)
    return out


def test_the_harness_is_where_it_is_said_to_be():
    names = {os.path.basename(p) for p in HARNESS}
    assert {"cli.py", "config.py", "peers.py", "measure.py", "__main__.py"} <= names
    assert not os.path.exists(os.path.join(PACKAGE, "compare.py"))
    assert len(CORE) > 10 and all("bench" not in _rel(p).split(os.sep)[1:-1] for p in CORE)


@pytest.mark.parametrize("path", HARNESS + CORE, ids=_rel)
def test_no_class_or_function_is_too_long(path):
    assert not too_long(_parse(path)), too_long(_parse(path))


@pytest.mark.parametrize("path", HARNESS + CORE, ids=_rel)
def test_no_module_imports_another_ones_private_names(path):
    assert not private_imports(_parse(path), path), private_imports(_parse(path), path)


#: The modules whose names are the package's public surface; a class reachable from one of
#: them is public.  Every other class of the package is private.
PUBLIC_MODULES = ("unienv_mp", "unienv_mp.backend", "unienv_mp.manager", "unienv_mp.sampler",
                  "unienv_mp.windows",
                  "unienv_mp.queue", "unienv_mp.gather", "unienv_mp.stats", "unienv_mp.errors",
                  "unienv_mp.compat", "unienv_mp.ray")


def _package_classes():
    """Every class defined in the library's modules (not the harness), by module."""
    import importlib
    import inspect
    out = []
    for path in CORE:
        rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
        name = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
        if name.split(".")[:2] == ["unienv_mp", "ray"] and importlib.util.find_spec("ray") is None:
            continue
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == name:
                out.append(cls)
    return out


def _public_classes():
    import importlib
    import inspect
    found = set()
    for name in PUBLIC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:   # (ray, when it is not installed)
            continue
        for attr in getattr(module, "__all__", dir(module)):
            value = getattr(module, attr, None)
            if inspect.isclass(value):
                found.add(value)
    return found


def lines_with_private_bases(cls, public):
    """Lines of ``cls``'s own source plus those of every base class of the package that is
    not public (what a class split into partial classes would hide)."""
    import inspect
    total = 0
    for c in cls.__mro__:
        if not c.__module__.startswith("unienv_mp") or (c is not cls and c in public):
            continue
        try:
            total += len(inspect.getsourcelines(c)[0])
        except (OSError, TypeError):   # (compiled classes)
            pass
    return total


def test_no_class_is_too_long_counting_its_private_base_classes():
    public = _public_classes()
    assert {"MultiprocessingSampler", "MultiProcessingSampleManager", "SamplerBase",
            "ShmQueue"} <= {c.__name__ for c in public}
    too_long = {f"{c.__module__}.{c.__qualname__}": n for c in _package_classes()
                if (n := lines_with_private_bases(c, public)) > MAX_CLASS_LINES}
    assert not too_long


def test_the_count_of_private_bases_sees_a_class_split_in_two(tmp_path, monkeypatch):
    import importlib.util
    half = "\n".join(f"    a{i} = {i}" for i in range(MAX_CLASS_LINES // 2 + 50))
    path = tmp_path / "unienv_mp_split_probe.py"
    path.write_text(f"class First:\n{half}\n\n\nclass Second(First):\n{half}\n")
    spec = importlib.util.spec_from_file_location("unienv_mp_split_probe", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "unienv_mp_split_probe", module)
    spec.loader.exec_module(module)
    assert lines_with_private_bases(module.Second, set()) > MAX_CLASS_LINES
    assert lines_with_private_bases(module.Second, {module.First}) <= MAX_CLASS_LINES


def test_the_core_package_never_imports_the_harness():
    found = {_rel(p): imports_bench(_parse(p), p) for p in CORE}
    assert not {p: lines for p, lines in found.items() if lines}
    # the entry point alone does
    main = os.path.join(PACKAGE, "__main__.py")
    assert imports_bench(_parse(main), main)


def test_the_checks_catch_what_they_check():
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert too_long(ast.parse(f"def f():\n{long_body}\n"))
    assert not too_long(ast.parse("def f():\n" + "\n".join(long_body.splitlines()[:-1])))
    method = "class C:\n" + "\n".join("    " + line for line in
                                       f"def m(self):\n{long_body}".splitlines())
    assert [k for k, *_ in too_long(ast.parse(method))] == ["function"]
    big_class = "class C:\n" + "\n".join(f"    a{i} = {i}" for i in range(MAX_CLASS_LINES))
    assert [k for k, *_ in too_long(ast.parse(big_class))] == ["class"]
    assert private_imports(ast.parse("from .peers import _SampleDataset"))
    assert private_imports(ast.parse("from unienv_mp.bench.data import _photo_like"))
    assert not private_imports(ast.parse("from .peers import make_sampler\n"
                                         "from collections import _chain"))
    core = os.path.join(PACKAGE, "sampler.py")
    assert not private_imports(ast.parse("from . import _os, _transport"), core)
    assert not private_imports(ast.parse("from unienv_mp import _os"), core)
    assert private_imports(ast.parse("from . import _os, _lookalike"), core)
    assert private_imports(ast.parse("from ._streams import _mix"), core)
    ray = os.path.join(PACKAGE, "ray", "manager.py")
    assert not private_imports(ast.parse("from .. import _os\nfrom . import _actor"), ray)
    assert private_imports(ast.parse("from . import _os"), ray)   # (no ray/_os)
    core = os.path.join(PACKAGE, "sampler.py")
    assert imports_bench(ast.parse("from .bench import cli"), core)
    assert imports_bench(ast.parse("from . import bench"), core)
    assert imports_bench(ast.parse("import unienv_mp.bench.config"), core)
    assert not imports_bench(ast.parse("from . import gather"), core)
    ray = os.path.join(PACKAGE, "ray", "sampler.py")
    assert imports_bench(ast.parse("from ..bench.peers import make_sampler"), ray)
    assert not imports_bench(ast.parse("from .bench import x"), ray)   # unienv_mp.ray.bench


def test_the_harness_imports_and_reports_progress_without_tqdm():
    """tqdm is optional: no module of the harness imports it when imported, and without it
    a run says a line as each row starts and finishes."""
    code = (
        "import importlib, pkgutil, sys\n"
        "sys.modules['tqdm'] = None\n"
        "import unienv_mp.bench\n"
        "for m in pkgutil.iter_modules(unienv_mp.bench.__path__, 'unienv_mp.bench.'):\n"
        "    importlib.import_module(m.name)\n"
        "import unienv_mp.__main__\n"
        "from unienv_mp.bench.progress import Progress\n"
        "p = Progress(True)\n"
        "p.tqdm = None if p.tqdm is None else sys.exit('tqdm used')\n"
        "advance, close = p.timing('a row')\n"
        "advance(0.5); close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "a row ..." in out.stderr and "a row: done in" in out.stderr
