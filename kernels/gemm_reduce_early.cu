// GEMM + ReduceScatter with early sums on one node (mkGemmReduceScatter at BN 256, BM 128,
// more tiles than CTAs): the idle producer warps of each GEMM CTA sum its earlier tiles
// while the GEMM computes the later ones, and the CTA's 12 warps the rest after it. The
// shared parts are in common/gemm_reduce.cuh.
#include "common/gemm_reduce.cuh"

namespace mk { namespace gemm_reduce {

using namespace mk::gemm;

// ---- Early sums (GEMM+RS, the mk_gemm_reduce_early_* kernels) -------------------------
// One node, GEMM CTAs reducing after their GEMM, planned by ops::dense::gemm_reduce::early_items:
// the producer warpgroup's warps 2-3 (idle beside the GEMM once the gate is open) sum the
// first items of the CTA's reducer walk -- at most early_items, never the CTA's last --
// while the GEMM computes the later tiles, and stop at the end of the GEMM; the CTA's 12
// warps sum the rest after it. Loads staged with cp.async in kSideStagingBytes after the
// engine's shared memory (the ring is in use). An item is summed in pieces of kSideRows
// rows; between pieces the side warps look for the end of the GEMM.
// Measured (benches/results/2026-12-03-moe-burst-early-sums-attention.md): GEMM+RS M 1024 / 4096 at 2 ranks 0.866 -> 0.845, 0.881 -> 0.843;
// GEMM+AR M 256 lost (one GEMM tile of time does not cover a tile's sum beside the GEMM,
// whose TMA loads leave the side warps ~4-6 GB/s per CTA), so only ReduceScatter gets
// these kernels, separate entries so that the others' code does not depend on them.
constexpr int kSideRows = 32;  // ops::dense::gemm_reduce::SIDE_ROWS

// Shared between a GEMM CTA's side warps and its warps after the GEMM.
struct EarlySums {
  int items;      // items of the walk the side warps summed (side thread 0 writes it before the CTA barrier)
  int rows;       // rows of the next item they summed (a multiple of kSideRows)
  int gemm_done;  // consumer 0 sets it after its last epilogue: the side warps start no further piece
};

// Shared memory after the engine's: what fits below the 227 KiB beside 1 KiB of static
// shared memory, 16 or 8 KiB, else 0 (ops::dense::gemm_reduce::side_staging_bytes mirrors it).
template <class Cfg, class Epi>
constexpr int side_staging_bytes() {
  constexpr int free = 232448 - 1024 - engine_smem_bytes<Cfg, Epi>();
  return free >= 16384 ? 16384 : (free >= 8192 ? 8192 : 0);
}

// The side warps: true once every rank flagged the slabs of tile tc holding rows [r0, r1)
// (team thread q polls rank q's); false if the GEMM ended first -- the 12 warps then wait
// for it after the GEMM, bounded (wait_partials). No bound is needed here: the GEMM ends
// whatever the peers do (its only wait, the gate's, is bounded). The poll backs off to
// 256 ns between reads.
template <class Team>
__device__ __forceinline__ bool poll_partials(const GemmReduceParams& p, uint64_t epoch, const TileCoord& tc, int r0, int r1,
                                              const volatile int* gemm_done) {
  const WorkspaceView& ws = p.ws;
  const int q = Team::tid();
  for (int ns = 32;; ns = min(2 * ns, 256)) {
    int ready = 1;
    if (q < ws.nranks) {
      for (int slab = 0; slab < 2; ++slab) {
        const int s0 = tc.m_block * 128 + slab * 64;
        if (s0 >= r1 || s0 + 64 <= r0) continue;
        ready &= mk_ld_acquire_sys(slab_flag(p, q, tc, slab)) >= epoch;
      }
    }
    // bar.red orders every thread's acquire before the team's reads of the partials.
    if (Team::and_all(ready)) return true;
    if (!Team::and_all(*gemm_done == 0)) return false;
    __nanosleep(ns);
  }
}

// The side warps' early sums (after the gate opened successfully).
template <typename T, int BN>
__device__ __forceinline__ void early_sums(const GemmReduceParams& p, uint64_t epoch, EarlySums* es, const Staging& staging) {
  using Team = SideWarps;
  int k = 0, rows = 0;
  if (p.row_hi > p.row_lo) {
    const int lo_block = p.row_lo / 128, blocks = (p.row_hi - 1) / 128 - lo_block + 1;
    const int total = blocks * p.tiles_n, j = blockIdx.x, stride = p.compute_ctas;
    const int mine = j < total ? (total - j + stride - 1) / stride : 0;
    const int limit = min(p.early_items, mine - 1);
    const auto partial = [&](int q) { return reinterpret_cast<const char*>(p.ws.data[q]) + p.partial_offset; };
    const volatile int* done = &es->gemm_done;
    bool stop = false;
    for (; k < limit; ++k) {
      const TileCoord tc = owned_tile(p, lo_block, blocks, j + k * stride);
      const int r0 = max(tc.m_block * 128, p.row_lo), r1 = min(min(tc.m_block * 128 + 128, p.row_hi), p.m);
      if (!poll_partials<Team>(p, epoch, tc, r0, r1, done)) break;
      const int c0 = tc.n_block * BN, c1 = min(c0 + BN, p.n);
      for (rows = 0; r0 + rows < r1; rows += kSideRows) {
        if (rows > 0 && !Team::and_all(*done == 0)) {
          stop = true;  // the GEMM is over: the 12 warps take the rest of this item
          break;
        }
        sum_rows<T, Team>(staging, partial, p.ws.nranks, 0, reinterpret_cast<char*>(p.c), p.out_row0, nullptr, p.n, r0 + rows,
                          min(r0 + rows + kSideRows, r1), c0, c1, p.trace);
      }
      if (stop) break;
      rows = 0;
      if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_ITEMS, 1);
    }
  }
  if (Team::tid() == 0) {
    es->items = k;
    es->rows = rows;
    mk_trace_stamp(p.trace, MK_TR_SIDE);
  }
}

// reduce_tiles for the 12 warps after the side warps' early sums: the walk resumes at this
// team's item `first`, from row `first_rows` of its rows (ops::dense::gemm_reduce::team_rest
// mirrors the split).
template <typename T, int BN>
__device__ __forceinline__ bool reduce_tiles_from(const GemmReduceParams& p, uint64_t epoch, int j, int stride, int first,
                                                  int first_rows) {
  using Team = CtaTeam;
  const Staging staging = team_staging<BN, Team>();
  if (p.row_hi <= p.row_lo) return true;
  const int lo_block = p.row_lo / 128, blocks = (p.row_hi - 1) / 128 - lo_block + 1;
  for (int i = j + first * stride, skip = first_rows; i < blocks * p.tiles_n; i += stride, skip = 0) {
    const TileCoord tc = owned_tile(p, lo_block, blocks, i);
    const int r0 = max(tc.m_block * 128, p.row_lo) + skip, r1 = min(min(tc.m_block * 128 + 128, p.row_hi), p.m);
    if (r0 >= r1) continue;
    if (!wait_partials<Team>(p, epoch, tc, r0, r1)) return false;
    if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_ITEMS, 1);
    sum_partials<T, Team>(p, staging, r0, r1, tc.n_block * BN, min(tc.n_block * BN + BN, p.n), nullptr);
  }
  return true;
}

// The early kernels' side warps: warp 2 opens the gate (as ReduceSideWork), then warps 2-3
// sum the CTA's first items (early_sums).
struct EarlySideWork : NoAWait {
  struct Params {
    const GemmReduceParams* op;
    Gate* gate;
    EarlySums* early;
    Staging side;
  };
  __device__ static void before_a_load(const Params&, int, int, int) {}
  __device__ static const CUtensorMap* a_source(const Params&, const CUtensorMap* tma_a, int m_row0, int& row) {
    row = m_row0;
    return tma_a;
  }
};
template <typename T, int BN>
struct EarlySideWorkFor : EarlySideWork {
  __device__ static void side_work(const Params& w, int) {
    const GemmReduceParams& p = *w.op;
    if (threadIdx.x / 32 == 2) open_gate(p, w.gate);
    if (p.early_items > 0) {
      gate_wait(w.gate);  // both warps: the same outcome, so both (named barrier 3) sum or neither
      if (w.gate->ok) early_sums<T, BN>(p, w.gate->epoch, w.early, w.side);
    }
  }
};

// GEMM+RS with early sums (mk_gemm_reduce_early_*: BN 256, BM 128, one node, GEMM CTAs
// reducing after their GEMM -- the host picks these kernels only then, with the side
// staging after the engine's shared memory): gemm_reduce's one-node GEMM CTA path, with
// the side warps summing during the GEMM and the 12 warps resuming after them.
template <typename T, int BN>
__device__ __forceinline__ void gemm_reduce_early(const CUtensorMap* tma_a, const CUtensorMap* tma_b, const CUtensorMap* tma_p,
                                                  const GemmReduceParams& p) {
  using Cfg = GemmConfig<T, BN, FusedStages<BN>::value, SHARE_NONE, kProducerRegs>;
  static_assert(Cfg::STAGES * Cfg::STAGE_BYTES >= kRingStagingBytes<BN>, "ring_staging fits the ring");
  using Epi = PartialEpilogue;
  constexpr int kSide = side_staging_bytes<Cfg, Epi>();
  static_assert(kSide > 0, "the early kernels need side staging");
  extern __shared__ __align__(1024) char smem[];
  mk_check_engine_smem<Cfg, Epi>();
  uint32_t dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  // A plan mismatch (the host launches these on one node, without dedicated or side
  // reducers, with the staging) is a bug: trap rather than reduce wrongly.
  if (dyn_smem < uint32_t(engine_smem_bytes<Cfg, Epi>() + kSide) || p.nodes != 1 || p.reduce_ctas != 0 ||
      p.two_phase || (int)gridDim.x != p.compute_ctas)
    __trap();
  const WorkspaceView& ws = p.ws;
  mk_trace_begin(p.trace, false);

  __shared__ Gate gate;
  __shared__ EarlySums early;
  // The engine's own barrier (after its mbarrier inits) orders these inits before any use.
  if (threadIdx.x == 0) {
    mbar_init(&gate.bar, 1);
    early = EarlySums{0, 0, 0};
  }
  mk_trace_time(p.trace, MK_TR_SETUP);
  RasterParams sched;
  sched.tiles_m = (p.m + Cfg::BM - 1) / Cfg::BM;
  sched.tiles_n = p.tiles_n;
  sched.group_m = p.group_m > 0 ? p.group_m : 1;
  sched.m_block_base = 0;
  sched.owners = p.interleave;
  // The side staging: right after the engine's shared memory (from the ring's 1 KiB-aligned base).
  char* side_base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem) + 1023) & ~uintptr_t(1023)) +
                    (engine_smem_bytes<Cfg, Epi>() - 1024);
  typename EarlySideWorkFor<T, BN>::Params await{&p, &gate, &early, Staging{side_base, kSide}};
  typename Epi::Params epi;
  epi.dest.tma_c = tma_p;
  epi.dest.gate = &gate;
  epi.signal.flags = mk_signal_word(ws, ws.rank, GR_TILE);
  epi.signal.tiles_n = p.tiles_n;
  epi.signal.gate = &gate;
  epi.signal.m = p.m;
  gemm_persistent<Cfg, OwnerInterleavedRaster, EarlySideWorkFor<T, BN>, Epi>(tma_a, tma_b, GemmShape{p.m, p.n, p.k, p.a_box_rows}, sched, await, epi,
                                                                             blockIdx.x, p.compute_ctas, smem);
  // Consumer 0 is past its last epilogue: the side warps start no further piece. "GEMM" in
  // the trace is this moment, not the CTA barrier after the side warps.
  if (threadIdx.x == 128) {
    *reinterpret_cast<volatile int*>(&early.gemm_done) = 1;
    mk_trace_stamp(p.trace, MK_TR_GEMM);
  }
  restore_launch_registers<Cfg>();  // its CTA barrier: the side warps' EarlySums are written
  const uint64_t epoch = gate.epoch;
  if (gate.ok) reduce_tiles_from<T, BN>(p, epoch, blockIdx.x, p.compute_ctas, early.items, early.rows);
  if (MK_TRACED(p.trace)) {
    __syncthreads();
    mk_trace_time(p.trace, MK_TR_ROLE);
  }
  mk_op_epoch_end_readers(ws, GR_EPOCH, GR_ARRIVE, GR_DONE, epoch);
  mk_trace_time(p.trace, MK_TR_END);
}

}  // namespace gemm_reduce
}  // namespace mk

#define MK_GEMM_REDUCE_EARLY_ENTRY(NAME, T)                                                             \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                 \
      NAME(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,       \
           const __grid_constant__ CUtensorMap tma_p, const __grid_constant__ GemmReduceParams p) {    \
    mk::gemm_reduce::gemm_reduce_early<T, 256>(&tma_a, &tma_b, &tma_p, p);                             \
  }


#include "kernel_instances/gemm_reduce_early.inc"  // the entry points: kernels/instances.txt
