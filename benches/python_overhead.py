"""Python-side costs of the mkernel package, measured beside what they wrap.

1. Host time per call (µs) of one AllReduce on a small tensor, enqueue only: the raw C
   call through ctypes with precomputed arguments, the package's function with `out=`
   (argument checks, stream lookup), and the `torch.ops.mkernel` custom op (allocates its
   output). The difference is what the package adds over the C ABI.
2. One tensor-parallel MLP block step (forward and backward, sequence parallel): the fused
   layers (`ColumnParallelLinear` → GELU → `RowParallelLinear`: AllGather+GEMM and
   GEMM+ReduceScatter) against torch matmuls around mkernel's own AllGather and
   ReduceScatter, in the same run.

Contenders run in interleaved blocks (ABAB…); each block's per-call time is one sample; the
report gives median, p10 and p90 over the blocks. Outputs of the two MLP paths are compared
before timing. One JSON record per run goes to --json (GPU, torch, commit, date).

    python3 benches/python_overhead.py --json out.json                    # one rank
    torchrun --nproc-per-node 2 benches/python_overhead.py --json out.json # ranks share GPU 0 under MPS

Needs a CUDA GPU; without one it prints SKIPPED and exits 77.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import subprocess
import sys
import time


def quantiles(samples: list[float]) -> dict:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]  # noqa: E731
    return {"median": statistics.median(s), "p10": pick(0.1), "p90": pick(0.9), "blocks": len(s)}


def interleaved(contenders: dict, blocks: int, sample) -> dict:
    """Runs sample(fn) for every contender once per block, rotating the order each block."""
    names = list(contenders)
    out = {name: [] for name in names}
    for b in range(blocks):
        for i in range(len(names)):
            name = names[(b + i) % len(names)]
            out[name].append(sample(contenders[name]))
    return {name: quantiles(v) for name, v in out.items()}


def host_overhead(mkernel, torch, comm, calls: int, blocks: int) -> dict:
    from mkernel import _lib

    def rank_input(r: int):
        gen = torch.Generator(device="cuda").manual_seed(4321 + r)
        return torch.randn(4096, device="cuda", dtype=torch.float32, generator=gen)  # 16 KB

    x = rank_input(comm.rank)
    y = torch.empty_like(x)
    lib = _lib.library()
    handle = comm.handle()
    stream = _lib.mkStream_t(torch.cuda.current_stream().cuda_stream)
    raw_args = (x.data_ptr(), y.data_ptr(), x.numel(), _lib.DTYPE_CODES["float32"], _lib.REDOP_CODES["sum"], handle, stream)

    def raw():
        lib.mkAllReduce(*raw_args)

    def package():
        mkernel.all_reduce(x, comm, out=y)

    def custom_op():
        torch.ops.mkernel.all_reduce(x, comm.name, "sum")

    def sample(fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed / calls * 1e6

    for fn in (raw, package, custom_op):  # warm-up, and a check that each path runs
        sample(fn)
    expected = sum(rank_input(r).double() for r in range(comm.world_size))
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-5)
    return interleaved({"c_abi_ctypes": raw, "package_out": package, "torch_ops": custom_op}, blocks, sample)


def mlp_step(mkernel, torch, comm, tokens: int, hidden: int, ffn: int, iters: int, blocks: int) -> dict:
    n, rank = comm.world_size, comm.rank
    dt = dict(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    w1 = torch.randn(ffn // n, hidden, generator=gen, **dt) / hidden**0.5
    w2 = torch.randn(hidden, ffn // n, generator=gen, **dt) / (ffn / n) ** 0.5
    x = torch.randn(tokens // n, hidden, generator=gen, **dt)
    grad = torch.randn(tokens // n, hidden, generator=gen, **dt)

    col = mkernel.nn.ColumnParallelLinear(hidden, ffn, comm, bias=False, sequence_parallel=True, **dt)
    row = mkernel.nn.RowParallelLinear(ffn, hidden, comm, bias=False, sequence_parallel=True, **dt)
    with torch.no_grad():
        col.weight.copy_(w1)
        row.weight.copy_(w2)

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return mkernel.all_gather(t.contiguous(), comm)

        @staticmethod
        def backward(ctx, g):
            return mkernel.reduce_scatter(g.contiguous(), comm)

    class Scatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return mkernel.reduce_scatter(t.contiguous(), comm)

        @staticmethod
        def backward(ctx, g):
            return mkernel.all_gather(g.contiguous(), comm)

    w1u = w1.clone().requires_grad_()
    w2u = w2.clone().requires_grad_()

    def fused_forward(inp):
        return row(torch.nn.functional.gelu(col(inp)))

    def unfused_forward(inp):
        h = torch.nn.functional.gelu(Gather.apply(inp) @ w1u.t())
        return Scatter.apply(h @ w2u.t())

    xin = x.clone().requires_grad_()
    torch.testing.assert_close(fused_forward(xin), unfused_forward(xin), rtol=2e-2, atol=2e-2)

    def step(forward):
        inp = x.clone().requires_grad_()
        forward(inp).backward(grad)

    def sample(forward):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step(forward)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters * 1e3

    for forward in (fused_forward, unfused_forward):
        sample(forward)
    result = interleaved({"fused_layers": fused_forward, "torch_matmul_plus_mkernel_collectives": unfused_forward},
                         blocks, sample)
    result["shape"] = {"tokens": tokens, "hidden": hidden, "ffn": ffn, "ranks": n, "dtype": "bf16"}
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the record here (rank 0)")
    p.add_argument("--calls", type=int, default=200, help="calls per block for the host-time part")
    p.add_argument("--blocks", type=int, default=7, help="interleaved blocks per contender (>= 5)")
    p.add_argument("--iters", type=int, default=20, help="MLP steps per block")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    args = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("python_overhead: SKIPPED (no CUDA device)")
        return 77
    import mkernel
    import mkernel.nn  # noqa: F401

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        comm = mkernel.Communicator()
    else:
        comm = mkernel.Communicator(unique_id=mkernel.get_unique_id(), rank=0, world_size=1)
    with comm:
        record = {
            "bench": "python_overhead",
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "command": " ".join(sys.argv),
            "commit": os.environ.get("MK_COMMIT")
            or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host_us_per_call_all_reduce_16KB": host_overhead(mkernel, torch, comm, args.calls, args.blocks),
            "mlp_step_us": mlp_step(mkernel, torch, comm, args.tokens, args.hidden, args.ffn, args.iters, args.blocks),
        }
    if comm.rank == 0:
        print(json.dumps(record, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
