"""Exceptions: one class per mkResult_t code, all subclasses of MkError.

Every exception carries the result code and the library's detailed message
(mkGetLastError), or the rule a Python-side argument check found broken.
"""

from __future__ import annotations

from . import _lib


class MkError(RuntimeError):
    """A failed mkernel call. `code` is the mkResult_t value, `message` the detail."""

    code: int = -1

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class MkCudaError(MkError):
    """A CUDA call failed (driver error, launch failure, out of device memory)."""

    code = _lib.UNHANDLED_CUDA_ERROR


class MkSystemError(MkError):
    """A system call, socket or system library failed (e.g. no libcuda on this machine)."""

    code = _lib.SYSTEM_ERROR


class MkInternalError(MkError):
    """An invariant inside mkernel broke (a bug in mkernel)."""

    code = _lib.INTERNAL_ERROR


class MkInvalidArgumentError(MkError, ValueError):
    """An argument breaks a rule: dtype, device, shape, contiguity, alignment, size."""

    code = _lib.INVALID_ARGUMENT


class MkInvalidUsageError(MkError):
    """A valid call in the wrong state (closed or aborted communicator, workspace too small, ...)."""

    code = _lib.INVALID_USAGE


class MkRemoteError(MkError):
    """A peer failed or aborted, and this rank stopped because of it."""

    code = _lib.REMOTE_ERROR


class MkInProgressError(MkError):
    """A non-blocking operation has not completed yet."""

    code = _lib.IN_PROGRESS


class MkTimeoutError(MkError):
    """A bounded wait expired (bootstrap, or a kernel waiting for a peer)."""

    code = _lib.TIMEOUT


class MkMoeOverflowError(MkError):
    """A no-drop MoE dispatch whose rows did not fit its receive buffer.

    Not a library error code: an overflow is the call's outcome. Nothing moved, the
    communicator stays usable, and every rank sees the same `needed_capacity`; call again
    with recv_capacity >= needed_capacity. Raised by MoeDispatch.raise_for_overflow
    (which reads the needed capacity from the device) and by mkernel.nn.MoE.
    """

    def __init__(self, op: str, recv_capacity: int, needed_capacity: int):
        super().__init__(
            f"mkernel.{op}: the routed rows need recv_capacity >= {needed_capacity}, but the call had "
            f"{recv_capacity}; nothing moved and the communicator is usable: call again with "
            f"recv_capacity={needed_capacity}"
        )
        self.recv_capacity = recv_capacity
        self.needed_capacity = needed_capacity


_BY_CODE: dict[int, type[MkError]] = {
    cls.code: cls
    for cls in (
        MkCudaError,
        MkSystemError,
        MkInternalError,
        MkInvalidArgumentError,
        MkInvalidUsageError,
        MkRemoteError,
        MkInProgressError,
        MkTimeoutError,
    )
}


def error_class(code: int) -> type[MkError]:
    """The exception class for a result code (MkError itself for codes this package does not know)."""
    return _BY_CODE.get(code, MkError)


def error_string(code: int) -> str:
    """The library's short description of a result code."""
    raw = _lib.library().mkGetErrorString(code)
    return raw.decode("utf-8", "replace") if raw else f"result {code}"


def raise_for(code: int, call: str, comm_handle=None) -> None:
    """Raises the MkError subclass for `code` unless it is mkSuccess.

    The message is the library's last error: of `comm_handle` when given (per
    communicator, independent of the calling thread), else of the calling thread.
    """
    if code == _lib.SUCCESS:
        return
    lib = _lib.library()
    raw = lib.mkGetLastError(comm_handle)
    detail = raw.decode("utf-8", "replace") if raw else ""
    text = f"{call} failed: {error_string(code)}"
    if detail:
        text += f": {detail}"
    cls = error_class(code)
    raise cls(text, code)
