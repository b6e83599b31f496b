"""Argument checks shared by the eager ops and their fake (shape-only) implementations.

Each check raises MkInvalidArgumentError with a message in torch's style: the op, the
argument, what was expected and what was given. Shape and dtype rules run first (also
under FakeTensorMode and torch.compile); device and alignment rules need real storage
and run only when launching.
"""

from __future__ import annotations

import math

import torch

from . import _lib
from .errors import MkInvalidArgumentError

TORCH_DTYPES = {
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.uint32: "uint32",
    torch.int64: "int64",
    torch.uint64: "uint64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8e4m3",
    torch.float8_e5m2: "float8e5m2",
}
ALL_DTYPES = tuple(TORCH_DTYPES)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The reductions take every type (fp8 within a node, in float with one rounding).
REDUCE_DTYPES = ALL_DTYPES
GEMM_DTYPES = (torch.bfloat16, torch.float16)
# B of scaled_gemm (its kernels read e4m3 B) ...
SCALED_GEMM_DTYPES = (torch.float8_e4m3fn,)
# ... and its A: e4m3, or e5m2, the gradient of an fp8 backward (e5m2 x e4m3 kernels).
SCALED_GEMM_A_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
REDUCE_OPS = tuple(_lib.REDOP_CODES)


def fail(op: str, message: str):
    raise MkInvalidArgumentError(f"mkernel.{op}: {message}")


_DTYPE_CODES = {dtype: _lib.DTYPE_CODES[name] for dtype, name in TORCH_DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES[dtype]


def tensor(op: str, name: str, t, *, dtypes=None, dim: int | None = None, min_dim: int | None = None):
    """Checks that `t` is a contiguous tensor with an allowed dtype and rank."""
    if not isinstance(t, torch.Tensor):
        fail(op, f"expected {name} to be a torch.Tensor, but got {type(t).__name__}")
    allowed = dtypes if dtypes is not None else ALL_DTYPES
    if t.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        fail(op, f"expected {name} to have dtype in ({names}), but got {t.dtype}")
    if dim is not None and t.dim() != dim:
        fail(op, f"expected {name} to be a {dim}-D tensor, but got a {t.dim()}-D tensor of shape {tuple(t.shape)}")
    if min_dim is not None and t.dim() < min_dim:
        fail(op, f"expected {name} to have at least {min_dim} dimension(s), but got a {t.dim()}-D tensor")
    if not t.is_contiguous():
        fail(op, f"expected {name} to be contiguous (densely packed, row-major); call .contiguous() first")


def same_dtype(op: str, **named):
    items = list(named.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            fail(op, f"expected {first_name} and {name} to have the same dtype, but got {first.dtype} and {t.dtype}")


def multiple_of(op: str, what: str, value: int, factor: int, *, positive: bool = False):
    if positive and value <= 0:
        fail(op, f"expected {what} to be a positive multiple of {factor}, but got {value}")
    if value % factor != 0:
        fail(op, f"expected {what} to be a multiple of {factor}, but got {value}")


def equal(op: str, what: str, value: int, expected: int, because: str = ""):
    if value != expected:
        suffix = f" ({because})" if because else ""
        fail(op, f"expected {what} to be {expected}, but got {value}{suffix}")


def world_size(op: str, n: int):
    """The world size a shape rule is given: an op argument, so it may come from a traced graph."""
    if n < 1:
        fail(op, f"expected world_size to be positive, but got {n}")


def reduce_op(op: str, reduce: str) -> int:
    if reduce not in _lib.REDOP_CODES:
        fail(op, f"expected op to be one of {REDUCE_OPS}, but got {reduce!r}")
    return _lib.REDOP_CODES[reduce]


MOE_ACTIVATIONS = tuple(_lib.MOE_ACTIVATION_CODES)


def moe_activation(op: str, activation) -> int:
    """The mkMoeOptions_t.activation code of an activation name ("none", "silu", "gelu")."""
    code = _lib.MOE_ACTIVATION_CODES.get(activation) if isinstance(activation, str) else None
    if code is None:
        fail(
            op,
            f"expected activation to be one of {MOE_ACTIVATIONS} ('silu' = SwiGLU, 'gelu' = GeGLU, both with the "
            f"gated w1 [E_local, 2 * ffn, hidden]), but got {activation!r}",
        )
    return code


def expert_capacity(op: str, capacity) -> int:
    """mkMoeOptions_t.expertCapacity: 0 is no-drop mode, [1, 2^31) drop mode with that cap."""
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        fail(op, f"expected expert_capacity to be an int, but got {type(capacity).__name__}")
    if not 0 <= capacity < 2**31:
        fail(
            op,
            f"expected expert_capacity (rows each rank may send to each expert; 0 = no drop) to be in [0, 2^31), "
            f"but got {capacity}",
        )
    return capacity


def softmax_scale(op: str, scale: float):
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        fail(op, f"expected softmax_scale to be finite and positive, but got {scale!r}")


def on_device(op: str, device: torch.device, **named):
    """Checks that every tensor is in the memory of `device` (a CUDA device with its index).

    One comparison of torch.device objects per tensor: reading `t.device.type` and
    `t.device.index` would build two device objects.
    """
    for name, t in named.items():
        if t.device != device:
            fail(op, f"expected {name} to be on {device} (the communicator's device), but got a tensor on {t.device}")


def aligned(op: str, *specs):
    """Checks, for each (name, tensor, alignment) in order, that the tensor's first element
    sits at a multiple of `alignment` bytes (one call for all of an op's tensors)."""
    for name, t, alignment in specs:
        address = t.data_ptr()
        if address % alignment != 0:
            fail(
                op,
                f"expected {name} to be {alignment}-byte aligned, but its data starts at address "
                f"{address:#x} (a view with a storage offset? call .clone())",
            )


def output(op: str, name: str, out, *, shape, dtype, device: torch.device):
    """Checks a caller-supplied output tensor (out=)."""
    tensor(op, name, out, dtypes=(dtype,))
    if out.shape != tuple(shape):  # torch.Size is a tuple
        fail(op, f"expected {name} to have shape {tuple(shape)}, but got {tuple(out.shape)}")
    on_device(op, device, **{name: out})
