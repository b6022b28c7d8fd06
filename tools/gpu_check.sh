#!/bin/bash
# The GPU checks in one go, on a machine with Python, torch (and what torch itself needs)
# and nothing else to rely on: no network, no other package.
#
# Run it as `tools/gpu_check.sh` (bash), from any folder; PYTHON, WHEELS, SITE and OUT
# below may be set (relative paths are taken from the folder it is started in).
#
# Everything else comes from wheels in $WHEELS (default .gpu/, ignored by git), for the
# machine's Python: NEEDS below is the one list of them.  Before anything is built, each is
# looked for there (a wheel this Python can install, at a version the line allows), else
# among the packages installed already; if any is found in neither, the script stops with
# one line that names them all.  Fetch them where there is a network, e.g. for Python 3.12:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .gpu NAME==VERSION ...
#
# Then: install the wheels into $SITE (default /tmp/site, on PYTHONPATH), build in place,
# the GPU tests, the main job's cuda case (image, 8 workers; state), the device feed's CPU
# tests (the fake device, the fake torch.cuda) and the cuda benchmarks.  Without CUDA the
# GPU steps skip, each saying why.  Each step is under `timeout -k`, stopped with SIGINT
# first, so that pytest prints what it has.  Its seconds: BUILD_S, TESTS_S, IMAGE_S,
# STATE_S, DEVICE_S, PYBENCH_S, 475 in all by default (TOTAL_S), under the device tool's
# 600 s a command; a step may also take what the steps before it left unused (see
# run_step).  Each writes its log under $OUT (default gpu-logs/ in the repository,
# 8 files); 00_steps.txt says when each began, its limit, and how it ended.  Exits 1 if
# any step failed.
ROOT=$(cd "$(dirname "$0")/.." && pwd) || exit 1
# relative paths are taken from where the script is started, before it moves to the root
absolute() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
PYTHON=${PYTHON:-python3}
case $PYTHON in */*) PYTHON=$(absolute "$PYTHON") ;; esac
WHEELS=$(absolute "${WHEELS:-$ROOT/.gpu}")
SITE=$(absolute "${SITE:-/tmp/site}")
OUT=$(absolute "${OUT:-$ROOT/gpu-logs}")
cd "$ROOT" || exit 1

# name, versions allowed, why (the build's and the package's own needs: pyproject.toml)
NEEDS='
numpy>=2.0             build (headers) and run
Cython>=3.0            build
setuptools>=77         build (the SPDX license field)
unienv==0.0.1b16       the samplers wrapped (unienv_data, unienv_interface)
xbarray                unienv
pyvers                 unienv
array-api-compat       xbarray
array-api-extra        xbarray
cloudpickle            unienv_interface imports it
pillow                 unienv
pytest>=8.1            the tests
pluggy>=1.6            pytest
iniconfig>=2           pytest
packaging>=24          pytest
pygments>=2.15         pytest
pytest-benchmark>=5.2  the benchmarks
py-cpuinfo2>=10.1      pytest-benchmark
'

mkdir -p "$OUT" && : > "$OUT"/00_steps.txt \
    || { echo "gpu_check: cannot write the logs in $OUT (set OUT to a folder it may write)"; exit 1; }
export PYTHONUNBUFFERED=1
T0=$(date +%s)
step() { echo "== $1 at $(( $(date +%s) - T0 )) s" >> "$OUT"/00_steps.txt; }

step check
# (prints the wheel files to install, one a line; or one line naming what is missing)
PLAN=$(NEEDS="$NEEDS" WHEELS="$WHEELS" "$PYTHON" - 2>"$OUT"/01_env.txt <<'EOF'
import importlib.metadata as md
import os
import sys

try:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError as e:
    sys.exit(f"gpu_check: {sys.executable} has no pip to install wheels with ({e})")

py = f"{sys.version_info.major}.{sys.version_info.minor}"
folder = os.environ["WHEELS"]
supported = set(sys_tags())
wheels = {}   # name -> [(version, path)] installable here
elsewhere = set()   # names with a wheel there for another Python or machine only
for f in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
    if f.endswith(".whl"):
        try:
            name, version, _, tags = parse_wheel_filename(f)
        except Exception:
            continue
        if tags & supported:
            wheels.setdefault(name, []).append((version, os.path.join(folder, f)))
        else:
            elsewhere.add(name)
missing, plan = [], []
try:
    md.version("torch")
except md.PackageNotFoundError:
    missing.append("torch (install it first: it is never carried as a wheel)")
for line in os.environ["NEEDS"].strip().splitlines():
    req = Requirement(line.split()[0])
    name = canonicalize_name(req.name)
    found = [w for w in wheels.get(name, []) if req.specifier.contains(w[0], prereleases=True)]
    if found:
        version, path = max(found)
        plan.append(path)
        print(f"{req}: {os.path.basename(path)}", file=sys.stderr)
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        have = None
    if have is not None and req.specifier.contains(have, prereleases=True):
        print(f"{req}: {have}, installed here", file=sys.stderr)
        continue
    why = [f"found {have}"] if have else []
    if name in elsewhere and name not in wheels:
        why.append("its wheel there is for another Python or machine")
    elif name in wheels:
        why.append(f"its wheel there is {', '.join(str(v) for v, _ in wheels[name])}")
    missing.append(str(req) + (f" ({'; '.join(why)})" if why else ""))
if missing:
    where = folder + ("/" if os.path.isdir(folder) else " (no such folder)")
    print(f"gpu_check: missing for Python {py}, neither in {where} nor installed: "
          f"{', '.join(missing)}")
    sys.exit(1)
print("\n".join(plan))
EOF
)
rc=$?
if [ $rc != 0 ]; then
    echo "${PLAN:-gpu_check: the check of the wheels failed: $(tail -1 "$OUT"/01_env.txt)}"
    exit 1
fi

step install
mkdir -p "$SITE"
if [ -n "$PLAN" ]; then
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" $PLAN >> "$OUT"/01_env.txt 2>&1 \
        || { echo "gpu_check: installing the wheels failed:"; tail -5 "$OUT"/01_env.txt; exit 1; }
fi
export PYTHONPATH=$SITE:$PWD
CUDA=$("$PYTHON" -c "import torch; print(torch.cuda.is_available())" 2>>"$OUT"/01_env.txt)
{ date -u; nvidia-smi; "$PYTHON" -c "import torch,sys,numpy,Cython;print(sys.version, torch.__version__, torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA', numpy.__version__, Cython.__version__)"; ulimit -l; nproc; free -g; lscpu | head -20; } >> "$OUT"/01_env.txt 2>&1
[ "$CUDA" = True ] || echo "gpu_check: no CUDA here (torch.cuda.is_available() is $CUDA): the GPU steps skip" | tee -a "$OUT"/00_steps.txt

BUILD_S=${BUILD_S:-90}
step build
timeout -s INT -k 10 "$BUILD_S" "$PYTHON" setup.py build_ext --inplace -j "$(nproc)" > "$OUT"/02_build.txt 2>&1 || { echo build failed; tail -40 "$OUT"/02_build.txt; exit 1; }

# Each step may run for its own seconds, or, where the steps before it ended early, for
# what is left of the whole (TOTAL_S, by default the sum of the steps' own) less what the
# steps after it may take: as long as it all runs at worst as before, and a step slowed by
# a busy machine (the device feed's CPU tests, where the GPU steps skipped) has the time.
TESTS_S=${TESTS_S:-140} IMAGE_S=${IMAGE_S:-90} STATE_S=${STATE_S:-40}
DEVICE_S=${DEVICE_S:-70} PYBENCH_S=${PYBENCH_S:-45}
TOTAL_S=${TOTAL_S:-$(( BUILD_S + TESTS_S + IMAGE_S + STATE_S + DEVICE_S + PYBENCH_S ))}
FAILED=0
run_step() {   # name, its own seconds, the seconds of the steps after it, log, command...
    local name=$1 seconds=$2 later=$3 log=$4
    shift 4
    local left=$(( T0 + TOTAL_S - $(date +%s) - later ))
    [ "$left" -gt "$seconds" ] && seconds=$left
    echo "== $name at $(( $(date +%s) - T0 )) s (limit $seconds s)" >> "$OUT"/00_steps.txt
    timeout -s INT -k 10 "$seconds" "$@" > "$OUT/$log" 2>&1
    local rc=$?
    case $rc in
        0) echo "$name rc=0" ;;
        124|137) echo "$name rc=$rc: stopped at its limit of $seconds s (see $log)" ;;
        *) echo "$name rc=$rc: failed (see $log)" ;;
    esac >> "$OUT"/00_steps.txt
    [ $rc = 0 ] || FAILED=1
}
PYTEST=("$PYTHON" -m pytest -p no:cacheprovider -rs -o faulthandler_timeout=60)
run_step tests_cuda "$TESTS_S" $(( IMAGE_S + STATE_S + DEVICE_S + PYBENCH_S )) 03_test_cuda.txt \
    "${PYTEST[@]}" -v tests/test_cuda.py
run_step image "$IMAGE_S" $(( STATE_S + DEVICE_S + PYBENCH_S )) 04_case_image.txt \
    "$PYTHON" -m unienv_mp --case cuda --workers 8 --transitions 8000
run_step state "$STATE_S" $(( DEVICE_S + PYBENCH_S )) 05_case_state.txt \
    "$PYTHON" -m unienv_mp --case cuda --workers 8 --image-shape none --batch-size 32
run_step tests_device "$DEVICE_S" "$PYBENCH_S" 06_test_device.txt \
    "${PYTEST[@]}" -v tests/test_device.py tests/test_device_ops.py
run_step pybench "$PYBENCH_S" 0 07_pybench.txt \
    "${PYTEST[@]}" -q benchmarks/bench_cuda.py --benchmark-max-time=1 --benchmark-columns=min,median,mean,rounds
step end
cat "$OUT"/00_steps.txt
tail -5 "$OUT"/03_test_cuda.txt; cat "$OUT"/04_case_image.txt "$OUT"/05_case_state.txt; tail -3 "$OUT"/06_test_device.txt
exit $FAILED
