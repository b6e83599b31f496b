"""The fake implementations give the output shapes and dtypes the ops document, for
fake CUDA tensors (torch.compile's tracing) and meta tensors, at several world sizes;
they take the world size from the op's argument, never from the registry."""

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

    def one():
        return e(1, dtype=torch.float32)

    f8 = torch.float8_e4m3fn
    rows, k, nn_, tokens, hidden, ffn, topk, cap = 6, 32, 24, 5, 256, 384, 3, 512
    local_experts = 2
    layout_bytes = mkernel.moe_layout_bytes(tokens, topk, cap)
    dispatch = mkernel.moe_dispatch_gemm(
        e(tokens, hidden), e(tokens, topk, dtype=torch.int32), e(local_experts, ffn, hidden), comm, cap
    )
    gated = mkernel.moe_dispatch_gemm(
        e(tokens, hidden), e(tokens, topk, dtype=torch.int32), e(local_experts, 2 * ffn, hidden), comm, cap,
        activation="silu",
    )
    dropping = mkernel.moe_dispatch_gemm(
        e(tokens, hidden), e(tokens, topk, dtype=torch.int32), e(local_experts, 2 * ffn, hidden), comm, cap,
        activation="gelu", expert_capacity=3,
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
        "scaled_gemm_reduce_scatter": (
            spec(mkernel.scaled_gemm_reduce_scatter(e(rows * n, k, dtype=f8), e(nn_, k, dtype=f8), one(), one(), comm)),
            [((rows, nn_), bf16)],
        ),
        "scaled_gemm_all_reduce": (
            spec(
                mkernel.scaled_gemm_all_reduce(
                    e(rows, 256, dtype=f8),
                    e(nn_, 256, dtype=f8),
                    e(2, rows, dtype=torch.float32),
                    e(2, 1, dtype=torch.float32),
                    comm,
                    out_dtype=torch.float16,
                )
            ),
            [((rows, nn_), torch.float16)],
        ),
        "moe_dispatch_gemm": (
            spec(dispatch),
            [((cap, ffn), bf16), ((local_experts + 1,), torch.int32), ((layout_bytes,), torch.uint8)],
        ),
        "moe_dispatch_gemm silu": (
            [type(gated).__name__, *spec(gated)],
            ["MoeDispatch", ((cap, ffn), bf16), ((local_experts + 1,), torch.int32), ((layout_bytes,), torch.uint8)],
        ),
        "moe_dispatch_gemm drop": (
            [type(dropping).__name__, *spec(dropping)],
            [
                "MoeDropDispatch",
                ((cap, ffn), bf16),
                ((local_experts + 1,), torch.int32),
                ((layout_bytes,), torch.uint8),
                ((local_experts * n,), torch.int32),
            ],
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


def direct_ops(comm: str, n: int, device: str):
    """torch.ops.mkernel.* called as a traced graph calls them, the world size `n` an argument:
    {op: (output spec, expected spec)}."""
    ops = torch.ops.mkernel

    def e(*shape, dtype=bf16):
        return torch.empty(*shape, dtype=dtype, device=device)

    rows, k, nn_, tokens, hidden, ffn, topk, cap = 6, 32, 24, 5, 256, 384, 3, 512
    local_experts = 2
    layout = (mkernel.moe_layout_bytes(tokens, topk, cap),)
    q, kv, lse = e(2, 8, 4, 64), e(2, 8, 2, 64), e(2, 4, 8, dtype=torch.float32)
    f8, f32 = torch.float8_e4m3fn, torch.float32
    return {
        "all_gather": (spec(ops.all_gather(e(rows, 3, dtype=torch.int64), comm, n)), [((n * rows, 3), torch.int64)]),
        "reduce_scatter": (
            spec(ops.reduce_scatter(e(4 * n, 5, dtype=torch.float32), comm, n, "sum")),
            [((4, 5), torch.float32)],
        ),
        "all_reduce": (spec(ops.all_reduce(e(7, 3), comm, "sum")), [((7, 3), bf16)]),
        "all_gather_gemm": (
            spec(ops.all_gather_gemm(e(rows, k), e(nn_, k), comm, n, True)),
            [((n * rows, nn_), bf16), ((n * rows, k), bf16)],
        ),
        "gemm_reduce_scatter": (
            spec(ops.gemm_reduce_scatter(e(rows * n, k), e(nn_, k), comm, n)),
            [((rows, nn_), bf16)],
        ),
        "gemm_all_reduce": (spec(ops.gemm_all_reduce(e(rows, k), e(nn_, k), comm)), [((rows, nn_), bf16)]),
        "scaled_gemm_reduce_scatter": (
            spec(
                ops.scaled_gemm_reduce_scatter(
                    e(rows * n, k, dtype=f8), e(nn_, k, dtype=f8), e(rows * n, dtype=f32), e(nn_, dtype=f32), bf16, comm, n
                )
            ),
            [((rows, nn_), bf16)],
        ),
        "scaled_gemm_all_reduce": (
            spec(ops.scaled_gemm_all_reduce(e(rows, k, dtype=f8), e(nn_, k, dtype=f8), e(1, dtype=f32), e(1, dtype=f32), torch.float16, comm)),
            [((rows, nn_), torch.float16)],
        ),
        "moe_dispatch_gemm": (
            spec(
                ops.moe_dispatch_gemm(
                    e(tokens, hidden), e(tokens, topk, dtype=torch.int32), e(local_experts, ffn, hidden), comm, n, cap
                )
            ),
            [((cap, ffn), bf16), ((local_experts + 1,), torch.int32), (layout, torch.uint8)],
        ),
        "moe_dispatch_gemm_with_options": (
            spec(
                ops.moe_dispatch_gemm_with_options(
                    e(tokens, hidden),
                    e(tokens, topk, dtype=torch.int32),
                    e(local_experts, 2 * ffn, hidden),
                    comm,
                    n,
                    cap,
                    "silu",
                    7,
                )
            ),
            [
                ((cap, ffn), bf16),
                ((local_experts + 1,), torch.int32),
                ((local_experts * n,), torch.int32),
                (layout, torch.uint8),
            ],
        ),
        "moe_gemm_combine": (
            spec(
                ops.moe_gemm_combine(
                    e(cap, ffn),
                    e(local_experts, hidden, ffn),
                    e(tokens, topk, dtype=torch.float32),
                    e(*layout, dtype=torch.uint8),
                    comm,
                    n,
                )
            ),
            [((tokens, hidden), bf16)],
        ),
        "ring_attention": (
            spec(ops.ring_attention(q, kv, kv, comm, 0.125, True)),
            [((2, 8, 4, 64), bf16), ((2, 4, 8), torch.float32)],
        ),
        "ring_attention_backward": (
            spec(ops.ring_attention_backward(q, kv, kv, q, q, lse, comm, 0.125, True)),
            [((2, 8, 4, 64), bf16), ((2, 8, 2, 64), bf16), ((2, 8, 2, 64), bf16)],
        ),
    }


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("device", ["cuda", "meta"])
def test_fake_shapes_follow_the_world_size_argument(shape_comm, n, device):
    # The name is registered at world size 1: a fake that read the registry would give the 1-rank shapes.
    comm = shape_comm(1).name
    if device == "meta":
        results = direct_ops(comm, n, device)
    else:
        with FakeTensorMode():
            results = direct_ops(comm, n, device)
    for op, (got, want) in results.items():
        assert got == want, op


def test_fakes_never_look_the_communicator_up():
    # Nothing is registered under the name, so a lookup would raise.
    with FakeTensorMode():
        results = direct_ops("never-registered", 2, "cuda")
    assert len(results) == 13
    for op, (got, want) in results.items():
        assert got == want, op


def test_fake_rules_use_the_world_size_argument(shape_comm):
    comm = shape_comm(1).name
    with FakeTensorMode():
        x, idx = torch.empty(4, 128, dtype=bf16, device="cuda"), torch.empty(4, 2, dtype=torch.int32, device="cuda")
        w1 = torch.empty(600, 128, 128, dtype=bf16, device="cuda")
        torch.ops.mkernel.moe_dispatch_gemm(x, idx, w1, comm, 1, 128)  # 600 experts: within the limit
        with pytest.raises(mkernel.MkInvalidArgumentError, match=r"w1.shape\[0\] \* world size = 1200"):
            torch.ops.mkernel.moe_dispatch_gemm(x, idx, w1, comm, 2, 128)
        with pytest.raises(mkernel.MkInvalidArgumentError, match="expected world_size to be positive, but got 0"):
            torch.ops.mkernel.all_gather(x, comm, 0)


def real_calls(comm: str, n: int):
    """Each op that takes the world size, called on CPU tensors (its real implementation)."""
    ops = torch.ops.mkernel

    def t(*shape, dtype=bf16):
        return torch.zeros(*shape, dtype=dtype)

    layout = t(mkernel.moe_layout_bytes(4, 2, 128), dtype=torch.uint8)
    f8, f32 = torch.float8_e4m3fn, torch.float32
    return {
        "all_gather": lambda: ops.all_gather(t(4, 8), comm, n),
        "reduce_scatter": lambda: ops.reduce_scatter(t(8, 8), comm, n, "sum"),
        "all_gather_gemm": lambda: ops.all_gather_gemm(t(4, 16), t(8, 16), comm, n, False),
        "gemm_reduce_scatter": lambda: ops.gemm_reduce_scatter(t(8, 16), t(8, 16), comm, n),
        "scaled_gemm_reduce_scatter": lambda: ops.scaled_gemm_reduce_scatter(
            t(8, 16, dtype=f8), t(8, 16, dtype=f8), t(1, dtype=f32), t(1, dtype=f32), bf16, comm, n
        ),
        "moe_dispatch_gemm": lambda: ops.moe_dispatch_gemm(
            t(4, 128), t(4, 2, dtype=torch.int32), t(2, 128, 128), comm, n, 128
        ),
        "moe_dispatch_gemm_with_options": lambda: ops.moe_dispatch_gemm_with_options(
            t(4, 128), t(4, 2, dtype=torch.int32), t(2, 256, 128), comm, n, 128, "silu", 2
        ),
        "moe_gemm_combine": lambda: ops.moe_gemm_combine(
            t(128, 128), t(2, 128, 128), t(4, 2, dtype=torch.float32), layout, comm, n
        ),
    }


@pytest.mark.parametrize("op", list(real_calls("x", 1)))
def test_real_ops_refuse_another_world_size(shape_comm, op):
    comm = shape_comm(2).name
    # The options variant's messages name the public function that calls it.
    named = op.removesuffix("_with_options")
    with pytest.raises(
        mkernel.MkInvalidArgumentError,
        match=rf"mkernel.{named}: expected world_size to be the world size of communicator '{comm}' \(2\), but got 1",
    ):
        real_calls(comm, 1)[op]()
    # The communicator's own world size passes that check and reaches the device check.
    with pytest.raises(mkernel.MkInvalidArgumentError, match=rf"mkernel.{named}: expected \w+ to be on cuda:0"):
        real_calls(comm, 2)[op]()


def test_moe_layout_bytes_follows_the_documented_formula():
    # mkernel.h: 4·(4 + 3·tokens·topk + 6·recvCapacity/128 + 1025).
    for tokens, topk, cap in [(0, 1, 0), (5, 3, 512), (4096, 8, 65536)]:
        assert mkernel.moe_layout_bytes(tokens, topk, cap) == 4 * (4 + 3 * tokens * topk + 6 * cap // 128 + 1025)
    # The sizes the library refuses (a layout of 2^31 int32 words or more) raise on every call.
    for _ in range(2):
        with pytest.raises(mkernel.MkInvalidArgumentError, match="mkMoeLayoutBytes failed"):
            mkernel.moe_layout_bytes(1 << 20, 1 << 10, 128)


def test_moe_layout_bytes_of_symbolic_sizes_match_the_library():
    """The expression a symbolic token count gets is the library's count at every size."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    tokens = env.create_unbacked_symint()
    for t, k, cap in [(0, 1, 0), (1, 1, 128), (7, 3, 1), (333, 8, 4096), (4096, 8, 65536 + 128)]:
        size = mkernel.moe_layout_bytes(tokens, k, cap)
        assert isinstance(size, torch.SymInt)
        assert int(size.node.expr.subs(tokens.node.expr, t)) == mkernel.moe_layout_bytes(t, k, cap), (t, k, cap)


def test_moe_segment_starts():
    counts = torch.tensor([0, 1, 128, 129, 999], dtype=torch.int32)  # the last entry is the needed capacity
    assert mkernel.moe_segment_starts(counts).tolist() == [0, 0, 128, 256, 512]
