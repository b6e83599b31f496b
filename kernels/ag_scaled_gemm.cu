// fp8 AllGather + GEMM in one persistent kernel (mkAllGatherScaledGemm): every rank holds
// rows_per_rank rows of A in e4m3 with their fp32 scales; the kernel gathers the rows and
// the scales of every rank into its workspace and runs the scaled GEMM
// (kernels/common/gemm/scaled_mainloop.cuh) over them, C = (A·sA)(B·sB)ᵀ for all gathered
// rows, B and its scales local (a column-parallel weight shard).
//
// The gather is mkAllGatherGemm's on one node (kernels/ag_gemm.cu, the words and helpers
// of kernels/common/ag_gemm.cuh) with one-byte elements and scales beside the rows:
// 1. Own shard: the whole grid copies this rank's rows and scales into its own gathered
//    buffers; the last CTA raises the own chunks' flags.
// 2. GEMM: every CTA runs the scaled mainloop over the gathered rows, m-blocks in
//    rank-rotated order (own rows first); before a tile's A rows are loaded its producer
//    thread waits for the flags of the chunks covering them (ScaledChunkWait). The consumers
//    read the gathered scales through L2 (ScaleRead::WrittenDuringKernel): the peers write
//    them while the kernel runs, and the producer's acquire of the chunk flag, then its
//    mbarrier arrival and the consumers' wait on it, order those writes before the reads.
// 3. Push, beside the GEMM: the three idle warps of every CTA's producer warpgroup copy
//    this rank's rows and scales into every peer's gathered buffers (rank-1 first, then
//    rank-2, ...: the order in which the peers consume them), each chunk sliced over all
//    CTAs; the last CTA to finish a chunk's slice raises its flag at the peer (AGG_PUSHED,
//    AGG_CHUNK). A pusher writes to peer q only after q's AGG_DONE for the previous call.
// 4. End: the last CTA advances the epoch (AGG_EPOCH, on the device: graph replays stay in
//    step) and tells every peer it finished reading its buffers (AGG_DONE).
//
// Gathered scales, at scale_offset in the data region: per tensor and rowwise one fp32 per
// gathered row (per tensor: each rank's one scale, written for each of its rows), so the
// GEMM runs rowwise over A whatever the mode; block scales [K/128][m], rank r's
// [K/128][rows_per_rank] in columns [r·rows_per_rank, (r+1)·rows_per_rank).
//
// Kernel name: mk_ag_scaled_gemm_e4m3_<out>_bn<BN>, out in {bf16, f16}, BN in {64, 128},
// TMA-store epilogue. Signature: (CUtensorMap tma_a over the gathered rows, tma_b, tma_c,
// AgScaledGemmParams p). Launch: 384 threads, grid = p.ag.compute_ctas, dynamic shared
// memory = ScaledConfig::smem_bytes (src/ops/dense/ag_scaled_gemm.rs, the same formula).
#include "common/ag_gemm.cuh"
#include "common/fused_op.cuh"
#include "common/gemm/scaled_mainloop.cuh"

namespace mk { namespace ag_scaled_gemm {

using namespace mk::gemm;
using namespace mk::ag_gemm;

// The producer warpgroup's registers: its three idle warps push (80, as kernels/ag_gemm.cu's
// push loop needs; the consumers keep 208, above the two accumulator arrays' 128).
constexpr int kProducerRegs = 80;
// The pushers: warps 1-3 of every CTA's producer warpgroup (threads 32..127, barrier 3).
using SideWarps = WarpTeam<32, 96, 3>;
// 16-byte loads in flight per pushing thread.
constexpr int kPushInFlight = 8;

__device__ __forceinline__ float* gathered_scales(const AgScaledGemmParams& sp, int rank) {
  return reinterpret_cast<float*>(reinterpret_cast<char*>(sp.ag.ws.data[rank]) + sp.scale_offset);
}

// Threads `tid` of `threads` copy scale words [begin, end) of this rank's local rows
// [row0, row0 + rows) into the gathered scales `dst`: word j is K block j / rows of local
// row row0 + j % rows.
__device__ __forceinline__ void copy_scales(float* dst, const AgScaledGemmParams& sp, int row0, int rows, uint32_t begin,
                                            uint32_t end, int tid, int threads) {
  const AgGemmParams& p = sp.ag;
  const float* src = reinterpret_cast<const float*>(sp.scale_a_local);
  const size_t first_row = (size_t)p.global_rank * p.rows_per_rank;
  for (uint32_t j = begin + tid; j < end; j += threads) {
    const uint32_t kb = j / rows, i = row0 + j % rows;
    dst[(size_t)kb * p.m + first_row + i] = src[((size_t)kb * p.rows_per_rank + i) * sp.scale_a_local_step];
  }
}

// Scale words of a run of `rows` rows: one per row, K/128 per row with block scales.
__device__ __forceinline__ uint32_t scale_words(const AgScaledGemmParams& sp, int rows) {
  return (uint32_t)rows * (uint32_t)max(sp.scale_k_blocks, 1);
}

// [begin, end) of slice `part` of `parts` of `total` units of `unit` bytes.
__device__ __forceinline__ void slice_of(size_t total, size_t unit, int part, int parts, size_t& begin, size_t& end) {
  const size_t slice = (total / unit + parts - 1) / parts * unit;
  begin = min(total, (size_t)part * slice);
  end = min(total, begin + slice);
}

// Whole grid, before the GEMM: every CTA copies its slice of this rank's rows and scales
// into its own gathered buffers; the last to finish raises the own chunks' flags.
__device__ __forceinline__ void copy_own_shard(const AgScaledGemmParams& sp, uint64_t epoch) {
  const AgGemmParams& p = sp.ag;
  const WorkspaceView& ws = p.ws;
  const size_t row_bytes = (size_t)p.k;  // one byte per e4m3 element
  size_t begin, end;
  slice_of((size_t)p.rows_per_rank * row_bytes, 16, blockIdx.x, gridDim.x, begin, end);
  char* own = reinterpret_cast<char*>(ws.data[ws.rank]) + p.gathered_offset + (size_t)p.global_rank * p.rows_per_rank * row_bytes;
  cta_copy(own + begin, reinterpret_cast<const char*>(p.a_local) + begin, end - begin);
  slice_of(scale_words(sp, p.rows_per_rank), 1, blockIdx.x, gridDim.x, begin, end);
  copy_scales(gathered_scales(sp, ws.rank), sp, 0, p.rows_per_rank, (uint32_t)begin, (uint32_t)end, threadIdx.x, blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (mk_arrive_last(mk_signal_word(ws, ws.rank, AGG_LOCAL), gridDim.x)) {
      for (int c = 0; c < p.chunks_per_rank; ++c)
        mk_signal_store(mk_signal_word(ws, ws.rank, agg_chunk(p, p.global_rank, c)), epoch);
    }
  }
}

// Pusher `part` of `parts` (the threads of Team) copies its slice of every chunk of this
// rank's rows, and of the chunk's scales, into every peer's gathered buffers: rank-1 first
// (it consumes our rows next), then rank-2, ... After its slice of chunk c for peer q it
// counts itself in AGG_PUSHED(q, c); the last pusher of that chunk raises the chunk's flag
// at q. Team thread 0 waits.
template <class Team>
__device__ __forceinline__ bool push_shard(const AgScaledGemmParams& sp, uint64_t epoch, int part, int parts) {
  const int tid = Team::tid(), threads = Team::threads();
  const AgGemmParams& p = sp.ag;
  const WorkspaceView& ws = p.ws;
  const int n = ws.nranks, me = ws.rank, chunks = p.chunks_per_rank;
  const size_t row_bytes = (size_t)p.k;
  for (int i = 1; i < n; ++i) {
    const int q = (me - i + n) % n;
    int ok = 1;
    // q must have finished reading its gathered buffers of our previous call.
    if (tid == 0)
      ok = mk_wait_geq_inline(ws, mk_signal_word(ws, me, AGG_DONE + q), epoch - 1, q, MK_WAIT_OP_FLAG,
                              MK_OP_ALL_GATHER_SCALED_GEMM);
    if (!Team::and_all(ok)) return false;
    char* peer = reinterpret_cast<char*>(ws.data[q]) + p.gathered_offset + (size_t)me * p.rows_per_rank * row_bytes;
    for (int c = 0; c < chunks; ++c) {
      const int row0 = c * p.chunk_rows, rows = min(p.chunk_rows, p.rows_per_rank - row0);
      size_t begin, end;
      slice_of((size_t)rows * row_bytes, 16, part, parts, begin, end);
      const size_t first = (size_t)row0 * row_bytes;
      copy_vectors<kPushInFlight>(peer + first + begin, reinterpret_cast<const char*>(p.a_local) + first + begin,
                                  end - begin, tid, threads);
      slice_of(scale_words(sp, rows), 1, part, parts, begin, end);
      copy_scales(gathered_scales(sp, q), sp, row0, rows, (uint32_t)begin, (uint32_t)end, tid, threads);
      Team::sync();
      if (tid == 0) {
        __threadfence_system();  // our slice (every thread's stores, ordered by the barrier), then the count
        if (mk_arrive_last(mk_signal_word(ws, me, AGG_PUSHED + q * MK_AG_GEMM_MAX_CHUNKS + c), (unsigned long long)parts))
          mk_signal_store(mk_signal_word(ws, q, agg_chunk(p, me, c)), epoch);
      }
    }
  }
  return true;
}

// The scaled mainloop's hooks: the producer thread waits for a tile's rows (and so their
// scales: a chunk's flag covers both); the side warps push.
struct ScaledChunkWait {
  struct Params {
    const AgScaledGemmParams* op;  // the __grid_constant__ kernel parameter (no local copy)
    uint64_t epoch;
  };
  __device__ static void before_a_load(const Params& w, int, int row0, int rows) {
    wait_gathered_rows(w.op->ag, w.epoch, row0, rows, MK_OP_ALL_GATHER_SCALED_GEMM);
  }
  __device__ static const CUtensorMap* a_source(const Params&, const CUtensorMap* tma_a, int m_row0, int& row) {
    row = m_row0;
    return tma_a;
  }
  __device__ static void side_work(const Params& w, int) {
    push_shard<SideWarps>(*w.op, w.epoch, blockIdx.x, gridDim.x);
  }
};

template <typename TAB, typename TOut, int BN>
__device__ __forceinline__ void ag_scaled_gemm(const CUtensorMap* tma_a, const CUtensorMap* tma_b,
                                               const CUtensorMap* tma_c, const AgScaledGemmParams& sp) {
  using Cfg = ScaledConfig<TAB, TAB, TOut, BN, true, kProducerRegs>;
  const AgGemmParams& p = sp.ag;
  const WorkspaceView& ws = p.ws;
  const uint64_t epoch = mk_op_epoch_begin(ws, AGG_EPOCH);
  copy_own_shard(sp, epoch);

  RasterParams sched;
  sched.tiles_m = (p.m + Cfg::BM - 1) / Cfg::BM;
  sched.tiles_n = (p.n + BN - 1) / BN;
  sched.group_m = p.group_m > 0 ? p.group_m : 1;
  sched.m_block_base = p.m_block_base;
  sched.owners = 1;
  // A's scales: one per gathered row (step 1) unless block scales ([K/128][m]).
  const ScaledOperands op{nullptr, gathered_scales(sp, ws.rank), reinterpret_cast<const float*>(sp.scale_b),
                          p.m, p.n, p.k, 1, sp.scale_b_step, sp.scale_k_blocks};
  const typename ScaledChunkWait::Params await{&sp, epoch};
  scaled_gemm_persistent<Cfg, RankRotatedRaster, ScaledChunkWait, ScaleRead::WrittenDuringKernel>(
      tma_a, tma_b, tma_c, op, sched, await, blockIdx.x, gridDim.x);

  // The last CTA to finish advances the epoch and frees this rank's gathered buffers.
  mk_op_epoch_end(ws, AGG_EPOCH, AGG_ARRIVE, AGG_DONE, epoch);
}

}  // namespace ag_scaled_gemm
}  // namespace mk

#define MK_AG_SCALED_GEMM_ENTRY(NAME, TAB, TOUT, BN)                                                 \
  extern "C" __global__ void __launch_bounds__(384, 1)                                              \
      NAME(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,     \
           const __grid_constant__ CUtensorMap tma_c, const __grid_constant__ AgScaledGemmParams p) { \
    static_assert(std::is_same<TAB, __nv_fp8_e4m3>::value, "its instances gather and multiply e4m3");  \
    mk::ag_scaled_gemm::ag_scaled_gemm<TAB, TOUT, BN>(&tma_a, &tma_b, &tma_c, p);                   \
  }

#include "kernel_instances/ag_scaled_gemm.inc"  // the entry points: kernels/instances.txt
