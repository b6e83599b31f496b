// Tile schedulers for the persistent GEMM engine: which (m_block, n_block) C tile the
// linear work index t maps to. CTA `cta` of `num_ctas` processes t = cta, cta + num_ctas, …
// (or, for a scheduler with a ticket counter, the tickets it takes: engine.cuh HasTickets),
// so every policy only has to define the order. Policies are compile-time so the plain
// GEMM pays nothing for the fused ops' orders.
// Also here: the K blocks each CTA of a split-K cluster computes (split_k_range).
//
// Policy interface (duck-typed):
//   struct Policy {
//     struct Params { ... };                                   // passed by the kernel
//     __device__ static TileCoord tile(const Params&, int t);  // 0 <= t < tiles_m * tiles_n
//   };
#pragma once
#include <cstdint>

namespace mk { namespace gemm {

struct TileCoord {
  int m_block;
  int n_block;
};

// Parameters of the built-in orders (each kernel fills them from its own parameters).
struct RasterParams {
  int tiles_m;       // ceil(M / BM)
  int tiles_n;       // ceil(N / BN)
  int group_m;       // m-blocks walked together (L2 reuse of B); >= 1
  int m_block_base;  // RankRotatedRaster: m-block that comes first (rank's own rows)
  int owners;        // OwnerInterleavedRaster: equal row shards to interleave (1: none)
};

// Grouped ("swizzled") raster: groups of `group_m` m-blocks; inside a group the m-block
// varies fastest, then the n-block. Consecutive CTAs share B tiles (same n-block) and a
// small set of A row blocks, so one wave's working set stays in L2.
__device__ __forceinline__ TileCoord grouped_tile(int tiles_m, int tiles_n, int group_m, int t) {
  const int per_group = group_m * tiles_n;
  const int group = t / per_group;
  const int first_m = group * group_m;
  const int rows = min(tiles_m - first_m, group_m);
  const int in_group = t - group * per_group;
  return TileCoord{first_m + in_group % rows, in_group / rows};
}

// The inverse of grouped_tile: the linear index of tile c.
__device__ __forceinline__ int grouped_index(int tiles_m, int tiles_n, int group_m, TileCoord c) {
  const int group = c.m_block / group_m;
  const int first_m = group * group_m;
  const int rows = min(tiles_m - first_m, group_m);
  return group * group_m * tiles_n + c.n_block * rows + (c.m_block - first_m);
}

struct GroupedRaster {
  using Params = RasterParams;
  __device__ static TileCoord tile(const Params& p, int t) {
    return grouped_tile(p.tiles_m, p.tiles_n, p.group_m, t);
  }
};

// Grouped raster whose row order starts at m_block_base and wraps: with
// m_block_base = rank * tiles_m / nranks each rank first computes the rows it already
// holds (AllGather+GEMM) or whose destination it owns, then the next rank's, and so on.
struct RankRotatedRaster {
  using Params = RasterParams;
  __device__ static TileCoord tile(const Params& p, int t) {
    TileCoord c = grouped_tile(p.tiles_m, p.tiles_n, p.group_m, t);
    c.m_block += p.m_block_base;
    if (c.m_block >= p.tiles_m) c.m_block -= p.tiles_m;
    return c;
  }
};

// GEMM + reduction: the m-blocks form `owners` equal shards (one per destination rank;
// tiles_m % owners == 0, else pass owners = 1) and are visited shard-interleaved —
// block 0 of every shard, then block 1, … — so every owner's reduction pipelines against
// compute from the start, instead of the last owner reducing all of its rows after the
// GEMM ends. Reduction CTAs walk the same order (interleaved_tile).
__device__ __forceinline__ TileCoord interleaved_tile(int tiles_m, int tiles_n, int group_m, int owners, int t) {
  TileCoord c = grouped_tile(tiles_m, tiles_n, group_m, t);
  if (owners > 1) {
    const int per_owner = tiles_m / owners;
    c.m_block = (c.m_block % owners) * per_owner + c.m_block / owners;
  }
  return c;
}

struct OwnerInterleavedRaster {
  using Params = RasterParams;
  __device__ static TileCoord tile(const Params& p, int t) {
    return interleaved_tile(p.tiles_m, p.tiles_n, p.group_m, p.owners, t);
  }
};

// Split-K: the K blocks [first, first + count) that CTA `rank` of a cluster of `split` CTAs
// computes for the tile the cluster shares. Consecutive ranges in rank order that cover the
// tile's k_blocks once and differ in size by at most one, so every CTA has a block when
// split <= k_blocks. tests/split_k_protocol.rs runs this very function, host-compiled.
struct KBlockRange {
  int first;
  int count;
};
__device__ __forceinline__ KBlockRange split_k_range(uint32_t rank, uint32_t split, int k_blocks) {
  const int first = (int)((int64_t)rank * k_blocks / split);
  return KBlockRange{first, (int)((int64_t)(rank + 1) * k_blocks / split) - first};
}

}  // namespace gemm
}  // namespace mk
