"""An unmodified torch.distributed program (backend nccl) that libmkernel-nccl must run:
all_reduce (sum, avg, max), all_gather_into_tensor, reduce_scatter_tensor, broadcast and
barrier on fresh random tensors, each checked against a float64 reference built from every
rank's inputs (each rank regenerates them from the ranks' seeds). Launch with torchrun;
prints "torch.distributed on libmkernel-nccl: N passed, M failed" on rank 0."""
import os
import sys

import torch
import torch.distributed as dist


def inputs(rank, n, dtype, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    # Multiples of 1/4 in [-2, 2]: exact in every dtype tested.
    return (torch.randint(-8, 9, (n,), generator=g).double() / 4).to(dtype)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("MK_TEST_DEVICE", "0")))
    dev = torch.device("cuda", torch.cuda.current_device())
    passed = failed = 0
    step = 0

    def check(name, got, want, tol):
        nonlocal passed, failed
        ok = bool(torch.allclose(got.double().cpu(), want, rtol=tol, atol=tol)) and not torch.isnan(got.double()).any()
        if ok:
            passed += 1
        else:
            failed += 1
            print(f"rank {rank}: {name} differs: max error {(got.double().cpu() - want).abs().max().item()}", flush=True)

    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 1e-3), (torch.int32, 0)):
        for n in (1, 1000, 1 << 20):
            step += 1
            every = [inputs(r, n * world, dtype, step).double() for r in range(world)]
            mine = inputs(rank, n * world, dtype, step)
            total = sum(every)
            for op, want in ((dist.ReduceOp.SUM, total), (dist.ReduceOp.MAX, torch.stack(every).max(0).values)):
                x = mine.clone().to(dev)
                dist.all_reduce(x, op=op)
                check(f"all_reduce {op} {dtype} {n}", x, want, tol)
            if dtype.is_floating_point:
                x = mine.clone().to(dev)
                dist.all_reduce(x, op=dist.ReduceOp.AVG)
                check(f"all_reduce avg {dtype} {n}", x, total / world, tol)
            shard = mine[:n].to(dev)
            out = torch.full((n * world,), float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(out, shard)
            check(f"all_gather_into_tensor {dtype} {n}", out, torch.cat([e[:n] for e in every]), tol)
            rs = torch.full((n,), float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(rs, mine.to(dev))
            check(f"reduce_scatter_tensor {dtype} {n}", rs, total[rank * n:(rank + 1) * n], tol)
            root = world - 1
            b = mine[:n].clone().to(dev)
            dist.broadcast(b, src=root)
            check(f"broadcast {dtype} {n}", b, every[root][:n], 0)
            dist.barrier()
    torch.cuda.synchronize()
    counts = torch.tensor([passed, failed], device=dev)
    dist.all_reduce(counts)
    if rank == 0:
        print(f"torch.distributed on libmkernel-nccl (world {world}): {counts[0].item()} passed, {counts[1].item()} failed", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if counts[1].item() else 0)


if __name__ == "__main__":
    main()
