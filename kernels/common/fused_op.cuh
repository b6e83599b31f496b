// What every fused kernel shares: its device-side epoch and the end-of-kernel handshake.
//
// A fused op keeps three kinds of words in the signal region (own rank unless noted):
//   epoch_word       the last epoch this rank completed;
//   arrive_word      how many CTAs of the running launch have finished;
//   done_word + q    written by rank q: q finished epoch e of this op (so this rank may
//                    overwrite the buffers q was reading).
// Every CTA reads the epoch at start (mk_op_epoch_begin); the last CTA to finish advances
// it and tells every peer (mk_op_epoch_end). Epochs live on the device, so replays of a
// captured CUDA graph stay in step with direct calls.
#pragma once
#include "gemm/engine.cuh"
#include "signals.cuh"

// Whole CTA: this launch's epoch (last completed + 1).
__device__ __forceinline__ uint64_t mk_op_epoch_begin(const WorkspaceView& ws, uint32_t epoch_word) {
  __shared__ uint64_t epoch_s;
  if (threadIdx.x == 0) epoch_s = mk_ld_acquire_sys(mk_signal_word(ws, ws.rank, epoch_word)) + 1;
  __syncthreads();
  return epoch_s;
}

// Whole CTA, after its work: the last CTA of the grid advances the epoch and raises
// done_word + rank in every peer's region.
__device__ __forceinline__ void mk_op_epoch_end(const WorkspaceView& ws, uint32_t epoch_word, uint32_t arrive_word,
                                                uint32_t done_word, uint64_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    if (mk_arrive_last(mk_signal_word(ws, ws.rank, arrive_word), gridDim.x)) {
      mk_st_release_sys(mk_signal_word(ws, ws.rank, epoch_word), epoch);
      for (int q = 0; q < ws.nranks; ++q)
        if (q != ws.rank) mk_signal_store(mk_signal_word(ws, q, done_word + ws.rank), epoch);
    }
  }
}

// mk_op_epoch_end for an op whose done words only say "this rank finished READING your
// buffers" -- its CTAs never write into a peer's memory (GEMM + ReduceScatter /
// AllReduce: every rank pulls; the only remote stores are the done words themselves).
// The guarantee a peer needs: every read of its buffer by every CTA here happens before
// its next call's writes to that buffer, in causality order:
//   a CTA's reads -> bar.sync -> thread 0's atom.acq_rel.gpu (release) -> the last CTA's
//   same atom (acquire) -> fence.acq_rel.sys + st.relaxed.sys (a release pattern at
//   system scope) -> the peer's ld.acquire.sys of its done word -> the peer's writes.
// Every CTA's fence is at GPU scope (all CTAs of this grid are on this GPU), and only the
// last CTA pays one fence at system scope, for all of its stores (mk_op_epoch_end: a
// fence.sc.sys per CTA, then a fence.sc.sys and a release at system scope per peer, on
// the kernel's critical path: ~3 us of the end at M = 1, benches/results/2026-12-03-courier-and-fa3-attention.md).
// A load has returned its value before the CTA's barrier (its data was summed and stored),
// so no scope stronger than GPU is needed to order the reads themselves.
// Not for ops that write into peers' memory (AG+GEMM's pushes, MoE's sends): there the
// system-scope fence in each writing CTA is what publishes its remote stores.
__device__ __forceinline__ void mk_op_epoch_end_readers(const WorkspaceView& ws, uint32_t epoch_word, uint32_t arrive_word,
                                                        uint32_t done_word, uint64_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long* arrive = reinterpret_cast<unsigned long long*>(mk_signal_word(ws, ws.rank, arrive_word));
    unsigned long long before;
    asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(before) : "l"(arrive) : "memory");
    if (before == gridDim.x - 1) {
      *arrive = 0;  // the next launch starts after this one ends (stream order)
      asm volatile("fence.acq_rel.sys;" ::: "memory");
      mk_st_relaxed_sys(mk_signal_word(ws, ws.rank, epoch_word), epoch);
      for (int q = 0; q < ws.nranks; ++q)
        if (q != ws.rank) mk_st_relaxed_sys(mk_signal_word(ws, q, done_word + ws.rank), epoch);
    }
  }
}

// The threads that run a fused op's data movement, and how they synchronise among
// themselves: a whole CTA, or COUNT threads from FIRST on (whole warps) with their own
// named barrier (e.g. the producer warpgroup's idle warps 32..127 on barrier 3, or the
// consumer warpgroups 128..383 on barrier 4 once the GEMM is done).
struct CtaTeam {
  __device__ static int tid() { return threadIdx.x; }
  __device__ static int threads() { return blockDim.x; }
  __device__ static int and_all(int v) { return __syncthreads_and(v); }
  __device__ static void sync() { __syncthreads(); }
};
template <int FIRST, int COUNT, int BARRIER>
struct WarpTeam {
  static_assert(FIRST % 32 == 0 && COUNT % 32 == 0, "named barriers count whole warps");
  __device__ static int tid() { return threadIdx.x - FIRST; }
  __device__ static int threads() { return COUNT; }
  __device__ static int and_all(int v) { return mk::gemm::named_barrier_and(BARRIER, COUNT, v); }
  __device__ static void sync() { mk::gemm::named_barrier_sync(BARRIER, COUNT); }
};

// Deepest stage ring that fits in 227 KiB beside the TMA epilogue's staging buffers, for
// tiles of BM rows (ops::gemm::fused_stages(bm, bn), checked in mk_check_engine_smem).
template <int BN, int BM = 128>
struct FusedStages : mk::gemm::RingStages<BM, BN, mk::gemm::TmaStoreEpilogue::smem_bytes_per_wg<BN>()> {};

// The ring depth and dynamic shared memory the planner launches a fused engine with
// (ops::gemm::fused_stages and fused_smem_bytes), one specialization per tile rows x width
// it knows, from gemm_planned_tiles.inc (generated from src/ops/gemm/smem.rs, whose test
// keeps it fresh). mk_check_engine_smem, which every fused kernel calls, checks its
// configuration against them at compile time: both formulas stay (this one lays out the
// shared memory, the planner's sizes the launch), and the build fails as soon as they
// disagree, with no GPU. (AG+GEMM and MoE launch with
// ops::gemm::smem_bytes(bn, Tma), equal to fused_smem_bytes(128, bn): ops::dense::gemm_reduce's
// tests check it.)
template <int BM, int BN>
struct PlannedFused;  // no entry: a tile the planner does not know
#define MK_PLANNED_FUSED(BM, BN, STAGES, SMEM_BYTES)               \
  template <>                                                      \
  struct PlannedFused<BM, BN> {                                    \
    static constexpr int stages = STAGES, smem_bytes = SMEM_BYTES; \
  };
#include "gemm_planned_tiles.inc"
#undef MK_PLANNED_FUSED

// Checks the configuration against the planner's (at compile time), and traps when the
// launch gave less dynamic shared memory than the engine needs.
template <class Cfg, class Epi>
__device__ __forceinline__ void mk_check_engine_smem() {
  using Planned = PlannedFused<Cfg::BM, Cfg::BN>;
  static_assert(Cfg::STAGES == Planned::stages, "ops::gemm::fused_stages differs from the kernel's ring depth");
  static_assert(mk::gemm::engine_smem_bytes<Cfg, Epi>() == Planned::smem_bytes,
                "ops::gemm::fused_smem_bytes differs from engine_smem_bytes");
  uint32_t dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < uint32_t(mk::gemm::engine_smem_bytes<Cfg, Epi>())) __trap();
}
