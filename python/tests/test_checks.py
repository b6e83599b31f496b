"""Every Python-side argument check raises MkInvalidArgumentError (a ValueError) naming
the op, the argument and the rule. CPU tensors: shape and dtype rules are checked before
the device, so each rule is reached on a machine without a GPU."""

from __future__ import annotations

import datetime

import pytest
import torch

import mkernel
from mkernel import _checks

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
e4m3 = torch.float8_e4m3fn


def t(*shape, dtype=bf16):
    return torch.zeros(*shape, dtype=dtype)


def expect(fn, match: str, exc=mkernel.MkInvalidArgumentError):
    with pytest.raises(exc, match=match) as info:
        fn()
    assert isinstance(info.value, mkernel.MkError)
    return info.value


def cases(c):
    """(id, call, expected message) for every rule; `c` is a 2-rank shape-only communicator."""
    n = c.name
    return [
        # all_gather / reduce_scatter / all_reduce
        (
            "ag-not-tensor",
            lambda: mkernel.all_gather([1, 2], n),
            r"all_gather: expected input to be a torch.Tensor, but got list",
        ),
        (
            "ag-0d",
            lambda: mkernel.all_gather(torch.tensor(1.0), n),
            r"all_gather: expected input to have at least 1 dimension",
        ),
        (
            "ag-bool",
            lambda: mkernel.all_gather(t(4, dtype=torch.bool), n),
            r"all_gather: expected input to have dtype in .*but got torch.bool",
        ),
        ("ag-noncontig", lambda: mkernel.all_gather(t(4, 6).t(), n), r"all_gather: expected input to be contiguous"),
        (
            "ag-device",
            lambda: mkernel.all_gather(t(4, 8), n),
            r"all_gather: expected input to be on cuda:0 .*but got a tensor on cpu",
        ),
        (
            "ag-out-shape",
            lambda: mkernel.all_gather(t(4, 8), n, out=t(4, 8)),
            r"all_gather: expected out to have shape \(8, 8\), but got \(4, 8\)",
        ),
        (
            "ag-out-dtype",
            lambda: mkernel.all_gather(t(4, 8), n, out=t(8, 8, dtype=f16)),
            r"all_gather: expected out to have dtype in \(torch.bfloat16\)",
        ),
        (
            "rs-rows",
            lambda: mkernel.reduce_scatter(t(3, 8), n),
            r"reduce_scatter: expected input.shape\[0\] \(3\) to be divisible by the world size \(2\)",
        ),
        (
            "rs-op",
            lambda: mkernel.reduce_scatter(t(4, 8), n, "mean"),
            r"reduce_scatter: expected op to be one of \('sum', 'prod', 'max', 'min', 'avg'\), but got 'mean'",
        ),
        ("ar-op", lambda: mkernel.all_reduce(t(4, 8), n, "xor"), r"all_reduce: expected op to be one of"),
        ("ar-device", lambda: mkernel.all_reduce(t(4, 8), n), r"all_reduce: expected input to be on cuda:0"),
        # gemm
        (
            "gemm-dtype",
            lambda: mkernel.gemm(t(8, 16, dtype=f32), t(8, 16, dtype=f32)),
            r"gemm: expected a to have dtype in \(torch.bfloat16, torch.float16\), but got torch.float32",
        ),
        (
            "gemm-mixed",
            lambda: mkernel.gemm(t(8, 16), t(8, 16, dtype=f16)),
            r"gemm: expected a and b to have the same dtype, but got torch.bfloat16 and torch.float16",
        ),
        (
            "gemm-rank",
            lambda: mkernel.gemm(t(2, 8, 16), t(8, 16)),
            r"gemm: expected a to be a 2-D tensor, but got a 3-D tensor",
        ),
        ("gemm-k", lambda: mkernel.gemm(t(8, 16), t(8, 24)), r"gemm: expected a \[M, K\] and b \[N, K\] to share K"),
        (
            "gemm-k8",
            lambda: mkernel.gemm(t(8, 12), t(8, 12)),
            r"gemm: expected K \(a.shape\[1\]\) to be a multiple of 8, but got 12",
        ),
        (
            "gemm-k0",
            lambda: mkernel.gemm(t(8, 0), t(8, 0)),
            r"gemm: expected K \(a.shape\[1\]\) to be a positive multiple of 8, but got 0",
        ),
        (
            "gemm-cpu",
            lambda: mkernel.gemm(t(8, 16), t(8, 16)),
            r"gemm: expected a to be a CUDA tensor, but got a tensor on cpu",
        ),
        ("gemm-noncontig", lambda: mkernel.gemm(t(16, 8).t(), t(8, 16)), r"gemm: expected a to be contiguous"),
        # all_gather_gemm
        (
            "aggemm-k",
            lambda: mkernel.all_gather_gemm(t(4, 12), t(8, 12), n),
            r"all_gather_gemm: expected K \(a.shape\[1\]\) to be a multiple of 8, but got 12",
        ),
        (
            "aggemm-n",
            lambda: mkernel.all_gather_gemm(t(4, 16), t(12, 16), n),
            r"all_gather_gemm: expected N \(b.shape\[0\]\) to be a multiple of 8, but got 12",
        ),
        (
            "aggemm-device",
            lambda: mkernel.all_gather_gemm(t(4, 16), t(8, 16), n),
            r"all_gather_gemm: expected a to be on cuda:0",
        ),
        (
            "aggemm-out",
            lambda: mkernel.all_gather_gemm(t(4, 16), t(8, 16), n, out=t(4, 8)),
            r"all_gather_gemm: expected out to have shape \(8, 8\)",
        ),
        # gemm_reduce_scatter / gemm_all_reduce
        (
            "gemmrs-m",
            lambda: mkernel.gemm_reduce_scatter(t(5, 16), t(8, 16), n),
            r"gemm_reduce_scatter: expected M \(a.shape\[0\] = 5\) to be divisible by the world size \(2\)",
        ),
        (
            "gemmrs-n",
            lambda: mkernel.gemm_reduce_scatter(t(4, 16), t(6, 16), n),
            r"gemm_reduce_scatter: expected N \(b.shape\[0\]\) to be a multiple of 8, but got 6",
        ),
        (
            "gemmrs-k",
            lambda: mkernel.gemm_reduce_scatter(t(4, 4), t(8, 4), n),
            r"gemm_reduce_scatter: expected K \(a.shape\[1\]\) to be a multiple of 8, but got 4",
        ),
        (
            "gemmar-n",
            lambda: mkernel.gemm_all_reduce(t(5, 16), t(6, 16), n),
            r"gemm_all_reduce: expected N \(b.shape\[0\]\) to be a multiple of 8",
        ),
        (
            "gemmar-device",
            lambda: mkernel.gemm_all_reduce(t(5, 16), t(8, 16), n),
            r"gemm_all_reduce: expected a to be on cuda:0",
        ),
        # MoE dispatch
        (
            "moe-x-dtype",
            lambda: mkernel.moe_dispatch_gemm(t(4, 128, dtype=f32), t(4, 2, dtype=torch.int32), t(2, 128, 128), n, 256),
            r"moe_dispatch_gemm: expected x to have dtype in",
        ),
        (
            "moe-idx-dtype",
            lambda: mkernel.moe_dispatch_gemm(t(4, 128), t(4, 2, dtype=torch.int64), t(2, 128, 128), n, 256),
            r"moe_dispatch_gemm: expected topk_idx to have dtype in \(torch.int32\), but got torch.int64",
        ),
        (
            "moe-idx-rows",
            lambda: mkernel.moe_dispatch_gemm(t(4, 128), t(3, 2, dtype=torch.int32), t(2, 128, 128), n, 256),
            r"moe_dispatch_gemm: expected topk_idx to have one row per token \(4\), but got 3",
        ),
        (
            "moe-topk",
            lambda: mkernel.moe_dispatch_gemm(t(4, 128), t(4, 33, dtype=torch.int32), t(2, 128, 128), n, 256),
            r"moe_dispatch_gemm: expected topk \(topk_idx.shape\[1\]\) to be in \[1, 32\], but got 33",
        ),
        (
            "moe-w1-hidden",
            lambda: mkernel.moe_dispatch_gemm(t(4, 128), t(4, 2, dtype=torch.int32), t(2, 128, 256), n, 256),
            r"moe_dispatch_gemm: expected w1.shape\[2\] to be 128, but got 256",
        ),
        (
            "moe-hidden",
            lambda: mkernel.moe_dispatch_gemm(t(4, 64), t(4, 2, dtype=torch.int32), t(2, 128, 64), n, 256),
            r"moe_dispatch_gemm: expected hidden \(x.shape\[1\]\) to be a multiple of 128, but got 64",
        ),
        (
            "moe-ffn",
            lambda: mkernel.moe_dispatch_gemm(t(4, 128), t(4, 2, dtype=torch.int32), t(2, 96, 128), n, 256),
            r"moe_dispatch_gemm: expected ffn \(w1.shape\[1\]\) to be a multiple of 128, but got 96",
        ),
        (
            "moe-capacity",
            lambda: mkernel.moe_dispatch_gemm(t(4, 128), t(4, 2, dtype=torch.int32), t(2, 128, 128), n, 200),
            r"moe_dispatch_gemm: expected recv_capacity to be a multiple of 128, but got 200",
        ),
        (
            "moe-experts",
            lambda: mkernel.moe_dispatch_gemm(t(4, 128), t(4, 2, dtype=torch.int32), t(513, 128, 128), n, 256),
            r"moe_dispatch_gemm: expected the number of experts \(w1.shape\[0\] \* world size = 1026\) to be in \[1, 1024\]",
        ),
        (
            "moe-device",
            lambda: mkernel.moe_dispatch_gemm(t(4, 128), t(4, 2, dtype=torch.int32), t(2, 128, 128), n, 256),
            r"moe_dispatch_gemm: expected x to be on cuda:0",
        ),
        # MoE dispatch options: the gated activation and drop mode
        (
            "moe-activation",
            lambda: mkernel.moe_dispatch_gemm(
                t(4, 128), t(4, 2, dtype=torch.int32), t(2, 256, 128), n, 256, activation="swiglu"
            ),
            r"moe_dispatch_gemm: expected activation to be one of \('none', 'silu', 'gelu'\) \('silu' = SwiGLU, "
            r"'gelu' = GeGLU, both with the gated w1 \[E_local, 2 \* ffn, hidden\]\), but got 'swiglu'",
        ),
        (
            "moe-activation-type",
            lambda: mkernel.moe_dispatch_gemm(t(4, 128), t(4, 2, dtype=torch.int32), t(2, 256, 128), n, 256, activation=1),
            r"moe_dispatch_gemm: expected activation to be one of .*, but got 1",
        ),
        (
            "moe-gated-w1-rows",
            lambda: mkernel.moe_dispatch_gemm(
                t(4, 128), t(4, 2, dtype=torch.int32), t(2, 128, 128), n, 256, activation="silu"
            ),
            r"moe_dispatch_gemm: expected w1.shape\[1\] \(2 \* ffn with activation='silu', w1 \[E_local, 2 \* ffn, "
            r"hidden\], gate rows then up rows\) to be a multiple of 256, but got 128",
        ),
        (
            "moe-gated-w1-hidden",
            lambda: mkernel.moe_dispatch_gemm(
                t(4, 128), t(4, 2, dtype=torch.int32), t(2, 256, 256), n, 256, activation="gelu"
            ),
            r"moe_dispatch_gemm: expected w1.shape\[2\] to be 128, but got 256 \(x's hidden size; w1 is "
            r"\[E_local, 2 \* ffn, hidden\], gate rows then up rows\)",
        ),
        (
            "moe-drop-zero",
            lambda: mkernel.moe_dispatch_gemm(
                t(4, 128), t(4, 2, dtype=torch.int32), t(2, 128, 128), n, 256, expert_capacity=0
            ),
            r"moe_dispatch_gemm: expected expert_capacity >= 1 \(0 would drop every row; None is no-drop mode\), "
            r"but got 0",
        ),
        (
            "moe-drop-negative",
            lambda: mkernel.moe_dispatch_gemm(
                t(4, 128), t(4, 2, dtype=torch.int32), t(2, 128, 128), n, 256, expert_capacity=-3
            ),
            r"moe_dispatch_gemm: expected expert_capacity \(rows each rank may send to each expert; 0 = no drop\) "
            r"to be in \[0, 2\^31\), but got -3",
        ),
        (
            "moe-drop-too-large",
            lambda: mkernel.moe_dispatch_gemm(
                t(4, 128), t(4, 2, dtype=torch.int32), t(2, 128, 128), n, 256, expert_capacity=2**31
            ),
            r"moe_dispatch_gemm: expected expert_capacity .* to be in \[0, 2\^31\), but got 2147483648",
        ),
        (
            "moe-drop-type",
            lambda: mkernel.moe_dispatch_gemm(
                t(4, 128), t(4, 2, dtype=torch.int32), t(2, 128, 128), n, 256, expert_capacity=True
            ),
            r"moe_dispatch_gemm: expected expert_capacity to be an int, but got bool",
        ),
        (
            "moe-options-op-capacity",
            lambda: torch.ops.mkernel.moe_dispatch_gemm_with_options(
                t(4, 128), t(4, 2, dtype=torch.int32), t(2, 128, 128), n, 2, 256, "none", -1
            ),
            r"moe_dispatch_gemm: expected expert_capacity .* to be in \[0, 2\^31\), but got -1",
        ),
        (
            "moe-options-device",
            lambda: mkernel.moe_dispatch_gemm(
                t(4, 128), t(4, 2, dtype=torch.int32), t(2, 256, 128), n, 256, activation="silu", expert_capacity=4
            ),
            r"moe_dispatch_gemm: expected x to be on cuda:0",
        ),
        # MoE combine
        (
            "combine-weights",
            lambda: mkernel.moe_gemm_combine(t(256, 128), t(2, 128, 128), t(4, 2), t(16, dtype=torch.uint8), n),
            r"moe_gemm_combine: expected topk_weights to have dtype in \(torch.float32\), but got torch.bfloat16",
        ),
        (
            "combine-ffn",
            lambda: mkernel.moe_gemm_combine(
                t(256, 128), t(2, 128, 256), t(4, 2, dtype=f32), t(16, dtype=torch.uint8), n
            ),
            r"moe_gemm_combine: expected w2.shape\[2\] to be 128, but got 256",
        ),
        (
            "combine-layout",
            lambda: mkernel.moe_gemm_combine(
                t(256, 128), t(2, 128, 128), t(4, 2, dtype=f32), t(16, dtype=torch.uint8), n
            ),
            r"moe_gemm_combine: expected layout.numel\(\) to be \d+, but got 16 \(moe_layout_bytes",
        ),
        # ring attention
        (
            "ring-rank",
            lambda: mkernel.ring_attention(t(2, 8, 64), t(2, 8, 64), t(2, 8, 64), n),
            r"ring_attention: expected q to be a 4-D tensor",
        ),
        (
            "ring-headdim",
            lambda: mkernel.ring_attention(t(1, 8, 2, 96), t(1, 8, 2, 96), t(1, 8, 2, 96), n),
            r"ring_attention: expected head_dim \(q.shape\[3\]\) to be 64 or 128, but got 96",
        ),
        (
            "ring-kv",
            lambda: mkernel.ring_attention(t(1, 8, 4, 64), t(1, 8, 3, 64), t(1, 8, 3, 64), n),
            r"ring_attention: expected kv_heads \(k.shape\[2\] = 3\) to divide num_heads \(q.shape\[2\] = 4\)",
        ),
        (
            "ring-kv-shape",
            lambda: mkernel.ring_attention(t(1, 8, 4, 64), t(1, 8, 2, 64), t(1, 8, 1, 64), n),
            r"ring_attention: expected k and v to have the same shape",
        ),
        (
            "ring-seq",
            lambda: mkernel.ring_attention(t(1, 8, 4, 64), t(1, 6, 4, 64), t(1, 6, 4, 64), n),
            r"ring_attention: expected k \[batch, seq_local, kv_heads, head_dim\] to match q",
        ),
        (
            "ring-causal",
            lambda: mkernel.ring_attention(t(1, 7, 4, 64), t(1, 7, 4, 64), t(1, 7, 4, 64), n, causal=True),
            r"ring_attention: expected an even seq_local \(q.shape\[1\]\) with causal=True",
        ),
        (
            "ring-scale",
            lambda: mkernel.ring_attention(
                t(1, 8, 4, 64), t(1, 8, 4, 64), t(1, 8, 4, 64), n, softmax_scale=float("nan")
            ),
            r"ring_attention: expected softmax_scale to be finite and positive, but got nan",
        ),
        (
            "ring-dtype",
            lambda: mkernel.ring_attention(t(1, 8, 4, 64), t(1, 8, 4, 64, dtype=f16), t(1, 8, 4, 64), n),
            r"ring_attention: expected q and k to have the same dtype",
        ),
        (
            "ring-bwd-lse",
            lambda: torch.ops.mkernel.ring_attention_backward(
                *(t(1, 8, h, 64) for h in (4, 2, 2, 4, 4)), t(1, 8, 4, dtype=f32), n, 0.125, False
            ),
            r"ring_attention_backward: expected lse \[batch, heads, seq_local\] \(1, 4, 8\), but got \(1, 8, 4\)",
        ),
        (
            "ring-bwd-dout",
            lambda: torch.ops.mkernel.ring_attention_backward(
                *(t(1, 8, h, 64) for h in (4, 2, 2, 4, 2)), t(1, 4, 8, dtype=f32), n, 0.125, False
            ),
            r"ring_attention_backward: expected dout to have q's shape \(1, 8, 4, 64\), but got \(1, 8, 2, 64\)",
        ),
        (
            "ring-device",
            lambda: mkernel.ring_attention(t(1, 8, 4, 64), t(1, 8, 4, 64), t(1, 8, 4, 64), n),
            r"ring_attention: expected q to be on cuda:0",
        ),
        # fp8: the unscaled GEMM refuses it; scaled_gemm's rules
        (
            "gemm-fp8",
            lambda: mkernel.gemm(t(4, 16, dtype=e4m3), t(8, 16, dtype=e4m3)),
            r"gemm: expected a to have dtype in \(torch.bfloat16, torch.float16\), but got torch.float8_e4m3fn",
        ),
        (
            "sgemm-bf16",
            lambda: mkernel.scaled_gemm(t(4, 16), t(8, 16), t(1, dtype=f32), t(1, dtype=f32)),
            r"scaled_gemm: expected a to have dtype in \(torch.float8_e4m3fn, torch.float8_e5m2\), "
            r"but got torch.bfloat16",
        ),
        (
            "sgemm-b-e5m2",
            lambda: mkernel.scaled_gemm(
                t(4, 16, dtype=torch.float8_e5m2), t(8, 16, dtype=torch.float8_e5m2), t(1, dtype=f32), t(1, dtype=f32)
            ),
            r"scaled_gemm: expected b to have dtype torch.float8_e4m3fn, but got torch.float8_e5m2 \(only a may be e5m2\)",
        ),
        (
            "sgemm-b-bf16",
            lambda: mkernel.scaled_gemm(
                t(4, 16, dtype=torch.float8_e5m2), t(8, 16), t(1, dtype=f32), t(1, dtype=f32)
            ),
            r"scaled_gemm: expected b to have dtype in \(torch.float8_e4m3fn\), but got torch.bfloat16",
        ),
        # scaled_gemm_reduce_scatter / scaled_gemm_all_reduce: scaled_gemm's rules (e4m3 a), then the reduction's
        (
            "sgemmrs-e5m2",
            lambda: mkernel.scaled_gemm_reduce_scatter(
                t(4, 16, dtype=torch.float8_e5m2), t(8, 16, dtype=e4m3), t(1, dtype=f32), t(1, dtype=f32), n
            ),
            r"scaled_gemm_reduce_scatter: expected a to have dtype in \(torch.float8_e4m3fn\), but got torch.float8_e5m2",
        ),
        (
            "sgemmrs-m",
            lambda: mkernel.scaled_gemm_reduce_scatter(
                t(5, 16, dtype=e4m3), t(8, 16, dtype=e4m3), t(1, dtype=f32), t(1, dtype=f32), n
            ),
            r"scaled_gemm_reduce_scatter: expected M \(a.shape\[0\] = 5\) to be divisible by the world size \(2\)",
        ),
        (
            "sgemmrs-n",
            lambda: mkernel.scaled_gemm_reduce_scatter(
                t(4, 16, dtype=e4m3), t(12, 16, dtype=e4m3), t(1, dtype=f32), t(1, dtype=f32), n
            ),
            r"scaled_gemm_reduce_scatter: expected N \(b.shape\[0\]\) to be a multiple of 8, but got 12",
        ),
        (
            "sgemmrs-device",
            lambda: mkernel.scaled_gemm_reduce_scatter(
                t(4, 16, dtype=e4m3), t(8, 16, dtype=e4m3), t(4, dtype=f32), t(8, dtype=f32), n
            ),
            r"scaled_gemm_reduce_scatter: expected a to be on cuda:0",
        ),
        (
            "sgemmar-k",
            lambda: mkernel.scaled_gemm_all_reduce(
                t(3, 24, dtype=e4m3), t(8, 24, dtype=e4m3), t(1, dtype=f32), t(1, dtype=f32), n
            ),
            r"scaled_gemm_all_reduce: expected K \(a.shape\[1\]\) to be a multiple of 16, but got 24",
        ),
        (
            "sgemmar-block-layout",
            lambda: mkernel.scaled_gemm_all_reduce(
                t(3, 256, dtype=e4m3), t(8, 256, dtype=e4m3), t(3, 2, dtype=f32), t(2, 1, dtype=f32), n
            ),
            r"scaled_gemm_all_reduce: expected .* the shapes \(2, 3\) and \(2, 1\)",
        ),
        (
            "sgemmar-out",
            lambda: mkernel.scaled_gemm_all_reduce(
                t(3, 16, dtype=e4m3), t(8, 16, dtype=e4m3), t(1, dtype=f32), t(1, dtype=f32), n, out=t(3, 8, dtype=f16)
            ),
            r"scaled_gemm_all_reduce: expected out to have dtype",
        ),
        (
            "sgemm-k",
            lambda: mkernel.scaled_gemm(t(4, 24, dtype=e4m3), t(8, 24, dtype=e4m3), t(1, dtype=f32), t(1, dtype=f32)),
            r"scaled_gemm: expected K \(a.shape\[1\]\) to be a multiple of 16, but got 24",
        ),
        (
            "sgemm-shared-k",
            lambda: mkernel.scaled_gemm(t(4, 32, dtype=e4m3), t(8, 16, dtype=e4m3), t(1, dtype=f32), t(1, dtype=f32)),
            r"scaled_gemm: expected a \[M, K\] and b \[N, K\] to share K",
        ),
        (
            "sgemm-scale-dtype",
            lambda: mkernel.scaled_gemm(t(4, 16, dtype=e4m3), t(8, 16, dtype=e4m3), t(1), t(1, dtype=f32)),
            r"scaled_gemm: expected scale_a to have dtype in \(torch.float32\), but got torch.bfloat16",
        ),
        (
            "sgemm-scale-count",
            lambda: mkernel.scaled_gemm(
                t(4, 16, dtype=e4m3), t(8, 16, dtype=e4m3), t(4, 1, dtype=f32), t(1, dtype=f32)
            ),
            r"scaled_gemm: expected scale_a and scale_b to hold one value each \(per tensor\), M = 4 and N = 8 "
            r"values \(rowwise: one per row of a and of b\), or, K being a multiple of 128, .* but got \(4, 1\) and \(1,\)",
        ),
        (
            "sgemm-block-layout",
            lambda: mkernel.scaled_gemm(
                t(4, 256, dtype=e4m3), t(8, 256, dtype=e4m3), t(4, 2, dtype=f32), t(2, 1, dtype=f32)
            ),
            r"scaled_gemm: expected .* the shapes \(2, 4\) and \(2, 1\) \(block: \[K/128, M\] and "
            r"\[K/128, ceil\(N/128\)\]\), but got \(4, 2\) and \(2, 1\)",
        ),
        (
            "sgemm-out-dtype",
            lambda: mkernel.scaled_gemm(
                t(4, 16, dtype=e4m3), t(8, 16, dtype=e4m3), t(1, dtype=f32), t(1, dtype=f32), out_dtype=f32
            ),
            r"scaled_gemm: expected out_dtype to be one of \(torch.bfloat16, torch.float16\), but got torch.float32",
        ),
        (
            "sgemm-device",
            lambda: mkernel.scaled_gemm(
                t(4, 16, dtype=e4m3), t(8, 16, dtype=e4m3), t(4, 1, dtype=f32), t(1, 8, dtype=f32)
            ),
            r"scaled_gemm: expected a to be a CUDA tensor, but got a tensor on cpu",
        ),
    ]


CASE_IDS = [case[0] for case in cases(type("C", (), {"name": "x"}))]


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_op_argument_checks(shape_comm, case_id):
    c = shape_comm(2)
    _, call, match = next(case for case in cases(c) if case[0] == case_id)
    error = expect(call, match)
    assert isinstance(error, ValueError)
    assert error.code == 4  # mkInvalidArgument


def test_alignment_check_names_the_rule():
    raw = torch.zeros(64, dtype=torch.uint8)
    _checks.aligned("gemm", ("a", raw, 16), ("b", raw[4:], 4))  # torch's allocations are aligned
    expect(
        lambda: _checks.aligned("gemm", ("a", raw, 16), ("b", raw[1:], 16)),
        r"gemm: expected b to be 16-byte aligned, but its data starts at address 0x[0-9a-f]+",
    )
    # In the order given: the first misaligned tensor is named.
    expect(
        lambda: _checks.aligned("gemm", ("a", raw[2:], 4), ("b", raw[1:], 16)),
        r"gemm: expected a to be 4-byte aligned",
    )


def test_unknown_communicator_name():
    expect(
        lambda: mkernel.all_gather(t(4, 8), "no-such-comm"),
        r"no communicator is registered under the name 'no-such-comm'",
        mkernel.MkInvalidUsageError,
    )


def test_comm_of_wrong_type():
    expect(
        lambda: mkernel.all_gather(t(4, 8), 42), r"expected comm to be an mkernel.Communicator or its name, but got int"
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"unique_id": bytes(128), "rank": 2, "world_size": 2}, r"rank must be an int in \[0, 2\), got 2"),
        ({"unique_id": bytes(128), "rank": 0, "world_size": 0}, r"world_size must be a positive int, got 0"),
        ({"unique_id": bytes(100), "rank": 0, "world_size": 1}, r"unique_id must be 128 bytes, got 100"),
        ({"unique_id": bytes(128)}, r"unique_id needs rank and world_size"),
        ({"rank": 0, "world_size": 1}, r"rank and world_size are taken from the group"),
        (
            {"unique_id": bytes(128), "rank": 0, "world_size": 1, "timeout": -1},
            r"timeout must be between 1 ms and 2\^31-1 ms, got -1",
        ),
        (
            {"unique_id": bytes(128), "rank": 0, "world_size": 1, "bootstrap_timeout": datetime.timedelta(days=30)},
            r"bootstrap_timeout must be between",
        ),
        (
            {"unique_id": bytes(128), "rank": 0, "world_size": 1, "workspace_bytes": 0},
            r"workspace_bytes must be an int in \[1, ",
        ),
        ({"unique_id": bytes(128), "rank": 0, "world_size": 1, "max_ctas": 2.5}, r"max_ctas must be an int"),
        ({"unique_id": bytes(128), "rank": 0, "world_size": 1, "name": ""}, r"name must be a non-empty str"),
    ],
)
def test_communicator_argument_checks(kwargs, match):
    expect(lambda: mkernel.Communicator(**kwargs), "mkernel.Communicator: " + match)


def test_communicator_group_and_unique_id_exclusive():
    expect(
        lambda: mkernel.Communicator(object(), unique_id=bytes(128), rank=0, world_size=1),
        r"give either group or unique_id, not both",
    )


def test_communicator_name_must_be_free(shape_comm):
    taken = shape_comm(2).name
    expect(
        lambda: mkernel.Communicator(unique_id=bytes(128), rank=0, world_size=1, name=taken),
        "a communicator named .* already exists",
        mkernel.MkInvalidUsageError,
    )


def test_layers_check_divisibility(shape_comm):
    c = shape_comm(4)
    expect(
        lambda: mkernel.nn.ColumnParallelLinear(64, 30, c.name, device="meta"),
        r"nn.ColumnParallelLinear: expected out_features \(30\) to be divisible by the world size \(4\)",
    )
    expect(
        lambda: mkernel.nn.RowParallelLinear(30, 64, c.name, device="meta"),
        r"nn.RowParallelLinear: expected in_features \(30\) to be divisible by the world size \(4\)",
    )
    expect(
        lambda: mkernel.nn.RowParallelLinear(64, 64, c.name, dtype=torch.float32, device="meta"),
        r"expected dtype torch.bfloat16 or torch.float16",
    )


def test_cached_shape_rules_still_refuse(shape_comm):
    """The MoE and ring attention shape rules keep their results by the arguments' shapes,
    dtypes and contiguity: a call that differs from a cached good one in any of them, or a
    bad call made twice, raises its message. Meta tensors: the ops' fakes run the rules."""
    n = shape_comm(2).name

    def m(*shape, dtype=bf16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    def qkv(seq=8, dtype=bf16):
        return m(1, seq, 4, 64, dtype=dtype), m(1, seq, 2, 64, dtype=dtype), m(1, seq, 2, 64, dtype=dtype)

    q, k, v = qkv()
    for _ in range(2):  # the second call is served from the cache
        assert mkernel.ring_attention(q, k, v, n, causal=True)[0].shape == q.shape
    strided_k = m(1, 2, 8, 64).transpose(1, 2)  # k's shape, not contiguous
    assert strided_k.shape == k.shape
    for _ in range(2):
        expect(
            lambda: mkernel.ring_attention(q, strided_k, v, n, causal=True), r"ring_attention: expected k to be contiguous"
        )
        expect(lambda: mkernel.ring_attention(*qkv(dtype=f32), n), r"ring_attention: expected q to have dtype in")
        expect(lambda: mkernel.ring_attention(*qkv(seq=7), n, causal=True), r"expected an even seq_local")
        expect(lambda: mkernel.ring_attention(q, k, v, n, softmax_scale=float("nan")), r"expected softmax_scale")
    assert mkernel.ring_attention(*qkv(seq=7), n, causal=False)[0].shape == (1, 7, 4, 64)

    x, idx, w1 = m(5, 128), m(5, 2, dtype=torch.int32), m(1, 256, 128)
    assert mkernel.moe_dispatch_gemm(x, idx, w1, n, 256).y.shape == (256, 256)
    for _ in range(2):
        expect(lambda: mkernel.moe_dispatch_gemm(x, idx, w1, n, 200), r"expected recv_capacity to be a multiple of 128")
        expect(
            lambda: mkernel.moe_dispatch_gemm(m(128, 5).t(), idx, w1, n, 256),
            r"moe_dispatch_gemm: expected x to be contiguous",
        )
        expect(
            lambda: mkernel.moe_dispatch_gemm(x, idx, m(1, 256, 128, dtype=f16), n, 256),
            r"expected x and w1 to have the same dtype",
        )
