// GEMM + ReduceScatter and GEMM + AllReduce in one persistent kernel (mkGemmReduceScatter,
// mkGemmAllReduce; one-shot reduction).
//
// CTAs [0, compute_ctas) run the GEMM engine on this rank's K slice and store partial
// tiles P (rounded to the input type) in this rank's fused-op region with TMA, each slab
// followed by an epoch-valued flag. CTAs [compute_ctas, +reduce_ctas) walk the tiles in
// the compute order, wait until every rank has stored a tile, read the n partials of it
// (peers' over NVLink) and add them in fp32 in rank order 0..n-1 (the same order on every
// rank, so AllReduce outputs are bitwise identical across ranks), writing the rows this
// rank owns (ReduceScatter: its M / n rows; AllReduce: all of them).
//
// Epochs are device-side (GR_EPOCH, advanced by the last CTA), so graph replays stay in
// step. Before storing a new P, compute CTAs wait until every peer has finished reading the
// previous one (GR_DONE, raised by the peer's last CTA).
#include "common/gemm/engine.cuh"
#include "common/fused_op.cuh"
#include "common/trace.cuh"

#define GR_EPOCH (MK_SIG_OP_BASE + 1024)
#define GR_ARRIVE (MK_SIG_OP_BASE + 1025)
#define GR_DONE (MK_SIG_OP_BASE + 1032)  // + q: rank q finished reading this rank's P of epoch e
#define GR_TILE (MK_SIG_OP_BASE + 2048)  // + tile * 2 + slab: slab stored (own region)
// Two-phase AllReduce: GR_TILE + 2 * tiles + tile: the owner reduced the tile into its R.

namespace mk { namespace gemm_reduce {

using namespace mk::gemm;

// After a 64-row slab of a partial tile is stored, its flag takes the epoch.
struct EpochTileSignal {
  struct Params {
    uint64_t* flags;
    int tiles_n;
    uint64_t epoch;
  };
  static constexpr bool enabled = true;
  __device__ static void after_store(const Params& p, const SlabInfo& s) {
    fence_proxy_async_global();  // the TMA (async proxy) writes, then the flag
    uint64_t* f = p.flags + ((size_t)s.tile.m_block * p.tiles_n + s.tile.n_block) * 2 + s.consumer;
    mk_signal_store(f, p.epoch);
  }
};

template <typename T>
__device__ __forceinline__ void add8(float (&acc)[8], int4 v) {
  const T* h = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] += (float)h[i];
}

template <typename T>
__device__ __forceinline__ int4 pack8(const float (&acc)[8]) {
  int4 out;
  T* h = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int i = 0; i < 8; ++i) h[i] = T(acc[i]);
  return out;
}

// The reducers: dedicated CTAs (CtaTeam), or the two consumer warpgroups of a GEMM CTA
// after its last tile (threads 128..383, named barrier 4; the producer warpgroup has only
// 40 registers).
using Consumers = WarpTeam<128, 256, 4>;

// Team thread q (< nranks) waits for rank q's slabs of tile `tc` that hold rows [r0, r1);
// every thread learns whether all waits succeeded.
template <class Team>
__device__ __forceinline__ bool wait_partials(const GemmReduceParams& p, uint64_t epoch, const TileCoord& tc, int r0, int r1) {
  const WorkspaceView& ws = p.ws;
  const uint64_t t0 = p.trace ? mk_globaltimer() : 0;
  int ok = 1;
  const int q = Team::tid();
  if (q < ws.nranks) {
    for (int slab = 0; slab < 2; ++slab) {
      const int s0 = tc.m_block * 128 + slab * 64;
      if (s0 >= r1 || s0 + 64 <= r0) continue;
      const uint64_t* f = mk_signal_word(ws, q, GR_TILE + ((uint32_t)tc.m_block * p.tiles_n + tc.n_block) * 2 + slab);
      ok &= mk_wait_geq_inline(ws, f, epoch, q, MK_WAIT_OP_FLAG, p.op);  // inlined: no calls in the GEMM warps (ptxas)
    }
  }
  ok = Team::and_all(ok);
  if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_WAIT, mk_globaltimer() - t0);
  return ok != 0;
}

// Sums rows [r0, r1) x columns [c0, c1) of every rank's partial in rank order 0..n-1 (the
// same order on every rank) and writes them to C (at row - out_row0) and, when
// `reduced` is set, to the same place in this rank's R.
template <typename T, class Team>
__device__ __forceinline__ void sum_partials(const GemmReduceParams& p, int r0, int r1, int c0, int c1, char* reduced) {
  const WorkspaceView& ws = p.ws;
  const int vpr = (c1 - c0) / 8;  // N % 8 == 0: 16-byte vectors never straddle a row end
  const int nvec = (r1 - r0) * vpr;
  if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_BYTES, (uint64_t)nvec * 16 * (ws.nranks + (reduced ? 2 : 1)));
  // Each thread loads every rank's vector for kVectors vectors before the first add:
  // with one vector in flight per rank the loop is latency-bound (measured ~5 GB/s per
  // CTA).
  constexpr int kVectors = 4;
  for (int v0 = Team::tid(); v0 < nvec; v0 += kVectors * Team::threads()) {
    int4 part[kVectors][MK_MAX_PEERS];
#pragma unroll
    for (int u = 0; u < kVectors; ++u) {
      const int v = v0 + u * Team::threads();
      if (v >= nvec) break;
      const size_t off = ((size_t)(r0 + v / vpr) * p.n + c0 + (v % vpr) * 8) * sizeof(T);
#pragma unroll
      for (int src = 0; src < MK_MAX_PEERS; ++src)
        if (src < ws.nranks) part[u][src] = *reinterpret_cast<const int4*>(reinterpret_cast<const char*>(ws.data[src]) + p.partial_offset + off);
    }
#pragma unroll
    for (int u = 0; u < kVectors; ++u) {
      const int v = v0 + u * Team::threads();
      if (v >= nvec) break;
      const int r = r0 + v / vpr, col = c0 + (v % vpr) * 8;
      const size_t off = ((size_t)r * p.n + col) * sizeof(T);
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (int src = 0; src < MK_MAX_PEERS; ++src)
        if (src < ws.nranks) add8<T>(acc, part[u][src]);
      const int4 sum = pack8<T>(acc);
      *reinterpret_cast<int4*>(reinterpret_cast<char*>(p.c) + ((size_t)(r - p.out_row0) * p.n + col) * sizeof(T)) = sum;
      if (reduced) *reinterpret_cast<int4*>(reduced + off) = sum;
    }
  }
}

// One-shot (ReduceScatter, small-M AllReduce): every tile holding rows this rank writes is
// reduced, in the compute order; this team takes tiles j, j + stride, ...
template <typename T, int BN, class Team>
__device__ __forceinline__ bool reduce_tiles(const GemmReduceParams& p, uint64_t epoch, int j, int stride) {
  const int tiles_m = (p.m + 127) / 128;
  const int total = tiles_m * p.tiles_n;
  const int lo_block = p.row_lo / 128, hi_block = (p.row_hi - 1) / 128;
  for (int t = j; t < total; t += stride) {
    const TileCoord tc = interleaved_tile(tiles_m, p.tiles_n, p.group_m, p.interleave, t);
    if (tc.m_block < lo_block || tc.m_block > hi_block) continue;
    const int r0 = max(tc.m_block * 128, p.row_lo), r1 = min(min(tc.m_block * 128 + 128, p.row_hi), p.m);
    if (!wait_partials<Team>(p, epoch, tc, r0, r1)) return false;
    if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_ITEMS, 1);
    sum_partials<T, Team>(p, r0, r1, tc.n_block * BN, min(tc.n_block * BN + BN, p.n), nullptr);
  }
  return true;
}

// Two-phase AllReduce. Phase 1: the tiles of this rank's row blocks are reduced (as
// above) into C and R, each then flagged. Phase 2: every other tile is copied from its
// owner's R once the owner has flagged it. One rank computes each sum, so every rank's C
// is bitwise identical; each rank reads n·M/n + (n−1)·M/n rows instead of the one-shot's
// n·M.
template <typename T, int BN, class Team>
__device__ __forceinline__ bool reduce_then_gather(const GemmReduceParams& p, uint64_t epoch, int j, int stride) {
  const WorkspaceView& ws = p.ws;
  const int tiles_m = (p.m + 127) / 128;
  const int total = tiles_m * p.tiles_n;
  const int blocks_per_rank = p.rows_per_rank / 128;
  const int lo_block = ws.rank * blocks_per_rank, hi_block = lo_block + blocks_per_rank - 1;
  char* reduced = reinterpret_cast<char*>(ws.data[ws.rank]) + p.reduced_offset;
  for (int t = j; t < total; t += stride) {
    const TileCoord tc = interleaved_tile(tiles_m, p.tiles_n, p.group_m, p.interleave, t);
    if (tc.m_block < lo_block || tc.m_block > hi_block) continue;
    const int r0 = tc.m_block * 128, r1 = min(r0 + 128, p.m);
    if (!wait_partials<Team>(p, epoch, tc, r0, r1)) return false;
    if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_ITEMS, 1);
    sum_partials<T, Team>(p, r0, r1, tc.n_block * BN, min(tc.n_block * BN + BN, p.n), reduced);
    Team::sync();
    if (Team::tid() == 0)
      mk_signal_store(mk_signal_word(ws, ws.rank, GR_TILE + 2 * total + (uint32_t)tc.m_block * p.tiles_n + tc.n_block), epoch);
  }
  for (int t = j; t < total; t += stride) {
    const TileCoord tc = interleaved_tile(tiles_m, p.tiles_n, p.group_m, p.interleave, t);
    const int owner = tc.m_block / blocks_per_rank;
    if (owner == ws.rank) continue;
    const uint64_t t0 = p.trace ? mk_globaltimer() : 0;
    int ok = 1;
    if (Team::tid() == 0) {
      const uint64_t* f = mk_signal_word(ws, owner, GR_TILE + 2 * total + (uint32_t)tc.m_block * p.tiles_n + tc.n_block);
      ok = mk_wait_geq_inline(ws, f, epoch, owner, MK_WAIT_OP_FLAG, p.op);
      mk_trace_add(p.trace, MK_TR_WAIT, mk_globaltimer() - t0);
    }
    if (!Team::and_all(ok)) return false;
    const int r0 = tc.m_block * 128, r1 = min(r0 + 128, p.m);
    const int c0 = tc.n_block * BN, c1 = min(c0 + BN, p.n);
    const int vpr = (c1 - c0) / 8;
    const int nvec = (r1 - r0) * vpr;
    if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_BYTES, (uint64_t)nvec * 32);
    const char* src = reinterpret_cast<const char*>(ws.data[owner]) + p.reduced_offset;
    constexpr int kVectors = 8;  // in flight per thread, as above
    for (int v0 = Team::tid(); v0 < nvec; v0 += kVectors * Team::threads()) {
      int4 piece[kVectors];
#pragma unroll
      for (int u = 0; u < kVectors; ++u) {
        const int v = v0 + u * Team::threads();
        if (v < nvec) piece[u] = *reinterpret_cast<const int4*>(src + ((size_t)(r0 + v / vpr) * p.n + c0 + (v % vpr) * 8) * sizeof(T));
      }
#pragma unroll
      for (int u = 0; u < kVectors; ++u) {
        const int v = v0 + u * Team::threads();
        if (v < nvec)
          *reinterpret_cast<int4*>(reinterpret_cast<char*>(p.c) + ((size_t)(r0 + v / vpr) * p.n + c0 + (v % vpr) * 8) * sizeof(T)) = piece[u];
      }
    }
  }
  return true;
}

template <typename T, int BN, class Team>
__device__ __forceinline__ bool reduce(const GemmReduceParams& p, uint64_t epoch, int j, int stride) {
  return p.two_phase ? reduce_then_gather<T, BN, Team>(p, epoch, j, stride) : reduce_tiles<T, BN, Team>(p, epoch, j, stride);
}

// Without dedicated reduction CTAs, the GEMM CTAs reduce: each CTA's two consumer
// warpgroups (256 threads, the full register budget) run the reduction once their last
// tile is stored and signalled, CTA c taking tiles c, c + grid, ... The GEMM keeps every
// SM; the reduction overlaps only the GEMM's last wave (CTAs finish at different times).
template <typename T, int BN>
struct ReduceAfterGemm : TmaEpilogue<LocalDest, TmaStoreOp, EpochTileSignal> {
  using Base = TmaEpilogue<LocalDest, TmaStoreOp, EpochTileSignal>;
  struct Params : Base::Params {
    const GemmReduceParams* op;
    uint64_t epoch;
  };
  __device__ static void finish(const Params& p, const SlabInfo& s) {
    Base::finish(p, s);  // this warpgroup's last slab stored and signalled
    if (p.op->reduce_ctas == 0) reduce<T, BN, Consumers>(*p.op, p.epoch, blockIdx.x, gridDim.x);
  }
};

template <typename T, int BN>
__device__ __forceinline__ void gemm_reduce(const CUtensorMap* tma_a, const CUtensorMap* tma_b, const CUtensorMap* tma_p,
                                            const GemmReduceParams& p) {
  using Cfg = GemmConfig<T, BN, FusedStages<BN>::value>;
  using Epi = ReduceAfterGemm<T, BN>;
  extern __shared__ __align__(1024) char smem[];
  mk_check_engine_smem<Cfg, Epi>();
  const WorkspaceView& ws = p.ws;
  mk_trace_begin(p.trace, (int)blockIdx.x >= p.compute_ctas);
  const uint64_t epoch = mk_op_epoch_begin(ws, GR_EPOCH);

  if ((int)blockIdx.x < p.compute_ctas) {
    // Peers must have finished reading our previous partials before we overwrite them.
    const bool peers_done = mk_cta_wait_peers(ws, GR_DONE, epoch - 1, ws.rank, MK_WAIT_OP_FLAG, p.op);
    mk_trace_time(p.trace, MK_TR_SETUP);
    if (peers_done) {
      RasterParams sched;
      sched.tiles_m = (p.m + Cfg::BM - 1) / Cfg::BM;
      sched.tiles_n = p.tiles_n;
      sched.group_m = p.group_m > 0 ? p.group_m : 1;
      sched.m_block_base = 0;
      sched.owners = p.interleave;
      NoAWait::Params await{0};
      typename Epi::Params epi;
      epi.dest.tma_c = tma_p;
      epi.signal.flags = mk_signal_word(ws, ws.rank, GR_TILE);
      epi.signal.tiles_n = p.tiles_n;
      epi.signal.epoch = epoch;
      epi.op = &p;
      epi.epoch = epoch;
      gemm_persistent<Cfg, OwnerInterleavedRaster, NoAWait, Epi>(tma_a, tma_b, GemmShape{p.m, p.n, p.k}, sched, await, epi,
                                                         blockIdx.x, p.compute_ctas, smem);
    }
  } else {
    mk_trace_time(p.trace, MK_TR_SETUP);
    reduce<T, BN, CtaTeam>(p, epoch, blockIdx.x - p.compute_ctas, p.reduce_ctas);
  }
  if (p.trace) {
    __syncthreads();  // a GEMM CTA's thread 0 (the producer) finishes before its consumers
    mk_trace_time(p.trace, MK_TR_ROLE);
  }

  // The last CTA to finish advances the epoch and tells every peer we are done reading
  // its partials.
  mk_op_epoch_end(ws, GR_EPOCH, GR_ARRIVE, GR_DONE, epoch);
  mk_trace_time(p.trace, MK_TR_END);
}

}  // namespace gemm_reduce
}  // namespace mk

#define MK_GEMM_REDUCE_ENTRY(NAME, T, BN)                                                               \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                 \
      NAME(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,       \
           const __grid_constant__ CUtensorMap tma_p, const __grid_constant__ GemmReduceParams p) {    \
    mk::gemm_reduce::gemm_reduce<T, BN>(&tma_a, &tma_b, &tma_p, p);                                    \
  }

MK_GEMM_REDUCE_ENTRY(mk_gemm_reduce_bf16_bn256, __nv_bfloat16, 256)
MK_GEMM_REDUCE_ENTRY(mk_gemm_reduce_bf16_bn128, __nv_bfloat16, 128)
MK_GEMM_REDUCE_ENTRY(mk_gemm_reduce_f16_bn256, __half, 256)
MK_GEMM_REDUCE_ENTRY(mk_gemm_reduce_f16_bn128, __half, 128)
