"""Mixture-of-experts layer on mkernel's fused MoE ops, forward and backward.

The router stays outside (as Megatron and DeepSeek keep it): the layer takes each token's
top-k expert ids and weights. The forward is mkernel's: moe_dispatch_gemm (the all-to-all
dispatch fused with each local expert's first GEMM and, for SwiGLU and GeGLU, the gated
activation in its epilogue) and moe_gemm_combine (the second GEMM fused with the way back
and the weighted sum over the top-k).

Two backwards (MoeSettings.backward):

- "kernels" (the default; mkernel.nn.moe_backward): the combine's backward is a dispatch of
  the output gradient through W2ᵀ, the dispatch's backward a combine of the activation's
  gradient through W1ᵀ, the weight gradients grouped GEMMs (torch._grouped_mm) over the
  receive buffer's expert segments. docs/decisions/0081-moe-backward-on-the-kernels.md.
- "recompute": the layer recomputed unfused from the saved inputs and differentiated: the
  tokens, ids, weights and output gradient are all-gathered over the communicator
  (mkernel's all_gather), each rank runs its own experts on the choices that name them as
  grouped GEMMs (torch._grouped_mm, dgrad and wgrad alike, with no host synchronisation),
  and the gradients of the tokens and weights are reduce-scattered back (mkernel's
  reduce_scatter). docs/decisions/0073-moe-layer-autograd.md.

`moe_reference` is the same layer written plainly, per expert in any dtype (float64 for
the tests), over torch.distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import _checks as check
from ..errors import MkMoeOverflowError
from ..ops import all_gather, moe_dispatch_gemm, moe_gemm_combine, reduce_scatter, resolve
from .moe_backward import (
    ACTIVATION_BACKWARDS,
    ActivationBackward,
    activation_backward_by_autograd,
    moe_backward_on_kernels,
)

Activation = Callable[[torch.Tensor], torch.Tensor]


def glu(act: Activation) -> Activation:
    """The gated linear unit of `act` on fc1's output [rows, 2 * ffn] in Megatron's fused
    layout (gate columns first, then up): act(gate) * up."""

    def gated(h: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(h, 2, dim=-1)
        return act(gate) * up

    return gated


# Layer activation name: (the dispatch epilogue's activation, the same activation in torch).
# The gated ones run fused in moe_dispatch_gemm; the plain ones run in torch between the ops.
ACTIVATIONS: dict[str, tuple[str, Activation]] = {
    "swiglu": ("silu", glu(F.silu)),
    "geglu": ("gelu", glu(F.gelu)),
    "silu": ("none", F.silu),
    "gelu": ("none", F.gelu),
    "relu": ("none", F.relu),
}

BACKWARDS = ("kernels", "recompute")
"""MoeSettings.backward: dgrad through the MoE kernels (moe_backward), or the unfused recomputation."""


def expert_capacity(tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Megatron's per-rank expert capacity (moe_utils.get_capacity): ceil(tokens * topk /
    experts * capacity_factor), at least 1."""
    return max(1, math.ceil(tokens * topk / num_experts * capacity_factor))


def receive_capacity(tokens: int, topk: int, local_experts: int, ep: int, expert_capacity: int | None = None) -> int:
    """Rows of moe_dispatch_gemm's receive buffer that no routing can overflow, each expert's
    segment padded to 128 rows: every rank's tokens sending min(topk, E_local) rows here, and
    in drop mode every rank sending each expert at most expert_capacity rows (the smaller
    bound of the two). Every rank gets the
    same value when every rank has the same token count (as the ops require of recv_capacity)."""
    rows = ep * tokens * min(topk, local_experts) + local_experts * 127
    bound = (rows + 127) // 128 * 128
    if expert_capacity is not None:
        return min(bound, local_experts * ((ep * expert_capacity + 127) // 128 * 128))
    return bound


def moe_kept(topk_idx: torch.Tensor, num_experts: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drop rule of moe_dispatch_gemm's drop mode, on this rank's routing: per expert, the
    first `capacity` rows in token order are kept, a row being a distinct (token, expert) pair
    (a token listing an expert twice takes one place, and both its choices share the row's fate).

    Returns (kept [tokens, topk] bool: the choice has a row at its owner; drop_counts
    [num_experts] int32: dropped rows per expert). No host synchronisation.
    """
    idx = topk_idx.to(torch.int64)
    valid = idx >= 0
    column = idx.clamp(min=0)
    listed = torch.zeros(idx.shape[0], num_experts, dtype=torch.int32, device=idx.device)
    rows = listed.scatter_add_(1, column, valid.to(torch.int32)) > 0
    place = torch.cumsum(rows.to(torch.int32), dim=0) - 1  # the row's place among its expert's rows
    kept_rows = rows & (place < capacity)
    kept = valid & kept_rows.gather(1, column)
    drop_counts = (rows.sum(0) - kept_rows.sum(0)).to(torch.int32)
    return kept, drop_counts


def moe_reference(x, topk_idx, topk_weights, w1, w2, activation, ep_group=None):
    """The MoE layer unfused, differentiable in x, topk_weights, w1 and w2.

    x [tokens, hidden]; topk_idx [tokens, k] (-1: none), topk_weights [tokens, k] float32;
    w1 [E_local, ffn, hidden] (gated: [E_local, 2 * ffn, hidden], `activation` being glu(...)),
    w2 [E_local, hidden, ffn] of this rank's experts [r·E_local, (r+1)·E_local).
    out[t] = Σ_j topk_weights[t, j] · expert_e(x[t]). Drop mode is this with the dropped
    choices' ids set to -1 (moe_kept).

    Over an expert-parallel group (every rank with the same token count) the tokens, ids
    and weights are all-gathered, each rank applies its own experts to the choices that
    name them, and the partial outputs are summed over the group, each rank keeping its
    rows: AllGather, AllReduce and (in the backward) ReduceScatter only, which
    libmkernel-nccl's standalone mode serves; it has no send/receive for an all-to-all.
    """
    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    rank = dist.get_rank(ep_group) if ep_group is not None else 0
    if ep > 1:
        x_all = torch.cat(dist.nn.functional.all_gather(x, group=ep_group))
        weights_all = torch.cat(dist.nn.functional.all_gather(topk_weights, group=ep_group))
        idx_all = [torch.empty_like(topk_idx) for _ in range(ep)]
        dist.all_gather(idx_all, topk_idx.contiguous(), group=ep_group)
        idx_all = torch.cat(idx_all)
    else:
        x_all, weights_all, idx_all = x, topk_weights, topk_idx
    local_experts = w1.shape[0]
    k = idx_all.shape[1]
    local = idx_all.to(torch.int64).reshape(-1) - rank * local_experts
    accumulate = torch.promote_types(torch.float32, x.dtype)  # fp32 sums, as moe_gemm_combine's
    out = torch.zeros(x_all.shape[0], w2.shape[1], dtype=accumulate, device=x.device)
    for e in range(local_experts):
        slots = torch.nonzero(local == e).squeeze(1)
        if slots.numel():
            tokens = slots // k
            y = activation(x_all[tokens] @ w1[e].t()) @ w2[e].t()
            out = out.index_add(0, tokens, y.to(accumulate) * weights_all.reshape(-1)[slots].unsqueeze(1))
    if ep > 1:
        # An AllReduce and this rank's rows: gloo (the CPU tests) has no ReduceScatter.
        out = dist.nn.functional.all_reduce(out, group=ep_group)[rank * x.shape[0] : (rank + 1) * x.shape[0]]
    return out.to(x.dtype)


def moe_local_experts(x, topk_idx, topk_weights, w1, w2, activation: Activation, first_expert: int) -> torch.Tensor:
    """The outputs of experts [first_expert, first_expert + E_local) (weights w1, w2) for
    every choice that names one, weighted and summed per token: float32 [tokens, hidden].

    Grouped GEMMs (torch._grouped_mm, bf16, fp16 or fp32) with no host synchronisation: the
    choices of this rank's experts are laid out expert by expert in a buffer of a size known
    without reading the routing (every choice, plus each group's padding), each expert's
    group padded to 16 bytes of rows, since _grouped_mm's backward contracts over the rows
    (wgrad = dZᵀ·Y per group) and its TMA loads need each group to start 16-byte aligned
    (torchtitan pads its token groups alike). Padding rows are zero; rows past the last
    group, which _grouped_mm leaves unspecified, and padding rows are masked at the input
    and at the expert outputs (before the weights multiply them), so they reach neither
    the forward nor any gradient. Differentiable in x, topk_weights, w1 and w2.
    """
    tokens, k = topk_idx.shape
    slots = tokens * k
    local_experts = w1.shape[0]
    align = max(1, 16 // x.element_size())
    local = topk_idx.reshape(-1).to(torch.int64) - first_expert
    mine = (local >= 0) & (local < local_experts)
    group = torch.where(mine, local, local_experts)  # other experts' choices form a last group
    sizes = torch.bincount(group, minlength=local_experts + 1)
    padded = (sizes[:local_experts] + align - 1) // align * align
    padded_ends = torch.cumsum(padded, 0)
    offs = padded_ends.to(torch.int32)
    # Row of each choice: its group's padded start plus its place in the group (token order).
    order = torch.argsort(group, stable=True)
    sorted_group = group[order]
    starts = torch.cumsum(sizes, 0) - sizes
    capacity = slots + (align - 1) * local_experts
    padded_starts = torch.cat([padded_ends - padded, padded_ends.new_full((1,), capacity)])
    place = torch.arange(slots, device=x.device) - starts[sorted_group]
    row = torch.where(sorted_group < local_experts, padded_starts[sorted_group] + place, capacity)
    # The slot each row holds (`slots` for none); other experts' choices land in a dropped last row.
    slot_of_row = torch.full((capacity + 1,), slots, dtype=torch.int64, device=x.device)
    slot_of_row = slot_of_row.scatter(0, row, order)[:capacity]
    keep = (slot_of_row < slots).unsqueeze(1)
    slot = torch.where(slot_of_row < slots, slot_of_row, 0)
    token = slot // k
    rows = torch.where(keep, x[token], 0)
    h = torch._grouped_mm(rows, w1.transpose(1, 2), offs=offs)
    z = torch._grouped_mm(activation(h), w2.transpose(1, 2), offs=offs)
    # Masked before the product: a weight's gradient is the product's gradient times z, and
    # 0 times an unspecified row could be NaN.
    z = torch.where(keep, z, 0)
    weighted = z.float() * topk_weights.reshape(-1)[slot].float().unsqueeze(1)
    return torch.zeros(tokens, w2.shape[1], dtype=torch.float32, device=x.device).index_add(0, token, weighted)


@dataclass
class MoeSettings:
    """What the MoE autograd function needs besides tensors.

    comm: the communicator's registered name (expert parallelism over its ranks);
    fused_activation: "none", "silu" or "gelu", what moe_dispatch_gemm's epilogue applies;
    activation: the activation between the two GEMMs in torch (with a fused one, its torch
    twin, which the backward's recomputation uses; else applied to y between the ops);
    recv_capacity: rows of the receive buffer, None for receive_capacity's bound (never
    overflows, never checked); a given one is checked after each dispatch (a host
    synchronisation) and, with on_overflow "retry", raised to the needed capacity and the
    dispatch called again; with "raise", MkMoeOverflowError;
    backward: "kernels" (moe_backward_on_kernels) or "recompute" (moe_local_experts
    differentiated);
    activation_backward: for "kernels", (h, dy) -> (act(h), dh) (moe_backward's
    ACTIVATION_BACKWARDS); None differentiates `activation` with autograd.
    """

    comm: str
    fused_activation: str
    activation: Activation
    recv_capacity: Optional[int] = None
    on_overflow: str = "retry"
    backward: str = "kernels"
    activation_backward: Optional[ActivationBackward] = None


def _dispatch(x, topk_idx, w1, settings: MoeSettings, expert_capacity: int | None):
    comm = resolve(settings.comm)
    tokens, topk = topk_idx.shape
    if settings.recv_capacity is None:
        capacity = receive_capacity(tokens, topk, w1.shape[0], comm.world_size, expert_capacity)
    else:
        capacity = settings.recv_capacity
    while True:
        dispatched = moe_dispatch_gemm(
            x,
            topk_idx,
            w1,
            settings.comm,
            capacity,
            activation=settings.fused_activation,
            expert_capacity=expert_capacity,
        )
        if settings.recv_capacity is None:
            return dispatched
        needed = int(dispatched.needed_capacity)  # every rank reads the same value, so all retry alike
        if needed <= capacity:
            return dispatched
        if settings.on_overflow != "retry":
            raise MkMoeOverflowError("nn.MoE", capacity, needed)
        capacity = settings.recv_capacity = needed


class MoeFunction(torch.autograd.Function):
    """The MoE layer's autograd node. Forward: the fused ops. Backward (settings.backward):
    "kernels", the output gradient dispatched through W2ᵀ and the activation's gradient
    combined through W1ᵀ (moe_backward_on_kernels); "recompute", the unfused recomputation
    (moe_local_experts) differentiated, the tokens gathered and their gradients
    reduce-scattered over the communicator.

    apply(x [tokens, hidden], topk_weights [tokens, k] float32, w1, w2, topk_idx [tokens, k]
    int32, settings, expert_capacity (None: no drop)) -> (out [tokens, hidden], drop_counts
    [experts] int32, zeros without drop mode; not differentiable).
    """

    @staticmethod
    def forward(ctx, x, topk_weights, w1, w2, topk_idx, settings: MoeSettings, capacity: int | None):
        dispatched = _dispatch(x, topk_idx, w1, settings, capacity)
        y = dispatched.y if settings.fused_activation != "none" else settings.activation(dispatched.y).contiguous()
        out = moe_gemm_combine(y, w2, topk_weights, dispatched.layout, settings.comm)
        if capacity is None:
            drop_counts = torch.zeros(w1.shape[0] * resolve(settings.comm).world_size, dtype=torch.int32, device=x.device)
        else:
            drop_counts = dispatched.drop_counts
        ctx.mark_non_differentiable(drop_counts)
        # The kernels' backward needs h = x·W1ᵀ per row: the unactivated dispatch output is
        # it (kept, as the forward allocated it anyway); a fused gated one is recomputed.
        hidden_rows = None
        if settings.backward == "kernels" and settings.fused_activation == "none":
            hidden_rows = dispatched.y
        ctx.save_for_backward(x, topk_weights, w1, w2, topk_idx, hidden_rows)
        ctx.settings, ctx.capacity, ctx.backward = settings, capacity, settings.backward
        ctx.recv_capacity = dispatched.y.shape[0]  # the capacity that fit (after any retry)
        return out, drop_counts

    @staticmethod
    def backward(ctx, dout, _drop_counts):
        x, topk_weights, w1, w2, topk_idx, hidden_rows = ctx.saved_tensors
        settings = ctx.settings
        comm = resolve(settings.comm)
        n = comm.world_size
        local_experts = w1.shape[0]
        kept_idx = topk_idx
        if ctx.capacity is not None:
            # A dropped choice is no choice: its id -1 gives it no output and its weight no gradient.
            kept, _ = moe_kept(topk_idx, local_experts * n, ctx.capacity)
            kept_idx = torch.where(kept, topk_idx, -1)
        if ctx.backward == "kernels":  # as the forward saw it
            activation_backward = settings.activation_backward or activation_backward_by_autograd(settings.activation)
            dx, dweights, dw1, dw2 = moe_backward_on_kernels(
                dout,
                x,
                topk_idx,
                kept_idx,
                topk_weights,
                w1,
                w2,
                hidden_rows,
                comm=settings.comm,
                recv_capacity=ctx.recv_capacity,
                expert_capacity=ctx.capacity,
                activation_backward=activation_backward,
            )
            return dx, dweights, dw1, dw2, None, None, None
        topk_idx = kept_idx
        dout = dout.contiguous()
        if n > 1:
            x_all, idx_all, weights_all, dout_all = (all_gather(t, comm) for t in (x, topk_idx, topk_weights, dout))
        else:
            x_all, idx_all, weights_all, dout_all = x, topk_idx, topk_weights, dout
        leaves = [t.detach().requires_grad_(True) for t in (x_all, weights_all, w1, w2)]
        with torch.enable_grad():
            x_, weights_, w1_, w2_ = leaves
            out = moe_local_experts(x_, idx_all, weights_, w1_, w2_, settings.activation, comm.rank * local_experts)
            dx, dweights, dw1, dw2 = torch.autograd.grad(out, leaves, dout_all.to(out.dtype))
        if n > 1:
            dx, dweights = reduce_scatter(dx.contiguous(), comm), reduce_scatter(dweights.contiguous(), comm)
        return dx, dweights, dw1, dw2, None, None, None


class MoE(nn.Module):
    """Expert-parallel mixture-of-experts MLP over a communicator's ranks, router outside.

    forward(x [..., hidden], topk_idx [..., k] (expert ids, -1 = none; int32 or int64),
    topk_weights [..., k] (converted to float32)) -> out like x:
    out[t] = Σ_j topk_weights[t, j] · expert_{topk_idx[t, j]}(x[t]).

    Rank r holds experts [r · E_local, (r + 1) · E_local) of `num_experts`: w1
    [E_local, 2 · ffn, hidden] for "swiglu" and "geglu" (Megatron's fused fc1 layout: per
    expert the ffn gate rows, then the ffn up rows) or [E_local, ffn, hidden] for the plain
    "silu", "gelu", "relu"; w2 [E_local, hidden, ffn]. bf16 or fp16; hidden and ffn
    multiples of 128. SwiGLU and GeGLU run in the first GEMM's epilogue; a plain activation
    runs in torch between the two fused ops.

    capacity_factor (drop mode, Megatron's): each rank sends each expert at most
    ceil(tokens · k / num_experts · capacity_factor) of its rows, the first in token order;
    the dropped choices add nothing, and `drop_counts` holds the latest forward's dropped
    rows per expert ([num_experts] int32 on the device; zeros without drop mode).

    recv_capacity: None (the default) sizes the receive buffer so that no routing overflows
    (receive_capacity); a smaller one is checked after every dispatch (a host
    synchronisation) and on overflow grown to the needed capacity and the dispatch repeated
    (on_overflow="retry") or MkMoeOverflowError raised ("raise"); the communicator stays
    usable either way. Every rank must call forward with the same token count.

    Trainable: x, topk_weights, w1 and w2 get their gradients; every rank must run the
    backward too, as it ran the forward. backward="kernels" (the default) runs dgrad on the
    MoE ops themselves (the output gradient dispatched through W2ᵀ, the activation's
    gradient combined through W1ᵀ; mkernel.nn.moe_backward) and wgrad as torch._grouped_mm
    over the received rows; backward="recompute" recomputes the experts unfused with
    torch._grouped_mm and differentiates that (one more forward of the experts).
    """

    def __init__(
        self,
        comm,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "swiglu",
        capacity_factor: float | None = None,
        recv_capacity: int | None = None,
        on_overflow: str = "retry",
        backward: str = "kernels",
        device=None,
        dtype=torch.bfloat16,
    ):
        super().__init__()
        layer = "nn.MoE"
        c = resolve(comm)
        if activation not in ACTIVATIONS:
            check.fail(layer, f"expected activation to be one of {tuple(ACTIVATIONS)}, but got {activation!r}")
        if on_overflow not in ("retry", "raise"):
            check.fail(layer, f"expected on_overflow to be 'retry' or 'raise', but got {on_overflow!r}")
        if backward not in BACKWARDS:
            check.fail(layer, f"expected backward to be one of {BACKWARDS}, but got {backward!r}")
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts % c.world_size != 0:
            check.fail(
                layer,
                f"expected num_experts to be a multiple of the world size ({c.world_size}), but got {num_experts!r}",
            )
        if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
            check.fail(layer, f"expected capacity_factor to be positive (or None: no drop), but got {capacity_factor!r}")
        if recv_capacity is not None:
            check.multiple_of(layer, "recv_capacity", recv_capacity, 128, positive=True)
        check.multiple_of(layer, "hidden_size", hidden_size, 128, positive=True)
        check.multiple_of(layer, "ffn_hidden_size", ffn_hidden_size, 128, positive=True)
        if num_experts > 1024:
            check.fail(layer, f"expected num_experts to be at most 1024, but got {num_experts}")
        fused, torch_activation = ACTIVATIONS[activation]
        self.comm = c.name
        self.num_experts = num_experts
        self.activation = activation
        self.capacity_factor = capacity_factor
        self.settings = MoeSettings(
            c.name, fused, torch_activation, recv_capacity, on_overflow, backward, ACTIVATION_BACKWARDS[activation]
        )
        local = num_experts // c.world_size
        fc1_rows = 2 * ffn_hidden_size if fused != "none" else ffn_hidden_size
        self.w1 = nn.Parameter(torch.empty(local, fc1_rows, hidden_size, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, ffn_hidden_size, device=device, dtype=dtype))
        self.drop_counts: torch.Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's weights as nn.Linear initialises its weight: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        for w in (self.w1, self.w2):
            bound = 1.0 / math.sqrt(w.shape[2])
            nn.init.uniform_(w, -bound, bound)

    @property
    def recv_capacity(self) -> int | None:
        """The receive buffer's rows (None: the no-overflow bound); grows on a retried overflow."""
        return self.settings.recv_capacity

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        layer = "nn.MoE"
        for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if not isinstance(t, torch.Tensor):
                check.fail(layer, f"expected {name} to be a torch.Tensor, but got {type(t).__name__}")
        if topk_idx.shape != topk_weights.shape or topk_idx.shape[:-1] != x.shape[:-1]:
            check.fail(
                layer,
                f"expected topk_idx and topk_weights [..., k] with x's leading dimensions {tuple(x.shape[:-1])}, but "
                f"got {tuple(topk_idx.shape)} and {tuple(topk_weights.shape)}",
            )
        if topk_idx.dtype not in (torch.int32, torch.int64):
            check.fail(layer, f"expected topk_idx to be int32 or int64, but got {topk_idx.dtype}")
        hidden = x.shape[-1]
        rows = x.reshape(-1, hidden).contiguous()
        idx = topk_idx.reshape(-1, topk_idx.shape[-1]).to(torch.int32).contiguous()
        weights = topk_weights.reshape(idx.shape).to(torch.float32).contiguous()
        capacity = None
        if self.capacity_factor is not None:
            capacity = expert_capacity(rows.shape[0], idx.shape[1], self.num_experts, self.capacity_factor)
        out, self.drop_counts = MoeFunction.apply(rows, weights, self.w1, self.w2, idx, self.settings, capacity)
        return out.view_as(x)

    def extra_repr(self) -> str:
        local, _, hidden = self.w1.shape
        return (
            f"comm={self.comm!r}, num_experts={self.num_experts} ({local} local), hidden={hidden}, "
            f"ffn={self.w2.shape[2]}, activation={self.activation!r}, capacity_factor={self.capacity_factor}, "
            f"backward={self.settings.backward!r}"
        )
