// Scaled fp8 GEMM entry kernels (mkScaledGemm): C[M,N] = (A·sA)(B·sB)ᵀ with A [M,K] in e4m3
// or e5m2 and B [N,K] in e4m3, both K-major, C bf16 or fp16. The loop, the scale modes and
// why it is kept apart from the GEMM engine: kernels/common/gemm/scaled_mainloop.cuh.
//
// Kernel name: mk_scaled_gemm_<a>_<out>_bn<BN>_<epilogue>, a in {e4m3, e5m2} (A's type; B
// is e4m3), out in {bf16, f16}, BN in {64, 128}, epilogue in {tma, direct}. One signature:
//   (CUtensorMap tma_a, CUtensorMap tma_b, CUtensorMap tma_c, void* c, const float* scale_a,
//    const float* scale_b, int M, int N, int K, int group_m, int scale_a_step, int scale_b_step,
//    int scale_k_blocks)
// (the fields of ScaledOperands, and the grouped raster's group).
// Launch: 384 threads, grid = number of CTAs (<= tiles), dynamic shared memory =
// ScaledConfig::smem_bytes, which src/ops/gemm/scaled.rs computes by the same formula (the
// kernel traps when it gets less).
#include "common/gemm/scaled_mainloop.cuh"

namespace mk { namespace gemm {

// One kernel's body: the grouped raster over all of C, no hooks.
template <class Cfg>
__device__ __forceinline__ void scaled_gemm(const CUtensorMap* tma_a, const CUtensorMap* tma_b, const CUtensorMap* tma_c,
                                            const ScaledOperands& op, int group_m) {
  RasterParams sched;
  sched.tiles_m = (op.M + Cfg::BM - 1) / Cfg::BM;
  sched.tiles_n = (op.N + Cfg::BN - 1) / Cfg::BN;
  sched.group_m = group_m > 0 ? group_m : 1;
  sched.m_block_base = 0;
  sched.owners = 1;
  scaled_gemm_persistent<Cfg, GroupedRaster, NoAWait>(tma_a, tma_b, tma_c, op, sched, NoAWait::Params{0}, blockIdx.x,
                                                      gridDim.x);
}

}  // namespace gemm
}  // namespace mk

#define MK_SCALED_GEMM_ENTRY(NAME, TA, TB, TOUT, BN, TMA_EPI)                                                       \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                          \
      NAME(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,                \
           const __grid_constant__ CUtensorMap tma_c, void* c, const float* scale_a, const float* scale_b, int M, \
           int N, int K, int group_m, int scale_a_step, int scale_b_step, int scale_k_blocks) {                 \
    const mk::gemm::ScaledOperands op{c, scale_a, scale_b, M, N, K, scale_a_step, scale_b_step, scale_k_blocks}; \
    mk::gemm::scaled_gemm<mk::gemm::ScaledConfig<TA, TB, TOUT, BN, TMA_EPI>>(&tma_a, &tma_b, &tma_c, op, group_m); \
  }

#include "kernel_instances/scaled_gemm.inc"  // the entry points: kernels/instances.txt
