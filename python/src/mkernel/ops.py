"""Tensor operations over the C ABI.

Each op has a shape rule (`*_shapes`: checks dtypes, ranks, contiguity and sizes, and
returns the output shapes; shared with the fake implementations in mkernel.library) and a
launcher (`*_launch`: checks devices and alignment, then enqueues the kernel on the
current torch stream of the communicator's device). Nothing here synchronises the host,
so every op can be captured in a CUDA graph.

The public functions route through torch.ops.mkernel.* (so torch.compile keeps them in
the graph; `dispatch` says how) unless `out=` is given, in which case they launch into
`out` directly (eager mode and CUDA graphs). They resolve the communicator first and pass
its name, and its world size to the ops whose shapes depend on it (mkernel.library says
why).
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import NamedTuple, Union

import torch
from torch.autograd import forward_ad as _forward_ad

from . import _checks as check
from . import _lib
from .comm import Communicator, lookup
from .errors import MkMoeOverflowError, raise_for

CommLike = Union[Communicator, str]


def resolve(comm: CommLike):
    """The communicator for a Communicator or its registered name."""
    if isinstance(comm, str):
        return lookup(comm)
    if isinstance(comm, Communicator):
        return comm
    check.fail("ops", f"expected comm to be an mkernel.Communicator or its name, but got {type(comm).__name__}")


def comm_name(comm: CommLike) -> str:
    """The registered name of a Communicator or name; raises for a name nothing is registered under."""
    return resolve(comm).name


def _tensors(op: str, **named) -> None:
    """Type check before dispatch, so a non-tensor gets this package's error, not the dispatcher's."""
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            check.fail(op, f"expected {name} to be a torch.Tensor, but got {type(value).__name__}")


def dispatch(op, *args):
    """Calls `op` (a torch.ops.mkernel op), skipping its autograd kernel where that kernel
    would only pass the call on.

    In eager mode with grad off or no argument requiring grad, an op's autograd kernel
    (mkernel.library) sends the call below the autograd keys; entering them here instead
    saves that Python hop and its redispatch (about 2.5 µs). Every other dispatch key and
    mode (fake and meta tensors, dispatch modes, the profiler) still sees the op. While
    torch.compile traces, the call is the op itself, which the graph records. Inside a
    forward-mode AD level the autograd kernel runs too: it refuses inputs with tangents.
    """
    if (
        torch.compiler.is_compiling()
        or (torch.is_grad_enabled() and torch._C._any_requires_grad(*args))
        or _forward_ad._current_level >= 0
    ):
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _stream(device: int) -> int:
    """The current torch stream of CUDA device `device`, as the cudaStream_t value ctypes passes.

    torch.cuda.current_stream(device).cuda_stream would build a torch.cuda.Stream object
    per call; the raw lookup is the one Inductor's generated code makes before each launch.
    """
    return torch._C._cuda_getCurrentRawStream(device)


def _call(comm, fn_name: str, *args) -> None:
    """Calls a communicator op with its handle and stream last; raises with the comm's message.

    A communicator that has hit an asynchronous error raises it first (Communicator.handle,
    in check_async_error's words (the communicator's name, the kernel's description: which
    op, which peer)). The library would refuse the launch by itself (Comm::check_usable)
    with the same code and description; querying first keeps every such error in one
    wording, for one C call.
    """
    handle = comm.handle()
    code = getattr(_lib.library(), fn_name)(*args, handle, _stream(comm.device))
    if code != _lib.SUCCESS:
        raise_for(code, fn_name, handle)


def _memoized(rule):
    """Caches a shape rule's result by everything it reads of its arguments: each tensor's
    shape, dtype and contiguity, and each other argument's type and value.

    For the rules whose checks cost more than building that key (the MoE and ring
    attention rules, about 2 µs against 1 µs). A rule that raises stores nothing, so a bad
    call raises its message every time; arguments that give no key (symbolic sizes while
    tracing, which cannot be hashed) run the rule itself.
    """
    cache = {}

    @functools.wraps(rule)
    def cached(*args):
        try:
            key = tuple(
                [(a.shape, a.dtype, a.is_contiguous()) if isinstance(a, torch.Tensor) else (type(a), a) for a in args]
            )
            result = cache.get(key)
        except Exception:  # noqa: BLE001 -- no key: the rule itself runs and raises what it raises
            return rule(*args)
        if result is None:
            result = rule(*args)
            if len(cache) >= 1024:
                cache.clear()
            cache[key] = result
        return result

    return cached


# --- AllGather / ReduceScatter / AllReduce ------------------------------------------------------


def all_gather_shapes(x, world_size: int):
    check.tensor("all_gather", "input", x, min_dim=1)
    check.world_size("all_gather", world_size)
    return (x.shape[0] * world_size, *x.shape[1:])


def all_gather_launch(x, out, comm) -> None:
    check.on_device("all_gather", comm.torch_device, input=x, output=out)
    check.aligned("all_gather", ("input", x, x.element_size()), ("output", out, out.element_size()))
    _call(comm, "mkAllGather", x.data_ptr(), out.data_ptr(), x.numel(), check.dtype_code(x.dtype))


def reduce_scatter_shapes(x, op: str, world_size: int):
    check.tensor("reduce_scatter", "input", x, dtypes=check.REDUCE_DTYPES, min_dim=1)
    check.reduce_op("reduce_scatter", op)
    check.world_size("reduce_scatter", world_size)
    rows = x.shape[0]
    if rows % world_size != 0:
        check.fail(
            "reduce_scatter", f"expected input.shape[0] ({rows}) to be divisible by the world size ({world_size})"
        )
    return (rows // world_size, *x.shape[1:])


def reduce_scatter_launch(x, out, op: str, comm) -> None:
    check.on_device("reduce_scatter", comm.torch_device, input=x, output=out)
    check.aligned("reduce_scatter", ("input", x, x.element_size()), ("output", out, out.element_size()))
    _call(
        comm,
        "mkReduceScatter",
        x.data_ptr(),
        out.data_ptr(),
        out.numel(),
        check.dtype_code(x.dtype),
        check.reduce_op("reduce_scatter", op),
    )


def all_reduce_shapes(x, op: str):
    check.tensor("all_reduce", "input", x, dtypes=check.REDUCE_DTYPES)
    check.reduce_op("all_reduce", op)
    return tuple(x.shape)


def all_reduce_launch(x, out, op: str, comm) -> None:
    check.on_device("all_reduce", comm.torch_device, input=x, output=out)
    check.aligned("all_reduce", ("input", x, x.element_size()), ("output", out, out.element_size()))
    _call(
        comm,
        "mkAllReduce",
        x.data_ptr(),
        out.data_ptr(),
        x.numel(),
        check.dtype_code(x.dtype),
        check.reduce_op("all_reduce", op),
    )


def all_gather(input: torch.Tensor, comm: CommLike, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenates every rank's `input` along dim 0 (rank order): [world_size * rows, ...].

    Any dtype of mkDataType_t (copied bit for bit). In place when `out[rank * rows:]`
    starts at `input` (as NCCL).
    """
    _tensors("all_gather", input=input)
    c = resolve(comm)
    if out is None:
        return dispatch(torch.ops.mkernel.all_gather, input, c.name, c.world_size)
    shape = all_gather_shapes(input, c.world_size)
    check.output("all_gather", "out", out, shape=shape, dtype=input.dtype, device=c.torch_device)
    all_gather_launch(input, out, c)
    return out


def reduce_scatter(
    input: torch.Tensor, comm: CommLike, op: str = "sum", *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Reduces `input` over the ranks with `op` and returns this rank's block of rows.

    `input.shape[0]` must be divisible by the world size; rank r gets rows
    [r * rows / n, (r + 1) * rows / n) of the reduction. op: sum, prod, max, min, avg.
    Half and bfloat16 accumulate in float and round once.
    """
    _tensors("reduce_scatter", input=input)
    c = resolve(comm)
    if out is None:
        return dispatch(torch.ops.mkernel.reduce_scatter, input, c.name, c.world_size, op)
    shape = reduce_scatter_shapes(input, op, c.world_size)
    check.output("reduce_scatter", "out", out, shape=shape, dtype=input.dtype, device=c.torch_device)
    reduce_scatter_launch(input, out, op, c)
    return out


def all_reduce(
    input: torch.Tensor, comm: CommLike, op: str = "sum", *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Reduces `input` over the ranks with `op`; every rank gets the whole (bitwise identical) result.

    In place with `out=input`.
    """
    _tensors("all_reduce", input=input)
    c = resolve(comm)
    if out is None:
        return dispatch(torch.ops.mkernel.all_reduce, input, c.name, op)
    shape = all_reduce_shapes(input, op)
    check.output("all_reduce", "out", out, shape=shape, dtype=input.dtype, device=c.torch_device)
    all_reduce_launch(input, out, op, c)
    return out


# --- GEMMs ----------------------------------------------------------------------------------------


def _gemm_operands(op: str, a, b):
    check.tensor(op, "a", a, dtypes=check.GEMM_DTYPES, dim=2)
    check.tensor(op, "b", b, dtypes=check.GEMM_DTYPES, dim=2)
    check.same_dtype(op, a=a, b=b)
    if a.shape[1] != b.shape[1]:
        check.fail(
            op,
            f"expected a [M, K] and b [N, K] to share K, but got a.shape = {tuple(a.shape)} and "
            f"b.shape = {tuple(b.shape)} (b is the nn.Linear weight layout: C = a @ b.T)",
        )
    return a.shape[0], b.shape[0], a.shape[1]


def gemm_shapes(a, b):
    m, n, k = _gemm_operands("gemm", a, b)
    check.multiple_of("gemm", "K (a.shape[1])", k, 8, positive=True)
    return (m, n)


def gemm_launch(a, b, out) -> None:
    op = "gemm"
    if a.device.type != "cuda":
        check.fail(op, f"expected a to be a CUDA tensor, but got a tensor on {a.device}")
    device = a.device.index
    check.on_device(op, a.device, a=a, b=b, out=out)
    check.aligned(op, ("a", a, 16), ("b", b, 16), ("out", out, out.element_size()))
    m, k = a.shape
    n = b.shape[0]
    lib = _lib.library()
    with torch.cuda.device(device):
        code = lib.mkGemm(
            a.data_ptr(), b.data_ptr(), out.data_ptr(), m, n, k, check.dtype_code(a.dtype), _stream(device)
        )
    raise_for(code, "mkGemm")


def gemm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """C = a @ b.T with mkernel's GEMM engine (no communication): a [M, K], b [N, K], bf16/fp16."""
    _tensors("gemm", a=a, b=b)
    if out is None:
        return dispatch(torch.ops.mkernel.gemm, a, b)
    shape = gemm_shapes(a, b)
    if a.device.type != "cuda":
        check.fail("gemm", f"expected a to be a CUDA tensor, but got a tensor on {a.device}")
    check.output("gemm", "out", out, shape=shape, dtype=a.dtype, device=a.device)
    gemm_launch(a, b, out)
    return out


def scaled_gemm_shapes(a, b, scale_a, scale_b, out_dtype, op: str = "scaled_gemm", a_dtypes=None):
    """C's shape and the scale mode ("tensor", "rowwise" or "block") the scales' sizes give.

    `op` names the op in the messages; `a_dtypes` are the types it takes for a (scaled_gemm's:
    e4m3 and e5m2)."""
    a_dtypes = a_dtypes or check.SCALED_GEMM_A_DTYPES
    check.tensor(op, "a", a, dtypes=a_dtypes, dim=2)
    if torch.float8_e5m2 in a_dtypes and isinstance(b, torch.Tensor) and b.dtype == torch.float8_e5m2:
        check.fail(op, "expected b to have dtype torch.float8_e4m3fn, but got torch.float8_e5m2 (only a may be e5m2)")
    check.tensor(op, "b", b, dtypes=check.SCALED_GEMM_DTYPES, dim=2)
    check.tensor(op, "scale_a", scale_a, dtypes=(torch.float32,))
    check.tensor(op, "scale_b", scale_b, dtypes=(torch.float32,))
    if out_dtype not in check.GEMM_DTYPES:
        check.fail(op, f"expected out_dtype to be one of {check.GEMM_DTYPES}, but got {out_dtype}")
    if a.shape[1] != b.shape[1]:
        check.fail(
            op,
            f"expected a [M, K] and b [N, K] to share K, but got a.shape = {tuple(a.shape)} and "
            f"b.shape = {tuple(b.shape)} (b is the nn.Linear weight layout: C = a @ b.T)",
        )
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    check.multiple_of(op, "K (a.shape[1])", k, 16, positive=True)
    # Where two modes fit the sizes (M = N = 1, or K = 128 with N = 1), they compute the same C.
    block_shapes = ((k // 128, m), (k // 128, -(-n // 128)))
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        mode = "tensor"
    elif scale_a.numel() == m and scale_b.numel() == n:
        mode = "rowwise"
    elif k % 128 == 0 and (tuple(scale_a.shape), tuple(scale_b.shape)) == block_shapes:
        mode = "block"
    else:
        check.fail(
            op,
            f"expected scale_a and scale_b to hold one value each (per tensor), M = {m} and N = {n} values "
            f"(rowwise: one per row of a and of b), or, K being a multiple of 128, the shapes "
            f"{block_shapes[0]} and {block_shapes[1]} (block: [K/128, M] and [K/128, ceil(N/128)]), but got "
            f"{tuple(scale_a.shape)} and {tuple(scale_b.shape)}",
        )
    return (m, n), mode


def scaled_gemm_launch(a, b, scale_a, scale_b, out, mode: str) -> None:
    op = "scaled_gemm"
    if a.device.type != "cuda":
        check.fail(op, f"expected a to be a CUDA tensor, but got a tensor on {a.device}")
    device = a.device.index
    check.on_device(op, a.device, a=a, b=b, scale_a=scale_a, scale_b=scale_b, out=out)
    check.aligned(
        op, ("a", a, 16), ("b", b, 16), ("scale_a", scale_a, 4), ("scale_b", scale_b, 4), ("out", out, 2)
    )
    m, k = a.shape
    n = b.shape[0]
    lib = _lib.library()
    with torch.cuda.device(device):
        code = lib.mkScaledGemmMixed(
            a.data_ptr(),
            _lib.as_ptr(scale_a.data_ptr(), ctypes.c_float),
            b.data_ptr(),
            _lib.as_ptr(scale_b.data_ptr(), ctypes.c_float),
            out.data_ptr(),
            m,
            n,
            k,
            check.dtype_code(a.dtype),
            check.dtype_code(b.dtype),
            check.dtype_code(out.dtype),
            _lib.SCALE_MODE_CODES[mode],
            _stream(device),
        )
    raise_for(code, "mkScaledGemmMixed")


def scaled_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """C = (a · scale_a) @ (b · scale_b).T with fp8 a [M, K] (torch.float8_e4m3fn, or
    torch.float8_e5m2: the gradient of an fp8 backward) and b [N, K] (torch.float8_e4m3fn; an
    e5m2 b is refused), row-major (b is the nn.Linear weight layout, the transpose of
    torch._scaled_mm's second operand), and float32 scales as torch._scaled_mm takes them: one value each (per tensor), or
    M values for a and N for b (rowwise; torch's [M, 1] and [1, N] shapes are fine). C is
    out_dtype (bfloat16 or float16), accumulated in fp32 (promoted every 128 of K) and rounded
    once. K must be a multiple of 16. Block scales (DeepSeek-V3's) are also taken: scale_a
    [K/128, M] (one per row of a per 128 of K: torch's outer-dim-major 1x128 scale_a, transposed)
    and scale_b [K/128, ceil(N/128)] (one per 128 × 128 block of b: torch's 128x128 scale_b for
    its [K, N] second operand), contiguous, K a multiple of 128. The scales are not checked for NaN or infinity (they stay
    on the GPU); such a scale gives NaN or infinity in C, as in torch._scaled_mm."""
    _tensors("scaled_gemm", a=a, b=b, scale_a=scale_a, scale_b=scale_b)
    if out is None:
        return dispatch(torch.ops.mkernel.scaled_gemm, a, b, scale_a, scale_b, out_dtype)
    shape, mode = scaled_gemm_shapes(a, b, scale_a, scale_b, out_dtype)
    if a.device.type != "cuda":
        check.fail("scaled_gemm", f"expected a to be a CUDA tensor, but got a tensor on {a.device}")
    check.output("scaled_gemm", "out", out, shape=shape, dtype=out_dtype, device=a.device)
    scaled_gemm_launch(a, b, scale_a, scale_b, out, mode)
    return out


def all_gather_gemm_shapes(a, b, world_size: int):
    op = "all_gather_gemm"
    rows, n, k = _gemm_operands(op, a, b)
    check.multiple_of(op, "K (a.shape[1])", k, 8, positive=True)
    check.multiple_of(op, "N (b.shape[0])", n, 8)
    check.world_size(op, world_size)
    m = rows * world_size
    return (m, n), (m, k)


def all_gather_gemm_launch(a, b, out, gathered, comm) -> None:
    op = "all_gather_gemm"
    named = {"a": a, "b": b, "out": out}
    if gathered is not None:
        named["gathered_a"] = gathered
    check.on_device(op, comm.torch_device, **named)
    check.aligned(op, *((name, t, 16) for name, t in named.items()))
    m, n = out.shape
    k = a.shape[1]
    _call(
        comm,
        "mkAllGatherGemm",
        a.data_ptr(),
        b.data_ptr(),
        out.data_ptr(),
        gathered.data_ptr() if gathered is not None else None,
        m,
        n,
        k,
        check.dtype_code(a.dtype),
    )


def all_gather_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    comm: CommLike,
    *,
    return_gathered: bool = False,
    out: torch.Tensor | None = None,
    gathered_out: torch.Tensor | None = None,
):
    """AllGather of `a`'s rows over the ranks, then C = A_gathered @ b.T, in one kernel.

    a: this rank's rows [M / n, K]; b: [N, K], the same on every rank; returns C [M, N]
    (and the gathered A [M, K] with return_gathered=True, for a backward pass). bf16/fp16,
    K a positive multiple of 8, N a multiple of 8; the gathered A must fit in the workspace.
    """
    _tensors("all_gather_gemm", a=a, b=b)
    comm = resolve(comm)
    if out is None and gathered_out is None:
        c, g = dispatch(torch.ops.mkernel.all_gather_gemm, a, b, comm.name, comm.world_size, return_gathered)
        return (c, g) if return_gathered else c
    c_shape, g_shape = all_gather_gemm_shapes(a, b, comm.world_size)
    if out is None:
        out = torch.empty(c_shape, dtype=a.dtype, device=a.device)
    check.output("all_gather_gemm", "out", out, shape=c_shape, dtype=a.dtype, device=comm.torch_device)
    if gathered_out is None and return_gathered:
        gathered_out = torch.empty(g_shape, dtype=a.dtype, device=a.device)
    if gathered_out is not None:
        check.output("all_gather_gemm", "gathered_out", gathered_out, shape=g_shape, dtype=a.dtype, device=comm.torch_device)
    all_gather_gemm_launch(a, b, out, gathered_out, comm)
    return (out, gathered_out) if (return_gathered or gathered_out is not None) else out


def gemm_reduce_scatter_shapes(a, b, world_size: int):
    op = "gemm_reduce_scatter"
    m, n, k = _gemm_operands(op, a, b)
    check.multiple_of(op, "K (a.shape[1])", k, 8)
    check.multiple_of(op, "N (b.shape[0])", n, 8)
    check.world_size(op, world_size)
    if m % world_size != 0:
        check.fail(op, f"expected M (a.shape[0] = {m}) to be divisible by the world size ({world_size})")
    return (m // world_size, n)


def gemm_all_reduce_shapes(a, b):
    op = "gemm_all_reduce"
    m, n, k = _gemm_operands(op, a, b)
    check.multiple_of(op, "K (a.shape[1])", k, 8)
    check.multiple_of(op, "N (b.shape[0])", n, 8)
    return (m, n)


def _reduced_gemm_launch(op: str, fn_name: str, a, b, out, comm) -> None:
    check.on_device(op, comm.torch_device, a=a, b=b, out=out)
    check.aligned(op, ("a", a, 16), ("b", b, 16), ("out", out, 16))
    m, k = a.shape
    n = b.shape[0]
    _call(comm, fn_name, a.data_ptr(), b.data_ptr(), out.data_ptr(), m, n, k, check.dtype_code(a.dtype))


def gemm_reduce_scatter_launch(a, b, out, comm) -> None:
    _reduced_gemm_launch("gemm_reduce_scatter", "mkGemmReduceScatter", a, b, out, comm)


def gemm_all_reduce_launch(a, b, out, comm) -> None:
    _reduced_gemm_launch("gemm_all_reduce", "mkGemmAllReduce", a, b, out, comm)


def gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, comm: CommLike, *, out: torch.Tensor | None = None):
    """Σ over ranks of a @ b.T, reduce-scattered by rows: this rank's [M / n, N] block.

    a: [M, K] with this rank's K columns; b: [N, K] likewise. Partials are rounded once to
    the dtype, then summed in fp32 in rank order and rounded once.
    """
    _tensors("gemm_reduce_scatter", a=a, b=b)
    c = resolve(comm)
    if out is None:
        return dispatch(torch.ops.mkernel.gemm_reduce_scatter, a, b, c.name, c.world_size)
    shape = gemm_reduce_scatter_shapes(a, b, c.world_size)
    check.output("gemm_reduce_scatter", "out", out, shape=shape, dtype=a.dtype, device=c.torch_device)
    gemm_reduce_scatter_launch(a, b, out, c)
    return out


def gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, comm: CommLike, *, out: torch.Tensor | None = None):
    """Σ over ranks of a @ b.T on every rank (bitwise identical): [M, N]. Any M."""
    _tensors("gemm_all_reduce", a=a, b=b)
    c = resolve(comm)
    if out is None:
        return dispatch(torch.ops.mkernel.gemm_all_reduce, a, b, c.name)
    shape = gemm_all_reduce_shapes(a, b)
    check.output("gemm_all_reduce", "out", out, shape=shape, dtype=a.dtype, device=c.torch_device)
    gemm_all_reduce_launch(a, b, out, c)
    return out


# --- MoE --------------------------------------------------------------------------------------------


def scaled_gemm_reduce_scatter_shapes(a, b, scale_a, scale_b, out_dtype, world_size: int):
    """This rank's rows of C and the scale mode: scaled_gemm's rules over this rank's K slice
    (a and b in torch.float8_e4m3fn), then the reduction's."""
    op = "scaled_gemm_reduce_scatter"
    (m, n), mode = scaled_gemm_shapes(a, b, scale_a, scale_b, out_dtype, op, check.SCALED_GEMM_DTYPES)
    check.multiple_of(op, "N (b.shape[0])", n, 8)
    check.world_size(op, world_size)
    if m % world_size != 0:
        check.fail(op, f"expected M (a.shape[0] = {m}) to be divisible by the world size ({world_size})")
    return (m // world_size, n), mode


def scaled_gemm_all_reduce_shapes(a, b, scale_a, scale_b, out_dtype):
    """C's shape and the scale mode: scaled_gemm's rules (a and b in torch.float8_e4m3fn), N a
    multiple of 8."""
    op = "scaled_gemm_all_reduce"
    (m, n), mode = scaled_gemm_shapes(a, b, scale_a, scale_b, out_dtype, op, check.SCALED_GEMM_DTYPES)
    check.multiple_of(op, "N (b.shape[0])", n, 8)
    return (m, n), mode


def _scaled_reduced_gemm_launch(op: str, fn_name: str, a, b, scale_a, scale_b, out, mode: str, comm) -> None:
    check.on_device(op, comm.torch_device, a=a, b=b, scale_a=scale_a, scale_b=scale_b, out=out)
    check.aligned(
        op, ("a", a, 16), ("b", b, 16), ("scale_a", scale_a, 4), ("scale_b", scale_b, 4), ("out", out, 16)
    )
    m, k = a.shape
    n = b.shape[0]
    _call(
        comm,
        fn_name,
        a.data_ptr(),
        _lib.as_ptr(scale_a.data_ptr(), ctypes.c_float),
        b.data_ptr(),
        _lib.as_ptr(scale_b.data_ptr(), ctypes.c_float),
        out.data_ptr(),
        m,
        n,
        k,
        check.dtype_code(a.dtype),
        check.dtype_code(out.dtype),
        _lib.SCALE_MODE_CODES[mode],
    )


def scaled_gemm_reduce_scatter_launch(a, b, scale_a, scale_b, out, mode: str, comm) -> None:
    _scaled_reduced_gemm_launch(
        "scaled_gemm_reduce_scatter", "mkScaledGemmReduceScatter", a, b, scale_a, scale_b, out, mode, comm
    )


def scaled_gemm_all_reduce_launch(a, b, scale_a, scale_b, out, mode: str, comm) -> None:
    _scaled_reduced_gemm_launch(
        "scaled_gemm_all_reduce", "mkScaledGemmAllReduce", a, b, scale_a, scale_b, out, mode, comm
    )


def scaled_gemm_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    comm: CommLike,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ over ranks of (a · scale_a) @ (b · scale_b).T, reduce-scattered by rows: this rank's
    [M / n, N] block of out_dtype (bfloat16 or float16).

    a [M, K] and b [N, K] in torch.float8_e4m3fn hold this rank's K columns, with this rank's
    float32 scales as scaled_gemm takes them (per tensor, rowwise or block; each rank's own).
    Each rank's partial is scaled_gemm's, rounded once to out_dtype; the partials are summed
    in fp32 in rank order and rounded once. N must be a multiple of 8."""
    _tensors("scaled_gemm_reduce_scatter", a=a, b=b, scale_a=scale_a, scale_b=scale_b)
    c = resolve(comm)
    if out is None:
        return dispatch(
            torch.ops.mkernel.scaled_gemm_reduce_scatter, a, b, scale_a, scale_b, out_dtype, c.name, c.world_size
        )
    shape, mode = scaled_gemm_reduce_scatter_shapes(a, b, scale_a, scale_b, out_dtype, c.world_size)
    check.output("scaled_gemm_reduce_scatter", "out", out, shape=shape, dtype=out_dtype, device=c.torch_device)
    scaled_gemm_reduce_scatter_launch(a, b, scale_a, scale_b, out, mode, c)
    return out


def scaled_gemm_all_reduce(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    comm: CommLike,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ over ranks of (a · scale_a) @ (b · scale_b).T on every rank (bitwise identical):
    [M, N] of out_dtype. Operands as scaled_gemm_reduce_scatter; any M."""
    _tensors("scaled_gemm_all_reduce", a=a, b=b, scale_a=scale_a, scale_b=scale_b)
    c = resolve(comm)
    if out is None:
        return dispatch(torch.ops.mkernel.scaled_gemm_all_reduce, a, b, scale_a, scale_b, out_dtype, c.name)
    shape, mode = scaled_gemm_all_reduce_shapes(a, b, scale_a, scale_b, out_dtype)
    check.output("scaled_gemm_all_reduce", "out", out, shape=shape, dtype=out_dtype, device=c.torch_device)
    scaled_gemm_all_reduce_launch(a, b, scale_a, scale_b, out, mode, c)
    return out


def _layout_bytes(tokens, topk, recv_capacity) -> int:
    size = ctypes.c_size_t(0)
    raise_for(_lib.library().mkMoeLayoutBytes(tokens, topk, recv_capacity, ctypes.byref(size)), "mkMoeLayoutBytes")
    return size.value


_cached_layout_bytes = functools.lru_cache(maxsize=256)(_layout_bytes)


def moe_layout_bytes(tokens: int, topk: int, recv_capacity: int) -> int:
    """Bytes of the layout buffer moe_dispatch_gemm fills and moe_gemm_combine reads (mkMoeLayoutBytes).

    A pure function of its arguments, cached for int arguments: both MoE ops' shape rules
    ask it on every call. Sizes it refuses raise every time (lru_cache keeps no
    exceptions). A symbolic size (torch.compile tracing with dynamic shapes) gets the same
    count as an expression of that size, from the library's own coefficients
    (_layout_terms): passed to ctypes it would become an int and specialize the compiled
    graph to that token count, so that every new count compiled again.
    """
    if type(tokens) is int and type(topk) is int and type(recv_capacity) is int:
        return _cached_layout_bytes(tokens, topk, recv_capacity)
    fixed, per_slot, per_block = _layout_terms()
    return fixed + per_slot * tokens * topk + per_block * ((recv_capacity + 127) // 128)


@functools.lru_cache(maxsize=1)
def _layout_terms() -> tuple[int, int, int]:
    """The layout size's terms, as the library counts them: bytes for no token and no row
    block, per (token, choice) slot, and per 128-row block of the receive buffer. The size
    is affine in the slots and blocks (ops::moe::checked_layout_offsets; a test checks it
    against mkMoeLayoutBytes)."""
    fixed = _layout_bytes(0, 1, 0)
    return fixed, _layout_bytes(1, 1, 0) - fixed, _layout_bytes(0, 1, 128) - fixed


def moe_segment_starts(recv_counts: torch.Tensor) -> torch.Tensor:
    """First row of each local expert's segment in moe_dispatch_gemm's `y`, computed on the device.

    Expert e's rows start at Σ_{e' < e} roundup(recv_counts[e'], 128) and number
    recv_counts[e]; returns an int64 tensor of E_local + 1 starts (the last is the end of
    the last segment). No host synchronisation.
    """
    counts = recv_counts[:-1].to(torch.int64)
    padded = (counts + 127) // 128 * 128
    return torch.cat([padded.new_zeros(1), torch.cumsum(padded, 0)])


def moe_raise_for_overflow(recv_counts: torch.Tensor, recv_capacity: int, op: str = "moe_dispatch_gemm") -> None:
    """Raises MkMoeOverflowError when a dispatch's rows did not fit `recv_capacity`.

    Reads recv_counts[-1], the smallest recv_capacity that fits the call's routing on every
    rank, from the device: a host synchronisation (so not inside a CUDA graph's capture).
    Every rank reads the same value, so every rank raises alike and may call again alike.
    """
    needed = int(recv_counts[-1])
    if needed > recv_capacity:
        raise MkMoeOverflowError(op, recv_capacity, needed)


class _Overflow:
    """The overflow queries of a dispatch's outputs (mixed into its NamedTuples)."""

    __slots__ = ()

    @property
    def needed_capacity(self) -> torch.Tensor:
        """The smallest recv_capacity that fits the call's routing (a 0-d int32 tensor on the
        device, no synchronisation); larger than y.shape[0] when the call overflowed."""
        return self.recv_counts[-1]

    def raise_for_overflow(self) -> None:
        """Raises MkMoeOverflowError when the call overflowed (moe_raise_for_overflow: syncs the host)."""
        moe_raise_for_overflow(self.recv_counts, self.y.shape[0])


class _MoeDispatchFields(NamedTuple):
    y: torch.Tensor
    recv_counts: torch.Tensor
    layout: torch.Tensor


class MoeDispatch(_Overflow, _MoeDispatchFields):
    """moe_dispatch_gemm's outputs (y, recv_counts, layout): pass `layout` (and `y`, or its
    activation) to moe_gemm_combine. `needed_capacity` and `raise_for_overflow()` tell an overflow."""

    __slots__ = ()


class _MoeDropDispatchFields(NamedTuple):
    y: torch.Tensor
    recv_counts: torch.Tensor
    layout: torch.Tensor
    drop_counts: torch.Tensor


class MoeDropDispatch(_Overflow, _MoeDropDispatchFields):
    """moe_dispatch_gemm's outputs in drop mode: MoeDispatch's three, then drop_counts
    [experts] int32 (per expert, this rank's rows the capacity dropped)."""

    __slots__ = ()


@_memoized
def moe_dispatch_shapes(x, topk_idx, w1, recv_capacity: int, world_size: int, activation: str = "none"):
    """(y, recv_counts, layout) shapes and the number of experts; with a gated activation
    w1 is [E_local, 2 * ffn, hidden] and y [recv_capacity, ffn]."""
    op = "moe_dispatch_gemm"
    gated = check.moe_activation(op, activation) != _lib.MOE_ACTIVATION_CODES["none"]
    check.tensor(op, "x", x, dtypes=check.GEMM_DTYPES, dim=2)
    check.tensor(op, "topk_idx", topk_idx, dtypes=(torch.int32,), dim=2)
    check.tensor(op, "w1", w1, dtypes=check.GEMM_DTYPES, dim=3)
    check.same_dtype(op, x=x, w1=w1)
    tokens, hidden = x.shape
    if topk_idx.shape[0] != tokens:
        check.fail(op, f"expected topk_idx to have one row per token ({tokens}), but got {topk_idx.shape[0]}")
    topk = topk_idx.shape[1]
    if not 1 <= topk <= 32:
        check.fail(op, f"expected topk (topk_idx.shape[1]) to be in [1, 32], but got {topk}")
    local_experts, w_rows, w_hidden = w1.shape
    layout = "[E_local, 2 * ffn, hidden], gate rows then up rows" if gated else "[E_local, ffn, hidden]"
    check.equal(op, "w1.shape[2]", w_hidden, hidden, f"x's hidden size; w1 is {layout}")
    check.world_size(op, world_size)
    experts = local_experts * world_size
    if not 1 <= experts <= 1024:
        check.fail(op, f"expected the number of experts (w1.shape[0] * world size = {experts}) to be in [1, 1024]")
    check.multiple_of(op, "hidden (x.shape[1])", hidden, 128, positive=True)
    if gated:
        check.multiple_of(op, f"w1.shape[1] (2 * ffn with activation={activation!r}, w1 {layout})", w_rows, 256, positive=True)
        ffn = w_rows // 2
    else:
        check.multiple_of(op, "ffn (w1.shape[1])", w_rows, 128, positive=True)
        ffn = w_rows
    check.multiple_of(op, "recv_capacity", recv_capacity, 128)
    if recv_capacity < 0:
        check.fail(op, f"expected recv_capacity to be non-negative, but got {recv_capacity}")
    return (recv_capacity, ffn), (local_experts + 1,), (moe_layout_bytes(tokens, topk, recv_capacity),), experts


def moe_dispatch_launch(x, topk_idx, w1, y, recv_counts, layout, experts: int, comm) -> None:
    op = "moe_dispatch_gemm"
    check.on_device(op, comm.torch_device, x=x, topk_idx=topk_idx, w1=w1, y=y, recv_counts=recv_counts, layout=layout)
    check.aligned(
        op,
        ("x", x, 16),
        ("w1", w1, 16),
        ("y", y, 16),
        ("layout", layout, 16),
        ("topk_idx", topk_idx, 4),
        ("recv_counts", recv_counts, 4),
    )
    tokens, hidden = x.shape
    _call(
        comm,
        "mkMoeDispatchGemm",
        x.data_ptr(),
        _lib.as_ptr(topk_idx.data_ptr(), ctypes.c_int32),
        w1.data_ptr(),
        y.data_ptr(),
        _lib.as_ptr(recv_counts.data_ptr(), ctypes.c_int32),
        layout.data_ptr(),
        tokens,
        hidden,
        w1.shape[1],
        topk_idx.shape[1],
        experts,
        y.shape[0],
        check.dtype_code(x.dtype),
    )


@functools.lru_cache(maxsize=1)
def _moe_options_initializer() -> bytes:
    """This library's MK_MOE_OPTIONS_INITIALIZER (mkMoeOptionsInit), as bytes to copy per call."""
    options = _lib.mkMoeOptions_t()
    raise_for(_lib.library().mkMoeOptionsInit(ctypes.byref(options)), "mkMoeOptionsInit")
    return bytes(options)


def moe_options(activation: str, expert_capacity: int) -> _lib.mkMoeOptions_t:
    """The mkMoeOptions_t of an activation name and an expert capacity (0: no-drop mode)."""
    options = _lib.mkMoeOptions_t.from_buffer_copy(_moe_options_initializer())
    options.activation = _lib.MOE_ACTIVATION_CODES[activation]
    if expert_capacity:
        options.capacityPolicy = _lib.MOE_DROP
        options.expertCapacity = expert_capacity
    return options


def moe_dispatch_options_launch(
    x, topk_idx, w1, y, recv_counts, drop_counts, layout, experts: int, activation: str, expert_capacity: int, comm
) -> None:
    op = "moe_dispatch_gemm"
    check.on_device(
        op,
        comm.torch_device,
        x=x,
        topk_idx=topk_idx,
        w1=w1,
        y=y,
        recv_counts=recv_counts,
        drop_counts=drop_counts,
        layout=layout,
    )
    check.aligned(
        op,
        ("x", x, 16),
        ("w1", w1, 16),
        ("y", y, 16),
        ("layout", layout, 16),
        ("topk_idx", topk_idx, 4),
        ("recv_counts", recv_counts, 4),
        ("drop_counts", drop_counts, 4),
    )
    tokens, hidden = x.shape
    options = moe_options(activation, expert_capacity)
    _call(
        comm,
        "mkMoeDispatchGemmWithOptions",
        x.data_ptr(),
        _lib.as_ptr(topk_idx.data_ptr(), ctypes.c_int32),
        w1.data_ptr(),
        y.data_ptr(),
        _lib.as_ptr(recv_counts.data_ptr(), ctypes.c_int32),
        _lib.as_ptr(drop_counts.data_ptr(), ctypes.c_int32),
        layout.data_ptr(),
        tokens,
        hidden,
        y.shape[1],  # ffn: y's columns (a gated w1 has twice as many rows)
        topk_idx.shape[1],
        experts,
        y.shape[0],
        check.dtype_code(x.dtype),
        ctypes.byref(options),
    )


def moe_dispatch_gemm(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    w1: torch.Tensor,
    comm: CommLike,
    recv_capacity: int,
    *,
    activation: str = "none",
    expert_capacity: int | None = None,
) -> MoeDispatch | MoeDropDispatch:
    """MoE token dispatch fused with the experts' first GEMM.

    x [tokens, hidden] and its routing topk_idx [tokens, topk] (int32 expert ids, -1 =
    none); this rank owns experts [r * E_local, (r + 1) * E_local) with weights
    w1 [E_local, ffn, hidden]. Returns MoeDispatch: y [recv_capacity, ffn] (rows grouped by
    local expert; see moe_segment_starts), recv_counts [E_local + 1] int32 (the last entry
    is the smallest recv_capacity that fits) and the layout for moe_gemm_combine.

    activation "silu" (SwiGLU) or "gelu" (GeGLU, erf form): w1 is the gated weight
    [E_local, 2 * ffn, hidden] (per expert the ffn gate rows, then the ffn up rows: Megatron's
    fused fc1 layout) and y = act(x · w_gateᵀ) · (x · w_upᵀ), formed in the GEMM's epilogue.

    expert_capacity C (drop mode, Megatron's capacity factor): each rank sends each expert at
    most its first C rows in token order (a token listing an expert twice takes one place);
    the rest are dropped and add nothing in moe_gemm_combine. Returns MoeDropDispatch, whose
    drop_counts [experts] int32 counts this rank's dropped rows per expert. A recv_capacity
    of E_local * roundup(world_size * C, 128) never overflows.

    recv_counts[-1] > recv_capacity means the call overflowed: nothing moved (y, and the output of a
    moe_gemm_combine on that layout, hold no data), the communicator stays usable, and a call with
    recv_capacity = recv_counts[-1] runs. Every rank reads the same value; the result's
    raise_for_overflow() raises MkMoeOverflowError naming it (a host synchronisation).
    """
    op = "moe_dispatch_gemm"
    _tensors(op, x=x, topk_idx=topk_idx, w1=w1)
    c = resolve(comm)
    check.moe_activation(op, activation)
    if activation == "none" and expert_capacity is None:
        y, counts, layout = dispatch(
            torch.ops.mkernel.moe_dispatch_gemm, x, topk_idx, w1, c.name, c.world_size, recv_capacity
        )
        return MoeDispatch(y, counts, layout)
    capacity = 0
    if expert_capacity is not None:
        capacity = check.expert_capacity(op, expert_capacity)
        if capacity == 0:
            check.fail(op, "expected expert_capacity >= 1 (0 would drop every row; None is no-drop mode), but got 0")
    y, counts, drops, layout = dispatch(
        torch.ops.mkernel.moe_dispatch_gemm_with_options,
        x,
        topk_idx,
        w1,
        c.name,
        c.world_size,
        recv_capacity,
        activation,
        capacity,
    )
    if expert_capacity is None:
        return MoeDispatch(y, counts, layout)
    return MoeDropDispatch(y, counts, layout, drops)


@_memoized
def moe_combine_shapes(y_act, w2, topk_weights, layout, world_size: int):
    op = "moe_gemm_combine"
    check.tensor(op, "y_act", y_act, dtypes=check.GEMM_DTYPES, dim=2)
    check.tensor(op, "w2", w2, dtypes=check.GEMM_DTYPES, dim=3)
    check.tensor(op, "topk_weights", topk_weights, dtypes=(torch.float32,), dim=2)
    check.tensor(op, "layout", layout, dtypes=(torch.uint8,), dim=1)
    check.same_dtype(op, y_act=y_act, w2=w2)
    recv_capacity, ffn = y_act.shape
    local_experts, hidden, w_ffn = w2.shape
    check.equal(op, "w2.shape[2]", w_ffn, ffn, "y_act's ffn size; w2 is [E_local, hidden, ffn]")
    tokens, topk = topk_weights.shape
    if not 1 <= topk <= 32:
        check.fail(op, f"expected topk (topk_weights.shape[1]) to be in [1, 32], but got {topk}")
    check.world_size(op, world_size)
    experts = local_experts * world_size
    if not 1 <= experts <= 1024:
        check.fail(op, f"expected the number of experts (w2.shape[0] * world size = {experts}) to be in [1, 1024]")
    check.multiple_of(op, "hidden (w2.shape[1])", hidden, 128, positive=True)
    check.multiple_of(op, "ffn (y_act.shape[1])", ffn, 128, positive=True)
    check.multiple_of(op, "recv_capacity (y_act.shape[0])", recv_capacity, 128)
    check.equal(
        op,
        "layout.numel()",
        layout.numel(),
        moe_layout_bytes(tokens, topk, recv_capacity),
        "moe_layout_bytes(tokens, topk, recv_capacity): pass the layout from moe_dispatch_gemm",
    )
    return (tokens, hidden), experts


def moe_combine_launch(y_act, w2, topk_weights, layout, out, experts: int, comm) -> None:
    op = "moe_gemm_combine"
    check.on_device(op, comm.torch_device, y_act=y_act, w2=w2, topk_weights=topk_weights, layout=layout, out=out)
    check.aligned(
        op,
        ("y_act", y_act, 16),
        ("w2", w2, 16),
        ("layout", layout, 16),
        ("out", out, 16),
        ("topk_weights", topk_weights, 4),
    )
    tokens, topk = topk_weights.shape
    recv_capacity, ffn = y_act.shape
    _call(
        comm,
        "mkMoeGemmCombine",
        y_act.data_ptr(),
        w2.data_ptr(),
        _lib.as_ptr(topk_weights.data_ptr(), ctypes.c_float),
        layout.data_ptr(),
        out.data_ptr(),
        tokens,
        w2.shape[1],
        ffn,
        topk,
        experts,
        recv_capacity,
        check.dtype_code(y_act.dtype),
    )


def moe_gemm_combine(
    y_act: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, layout: torch.Tensor, comm: CommLike
) -> torch.Tensor:
    """The experts' second GEMM fused with the way back: out [tokens, hidden].

    y_act [recv_capacity, ffn] in the layout of moe_dispatch_gemm's y (e.g. its
    activation); w2 [E_local, hidden, ffn]; topk_weights [tokens, topk] float32; layout
    from the preceding moe_dispatch_gemm on this communicator with the same tokens, hidden,
    topk, experts and recv_capacity (ffn may differ: the layout does not depend on it; the MoE
    layer's backward combines [recv_capacity, 2 * ffn] gradients on a dispatch of ffn columns).
    out[t] = Σ_j topk_weights[t, j] · (y_act row of (t, topk_idx[t, j])) · W2ᵀ.
    """
    _tensors("moe_gemm_combine", y_act=y_act, w2=w2, topk_weights=topk_weights, layout=layout)
    c = resolve(comm)
    return dispatch(torch.ops.mkernel.moe_gemm_combine, y_act, w2, topk_weights, layout, c.name, c.world_size)


# --- Ring attention ---------------------------------------------------------------------------------


@_memoized
def ring_attention_shapes(q, k, v, softmax_scale: float, causal: bool):
    op = "ring_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check.tensor(op, name, t, dtypes=check.GEMM_DTYPES, dim=4)
    check.same_dtype(op, q=q, k=k, v=v)
    batch, seq, heads, head_dim = q.shape
    if tuple(k.shape) != tuple(v.shape):
        check.fail(op, f"expected k and v to have the same shape, but got {tuple(k.shape)} and {tuple(v.shape)}")
    kb, kseq, kv_heads, kdim = k.shape
    if (kb, kseq, kdim) != (batch, seq, head_dim):
        check.fail(
            op,
            f"expected k [batch, seq_local, kv_heads, head_dim] to match q {tuple(q.shape)} in batch, seq_local "
            f"and head_dim, but got {tuple(k.shape)}",
        )
    if head_dim not in (64, 128):
        check.fail(op, f"expected head_dim (q.shape[3]) to be 64 or 128, but got {head_dim}")
    if kv_heads == 0 or heads % kv_heads != 0:
        check.fail(op, f"expected kv_heads (k.shape[2] = {kv_heads}) to divide num_heads (q.shape[2] = {heads})")
    if causal and seq % 2 != 0:
        check.fail(op, f"expected an even seq_local (q.shape[1]) with causal=True (zigzag layout), but got {seq}")
    check.softmax_scale(op, softmax_scale)
    return tuple(q.shape), (batch, heads, seq)


def ring_attention_launch(q, k, v, out, lse, softmax_scale: float, causal: bool, comm) -> None:
    op = "ring_attention"
    check.on_device(op, comm.torch_device, q=q, k=k, v=v, out=out, lse=lse)
    check.aligned(op, ("q", q, 16), ("k", k, 16), ("v", v, 16), ("out", out, 16), ("lse", lse, 4))
    batch, seq, heads, head_dim = q.shape
    _call(
        comm,
        "mkRingAttention",
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        _lib.as_ptr(lse.data_ptr(), ctypes.c_float),
        batch,
        seq,
        heads,
        k.shape[2],
        head_dim,
        softmax_scale,  # c_float: ctypes converts a Python float
        1 if causal else 0,
        check.dtype_code(q.dtype),
    )


@_memoized
def ring_attention_backward_shapes(q, k, v, out, dout, lse, softmax_scale: float, causal: bool):
    """(dq, dk, dv) shapes, after the forward's rules and out, dout, lse matching them."""
    op = "ring_attention_backward"
    q_shape, lse_shape = ring_attention_shapes(q, k, v, softmax_scale, causal)
    for name, t in (("out", out), ("dout", dout)):
        check.tensor(op, name, t, dtypes=check.GEMM_DTYPES, dim=4)
        if tuple(t.shape) != q_shape:
            check.fail(op, f"expected {name} to have q's shape {q_shape}, but got {tuple(t.shape)}")
    check.same_dtype(op, q=q, out=out, dout=dout)
    check.tensor(op, "lse", lse, dtypes=(torch.float32,), dim=3)
    if tuple(lse.shape) != lse_shape:
        check.fail(op, f"expected lse [batch, heads, seq_local] {lse_shape}, but got {tuple(lse.shape)}")
    return q_shape, tuple(k.shape), tuple(v.shape)


def ring_attention_backward_launch(
    q, k, v, out, dout, lse, dq, dk, dv, softmax_scale: float, causal: bool, comm
) -> None:
    op = "ring_attention_backward"
    tensors = dict(q=q, k=k, v=v, out=out, dout=dout, lse=lse, dq=dq, dk=dk, dv=dv)
    check.on_device(op, comm.torch_device, **tensors)
    check.aligned(op, *((name, t, 4 if name == "lse" else 16) for name, t in tensors.items()))
    batch, seq, heads, head_dim = q.shape
    _call(
        comm,
        "mkRingAttentionBackward",
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        dout.data_ptr(),
        _lib.as_ptr(lse.data_ptr(), ctypes.c_float),
        dq.data_ptr(),
        dk.data_ptr(),
        dv.data_ptr(),
        batch,
        seq,
        heads,
        k.shape[2],
        head_dim,
        softmax_scale,  # c_float: ctypes converts a Python float
        1 if causal else 0,
        check.dtype_code(q.dtype),
    )


def default_softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: CommLike,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context-parallel attention: returns (out, lse), differentiable in q, k and v.

    q [batch, seq_local, heads, head_dim], k and v [batch, seq_local, kv_heads, head_dim]
    (GQA when kv_heads < heads), this rank's shard of the global sequence: contiguous
    shards without causal, the zigzag layout with causal=True (see mkernel.h). out is like
    q; lse [batch, heads, seq_local] float32 (natural log). softmax_scale defaults to
    1/sqrt(head_dim). Autograd runs mkRingAttentionBackward (every rank must run the
    backward too, as it ran the forward); no gradient flows through lse (a by-product, as
    in FlashAttention).
    """
    _tensors("ring_attention", q=q, k=k, v=v)
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1])
    return tuple(
        dispatch(torch.ops.mkernel.ring_attention, q, k, v, comm_name(comm), float(softmax_scale), bool(causal))
    )
