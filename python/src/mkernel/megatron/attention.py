"""Core attention for Megatron's SelfAttention on mkRingAttention / mkRingAttentionBackward.

Megatron's SelfAttention projects q, k, v and calls `core_attention(query, key, value,
attention_mask, attn_mask_type=...)` with [s, b, heads, head_dim] tensors of this rank's
sequence shard; it expects [s, b, heads · head_dim] back. This module transposes to
mkernel's [b, s, heads, head_dim], runs ring attention over the context-parallel group
and transposes back.

Context-parallel sharding needs no remapping: Megatron's `get_batch_on_this_cp_rank`
cuts the sequence into 2·cp chunks and gives rank r chunks r and 2·cp − 1 − r, in that
order, which is mkernel's causal zigzag layout (mkernel.h: rank r holds chunk r followed
by chunk 2·nranks − 1 − r, each seqLocal/2 tokens). `zigzag_positions` states the
layout; a test checks it against Megatron's function. Rotary embeddings stay Megatron's
(they already use the CP rank's positions).
"""

from __future__ import annotations

import math

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..ops import ring_attention
from .communicators import Communicators
from .config_checks import check_attention, check_communicators, refuse


def zigzag_positions(seq_global: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token positions of rank `cp_rank`'s shard in mkernel's causal zigzag layout, in local order."""
    chunk = seq_global // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_chunk = 2 * cp_size - 1 - cp_rank
    second = torch.arange(second_chunk * chunk, (second_chunk + 1) * chunk)
    return torch.cat([first, second])


class MkernelRingAttention(MegatronModule):
    """Megatron core attention (the DotProductAttention slot) on mkernel's ring attention.

    Built by SelfAttention with Megatron's keyword arguments plus `communicators` (bound
    by get_gpt_layer_mkernel_spec). Causal or unmasked self-attention; GQA when
    num_query_groups < num_attention_heads. Refused at construction (the message names
    the option): a head dim other than 64 or 128, attention dropout, masks other than
    causal / none, softmax variants, sliding windows, a CP communication type other than
    the ring (p2p).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        *,
        communicators: Communicators,
    ):
        super().__init__(config=config)
        layer = "MkernelRingAttention"
        check_communicators(layer, communicators)
        head_dim = config.kv_channels
        check_attention(
            layer, config, head_dim=head_dim, attn_mask_type_name=attn_mask_type.name, cp_comm_type=cp_comm_type
        )
        if attention_dropout not in (None, 0.0):
            refuse(layer, "attention_dropout", attention_dropout, [0.0])
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.causal = attn_mask_type == AttnMaskType.causal
        # Megatron's apply_query_key_layer_scaling divides the scale by the layer number and
        # multiplies it back inside its fp32 softmax: the same scores, so the plain scale here.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        cp_group = pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp") else None
        self.comm = communicators.for_group("cp", cp_group, config)
        self.communicators = communicators

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query [s, b, heads, d], key and value [s, b, groups, d] -> [s, b, heads · d]."""
        if packed_seq_params is not None:
            refuse("MkernelRingAttention.forward", "packed_seq_params", "given", [None])
        if attention_bias is not None:
            refuse("MkernelRingAttention.forward", "attention_bias", "given", [None])
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            refuse("MkernelRingAttention.forward", "attn_mask_type", mask_type.name, ["causal", "no_mask"])
        # The causal mask Megatron passes for causal attention is implied by `causal`; any
        # other explicit mask (padding) is not representable.
        if attention_mask is not None and mask_type != AttnMaskType.causal:
            refuse("MkernelRingAttention.forward", "attention_mask", "a tensor", ["None (or a causal mask)"])
        q, k, v = (t.transpose(0, 1).contiguous() for t in (query, key, value))
        out, _lse = ring_attention(
            q, k, v, self.comm.name, softmax_scale=self.softmax_scale, causal=mask_type == AttnMaskType.causal
        )
        s, b = query.shape[0], query.shape[1]
        return out.transpose(0, 1).reshape(s, b, -1)
