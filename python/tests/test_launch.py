"""The launch path on a CPU: the C library replaced by a stand-in that records its calls,
the communicator by one whose tensors live on the CPU. What each C function is given (the
handle and current stream last, typed pointers at the right addresses), and a communicator's
asynchronous error raised with its description."""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass, field

import pytest
import torch

import mkernel
from mkernel import _lib, ops
from mkernel import comm as registry

STREAM = 0x5000
HANDLE = _lib.mkComm_t(0x1000)


class StandInLibrary:
    """Records every call; mkAllReduce and the MoE ops return `result`."""

    def __init__(self):
        self.calls = []
        self.result = _lib.SUCCESS

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            if name == "mkGetLastError":
                return b"the library's detail"
            if name == "mkGetErrorString":
                return b"remote error"
            return self.result

        return call


@dataclass
class CpuComm:
    """Registered like a Communicator (the ops take it by name); its tensors live on the CPU."""

    world_size: int = 1
    rank: int = 0
    device: int = 0
    torch_device: torch.device = torch.device("cpu")
    name: str = "test-launch"
    async_error: Exception | None = None
    async_checks: list = field(default_factory=list)

    def handle(self):
        self.check_async_error(HANDLE)
        return HANDLE

    def check_async_error(self, handle=None):
        self.async_checks.append(handle)
        if self.async_error is not None:
            raise self.async_error


@pytest.fixture
def launch(monkeypatch):
    library = StandInLibrary()
    monkeypatch.setattr(_lib, "_library", library)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: STREAM, raising=False)
    comm = CpuComm()
    registry.register(comm)
    yield library, comm
    registry.unregister(comm.name)


def _random(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_all_reduce_passes_handle_and_stream_last(launch):
    library, comm = launch
    x, y = _random(64), torch.empty(64)
    mkernel.all_reduce(x, comm.name, "max", out=y)
    name, args = library.calls[-1]
    assert name == "mkAllReduce"
    assert args == (x.data_ptr(), y.data_ptr(), 64, _lib.DTYPE_CODES["float32"], _lib.REDOP_CODES["max"], HANDLE, STREAM)
    assert comm.async_checks == [HANDLE], "the asynchronous error is queried before the launch"
    # The op allocates its output, a 0-d one too.
    scalar = _random(())
    out = mkernel.all_reduce(scalar, comm.name)
    assert out.shape == () and out.dtype == torch.float32
    assert library.calls[-1][1][:3] == (scalar.data_ptr(), out.data_ptr(), 1)


def test_typed_pointers_point_at_the_tensors(launch):
    library, comm = launch
    tokens, hidden, ffn, topk = 4, 128, 128, 2
    x = _random(tokens, hidden, dtype=torch.bfloat16)
    idx = torch.tensor([[0, -1]] * tokens, dtype=torch.int32)
    w1 = _random(1, ffn, hidden, dtype=torch.bfloat16, seed=1)
    y, counts, layout = mkernel.moe_dispatch_gemm(x, idx, w1, comm.name, 128)
    assert (y.shape, y.dtype) == ((128, ffn), torch.bfloat16)
    assert (counts.shape, counts.dtype) == ((2,), torch.int32)
    assert (layout.shape, layout.dtype) == ((mkernel.moe_layout_bytes(tokens, topk, 128),), torch.uint8)
    name, args = library.calls[-1]
    assert name == "mkMoeDispatchGemm"

    def address(p):
        return ctypes.cast(p, ctypes.c_void_p).value

    assert isinstance(args[1], ctypes.POINTER(ctypes.c_int32)) and address(args[1]) == idx.data_ptr()
    assert isinstance(args[4], ctypes.POINTER(ctypes.c_int32)) and address(args[4]) == counts.data_ptr()
    assert (args[0], args[2], args[3], args[5]) == (x.data_ptr(), w1.data_ptr(), y.data_ptr(), layout.data_ptr())
    assert args[6:] == (tokens, hidden, ffn, topk, 1, 128, _lib.DTYPE_CODES["bfloat16"], HANDLE, STREAM)

    weights = _random(tokens, topk, seed=2)
    out = mkernel.moe_gemm_combine(y, _random(1, hidden, ffn, dtype=torch.bfloat16, seed=3), weights, layout, comm.name)
    name, args = library.calls[-1]
    assert name == "mkMoeGemmCombine"
    assert isinstance(args[2], ctypes.POINTER(ctypes.c_float)) and address(args[2]) == weights.data_ptr()
    assert args[4] == out.data_ptr()


def test_ring_attention_passes_the_scale_as_a_float(launch):
    library, comm = launch
    q, k, v = (_random(1, 8, h, 64, dtype=torch.bfloat16, seed=s) for s, h in ((0, 4), (1, 2), (2, 2)))
    out, lse = mkernel.ring_attention(q, k, v, comm.name, softmax_scale=0.3, causal=True)
    name, args = library.calls[-1]
    assert name == "mkRingAttention"
    assert ctypes.cast(args[4], ctypes.c_void_p).value == lse.data_ptr()
    assert args[5:] == (1, 8, 4, 2, 64, pytest.approx(0.3), 1, _lib.DTYPE_CODES["bfloat16"], HANDLE, STREAM)


def test_an_asynchronous_error_raises_before_the_launch(launch):
    library, comm = launch
    library.result = _lib.REMOTE_ERROR
    comm.async_error = mkernel.MkRemoteError("communicator failed asynchronously (abort it and create a new one)")
    x = _random(64)
    with pytest.raises(mkernel.MkRemoteError, match="failed asynchronously"):
        mkernel.all_reduce(x, comm.name, out=torch.empty(64))
    assert comm.async_checks == [HANDLE]
    assert library.calls == [], "nothing is launched on a failed communicator"
    # With no asynchronous error recorded, the refusal carries the library's message.
    comm.async_error = None
    with pytest.raises(mkernel.MkRemoteError, match=r"mkAllReduce failed: remote error: the library's detail"):
        mkernel.all_reduce(x, comm.name, out=torch.empty(64))


class FailedCommLibrary:
    """The library's side of a communicator whose kernel recorded an error (src/comm): the
    first look at the error (mkCommGetAsyncError, or the check every op makes before it
    launches) makes the kernel's description the communicator's message, and a refused op
    then replaces that message with its own refusal, which quotes the description."""

    REFUSAL = "the communicator stopped at an earlier asynchronous error: {}; destroy it and create a new one"

    def __init__(self, code, description):
        self.code, self.description = code, description
        self.recorded = False
        self.message = ""

    def _async_error(self):
        if not self.recorded:
            self.recorded = True
            self.message = self.description
        return self.code

    def __getattr__(self, name):
        def call(*args):
            if name == "mkCommGetAsyncError":
                args[1]._obj.value = self._async_error()
                return _lib.SUCCESS
            if name == "mkGetLastError":
                return self.message.encode()
            if name == "mkGetErrorString":
                return b"timeout"
            if name in ("mkConfigInit", "mkCommInitRankConfig", "mkCommAbort"):
                return _lib.SUCCESS
            code = self._async_error()  # an op on the communicator: refused before it launches
            self.message = f"{name}: {self.REFUSAL.format(self.description)}"
            return code

        return call


def test_an_asynchronous_error_keeps_its_description(monkeypatch):
    """Every call after a kernel's timeout raises the timeout with the kernel's description (which
    op, which peer), not the generic refusal the library gives an op on a failed communicator."""
    description = "mkAllReduce on rank 0 timed out waiting for rank 1 (step 3) after MK_TIMEOUT_MS"
    monkeypatch.setattr(_lib, "_library", FailedCommLibrary(_lib.TIMEOUT, description))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: STREAM, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    comm = mkernel.Communicator(unique_id=bytes(128), rank=0, world_size=1, device=0, name="test-async-description")
    comm.torch_device = torch.device("cpu")
    try:
        x = _random(64)
        for call in range(2):
            with pytest.raises(mkernel.MkTimeoutError, match="timed out waiting for rank 1") as raised:
                mkernel.all_reduce(x, comm, out=torch.empty(64))
            assert "abort it and create a new one" in str(raised.value), call
    finally:
        comm.abort()
