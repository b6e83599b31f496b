"""Context-parallel attention as a module, forward and backward."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import comm_name, default_softmax_scale, dispatch, resolve


class RingAttention(nn.Module):
    """Ring (context-parallel) attention over the ranks of a communicator.

    forward(q, k, v) takes this rank's shard of the global sequence:
    q [batch, seq_local, heads, head_dim], k and v [batch, seq_local, kv_heads, head_dim]
    (bf16 or fp16, head_dim 64 or 128, kv_heads dividing heads), contiguous shards
    without `causal`, the zigzag layout with `causal=True` (see mkernel.ring_attention).
    Returns out, like q; with return_lse=True also lse [batch, heads, seq_local] float32.

    Differentiable in q, k and v: the backward is mkRingAttentionBackward, which every rank
    runs (as every rank ran the forward); no gradient flows through lse.
    """

    def __init__(self, comm, *, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False):
        super().__init__()
        resolve(comm)
        self.comm = comm_name(comm)
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.return_lse = return_lse

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        scale = self.softmax_scale if self.softmax_scale is not None else default_softmax_scale(q.shape[-1])
        out, lse = dispatch(
            torch.ops.mkernel.ring_attention, q, k, v, self.comm, float(scale), bool(self.causal)
        )
        return (out, lse) if self.return_lse else out

    def extra_repr(self) -> str:
        return f"comm={self.comm!r}, causal={self.causal}, softmax_scale={self.softmax_scale}"
