"""Single-GPU attention baseline for `mkbench ring_attn`: torch scaled_dot_product_attention
with the cuDNN and the FlashAttention-2 backends, forward, bf16, B=1 H=32 D=128, random
inputs, CUDA-event medians after warm-up. TFLOP/s = 4·B·H·S²·D / t (half of it causal).

    python3 benches/sdpa_baseline.py [S ...] [--causal 0,1] [--backends cudnn,flash]
                                     [-w 3] [-n 10] [--rest-ms 0]

The H200 lowers its clocks under sustained attention (power), so a case measured after
long ones reads slower. For a fair comparison with `mkbench ring_attn` give both the same
case order (--causal 1,0 runs the causal cases first), warm-up and iterations, and the
same idle time before each case (--rest-ms; mkbench takes --rest-ms and --unfused 0).
"""
import argparse
import time
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("seqs", nargs="*", type=int, default=[8192, 16384, 32768])
ap.add_argument("--causal", default="0,1", help="cases in this order, comma-separated")
ap.add_argument("--backends", default="cudnn,flash")
ap.add_argument("-w", dest="warmup", type=int, default=3)
ap.add_argument("-n", dest="iters", type=int, default=10)
ap.add_argument("--rest-ms", type=int, default=0, help="idle time before each case")
args = ap.parse_args()
backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
B, H, D = 1, 32, 128
print(f"# torch {torch.__version__} SDPA forward bf16 B={B} H={H} D={D}, median of {args.iters} after {args.warmup} warm-up, rest {args.rest_ms} ms")
print(f"# {'S':>6} {'causal':>6} | {'backend':>8} {'ms':>8} {'TF/s':>7}")
for causal in (c == "1" for c in args.causal.split(",")):
    for S in args.seqs:
        q, k, v = (torch.rand(B, H, S, D, device="cuda", dtype=torch.bfloat16) * 2 - 1 for _ in range(3))
        for name in args.backends.split(","):
            try:
                if args.rest_ms > 0:
                    torch.cuda.synchronize()
                    time.sleep(args.rest_ms / 1000)
                with sdpa_kernel(backends[name]):
                    for _ in range(args.warmup):
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    times = []
                    for _ in range(args.iters):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        b.record()
                        torch.cuda.synchronize()
                        times.append(a.elapsed_time(b))
                ms = sorted(times)[len(times) // 2]
                flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
                print(f"  {S:>6} {int(causal):>6} | {name:>8} {ms:>8.3f} {flops / ms / 1e9:>7.1f}")
            except Exception as e:  # a backend that does not take this shape
                print(f"  {S:>6} {int(causal):>6} | {name:>8} unavailable: {type(e).__name__}: {e}")
