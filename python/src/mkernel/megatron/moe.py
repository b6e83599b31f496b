"""Megatron's MoE layer with the token dispatch and the experts on mkernel's fused MoE ops.

Megatron's router stays: it gives each token's routing map and probabilities. The
tokens' top-k expert ids and weights then go to `moe_dispatch_gemm` (all-to-all dispatch
over the expert-parallel group fused with each local expert's first GEMM), the gated or
plain activation of the config runs in torch, and `moe_gemm_combine` (the second GEMM
fused with the way back and the weighted sum over the top-k) returns each token's
output. Megatron's token dispatcher is built (MoELayer builds it) but not called.

The experts are Megatron's SequentialMLP: the same modules, parameters and state-dict
keys (`experts.local_experts.{i}.linear_fc1.weight`, ...), so checkpoints interchange
with the local spec. The fused ops take each GEMM's weights as one [E_local, N, K]
tensor: the forward stacks the experts' weights (one copy of them per step).

The library has no backward for its MoE ops yet. The backward here recomputes the
layer unfused from the saved inputs (the tokens all-gathered over the expert-parallel
group, the same GEMMs and activation, the outputs summed back: `moe_reference`)
and differentiates that: gradients
reach x, the router's probabilities and every expert weight, at the cost of one more
forward of the experts.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from ..ops import moe_dispatch_gemm, moe_gemm_combine
from .communicators import Communicators
from .config_checks import check_communicators, check_moe, refuse


def topk_from_routing(probs: torch.Tensor, routing_map: torch.Tensor, topk: int):
    """Megatron's router output ([tokens, experts] probabilities and boolean map) as mkernel's
    (topk_idx int32 [tokens, topk], -1 where a token has fewer choices; topk_weights float32)."""
    idx = torch.topk(routing_map.to(torch.float32), topk, dim=1).indices
    chosen = routing_map.gather(1, idx)
    weights = probs.gather(1, idx).to(torch.float32) * chosen
    return idx.masked_fill(~chosen, -1).to(torch.int32), weights


def activation_of(config) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation Megatron's MLP applies between fc1 and fc2 (without bias), gated or plain."""
    act = config.activation_func
    if not config.gated_linear_unit:
        return act
    offset = config.glu_linear_offset
    clamp = config.activation_func_clamp_value

    def glu(y):
        gate, linear = torch.chunk(y, 2, dim=-1)
        if clamp is not None:
            gate = gate.clamp(max=clamp)
            linear = linear.clamp(min=-clamp, max=clamp)
        return act(gate) * (linear + offset)

    return glu


def moe_reference(x, topk_idx, topk_weights, w1, w2, activation, ep_group=None):
    """The MoE layer unfused, differentiable in x, topk_weights, w1 and w2.

    x [tokens, hidden]; topk_idx [tokens, k] (-1: none), topk_weights [tokens, k] float32;
    w1 [E_local, ffn, hidden], w2 [E_local, hidden, ffn] of this rank's experts
    [r·E_local, (r+1)·E_local). out[t] = Σ_j topk_weights[t, j] · expert_e(x[t]).

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


def receive_capacity(tokens: int, topk: int, local_experts: int, ep: int) -> int:
    """Rows of moe_dispatch_gemm's receive buffer that no routing can overflow: every rank's
    tokens sending min(topk, E_local) rows here, each expert's segment padded to 128 rows."""
    rows = ep * tokens * min(topk, local_experts) + local_experts * 127
    return (rows + 127) // 128 * 128


class _FusedMoe(torch.autograd.Function):
    """Forward: moe_dispatch_gemm -> activation -> moe_gemm_combine. Backward: moe_reference recomputed."""

    @staticmethod
    def forward(ctx, x, topk_weights, w1, w2, topk_idx, layer):
        tokens, topk = topk_idx.shape
        capacity = receive_capacity(tokens, topk, w1.shape[0], layer.comm.world_size)
        dispatched = moe_dispatch_gemm(x, topk_idx, w1, layer.comm.name, capacity)
        y_act = layer.activation(dispatched.y).contiguous()
        out = moe_gemm_combine(y_act, w2, topk_weights, dispatched.layout, layer.comm.name)
        ctx.save_for_backward(x, topk_weights, w1, w2, topk_idx)
        ctx.layer = layer
        return out

    @staticmethod
    def backward(ctx, dout):
        x, topk_weights, w1, w2, topk_idx = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(True) for t in (x, topk_weights, w1, w2)]
        with torch.enable_grad():
            x_, weights_, w1_, w2_ = inputs
            out = moe_reference(x_, topk_idx, weights_, w1_, w2_, ctx.layer.activation, ctx.layer.ep_group)
            grads = torch.autograd.grad(out, inputs, dout, allow_unused=True)
        return (*grads, None, None)


class MkernelExperts(SequentialMLP):
    """Megatron's SequentialMLP (same parameters and keys); the MoE layer reads its weights stacked."""

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        w1 = torch.stack([expert.linear_fc1.weight for expert in self.local_experts])
        w2 = torch.stack([expert.linear_fc2.weight for expert in self.local_experts])
        return w1, w2


class MkernelMoELayer(MoELayer):
    """Megatron's MoELayer with dispatch, experts and combine on mkernel's fused MoE ops.

    Takes Megatron's arguments plus `communicators`. Refused at construction (the message
    names the option and the supported values): what mkMoeDispatchGemm /
    mkMoeGemmCombine cannot take (hidden and moe_ffn_hidden_size not multiples of 128,
    more than 32 choices or 1024 experts, a dtype other than bf16/fp16) and the Megatron
    MoE options this layer does not implement (tensor or expert-tensor parallelism, expert
    biases, shared experts, latent projections, capacity dropping and padding, probabilities
    applied on the input, the flex token dispatcher).
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *, communicators: Communicators):
        layer = "MkernelMoELayer"
        check_communicators(layer, communicators)
        ep_size = config.expert_model_parallel_size
        if config.num_moe_experts % ep_size != 0:
            multiples = f"multiples of expert_model_parallel_size ({ep_size})"
            refuse(layer, "config.num_moe_experts", config.num_moe_experts, [multiples])
        check_moe(layer, config, num_local_experts=config.num_moe_experts // ep_size, ep_size=ep_size)
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        if not isinstance(self.experts, MkernelExperts):
            refuse(layer, "submodules.experts", type(self.experts).__name__, ["MkernelExperts"])
        self.ep_group = self.experts.ep_group
        self.comm = communicators.for_group("ep", self.ep_group, config)
        self.communicators = communicators
        self.activation = activation_of(self.config)

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        """hidden_states [s, b, h] -> ([s, b, h], None)."""
        if intermediate_tensors is not None:
            refuse("MkernelMoELayer.forward", "intermediate_tensors", "given", [None])
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        probs, routing_map = self.route(hidden_states, padding_mask)
        topk_idx, topk_weights = topk_from_routing(probs, routing_map, self.config.moe_router_topk)
        w1, w2 = self.experts.stacked_weights()
        x = hidden_states.reshape(-1, hidden_states.shape[-1]).contiguous()
        out = _FusedMoe.apply(x, topk_weights, w1, w2, topk_idx, self)
        return out.view_as(hidden_states), None
