"""mkernel.Communicator: an mkComm_t owned by a Python object.

The communicator bootstraps from an existing torch.distributed process group (rank 0 of
the group makes the unique id and the group broadcasts it, over gloo or nccl) or from an
explicit (unique_id, rank, world_size). Every communicator is registered under a name,
which the torch.library ops take in place of the object (as torch's functional
collectives take a group name), so compiled graphs stay free of Python objects.
"""

from __future__ import annotations

import ctypes
import datetime
import itertools
import os
import threading
from typing import Union

import torch

from . import _lib
from .errors import MkInvalidArgumentError, MkInvalidUsageError, MkSystemError, error_class, error_string, raise_for

_registry_lock = threading.Lock()
_registry: dict[str, object] = {}
_names = itertools.count()

Timeout = Union[float, int, datetime.timedelta, None]

# Layout of the symmetric workspace the library allocates per rank at init (src/comm/workspace.rs):
# the signal and low-latency regions (CONTROL_BYTES there, which a Rust test checks this
# against), then the collectives' data region and an equal region for the fused ops.
_CONTROL_BYTES = 4 << 20
_MIN_DATA_BYTES = 64 << 10
_DEFAULT_WORKSPACE_BYTES = 256 << 20


def get_unique_id() -> bytes:
    """A new 128-byte unique id; starts the bootstrap root in this process (call it on one rank)."""
    lib = _lib.library()
    uid = _lib.mkUniqueId()
    raise_for(lib.mkGetUniqueId(ctypes.byref(uid)), "mkGetUniqueId")
    return ctypes.string_at(ctypes.addressof(uid), _lib.UNIQUE_ID_BYTES)


def lookup(name: str):
    """The communicator registered under `name` (what the torch.ops.mkernel ops are given).

    Reads without the lock: one dict read is atomic (under the GIL, and with a free-threaded
    build's per-dict locks); the lock only keeps register()'s check-and-insert whole. So
    torch.compile traces the lookup (Dynamo cannot enter a lock) and guards on the world
    size it reads, recompiling when another communicator takes the name.
    """
    comm = _registry.get(name)
    if comm is None:
        raise MkInvalidUsageError(
            f"mkernel: no communicator is registered under the name {name!r} (it was closed, aborted, "
            "or never created in this process)"
        )
    return comm


def register(comm) -> None:
    """Registers an object with `name`, `rank`, `world_size`, `device` and `torch_device` for lookup() by name
    (and, to launch, `handle()`)."""
    with _registry_lock:
        if comm.name in _registry:
            raise MkInvalidUsageError(f"mkernel: a communicator named {comm.name!r} already exists")
        _registry[comm.name] = comm


def unregister(name: str) -> None:
    with _registry_lock:
        _registry.pop(name, None)


def _milliseconds(what: str, value: Timeout) -> int | None:
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else float(value)
    ms = int(round(seconds * 1000))
    if not 0 < ms <= 2**31 - 1:
        raise MkInvalidArgumentError(f"mkernel.Communicator: {what} must be between 1 ms and 2^31-1 ms, got {value!r}")
    return ms


def _optional_int(what: str, value: int | None, low: int, high: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise MkInvalidArgumentError(f"mkernel.Communicator: {what} must be an int in [{low}, {high}], got {value!r}")
    return value


def _check_rank(rank, world_size) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise MkInvalidArgumentError(f"mkernel.Communicator: world_size must be a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise MkInvalidArgumentError(f"mkernel.Communicator: rank must be an int in [0, {world_size}), got {rank!r}")


def _workspace_allocation(workspace_bytes: int | None) -> int:
    """Bytes of device memory the library allocates for a communicator's symmetric workspace."""
    data = workspace_bytes
    if data is None:
        text = os.environ.get("MK_WORKSPACE_BYTES", "").strip()
        # The library reads a non-negative decimal integer and ignores anything else.
        data = int(text) if text.isdigit() else _DEFAULT_WORKSPACE_BYTES
    return _CONTROL_BYTES + 2 * max(data, _MIN_DATA_BYTES)


class Communicator:
    """One rank of an mkernel communicator, on one CUDA device.

    Args:
        group: torch.distributed process group to bootstrap over (None: the default group).
            Its rank 0 creates the unique id and broadcasts it to the group (gloo or nccl).
        device: CUDA device of this rank (int, "cuda:N" or torch.device); default: the
            current CUDA device.
        timeout: bound on every in-kernel wait for a peer (seconds or timedelta;
            MK_TIMEOUT_MS). A peer that does not arrive in time stops the kernel; the error
            surfaces as MkTimeoutError / MkRemoteError on the next call.
        workspace_bytes: symmetric workspace per rank (MK_WORKSPACE_BYTES); the fused ops'
            operands must fit in it (the error names the size needed).
        bootstrap_timeout: bound on each bootstrap step (MK_BOOTSTRAP_TIMEOUT_MS).
        max_ctas, comm_ctas, ranks_per_node: the other mkConfig_t fields (see mkernel.h).
        unique_id, rank, world_size: bootstrap without torch.distributed: the same 128-byte
            id (from mkernel.get_unique_id() on one rank) on every rank, and this rank.
        name: the name the torch.library ops use for it (default: "mkernel:<n>").

    Attributes: name, rank, world_size, device (the CUDA device index) and torch_device
    (that device as a torch.device, which the ops compare their tensors' devices with).

    Creation blocks until every rank has joined. Use it as a context manager, or call
    close(). abort() may be called from any thread (a watchdog): it stops the kernels and
    host waits of this communicator, and every later call raises MkInvalidUsageError.
    """

    def __init__(
        self,
        group=None,
        *,
        device=None,
        timeout: Timeout = None,
        workspace_bytes: int | None = None,
        bootstrap_timeout: Timeout = None,
        max_ctas: int | None = None,
        comm_ctas: int | None = None,
        ranks_per_node: int | None = None,
        unique_id: bytes | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        name: str | None = None,
    ):
        self._handle: _lib.mkComm_t | None = None
        self._lock = threading.Lock()
        self._state = "closed"
        self.name = name if name is not None else f"mkernel:{next(_names)}"
        if not isinstance(self.name, str) or not self.name:
            raise MkInvalidArgumentError(f"mkernel.Communicator: name must be a non-empty str, got {name!r}")
        with _registry_lock:
            if self.name in _registry:
                raise MkInvalidUsageError(f"mkernel.Communicator: a communicator named {self.name!r} already exists")
        config = self._build_config(timeout, workspace_bytes, bootstrap_timeout, max_ctas, comm_ctas, ranks_per_node)
        self._device_memory_bytes = _workspace_allocation(workspace_bytes)

        if unique_id is not None:
            if group is not None:
                raise MkInvalidArgumentError("mkernel.Communicator: give either group or unique_id, not both")
            if rank is None or world_size is None:
                raise MkInvalidArgumentError("mkernel.Communicator: unique_id needs rank and world_size")
            uid = bytes(unique_id)
            _check_rank(rank, world_size)
            if len(uid) != _lib.UNIQUE_ID_BYTES:
                raise MkInvalidArgumentError(
                    f"mkernel.Communicator: unique_id must be {_lib.UNIQUE_ID_BYTES} bytes, got {len(uid)}"
                )
        elif rank is not None or world_size is not None:
            raise MkInvalidArgumentError(
                "mkernel.Communicator: rank and world_size are taken from the group; give them only with unique_id"
            )
        if not torch.cuda.is_available():
            raise MkSystemError(
                "mkernel.Communicator: torch sees no CUDA device (torch.cuda.is_available() is False); "
                "mkernel's communicators need an NVIDIA GPU (sm_90)"
            )
        self.device = self._resolve_device(device)
        self.torch_device = torch.device("cuda", self.device)
        if unique_id is None:
            uid, rank, world_size = self._unique_id_from_group(group)
        self.rank = rank
        self.world_size = world_size

        c_uid = _lib.mkUniqueId()
        ctypes.memmove(ctypes.addressof(c_uid), uid, _lib.UNIQUE_ID_BYTES)
        handle = _lib.mkComm_t()
        lib = _lib.library()
        # The library creates the rank on the current CUDA device (as NCCL does).
        with torch.cuda.device(self.device):
            code = lib.mkCommInitRankConfig(ctypes.byref(handle), world_size, c_uid, rank, ctypes.byref(config))
        raise_for(code, "mkCommInitRankConfig")
        self._handle = handle
        self._state = "open"
        register(self)

    # --- construction helpers -------------------------------------------------------------

    @staticmethod
    def _resolve_device(device) -> int:
        if device is None:
            return torch.cuda.current_device()
        if isinstance(device, int) and not isinstance(device, bool):
            return device
        dev = torch.device(device)
        if dev.type != "cuda":
            raise MkInvalidArgumentError(f"mkernel.Communicator: device must be a CUDA device, got {device!r}")
        return dev.index if dev.index is not None else torch.cuda.current_device()

    @staticmethod
    def _build_config(timeout, workspace_bytes, bootstrap_timeout, max_ctas, comm_ctas, ranks_per_node):
        config = _lib.mkConfig_t()
        raise_for(_lib.library().mkConfigInit(ctypes.byref(config)), "mkConfigInit")
        fields = {
            "timeoutMs": _milliseconds("timeout", timeout),
            "bootstrapTimeoutMs": _milliseconds("bootstrap_timeout", bootstrap_timeout),
            "maxCtas": _optional_int("max_ctas", max_ctas, 1, 2**31 - 1),
            "commCtas": _optional_int("comm_ctas", comm_ctas, 1, 2**31 - 1),
            "ranksPerNode": _optional_int("ranks_per_node", ranks_per_node, 1, 2**31 - 1),
            "workspaceBytes": _optional_int("workspace_bytes", workspace_bytes, 1, 2**63 - 1),
        }
        for field, value in fields.items():
            if value is not None:
                setattr(config, field, value)
        return config

    def _unique_id_from_group(self, group):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise MkInvalidUsageError(
                "mkernel.Communicator: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group() first, or pass unique_id, rank and world_size"
            )
        if group is None:
            group = dist.group.WORLD
        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        on_gpu = "nccl" in backend and "gloo" not in backend
        buffer = torch.zeros(_lib.UNIQUE_ID_BYTES, dtype=torch.uint8, device=f"cuda:{self.device}" if on_gpu else "cpu")
        if rank == 0:
            buffer.copy_(torch.frombuffer(bytearray(get_unique_id()), dtype=torch.uint8))
        dist.broadcast(buffer, src=dist.get_global_rank(group, 0), group=group)
        return bytes(buffer.cpu().tolist()), rank, world_size

    # --- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"mkernel.Communicator(name={self.name!r}, rank={self.rank}, world_size={self.world_size}, "
            f"device=cuda:{self.device}, state={self._state})"
        )

    @property
    def closed(self) -> bool:
        return self._handle is None

    def _take_handle(self, state: str):
        with self._lock:
            handle, self._handle = self._handle, None
            if handle is not None:
                self._state = state
        if handle is not None:
            unregister(self.name)
        return handle

    def close(self) -> None:
        """Waits for the work queued on this communicator's device, then releases it (mkCommDestroy).

        Every rank closes its own communicator. Closing twice does nothing.
        """
        if self._handle is None:
            return
        torch.cuda.synchronize(self.device)
        handle = self._take_handle("closed")
        if handle is not None:
            raise_for(_lib.library().mkCommDestroy(handle), "mkCommDestroy")

    def abort(self) -> None:
        """Stops this communicator's kernels and host waits, and releases it (mkCommAbort).

        Safe from any thread, e.g. a watchdog that sees a step take too long: the blocked
        kernels stop, the stream drains, and every later call on this communicator raises
        MkInvalidUsageError. Aborting a closed communicator does nothing. Another thread may
        be inside an mkernel call on this communicator: that call returns an error, and the
        library frees the communicator only after it has left (docs/thread-safety.md).
        """
        handle = self._take_handle("aborted")
        if handle is not None:
            raise_for(_lib.library().mkCommAbort(handle), "mkCommAbort")

    # --- queries ----------------------------------------------------------------------------

    def handle(self) -> _lib.mkComm_t:
        """The mkComm_t, after checking that the communicator is open and has no async error."""
        handle = self._handle
        if handle is None:
            raise MkInvalidUsageError(f"mkernel: communicator {self.name!r} is {self._state}; create a new one")
        self.check_async_error(handle)
        return handle

    def check_async_error(self, handle=None) -> None:
        """Raises the error a kernel of this communicator hit asynchronously (mkCommGetAsyncError), if any.

        Once set, the communicator refuses new operations: abort it and create a new one.
        """
        if handle is None:
            handle = self._handle
            if handle is None:
                raise MkInvalidUsageError(f"mkernel: communicator {self.name!r} is {self._state}; create a new one")
        lib = _lib.library()
        state = _lib.mkResult_t(0)
        raise_for(lib.mkCommGetAsyncError(handle, ctypes.byref(state)), "mkCommGetAsyncError", handle)
        if state.value != _lib.SUCCESS:
            raw = lib.mkGetLastError(handle)
            detail = raw.decode("utf-8", "replace") if raw else ""
            text = f"mkernel: communicator {self.name!r} failed asynchronously: {error_string(state.value)}"
            if detail:
                text += f": {detail}"
            raise error_class(state.value)(text + " (abort it and create a new one)", state.value)

    @property
    def device_memory_bytes(self) -> int:
        """Device memory this communicator holds outside torch's allocator, in bytes.

        The C ABI has no query for it, so it is computed the way the library sizes its
        symmetric workspace: a 2 MiB signal region plus two data regions (collectives and
        fused ops) of the configured workspace bytes each (workspace_bytes, else
        MK_WORKSPACE_BYTES, else 256 MiB; at least 64 KiB). The driver rounds the
        allocation up to its granularity, so the true figure may be slightly larger.
        """
        return self._device_memory_bytes
