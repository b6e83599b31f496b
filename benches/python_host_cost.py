"""Host time per call that the mkernel Python package adds, measured on a CPU.

What a call costs on the host before the library's C function runs: the argument checks,
the communicator lookup, the output allocations, the torch.library dispatch, the stream
lookup and the ctypes call itself. Everything below the Python package is replaced by a
stand-in that does no work, so the numbers are the package's own:

- libmkernel.so is a stub library built here with the C compiler (`cc`): one function per
  declaration of mkernel._lib, each returning mkSuccess (mkMoeLayoutBytes writes a size).
  The package loads it through MKERNEL_LIBRARY with its real ctypes declarations, so the
  ctypes marshalling of every argument is measured, the C work is not.
- The CUDA calls torch makes for the current stream (torch._C._cuda_getCurrentRawStream,
  torch.cuda.current_stream) return stream 0 without touching a device.
- The communicator is a real mkernel.Communicator over the stub library (one rank,
  device 0), whose `torch_device` is the CPU: the tensors live in host memory, so the
  device checks compare against the CPU and the outputs come from torch's CPU allocator
  (a few hundred ns per tensor below the CUDA caching allocator's cost; every output
  here is under 32 MB, so glibc serves it from its heap, not from mmap).

Cases (sizes of benches/python_overhead.py, benches/moe_same_process.py at E=32 H=7168
F=2048 top-k 8, and benches/attention_same_process.py at B=1 H=32 D=128; the Python path
does not depend on the sizes, the tokens and sequence are kept small to keep the
allocations off mmap):

- all_reduce 16 KB fp32: the ctypes call alone with precomputed arguments (the floor),
  `mkernel.all_reduce(x, comm, out=y)`, `mkernel.all_reduce(x, comm)` and
  `torch.ops.mkernel.all_reduce(x, name, "sum")`;
- moe_dispatch_gemm and moe_gemm_combine through the public functions, and through
  torch.ops.mkernel directly;
- ring_attention forward through the public function, on inputs that do not require
  grad and on inputs that do (as benches/attention_same_process.py times it: the forward
  then records the autograd node for the backward).

Each case runs --calls calls per block, in --blocks blocks interleaved over the cases
(ABC…ABC…, the order rotated each block); the report gives the median µs per call over
the blocks with p10 and p90. --profile CASE prints cProfile's top functions for one case.

    python3 benches/python_host_cost.py [--calls 2000] [--blocks 15] [--json PATH] [--profile CASE]

Needs torch (its CPU side is enough: no GPU, no CUDA driver) and a C compiler; without a
compiler it prints SKIPPED and exits 77. What it cannot measure is what the stand-ins
replace: the C functions' own time (benches/python_overhead.py measures the ctypes call
to the real library on a GPU), CUDA's stream lookup and the CUDA caching allocator.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# C stand-ins for the declarations whose results or out-arguments the package reads; every
# other declared function becomes `int name(void) { return 0; }` (mkSuccess; the System V
# ABI lets a caller pass arguments such a function ignores).
SPECIAL_STUBS = {
    "mkGetErrorString": 'const char *mkGetErrorString(int code) { (void)code; return "stub"; }',
    "mkGetLastError": 'const char *mkGetLastError(void *comm) { (void)comm; return ""; }',
    "mkCommInitRankConfig": "int mkCommInitRankConfig(void **comm) { *comm = (void *)0x1000; return 0; }",
    "mkCommInitRank": "int mkCommInitRank(void **comm) { *comm = (void *)0x1000; return 0; }",
    # The layout size of include/mkernel.h: 4·(4 + 3·tokens·topk + 6·recvCapacity/128 + 1025).
    "mkMoeLayoutBytes": (
        "int mkMoeLayoutBytes(size_t tokens, size_t topk, size_t recv_capacity, size_t *bytes) {\n"
        "  *bytes = 4 * (4 + 3 * tokens * topk + 6 * (recv_capacity / 128) + 1025);\n"
        "  return 0;\n"
        "}"
    ),
}


def build_stub_library(names, directory: Path) -> Path:
    """Compiles a libmkernel.so stand-in with a no-op function for each of `names`."""
    lines = ["#include <stddef.h>"]
    for name in names:
        lines.append(SPECIAL_STUBS.get(name, f"int {name}(void) {{ return 0; }}"))
    source = directory / "mkernel_stub.c"
    source.write_text("\n".join(lines) + "\n")
    library = directory / "libmkernel_stub.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


class CpuStream:
    """What torch.cuda.current_stream returns, as far as a launch reads it."""

    cuda_stream = 0


def stub_cuda_streams(torch) -> None:
    """The current stream is stream 0 of every device, found without CUDA."""
    if hasattr(torch._C, "_cuda_getCurrentRawStream"):
        torch._C._cuda_getCurrentRawStream = lambda device: 0
    torch.cuda.current_stream = lambda device=None: CpuStream


def cpu_communicator(torch, mkernel):
    """A one-rank mkernel.Communicator on the stub library whose tensors live on the CPU."""
    with contextlib.ExitStack() as patches:
        # The constructor asks torch for a GPU and selects the device around the init call.
        for name, value in (("is_available", lambda: True), ("device", lambda device: contextlib.nullcontext())):
            original = getattr(torch.cuda, name)
            setattr(torch.cuda, name, value)
            patches.callback(setattr, torch.cuda, name, original)
        comm = mkernel.Communicator(unique_id=bytes(128), rank=0, world_size=1, device=0, name="host-cost")
    comm.torch_device = torch.device("cpu")
    return comm


def cases(torch, mkernel, comm) -> dict:
    from mkernel import _lib

    bf16 = torch.bfloat16
    g = torch.Generator().manual_seed(20260)

    def rand(*shape, dtype=bf16):
        return torch.randn(*shape, generator=g).to(dtype)

    # AllReduce of 16 KB (benches/python_overhead.py).
    x = rand(4096, dtype=torch.float32)
    y = torch.empty_like(x)
    lib = _lib.library()
    raw_args = (
        x.data_ptr(),
        y.data_ptr(),
        x.numel(),
        _lib.DTYPE_CODES["float32"],
        _lib.REDOP_CODES["sum"],
        comm.handle(),
        _lib.mkStream_t(0),
    )

    # MoE at one rank, E=32 H=7168 F=2048 top-k 8 (benches/moe_same_process.py); w1 and w2
    # are allocated, never written (the stub reads nothing), so their pages stay untouched.
    experts, hidden, ffn, topk, tokens = 32, 7168, 2048, 8, 256
    capacity = 4096
    moe_x = rand(tokens, hidden)
    idx = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices.to(torch.int32)
    w1 = torch.empty(experts, ffn, hidden, dtype=bf16)
    w2 = torch.empty(experts, hidden, ffn, dtype=bf16)
    weights = torch.rand(tokens, topk, generator=g)
    dispatch = mkernel.moe_dispatch_gemm(moe_x, idx, w1, comm, capacity)
    y_act = rand(capacity, ffn)

    # Attention forward, B=1 H=32 D=128 (benches/attention_same_process.py).
    q, k, v = (rand(1, 512, 32, 128) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    name, n = comm.name, comm.world_size

    return {
        "all_reduce ctypes call alone": lambda: lib.mkAllReduce(*raw_args),
        "all_reduce out=": lambda: mkernel.all_reduce(x, comm, out=y),
        "all_reduce": lambda: mkernel.all_reduce(x, comm),
        "torch.ops all_reduce": lambda: torch.ops.mkernel.all_reduce(x, name, "sum"),
        "moe_dispatch_gemm": lambda: mkernel.moe_dispatch_gemm(moe_x, idx, w1, comm, capacity),
        "torch.ops moe_dispatch_gemm": lambda: torch.ops.mkernel.moe_dispatch_gemm(moe_x, idx, w1, name, n, capacity),
        "moe_gemm_combine": lambda: mkernel.moe_gemm_combine(y_act, w2, weights, dispatch.layout, comm),
        "torch.ops moe_gemm_combine": lambda: torch.ops.mkernel.moe_gemm_combine(
            y_act, w2, weights, dispatch.layout, name, n
        ),
        "ring_attention fwd": lambda: mkernel.ring_attention(q, k, v, comm, causal=True),
        "ring_attention fwd, grad": lambda: mkernel.ring_attention(qg, kg, vg, comm, causal=True),
    }


def quantiles(samples: list[float]) -> dict:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]  # noqa: E731
    return {"median_us": statistics.median(s), "p10_us": pick(0.1), "p90_us": pick(0.9), "blocks": len(s)}


def measure(calls: dict, per_block: int, blocks: int) -> dict:
    names = list(calls)
    for fn in calls.values():  # warm-up: first-call work (lazy imports, caches) stays out
        for _ in range(max(10, per_block // 10)):
            fn()
    samples = {name: [] for name in names}
    for b in range(blocks):
        for i in range(len(names)):
            name = names[(b + i) % len(names)]
            fn = calls[name]
            start = time.perf_counter()
            for _ in range(per_block):
                fn()
            samples[name].append((time.perf_counter() - start) / per_block * 1e6)
    return {name: quantiles(s) for name, s in samples.items()}


def profile(fn, calls: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per block")
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--profile", metavar="CASE", help="cProfile one case instead of timing")
    args = ap.parse_args()
    if args.calls < 1 or args.blocks < 1:
        ap.error("need --calls >= 1 and --blocks >= 1")
    if shutil.which("cc") is None:
        print("SKIPPED: no C compiler (cc) to build the stub library")
        return 77

    with tempfile.TemporaryDirectory() as tmp:
        sys.path.append(str(HERE.parent / "python" / "src"))  # the source checkout, where no wheel is installed
        from mkernel import _lib

        os.environ[_lib.LIBRARY_ENV] = str(build_stub_library(_lib.DECLARATIONS, Path(tmp)))
        import torch

        import mkernel

        stub_cuda_streams(torch)
        comm = cpu_communicator(torch, mkernel)
        calls = cases(torch, mkernel, comm)
        if args.profile:
            if args.profile not in calls:
                ap.error(f"--profile takes one of {list(calls)}")
            profile(calls[args.profile], args.calls)
            return 0
        results = measure(calls, args.calls, args.blocks)

    print(f"# torch {torch.__version__}, mkernel {mkernel.__version__} from {Path(mkernel.__file__).parent}")
    print(f"# host µs per call, C library and CUDA stream lookup stubbed; {args.blocks} blocks of {args.calls} calls")
    print(f"# {'case':<32} {'median':>8} {'p10':>8} {'p90':>8}")
    for name, r in results.items():
        print(f"  {name:<32} {r['median_us']:>8.2f} {r['p10_us']:>8.2f} {r['p90_us']:>8.2f}")
    if args.json:
        record = {
            "bench": "python_host_cost",
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "calls": args.calls,
            "blocks": args.blocks,
            "results": results,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
