"""Megatron-core's ColumnParallelLinear / RowParallelLinear with their communication fused.

The classes subclass Megatron's own: construction, parameters (shapes, initialisation,
the attributes Megatron's DDP and optimizer read), `state_dict` and `sharded_state_dict`
are Megatron's, so checkpoints interchange with the local spec. Only `forward` changes:

| layer | Megatron (local spec) | here |
|---|---|---|
| column, sequence parallel | AllGather(x), then x·Wᵀ; backward ReduceScatter(dy·W) | `all_gather_gemm`; backward `gemm_reduce_scatter` |
| column, no sequence parallelism | x·Wᵀ; backward AllReduce(dy·W) | x·Wᵀ; backward `gemm_all_reduce` |
| row, sequence parallel | ReduceScatter(x·Wᵀ); backward AllGather(dy)·W | `gemm_reduce_scatter`; backward `all_gather_gemm` |
| row, no sequence parallelism | AllReduce(x·Wᵀ) | `gemm_all_reduce` |

With one tensor-parallel rank there is no communication to fuse and both run x·Wᵀ.

The row layer adds its bias outside the fused op, in torch, as Megatron does: under
sequence parallelism each rank's bias gradient then covers its own sequence shard, and
Megatron's `finalize_model_grads` sums it over the group (the bias carries
`sequence_parallel=True`), exactly as for the local spec.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from ..nn.linear import _ColumnReplicated, _ColumnSequenceParallel, _RowAllReduce, _RowSequenceParallel
from .communicators import Communicators
from .config_checks import check_communicators, check_linear, refuse


class MkernelColumnParallelLinear(ColumnParallelLinear):
    """Megatron's ColumnParallelLinear whose forward and backward run on mkernel's fused ops.

    Takes Megatron's arguments plus `communicators` (the model's
    mkernel.megatron.Communicators, given by the layer spec). Refuses at construction
    what the fused path does not do (the message names the option and the supported
    values): gather_output, a weight passed at forward time, expert layers,
    gradient_accumulation_fusion, deferred embedding wgrad, dtypes other than bf16 /
    fp16, feature sizes that are not multiples of 8.
    """

    def __init__(self, input_size, output_size, *, communicators: Communicators, config, init_method, **kwargs):
        layer = "MkernelColumnParallelLinear"
        check_communicators(layer, communicators)
        for option, supported in (
            ("gather_output", False),
            ("skip_weight_param_allocation", False),
            ("is_expert", False),
            ("disable_grad_reduce", False),
        ):
            if kwargs.get(option, supported) != supported:
                refuse(layer, option, kwargs[option], [supported])
        super().__init__(input_size, output_size, config=config, init_method=init_method, **kwargs)
        check_linear(layer, config, in_features=input_size, out_features=self.output_size_per_partition)
        self.comm = communicators.for_group("tp", self.tp_group, config)
        self.communicators = communicators

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        """input_ [s, b, h] ([s/tp, b, h] under sequence parallelism) -> ([s, b, out/tp], bias or None)."""
        if weight is not None:
            refuse("MkernelColumnParallelLinear.forward", "weight", "a tensor", ["None (the layer's own weight)"])
        if runtime_gather_output:
            refuse("MkernelColumnParallelLinear.forward", "runtime_gather_output", True, [None, False])
        bias = None if self.skip_bias_add else self.bias
        n = self.comm.world_size
        if n == 1:
            output = F.linear(input_, self.weight, bias)
        else:
            rows = input_.reshape(-1, input_.shape[-1])
            if self.sequence_parallel:
                y = _ColumnSequenceParallel.apply(rows, self.weight, self.comm.name, n)
                lead = (input_.shape[0] * n, *input_.shape[1:-1])
            else:
                y = _ColumnReplicated.apply(rows, self.weight, self.comm.name)
                lead = tuple(input_.shape[:-1])
            if bias is not None:
                y = y + bias
            output = y.reshape(*lead, self.output_size_per_partition)
        return output, (self.bias if self.skip_bias_add else None)


class MkernelRowParallelLinear(RowParallelLinear):
    """Megatron's RowParallelLinear whose forward and backward run on mkernel's fused ops.

    Takes Megatron's arguments plus `communicators`. Requires input_is_parallel=True
    (the input is a column-parallel layer's output, as everywhere in a GPT layer).
    """

    def __init__(self, input_size, output_size, *, communicators: Communicators, config, init_method, **kwargs):
        layer = "MkernelRowParallelLinear"
        check_communicators(layer, communicators)
        if kwargs.get("input_is_parallel") is not True:
            refuse(layer, "input_is_parallel", kwargs.get("input_is_parallel"), [True])
        if kwargs.get("is_expert", False):
            refuse(layer, "is_expert", True, [False])
        super().__init__(input_size, output_size, config=config, init_method=init_method, **kwargs)
        check_linear(layer, config, in_features=self.input_size_per_partition, out_features=output_size)
        self.comm = communicators.for_group("tp", self.tp_group, config)
        self.communicators = communicators

    def forward(self, input_: torch.Tensor):
        """input_ [s, b, in/tp] -> ([s/tp, b, h] under sequence parallelism, else [s, b, h]; bias or None)."""
        n = self.comm.world_size
        if n == 1:
            output = F.linear(input_, self.weight)
        else:
            rows = input_.reshape(-1, input_.shape[-1])
            if self.sequence_parallel:
                if input_.shape[0] % n != 0:
                    refuse(
                        "MkernelRowParallelLinear.forward",
                        "sequence length (input.shape[0])",
                        input_.shape[0],
                        [f"multiples of the tensor-parallel size ({n})"],
                    )
                y = _RowSequenceParallel.apply(rows, self.weight, None, self.comm.name, n)
                output = y.reshape(input_.shape[0] // n, *input_.shape[1:-1], self.output_size)
            else:
                y = _RowAllReduce.apply(rows, self.weight, self.comm.name)
                output = y.reshape(*input_.shape[:-1], self.output_size)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None
