"""Builds stand-in CUDA libraries so that PyPI's Linux torch wheel imports without its CUDA wheels.

PyPI's torch for Linux x86_64 is the CUDA build: its libraries link against libcudart,
cuBLAS, cuDNN, NCCL, ... which come as several GB of nvidia-* wheels. The CPU tests of
the mkernel package need torch's CPU side only. This script installs nothing from
NVIDIA: it reads which CUDA libraries torch's libraries need and which symbols they
import from them, and compiles one small library per missing soname that defines those
symbols (with their symbol versions). Every stand-in function returns an error code
(cudaGetDeviceCount reports no device), so torch.cuda.is_available() is False and any
CUDA call fails instead of running. Only for tests on machines without a GPU.

Usage: python cuda_stubs.py TORCH_LIB_DIR OUT_DIR   (then run with LD_LIBRARY_PATH=OUT_DIR)
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

# Functions whose result torch reads on a CPU-only path: they report "no device" instead of the generic error.
SPECIAL = {
    "cudaGetDeviceCount": "int cudaGetDeviceCount(int *count) { if (count) *count = 0; return 100; }",
    "cudaGetErrorString": 'const char *cudaGetErrorString(int e) { (void)e; return "no CUDA runtime (test stand-in)"; }',
    "cudaGetErrorName": 'const char *cudaGetErrorName(int e) { (void)e; return "cudaErrorNoDevice"; }',
    "cudaGetLastError": "int cudaGetLastError(void) { return 0; }",
    "cudaPeekAtLastError": "int cudaPeekAtLastError(void) { return 0; }",
    "cudaDriverGetVersion": "int cudaDriverGetVersion(int *v) { if (v) *v = 0; return 0; }",
}
# The driver stays absent: code that loads it lazily (torch's NVRTC helper, libmkernel) must see
# "no driver", not a stand-in.
NOT_STUBBED = {"libcuda.so.1"}
GENERIC_ERROR = 999  # cudaErrorUnknown; also a failure status for cuBLAS, cuDNN, NCCL, ...


def run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def needed(lib: Path) -> list[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", run("readelf", "-dW", str(lib)))


def resolved_paths(lib: Path) -> dict[str, str | None]:
    out = {}
    for line in run("ldd", str(lib)).splitlines():
        m = re.match(r"\s*(\S+) => (not found|(\S+))", line)
        if m:
            out[m.group(1)] = m.group(3)
    return out


@functools.lru_cache(maxsize=None)
def dyn_symbols(lib: Path) -> list[tuple[str, str | None, bool, str, str]]:
    """(name, version or None, defined, binding, type) for each dynamic symbol of `lib` (read once)."""
    return list(_dyn_symbols(lib))


def _dyn_symbols(lib: Path):
    for line in run("readelf", "--dyn-syms", "-W", str(lib)).splitlines():
        parts = line.split()
        if len(parts) < 8 or not parts[0].rstrip(":").isdigit():
            continue
        typ, bind, ndx, name = parts[3], parts[4], parts[6], parts[7]
        version = None
        if "@" in name:
            name, _, version = name.partition("@")
            version = version.lstrip("@")
        yield name, version, ndx != "UND", bind, typ


def version_files(lib: Path) -> dict[str, str]:
    """Version name -> the soname that must define it (from the .gnu.version_r section)."""
    out, current = {}, None
    for line in run("readelf", "-V", "-W", str(lib)).splitlines():
        m = re.search(r"File: (\S+)", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"Name: (\S+)", line)
        if m and current and "Flags" in line:
            out[m.group(1)] = current
    return out


def main(torch_lib: Path, out_dir: Path) -> None:
    libs = sorted(p for p in torch_lib.glob("*.so*") if p.is_file())
    libs += sorted(torch_lib.parent.glob("_C*.so"))
    missing: set[str] = set()
    found: set[str] = set()
    for lib in libs:
        for soname, path in resolved_paths(lib).items():
            if path:
                found.add(path)
            elif soname not in NOT_STUBBED:
                missing.add(soname)
    if not missing:
        print("cuda_stubs: every library torch needs is present; nothing to build")
        return

    defined: set[str] = set()
    for path in sorted({Path(p).resolve() for p in found} | {p.resolve() for p in libs}):
        defined.update(name for name, _v, is_def, _b, _t in dyn_symbols(path) if is_def)

    # soname -> version -> symbols; objects are defined as data, everything else as functions.
    wanted: dict[str, dict[str | None, set[str]]] = {s: defaultdict(set) for s in missing}
    objects: set[str] = set()
    # An unversioned import (NCCL's, cuDNN's) does not say which library defines it; the loader
    # accepts a definition from any library in the global scope, so one stand-in takes them all.
    fallback = sorted(missing)[0]
    for lib in libs:
        owners = version_files(lib)
        direct = set(needed(lib))
        for name, version, is_def, bind, typ in dyn_symbols(lib.resolve()):
            if is_def or bind == "WEAK" or not name:
                continue
            owner = owners.get(version) if version else None
            if owner in missing:
                wanted[owner][version].add(name)
            elif owner is None and name not in defined and direct & missing:
                wanted[fallback][None].add(name)
            else:
                continue
            if typ == "OBJECT":
                objects.add(name)

    out_dir.mkdir(parents=True, exist_ok=True)
    for soname, by_version in sorted(wanted.items()):
        symbols = sorted(set().union(*by_version.values())) if by_version else []
        c_lines = ["/* Test stand-in generated by cuda_stubs.py: every function fails. */"]
        for name in symbols:
            if name in SPECIAL:
                c_lines.append(SPECIAL[name])
            elif name in objects:
                c_lines.append(f"char {name}[256];")
            else:
                c_lines.append(f"long {name}(void) {{ return {GENERIC_ERROR}; }}")
        stem = out_dir / soname
        Path(f"{stem}.c").write_text("\n".join(c_lines) + "\n")
        versions = [v for v in by_version if v]
        cmd = ["cc", "-shared", "-fPIC", "-O0", "-w", "-o", str(stem), f"{stem}.c", f"-Wl,-soname,{soname}"]
        if versions:
            unversioned = sorted(by_version.get(None, ()))
            blocks = []
            for i, v in enumerate(sorted(versions)):
                names = sorted(by_version[v]) + (unversioned if i == 0 else [])
                blocks.append(f"{v} {{ global: {' '.join(n + ';' for n in names)} }};")
            Path(f"{stem}.map").write_text("\n".join(blocks) + "\n")
            cmd.append(f"-Wl,--version-script={stem}.map")
        subprocess.run(cmd, check=True)
        print(f"cuda_stubs: {soname}: {len(symbols)} symbols")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
