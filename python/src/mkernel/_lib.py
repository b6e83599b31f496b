"""The C ABI of libmkernel.so, declared with ctypes.

ctypes, not cffi: it ships with CPython (no build step and no extra dependency), its
calls release the GIL (so `Communicator.abort` can run from a watchdog thread while
another thread is blocked in the library), and the ABI is small and fixed. The
declarations below are the one place the C signatures are written in Python;
tests/test_header_drift.py parses include/mkernel.h and compares every prototype with
them (names, argument counts, argument and result types).

The library is loaded on first use, not at import, and it loads libcuda itself only when
a call needs the GPU: `import mkernel` works on a machine without a GPU or a driver.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from ctypes import POINTER, c_char, c_char_p, c_float, c_int, c_int32, c_longlong, c_size_t, c_uint
from pathlib import Path

LIBRARY_ENV = "MKERNEL_LIBRARY"
"""Environment variable naming a libmkernel.so to load instead of the bundled one."""

# mkResult_t, mkDataType_t and mkRedOp_t are C enums: int-sized, passed as c_int.
mkResult_t = c_int
mkDataType_t = c_int
mkRedOp_t = c_int
mkScaleMode_t = c_int


class mkComm_t(ctypes.c_void_p):
    """Opaque communicator handle (a distinct type so it cannot be passed as a buffer)."""


class mkStream_t(ctypes.c_void_p):
    """cudaStream_t: torch.cuda.Stream.cuda_stream converts to it."""


class mkUniqueId(ctypes.Structure):
    _fields_ = [("internal", c_char * 128)]


class mkConfig_t(ctypes.Structure):
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("timeoutMs", c_int),
        ("bootstrapTimeoutMs", c_int),
        ("commCtas", c_int),
        ("maxCtas", c_int),
        ("ranksPerNode", c_int),
        ("workspaceBytes", c_longlong),
    ]


class mkMoeOptions_t(ctypes.Structure):
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("capacityPolicy", c_int),
        ("expertCapacity", c_longlong),
        ("activation", c_int),
        ("reserved", c_int),
    ]


UNIQUE_ID_BYTES = ctypes.sizeof(mkUniqueId)

# Result codes (mkResult_t), numbered as in include/mkernel.h.
SUCCESS = 0
UNHANDLED_CUDA_ERROR = 1
SYSTEM_ERROR = 2
INTERNAL_ERROR = 3
INVALID_ARGUMENT = 4
INVALID_USAGE = 5
REMOTE_ERROR = 6
IN_PROGRESS = 7
TIMEOUT = 8

# Data types (mkDataType_t) and reduction operators (mkRedOp_t).
DTYPE_CODES = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
    "float8e4m3": 10,
    "float8e5m2": 11,
}
# Scale modes of mkScaledGemm (mkScaleMode_t).
SCALE_MODE_CODES = {"tensor": 0, "rowwise": 1, "block": 2}
REDOP_CODES = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
# mkMoeOptions_t.activation (MK_MOE_ACT_*): "silu" is SwiGLU, "gelu" GeGLU, both with the gated w1.
MOE_ACTIVATION_CODES = {"none": 0, "silu": 1, "gelu": 2}
# mkMoeOptions_t.capacityPolicy.
MOE_NO_DROP = 0
MOE_DROP = 1

_void_p = ctypes.c_void_p

# name: (result type, [argument types]) for every function of include/mkernel.h.
DECLARATIONS: dict[str, tuple[object, list[object]]] = {
    "mkAllGather": (mkResult_t, [_void_p, _void_p, c_size_t, mkDataType_t, mkComm_t, mkStream_t]),
    "mkReduceScatter": (mkResult_t, [_void_p, _void_p, c_size_t, mkDataType_t, mkRedOp_t, mkComm_t, mkStream_t]),
    "mkAllReduce": (mkResult_t, [_void_p, _void_p, c_size_t, mkDataType_t, mkRedOp_t, mkComm_t, mkStream_t]),
    "mkGetUniqueId": (mkResult_t, [POINTER(mkUniqueId)]),
    "mkCommInitRank": (mkResult_t, [POINTER(mkComm_t), c_int, mkUniqueId, c_int]),
    "mkCommInitRankConfig": (mkResult_t, [POINTER(mkComm_t), c_int, mkUniqueId, c_int, POINTER(mkConfig_t)]),
    "mkCommInitAll": (mkResult_t, [POINTER(mkComm_t), c_int, POINTER(c_int)]),
    "mkCommDestroy": (mkResult_t, [mkComm_t]),
    "mkCommAbort": (mkResult_t, [mkComm_t]),
    "mkCommGetAsyncError": (mkResult_t, [mkComm_t, POINTER(mkResult_t)]),
    "mkConfigInit": (mkResult_t, [POINTER(mkConfig_t)]),
    "mkAllGatherGemm": (
        mkResult_t,
        [_void_p, _void_p, _void_p, _void_p, c_size_t, c_size_t, c_size_t, mkDataType_t, mkComm_t, mkStream_t],
    ),
    "mkGemmReduceScatter": (
        mkResult_t,
        [_void_p, _void_p, _void_p, c_size_t, c_size_t, c_size_t, mkDataType_t, mkComm_t, mkStream_t],
    ),
    "mkGemmAllReduce": (
        mkResult_t,
        [_void_p, _void_p, _void_p, c_size_t, c_size_t, c_size_t, mkDataType_t, mkComm_t, mkStream_t],
    ),
    "mkMoeLayoutBytes": (mkResult_t, [c_size_t, c_size_t, c_size_t, POINTER(c_size_t)]),
    "mkMoeDispatchGemm": (
        mkResult_t,
        [
            _void_p,
            POINTER(c_int32),
            _void_p,
            _void_p,
            POINTER(c_int32),
            _void_p,
            c_size_t,
            c_size_t,
            c_size_t,
            c_size_t,
            c_size_t,
            c_size_t,
            mkDataType_t,
            mkComm_t,
            mkStream_t,
        ],
    ),
    "mkMoeOptionsInit": (mkResult_t, [POINTER(mkMoeOptions_t)]),
    "mkMoeDispatchGemmWithOptions": (
        mkResult_t,
        [
            _void_p,
            POINTER(c_int32),
            _void_p,
            _void_p,
            POINTER(c_int32),
            POINTER(c_int32),
            _void_p,
            c_size_t,
            c_size_t,
            c_size_t,
            c_size_t,
            c_size_t,
            c_size_t,
            mkDataType_t,
            POINTER(mkMoeOptions_t),
            mkComm_t,
            mkStream_t,
        ],
    ),
    "mkMoeGemmCombine": (
        mkResult_t,
        [
            _void_p,
            _void_p,
            POINTER(c_float),
            _void_p,
            _void_p,
            c_size_t,
            c_size_t,
            c_size_t,
            c_size_t,
            c_size_t,
            c_size_t,
            mkDataType_t,
            mkComm_t,
            mkStream_t,
        ],
    ),
    "mkRingAttention": (
        mkResult_t,
        [
            _void_p,
            _void_p,
            _void_p,
            _void_p,
            POINTER(c_float),
            c_size_t,
            c_size_t,
            c_size_t,
            c_size_t,
            c_size_t,
            c_float,
            c_int32,
            mkDataType_t,
            mkComm_t,
            mkStream_t,
        ],
    ),
    "mkRingAttentionBackward": (
        mkResult_t,
        [
            _void_p,
            _void_p,
            _void_p,
            _void_p,
            _void_p,
            POINTER(c_float),
            _void_p,
            _void_p,
            _void_p,
            c_size_t,
            c_size_t,
            c_size_t,
            c_size_t,
            c_size_t,
            c_float,
            c_int32,
            mkDataType_t,
            mkComm_t,
            mkStream_t,
        ],
    ),
    "mkGemm": (mkResult_t, [_void_p, _void_p, _void_p, c_size_t, c_size_t, c_size_t, mkDataType_t, mkStream_t]),
    "mkScaledGemm": (
        mkResult_t,
        [
            _void_p,
            POINTER(c_float),
            _void_p,
            POINTER(c_float),
            _void_p,
            c_size_t,
            c_size_t,
            c_size_t,
            mkDataType_t,
            mkDataType_t,
            mkScaleMode_t,
            mkStream_t,
        ],
    ),
    "mkScaledGemmMixed": (
        mkResult_t,
        [
            _void_p,
            POINTER(c_float),
            _void_p,
            POINTER(c_float),
            _void_p,
            c_size_t,
            c_size_t,
            c_size_t,
            mkDataType_t,
            mkDataType_t,
            mkDataType_t,
            mkScaleMode_t,
            mkStream_t,
        ],
    ),
    "mkAllGatherScaledGemm": (
        mkResult_t,
        [
            _void_p,
            POINTER(c_float),
            _void_p,
            POINTER(c_float),
            _void_p,
            c_size_t,
            c_size_t,
            c_size_t,
            mkDataType_t,
            mkDataType_t,
            mkScaleMode_t,
            mkComm_t,
            mkStream_t,
        ],
    ),
    "mkScaledGemmReduceScatter": (
        mkResult_t,
        [
            _void_p,
            POINTER(c_float),
            _void_p,
            POINTER(c_float),
            _void_p,
            c_size_t,
            c_size_t,
            c_size_t,
            mkDataType_t,
            mkDataType_t,
            mkScaleMode_t,
            mkComm_t,
            mkStream_t,
        ],
    ),
    "mkScaledGemmAllReduce": (
        mkResult_t,
        [
            _void_p,
            POINTER(c_float),
            _void_p,
            POINTER(c_float),
            _void_p,
            c_size_t,
            c_size_t,
            c_size_t,
            mkDataType_t,
            mkDataType_t,
            mkScaleMode_t,
            mkComm_t,
            mkStream_t,
        ],
    ),
    "mkGetVersion": (mkResult_t, [POINTER(c_int)]),
    "mkCommCount": (mkResult_t, [mkComm_t, POINTER(c_int)]),
    "mkCommUserRank": (mkResult_t, [mkComm_t, POINTER(c_int)]),
    "mkCommCuDevice": (mkResult_t, [mkComm_t, POINTER(c_int)]),
    "mkGetErrorString": (c_char_p, [mkResult_t]),
    "mkGetLastError": (c_char_p, [mkComm_t]),
}


def bundled_library_path() -> Path:
    """Where the wheel puts libmkernel.so: next to this file."""
    return Path(__file__).with_name("libmkernel.so")


def bundled_header_path() -> Path:
    """The C header the bundled library was built with (shipped in the wheel)."""
    return Path(__file__).parent / "include" / "mkernel.h"


_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The loaded libmkernel.so with every function declared (loaded once, on first use)."""
    global _library
    if _library is not None:
        return _library
    with _lock:
        if _library is None:
            path = os.environ.get(LIBRARY_ENV) or str(bundled_library_path())
            try:
                lib = ctypes.CDLL(path)
            except OSError as err:
                raise ImportError(
                    f"mkernel: cannot load {path} ({err}); reinstall the mkernel wheel or set {LIBRARY_ENV}"
                ) from err
            for name, (restype, argtypes) in DECLARATIONS.items():
                fn = getattr(lib, name)
                fn.restype = restype
                fn.argtypes = argtypes
            _library = lib
    return _library


_POINTER_BYTES = ctypes.sizeof(ctypes.c_void_p)


def as_ptr(address: int, ctype):
    """A typed pointer argument from a raw device address (tensor.data_ptr()).

    Made from the address's bytes: a quarter of the host time of
    ctypes.cast(ctypes.c_void_p(address), POINTER(ctype)).
    """
    return POINTER(ctype).from_buffer_copy(address.to_bytes(_POINTER_BYTES, sys.byteorder))
