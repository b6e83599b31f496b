#!/usr/bin/env bash
# compute-sanitizer audit of the GPU test suites, on the GPU machine, from carried binaries
# (BIN=DIR or BIN_TAR=FILE as scripts/gpu-run.sh takes them). One rank by default (a
# sanitized process cannot be an MPS client here, and rank processes without MPS
# time-slice; --ranks below runs several as threads of one process): every
# `mktest` suite under memcheck (out-of-bounds and misaligned accesses, leaks of device
# memory), then racecheck and synccheck (shared-memory hazards, barriers reached by part of a
# warp or block) on the fused-op suites. Each step has a timeout. Only a clean run is a
# pass: a step that runs out (TIMEOUT), that mktest reports SKIPPED (exit 77) or that fails
# makes the script exit 1; steps left out for the deadline are listed as SKIPPED (deadline)
# and make it exit 3 when nothing failed. Writes $OUT/sanitize.log and
# $OUT/sanitize-summary.txt.
#   scripts/gpu-sanitize.sh [--tools "memcheck racecheck synccheck"] [--suites "..."]
#                           [--ranks N] [--step-timeout 90] [--deadline SECONDS] [--full-size]
# Each suite runs its sanitizer-sized set (MK_TEST_SANITIZE=1, grids of 8 CTAs) unless
# --full-size asks for its whole set.
# --ranks N > 1 runs the fused-op suites of --suites (the others are left out) with their N
# ranks as threads of the one sanitized process (MK_TEST_THREADS=1, each rank's grid capped
# as scripts/mps.sh caps N rank processes, so the ranks' persistent grids are co-resident).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-bins.sh  # $OUT, and $BIN from BIN or BIN_TAR
TOOLS="memcheck racecheck synccheck"; SUITES="smoke collectives api gemm ag_gemm gemm_reduce moe ring_attn ring_attn_bwd mixed"
STEP=90; DEADLINE=0; T0=$(date +%s); SKIPPED_STEPS=0; RANKS=1; FULL_SIZE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --tools) TOOLS="$2"; shift ;;
    --suites) SUITES="$2"; shift ;;
    --ranks) RANKS="$2"; shift ;;
    --step-timeout) STEP="$2"; shift ;;
    --deadline) DEADLINE="$2"; shift ;;
    --full-size) FULL_SIZE=1 ;;
    *) echo "gpu-sanitize.sh: unknown option $1"; exit 2 ;;
  esac
  shift
done
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$SAN" ] || { echo "gpu-sanitize.sh: compute-sanitizer not found"; exit 2; }
case "$RANKS" in ''|*[!0-9]*|0) echo "gpu-sanitize.sh: --ranks takes a positive whole number"; exit 2 ;; esac
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} MK_TEST_NRANKS=$RANKS
# The suites' sanitizer-sized sets (mktest's MK_TEST_SANITIZE: one dtype, at most two rounds,
# the small shapes), with every grid capped at 8 CTAs so those shapes still give each CTA
# several work items; --full-size runs the suites' whole sets and grids instead.
if [ "$FULL_SIZE" = 0 ]; then export MK_TEST_SANITIZE=1 MK_MAX_CTAS=8; fi
if [ "$RANKS" -gt 1 ]; then
  # Only the suites that run their ranks as threads; the others would start rank processes.
  fused=""
  for s in $SUITES; do case " ag_gemm gemm_reduce moe ring_attn ring_attn_bwd mixed " in *" $s "*) fused="$fused $s" ;; esac; done
  SUITES=$fused
  export MK_TEST_THREADS=1
  [ "$FULL_SIZE" = 1 ] && export MK_MAX_CTAS="$(max_ctas_for "$RANKS")"
fi
SUMMARY="$OUT/sanitize-summary.txt"; LOG="$OUT/sanitize.log"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
status=0
for tool in $TOOLS; do
  suites=$SUITES
  # racecheck and synccheck look at shared memory and barriers: the fused kernels' own
  # protocols; the collectives and the plain engine are covered by memcheck.
  [ "$tool" != memcheck ] && suites=$(echo " $SUITES " | sed 's/ smoke / /; s/ collectives / /; s/ api / /; s/ gemm / /')
  for suite in $suites; do
    t=$STEP
    if [ "$DEADLINE" != 0 ]; then
      left=$(( DEADLINE - ($(date +%s) - T0) - 15 ))
      [ "$left" -lt 20 ] && { note "$tool $suite: SKIPPED (deadline)"; SKIPPED_STEPS=$((SKIPPED_STEPS + 1)); continue; }
      [ "$left" -lt "$t" ] && t=$left
    fi
    echo "===== $tool: mktest $suite, $RANKS rank(s)" >> "$LOG"
    s0=$(date +%s)
    # --report-api-errors no: the suites' argument tests hand host pointers to the library,
    # whose cuPointerGetAttribute check then fails as it should (the library checks every
    # driver call's result itself); the tool's job here is the kernels' accesses.
    timeout -k 5 "$t" "$SAN" --tool "$tool" --error-exitcode 86 --print-limit 20 --report-api-errors no \
      $([ "$tool" = memcheck ] && echo --leak-check full) "$BIN/mktest" "$suite" >> "$LOG" 2>&1
    rc=$?
    took=$(( $(date +%s) - s0 ))
    case $rc in
      0) note "$tool $suite: CLEAN (${took} s)" ;;
      86) note "$tool $suite: ERRORS REPORTED (${took} s, see sanitize.log)"; status=1 ;;
      124|137) note "$tool $suite: TIMEOUT after ${t} s (not a pass)"; status=1 ;;
      77) note "$tool $suite: SKIPPED by mktest (exit 77: did not run; not a pass)"; status=1 ;;
      *) note "$tool $suite: mktest FAILED under the tool (exit $rc, ${took} s)"; status=1 ;;
    esac
  done
done
grep -E "ERROR SUMMARY|Invalid|Race|Barrier|Leaked" "$LOG" | sort | uniq -c | sort -rn | head -40 >> "$SUMMARY"
if [ "$SKIPPED_STEPS" -gt 0 ]; then
  note "$SKIPPED_STEPS step(s) SKIPPED (deadline): not run, not passed"
  [ $status = 0 ] && status=3
fi
exit $status
