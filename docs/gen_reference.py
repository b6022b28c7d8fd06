"""Writes the API reference pages at build time (mkdocs-gen-files runs it): one page per
public module, one page per public class, each name documented once, at its shortest
public path (see docs/public_api.py).  The navigation is ``reference/SUMMARY.md``
(mkdocs-literate-nav)."""
import os
import sys

import mkdocs_gen_files

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from public_api import page_of, public_names  # noqa: E402


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
