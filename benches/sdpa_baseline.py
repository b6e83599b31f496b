"""Single-GPU attention baseline for `mkbench ring_attn`: torch scaled_dot_product_attention
with the cuDNN and the FlashAttention-2 backends, forward, bf16, B=1 H=32 D=128, random
inputs, CUDA-event medians after warm-up. TFLOP/s = 4·B·H·S²·D / t (half of it causal).

    python3 benches/sdpa_baseline.py [S ...]
"""
import sys
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

seqs = [int(x) for x in sys.argv[1:]] or [8192, 16384, 32768]
B, H, D, iters, warmup = 1, 32, 128, 10, 3
print(f"# torch {torch.__version__} SDPA forward bf16 B={B} H={H} D={D}, median of {iters} after {warmup} warm-up")
print(f"# {'S':>6} {'causal':>6} | {'backend':>8} {'ms':>8} {'TF/s':>7}")
for causal in (False, True):
    for S in seqs:
        q, k, v = (torch.rand(B, H, S, D, device="cuda", dtype=torch.bfloat16) * 2 - 1 for _ in range(3))
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    for _ in range(warmup):
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    times = []
                    for _ in range(iters):
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
