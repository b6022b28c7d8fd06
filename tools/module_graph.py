"""The module graph in the docs' Design page (docs/design.md): every module of the package,
what it holds (written by hand, in that page), and what it imports from the package (read from
the code, here).

    python tools/module_graph.py            # print the graph as the code has it
    python tools/module_graph.py --write    # rewrite the page's graph from the code
    python tools/module_graph.py --check    # exit 1, saying what differs, unless the
                                            # page's graph is the code's

The graph is the ``` block after the line ``<!-- module graph -->`` in docs/design.md.  An
entry is a module's file name at the start of a line, what it holds, and ``<- `` followed
by the modules it imports (``; ... on first use`` for those imported inside a function or
only for type checkers).  ``errors.py``, which most modules import, is left out of the
imports, and each subpackage (``_transport/``, ``_process/``, ...) is one entry: what it
holds module by module is its ``__init__.py``'s docstring.  The order of
the entries and what they hold are the page's; a module of the package with no entry,
or an entry for no module, is an error that ``--write`` cannot mend: write the entry's
first line by hand, then run ``--write``.
"""
import ast
import difflib
import pathlib
import re
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "unienv_mp"
PAGE = ROOT / "docs" / "design.md"
MARKER = "<!-- module graph -->"
LEFT_OUT = {"errors"}   # imported nearly everywhere: not shown
FOLDED = {"_transport", "_direct", "_process", "_device", "_sampling", "ray", "bench"}
                        # subpackages, each shown as one entry
NAME_WIDTH = 18
WIDTH = 92
_PYX_IMPORT = re.compile(r"^\s*from\s+(\.+[\w.]*)\s+c?import[ \t]+([\w \t,]+)", re.M)


class GraphError(Exception):
    """The page's graph cannot be compared with the code, or rewritten from it."""


def _unit(module):
    """The entry a dotted module of the package (``ray.manager``) is shown under."""
    parts = module.split(".")
    if parts[0] in FOLDED:
        return parts[0] + "/"
    return "/".join(parts) or "__init__"


def _modules():
    """``{dotted name: path}`` of every module of the package (``__init__`` as the
    package's own name: ``ray`` for ``ray/__init__.py``, ``""`` for the top)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".pyx") or "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(module, level, name, is_package):
    """The dotted name, within the package, that ``from <level dots><name>`` in
    ``module`` refers to (None: outside the package)."""
    if level == 0:
        if name == PACKAGE.name or name.startswith(PACKAGE.name + "."):
            return name[len(PACKAGE.name) + 1:]
        return None
    base = module.split(".") if module else []
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _from_import(module, level, name, names, is_package, known):
    """The package's modules that ``from <level dots><name> import <names>`` in
    ``module`` names: each name that is a submodule, else the module imported from."""
    base = _resolve(module, level, name, is_package)
    if base is None:
        return []
    fulls = (f"{base}.{n}" if base else n for n in names)
    return [full if full in known else base for full in fulls]


def _imports_of(module, path, known):
    """``(at import, on first use)``: the package's modules ``module`` imports."""
    is_package = path.stem == "__init__"
    text = path.read_text()
    resolved = []   # (dotted target, lazy)
    if path.suffix == ".pyx":   # (relative imports at the top: a regular expression will do)
        for m in _PYX_IMPORT.finditer(text):
            dots, names = m.group(1), [n.strip() for n in m.group(2).split(",")]
            resolved += [(target, False) for target in _from_import(
                module, len(dots) - len(dots.lstrip(".")), dots.lstrip("."), names,
                is_package, known)]
        return _split(module, resolved, known)
    tree = ast.parse(text, str(path))
    lazy_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
            lazy_nodes.update(id(n) for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        lazy = id(node) in lazy_nodes
        if isinstance(node, ast.ImportFrom):
            resolved += [(target, lazy) for target in _from_import(
                module, node.level, node.module or "", [a.name for a in node.names],
                is_package, known)]
        elif isinstance(node, ast.Import):
            resolved += [(_resolve(module, 0, a.name, False), lazy) for a in node.names]
    return _split(module, resolved, known)


def _split(module, resolved, known):
    eager, lazy = set(), set()
    for target, is_lazy in resolved:
        if target is None or target not in known:
            continue
        unit = _unit(target)
        if target.split(".")[-1] in LEFT_OUT or unit == _unit(module):
            continue
        (lazy if is_lazy else eager).add(unit)
    return eager, lazy - eager


def code_graph():
    """``{entry: (at import, on first use)}`` as the code has it."""
    known = _modules()
    graph = {}
    for module, path in known.items():
        if module.split(".")[-1] in LEFT_OUT:
            continue
        unit = _unit(module)
        if unit.endswith("/"):
            entry = unit
        else:
            rel = path.relative_to(PACKAGE)
            entry = "/".join(rel.parts)
        eager, lazy = _imports_of(module, path, known)
        old = graph.setdefault(entry, (set(), set()))
        old[0].update(eager)
        old[1].update(lazy)
    for eager, lazy in graph.values():
        lazy -= eager
    return graph


def _block(text):
    """``(start, end)``: where the graph's lines lie in the page's ``text``."""
    at = text.find(MARKER)
    if at < 0:
        raise GraphError(f"docs/design.md has no line {MARKER!r} before the module graph")
    start = text.index("```\n", at) + 4
    end = text.index("```", start)
    return start, end


def parse(block):
    """``[(entry, what it holds)]`` from the graph's text, in its order."""
    entries = []
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            name, _, rest = line.partition(" ")
            entries.append([name, rest])
        elif entries:
            # (a word wrapped at its hyphen is one word again)
            joint = "" if entries[-1][1].endswith("-") else " "
            entries[-1][1] += joint + line.strip()
        else:
            raise GraphError(f"the graph starts with an indented line: {line!r}")
    return [(name, " ".join(rest.split("<-")[0].split())) for name, rest in entries]


def _shown(entry):
    """The name an entry's imports show: without the file's extension."""
    return entry if entry.endswith("/") else entry.rsplit(".", 1)[0].removesuffix("/__init__")


def render(entries, graph):
    """The graph's text: ``entries`` (``[(entry, what it holds)]``) with the imports
    of ``graph``, ordered as the entries are."""
    order = {_shown(name): i for i, (name, _) in enumerate(entries)}

    def listed(units):
        return ", ".join(sorted(units, key=lambda u: (order.get(u, len(order)), u)))
    pad = " " * NAME_WIDTH
    lines = []
    for name, holds in entries:
        eager, lazy = graph[name]
        wrapped = textwrap.wrap(holds, WIDTH - NAME_WIDTH, break_on_hyphens=False) or [""]
        lines.append(name.ljust(NAME_WIDTH - 1) + " " + wrapped[0])
        lines.extend(pad + w for w in wrapped[1:])
        if not (eager or lazy):
            continue
        words = listed(eager)
        if lazy:
            words += ("; " if words else "") + listed(lazy) + " on first use"
        arrow = textwrap.wrap("<- " + words, WIDTH - NAME_WIDTH,
                              subsequent_indent="   ", break_on_hyphens=False)
        if len(lines[-1]) + 2 + len(arrow[0]) <= WIDTH and len(arrow) == 1:
            lines[-1] += "  " + arrow[0]
        else:
            lines.extend(pad + a for a in arrow)
    return "\n".join(lines) + "\n"


def expected(text):
    """The page's graph as the code has it (raises GraphError for an entry the code
    has not, or a module of the package that has no entry)."""
    start, end = _block(text)
    entries = parse(text[start:end])
    graph = code_graph()
    names = [name for name, _ in entries]
    missing = sorted(set(graph) - set(names))
    extra = sorted(set(names) - set(graph))
    twice = sorted({n for n in names if names.count(n) > 1})
    problems = []
    if missing:
        problems.append(f"modules with no entry in the page's graph: {', '.join(missing)} "
                        f"(write each one's name and what it holds, then run --write)")
    if extra:
        problems.append(f"entries in the page's graph for no module: {', '.join(extra)}")
    if twice:
        problems.append(f"entries in the page's graph twice: {', '.join(twice)}")
    if problems:
        raise GraphError("; ".join(problems))
    return start, end, render(entries, graph)


def differences(text):
    """What differs between the page's graph in ``text`` and the code's, as a unified
    diff ("" if nothing)."""
    start, end, want = expected(text)
    have = text[start:end]
    if have == want:
        return ""
    return "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                        "docs/design.md (graph)", "the code"))


def main(argv):
    text = PAGE.read_text()
    try:
        if "--check" in argv:
            diff = differences(text)
            if diff:
                print("the module graph in docs/design.md is not the code's (run "
                      "`python tools/module_graph.py --write`):\n" + diff, file=sys.stderr)
                return 1
            return 0
        start, end, want = expected(text)
    except GraphError as e:
        print(f"module graph: {e}", file=sys.stderr)
        return 1
    if "--write" in argv:
        PAGE.write_text(text[:start] + want + text[end:])
    else:
        sys.stdout.write(want)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
