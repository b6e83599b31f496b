"""Attention at one rank: mkernel and torch's SDPA in one process, on the same tensors.

mkernel.ring_attention on a one-rank communicator (its layout, [B, S, H, D]) against
torch.nn.functional.scaled_dot_product_attention with the cuDNN and FlashAttention backends
on transposed views of the same tensors ([B, H, S, D], no copy), bf16, D = 128, random
inputs in [-1, 1). Directions: `fwd`, and with --backward also `fwd+bwd` (autograd of q, k
and v for a random dout) and `bwd` (torch.autograd.grad on one retained graph).

Before timing, each case checks every contender against cuDNN (its output, and with
--backward dq, dk, dv): the relative L2 error goes into the record (`rel_err_vs_cudnn`) and
one above 2e-2, or a non-finite value, fails the run. This is a sanity check of the
comparison; the float64 checks are the test suites' (mktest ring_attn, ring_attn_bwd).

TFLOP/s: forward 4·B·H·S²·D, backward 2.5 times that (FlashAttention's convention), both
halved when causal. The protocol is mkbench's (bench_record.interleaved).

    PYTHONPATH=<the wheel's site> python3 benches/attention_same_process.py [S ...]
        [--causal 1,0] [--heads 32] [--kv-heads 32] [--backward] [-w 3] [-n 10] [--blocks 5]
        [--rest-ms 0] [--json PATH]

Needs a CUDA GPU and the mkernel package; without a GPU it prints SKIPPED and exits 77.
"""
import argparse
import sys
import time

import bench_record

B, D = 1, 128
TOLERANCE = 2e-2
FLOP_FACTOR = {"fwd": 1.0, "fwd+bwd": 3.5, "bwd": 2.5}


def rel_l2(got, want):
    """||got - want|| / ||want|| over float64 copies; inf when got holds a non-finite value."""
    g, w = got.double(), want.double()
    if not bool(g.isfinite().all()):
        return float("inf")
    return float((g - w).norm() / w.norm().clamp_min(1e-300))


def row(seq, heads, kv_heads, causal, direction, results, errors):
    shape = {"ranks": 1, "seq": seq, "seq_per_rank": seq, "heads": heads, "kv_heads": kv_heads, "dim": D,
             "causal": int(causal), "direction": direction}
    return bench_record.row(shape, results, {name: {"rel_err_vs_cudnn": e} for name, e in errors.items()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("seqs", nargs="*", type=int, default=[8192, 16384, 32768])
    ap.add_argument("--causal", default="1,0", help="cases in this order, comma-separated")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    ap.add_argument("--backward", action="store_true", help="also time fwd+bwd and bwd alone")
    ap.add_argument("--rest-ms", type=int, default=0, help="idle time before each case")
    bench_record.add_protocol_args(ap)
    args = ap.parse_args()
    kv_heads = args.kv_heads or args.heads
    if args.iters < 1 or args.blocks < 1 or args.heads % kv_heads:
        ap.error("need -n >= 1, --blocks >= 1 and --kv-heads dividing --heads")

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA GPU")
        return 77
    import mkernel

    comm = mkernel.Communicator(unique_id=mkernel.get_unique_id(), rank=0, world_size=1, device=0)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    gqa = kv_heads != args.heads
    directions = ["fwd", "fwd+bwd", "bwd"] if args.backward else ["fwd"]
    print(f"# torch {torch.__version__}, mkernel {mkernel.__version__}: attention bf16 B={B} H={args.heads} "
          f"H_kv={kv_heads} D={D}, one process, the same tensors; warm-up {args.warmup} then {args.blocks} "
          f"interleaved blocks of {args.iters} calls (median), rest {args.rest_ms} ms")
    print(f"# {'S':>6} {'causal':>6} {'dir':>7} | {'contender':>28} {'ms':>8} {'TF/s':>7} {'p10 ms':>8} "
          f"{'p90 ms':>8} {'host us':>8} {'rel err':>8}  (rel err: against cuDNN)")
    rows, ok = [], True
    for causal in (c == "1" for c in args.causal.split(",")):
        for S in args.seqs:
            q = torch.rand(B, S, args.heads, D, device="cuda", dtype=torch.bfloat16) * 2 - 1
            k, v = (torch.rand(B, S, kv_heads, D, device="cuda", dtype=torch.bfloat16) * 2 - 1 for _ in range(2))
            dout = torch.rand_like(q) * 2 - 1
            for t in (q, k, v):
                t.requires_grad_(True)

            def mk(q, k, v):
                return mkernel.ring_attention(q, k, v, comm, causal=causal)[0]

            def sdpa(name):
                def f(q, k, v):
                    with sdpa_kernel(backends[name]):
                        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=causal, enable_gqa=gqa)
                    return o.transpose(1, 2)
                return f

            forwards = {"mkernel": mk, "sdpa_cudnn": sdpa("cudnn"), "sdpa_flash": sdpa("flash")}
            # The check: every contender's output (and gradients) against cuDNN's.
            errors, refused = {}, set()
            reference = None
            for name in ("sdpa_cudnn", "mkernel", "sdpa_flash"):
                try:
                    out = forwards[name](q, k, v)
                    grads = torch.autograd.grad(out, (q, k, v), dout) if args.backward else ()
                except Exception as e:  # noqa: BLE001 -- a backend that refuses the shape
                    refused.add(name)
                    print(f"  {S:>6} {int(causal):>6} | {name}: unavailable: {type(e).__name__}: {e}")
                    continue
                got = [out.detach(), *grads]
                if reference is None:
                    reference = got
                    continue
                errors[name] = max(rel_l2(a, b) for a, b in zip(got, reference))
                ok &= errors[name] <= TOLERANCE
            if reference is None:
                print(f"  {S:>6} {int(causal):>6} | no cuDNN reference: the case is not checked")
                ok = False
            live = {name: f for name, f in forwards.items() if name not in refused}
            for direction in directions:
                if args.rest_ms > 0:
                    torch.cuda.synchronize()
                    time.sleep(args.rest_ms / 1000)
                if direction == "fwd":
                    calls = {name: (lambda f=f: f(q.detach(), k.detach(), v.detach())) for name, f in live.items()}
                elif direction == "fwd+bwd":
                    calls = {name: (lambda f=f: torch.autograd.grad(f(q, k, v), (q, k, v), dout))
                             for name, f in live.items()}
                else:
                    graphs = {name: f(q, k, v) for name, f in live.items()}
                    calls = {name: (lambda o=o: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True))
                             for name, o in graphs.items()}
                results = bench_record.interleaved(calls, args.warmup, args.blocks, args.iters)
                results.update({name: None for name in refused})
                flops = 4 * B * args.heads * S * S * D * (0.5 if causal else 1.0) * FLOP_FACTOR[direction]
                bench_record.print_timed(f"{S:>6} {int(causal):>6} {direction:>7}", results, flops,
                                         {name: f"{e:.2e}" for name, e in errors.items()})
                rows.append(row(S, args.heads, kv_heads, causal, direction, results, errors))
    comm.close()
    if args.json:
        config = {"batch": B, "layout": "mkernel [B, S, H, D]; SDPA on transposed views of the same tensors",
                  **bench_record.protocol_config(args), "rest_ms": args.rest_ms,
                  "flops": "forward 4·B·H·S²·D, backward 2.5x, halved when causal",
                  "check": f"relative L2 against cuDNN (outputs, and gradients with --backward) <= {TOLERANCE}",
                  "torch": torch.__version__}
        bench_record.write(args.json, "attention_same_process", ok, config, rows)
    print("OK" if ok else "FAILED: a contender disagrees with cuDNN beyond the tolerance (see rel err)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
