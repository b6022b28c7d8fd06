"""The public API that the reference documents: the public modules, and where each public
name is documented (its shortest public path: ``unienv_mp.MultiprocessingSampler``, not
``unienv_mp.sampler.MultiprocessingSampler``).  Used by docs/gen_reference.py to write the
pages and by docs/check_site.py to check a built site; imports nothing of mkdocs."""
import importlib
import inspect
import os
import typing

#: The public modules, in the order of the navigation (tests/test_layout.py holds the same
#: list and checks that nothing else is public).
MODULES = ("unienv_mp", "unienv_mp.sampler", "unienv_mp.windows", "unienv_mp.manager",
           "unienv_mp.queue", "unienv_mp.stats", "unienv_mp.errors", "unienv_mp.backend",
           "unienv_mp.gather", "unienv_mp.compat", "unienv_mp.ray")


def public_names():
    """{module: [(name, is_class, documented_at)]}, where ``documented_at`` is the shortest
    public path of the object (the first module of MODULES that exports it).  A module that
    cannot be imported here (``unienv_mp.ray`` without Ray: the ``docs`` extra does not
    install it) is read from its source instead (`_static_names`)."""
    home, out = {}, {}
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            out[module_name] = _static_names(module_name, home)
            continue
        rows = []
        for name in module.__all__:
            value = getattr(module, name)
            # (classes, functions and type variables by identity: the same object re-exported
            # is one name; other values by where they are exported)
            by_identity = (inspect.isclass(value) or callable(value)
                           or isinstance(value, typing.TypeVar))
            key = id(value) if by_identity else (module_name, name)
            home.setdefault(key, f"{module_name}.{name}")
            rows.append((name, inspect.isclass(value), home[key]))
        out[module_name] = rows
    return out


def _static_names(module_name, home):
    """The rows of ``module_name`` read from its source with griffe (which mkdocstrings
    reads the docs with), without importing it; each name by the path it resolves to."""
    import griffe
    module = griffe.load(module_name, search_paths=[_ROOT], resolve_aliases=True,
                         resolve_external=False)
    rows = []
    for name in module.exports or ():
        member = module[str(name)]
        target = member.final_target if member.is_alias else member
        home.setdefault(target.path, f"{module_name}.{name}")
        rows.append((str(name), target.is_class, home[target.path]))
    return rows


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def page_of(path):
    """The reference page of a class: its dotted path as folders."""
    return path.replace(".", "/") + ".md"
