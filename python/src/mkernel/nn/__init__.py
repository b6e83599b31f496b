"""Layers built on mkernel's fused ops: tensor-parallel linear layers, ring attention and
the expert-parallel mixture of experts."""

from .attention import RingAttention
from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import MoE

__all__ = ["ColumnParallelLinear", "MoE", "RingAttention", "RowParallelLinear"]
