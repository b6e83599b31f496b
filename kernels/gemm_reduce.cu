// GEMM + ReduceScatter and GEMM + AllReduce in one persistent kernel (mkGemmReduceScatter,
// mkGemmAllReduce): the GEMM CTAs store partial tiles and then reduce (or dedicated
// reduction CTAs do, with MK_COMM_SMS); one-shot, two-phase and across nodes. The shared
// parts and the protocol are in common/gemm_reduce.cuh.
#include "common/gemm_reduce.cuh"

namespace mk { namespace gemm_reduce {

using namespace mk::gemm;

// BM = 64 (M <= 64, chosen by the host, A's tensor map boxed {64, 64}): the A stages hold
// only the 64 rows the one live consumer reads, so 4 stages fit instead of 3 at BN 256 (8
// at BN 128, as with BM 128): more of B -- all of a small-M GEMM's traffic -- in flight.
// The reduction still works in 128-row blocks (one block: M <= 64).
template <typename T, int BN, int BM = 128>
__device__ __forceinline__ void gemm_reduce(const CUtensorMap* tma_a, const CUtensorMap* tma_b, const CUtensorMap* tma_p,
                                            const GemmReduceParams& p) {
  using Cfg = GemmConfig<T, BN, FusedStages<BN, BM>::value, SHARE_NONE, kProducerRegs, BM>;
  // The reducers stage their loads in the first kRingStagingBytes of the ring
  // (ring_staging): the ring must hold them (BM 64 runs its own, deeper ring).
  static_assert(Cfg::STAGES * Cfg::STAGE_BYTES >= kRingStagingBytes<BN>, "ring_staging fits the ring");
  using Epi = PartialEpilogue;
  using Raster = OwnerInterleavedRaster;
  extern __shared__ __align__(1024) char smem[];
  mk_check_engine_smem<Cfg, Epi>();
  const WorkspaceView& ws = p.ws;
  mk_trace_begin(p.trace, (int)blockIdx.x >= p.compute_ctas);
  uint64_t epoch;

  if ((int)blockIdx.x < p.compute_ctas) {
    __shared__ Gate gate;
    // The engine's own barrier (after its mbarrier inits) orders this init before any use.
    if (threadIdx.x == 0) mbar_init(&gate.bar, 1);
    if (p.nodes > 1) {
      // Across nodes: the whole CTA waits first (thread 0 posts to the proxy) and opens the
      // gate at once. Peers must have finished reading our previous partials before we
      // overwrite them.
      epoch = mk_op_epoch_begin(ws, GR_EPOCH);
      const bool peers_done = mk_cta_wait_peers(ws, GR_DONE, epoch - 1, ws.rank, MK_WAIT_OP_FLAG, p.op,
                                                 p.rank_of + p.node * MK_MAX_PEERS);
      if (peers_done && blockIdx.x == 0 && threadIdx.x == 0) gr_post_net_done(p, epoch);
      if (threadIdx.x == 0) gate_open(&gate, epoch, peers_done);
    }
    // One node: warp 2 opens the gate during the GEMM (ReduceSideWork). "setup" in the
    // trace is the time before the engine starts.
    mk_trace_time(p.trace, MK_TR_SETUP);
    RasterParams sched;
    sched.tiles_m = (p.m + Cfg::BM - 1) / Cfg::BM;
    sched.tiles_n = p.tiles_n;
    sched.group_m = p.group_m > 0 ? p.group_m : 1;
    sched.m_block_base = 0;
    sched.owners = p.interleave;
    typename ReduceSideWorkFor<T, BN>::Params await{&p, &gate};
    typename Epi::Params epi;
    epi.dest.tma_c = tma_p;
    epi.dest.gate = &gate;
    epi.signal.flags = mk_signal_word(ws, ws.rank, GR_TILE);
    epi.signal.tiles_n = p.tiles_n;
    epi.signal.gate = &gate;
    epi.signal.m = p.m;
    // Runs whatever the gate's outcome (a failed gate only stops P's stores and flags): the
    // loads and wgmmas touch nothing a peer reads.
    gemm_persistent<Cfg, Raster, ReduceSideWorkFor<T, BN>, Epi>(tma_a, tma_b, GemmShape{p.m, p.n, p.k, p.a_box_rows}, sched, await, epi,
                                                              blockIdx.x, p.compute_ctas, smem);
    // Without dedicated reduction CTAs, the GEMM CTAs reduce once their
    // GEMM is done: all 12 warps, as CTA c of the grid taking owned tiles c, c + grid, ...
    // The GEMM's stores overlap only its last wave this way (CTAs finish at different
    // times); the side warps, which overlap all of it, measured slower (docs/decisions/0101).
    // restore_launch_registers' CTA barrier comes after warp 2 opened the gate (it opens
    // it before any side work and reaches the barrier only after): every thread reads it.
    restore_launch_registers<Cfg>();
    epoch = gate.epoch;
    if (gate.ok && p.reduce_ctas == 0) {
      mk_trace_time(p.trace, MK_TR_GEMM);
      reduce<T, BN, CtaTeam>(p, epoch, blockIdx.x, p.compute_ctas);
    }
  } else {
    epoch = mk_op_epoch_begin(ws, GR_EPOCH);
    mk_trace_time(p.trace, MK_TR_SETUP);
    reduce<T, BN, CtaTeam>(p, epoch, blockIdx.x - p.compute_ctas, p.reduce_ctas);
  }
  if (MK_TRACED(p.trace)) {
    __syncthreads();  // a GEMM CTA's thread 0 (the producer) finishes before its consumers
    mk_trace_time(p.trace, MK_TR_ROLE);
  }

  // The last CTA to finish advances the epoch and tells every peer we are done reading
  // its partials.
  // Only reads of peers' memory happen here (every rank pulls), so the GPU-scope variant:
  // one system-scope fence, in the last CTA only (fused_op.cuh).
  mk_op_epoch_end_readers(ws, GR_EPOCH, GR_ARRIVE, GR_DONE, epoch);
  mk_trace_time(p.trace, MK_TR_END);
}

}  // namespace gemm_reduce
}  // namespace mk

#define MK_GEMM_REDUCE_ENTRY(NAME, T, BN, BM)                                                           \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                 \
      NAME(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,       \
           const __grid_constant__ CUtensorMap tma_p, const __grid_constant__ GemmReduceParams p) {    \
    mk::gemm_reduce::gemm_reduce<T, BN, BM>(&tma_a, &tma_b, &tma_p, p);                                \
  }


#include "kernel_instances/gemm_reduce.inc"  // the entry points: kernels/instances.txt
