// Element-wise building blocks of the collectives (kernels/collectives.cu within a node,
// kernels/hier_collectives.cu across nodes): whole-CTA copies and reductions over up to
// MK_MAX_PEERS sources, 16-byte vectors when every pointer allows, element-wise otherwise.
// Reductions accumulate half/bfloat16 in float and round once on the store.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include "mk_kernel_abi.h"

#define MK_RED_SUM 0
#define MK_RED_PROD 1
#define MK_RED_MAX 2
#define MK_RED_MIN 3
#define MK_RED_AVG 4

// ---- element traits: what a reduction accumulates in ----
template <typename T> struct Traits {
  typedef T Acc;
  static __device__ __forceinline__ Acc load(T v) { return v; }
  static __device__ __forceinline__ T store(Acc a) { return a; }
};
template <> struct Traits<__half> {
  typedef float Acc;
  static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half store(float a) { return __float2half_rn(a); }
};
template <> struct Traits<__nv_bfloat16> {
  typedef float Acc;
  static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 store(float a) { return __float2bfloat16_rn(a); }
};

template <typename A> __device__ __forceinline__ A combine(A a, A b, int op) {
  switch (op) {
    case MK_RED_PROD: return (A)(a * b);
    case MK_RED_MAX: return a > b ? a : b;
    case MK_RED_MIN: return a < b ? a : b;
    default: return (A)(a + b);  // sum, avg
  }
}
template <typename A> __device__ __forceinline__ A finalize(A a, int op, int nranks) {
  return op == MK_RED_AVG ? (A)(a / (A)nranks) : a;
}

// ---- copies: 16-byte vectors when every pointer allows, element-wise otherwise ----
__device__ __forceinline__ uint4 load16(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

template <typename E>
__device__ __forceinline__ void copy_elems(char* dst, char* dst2, const char* src, uint64_t n, uint64_t tid, uint64_t nthreads) {
  const E* s = reinterpret_cast<const E*>(src);
  E* d = reinterpret_cast<E*>(dst);
  E* d2 = reinterpret_cast<E*>(dst2);
  for (uint64_t i = tid; i < n; i += nthreads) {
    E v = s[i];
    d[i] = v;
    if (dst2) d2[i] = v;
  }
}

// Copies `bytes` (a multiple of elem) from src to dst (and dst2 when non-NULL), spread over
// nthreads threads of which this is tid.
__device__ __forceinline__ void copy_range(char* dst, char* dst2, const char* src, uint64_t bytes, int elem, uint64_t tid,
                                           uint64_t nthreads) {
  uint64_t done = 0;
  bool vec = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
               (dst2 ? reinterpret_cast<uintptr_t>(dst2) : 0)) & 15) == 0;
  if (vec) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    uint4* d2 = reinterpret_cast<uint4*>(dst2);
    uint64_t nv = bytes / 16;
    const int U = 4;
    uint64_t i = tid;
    for (; i + (U - 1) * nthreads < nv; i += U * nthreads) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = load16(s + i + u * nthreads);
#pragma unroll
      for (int u = 0; u < U; ++u) d[i + u * nthreads] = v[u];
      if (dst2) {
#pragma unroll
        for (int u = 0; u < U; ++u) d2[i + u * nthreads] = v[u];
      }
    }
    for (; i < nv; i += nthreads) {
      uint4 v = load16(s + i);
      d[i] = v;
      if (dst2) d2[i] = v;
    }
    done = nv * 16;
  }
  if (done == bytes) return;
  dst += done;
  src += done;
  if (dst2) dst2 += done;
  uint64_t rest = bytes - done;
  switch (elem) {
    case 8: copy_elems<uint64_t>(dst, dst2, src, rest / 8, tid, nthreads); break;
    case 4: copy_elems<uint32_t>(dst, dst2, src, rest / 4, tid, nthreads); break;
    case 2: copy_elems<uint16_t>(dst, dst2, src, rest / 2, tid, nthreads); break;
    default: copy_elems<uint8_t>(dst, dst2, src, rest, tid, nthreads); break;
  }
}

__device__ __forceinline__ void cta_copy(char* dst, char* dst2, const char* src, uint64_t bytes, int elem) {
  copy_range(dst, dst2, src, bytes, elem, threadIdx.x, blockDim.x);
}

// dst[i] (and dst2[i]) = op over p < nsrc of src[p][i], for i < n, by the whole CTA.
template <typename T>
__device__ __forceinline__ void cta_reduce(T* dst, T* dst2, const char* const (&src)[MK_MAX_PEERS], int nsrc, uint64_t n, int op,
                                           int nranks) {
  typedef Traits<T> Tr;
  typedef typename Tr::Acc A;
  constexpr int V = 16 / sizeof(T);
  uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | (dst2 ? reinterpret_cast<uintptr_t>(dst2) : 0);
#pragma unroll
  for (int p = 0; p < MK_MAX_PEERS; ++p)
    if (p < nsrc) bits |= reinterpret_cast<uintptr_t>(src[p]);
  uint64_t done = 0;
  if ((bits & 15) == 0) {
    uint64_t nv = n / V;
    for (uint64_t i = threadIdx.x; i < nv; i += blockDim.x) {
      uint4 raw[MK_MAX_PEERS];
#pragma unroll
      for (int p = 0; p < MK_MAX_PEERS; ++p)
        if (p < nsrc) raw[p] = load16(src[p] + i * 16);
      A acc[V];
      const T* t0 = reinterpret_cast<const T*>(&raw[0]);
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] = Tr::load(t0[v]);
#pragma unroll
      for (int p = 1; p < MK_MAX_PEERS; ++p) {
        if (p < nsrc) {
          const T* t = reinterpret_cast<const T*>(&raw[p]);
#pragma unroll
          for (int v = 0; v < V; ++v) acc[v] = combine<A>(acc[v], Tr::load(t[v]), op);
        }
      }
      uint4 out;
      T* o = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int v = 0; v < V; ++v) o[v] = Tr::store(finalize<A>(acc[v], op, nranks));
      reinterpret_cast<uint4*>(dst)[i] = out;
      if (dst2) reinterpret_cast<uint4*>(dst2)[i] = out;
    }
    done = nv * V;
  }
  for (uint64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    A acc = Tr::load(__ldcg(reinterpret_cast<const T*>(src[0]) + i));
#pragma unroll
    for (int p = 1; p < MK_MAX_PEERS; ++p)
      if (p < nsrc) acc = combine<A>(acc, Tr::load(__ldcg(reinterpret_cast<const T*>(src[p]) + i)), op);
    T r = Tr::store(finalize<A>(acc, op, nranks));
    dst[i] = r;
    if (dst2) dst2[i] = r;
  }
}
