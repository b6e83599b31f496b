#!/usr/bin/env bash
# libmkernel-nccl on a GPU: exits 77 and prints SKIPPED where there is none.
#  1. ctests/nccl/gpu_collectives.c (nccl-tests style; standalone mode) at N = 1, 2, 4 ranks
#     of one process on GPU 0.
#  2. ctests/nccl/torch_collectives.py, an unmodified torch.distributed program (backend
#     nccl), under LD_PRELOAD: standalone at world size 2 and 4 on GPU 0 (processes under
#     MPS when it starts, each capped to its share of the SMs), and interpose over PyTorch's
#     own libnccl.so.2 at world size 1, where MK_DEBUG=INFO must show the AllReduce calls
#     counted on mkernel.
# Needs target/release/libmkernel_nccl.so (cargo build --release), nccl.h (build/nccl-2.28.9
# from scripts/test-nccl.sh --fetch, else the nvidia-nccl-cu13 wheel PyTorch installed), and
# the CUDA toolkit (nvcc's include/ and lib64/). Logs go to $OUT when set, else build/nccl-tests.
set -uo pipefail
cd "$(dirname "$0")/../.."
if ! command -v nvidia-smi >/dev/null || ! grep -q GPU <<<"$(nvidia-smi -L 2>/dev/null)"; then
  echo "SKIPPED: libmkernel-nccl GPU suite (no GPU on this machine)"
  exit 77
fi
LOGS=${OUT:-build/nccl-tests}
BIN=build/nccl-tests
mkdir -p "$LOGS" "$BIN/lib"
SO=${MK_NCCL_SO:-$PWD/target/release/libmkernel_nccl.so}
[ -f "$SO" ] || { echo "FAILED: $SO is missing (cargo build --release)"; exit 1; }
ln -sf "$SO" "$BIN/lib/libmkernel-nccl.so.2"
ln -sf libmkernel-nccl.so.2 "$BIN/lib/libmkernel-nccl.so"
LIB=$PWD/$BIN/lib
NCCL_INCLUDE=build/nccl-2.28.9/include
[ -f "$NCCL_INCLUDE/nccl.h" ] || NCCL_INCLUDE=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "include"))' 2>/dev/null)
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
echo "nccl.h from $NCCL_INCLUDE ($(grep -m1 'define NCCL_VERSION_CODE' "$NCCL_INCLUDE/nccl.h")); CUDA at $CUDA_HOME"
cc -std=c11 -O2 -Wall -Wextra -Werror -isystem "$CUDA_HOME/include" -isystem "$NCCL_INCLUDE" \
  ctests/nccl/gpu_collectives.c -o "$BIN/gpu_collectives" -L"$LIB" -lmkernel-nccl -Wl,-rpath,"$LIB" \
  -L"$CUDA_HOME/lib64" -lcudart -Wl,-rpath,"$CUDA_HOME/lib64" -lpthread -lm || exit 1

passed=0; failed=0
step() {  # NAME COMMAND...: runs one step, logging to $LOGS/NAME.log
  local name=$1; shift
  echo "===== $name"
  if "$@" >"$LOGS/$name.log" 2>&1; then passed=$((passed + 1)); echo "ok"; else failed=$((failed + 1)); echo "FAILED (rc $?)"; fi
  tail -5 "$LOGS/$name.log"
}

for n in 1 2 4; do
  step "c-standalone-n$n" env MK_NCCL_MODE=standalone MK_DEBUG=WARN "$BIN/gpu_collectives" "$n"
done

. scripts/mps.sh  # as_ranks, mps_start, mps_stop
mps_start nccl; trap mps_stop EXIT
torch_run() {  # WORLD MODE
  local world=$1 mode=$2
  as_ranks "$world" env MK_NCCL_MODE="$mode" MK_DEBUG=INFO LD_PRELOAD="$LIB/libmkernel-nccl.so.2" timeout 300 \
    python3 -m torch.distributed.run --standalone --nproc-per-node "$world" ctests/nccl/torch_collectives.py
}
step torch-standalone-w2 torch_run 2 standalone
step torch-standalone-w4 torch_run 4 standalone
step torch-interpose-w1 torch_run 1 interpose
# Interpose must really route: the destroy line counts AllReduce calls on mkernel.
if grep -q "interpose mode over .*libnccl" "$LOGS/torch-interpose-w1.log" &&
   grep -Eq "calls on mkernel: AllReduce [1-9]" "$LOGS/torch-interpose-w1.log"; then
  passed=$((passed + 1))
else
  failed=$((failed + 1)); echo "FAILED: interpose at world size 1 did not run AllReduce on mkernel (see $LOGS/torch-interpose-w1.log)"
fi
# Seven judged outcomes: the three C runs, the three torch runs and the interpose check.
# A step that died without a verdict (a shell error inside it) counts as a failure.
missing=$(( 7 - passed - failed ))
[ "$missing" -gt 0 ] && { failed=$((failed + missing)); echo "FAILED: $missing step(s) ended without a verdict"; }
echo "libmkernel-nccl GPU suite: $passed passed, $failed failed"
[ "$failed" = 0 ]
