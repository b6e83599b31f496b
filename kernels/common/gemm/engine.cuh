// mkernel's Hopper GEMM engine: C[M,N] = A[M,K] · B[N,K]ᵀ, bf16/fp16 in and out, fp32
// accumulate, all row-major. Persistent and warp-specialised:
//   warpgroup 0      one producer thread: TMA loads of A (BM x 64) and B (BN x 64) tiles,
//                    128-byte swizzled, into a STAGES-deep ring (full/empty mbarriers);
//   warpgroups 1, 2  consumers: each owns 64 rows of the BM=128 tile, wgmma m64nBNk16 from
//                    shared memory with one batch in flight, then the epilogue policy.
// Compile-time policies make it the core of every fused op:
//   Sched  tile order (scheduler.cuh: GroupedRaster, RankRotatedRaster);
//   AWait  hook before a tile's A rows are loaded (hooks.cuh: NoAWait, FlagAWait);
//   Epi    what happens to each C tile (epilogue.cuh: TmaStoreEpilogue, DirectStoreEpilogue).
// The CTA count is a run-time argument: a fused kernel gives the engine `num_ctas` of its
// CTAs (ids 0..num_ctas-1) and uses the others for communication.
//
// A tile that overhangs M, N or K is handled by TMA: loads zero-fill, stores clip.
//
// Using it in a fused kernel (see kernels/gemm.cu for the plain case):
//   using Cfg = GemmConfig<__nv_bfloat16, 256, 3>;        // T, BN in {64,128,256}, stages
//   using Epi = TmaEpilogue<PeerDest, TmaAddOp, MySignal>; // or TmaStoreEpilogue, DirectStoreEpilogue<Op>
//   extern "C" __global__ void __launch_bounds__(Cfg::THREADS, 1) my_fused(const __grid_constant__ CUtensorMap ta,
//       const __grid_constant__ CUtensorMap tb, const __grid_constant__ MyParams p) {
//     extern __shared__ __align__(1024) char smem[];
//     if (blockIdx.x >= p.gemm_ctas) { communication_role(p); return; }   // CTA-count split
//     gemm_persistent<Cfg, RankRotatedRaster, MyAWait, Epi>(&ta, &tb, GemmShape{M, N, K}, p.raster,
//         p.wait, p.epi, blockIdx.x, p.gemm_ctas, smem);
//   }
// launched with Cfg::THREADS threads and engine_smem_bytes<Cfg, Epi>() dynamic shared
// memory (Rust: ops::gemm::engine_smem_bytes). Tensor maps that the engine or an epilogue
// reads must live in kernel parameter space (__grid_constant__) or global memory.
// Named barriers 1 and 2 belong to the consumer warpgroups' epilogues.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include "epilogue.cuh"
#include "hooks.cuh"
#include "ptx.cuh"
#include "scheduler.cuh"
#include "wgmma_ops.cuh"

namespace mk { namespace gemm {

template <typename T_, int BN_, int STAGES_>
struct GemmConfig {
  using T = T_;
  static constexpr int BM = 128;
  static constexpr int BN = BN_;
  static constexpr int BK = 64;  // 64 x 2 bytes = one 128-byte swizzle row
  static constexpr int STAGES = STAGES_;
  static constexpr int CONSUMERS = 2;
  static constexpr int THREADS = 128 * (CONSUMERS + 1);
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = 232;
  static constexpr int A_STAGE_BYTES = BM * BK * 2;
  static constexpr int B_STAGE_BYTES = BN * BK * 2;
  static constexpr int STAGE_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;
  static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma N");
  static_assert(sizeof(T) == 2, "16-bit inputs");
};

// Shared memory the engine needs for a config and epilogue (plus 1024 for alignment slack).
template <class Cfg, class Epi>
__host__ __device__ constexpr int engine_smem_bytes() {
  return 1024 + Cfg::STAGES * Cfg::STAGE_BYTES + Cfg::CONSUMERS * Epi::template smem_bytes_per_wg<Cfg::BN>() +
         2 * Cfg::STAGES * 8;
}

struct GemmShape {
  int M, N, K;
};

// Runs the engine in one CTA of a kernel launched with Cfg::THREADS threads and
// __launch_bounds__(Cfg::THREADS, 1). `smem` is the dynamic shared memory
// (engine_smem_bytes<Cfg, Epi>() bytes). tma_a / tma_b point at __grid_constant__ tensor
// maps: A dims {K, M}, B dims {K, N}, boxes {64, 128} / {64, BN}, SWIZZLE_128B.
template <class Cfg, class Sched, class AWait, class Epi>
__device__ __forceinline__ void gemm_persistent(const CUtensorMap* tma_a, const CUtensorMap* tma_b, GemmShape shape,
                                                const typename Sched::Params& sched,
                                                const typename AWait::Params& await,
                                                const typename Epi::Params& epi, int cta, int num_ctas,
                                                char* smem_raw) {
  using T = typename Cfg::T;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, STAGES = Cfg::STAGES;
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  char* smem_a = smem;
  char* smem_b = smem_a + STAGES * Cfg::A_STAGE_BYTES;
  char* smem_c = smem_b + STAGES * Cfg::B_STAGE_BYTES;
  constexpr int C_WG_BYTES = Epi::template smem_bytes_per_wg<BN>();
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_c + Cfg::CONSUMERS * C_WG_BYTES);
  uint64_t* empty = full + STAGES;

  const int wg = threadIdx.x / 128;
  const int tiles_m = (shape.M + BM - 1) / BM;
  const int tiles_n = (shape.N + BN - 1) / BN;
  const int num_tiles = tiles_m * tiles_n;
  const int k_blocks = (shape.K + BK - 1) / BK;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], Cfg::CONSUMERS * 4);  // one arrival per consumer warp
    }
    fence_mbar_init();
  }
  __syncthreads();

  if (wg == 0) {
    setmaxnreg_dec<Cfg::PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      prefetch_tensor_map(tma_a);
      prefetch_tensor_map(tma_b);
      int stage = 0;
      uint32_t phase = 0;
      for (int t = cta; t < num_tiles; t += num_ctas) {
        const TileCoord tc = Sched::tile(sched, t);
        const int m0 = tc.m_block * BM, n0 = tc.n_block * BN;
        AWait::before_a_load(await, tc.m_block, m0, BM);
        for (int kb = 0; kb < k_blocks; ++kb) {
          mbar_wait(&empty[stage], phase ^ 1);
          mbar_expect_tx(&full[stage], Cfg::STAGE_BYTES);
          tma_load_2d(smem_a + stage * Cfg::A_STAGE_BYTES, tma_a, &full[stage], kb * BK, m0);
          tma_load_2d(smem_b + stage * Cfg::B_STAGE_BYTES, tma_b, &full[stage], kb * BK, n0);
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
  } else {
    setmaxnreg_inc<Cfg::CONSUMER_REGS>();
    const int consumer = wg - 1;
    const int thread = threadIdx.x % 128;
    const bool warp_leader = (threadIdx.x % 32) == 0;
    int stage = 0;
    uint32_t phase = 0;
    float acc[BN / 2];
    SlabInfo slab;
    slab.M = shape.M;
    slab.N = shape.N;
    slab.consumer = consumer;
    slab.thread = thread;
    slab.smem = smem_c + consumer * C_WG_BYTES;
    for (int t = cta; t < num_tiles; t += num_ctas) {
      const TileCoord tc = Sched::tile(sched, t);
      int prev = -1;
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(&full[stage], phase);
        const char* a = smem_a + stage * Cfg::A_STAGE_BYTES + consumer * (64 * BK * 2);
        const char* b = smem_b + stage * Cfg::B_STAGE_BYTES;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BK / 16; ++k) {
          Wgmma<BN, T>::mma(acc, make_smem_desc_sw128(a + k * 32), make_smem_desc_sw128(b + k * 32),
                            (kb > 0 || k > 0) ? 1 : 0);
        }
        wgmma_commit();
        wgmma_wait<1>();  // the previous k-block's batch is done: release its stage
        if (prev >= 0 && warp_leader) mbar_arrive(&empty[prev]);
        prev = stage;
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
      wgmma_wait<0>();
      fence_operands(acc);
      if (warp_leader) mbar_arrive(&empty[prev]);
      slab.tile = tc;
      slab.row0 = tc.m_block * BM + consumer * 64;
      slab.col0 = tc.n_block * BN;
      Epi::template store<T, BN>(epi, acc, slab);
    }
    Epi::finish(epi, slab);
  }
}

}  // namespace gemm
}  // namespace mk
