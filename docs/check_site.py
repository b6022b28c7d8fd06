"""Checks a built site: every public name, and every public method and property of each
public class, has its place in the API reference.

    mkdocs build --strict --site-dir SITE && python docs/check_site.py SITE

(mkdocs' strict build fails on a broken link; this fails on a name left out.)
"""
import glob
import inspect
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from public_api import MODULES, public_names  # noqa: E402


def anchors(site):
    """Every id="unienv_mp...." in the site's reference pages."""
    found = set()
    for page in glob.glob(os.path.join(site, "reference", "**", "*.html"), recursive=True):
        with open(page, encoding="utf-8") as f:
            found.update(re.findall(r'id="(unienv_mp[\w.]*)"', f.read()))
    return found


def expected():
    """The ids the reference must have."""
    import importlib
    want = set()
    for module_name, rows in public_names().items():
        module = importlib.import_module(module_name)
        want.add(module_name)
        for name, is_class, at in rows:
            want.add(at)
            if not is_class:
                continue
            cls = getattr(module, name)
            for klass in cls.__mro__:
                if not klass.__module__.startswith("unienv_mp"):
                    continue
                for member, value in vars(klass).items():
                    if not member.startswith("_") and _documented(value):
                        want.add(f"{at}.{member}")
    return want


def _documented(value):
    """A method or property with a docstring (a class's plain values, such as a
    dataclass's defaults, are documented in its docstring)."""
    if not (inspect.isfunction(value) or hasattr(type(value), "__get__")):
        return False
    return bool(value.__doc__) and value.__doc__ != type(value).__doc__


def main(site):
    missing = sorted(expected() - anchors(site))
    if missing:
        print("the API reference lacks:\n  " + "\n  ".join(missing))
        return 1
    print(f"the API reference has every public name ({len(MODULES)} modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
