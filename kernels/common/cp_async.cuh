// cp.async (LDGSTS): 16-byte global -> shared copies that hold no registers while in
// flight. Loops that stream memory through an SM (the reducers of the fused ops, the
// collectives, the attention's K/V loads) use them to keep tens of KiB in flight per SM
// where a few vectors per thread in registers leave the loop bound by memory latency.
#pragma once
#include <stdint.h>

// 16 bytes from global `src` to shared `dst`, through L2 only (.cg: no stale L1 lines of
// memory that peers write). src_bytes < 16 zero-fills the rest (0: rows past the end).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight; the
// completed copies are then visible to this thread (others need a barrier).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// The mbarrier at `bar` (shared memory) receives one arrival from this thread once all of
// its prior cp.async copies have landed. .noinc: that arrival counts towards the
// barrier's expected count (init the barrier with one arrival per thread that calls it).
// Generic-proxy writes: a consumer that reads the data by wgmma (async proxy) executes
// fence.proxy.async after its wait on the barrier.
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"((uint32_t)__cvta_generic_to_shared(bar))
               : "memory");
}
