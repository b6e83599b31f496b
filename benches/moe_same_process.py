"""MoE at one rank: mkernel's fused ops against torch._grouped_mm in one process.

The expert sizes of the GEMM targets (32 experts, hidden 7168, ffn 2048, top-k 8, bf16),
tokens routed uniformly at random to k distinct experts. Both directions at one rank, where
the exchange is a local permutation:
- `dispatch`: mkernel.moe_dispatch_gemm (rows grouped by expert, each expert's segment
  padded to 128 rows, times W1ᵀ) against torch's sequence: sort the (token, choice) pairs
  by expert, gather x, torch._grouped_mm with W1ᵀ (`torch_gather_grouped_mm`), and the
  grouped GEMM alone on the gathered rows (`torch_grouped_mm`);
- `combine`: mkernel.moe_gemm_combine (times W2ᵀ, weighted sum per token) against
  torch._grouped_mm with W2ᵀ then a weighted index_add_ in fp32 (`torch_grouped_mm_index_add`),
  and the grouped GEMM alone.
Two bounds in the same run, for where the time of a fused op goes: the same FLOPs as one
dense GEMM of every routed row with one expert's weights (`torch_dense_mm`: what the
tensor cores take for this work, no expert boundaries) and the rows' gather alone
(`torch_gather`: the copy a dispatch makes at one rank).
Before timing, each case checks mkernel against torch: recvCounts equal the per-expert
counts; per expert, the sum of its rows of y (order-free: mkernel orders rows within an
expert by arrival) and the combined output, relative L2 at most 2e-2.

TFLOP/s counts 2·T·k·hidden·ffn per direction (the rows routed, not the padding). The
protocol and record are mkbench's (bench_record).

    PYTHONPATH=<the wheel's site> python3 benches/moe_same_process.py [T ...] [--experts 32]
        [--hidden 7168] [--ffn 2048] [--topk 8] [-w 3] [-n 10] [--blocks 5] [--json PATH]

Needs a CUDA GPU, torch._grouped_mm (torch 2.8 and later) and the mkernel package; without
a GPU it prints SKIPPED and exits 77.
"""
import argparse
import sys

import bench_record

TOLERANCE = 2e-2


def row(tokens, experts, hidden, ffn, topk, direction, results, errors):
    shape = {"ranks": 1, "tokens": tokens, "experts": experts, "hidden": hidden, "ffn": ffn, "topk": topk,
             "direction": direction}
    return bench_record.row(shape, results, {name: {"rel_err_vs_torch": e} for name, e in errors.items()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tokens", nargs="*", type=int, default=[4096, 16384])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    bench_record.add_protocol_args(ap)
    args = ap.parse_args()
    if args.iters < 1 or args.blocks < 1 or not 1 <= args.topk <= args.experts:
        ap.error("need -n >= 1, --blocks >= 1 and 1 <= --topk <= --experts")

    import torch

    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA GPU")
        return 77
    import mkernel

    E, H, F, k = args.experts, args.hidden, args.ffn, args.topk
    # The dispatch keeps its receive buffer (capacity rows of H) and the counts in the
    # workspace: room for the largest batch's padded capacity, at most T·k + E·128 rows.
    most_rows = max(args.tokens) * k + E * 128
    workspace = max(256 << 20, most_rows * H * 2 + (1 << 20))
    comm = mkernel.Communicator(
        unique_id=mkernel.get_unique_id(), rank=0, world_size=1, device=0, workspace_bytes=workspace
    )
    dev, bf16 = "cuda", torch.bfloat16
    w1 = (torch.rand(E, F, H, device=dev, dtype=bf16) * 2 - 1) / H**0.5
    w2 = (torch.rand(E, H, F, device=dev, dtype=bf16) * 2 - 1) / F**0.5
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)  # [E, H, F], [E, F, H]: column-major views
    print(f"# torch {torch.__version__}, mkernel {mkernel.__version__}: MoE at one rank, E={E} H={H} F={F} "
          f"top-k {k}, bf16; warm-up {args.warmup} then {args.blocks} interleaved blocks of {args.iters} calls")
    print(f"# {'T':>6} {'dir':>8} | {'contender':>28} {'ms':>8} {'TF/s':>7} {'p10 ms':>8} {'p90 ms':>8} "
          f"{'host us':>8} {'rel err':>8}  (rel err: against torch)")
    rows, ok = [], True
    for T in args.tokens:
        x = torch.rand(T, H, device=dev, dtype=bf16) * 2 - 1
        idx = torch.rand(T, E, device=dev).topk(k, dim=1).indices.to(torch.int32)
        weights = torch.rand(T, k, device=dev, dtype=torch.float32)
        counts = torch.bincount(idx.flatten().long(), minlength=E)
        capacity = int(((counts + 127) // 128 * 128).sum())
        # torch's sequence: (token, choice) pairs sorted by expert.
        order = torch.argsort(idx.flatten(), stable=True)
        source_token = order // k
        offs = torch.cumsum(counts, 0).to(torch.int32)
        x_sorted = x[source_token]

        def mk_dispatch():
            return mkernel.moe_dispatch_gemm(x, idx, w1, comm, capacity)

        def torch_dispatch():
            return torch._grouped_mm(x[source_token], w1t, offs=offs)

        def torch_gemm1():
            return torch._grouped_mm(x_sorted, w1t, offs=offs)

        def torch_dense1():
            return torch.mm(x_sorted, w1t[0])

        def torch_gather():
            return x[source_token]

        # The check of the dispatch, order-free within an expert.
        d = mk_dispatch()
        y_ref = torch_gemm1()
        starts = mkernel.moe_segment_starts(d.recv_counts)
        mk_sums = torch.stack([d.y[int(starts[e]):int(starts[e]) + int(counts[e])].double().sum(0) for e in range(E)])
        ref_bounds = torch.cat([offs.new_zeros(1), offs]).long()
        ref_sums = torch.stack([y_ref[int(ref_bounds[e]):int(ref_bounds[e + 1])].double().sum(0) for e in range(E)])
        errors = {}
        same_counts = bool(torch.equal(d.recv_counts[:-1].long(), counts))
        errors["mkernel_dispatch_gemm"] = float((mk_sums - ref_sums).norm() / ref_sums.norm()) if same_counts else float("inf")

        # The combine on y itself (standing in for its activation), the same rows on both sides.
        y_act_mk, y_act_ref = d.y, y_ref
        weights_sorted = weights.flatten()[order]

        def mk_combine():
            return mkernel.moe_gemm_combine(y_act_mk, w2, weights, d.layout, comm)

        def torch_combine():
            z = torch._grouped_mm(y_act_ref, w2t, offs=offs)
            out = torch.zeros(T, H, device=dev, dtype=torch.float32)
            out.index_add_(0, source_token, z.float() * weights_sorted[:, None])
            return out.to(bf16)

        def torch_gemm2():
            return torch._grouped_mm(y_act_ref, w2t, offs=offs)

        def torch_dense2():
            return torch.mm(y_act_ref, w2t[0])

        out_mk, out_ref = mk_combine().double(), torch_combine().double()
        errors["mkernel_gemm_combine"] = (
            float((out_mk - out_ref).norm() / out_ref.norm()) if bool(out_mk.isfinite().all()) else float("inf")
        )
        ok &= all(e <= TOLERANCE for e in errors.values())
        flops = 2 * T * k * H * F
        for direction, calls in (
            ("dispatch", {"mkernel_dispatch_gemm": mk_dispatch, "torch_gather_grouped_mm": torch_dispatch,
                          "torch_grouped_mm": torch_gemm1, "torch_dense_mm": torch_dense1, "torch_gather": torch_gather}),
            ("combine", {"mkernel_gemm_combine": mk_combine, "torch_grouped_mm_index_add": torch_combine,
                         "torch_grouped_mm": torch_gemm2, "torch_dense_mm": torch_dense2}),
        ):
            results = bench_record.interleaved(calls, args.warmup, args.blocks, args.iters)
            bench_record.print_timed(f"{T:>6} {direction:>8}", results, flops,
                                     {name: f"{e:.2e}" for name, e in errors.items()}, no_flops=("torch_gather",))
            rows.append(row(T, E, H, F, k, direction, results, errors))
    comm.close()
    if args.json:
        config = {**bench_record.protocol_config(args),
                  "flops": "2·T·k·hidden·ffn per direction (routed rows, not padding)",
                  "check": f"per-expert row sums of y and the combined output against torch, relative L2 <= {TOLERANCE}",
                  "torch": torch.__version__}
        bench_record.write(args.json, "moe_same_process", ok, config, rows)
    print("OK" if ok else "FAILED: mkernel disagrees with torch beyond the tolerance (see rel err)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
