#!/usr/bin/env bash
# check.sh - exhaustive spin verification of models/ring.pml (see models/README.md).
#
#   models/check.sh           full suite (about 5 minutes, up to ~3.5 GB of memory)
#   models/check.sh --quick   the quicker subset that tests/test_model.py runs
#
# For every configuration: spin -a, gcc pan.c, ./pan (full state-space search).  Exits
# non-zero if the correct model has any error or an incomplete search in any
# configuration, or if a deliberately broken variant is NOT reported.
set -u
here=$(cd "$(dirname "$0")" && pwd)
model="$here/ring.pml"
quick=0
[ "${1:-}" = "--quick" ] && quick=1

command -v spin >/dev/null || { echo "check.sh: spin not found (apt-get install -y spin)"; exit 2; }
command -v gcc >/dev/null || { echo "check.sh: gcc not found"; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/ringpml.XXXXXX")
trap 'rm -rf "$work"' EXIT
failures=0
n=0

# run EXPECT MODE NAME FLAGS...
#   EXPECT: pass (no error, complete search) | fail (spin must report an error)
#   MODE:   safety (assertions + invalid end states) | np (non-progress cycles)
run() {
    local expect=$1 mode=$2 name=$3
    shift 3
    n=$((n + 1))
    local d="$work/$n"
    mkdir -p "$d"
    local opt=-O1
    [ "$expect" = fail ] && opt=-O0     # tiny searches: compile time dominates
    cp "$model" "$d/ring.pml"       # spin -t wants the model and its trail side by side
    (
        cd "$d" || exit 1
        spin -a "$@" ring.pml >spin.out 2>&1 || { cat spin.out; exit 1; }
        if [ "$mode" = np ]; then
            gcc $opt -w -DNP -DCOLLAPSE -DMEMLIM=4096 -o pan pan.c || exit 1
            ./pan -l -m20000 >pan.out 2>&1
        else
            gcc $opt -w -DSAFETY -DCOLLAPSE -DMEMLIM=4096 -o pan pan.c || exit 1
            ./pan -m20000 >pan.out 2>&1
        fi
        exit 0
    ) || { echo "FAIL  $name: could not build the verifier"; failures=$((failures + 1)); return; }
    local out="$d/pan.out"
    local errors states trans secs what incomplete=""
    errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$out" | head -1)
    states=$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' "$out" | head -1)
    trans=$(sed -n 's/^ *\([0-9.e+]*\) transitions.*/\1/p' "$out" | head -1)
    secs=$(sed -n 's/^pan: elapsed time \([0-9.e+]*\).*/\1/p' "$out" | head -1)
    what=$(grep -m1 -E '^pan:1: ' "$out" | sed 's/^pan:1: //')
    if grep -qE 'max search depth too small|out of memory|reached -DMEMLIM|Search not completed' "$out"; then
        incomplete="incomplete search: $(grep -m1 -E 'max search depth too small|out of memory|reached -DMEMLIM|Search not completed' "$out")"
    fi
    [ -n "$errors" ] || { incomplete="no result (pan output: $(tail -3 "$out" | tr '\n' ' '))"; errors=0; }
    local verdict
    if [ "$expect" = pass ]; then
        if [ "$errors" = 0 ] && [ -z "$incomplete" ]; then verdict=ok; else verdict=FAIL; fi
    else
        if [ "$errors" != 0 ]; then verdict=ok; else verdict=FAIL; fi
    fi
    printf '%-4s  %-6s %-60s states=%-10s transitions=%-10s errors=%s  (%ss)\n' \
        "$verdict" "$expect" "$name" "${states:-?}" "${trans:-?}" "$errors" "${secs:-?}"
    [ -n "$what" ] && echo "        spin: $what"
    [ -n "$incomplete" ] && [ "$expect" = pass ] && echo "        $incomplete"
    if [ "$verdict" != ok ]; then
        failures=$((failures + 1))
        if [ "$expect" = pass ] && [ "$errors" != 0 ]; then
            # show the counterexample
            (cd "$d" && spin -t -p -g -l "$@" ring.pml 2>&1 | tail -60 | sed 's/^/        /')
        fi
    fi
}

echo "spin: $(spin -V)"
echo "== the protocol as written in csrc/umr_ring.c: every run must end with errors=0"
run pass safety "1P/1C  cap=1  3 items"                          -DCAP=1 -DNP=1 -DNC=1 -DNI=3
run pass safety "1P/1C  cap=2  4 items"                          -DCAP=2 -DNP=1 -DNC=1 -DNI=4
run pass safety "1P/1C  cap=2  4 items, pop_many(2)"             -DCAP=2 -DNP=1 -DNC=1 -DNI=4 -DWANT=2
run pass safety "1P/2C  cap=1  3 items (pops 2+1)"               -DCAP=1 -DNP=1 -DNC=2 -DNI=3
run pass safety "2P/2C  cap=1  1+1 items (pops 1+1)"             -DCAP=1 -DNP=2 -DNC=2 -DNI=1
run pass safety "2P/2C  cap=2  1+1 items (pops 1+1)"             -DCAP=2 -DNP=2 -DNC=2 -DNI=1
run pass safety "1P/1C  cap=1  2 items, shutdown"                -DCAP=1 -DNP=1 -DNC=1 -DNI=2 -DSHUT=1
run pass safety "2P/1C  cap=1  1+1 items, shutdown"              -DCAP=1 -DNP=2 -DNC=1 -DNI=1 -DSHUT=1
run pass safety "2P/1C  cap=2  1+1 items, shutdown"              -DCAP=2 -DNP=2 -DNC=1 -DNI=1 -DSHUT=1
if [ $quick = 0 ]; then
    run pass safety "2P/1C  cap=1  2+2 items"                    -DCAP=1 -DNP=2 -DNC=1 -DNI=2
    run pass safety "2P/1C  cap=2  2+2 items"                    -DCAP=2 -DNP=2 -DNC=1 -DNI=2
    run pass safety "2P/1C  cap=2  2+2 items, pop_many(2)"       -DCAP=2 -DNP=2 -DNC=1 -DNI=2 -DWANT=2
    run pass safety "1P/2C  cap=2  3 items (pops 2+1)"           -DCAP=2 -DNP=1 -DNC=2 -DNI=3
    run pass safety "2P/2C  cap=2  2+1 items (pops 2+1)"         -DCAP=2 -DNP=2 -DNC=2 -DNI=2 -DNI1=1 -DNPOP0=2
    run pass safety "1P/2C  cap=1  2 items, shutdown"            -DCAP=1 -DNP=1 -DNC=2 -DNI=2 -DSHUT=1
    run pass safety "1P/2C  cap=2  2 items, shutdown"            -DCAP=2 -DNP=1 -DNC=2 -DNI=2 -DSHUT=1
    run pass safety "2P/2C  cap=2  1+1 items, shutdown"          -DCAP=2 -DNP=2 -DNC=2 -DNI=1 -DSHUT=1
fi
echo "== no infinite execution at all (non-progress cycles, no progress labels)"
run pass np     "1P/1C  cap=1  3 items"                          -DCAP=1 -DNP=1 -DNC=1 -DNI=3
run pass np     "2P/2C  cap=2  1+1 items"                        -DCAP=2 -DNP=2 -DNC=2 -DNI=1
run pass np     "1P/1C  cap=1  2 items, shutdown"                -DCAP=1 -DNP=1 -DNC=1 -DNI=2 -DSHUT=1
if [ $quick = 0 ]; then
    run pass np "2P/2C  cap=1  1+1 items"                        -DCAP=1 -DNP=2 -DNC=2 -DNI=1
    run pass np "2P/1C  cap=2  1+1 items, shutdown"              -DCAP=2 -DNP=2 -DNC=1 -DNI=1 -DSHUT=1
fi
echo "== sanity: the cycle check does find cycles (CAS weak failing spuriously forever)"
run fail np     "1P/1C  cap=1  1 item, WEAKCAS"                  -DCAP=1 -DNP=1 -DNC=1 -DNI=1 -DWEAKCAS=1
echo "== deliberately broken variants: every run must report an error"
run fail safety "BROKEN=1 notifier loads the word before its store" -DCAP=1 -DNP=1 -DNC=1 -DNI=2 -DBROKEN=1
run fail safety "BROKEN=2 seen loaded after the re-check"        -DCAP=1 -DNP=1 -DNC=1 -DNI=2 -DBROKEN=2
run fail safety "BROKEN=3 sleeps without re-check"               -DCAP=1 -DNP=1 -DNC=1 -DNI=2 -DBROKEN=3
run fail safety "BROKEN=4 undoubled Vyukov seq, cap=1"           -DCAP=1 -DNP=1 -DNC=1 -DNI=2 -DBROKEN=4
run fail safety "BROKEN=5 registers once per blocking call"      -DCAP=1 -DNP=1 -DNC=1 -DNI=2 -DBROKEN=5
run fail safety "BROKEN=6 FUTEX_WAKE of one, 2P/2C cap=2"        -DCAP=2 -DNP=2 -DNC=2 -DNI=1 -DBROKEN=6
run fail safety "BROKEN=1 on 2P/2C cap=2"                        -DCAP=2 -DNP=2 -DNC=2 -DNI=1 -DBROKEN=1
run fail safety "BROKEN=5 on 2P/2C cap=2"                        -DCAP=2 -DNP=2 -DNC=2 -DNI=1 -DBROKEN=5

echo
if [ $failures -ne 0 ]; then
    echo "check.sh: $failures of $n runs FAILED"
    exit 1
fi
echo "check.sh: all $n runs as expected"
