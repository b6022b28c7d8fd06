"""The stubs of the compiled modules (unienv_mp/**/*.pyi), held to the modules themselves.

- stubtest compares every name, signature, default and kind (method, property, static)
  of the stubs with the compiled modules;
- the constructors, which a compiled class does not describe at run time, are compared
  with their definitions in the .pyx sources;
- the docstrings of the stubs (what IDEs show) are those of the modules (what ``help()``
  shows);
- ``mypy --strict`` type-checks tests/typecheck/usage.py, a user's code with the types it
  expects, and the file runs.
"""
import ast
import glob
import inspect
import os
import re
import subprocess
import sys

import pytest

import unienv_mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "unienv_mp")
TYPING = os.path.join(ROOT, "tests", "typecheck")
# Compiled modules by dotted name within the package ("_transport.ring"), their sources
# and stubs beside them.
COMPILED = sorted(os.path.relpath(p, PACKAGE)[:-4].replace(os.sep, ".")
                  for p in glob.glob(os.path.join(PACKAGE, "**", "*.pyx"), recursive=True))


def _module(name):
    __import__(f"unienv_mp.{name}")
    return sys.modules[f"unienv_mp.{name}"]


def _path(name, suffix):
    return os.path.join(PACKAGE, *name.split(".")) + suffix


def _stub(name):
    with open(_path(name, ".pyi")) as f:
        return ast.parse(f.read())


def _mypy_env():
    env = dict(os.environ)
    env.pop("MYPYPATH", None)
    return env


def test_every_compiled_module_has_a_stub_and_is_compiled():
    assert COMPILED == ["_direct.rows", "_transport.codec", "_transport.ring"]
    stubs = sorted(os.path.relpath(p, PACKAGE)[:-4].replace(os.sep, ".")
                   for p in glob.glob(os.path.join(PACKAGE, "**", "*.pyi"), recursive=True))
    assert stubs == COMPILED
    assert os.path.isfile(os.path.join(PACKAGE, "py.typed"))
    for name in COMPILED:
        assert _module(name).__file__.endswith(".so"), name


# Differences stubtest reports that are not differences.
ALLOWED = [
    # Cython's generated pickling helpers.
    r"unienv_mp\..*\.__(reduce|setstate)_cython__",
]
if sys.version_info < (3, 12):
    # Python 3.12 names the buffer protocol __buffer__ / __release_buffer__ (PEP 688);
    # before, a class exports buffers without those methods, and the stubs declare them
    # so that type checkers accept the class where a buffer is expected.
    # test_buffer_classes_export_buffers checks the exporting itself.
    ALLOWED.append(r"unienv_mp\..*\.__(release_)?buffer__")


def test_stubs_match_the_compiled_modules(tmp_path):
    allowlist = tmp_path / "allowlist.txt"
    allowlist.write_text("\n".join(ALLOWED) + "\n")
    r = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", *(f"unienv_mp.{m}" for m in COMPILED),
         "--mypy-config-file", os.path.join(TYPING, "mypy.ini"), "--allowlist",
         str(allowlist), "--concise"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_mypy_env())
    assert r.returncode == 0, r.stdout + r.stderr


def test_buffer_classes_export_buffers():
    from unienv_mp._transport.codec import SlotLease
    from unienv_mp._transport.ring import Segment
    for name in COMPILED:
        for node in _stub(name).body:
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(f, ast.FunctionDef) and f.name == "__buffer__"
                    for f in node.body):
                assert node.name in ("Segment", "SlotLease"), node.name
    seg = Segment.create(128, "typing")
    try:
        with memoryview(seg) as view:
            assert view.nbytes == 128
        lease = SlotLease(seg, 64, 32)
        with memoryview(lease) as view:
            assert view.nbytes == 32
        del lease
    finally:
        seg.close()


# -- constructors -------------------------------------------------------------------------

def _split_top_level(text):
    """Split a parameter list at the commas that are not inside brackets or quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _pyx_constructor(source, cls):
    """The Python signature (an ast.arguments, without ``self``) of the constructor of
    ``cdef class cls`` in ``source``: its ``__init__``, else its ``__cinit__``; None if it
    has neither (it takes no arguments).  C types and ``not None`` are dropped: ``Segment segment not None`` is
    the parameter ``segment``."""
    m = re.search(rf"^cdef class {cls}\b.*?:\n(.*?)(?=^\S|\Z)", source, re.S | re.M)
    assert m, f"no cdef class {cls} in the source"
    body = m.group(1)
    for method in ("__init__", "__cinit__"):
        d = re.search(rf"^    def {method}\((.*?)\):", body, re.S | re.M)
        if d:
            break
    else:
        return None
    params = []
    for p in _split_top_level(d.group(1))[1:]:
        name, eq, default = p.partition("=")
        name = re.sub(r"\bnot None\b", "", name).split()[-1] if name.strip() != "*" else "*"
        params.append(name + (f"={default.strip()}" if eq else ""))
    return ast.parse(f"def f({', '.join(params)}): pass").body[0].args


def _shape(args, evaluate):
    """(kind, name, default) of every parameter but the first, for comparing."""
    out = []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for a, d in zip(positional, defaults):
        out.append(("positional", a.arg, None if d is None else evaluate(d)))
    if args.vararg:
        out.append(("*args", args.vararg.arg, None))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append(("keyword", a.arg, None if d is None else evaluate(d)))
    if args.kwarg:
        out.append(("**kwargs", args.kwarg.arg, None))
    return out


def test_constructors_match_the_sources():
    checked = []
    for name in COMPILED:
        module = _module(name)
        with open(_path(name, ".pyx")) as f:
            source = f.read()
        for node in _stub(name).body:
            if not isinstance(node, ast.ClassDef) or not hasattr(module, node.name):
                continue   # (a protocol of the stub's own, for type checkers only)
            stub = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
            stub_init = stub.get("__init__") or stub.get("__new__")
            pyx = _pyx_constructor(source, node.name)
            want = [] if pyx is None else _shape(
                pyx, lambda d: eval(ast.unparse(d), vars(module)))
            # (the stub's first parameter is self or cls; the source's was dropped)
            got = [] if stub_init is None else _shape(stub_init.args, ast.literal_eval)[1:]
            assert got == want, f"{name}.{node.name}"
            checked.append(node.name)
    assert sorted(checked) == ["Event", "Prepared", "RingBuffer", "Segment", "SlotLease"]


def test_constructor_check_catches_a_difference():
    source = ("cdef class A:\n    def __init__(self, int n, Segment s not None, *, x=1):\n"
              "        pass\n")
    args = _pyx_constructor(source, "A")
    assert _shape(args, ast.literal_eval) == [
        ("positional", "n", None), ("positional", "s", None), ("keyword", "x", 1)]
    stub = ast.parse("def __init__(self, n: int, s: S, x: int = 1) -> None: ...").body[0]
    assert _shape(stub.args, ast.literal_eval)[1:] != _shape(args, ast.literal_eval)


# -- docstrings ---------------------------------------------------------------------------

def _own_doc(obj):
    """The docstring written for ``obj`` itself, or None (the generic text of a slot
    wrapper such as ``__len__``, or of a class attribute's type, is not)."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if inspect.isclass(obj) or inspect.ismodule(obj) or callable(obj) and hasattr(
            obj, "__code__"):
        return obj.__doc__
    if inspect.isgetsetdescriptor(obj) or isinstance(obj, property):
        return obj.__doc__
    return None


def _docstrings(tree, runtime, prefix):
    """(qualified name, stub docstring, runtime docstring) for the module and for every
    class, function and property of the stub that exists at run time."""
    yield prefix, ast.get_docstring(tree, clean=True), runtime.__doc__
    for node in tree.body:
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            continue
        obj = inspect.getattr_static(runtime, node.name, None)
        if obj is None:
            continue
        name = f"{prefix}.{node.name}"
        if isinstance(node, ast.ClassDef):
            yield from _docstrings(node, obj, name)
        else:
            yield name, ast.get_docstring(node, clean=True), _own_doc(obj)


def test_stub_docstrings_are_the_modules_docstrings():
    compared = 0
    for name in COMPILED:
        for qualname, stub_doc, runtime_doc in _docstrings(_stub(name), _module(name), name):
            runtime_doc = inspect.cleandoc(runtime_doc) if runtime_doc else None
            assert stub_doc == runtime_doc, (
                f"{qualname}: the stub's docstring differs from the module's\n"
                f"--- stub ---\n{stub_doc}\n--- module ---\n{runtime_doc}")
            compared += runtime_doc is not None
    assert compared >= 40


# -- a user's view ------------------------------------------------------------------------

def test_the_api_type_checks_under_mypy_strict(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", os.path.join(TYPING, "mypy.ini"),
         "--cache-dir", str(tmp_path / "cache"), os.path.join(TYPING, "usage.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_mypy_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found in 1 source file" in r.stdout


def test_mypy_rejects_a_wrong_expectation(tmp_path):
    """The check above can fail: a type the stubs do not give is an error."""
    wrong = tmp_path / "wrong.py"
    wrong.write_text("from typing_extensions import assert_type\n"
                     "from unienv_mp import RingBuffer\n"
                     "assert_type(RingBuffer(1, 8).pop(), str)\n")
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", os.path.join(TYPING, "mypy.ini"),
         "--cache-dir", str(tmp_path / "cache"), str(wrong)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_mypy_env())
    assert r.returncode == 1, r.stdout + r.stderr
    assert 'Expression is of type "bytes", not "str"' in r.stdout


def test_the_usage_file_runs():
    r = subprocess.run([sys.executable, os.path.join(TYPING, "usage.py")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "usage ok"


def test_lazy_names_are_visible_to_type_checkers():
    """Every name of ``__all__`` that the package loads on first use (it binds no other
    way) is imported for type checkers, from the module it is loaded from."""
    with open(os.path.join(PACKAGE, "__init__.py")) as f:
        tree = ast.parse(f.read())
    checked = [node for node in tree.body if isinstance(node, ast.If)
               and ast.unparse(node.test) == "TYPE_CHECKING"]
    assert len(checked) == 1
    imported = {alias.asname: node.module for node in ast.walk(checked[0])
                if isinstance(node, ast.ImportFrom) for alias in node.names
                if alias.asname == alias.name}
    bound = {alias.asname or alias.name for node in tree.body
             if isinstance(node, ast.ImportFrom) for alias in node.names}
    lazy = set(unienv_mp.__all__) - bound
    assert lazy and set(imported) == lazy
    for name, module in imported.items():
        assert getattr(unienv_mp, name).__module__ == f"unienv_mp.{module}", name
