#!/usr/bin/env bash
# Runs one mktest command again and again on the GPU machine and counts how often it passes:
# for an intermittent failure, "N clean runs in a row" is the evidence that it is gone.
#   scripts/gpu-repeat.sh [--times N] [--deadline SECONDS] [--bound SECONDS] [--label NAME] \
#       -- [NAME=VALUE ...] mktest ARGS...
# The command after -- runs with $BIN/mktest for `mktest` (BIN / BIN_TAR as in gpu-bins.sh),
# N times (default 30) or until --deadline seconds have passed, each run bounded by --bound
# seconds (default 240). A run that outlives its bound is a hang the library's bounded waits
# did not stop: before it is killed, cuda-gdb (when the machine has it) attaches and writes
# which kernels, CTAs and warps were still resident, and where, to $OUT/NAME-hang.txt.
# Writes $OUT/NAME.log (every run's output) and a line per run plus the count to the console
# and $OUT/NAME-summary.txt. Exit 0 only when every run passed and at least one ran.
set -uo pipefail
cd "$(dirname "$0")/.."
TIMES=30; DEADLINE=0; BOUND=240; LABEL=repeat
while [ $# -gt 0 ]; do
  case "$1" in
    --times) TIMES="$2"; shift ;;
    --deadline) DEADLINE="$2"; shift ;;
    --bound) BOUND="$2"; shift ;;
    --label) LABEL="$2"; shift ;;
    --) shift; break ;;
    *) echo "gpu-repeat.sh: unknown option $1"; exit 2 ;;
  esac
  shift
done
[ $# -gt 0 ] || { echo "gpu-repeat.sh: no command after --"; exit 2; }
for v in "$TIMES" "$DEADLINE" "$BOUND"; do
  case "$v" in ''|*[!0-9]*) echo "gpu-repeat.sh: --times, --deadline and --bound take whole numbers, not $v"; exit 2 ;; esac
done
. scripts/gpu-bins.sh  # $OUT, $BIN
export CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-EAGER}
cmd=()
for w in "$@"; do [ "$w" = mktest ] && cmd+=("$BIN/mktest") || cmd+=("$w"); done
LOG="$OUT/$LABEL.log"; SUM="$OUT/$LABEL-summary.txt"; HANG="$OUT/$LABEL-hang.txt"
: > "$LOG"; : > "$SUM"
CUDA_GDB=$(command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null || true)
T0=$(date +%s); runs=0; passed=0
while [ "$runs" -lt "$TIMES" ]; do
  if [ "$DEADLINE" != 0 ] && [ $(( DEADLINE - ($(date +%s) - T0) )) -lt $(( BOUND / 4 + 10 )) ]; then
    echo "deadline: stopped before run $((runs + 1))" | tee -a "$SUM"; break
  fi
  runs=$((runs + 1)); t0=$(date +%s)
  echo "===== run $runs: $*" >> "$LOG"
  env "${cmd[@]}" >> "$LOG" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$BOUND" ]; do sleep 1; done
  if kill -0 "$pid" 2>/dev/null; then
    {
      echo "===== run $runs outlived ${BOUND} s"
      nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>&1
      if [ -n "$CUDA_GDB" ]; then
        # The env wrapper's child is the mktest process.
        target=$(pgrep -P "$pid" | head -n 1); target=${target:-$pid}
        timeout 120 "$CUDA_GDB" -p "$target" -batch -ex "info cuda kernels" -ex "info cuda blocks" \
          -ex "info cuda warps" -ex "thread apply all bt 8" 2>&1 | head -n 400
      else
        echo "(no cuda-gdb on this machine)"
      fi
    } >> "$HANG"
    kill -9 "$pid" 2>/dev/null; pkill -9 -P "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null; rc=137
  else
    wait "$pid"; rc=$?
  fi
  [ "$rc" = 0 ] && passed=$((passed + 1))
  echo "run $runs: $(outcome "$rc") in $(( $(date +%s) - t0 )) s" | tee -a "$SUM"
  [ "$rc" = 0 ] || sed -n "/^===== run $runs:/,\$p" "$LOG" | grep -E "FAILED|WRONG|error|did not stop|stopped after" | tail -n 6 | sed 's/^/    /' | tee -a "$SUM"
done
echo "$LABEL: $passed of $runs runs passed ($*)" | tee -a "$SUM"
[ "$runs" -gt 0 ] && [ "$passed" = "$runs" ]
