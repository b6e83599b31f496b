#!/usr/bin/env bash
# Prints the SM count of CUDA device 0 (the first visible one), as the driver reports it
# (cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT), through python3's ctypes:
# nvidia-smi has no such field). Where it cannot be read (no python3, no driver, no GPU) it
# prints 132, the SM count of an H100/H200 SXM, the GPUs the kernels are built for.
n=$(python3 -c '
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
d, n = ctypes.c_int(), ctypes.c_int()
ok = cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(d), 0) == 0 and cu.cuDeviceGetAttribute(ctypes.byref(n), 16, d) == 0
print(n.value if ok else "")' 2>/dev/null) || true
case "$n" in ''|*[!0-9]*|0) echo 132 ;; *) echo "$n" ;; esac
