// fp8 GEMM + ReduceScatter and GEMM + AllReduce in one persistent kernel
// (mkScaledGemmReduceScatter, mkScaledGemmAllReduce): every rank multiplies its K slice of A
// and B, both e4m3 with their fp32 scales, with the scaled GEMM's mainloop
// (kernels/common/gemm/scaled_mainloop.cuh: fp32 sums promoted every 128 of K, scaled as the
// mode says), rounds each partial tile once to C's type (bf16 or fp16) into P, and the n
// partials are summed in fp32 in rank order by the reducers of mkGemmReduceScatter /
// mkGemmAllReduce (kernels/common/gemm_reduce.cuh), unchanged: the same start gate, slab
// flags, signal words (GR_*), one-shot and two-phase walks, and the same end.
//
// What differs from kernels/gemm_reduce.cu is the GEMM only: the scaled mainloop in place
// of the bf16 engine, with the bf16 kernels' partial-tile epilogue (PartialEpilogue: TMA
// stores into P behind the start gate, each 64-row slab flagged by the courier, warp 1 of
// the producer warpgroup) and their side-warp hook (warp 2 opens the gate beside the
// GEMM). One node; 128-row tiles only (a 64-row slab past M skips its wgmmas, as in
// mkScaledGemm); no early sums (the scaled ring fills the shared memory they stage in).
//
// Kernel name: mk_gemm_reduce_scaled_e4m3_<out>_bn<BN>, out in {bf16, f16}, BN in {64, 128}.
// Signature: (CUtensorMap tma_a, tma_b, tma_p over P, ScaledGemmReduceParams p). Launch: 384
// threads, grid = p.gr.compute_ctas + p.gr.reduce_ctas, dynamic shared memory =
// scaled_smem_bytes<Cfg, PartialEpilogue>() (ops::gemm::scaled::smem_bytes_with_courier,
// the same formula).
#include "common/gemm_reduce.cuh"
#include "common/gemm/scaled_mainloop.cuh"

namespace mk { namespace gemm_reduce_scaled {

using namespace mk::gemm;
using namespace mk::gemm_reduce;

template <typename TAB, typename TOut, int BN>
__device__ __forceinline__ void scaled_gemm_reduce(const CUtensorMap* tma_a, const CUtensorMap* tma_b,
                                                   const CUtensorMap* tma_p, const ScaledGemmReduceParams& sp) {
  // The producer warpgroup keeps 80 registers (the gate's wait), the consumers 208: the two
  // accumulator arrays and addressing, as in mkAllGatherScaledGemm.
  using Cfg = ScaledConfig<TAB, TAB, TOut, BN, true, kProducerRegs>;
  using Epi = PartialEpilogue;
  using Hook = ReduceSideWorkFor<TOut, BN>;
  // The reducers stage their loads in the first kRingStagingBytes of the ring (ring_staging,
  // laid out for the bf16 engine's ring of the same width): the scaled ring must hold them.
  static_assert(Cfg::STAGES * Cfg::STAGE_BYTES >= kRingStagingBytes<BN>, "ring_staging fits the ring");
  const GemmReduceParams& p = sp.gr;
  const WorkspaceView& ws = p.ws;
  // A plan mismatch (the host launches this kernel on one node only) is a bug: trap rather
  // than reduce wrongly.
  if (p.nodes != 1 || p.early_items != 0) __trap();
  uint64_t epoch;

  if ((int)blockIdx.x < p.compute_ctas) {
    __shared__ Gate gate;
    // The mainloop's own barrier (after its mbarrier inits) orders this init before any use.
    if (threadIdx.x == 0) mbar_init(&gate.bar, 1);
    RasterParams sched;
    sched.tiles_m = (p.m + Cfg::BM - 1) / Cfg::BM;
    sched.tiles_n = p.tiles_n;
    sched.group_m = p.group_m > 0 ? p.group_m : 1;
    sched.m_block_base = 0;
    sched.owners = p.interleave;
    const typename Hook::Params await{&p, &gate};
    typename Epi::Params epi;
    epi.dest.tma_c = tma_p;
    epi.dest.gate = &gate;
    epi.signal.flags = mk_signal_word(ws, ws.rank, GR_TILE);
    epi.signal.tiles_n = p.tiles_n;
    epi.signal.gate = &gate;
    epi.signal.m = p.m;
    const ScaledOperands op{nullptr,
                            reinterpret_cast<const float*>(sp.scale_a),
                            reinterpret_cast<const float*>(sp.scale_b),
                            p.m,
                            p.n,
                            p.k,
                            sp.scale_a_step,
                            sp.scale_b_step,
                            sp.scale_k_blocks};
    // Runs whatever the gate's outcome (a failed gate only stops P's stores and flags): the
    // loads and wgmmas touch nothing a peer reads.
    scaled_gemm_persistent_with<Cfg, OwnerInterleavedRaster, Hook, Epi>(tma_a, tma_b, epi, op, sched, await,
                                                                        blockIdx.x, p.compute_ctas);
    // The CTA's 12 warps reduce once its GEMM is done (kernels/gemm_reduce.cu says why not
    // beside it); restore_launch_registers' CTA barrier comes after warp 2 opened the gate.
    restore_launch_registers<Cfg>();
    epoch = gate.epoch;
    if (gate.ok && p.reduce_ctas == 0) reduce<TOut, BN, CtaTeam>(p, epoch, blockIdx.x, p.compute_ctas);
  } else {
    // MK_COMM_SMS: a dedicated reduction CTA, as in kernels/gemm_reduce.cu.
    epoch = mk_op_epoch_begin(ws, GR_EPOCH);
    reduce<TOut, BN, CtaTeam>(p, epoch, blockIdx.x - p.compute_ctas, p.reduce_ctas);
  }
  // The last CTA to finish advances the epoch and tells every peer we are done reading its
  // partials (only reads of peers' memory happen here: fused_op.cuh's readers' end).
  mk_op_epoch_end_readers(ws, GR_EPOCH, GR_ARRIVE, GR_DONE, epoch);
}

}  // namespace gemm_reduce_scaled
}  // namespace mk

#define MK_GEMM_REDUCE_SCALED_ENTRY(NAME, TAB, TOUT, BN)                                                  \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                   \
      NAME(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,         \
           const __grid_constant__ CUtensorMap tma_p, const __grid_constant__ ScaledGemmReduceParams p) { \
    static_assert(std::is_same<TAB, __nv_fp8_e4m3>::value, "its instances multiply e4m3 A and B");      \
    mk::gemm_reduce_scaled::scaled_gemm_reduce<TAB, TOUT, BN>(&tma_a, &tma_b, &tma_p, p);               \
  }

#include "kernel_instances/gemm_reduce_scaled.inc"  // the entry points: kernels/instances.txt
