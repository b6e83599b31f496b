#!/usr/bin/env bash
# The fused ops' GPU cycle (tests at N = 1, 2, 4, 8 ranks on one GPU under MPS, then the
# benchmarks), from carried binaries: target/release/mktest, target/release/mkbench.
# Usage: scripts/gpu-fused.sh [suite] [bench-op]   (default: ag_gemm ag_gemm). Logs in $OUT
# (default gpu-fused-logs); BIN=DIR or BIN_TAR=FILE as scripts/gpu-run.sh takes them.
# Only exit status 0 is a pass: a test or bench step that fails, times out (TIMEOUT) or
# reports SKIPPED (mktest's exit 77) makes the script exit 1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-fused-logs}
. scripts/gpu-bins.sh  # $OUT created, $BIN, outcome(), as_ranks, mps_start
SUITE=${1:-ag_gemm}; BENCH=${2-ag_gemm}
B=$BIN
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mps_start fused; trap mps_stop EXIT
status=0
for n in ${RANKS:-1 2 4 8}; do
  echo "===== mktest $SUITE N=$n" | tee -a "$OUT/tests.log"
  as_ranks "$n" timeout ${TEST_TIMEOUT:-150} "$B/mktest" $SUITE >> "$OUT/tests.log" 2>&1; rc=$?
  echo "mktest $SUITE N=$n: $(outcome $rc)" | tee -a "$OUT/summary.txt"; [ $rc = 0 ] || status=1
  grep -E "WRONG|FAILED|correctness:|graph capture:|stopped after|error" "$OUT/tests.log" | tail -n 6
done
if [ -n "$BENCH" ]; then
  echo "===== mkbench $BENCH -g 1" | tee -a "$OUT/bench.log"
  as_ranks 1 timeout 200 "$B/mkbench" "$BENCH" ${BENCH_ARGS1:-} 2>&1 | tee -a "$OUT/bench.log"
  rc=${PIPESTATUS[0]}
  echo "mkbench $BENCH -g 1: $(outcome $rc)" | tee -a "$OUT/summary.txt"; [ $rc = 0 ] || status=1
  for n in ${BENCH_RANKS:-2 4}; do
    echo "===== mkbench $BENCH -g $n" | tee -a "$OUT/bench.log"
    as_ranks "$n" timeout 200 "$B/mkbench" "$BENCH" -g "$n" ${BENCH_ARGSN:-} 2>&1 | tee -a "$OUT/bench.log"
    rc=${PIPESTATUS[0]}
    echo "mkbench $BENCH -g $n: $(outcome $rc)" | tee -a "$OUT/summary.txt"; [ $rc = 0 ] || status=1
  done
fi
exit $status
