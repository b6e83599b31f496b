"""The fake implementations give the output shapes and dtypes the ops document, for
fake CUDA tensors (torch.compile's tracing) and meta tensors, at several world sizes."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mkernel

bf16 = torch.bfloat16


def spec(out):
    return [(tuple(o.shape), o.dtype) for o in (out if isinstance(out, (tuple, list)) else (out,))]


def run_ops(comm: str, n: int, device: str):
    def e(*shape, dtype=bf16):
        return torch.empty(*shape, dtype=dtype, device=device)

    rows, k, nn_, tokens, hidden, ffn, topk, cap = 6, 32, 24, 5, 256, 384, 3, 512
    local_experts = 2
    layout_bytes = mkernel.moe_layout_bytes(tokens, topk, cap)
    dispatch = mkernel.moe_dispatch_gemm(
        e(tokens, hidden), e(tokens, topk, dtype=torch.int32), e(local_experts, ffn, hidden), comm, cap
    )
    return {
        "all_gather": (spec(mkernel.all_gather(e(rows, 3, dtype=torch.int64), comm)), [((n * rows, 3), torch.int64)]),
        "reduce_scatter": (
            spec(mkernel.reduce_scatter(e(4 * n, 5, dtype=torch.float32), comm, "max")),
            [((4, 5), torch.float32)],
        ),
        "all_reduce": (
            spec(mkernel.all_reduce(e(7, 3, 2, dtype=torch.float16), comm, "avg")),
            [((7, 3, 2), torch.float16)],
        ),
        "gemm": (spec(mkernel.gemm(e(rows, k), e(nn_, k))), [((rows, nn_), bf16)]),
        "all_gather_gemm": (spec(mkernel.all_gather_gemm(e(rows, k), e(nn_, k), comm)), [((n * rows, nn_), bf16)]),
        "all_gather_gemm+gathered": (
            spec(mkernel.all_gather_gemm(e(rows, k), e(nn_, k), comm, return_gathered=True)),
            [((n * rows, nn_), bf16), ((n * rows, k), bf16)],
        ),
        "gemm_reduce_scatter": (
            spec(mkernel.gemm_reduce_scatter(e(rows * n, k), e(nn_, k), comm)),
            [((rows, nn_), bf16)],
        ),
        "gemm_all_reduce": (spec(mkernel.gemm_all_reduce(e(rows, k), e(nn_, k), comm)), [((rows, nn_), bf16)]),
        "moe_dispatch_gemm": (
            spec(dispatch),
            [((cap, ffn), bf16), ((local_experts + 1,), torch.int32), ((layout_bytes,), torch.uint8)],
        ),
        "moe_gemm_combine": (
            spec(
                mkernel.moe_gemm_combine(
                    dispatch.y,
                    e(local_experts, hidden, ffn),
                    e(tokens, topk, dtype=torch.float32),
                    dispatch.layout,
                    comm,
                )
            ),
            [((tokens, hidden), bf16)],
        ),
        "ring_attention": (
            spec(mkernel.ring_attention(e(2, 8, 4, 64), e(2, 8, 2, 64), e(2, 8, 2, 64), comm, causal=True)),
            [((2, 8, 4, 64), bf16), ((2, 4, 8), torch.float32)],
        ),
    }


@pytest.mark.parametrize("n", [1, 2, 4])
def test_fake_cuda_tensors(shape_comm, n):
    comm = shape_comm(n).name
    with FakeTensorMode():
        results = run_ops(comm, n, "cuda")
    for op, (got, want) in results.items():
        assert got == want, op


@pytest.mark.parametrize("n", [1, 2, 4])
def test_meta_tensors(shape_comm, n):
    comm = shape_comm(n).name
    for op, (got, want) in run_ops(comm, n, "meta").items():
        assert got == want, op


def test_fake_outputs_stay_on_the_input_device(shape_comm):
    comm = shape_comm(2).name
    # Without CUDA any index is fake; with it, fake tensors need a device that exists, and
    # the last one differs from the current one wherever there are several.
    device = f"cuda:{torch.cuda.device_count() - 1}" if torch.cuda.is_available() else "cuda:3"
    with FakeTensorMode():
        out = mkernel.all_gather_gemm(
            torch.empty(4, 16, dtype=bf16, device=device), torch.empty(8, 16, dtype=bf16, device=device), comm
        )
    assert out.device == torch.device(device)


def test_fake_implementations_check_shapes(shape_comm):
    comm = shape_comm(4).name
    with FakeTensorMode():
        with pytest.raises(mkernel.MkInvalidArgumentError, match="divisible by the world size"):
            mkernel.gemm_reduce_scatter(
                torch.empty(6, 16, dtype=bf16, device="cuda"), torch.empty(8, 16, dtype=bf16, device="cuda"), comm
            )


def test_moe_layout_bytes_follows_the_documented_formula():
    # mkernel.h: 4·(4 + 3·tokens·topk + 6·recvCapacity/128 + 1025).
    for tokens, topk, cap in [(0, 1, 0), (5, 3, 512), (4096, 8, 65536)]:
        assert mkernel.moe_layout_bytes(tokens, topk, cap) == 4 * (4 + 3 * tokens * topk + 6 * cap // 128 + 1025)


def test_moe_segment_starts():
    counts = torch.tensor([0, 1, 128, 129, 999], dtype=torch.int32)  # the last entry is the needed capacity
    assert mkernel.moe_segment_starts(counts).tolist() == [0, 0, 128, 256, 512]
