"""Layers built on mkernel's fused ops: tensor-parallel linear layers and ring attention."""

from .attention import RingAttention
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RingAttention", "RowParallelLinear"]
