"""get_gpt_layer_mkernel_spec: Megatron-core's local GPT layer spec with mkernel's modules swapped in.

The spec is Megatron's own `get_gpt_layer_local_spec` with five modules replaced and
everything else (layer norms, bias-dropout-add, rotary embeddings, the router, the
module tree and so the state-dict keys) left as Megatron builds it:

| slot | local spec | mkernel spec |
|---|---|---|
| self_attention.linear_qkv | ColumnParallelLinear | MkernelColumnParallelLinear |
| self_attention.core_attention | DotProductAttention (no CP) | MkernelRingAttention (CP ring) |
| self_attention.linear_proj | RowParallelLinear | MkernelRowParallelLinear |
| mlp.linear_fc1 / mlp.linear_fc2 (dense) | Column / RowParallelLinear | MkernelColumn / MkernelRowParallelLinear |
| mlp (MoE) | MoELayer + SequentialMLP | MkernelMoELayer + MkernelExperts |
| input_layernorm / pre_mlp_layernorm, without Apex | WrappedTorchNorm (refuses SP) | SequenceParallelTorchNorm |
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from .attention import MkernelRingAttention
from .communicators import Communicators
from .config_checks import check_communicators, refuse
from .linear import MkernelColumnParallelLinear, MkernelRowParallelLinear
from .moe import MkernelExperts, MkernelMoELayer
from .norm import SequenceParallelTorchNorm
from .router_without_te import let_router_run_without_transformer_engine


def get_gpt_layer_mkernel_spec(
    communicators: Communicators,
    num_experts: int | None = None,
    qk_layernorm: bool = False,
    normalization: str | None = None,
    multi_latent_attention: bool = False,
    moe_grouped_gemm: bool = False,
) -> ModuleSpec:
    """A GPT TransformerLayer spec whose parallel linears, core attention and MoE run on mkernel.

    Args:
        communicators: the model's mkernel.megatron.Communicators (one per model; its
            process groups are the ones the model is built with).
        num_experts, qk_layernorm, normalization: as for Megatron's get_gpt_layer_local_spec.
        multi_latent_attention, moe_grouped_gemm: accepted to be refused by name (the
            local spec's MLA and GroupedMLP have other modules and state-dict keys).

    Checkpoints interchange with `get_gpt_layer_local_spec(num_experts, qk_layernorm,
    normalization=normalization)`: the same module tree, parameter shapes and keys.
    """
    check_communicators("get_gpt_layer_mkernel_spec", communicators)
    if multi_latent_attention:
        refuse("get_gpt_layer_mkernel_spec", "multi_latent_attention", True, [False])
    if moe_grouped_gemm:
        refuse("get_gpt_layer_mkernel_spec", "moe_grouped_gemm", True, [False])
    if num_experts:
        # Megatron's router, which the MoE layer keeps, fails without Transformer Engine otherwise.
        let_router_run_without_transformer_engine()
    local = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm, normalization=normalization)
    with_comms = {"communicators": communicators}
    column = ModuleSpec(module=MkernelColumnParallelLinear, params=with_comms)
    row = ModuleSpec(module=MkernelRowParallelLinear, params=with_comms)

    attention = local.submodules.self_attention
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(
            attention.submodules,
            linear_qkv=column,
            # SelfAttention calls core_attention(...) itself, not through build_module.
            core_attention=functools.partial(MkernelRingAttention, communicators=communicators),
            linear_proj=row,
        ),
    )
    mlp = local.submodules.mlp
    if num_experts is None:
        mlp = dataclasses.replace(
            mlp, submodules=dataclasses.replace(mlp.submodules, linear_fc1=column, linear_fc2=row)
        )
    else:
        experts = ModuleSpec(
            module=MkernelExperts,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        )
        mlp = dataclasses.replace(
            mlp,
            module=MkernelMoELayer,
            params={**mlp.params, **with_comms},
            submodules=dataclasses.replace(mlp.submodules, experts=experts),
        )
    norms = {
        name: SequenceParallelTorchNorm
        for name in ("input_layernorm", "pre_mlp_layernorm")
        if getattr(local.submodules, name) is WrappedTorchNorm
    }
    return dataclasses.replace(
        local, submodules=dataclasses.replace(local.submodules, self_attention=attention, mlp=mlp, **norms)
    )


def get_gpt_block_spec(layer_spec: ModuleSpec, num_layers: int, layer_norm=None) -> TransformerBlockSubmodules:
    """A GPTModel decoder spec of `num_layers` copies of `layer_spec` with a final norm that also
    builds under sequence parallelism (Megatron's block picks WrappedTorchNorm without Apex,
    which refuses it). Serves the local spec too, so both specs get the same final norm."""
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * num_layers,
        layer_norm=layer_norm if layer_norm is not None else SequenceParallelTorchNorm,
    )
