"""Tensor-parallel linear layers with Megatron-LM's semantics, on mkernel's fused ops.

The tensor-parallel group is the communicator's ranks (world size n). Inputs are
[..., features] with the sequence (token) dimension first, as Megatron's [s, b, h];
with sequence parallelism the first dimension is this rank's shard of the sequence.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import _checks as check
from ..ops import comm_name, dispatch, resolve


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _transposed(w: torch.Tensor) -> torch.Tensor:
    """wᵀ densely packed: the [N, K] operand mkernel's GEMMs take to multiply by w itself."""
    return w.t().contiguous()


class _ColumnSequenceParallel(torch.autograd.Function):
    """y = AllGather(x) · Wᵀ. Backward: dx = ReduceScatter(dy · W) fused, dW = dyᵀ · AllGather(x)."""

    @staticmethod
    def forward(ctx, x, weight, comm: str, world_size: int):
        y, gathered = dispatch(torch.ops.mkernel.all_gather_gemm, x, weight, comm, world_size, True)
        ctx.save_for_backward(gathered, weight)
        ctx.comm, ctx.world_size = comm, world_size
        return y

    @staticmethod
    def backward(ctx, dy):
        gathered, weight = ctx.saved_tensors
        dy = dy.contiguous()
        # needs_input_grad is the same on every rank (same model), so skipping the collective is consistent.
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dispatch(
                torch.ops.mkernel.gemm_reduce_scatter, dy, _transposed(weight), ctx.comm, ctx.world_size
            )
        dw = dy.t() @ gathered
        return dx, dw, None, None


class _ColumnReplicated(torch.autograd.Function):
    """y = x · Wᵀ (x the same on every rank). Backward: dx = AllReduce(dy · W) fused, dW = dyᵀ · x."""

    @staticmethod
    def forward(ctx, x, weight, comm: str):
        ctx.save_for_backward(x, weight)
        ctx.comm = comm
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dispatch(torch.ops.mkernel.gemm_all_reduce, dy, _transposed(weight), ctx.comm)
        dw = dy.t() @ x
        return dx, dw, None


class _RowSequenceParallel(torch.autograd.Function):
    """y = ReduceScatter(x · Wᵀ) + b fused. Backward: dx = AllGather(dy) · W fused; dW = AllGather(dy)ᵀ · x
    and db = Σ AllGather(dy) in plain torch on the gathered dy the fused op returns."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm: str, world_size: int):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.world_size = comm, world_size
        ctx.has_bias = bias is not None
        y = dispatch(torch.ops.mkernel.gemm_reduce_scatter, x, weight, comm, world_size)
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, gathered_dy = dispatch(
            torch.ops.mkernel.all_gather_gemm, dy.contiguous(), _transposed(weight), ctx.comm, ctx.world_size, True
        )
        dw = gathered_dy.t() @ x
        db = gathered_dy.sum(0) if ctx.has_bias else None
        return dx, dw, db, None, None


class _RowAllReduce(torch.autograd.Function):
    """y = AllReduce(x · Wᵀ) fused. Backward (dy is the same on every rank): dx = dy · W, dW = dyᵀ · x."""

    @staticmethod
    def forward(ctx, x, weight, comm: str):
        ctx.save_for_backward(x, weight)
        return dispatch(torch.ops.mkernel.gemm_all_reduce, x, weight, comm)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return dy @ weight, dy.t() @ x, None


def _init_weight(weight: torch.Tensor, fan_in: int) -> None:
    # nn.Linear's default: kaiming_uniform(a=√5) = U(-1/√fan_in, 1/√fan_in) over the full fan-in.
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(weight, -bound, bound)


def _shard_setup(layer: str, comm, split: str, features: int, dtype: torch.dtype, device):
    """The checks both layers make before creating their weights: `split` (the features
    divided over the ranks, `features` of them) divisible by the world size, and a dtype the
    fused ops take. Returns the world size and the parameters' device (the communicator's
    GPU when `device` is None)."""
    communicator = resolve(comm)
    n = communicator.world_size
    if features % n != 0:
        check.fail(layer, f"expected {split} ({features}) to be divisible by the world size ({n})")
    if dtype not in check.GEMM_DTYPES:
        check.fail(layer, f"expected dtype torch.bfloat16 or torch.float16, but got {dtype}")
    return n, device if device is not None else torch.device("cuda", communicator.device)


class ColumnParallelLinear(nn.Module):
    """Linear layer whose output features are split over the ranks: y = x · Aᵀ + b, A = [A_0; ...; A_{n-1}].

    Rank r holds weight A_r [out_features / n, in_features] (and bias b_r) and returns its
    columns of y, [..., out_features / n]; feed it to a RowParallelLinear.

    sequence_parallel=True (Megatron's sequence parallelism): x is this rank's shard of
    the sequence, [s / n, ..., in_features]; forward is the fused AllGather+GEMM
    (mkernel.all_gather_gemm) and y covers the whole sequence, [s, ..., out_features / n].
    Backward: dx by the fused GEMM+ReduceScatter (dy · A_r reduce-scattered back to the
    sequence shards); dA_r = dyᵀ · AllGather(x) by a plain torch matmul on the gathered x
    the forward kept; db_r = Σ dy in plain torch.

    sequence_parallel=False: x is the same on every rank; forward is a plain torch
    matmul; backward dx by the fused GEMM+AllReduce, dA_r and db_r in plain torch.

    Weights are bf16 or fp16 (the fused ops' types); in_features and out_features / n
    multiples of 8.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm,
        *,
        bias: bool = True,
        sequence_parallel: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
    ):
        super().__init__()
        n, device = _shard_setup("nn.ColumnParallelLinear", comm, "out_features", out_features, dtype, device)
        self.comm = comm_name(comm)
        self.world_size = n
        self.in_features = in_features
        self.out_features = out_features
        self.out_features_per_rank = out_features // n
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(self.out_features_per_rank, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(self.out_features_per_rank, dtype=dtype, device=device)) if bias else None
        with torch.no_grad():
            _init_weight(self.weight, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        if self.sequence_parallel:
            y = _ColumnSequenceParallel.apply(rows, self.weight, self.comm, self.world_size)
            lead = (x.shape[0] * self.world_size, *x.shape[1:-1])
        else:
            y = _ColumnReplicated.apply(rows, self.weight, self.comm)
            lead = tuple(x.shape[:-1])
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features_per_rank)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} ({self.out_features_per_rank} per rank), "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}, comm={self.comm!r}"
        )


class RowParallelLinear(nn.Module):
    """Linear layer whose input features are split over the ranks: y = Σ_r x_r · A_rᵀ + b.

    Rank r holds weight A_r [out_features, in_features / n] and takes its slice of the
    input features, x_r [s, ..., in_features / n] (a ColumnParallelLinear's output).
    The bias is the same on every rank and is added once, after the reduction.

    sequence_parallel=True: forward is the fused GEMM+ReduceScatter
    (mkernel.gemm_reduce_scatter) and y is this rank's shard of the sequence,
    [s / n, ..., out_features]. Backward: dx by the fused AllGather+GEMM (the sequence
    shards of dy gathered and multiplied by A_r in one kernel, which also returns the
    gathered dy); dA_r = AllGather(dy)ᵀ · x_r and db = Σ AllGather(dy) in plain torch
    on that gathered dy (so db is the full gradient, equal on every rank, with no extra
    all-reduce of the bias gradient).

    sequence_parallel=False: forward is the fused GEMM+AllReduce (mkernel.gemm_all_reduce)
    and y is the whole [s, ..., out_features] on every rank; backward dx, dA_r, db in
    plain torch (dy is already the same on every rank: no communication).

    Weights are bf16 or fp16; out_features and in_features / n multiples of 8.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm,
        *,
        bias: bool = True,
        sequence_parallel: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
    ):
        super().__init__()
        n, device = _shard_setup("nn.RowParallelLinear", comm, "in_features", in_features, dtype, device)
        self.comm = comm_name(comm)
        self.world_size = n
        self.in_features = in_features
        self.out_features = out_features
        self.in_features_per_rank = in_features // n
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features_per_rank, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        with torch.no_grad():
            _init_weight(self.weight, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        if self.sequence_parallel:
            if x.shape[0] % self.world_size != 0:
                check.fail(
                    "nn.RowParallelLinear",
                    f"expected the sequence length (input.shape[0] = {x.shape[0]}) to be divisible by the world size "
                    f"({self.world_size}) with sequence_parallel=True",
                )
            y = _RowSequenceParallel.apply(rows, self.weight, self.bias, self.comm, self.world_size)
            return y.reshape(x.shape[0] // self.world_size, *x.shape[1:-1], self.out_features)
        y = _RowAllReduce.apply(rows, self.weight, self.comm)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_features_per_rank} per rank), out_features={self.out_features}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}, comm={self.comm!r}"
        )
