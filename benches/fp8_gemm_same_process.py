"""The scaled fp8 GEMM: mkernel's mkScaledGemm against torch._scaled_mm (cuBLASLt) in one process.

C[M,N] = (A·sA)(B·sB)ᵀ with A [M,K] and B [N,K] in e4m3 (B passed to torch as the
column-major [K,N] view it requires), bf16 out, per scale mode:
- `tensor`: one fp32 scale each (torch: 0-dim scales);
- `rowwise`: one per row of A and of B (torch: scale_a [M,1], scale_b [1,N]);
- `block`: DeepSeek-V3's, A 1x128 and B 128x128 (torch: torch.nn.functional.scaled_mm with
  its Blockwise_1x128 and Blockwise_128x128 recipes, on the same scale memory: mkernel's
  [K/128, M] scale_a is torch's outer-dim-major (M, K/128), its [K/128, ceil(N/128)]
  scale_b torch's for the [K, N] operand). Where torch has no such recipe on this device,
  its contender is recorded as not run.
Shapes: the GEMM table's large shapes and its decode rows (M in {1, 16, 64, 128, 256}
against the (N, K) of a large model's projections), as `mkbench gemm` runs them in bf16.
Inputs: uniform [-1, 1) quantized as a user does (amax to 448, per tensor or per row).
Before timing, each case checks mkernel against torch: relative L2 at most 1e-2 (both round
to bf16 from fp32 sums; they differ in summation order) and no NaN.

TFLOP/s counts 2·M·N·K. The protocol and record are mkbench's (bench_record); the record's
bench is `fp8_gemm` and benches/targets.py judges it (fp8_gemm_large, fp8_gemm_decode).

    PYTHONPATH=<the wheel's site> python3 benches/fp8_gemm_same_process.py [--mode tensor|rowwise|block|all]
        [--shape MxNxK ...] [-w 3] [-n 10] [--blocks 5] [--json PATH]

Needs a CUDA GPU with fp8 (sm_89 or later; mkernel's kernels need sm_90), torch with
torch.float8_e4m3fn and the mkernel package; without a GPU it prints SKIPPED and exits 77.
"""
import argparse
import ctypes
import sys

import bench_record

LARGE = ((4096, 4096, 4096), (8192, 8192, 8192), (8192, 28672, 8192), (16384, 8192, 8192), (8192, 8192, 28672))
DECODE_M = (1, 16, 64, 128, 256)
DECODE_NK = ((8192, 8192), (28672, 8192), (8192, 28672))
TOLERANCE = 1e-2
E4M3_MAX = 448.0


def default_shapes():
    shapes = list(LARGE)
    for n, k in DECODE_NK:
        for m in DECODE_M:
            shapes.append((m, n, k))
    return shapes


def parse_shape(text):
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--shape takes MxNxK, not {text!r}")
    return tuple(int(p) for p in parts)


def quantize(x, mode, side):
    """(e4m3 tensor, fp32 scales in mkernel's layout) of x [rows, K]: per tensor one scale,
    rowwise one per row ([rows, 1]), block one per row per 128 of K for A ([K/128, rows]) or
    per 128 x 128 block for B ([K/128, ceil(rows/128)])."""
    import torch

    rows, k = x.shape
    if mode == "tensor":
        scale = (x.abs().amax().float() / E4M3_MAX).clamp(min=1e-12)
        return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale
    if mode == "rowwise":
        scale = (x.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp(min=1e-12)
        return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale
    kb = k // 128
    if side == "a":
        scale = (x.view(rows, kb, 128).abs().amax(dim=2) / E4M3_MAX).clamp(min=1e-12)  # [rows, K/128]
        q = (x.view(rows, kb, 128) / scale.unsqueeze(2)).view(rows, k)
    else:
        nb = -(-rows // 128)
        padded = torch.nn.functional.pad(x, (0, 0, 0, nb * 128 - rows))
        scale = (padded.view(nb, 128, kb, 128).abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)  # [nb, K/128]
        q = (padded.view(nb, 128, kb, 128) / scale.view(nb, 1, kb, 1)).view(nb * 128, k)[:rows]
    return q.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale.t().contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("tensor", "rowwise", "block", "all"), default="all")
    ap.add_argument("--shape", type=parse_shape, action="append")
    bench_record.add_protocol_args(ap)
    args = ap.parse_args()
    if args.iters < 1 or args.blocks < 1:
        ap.error("need -n >= 1 and --blocks >= 1")

    import torch

    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA GPU")
        return 77
    from mkernel import _lib

    lib = _lib.library()
    modes = ("tensor", "rowwise", "block") if args.mode == "all" else (args.mode,)
    functional = torch.nn.functional
    recipes = getattr(functional, "ScalingType", None)
    shapes = args.shape or default_shapes()
    e4m3, bf16 = _lib.DTYPE_CODES["float8e4m3"], _lib.DTYPE_CODES["bfloat16"]
    print(f"# torch {torch.__version__}: C = (A·sA)(B·sB)ᵀ, e4m3 in, bf16 out; {torch.cuda.get_device_name()}")
    print("  shape                  mode    |                  contender   median ms    TF/s    p10 ms   p90 ms  host us")
    rows, ok = [], True
    for m, n, k in shapes:
        for mode in modes:
            if mode == "block" and k % 128:
                continue
            gen = torch.Generator(device="cuda").manual_seed(m * 7 + n * 13 + k)
            x = torch.rand(m, k, device="cuda", generator=gen) * 2 - 1
            w = torch.rand(n, k, device="cuda", generator=gen) * 2 - 1
            a, sa = quantize(x, mode, "a")
            b, sb = quantize(w, mode, "b")  # [N, K] row-major: K-major, as both contenders read it
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            # torch's conventions: scale_b [1, N] for rowwise, 0-dim for a tensor.
            sa_t, sb_t = (sa, sb.reshape(1, n)) if mode == "rowwise" else (sa, sb)
            sa_flat, sb_flat = sa.reshape(-1).contiguous(), sb.reshape(-1).contiguous()
            stream = _lib.mkStream_t(torch.cuda.current_stream().cuda_stream)
            mode_code = _lib.SCALE_MODE_CODES[mode]

            def mkernel_call():
                code = lib.mkScaledGemm(
                    a.data_ptr(), _lib.as_ptr(sa_flat.data_ptr(), ctypes.c_float), b.data_ptr(),
                    _lib.as_ptr(sb_flat.data_ptr(), ctypes.c_float), c.data_ptr(), m, n, k, e4m3, bf16, mode_code,
                    stream)
                if code != 0:
                    raise RuntimeError(f"mkScaledGemm: {code}: {lib.mkGetLastError(None).decode()}")

            def torch_call():
                if mode == "block":
                    if recipes is None:
                        raise RuntimeError("torch.nn.functional has no ScalingType (blockwise scaled_mm)")
                    return functional.scaled_mm(
                        a, b.t(), sa.t(), recipes.Blockwise_1x128, sb, recipes.Blockwise_128x128,
                        output_dtype=torch.bfloat16)
                return torch._scaled_mm(a, b.t(), scale_a=sa_t, scale_b=sb_t, out_dtype=torch.bfloat16)

            notes = {}
            c.fill_(float("nan"))
            mkernel_call()
            try:
                want = torch_call().float()
                got = c.float()
                finite = bool(torch.isfinite(got).all())
                err = float((got - want).norm() / want.norm().clamp(min=1e-30)) if finite else float("inf")
                notes = {"mkernel_scaled_gemm": {"rel_err_vs_torch": err}}
                if not err <= TOLERANCE:
                    ok = False
                    print(f"  {m}x{n}x{k} {mode}: WRONG: relative L2 {err:.3g} vs torch._scaled_mm (limit {TOLERANCE})")
            except (RuntimeError, TypeError, AttributeError) as e:
                print(f"  {m}x{n}x{k} {mode}: torch's scaled mm unavailable here: {e}")
            results = bench_record.interleaved(
                {"mkernel_scaled_gemm": mkernel_call, "torch_scaled_mm": torch_call}, args.warmup, args.blocks, args.iters
            )
            label = f"{m:>5}x{n:>5}x{k:>5} {mode:<7}"
            bench_record.print_timed(label, results, 2.0 * m * n * k)
            shape = {"m": m, "n": n, "k": k, "mode": mode, "dtype": "e4m3"}
            rows.append(bench_record.row(shape, results, notes))
    config = {**bench_record.protocol_config(args), "modes": list(modes), "torch": torch.__version__}
    if args.json:
        bench_record.write(args.json, "fp8_gemm", ok, config, rows)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
