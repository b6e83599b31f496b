// Utility kernels: fill buffers with reproducible pseudo-random data for tests and
// benchmarks (fresh, never-zero inputs without a host round trip). Tool kernels: compiled
// into util_tools.fatbin only, never into the library.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include "mk_kernel_abi.h"
#include "mkernel.h"

// SplitMix64: a cheap, well-mixed hash of (seed, index), so every element is independent
// of how the grid is laid out.
__device__ __forceinline__ uint64_t mk_splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ float mk_uniform(uint64_t seed, uint64_t i) {
  // 24 random bits -> [-1, 1)
  uint32_t r = (uint32_t)(mk_splitmix64(seed * 0x632be59bd9b4e019ull + i) >> 40);
  return (float)r * (2.0f / 16777216.0f) - 1.0f;
}

#ifdef MK_TOOL_KERNELS
extern "C" __global__ void mk_fill_random(FillRandomParams p) {
  uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.count; i += stride) {
    float v = mk_uniform(p.seed, i) * p.scale;
    switch (p.dtype) {
      case mkFloat16: reinterpret_cast<__half*>(p.data)[i] = __float2half_rn(v); break;
      case mkBfloat16: reinterpret_cast<__nv_bfloat16*>(p.data)[i] = __float2bfloat16_rn(v); break;
      case mkFloat32: reinterpret_cast<float*>(p.data)[i] = v; break;
      case mkFloat64: reinterpret_cast<double*>(p.data)[i] = (double)v; break;
      case mkInt32: reinterpret_cast<int32_t*>(p.data)[i] = (int32_t)(v * 1000.0f); break;
      default: break;
    }
  }
}
#endif  // MK_TOOL_KERNELS
