"""Writes the API reference pages at build time (mkdocs-gen-files), from the public
modules' ``__all__``: one page per public module, one page per public class, each name
documented once, at its shortest public path (``unienv_mp.MultiprocessingSampler``, not
``unienv_mp.sampler.MultiprocessingSampler``).  The navigation is ``reference/SUMMARY.md``
(mkdocs-literate-nav)."""
import importlib
import inspect

import mkdocs_gen_files

#: The public modules, in the order of the navigation (tests/test_layout.py holds the same
#: list and checks that nothing else is public).
MODULES = ("unienv_mp", "unienv_mp.sampler", "unienv_mp.manager", "unienv_mp.queue",
           "unienv_mp.stats", "unienv_mp.errors", "unienv_mp.backend", "unienv_mp.gather",
           "unienv_mp.compat", "unienv_mp.ray")


def public_names():
    """{module: [(name, is_class, documented_at)]}, where ``documented_at`` is the shortest
    public path of the object (the first module of MODULES that exports it)."""
    home, out = {}, {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        rows = []
        for name in module.__all__:
            value = getattr(module, name)
            key = id(value) if inspect.isclass(value) or callable(value) else (module_name, name)
            home.setdefault(key, f"{module_name}.{name}")
            rows.append((name, inspect.isclass(value), home[key]))
        out[module_name] = rows
    return out


def page_of(path):
    """The reference page of a class (its own page) or of another name (its module's)."""
    return path.replace(".", "/") + ".md"


def write():
    nav = mkdocs_gen_files.Nav()
    for module_name, rows in public_names().items():
        module_page = module_name.replace(".", "/") + ".md"
        own = [(n, c) for n, c, at in rows if at == f"{module_name}.{n}"]
        elsewhere = [(n, at) for n, c, at in rows if at != f"{module_name}.{n}"]
        members = [n for n, c in own if not c]
        with mkdocs_gen_files.open(f"reference/{module_page}", "w") as f:
            print(f"# `{module_name}`\n", file=f)
            print(f"::: {module_name}", file=f)
            print("    options:", file=f)
            print("      show_root_heading: false", file=f)
            print(f"      members: {members!r}", file=f)
            classes = [n for n, c in own if c]
            if classes or elsewhere:
                print("\n## Names\n\n| name | documented at |\n|---|---|", file=f)
                for n in classes:
                    print(f"| [`{n}`][{module_name}.{n}] | its own page |", file=f)
                for n, at in elsewhere:
                    print(f"| `{n}` | [`{at}`][{at}] |", file=f)
        nav[tuple(module_name.split("."))] = module_page
        for n, is_class in own:
            if not is_class:
                continue
            path = f"{module_name}.{n}"
            with mkdocs_gen_files.open(f"reference/{page_of(path)}", "w") as f:
                # the object's own heading is the page's title
                print(f"::: {path}\n    options:\n      heading_level: 1", file=f)
            nav[(*module_name.split("."), n)] = page_of(path)
    with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as f:
        f.writelines(nav.build_literate_nav())


write()
