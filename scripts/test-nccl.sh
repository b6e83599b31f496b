#!/usr/bin/env bash
# Tests libmkernel-nccl (nccl/): fetches the reference nccl.h (NCCL 2.28.9, from the
# nvidia-nccl-cu13==2.28.9 wheel, headers only) into build/nccl-2.28.9/include, runs the
# crate's Rust tests (prototypes, exports and layouts against that header; unit tests), then
# C programs built against the real nccl.h with strict warnings and linked to the library:
# standalone error paths and group bookkeeping, and interpose mode over a stand-in NCCL
# (ctests/nccl/fake_nccl.c), found both by MK_NCCL_LIBRARY and under LD_PRELOAD; and a
# program that opens libnccl.so.2 by name through the installed alias. Ends with the GPU
# suite (ctests/nccl/gpu.sh), which says SKIPPED without a GPU.
#   scripts/test-nccl.sh           all of the above
#   scripts/test-nccl.sh --fetch   only fetch the header
set -euo pipefail
cd "$(dirname "$0")/.."
NCCL_VERSION=2.28.9
NCCL_INCLUDE=build/nccl-$NCCL_VERSION/include

if [ ! -f "$NCCL_INCLUDE/nccl.h" ]; then
  echo "== fetching nccl.h from nvidia-nccl-cu13==$NCCL_VERSION"
  tmp=$(mktemp -d)
  pip=python3; [ -x .venv-cuda/bin/python ] && pip=.venv-cuda/bin/python
  # The header is the same in every platform's wheel; name one so any host can fetch it.
  "$pip" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_18_x86_64 --python-version 3.12 --implementation cp \
    "nvidia-nccl-cu13==$NCCL_VERSION" -d "$tmp"
  mkdir -p "$NCCL_INCLUDE"
  python3 - "$tmp"/nvidia_nccl_cu13-*.whl "$NCCL_INCLUDE/nccl.h" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as w:
    data = w.read("nvidia/nccl/include/nccl.h")
open(sys.argv[2], "wb").write(data)
PY
  rm -rf "$tmp"
fi
grep -q "#define NCCL_VERSION_CODE 22809" "$NCCL_INCLUDE/nccl.h" || { echo "$NCCL_INCLUDE/nccl.h is not NCCL $NCCL_VERSION"; exit 1; }
[ "${1:-}" = "--fetch" ] && exit 0

export CARGO_TERM_COLOR=never
echo "== libmkernel-nccl: build and Rust tests (header prototypes, exports, layouts; units)"
cargo build --release -p mkernel-nccl
cargo test --release -p mkernel-nccl -- --test-threads=2

echo "== libmkernel-nccl: C programs against the real nccl.h"
CUDA_INCLUDE=${MK_CUDA_INCLUDE:-$(ls -d .venv-cuda/lib/python3*/site-packages/nvidia/cu13/include | head -1)}
BIN=build/nccl-tests
mkdir -p "$BIN"
# Installed as a user installs it, and found through pkg-config; programs load it by SONAME.
PREFIX=$PWD/build/nccl-prefix
make -s install-nccl PREFIX="$PREFIX"
export PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig
LIB=$(pkg-config --variable=libdir mkernel-nccl)
LINK=($(pkg-config --libs mkernel-nccl) -Wl,-rpath,"$LIB")
CFLAGS=(-std=c11 -Wall -Wextra -Wpedantic -Werror -g -isystem "$CUDA_INCLUDE" -isystem "$NCCL_INCLUDE")
cc "${CFLAGS[@]}" ctests/nccl/cpu_standalone.c -o "$BIN/cpu_standalone" "${LINK[@]}"
cc "${CFLAGS[@]}" -fPIC -shared ctests/nccl/fake_nccl.c -o "$BIN/libfakenccl.so"
# A program linked to "NCCL" alone (the stand-in), as PyTorch is linked to libnccl.so.2.
cc "${CFLAGS[@]}" ctests/nccl/cpu_interpose.c -o "$BIN/cpu_interpose" -L"$BIN" -lfakenccl -Wl,-rpath,"$PWD/$BIN"
# The same program linked to this library, finding the stand-in through MK_NCCL_LIBRARY.
cc "${CFLAGS[@]}" ctests/nccl/cpu_interpose.c -o "$BIN/cpu_interpose_linked" "${LINK[@]}"

expect_line() {  # FILE PATTERN: the log must hold a line matching PATTERN
  grep -q -- "$2" "$1" || { echo "FAILED: no line matching '$2' in:"; cat "$1"; exit 1; }
}
log=$BIN/log.txt
# No NCCL anywhere (the CI machine): standalone, reported at INFO.
env -u MK_NCCL_MODE -u MK_NCCL_LIBRARY MK_DEBUG=INFO "$BIN/cpu_standalone" 2>"$log"
expect_line "$log" "libmkernel-nccl: standalone mode on mkernel alone"
MK_NCCL_MODE=standalone "$BIN/cpu_standalone"
# Interpose found by RTLD_NEXT: the program links the stand-in, this library is preloaded.
MK_DEBUG=INFO LD_PRELOAD="$LIB/libmkernel-nccl.so.2" "$BIN/cpu_interpose" 2>"$log"
expect_line "$log" "interpose mode over .*libfakenccl.so (NCCL 2.27.7, found by the loader's search order"
expect_line "$log" "destroyed rank 0 of 1; calls on mkernel: none; on NCCL: AllReduce 1, Broadcast 2, Send 1, Recv 1"
# Interpose found by MK_NCCL_LIBRARY.
MK_DEBUG=INFO MK_NCCL_LIBRARY="$PWD/$BIN/libfakenccl.so" "$BIN/cpu_interpose_linked" 2>"$log"
expect_line "$log" "found by MK_NCCL_LIBRARY"
# Forced interpose with no NCCL is an error at every call, not a silent standalone.
if MK_NCCL_MODE=interpose "$BIN/cpu_standalone" >"$log" 2>&1; then echo "FAILED: MK_NCCL_MODE=interpose ran without an NCCL"; exit 1; fi
expect_line "$log" "MK_NCCL_MODE=interpose but no real NCCL was found"
# A program that opens NCCL by name (vLLM's pynccl) under the preload, no real NCCL installed:
# the installed alias lib/mkernel-nccl/libnccl.so.2 gives it the name (docs/nccl.md).
version=$(env -u MK_NCCL_MODE -u MK_NCCL_LIBRARY LD_LIBRARY_PATH="$LIB/mkernel-nccl" \
  LD_PRELOAD="$LIB/libmkernel-nccl.so.2" MK_DEBUG=INFO python3 -c \
  'import ctypes; v = ctypes.c_int(); ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(v)); print(v.value)' 2>"$log")
[ "$version" = 22809 ] || { echo "FAILED: ncclGetVersion through dlopen(\"libnccl.so.2\") gave '$version'"; cat "$log"; exit 1; }
expect_line "$log" "libmkernel-nccl: standalone mode on mkernel alone"
echo "libmkernel-nccl C programs: 5 passed, 0 failed"

echo "== libmkernel-nccl: GPU suite (SKIPPED without a GPU)"
rc=0; ctests/nccl/gpu.sh || rc=$?
[ "$rc" = 0 ] || [ "$rc" = 77 ] || exit "$rc"
