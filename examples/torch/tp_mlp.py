"""A tensor-parallel MLP block trained for a few steps on random data with mkernel's fused ops.

Launch it like any torch program, one process per rank (ranks may share a GPU):

    torchrun --nproc-per-node 2 examples/torch/tp_mlp.py

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous; the mkernel communicator
bootstraps over the gloo process group. With sequence parallelism (the default), each
rank holds 1/n of the sequence: the up projection gathers it inside its GEMM
(AllGather+GEMM) and the down projection scatters it back (GEMM+ReduceScatter).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mkernel
from mkernel.nn import ColumnParallelLinear, RowParallelLinear


class ParallelMLP(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int, comm: mkernel.Communicator, sequence_parallel: bool):
        super().__init__()
        self.up = ColumnParallelLinear(hidden, ffn, comm, sequence_parallel=sequence_parallel)
        self.down = RowParallelLinear(ffn, hidden, comm, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=512, help="global sequence length")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--no-sequence-parallel", action="store_true", help="replicate activations, all-reduce outputs")
    parser.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the block")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # Ranks on the same host share the GPUs round-robin (several ranks per GPU is fine under MPS).
    device = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(device)
    sequence_parallel = not args.no_sequence_parallel
    torch.manual_seed(1234 + rank)

    with mkernel.Communicator(device=device) as comm:
        model = ParallelMLP(args.hidden, args.ffn, comm, sequence_parallel)
        step_fn = torch.compile(model, fullgraph=True) if args.compile else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        local_seq = args.seq // world if sequence_parallel else args.seq
        # A fixed random regression target: the loss should fall.
        x = torch.randn(local_seq, args.batch, args.hidden, dtype=torch.bfloat16)
        target = torch.randn(local_seq, args.batch, args.hidden, dtype=torch.bfloat16)
        if not sequence_parallel:  # replicated activations: every rank has the same input and loss
            dist.broadcast(x, src=0)
            dist.broadcast(target, src=0)
        x, target = x.to(device), target.to(device)
        for step in range(args.steps):
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(step_fn(x).float(), target.float())
            loss.backward()
            optimizer.step()
            # The mean over ranks, for printing only (a host sync, outside the step).
            shown = torch.tensor([loss.item()])
            dist.all_reduce(shown)
            if rank == 0:
                print(f"step {step}: loss {shown.item() / world:.5f}")
        torch.cuda.synchronize()
        if rank == 0:
            print(
                f"mkernel {mkernel.__version__}: {world} rank(s), workspace {comm.device_memory_bytes >> 20} MiB per rank"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
