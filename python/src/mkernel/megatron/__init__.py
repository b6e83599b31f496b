"""mkernel inside Megatron-core: a GPT layer spec whose tensor-, sequence-, context- and
expert-parallel modules run on mkernel's fused ops (docs/megatron.md).

    from mkernel.megatron import Communicators, get_gpt_layer_mkernel_spec
    comms = Communicators()                      # over megatron.core.parallel_state's groups
    spec = get_gpt_layer_mkernel_spec(comms)     # in place of get_gpt_layer_local_spec()
    model = GPTModel(config, transformer_layer_spec=spec, ...)

Importing this module imports megatron.core; `import mkernel` does not.
"""

from ..nn.moe import moe_reference
from .attention import MkernelRingAttention, zigzag_positions
from .communicators import Communicators
from .linear import MkernelColumnParallelLinear, MkernelRowParallelLinear
from .moe import MkernelExperts, MkernelMoELayer, topk_from_routing
from .norm import SequenceParallelTorchNorm
from .router_without_te import let_router_run_without_transformer_engine
from .spec import get_gpt_block_spec, get_gpt_layer_mkernel_spec

__all__ = [
    "Communicators",
    "MkernelColumnParallelLinear",
    "MkernelExperts",
    "MkernelMoELayer",
    "MkernelRingAttention",
    "MkernelRowParallelLinear",
    "SequenceParallelTorchNorm",
    "get_gpt_block_spec",
    "get_gpt_layer_mkernel_spec",
    "let_router_run_without_transformer_engine",
    "moe_reference",
    "topk_from_routing",
    "zigzag_positions",
]
