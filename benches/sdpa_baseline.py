"""Single-GPU attention baseline for `mkbench ring_attn` and `mkbench ring_attn_bwd`: torch
scaled_dot_product_attention with the cuDNN and the FlashAttention-2 backends, bf16 (or
fp16 with --dtype fp16), B=1, H=32 D=128 by default, random inputs in [-1, 1). Forward TFLOP/s = 4·B·H·S²·D / t (half of
it causal).

    python3 benches/sdpa_baseline.py [S ...] [--causal 0,1] [--backends cudnn,flash]
                                     [--heads 32] [--kv-heads 32] [--dim 128] [--backward]
                                     [--dtype bf16|fp16]
                                     [-w 3] [-n 10] [--blocks 5] [--rest-ms 0] [--json PATH]

--backward times, per backend, the backward alone (`torch.autograd.grad` of a forward kept
with its graph, dout random in [-1, 1)) and the forward + backward, as training runs them;
the backend is chosen for the forward, and autograd runs that backend's backward. FLOPs by
FlashAttention's convention: the backward 2.5 × the forward's, forward + backward 3.5 ×.
Its record is bench "sdpa_baseline_bwd", rows keyed as `mkbench ring_attn_bwd`'s one-rank
rows (ranks, seq, seq_per_rank, heads, kv_heads, dim, causal, dtype), contenders
sdpa_<backend>_backward and sdpa_<backend>_forward+backward. --kv-heads below --heads
(grouped-query attention, torch's enable_gqa) needs --backward. A backend that refuses a
case (not built in, or not for this shape or GPU) is recorded with a null time and its
error printed.

The protocol is mkbench's (docs/benchmarks.md, benches/bench_record.py): per case, -w
warm-up calls per backend, then --blocks blocks in which every backend, in an order rotated
by one per block, makes -n calls, each timed by its own pair of CUDA events and synchronised
once per block; the median with p10 / p90, and the host's time to enqueue one call. --json PATH writes the run's
record in mkbench's schema (mkbench/1): bench "sdpa_baseline", one row per case with the
shape keys of `mkbench ring_attn`'s one-rank rows (ranks, seq, seq_per_rank, heads, dim,
causal, dtype: "bf16" or "fp16", as mkbench's --dtype names it) and one contender per backend (sdpa_cudnn, sdpa_flash). The tensors are torch's
[B, H, S, D]; mkbench's kernels take [S, H, D] (config.layout says so).

The H200 lowers its clocks under sustained attention (power), so a case measured after
long ones reads slower. For a fair comparison with `mkbench ring_attn` give both the same
case order (--causal 1,0 runs the causal cases first), warm-up, blocks and calls, and the
same idle time before each case (--rest-ms; mkbench takes --rest-ms and --unfused 0).
The record-building functions need no torch (scripts/test-bench.sh checks them on a CPU).
"""
import argparse
import json
import sys
import time

import bench_record
from bench_record import stats

B, H, D = 1, 32, 128
# The element types, by the names mkbench's --dtype takes (and records carry).
DTYPES = ("bf16", "fp16")


def row(seq, causal, results, heads=H, dim=D, kv_heads=None, dtype="bf16"):
    """One case: `results` maps a contender (a backend, or `<backend>_backward` and
    `<backend>_forward+backward`) to (GPU µs samples, host µs samples), or to None where the
    backend refused the case. The shape is `mkbench ring_attn`'s one-rank rows', and with
    `kv_heads` `mkbench ring_attn_bwd`'s; `dtype` is one of DTYPES."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {DTYPES}")
    contenders = [bench_record.contender(f"sdpa_{key}", r) for key, r in results.items()]
    shape = {"ranks": 1, "seq": seq, "seq_per_rank": seq, "heads": heads, "dim": dim, "causal": int(causal)}
    if kv_heads is not None:
        shape["kv_heads"] = kv_heads
    shape["dtype"] = dtype
    return {"shape": shape, "contenders": contenders}


def record(ok, config, rows, torch_version=None, backward=False):
    """The whole record (docs/benchmarks.md): bench "sdpa_baseline", or with `backward`
    "sdpa_baseline_bwd"."""
    cfg = {"batch": B, "layout": "torch SDPA [B, H, S, D]; mkbench ring_attn takes [S, H, D]", **config}
    if backward:
        cfg["flops"] = "backward 2.5 x and forward+backward 3.5 x the forward's 4*B*H*S^2*D, half when causal"
    if torch_version:
        cfg["torch"] = torch_version
    return bench_record.record("sdpa_baseline_bwd" if backward else "sdpa_baseline", ok, cfg, rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("seqs", nargs="*", type=int, default=[8192, 16384, 32768])
    ap.add_argument("--causal", default="0,1", help="cases in this order, comma-separated")
    ap.add_argument("--backends", default="cudnn,flash")
    ap.add_argument("--heads", type=int, default=H)
    ap.add_argument("--kv-heads", type=int, help="K/V heads (default: --heads); fewer needs --backward")
    ap.add_argument("--dim", type=int, default=D)
    ap.add_argument("--backward", action="store_true", help="time the backward and the forward + backward")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16", help="the tensors' type (default bf16)")
    ap.add_argument("--rest-ms", type=int, default=0, help="idle time before each case")
    bench_record.add_protocol_args(ap)
    args = ap.parse_args()
    if args.iters < 1 or args.blocks < 1:
        ap.error("need -n >= 1 and --blocks >= 1")
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if kv_heads < 1 or args.heads % kv_heads:
        ap.error(f"--kv-heads {kv_heads} must divide --heads {args.heads}")
    if kv_heads != args.heads and not args.backward:
        ap.error("--kv-heads below --heads needs --backward (mkbench ring_attn's rows have no kv_heads)")

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    known = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    names = args.backends.split(",")
    unknown = [b for b in names if b not in known]
    if unknown:
        ap.error(f"unknown backend(s) {unknown}: cudnn, flash")
    heads, dim = args.heads, args.dim
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    what = "forward and backward" if args.backward else "forward"
    print(f"# torch {torch.__version__} SDPA {what} {args.dtype} B={B} H={heads} H_kv={kv_heads} D={dim}, warm-up "
          f"{args.warmup} then {args.blocks} interleaved blocks of {args.iters} calls (median), rest {args.rest_ms} ms")
    if args.backward:
        print("# TF/s: backward 2.5 x, forward+backward 3.5 x the forward's 4·B·H·S²·D, half when causal")
    print(f"# {'S':>6} {'causal':>6} | {'contender':>22} {'ms':>8} {'TF/s':>7} {'p10 ms':>8} {'p90 ms':>8} {'host us':>8}")
    rows = []
    for causal in (c == "1" for c in args.causal.split(",")):
        for S in args.seqs:
            def rand(h, grad=False):
                x = torch.rand(B, h, S, dim, device="cuda", dtype=torch_dtype) * 2 - 1
                return x.requires_grad_(grad)

            q, k, v = rand(heads, args.backward), rand(kv_heads, args.backward), rand(kv_heads, args.backward)
            gqa = {"enable_gqa": True} if kv_heads != heads else {}

            def forward(name):
                with sdpa_kernel(known[name]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)

            # Per contender: its call, and the factor of the forward's FLOPs it does.
            calls = {}
            for name in names:
                if not args.backward:
                    calls[name] = ((lambda name=name: forward(name)), 1.0)
                    continue
                dout = rand(heads)
                kept = {}

                def backward(name=name, dout=dout, kept=kept):
                    # The forward kept with its graph (made at the warm-up), as autograd keeps it.
                    if name not in kept:
                        kept[name] = forward(name)
                    torch.autograd.grad(kept[name], (q, k, v), dout, retain_graph=True)

                def forward_backward(name=name, dout=dout):
                    torch.autograd.grad(forward(name), (q, k, v), dout)

                calls[f"{name}_backward"] = (backward, 2.5)
                calls[f"{name}_forward+backward"] = (forward_backward, 3.5)
            if args.rest_ms > 0:
                torch.cuda.synchronize()
                time.sleep(args.rest_ms / 1000)
            results = bench_record.interleaved({key: call for key, (call, _) in calls.items()}, args.warmup,
                                               args.blocks, args.iters)
            usable = [key for key, r in results.items() if r is not None]
            flops = 4 * B * heads * S * S * dim * (0.5 if causal else 1.0)
            for key in usable:
                s = stats(results[key][0])
                ms = s["median_us"] / 1e3
                print(f"  {S:>6} {int(causal):>6} | {key:>22} {ms:>8.3f} {calls[key][1] * flops / ms / 1e9:>7.1f} "
                      f"{s['p10_us'] / 1e3:>8.3f} {s['p90_us'] / 1e3:>8.3f} {stats(results[key][1])['median_us']:>8.1f}")
            rows.append(row(S, causal, results, heads, dim, kv_heads if args.backward else None, args.dtype))
            del q, k, v, calls
    if args.json:
        config = {"warmup": args.warmup, "blocks": args.blocks, "iters": args.iters, "rest_ms": args.rest_ms,
                  "backends": names, "dtype": args.dtype}
        with open(args.json, "w") as f:
            json.dump(record(True, config, rows, torch.__version__, args.backward), f)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
