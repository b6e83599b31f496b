"""The package imports and loads its library on a machine without a GPU."""

import ctypes
import os
import re
import subprocess
import sys

import pytest
import torch

import mkernel
from mkernel import _lib

from header import HEADER, header_text


def test_import_needs_no_gpu():
    # A fresh interpreter, so nothing earlier in the session has loaded the library or CUDA.
    # Loading libmkernel.so (a call that needs no GPU) must not load the CUDA driver. Importing
    # torch may already have loaded it (torch 2.11 does where a driver is installed), so the
    # driver's presence is compared before and after the load.
    code = (
        "import mkernel, torch; driver = lambda: 'libcuda.so' in open('/proc/self/maps').read(); "
        "before = driver(); version = mkernel.library_version(); "
        "print(mkernel.__version__, version > 0, before, driver(), 'libmkernel.so' in open('/proc/self/maps').read())"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert out[:2] == [mkernel.__version__, "True"] and out[4] == "True", out
    assert out[3] == out[2], f"loading libmkernel.so loaded the CUDA driver: {out}"


def test_import_prints_no_warning():
    # With every default warning shown: torch warns on import when NumPy (a requirement of
    # the wheel) is missing, and a user sees that as mkernel's.
    run = subprocess.run(
        [sys.executable, "-W", "default", "-c", "import mkernel"], check=True, capture_output=True, text=True
    )
    assert run.stderr == "", run.stderr


def test_bundled_library_loads_and_reports_the_header_version():
    text = header_text()
    major, minor, patch = (
        int(re.search(rf"#define MK_{part} (\d+)", text).group(1)) for part in ("MAJOR", "MINOR", "PATCH")
    )
    assert mkernel.library_version() == major * 10000 + minor * 100 + patch
    assert mkernel.__version__ == f"{major}.{minor}.{patch}"


def test_wheel_bundles_the_library_and_the_header():
    if os.environ.get(_lib.LIBRARY_ENV):
        pytest.skip(f"{_lib.LIBRARY_ENV} overrides the bundled library")
    assert _lib.bundled_library_path().is_file()
    assert _lib.bundled_header_path().read_text() == HEADER.read_text()


def test_config_comes_from_mkConfigInit():
    lib = _lib.library()
    config = _lib.mkConfig_t()
    assert lib.mkConfigInit(ctypes.byref(config)) == _lib.SUCCESS
    text = header_text()
    assert config.size == ctypes.sizeof(_lib.mkConfig_t)
    assert config.magic == int(re.search(r"#define MK_CONFIG_MAGIC (0x[0-9a-fA-F]+)u", text).group(1), 16)
    assert config.timeoutMs == -(2**31)  # MK_CONFIG_UNDEF_INT = INT_MIN
    assert config.workspaceBytes == -1


def test_communicator_without_gpu_raises_system_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(mkernel.MkSystemError, match="no CUDA device"):
        mkernel.Communicator(unique_id=bytes(128), rank=0, world_size=1)


def test_library_error_carries_the_library_message():
    """A failing C call raises the subclass for its code, with mkGetLastError's detail."""
    from mkernel.errors import raise_for

    lib = _lib.library()
    with pytest.raises(mkernel.MkInvalidArgumentError, match=r"mkCommDestroy failed: .*comm is NULL"):
        raise_for(lib.mkCommDestroy(None), "mkCommDestroy")
    if torch.cuda.is_available():
        return
    uid = _lib.mkUniqueId()
    assert lib.mkGetUniqueId(ctypes.byref(uid)) == _lib.SUCCESS
    handle = _lib.mkComm_t()
    code = lib.mkCommInitRank(ctypes.byref(handle), 1, uid, 0)
    with pytest.raises(mkernel.MkSystemError, match=r"libcuda"):
        raise_for(code, "mkCommInitRank")
    assert not handle


def test_get_unique_id_is_128_bytes_and_fresh():
    a, b = mkernel.get_unique_id(), mkernel.get_unique_id()
    assert len(a) == len(b) == 128
    assert a != b


def test_error_classes_match_result_codes():
    from mkernel.errors import error_class

    text = header_text()
    codes = {name: int(value) for name, value in re.findall(r"\bmk(\w+) = (\d+),", text)}
    expected = {
        "UnhandledCudaError": mkernel.MkCudaError,
        "SystemError": mkernel.MkSystemError,
        "InternalError": mkernel.MkInternalError,
        "InvalidArgument": mkernel.MkInvalidArgumentError,
        "InvalidUsage": mkernel.MkInvalidUsageError,
        "RemoteError": mkernel.MkRemoteError,
        "InProgress": mkernel.MkInProgressError,
        "Timeout": mkernel.MkTimeoutError,
    }
    for name, cls in expected.items():
        assert error_class(codes[name]) is cls, name
        assert issubclass(cls, mkernel.MkError)
    assert error_class(12345) is mkernel.MkError
