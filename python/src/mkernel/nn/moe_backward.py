"""The MoE layer's backward on mkernel's own kernels: the combine's backward is a dispatch,
the dispatch's backward is a combine.

In the forward, row i of an owner's receive buffer holds one (token, local expert e) pair
(moe_dispatch_gemm's layout: experts in order, each segment on a 128-row boundary, in a
segment by source rank then token): h = x[t]·W1_eᵀ, y = act(h), Z = y·W2_eᵀ, and the
token's rank sums out[t] = Σ_j w[t, j]·Z[row(t, j)]. With w̄ the sum of the weights of the
token's choices naming the row's expert (a token listing an expert twice has one row), the
backward per row is

    D = dout[t]·W2_e               moe_dispatch_gemm of dout, B = W2ᵀ (a transposed copy)
    d w[t, j] = dout[t]·Z = D·y     every choice naming the row's expert
    dy = w̄·D,  dh = act'(h)·dy     (ACTIVATION_BACKWARDS, in fp32)
    dx[t] = Σ_rows dh·W1_e          moe_gemm_combine of dh, B = W1ᵀ, weight 1 per row
    dW2_e = Σ_rows (w̄·dout[t])ᵀ·y,  dW1_e = Σ_rows dhᵀ·x[t]   torch._grouped_mm

so neither GEMM of the forward runs again except, for a gated activation fused in the
dispatch's epilogue, h = x·W1ᵀ (the fused forward never stores it). The weight gradients
need the raw rows of x and dout at each expert's owner, which the MoE ops do not return
(the dispatch returns rows already multiplied by a weight): they are all-gathered over the
communicator and picked by the receive layout, recomputed here from every rank's routing
(moe_receive_rows). docs/decisions/0081-moe-backward-on-the-kernels.md says why and what
it costs.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from ..ops import all_gather, moe_dispatch_gemm, moe_gemm_combine, reduce_scatter, resolve

ROW_BLOCK = 128
"""Each expert's segment of the receive buffer starts on a multiple of this many rows."""

# (h, dy) -> (act(h), dh), both float32.
ActivationBackward = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class ReceiveRows(NamedTuple):
    """One rank's receive buffer row by row, from every rank's routing (moe_receive_rows).

    token [recv_capacity] int64: the row's token among the gathered tokens (source rank ·
    tokens + index), -1 for padding and rows past the last segment;
    weight [recv_capacity] float32: the sum of the routing weights of the token's choices
    naming the row's expert, 0 where token is -1;
    group_ends [E_local] int32: where each expert's segment ends, its padding included
    (torch._grouped_mm's offs over the buffer's rows);
    choice_row [tokens, k] int64: the row of each choice naming one of this rank's experts,
    -1 for every other choice.
    """

    token: torch.Tensor
    weight: torch.Tensor
    group_ends: torch.Tensor
    choice_row: torch.Tensor


def moe_receive_rows(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, rank: int, local_experts: int, recv_capacity: int
) -> ReceiveRows:
    """The receive layout of `rank` as moe_dispatch_gemm fills it (include/mkernel.h): rows
    grouped by local expert, in a group by source rank then token, one row per distinct
    (token, expert); expert e's segment starts at Σ_{e' < e} roundup(rows of e', 128).

    topk_idx [tokens, k] and topk_weights [tokens, k]: every rank's routing, concatenated in
    rank order (the gathered tokens), with dropped choices already -1 (moe_kept). Computed
    on the device without host synchronisation.
    """
    device = topk_idx.device
    idx = topk_idx.to(torch.int64)
    tokens = idx.shape[0]
    local = idx - rank * local_experts
    mine = (local >= 0) & (local < local_experts)
    column = torch.where(mine, local, 0)
    # pairs[t, e]: token t has a row at local expert e (counted once however often it lists e).
    listed = torch.zeros(tokens, local_experts, dtype=torch.int32, device=device)
    pairs = listed.scatter_add_(1, column, mine.to(torch.int32)) > 0
    pair_weight = torch.zeros(tokens, local_experts, dtype=torch.float32, device=device)
    pair_weight.scatter_add_(1, column, torch.where(mine, topk_weights.to(torch.float32), 0.0))
    counts = pairs.sum(0)
    padded = (counts + ROW_BLOCK - 1) // ROW_BLOCK * ROW_BLOCK
    ends = torch.cumsum(padded, 0)
    pair_row = (ends - padded).unsqueeze(0) + torch.cumsum(pairs.to(torch.int64), 0) - 1
    # A forward that ran at this capacity fits every pair; the guard keeps a misuse in bounds.
    fits = pairs & (pair_row < recv_capacity)
    target = torch.where(fits, pair_row, recv_capacity).reshape(-1)  # recv_capacity: a row that is cut off
    token_of_pair = torch.arange(tokens, device=device).unsqueeze(1).expand(tokens, local_experts).reshape(-1)
    token = torch.full((recv_capacity + 1,), -1, dtype=torch.int64, device=device)
    token = token.scatter(0, target, torch.where(fits.reshape(-1), token_of_pair, -1))[:recv_capacity]
    weight = torch.zeros(recv_capacity + 1, dtype=torch.float32, device=device)
    weight = weight.scatter(0, target, torch.where(fits, pair_weight, 0.0).reshape(-1))[:recv_capacity]
    choice_row = torch.where(mine & fits.gather(1, column), pair_row.gather(1, column), -1)
    return ReceiveRows(token, weight, ends.to(torch.int32), choice_row)


def first_choice_weights(topk_idx: torch.Tensor) -> torch.Tensor:
    """float32 [tokens, k]: 1 for the first choice naming each expert of a token, 0 for a
    repeat of an earlier choice and for -1. moe_gemm_combine counts a repeated expert once
    per choice, but its row is one row whose gradient already sums both choices' weights."""
    idx = topk_idx.to(torch.int64)
    k = idx.shape[1]
    earlier = torch.ones(k, k, dtype=torch.bool, device=idx.device).tril(-1)  # [j, j']: j' < j
    repeat = ((idx.unsqueeze(2) == idx.unsqueeze(1)) & earlier).any(2)
    return ((idx >= 0) & ~repeat).to(torch.float32)


# --- activation backward: act(h) and dh from (h, dy), in fp32 --------------------------------------

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _silu_and_derivative(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sigmoid(g)
    return g * s, s * (1.0 + g * (1.0 - s))


def _gelu_and_derivative(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GELU's erf form (torch.nn.functional.gelu's default, the dispatch epilogue's)."""
    cdf = 0.5 * (1.0 + torch.erf(g * _SQRT1_2))
    return g * cdf, cdf + g * torch.exp(-0.5 * g * g) * _INV_SQRT_2PI


def _relu_and_derivative(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return g.clamp(min=0), (g > 0).to(g.dtype)


def _plain(fn) -> ActivationBackward:
    def backward(h: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, da = fn(h.float())
        return a, dy.float() * da

    return backward


def _gated(fn) -> ActivationBackward:
    """act(gate)·up on [rows, 2·ffn] in Megatron's fused fc1 layout (gate columns, then up)."""

    def backward(h: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = h.float().chunk(2, dim=-1)
        a, da = fn(gate)
        dy = dy.float()
        return a * up, torch.cat([dy * up * da, dy * a], dim=-1)

    return backward


ACTIVATION_BACKWARDS: dict[str, ActivationBackward] = {
    "swiglu": _gated(_silu_and_derivative),
    "geglu": _gated(_gelu_and_derivative),
    "silu": _plain(_silu_and_derivative),
    "gelu": _plain(_gelu_and_derivative),
    "relu": _plain(_relu_and_derivative),
}
"""The layer's activations (mkernel.nn.moe.ACTIVATIONS' names) differentiated by hand: each
forms act(h) and dh in one pass over h, in fp32 (autograd would keep act(gate) in the
element type between its kernels)."""


def activation_backward_by_autograd(activation: Callable[[torch.Tensor], torch.Tensor]) -> ActivationBackward:
    """Any activation (Megatron's clamped or offset GLU, say) differentiated by autograd."""

    def backward(h: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad():
            leaf = h.detach().float().requires_grad_(True)
            y = activation(leaf)
            (dh,) = torch.autograd.grad(y, leaf, dy.to(y.dtype))
        return y.detach(), dh

    return backward


# --- the backward -----------------------------------------------------------------------------------


def moe_backward_on_kernels(
    dout: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    kept_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    hidden_rows: torch.Tensor | None,
    *,
    comm: str,
    recv_capacity: int,
    expert_capacity: int | None,
    activation_backward: ActivationBackward,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d topk_weights, dw1, dw2) of the layer's forward (MoeFunction), every rank alike.

    topk_idx: this rank's routing as the forward dispatched it; kept_idx: the same with the
    choices the drop rule dropped set to -1 (topk_idx itself without drop mode);
    recv_capacity and expert_capacity: the forward's (the same routing at the same capacity
    never overflows, and the same drop rule keeps the same rows); hidden_rows: the
    forward's h = x·W1ᵀ rows ([recv_capacity, ffn], unactivated) when the dispatch applied
    no activation, None when it fused a gated one (then h is recomputed).
    """
    c = resolve(comm)
    n, rank, comm = c.world_size, c.rank, c.name
    dtype = x.dtype
    dout = dout.to(dtype).contiguous()

    # D = dout·W2_e in the forward's rows: the dispatch reads B as [E_local, N, K] = W2ᵀ.
    w2_t = w2.transpose(1, 2).contiguous()
    dispatched = moe_dispatch_gemm(dout, topk_idx, w2_t, comm, recv_capacity, expert_capacity=expert_capacity)
    del w2_t

    if n > 1:
        idx_all, weights_all, x_all, dout_all = (all_gather(t, comm) for t in (kept_idx, topk_weights, x, dout))
    else:
        idx_all, weights_all, x_all, dout_all = kept_idx, topk_weights, x, dout
    rows = moe_receive_rows(idx_all, weights_all, rank, w1.shape[0], recv_capacity)
    # Rows that hold no token: the ops leave them unspecified (NaN, say) in h and D, and
    # _grouped_mm leaves those past the last group so. y and dh are masked there before
    # they meet a GEMM or a sum; the gathered x and dout rows are zero there, so that
    # 0 · (a NaN of the caller's) never reaches a weight's gradient either.
    empty = (rows.token < 0).unsqueeze(1)
    token = rows.token.clamp(min=0)
    x_rows = x_all[token].masked_fill_(empty, 0)  # in place: each is [recv_capacity, hidden]
    dout_rows = dout_all[token].masked_fill_(empty, 0)
    if hidden_rows is None:
        hidden_rows = torch._grouped_mm(x_rows, w1.transpose(1, 2), offs=rows.group_ends)
    d_rows = dispatched.y.float()

    y, dh = activation_backward(hidden_rows, d_rows * rows.weight.unsqueeze(1))
    y = y.masked_fill_(empty, 0)
    dh = dh.to(dtype).masked_fill_(empty, 0)
    # d w[t, j] = dout[t]·Z[row] = dout[t]·W2_e·y[row] = D[row]·y[row]: no Z needed (read
    # at the rows of choices only).
    row_dweight = (d_rows * y).sum(1)

    # dx: dh through W1 back to the tokens' ranks, each row once (weight 1 on its first choice).
    w1_t = w1.transpose(1, 2).contiguous()
    dx = moe_gemm_combine(dh, w1_t, first_choice_weights(topk_idx), dispatched.layout, comm)
    del w1_t

    dz = (dout_rows.float() * rows.weight.unsqueeze(1)).to(dtype)
    dw2 = torch._grouped_mm(dz.t(), y.to(dtype), offs=rows.group_ends)
    dw1 = torch._grouped_mm(dh.t(), x_rows, offs=rows.group_ends)

    choice = rows.choice_row
    dweights = torch.where(choice >= 0, row_dweight[choice.clamp(min=0)], 0.0)
    if n > 1:
        # Each choice's value is nonzero on its expert's owner only: the sum is that value.
        dweights = reduce_scatter(dweights.contiguous(), comm)
    return dx, dweights, dw1, dw2
