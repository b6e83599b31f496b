// Plain GEMM entry kernels (mkGemm): the engine of kernels/common/gemm with the grouped
// raster, no A wait and either the TMA-store or the direct-store epilogue.
//
// Kernel name: mk_gemm_<dtype>_bn<BN>_<epilogue>[_c2a|_c2b][_bm64][_splitk], dtype in
// {bf16, f16}, BN in {64, 128, 256}, epilogue in {tma, direct}; _c2a/_c2b: 2-CTA cluster
// sharing A/B; _bm64: 64-row tiles (A map box {64, 64}); _splitk: the CTAs of a cluster
// (cluster dims (S,1,1), 2 <= S <= 8, S <= the K blocks) split K and CTA 0 adds the
// partials in rank order. All share one signature (unused arguments are ignored):
//   (CUtensorMap tma_a, CUtensorMap tma_b, CUtensorMap tma_c, void* c, int M, int N, int K,
//    int group_m)
// Launch: 384 threads, grid = number of CTAs (<= tiles x S), dynamic shared memory =
// mk_gemm_smem_bytes as computed by src/ops/gemm.rs (checked here).
#include <type_traits>

#include "common/gemm/engine.cuh"

namespace mk { namespace gemm {

// Deepest ring that fits in 227 KiB next to the epilogue's staging buffers and, for
// split-K, the fp32 partial slabs (counted as staging: half per consumer warpgroup).
template <int BM, int BN, bool TMA_EPI, bool SPLIT_K>
struct PlainStages : RingStages<BM, BN, (TMA_EPI ? 64 * BN * 2 : 0) + (SPLIT_K ? BM / 64 * 64 * BN * 4 / 2 : 0)> {};

template <typename T, int BN, bool TMA_EPI, int SHARE = SHARE_NONE, int BM = 128, bool SPLIT_K = false>
__device__ __forceinline__ void plain_gemm(const CUtensorMap* tma_a, const CUtensorMap* tma_b,
                                           const CUtensorMap* tma_c, void* c, int M, int N, int K, int group_m) {
  using Cfg = GemmConfig<T, BN, PlainStages<BM, BN, TMA_EPI, SPLIT_K>::value, SHARE, 40, BM, SPLIT_K>;
  using Epi = typename std::conditional<TMA_EPI, TmaStoreEpilogue, DirectStoreEpilogue<StoreOp>>::type;
  extern __shared__ __align__(1024) char smem[];
  uint32_t dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < uint32_t(engine_smem_bytes<Cfg, Epi>())) __trap();  // host/kernel plan mismatch
  // Every CTA of a split-K cluster needs a K block (the host plans S <= K / 64).
  if (SPLIT_K && (int)cluster_nctarank() > (K + Cfg::BK - 1) / Cfg::BK) __trap();

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
  } else {
    epi.c = c;
    epi.ldc = N;
  }
  gemm_persistent<Cfg, GroupedRaster, NoAWait, Epi>(tma_a, tma_b, GemmShape{M, N, K}, sched, await, epi,
                                                     blockIdx.x, gridDim.x, smem);
}

}  // namespace gemm
}  // namespace mk

#define MK_GEMM_ENTRY_FULL(NAME, T, BN, TMA_EPI, SHARE, BM, SPLIT_K)                                    \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                 \
      NAME(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,       \
           const __grid_constant__ CUtensorMap tma_c, void* c, int M, int N, int K, int group_m) {     \
    mk::gemm::plain_gemm<T, BN, TMA_EPI, SHARE, BM, SPLIT_K>(&tma_a, &tma_b, &tma_c, c, M, N, K, group_m); \
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
