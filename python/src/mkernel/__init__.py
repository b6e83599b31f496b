"""mkernel for PyTorch: fused communication + compute kernels on torch tensors.

    import mkernel
    comm = mkernel.Communicator()            # over the default torch.distributed group
    y = mkernel.all_gather_gemm(x_shard, w, comm)

Importing needs no GPU: the bundled libmkernel.so is loaded on first use and loads the
CUDA driver only when a call needs it.
"""

from . import library  # noqa: F401  (registers torch.ops.mkernel.*)
from . import nn
from ._version import __version__
from .comm import Communicator, get_unique_id
from .errors import (
    MkCudaError,
    MkError,
    MkInProgressError,
    MkInternalError,
    MkInvalidArgumentError,
    MkInvalidUsageError,
    MkMoeOverflowError,
    MkRemoteError,
    MkSystemError,
    MkTimeoutError,
)
from .ops import (
    MoeDispatch,
    MoeDropDispatch,
    all_gather,
    all_gather_gemm,
    all_reduce,
    gemm,
    gemm_all_reduce,
    gemm_reduce_scatter,
    moe_dispatch_gemm,
    moe_gemm_combine,
    moe_layout_bytes,
    moe_raise_for_overflow,
    moe_segment_starts,
    reduce_scatter,
    ring_attention,
    scaled_gemm,
    scaled_gemm_all_reduce,
    scaled_gemm_reduce_scatter,
)


def library_version() -> int:
    """The loaded libmkernel.so's version as MK_VERSION(major, minor, patch) = major*10000 + minor*100 + patch."""
    import ctypes

    from . import _lib
    from .errors import raise_for

    version = ctypes.c_int(0)
    raise_for(_lib.library().mkGetVersion(ctypes.byref(version)), "mkGetVersion")
    return version.value


__all__ = [
    "Communicator",
    "MkCudaError",
    "MkError",
    "MkInProgressError",
    "MkInternalError",
    "MkInvalidArgumentError",
    "MkInvalidUsageError",
    "MkMoeOverflowError",
    "MkRemoteError",
    "MkSystemError",
    "MkTimeoutError",
    "MoeDispatch",
    "MoeDropDispatch",
    "__version__",
    "all_gather",
    "all_gather_gemm",
    "all_reduce",
    "gemm",
    "gemm_all_reduce",
    "gemm_reduce_scatter",
    "get_unique_id",
    "library_version",
    "moe_dispatch_gemm",
    "moe_gemm_combine",
    "moe_layout_bytes",
    "moe_raise_for_overflow",
    "moe_segment_starts",
    "nn",
    "reduce_scatter",
    "ring_attention",
    "scaled_gemm",
    "scaled_gemm_all_reduce",
    "scaled_gemm_reduce_scatter",
]
