#!/bin/bash
# The GPU checks in one go, on a machine with CUDA and no network: install the wheels in
# $WHEELS (default .gpu/: unienv, xbarray, pyvers, array-api-compat, array-api-extra, for
# its Python; `pip download --no-deps --only-binary=:all: --python-version 3.12 ...`),
# build in place, then the GPU tests, the main job's cuda case (image, 8 workers; state),
# tests/test_device.py and the cuda benchmarks.  Each step is under `timeout -k` (its
# seconds: BUILD_S, TESTS_S, IMAGE_S, STATE_S, DEVICE_S, PYBENCH_S; 540 in all by default)
# and is stopped with SIGINT first, so that pytest prints what it has; each writes its log
# under $OUT (default ./gpu-logs, 8 files); 00_steps.txt says when each began and how it
# ended.  Exits 1 if any step failed.
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUT"
: > "$OUT"/00_steps.txt
FAILED=0
export PYTHONUNBUFFERED=1
T0=$(date +%s)
step() { echo "== $1 at $(( $(date +%s) - T0 )) s" >> "$OUT"/00_steps.txt; }
step install
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${WHEELS:-.gpu}"/*.whl > "$OUT"/01_env.txt 2>&1 || { cat "$OUT"/01_env.txt; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
{ date -u; nvidia-smi; python3 -c "import torch,sys,numpy,Cython;print(sys.version, torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), numpy.__version__, Cython.__version__)"; ulimit -l; nproc; free -g; lscpu | head -20; } >> "$OUT"/01_env.txt 2>&1
step build
timeout -s INT -k 10 ${BUILD_S:-120} python3 setup.py build_ext --inplace -j 16 > "$OUT"/02_build.txt 2>&1 || { echo build failed; tail -40 "$OUT"/02_build.txt; exit 1; }
step tests_cuda
timeout -s INT -k 10 ${TESTS_S:-180} python3 -m pytest -v -p no:cacheprovider -rs -o faulthandler_timeout=60 tests/test_cuda.py > "$OUT"/03_test_cuda.txt 2>&1
rc=$?; echo "test_cuda rc=$rc" >> "$OUT"/00_steps.txt; [ $rc = 0 ] || FAILED=1
step image
timeout -s INT -k 10 ${IMAGE_S:-90} python3 -m unienv_mp --case cuda --workers 8 --transitions 8000 > "$OUT"/04_case_image.txt 2>&1
rc=$?; echo "image rc=$rc" >> "$OUT"/00_steps.txt; [ $rc = 0 ] || FAILED=1
step state
timeout -s INT -k 10 ${STATE_S:-45} python3 -m unienv_mp --case cuda --workers 8 --image-shape none --batch-size 32 > "$OUT"/05_case_state.txt 2>&1
rc=$?; echo "state rc=$rc" >> "$OUT"/00_steps.txt; [ $rc = 0 ] || FAILED=1
step tests_device
timeout -s INT -k 10 ${DEVICE_S:-60} python3 -m pytest -q -p no:cacheprovider -rs -o faulthandler_timeout=60 tests/test_device.py > "$OUT"/06_test_device.txt 2>&1
rc=$?; echo "test_device rc=$rc" >> "$OUT"/00_steps.txt; [ $rc = 0 ] || FAILED=1
step pybench
timeout -s INT -k 10 ${PYBENCH_S:-45} python3 -m pytest -q -p no:cacheprovider benchmarks/bench_cuda.py --benchmark-max-time=1 --benchmark-columns=min,median,mean,rounds > "$OUT"/07_pybench.txt 2>&1
rc=$?; echo "pybench rc=$rc" >> "$OUT"/00_steps.txt; [ $rc = 0 ] || FAILED=1
step end
cat "$OUT"/00_steps.txt
tail -5 "$OUT"/03_test_cuda.txt; cat "$OUT"/04_case_image.txt "$OUT"/05_case_state.txt; tail -3 "$OUT"/06_test_device.txt
exit $FAILED
