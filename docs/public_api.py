"""The public API that the reference documents: the public modules, and where each public
name is documented (its shortest public path: ``unienv_mp.MultiprocessingSampler``, not
``unienv_mp.sampler.MultiprocessingSampler``).  Used by docs/gen_reference.py to write the
pages and by docs/check_site.py to check a built site; imports nothing of mkdocs."""
import importlib
import inspect
import typing

#: The public modules, in the order of the navigation (tests/test_layout.py holds the same
#: list and checks that nothing else is public).
MODULES = ("unienv_mp", "unienv_mp.sampler", "unienv_mp.windows", "unienv_mp.manager",
           "unienv_mp.queue", "unienv_mp.stats", "unienv_mp.errors", "unienv_mp.backend",
           "unienv_mp.gather", "unienv_mp.compat", "unienv_mp.ray")


def public_names():
    """{module: [(name, is_class, documented_at)]}, where ``documented_at`` is the shortest
    public path of the object (the first module of MODULES that exports it)."""
    home, out = {}, {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
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


def page_of(path):
    """The reference page of a class: its dotted path as folders."""
    return path.replace(".", "/") + ".md"
