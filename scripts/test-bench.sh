#!/usr/bin/env bash
# The benchmark tooling's CPU tests (no GPU needed):
#  1. mkbench's unit tests (protocol statistics, interleaving, record writer, options);
#     the record the Rust writer produces is validated by benches/plot.py --check.
#  2. The schema check accepts the fixtures (benches/fixtures) and refuses records that
#     break one rule each; benches/sdpa_baseline.py's record writer (no torch needed) makes a
#     record the check accepts, with mkbench's statistics.
#  3. plot.py renders the fixtures to PNGs (matplotlib in a venv under target/).
#  4. mkbench refuses a typo before probing a GPU (exit 2) and, without a GPU, says
#     SKIPPED with exit 77.
#  5. gpu-run.sh with fake binaries: a SKIPPED step (exit 77) fails the run by default and
#     exits 3 under --allow-skip, never 0; the same run with passing fakes exits 0; a
#     typo exits 2 before any GPU probe.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "test-bench: FAILED: $*"; exit 1; }

echo "== mkbench unit tests; the Rust writer's record against the schema"
MK_BENCH_SAMPLE="$WORK/sample.json" cargo test --release --bin mkbench -- --test-threads=2
[ -s "$WORK/sample.json" ] || fail "the record test wrote no sample"
python3 benches/plot.py --check "$WORK/sample.json"

echo "== schema: fixtures pass, each broken copy fails with its rule"
python3 benches/plot.py --check benches/fixtures/*.json
python3 - "$WORK" <<'EOF'
import copy, json, subprocess, sys
work = sys.argv[1]
good = json.load(open("benches/fixtures/ag_gemm.json"))
def broken(name, edit, rule):
    rec = copy.deepcopy(good)
    edit(rec)
    path = f"{work}/{name}.json"
    json.dump(rec, open(path, "w"))
    r = subprocess.run([sys.executable, "benches/plot.py", "--check", path], capture_output=True, text=True)
    assert r.returncode != 0, f"{name}: accepted"
    assert rule in r.stderr, f"{name}: {r.stderr!r} does not name {rule!r}"
broken("wrong-schema", lambda r: r.update(schema="mkbench/0"), '"schema" must be')
broken("no-machine-clock", lambda r: r["machine"].pop("sm_clock_mhz"), 'missing key "sm_clock_mhz"')
broken("bad-date", lambda r: r.update(date="yesterday"), "ISO 8601")
broken("p10-above-median", lambda r: r["rows"][0]["contenders"][0].update(p10_us=1e9), "p10_us <= median_us <= p90_us")
broken("twice", lambda r: r["rows"][0]["contenders"].append(r["rows"][0]["contenders"][0]), "appears twice")
broken("no-rows-key", lambda r: r.pop("rows"), 'missing key "rows"')
broken("negative-time", lambda r: r["rows"][1]["contenders"][2].update(median_us=-1.0), "positive")
broken("graph-calls-zero", lambda r: r["rows"][0]["contenders"][-1].update(graph_calls=0), '"graph_calls" is a positive integer')
broken("graph-calls-name", lambda r: r["rows"][0]["contenders"][0].update(graph_calls=10), "is named <x>_graph")
print("schema: 9 broken records refused, each naming its rule")
EOF
python3 - "$WORK" <<'EOF'
import json, subprocess, sys
sys.path.insert(0, "benches")
import sdpa_baseline as s
import bench_record
assert bench_record.stats([5.0, 1.0, 4.0, 2.0, 3.0]) == {"median_us": 3.0, "p10_us": 1.0, "p90_us": 5.0, "min_us": 1.0, "samples": 5}
assert bench_record.stats([4.0, 2.0])["median_us"] == 3.0
rows = [s.row(8192, True, {"cudnn": ([900.0 + i for i in range(50)], [12.0] * 50), "flash": None})]
path = f"{sys.argv[1]}/sdpa.json"
json.dump(s.record(True, {"warmup": 3, "blocks": 5, "iters": 10}, rows), open(path, "w"))
r = subprocess.run([sys.executable, "benches/plot.py", "--check", path], capture_output=True, text=True)
assert r.returncode == 0, r.stderr
rec = json.load(open(path))
assert rec["bench"] == "sdpa_baseline" and rec["rows"][0]["shape"]["seq_per_rank"] == 8192
assert rec["rows"][0]["contenders"][0]["host_enqueue_us"] == 12.0
assert "kv_heads" not in rec["rows"][0]["shape"], "forward rows are keyed as mkbench ring_attn's"
assert rec["rows"][0]["shape"]["dtype"] == "bf16", "bf16 unless told otherwise"
assert s.row(8192, True, {"cudnn": None}, dtype="fp16")["shape"]["dtype"] == "fp16"
try:
    s.row(8192, True, {"cudnn": None}, dtype="bfloat16")
    raise AssertionError("a dtype mkbench does not name is refused")
except ValueError as e:
    assert "bfloat16" in str(e), e
# --backward: two contenders per backend, rows keyed as mkbench ring_attn_bwd's one-rank rows.
samples = ([2000.0 + i for i in range(50)], [30.0] * 50)
rows = [s.row(16384, False, {"cudnn_backward": samples, "cudnn_forward+backward": samples,
                             "flash_backward": None, "flash_forward+backward": None}, 32, 128, 8, "fp16")]
json.dump(s.record(True, {"warmup": 3, "blocks": 5, "iters": 10}, rows, backward=True), open(path, "w"))
r = subprocess.run([sys.executable, "benches/plot.py", "--check", path], capture_output=True, text=True)
assert r.returncode == 0, r.stderr
rec = json.load(open(path))
assert rec["bench"] == "sdpa_baseline_bwd" and "2.5" in rec["config"]["flops"]
assert rec["rows"][0]["shape"] == {"ranks": 1, "seq": 16384, "seq_per_rank": 16384, "heads": 32, "kv_heads": 8,
                                   "dim": 128, "causal": 0, "dtype": "fp16"}
names = [c["name"] for c in rec["rows"][0]["contenders"]]
assert names == ["sdpa_cudnn_backward", "sdpa_cudnn_forward+backward", "sdpa_flash_backward",
                 "sdpa_flash_forward+backward"], names
assert rec["rows"][0]["contenders"][2]["median_us"] is None
for bad, flag in ((["--kv-heads", "8"], "--kv-heads"), (["--kv-heads", "5", "--backward"], "--kv-heads"),
                  (["--dtype", "fp8"], "--dtype")):
    r = subprocess.run([sys.executable, "benches/sdpa_baseline.py", *bad], capture_output=True, text=True)
    assert r.returncode == 2 and flag in r.stderr, (bad, r.returncode, r.stderr)
print("sdpa_baseline.py: its records (forward, --backward) pass the schema check")
EOF

echo "== plot.py renders the fixtures"
VENV=target/bench-venv
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import matplotlib" 2>/dev/null; then
  python3 -m venv "$VENV"
  # A cached wheel folder (.whl) first where there is one, then the package index.
  links=(); [ -d .whl ] && links=(--find-links .whl)
  "$VENV/bin/pip" install -q "${links[@]}" matplotlib
fi
"$VENV/bin/python" benches/plot.py benches/fixtures/*.json -o "$WORK/png" > "$WORK/png.list"
# ag_gemm's speedup plot, all_gather's curves for each of its two dtypes, and a Python
# bench's (moe_same_process: the op under test is each row's mkernel_* contender).
[ "$(wc -l < "$WORK/png.list")" = 4 ] || fail "expected 4 PNGs, got: $(cat "$WORK/png.list")"
while read -r png; do
  [ "$(head -c 8 "$png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || fail "$png is not a PNG"
  [ "$(stat -c %s "$png")" -gt 10000 ] || fail "$png is suspiciously small"
done < "$WORK/png.list"

echo "== plot.py: the op under test per row, the shape keys shared by every row"
python3 - <<'EOF'
import sys
sys.path.insert(0, "benches")
import plot
assert plot._under_test([{"fused": 1, "x": 2}, {"x": 3}]) == ["fused", "fused"]
assert plot._under_test([{"mk": 1, "cublaslt": 2}]) == ["mk"]
assert plot._under_test([{"mkernel_dispatch_gemm": 1, "t": 2}, {"mkernel_gemm_combine": 1, "t": 2}, {"t": 1}]) == [
    "mkernel_dispatch_gemm", "mkernel_gemm_combine", None]
rows = [{"shape": {"a": 1, "b": 2}}, {"shape": {"a": 1, "b": 3}}]
assert plot._constant_keys(rows) == {"a"}
assert plot._constant_keys(rows[:1]) == set()
EOF

echo "== targets.py: met, missed and not measured, from records made here and from stored ones"
python3 - <<'EOF'
import sys
sys.path.insert(0, "benches")
import targets

def c(name, us, host=None):
    return {"name": name, "median_us": us, "host_enqueue_us": host}

def rec(bench, rows, config=None):
    return {"bench": bench, "config": config or {}, "machine": {"gpu": "G"}, "rows": rows}

gemm = rec("gemm", [
    {"shape": {"m": 1, "n": 8192, "k": 8192}, "contenders": [c("mk", 10.0, 4.0), c("cublaslt", 10.5)]},
    {"shape": {"m": 512, "n": 8192, "k": 8192}, "contenders": [c("mk", 10.0, 4.0), c("cublaslt", 9.0)]},
])
ar = rec("all_reduce", [
    {"shape": {"bytes": 8}, "contenders": [c("out_of_place", 7.0, 4.0), c("out_of_place_graph", 3.0)]},
    {"shape": {"bytes": 1 << 20}, "contenders": [c("out_of_place", 20.0, 4.0)]},
], {"ranks": 2, "ranks_as": "processes"})
gar = rec("gemm_ar", [{"shape": {"ranks": 2, "m": 1, "n": 8, "k": 8}, "contenders": [c("fused", 16.0, 6.0), c("cublaslt", 10.0)]}])
v = {x["target"].split()[0]: x["met"] for x in targets.judge([gemm, ar, gar])}
assert v == {"gemm_decode": True, "gemm_table": False, "host_per_call": False, "all_reduce_latency": True,
             "gemm_ar_small_m": False, "moe_vs_grouped_mm": None, "moe_layer": None, "fp8_gemm_large": None,
             "fp8_gemm_decode": None,
             "attention_fwd": None, "attention_bwd": None, "attention_fwd_bwd": None}, v
moe = rec("moe_same_process", [{"shape": {"tokens": 4096, "direction": "dispatch"},
                                "contenders": [c("mkernel_dispatch_gemm", 9.0), c("torch_grouped_mm", 10.0)]}])
assert targets.moe_vs_grouped_mm([moe])["met"] is True
# The layer bench: its layer rows judge moe_layer (the graph-captured stack's time / mkernel's),
# its phase rows join moe_vs_grouped_mm, its fwd+bwd rows are reported without a check.
def layer_row(model, tokens, direction, contenders):
    return {"shape": {"ranks": 1, "model": model, "tokens": tokens, "direction": direction},
            "contenders": [c(n, us) for n, us in contenders]}
layer_pass = rec("moe_layer_same_process", [
    layer_row("deepseek-v3", 4096, "layer", [("mkernel_moe_layer", 9.0), ("torch_stack_graph", 10.0), ("torch_stack", 12.0)]),
    layer_row("mixtral-8x7b", 16384, "layer", [("mkernel_moe_layer", 20.0), ("torch_stack_graph", 20.0)]),
    layer_row("deepseek-v3", 4096, "dispatch", [("mkernel_dispatch_gemm", 5.0), ("torch_grouped_mm", 6.0)]),
    layer_row("deepseek-v3", 4096, "combine", [("mkernel_gemm_combine", 4.0), ("torch_grouped_mm", 4.0)]),
    layer_row("deepseek-v3", 4096, "fwd+bwd", [("mkernel_moe_layer_fwd_bwd", 40.0), ("torch_stack_fwd_bwd", 30.0)]),
    layer_row("deepseek-v3", 256, "layer", [("mkernel_moe_layer", 9.0), ("torch_stack_graph", 1.0)]),
])
v = targets.moe_layer([layer_pass])
assert v["met"] is True, v
assert any("deepseek-v3 T 4096: 1.11 x" in line for line in v["lines"]), v["lines"]
assert any("forward + backward (no target): 0.75 x" in line for line in v["lines"]), "fwd+bwd is reported, not judged"
assert not any("T 256" in line for line in v["lines"]), "T outside {4096, 16384} is not judged"
assert targets.moe_vs_grouped_mm([layer_pass])["met"] is True
assert targets.moe_vs_grouped_mm([moe, layer_pass])["lines"][1] == "G deepseek-v3 4096 tokens dispatch: 1.20 x torch._grouped_mm"
layer_miss = rec("moe_layer_same_process", [
    layer_row("qwen3-235b", 16384, "layer", [("mkernel_moe_layer", 11.0), ("torch_stack_graph", 10.0)]),
    layer_row("qwen3-235b", 16384, "combine", [("mkernel_gemm_combine", 4.2), ("torch_grouped_mm", 4.0)]),
])
assert targets.moe_layer([layer_pass, layer_miss])["met"] is False, "0.91 x on qwen3-235b"
assert targets.moe_vs_grouped_mm([layer_miss])["met"] is False, "the combine at 0.95 x grouped_mm"
# Without the graph's time (its capture failed) the layer row speaks to nothing.
no_graph = rec("moe_layer_same_process", [layer_row("qwen3-235b", 4096, "layer", [("mkernel_moe_layer", 11.0),
                                                                                  ("torch_stack_graph", None)])])
assert targets.moe_layer([no_graph])["met"] is None
fp8 = rec("fp8_gemm", [
    {"shape": {"m": 4096, "n": 4096, "k": 4096, "mode": "tensor"},
     "contenders": [c("mkernel_scaled_gemm", 100.0), c("torch_scaled_mm", 110.0)]},
    {"shape": {"m": 8192, "n": 8192, "k": 8192, "mode": "tensor"},
     "contenders": [c("mkernel_scaled_gemm", 800.0), c("torch_scaled_mm", 760.0)]},
    {"shape": {"m": 1, "n": 8192, "k": 8192, "mode": "rowwise"},
     "contenders": [c("mkernel_scaled_gemm", 10.0), c("torch_scaled_mm", 9.0)]},
])
assert targets.fp8_gemm_large([fp8])["met"] is True, "geomean of 1.10 and 0.95"
assert targets.fp8_gemm_decode([fp8])["met"] is False, "0.90 on a decode row"
def attn(bench, contenders, date="d1", gpu="G", kv=32, ranks=1, dtype=None):
    shape = {"ranks": ranks, "seq": 8192, "heads": 32, "kv_heads": kv, "dim": 128, "causal": 1}
    if bench in ("ring_attn", "sdpa_baseline"):
        del shape["kv_heads"]  # the forward rows carry no kv_heads
    if dtype:
        shape["dtype"] = dtype  # older records' rows carry none
    return {"bench": bench, "date": date, "config": {}, "machine": {"gpu": gpu},
            "rows": [{"shape": shape, "contenders": [c(n, us) for n, us in contenders]}]}

fwd = [attn("ring_attn", [("fused", 100.0)]), attn("sdpa_baseline", [("sdpa_cudnn", 101.0)])]
assert targets.attention_fwd(fwd)["met"] is True, "1.01 x cuDNN"
# cuDNN's row of another GPU, or of another rank count of ours, pairs with nothing.
assert targets.attention_fwd([fwd[0], attn("sdpa_baseline", [("sdpa_cudnn", 101.0)], gpu="H")])["met"] is None
assert targets.attention_fwd([attn("ring_attn", [("fused", 100.0)], ranks=2), fwd[1]])["met"] is None
# The same day's cuDNN row is the one paired, whatever order the records come in.
bwd = [attn("sdpa_baseline_bwd", [("sdpa_cudnn_backward", 90.0), ("sdpa_cudnn_forward+backward", 200.0)], "d2"),
       attn("ring_attn_bwd", [("fused", 100.0), ("forward+backward", 100.0)], "d1"),
       attn("sdpa_baseline_bwd", [("sdpa_cudnn_backward", 96.0), ("sdpa_cudnn_forward+backward", 90.0)], "d1")]
assert targets.attention_bwd(bwd)["met"] is True, "0.96 x on d1 (0.90 on d2 is another day)"
assert targets.attention_fwd_bwd(bwd)["met"] is False, "0.90 x on d1"
# Grouped-query rows pair only with cuDNN's grouped-query rows.
assert targets.attention_bwd([attn("ring_attn_bwd", [("fused", 100.0)], kv=8), bwd[2]])["met"] is None
# fp16 rows pair only with fp16 rows; a row without a dtype is bf16.
assert targets.attention_fwd([attn("ring_attn", [("fused", 100.0)], dtype="fp16"), fwd[1]])["met"] is None
assert targets.attention_fwd([attn("ring_attn", [("fused", 100.0)], dtype="bf16"), fwd[1]])["met"] is True
fp16 = [attn("ring_attn", [("fused", 100.0)], dtype="fp16"), attn("sdpa_baseline", [("sdpa_cudnn", 90.0)], dtype="fp16")]
assert targets.attention_fwd(fp16 + fwd)["met"] is False, "fp16 0.90 x pairs apart from bf16's 1.01 x"
assert "NOT MEASURED" in targets.report(targets.judge([]))
EOF
out=$(python3 benches/targets.py benches/results/2026-12-05-h200-moe-gemm-rows/*.json) || fail "targets.py on the stored records"
grep -q "measured targets met" <<< "$out" || fail "targets.py printed no summary: $out"

echo "== mkbench: a typo fails before the GPU probe; no GPU is SKIPPED (77), not OK"
cargo build --release --bin mkbench
for op in all_gather ag_gemm ag_gemm_fp8 gemm_rs gemm_ar gemm_rs_fp8 gemm_ar_fp8 moe ring_attn ring_attn_bwd gemm host; do
  set +e; ./target/release/mkbench "$op" --no-such-option 1 > "$WORK/out" 2>&1; rc=$?; set -e
  [ $rc = 2 ] || fail "mkbench $op --no-such-option exited $rc, not 2: $(cat "$WORK/out")"
  grep -q -- "--no-such-option" "$WORK/out" || fail "mkbench $op: the message does not name the option"
  grep -q -- "--json" <<<"$(./target/release/mkbench "$op" --help)" || fail "mkbench $op --help"
done
set +e; ./target/release/mkbench all_reduce --dtype fp8 > "$WORK/out" 2>&1; rc=$?; set -e
[ $rc = 2 ] && grep -q -- "--dtype" "$WORK/out" || fail "mkbench all_reduce --dtype fp8 exited $rc: $(cat "$WORK/out")"
if ./target/release/mkbench all_gather -b 8 -e 8 > "$WORK/out" 2>&1; then
  grep -q "^OK" "$WORK/out" || fail "mkbench exited 0 without saying OK"
else
  rc=$?
  [ $rc = 77 ] && grep -q "^SKIPPED" "$WORK/out" || fail "mkbench all_gather exited $rc: $(cat "$WORK/out")"
fi

echo "== gpu-run.sh with fake binaries: skip is not pass"
fake() {  # fake DIR EXIT [RECORD]: binaries that print what they are and exit EXIT, writing
          # the file after --json (an empty record) when RECORD is 1
  mkdir -p "$1/ctests"
  for b in mktest mkbench transport_gpu ctests/test_abi ctests/test_abi_san ctests/test_cxx; do
    printf '#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = --json ] && [ "%s" = 1 ] && echo "{}" > "$2"; shift; done\necho "fake %s: SKIPPED or run, exit %s"\nexit %s\n' \
      "${3:-1}" "$b" "$2" "$2" > "$1/$b"
    chmod +x "$1/$b"
  done
  # As the real one: ranks in one hardware queue stall into mkTimeout (gpu-run.sh's step).
  sed -i '1a [ "${CUDA_DEVICE_MAX_CONNECTIONS:-}" = 1 ] \&\& { echo "fake mktest: mkTimeout"; exit 1; }' "$1/mktest"
  tar -C "$1" -cJf "$1.tar.xz" .
}
run_fake() {  # EXIT ARGS...: gpu-run.sh's exit status on fakes that exit EXIT (FAKE_RECORD=0: no records)
  local code=$1; shift
  rm -rf "$WORK/fake" "$WORK/out"
  fake "$WORK/fake" "$code" "${FAKE_RECORD:-1}"
  set +e
  env PATH="/usr/bin:/bin" OUT="$WORK/out" BIN_TAR="$WORK/fake.tar.xz" timeout 120 bash scripts/gpu-run.sh "$@" > "$WORK/log" 2>&1
  local rc=$?
  set -e
  echo "$rc"
}
FAST="--ranks 1 --no-bench --no-nodes --no-doors"
rc=$(run_fake 77 $FAST); [ "$rc" = 1 ] || fail "skipped suites under --require-gpu (default) exited $rc, not 1"
grep -q "SKIPPED" "$WORK/out/summary.txt" || fail "the summary does not say SKIPPED"
rc=$(run_fake 77 $FAST --require-gpu); [ "$rc" = 1 ] || fail "--require-gpu: exited $rc, not 1"
rc=$(run_fake 77 $FAST --allow-skip); [ "$rc" = 3 ] || fail "--allow-skip: skipped steps exited $rc, not 3"
rc=$(run_fake 0 $FAST); [ "$rc" = 0 ] || fail "passing fakes exited $rc, not 0: $(tail -5 "$WORK/log")"
grep -qF "in one hardware queue, stall made on purpose: PASS" "$WORK/out/summary.txt" || fail "no PASS for the one-queue stall step"
grep -q "\[step 1, " "$WORK/log" || fail "no progress line on the console"
rc=$(run_fake 77 --no-tests --no-nodes --ranks 1); [ "$rc" = 1 ] || fail "skipped benches exited $rc, not 1"
BENCH_ONLY="--no-tests --no-nodes --no-doors --ranks 1"
rc=$(run_fake 0 $BENCH_ONLY); [ "$rc" = 0 ] || fail "passing benches with records exited $rc, not 0: $(tail -5 "$WORK/log")"
for step in "mkbench host" "mkbench gemm" "mkbench moe -g 1"; do
  grep -qF "] $step: PASS" "$WORK/out/summary.txt" || fail "the bench run has no PASS line for $step"
done
rc=$(FAKE_RECORD=0 run_fake 0 $BENCH_ONLY); [ "$rc" = 1 ] || fail "benches that wrote no record exited $rc, not 1"
grep -q "passed but wrote no record" "$WORK/out/summary.txt" || fail "the summary does not name the missing records"
echo "== no pipeline into grep -q in the scripts (under pipefail a producer's SIGPIPE or usage exit reads as no match)"
if hits=$(grep -rnE '\|[[:space:]]*grep[[:space:]]+(-[a-zA-Z]*q|--quiet)' scripts ctests examples bindings --include='*.sh' | grep -vE ':[0-9]+:[[:space:]]*#'); then
  fail "pipelines into grep -q: $hits"
fi
rc=$(run_fake 0 --ranks 1 --no-bench --no-nodes --doors "$WORK/nowhere"); [ "$rc" = 1 ] || fail "missing doors exited $rc, not 1"
rc=$(run_fake 0 $FAST --bogus); [ "$rc" = 2 ] || fail "a typo exited $rc, not 2"
grep -q "MPS\|nvidia-smi" "$WORK/log" && fail "a typo reached the GPU probe"
rc=$(run_fake 0 $FAST --deadline); [ "$rc" = 2 ] || fail "--deadline without a value exited $rc, not 2"
echo "== attention_same_process.py, moe_same_process.py, moe_layer_same_process.py, fp8_gemm_same_process.py: their records (built without torch) pass the schema check"
python3 - "$WORK" <<'PY'
import json, subprocess, sys
sys.path.insert(0, "benches")
import attention_same_process as a
import bench_record
timed = ([2000.0 + i for i in range(50)], [15.0] * 50)
rows = [a.row(8192, 32, 8, True, d, {"mkernel": timed, "sdpa_cudnn": timed, "sdpa_flash": None}, {"mkernel": 3e-3})
        for d in ("fwd", "fwd+bwd", "bwd")]
path = f"{sys.argv[1]}/attention.json"
json.dump(bench_record.record("attention_same_process", True, {"warmup": 3}, rows), open(path, "w"))
r = subprocess.run([sys.executable, "benches/plot.py", "--check", path], capture_output=True, text=True)
assert r.returncode == 0, r.stderr
rec = json.load(open(path))
assert [row["shape"]["direction"] for row in rec["rows"]] == ["fwd", "fwd+bwd", "bwd"]
mk = rec["rows"][0]["contenders"][0]
assert mk["name"] == "mkernel" and mk["rel_err_vs_cudnn"] == 3e-3 and mk["host_enqueue_us"] == 15.0
assert rec["rows"][0]["contenders"][2] == {"name": "sdpa_flash", "median_us": None}
import moe_same_process as m
rows = [m.row(4096, 32, 7168, 2048, 8, d, {"mkernel": timed, "torch_grouped_mm": timed}, {"mkernel": 1e-3})
        for d in ("dispatch", "combine")]
json.dump(bench_record.record("moe_same_process", True, {"warmup": 3}, rows), open(path, "w"))
r = subprocess.run([sys.executable, "benches/plot.py", "--check", path], capture_output=True, text=True)
assert r.returncode == 0, r.stderr
assert json.load(open(path))["rows"][1]["shape"]["direction"] == "combine"
import moe_layer_same_process as ml
rows = [ml.row("deepseek-v3", 4096, 1.0, "layer", {"mkernel_moe_layer": timed, "torch_stack_graph": timed,
                                                   "torch_stack": None},
               {"mkernel_moe_layer": 4e-3}, {"torch_stack_graph": {"graph_calls": 1}})]
json.dump(bench_record.record("moe_layer_same_process", True, {"warmup": 3}, rows), open(path, "w"))
r = subprocess.run([sys.executable, "benches/plot.py", "--check", path], capture_output=True, text=True)
assert r.returncode == 0, r.stderr
shape = json.load(open(path))["rows"][0]["shape"]
assert (shape["model"], shape["experts"], shape["hidden"], shape["ffn"], shape["topk"]) == ("deepseek-v3", 256, 7168, 2048, 8)
import fp8_gemm_same_process as f
rows = [bench_record.row({"m": 1, "n": 8192, "k": 8192, "mode": mode, "dtype": "e4m3"},
                         {"mkernel_scaled_gemm": timed, "torch_scaled_mm": timed},
                         {"mkernel_scaled_gemm": {"rel_err_vs_torch": 2e-3}}) for mode in ("tensor", "rowwise")]
assert len(f.default_shapes()) == 5 + 15
json.dump(bench_record.record("fp8_gemm", True, {"warmup": 3}, rows), open(path, "w"))
r = subprocess.run([sys.executable, "benches/plot.py", "--check", path], capture_output=True, text=True)
assert r.returncode == 0, r.stderr
PY

echo "== figures.py: README and docs figures match the stored records; targets.py reads every record kind"
python3 benches/figures.py --check
python3 - "$WORK" <<'PY'
import json, os, shutil, subprocess, sys
sys.path.insert(0, "benches")
import figure_catalog, figures, plot, records
work = sys.argv[1]

# targets.py on every record of a day, python_overhead records included: judged, the others set aside.
day = sorted(f"benches/results/2026-12-05-h100-gemm-decode-rows/{n}" for n in os.listdir("benches/results/2026-12-05-h100-gemm-decode-rows") if n.endswith(".json"))
r = subprocess.run([sys.executable, "benches/targets.py", *day], capture_output=True, text=True)
assert r.returncode == 0, r.stderr
assert "set aside, no target reads them: 2 python_overhead record(s)" in r.stdout, r.stdout
assert "measured targets met" in r.stdout, r.stdout
json.dump({"bench": "something_else"}, open(f"{work}/odd.json", "w"))
r = subprocess.run([sys.executable, "benches/targets.py", f"{work}/odd.json"], capture_output=True, text=True)
assert r.returncode == 1 and "not a record of a known kind" in r.stderr, (r.returncode, r.stderr)

# A transcribed record may give the day alone; a measured one may not.
rec = json.load(open("benches/results/2026-12-04-error-claim-full-suite/moe-g2.json"))
records.validate(rec)
rec.pop("transcribed_from")
try:
    plot.validate(rec)
    raise AssertionError("a measured record without a time of day was accepted")
except plot.SchemaError as e:
    assert "ISO 8601" in str(e), e

# The runs list: the program by its name, no --json path, long repeated options shortened.
assert records.command({"command": ["/tmp/bins/mkbench", "gemm", "--json", "/x.json", "-n", "3"]}) == "mkbench gemm -n 3"
assert figures.short("mkbench gemm --shape a --shape b --shape c --shape d -w 1") == "mkbench gemm --shape a --shape b … (4 --shape) -w 1"
assert figure_catalog.span([1.0, 1.004]) == "1.00" and figure_catalog.span([0.5, 1.0], "{:.1f}", "×") == "0.5–1.0×"

# --check on a copy of the pages: a changed figure, an unknown block, a figure written by hand
# beside the blocks; --write repairs the first.
root = f"{work}/pages"
for d in ("docs", "benches/results"):
    shutil.copytree(d, f"{root}/{d}")
shutil.copy("README.md", root)
def check():
    return subprocess.run([sys.executable, "benches/figures.py", "--check", "--root", root], capture_output=True, text=True)
assert check().returncode == 0, check().stderr
page = f"{root}/docs/ops/moe.md"
text = open(page).read()
open(page, "w").write(text.replace("dispatch 0.613", "dispatch 0.500", 1))
r = check()
assert r.returncode == 1 and "docs/ops/moe.md: figures differ from the records" in r.stderr and "0.500" in r.stderr, r.stderr
assert subprocess.run([sys.executable, "benches/figures.py", "--write", "--root", root]).returncode == 0
assert open(page).read() == text and check().returncode == 0
open(page, "w").write(text + "\n<!-- figures:no_such_figure -->\n<!-- /figures -->\n")
r = check()
assert r.returncode == 1 and "no figure named 'no_such_figure'" in r.stderr, r.stderr
open(page, "w").write(text)
readme = open(f"{root}/README.md").read()
open(f"{root}/README.md", "w").write(readme.replace("| `mkGemm` | done;", "| `mkGemm` | done; 1.5× cuBLASLt;", 1))
r = check()
assert r.returncode == 1 and "a figure outside a figures block" in r.stderr, r.stderr
print("figures.py: a changed figure, an unknown block and a hand-written figure fail --check; --write repairs")
PY

echo "== benchmark tooling tests passed"
