// Hook run by the engine's producer thread before it issues the first TMA load of A rows
// for a tile: the place where a fused op waits until those rows have arrived.
//
// Policy interface (duck-typed):
//   struct AWait {
//     struct Params { ... };
//     // Called by the single producer thread, once per tile, before the tile's first
//     // A load. m_row0 = first A row of the tile, rows = BM (the tile may overhang M).
//     __device__ static void before_a_load(const Params&, int m_block, int m_row0, int rows);
//     // Which tensor map (and row in it) the tile's A rows are loaded from; the engine's
//     // own map and m_row0 unless the hook keeps some rows elsewhere (e.g. a rank's own
//     // rows read in place). Producer thread, once per tile. (No 2-CTA clusters.)
//     __device__ static const CUtensorMap* a_source(const Params&, const CUtensorMap* tma_a, int m_row0, int& row);
//     // Run by warps 1-3 of the producer warpgroup (96 threads, thread = 0..95), which
//     // the engine leaves idle: a fused op's data movement can live here, beside the
//     // GEMM on the same SM, instead of taking whole CTAs. Register budget: the
//     // producer's (Cfg::PRODUCER_REGS); named barrier 3 is theirs. With a signalling
//     // epilogue (Epi::kCourier) warp 1 is the courier: only warps 2-3 (thread = 32..95) run it.
//     __device__ static void side_work(const Params&, int thread);
//     // Optional (engine.cuh HasSplitB): each B tile as two halves of BN/2 rows from the
//     // rows this returns (first) and sets (second_row); producer thread, per k-block.
//     __device__ static int b_halves(const Params&, int n_block, int half_rows, int& second_row);
//   };
// After observing a flag through ordinary loads, the hook must execute
// fence_proxy_async_global() so that the TMA loads that follow see the data.
#pragma once
#include <cuda.h>
#include <cstdint>
#include "ptx.cuh"

namespace mk { namespace gemm {

// Plain GEMM: A is already there.
struct NoAWait {
  struct Params {
    int unused;
  };
  __device__ static void before_a_load(const Params&, int, int, int) {}
  __device__ static const CUtensorMap* a_source(const Params&, const CUtensorMap* tma_a, int m_row0, int& row) {
    row = m_row0;
    return tma_a;
  }
  __device__ static void side_work(const Params&, int) {}
};

}  // namespace gemm
}  // namespace mk
