"""Megatron-core's MoE router on an installation without Transformer Engine.

megatron-core 0.16.1's `moe_utils.router_gating_linear` (every router's gating GEMM, in
the local spec as in mkernel's) reads the module global `te_general_gemm` to choose between
Transformer Engine's GEMM and torch's, but the global is only bound when Transformer Engine
imports: without it, the first MoE forward stops with `NameError: name 'te_general_gemm' is
not defined`. Binding it to None selects torch's GEMM, the path the code already has for
that case. Installations with Transformer Engine are left as they are.
"""

from __future__ import annotations


def let_router_run_without_transformer_engine() -> bool:
    """Binds `moe_utils.te_general_gemm = None` when Transformer Engine is absent and the
    global is missing. Returns whether it bound it. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if getattr(moe_utils, "HAVE_TE", False) or hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True
