"""Megatron's torch layer norm made usable under sequence parallelism.

Without Apex or Transformer Engine, Megatron's layer norm is WrappedTorchNorm (torch's
LayerNorm / RMSNorm), which refuses sequence parallelism only because it does not mark
its parameters: under sequence parallelism each tensor-parallel rank normalises its own
sequence shard, so the norm's weight and bias gradients are partial sums, and Megatron's
`finalize_model_grads` adds them over the group for every parameter marked
`sequence_parallel` (as Apex's FusedLayerNorm marks its own). This norm is torch's,
marked the same way; its parameters and state-dict keys are WrappedTorchNorm's.
"""

from __future__ import annotations

import copy

from megatron.core.transformer.torch_norm import WrappedTorchNorm


class SequenceParallelTorchNorm:
    """WrappedTorchNorm(config, hidden_size, eps, ...) that also builds under sequence parallelism."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if not config.sequence_parallel:
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        unmarked = copy.copy(config)
        unmarked.sequence_parallel = False
        norm = WrappedTorchNorm(unmarked, hidden_size, eps, **kwargs)
        for parameter in norm.parameters():
            parameter.sequence_parallel = True
        return norm
