"""Check what `python -m build` and `auditwheel repair` made, against the source tree.

    python .ci/check_dist.py SDIST WHEEL

Run from the repository root, with the tree checked out by git.  Exits non-zero, saying
why, when:

- the sdist lacks a tracked file, or holds one that is not tracked (besides the metadata
  setuptools writes);
- the wheel does not hold exactly the package's tracked modules, stubs, py.typed and Cython
  sources, one compiled module per .pyx, and the license;
- the wheel's tag is not CPython's (this interpreter's version) with a manylinux platform
  tag for this machine, or its WHEEL file says otherwise;
- the metadata does not carry the version of unienv_mp/__init__.py, the SPDX license and
  the license file, or names a classifier PyPI does not know.
"""
import ast
import email.parser
import os
import platform
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import trove_classifiers

PACKAGE = "unienv_mp"
# setuptools writes these into the sdist; they are not tracked.
SDIST_GENERATED = re.compile(r"^(PKG-INFO|setup\.cfg|unienv_mp\.egg-info/.*)$")
# tracked, but not for users: stays out of the sdist
NOT_IN_SDIST = {".gitignore"}
IN_WHEEL = (".py", ".pyi", ".pyx", ".pxd")

errors = []


def fail(message):
    errors.append(message)


def source_version():
    with open(os.path.join(PACKAGE, "__init__.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "__version__"):
            return ast.literal_eval(node.value)
    raise SystemExit("no __version__ in unienv_mp/__init__.py")


def tracked():
    out = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout
    return {p for p in out.decode().split("\0") if p}


def check_metadata(text, where, version):
    md = email.parser.Parser().parsestr(text)
    expect = {"Name": PACKAGE, "Version": version, "License-Expression": "MIT",
              "License-File": "LICENSE", "Requires-Python": ">=3.10",
              "Description-Content-Type": "text/markdown"}
    for key, value in expect.items():
        if md.get(key) != value:
            fail(f"{where}: {key} is {md.get(key)!r}, expected {value!r}")
    classifiers = md.get_all("Classifier") or []
    unknown = [c for c in classifiers if c not in trove_classifiers.classifiers]
    if unknown:
        fail(f"{where}: classifiers PyPI does not know: {unknown}")
    if any(c.startswith("License ::") for c in classifiers):
        fail(f"{where}: a License classifier beside the SPDX License-Expression")
    for needed in ("Operating System :: POSIX :: Linux",
                   "Programming Language :: Python :: Implementation :: CPython",
                   "Programming Language :: Cython", "Typing :: Typed"):
        if needed not in classifiers:
            fail(f"{where}: classifier {needed!r} missing")
    if not md.get("Keywords"):
        fail(f"{where}: no keywords")
    if not md.get_all("Project-URL"):
        fail(f"{where}: no project URLs")


def check_sdist(path, files, version):
    top = f"{PACKAGE}-{version}/"
    if os.path.basename(path) != f"{PACKAGE}-{version}.tar.gz":
        fail(f"sdist {path}: expected {PACKAGE}-{version}.tar.gz")
    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        names = set()
        for m in members:
            if not m.name.startswith(top):
                fail(f"sdist: {m.name} outside {top}")
                continue
            names.add(m.name[len(top):])
        pkg_info = tar.extractfile(top + "PKG-INFO").read().decode()
    want = files - NOT_IN_SDIST
    missing = sorted(want - names)
    extra = sorted(n for n in names - want if not SDIST_GENERATED.match(n))
    if missing:
        fail(f"sdist lacks tracked files: {missing} (see MANIFEST.in)")
    if extra:
        fail(f"sdist holds files that are not tracked: {extra}")
    check_metadata(pkg_info, "sdist PKG-INFO", version)
    return len(names)


def check_wheel(path, files, version):
    name = os.path.basename(path)
    m = re.fullmatch(rf"{PACKAGE}-{re.escape(version)}-(\w+)-(\w+)-([\w.]+)\.whl", name)
    if not m:
        fail(f"wheel {name}: not {PACKAGE}-{version}-<python>-<abi>-<platform>.whl")
        return None
    py, abi, plats = m.group(1), m.group(2), m.group(3).split(".")
    cp = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if py != cp or abi != cp:
        fail(f"wheel {name}: python and abi tags {py}-{abi}, expected {cp}-{cp}")
    arch = platform.machine()
    for plat in plats:
        if not re.fullmatch(rf"manylinux(_2_\d+|2014)_{arch}", plat):
            fail(f"wheel {name}: platform tag {plat} is not manylinux for {arch}")
    dist_info = f"{PACKAGE}-{version}.dist-info/"
    with zipfile.ZipFile(path) as z:
        names = {n for n in z.namelist() if not n.endswith("/")}
        wheel_file = z.read(dist_info + "WHEEL").decode()
        metadata = z.read(dist_info + "METADATA").decode()
        license_text = z.read(dist_info + "licenses/LICENSE").decode() \
            if dist_info + "licenses/LICENSE" in names else None
    tags = {line.split(":", 1)[1].strip() for line in wheel_file.splitlines()
            if line.startswith("Tag:")}
    if tags != {f"{py}-{abi}-{plat}" for plat in plats}:
        fail(f"wheel {name}: WHEEL says tags {sorted(tags)}")
    if "Root-Is-Purelib: false" not in wheel_file:
        fail(f"wheel {name}: WHEEL does not say Root-Is-Purelib: false")
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    want = {f for f in files if f.startswith(PACKAGE + "/")
            and (f.endswith(IN_WHEEL) or os.path.basename(f) == "py.typed")}
    want |= {f[:-len(".pyx")] + ext for f in files
             if f.startswith(PACKAGE + "/") and f.endswith(".pyx")}
    want |= {dist_info + n for n in ("METADATA", "WHEEL", "RECORD", "top_level.txt",
                                     "licenses/LICENSE")}
    missing, extra = sorted(want - names), sorted(names - want)
    if missing:
        fail(f"wheel lacks: {missing}")
    if extra:
        fail(f"wheel holds more than the package: {extra}")
    with open("LICENSE") as f:
        if license_text != f.read():
            fail("wheel: its licenses/LICENSE is not the repository's LICENSE")
    check_metadata(metadata, "wheel METADATA", version)
    return len(names), plats


def main(argv):
    if len(argv) != 2:
        raise SystemExit(__doc__)
    sdist, wheel = argv
    version = source_version()
    files = tracked()
    n_sdist = check_sdist(sdist, files, version)
    checked = check_wheel(wheel, files, version)
    if errors:
        print("\n".join(f"check_dist: {e}" for e in errors), file=sys.stderr)
        return 1
    n_wheel, plats = checked
    print(f"check_dist: sdist {os.path.basename(sdist)}: {n_sdist} files, as tracked")
    print(f"check_dist: wheel {os.path.basename(wheel)}: {n_wheel} files, "
          f"platform tag {'.'.join(plats)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
