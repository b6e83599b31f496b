#!/usr/bin/env bash
# THE GPU cycle, on the GPU machine, from binaries built elsewhere (it has no Rust):
#   cargo build --release     # here
#   scripts/pack-bins.sh      # here: mktest, mkbench and the `make ctest` C tests in one file
#   device run: command "BIN_TAR=.carry/bins.tar.xz scripts/gpu-run.sh", carry [".carry/bins.tar.xz"]
# Starts MPS, runs the mktest suites with 1, 2, 4 and 8 rank processes sharing the GPU
# (each MPS client gets 100/N % of the SMs and an MK_MAX_CTAS that fits in it, so every
# persistent grid is co-resident) — smoke, collectives, api (the C ABI on a live
# communicator), the fused ops (ag_gemm, ag_gemm_fp8, gemm_reduce, gemm_reduce_fp8, moe, ring_attn, ring_attn_bwd)
# and, with one rank, the GEMM engine and the scaled fp8 GEMM; at 2 ranks also the collectives with every message on
# one protocol, and the fused suites with their ranks as threads of one process — then the
# soak (mktest soak: every op in a random
# order with random shapes, 4 ranks under MPS, for --soak-seconds), then the benches:
# collectives (float, and the reductions in every dtype), `mkbench host`, `mkbench gemm`, and the fused ops
# beside their unfused sequences (torch SDPA's records beside ring attention's forward and
# backward); writes logs
# under $OUT (at most 8 files), and stops MPS.
# Then the collectives and the dense fused ops across emulated nodes (mktest nodes: 4 ranks,
# MK_RANKS_PER_NODE=2, MK_NET=socket; its killed-node test without MPS), logged to
# $OUT/nodes.log, and their benches.
# Options: --ranks "1 2 4 8" (tests)  --suites "gemm_reduce ..." (instead of every suite;
#          soak and chaos named there run only in their own steps)
#          --soak-seconds 240 (the soak's duration, 0 leaves it out; it runs when --ranks
#          holds 4, cut to what --deadline leaves)
#          --bench-ranks "1 2 4 8"  --no-tests  --no-bench  --no-gemm  --max-size 1G
#          --gemm-sweep "256x28672x8192 ..." (after `mkbench gemm`: `mkbench gemm --sweep`
#          on these shapes, every tile, split and cluster beside cuBLASLt; how a table row
#          is chosen)
#          --doors DIR (the examples, wheel and libmkernel-nccl that scripts/pack-doors.sh packed,
#          default .carry/doors; run last by scripts/gpu-doors.sh)  --no-doors
#          --no-nodes (skip mktest nodes and its benches)  --only-nodes (only mktest nodes and the
#          emulated-node benches)  --node-ops "all_gather reduce_scatter all_reduce ag_gemm
#          gemm_rs gemm_ar" (which emulated-node benches)
#          BIN=DIR (the binaries' folder, default target/release) or BIN_TAR=FILE (as
#          scripts/pack-bins.sh packs them, for a size-limited copy to the GPU machine)
#          --deadline SECONDS (stop starting steps when fewer than ~30 s of this budget are left,
#          and cut each step's timeout to what is left: for a device call with a time limit;
#          skipped steps are listed as SKIPPED (deadline) and make the exit status 3 when
#          nothing failed)
# Without MPS, beside the collectives' killed rank: mktest chaos at 2 and 4 ranks (of
# --ranks): a rank dies at a random moment of a sequence of ops, the survivors must stop,
# make a new communicator and run verified ops on it.
# Then the C tests that `make ctest` built (test_abi, test_abi_san, test_cxx) against the
# carried libmkernel, on the GPU (their GPU branches run only here), and the cargo tests
# that need a GPU (transport_gpu --ignored), logged to $OUT/ctest.log.
# Every step has a timeout, so nothing here can hang the call. Only exit status 0 is a pass:
# a step that fails, times out (TIMEOUT) or reports SKIPPED (mktest's exit 77: something
# did not run) makes the script exit 1.
# --require-gpu (the default) makes a step that reports SKIPPED a failure (exit 1);
# --allow-skip (a dry run where no GPU is expected) lists such steps and exits 3 instead,
# still never 0. Options are parsed before anything is unpacked or any GPU is probed, so a
# typo fails at once (exit 2) on every machine. The console shows each step as
# [step k, elapsed s] while the logs go to files under $OUT; every bench writes its JSON
# record (docs/benchmarks.md), packed at the end into $OUT/bench-json.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
DEADLINE=0; T0=$(date +%s); SKIPPED_STEPS=0; REQUIRE_GPU=1; STEP=0
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
RANKS="1 2 4 8"; SUITES=""; SOAK_SECONDS=240; NODE_OPS="all_gather reduce_scatter all_reduce ag_gemm gemm_rs gemm_ar"; BENCH_RANKS=""; TESTS=1; BENCH=1; GEMM=1; MAXSIZE=1G; NODES=1; ONLY_NODES=0; NODE_BENCH=1; DOORS=1; DOORS_DIR=.carry/doors; GEMM_SWEEP=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks|--suites|--node-ops|--bench-ranks|--max-size|--deadline|--soak-seconds|--doors|--gemm-sweep)
      [ $# -ge 2 ] || { echo "gpu-run.sh: $1 needs a value"; exit 2; } ;;
  esac
  case "$1" in
    --ranks) RANKS="$2"; shift ;;
    --suites) SUITES="$2"; shift ;;
    --soak-seconds) SOAK_SECONDS="$2"; shift ;;
    --node-ops) NODE_OPS="$2"; shift ;;
    --bench-ranks) BENCH_RANKS="$2"; shift ;;
    --no-tests) TESTS=0 ;;
    --no-bench) BENCH=0; NODE_BENCH=0 ;;
    --no-gemm) GEMM=0 ;;
    --gemm-sweep) GEMM_SWEEP="$2"; shift ;;
    --max-size) MAXSIZE="$2"; shift ;;
    --no-nodes) NODES=0 ;;
    --only-nodes) ONLY_NODES=1; BENCH=0; DOORS=0 ;;
    --doors) DOORS_DIR="$2"; shift ;;
    --no-doors) DOORS=0 ;;
    --deadline) DEADLINE="$2"; shift ;;
    --require-gpu) REQUIRE_GPU=1 ;;
    --allow-skip) REQUIRE_GPU=0 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu-run.sh: unknown option $1 (see --help)"; exit 2 ;;
  esac
  shift
done
for v in "$DEADLINE" "$SOAK_SECONDS"; do case "$v" in ''|*[!0-9]*) echo "gpu-run.sh: --deadline and --soak-seconds take whole seconds, not $v"; exit 2 ;; esac; done
# A suite named in --suites (or every suite when none is).
wants() { [ -z "$SUITES" ] || [[ " $SUITES " == *" $1 "* ]]; }
. scripts/gpu-bins.sh  # $OUT, and $BIN from BIN or BIN_TAR
[ -f "$BIN/COMMIT" ] && export MK_COMMIT=$(cat "$BIN/COMMIT")
JSON_DIR="$OUT/json"; mkdir -p "$JSON_DIR"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# As README advises across nodes: no lazy module load may wait on a resident kernel.
export CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-EAGER}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { STEP=$((STEP + 1)); echo "[step $STEP, $(( $(date +%s) - T0 )) s] $*" | tee -a "$SUMMARY"; }
# A step's exit status into the script's: only 0 passes; 77 (SKIPPED) fails under
# --require-gpu and is counted as skipped under --allow-skip.
check_rc() {
  [ "$1" = 0 ] && return 0
  if [ "$1" = 77 ] && [ "$REQUIRE_GPU" = 0 ]; then SKIPPED_STEPS=$((SKIPPED_STEPS + 1)); else status=1; fi
}
# --deadline: a step's timeout cut to the time left (less a margin for the summary and
# MPS shutdown); `late` is true when too little is left to start a step.
limit() {
  [ "$DEADLINE" = 0 ] && { echo "$1"; return; }
  local left=$(( DEADLINE - ($(date +%s) - T0) - 20 ))
  echo $(( $1 < left ? $1 : (left > 1 ? left : 1) ))
}
late() {
  [ "$DEADLINE" != 0 ] && [ $(( DEADLINE - ($(date +%s) - T0) )) -lt 30 ] || return 1
  note "$*: SKIPPED (deadline)"; SKIPPED_STEPS=$((SKIPPED_STEPS + 1)); return 0
}
status=0
# Every step the options ask for is wanted before its own conditions are tested, and the
# summary must hold a line for each (PASS, FAIL, TIMEOUT or SKIPPED): a step whose gate
# went false without a word shows as NOT RUN at the end and fails the run.
WANTED=()
want() { WANTED+=("$1"); }
# A bench step that passed must have written its JSON record.
has_record() {
  [ "$2" = 0 ] || return 0
  [ -s "$1" ] && return 0
  note "$3: passed but wrote no record ($(basename "$1"))"; status=1
}

{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,compute_mode --format=csv; } | tee -a "$SUMMARY"

# MPS: several rank processes on one GPU run side by side instead of time-slicing.
if mps_start run; then note "MPS started"; else note "MPS did not start: ranks will time-slice"; fi
trap mps_stop EXIT

note "GPU: $SMS SMs; MK_MAX_CTAS per rank at 2, 4, 8 ranks: $(max_ctas_for 2), $(max_ctas_for 4), $(max_ctas_for 8)"


if [ "$TESTS" = 1 ] && [ "$ONLY_NODES" = 0 ]; then
  for n in $RANKS; do
    suites="smoke collectives api ag_gemm ag_gemm_fp8 gemm_reduce gemm_reduce_fp8 moe ring_attn ring_attn_bwd mixed"
    [ "$n" = 1 ] && suites="$suites gemm gemm_fp8"  # the GEMM engine and the scaled fp8 GEMM alone: one-rank suites
    # soak and chaos run in their own steps (below), never in this loop.
    if [ -n "$SUITES" ]; then
      suites=""; for s in $SUITES; do case "$s" in soak|chaos) ;; *) suites="$suites $s" ;; esac; done
      suites=${suites# }
      [ -n "$suites" ] || break
    fi
    want "mktest $suites N=$n"
    late "mktest $suites N=$n" && continue
    echo "===== mktest $suites with $n rank(s)" | tee -a "$OUT/mktest.log"
    t0=$(date +%s)
    # The killed-rank test runs after MPS stops (see below).
    as_ranks "$n" env MK_TEST_KILL=skip timeout "$(limit 480)" "$BIN/mktest" $suites >> "$OUT/mktest.log" 2>&1
    rc=$?
    note "mktest $suites N=$n: $(outcome $rc) in $(( $(date +%s) - t0 )) s"
    check_rc $rc
    grep -E "WRONG|FAILED|SKIPPED|error|stopped after|init/destroy|graph capture|correctness:|in-process|^\[suite" "$OUT/mktest.log" | tail -n 40 | sed "s/^/    /" | tail -n 12
    # A hung or crashed client can leave the MPS server unusable for the next N: restart it.
    if [ "$rc" != 0 ] && [ "$MPS" = 1 ]; then mps_stop; mps_start run; fi
  done
  # The MoE kernels' dedicated-CTA path (MK_COMM_SMS: sender / pull CTAs instead of the
  # GEMM CTAs' own warps), at 2 ranks.
  want "mktest moe MK_COMM_SMS=4 N=2"
  if ! late "mktest moe MK_COMM_SMS=4 N=2"; then
    echo "===== mktest moe with MK_COMM_SMS=4, 2 ranks" | tee -a "$OUT/mktest.log"
    as_ranks 2 env MK_COMM_SMS=4 MK_TEST_KILL=skip timeout "$(limit 120)" "$BIN/mktest" moe >> "$OUT/mktest.log" 2>&1
    rc=$?
    note "mktest moe MK_COMM_SMS=4 N=2: $(outcome $rc)"
    check_rc $rc
  fi
  # The collectives with every message on one protocol, at 2 ranks: 0 sends all of them
  # through the simple one, 4 MiB all but the largest through the low-latency one (several
  # pieces per LL CTA); the default splits at 64 KiB.
  for ll_max in 0 4194304; do
    wants collectives || break
    want "mktest collectives MK_INTERNAL_COLLECTIVE_LL_MAX_BYTES=$ll_max N=2"
    late "mktest collectives MK_INTERNAL_COLLECTIVE_LL_MAX_BYTES=$ll_max N=2" && continue
    echo "===== mktest collectives with MK_INTERNAL_COLLECTIVE_LL_MAX_BYTES=$ll_max, 2 ranks" | tee -a "$OUT/mktest.log"
    as_ranks 2 env MK_INTERNAL_COLLECTIVE_LL_MAX_BYTES="$ll_max" MK_TEST_KILL=skip timeout "$(limit 150)" "$BIN/mktest" collectives >> "$OUT/mktest.log" 2>&1
    rc=$?
    note "mktest collectives MK_INTERNAL_COLLECTIVE_LL_MAX_BYTES=$ll_max N=2: $(outcome $rc)"
    check_rc $rc
  done
  # The fused-op suites with 2 ranks as threads of one process (MK_TEST_THREADS=1): the
  # communicators of one process, whose peers are plain pointers instead of IPC mappings.
  threaded=""
  for s in ag_gemm ag_gemm_fp8 gemm_reduce gemm_reduce_fp8 moe ring_attn ring_attn_bwd mixed; do wants "$s" && threaded="$threaded $s"; done
  [ -n "$threaded" ] && want "mktest$threaded, 2 rank threads"
  if [ -n "$threaded" ] && ! late "mktest$threaded, 2 rank threads"; then
    echo "===== mktest$threaded, 2 ranks as threads of one process" | tee -a "$OUT/mktest.log"
    env MK_TEST_THREADS=1 MK_TEST_NRANKS=2 MK_MAX_CTAS="$(max_ctas_for 2)" MK_TEST_KILL=skip timeout "$(limit 300)" \
      "$BIN/mktest" $threaded >> "$OUT/mktest.log" 2>&1
    rc=$?
    note "mktest$threaded, 2 rank threads: $(outcome $rc)"
    check_rc $rc
  fi
  # Ranks that share one hardware queue stall (docs/decisions/0083): made on purpose here,
  # two rank threads with CUDA_DEVICE_MAX_CONNECTIONS=1, the MoE suite must fail with
  # mkTimeout within its bound (a 4 s timeout: the harness's 4·17/16 + 15 s, and the
  # cases before the stall), never hang. A pass here would mean 0083's account is wrong.
  queue_step="moe, 2 rank threads in one hardware queue, stall made on purpose"
  wants moe && want "$queue_step"
  if wants moe && ! late "$queue_step"; then
    t=$(date +%s)
    env CUDA_DEVICE_MAX_CONNECTIONS=1 MK_TEST_TIMEOUT_MS=4000 MK_TEST_THREADS=1 MK_TEST_NRANKS=2 \
      MK_MAX_CTAS="$(max_ctas_for 2)" MK_TEST_KILL=skip timeout "$(limit 90)" "$BIN/mktest" moe > "$OUT/shared-queue.log" 2>&1
    rc=$?; took=$(( $(date +%s) - t ))
    if [ "$rc" = 1 ] && grep -q "mkTimeout" "$OUT/shared-queue.log" && [ "$took" -le 45 ]; then
      note "$queue_step: PASS (mkTimeout, the suite ended in $took s)"
    else
      note "$queue_step: FAIL (rc $rc in $took s; want rc 1 with mkTimeout within 45 s: shared-queue.log)"; status=1
    fi
  fi
  # GEMM+RS/AR's non-default reducers, when the suite runs: after (every warp of a GEMM
  # CTA sums after its GEMM, no early sums) at 2 ranks.
  for step in "after 2"; do
    read -r mode ranks <<<"$step"
    wants gemm_reduce || break
    want "mktest gemm_reduce MK_INTERNAL_GEMM_REDUCERS=$mode N=$ranks"
    late "mktest gemm_reduce MK_INTERNAL_GEMM_REDUCERS=$mode N=$ranks" && continue
    echo "===== mktest gemm_reduce with MK_INTERNAL_GEMM_REDUCERS=$mode, $ranks ranks" | tee -a "$OUT/mktest.log"
    as_ranks "$ranks" env MK_INTERNAL_GEMM_REDUCERS="$mode" MK_TEST_KILL=skip timeout "$(limit 120)" "$BIN/mktest" gemm_reduce >> "$OUT/mktest.log" 2>&1
    rc=$?
    note "mktest gemm_reduce MK_INTERNAL_GEMM_REDUCERS=$mode N=$ranks: $(outcome $rc)"
    check_rc $rc
  done
fi

if [ "$TESTS" = 1 ] && [ "$ONLY_NODES" = 0 ] && [ "$SOAK_SECONDS" -gt 0 ] && wants soak && [[ " $RANKS " == *" 4 "* ]]; then
  # The soak: every op in a random order with random legal shapes, 4 ranks under MPS. Its
  # duration is cut to what --deadline leaves (start-up, the last call and the summary take
  # well under 2 minutes); the suite's own deadline (ranks::spawn) is the duration + 240 s.
  want "mktest soak N=4"
  soak=$SOAK_SECONDS
  if [ "$DEADLINE" != 0 ]; then
    left=$(( DEADLINE - ($(date +%s) - T0) - 20 - 120 ))
    [ "$left" -lt "$soak" ] && soak=$left
  fi
  if [ "$soak" -lt 30 ]; then
    note "mktest soak N=4: SKIPPED (deadline)"; SKIPPED_STEPS=$((SKIPPED_STEPS + 1))
  else
    echo "===== mktest soak, 4 ranks, MK_SOAK_SECONDS=$soak" | tee -a "$OUT/mktest.log"
    t0=$(date +%s)
    as_ranks 4 env MK_SOAK_SECONDS="$soak" timeout "$(limit $((soak + 300)))" "$BIN/mktest" soak >> "$OUT/mktest.log" 2>&1
    rc=$?
    note "mktest soak N=4 ($soak s, MPS): $(outcome $rc) in $(( $(date +%s) - t0 )) s"
    check_rc $rc
    sed -n '/^===== mktest soak/,$p' "$OUT/mktest.log" | grep -E "soak|calls|WRONG|FAILED|error" | tail -n 16 | sed "s/^/    /"
    if [ "$rc" != 0 ] && [ "$MPS" = 1 ]; then mps_stop; mps_start run; fi
  fi
fi

if [ "$TESTS" = 1 ] && [ "$ONLY_NODES" = 0 ]; then
  # The C tests through the installed header and library, on a machine with a GPU. Under
  # ASan the driver's allocations that live until exit read as leaks, so leak detection
  # stays with the CPU run (make ctest); CUDA needs the shadow gap unprotected.
  for t in test_abi test_abi_san test_cxx; do
    want "ctest $t"
    late "ctest $t" && continue
    if [ ! -x "$CTEST_BIN/$t" ]; then
      note "ctest $t: MISSING from $CTEST_BIN (pack with scripts/pack-bins.sh, which runs make ctest)"; status=1; continue
    fi
    echo "===== ctest $t" >> "$OUT/ctest.log"
    env LD_LIBRARY_PATH="$CTEST_LIB:$LD_LIBRARY_PATH" ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
      timeout "$(limit 120)" "$CTEST_BIN/$t" >> "$OUT/ctest.log" 2>&1
    rc=$?
    note "ctest $t: $(outcome $rc)"
    check_rc $rc
  done
  # The cargo tests that need a GPU (ignored in CI), from the carried test binary.
  if ! late "transport_gpu --ignored"; then
    if [ -x "$BIN/transport_gpu" ]; then
      echo "===== transport_gpu --ignored" >> "$OUT/ctest.log"
      timeout "$(limit 60)" "$BIN/transport_gpu" --ignored >> "$OUT/ctest.log" 2>&1; rc=$?
      note "cargo test transport_gpu --ignored: $(outcome $rc)"
    else
      note "cargo test transport_gpu --ignored: MISSING from $BIN (pack with scripts/pack-bins.sh)"; rc=1
    fi
    check_rc $rc
  fi
fi

if [ "$TESTS" = 1 ] && [ "$ONLY_NODES" = 0 ]; then
  # A rank killed mid-op, without MPS: under MPS the dying client poisons the others'
  # contexts (their next launch fails with an illegal address), which would test MPS, not us.
  mps_stop
  for n in $RANKS; do
    [ "$n" -gt 1 ] || continue
    want "mktest killed rank N=$n"
    late "mktest killed rank N=$n" && continue
    echo "===== mktest collectives, killed rank only, $n rank(s), no MPS" | tee -a "$OUT/mktest.log"
    env MK_TEST_KILL=only MK_TEST_NRANKS="$n" timeout "$(limit 90)" "$BIN/mktest" collectives >> "$OUT/mktest.log" 2>&1
    rc=$?
    note "mktest killed rank N=$n (no MPS): $(outcome $rc)"
    check_rc $rc
    grep -E "killed rank|FAILED" "$OUT/mktest.log" | tail -n 6 | sed "s/^/    /"
  done
  # Chaos, also without MPS: a rank dies at a random moment of a sequence of collectives and
  # fused ops; the survivors stop, make a new communicator and run verified ops on it.
  for n in $RANKS; do
    { [ "$n" = 2 ] || [ "$n" = 4 ]; } && wants chaos || continue
    want "mktest chaos N=$n"
    late "mktest chaos N=$n" && continue
    echo "===== mktest chaos, $n ranks, no MPS" | tee -a "$OUT/mktest.log"
    env MK_TEST_NRANKS="$n" timeout "$(limit 180)" "$BIN/mktest" chaos >> "$OUT/mktest.log" 2>&1
    rc=$?
    note "mktest chaos N=$n (no MPS): $(outcome $rc)"
    check_rc $rc
    grep -E "chaos|FAILED" "$OUT/mktest.log" | tail -n 8 | sed "s/^/    /"
  done
  mps_start run
fi

if [ "$TESTS" = 1 ] && [ "$NODES" = 1 ]; then
  # Across emulated nodes: 4 ranks on the one GPU, two nodes of two, the proxies talking
  # over sockets (the GPU machine has no RDMA device). The suite's own deadline is 240 s
  # (ranks::spawn kills stragglers); timeout is the backstop.
  NODE_ENV="MK_RANKS_PER_NODE=2 MK_NET=socket"
  want "mktest nodes N=4"; want "mktest nodes killed node N=4"
  if ! late "mktest nodes N=4"; then
    echo "===== mktest nodes, 4 ranks, $NODE_ENV" | tee -a "$OUT/nodes.log"
    t0=$(date +%s)
    as_ranks 4 env $NODE_ENV MK_TEST_KILL=skip timeout "$(limit 280)" "$BIN/mktest" nodes >> "$OUT/nodes.log" 2>&1
    rc=$?
    note "mktest nodes N=4 (2 per node, sockets): $(outcome $rc) in $(( $(date +%s) - t0 )) s"
    check_rc $rc
    grep -E "WRONG|FAILED|error|across nodes|graph capture|inter-node|SKIPPED" "$OUT/nodes.log" | tail -n 12 | sed "s/^/    /"
  fi
  # One emulated node killed while the others wait for it, without MPS (see above).
  mps_stop
  if ! late "mktest nodes killed node N=4"; then
    echo "===== mktest nodes, killed node only, 4 ranks, $NODE_ENV, no MPS" | tee -a "$OUT/nodes.log"
    env $NODE_ENV MK_TEST_KILL=only MK_TEST_NRANKS=4 timeout "$(limit 90)" "$BIN/mktest" nodes >> "$OUT/nodes.log" 2>&1
    rc=$?
    note "mktest nodes killed node N=4 (no MPS): $(outcome $rc)"
    check_rc $rc
    grep -E "killed node|FAILED" "$OUT/nodes.log" | tail -n 6 | sed "s/^/    /"
  fi
  mps_start run
fi

if [ "$BENCH" = 1 ]; then
  # The collectives in float from 8 B (5 interleaved blocks of 20 calls, every output
  # element checked), then the reductions in every dtype the library takes, to 16M.
  for n in ${BENCH_RANKS:-$RANKS}; do
    for op in all_gather reduce_scatter all_reduce; do
      lo=8; hi=$MAXSIZE
      [ "$n" -gt 1 ] && hi=256M
      want "mkbench $op -g $n"
      late "mkbench $op -g $n" && continue
      echo "===== mkbench $op -b $lo -e $hi -f 2 -n 20 -w 5 -g $n" >> "$OUT/bench.log"
      as_ranks "$n" timeout "$(limit 150)" "$BIN/mkbench" $op -b $lo -e $hi -f 2 -n 20 -w 5 -g "$n" --json "$JSON_DIR/$op-g$n.json" >> "$OUT/bench.log" 2>&1
      rc=$?
      note "mkbench $op -g $n: $(outcome $rc)"
      check_rc $rc
      has_record "$JSON_DIR/$op-g$n.json" $rc "mkbench $op -g $n"
    done
    for op in reduce_scatter all_reduce; do
      want "mkbench $op --dtype all -g $n"
      late "mkbench $op --dtype all -g $n" && continue
      echo "===== mkbench $op --dtype all -b 8 -e 16M -f 8 -n 20 -w 5 -g $n" >> "$OUT/bench.log"
      as_ranks "$n" timeout "$(limit 150)" "$BIN/mkbench" $op --dtype all -b 8 -e 16M -f 8 -n 20 -w 5 -g "$n" --json "$JSON_DIR/$op-all-dtypes-g$n.json" >> "$OUT/bench.log" 2>&1
      rc=$?
      note "mkbench $op --dtype all -g $n: $(outcome $rc)"
      check_rc $rc
      has_record "$JSON_DIR/$op-all-dtypes-g$n.json" $rc "mkbench $op --dtype all -g $n"
    done
  done
  # Small AllReduces with the ranks as threads of one process (--threads): no start skew
  # between MPS client processes, so this is the latency a one-GPU run can judge.
  for n in ${BENCH_RANKS:-$RANKS}; do
    [ "$n" -gt 1 ] || continue
    want "mkbench all_reduce --threads -g $n"
    late "mkbench all_reduce --threads -g $n" && continue
    echo "===== mkbench all_reduce --threads -b 8 -e 1M -f 2 -n 20 -w 5 -g $n (MK_MAX_CTAS=$(max_ctas_for "$n"))" >> "$OUT/bench.log"
    env MK_MAX_CTAS="$(max_ctas_for "$n")" timeout "$(limit 120)" "$BIN/mkbench" all_reduce --threads -b 8 -e 1M -f 2 -n 20 -w 5 -g "$n" \
      --json "$JSON_DIR/all_reduce-threads-g$n.json" >> "$OUT/bench.log" 2>&1
    rc=$?
    note "mkbench all_reduce --threads -g $n: $(outcome $rc)"
    check_rc $rc
    has_record "$JSON_DIR/all_reduce-threads-g$n.json" $rc "mkbench all_reduce --threads -g $n"
  done
  # The host time of an op call, piece by piece (one rank, a few seconds).
  want "mkbench host"
  if ! late "mkbench host"; then
    echo "===== mkbench host" >> "$OUT/bench.log"
    timeout "$(limit 60)" "$BIN/mkbench" host --json "$JSON_DIR/host.json" >> "$OUT/bench.log" 2>&1; rc=$?
    note "mkbench host: $(outcome $rc)"
    check_rc $rc
    has_record "$JSON_DIR/host.json" $rc "mkbench host"
  fi
  [ "$GEMM" = 1 ] && want "mkbench gemm"
  if [ "$GEMM" = 1 ] && ! late "mkbench gemm"; then
    echo "===== mkbench gemm" | tee -a "$OUT/gemm.log"
    timeout "$(limit 300)" "$BIN/mkbench" gemm --json "$JSON_DIR/gemm.json" >> "$OUT/gemm.log" 2>&1; rc=$?
    tail -n 15 "$OUT/gemm.log"
    note "mkbench gemm: $(outcome $rc)"
    check_rc $rc
    has_record "$JSON_DIR/gemm.json" $rc "mkbench gemm"
  fi
  [ "$GEMM" = 1 ] && [ -n "$GEMM_SWEEP" ] && want "mkbench gemm --sweep"
  if [ "$GEMM" = 1 ] && [ -n "$GEMM_SWEEP" ] && ! late "mkbench gemm --sweep"; then
    shape_args=""
    for shape in $GEMM_SWEEP; do shape_args="$shape_args --shape $shape"; done
    echo "===== mkbench gemm --sweep$shape_args" | tee -a "$OUT/gemm.log"
    timeout "$(limit 300)" "$BIN/mkbench" gemm --sweep $shape_args --json "$JSON_DIR/gemm-sweep.json" >> "$OUT/gemm.log" 2>&1; rc=$?
    tail -n 15 "$OUT/gemm.log"
    note "mkbench gemm --sweep: $(outcome $rc)"
    check_rc $rc
    has_record "$JSON_DIR/gemm-sweep.json" $rc "mkbench gemm --sweep"
  fi
  # The fused ops beside their unfused sequences (mkbench's default shapes; fewer at several
  # ranks, where every rank's GEMM shares the one GPU), in mkbench's default protocol (5
  # interleaved blocks of 20 calls; ring attention's long cases 5 blocks of 5).
  for n in ${BENCH_RANKS:-$RANKS}; do
    for op in ag_gemm ag_gemm_fp8 gemm_rs gemm_ar gemm_rs_fp8 gemm_ar_fp8 moe ring_attn ring_attn_bwd; do
      args="-g $n"; secs=200
      # One rank: against torch SDPA (below) by the same protocol, causal first, each case
      # after 1 s idle: the H200 lowers its clocks under sustained attention, so a case
      # measured after long ones reads slower. The forward alone (its unfused columns equal
      # it there); the backward and forward + backward, S 8K to 32K (a float64 check of
      # sampled rows on the host before each case).
      [ "$op" = ring_attn ] && [ "$n" = 1 ] && args="$args --causal 1,0 --unfused 0 --rest-ms 1000 -w 3 -n 10"
      [ "$op" = ring_attn_bwd ] && [ "$n" = 1 ] && { args="$args --seq 8192,16384,32768 --causal 1,0 --rest-ms 1000 -w 3 -n 10"; secs=360; }
      if [ "$n" -gt 1 ]; then
        case $op in
          ag_gemm|ag_gemm_fp8) args="$args --rows 128,512,2048 --nk 8192x8192" ;;
          gemm_rs|gemm_rs_fp8) args="$args --m 1024,4096" ;;
          gemm_ar|gemm_ar_fp8) args="$args --m 1,16,64,256,2048,8192 --nk 8192x1024" ;;
          moe) args="$args" ;;
          ring_attn) args="$args --seq 16384,32768 -n 5 -w 1" ;;
          ring_attn_bwd) args="$args --seq 8192 --causal 1,0 -n 5 -w 1" ;;
        esac
      fi
      want "mkbench $op -g $n"
      late "mkbench $op -g $n" && continue
      echo "===== mkbench $op $args" | tee -a "$OUT/fused.log"
      as_ranks "$n" timeout "$(limit $secs)" "$BIN/mkbench" $op $args --json "$JSON_DIR/$op-g$n.json" >> "$OUT/fused.log" 2>&1; rc=$?
      note "mkbench $op -g $n: $(outcome $rc)"
      check_rc $rc
      has_record "$JSON_DIR/$op-g$n.json" $rc "mkbench $op -g $n"
      if [ "$op" = ring_attn ] && [ "$n" = 1 ] && python3 -c "import torch" 2>/dev/null; then
        echo "===== sdpa_baseline.py (cuDNN, same protocol)" | tee -a "$OUT/fused.log"
        timeout "$(limit 120)" python3 benches/sdpa_baseline.py 8192 16384 32768 --causal 1,0 --backends cudnn \
          --rest-ms 1000 -w 3 -n 10 --blocks 5 --json "$JSON_DIR/sdpa_baseline.json" >> "$OUT/fused.log" 2>&1 \
          || { note "sdpa_baseline.py: FAILED"; status=1; }
      fi
      if [ "$op" = ring_attn_bwd ] && [ "$n" = 1 ] && python3 -c "import torch" 2>/dev/null && ! late "sdpa_baseline.py --backward"; then
        echo "===== sdpa_baseline.py --backward (cuDNN, flash; same protocol)" | tee -a "$OUT/fused.log"
        timeout "$(limit 240)" python3 benches/sdpa_baseline.py 8192 16384 32768 --causal 1,0 --backward --backends cudnn,flash \
          --rest-ms 1000 -w 3 -n 10 --blocks 5 --json "$JSON_DIR/sdpa_baseline_bwd.json" >> "$OUT/fused.log" 2>&1; rc=$?
        note "sdpa_baseline.py --backward: $(outcome $rc)"
        [ "$rc" = 0 ] || status=1
      fi
      # fp16 rows of the backward at one rank (S 8K and 16K) beside cuDNN's fp16 backward:
      # the attention targets are per dtype.
      if [ "$op" = ring_attn_bwd ] && [ "$n" = 1 ]; then
        fp16_step="mkbench ring_attn_bwd -g 1 --dtype fp16"
        want "$fp16_step"
        if ! late "$fp16_step"; then
          echo "===== $fp16_step" | tee -a "$OUT/fused.log"
          timeout "$(limit 240)" "$BIN/mkbench" ring_attn_bwd -g 1 --dtype fp16 --seq 8192,16384 --causal 1,0 \
            --rest-ms 1000 -w 3 -n 10 --json "$JSON_DIR/ring_attn_bwd-fp16-g1.json" >> "$OUT/fused.log" 2>&1; rc=$?
          note "$fp16_step: $(outcome $rc)"
          check_rc $rc
          has_record "$JSON_DIR/ring_attn_bwd-fp16-g1.json" $rc "$fp16_step"
          if python3 -c "import torch" 2>/dev/null && ! late "sdpa_baseline.py --backward --dtype fp16"; then
            timeout "$(limit 120)" python3 benches/sdpa_baseline.py 8192 16384 --causal 1,0 --backward --dtype fp16 \
              --backends cudnn --rest-ms 1000 -w 3 -n 10 --blocks 5 --json "$JSON_DIR/sdpa_baseline_bwd-fp16.json" \
              >> "$OUT/fused.log" 2>&1; rc=$?
            note "sdpa_baseline.py --backward --dtype fp16: $(outcome $rc)"
            [ "$rc" = 0 ] || status=1
          fi
        fi
      fi
    done
  done
fi

if [ "$NODES" = 1 ] && [ "$NODE_BENCH" = 1 ]; then
  # Across two emulated nodes of two ranks (sockets, staged through host memory): the
  # collectives' bandwidth, and the dense fused ops beside their unfused sequences (our
  # GEMM + the hierarchical collective), each with its parts' times.
  for op in $NODE_OPS; do
    case "$op" in
      all_gather|reduce_scatter|all_reduce) spec="$op -b 1M -e 64M -f 4 -n 10 -w 3" ;;
      ag_gemm) spec="ag_gemm --rows 128,512,2048 --nk 8192x8192 -n 5 -w 2" ;;
      gemm_rs) spec="gemm_rs --m 1024,4096 --nk 8192x1024 -n 5 -w 2" ;;
      gemm_ar) spec="gemm_ar --m 16,256,2048 --nk 8192x1024 -n 5 -w 2" ;;
      *) note "unknown --node-ops entry $op"; status=1; continue ;;
    esac
    want "mkbench $op -g 4 across 2 emulated nodes"
    late "mkbench $op -g 4 across 2 emulated nodes" && continue
    echo "===== mkbench $spec -g 4, MK_RANKS_PER_NODE=2 MK_NET=socket" | tee -a "$OUT/bench.log"
    as_ranks 4 env MK_RANKS_PER_NODE=2 MK_NET=socket timeout "$(limit 120)" "$BIN/mkbench" $spec -g 4 --json "$JSON_DIR/$op-g4-nodes.json" >> "$OUT/bench.log" 2>&1
    rc=$?
    note "mkbench $op -g 4 across 2 emulated nodes: $(outcome $rc)"
    check_rc $rc
  done
fi

mps_stop
[ "$DOORS" = 1 ] && [ "$TESTS" = 1 ] && want "doors (examples, Python, NCCL)"
if [ "$DOORS" = 1 ] && [ "$TESTS" = 1 ] && ! late "doors (examples, Python, NCCL)"; then
  # What users link or import, from what scripts/pack-doors.sh packed (gpu-doors.sh).
  if [ -d "$DOORS_DIR" ]; then
    d_args=(--dir "$DOORS_DIR")
    [ "$DEADLINE" != 0 ] && d_args+=(--deadline "$(limit 100000)")
    OUT="$OUT" scripts/gpu-doors.sh "${d_args[@]}" > "$OUT/doors.console" 2>&1
    rc=$?
    note "doors (examples, Python, NCCL): $(outcome $rc)"
    sed 's/^/    /' "$OUT/doors-summary.txt" 2>/dev/null
    check_rc $rc
  else
    note "doors (examples, Python, NCCL): FAIL: $DOORS_DIR is missing (run scripts/pack-doors.sh first, or pass --no-doors)"
    status=1
  fi
fi
# The one-GPU speed targets as this run's records show them (a report: it gates nothing).
records=$(ls "$JSON_DIR"/*.json "$OUT"/*.json 2>/dev/null)
if [ -n "$records" ] && command -v python3 > /dev/null; then
  # shellcheck disable=SC2086  # one path per word: the run's own file names have no spaces
  if python3 benches/targets.py $records > "$OUT/targets.txt" 2>&1; then
    note "targets: $(tail -n 1 "$OUT/targets.txt" | sed 's/^# //') (targets.txt)"
  else
    note "targets: benches/targets.py failed (targets.txt)"
  fi
fi
if [ -n "$(ls -A "$JSON_DIR" 2>/dev/null)" ]; then
  tar -C "$OUT" -czf "$OUT/bench-json.tar.gz" json && rm -rf "$JSON_DIR"
else
  rmdir "$JSON_DIR" 2>/dev/null
fi
for w in "${WANTED[@]}"; do
  grep -qF -- "] $w" "$SUMMARY" || { note "$w: NOT RUN (asked for; no step ran it or said why)"; status=1; }
done
if [ "$SKIPPED_STEPS" -gt 0 ]; then
  note "$SKIPPED_STEPS step(s) SKIPPED (deadline or --allow-skip): not a pass"
  [ $status = 0 ] && status=3
fi
echo "===== summary"; cat "$SUMMARY"
exit $status
