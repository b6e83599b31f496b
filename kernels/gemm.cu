// Plain GEMM entry kernels (mkGemm): the engine of kernels/common/gemm with the grouped
// raster, no A wait and either the TMA-store or the direct-store epilogue.
//
// Kernel name: mk_gemm_<dtype>_bn<BN>_<epilogue>[_c2a|_c2b][_bm64][_splitk], dtype in
// {bf16, f16}, BN in {64, 128, 224, 256}, epilogue in {tma, direct}; _c2a/_c2b: 2-CTA cluster
// sharing A/B; _bm64: 64-row tiles (A map box {64, 64}); _splitk: the CTAs of a cluster
// (cluster dims (S,1,1), 2 <= S <= 8, S <= the K blocks) split K and CTA 0 adds the
// partials in rank order. All share one signature (unused arguments are ignored):
//   (CUtensorMap tma_a, CUtensorMap tma_b, CUtensorMap tma_c, void* c, int M, int N, int K,
//    int group_m)
// Launch: 384 threads, grid = number of CTAs (<= tiles x S), dynamic shared memory =
// mk_gemm_smem_bytes as computed by src/ops/gemm/engine.rs (checked here).
#include <type_traits>

#include "common/gemm/engine.cuh"

namespace mk { namespace gemm {

// Deepest ring that fits in 227 KiB next to the epilogue's staging buffers and, for
// split-K, the fp32 partial slabs (counted as staging: half per consumer warpgroup).
template <int BM, int BN, bool TMA_EPI, bool SPLIT_K>
struct PlainStages
    : RingStages<BM, BN,
                 (TMA_EPI ? TmaStoreEpilogue::smem_bytes_per_wg<BN>() : 0) + (SPLIT_K ? BM / 64 * 64 * BN * 4 / 2 : 0)> {};

// The ring depth and dynamic shared memory the planner launches a tile with
// (ops::gemm::tile_stages and tile_smem_bytes), one specialization per tile rows x width x
// split-K x epilogue it knows, from gemm_planned_tiles.inc (generated from
// src/ops/gemm/smem.rs, whose test keeps it fresh). Every kernel checks them against its
// own PlainStages and engine_smem_bytes at compile time: both formulas stay (this one lays
// out the shared memory, the planner's sizes the launch), and the build fails as soon as
// they disagree, with no GPU.
template <int BM, int BN, bool TMA_EPI, bool SPLIT_K>
struct PlannedTile;  // no entry: a tile the planner does not know
#define MK_PLANNED_TILE(BM, BN, TMA_EPI, SPLIT_K, STAGES, SMEM_BYTES) \
  template <>                                                        \
  struct PlannedTile<BM, BN, TMA_EPI, SPLIT_K> {                     \
    static constexpr int stages = STAGES, smem_bytes = SMEM_BYTES;   \
  };
#include "gemm_planned_tiles.inc"
#undef MK_PLANNED_TILE

template <typename T, int BN, bool TMA_EPI, int SHARE = SHARE_NONE, int BM = 128, bool SPLIT_K = false>
__device__ __forceinline__ void plain_gemm(const CUtensorMap* tma_a, const CUtensorMap* tma_b,
                                           const CUtensorMap* tma_c, void* c, int M, int N, int K, int group_m,
                                           int a_box_rows) {
  using Cfg = GemmConfig<T, BN, PlainStages<BM, BN, TMA_EPI, SPLIT_K>::value, SHARE, 40, BM, SPLIT_K>;
  using Epi = typename std::conditional<TMA_EPI, TmaStoreEpilogue, DirectStoreEpilogue<StoreOp>>::type;
  using Planned = PlannedTile<BM, BN, TMA_EPI, SPLIT_K>;
  static_assert(Cfg::STAGES == Planned::stages, "ops::gemm::tile_stages differs from PlainStages");
  static_assert(engine_smem_bytes<Cfg, Epi>() == Planned::smem_bytes,
                "ops::gemm::tile_smem_bytes differs from engine_smem_bytes");
  extern __shared__ __align__(1024) char smem[];
  uint32_t dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < uint32_t(engine_smem_bytes<Cfg, Epi>())) __trap();  // host/kernel plan mismatch
  // Every CTA of a split-K cluster needs a K block (the host plans S <= K / 64).
  if (SPLIT_K && (int)cluster_nctarank() > (K + Cfg::BK - 1) / Cfg::BK) __trap();
  // The A box the host made (ops::gemm::GemmPlan::a_box_rows): min(M, the rows a CTA loads).
  if (a_box_rows < 1 || a_box_rows > Cfg::A_LOAD_ROWS || (a_box_rows < Cfg::A_LOAD_ROWS && a_box_rows != M)) __trap();

  RasterParams sched;
  sched.tiles_m = (M + Cfg::BM - 1) / Cfg::BM;
  sched.tiles_n = (N + BN - 1) / BN;
  if (SHARE == SHARE_B) sched.tiles_m = (sched.tiles_m + 1) / 2;  // the raster walks cluster tiles
  if (SHARE == SHARE_A) sched.tiles_n = (sched.tiles_n + 1) / 2;
  sched.group_m = group_m > 0 ? group_m : 1;
  sched.m_block_base = 0;
  sched.owners = 1;
  NoAWait::Params await{0};
  typename Epi::Params epi;
  if constexpr (TMA_EPI) {
    epi.dest.tma_c = tma_c;
    epi.signal.unused = 0;
    epi.dest.c = c;  // the columns of a 224-wide tile past its three boxes
    epi.dest.ldc = N;
  } else {
    epi.c = c;
    epi.ldc = N;
  }
  gemm_persistent<Cfg, GroupedRaster, NoAWait, Epi>(tma_a, tma_b, GemmShape{M, N, K, a_box_rows}, sched, await, epi,
                                                     blockIdx.x, gridDim.x, smem);
}

}  // namespace gemm
}  // namespace mk

#define MK_GEMM_ENTRY_FULL(NAME, T, BN, TMA_EPI, SHARE, BM, SPLIT_K)                                    \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                 \
      NAME(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,       \
           const __grid_constant__ CUtensorMap tma_c, void* c, int M, int N, int K, int group_m,      \
           int a_box_rows) {                                                                           \
    mk::gemm::plain_gemm<T, BN, TMA_EPI, SHARE, BM, SPLIT_K>(&tma_a, &tma_b, &tma_c, c, M, N, K, group_m,   \
                                                              a_box_rows);                             \
  }
#define MK_GEMM_ENTRY_SHARE(NAME, T, BN, TMA_EPI, SHARE) MK_GEMM_ENTRY_FULL(NAME, T, BN, TMA_EPI, SHARE, 128, false)
#define MK_GEMM_ENTRY(NAME, T, BN, TMA_EPI) MK_GEMM_ENTRY_SHARE(NAME, T, BN, TMA_EPI, mk::gemm::SHARE_NONE)
// MK_GEMM_ENTRY_SHARE's 2-CTA clusters use TMA multicast (launch with cluster dims (2,1,1),
// even grid): _c2b share B (pairs of m-blocks), _c2a share A (pairs of n-blocks).
// MK_GEMM_ENTRY_TILE(NAME, T, BN, TMA_EPI, BM, SPLIT_K): no multicast, BM-row tiles,
// split-K clusters or none.
#define MK_GEMM_ENTRY_TILE(NAME, T, BN, TMA_EPI, BM, SPLIT_K) \
  MK_GEMM_ENTRY_FULL(NAME, T, BN, TMA_EPI, mk::gemm::SHARE_NONE, BM, SPLIT_K)

#include "kernel_instances/gemm.inc"  // the entry points: kernels/instances.txt
