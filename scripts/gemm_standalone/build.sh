#!/usr/bin/env bash
# Builds the standalone GEMM check library (here, with the pinned nvcc; runs on the GPU box).
set -euo pipefail
cd "$(dirname "$0")/../.."
NV=${NVCC_ROOT:-.venv-cuda/lib/python3.11/site-packages/nvidia/cu13}
mkdir -p build/gemm_standalone
"$NV/bin/nvcc" -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Xptxas -v -I"$NV/include" \
  -shared -Xcompiler -fPIC -cudart static -L"$NV/lib" \
  -o build/gemm_standalone/libmkgemm_standalone.so scripts/gemm_standalone/launcher.cu \
  2> build/gemm_standalone/ptxas.txt
grep -E "spill|registers" build/gemm_standalone/ptxas.txt | sort | uniq -c
