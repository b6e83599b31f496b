#!/usr/bin/env bash
# Installs what building and testing mkernel needs on a fresh Debian/Ubuntu machine:
# system packages (when missing and we can), and the pinned CUDA compiler wheels into
# .venv-cuda (where build.rs looks for nvcc). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cc >/dev/null || need_apt+=(build-essential)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
command -v readelf >/dev/null || need_apt+=(binutils)
command -v make >/dev/null || need_apt+=(make)
command -v python3 >/dev/null || need_apt+=(python3 python3-venv)
# scripts/test-examples.sh: the CMake package, the Go binding and the examples.
command -v cmake >/dev/null || need_apt+=(cmake)
command -v go >/dev/null || need_apt+=(golang-go)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
# rdma-core's headers: tests/rdma_abi.rs checks the transport's verbs declarations against them.
pkg-config --exists libibverbs 2>/dev/null || need_apt+=(libibverbs-dev)
if ((${#need_apt[@]})); then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

if [ ! -x .venv-cuda/bin/pip ]; then
  python3 -m venv .venv-cuda
fi
if ! cmp -s scripts/cuda-wheels.txt .venv-cuda/.installed 2>/dev/null; then
  .venv-cuda/bin/pip install -q --disable-pip-version-check -r scripts/cuda-wheels.txt
  cp scripts/cuda-wheels.txt .venv-cuda/.installed
fi
nvcc=$(ls .venv-cuda/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)
echo "setup: nvcc at $nvcc ($("$nvcc" --version | tail -1))"
