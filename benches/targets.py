#!/usr/bin/env python3
"""The one-GPU speed targets, judged from bench records: for each target, what the given
records show and whether it is met. A target no given record speaks to says so.

    python3 benches/targets.py RECORD.json [RECORD.json ...] [--json OUT]

Records are any that benches/records.py reads: mkbench's `--json` output and the Python
benches' (`moe_same_process`, `moe_layer_same_process`) in the schema plot.py validates (docs/benchmarks.md), and
kinds no target reads (`python_overhead`), which are counted in a note and set aside. Each
target names the records it reads:

| target | records | met when |
|---|---|---|
| gemm_decode | gemm | cuBLASLt time / ours >= 1.0 at M in {1, 16, 64, 128, 256} and (N, K) in DECODE_NK |
| gemm_table | gemm | cuBLASLt time / ours >= 0.95 on every shape |
| host_per_call | any mkbench record | the op under test's median host enqueue time <= 5 us, per bench |
| all_reduce_latency | all_reduce at 2 ranks | out-of-place direct call <= 8 us at every size <= 64 KiB |
| gemm_ar_small_m | gemm_ar | fused <= cuBLASLt alone + 5 us at M <= 16 |
| moe_vs_grouped_mm | moe_same_process, moe_layer_same_process | each GEMM phase's mkernel time <= torch._grouped_mm time at 4096 and 16384 tokens |
| moe_layer | moe_layer_same_process | the graph-captured torch stack's time / mkernel.nn.MoE's >= 1.0, per GPU, model and T in {4096, 16384} (forward + backward reported beside it, no target) |
| fp8_gemm_large | fp8_gemm | geomean of torch._scaled_mm time / mkScaledGemm's >= 1.0 over the large shapes, per GPU and scale mode |
| fp8_gemm_decode | fp8_gemm | torch._scaled_mm time / mkScaledGemm's >= 0.95 on every decode row (M <= 256) |
| attention_fwd | ring_attn + sdpa_baseline | cuDNN SDPA time / mkRingAttention's (one rank) >= 1.0 on every row |
| attention_bwd | ring_attn_bwd + sdpa_baseline_bwd | cuDNN's backward time / mkRingAttentionBackward's >= 0.95 on every row |
| attention_fwd_bwd | ring_attn_bwd + sdpa_baseline_bwd | cuDNN's forward + backward time / mkernel's >= 0.95 on every row |

The attention targets pair a row of ours with cuDNN's row of the same GPU and shape (seq,
heads, kv_heads, dim, causal, at one rank), from the record of the same date when there is
one: the issue asks for both from the same run, and a record does not say which run it was.

Exit status 0 whatever the verdicts: this reports, it does not gate (a run on a GPU the
targets were not set for still prints its table); 1 for a file that is no record. With --json, writes the verdicts.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from records import MKBENCH, load  # noqa: E402
from records import kind as records_kind  # noqa: E402

DECODE_M = (1, 16, 64, 128, 256)
DECODE_NK = ((8192, 8192), (28672, 8192), (8192, 28672))
GEMM_DECODE_MIN = 1.0
GEMM_TABLE_MIN = 0.95
HOST_MAX_US = 5.0
ALL_REDUCE_MAX_BYTES = 64 * 1024
ALL_REDUCE_MAX_US = 8.0
GEMM_AR_MAX_M = 16
GEMM_AR_SLACK_US = 5.0
MOE_TOKENS = (4096, 16384)
MOE_PHASES = ("dispatch", "combine")
MOE_LAYER_MIN = 1.0
FP8_LARGE_GEOMEAN_MIN = 1.0
FP8_DECODE_MIN = 0.95
FP8_DECODE_MAX_M = 256
ATTENTION_FWD_MIN = 1.0
ATTENTION_BWD_MIN = 0.95
ATTENTION_FWD_BWD_MIN = 0.95
# The shape keys an attention row of ours and cuDNN's must share.
ATTENTION_KEYS = ("seq", "heads", "kv_heads", "dim", "causal", "dtype")
# What a row without a dtype ran in (records from before rows carried one were all bf16).
ATTENTION_DEFAULT_DTYPE = "bf16"

# The contender that is the op under test, by bench (host_per_call).
UNDER_TEST = {
    "gemm": "mk",
    "all_gather": "out_of_place",
    "reduce_scatter": "out_of_place",
    "all_reduce": "out_of_place",
    "ag_gemm": "fused",
    "ag_gemm_fp8": "fused_fp8",
    "gemm_rs": "fused",
    "gemm_ar": "fused",
    "moe": "fused",
    "ring_attn": "fused",
    "ring_attn_bwd": "fused",
    "fp8_gemm": "mkernel_scaled_gemm",
}


def _field(row, name, key):
    """`key` of the contender `name` in `row`, or None."""
    for c in row["contenders"]:
        if c["name"] == name:
            return c.get(key)
    return None


def _median(row, name):
    return _field(row, name, "median_us")


def _rows(records, bench):
    """(record, row) of every row of the records of `bench`."""
    for rec in records:
        if rec["bench"] == bench:
            for row in rec["rows"]:
                yield rec, row


def _ranks(rec, row):
    return row["shape"].get("ranks", rec["config"].get("ranks", 1))


def _gpu(rec):
    return rec["machine"].get("gpu") or "unknown GPU"


def _verdict(name, lines, checks):
    """checks: booleans, one per measured point; none measured -> no verdict."""
    if not checks:
        return {"target": name, "met": None, "lines": lines or ["no record speaks to it"]}
    return {"target": name, "met": all(checks), "lines": lines}


def _gemm_ratios(records, keep):
    """(cuBLASLt time / ours, label) of every gemm row that `keep(shape)` accepts."""
    out = []
    for rec, row in _rows(records, "gemm"):
        s = row["shape"]
        ours, theirs = _median(row, "mk"), _median(row, "cublaslt")
        if keep(s) and ours and theirs:
            out.append((theirs / ours, f'{_gpu(rec)} {s.get("dtype", "")} {s["m"]} x {s["n"]} x {s["k"]}'))
    return out


def _gemm_verdict(name, ratios, least):
    """The count and the lowest ratio, then every shape under `least`."""
    if not ratios:
        return _verdict(name, [], [])
    low = min(ratios)
    lines = [f"{len(ratios)} shapes, lowest {low[0]:.3f} ({low[1]})"]
    lines += [f"{label}: {r:.3f}" for r, label in ratios if r < least]
    return _verdict(name, lines, [r >= least for r, _ in ratios])


def gemm_decode(records):
    decode = lambda s: s.get("m") in DECODE_M and (s.get("n"), s.get("k")) in DECODE_NK  # noqa: E731
    return _gemm_verdict(f"gemm_decode (>= {GEMM_DECODE_MIN} x cuBLASLt)", _gemm_ratios(records, decode), GEMM_DECODE_MIN)


def gemm_table(records):
    return _gemm_verdict(
        f"gemm_table (>= {GEMM_TABLE_MIN} x cuBLASLt on every shape)", _gemm_ratios(records, lambda s: True), GEMM_TABLE_MIN
    )


def host_per_call(records):
    by_bench = {}
    for rec in records:
        name = UNDER_TEST.get(rec["bench"])
        if name is None:
            continue
        for row in rec["rows"]:
            h = _field(row, name, "host_enqueue_us")
            if h is not None:
                by_bench.setdefault((rec["bench"], _gpu(rec)), []).append(h)
    lines, checks = [], []
    for (bench, gpu), hosts in sorted(by_bench.items()):
        median = statistics.median(hosts)
        checks.append(median <= HOST_MAX_US)
        lines.append(f"{gpu} {bench}: {median:.1f} us ({len(hosts)} rows)")
    return _verdict(f"host_per_call (<= {HOST_MAX_US} us, median per op)", lines, checks)


def all_reduce_latency(records):
    lines, checks = [], []
    for rec in records:
        if rec["bench"] != "all_reduce" or rec["config"].get("ranks") != 2:
            continue
        direct = [(r["shape"]["bytes"], _median(r, "out_of_place"), _median(r, "out_of_place_graph")) for r in rec["rows"]
                  if r["shape"].get("bytes", 1 << 62) <= ALL_REDUCE_MAX_BYTES and _median(r, "out_of_place")]
        if not direct:
            continue
        worst = max(direct, key=lambda d: d[1])
        checks.append(worst[1] <= ALL_REDUCE_MAX_US)
        graphs = [g for _, _, g in direct if g]
        graph = f", graph replay {min(graphs):.1f}-{max(graphs):.1f} us" if graphs else ""
        lines.append(f'{_gpu(rec)}, ranks as {rec["config"].get("ranks_as", "?")}: direct up to {worst[1]:.1f} us '
                     f"(at {worst[0]} B){graph}")
    return _verdict(f"all_reduce_latency (2 ranks, <= {ALL_REDUCE_MAX_US} us direct up to 64 KiB)", lines, checks)


def gemm_ar_small_m(records):
    lines, checks = [], []
    for rec, row in _rows(records, "gemm_ar"):
        s = row["shape"]
        if s.get("m", GEMM_AR_MAX_M + 1) > GEMM_AR_MAX_M or _ranks(rec, row) < 2:
            continue
        fused, alone = _median(row, "fused"), _median(row, "cublaslt")
        if not fused or not alone:
            continue
        checks.append(fused <= alone + GEMM_AR_SLACK_US)
        lines.append(f'{_gpu(rec)} {_ranks(rec, row)} ranks M {s["m"]} N {s["n"]} K {s["k"]}: '
                     f"fused {fused:.1f} us, cuBLASLt alone {alone:.1f} us (+{fused - alone:.1f})")
    return _verdict(f"gemm_ar_small_m (fused <= cuBLASLt + {GEMM_AR_SLACK_US} us at M <= {GEMM_AR_MAX_M})", lines, checks)


def moe_vs_grouped_mm(records):
    lines, checks = [], []
    for bench in ("moe_same_process", "moe_layer_same_process"):
        for rec, row in _rows(records, bench):
            s = row["shape"]
            if s.get("tokens") not in MOE_TOKENS or s.get("direction") not in MOE_PHASES:
                continue
            ours = next((c for c in row["contenders"] if c["name"].startswith("mkernel_")), None)
            grouped = _median(row, "torch_grouped_mm")
            if not ours or not ours.get("median_us") or not grouped:
                continue
            ratio = grouped / ours["median_us"]
            checks.append(ratio >= 1.0)
            model = f'{s["model"]} ' if s.get("model") else ""
            lines.append(f'{_gpu(rec)} {model}{s["tokens"]} tokens {s["direction"]}: {ratio:.2f} x torch._grouped_mm')
    return _verdict("moe_vs_grouped_mm (>= 1.0 x torch._grouped_mm alone)", lines, checks)


def moe_layer(records):
    """The whole layer's forward against the torch stack in one CUDA graph, per GPU, model
    and T; the forward + backward rows of the same records as lines without a check."""
    lines, checks, reported = [], [], []
    for rec, row in _rows(records, "moe_layer_same_process"):
        s = row["shape"]
        if s.get("tokens") not in MOE_TOKENS or _ranks(rec, row) != 1:
            continue
        label = f'{_gpu(rec)} {s.get("model", "?")} T {s["tokens"]}'
        if s.get("direction") == "layer":
            ours, stack = _median(row, "mkernel_moe_layer"), _median(row, "torch_stack_graph")
            if ours and stack:
                checks.append(stack / ours >= MOE_LAYER_MIN)
                lines.append(f"{label}: {stack / ours:.2f} x the graph-captured torch stack")
        elif s.get("direction") == "fwd+bwd":
            ours, stack = _median(row, "mkernel_moe_layer_fwd_bwd"), _median(row, "torch_stack_fwd_bwd")
            if ours and stack:
                reported.append(f"{label} forward + backward (no target): {stack / ours:.2f} x the torch stack")
    return _verdict(f"moe_layer (>= {MOE_LAYER_MIN} x the torch stack in one CUDA graph)", lines + reported, checks)


def _fp8_ratios(records, keep):
    """(torch._scaled_mm time / mkScaledGemm's, GPU, mode, label) of every fp8_gemm row that
    `keep(shape)` accepts and both contenders ran."""
    out = []
    for rec, row in _rows(records, "fp8_gemm"):
        s = row["shape"]
        ours, theirs = _median(row, "mkernel_scaled_gemm"), _median(row, "torch_scaled_mm")
        if keep(s) and ours and theirs:
            out.append((theirs / ours, _gpu(rec), s.get("mode", ""), f'{s["m"]} x {s["n"]} x {s["k"]}'))
    return out


def fp8_gemm_large(records):
    by_group = {}
    for ratio, gpu, mode, _ in _fp8_ratios(records, lambda s: s.get("m", 0) > FP8_DECODE_MAX_M):
        by_group.setdefault((gpu, mode), []).append(ratio)
    lines, checks = [], []
    for (gpu, mode), ratios in sorted(by_group.items()):
        g = statistics.geometric_mean(ratios)
        checks.append(g >= FP8_LARGE_GEOMEAN_MIN)
        lines.append(f"{gpu} {mode}: geomean {g:.3f} over {len(ratios)} shapes (lowest {min(ratios):.3f})")
    return _verdict(f"fp8_gemm_large (geomean >= {FP8_LARGE_GEOMEAN_MIN} x torch._scaled_mm)", lines, checks)


def fp8_gemm_decode(records):
    ratios = _fp8_ratios(records, lambda s: s.get("m", 0) <= FP8_DECODE_MAX_M)
    if not ratios:
        return _verdict(f"fp8_gemm_decode (>= {FP8_DECODE_MIN} x torch._scaled_mm)", [], [])
    low = min(ratios)
    lines = [f"{len(ratios)} rows, lowest {low[0]:.3f} ({low[1]} {low[2]} {low[3]})"]
    lines += [f"{gpu} {mode} {label}: {r:.3f}" for r, gpu, mode, label in ratios if r < FP8_DECODE_MIN]
    return _verdict(
        f"fp8_gemm_decode (>= {FP8_DECODE_MIN} x torch._scaled_mm)", lines, [r >= FP8_DECODE_MIN for r, *_ in ratios]
    )


def _attention_key(rec, row):
    s = row["shape"]
    # A forward row carries no kv_heads (as many as heads); a row without a dtype is bf16.
    implied = {"kv_heads": s.get("heads"), "dtype": ATTENTION_DEFAULT_DTYPE}
    return (_gpu(rec),) + tuple(s.get(k, implied.get(k)) for k in ATTENTION_KEYS)


def _attention_ratios(records, ours_bench, ours_name, theirs_bench, theirs_name):
    """(cuDNN time / ours, label) of every one-rank row of `ours_bench` with a cuDNN row of
    the same GPU and shape; cuDNN's row from a record of the same date when one exists."""
    theirs = {}
    for rec, row in _rows(records, theirs_bench):
        t = _median(row, theirs_name)
        if t:
            theirs.setdefault(_attention_key(rec, row), []).append((rec.get("date"), t))
    out = []
    for rec, row in _rows(records, ours_bench):
        ours = _median(row, ours_name)
        candidates = theirs.get(_attention_key(rec, row))
        if _ranks(rec, row) != 1 or not ours or not candidates:
            continue
        day = (rec.get("date") or "")[:10]  # records date themselves to the second
        same_day = [t for d, t in candidates if day and (d or "")[:10] == day]
        t = (same_day or [t for _, t in candidates])[-1]
        s = row["shape"]
        kv = s.get("kv_heads", s.get("heads"))
        dtype = s.get("dtype", ATTENTION_DEFAULT_DTYPE)
        label = f'{_gpu(rec)} {dtype} S {s.get("seq")} H {s.get("heads")}/{kv} D {s.get("dim")} causal {s.get("causal")}'
        if rec["config"].get("engine"):
            label += f' ({rec["config"]["engine"]} engine)'
        out.append((t / ours, label))
    return out


def _attention_verdict(name, least, ratios):
    lines = [f"{label}: {r:.3f} x cuDNN" for r, label in ratios]
    return _verdict(f"{name} (>= {least} x cuDNN SDPA)", lines, [r >= least for r, _ in ratios])


def attention_fwd(records):
    ratios = _attention_ratios(records, "ring_attn", "fused", "sdpa_baseline", "sdpa_cudnn")
    return _attention_verdict("attention_fwd", ATTENTION_FWD_MIN, ratios)


def attention_bwd(records):
    ratios = _attention_ratios(records, "ring_attn_bwd", "fused", "sdpa_baseline_bwd", "sdpa_cudnn_backward")
    return _attention_verdict("attention_bwd", ATTENTION_BWD_MIN, ratios)


def attention_fwd_bwd(records):
    ratios = _attention_ratios(records, "ring_attn_bwd", "forward+backward", "sdpa_baseline_bwd",
                               "sdpa_cudnn_forward+backward")
    return _attention_verdict("attention_fwd_bwd", ATTENTION_FWD_BWD_MIN, ratios)


TARGETS = (
    gemm_decode,
    gemm_table,
    host_per_call,
    all_reduce_latency,
    gemm_ar_small_m,
    moe_vs_grouped_mm,
    moe_layer,
    fp8_gemm_large,
    fp8_gemm_decode,
    attention_fwd,
    attention_bwd,
    attention_fwd_bwd,
)


def judge(records):
    """The verdict of every target on `records` (mkbench/1)."""
    return [t(records) for t in TARGETS]


def set_aside(records):
    """(the mkbench/1 records among `records`, a note counting the others by kind or None)."""
    measured, others = [], {}
    for r in records:
        if records_kind(r) == MKBENCH:
            measured.append(r)
        else:
            others[records_kind(r)] = others.get(records_kind(r), 0) + 1
    if not others:
        return measured, None
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(others.items()))
    return measured, f"# set aside, no target reads them: {kinds} record(s)"


def report(verdicts, note=None):
    out = [note] if note else []
    for v in verdicts:
        state = {True: "MET", False: "MISSED", None: "NOT MEASURED"}[v["met"]]
        out.append(f"{state:<12} {v['target']}")
        out += [f"             {line}" for line in v["lines"]]
    met = sum(v["met"] is True for v in verdicts)
    measured = sum(v["met"] is not None for v in verdicts)
    out.append(f"# {met} of {measured} measured targets met ({len(verdicts)} targets)")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+")
    ap.add_argument("--json", help="write the verdicts here")
    a = ap.parse_args(argv)
    try:
        records = [load(p) for p in a.records]
    except (ValueError, OSError) as e:  # RecordError, plot.SchemaError, a JSON error
        print(f"targets.py: {e}", file=sys.stderr)
        return 1
    measured, note = set_aside(records)
    verdicts = judge(measured)
    print(report(verdicts, note))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(verdicts, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
