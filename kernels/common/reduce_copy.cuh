// Element-wise building blocks of the collectives (kernels/collectives.cu within a node,
// kernels/hier_collectives.cu across nodes): whole-CTA copies and reductions over up to
// MK_MAX_PEERS sources, 16-byte vectors when every pointer allows, element-wise otherwise.
// Reductions accumulate half, bfloat16 and both fp8 formats in float and round once on the
// store (fp8 with saturation to the largest finite value, NaN kept: docs/decisions/0075).
//
// The vector loops have two ways to keep loads in flight. In registers a thread holds 1-4
// (copy) or nsrc (reduce) 16-byte vectors at a time: 8-64 KiB per CTA of 512 threads, and
// at ~1 us loaded latency (HBM and NVLink with several ranks on the GPUs) a CTA moves only
// 15-24 GB/s. Staged (a caller passes stage_bytes, the dynamic shared memory its kernel was
// launched with), cp.async copies hold no registers while in flight, so half of
// stage_bytes is in flight per CTA while the other half is consumed (double buffering).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include "mk_kernel_abi.h"
#include "mkernel.h"
#include "cp_async.cuh"

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

// fp8 is widened exactly (every e4m3 and e5m2 value is a float) and rounded once, to
// nearest even with saturation: a result past the largest finite value (448 for e4m3,
// 57344 for e5m2; an infinite one too) becomes that value with its sign, NaN stays NaN.
// That is the conversion NCCL's fp8 reductions make (cuda_fp8.h's __NV_SATFINITE).
template <> struct Traits<__nv_fp8_e4m3> {
  typedef float Acc;
  static __device__ __forceinline__ float load(__nv_fp8_e4m3 v) { return static_cast<float>(v); }
  static __device__ __forceinline__ __nv_fp8_e4m3 store(float a) {
    __nv_fp8_e4m3 r;
    r.__x = __nv_cvt_float_to_fp8(a, __NV_SATFINITE, __NV_E4M3);
    return r;
  }
};
template <> struct Traits<__nv_fp8_e5m2> {
  typedef float Acc;
  static __device__ __forceinline__ float load(__nv_fp8_e5m2 v) { return static_cast<float>(v); }
  static __device__ __forceinline__ __nv_fp8_e5m2 store(float a) {
    __nv_fp8_e5m2 r;
    r.__x = __nv_cvt_float_to_fp8(a, __NV_SATFINITE, __NV_E5M2);
    return r;
  }
};

// One element loaded with __ldcg (L2 only: the peers' slots are read once); fp8 has no
// overload of its own, so its byte is loaded.
template <typename T> __device__ __forceinline__ T ldcg_element(const T* p) { return __ldcg(p); }
template <> __device__ __forceinline__ __nv_fp8_e4m3 ldcg_element(const __nv_fp8_e4m3* p) {
  __nv_fp8_e4m3 r;
  r.__x = __ldcg(reinterpret_cast<const unsigned char*>(p));
  return r;
}
template <> __device__ __forceinline__ __nv_fp8_e5m2 ldcg_element(const __nv_fp8_e5m2* p) {
  __nv_fp8_e5m2 r;
  r.__x = __ldcg(reinterpret_cast<const unsigned char*>(p));
  return r;
}

// max and min: integers compare; floating accumulators take fmax/fmin, which return the
// other operand when one is NaN (NaN only when every source is NaN), whatever the order
// of the sources -- NCCL's rule for its floating types.
template <typename A> __device__ __forceinline__ A max_of(A a, A b) { return a > b ? a : b; }
template <typename A> __device__ __forceinline__ A min_of(A a, A b) { return a < b ? a : b; }
template <> __device__ __forceinline__ float max_of(float a, float b) { return fmaxf(a, b); }
template <> __device__ __forceinline__ float min_of(float a, float b) { return fminf(a, b); }
template <> __device__ __forceinline__ double max_of(double a, double b) { return fmax(a, b); }
template <> __device__ __forceinline__ double min_of(double a, double b) { return fmin(a, b); }

template <typename A> __device__ __forceinline__ A combine(A a, A b, int op) {
  switch (op) {
    case mkProd: return (A)(a * b);
    case mkMax: return max_of(a, b);
    case mkMin: return min_of(a, b);
    default: return (A)(a + b);  // sum, avg
  }
}
template <typename A> __device__ __forceinline__ A finalize(A a, int op, int nranks) {
  return op == mkAvg ? (A)(a / (A)nranks) : a;
}

// ---- copies: 16-byte vectors when every pointer allows, element-wise otherwise ----
__device__ __forceinline__ uint4 load16(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

// ---- staging: each thread cp.asyncs only its own vectors into its own slots ----
// Slot j of thread t is 16 bytes at (j * blockDim.x + t) * 16 of the dynamic shared memory:
// consecutive threads use consecutive 16 B (no bank conflicts), and a slot belongs to the
// same thread whatever the layout of j, so cp.async.wait_group alone makes the data
// visible to its reader (no barrier between the copy and the read, nor between calls).
// j = (buffer * nsrc + source) * U + u for U vectors per source per batch. A thread walks
// its own vectors i = first, first + stride, ... in batches of U; batch b+1 is issued
// (one commit group, empty past the end) before waiting for batch b, so "all but the
// newest group" is always batch b. The kernels sit at their register cap: these loops
// keep only a few scalars live (no batch counter, no per-source addresses).
__device__ __forceinline__ uint4* stage_slots() {
  extern __shared__ __align__(16) uint4 mk_stage_smem[];
  return mk_stage_smem + threadIdx.x;
}

// Vectors per source per batch when stage_bytes hold two batches of nsrc sources for the
// whole CTA; 0 when not even one vector each fits (the caller keeps the register loop).
__device__ __forceinline__ uint32_t stage_vectors(uint32_t stage_bytes, int nsrc) {
  return stage_bytes / 2 / (blockDim.x * 16u * (uint32_t)nsrc);
}

// One batch of one source: vectors i, i + stride, ... (U of them, those below nv) into
// slots buf[0], buf[blockDim.x], ...
__device__ __forceinline__ void stage_issue(uint4* buf, const uint4* s, uint64_t i, uint64_t nv, uint64_t stride, uint32_t U) {
  for (uint32_t u = 0; u < U && i < nv; ++u, i += stride) cp_async16(buf + u * blockDim.x, s + i);
}

// d[i] (and d2[i]) = s[i] for vectors i < nv, vector i by the thread with tid == i % nthreads,
// through U staged vectors per thread per batch: batch b+1 loads while batch b is stored.
__device__ __forceinline__ void copy_vectors_staged(uint4* d, uint4* d2, const uint4* s, uint64_t nv, uint64_t tid,
                                                    uint64_t nthreads, uint32_t U) {
  uint4* slots = stage_slots();
  const uint32_t half = U * blockDim.x;  // slots of one buffer
  const uint64_t batch = (uint64_t)U * nthreads;
  uint32_t cur = 0;
  stage_issue(slots, s, tid, nv, nthreads, U);
  cp_async_commit();
  for (uint64_t first = tid; first < nv; first += batch) {
    stage_issue(slots + (half - cur), s, first + batch, nv, nthreads, U);
    cp_async_commit();
    cp_async_wait<1>();
    const uint4* buf = slots + cur;
    uint64_t i = first;
    for (uint32_t u = 0; u < U && i < nv; ++u, i += nthreads) {
      uint4 v = buf[u * blockDim.x];
      d[i] = v;
      if (d2) d2[i] = v;
    }
    cur = half - cur;
  }
}

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
// nthreads threads of which this is tid; the vectors are staged through shared memory when
// the kernel was launched with stage_bytes of it (0: in registers).
__device__ __forceinline__ void copy_range(char* dst, char* dst2, const char* src, uint64_t bytes, int elem, uint64_t tid,
                                           uint64_t nthreads, uint32_t stage_bytes = 0) {
  uint64_t done = 0;
  bool vec = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
               (dst2 ? reinterpret_cast<uintptr_t>(dst2) : 0)) & 15) == 0;
  const uint32_t staged = stage_bytes ? stage_vectors(stage_bytes, 1) : 0;
  if (vec && staged) {
    copy_vectors_staged(reinterpret_cast<uint4*>(dst), reinterpret_cast<uint4*>(dst2), reinterpret_cast<const uint4*>(src),
                        bytes / 16, tid, nthreads, staged);
    done = bytes / 16 * 16;
  } else if (vec) {
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

__device__ __forceinline__ void cta_copy(char* dst, char* dst2, const char* src, uint64_t bytes, int elem,
                                         uint32_t stage_bytes = 0) {
  copy_range(dst, dst2, src, bytes, elem, threadIdx.x, blockDim.x, stage_bytes);
}

// op over p < nsrc of the 16-byte vectors vec(0), vec(1), ... (accumulated in Traits<T>::Acc,
// in source order, finalized and rounded once): one output vector of cta_reduce.
template <typename T, class Vec>
__device__ __forceinline__ uint4 reduce_vector(Vec vec, int nsrc, int op, int nranks) {
  typedef Traits<T> Tr;
  typedef typename Tr::Acc A;
  constexpr int V = 16 / sizeof(T);
  uint4 raw = vec(0);
  const T* t = reinterpret_cast<const T*>(&raw);
  A acc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = Tr::load(t[v]);
#pragma unroll
  for (int p = 1; p < MK_MAX_PEERS; ++p) {
    if (p < nsrc) {
      raw = vec(p);
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] = combine<A>(acc[v], Tr::load(t[v]), op);
    }
  }
  uint4 out;
  T* o = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int v = 0; v < V; ++v) o[v] = Tr::store(finalize<A>(acc[v], op, nranks));
  return out;
}

// One batch of every source: source p's vectors into slots (buffer, p, u).
__device__ __forceinline__ void reduce_stage_issue(uint4* buf, const char* const (&src)[MK_MAX_PEERS], int nsrc, uint64_t first,
                                                   uint64_t nv, uint32_t U) {
#pragma unroll
  for (int p = 0; p < MK_MAX_PEERS; ++p)
    if (p < nsrc) stage_issue(buf + p * U * blockDim.x, reinterpret_cast<const uint4*>(src[p]), first, nv, blockDim.x, U);
  cp_async_commit();
}

// The vector part of cta_reduce (nv 16-byte vectors, every pointer aligned) through U staged
// vectors per source per thread per batch: batch b+1 loads while batch b is reduced, one
// source at a time from shared memory (an accumulator and one vector live, not nsrc).
template <typename T>
__device__ __forceinline__ void reduce_vectors_staged(T* dst, T* dst2, const char* const (&src)[MK_MAX_PEERS], int nsrc, uint64_t nv,
                                                      int op, int nranks, uint32_t U) {
  uint4* slots = stage_slots();
  const uint32_t per_src = U * blockDim.x;
  const uint32_t half = nsrc * per_src;  // slots of one buffer
  uint32_t cur = 0;
  reduce_stage_issue(slots, src, nsrc, threadIdx.x, nv, U);
  for (uint64_t first = threadIdx.x; first < nv; first += per_src) {
    reduce_stage_issue(slots + (half - cur), src, nsrc, first + per_src, nv, U);
    cp_async_wait<1>();
    const uint4* buf = slots + cur;
    uint64_t i = first;
    for (uint32_t u = 0; u < U && i < nv; ++u, i += blockDim.x) {
      const uint4* slot = buf + u * blockDim.x;
      const uint4 out = reduce_vector<T>([&](int p) { return slot[p * per_src]; }, nsrc, op, nranks);
      reinterpret_cast<uint4*>(dst)[i] = out;
      if (dst2) reinterpret_cast<uint4*>(dst2)[i] = out;
    }
    cur = half - cur;
  }
}

// dst[i] (and dst2[i]) = op over p < nsrc of src[p][i], for i < n, by the whole CTA; the
// vectors are staged through shared memory when the kernel was launched with stage_bytes of
// it and one vector of every source fits twice per thread (0: in registers).
template <typename T>
__device__ __forceinline__ void cta_reduce(T* dst, T* dst2, const char* const (&src)[MK_MAX_PEERS], int nsrc, uint64_t n, int op,
                                           int nranks, uint32_t stage_bytes = 0) {
  typedef Traits<T> Tr;
  typedef typename Tr::Acc A;
  constexpr int V = 16 / sizeof(T);
  uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | (dst2 ? reinterpret_cast<uintptr_t>(dst2) : 0);
#pragma unroll
  for (int p = 0; p < MK_MAX_PEERS; ++p)
    if (p < nsrc) bits |= reinterpret_cast<uintptr_t>(src[p]);
  uint64_t done = 0;
  const uint32_t staged = stage_bytes ? stage_vectors(stage_bytes, nsrc) : 0;
  if ((bits & 15) == 0 && staged) {
    reduce_vectors_staged<T>(dst, dst2, src, nsrc, n / V, op, nranks, staged);
    done = n / V * V;
  } else if ((bits & 15) == 0) {
    uint64_t nv = n / V;
    for (uint64_t i = threadIdx.x; i < nv; i += blockDim.x) {
      uint4 raw[MK_MAX_PEERS];  // every source's load issued before the first add
#pragma unroll
      for (int p = 0; p < MK_MAX_PEERS; ++p)
        if (p < nsrc) raw[p] = load16(src[p] + i * 16);
      const uint4 out = reduce_vector<T>([&](int p) { return raw[p]; }, nsrc, op, nranks);
      reinterpret_cast<uint4*>(dst)[i] = out;
      if (dst2) reinterpret_cast<uint4*>(dst2)[i] = out;
    }
    done = nv * V;
  }
  for (uint64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    A acc = Tr::load(ldcg_element(reinterpret_cast<const T*>(src[0]) + i));
#pragma unroll
    for (int p = 1; p < MK_MAX_PEERS; ++p)
      if (p < nsrc) acc = combine<A>(acc, Tr::load(ldcg_element(reinterpret_cast<const T*>(src[p]) + i)), op);
    T r = Tr::store(finalize<A>(acc, op, nranks));
    dst[i] = r;
    if (dst2) dst2[i] = r;
  }
}
