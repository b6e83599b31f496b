// Where each CTA of a fused kernel spends its time, for `mkbench --trace`. The hooks exist
// only in the tool build of a kernel file (MK_TOOL_KERNELS: the `_trace` twins of
// kernels/instances.txt, which only mkbench loads); in the kernels the library launches
// MK_TRACED(trace) is the constant false, so every hook and every `if (MK_TRACED(...))`
// compiles away.
// Per CTA, MK_TRACE_WORDS u64 at trace + blockIdx.x * MK_TRACE_WORDS:
//   0 start (%globaltimer ns)   1 after the setup every CTA does (e.g. own rows copied)
//   2 role's work done          3 end (after the end-of-kernel handshake)
//   4 ns spent in waits         5 bytes moved by the role (reads + writes)
//   6 work items (tiles, chunks)  7 SM id | role << 32 (0 compute, 1 communication)
//   8 a GEMM CTA's GEMM done, where the same CTA then moves data (0 if not recorded)
//   9 a GEMM CTA's side work done (the producer warpgroup's idle warps: AG+GEMM's push,
//     MoE dispatch's token sends; 0 if not recorded)
//   10-13 the setup's steps done, where a kernel records them (0 if not): the MoE
//     dispatch's prep CTAs: pass 1, the column scans, the offsets (CTA 0: its tables), pass 2
// Thread 0 writes the times; counters are added by one thread of the counting team.
#pragma once
#include <stdint.h>
#include "mk_kernel_abi.h"
#include "signals.cuh"

// A file that defines MK_TRACE_AT_RUN_TIME before its includes keeps its hooks behind the
// run-time test in the library's build too (kernels/ag_gemm.cu says why).
#if defined(MK_TOOL_KERNELS) || defined(MK_TRACE_AT_RUN_TIME)
#define MK_TRACED(trace) ((trace) != 0)
#else
#define MK_TRACED(trace) false
#endif

enum MkTraceSlot { MK_TR_START = 0, MK_TR_SETUP = 1, MK_TR_ROLE = 2, MK_TR_END = 3, MK_TR_WAIT = 4, MK_TR_BYTES = 5,
                   MK_TR_ITEMS = 6, MK_TR_SM = 7, MK_TR_GEMM = 8, MK_TR_SIDE = 9, MK_TR_STEP = 10 };
constexpr int MK_TR_STEPS = 4;  // slots MK_TR_STEP .. + 3

__device__ __forceinline__ uint64_t* mk_trace_slot(uint64_t trace, int slot) {
  return reinterpret_cast<uint64_t*>(trace) + (size_t)blockIdx.x * MK_TRACE_WORDS + slot;
}
// The calling thread (one of a team, the caller's choice): records the time now in `slot`.
__device__ __forceinline__ void mk_trace_stamp(uint64_t trace, int slot) {
  if (MK_TRACED(trace)) *mk_trace_slot(trace, slot) = mk_globaltimer();
}
// Thread 0: records the time now in `slot`.
__device__ __forceinline__ void mk_trace_time(uint64_t trace, int slot) {
  if (threadIdx.x == 0) mk_trace_stamp(trace, slot);
}
// Thread 0, first thing in the kernel: start time, SM, role; counters zeroed.
__device__ __forceinline__ void mk_trace_begin(uint64_t trace, bool communication_role) {
  if (!MK_TRACED(trace) || threadIdx.x != 0) return;
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  *mk_trace_slot(trace, MK_TR_SM) = sm | ((uint64_t)communication_role << 32);
  *mk_trace_slot(trace, MK_TR_WAIT) = 0;
  *mk_trace_slot(trace, MK_TR_BYTES) = 0;
  *mk_trace_slot(trace, MK_TR_ITEMS) = 0;
  *mk_trace_slot(trace, MK_TR_GEMM) = 0;
  *mk_trace_slot(trace, MK_TR_SIDE) = 0;
  for (int i = 0; i < MK_TR_STEPS; ++i) *mk_trace_slot(trace, MK_TR_STEP + i) = 0;
  *mk_trace_slot(trace, MK_TR_START) = mk_globaltimer();
}
// One thread of whichever team counts: adds `v` to a counter slot (atomically: a GEMM
// CTA's producer thread and its side warps may count into the same slot).
__device__ __forceinline__ void mk_trace_add(uint64_t trace, int slot, uint64_t v) {
  if (MK_TRACED(trace)) atomicAdd(reinterpret_cast<unsigned long long*>(mk_trace_slot(trace, slot)), (unsigned long long)v);
}
