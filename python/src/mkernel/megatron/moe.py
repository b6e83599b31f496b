"""Megatron's MoE layer with the token dispatch and the experts on mkernel's fused MoE ops.

Megatron's router stays: it gives each token's routing map and probabilities. The
tokens' top-k expert ids and weights then go to mkernel.nn.moe's MoeFunction:
`moe_dispatch_gemm` (all-to-all dispatch over the expert-parallel group fused with each
local expert's first GEMM, and SwiGLU or GeGLU in its epilogue when the config's
activation is exactly one of them; any other activation runs in torch between the ops)
and `moe_gemm_combine` (the second GEMM fused with the way back and the weighted sum over
the top-k). Megatron's token dispatcher is built (MoELayer builds it) but not called.

The experts are Megatron's SequentialMLP: the same modules, parameters and state-dict
keys (`experts.local_experts.{i}.linear_fc1.weight`, ...), so checkpoints interchange
with the local spec. The fused ops take each GEMM's weights as one [E_local, N, K]
tensor: the forward stacks the experts' weights (one copy of them per step).

The backward is MoeFunction's default, on the MoE kernels (mkernel.nn.moe_backward): the
output gradient dispatched through W2ᵀ, the activation's gradient (autograd of the
config's activation) combined through W1ᵀ, the weight gradients grouped GEMMs over the
received rows. Gradients reach x, the router's probabilities and every expert weight.
`moe_reference` (mkernel.nn.moe) is the same layer written plainly, the tests' reference.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from ..nn.moe import MoeFunction, MoeSettings, glu
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
    if clamp is None and offset == 0:
        return glu(act)

    def clamped_glu(y):
        gate, linear = torch.chunk(y, 2, dim=-1)
        if clamp is not None:
            gate = gate.clamp(max=clamp)
            linear = linear.clamp(min=-clamp, max=clamp)
        return act(gate) * (linear + offset)

    return clamped_glu


def fused_activation_of(config) -> str:
    """What moe_dispatch_gemm's epilogue can apply for the config: "silu" (SwiGLU) or "gelu"
    (GeGLU, erf form, torch.nn.functional.gelu as megatron-core's MLP applies it) for a gated
    unit without clamp or offset, else "none" (the activation then runs in torch)."""
    if not config.gated_linear_unit or config.activation_func_clamp_value is not None or config.glu_linear_offset:
        return "none"
    return {F.silu: "silu", F.gelu: "gelu"}.get(config.activation_func, "none")


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
        self.moe_settings = MoeSettings(self.comm.name, fused_activation_of(self.config), self.activation)

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
        out, _drop_counts = MoeFunction.apply(x, topk_weights, w1, w2, topk_idx, self.moe_settings, None)
        return out.view_as(hidden_states), None
