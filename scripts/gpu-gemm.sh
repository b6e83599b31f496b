#!/usr/bin/env bash
# The full GPU cycle for the GEMM engine, in one device call: correctness, the
# fusion hooks, the benchmark against cuBLASLt, and the SASS/ptxas checks. Logs go to
# $OUT (or ./gpu-gemm-logs). Build here first (no Rust toolchain on the GPU machine):
#   cargo build --release && scripts/gemm_standalone/build.sh
#   mkdir -p build/gemm_fatbin && cp target/release/build/mkernel-*/out/gemm.{fatbin,ptxas.log} build/gemm_fatbin/
# then run with carry = target/release/mktest target/release/mkbench build/gemm_standalone build/gemm_fatbin.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-gemm-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv \
  | tee "$OUT/gpu.txt"

echo "== mktest gemm"
# Sweep the variants (tile heights and widths, split-K, 2-CTA clusters) only when every
# variant passed its checks.
sweep="--sweep"
timeout 240 ./target/release/mktest gemm > "$OUT/mktest_gemm.log" 2>&1 || { status=1; sweep=""; }
grep -v " -> ok$" "$OUT/mktest_gemm.log" | tail -20

if [ -f build/gemm_standalone/libmkgemm_standalone.so ]; then
  echo "== standalone: fusion hooks"
  timeout 60 python3 scripts/gemm_standalone/check.py --hooks > "$OUT/hooks.log" 2>&1 || status=1
  tail -5 "$OUT/hooks.log"
fi

echo "== mkbench gemm"
timeout 300 ./target/release/mkbench gemm --json "$OUT/mkbench_gemm.json" ${MKBENCH_ARGS-$sweep} 2>&1 | tee "$OUT/mkbench_gemm.log" || status=1

echo "== SASS / ptxas"
if [ -f build/gemm_fatbin/gemm.fatbin ]; then
  echo "HGMMA instructions: $(cuobjdump --dump-sass build/gemm_fatbin/gemm.fatbin | grep -c HGMMA)" | tee "$OUT/sass.txt"
  echo "local-memory instructions (LDL/STL): $(cuobjdump --dump-sass build/gemm_fatbin/gemm.fatbin | grep -cE 'LDL|STL')" | tee -a "$OUT/sass.txt"
  grep -E "spill|registers" build/gemm_fatbin/gemm.ptxas.log | sort | uniq -c | tee -a "$OUT/sass.txt"
fi
exit $status
