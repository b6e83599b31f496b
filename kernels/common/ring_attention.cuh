// What the ring-attention kernels share (kernels/ring_attention.cu, the forward, and
// kernels/ring_attention_backward.cu): token positions, ring-step sources, the exp2 and
// packing helpers of the engine, the 128-byte-swizzle offsets, the dynamic schedule's
// ticket and the publishing of this rank's K/V into its workspace.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "fused_op.cuh"

namespace mk { namespace ring_attn {

// 2^x on the SFU (MUFU.EX2), subnormal results flushed to 0: exp2f's fix-up of the
// subnormal range would triple the softmax's instruction count, and probabilities below
// 2^-126 of the row maximum vanish in the row sum anyway. 2^-inf = +0.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
struct Mma;  // the packing of two fp32 into a b32 register of T
template <>
struct Mma<__nv_bfloat16> {
  __device__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <>
struct Mma<__half> {
  __device__ static uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

// Element offset of (row, 16-byte chunk) in a tile of R rows stored as wgmma's K-major
// 128-byte-swizzle layout: 64-element column blocks of R rows x 128 bytes, chunk c of row
// r at c ^ (r & 7) inside its block (the tile must start 1024-byte aligned).
template <int R>
__device__ __forceinline__ int swz(int row, int chunk) {
  return (chunk >> 3) * (R * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

// Global token position of local token i on `rank` (ops::ring_attention::rank_spans):
// contiguous shards, or zigzag chunks rank and 2n-1-rank of seq/2 tokens. Monotonic in i.
__device__ __forceinline__ int token_pos(int rank, int i, int seq, int n, bool causal) {
  if (!causal) return rank * seq + i;
  const int half = seq >> 1;
  return i < half ? rank * half + i : (2 * n - 1 - rank) * half + (i - half);
}

// All threads of the CTA copy `bytes` (a multiple of 16) from src to dst.
__device__ __forceinline__ void cta_copy(char* dst, const char* src, size_t bytes) {
  constexpr int kInFlight = 8;
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* d = reinterpret_cast<int4*>(dst);
  const size_t n = bytes / 16, stride = blockDim.x;
  size_t i = threadIdx.x;
  for (; i + (kInFlight - 1) * stride < n; i += kInFlight * stride) {
    int4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) v[u] = s[i + u * stride];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) d[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) d[i] = s[i];
}

// The next ticket of the dynamic schedule.
__device__ __forceinline__ int take_ticket(unsigned long long* counter) {
  unsigned long long v;
  asm volatile("atom.relaxed.gpu.global.add.u64 %0, [%1], 1;" : "=l"(v) : "l"(counter));
  return (int)v;
}

// The rank whose K/V ring step s (0 <= s < n) of `rank` reads: (rank - s) mod n, without
// the integer division of `%` (about 20 instructions, which would run per tile in the
// consumers' loop and cost the 24-register producer spills).
__device__ __forceinline__ int ring_src(int rank, int s, int n) {
  const int r = rank - s;
  return r < 0 ? r + n : r;
}

// Descriptor of an MN-major 128-byte-swizzled wgmma B operand (a [token][d] tile, d
// contiguous): 8-token groups 1024 bytes apart (stride byte offset), 64-wide d blocks
// `block_bytes` apart (leading byte offset), as CUTLASS's canonical MN-major SW128 layout.
__device__ __forceinline__ uint64_t desc_mn_sw128(const void* p, uint32_t block_bytes) {
  uint64_t desc = (uint64_t(gemm::smem_addr(p)) & 0x3FFFF) >> 4;
  desc |= uint64_t(block_bytes >> 4) << 16;
  desc |= uint64_t(1024 >> 4) << 32;
  desc |= uint64_t(1) << 62;
  return desc;
}

// Publish phase (whole CTA): after every peer has said (done_word + peer >= epoch - 1) it
// finished reading this rank's workspace in the previous call, this CTA's slice of K and
// V (kv_elems 2-byte elements each) goes to the own fused-op region at kv_offset, V after
// K; the last CTA (counter copied_word) raises kv_word + rank in every peer. False when a
// wait gave up (the CTA then skips to the end).
__device__ __forceinline__ bool publish_kv(const WorkspaceView& ws, const void* k, const void* v, uint64_t kv_elems,
                                           uint64_t kv_offset, uint64_t epoch, uint32_t done_word,
                                           uint32_t copied_word, uint32_t kv_word, uint32_t op) {
  if (!mk_cta_wait_peers(ws, done_word, epoch - 1, ws.rank, MK_WAIT_OP_FLAG, op)) return false;
  const size_t bytes = (size_t)kv_elems * 2;  // one of K, V
  const size_t slice = ((bytes / 16 + gridDim.x - 1) / gridDim.x) * 16;
  const size_t begin = min(bytes, (size_t)blockIdx.x * slice), end = min(bytes, begin + slice);
  char* own = reinterpret_cast<char*>(ws.data[ws.rank]) + kv_offset;
  cta_copy(own + begin, reinterpret_cast<const char*>(k) + begin, end - begin);
  cta_copy(own + bytes + begin, reinterpret_cast<const char*>(v) + begin, end - begin);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    if (mk_arrive_last(mk_signal_word(ws, ws.rank, copied_word), gridDim.x)) {
      for (int q = 0; q < ws.nranks; ++q)
        if (q != ws.rank) mk_signal_store(mk_signal_word(ws, q, kv_word + ws.rank), epoch);
    }
  }
  return true;
}

}  // namespace ring_attn
}  // namespace mk
