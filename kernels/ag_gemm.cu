// AllGather + GEMM in one persistent kernel (mkAllGatherGemm).
//
// CTAs [0, compute_ctas) run the GEMM engine over the gathered A in this rank's workspace,
// row blocks in rank-rotated order (own rows first); before a tile's A rows are loaded the
// producer waits for the chunks covering them. CTAs [compute_ctas, +comm_ctas) push this
// rank's rows, chunk by chunk, into every rank's gathered buffer (its own first, then
// rank-1, rank-2, ...: the order in which the others consume them) and raise one
// epoch-valued flag per chunk in the receiver's signal region. With `gathered_out` they
// then copy the whole gathered A out for the caller.
//
// Epochs live on the device (signal word AGG_EPOCH), so a captured CUDA graph replays
// correctly: every CTA reads the epoch at start; the last CTA to finish advances it and
// tells every peer it has finished reading its gathered buffer (AGG_DONE), which a pusher
// waits for before overwriting that buffer in the next call.
#include "common/gemm/engine.cuh"
#include "common/fused_op.cuh"

#define MK_OP_AG_GEMM 16
// Signal words of this op (own region unless noted).
#define AGG_EPOCH (MK_SIG_OP_BASE + 0)   // last completed epoch of this rank
#define AGG_ARRIVE (MK_SIG_OP_BASE + 1)  // CTAs of the running launch that have finished
#define AGG_LOCAL (MK_SIG_OP_BASE + 2)   // CTAs of the running launch that copied their slice of the own rows
#define AGG_DONE (MK_SIG_OP_BASE + 8)    // + q: rank q finished epoch e (written by q)
#define AGG_CHUNK (MK_SIG_OP_BASE + 64)  // + src * MK_AG_GEMM_MAX_CHUNKS + c: chunk arrived (written by src)

namespace mk { namespace ag_gemm {

using namespace mk::gemm;

// Waits, in the engine's producer thread, for every chunk covering rows [row0, row0 + rows).
struct ChunkAWait {
  struct Params {
    const AgGemmParams* op;  // the __grid_constant__ kernel parameter (no local copy)
    uint64_t epoch;
  };
  __device__ static void before_a_load(const Params& w, int, int row0, int rows) {
    const AgGemmParams& p = *w.op;
    const int end = min(row0 + rows, p.m);
    for (int r = row0; r < end;) {
      const int src = r / p.rows_per_rank;
      const int c = (r - src * p.rows_per_rank) / p.chunk_rows;
      const uint64_t* flag = mk_signal_word(p.ws, p.ws.rank, AGG_CHUNK + src * MK_AG_GEMM_MAX_CHUNKS + c);
      // A failed wait (timeout, abort) has recorded the error and raised the abort word;
      // the tile then computes on stale rows and the kernel still ends, in bounded time.
      mk_wait_geq_inline(p.ws, flag, w.epoch, src, MK_WAIT_OP_FLAG, MK_OP_AG_GEMM);
      r = min(src * p.rows_per_rank + (c + 1) * p.chunk_rows, (src + 1) * p.rows_per_rank);
    }
    fence_proxy_async_global();  // the peers' generic-proxy stores, then our TMA loads
  }
};

// All threads of the CTA copy `bytes` (a multiple of 16) from src to dst.
__device__ __forceinline__ void cta_copy(char* dst, const char* src, size_t bytes) {
  constexpr int kInFlight = 8;  // 16-byte loads per thread before the first store: latency-bound otherwise
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* d = reinterpret_cast<int4*>(dst);
  const size_t n = bytes / 16;
  const size_t stride = blockDim.x;
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

__device__ __forceinline__ bool push_and_gather(const AgGemmParams& p, uint64_t epoch, int j) {
  const WorkspaceView& ws = p.ws;
  const int n = ws.nranks, me = ws.rank, chunks = p.chunks_per_rank;
  const size_t row_bytes = (size_t)p.k * 2;
  // This rank's own rows were copied by every CTA (copy_own_rows); push to the others,
  // rank-1 first (it consumes our rows next), then rank-2, ...
  for (int it = j; it < (n - 1) * chunks; it += p.comm_ctas) {
    const int q = (me - 1 - it / chunks + n) % n;
    const int c = it % chunks;
    const int row0 = c * p.chunk_rows;
    const int rows = min(p.chunk_rows, p.rows_per_rank - row0);
    if (!mk_cta_wait(ws, mk_signal_word(ws, me, AGG_DONE + q), epoch - 1, q, MK_WAIT_OP_FLAG, MK_OP_AG_GEMM))
      return false;
    char* dst = reinterpret_cast<char*>(ws.data[q]) + p.gathered_offset + ((size_t)me * p.rows_per_rank + row0) * row_bytes;
    cta_copy(dst, reinterpret_cast<const char*>(p.a_local) + row0 * row_bytes, rows * row_bytes);
    __syncthreads();
    if (threadIdx.x == 0) mk_signal_store(mk_signal_word(ws, q, AGG_CHUNK + me * MK_AG_GEMM_MAX_CHUNKS + c), epoch);
  }
  if (p.gathered_out == 0) return true;
  const char* own = reinterpret_cast<const char*>(ws.data[me]) + p.gathered_offset;
  for (int it = j; it < n * chunks; it += p.comm_ctas) {
    const int src = it / chunks, c = it % chunks;
    const int row0 = c * p.chunk_rows;
    const int rows = min(p.chunk_rows, p.rows_per_rank - row0);
    if (!mk_cta_wait(ws, mk_signal_word(ws, me, AGG_CHUNK + src * MK_AG_GEMM_MAX_CHUNKS + c), epoch, src,
                     MK_WAIT_OP_FLAG, MK_OP_AG_GEMM))
      return false;
    const size_t off = ((size_t)src * p.rows_per_rank + row0) * row_bytes;
    cta_copy(reinterpret_cast<char*>(p.gathered_out) + off, own + off, rows * row_bytes);
  }
  return true;
}


// Whole grid: every CTA copies its slice of this rank's rows into the own gathered buffer;
// the last to finish raises the own-row chunk flags. The GEMM starts on these rows, so
// they must not wait for the few push CTAs.
__device__ __forceinline__ void copy_own_rows(const AgGemmParams& p, uint64_t epoch) {
  const WorkspaceView& ws = p.ws;
  const size_t row_bytes = (size_t)p.k * 2;
  const size_t total = (size_t)p.rows_per_rank * row_bytes;  // a multiple of 16
  const size_t slice = ((total / 16 + gridDim.x - 1) / gridDim.x) * 16;
  const size_t begin = min(total, (size_t)blockIdx.x * slice), end = min(total, begin + slice);
  char* own = reinterpret_cast<char*>(ws.data[ws.rank]) + p.gathered_offset + (size_t)ws.rank * p.rows_per_rank * row_bytes;
  cta_copy(own + begin, reinterpret_cast<const char*>(p.a_local) + begin, end - begin);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned long long* arrived = reinterpret_cast<unsigned long long*>(mk_signal_word(ws, ws.rank, AGG_LOCAL));
    if (atomicAdd(arrived, 1ull) == gridDim.x - 1) {
      *arrived = 0;  // every CTA has arrived; the next launch starts after this one ends
      for (int c = 0; c < p.chunks_per_rank; ++c)
        mk_signal_store(mk_signal_word(ws, ws.rank, AGG_CHUNK + ws.rank * MK_AG_GEMM_MAX_CHUNKS + c), epoch);
    }
  }
}

template <typename T, int BN>
__device__ __forceinline__ void ag_gemm(const CUtensorMap* tma_a, const CUtensorMap* tma_b, const CUtensorMap* tma_c,
                                        const AgGemmParams& p) {
  using Cfg = GemmConfig<T, BN, FusedStages<BN>::value>;
  using Epi = TmaStoreEpilogue;
  extern __shared__ __align__(1024) char smem[];
  mk_check_engine_smem<Cfg, Epi>();
  const WorkspaceView& ws = p.ws;
  const uint64_t epoch = mk_op_epoch_begin(ws, AGG_EPOCH);
  copy_own_rows(p, epoch);

  if ((int)blockIdx.x < p.compute_ctas) {
    RasterParams sched;
    sched.tiles_m = (p.m + Cfg::BM - 1) / Cfg::BM;
    sched.tiles_n = (p.n + BN - 1) / BN;
    sched.group_m = p.group_m > 0 ? p.group_m : 1;
    sched.m_block_base = p.m_block_base;
    typename ChunkAWait::Params await{&p, epoch};
    typename Epi::Params epi;
    epi.dest.tma_c = tma_c;
    epi.signal.unused = 0;
    gemm_persistent<Cfg, RankRotatedRaster, ChunkAWait, Epi>(tma_a, tma_b, GemmShape{p.m, p.n, p.k}, sched, await, epi,
                                                              blockIdx.x, p.compute_ctas, smem);
  } else {
    push_and_gather(p, epoch, blockIdx.x - p.compute_ctas);
  }

  // The last CTA to finish advances the epoch and frees this rank's gathered buffer.
  mk_op_epoch_end(ws, AGG_EPOCH, AGG_ARRIVE, AGG_DONE, epoch);
}

}  // namespace ag_gemm
}  // namespace mk

#define MK_AG_GEMM_ENTRY(NAME, T, BN)                                                                  \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                \
      NAME(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,      \
           const __grid_constant__ CUtensorMap tma_c, const __grid_constant__ AgGemmParams p) {       \
    mk::ag_gemm::ag_gemm<T, BN>(&tma_a, &tma_b, &tma_c, p);                                           \
  }

MK_AG_GEMM_ENTRY(mk_ag_gemm_bf16_bn256, __nv_bfloat16, 256)
MK_AG_GEMM_ENTRY(mk_ag_gemm_bf16_bn128, __nv_bfloat16, 128)
MK_AG_GEMM_ENTRY(mk_ag_gemm_f16_bn256, __half, 256)
MK_AG_GEMM_ENTRY(mk_ag_gemm_f16_bn128, __half, 128)
