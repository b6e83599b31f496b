"""torch.library ops: torch.ops.mkernel.*, each with a fake implementation.

The fake implementations run the same shape and dtype rules as the eager ops and return
empty tensors of the output shapes, so torch.compile(fullgraph=True) traces through them
without graph breaks, and they also serve meta tensors. A communicator is passed by its
registered name (Communicator.name), as torch's functional collectives pass a group name.

Every op whose output shapes or shape rules depend on the world size takes it as an
explicit `world_size` argument, as torch's functional collectives take `group_size`, and
its fake implementation reads nothing but its arguments (docs/decisions/0046). The traced
graph then holds every input of the shape logic, so a compiled graph cached for one world
size (Inductor's FX graph cache is on disk, shared by every process of a user) cannot be
served to a communicator of another size under the same name. The real implementations
look the name up and refuse a `world_size` that differs from the communicator's.

The ops are defined with torch.library.Library (define, impl, register_fake), not with
the torch.library.custom_op decorator, whose eager calls pay about 5 µs more of host time
for the same schema, tags and fake: its backend kernel runs behind a Dynamo-disabling
wrapper and checks every result for aliasing, and its autograd kernel builds a metadata
object per call (pytorch/pytorch#139500). Each op gets the autograd kernel custom_op would
give it (_autograd_kernel): ring attention's formula, and for the others a node whose
backward raises, so a gradient never stops silently at an mkernel op. The public
functions skip that kernel where it would only pass the call on (mkernel.ops.dispatch).
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad as _forward_ad
from torch.library import Library

from . import _checks as check
from . import ops
from .comm import lookup

_LIBRARY = Library("mkernel", "FRAGMENT")
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


def _below_autograd(op, keyset, *args):
    """Calls `op` below the autograd keys: its implementation, or its fake while tracing."""
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(keyset & _AFTER_AUTOGRAD, *args)


class _NoGradient(torch.autograd.Function):
    """The autograd node of an op without a gradient formula: its backward raises."""

    @staticmethod
    def forward(ctx, name, op, keyset, *args):
        ctx.name = name
        return _below_autograd(op, keyset, *args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"mkernel.{ctx.name} has no gradient formula: the backward pass reached it through an input that "
            "requires grad (detach that input, or use the mkernel.nn layers, whose backward passes are defined)"
        )


class _RingAttentionGradient(torch.autograd.Function):
    """Ring attention's autograd node: the backward is torch.ops.mkernel.ring_attention_backward
    on what the forward saved. lse is a by-product (as in FlashAttention) and is returned as a
    constant (requires_grad False): a loss that uses it gets no gradient through it, visibly,
    rather than a silent zero."""

    @staticmethod
    def forward(ctx, name, op, keyset, q, k, v, comm, softmax_scale, causal):
        out, lse = _below_autograd(op, keyset, q, k, v, comm, softmax_scale, causal)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.softmax_scale, ctx.causal = comm, softmax_scale, causal
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ops.dispatch(
            ring_attention_backward, q, k, v, out, dout.contiguous(), lse, ctx.comm, ctx.softmax_scale, ctx.causal
        )
        return None, None, None, dq, dk, dv, None, None, None


def _refuse_tangents(name: str, args) -> None:
    """Forward-mode AD (torch.autograd.forward_ad) is not defined for mkernel's ops: an
    input with a tangent is refused, since going on below the autograd keys would drop the
    tangent and leave the output's as zero. Checked only inside a dual level (a module
    global), so calls outside one pay nothing."""
    level = _forward_ad._current_level
    for a in args:
        if isinstance(a, torch.Tensor) and torch._VF._unpack_dual(a, level=level)[1] is not None:
            raise RuntimeError(
                f"mkernel.{name} has no forward-mode derivative (torch.autograd.forward_ad): an input carries a "
                "tangent; compute it outside the dual level, or use reverse mode"
            )


def _autograd_kernel(name: str, op, gradient):
    """An op's Autograd kernel, as custom_op's: with grad, the outputs get a node of the
    autograd.Function `gradient`; without, the call goes on below the autograd keys.

    torch.library.register_autograd would make the same node, but rebuilds the op's
    arguments from its schema on every call (utils.fill_defaults, several µs of host time),
    which a schema without defaults does not need.
    """

    def kernel(keyset, *args):
        if _forward_ad._current_level >= 0:
            _refuse_tangents(name, args)
        if torch._C.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return gradient.apply(name, op, keyset, *args)
        return _below_autograd(op, keyset, *args)

    return kernel


def _define(schema: str, *, gradient=_NoGradient):
    """Defines torch.ops.mkernel.<name> with `schema` and the decorated function as its
    implementation for every device, and an Autograd kernel with the autograd.Function
    `gradient` (default: a backward that raises); returns the op (its OpOverloadPacket)."""

    def define(impl):
        name = schema.split("(", 1)[0]
        _LIBRARY.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
        _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
        op = getattr(torch.ops.mkernel, name)
        _LIBRARY.impl(name, _autograd_kernel(name, op.default, gradient), "Autograd", with_keyset=True)
        return op

    return define


def _fake(name: str):
    """Registers the decorated function as the fake implementation of torch.ops.mkernel.<name>."""
    return torch.library.register_fake(f"mkernel::{name}", lib=_LIBRARY)


def _empty(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """An uninitialized tensor of `shape` on `like`'s device, of `like`'s dtype unless `dtype` is given.

    The sizes go to new_empty one by one: torch parses a tuple of sizes about 0.6 µs more
    slowly, and torch.empty(shape, dtype=..., device=like.device) adds building `like.device`.
    """
    if not shape:
        return like.new_empty((), dtype=dtype)
    return like.new_empty(*shape, dtype=dtype)


def _communicator(op: str, name: str, world_size: int):
    """The communicator registered under `name`, after checking that it has `world_size` ranks."""
    comm = lookup(name)
    if world_size != comm.world_size:
        check.fail(
            op,
            f"expected world_size to be the world size of communicator {name!r} ({comm.world_size}), but got "
            f"{world_size} (a graph compiled for another communicator of the same name?)",
        )
    return comm


@_define("all_gather(Tensor x, str comm, SymInt world_size) -> Tensor")
def all_gather(x: torch.Tensor, comm: str, world_size: int) -> torch.Tensor:
    c = _communicator("all_gather", comm, world_size)
    out = _empty(ops.all_gather_shapes(x, world_size), x)
    ops.all_gather_launch(x, out, c)
    return out


@_fake("all_gather")
def _(x, comm, world_size):
    return _empty(ops.all_gather_shapes(x, world_size), x)


@_define("reduce_scatter(Tensor x, str comm, SymInt world_size, str op) -> Tensor")
def reduce_scatter(x: torch.Tensor, comm: str, world_size: int, op: str) -> torch.Tensor:
    c = _communicator("reduce_scatter", comm, world_size)
    out = _empty(ops.reduce_scatter_shapes(x, op, world_size), x)
    ops.reduce_scatter_launch(x, out, op, c)
    return out


@_fake("reduce_scatter")
def _(x, comm, world_size, op):
    return _empty(ops.reduce_scatter_shapes(x, op, world_size), x)


@_define("all_reduce(Tensor x, str comm, str op) -> Tensor")
def all_reduce(x: torch.Tensor, comm: str, op: str) -> torch.Tensor:
    c = lookup(comm)
    out = _empty(ops.all_reduce_shapes(x, op), x)
    ops.all_reduce_launch(x, out, op, c)
    return out


@_fake("all_reduce")
def _(x, comm, op):
    return _empty(ops.all_reduce_shapes(x, op), x)


@_define("gemm(Tensor a, Tensor b) -> Tensor")
def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = _empty(ops.gemm_shapes(a, b), a)
    ops.gemm_launch(a, b, out)
    return out


@_fake("gemm")
def _(a, b):
    return _empty(ops.gemm_shapes(a, b), a)


@_define("scaled_gemm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype) -> Tensor")
def scaled_gemm(a, b, scale_a, scale_b, out_dtype):
    shape, mode = ops.scaled_gemm_shapes(a, b, scale_a, scale_b, out_dtype)
    out = _empty(shape, a, out_dtype)
    ops.scaled_gemm_launch(a, b, scale_a, scale_b, out, mode)
    return out


@_fake("scaled_gemm")
def _(a, b, scale_a, scale_b, out_dtype):
    shape, _mode = ops.scaled_gemm_shapes(a, b, scale_a, scale_b, out_dtype)
    return _empty(shape, a, out_dtype)


@_define(
    "all_gather_gemm(Tensor a, Tensor b, str comm, SymInt world_size, bool return_gathered) -> (Tensor, Tensor)"
)
def all_gather_gemm(
    a: torch.Tensor, b: torch.Tensor, comm: str, world_size: int, return_gathered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (C, gathered A); the gathered A is empty ([0, K]) unless return_gathered."""
    c = _communicator("all_gather_gemm", comm, world_size)
    c_shape, g_shape = ops.all_gather_gemm_shapes(a, b, world_size)
    out = _empty(c_shape, a)
    gathered = _empty(g_shape if return_gathered else (0, a.shape[1]), a)
    ops.all_gather_gemm_launch(a, b, out, gathered if return_gathered else None, c)
    return out, gathered


@_fake("all_gather_gemm")
def _(a, b, comm, world_size, return_gathered):
    c_shape, g_shape = ops.all_gather_gemm_shapes(a, b, world_size)
    return _empty(c_shape, a), _empty(g_shape if return_gathered else (0, a.shape[1]), a)


@_define("gemm_reduce_scatter(Tensor a, Tensor b, str comm, SymInt world_size) -> Tensor")
def gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, comm: str, world_size: int) -> torch.Tensor:
    c = _communicator("gemm_reduce_scatter", comm, world_size)
    out = _empty(ops.gemm_reduce_scatter_shapes(a, b, world_size), a)
    ops.gemm_reduce_scatter_launch(a, b, out, c)
    return out


@_fake("gemm_reduce_scatter")
def _(a, b, comm, world_size):
    return _empty(ops.gemm_reduce_scatter_shapes(a, b, world_size), a)


@_define("gemm_all_reduce(Tensor a, Tensor b, str comm) -> Tensor")
def gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, comm: str) -> torch.Tensor:
    c = lookup(comm)
    out = _empty(ops.gemm_all_reduce_shapes(a, b), a)
    ops.gemm_all_reduce_launch(a, b, out, c)
    return out


@_fake("gemm_all_reduce")
def _(a, b, comm):
    return _empty(ops.gemm_all_reduce_shapes(a, b), a)


@_define(
    "scaled_gemm_reduce_scatter(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, str comm, "
    "SymInt world_size) -> Tensor"
)
def scaled_gemm_reduce_scatter(a, b, scale_a, scale_b, out_dtype, comm, world_size):
    c = _communicator("scaled_gemm_reduce_scatter", comm, world_size)
    shape, mode = ops.scaled_gemm_reduce_scatter_shapes(a, b, scale_a, scale_b, out_dtype, world_size)
    out = _empty(shape, a, out_dtype)
    ops.scaled_gemm_reduce_scatter_launch(a, b, scale_a, scale_b, out, mode, c)
    return out


@_fake("scaled_gemm_reduce_scatter")
def _(a, b, scale_a, scale_b, out_dtype, comm, world_size):
    shape, _mode = ops.scaled_gemm_reduce_scatter_shapes(a, b, scale_a, scale_b, out_dtype, world_size)
    return _empty(shape, a, out_dtype)


@_define(
    "scaled_gemm_all_reduce(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, str comm) "
    "-> Tensor"
)
def scaled_gemm_all_reduce(a, b, scale_a, scale_b, out_dtype, comm):
    c = lookup(comm)
    shape, mode = ops.scaled_gemm_all_reduce_shapes(a, b, scale_a, scale_b, out_dtype)
    out = _empty(shape, a, out_dtype)
    ops.scaled_gemm_all_reduce_launch(a, b, scale_a, scale_b, out, mode, c)
    return out


@_fake("scaled_gemm_all_reduce")
def _(a, b, scale_a, scale_b, out_dtype, comm):
    shape, _mode = ops.scaled_gemm_all_reduce_shapes(a, b, scale_a, scale_b, out_dtype)
    return _empty(shape, a, out_dtype)


@_define(
    "moe_dispatch_gemm(Tensor x, Tensor topk_idx, Tensor w1, "
    "str comm, SymInt world_size, SymInt recv_capacity) -> (Tensor, Tensor, Tensor)"
)
def moe_dispatch_gemm(
    x: torch.Tensor, topk_idx: torch.Tensor, w1: torch.Tensor, comm: str, world_size: int, recv_capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = _communicator("moe_dispatch_gemm", comm, world_size)
    y_shape, counts_shape, layout_shape, experts = ops.moe_dispatch_shapes(x, topk_idx, w1, recv_capacity, world_size)
    y = _empty(y_shape, x)
    counts = _empty(counts_shape, x, torch.int32)
    layout = _empty(layout_shape, x, torch.uint8)
    ops.moe_dispatch_launch(x, topk_idx, w1, y, counts, layout, experts, c)
    return y, counts, layout


@_fake("moe_dispatch_gemm")
def _(x, topk_idx, w1, comm, world_size, recv_capacity):
    y_shape, counts_shape, layout_shape, _experts = ops.moe_dispatch_shapes(x, topk_idx, w1, recv_capacity, world_size)
    return _empty(y_shape, x), _empty(counts_shape, x, torch.int32), _empty(layout_shape, x, torch.uint8)


@_define(
    "moe_dispatch_gemm_with_options(Tensor x, Tensor topk_idx, Tensor w1, str comm, SymInt world_size, "
    "SymInt recv_capacity, str activation, int expert_capacity) -> (Tensor, Tensor, Tensor, Tensor)"
)
def moe_dispatch_gemm_with_options(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    w1: torch.Tensor,
    comm: str,
    world_size: int,
    recv_capacity: int,
    activation: str,
    expert_capacity: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mkMoeDispatchGemmWithOptions: returns (y, recv_counts, drop_counts, layout). activation
    "none", "silu" or "gelu" (gated w1); expert_capacity 0 is no-drop mode (drop_counts all 0)."""
    c = _communicator("moe_dispatch_gemm", comm, world_size)
    shapes = _moe_options_shapes(x, topk_idx, w1, world_size, recv_capacity, activation, expert_capacity)
    (y_shape, counts_shape, layout_shape, experts), drops_shape = shapes
    y = _empty(y_shape, x)
    counts = _empty(counts_shape, x, torch.int32)
    drops = _empty(drops_shape, x, torch.int32)
    layout = _empty(layout_shape, x, torch.uint8)
    ops.moe_dispatch_options_launch(x, topk_idx, w1, y, counts, drops, layout, experts, activation, expert_capacity, c)
    return y, counts, drops, layout


def _moe_options_shapes(x, topk_idx, w1, world_size, recv_capacity, activation, expert_capacity):
    """moe_dispatch_shapes' four results and drop_counts' shape ([experts]), after the options' rules."""
    check.expert_capacity("moe_dispatch_gemm", expert_capacity)
    shapes = ops.moe_dispatch_shapes(x, topk_idx, w1, recv_capacity, world_size, activation)
    return shapes, (shapes[3],)


@_fake("moe_dispatch_gemm_with_options")
def _(x, topk_idx, w1, comm, world_size, recv_capacity, activation, expert_capacity):
    shapes = _moe_options_shapes(x, topk_idx, w1, world_size, recv_capacity, activation, expert_capacity)
    (y_shape, counts_shape, layout_shape, _experts), drops_shape = shapes
    return (
        _empty(y_shape, x),
        _empty(counts_shape, x, torch.int32),
        _empty(drops_shape, x, torch.int32),
        _empty(layout_shape, x, torch.uint8),
    )


@_define(
    "moe_gemm_combine(Tensor y_act, Tensor w2, Tensor topk_weights, Tensor layout, "
    "str comm, SymInt world_size) -> Tensor"
)
def moe_gemm_combine(
    y_act: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    layout: torch.Tensor,
    comm: str,
    world_size: int,
) -> torch.Tensor:
    c = _communicator("moe_gemm_combine", comm, world_size)
    out_shape, experts = ops.moe_combine_shapes(y_act, w2, topk_weights, layout, world_size)
    out = _empty(out_shape, y_act)
    ops.moe_combine_launch(y_act, w2, topk_weights, layout, out, experts, c)
    return out


@_fake("moe_gemm_combine")
def _(y_act, w2, topk_weights, layout, comm, world_size):
    out_shape, _experts = ops.moe_combine_shapes(y_act, w2, topk_weights, layout, world_size)
    return _empty(out_shape, y_act)


@_define(
    "ring_attention(Tensor q, Tensor k, Tensor v, str comm, float softmax_scale, bool causal) -> (Tensor, Tensor)",
    gradient=_RingAttentionGradient,
)
def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: str, softmax_scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    c = lookup(comm)
    out_shape, lse_shape = ops.ring_attention_shapes(q, k, v, softmax_scale, causal)
    out = _empty(out_shape, q)
    lse = _empty(lse_shape, q, torch.float32)
    ops.ring_attention_launch(q, k, v, out, lse, softmax_scale, causal, c)
    return out, lse


@_fake("ring_attention")
def _(q, k, v, comm, softmax_scale, causal):
    out_shape, lse_shape = ops.ring_attention_shapes(q, k, v, softmax_scale, causal)
    return _empty(out_shape, q), _empty(lse_shape, q, torch.float32)


@_define(
    "ring_attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, "
    "str comm, float softmax_scale, bool causal) -> (Tensor, Tensor, Tensor)"
)
def ring_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    comm: str,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = lookup(comm)
    shapes = ops.ring_attention_backward_shapes(q, k, v, out, dout, lse, softmax_scale, causal)
    dq, dk, dv = (_empty(shape, q) for shape in shapes)
    ops.ring_attention_backward_launch(q, k, v, out, dout, lse, dq, dk, dv, softmax_scale, causal, c)
    return dq, dk, dv


@_fake("ring_attention_backward")
def _(q, k, v, out, dout, lse, comm, softmax_scale, causal):
    shapes = ops.ring_attention_backward_shapes(q, k, v, out, dout, lse, softmax_scale, causal)
    return tuple(_empty(shape, q) for shape in shapes)
