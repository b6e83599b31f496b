#!/usr/bin/env python3
"""Standalone check and benchmark of the GEMM engine's entry kernels, without the Rust
library: drives build/gemm_standalone/libmkgemm_standalone.so through ctypes, with torch
for inputs, references (float64 on the CPU, fp32 on the GPU) and the cuBLAS baseline
(torch.matmul in the same process).

  python3 scripts/gemm_standalone/check.py [--check] [--bench] [--out DIR]

Prints one line per check (OK/FAIL) and a table; exit status 1 if any check failed.
"""
import argparse, ctypes, json, math, os, statistics, sys, time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
LIB = os.path.join(HERE, "..", "..", "build", "gemm_standalone", "libmkgemm_standalone.so")
DT = {"bf16": (0, torch.bfloat16), "fp16": (1, torch.float16)}


def load():
    lib = ctypes.CDLL(LIB)
    lib.mk_standalone_gemm.restype = ctypes.c_int
    lib.mk_standalone_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 8 + [ctypes.c_void_p]
    return lib


def launch(lib, A, B, C, dt, bn, tma, group, ctas):
    M, K = A.shape
    N = B.shape[0]
    r = lib.mk_standalone_gemm(A.data_ptr(), B.data_ptr(), C.data_ptr(), M, N, K, DT[dt][0], bn, tma, group, ctas,
                               torch.cuda.current_stream().cuda_stream)
    if r != 0:
        raise RuntimeError(f"launch failed: {r}")


def plan_group(M, N, bn, sms):
    tm, tn = (M + 127) // 128, (N + bn - 1) // bn
    # Balance A rows and B rows resident in one wave: g*128 ~ (sms/g)*bn.
    g = max(1, round(math.sqrt(sms * bn / 128)))
    return max(1, min(g, tm))


def rel_err(out, ref):
    out = out.double()
    return (torch.linalg.norm(out - ref) / torch.linalg.norm(ref)).item()


def check(lib, sms):
    fails = 0
    small = [(1, 1, 8), (129, 257, 72), (1000, 3000, 520), (77, 136, 8), (300, 64, 1000), (256, 512, 64),
             (513, 1000, 4096), (64, 8, 24)]
    large = [(4096, 4096, 4096), (2048, 8192, 8192), (333, 8192, 2056)]
    g = torch.Generator(device="cpu").manual_seed(1234)
    for dt in ("bf16", "fp16"):
        tol = 1e-2 if dt == "bf16" else 2e-3
        for (M, N, K) in small + large:
            A = torch.randn(M, K, generator=g).to(DT[dt][1]).cuda()
            B = torch.randn(N, K, generator=g).to(DT[dt][1]).cuda()
            if (M, N, K) in small:
                ref = (A.cpu().double() @ B.cpu().double().T).cuda()
            else:
                ref = (A.float() @ B.float().T).double()
            for bn in (256, 128, 64):
                for tma in (1, 0):
                    if tma and N % 8:
                        continue
                    for ctas in (sms, 7):
                        C = torch.empty(M, N, dtype=DT[dt][1], device="cuda")
                        C.view(torch.int16).fill_(-1)  # 0xFFFF: NaN in bf16 and fp16
                        launch(lib, A, B, C, dt, bn, tma, plan_group(M, N, bn, sms), ctas)
                        torch.cuda.synchronize()
                        out = C
                        nan = torch.isnan(out).any().item()
                        e = rel_err(out, ref) if not nan else float("nan")
                        ok = (not nan) and e <= tol
                        fails += 0 if ok else 1
                        print(f"{'OK  ' if ok else 'FAIL'} {dt} M={M} N={N} K={K} bn={bn} "
                              f"epi={'tma' if tma else 'direct'} ctas={ctas} rel_err={e:.2e}", flush=True)
    return fails


def hooks(lib, sms):
    """The fusion hooks together: rank-rotated order, A-row flag waits (flags released late
    by the copy engine on another stream), TMA reduce-add into C, per-tile flags."""
    lib.mk_standalone_hooks_test.restype = ctypes.c_int
    lib.mk_standalone_hooks_test.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 7 + [ctypes.c_void_p]
    fails = 0
    g = torch.Generator(device="cpu").manual_seed(99)
    for (M, N, K, ctas, late) in [(1000, 768, 520, sms, False), (4096, 4096, 1024, sms, True), (777, 520, 64, 3, True)]:
        A = torch.randn(M, K, generator=g).bfloat16().cuda()
        B = torch.randn(N, K, generator=g).bfloat16().cuda()
        C0 = torch.randn(M, N, generator=g).bfloat16().cuda()
        C = C0.clone()
        rows_per_flag = 256
        nflags = (M + rows_per_flag - 1) // rows_per_flag
        tiles_m, tiles_n = (M + 127) // 128, (N + 255) // 256
        a_flags = torch.zeros(nflags, dtype=torch.int64, device="cuda")
        tile_flags = torch.zeros(tiles_m * tiles_n, dtype=torch.int64, device="cuda")
        ones = torch.ones(nflags, dtype=torch.int64).pin_memory()
        if not late:
            a_flags.fill_(1)
        torch.cuda.synchronize()
        # Both streams non-blocking; the late flags come from the host through the copy
        # engine (no SM needed while every SM holds a waiting GEMM CTA).
        main, side = torch.cuda.Stream(), torch.cuda.Stream()
        r = lib.mk_standalone_hooks_test(A.data_ptr(), B.data_ptr(), C.data_ptr(), a_flags.data_ptr(),
                                         tile_flags.data_ptr(), M, N, K, 4, tiles_m // 2, rows_per_flag,
                                         min(ctas, tiles_m * tiles_n), main.cuda_stream)
        if r != 0:
            raise RuntimeError(f"hooks launch failed: {r}")
        if late:
            time.sleep(0.005)
            with torch.cuda.stream(side):
                a_flags.copy_(ones, non_blocking=True)
        torch.cuda.synchronize()
        ref = C0.double() + A.double() @ B.double().T
        e = rel_err(C, ref)
        flags_ok = bool((tile_flags == 2).all().item())
        ok = (not torch.isnan(C).any().item()) and e <= 1e-2 and flags_ok
        fails += 0 if ok else 1
        print(f"{'OK  ' if ok else 'FAIL'} hooks M={M} N={N} K={K} ctas={ctas} late_flags={late} "
              f"rel_err={e:.2e} tile_flags_all_2={flags_ok}", flush=True)
    return fails


def bench(lib, sms, out_dir):
    shapes = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 28672, 8192), (16384, 8192, 8192),
              (8192, 8192, 28672), (128, 8192, 8192), (512, 8192, 8192), (2048, 8192, 8192)]
    rows = []
    for dt in ("bf16", "fp16"):
        for (M, N, K) in shapes:
            set_bytes = (M * K + N * K) * 2
            nsets = max(2, math.ceil(200e6 / set_bytes))
            sets = [(torch.rand(M, K, device="cuda").sub_(0.5).to(DT[dt][1]),
                     torch.rand(N, K, device="cuda").sub_(0.5).to(DT[dt][1])) for _ in range(nsets)]
            C = torch.empty(M, N, dtype=DT[dt][1], device="cuda")
            cands = []
            for bn in (256, 128, 64):
                tiles = ((M + 127) // 128) * ((N + bn - 1) // bn)
                if bn < 256 and tiles > 2 * sms:
                    continue
                gp = plan_group(M, N, bn, sms)
                for grp in sorted({gp, 8}):
                    cands.append((f"bn{bn}_g{grp}", bn, grp))
            fns = {"cublas": lambda i: torch.matmul(sets[i][0], sets[i][1].t(), out=C)}
            for name, bn, grp in cands:
                fns[name] = (lambda bn, grp: lambda i: launch(lib, sets[i][0], sets[i][1], C, dt, bn, 1, grp, sms))(bn, grp)
            flops = 2.0 * M * N * K
            inner = max(3, min(50, int(2e-3 / (flops / 700e12)) + 1))
            times = {k: [] for k in fns}
            for k, f in fns.items():  # warm-up
                for i in range(inner * 2):
                    f(i % nsets)
            torch.cuda.synchronize()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for rep in range(9):
                for k, f in fns.items():
                    ev0.record()
                    for i in range(inner):
                        f(i % nsets)
                    ev1.record()
                    ev1.synchronize()
                    times[k].append(ev0.elapsed_time(ev1) / inner * 1e-3)
            med = {k: statistics.median(v) for k, v in times.items()}
            best = min((k for k in med if k != "cublas"), key=lambda k: med[k])
            row = {"dtype": dt, "M": M, "N": N, "K": K, "cublas_tflops": flops / med["cublas"] / 1e12,
                   "ours_best": best, "ours_tflops": flops / med[best] / 1e12,
                   "variants": {k: flops / v / 1e12 for k, v in med.items()}}
            row["ratio"] = row["ours_tflops"] / row["cublas_tflops"]
            rows.append(row)
            print(f"{dt} {M:>6}x{N:>6}x{K:>6}  cublas {row['cublas_tflops']:7.1f}  ours {row['ours_tflops']:7.1f} "
                  f"({best})  ratio {row['ratio']:.3f}   " +
                  " ".join(f"{k}={v:.0f}" for k, v in row["variants"].items()), flush=True)
            del sets
            torch.cuda.empty_cache()
    for dt in ("bf16", "fp16"):
        r = [x["ratio"] for x in rows if x["dtype"] == dt]
        big = r[:5]
        print(f"{dt}: geomean(large 5) = {math.exp(sum(map(math.log, big)) / 5):.3f}  min(all) = {min(r):.3f}")
    if out_dir:
        with open(os.path.join(out_dir, "gemm_standalone_bench.json"), "w") as f:
            json.dump(rows, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--hooks", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIPPED: no GPU")
        return 0
    lib = load()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fails = 0
    if a.hooks:
        fails += hooks(lib, sms)
        print(f"hooks: {'OK' if fails == 0 else f'FAILED ({fails})'}", flush=True)
    if a.check or not (a.bench or a.hooks):
        fails += check(lib, sms)
        print(f"checks: {'OK' if fails == 0 else f'FAILED ({fails})'}", flush=True)
    if a.bench:
        bench(lib, sms, a.out)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
