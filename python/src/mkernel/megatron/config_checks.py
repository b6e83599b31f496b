"""What the mkernel layers take from a Megatron TransformerConfig, checked when the model is built.

Every refusal is an MkInvalidArgumentError naming the layer, the option (a
TransformerConfig field or a constructor argument), the value given and the values
supported, so a configuration the fused ops cannot run stops at model build, never
at step 1000.
"""

from __future__ import annotations

import torch

from ..errors import MkInvalidArgumentError

GEMM_DTYPES = (torch.bfloat16, torch.float16)
RING_ATTENTION_HEAD_DIMS = (64, 128)
# mkMoeDispatchGemm / mkMoeGemmCombine: hidden and ffn multiples of 128, top-k in [1, 32], experts in [1, 1024].
MOE_MULTIPLE = 128
MOE_MAX_TOPK = 32
MOE_MAX_EXPERTS = 1024


def refuse(layer: str, option: str, value, supported) -> None:
    listed = ", ".join(repr(s) if not isinstance(s, str) else s for s in supported)
    raise MkInvalidArgumentError(
        f"mkernel.megatron.{layer}: {option} = {value!r} is not supported; supported: {listed}"
    )


def check_communicators(layer: str, communicators) -> None:
    from .communicators import Communicators

    if not isinstance(communicators, Communicators):
        raise MkInvalidArgumentError(
            f"mkernel.megatron.{layer}: expected communicators to be an mkernel.megatron.Communicators, "
            f"but got {type(communicators).__name__} (build the layer through "
            "get_gpt_layer_mkernel_spec(communicators))"
        )


def _multiple(layer: str, what: str, value: int, multiple: int) -> None:
    if value <= 0 or value % multiple != 0:
        raise MkInvalidArgumentError(
            f"mkernel.megatron.{layer}: {what} = {value} is not supported; supported: positive multiples of {multiple}"
        )


def check_dtype(layer: str, config) -> None:
    if config.params_dtype not in GEMM_DTYPES:
        refuse(layer, "config.params_dtype", config.params_dtype, [*GEMM_DTYPES, "(set bf16=True or fp16=True)"])


def check_linear(layer: str, config, *, in_features: int, out_features: int) -> None:
    """The fused GEMMs' rules: bf16/fp16, K and N (per rank) multiples of 8; Megatron options they do not do."""
    check_dtype(layer, config)
    for option in ("gradient_accumulation_fusion", "defer_embedding_wgrad_compute"):
        if getattr(config, option, False):
            refuse(layer, f"config.{option}", True, [False])
    _multiple(layer, "input features per rank (from hidden_size, ffn_hidden_size, kv_channels)", in_features, 8)
    _multiple(layer, "output features per rank (from hidden_size, ffn_hidden_size, kv_channels)", out_features, 8)


def check_attention(layer: str, config, *, head_dim: int, attn_mask_type_name: str, cp_comm_type) -> None:
    """mkRingAttention's rules and the Megatron attention options it does not implement."""
    check_dtype(layer, config)
    if head_dim not in RING_ATTENTION_HEAD_DIMS:
        refuse(layer, "config.kv_channels (head dim)", head_dim, RING_ATTENTION_HEAD_DIMS)
    if attn_mask_type_name not in ("causal", "no_mask"):
        refuse(layer, "attn_mask_type", attn_mask_type_name, ["AttnMaskType.causal", "AttnMaskType.no_mask"])
    if config.attention_dropout != 0.0:
        refuse(layer, "config.attention_dropout", config.attention_dropout, [0.0])
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        refuse(layer, "config.softmax_type", config.softmax_type, ["vanilla"])
    if getattr(config, "window_size", None) is not None:
        refuse(layer, "config.window_size", config.window_size, [None])
    if config.context_parallel_size > 1 and cp_comm_type not in (None, "p2p"):
        refuse(layer, "cp_comm_type", cp_comm_type, ["p2p (mkernel's ring)"])


def check_moe(layer: str, config, *, num_local_experts: int, ep_size: int) -> None:
    """mkMoeDispatchGemm / mkMoeGemmCombine's rules and the Megatron MoE options they do not implement."""
    check_dtype(layer, config)
    experts = num_local_experts * ep_size
    if not 1 <= experts <= MOE_MAX_EXPERTS:
        refuse(layer, "config.num_moe_experts", experts, [f"1 to {MOE_MAX_EXPERTS}"])
    if not 1 <= config.moe_router_topk <= MOE_MAX_TOPK:
        refuse(layer, "config.moe_router_topk", config.moe_router_topk, [f"1 to {MOE_MAX_TOPK}"])
    _multiple(layer, "config.hidden_size", config.hidden_size, MOE_MULTIPLE)
    _multiple(layer, "config.moe_ffn_hidden_size", config.moe_ffn_hidden_size, MOE_MULTIPLE)
    # moe_expert_capacity_factor is Megatron's router's: it drops choices (its drop policy,
    # "probs" or "position") before the layer sees them, and a token with fewer choices
    # is what mkernel's dispatch takes (-1 ids). Padding to capacity is not.
    for option, supported in (
        ("tensor_model_parallel_size", 1),
        ("expert_tensor_parallel_size", 1),
        ("add_bias_linear", False),
        ("moe_shared_expert_intermediate_size", None),
        ("moe_latent_size", None),
        ("moe_pad_expert_input_to_capacity", False),
        ("moe_apply_probs_on_input", False),
        ("moe_use_legacy_grouped_gemm", False),
    ):
        value = getattr(config, option, supported)
        if value != supported:
            refuse(layer, f"config.{option}", value, [supported])
    # The layer never calls Megatron's dispatcher (mkernel's dispatch replaces it), but MoELayer
    # builds one: "flex" would need DeepEP.
    if config.moe_token_dispatcher_type not in ("alltoall", "allgather"):
        refuse(layer, "config.moe_token_dispatcher_type", config.moe_token_dispatcher_type, ["alltoall", "allgather"])
