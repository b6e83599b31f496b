"""The figures that benches/figures.py renders into README.md and docs/, by name (FIGURES).

Each figure is a function of a page (figures.Page): it reads the records it names
(`page.record(path)`, a path under benches/results/), returns markdown, and cites every run
it quotes (`page.cite(path)` gives "[n]" linked to the record). Every number it prints is
computed from a record, beside the baseline of the same run.
"""
import os
import statistics

import records


def rows(rec, **shape):
    """The rows of `rec` whose shape has every given key = value."""
    return [r for r in rec["rows"] if all(r["shape"].get(k) == v for k, v in shape.items())]


def contender(row, name):
    for c in row["contenders"]:
        if c["name"] == name:
            return c
    raise KeyError(f"no contender {name} in row {row['shape']}")


def median(row, name):
    return contender(row, name)["median_us"]


def time_over(row, name, base):
    """`name`'s time / `base`'s in one row: as the record states it, else from the medians."""
    stated = contender(row, name).get("time_over", {})
    if base in stated:
        return stated[base]
    return median(row, name) / median(row, base)


def span(values, fmt="{:.2f}", unit=""):
    """"a–b" (or "a" where every value rounds alike), with `unit` after it."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return (lo if lo == hi else f"{lo}–{hi}") + unit


def per(values, fmt="{:.3f}"):
    """"a / b / c" in the given order."""
    return " / ".join(fmt.format(v) for v in values)


def ms(us):
    return f"{us / 1e3:.2f}"


def gpu(page, path):
    """The GPU the record at `path` ran on ("H100"): a figure names it from the record."""
    return records.gpu(page.record(path))


# The records the figures read (paths under benches/results/) and the contenders they set
# side by side. A newer run shows in the pages once its record is named here and
# `figures.py --write` has run.
GEMM_TABLE = "2026-12-05-h100-gemm-decode-rows/gemm-sweep-3f3b7db.json"
GEMM_DECODE_RUNS = ("2026-12-05-h200-moe-gemm-rows/h200-gemm-decode.json",
                    "2026-12-05-h200-moe-gemm-rows/h200-gemm-sweep.json")
GEMM_ROWS_CHANGED = "2026-12-05-h200-moe-gemm-rows/h100-gemm-rows-0e0c2c3.json"
DECODE_M = (1, 16, 64, 128, 256)
DENSE_2_RANKS = {
    "ag_gemm": ("2026-12-04-error-claim-full-suite/ag_gemm-g2.json", "ag_mk+ours_capped"),
    "gemm_rs": ("2026-12-04-error-claim-full-suite/gemm_rs-g2.json", "ours_capped+mk_collective"),
    "gemm_ar": ("2026-12-04-error-claim-full-suite/gemm_ar-g2.json", "ours_capped+mk_collective"),
}
AG_GEMM_4_RANKS = "2026-12-04-error-claim-full-suite/ag_gemm-g4.json"
MOE_2_RANKS = "2026-12-04-error-claim-full-suite/moe-g2.json"
MOE_UNFUSED = {"dispatch": "exchange+per_expert_gemms_capped", "combine": "per_expert_gemms_capped+exchange"}
MOE_TORCH = {"H100": "2026-12-05-h100-moe-prep-over-ctas/moe_same_process.json",
             "H200": "2026-12-05-h200-moe-gemm-rows/h200-moe_same_process.json"}
RING_ATTN = ("2026-12-03-moe-burst-early-sums-attention/ring_attn-g1.json",
             "2026-12-03-moe-burst-early-sums-attention/sdpa_baseline.json")
ATTENTION_BACKWARD = "2026-12-05-h100-gemm-decode-rows/attention_same_process-partial.json"
# mkbench ring_attn_bwd under the default engine where it fits (one-pass), and cuDNN's backward
# from benches/sdpa_baseline.py --backward in the same call.
ATTENTION_BACKWARD_ONE_PASS = ("2026-12-07-h100-one-pass-backward-first-run/bwd-one-pass.json",
                               "2026-12-07-h100-one-pass-backward-first-run/sdpa_baseline_bwd.json")
ALL_REDUCE_2_RANKS = {
    ("H100", "processes"): "2026-12-05-h200-moe-gemm-rows/h100-host-all_reduce-g2.json",
    ("H100", "threads"): "2026-12-05-h200-moe-gemm-rows/h100-host-all_reduce-threads-g2.json",
    ("H200", "processes"): "2026-12-05-h200-moe-gemm-rows/h200-all_reduce-g2.json",
    ("H200", "threads"): "2026-12-05-h200-moe-gemm-rows/h200-all_reduce-threads-g2.json",
}
SMALL_BYTES = 32 * 1024
HOST_PER_CALL = {  # op -> (record, its contender under test)
    "`mkAllGather`": ("2026-12-05-h200-moe-gemm-rows/h100-host-all_gather-g1.json", "out_of_place"),
    "`mkReduceScatter`": ("2026-12-05-h200-moe-gemm-rows/h100-host-reduce_scatter-g1.json", "out_of_place"),
    "`mkAllReduce`": ("2026-12-05-h200-moe-gemm-rows/h100-host-all_reduce-g1.json", "out_of_place"),
    "`mkGemm`": ("2026-12-05-h200-moe-gemm-rows/h100-host-gemm-host.json", "mk"),
    "`mkAllGatherGemm`": ("2026-12-05-h200-moe-gemm-rows/h100-host-ag_gemm-g1.json", "fused"),
    "`mkGemmReduceScatter`": ("2026-12-05-h200-moe-gemm-rows/h100-host-gemm_rs-g1.json", "fused"),
    "`mkGemmAllReduce`": ("2026-12-05-h200-moe-gemm-rows/h100-host-gemm_ar-g1.json", "fused"),
    "`mkRingAttention`": ("2026-12-05-h200-moe-gemm-rows/h100-host-ring_attn-g1.json", "fused"),
    "`mkMoeDispatchGemm`, `mkMoeGemmCombine`": ("2026-12-05-h200-moe-gemm-rows/h100-host-moe-256.json", "fused"),
}
PYTHON_OVERHEAD = ("2026-12-05-h100-gemm-decode-rows/python_overhead-n1.json",
                   "2026-12-05-h100-moe-prep-over-ctas/python_overhead-n1-5d431d2.json",
                   "2026-12-05-h100-gemm-decode-rows/python_overhead-n2.json")
GEMM_TABLE_EARLIER = "2026-12-05-h100-gemm-table-and-rank-threads/gemm.json"
GEMM_AR_TWO_PHASE = "2026-12-03-courier-and-fa3-attention/gemm_ar-g2-two-phase.json"
MOE_DENSE_GEMM = "2026-12-05-h100-moe-prep-over-ctas/gemm-moe-dense.json"
MOE_DISPATCH = "2026-12-05-h100-moe-prep-over-ctas/moe-16384.json"
COLLECTIVES_COPY = "2026-12-02-collectives-vs-copy/all_gather-g1.json"
STAGING = "2026-12-03-staged-loads/collectives-staging-g2.json"
NODES = {op: f"2026-12-03-gemm-reduce-emulated-nodes/{op}-g4-nodes.json"
         for op in ("ag_gemm", "gemm_rs", "gemm_ar", "collectives")}
HOST_BASELINES = {"d2d_copy": "a D2D copy", "cublaslt": "cuBLASLt"}


def _gemm_ratios(rec, keep=lambda s: True):
    """cuBLASLt time / ours for every row `keep` accepts."""
    return [time_over(r, "cublaslt", "mk") for r in rec["rows"] if keep(r["shape"])]


def _max_rel_err(*recs):
    return max(r.get("rel_err", 0) for rec in recs for r in rec["rows"])


def _wrong(*recs):
    """How many outputs the bench's check refused (its `wrong`), in words."""
    checked = [r["wrong"] for rec in recs for r in rec["rows"] if "wrong" in r]
    bad = sum(bool(w) for w in checked)
    if bad:
        return f"{bad} of {len(checked)} outputs outside the bench's error bound"
    return f"all {len(checked)} outputs within the bench's error bound"


def gemm_h100(page):
    rec = page.record(GEMM_TABLE)
    every = _gemm_ratios(rec)
    decode = _gemm_ratios(rec, lambda s: s["m"] in DECODE_M)
    ms_ = [r["shape"]["m"] for r in rec["rows"]]
    host = [contender(r, "mk")["host_enqueue_us"] for r in rec["rows"]]
    host_lt = [contender(r, "cublaslt")["host_enqueue_us"] for r in rec["rows"]]
    return (f"{gpu(page, GEMM_TABLE)}, the table's plans: {span(every, '{:.3f}', '×')} cuBLASLt's throughput on all "
            f"{len(every)} "
            f"shapes of `mkbench gemm` (bf16 and fp16, M {min(ms_)}–{max(ms_)}), "
            f"{span(decode, '{:.3f}', '×')} on the {len(decode)} decode shapes (M {min(DECODE_M)}–{max(DECODE_M)}); "
            f"host time per call median {statistics.median(host):.1f} µs against cuBLASLt's "
            f"{statistics.median(host_lt):.1f} {page.cite(GEMM_TABLE)}")


def gemm_h200(page):
    runs = [page.record(p) for p in GEMM_DECODE_RUNS]
    parts = [f"{span(_gemm_ratios(rec), '{:.2f}', '×')} {page.cite(p)}" for p, rec in zip(GEMM_DECODE_RUNS, runs)]
    ms_ = [r["shape"]["m"] for rec in runs for r in rec["rows"]]
    gpus = " and ".join(sorted({gpu(page, p) for p in GEMM_DECODE_RUNS}))
    return (f"{gpus}, decode and tail-wave shapes (M {min(ms_)}–{max(ms_)}, bf16), two runs minutes apart: "
            f"{' and '.join(parts)} cuBLASLt's throughput")


def gemm(page):
    """docs/ops/gemm.md: the engine against cuBLASLt on both GPUs, and how close its outputs are."""
    rows_ = [page.record(GEMM_TABLE), *(page.record(p) for p in GEMM_DECODE_RUNS)]
    moved = page.record(GEMM_ROWS_CHANGED)
    lines = [
        f"- {gemm_h100(page)}.",
        f"- {gemm_h200(page)}. Three shape classes whose table rows then took the sweep's faster tile: "
        f"{span(_gemm_ratios(moved), '{:.3f}', '×')} on the H100 afterwards {page.cite(GEMM_ROWS_CHANGED)}.",
        f"- Outputs are not bit-identical to cuBLASLt's: relative error against cuBLASLt up to "
        f"{_max_rel_err(*rows_, moved):.1e} in these runs; {_wrong(*rows_, moved)}.",
    ]
    return "\n".join(lines)


def gemm_split_k_wave(page):
    """docs/ops/gemm.md, inline: split-K run on a partial last wave (the table's plans before
    the planner stopped doing that)."""
    rec = page.record(GEMM_TABLE_EARLIER)
    split = [r for r in rec["rows"] if "split1" not in r["plan"] and r["shape"]["n"] == 28672]
    return (f"measured {span([time_over(r, 'cublaslt', 'mk') for r in split], '{:.2f}', '×')} cuBLASLt's throughput at "
            f"M {per(sorted({r['shape']['m'] for r in split}), '{}')}, N 28672 on an {gpu(page, GEMM_TABLE_EARLIER)} "
            f"{page.cite(GEMM_TABLE_EARLIER)}")


def gemm_a_box(page):
    """docs/ops/gemm.md, inline: the same plan at M = 1 and 64 with a 64-row A box."""
    rec = page.record(GEMM_TABLE_EARLIER)
    one, sixty_four = (rows(rec, m=m, n=8192, k=8192, dtype="bfloat16")[0] for m in (1, 64))
    if one["plan"] != sixty_four["plan"]:
        raise ValueError(f"{GEMM_TABLE_EARLIER}: M = 1 and 64 ran different plans; the A box figure needs one")
    return (f"with a 64-row box the same plan took {median(one, 'mk'):.1f} µs at M = 1 and "
            f"{median(sixty_four, 'mk'):.1f} at M = 64 (N = K = 8192, bf16, {gpu(page, GEMM_TABLE_EARLIER)}) "
            f"{page.cite(GEMM_TABLE_EARLIER)}")


def _dense_2_ranks(page, op):
    path, unfused = DENSE_2_RANKS[op]
    rec = page.record(path)
    key = "rows" if op == "ag_gemm" else "m"
    return rec, unfused, key, [(r["shape"][key], time_over(r, "fused", unfused), r) for r in rec["rows"]]


def ag_gemm(page):
    """docs/ops/all_gather_gemm.md."""
    rec, unfused, key, pts = _dense_2_ranks(page, "ag_gemm")
    four = page.record(AG_GEMM_4_RANKS)
    pts4 = [(r["shape"]["rows"], time_over(r, "fused", unfused)) for r in four["rows"]]
    s = rec["rows"][0]["shape"]
    return (f"{records.gpu(rec)}, ranks as MPS processes ({rec['config']['MK_MAX_CTAS']} CTAs each), "
            f"N {s['n']}, K {s['k']}, bf16, "
            f"fused time / unfused "
            f"(`mkAllGather`, then our GEMM): 2 ranks {per([p[1] for p in pts])} at {per([p[0] for p in pts], '{}')} "
            f"rows per rank {page.cite(DENSE_2_RANKS['ag_gemm'][0])}; 4 ranks ({four['config']['MK_MAX_CTAS']} CTAs each) "
            f"{per([p[1] for p in pts4])} "
            f"at {per([p[0] for p in pts4], '{}')} {page.cite(AG_GEMM_4_RANKS)}.")


def _reduce_op(page, op, collective):
    rec, unfused, key, pts = _dense_2_ranks(page, op)
    s = rec["rows"][0]["shape"]
    parts = []
    for m, ratio, row in pts:
        t = contender(row, "fused")["median_us"]
        parts.append(f"{ratio:.3f} at M {m}" + (f" (fused {t:.1f} µs)" if t else ""))
    return (f"2 ranks on one {records.gpu(rec)} (MPS, {rec['config']['MK_MAX_CTAS']} CTAs each), "
            f"N {s['n']}, K {s['k']}, bf16, "
            f"fused time / unfused (our GEMM, "
            f"then `{collective}`): {', '.join(parts)} {page.cite(DENSE_2_RANKS[op][0])}.")


def gemm_rs(page):
    """docs/ops/gemm_reduce_scatter.md."""
    return _reduce_op(page, "gemm_rs", "mkReduceScatter")


def gemm_ar(page):
    """docs/ops/gemm_all_reduce.md: the one-shot regime at small M, two-phase at large M."""
    rec = page.record(GEMM_AR_TWO_PHASE)
    ratios = [time_over(r, "fused", "ours_capped+mk_collective") for r in rec["rows"]]
    ms_ = sorted({r["shape"]["m"] for r in rec["rows"]})
    ks = sorted({r["shape"]["k"] for r in rec["rows"]})
    return (_reduce_op(page, "gemm_ar", "mkAllReduce")
            + f" Two-phase, M {ms_[0]}–{ms_[-1]}, K {per(ks, '{}').replace(' / ', ' and ')}: {span(ratios, '{:.3f}')} "
            f"{page.cite(GEMM_AR_TWO_PHASE)}.")


def _moe_2_ranks(page):
    rec = page.record(MOE_2_RANKS)
    return {d: time_over(rows(rec, direction=d)[0], "fused", MOE_UNFUSED[d]) for d in ("dispatch", "combine")}


def _moe_torch(page, which):
    """{(tokens, direction): row} of the one-rank MoE beside torch, T >= 4096, from MOE_TORCH[which]."""
    rec = page.record(MOE_TORCH[which])
    return {(r["shape"]["tokens"], r["shape"]["direction"]): r for r in rec["rows"] if r["shape"]["tokens"] >= 4096}


def _ours(row):
    return next(c["name"] for c in row["contenders"] if c["name"].startswith("mkernel_"))


def moe_torch(page, which):
    """The one-rank MoE beside torch on the same tensors, from MOE_TORCH[which]."""
    got = _moe_torch(page, which)
    tokens = sorted({t for t, _ in got})
    d = [got[(t, "dispatch")] for t in tokens]
    c = [got[(t, "combine")] for t in tokens]
    ours = lambda rs: per([median(r, _ours(r)) / 1e3 for r in rs], "{:.2f}")  # noqa: E731
    base = lambda rs, n: per([median(r, n) / 1e3 for r in rs], "{:.2f}")  # noqa: E731
    over = lambda rs, n: per([time_over(r, n, _ours(r)) for r in rs], "{:.2f}")  # noqa: E731
    s = d[0]["shape"]
    return (f"{records.gpu(page.record(MOE_TORCH[which]))}, one rank, E {s['experts']}, H {s['hidden']}, F {s['ffn']}, "
            f"k {s['topk']}, T {per(tokens, '{}')}: dispatch {ours(d)} ms against "
            f"{base(d, 'torch_gather_grouped_mm')} for gather + `torch._grouped_mm` ({over(d, 'torch_gather_grouped_mm')}× "
            f"its speed) and {base(d, 'torch_grouped_mm')} for `torch._grouped_mm` alone on rows already laid out "
            f"({over(d, 'torch_grouped_mm')}×); combine {ours(c)} ms against {base(c, 'torch_grouped_mm_index_add')} for "
            f"grouped_mm + index_add ({over(c, 'torch_grouped_mm_index_add')}×) and {base(c, 'torch_grouped_mm')} for "
            f"grouped_mm alone ({over(c, 'torch_grouped_mm')}×) {page.cite(MOE_TORCH[which])}")


def moe(page):
    """docs/ops/moe.md."""
    two = _moe_2_ranks(page)
    return "\n".join([
        f"- {gpu(page, MOE_2_RANKS)}, 2 ranks as MPS processes, fused time / unfused (our exchange and "
        f"per-expert GEMMs): dispatch "
        f"{two['dispatch']:.3f}, combine {two['combine']:.3f} {page.cite(MOE_2_RANKS)}.",
        f"- {moe_torch(page, 'H100')}.",
        f"- {moe_h100_engine(page)}.",
        f"- {moe_torch(page, 'H200')}.",
        "- `torch._grouped_mm` alone does less than either fused op: it neither gathers nor scatters the rows.",
    ])


def _attention_pairs(page):
    """(S, causal, ours TF/s, cuDNN TF/s) of the forward, from the two records of one call."""
    ours, theirs = (page.record(p) for p in RING_ATTN)
    out = []
    for r in ours["rows"]:
        s = r["shape"]
        base = rows(theirs, seq=s["seq"], causal=s["causal"])[0]
        out.append((s["seq"], s["causal"], contender(r, "fused")["tflops"], contender(base, "sdpa_cudnn")["tflops"]))
    return out


def _attention_backward(page):
    rec = page.record(ATTENTION_BACKWARD)
    bwd = rows(rec, direction="bwd")
    return rec, [(contender(r, "mkernel")["tflops"], contender(r, "sdpa_cudnn")["tflops"],
                  time_over(r, "sdpa_cudnn", "mkernel")) for r in bwd], bwd


def _attention_backward_one_pass(page):
    """(seq, causal, cuDNN's backward time / ours) of every one-rank row of the one-pass engine."""
    ours, theirs = (page.record(p) for p in ATTENTION_BACKWARD_ONE_PASS)
    out = []
    for r in ours["rows"]:
        s = r["shape"]
        base = rows(theirs, seq=s["seq"], causal=s["causal"], heads=s["heads"], kv_heads=s["kv_heads"])[0]
        out.append((s["seq"], s["causal"], median(base, "sdpa_cudnn_backward") / median(r, "fused")))
    return out


def ring_attention(page):
    """docs/ops/ring_attention.md: forward and backward at one rank beside cuDNN."""
    fwd = _attention_pairs(page)
    rec, bwd, bwd_rows = _attention_backward(page)
    one_pass = _attention_backward_one_pass(page)
    return "\n".join([
        f"- Forward, {gpu(page, RING_ATTN[0])}, one rank, bf16: "
        f"{span([f[2] for f in fwd], '{:.0f}', ' TF/s')} at S {min(f[0] for f in fwd) // 1024}–"
        f"{max(f[0] for f in fwd) // 1024}K against cuDNN's {span([f[3] for f in fwd], '{:.0f}')} in the same call: "
        f"{span([f[2] / f[3] for f in fwd], '{:.2f}', '×')} its throughput {page.cite(*RING_ATTN)}.",
        f"- Backward, {gpu(page, ATTENTION_BACKWARD)}, one rank through the Python package, beside SDPA on the same tensors: "
        f"{span([b[0] for b in bwd], '{:.0f}', ' TF/s')} against cuDNN's {span([b[1] for b in bwd], '{:.0f}')} "
        f"({span([b[2] for b in bwd], '{:.2f}', '×')}) in the {len(bwd_rows)} cases the run finished ("
        + ", ".join(f"{r['shape']['seq'] // 1024}K {'causal' if r['shape']['causal'] else 'non-causal'}" for r in bwd_rows)
        + f"; B 1, H 32, D 128, bf16) {page.cite(ATTENTION_BACKWARD)}.",
        f"- Backward, one-pass engine, {gpu(page, ATTENTION_BACKWARD_ONE_PASS[0])}, one rank, `mkbench ring_attn_bwd` "
        f"beside `benches/sdpa_baseline.py --backward` in the same call: "
        f"{span([b[2] for b in one_pass], '{:.2f}', '×')} cuDNN's backward at S "
        f"{span([b[0] // 1024 for b in one_pass], '{}', 'K')}, causal and not "
        f"(B 1, H 32, D 128, bf16) {page.cite(*ATTENTION_BACKWARD_ONE_PASS)}.",
    ])


def _all_reduce_small(page, gpu, ranks_as):
    rec = page.record(ALL_REDUCE_2_RANKS[(gpu, ranks_as)])
    small = [r for r in rec["rows"] if r["shape"]["bytes"] <= SMALL_BYTES]
    return ([median(r, "out_of_place") for r in small], [median(r, "out_of_place_graph") for r in small],
            [median(r, "d2d_copy") for r in small if any(c["name"] == "d2d_copy" for c in r["contenders"])])


def all_reduce_small(page):
    parts = []
    for (which, ranks_as), path in ALL_REDUCE_2_RANKS.items():
        direct, graph, copy = _all_reduce_small(page, which, ranks_as)
        copies = f", a D2D copy {span(copy, '{:.1f}')}" if copy else ""
        parts.append(f"{gpu(page, path)}, {ranks_as}: {span(graph, '{:.1f}')} µs in a CUDA graph, {span(direct, '{:.1f}')} "
                     f"called directly{copies} {page.cite(path)}")
    return f"2-rank AllReduce ≤ {SMALL_BYTES // 1024} KB, µs per call: " + "; ".join(parts)


def host_per_call(page):
    """docs/architecture.md: host µs per call of each op, beside the host time of the run's
    library baseline where it has one."""
    parts = []
    for op, (path, name) in HOST_PER_CALL.items():
        rec = page.record(path)

        def host(n):
            return statistics.median(c["host_enqueue_us"] for r in rec["rows"] for c in r["contenders"]
                                     if c["name"] == n and c.get("host_enqueue_us"))

        beside = [f"{label} {host(n):.1f}" for n, label in HOST_BASELINES.items()
                  if any(c["name"] == n for r in rec["rows"] for c in r["contenders"])]
        parts.append(f"{op} {host(name):.1f}" + (f" ({', '.join(beside)})" if beside else "") + f" {page.cite(path)}")
    gpus = " and ".join(sorted({gpu(page, path) for path, _ in HOST_PER_CALL.values()}))
    return (f"Host µs per call on an {gpus}, median over a record's rows of the enqueue time: "
            + ", ".join(parts) + ".")


def _python(page, path):
    rec = page.record(path)
    host = rec["host_us_per_call_all_reduce_16KB"]
    mlp = rec["mlp_step_us"]
    return rec, host, mlp


def python_host(page):
    parts = []
    for path in PYTHON_OVERHEAD:
        rec, host, mlp = _python(page, path)
        parts.append(f"{mlp['shape']['ranks']} rank{'s' if mlp['shape']['ranks'] > 1 else ''}: "
                     f"{host['c_abi_ctypes']['median']:.2f} through ctypes to the C ABI, "
                     f"{host['package_out']['median']:.1f} through `mkernel.all_reduce(out=)`, "
                     f"{host['torch_ops']['median']:.1f} through `torch.ops` {page.cite(path)}")
    gpus = " and ".join(sorted({gpu(page, p) for p in PYTHON_OVERHEAD}))
    return f"Host µs per call of a 16 KB AllReduce, {gpus}: " + "; ".join(parts)


def tp_mlp(page):
    parts = []
    for path in PYTHON_OVERHEAD:
        rec, host, mlp = _python(page, path)
        s = mlp["shape"]
        fused, torch_ = mlp["fused_layers"]["median"], mlp["torch_matmul_plus_mkernel_collectives"]["median"]
        parts.append(f"{s['ranks']} rank{'s' if s['ranks'] > 1 else ''}, {s['tokens']} tokens: fused layers "
                     f"{ms(fused)} ms against {ms(torch_)} ({torch_ / fused:.2f}×) {page.cite(path)}")
    s = page.record(PYTHON_OVERHEAD[0])["mlp_step_us"]["shape"]
    gpus = " and ".join(sorted({gpu(page, p) for p in PYTHON_OVERHEAD}))
    return (f"Tensor-parallel MLP step (H {s['hidden']}, F {s['ffn']}, {s['dtype']}, forward and backward, sequence "
            f"parallel), {gpus}: " + "; ".join(parts))


TP_MLP_WHY = (
    "The fused layers are slower in this step. At two ranks sharing one GPU (MPS, half the SMs "
    "each), each rank's fused kernels run under the grid cap that keeps both ranks' persistent "
    "grids resident at once (`MK_MAX_CTAS` 32 from `rank_env` in scripts/mps.sh, so at most 32 "
    "SMs per fused op), while torch's matmuls spread over the rank's whole share: a cost of "
    "sharing one GPU that ranks on their own GPUs do not pay. At one rank, every backward step "
    "copies both weights into transposed form for the fused ops (`_transposed` in "
    "python/src/mkernel/nn/linear.py), which the torch path, whose matmuls read the transpose "
    "in place, does not do; the records do not split the rest of the gap.")


def python_gpu(page):
    """docs/python.md: the package's cost on a GPU and the MLP step."""
    return "\n".join([f"- {python_host(page)}.", f"- {tp_mlp(page)}. {TP_MLP_WHY}"])


def moe_h100_engine(page):
    """The dispatch at T 16384 against the engine on the same rows as one dense GEMM."""
    dense = rows(page.record(MOE_DENSE_GEMM), m=131072, n=2048, k=7168)[0]
    dispatch = rows(page.record(MOE_DISPATCH), direction="dispatch")[0]
    return (f"{gpu(page, MOE_DISPATCH)}, T {dispatch['shape']['tokens']}: the engine on the dispatch's routed rows "
            f"as one dense GEMM takes {ms(median(dense, 'mk'))} ms "
            f"against cuBLASLt's {ms(median(dense, 'cublaslt'))} {page.cite(MOE_DENSE_GEMM)}; the fused dispatch "
            f"{ms(median(dispatch, 'fused'))} ms, the exchange (the rows' copy) alone {ms(median(dispatch, 'exchange'))} "
            f"{page.cite(MOE_DISPATCH)}: part of the copy is hidden under the GEMM")


def collectives(page):
    """docs/ops/collectives.md: one rank against a copy; shared-memory staging against registers."""
    copy = [r for r in page.record(COLLECTIVES_COPY)["rows"] if r["shape"]["bytes"] >= 256 << 20]
    staged = page.record(STAGING)
    big = [r for r in staged["rows"] if r["shape"]["bytes"] >= 32 << 20]
    by_op = {}
    for r in big:
        by_op.setdefault(r["shape"]["op"], []).append(time_over(r, "registers", "staged_smem"))
    gain = "; ".join(f"`{op}` {span(v, '{:.2f}', '×')}" for op, v in by_op.items())
    speed = span([time_over(r, "d2d_copy", "out_of_place") for r in copy], "{:.2f}", "×")
    return "\n".join([
        f"- {gpu(page, COLLECTIVES_COPY)}, one rank, float: `mkAllGather` at {speed} "
        f"the speed of a device-to-device copy of the same size at {copy[0]['shape']['bytes'] >> 20} MB – "
        f"{copy[-1]['shape']['bytes'] >> 30} GB {page.cite(COLLECTIVES_COPY)}.",
        f"- {gpu(page, STAGING)}, 2 ranks, out of place, 32 and 128 MB: time with loads into registers / time with "
        f"loads staged in "
        f"shared memory: {gain} {page.cite(STAGING)}.",
    ])


def inter_node(page):
    """docs/ops/inter_node.md: 4 ranks in 2 emulated nodes over loopback TCP on one GPU."""
    parts = []
    for op, key in (("ag_gemm", "rows"), ("gemm_rs", "m"), ("gemm_ar", "m")):
        rec = page.record(NODES[op])
        pts = [(r["shape"][key], time_over(r, "fused", "ours+mk_collective")) for r in rec["rows"]]
        at = f"{per([p[0] for p in pts], '{}')} rows per rank" if key == "rows" else f"M {per([p[0] for p in pts], '{}')}"
        parts.append(f"`{op}` {per([p[1] for p in pts])} at {at} {page.cite(NODES[op])}")
    coll = page.record(NODES["collectives"])
    # The note gives these to a tenth of a millisecond.
    times = ", ".join(f"`{r['shape']['op']}` {median(r, 'out_of_place') / 1e3:.1f} ms" for r in coll["rows"])
    return "\n".join([
        f"- {gpu(page, NODES['collectives'])}, 4 ranks in 2 emulated nodes (loopback TCP), bf16, fused time / unfused "
        f"(our GEMM and the "
        "hierarchical collective, one after the other): " + "; ".join(parts) + ".",
        f"- The collectives at 64 MB, out of place, same run: {times} {page.cite(NODES['collectives'])}; one loopback "
        "stream per proxy bounds them, not the kernels.",
    ])


def _dense_row(page):
    ratios = [p[1] for op in DENSE_2_RANKS for p in _dense_2_ranks(page, op)[3]]
    return (f"{gpu(page, DENSE_2_RANKS['gemm_rs'][0])}, 2 ranks as MPS processes: fused time "
            f"{span(ratios, '{:.2f}', '×')} the unfused (our GEMM and our collective, one after the other) "
            f"{page.cite(*(path for path, _ in DENSE_2_RANKS.values()))}")


def _moe_row(page):
    two = _moe_2_ranks(page)
    got = _moe_torch(page, "H200")
    d = [r for (_, k), r in got.items() if k == "dispatch"]
    c = [r for (_, k), r in got.items() if k == "combine"]
    tokens = sorted({t for t, _ in got})
    over = lambda rs, n: span([time_over(r, n, _ours(r)) for r in rs], "{:.2f}", "×")  # noqa: E731
    return (f"{gpu(page, MOE_2_RANKS)}, 2 ranks: fused time {two['dispatch']:.2f} / {two['combine']:.2f}× the "
            f"unfused (dispatch / combine) {page.cite(MOE_2_RANKS)}; {gpu(page, MOE_TORCH['H200'])}, one rank, "
            f"T {per(tokens, '{}').replace(' / ', ' and ')}: dispatch at {over(d, 'torch_gather_grouped_mm')} the speed "
            f"of gather + `torch._grouped_mm` and {over(d, 'torch_grouped_mm')} that of `torch._grouped_mm` alone on "
            f"rows already laid out, combine at {over(c, 'torch_grouped_mm_index_add')} grouped_mm + index_add and "
            f"{over(c, 'torch_grouped_mm')} grouped_mm alone {page.cite(MOE_TORCH['H200'])}")


def _attention_row(page):
    fwd = _attention_pairs(page)
    return (f"forward, {gpu(page, RING_ATTN[0])}, one rank: {span([f[2] / f[3] for f in fwd], '{:.2f}', '×')} "
            f"cuDNN's throughput {page.cite(*RING_ATTN)}; backward, {gpu(page, ATTENTION_BACKWARD_ONE_PASS[0])}, one "
            f"rank, one-pass engine: {span([b[2] for b in _attention_backward_one_pass(page)], '{:.2f}', '×')} cuDNN's "
            f"backward {page.cite(*ATTENTION_BACKWARD_ONE_PASS)}")


def _python_row(page):
    py = [_python(page, p) for p in PYTHON_OVERHEAD]
    host = lambda key, fmt: span([h[key]["median"] for _, h, _ in py], fmt)  # noqa: E731
    mlp = span([m["torch_matmul_plus_mkernel_collectives"]["median"] / m["fused_layers"]["median"] for _, _, m in py],
               "{:.2f}", "×")
    why = os.path.relpath("docs/python.md", page.dir or ".")
    return (f"{gpu(page, PYTHON_OVERHEAD[0])}, host µs per call of a 16 KB AllReduce: "
            f"{host('c_abi_ctypes', '{:.2f}')} through ctypes to the C ABI, {host('package_out', '{:.1f}')} through "
            f"`mkernel.all_reduce(out=)`, {host('torch_ops', '{:.1f}')} through `torch.ops` {page.cite(*PYTHON_OVERHEAD)}; "
            f"a tensor-parallel MLP step with the fused layers runs at {mlp} the speed of torch matmuls around "
            f"mkernel's collectives (slower; why: [docs/python.md]({why}#benchmark))")


def _status_rows(page):
    """(op, figure) rows shared by the README's status and the results index."""
    return [
        ("`mkGemm`", f"{gemm_h100(page)}; {gemm_h200(page)}"),
        ("`mkAllGather`, `mkReduceScatter`, `mkAllReduce`", all_reduce_small(page)),
        ("`mkAllGatherGemm`, `mkGemmReduceScatter`, `mkGemmAllReduce`", _dense_row(page)),
        ("`mkMoeDispatchGemm`, `mkMoeGemmCombine`", _moe_row(page)),
        ("`mkRingAttention`, `mkRingAttentionBackward`", _attention_row(page)),
        ("Python package", _python_row(page)),
    ]


def _table(rows_):
    return "\n".join(["| op | figure, beside the baseline of the same run |", "|---|---|"]
                     + [f"| {op} | {fig} |" for op, fig in rows_])


def status(page):
    """README.md's status: the newest figure of each op."""
    return _table(_status_rows(page))


def latest(page):
    """benches/results/README.md: the newest figures of each op, more of them than the README's."""
    extra = [("`mkAllGatherGemm` at 2 and 4 ranks", ag_gemm(page)),
             ("MoE at one rank beside torch, H100", moe_torch(page, "H100")),
             ("MoE's GEMM at one rank", moe_h100_engine(page)),
             ("TP MLP step through the Python layers", tp_mlp(page)),
             ("host µs per call", host_per_call(page)),
             ("collectives and dense fused ops, 2 emulated nodes", inter_node(page).replace("\n- ", " ").lstrip("- "))]
    return _table(_status_rows(page) + extra)


FIGURES = {f.__name__: f for f in (status, latest, gemm, gemm_split_k_wave, gemm_a_box, collectives, ag_gemm,
                                   gemm_rs, gemm_ar, moe, ring_attention, inter_node, host_per_call, python_gpu)}
