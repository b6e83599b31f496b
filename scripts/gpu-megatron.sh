#!/usr/bin/env bash
# The Megatron proof (docs/megatron.md, "Comparison") on one GPU, from what
# scripts/pack-megatron.sh packed (default .carry/megatron): megatron-core's wheel, the
# mkernel wheel and libmkernel_nccl.so. The GPU machine needs no Rust and no network.
#   1. Installs both wheels offline (pip --no-index --no-deps --target, put first on
#      PYTHONPATH: the machine's python3 is a venv of its own, whose packages a new venv's
#      --system-site-packages would not see) and checks that every requirement they name
#      (torch, numpy, packaging) is met by what the machine has.
#   2. Starts MPS (scripts/mps.sh: each of N rank processes gets 100/N % of the SMs and
#      MK_MAX_CTAS of half that share) and runs examples/megatron/train_gpt.py with torchrun,
#      every rank on GPU 0, torch.distributed's nccl backend served by the carried
#      libmkernel_nccl.so under LD_PRELOAD in standalone mode (MK_NCCL_MODE=standalone: NCCL
#      itself refuses two ranks on one GPU). The model: 4 layers, hidden 1024, 16 heads,
#      sequence 4096, bf16, --steps steps (100), seed and token stream the same in every run:
#        tp-mkernel    mkernel spec, TP=2 with sequence parallelism (saves after K steps)
#        tp-local      local spec, TP=2 (no sequence parallelism: Megatron's torch norm refuses
#                      it without Apex; the same math), saves after K steps
#        dense-local-1 local spec at TP=CP=EP=1, one rank: the CP baseline (the local spec
#                      cannot do CP) and, beside tp-local, the reference the bound comes from
#        cp-mkernel    mkernel spec, CP=2
#        ep-mkernel    mkernel spec, EP=2, 8 experts, top-2 (data-parallel 2 for the dense part)
#        ep-local      local spec, the same (Megatron's allgather dispatcher)
#        ckpt-local-from-mkernel, ckpt-mkernel-from-local: one step of each spec at TP=2 from
#                      the other's checkpoint after K steps, on batch K (K = min(10, steps - 1))
#        moe-local-1   local spec, 8 experts, one rank, micro-batch 2 (the same two sequences
#                      per step as EP=2's two data-parallel ranks): the MoE reference
#   3. benches/megatron_compare.py turns the step lines into the comparison: the bound, each
#      layout's largest loss difference against it, the checkpoint losses, step times side
#      by side, as a record (mkbench/1), a plot and a draft results note.
# Options: --dir DIR (the pack)  --steps N (100; fewer when the time does not fit: say so)
#          --runs "tp reference cp ep checkpoint moe-reference" (groups, in this order by default)
#          --deadline SECONDS (stop starting runs when too little is left; each run's training
#          time is capped at its share of what is left (train_gpt.py --max-seconds), so a slow
#          machine gives every run fewer steps instead of losing the last runs; every cut is
#          printed and recorded)
#          --startup-seconds S (30: a run's expected time outside its steps, for that share, until
#          a run has measured it)
#          --plan (install, check, and check every run's arguments with train_gpt.py --dry-run,
#          print the commands, run nothing on a GPU; works on a CPU machine)
# Output under $OUT (default gpu-megatron-logs; at most 6 files): summary.txt, train.log (every
# run's console), steps.jsonl (train_gpt.py's lines), and from the comparison
# megatron-gpt.json, loss-curves.png, comparison.md. Each run is under `timeout` (torchrun
# stops its workers on SIGTERM; any worker of the run still alive after that is killed by
# its pid), so nothing can hang the call. Exit 0 only when every run passed and the comparison
# found every layout within the bound and the checkpoints interchanged; 1 on a failure, 3
# when runs were skipped for the deadline and nothing failed, 2 for bad options, 77 without
# a GPU (not under --plan).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
T0=$(date +%s)
DIR=.carry/megatron; STEPS=100; RUNS="tp reference cp ep checkpoint moe-reference"; DEADLINE=0; STARTUP=30; PLAN=0
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dir|--steps|--runs|--deadline|--startup-seconds)
      [ $# -ge 2 ] || { echo "gpu-megatron.sh: $1 needs a value"; exit 2; } ;;
  esac
  case "$1" in
    --dir) DIR=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --deadline) DEADLINE=$2; shift ;;
    --startup-seconds) STARTUP=$2; shift ;;
    --plan) PLAN=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu-megatron.sh: unknown option $1 (see --help)"; exit 2 ;;
  esac
  shift
done
for v in "$STEPS" "$DEADLINE" "$STARTUP"; do
  case "$v" in ''|*[!0-9]*) echo "gpu-megatron.sh: --steps, --deadline and --startup-seconds take whole numbers, not $v"; exit 2 ;; esac
done
[ "$STEPS" -ge 2 ] || { echo "gpu-megatron.sh: --steps must be at least 2 (the checkpoint is saved after min(10, steps - 1))"; exit 2; }
for g in $RUNS; do
  case "$g" in tp|reference|cp|ep|checkpoint|moe-reference) ;;
    *) echo "gpu-megatron.sh: unknown run group $g (tp reference cp ep checkpoint moe-reference)"; exit 2 ;; esac
done
[ -d "$DIR" ] || { echo "gpu-megatron.sh: $DIR is missing (scripts/pack-megatron.sh makes it)"; exit 2; }

PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu-megatron-logs}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt; TRAIN_LOG=$OUT/train.log; STEPS_LOG=$OUT/steps.jsonl
: > "$SUMMARY"; : > "$TRAIN_LOG"; : > "$STEPS_LOG"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mk-megatron.XXXXXX")
SITE=$WORK/site; CKPT=$WORK/checkpoints; mkdir -p "$CKPT"
note() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$SUMMARY"; }
status=0; skipped=0

# ---- 1. install and check -------------------------------------------------------------
[ -f "$DIR/COMMIT" ] && MK_COMMIT=$(cat "$DIR/COMMIT") && export MK_COMMIT
wheels=$(ls "$DIR"/megatron_core-*.whl "$DIR"/mkernel-*.whl 2>/dev/null)
nccl_so=$(cd "$DIR" && pwd)/libmkernel_nccl.so
if [ "$(wc -l <<<"$wheels")" != 2 ] || [ ! -f "$nccl_so" ]; then
  note "FAIL: $DIR must hold one megatron_core wheel, one mkernel wheel and libmkernel_nccl.so (scripts/pack-megatron.sh)"; exit 1
fi
# shellcheck disable=SC2086  # one wheel path per word: pack-megatron.sh's names have no spaces
if ! timeout 180 "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
     --target "$SITE" $wheels >> "$TRAIN_LOG" 2>&1; then
  note "FAIL: pip could not install $(echo $wheels | xargs -n1 basename | tr '\n' ' ')into $SITE (train.log; the megatron-core wheel is for CPython 3.12, this is $("$PYTHON" -c 'import platform; print(platform.python_version())'))"
  exit 1
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
PYTHONWARNINGS=ignore timeout 120 "$PYTHON" - 2>&1 <<'PY' | grep -v "warn" | tee -a "$SUMMARY"
# Every requirement of the two wheels (extras aside) met by an installed distribution.
import importlib.metadata as md
import sys

try:
    from packaging.requirements import Requirement
except ImportError:
    sys.exit("requirements not met: megatron-core needs packaging>=24.2: not installed")

problems = []
for dist in ("megatron-core", "mkernel"):
    for text in md.requires(dist) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            problems.append(f"{dist} needs {req}: not installed")
            continue
        if not req.specifier.contains(have, prereleases=True):
            problems.append(f"{dist} needs {req}: {req.name} {have} is installed")
        else:
            print(f"  {dist}: {req} met by {have}")
if problems:
    print("requirements not met:\n  " + "\n  ".join(problems))
    sys.exit(1)
import megatron.core, mkernel  # noqa: E401,E402 -- the installed copies, first on the path

print(f"  megatron-core {md.version('megatron-core')} from {megatron.core.__file__}")
print(f"  mkernel {md.version('mkernel')} from {mkernel.__file__}; python {sys.version.split()[0]}")
PY
if [ "${PIPESTATUS[0]}" != 0 ]; then
  note "FAIL: the carried wheels' requirements are not met, or they do not import (above)"; exit 1
fi
note "installed megatron-core and mkernel into $SITE"

# ---- the runs ----------------------------------------------------------------------------
MODEL=(--layers 4 --hidden 1024 --heads 16 --ffn 4096 --seq 4096 --vocab 32768 --seed 1234 --data markov-copy)
MOE=(--experts 8 --topk 2 --moe-ffn 1024)
K=$(( STEPS - 1 < 10 ? STEPS - 1 : 10 ))
# name | group | ranks | steps | train_gpt.py arguments beyond MODEL
RUN_TABLE="tp-mkernel|tp|2|$STEPS|--spec mkernel --tp 2 --sequence-parallel --save $CKPT/tp-mkernel --save-after $K
tp-local|tp|2|$STEPS|--spec local --tp 2 --save $CKPT/tp-local --save-after $K
dense-local-1|reference|1|$STEPS|--spec local
cp-mkernel|cp|2|$STEPS|--spec mkernel --cp 2
ep-mkernel|ep|2|$STEPS|--spec mkernel --ep 2 ${MOE[*]}
ep-local|ep|2|$STEPS|--spec local --ep 2 ${MOE[*]}
ckpt-local-from-mkernel|checkpoint|2|1|--spec local --tp 2 --load $CKPT/tp-mkernel --first-batch $K
ckpt-mkernel-from-local|checkpoint|2|1|--spec mkernel --tp 2 --sequence-parallel --load $CKPT/tp-local --first-batch $K
moe-local-1|moe-reference|1|$STEPS|--spec local ${MOE[*]} --micro-batch 2"
selected=()
for g in $RUNS; do
  while IFS= read -r line; do
    [ "$(cut -d'|' -f2 <<<"$line")" = "$g" ] && selected+=("$line")
  done <<<"$RUN_TABLE"
done

if [ "$PLAN" = 1 ]; then
  for line in "${selected[@]}"; do
    IFS='|' read -r name group ranks steps extra <<<"$line"
    # shellcheck disable=SC2086  # the table's arguments are words without spaces
    if timeout 120 "$PYTHON" examples/megatron/train_gpt.py "${MODEL[@]}" --steps "$steps" $extra --dry-run >> "$TRAIN_LOG" 2>&1; then
      note "plan $name: torchrun --standalone --nproc-per-node $ranks examples/megatron/train_gpt.py ${MODEL[*]} --steps $steps $extra"
    else
      note "plan $name: FAIL: train_gpt.py refuses its arguments (train.log)"; status=1
    fi
  done
  rm -rf "$WORK"
  exit $status
fi

if ! command -v nvidia-smi >/dev/null || ! grep -q GPU <<<"$(timeout 30 nvidia-smi -L 2>/dev/null)"; then
  note "SKIPPED: the Megatron proof needs a GPU (none found)"; rm -rf "$WORK"; exit 77
fi
{ date -u; timeout 30 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,compute_mode --format=csv; } >> "$SUMMARY"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
. scripts/mps.sh  # rank_env, mps_start, mps_stop
cleanup() { mps_stop; rm -rf "$WORK"; }
trap cleanup EXIT
if mps_start megatron; then note "MPS started"; else note "MPS did not start: the ranks time-slice (step times are not comparable)"; fi

# Preflight: torch.distributed's nccl backend on libmkernel_nccl.so alone, 2 ranks on this GPU
# (ctests/nccl/torch_collectives.py: every collective Megatron uses, checked). Informational:
# where it fails, the runs' own logs say how Megatron fails too.
if [ -f ctests/nccl/torch_collectives.py ]; then
  echo "===== preflight: ctests/nccl/torch_collectives.py, 2 ranks, standalone" >> "$TRAIN_LOG"
  # shellcheck disable=SC2046  # rank_env's NAME=VALUE words
  timeout -k 10 90 env $(rank_env 2) MK_NCCL_MODE=standalone LD_PRELOAD="$nccl_so" "$PYTHON" -m torch.distributed.run \
    --standalone --nproc-per-node 2 ctests/nccl/torch_collectives.py >> "$TRAIN_LOG" 2>&1
  rc=$?
  note "preflight (torch.distributed nccl on libmkernel_nccl.so, 2 ranks): $([ $rc = 0 ] && echo PASS || echo "FAIL (exit $rc)") $(grep -ao 'libmkernel-nccl (world 2): [0-9]* passed, [0-9]* failed' "$TRAIN_LOG" | tail -n 1)"
fi

# The seconds left before --deadline (a large number without one).
left() { [ "$DEADLINE" = 0 ] && echo 100000 || echo $(( DEADLINE - ($(date +%s) - T0) )); }
# "STEPS SECONDS" of a run: the steps it did (its summary line in steps.jsonl, else, when it died
# before writing one, its step lines) and the whole seconds its steps took.
run_stats() {
  timeout 60 "$PYTHON" -c 'import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
mine = [d for d in lines if d.get("run") == sys.argv[2]]
steps = [d for d in mine if not d.get("summary")]
done = next((d["steps_done"] for d in reversed(mine) if d.get("summary")), len(steps))
print(done, int(sum(d["step_s"] for d in steps)))' "$STEPS_LOG" "$1" || echo "0 0"
}
RESERVE=40  # the comparison, MPS shutdown and the summary
MEASURED_STARTUP=""
declare -A DONE_STEPS
for i in "${!selected[@]}"; do
  IFS='|' read -r name group ranks steps extra <<<"${selected[$i]}"
  # The paired local run does no more steps than its mkernel run did.
  case "$name" in
    tp-local) [ -n "${DONE_STEPS[tp-mkernel]:-}" ] && [ "${DONE_STEPS[tp-mkernel]}" -gt 0 ] && steps=${DONE_STEPS[tp-mkernel]} ;;
    ep-local) [ -n "${DONE_STEPS[ep-mkernel]:-}" ] && [ "${DONE_STEPS[ep-mkernel]}" -gt 0 ] && steps=${DONE_STEPS[ep-mkernel]} ;;
  esac
  # The checkpoint check needs the saving run's loss at step K, after the save: K + 1 steps.
  if [ "$name" = tp-local ] && [ "$steps" -le "$K" ]; then
    extra=${extra/ --save $CKPT\/tp-local --save-after $K/}
    note "tp-local: no checkpoint (tp-mkernel did $steps steps, fewer than the $((K + 1)) the check needs)"
  fi
  if [ "$group" = checkpoint ]; then
    from=$(sed -n 's/.*--load \([^ ]*\).*/\1/p' <<<"$extra")
    if [ ! -f "$from.rank0.pt" ]; then
      note "$name: SKIPPED (no checkpoint: $(basename "$from") did not run or stopped before step $K)"; skipped=$((skipped + 1)); continue
    fi
  fi
  # Time for this run: its share of what is left, counting every remaining run's start-up.
  remaining=$(( ${#selected[@]} - i )); training_left=0
  for line in "${selected[@]:$i}"; do [ "$(cut -d'|' -f4 <<<"$line")" -gt 1 ] && training_left=$((training_left + 1)); done
  budget=$(( $(left) - RESERVE ))
  if [ "$budget" -lt $(( STARTUP + 10 )) ]; then
    note "$name: SKIPPED (deadline: ${budget} s left for it)"; skipped=$((skipped + 1)); continue
  fi
  share=$(( (budget - STARTUP * remaining) / (training_left > 0 ? training_left : 1) ))
  [ "$share" -lt 10 ] && share=10
  max_seconds=""; [ "$DEADLINE" != 0 ] && [ "$steps" -gt 1 ] && max_seconds="--max-seconds $share"
  limit=$(( (steps > 1 ? share + STARTUP * 2 : STARTUP * 3) + 30 ))
  [ "$limit" -gt "$budget" ] && limit=$budget
  [ "$limit" -gt 540 ] && [ "$DEADLINE" = 0 ] && limit=540
  echo "===== $name: $ranks rank(s), --steps $steps $extra $max_seconds (limit $limit s)" >> "$TRAIN_LOG"
  t0=$(date +%s)
  # shellcheck disable=SC2046,SC2086  # rank_env's NAME=VALUE words; the table's arguments
  timeout -k 45 "$limit" env $(rank_env "$ranks") MK_NCCL_MODE=standalone LD_PRELOAD="$nccl_so" PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$ranks" \
    examples/megatron/train_gpt.py "${MODEL[@]}" --steps "$steps" $extra $max_seconds \
    --steps-log "$STEPS_LOG" --label "$name" >> "$TRAIN_LOG" 2>&1
  rc=$?
  # torchrun starts each worker in a session of its own: any left (torchrun killed) goes by pid.
  for pid in $(pgrep -f -- "--label $name\$" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
  read -r done_steps step_seconds <<<"$(run_stats "$name")"
  DONE_STEPS[$name]=$done_steps
  # What a run costs beyond its steps (start-up, first-step set-up, teardown), as measured: the
  # largest so far replaces --startup-seconds in the shares of the runs after it.
  outside=$(( $(date +%s) - t0 - step_seconds ))
  if [ "$rc" = 0 ] && [ "$outside" -gt 0 ]; then
    if [ -z "$MEASURED_STARTUP" ] || [ "$outside" -gt "$MEASURED_STARTUP" ]; then MEASURED_STARTUP=$outside; fi
    STARTUP=$MEASURED_STARTUP
  fi
  cut_note=""; [ "${DONE_STEPS[$name]}" -lt "$steps" ] && cut_note=", cut from $steps"
  case $rc in
    0) verdict=PASS ;;
    124|137) verdict=TIMEOUT; status=1 ;;
    *) verdict="FAIL (exit $rc)"; status=1 ;;
  esac
  note "$name: $verdict in $(( $(date +%s) - t0 )) s, ${DONE_STEPS[$name]} step(s)$cut_note ($step_seconds s in steps)"
  if [ "$rc" != 0 ]; then
    sed -n "/^===== $name:/,\$p" "$TRAIN_LOG" | grep -E "Error|error|Traceback|FAILED|refuse|SKIPPED" | tail -n 8 | sed 's/^/    /' | tee -a "$SUMMARY"
    # A crashed client can leave the MPS server unusable for the next run.
    if [ "$MPS" = 1 ]; then mps_stop; mps_start megatron; fi
  fi
done

# ---- 3. the comparison -------------------------------------------------------------------
if [ -s "$STEPS_LOG" ]; then
  command="scripts/gpu-megatron.sh --steps $STEPS"; [ "$DEADLINE" != 0 ] && command="$command --deadline $DEADLINE"
  timeout 120 "$PYTHON" benches/megatron_compare.py "$STEPS_LOG" --out "$OUT" --command "$command" >> "$SUMMARY" 2>&1
  crc=$?
  case $crc in
    0) note "comparison: every layout within the bound, checkpoints interchange" ;;
    3) note "comparison: incomplete (a layout or a checkpoint direction has no runs to compare; comparison.md)"
       [ "$status" = 0 ] && status=3 ;;
    *) note "comparison: FAIL (exit $crc: out of bound, or the comparison itself failed; summary.txt, comparison.md)"; status=1 ;;
  esac
else
  note "comparison: no step was logged"; status=1
fi
if [ "$skipped" -gt 0 ]; then
  note "$skipped run(s) SKIPPED: not a pass"
  [ "$status" = 0 ] && status=3
fi
echo "===== summary"; cat "$SUMMARY"
exit $status
