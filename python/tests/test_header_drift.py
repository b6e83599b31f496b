"""The ctypes declarations in mkernel._lib match include/mkernel.h.

The header's prototypes, enums and structs are parsed here and compared with the
Python side: the set of function names, each argument count, each argument and result
type (through this file's own table of C type -> ctypes type), the struct layouts and
the enum values.
"""

from __future__ import annotations

import ctypes
import re

import pytest

from mkernel import _lib

from header import header_text

# C type (as spelled in the header, whitespace-normalised) -> the ctypes type it must be declared as.
C_TO_CTYPES = {
    "mkResult_t": ctypes.c_int,
    "mkDataType_t": ctypes.c_int,
    "mkRedOp_t": ctypes.c_int,
    "mkScaleMode_t": ctypes.c_int,
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "size_t": ctypes.c_size_t,
    "float": ctypes.c_float,
    "mkComm_t": _lib.mkComm_t,
    "mkStream_t": _lib.mkStream_t,
    "mkUniqueId": _lib.mkUniqueId,
    "const void *": ctypes.c_void_p,
    "void *": ctypes.c_void_p,
    "const char *": ctypes.c_char_p,
    "const int32_t *": ctypes.POINTER(ctypes.c_int32),
    "int32_t *": ctypes.POINTER(ctypes.c_int32),
    "const float *": ctypes.POINTER(ctypes.c_float),
    "float *": ctypes.POINTER(ctypes.c_float),
    "int *": ctypes.POINTER(ctypes.c_int),
    "const int *": ctypes.POINTER(ctypes.c_int),
    "size_t *": ctypes.POINTER(ctypes.c_size_t),
    "mkResult_t *": ctypes.POINTER(ctypes.c_int),
    "mkComm_t *": ctypes.POINTER(_lib.mkComm_t),
    "mkUniqueId *": ctypes.POINTER(_lib.mkUniqueId),
    "mkConfig_t *": ctypes.POINTER(_lib.mkConfig_t),
    "const mkConfig_t *": ctypes.POINTER(_lib.mkConfig_t),
    "mkConfig_t": _lib.mkConfig_t,
    "mkMoeOptions_t *": ctypes.POINTER(_lib.mkMoeOptions_t),
    "const mkMoeOptions_t *": ctypes.POINTER(_lib.mkMoeOptions_t),
}
STRUCT_FIELD_TYPES = {
    "size_t": ctypes.c_size_t,
    "unsigned int": ctypes.c_uint,
    "int": ctypes.c_int,
    "long long": ctypes.c_longlong,
}


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _normalise(c_type: str) -> str:
    c_type = " ".join(c_type.replace("*", " * ").split())
    return c_type.replace("* *", "**").replace(" *", " *").strip()


def parse_prototypes(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (result type, [argument types]) for every function declared in the header."""
    body = _strip_comments(text)
    out = {}
    for m in re.finditer(r"([A-Za-z_][\w \t\*]*?)\b(mk\w+)\s*\(([^;{}]*?)\)\s*;", body, flags=re.S):
        result, name, params = m.group(1), m.group(2), m.group(3)
        args = []
        for param in params.split(","):
            param = " ".join(param.split())
            if not param or param == "void":
                continue
            decl = re.match(r"(.*?)\s*\b(\w+)$", param)
            args.append(_normalise(decl.group(1)))
        out[name] = (_normalise(result), args)
    return out


def _ctype_name(t) -> str:
    return getattr(t, "__name__", repr(t))


def drift(text: str, declarations: dict) -> list[str]:
    """Every difference between the header's prototypes and `declarations`, as readable lines."""
    problems = []
    prototypes = parse_prototypes(text)
    for name in sorted(set(prototypes) - set(declarations)):
        problems.append(f"{name}: in the header, not declared in mkernel._lib")
    for name in sorted(set(declarations) - set(prototypes)):
        problems.append(f"{name}: declared in mkernel._lib, not in the header")
    for name in sorted(set(prototypes) & set(declarations)):
        c_result, c_args = prototypes[name]
        py_result, py_args = declarations[name]
        if len(c_args) != len(py_args):
            problems.append(f"{name}: {len(c_args)} arguments in the header, {len(py_args)} in mkernel._lib")
            continue
        for i, (c_type, py_type) in enumerate([(c_result, py_result), *zip(c_args, py_args)]):
            what = "result" if i == 0 else f"argument {i}"
            expected = C_TO_CTYPES.get(c_type)
            if expected is None:
                problems.append(
                    f"{name}: {what} has C type {c_type!r}, which this test cannot map (extend C_TO_CTYPES)"
                )
            elif expected is not py_type:
                problems.append(
                    f"{name}: {what} is {c_type!r} in the header (ctypes {_ctype_name(expected)}), "
                    f"declared as {_ctype_name(py_type)}"
                )
    return problems


def test_header_has_prototypes():
    prototypes = parse_prototypes(header_text())
    assert len(prototypes) >= 25
    assert prototypes["mkAllGather"] == (
        "mkResult_t",
        ["const void *", "void *", "size_t", "mkDataType_t", "mkComm_t", "mkStream_t"],
    )


def test_declarations_match_the_header():
    assert drift(header_text(), _lib.DECLARATIONS) == []


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            lambda t: t.replace("mkResult_t mkCommCount(mkComm_t comm, int *count);", ""),
            "mkCommCount: declared in mkernel._lib, not in the header",
        ),
        (
            lambda t: t.replace(
                "mkResult_t mkCommDestroy(mkComm_t comm);", "mkResult_t mkCommDestroy(mkComm_t comm, int flags);"
            ),
            "mkCommDestroy: 2 arguments",
        ),
        (
            lambda t: t.replace(
                "mkResult_t mkCommDestroy(mkComm_t comm);",
                "mkResult_t mkCommDestroy(mkComm_t comm);\nmkResult_t mkCommSplit(mkComm_t comm, int color);",
            ),
            "mkCommSplit: in the header",
        ),
        (lambda t: t.replace("size_t sendcount,", "int sendcount,"), "mkAllGather: argument 3 is 'int'"),
        (
            lambda t: t.replace("const char *mkGetErrorString", "int mkGetErrorString"),
            "mkGetErrorString: result is 'int'",
        ),
    ],
)
def test_drift_is_detected(edit, expected):
    """The comparison itself finds each kind of change (so a passing drift test means something)."""
    text = header_text()
    edited = edit(text)
    assert edited != text, "the edit did not apply: update this test's header snippets"
    problems = drift(edited, _lib.DECLARATIONS)
    assert any(expected in p for p in problems), problems


def test_library_exports_every_declaration():
    lib = _lib.library()
    for name in _lib.DECLARATIONS:
        assert hasattr(lib, name), name


@pytest.mark.parametrize("name", ["mkConfig_t", "mkMoeOptions_t"])
def test_versioned_structs_match_the_header(name):
    body = _strip_comments(header_text())
    struct = re.search(r"typedef struct \{([^{}]*?)\}\s*" + name + ";", body, flags=re.S).group(1)
    fields = [
        (m.group(2), STRUCT_FIELD_TYPES[" ".join(m.group(1).split())])
        for m in re.finditer(r"([\w ]+?)\s+(\w+);", struct)
    ]
    assert fields == list(getattr(_lib, name)._fields_)


def test_unique_id_matches_the_header():
    body = _strip_comments(header_text())
    size = int(re.search(r"typedef struct \{\s*char internal\[(\d+)\];\s*\}\s*mkUniqueId;", body).group(1))
    assert ctypes.sizeof(_lib.mkUniqueId) == size == _lib.UNIQUE_ID_BYTES


def _enum(body: str, name: str) -> dict[str, int]:
    block = re.search(r"typedef enum \{([^{}]*)\}\s*" + name + ";", body).group(1)
    return {k: int(v) for k, v in re.findall(r"(\w+) = (\d+)", block)}


def test_enum_values_match_the_header():
    body = _strip_comments(header_text())
    dtypes = _enum(body, "mkDataType_t")
    python_names = {
        "int8": "mkInt8",
        "uint8": "mkUint8",
        "int32": "mkInt32",
        "uint32": "mkUint32",
        "int64": "mkInt64",
        "uint64": "mkUint64",
        "float16": "mkFloat16",
        "float32": "mkFloat32",
        "float64": "mkFloat64",
        "bfloat16": "mkBfloat16",
        "float8e4m3": "mkFloat8e4m3",
        "float8e5m2": "mkFloat8e5m2",
    }
    assert {python_names[k]: v for k, v in _lib.DTYPE_CODES.items()} == dtypes
    modes = _enum(body, "mkScaleMode_t")
    assert {"mkScale" + k.capitalize(): v for k, v in _lib.SCALE_MODE_CODES.items()} == modes
    ops = _enum(body, "mkRedOp_t")
    assert {"mk" + k.capitalize(): v for k, v in _lib.REDOP_CODES.items()} == ops
    results = _enum(body, "mkResult_t")
    assert results["mkSuccess"] == _lib.SUCCESS
    assert results["mkInvalidArgument"] == _lib.INVALID_ARGUMENT
    assert results["mkTimeout"] == _lib.TIMEOUT
    assert results["mkRemoteError"] == _lib.REMOTE_ERROR
