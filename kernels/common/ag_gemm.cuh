// The AllGather+GEMM's gather, as its two kernels share it (kernels/ag_gemm.cu: bf16/fp16
// rows; kernels/ag_scaled_gemm.cu: e4m3 rows and their scales): the chunk flags, the
// vector copy the pushers and the own-row copy use, and the wait the GEMM's producer thread
// makes before loading a tile's rows. Both kernels keep the same words (AGG_* in
// mk_kernel_abi.h) with the same meaning, so calls of either op in any order on one
// communicator stay in step: each advances AGG_EPOCH once and frees its gathered buffer
// with AGG_DONE.
#pragma once
#include <cstdint>
#include "gemm/ptx.cuh"
#include "signals.cuh"

namespace mk { namespace ag_gemm {

// The arrival flag of chunk c of global rank src's rows (in the receiving rank's region).
__device__ __forceinline__ uint32_t agg_chunk(const AgGemmParams& p, int src, int c) {
  return AGG_CHUNK + src * p.flag_stride + c;
}

// `threads` threads (this one is `tid`) copy `bytes` (a multiple of 16) from src to dst,
// IN_FLIGHT 16-byte loads per thread before the first store (latency-bound otherwise).
template <int IN_FLIGHT>
__device__ __forceinline__ void copy_vectors(char* dst, const char* src, size_t bytes, int tid, int threads) {
  const int4* s = reinterpret_cast<const int4*>(src) + tid;
  int4* d = reinterpret_cast<int4*>(dst) + tid;
  // 32-bit indexes (a slice is far below 64 GB): fewer registers in the side warps.
  const uint32_t n = (uint32_t)(bytes / 16), step = (uint32_t)threads;
  uint32_t i = tid;
  for (; i + (IN_FLIGHT - 1) * step < n; i += IN_FLIGHT * step, s += IN_FLIGHT * step, d += IN_FLIGHT * step) {
    int4 v[IN_FLIGHT];
#pragma unroll
    for (int u = 0; u < IN_FLIGHT; ++u) v[u] = s[u * step];
#pragma unroll
    for (int u = 0; u < IN_FLIGHT; ++u) d[u * step] = v[u];
  }
  for (; i < n; i += step, s += step, d += step) *d = *s;
}
__device__ __forceinline__ void cta_copy(char* dst, const char* src, size_t bytes) {
  copy_vectors<8>(dst, src, bytes, threadIdx.x, blockDim.x);
}

// Producer thread, before a tile's first A load: waits for every chunk covering gathered
// rows [row0, row0 + rows), then orders the peers' generic-proxy stores before the TMA
// loads that follow. A failed wait (timeout, abort) has recorded the error (naming the
// flag and `op`) and raised the abort word; the tile then computes on stale rows and the
// kernel still ends, in bounded time.
__device__ __forceinline__ void wait_gathered_rows(const AgGemmParams& p, uint64_t epoch, int row0, int rows,
                                                   uint32_t op) {
  const int end = min(row0 + rows, p.m);
  for (int r = row0; r < end;) {
    const int src = r / p.rows_per_rank;
    const int c = (r - src * p.rows_per_rank) / p.chunk_rows;
    const uint64_t* flag = mk_signal_word(p.ws, p.ws.rank, agg_chunk(p, src, c));
    mk_wait_geq_inline(p.ws, flag, epoch, src, MK_WAIT_OP_FLAG, op);
    r = min(src * p.rows_per_rank + (c + 1) * p.chunk_rows, (src + 1) * p.rows_per_rank);
  }
  mk::gemm::fence_proxy_async_global();
}

}  // namespace ag_gemm
}  // namespace mk
