// The scaled fp8 GEMM's persistent loop, shared by every kernel that multiplies fp8 with
// scales: mkScaledGemm (kernels/scaled_gemm.cu), mkAllGatherScaledGemm
// (kernels/ag_scaled_gemm.cu), and mkScaledGemmReduceScatter / mkScaledGemmAllReduce
// (kernels/gemm_reduce_scaled.cu). C[M,N] = (A·sA)(B·sB)ᵀ with A [M,K] and B [N,K] in fp8 (A's
// and B's types are the config's TA and TB: the pairs wgmma_fp8_ops.cuh has, e4m3 x e4m3
// and e5m2 x e4m3), both K-major (fp8 wgmma reads K-major operands only), C bf16 or fp16.
// Both fp8 types are one byte, so the ring, the swizzle and the descriptors do not depend
// on them: only the wgmma instruction does.
//
// Scales (ScaledOperands). Per tensor and rowwise (scale_k_blocks == 0):
// scale_a[r * scale_a_step] scales row r of A, scale_b[n * scale_b_step] row n of B (step 0:
// one scale per tensor, 1: one per row), once, on the fp32 sum. Block scales
// (scale_k_blocks = K / 128, the steps unused): scale_a is [K/128][M] (one per row of A per
// 128 of K), scale_b [K/128][ceil(N/128)] (one per 128 x 128 block of B), row-major (torch's
// layouts for its 1x128 and 128x128 recipes); each 128-wide stage's sums are scaled as they
// are promoted. The three modes share every kernel (a uniform branch).
//
// The structure is the GEMM engine's (engine.cuh): a persistent grid walking tiles in a
// raster order (Sched), a TMA producer thread feeding a ring of stages, two consumer
// warpgroups of 64 rows each, the engine's epilogues, and the engine's hook interface
// (hooks.cuh: AWait::before_a_load in the producer thread, AWait::side_work in the producer
// warpgroup's three idle warps), through which a fused op waits for rows and moves data, and
// the engine's epilogue interface (epilogue.cuh: C itself by default; a fused op's partial
// tiles with a courier raising their flags, Epi::kCourier, in warp 1 of the producer
// warpgroup, the hook's side work then in warps 2-3). It differs in the consumer's
// mainloop, and is kept apart so the engine's kernels stay as they are:
// - a stage holds 128 of K (128 one-byte elements: one 128-byte swizzle row), four wgmma
//   m64nBNk32 per stage;
// - promotion: the fp8 tensor cores accumulate with fewer mantissa bits than fp32 (about 14
//   on Hopper, DeepSeek-V3 §3.3.2), so each stage's four wgmmas start from zero and their
//   sum is added into a separate fp32 array once they are done: every 128 of K, the
//   interval DeepSeek-V3 uses. The wait for those wgmmas leaves no batch in flight across
//   stages; the other consumer warpgroup's wgmmas keep the tensor cores busy meanwhile;
// - per-tensor and rowwise scales multiply the fp32 sums once, before the epilogue:
//   sA[row]·sB[col]·Σ; block scales multiply each stage's sums at their promotion:
//   Σ_kb sA[row][kb]·sB[col/128][kb]·Σ_kb.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>
#include <type_traits>

#include "epilogue.cuh"
#include "hooks.cuh"
#include "ptx.cuh"
#include "scheduler.cuh"
#include "wgmma_fp8_ops.cuh"

namespace mk { namespace gemm {

// PRODUCER_REGS: the producer warpgroup's registers after setmaxnreg; 40 for the TMA thread
// alone, more where its idle warps run a fused op's side work (AWait::side_work). The
// consumers get what is left of 168 per thread.
template <typename TA_, typename TB_, typename TOut_, int BN_, bool TMA_EPI_, int PRODUCER_REGS_ = 40>
struct ScaledConfig {
  using TA = TA_;
  using TB = TB_;
  using TOut = TOut_;
  static constexpr int BM = 128, BN = BN_, BK = 128;  // BK one-byte elements: a 128-byte row
  static constexpr bool TMA_EPI = TMA_EPI_;
  static constexpr int CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1);
  static constexpr int CLUSTER = 1;  // no multicast (restore_launch_registers asks)
  static constexpr int PRODUCER_REGS = PRODUCER_REGS_;
  static constexpr int CONSUMER_REGS = ((THREADS * 168 - 128 * PRODUCER_REGS) / (128 * CONSUMERS)) / 8 * 8;
  static constexpr int A_STAGE_BYTES = BM * BK, B_STAGE_BYTES = BN * BK;
  static constexpr int STAGE_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;
  // The epilogue's staging per consumer warpgroup (TMA: 64 rows x BN two-byte outputs).
  static constexpr int STAGING_PER_WG = TMA_EPI ? 64 * BN * 2 : 0;
  // The deepest ring (at most 8) that fits in 227 KiB beside the staging.
  static constexpr int FIT = (232448 - 1024 - 2 * STAGING_PER_WG - 256) / STAGE_BYTES;
  static constexpr int STAGES = FIT > 8 ? 8 : FIT;
  // 1024 alignment slack, ring, staging, full/empty barriers.
  static constexpr int smem_bytes = 1024 + STAGES * STAGE_BYTES + CONSUMERS * STAGING_PER_WG + 2 * STAGES * 8;
  static_assert(BN == 64 || BN == 128, "wgmma fp8 tile widths: acc and the promoted sums both live in registers");
  static_assert(sizeof(TA) == 1 && sizeof(TB) == 1, "one-byte fp8 operands: BK bytes are BK elements");
  // Block scales: a tile's columns lie in one 128-wide block of B.
  static_assert(128 % BN == 0, "a tile within one block of B's scales");
  static_assert(sizeof(TOut) == 2, "bf16 or fp16 output");
  static_assert(smem_bytes <= 232448, "shared memory");
  static_assert(PRODUCER_REGS % 8 == 0 && CONSUMER_REGS <= 240, "setmaxnreg takes multiples of 8, at most 240");
  static_assert(CONSUMER_REGS >= 2 * (BN / 2) + 64, "two accumulator arrays and addressing in the consumers' registers");
};

template <class Cfg>
using ScaledEpilogue = typename std::conditional<Cfg::TMA_EPI, TmaStoreEpilogue, DirectStoreEpilogue<StoreOp>>::type;

// Dynamic shared memory of a kernel running the loop with epilogue Epi: the config's, and
// the courier's mailboxes after the stage barriers when the epilogue has a courier
// (ops::gemm::scaled::smem_bytes_with_courier mirrors it).
template <class Cfg, class Epi>
constexpr int scaled_smem_bytes() {
  return Cfg::smem_bytes + (Epi::kCourier ? kMailboxBytes : 0);
}

// How the consumers read A's scales. ld.global.nc (__ldg) may only read memory that no one
// writes while the kernel runs: right for a caller's scales (mkScaledGemm), wrong for
// scales that peers push into the workspace during the kernel (AllGather+GEMM), which are
// read through L2 (__ldcg) once the rows' flags have been observed.
enum class ScaleRead { ReadOnly, WrittenDuringKernel };

template <ScaleRead R>
__device__ __forceinline__ float load_scale(const float* p) {
  if constexpr (R == ScaleRead::ReadOnly) return __ldg(p);
  else return __ldcg(p);
}

// The GEMM's sizes and scales (see the top of this file).
struct ScaledOperands {
  void* c;  // C for the direct epilogue (the TMA epilogue writes through tma_c)
  const float* scale_a;
  const float* scale_b;
  int M, N, K;
  int scale_a_step, scale_b_step, scale_k_blocks;
};

// The persistent loop over tiles t = item0, item0 + item_step, ... of the order Sched
// (GroupedRaster, RankRotatedRaster, OwnerInterleavedRaster: RasterParams), with the hooks
// of AWait (hooks.cuh; a_source must return tma_a itself: the consumers index the scales by
// the tile's rows) and the epilogue Epi (epilogue.cuh; TMA staging of Cfg::STAGING_PER_WG per
// consumer warpgroup, a courier in warp 1 when Epi::kCourier).
// Launch: Cfg::THREADS threads, dynamic shared memory scaled_smem_bytes<Cfg, Epi>() (traps
// with less).
template <class Cfg, class Sched, class AWait, class Epi, ScaleRead kScaleARead = ScaleRead::ReadOnly>
__device__ __forceinline__ void scaled_gemm_persistent_with(const CUtensorMap* tma_a, const CUtensorMap* tma_b,
                                                            const typename Epi::Params& epi, const ScaledOperands& op,
                                                            const RasterParams& sched,
                                                            const typename AWait::Params& await, int item0,
                                                            int item_step) {
  using Mma = WgmmaFp8<Cfg::BN, typename Cfg::TA, typename Cfg::TB>;  // A's and B's fp8 types
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, STAGES = Cfg::STAGES;
  static_assert(Epi::template smem_bytes_per_wg<BN>() == Cfg::STAGING_PER_WG, "staging as the planner counts it");
  static_assert(!Epi::kCourier || Cfg::CONSUMERS == 2, "the courier serves two consumer warpgroups");
  extern __shared__ __align__(1024) char smem_raw[];
  uint32_t dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < uint32_t(scaled_smem_bytes<Cfg, Epi>())) __trap();  // host/kernel plan mismatch

  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  char* smem_a = smem;
  char* smem_b = smem_a + STAGES * Cfg::A_STAGE_BYTES;
  char* smem_c = smem_b + STAGES * Cfg::B_STAGE_BYTES;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_c + Cfg::CONSUMERS * Cfg::STAGING_PER_WG);
  uint64_t* empty = full + STAGES;
  uint64_t* mailboxes = empty + STAGES;  // the epilogue courier's (kMailboxBytes), with a courier only

  const int M = op.M, N = op.N;
  const int num_items = sched.tiles_m * sched.tiles_n;
  const int k_blocks = (op.K + BK - 1) / BK;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], Cfg::CONSUMERS * 4);  // one arrival per consumer warp
    }
    if constexpr (Epi::kCourier) {
      for (int c = 0; c < Cfg::CONSUMERS; ++c) {
        mbar_init(&mailboxes[c * kMailboxWords], 1);      // a slab handed to the courier
        mbar_init(&mailboxes[c * kMailboxWords + 1], 1);  // the courier took it
      }
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
      for (int t = item0; t < num_items; t += item_step) {
        const TileCoord tc = Sched::tile(sched, t);
        const int m0 = tc.m_block * BM, n0 = tc.n_block * BN;
        AWait::before_a_load(await, tc.m_block, m0, BM);
        for (int kb = 0; kb < k_blocks; ++kb) {
          mbar_wait(&empty[stage], phase ^ 1);
          // The TMA unit credits each box's full size, the zero fill past M, N or K included.
          mbar_expect_tx(&full[stage], Cfg::STAGE_BYTES);
          int a_row;
          const CUtensorMap* a_map = AWait::a_source(await, tma_a, m0, a_row);
          tma_load_2d(smem_a + stage * Cfg::A_STAGE_BYTES, a_map, &full[stage], kb * BK, a_row);
          tma_load_2d(smem_b + stage * Cfg::B_STAGE_BYTES, tma_b, &full[stage], kb * BK, n0);
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    } else if (Epi::kCourier && threadIdx.x / 32 == 1) {
      // The courier raises the flag of every slab of this CTA's tiles, in their order.
      const int tiles = item0 < num_items ? (num_items - item0 + item_step - 1) / item_step : 0;
      if (threadIdx.x == 32) Epi::courier(epi, mailboxes, tiles);
    } else if (threadIdx.x >= 32) {
      AWait::side_work(await, threadIdx.x - 32);
    }
  } else {
    setmaxnreg_inc<Cfg::CONSUMER_REGS>();
    const int consumer = wg - 1;
    const int thread = threadIdx.x % 128;
    const bool warp_leader = (threadIdx.x % 32) == 0;
    int stage = 0;
    uint32_t phase = 0;
    float acc[BN / 2];  // one stage's wgmma sums (the fp8 tensor cores' accumulator)
    float sum[BN / 2];  // the promoted fp32 sums over every stage so far
    SlabInfo slab;
    slab.M = M;
    slab.N = N;
    slab.consumer = consumer;
    slab.thread = thread;
    slab.smem = smem_c + consumer * Cfg::STAGING_PER_WG;
    slab.mailbox = Epi::kCourier ? mailboxes + consumer * kMailboxWords : nullptr;
    const float* scale_a = op.scale_a;
    const float* scale_b = op.scale_b;
    for (int t = item0; t < num_items; t += item_step) {
      const TileCoord tc = Sched::tile(sched, t);
      slab.tile = tc;
      slab.row0 = tc.m_block * BM + consumer * 64;
      slab.col0 = tc.n_block * BN;
      // A slab wholly at or past row M multiplies only zero fill: it skips its wgmmas but
      // still waits for and releases every stage (the empty barrier counts both consumers'
      // warps) and runs the epilogue, which clips its rows. Warpgroup-uniform.
      const bool live = slab.row0 < M;
      const bool block_scales = op.scale_k_blocks > 0;
      // This thread's two rows (acc_row: r and r + 8) and the tile's column of B's blocks;
      // a stage's scales are a row further (M, and ceil(N/128), floats).
      const int r = slab.row0 + acc_row(0, thread);
      const int n_blocks = (N + 127) / 128;
      const float* block_sa = scale_a + r;
      const float* block_sb = scale_b + slab.col0 / 128;
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) sum[i] = 0.f;
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(&full[stage], phase);
        // Block scales: loaded before the wgmmas, used once they are done.
        float s0 = 1.f, s1 = 1.f;
        if (block_scales && live) {
          const float sb = __ldg(block_sb + (long long)kb * n_blocks);
          s0 = r < M ? load_scale<kScaleARead>(block_sa + (long long)kb * M) * sb : 0.f;
          s1 = r + 8 < M ? load_scale<kScaleARead>(block_sa + (long long)kb * M + 8) * sb : 0.f;
        }
        if (live) {
          const char* a = smem_a + stage * Cfg::A_STAGE_BYTES + consumer * (64 * BK);
          const char* b = smem_b + stage * Cfg::B_STAGE_BYTES;
          wgmma_fence();
#pragma unroll
          for (int k = 0; k < BK / 32; ++k)
            Mma::mma(acc, make_smem_desc_sw128(a + k * 32), make_smem_desc_sw128(b + k * 32), k > 0 ? 1 : 0);
          wgmma_commit();
          wgmma_wait<0>();
          fence_operands(acc);
        }
        // The stage's operands are read: hand the slot back before the promotion's adds.
        if (warp_leader) mbar_arrive(&empty[stage]);
        if (live) {
          if (block_scales) {
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) sum[i] += acc[i] * ((i & 2) ? s1 : s0);
          } else {
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) sum[i] += acc[i];
          }
        }
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
      // C = sA[row] · sB[col] · Σ, in fp32 (per tensor and rowwise; block scales were applied
      // at the promotion). A thread's accumulators cover two rows (acc_row: r and r + 8) and,
      // per 8 columns, one pair (acc_col): elements 4j..4j+3 are (r, c), (r, c+1), (r+8, c),
      // (r+8, c+1). Rows and columns past C take no scale (the epilogue clips them, and their
      // scales may not exist).
      if (!block_scales) {
        const float sa0 = r < M ? load_scale<kScaleARead>(scale_a + (long long)r * op.scale_a_step) : 0.f;
        const float sa1 = r + 8 < M ? load_scale<kScaleARead>(scale_a + (long long)(r + 8) * op.scale_a_step) : 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const int col = slab.col0 + acc_col(4 * j, thread);
          const float sb0 = col < N ? __ldg(scale_b + (long long)col * op.scale_b_step) : 0.f;
          const float sb1 = col + 1 < N ? __ldg(scale_b + (long long)(col + 1) * op.scale_b_step) : 0.f;
          sum[4 * j] = sum[4 * j] * sa0 * sb0;
          sum[4 * j + 1] = sum[4 * j + 1] * sa0 * sb1;
          sum[4 * j + 2] = sum[4 * j + 2] * sa1 * sb0;
          sum[4 * j + 3] = sum[4 * j + 3] * sa1 * sb1;
        }
      }
      Epi::template store<typename Cfg::TOut, BN>(epi, sum, slab);
    }
    Epi::finish(epi, slab);
  }
  __syncwarp();
}

// The loop writing C itself: TMA stores through tma_c, or direct stores into op.c
// (ScaledEpilogue<Cfg>, no courier). Dynamic shared memory Cfg::smem_bytes.
template <class Cfg, class Sched, class AWait, ScaleRead kScaleARead = ScaleRead::ReadOnly>
__device__ __forceinline__ void scaled_gemm_persistent(const CUtensorMap* tma_a, const CUtensorMap* tma_b,
                                                       const CUtensorMap* tma_c, const ScaledOperands& op,
                                                       const RasterParams& sched, const typename AWait::Params& await,
                                                       int item0, int item_step) {
  using Epi = ScaledEpilogue<Cfg>;
  typename Epi::Params epi;
  if constexpr (Cfg::TMA_EPI) {
    epi.dest.tma_c = tma_c;
    epi.signal.unused = 0;
    epi.dest.c = op.c;
    epi.dest.ldc = op.N;
  } else {
    epi.c = op.c;
    epi.ldc = op.N;
  }
  scaled_gemm_persistent_with<Cfg, Sched, AWait, Epi, kScaleARead>(tma_a, tma_b, epi, op, sched, await, item0,
                                                                   item_step);
}

}  // namespace gemm
}  // namespace mk
