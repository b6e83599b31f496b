"""Runs a function on N rank processes sharing one GPU (torch.multiprocessing, spawn).

Each rank creates a Communicator from a unique id made here, in the parent, and calls
`target(comm, rank, world_size, *args)`; its return value (or traceback) comes back
through a queue. With MPS running (scripts/gpu-run.sh starts it), each rank gets
100/N % of the SMs and a grid cap that fits in it, so the ranks' persistent kernels are
co-resident.
"""

from __future__ import annotations

import os
import queue
import traceback

import pytest
import torch
import torch.multiprocessing as mp

import mkernel

def max_ctas(world_size: int) -> int | None:
    """Each rank's grid cap when `world_size` ranks share GPU 0 under MPS: half of its
    100/N % share of the SMs, the SM count rounded down to a multiple of 8, at least 1
    (scripts/mps.sh's max_ctas_for); None for one rank (every SM)."""
    if world_size <= 1:
        return None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(1, sms // 8 * 8 // world_size // 2)


def gpu_ready() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) < (9, 0):
        return False, f"needs an sm_90 GPU, found sm_{major}{minor}"
    return True, ""


_ready, _why = gpu_ready()
requires_gpu = pytest.mark.skipif(not _ready, reason=_why)


def _rank_main(rank, world_size, unique_id, results, target, args, comm_kwargs):
    try:
        if world_size > 1:
            os.environ.setdefault("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(100 // world_size))
        torch.cuda.set_device(0)
        kwargs = {"timeout": comm_kwargs.pop("timeout_s", 120), "max_ctas": max_ctas(world_size)}
        kwargs.update(comm_kwargs)
        if unique_id is None:
            payload = target(None, rank, world_size, *args)
        else:
            comm = mkernel.Communicator(unique_id=unique_id, rank=rank, world_size=world_size, device=0, **kwargs)
            try:
                payload = target(comm, rank, world_size, *args)
            finally:
                if not comm.closed:
                    comm.close()
        results.put((rank, True, payload))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(world_size: int, target, *args, timeout: float = 300, make_comm: bool = True, **comm_kwargs):
    """Runs target on `world_size` ranks; returns their results by rank, or fails the test.

    `timeout` bounds the whole run here; `timeout_s` (in comm_kwargs) is the communicator's
    in-kernel wait bound (default 120 s); other comm_kwargs go to mkernel.Communicator.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    unique_id = mkernel.get_unique_id() if make_comm else None
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world_size, unique_id, results, target, args, comm_kwargs))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    by_rank, failures = {}, []
    try:
        for _ in procs:
            rank, ok, payload = results.get(timeout=timeout)
            (by_rank.__setitem__(rank, payload) if ok else failures.append(f"rank {rank}:\n{payload}"))
    except queue.Empty:
        failures.append(f"ranks {sorted(set(range(world_size)) - set(by_rank))} gave no result within {timeout} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    return [by_rank[r] for r in range(world_size)]


def seeded(seed: int, *shape, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    """The same random tensor on every rank (generated on the CPU from `seed`)."""
    g = torch.Generator().manual_seed(seed)
    return ((torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1) * scale).to(dtype)


def close_to(name: str, got: torch.Tensor, want: torch.Tensor, *, rtol: float, atol: float) -> list[str]:
    """Compares `got` with a float64 reference; NaN never passes. Returns problems as text."""
    got64 = got.detach().double().cpu()
    want64 = want.detach().double().cpu()
    if got64.shape != want64.shape:
        return [f"{name}: shape {tuple(got64.shape)} != {tuple(want64.shape)}"]
    if not torch.isfinite(got64).all():
        return [f"{name}: {int((~torch.isfinite(got64)).sum())} non-finite values"]
    err = (got64 - want64).abs()
    bound = atol + rtol * want64.abs()
    if (err > bound).any():
        i = int((err - bound).argmax())
        return [
            f"{name}: {int((err > bound).sum())} of {err.numel()} values off; worst at flat index {i}: "
            f"got {got64.flatten()[i].item():.6g}, want {want64.flatten()[i].item():.6g}"
        ]
    return []
