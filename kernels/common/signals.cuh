// Signals between ranks: epoch-valued flags in the symmetric workspace, written with
// release and read with acquire at system scope, and bounded waits.
//
// Every flag only ever grows (it holds a step number), so nothing is reset between calls:
// a waiter asks "has this flag reached step s?". Every wait is bounded by the
// communicator's timeout (ws.timeout_ns of %globaltimer; 17/16 of it for a downstream wait
// on a flag this rank's own CTAs post: see MkWaitChecks). A wait that gives up
//   - records an error word in the rank's host-mapped CommStatus (first error wins; the
//     host reads it in mkCommGetAsyncError and refuses new ops afterwards),
//   - raises the abort word in every rank's signal region (its own too), so every other
//     CTA of every rank stops at its next wait instead of waiting out its own timeout,
//   - returns false; the caller's CTA must then leave the kernel.
// A wait that sees a raised abort word (or mkCommAbort's host abort word) records
// mkRemoteError (or mkInvalidUsage for a local abort) and returns false the same way.
//
// Fused kernels use the same helpers: mk_signal_word() for a flag, mk_cta_signal_peers()
// / mk_signal_store() to post one, mk_cta_wait() / mk_wait_geq() to wait, and the
// MK_SIG_OP_BASE.. words of the signal region for their own flags.
#pragma once
#include <stdint.h>
#include "mk_kernel_abi.h"
#include "mkernel.h"

// The signal-region layout (MK_SIG_* word indexes and each op's range), the operation codes
// (MK_OP_*) and wait codes (MK_WAIT_*) come from mk_kernel_abi.h (src/kernel_abi.rs); the
// result codes (mkTimeout, ...) from mkernel.h.

// ---- error words (decoded by ops::collectives::ErrorWord on the host) ----
// bits 0-7 mkResult_t code, 8-15 peer rank (0xff: none), 16-23 what was awaited, 24-31 op.

__device__ __forceinline__ uint32_t mk_error_word(uint32_t code, uint32_t peer, uint32_t what, uint32_t op) {
  return (code & 0xff) | ((peer & 0xff) << 8) | ((what & 0xff) << 16) | ((op & 0xff) << 24);
}

// ---- memory-model primitives ----
__device__ __forceinline__ uint64_t mk_ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t mk_ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t mk_ld_relaxed_sys_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void mk_st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// GPU scope: for flags between the CTAs of one kernel on one GPU (no peer reads them).
__device__ __forceinline__ uint64_t mk_ld_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t mk_ld_relaxed_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void mk_st_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// Who shares a flag: the system (peers, the host) or only this GPU's CTAs.
enum class MkScope { Sys, Gpu };
template <MkScope S>
__device__ __forceinline__ uint64_t mk_ld_acquire(const uint64_t* p) {
  if constexpr (S == MkScope::Gpu) return mk_ld_acquire_gpu(p);
  else return mk_ld_acquire_sys(p);
}
template <MkScope S>
__device__ __forceinline__ uint64_t mk_ld_relaxed(const uint64_t* p) {
  if constexpr (S == MkScope::Gpu) return mk_ld_relaxed_gpu(p);
  else return mk_ld_relaxed_sys(p);
}
__device__ __forceinline__ void mk_st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t mk_globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Word `index` of `rank`'s signal region, as mapped in this rank.
__device__ __forceinline__ uint64_t* mk_signal_word(const WorkspaceView& ws, int rank, uint32_t index) {
  return reinterpret_cast<uint64_t*>(ws.signals[rank]) + index;
}

// "The last to arrive resets the counter", for a counter word (in a signal region) that is
// zero between launches: adds `amount` (one thread per arrival) and is true for the
// arrival that completes `total`, which has set the counter back to zero -- a plain store:
// the next launch starts after this one ends (stream order), and every other arrival of
// this one is in. The caller orders what its arrival announces before it (a fence); an
// arrival with acq_rel ordering of its own (mk_op_epoch_end_readers) keeps its own atomic.
__device__ __forceinline__ bool mk_arrive_last(uint64_t* counter, unsigned long long total, unsigned long long amount = 1) {
  unsigned long long* c = reinterpret_cast<unsigned long long*>(counter);
  if (atomicAdd(c, amount) + amount != total) return false;
  *c = 0;
  return true;
}

__device__ __forceinline__ CommStatus* mk_status(const WorkspaceView& ws) {
  return reinterpret_cast<CommStatus*>(ws.status);
}

// Records `word` (nonzero) as this rank's error unless one is already recorded. The status
// block is host memory (cuMemHostAlloc), where a device atomic is not atomic on hosts without
// native PCIe atomics (x86: compute-sanitizer reports atomicCAS_system there as an invalid
// access), so the first error is chosen by a CAS on the low half of a device word of this
// rank's signal region (only this rank's kernels write it; the region is zeroed with the
// communicator, and errors are sticky), and every caller then stores the winner's word into
// the status block: the same value, so the order of those stores does not matter.
// Branch-free and 32-bit on purpose: this is inlined into the bounded waits of register-
// tight GEMM producer warps (after setmaxnreg), where a 64-bit CAS and a branch around
// the store make ptxas spill (mk_ag_gemm_*, the ring-attention trace kernels).
// `own_signals` is word 0 of this rank's signal region (mk_signal_word(ws, ws.rank, 0)):
// waiters already hold it, and recomputing it from ws.signals[ws.rank] costs registers.
__device__ __forceinline__ void mk_record_error_at(const WorkspaceView& ws, uint64_t* own_signals, uint32_t word) {
  unsigned int* claim = reinterpret_cast<unsigned int*>(own_signals + MK_SIG_ERROR_CLAIM);
  const unsigned int first = atomicCAS(claim, 0u, word);
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(&mk_status(ws)->error), "r"(first == 0u ? word : first) : "memory");
  __threadfence_system();
}

// The progress word of `peer` that a timed-out wait of `op` records beside its flag, or
// null: only the MoE dispatch keeps one (kernel_abi MOE_PROGRESS, one node), and a wait
// for this rank's own flag learns nothing from this rank's.
__device__ __forceinline__ const uint64_t* mk_peer_progress_word(const WorkspaceView& ws, uint32_t op, int peer) {
  if (op != MK_OP_MOE_DISPATCH || peer == ws.rank || peer < 0 || peer >= ws.nranks) return nullptr;
  return mk_signal_word(ws, peer, MOE_PROGRESS);
}

// mk_record_error_at for a wait that timed out: when its word is this rank's first error,
// the flag's address, the value awaited and the value last read go to the status block
// first, so the host's message can name the flag that never came (error_word.rs), and
// with them the awaited peer's progress word (`progress`, may be null) and its value. The
// branch is taken once per failed call, on the way out of a wait.
__device__ __forceinline__ void mk_record_timeout(const WorkspaceView& ws, uint64_t* own_signals, uint32_t word,
                                                  const void* flag, uint64_t target, const uint64_t* progress) {
  unsigned int* claim = reinterpret_cast<unsigned int*>(own_signals + MK_SIG_ERROR_CLAIM);
  const unsigned int first = atomicCAS(claim, 0u, word);
  CommStatus* status = mk_status(ws);
  if (first == 0u) {
    const uint64_t seen = *reinterpret_cast<const volatile uint64_t*>(flag);
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(&status->timeout_flag), "l"((uint64_t)flag) : "memory");
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(&status->timeout_target), "l"(target) : "memory");
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(&status->timeout_seen), "l"(seen) : "memory");
    const uint64_t progress_value = progress ? *reinterpret_cast<const volatile uint64_t*>(progress) : 0;
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(&status->timeout_progress_word), "l"((uint64_t)progress)
                 : "memory");
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(&status->timeout_progress), "l"(progress_value) : "memory");
    __threadfence_system();
  }
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(&status->error), "r"(first == 0u ? word : first) : "memory");
  __threadfence_system();
}

__device__ __forceinline__ void mk_record_error(const WorkspaceView& ws, uint32_t word) {
  mk_record_error_at(ws, mk_signal_word(ws, ws.rank, 0), word);
}

// Raises the abort word of every rank (this one included): their waits stop.
__device__ __forceinline__ void mk_raise_abort(const WorkspaceView& ws) {
  for (int r = 0; r < ws.nranks; ++r) mk_st_release_sys(mk_signal_word(ws, r, MK_SIG_ABORT), (uint64_t)ws.rank + 1);
}

// Records `word` and stops this node's ranks (their waits see the abort word): what a
// fused kernel does when a step other than a wait fails (a proxy post, say).
__device__ __forceinline__ void mk_fail(const WorkspaceView& ws, uint32_t word) {
  mk_record_error(ws, word);
  mk_raise_abort(ws);
}

// The abort word read outside a wait, by a loop that stops between waits whose flags had
// already arrived: true, with mkRemoteError recorded (first error wins), when a rank raised
// it, so that this rank reports why its outputs are missing even though no wait of its own
// gave up. Call-free, for code after setmaxnreg.
__device__ __forceinline__ bool mk_abort_seen(const WorkspaceView& ws, uint64_t* own_signals, uint32_t what,
                                              uint32_t op) {
  const uint64_t raised = mk_ld_relaxed_sys(own_signals + MK_SIG_ABORT);
  if (raised == 0) return false;
  mk_record_error_at(ws, own_signals, mk_error_word(mkRemoteError, (uint32_t)(raised - 1), what, op));
  return true;
}

// The checks a bounded wait makes between polls of its flag, call-free (usable after
// setmaxnreg): the abort word (device memory) and the timeout on every check; the host's
// abort flag only once per kHostCheckNs, because it lives in host-mapped memory and every
// read crosses PCIe: hundreds of waiting threads reading it every few microseconds slow
// the GEMM CTAs beside them by 10-100x (the MoE kernels, benches/results/2026-12-02-moe-time-split.md).
// A host abort (mkCommAbort) is noticed within a millisecond. Returns false, with the
// error recorded, when the wait must stop.
struct MkWaitChecks {
  static constexpr uint64_t kHostCheckNs = 1000000;
  const WorkspaceView& ws;
  uint64_t* own_signals;  // this rank's signal region: the abort word, and the error claim
  uint64_t start, next_host_check;
  __device__ __forceinline__ explicit MkWaitChecks(const WorkspaceView& w)
      : ws(w), own_signals(mk_signal_word(w, w.rank, 0)), start(mk_globaltimer()),
        next_host_check(start + kHostCheckNs) {}
  // DOWNSTREAM: a wait for a flag this rank's own CTAs post once their own waits are
  // through (the MoE prep's barriers). It gets a sixteenth longer, so that when both are
  // stuck the upstream wait gives up first and the error (first one wins) names the cause
  // rather than the symptom; a kernel's bound is so 17/16 of the timeout. A template
  // argument, not a test of `peer`: the engine kernels' waits must not pay registers for it.
  template <bool DOWNSTREAM = false>
  __device__ __forceinline__ bool keep_waiting(int peer, uint32_t what, uint32_t op, const void* flag,
                                              uint64_t target) {
    const uint64_t raised = mk_ld_relaxed_sys(own_signals + MK_SIG_ABORT);
    if (raised != 0) {
      mk_record_error_at(ws, own_signals, mk_error_word(mkRemoteError, (uint32_t)(raised - 1), what, op));
      return false;
    }
    const uint64_t now = mk_globaltimer();
    const uint64_t bound = DOWNSTREAM ? ws.timeout_ns + ws.timeout_ns / 16 : ws.timeout_ns;
    if (now - start > bound) {
      mk_record_timeout(ws, own_signals, mk_error_word(mkTimeout, (uint32_t)peer, what, op), flag, target,
                        mk_peer_progress_word(ws, op, peer));
      mk_raise_abort(ws);
      return false;
    }
    if (now >= next_host_check) {
      next_host_check = now + kHostCheckNs;
      if (mk_ld_relaxed_sys_u32(&mk_status(ws)->host_abort) != 0) {
        mk_record_error_at(ws, own_signals, mk_error_word(mkInvalidUsage, 0xff, what, op));
        mk_raise_abort(ws);
        return false;
      }
    }
    return true;
  }
};

// One thread: waits until *flag >= target. `what` and `op` describe the wait for the
// error word; `peer` is the rank expected to post the flag. False: the CTA must exit.
// Inlined form, for code that must not make calls (a GEMM producer warp after
// setmaxnreg: ptxas cannot allocate registers around a call there); mk_wait_geq below
// is the same wait out of line.
__device__ __forceinline__ bool mk_wait_geq_inline(const WorkspaceView& ws, const uint64_t* flag, uint64_t target,
                                                   int peer, uint32_t what, uint32_t op) {
  if (mk_ld_acquire_sys(flag) >= target) return true;
  MkWaitChecks checks(ws);
  for (uint32_t spin = 1;; ++spin) {
    if (mk_ld_acquire_sys(flag) >= target) return true;
    if ((spin & 31) == 0 && !checks.keep_waiting(peer, what, op, flag, target)) return false;
  }
}

__device__ __noinline__ bool mk_wait_geq(const WorkspaceView& ws, const uint64_t* flag, uint64_t target, int peer,
                                         uint32_t what, uint32_t op) {
  return mk_wait_geq_inline(ws, flag, target, peer, what, op);
}

// mk_wait_geq_inline with a back-off, for waits beside a running GEMM: hundreds of threads
// polling system-scope acquire loads in a tight loop slow the GEMM CTAs beside them by
// orders of magnitude (a fused MoE combine that polls so takes 130x the unfused one). Polls with relaxed loads, sleeping FIRST_NS doubling up to MAX_NS between
// them, checks abort and timeout every CHECK_EVERY polls (a power of two), then one
// acquire load. Inline and call-free: a GEMM producer warpgroup uses it after setmaxnreg.
// SCOPE: the flag's (MkScope::Gpu for flags only this GPU's CTAs post and read).
template <unsigned FIRST_NS, unsigned MAX_NS, uint32_t CHECK_EVERY, MkScope SCOPE = MkScope::Sys,
          bool DOWNSTREAM = false>
__device__ __forceinline__ bool mk_wait_geq_backoff(const WorkspaceView& ws, const uint64_t* flag, uint64_t target,
                                                    int peer, uint32_t what, uint32_t op) {
  static_assert((CHECK_EVERY & (CHECK_EVERY - 1)) == 0, "CHECK_EVERY: a power of two");
  if (mk_ld_acquire<SCOPE>(flag) >= target) return true;
  MkWaitChecks checks(ws);
  unsigned ns = FIRST_NS;
  for (uint32_t spin = 1;; ++spin) {
    __nanosleep(ns);
    if (ns < MAX_NS) ns *= 2;
    if (mk_ld_relaxed<SCOPE>(flag) >= target) return mk_ld_acquire<SCOPE>(flag) >= target;  // flags only grow
    if ((spin & (CHECK_EVERY - 1)) == 0 && !checks.template keep_waiting<DOWNSTREAM>(peer, what, op, flag, target))
      return false;
  }
}

// Whole CTA: thread p (< nranks, p != skip) waits for flag_base[p] >= target in this
// rank's signal region, then every thread learns whether all waits succeeded.
// `flag_index(p)` is MK_SIG_READY + b*MK_MAX_PEERS + p and the like. Across nodes ws
// indexes this node's ranks: `global_of[p]` is local rank p's global rank, the one an
// error names (null: one node, where the two are the same).
__device__ __forceinline__ bool mk_cta_wait_peers(const WorkspaceView& ws, uint32_t first_word, uint64_t target, int skip,
                                                  uint32_t what, uint32_t op, const int* global_of = nullptr) {
  int ok = 1;
  int p = threadIdx.x;
  if (p < ws.nranks && p != skip)
    ok = mk_wait_geq(ws, mk_signal_word(ws, ws.rank, first_word + p), target, global_of ? global_of[p] : p, what, op);
  return __syncthreads_and(ok) != 0;
}

// Whole CTA: after every thread's prior writes, thread p (< nranks, p != skip) stores
// `value` to word `first_word + ws.rank` of rank p's signal region.
__device__ __forceinline__ void mk_cta_signal_peers(const WorkspaceView& ws, uint32_t first_word, uint64_t value, int skip) {
  __syncthreads();
  int p = threadIdx.x;
  if (p < ws.nranks && p != skip) {
    __threadfence_system();
    mk_st_release_sys(mk_signal_word(ws, p, first_word + ws.rank), value);
  }
}

// Whole CTA: thread 0 waits for one flag; every thread learns the outcome.
__device__ __forceinline__ bool mk_cta_wait(const WorkspaceView& ws, const uint64_t* flag, uint64_t target, int peer,
                                            uint32_t what, uint32_t op) {
  int ok = 1;
  if (threadIdx.x == 0) ok = mk_wait_geq(ws, flag, target, peer, what, op);
  return __syncthreads_and(ok) != 0;
}

// One thread: publishes `value` to a (possibly remote) flag after this thread's prior
// writes and everything ordered before them (call after __syncthreads for CTA data).
__device__ __forceinline__ void mk_signal_store(uint64_t* flag, uint64_t value) {
  __threadfence_system();
  mk_st_release_sys(flag, value);
}
