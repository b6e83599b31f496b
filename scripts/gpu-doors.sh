#!/usr/bin/env bash
# The doors users come in by, on a GPU machine without Rust or Go, from what
# scripts/pack-doors.sh put in one folder (default .carry/doors):
#   1. examples: the C, C++ and Go examples, run by examples/run-examples.sh --require-gpu;
#   2. Python: the wheel installed over the machine's own torch, pytest python/tests (the GPU
#      tests at N = 1, 2, 4 ranks under MPS), then benches/python_overhead.py at 1 and 2 ranks
#      and benches/attention_same_process.py (ring attention against SDPA, fwd and bwd) and
#      benches/moe_same_process.py (the MoE ops against torch._grouped_mm),
#      benches/moe_layer_same_process.py (the whole MoE layer against the torch stack) and
#      benches/fp8_gemm_same_process.py (mkScaledGemm against torch._scaled_mm);
#   3. NCCL: ctests/nccl/gpu.sh with the carried libmkernel-nccl (the nccl-tests-style C
#      suite at N = 1, 2, 4 and the unmodified PyTorch script under LD_PRELOAD).
# Each step has a timeout; logs go to $OUT (default gpu-run-logs): doors.log, and the JSON
# record of python_overhead. Exits 0 only when every step passed; a step that reports
# SKIPPED fails here, since this script exists to run on a GPU; without a GPU it exits 77.
#   scripts/gpu-doors.sh [--dir DIR] [--only "examples python nccl"] [--deadline SECONDS]
#                        [--pytest-k EXPR]   (only the Python tests pytest -k EXPR selects)
# `python` is the two passes `python-tests` (pytest) and `python-benches` (the benches,
# installing the wheel themselves when no test pass did), so the doors split over two
# device calls by name: --only python-tests, then --only "examples python-benches nccl".
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=.carry/doors; ONLY="examples python nccl"; DEADLINE=0; PYTEST_K=""; T0=$(date +%s)
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) DIR=$2; shift ;;
    --only) ONLY=$2; shift ;;
    --deadline) DEADLINE=$2; shift ;;
    --pytest-k) PYTEST_K=$2; shift ;;
    *) echo "gpu-doors.sh: unknown option $1"; exit 2 ;;
  esac
  shift
done
if ! command -v nvidia-smi >/dev/null || ! grep -q GPU <<<"$(nvidia-smi -L 2>/dev/null)"; then
  echo "SKIPPED: the doors need a GPU (none found)"
  exit 77
fi
OUT=${OUT:-gpu-run-logs}
mkdir -p "$OUT"
LOG=$OUT/doors.log
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
[ -f "$DIR/COMMIT" ] && export MK_COMMIT=$(cat "$DIR/COMMIT")
status=0
# The seconds a step may take: its own limit, cut to what --deadline leaves.
limit() {
  [ "$DEADLINE" = 0 ] && { echo "$1"; return; }
  local left=$(( DEADLINE - ($(date +%s) - T0) - 10 ))
  echo $(( $1 < left ? $1 : (left > 1 ? left : 1) ))
}
step() {  # NAME SECONDS COMMAND...
  local name=$1 secs; secs=$(limit "$2"); shift 2
  echo "===== $name (limit ${secs} s)" >> "$LOG"
  local t0; t0=$(date +%s)
  timeout "$secs" "$@" >> "$LOG" 2>&1
  local rc=$?
  local verdict=PASS
  case $rc in 0) ;; 124|137) verdict="TIMEOUT"; status=1 ;; *) verdict="FAIL (exit $rc)"; status=1 ;; esac
  echo "[$(( $(date +%s) - T0 )) s] $name: $verdict in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/doors-summary.txt"
}

. scripts/mps.sh  # rank_env, mps_start, mps_stop
trap mps_stop EXIT

doors=""
for d in $ONLY; do [ "$d" = python ] && d="python-tests python-benches"; doors="$doors $d"; done
ONLY=$doors
site=build/python-test-venv/site  # where test-python.sh installs the wheel
for door in $ONLY; do
  case $door in
    examples)
      mps_start doors
      step examples 180 env LD_LIBRARY_PATH="$DIR/examples/lib:$LD_LIBRARY_PATH" \
        examples/run-examples.sh --require-gpu "$DIR"/examples/bin/*
      mps_stop ;;
    python-tests)
      wheel=$(ls "$DIR"/mkernel-*.whl | head -1)
      mps_start doors
      # -v names each test as it ends; pytest-timeout (in the GPU image) fails a stuck test with
      # its traceback instead of letting the step's timeout kill pytest before its summary.
      step python-tests 900 env MK_PYTHON_TORCH=system MK_PYTHON_WHEEL="$wheel" PYTHONUNBUFFERED=1 \
        scripts/test-python.sh -v --timeout=150 ${PYTEST_K:+-k "$PYTEST_K"}
      mps_stop ;;
    python-benches)
      wheel=$(ls "$DIR"/mkernel-*.whl | head -1)
      [ -d "$site" ] || step python-install 120 python3 -m pip install --quiet --disable-pip-version-check \
        --no-compile --no-deps --target "$site" "$wheel"
      mps_start doors
      if [ -d "$site" ]; then
        step python-overhead-n1 120 env PYTHONPATH="$site" python3 benches/python_overhead.py --json "$OUT/python_overhead-n1.json"
        step python-overhead-n2 120 env $(rank_env 2) PYTHONPATH="$site" python3 -m torch.distributed.run \
          --standalone --nproc-per-node 2 benches/python_overhead.py --json "$OUT/python_overhead-n2.json"
        # Attention at one rank through the package, beside SDPA on the same tensors, fwd and bwd.
        step attention-same-process 300 env PYTHONPATH="$site" python3 benches/attention_same_process.py 8192 16384 32768 \
          --causal 1,0 --backward --rest-ms 1000 --json "$OUT/attention_same_process.json"
        # MoE at one rank through the package, beside torch._grouped_mm, dispatch and combine,
        # from a decode batch (256 tokens) to 16K.
        step moe-same-process 240 env PYTHONPATH="$site" python3 benches/moe_same_process.py 256 4096 16384 \
          --json "$OUT/moe_same_process.json"
        # The whole SwiGLU MoE layer at the three model shapes beside the torch stack in one
        # CUDA graph, its GEMM phases and forward + backward; T 4096 only, to bound the step.
        step moe-layer-same-process 240 env PYTHONPATH="$site" python3 benches/moe_layer_same_process.py 4096 \
          --backward --json "$OUT/moe_layer_same_process.json"
        # The scaled fp8 GEMM beside torch._scaled_mm, per tensor and rowwise, the GEMM
        # table's large shapes and decode rows.
        step fp8-gemm-same-process 300 env PYTHONPATH="$site" python3 benches/fp8_gemm_same_process.py \
          --json "$OUT/fp8_gemm.json"
      fi
      mps_stop ;;
    nccl)
      step nccl 420 env MK_NCCL_SO="$PWD/$DIR/libmkernel_nccl.so" OUT="$OUT/nccl" ctests/nccl/gpu.sh ;;
    *) echo "gpu-doors.sh: unknown door $door"; exit 2 ;;
  esac
done
exit $status
