// The GEMM + reduction kernels' shared parts (kernels/gemm_reduce.cu, gemm_reduce_early.cu):
// the start gate, the partial tiles' epilogue and flags, and the reducers -- one-shot,
// two-phase and across nodes.
//
// CTAs [0, compute_ctas) run the GEMM engine on this rank's K slice and store partial
// tiles P (rounded to the input type) in this rank's fused-op region with TMA, each slab
// followed by an epoch-valued flag. The reducers -- each GEMM CTA once its GEMM is done,
// or CTAs [compute_ctas, +reduce_ctas) when MK_COMM_SMS asks for dedicated ones -- walk
// their owner's tiles in the compute order, wait until every rank has stored a tile, read the n partials of it
// (peers' over NVLink) and add them in fp32 in rank order 0..n-1 (the same order on every
// rank, so AllReduce outputs are bitwise identical across ranks), writing the rows this
// rank owns (ReduceScatter: its M / n rows; AllReduce: all of them).
//
// Epochs are device-side (GR_EPOCH, advanced by the last CTA), so graph replays stay in
// step. Before storing a new P, compute CTAs wait until every peer has finished reading the
// previous one (GR_DONE, raised by the peer's last CTA).
//
// Across nodes (p.nodes > 1) the same GEMM and the same reducers run a hierarchical
// reduction instead: node partials over NVLink, one proxy put per owner block to the
// GPU-l rank of each other node, the node partials summed by the owner, and for AllReduce
// the sums sent back the same way (reduce_nodes below; plan and data flow in
// src/ops/dense/gemm_reduce_nodes.rs).
#pragma once
#include "cp_async.cuh"
#include "gemm/engine.cuh"
#include "fused_op.cuh"
#include "proxy.cuh"
#include "trace.cuh"

// Signal words of this op: GR_* in mk_kernel_abi.h (src/kernel_abi.rs).

namespace mk { namespace gemm_reduce {

using namespace mk::gemm;

// The start gate of a GEMM CTA (shared memory): this launch's epoch, and whether every
// peer has finished reading this rank's partials of the previous launch (GR_DONE), so that
// P may be overwritten. Only P's stores (and, after the GEMM, R and the node buffers)
// need it; the GEMM's loads and wgmmas do not, so on one node the CTA starts its GEMM at
// once and warp 2 of the producer warpgroup (idle in the default "after" mode) reads the
// epoch and waits for the peers beside it (open_gate); the epilogue's store thread waits
// for the gate before its first store into P (GatedDest), the courier reads the epoch
// from it (EpochTileSignal). The GEMM thus does not wait for the peers: reading the epoch,
// waiting and meeting at two CTA barriers before the first TMA load costs 2.2 us at M = 1.
// Across nodes the whole CTA waits first (thread 0 also posts GR_NET_DONE through the
// proxy) and opens the gate before the engine starts.
struct Gate {
  uint64_t bar;    // mbarrier, count 1: arrives once, when epoch and ok are written
  uint64_t epoch;  // this launch's epoch (last completed + 1)
  int ok;          // 0: a wait failed (error recorded, abort raised): store nothing into P
};

// Opener (one thread, after writing epoch and ok): releases them at CTA scope; a waiter's
// acquire (mbarrier try_wait) sees them.
__device__ __forceinline__ void gate_open(Gate* g, uint64_t epoch, int ok) {
  g->epoch = epoch;
  g->ok = ok;
  mbar_arrive(&g->bar);
}
__device__ __forceinline__ void gate_wait(Gate* g) { mbar_wait(&g->bar, 0); }

// Warp 2 of a GEMM CTA's producer warpgroup (threads 64..95), one node: lane 0 reads the
// epoch, lane q (< nranks, != rank) waits for peer q's GR_DONE of the previous epoch, and
// lane 0 opens the gate. The peer words are this rank's own signal words; the poll backs
// off (mk_wait_geq_backoff, up to 256 ns between polls) so that a long wait --
// back-to-back calls where a peer is still reading -- does not steal issue slots and L2
// bandwidth from the GEMM beside it (tight system-scope polls during a GEMM
// slow it 20-25 %). Inline and call-free: 80 registers after setmaxnreg.
__device__ __forceinline__ void open_gate(const GemmReduceParams& p, Gate* g) {
  const WorkspaceView& ws = p.ws;
  const int lane = threadIdx.x & 31;
  uint64_t epoch = 0;
  if (lane == 0) epoch = mk_ld_acquire_sys(mk_signal_word(ws, ws.rank, GR_EPOCH)) + 1;
  epoch = __shfl_sync(0xffffffffu, epoch, 0);
  int ok = 1;
  if (lane < ws.nranks && lane != ws.rank)
    ok = mk_wait_geq_backoff<32, 256, 16>(ws, mk_signal_word(ws, ws.rank, GR_DONE + lane), epoch - 1, lane,
                                          MK_WAIT_OP_FLAG, p.op);
  ok = __all_sync(0xffffffffu, ok);
  // bar.warp.sync orders each lane's acquire before lane 0's release (the gate's mbarrier
  // arrive), so whoever passes the gate is causally after every peer's GR_DONE release.
  __syncwarp();
  if (lane == 0) gate_open(g, epoch, ok);
  __syncwarp();
}

// After a 64-row slab of a partial tile is stored, its flag takes the epoch.
struct EpochTileSignal {
  struct Params {
    uint64_t* flags;
    int tiles_n;
    const Gate* gate;  // the epoch; the courier's slabs come after the gate (GatedDest)
    int m;             // rows of P
  };
  static constexpr bool enabled = true;
  __device__ static void after_store(const Params& p, const SlabInfo& s) {
    // A slab entirely at or below row M holds no row of P (TMA clipped all of it) and its
    // flag is never read: every wait (wait_partials) skips the slabs outside the rows it
    // sums, which are < M. At M <= 64 that is every tile's second slab, whose flag would
    // cost the courier a system-scope release (a MEMBAR.SYS) per tile on the way to the
    // reduction.
    if (s.row0 >= p.m) return;
    // The courier got this slab from a consumer's store thread, which had passed the gate
    // (GatedDest) before storing it: the mailbox's release / acquire makes the gate's
    // epoch and ok visible here. A failed gate stored nothing: no flag either, so a peer
    // waits (and sees the abort word) instead of reading a stale partial.
    if (!p.gate->ok) return;
    // The engine waited for the slab's bulk stores to complete; the proxy fence orders those
    // async-proxy writes before this thread's generic accesses, and the release store at
    // system scope publishes them to a peer's acquire. A full fence.sc.sys before it (as in
    // mk_signal_store) only adds cost: 5 % of the whole op at 2 ranks.
    fence_proxy_async_global();
    uint64_t* f = p.flags + ((size_t)s.tile.m_block * p.tiles_n + s.tile.n_block) * 2 + s.consumer;
    mk_st_release_sys(f, p.gate->epoch);
  }
};

// The partials' destination (this rank's P), behind the start gate: the epilogue's store
// thread waits for it before every tile's stores (an mbarrier try_wait on a completed
// phase after the first: a few cycles), and stores nothing when it failed (nullptr: the
// epilogue skips the boxes). The proxy fence orders the gate's acquire (generic proxy:
// the peers' GR_DONE, i.e. their reads of P) before this thread's TMA stores (async
// proxy) into P -- the write-after-read counterpart of hooks.cuh's rule for TMA loads.
struct GatedDest {
  struct Params {
    const CUtensorMap* tma_c;  // P: dims {N, M}, box {64, 64}, CU_TENSOR_MAP_SWIZZLE_128B
    Gate* gate;
  };
  static constexpr bool kMayRefuse = true;
  __device__ static const CUtensorMap* map(const Params& p, const SlabInfo& s, int& row, int& col) {
    gate_wait(p.gate);
    fence_proxy_async_global();
    row = s.row0;
    col = s.col0;
    return p.gate->ok ? p.tma_c : nullptr;
  }
};

template <typename T>
__device__ __forceinline__ void add8(float (&acc)[8], int4 v) {
  const T* h = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] += (float)h[i];
}

template <typename T>
__device__ __forceinline__ int4 pack8(const float (&acc)[8]) {
  int4 out;
  T* h = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int i = 0; i < 8; ++i) h[i] = T(acc[i]);
  return out;
}

// The reducers: a whole CTA (CtaTeam) -- a dedicated reduction CTA, or a GEMM CTA once
// its GEMM is done (every warp, its registers back at the launch's 168) -- or, one node
// only, two idle warps of a GEMM CTA's producer warpgroup during the whole GEMM
// (threads 64..127, named barrier 3, the producer's kProducerRegs registers: they sum
// with few values live; warp 1 is the epilogue's courier, which raises the slab flags).
struct SideWarps : WarpTeam<64, 64, 3> {};
template <class Team>
struct LeanTeam {
  static constexpr bool value = false;
};
template <>
struct LeanTeam<SideWarps> {
  static constexpr bool value = true;
};
// Registers of the producer warpgroup during the GEMM (its side warps may reduce): 80, as
// AG+GEMM's pushers; the consumers keep 208, enough for BN = 256 without spills (ptxas;
// tests/kernels.rs). 40 / 232 measured no faster.
constexpr int kProducerRegs = 80;

// Rank q's flag for slab `slab` (rows 0-63 or 64-127) of tile tc: the epoch once the slab
// is stored (EpochTileSignal) -- a partial, or with tile owners, on the owner, the sum.
__device__ __forceinline__ const uint64_t* slab_flag(const GemmReduceParams& p, int q, const TileCoord& tc, int slab) {
  return mk_signal_word(p.ws, q, GR_TILE + ((uint32_t)tc.m_block * p.tiles_n + tc.n_block) * 2 + slab);
}

// Team thread q (< nranks) waits for rank q's slabs of tile `tc` that hold rows [r0, r1);
// every thread learns whether all waits succeeded.
template <class Team>
__device__ __forceinline__ bool wait_partials(const GemmReduceParams& p, uint64_t epoch, const TileCoord& tc, int r0, int r1) {
  const WorkspaceView& ws = p.ws;
  const uint64_t t0 = MK_TRACED(p.trace) ? mk_globaltimer() : 0;
  int ok = 1;
  const int q = Team::tid();
  if (q < ws.nranks) {
    for (int slab = 0; slab < 2; ++slab) {
      const int s0 = tc.m_block * 128 + slab * 64;
      if (s0 >= r1 || s0 + 64 <= r0) continue;
      ok &= mk_wait_geq_inline(ws, slab_flag(p, q, tc, slab), epoch, q, MK_WAIT_OP_FLAG, p.op);  // inlined: no calls in the GEMM warps (ptxas)
    }
  }
  ok = Team::and_all(ok);
  if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_WAIT, mk_globaltimer() - t0);
  return ok != 0;
}

// Where a CTA team stages its loads: the GEMM's operand ring, free once the CTA's GEMM is
// done, or in a dedicated reduction CTA, which never runs the GEMM. (The side warps reduce
// while the ring is in use: their loads go to registers.)
struct Staging {
  char* smem;
  int bytes;
};

// The reducers' staging: the ring of the engine's 128-row configuration.
template <int BN>
constexpr int kRingStagingBytes = FusedStages<BN>::value * (128 + BN) * 64 * 2;

template <int BN>
__device__ __forceinline__ Staging ring_staging() {
  extern __shared__ __align__(1024) char smem[];
  char* ring = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem) + 1023) & ~uintptr_t(1023));  // as the engine
  return Staging{ring, kRingStagingBytes<BN>};
}

template <int BN, class Team>
__device__ __forceinline__ Staging team_staging() {
  if constexpr (LeanTeam<Team>::value) return Staging{nullptr, 0};
  return ring_staging<BN>();
}

// The team sums rows [r0, r1) x columns [c0, c1) of `nsrc` row-major [*, n] buffers (row r
// of source i at src(i) + (r - src_row0) * n elements), in source order, into dst (row r at
// dst + (r - dst_row0) * n) and, when dst2 is set, into dst2 at row r; one source is copied
// bit for bit. `src` computes the bases from the kernel parameters (an array of 8 pointers
// would hold 16 registers).
// Loads go through shared memory: every thread cp.asyncs its own vectors of a batch into
// its own slots (slot (buffer, source, u) x thread, 16 bytes each: a warp's slots are
// contiguous) and reads back only those, so no barrier is needed; the next batch is in
// flight while this one is summed. Thread t keeps column vector t % vpr and walks the rows
// t / vpr, + rows_per_pass, ...: no division per vector. The loop is bound by instructions
// as much as by latency (~14 GB/s per CTA with 8 warps and a division per
// vector, from registers or staged alike), hence all 12 warps and the cheap indexing.
template <typename T, class Team, class Src>
__device__ __forceinline__ void staged_rows(const Staging& staging, Src src, int nsrc, int src_row0, char* dst, int dst_row0,
                                            char* dst2, int n, int r0, int r1, int c0, int c1) {
  const int nt = Team::threads(), tid = Team::tid();
  const int vpr = (c1 - c0) / 8;  // <= 32 vectors per row <= nt
  const int rows_per_pass = nt / vpr;
  const int my_row = tid / vpr;
  const int rows = my_row < rows_per_pass ? (r1 - r0 - my_row + rows_per_pass - 1) / rows_per_pass : 0;  // this thread's
  const size_t row_bytes = (size_t)n * sizeof(T);
  const size_t col_bytes = (size_t)(c0 + (tid % vpr) * 8) * sizeof(T);
  const int first_row = r0 + my_row;
  const int per_batch = max(1, staging.bytes / 2 / (nt * 16 * nsrc));  // vectors of each source per thread
  const auto slot = [&](int b, int s, int u) {
    return staging.smem + ((((size_t)(b & 1) * nsrc + s) * per_batch + u) * nt + tid) * 16;
  };
  const auto issue = [&](int b) {
    for (int u = 0, k = b * per_batch; u < per_batch && k < rows; ++u, ++k) {
      const size_t off = (size_t)(first_row + k * rows_per_pass - src_row0) * row_bytes + col_bytes;
      for (int s = 0; s < nsrc; ++s) cp_async16(slot(b, s, u), src(s) + off);
    }
    cp_async_commit();  // also when empty: wait_group<1> below counts groups
  };
  const int batches = (rows + per_batch - 1) / per_batch;
  if (batches > 0) issue(0);
  for (int b = 0; b < batches; ++b) {
    issue(b + 1);  // writes the slots read two batches ago, by this thread, already consumed
    cp_async_wait<1>();
    for (int u = 0, k = b * per_batch; u < per_batch && k < rows; ++u, ++k) {
      int4 out;
      if (nsrc == 1) {
        out = *reinterpret_cast<const int4*>(slot(b, 0, u));
      } else {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int s = 0; s < nsrc; ++s) add8<T>(acc, *reinterpret_cast<const int4*>(slot(b, s, u)));
        out = pack8<T>(acc);
      }
      const int r = first_row + k * rows_per_pass;
      *reinterpret_cast<int4*>(dst + (size_t)(r - dst_row0) * row_bytes + col_bytes) = out;
      if (dst2) *reinterpret_cast<int4*>(dst2 + (size_t)r * row_bytes + col_bytes) = out;
    }
  }
}

// staged_rows, counted in the trace.
template <typename T, class Team, class Src>
__device__ __forceinline__ void sum_rows(const Staging& staging, Src src, int nsrc, int src_row0, char* dst, int dst_row0,
                                         char* dst2, int n, int r0, int r1, int c0, int c1, uint64_t trace) {
  if (Team::tid() == 0) mk_trace_add(trace, MK_TR_BYTES, (uint64_t)(r1 - r0) * (c1 - c0) * sizeof(T) * (nsrc + (dst2 ? 2 : 1)));
  staged_rows<T, Team>(staging, src, nsrc, src_row0, dst, dst_row0, dst2, n, r0, r1, c0, c1);
}

// Team: copies rows [r0, r1) x columns [c0, c1) of a row-major [*, n] buffer to another:
// staged (a CTA team), or kVectors vectors in flight per thread in registers (side warps).
template <typename T, class Team, int kVectors = 8>
__device__ __forceinline__ void copy_rows(const Staging& staging, char* dst, const char* src, int n, int r0, int r1, int c0, int c1) {
  if constexpr (!LeanTeam<Team>::value) {
    return staged_rows<T, Team>(staging, [&](int) { return src; }, 1, 0, dst, 0, nullptr, n, r0, r1, c0, c1);
  }
  const int vpr = (c1 - c0) / 8;
  const int nvec = (r1 - r0) * vpr;
  for (int v0 = Team::tid(); v0 < nvec; v0 += kVectors * Team::threads()) {
    int4 piece[kVectors];
#pragma unroll
    for (int u = 0; u < kVectors; ++u) {
      const int v = v0 + u * Team::threads();
      if (v < nvec) piece[u] = *reinterpret_cast<const int4*>(src + ((size_t)(r0 + v / vpr) * n + c0 + (v % vpr) * 8) * sizeof(T));
    }
#pragma unroll
    for (int u = 0; u < kVectors; ++u) {
      const int v = v0 + u * Team::threads();
      if (v < nvec) *reinterpret_cast<int4*>(dst + ((size_t)(r0 + v / vpr) * n + c0 + (v % vpr) * 8) * sizeof(T)) = piece[u];
    }
  }
}

// Sums rows [r0, r1) x columns [c0, c1) of every rank's partial in rank order 0..n-1 (the
// same order on every rank) and writes them to C (at row - out_row0) and, when
// `reduced` is set, to the same place in this rank's R.
template <typename T, class Team>
__device__ __forceinline__ void sum_partials(const GemmReduceParams& p, const Staging& staging, int r0, int r1, int c0, int c1,
                                             char* reduced) {
  const WorkspaceView& ws = p.ws;
  if constexpr (LeanTeam<Team>::value) {
    const int vpr = (c1 - c0) / 8;  // N % 8 == 0: 16-byte vectors never straddle a row end
    const int nvec = (r1 - r0) * vpr;
    if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_BYTES, (uint64_t)nvec * 16 * (ws.nranks + (reduced ? 2 : 1)));
    // Side warps (80 registers): one source at a time, kLean vectors of it in flight,
    // added into fp32 sums -- registers independent of the rank count.
    constexpr int kLean = 3;
    for (int v0 = Team::tid(); v0 < nvec; v0 += kLean * Team::threads()) {
      float acc[kLean][8];
#pragma unroll
      for (int u = 0; u < kLean; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
      for (int src = 0; src < ws.nranks; ++src) {
        const char* base = reinterpret_cast<const char*>(ws.data[src]) + p.partial_offset;
        int4 part[kLean];
#pragma unroll
        for (int u = 0; u < kLean; ++u) {
          const int v = v0 + u * Team::threads();
          if (v < nvec) part[u] = *reinterpret_cast<const int4*>(base + ((size_t)(r0 + v / vpr) * p.n + c0 + (v % vpr) * 8) * sizeof(T));
        }
#pragma unroll
        for (int u = 0; u < kLean; ++u)
          if (v0 + u * Team::threads() < nvec) add8<T>(acc[u], part[u]);
      }
#pragma unroll
      for (int u = 0; u < kLean; ++u) {
        const int v = v0 + u * Team::threads();
        if (v >= nvec) break;
        const int r = r0 + v / vpr, col = c0 + (v % vpr) * 8;
        const int4 sum = pack8<T>(acc[u]);
        *reinterpret_cast<int4*>(reinterpret_cast<char*>(p.c) + ((size_t)(r - p.out_row0) * p.n + col) * sizeof(T)) = sum;
        if (reduced) *reinterpret_cast<int4*>(reduced + ((size_t)r * p.n + col) * sizeof(T)) = sum;
      }
    }
    return;
  }
  const auto partial = [&](int q) { return reinterpret_cast<const char*>(p.ws.data[q]) + p.partial_offset; };
  sum_rows<T, Team>(staging, partial, ws.nranks, 0, reinterpret_cast<char*>(p.c), p.out_row0, reduced, p.n, r0, r1, c0, c1, p.trace);
}

// Tile i of the `blocks` x tiles_n tiles of row blocks [first, first + blocks), in the order
// the GEMM computes them: with owner-interleaved compute (p.interleave owners, group_m a
// multiple of them: the host plans it so), an owner's blocks come group_m / owners to a
// group, n-block by n-block. Reducer teams take i = j, j + stride, ... of one owner's tiles,
// so every team gets its share: striding over all tiles and skipping other owners' would
// leave the CTAs of the other parity idle at two ranks (the stride and the interleave are
// both even) -- half the CTAs would reduce everything. Mirrored by gemm_reduce::owned_tile (tested).
__device__ __forceinline__ TileCoord owned_tile(const GemmReduceParams& p, int first, int blocks, int i) {
  TileCoord c = grouped_tile(blocks, p.tiles_n, max(1, p.group_m / max(1, p.interleave)), i);
  c.m_block += first;
  return c;
}

// One-shot (ReduceScatter, small-M AllReduce): every tile holding rows this rank writes is
// reduced, in the compute order; this team takes the owned tiles j, j + stride, ...
template <typename T, int BN, class Team>
__device__ __forceinline__ bool reduce_tiles(const GemmReduceParams& p, uint64_t epoch, int j, int stride) {
  const Staging staging = team_staging<BN, Team>();
  if (p.row_hi <= p.row_lo) return true;  // fewer rows than ranks
  const int lo_block = p.row_lo / 128, blocks = (p.row_hi - 1) / 128 - lo_block + 1;
  for (int i = j; i < blocks * p.tiles_n; i += stride) {
    const TileCoord tc = owned_tile(p, lo_block, blocks, i);
    const int r0 = max(tc.m_block * 128, p.row_lo), r1 = min(min(tc.m_block * 128 + 128, p.row_hi), p.m);
    if (!wait_partials<Team>(p, epoch, tc, r0, r1)) return false;
    if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_ITEMS, 1);
    sum_partials<T, Team>(p, staging, r0, r1, tc.n_block * BN, min(tc.n_block * BN + BN, p.n), nullptr);
  }
  return true;
}

// Two-phase AllReduce. Phase 1: the tiles of this rank's row blocks are reduced (as
// above) into C and R, each then flagged. Phase 2: every other tile is copied from its
// owner's R once the owner has flagged it, the owners taken in turn. One rank computes
// each sum, so every rank's C is bitwise identical; each rank reads n·M/n + (n−1)·M/n rows
// instead of the one-shot's n·M.
template <typename T, int BN, class Team>
__device__ __forceinline__ bool reduce_then_gather(const GemmReduceParams& p, uint64_t epoch, int j, int stride) {
  const Staging staging = team_staging<BN, Team>();
  const WorkspaceView& ws = p.ws;
  const int tiles_m = (p.m + 127) / 128;
  const int total = tiles_m * p.tiles_n;
  const int per_rank = p.rows_per_rank / 128;
  // Row blocks owner q holds: [q * per_rank, +blocks_of(q)) (the last owners' may be short).
  const auto blocks_of = [&](int q) { return max(0, min(per_rank, tiles_m - q * per_rank)); };
  char* reduced = reinterpret_cast<char*>(ws.data[ws.rank]) + p.reduced_offset;
  for (int i = j; i < blocks_of(ws.rank) * p.tiles_n; i += stride) {
    const TileCoord tc = owned_tile(p, ws.rank * per_rank, blocks_of(ws.rank), i);
    const int r0 = tc.m_block * 128, r1 = min(r0 + 128, p.m);
    if (!wait_partials<Team>(p, epoch, tc, r0, r1)) return false;
    if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_ITEMS, 1);
    sum_partials<T, Team>(p, staging, r0, r1, tc.n_block * BN, min(tc.n_block * BN + BN, p.n), reduced);
    Team::sync();
    if (Team::tid() == 0)
      mk_signal_store(mk_signal_word(ws, ws.rank, GR_TILE + 2 * total + (uint32_t)tc.m_block * p.tiles_n + tc.n_block), epoch);
  }
  const int others = ws.nranks - 1;
  for (int i = j; i < others * per_rank * p.tiles_n; i += stride) {
    const int owner = (ws.rank + 1 + i % others) % ws.nranks, k = i / others;
    if (k >= blocks_of(owner) * p.tiles_n) continue;
    const TileCoord tc = owned_tile(p, owner * per_rank, blocks_of(owner), k);
    const uint64_t t0 = MK_TRACED(p.trace) ? mk_globaltimer() : 0;
    int ok = 1;
    if (Team::tid() == 0) {
      const uint64_t* f = mk_signal_word(ws, owner, GR_TILE + 2 * total + (uint32_t)tc.m_block * p.tiles_n + tc.n_block);
      ok = mk_wait_geq_inline(ws, f, epoch, owner, MK_WAIT_OP_FLAG, p.op);
      mk_trace_add(p.trace, MK_TR_WAIT, mk_globaltimer() - t0);
    }
    if (!Team::and_all(ok)) return false;
    const int r0 = tc.m_block * 128, r1 = min(r0 + 128, p.m);
    const int c0 = tc.n_block * BN, c1 = min(c0 + BN, p.n);
    if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_BYTES, (uint64_t)(r1 - r0) * (c1 - c0) * sizeof(T) * 2);
    // In flight per thread: 8, or 4 in the side warps' 80 registers.
    copy_rows<T, Team, LeanTeam<Team>::value ? 4 : 8>(staging, reinterpret_cast<char*>(p.c),
                                                      reinterpret_cast<const char*>(ws.data[owner]) + p.reduced_offset, p.n, r0, r1,
                                                      c0, c1);
  }
  return true;
}

// ---- Across nodes -------------------------------------------------------------------
// ws is this node's workspace (local ranks 0..L-1); owners are global ranks; this rank
// (node n, local rank l) talks to the GPU-l rank of every other node through its proxy.

__device__ __forceinline__ int gr_rank_of(const GemmReduceParams& p, int node, int local) {
  return p.rank_of[node * MK_MAX_PEERS + local];
}
// First row owned by global rank q (owner q's rows end where q + 1's begin).
__device__ __forceinline__ int gr_owner_lo(const GemmReduceParams& p, int q) {
  return (int)min((long long)p.m, (long long)q * p.owner_rows);
}

// A team's thread 0: the last command it posted (drained before the kernel ends: the
// next call overwrites the sources).
struct NetPosts {
  uint64_t ticket;
  bool posted;
};

// Thread 0: puts `bytes` at src (this rank's window) to dst in `peer`'s, raising `word`
// there to the epoch after the data -- once `peer` (node m's GPU-l rank) said it is done
// with what this rank put there in the previous call.
__device__ __forceinline__ bool gr_put(const GemmReduceParams& p, uint64_t epoch, int m, int peer, uint64_t src,
                                       uint64_t dst, uint64_t bytes, uint32_t word, NetPosts& posts) {
  if (!mk_wait_geq_inline(p.ws, mk_signal_word(p.ws, p.ws.rank, GR_NET_DONE + m), epoch - 1, peer, MK_WAIT_GRANT, p.op))
    return false;
  const int rc = mk_proxy_put(p.ring, (uint32_t)peer, src, dst, (uint32_t)bytes, word, (uint32_t)epoch, &posts.ticket);
  if (rc != mkSuccess) {
    mk_fail(p.ws, mk_error_word((uint32_t)rc, (uint32_t)peer, MK_WAIT_PROXY, p.op));
    return false;
  }
  posts.posted = true;
  return true;
}

// Thread 0: adds `add` elements to the counter at signal word `word`; true for the caller
// whose add completes `total`. That caller resets the counter (every piece is counted;
// the next launch starts after this one ends) and fences, so the other teams' data
// (fenced before they counted) is ordered before the flag or put it issues next.
__device__ __forceinline__ bool gr_count_completes(const WorkspaceView& ws, uint32_t word, unsigned long long add,
                                                   unsigned long long total) {
  unsigned long long* count = reinterpret_cast<unsigned long long*>(mk_signal_word(ws, ws.rank, word));
  if (atomicAdd(count, add) + add != total) return false;
  *count = 0;
  __threadfence_system();
  return true;
}

// Thread 0, after its team stored rows [r0, r1) x `cols` columns of owner q's rows
// [lo, hi) into slab m (and fenced them): counts them per owner block. The team that
// completes a block publishes it: slab n (this node's partial of this rank's own rows)
// by its flag, slab m != n by a put into inbox slab n of q = rank_of(m, l).
template <typename T>
__device__ __forceinline__ bool count_node_rows(const GemmReduceParams& p, uint64_t epoch, int m, int q, int lo, int hi,
                                                int r0, int r1, int cols, NetPosts& posts) {
  const WorkspaceView& ws = p.ws;
  const uint64_t row_bytes = (uint64_t)p.n * sizeof(T);
  for (int b = (r0 - lo) / 128; b <= (r1 - 1 - lo) / 128; ++b) {
    const int b0 = lo + b * 128, b1 = min(b0 + 128, hi);
    const unsigned long long add = (unsigned long long)(min(r1, b1) - max(r0, b0)) * cols;
    if (!gr_count_completes(ws, p.count_node_word + m * p.owner_blocks + b, add, (unsigned long long)(b1 - b0) * p.n)) continue;
    const uint32_t word = p.net_in_word + p.node * p.owner_blocks + b;
    if (m == p.node) {
      mk_signal_store(mk_signal_word(ws, ws.rank, word), epoch);
      continue;
    }
    const uint64_t within = (uint64_t)b * 128 * row_bytes;
    if (!gr_put(p, epoch, m, q, p.outbox_offset + (uint64_t)m * p.slab_bytes + within,
                p.inbox_offset + (uint64_t)p.node * p.slab_bytes + within, (uint64_t)(b1 - b0) * row_bytes, word, posts))
      return false;
  }
  return true;
}

// Thread 0 (AllReduce), after its team wrote rows [r0, r1) x `cols` of this rank's block b
// to R: counts them; the team completing the block raises its flag for the local peers and
// puts the rows into R of the GPU-l rank of every other node.
template <typename T>
__device__ __forceinline__ bool count_own_rows(const GemmReduceParams& p, uint64_t epoch, int b, int r0, int r1, int cols,
                                               NetPosts& posts) {
  const WorkspaceView& ws = p.ws;
  if (!gr_count_completes(ws, p.count_final_word + b, (unsigned long long)(r1 - r0) * cols, (unsigned long long)(r1 - r0) * p.n))
    return true;
  const uint32_t word = p.net_reduced_word + p.node * p.owner_blocks + b;
  mk_signal_store(mk_signal_word(ws, ws.rank, word), epoch);
  const uint64_t row_bytes = (uint64_t)p.n * sizeof(T);
  const uint64_t at = p.reduced_offset + (uint64_t)r0 * row_bytes;
  for (int i = 1; i < p.nodes; ++i) {
    const int m = (p.node + i) % p.nodes;
    if (!gr_put(p, epoch, m, gr_rank_of(p, m, ws.rank), at, at, (uint64_t)(r1 - r0) * row_bytes, word, posts)) return false;
  }
  return true;
}

// The reduction across nodes, for team j of `stride`:
//  1. node partials of the tiles j, j + stride, ... (compute order), other nodes' owners
//     first (their puts go out while this node's work continues);
//  2. this rank's own blocks x column tiles: the N node partials summed in node order;
//  3. AllReduce: every block this rank does not own, copied from the R of the local rank
//     holding it (its owner on this node, or the owner's GPU-i counterpart here).
template <typename T, int BN, class Team>
__device__ __forceinline__ bool reduce_nodes(const GemmReduceParams& p, uint64_t epoch, int j, int stride) {
  const Staging staging = team_staging<BN, Team>();
  const WorkspaceView& ws = p.ws;
  const int L = ws.nranks, l = ws.rank, N = p.nodes, n = p.node, g = p.global_rank;
  const bool all = p.op == MK_OP_GEMM_ALL_REDUCE;
  const int tiles_m = (p.m + 127) / 128;
  const int total = tiles_m * p.tiles_n;
  char* own = reinterpret_cast<char*>(ws.data[l]);
  NetPosts posts{0, false};
  int ok = 1;

  const auto partial = [&](int s) { return reinterpret_cast<const char*>(p.ws.data[s]) + p.partial_offset; };
  for (int t = j; t < total; t += stride) {
    const TileCoord tc = interleaved_tile(tiles_m, p.tiles_n, p.group_m, p.interleave, t);
    const int tr0 = tc.m_block * 128, tr1 = min(tr0 + 128, p.m);
    const int c0 = tc.n_block * BN, c1 = min(c0 + BN, p.n);
    for (int i = 1; i <= N; ++i) {
      const int m = (n + i) % N, q = gr_rank_of(p, m, l);
      const int lo = gr_owner_lo(p, q), hi = gr_owner_lo(p, q + 1);
      const int r0 = max(tr0, lo), r1 = min(tr1, hi);
      if (r0 >= r1) continue;
      if (!wait_partials<Team>(p, epoch, tc, r0, r1)) return false;
      if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_ITEMS, 1);
      char* slab = own + (m == n ? p.inbox_offset : p.outbox_offset) + (uint64_t)m * p.slab_bytes;
      sum_rows<T, Team>(staging, partial, L, 0, slab, lo, nullptr, p.n, r0, r1, c0, c1, p.trace);
      __threadfence_system();  // this thread's rows, before the count (the proxy reads them)
      Team::sync();
      if (Team::tid() == 0) ok = count_node_rows<T>(p, epoch, m, q, lo, hi, r0, r1, c1 - c0, posts);
      if (!Team::and_all(ok)) return false;
    }
  }

  const int my_lo = gr_owner_lo(p, g), my_hi = gr_owner_lo(p, g + 1);
  const int my_blocks = (my_hi - my_lo + 127) / 128;
  const auto inbox = [&](int s) { return reinterpret_cast<const char*>(p.ws.data[p.ws.rank]) + p.inbox_offset + (uint64_t)s * p.slab_bytes; };
  char* reduced = all ? own + p.reduced_offset : nullptr;
  for (int it = j; it < my_blocks * p.tiles_n; it += stride) {
    const int b = it / p.tiles_n, nt = it % p.tiles_n;
    const uint64_t t0 = MK_TRACED(p.trace) ? mk_globaltimer() : 0;
    const int x = Team::tid();
    ok = 1;
    if (x < N)
      ok = mk_wait_geq_inline(ws, mk_signal_word(ws, l, p.net_in_word + x * p.owner_blocks + b), epoch, gr_rank_of(p, x, l),
                              x == n ? MK_WAIT_OP_FLAG : MK_WAIT_NET, p.op);
    if (!Team::and_all(ok)) return false;
    if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_WAIT, mk_globaltimer() - t0);
    const int r0 = my_lo + b * 128, r1 = min(r0 + 128, my_hi);
    const int c0 = nt * BN, c1 = min(c0 + BN, p.n);
    sum_rows<T, Team>(staging, inbox, N, my_lo, reinterpret_cast<char*>(p.c), p.out_row0, reduced, p.n, r0, r1, c0, c1, p.trace);
    if (all) {
      __threadfence_system();
      Team::sync();
      if (Team::tid() == 0) ok = count_own_rows<T>(p, epoch, b, r0, r1, c1 - c0, posts);
      if (!Team::and_all(ok)) return false;
    }
  }

  if (all) {
    const int items = N * L * p.owner_blocks * p.tiles_n;
    for (int it = j; it < items; it += stride) {
      const int nt = it % p.tiles_n, rest = it / p.tiles_n;
      const int b = rest % p.owner_blocks, k = rest / p.owner_blocks;
      const int m = (n + k / L) % N, x = (l + k % L) % L;  // this node's owners first
      const int q = gr_rank_of(p, m, x);
      if (q == g) continue;
      const int lo = gr_owner_lo(p, q), hi = gr_owner_lo(p, q + 1);
      const int r0 = lo + b * 128, r1 = min(r0 + 128, hi);
      if (r0 >= r1) continue;
      const uint64_t t0 = MK_TRACED(p.trace) ? mk_globaltimer() : 0;
      ok = 1;
      if (Team::tid() == 0)
        ok = mk_wait_geq_inline(ws, mk_signal_word(ws, x, p.net_reduced_word + m * p.owner_blocks + b), epoch, q,
                                m == n ? MK_WAIT_OP_FLAG : MK_WAIT_NET, p.op);
      if (!Team::and_all(ok)) return false;
      if (Team::tid() == 0) mk_trace_add(p.trace, MK_TR_WAIT, mk_globaltimer() - t0);
      const int c0 = nt * BN, c1 = min(c0 + BN, p.n);
      copy_rows<T, Team>(staging, reinterpret_cast<char*>(p.c), reinterpret_cast<const char*>(ws.data[x]) + p.reduced_offset, p.n, r0, r1,
                         c0, c1);
    }
  }

  ok = 1;
  if (Team::tid() == 0 && posts.posted) {
    const int rc = mk_proxy_wait_complete(p.ring, posts.ticket);
    if (rc != mkSuccess) ok = 0, mk_fail(p.ws, mk_error_word((uint32_t)rc, 0xff, MK_WAIT_PROXY, p.op));
  }
  return Team::and_all(ok) != 0;
}

// Thread 0 of CTA 0, at the start of a call across nodes, once the local peers finished
// reading this rank's buffers of the previous call: tells the GPU-l rank of every other
// node that it may put this call's data into this rank's inbox and R (GR_NET_DONE).
__device__ __forceinline__ void gr_post_net_done(const GemmReduceParams& p, uint64_t epoch) {
  for (int i = 1; i < p.nodes; ++i) {
    const int m = (p.node + i) % p.nodes, peer = gr_rank_of(p, m, p.ws.rank);
    uint64_t ticket;
    const int rc = mk_proxy_signal(p.ring, (uint32_t)peer, GR_NET_DONE + p.node, (uint32_t)(epoch - 1), &ticket);
    if (rc != mkSuccess) {
      mk_fail(p.ws, mk_error_word((uint32_t)rc, (uint32_t)peer, MK_WAIT_PROXY, p.op));
      return;
    }
  }
}

template <typename T, int BN, class Team>
__device__ __forceinline__ bool reduce(const GemmReduceParams& p, uint64_t epoch, int j, int stride) {
  if constexpr (!LeanTeam<Team>::value) {  // the side warps reduce on one node only (the host plans it)
    if (p.nodes > 1) return reduce_nodes<T, BN, Team>(p, epoch, j, stride);
  }
  return p.two_phase ? reduce_then_gather<T, BN, Team>(p, epoch, j, stride) : reduce_tiles<T, BN, Team>(p, epoch, j, stride);
}

// The GEMM's epilogue: partial tiles stored into this rank's region, each 64-row slab
// flagged with the epoch.
using PartialEpilogue = TmaEpilogue<GatedDest, TmaStoreOp, EpochTileSignal>;

// The side warps' hook (kernels/common/gemm/hooks.cuh) of kernels/gemm_reduce.cu and
// kernels/gemm_reduce_scaled.cu. The idle producer warps do not reduce during the GEMM:
// that measured slower than reducing after it (docs/decisions/0101-side-reducers.md;
// kernels/gemm_reduce_early.cu sums the earlier tiles during the GEMM instead). On one
// node, warp 2 first opens the CTA's start gate (open_gate): warps 2-3 run beside the GEMM
// from its start, which is what lets the epoch read and the peers' GR_DONE wait overlap the
// first loads.
struct ReduceSideWork : NoAWait {
  struct Params {
    const GemmReduceParams* op;
    Gate* gate;
  };
  __device__ static void before_a_load(const Params&, int, int, int) {}
  __device__ static const CUtensorMap* a_source(const Params&, const CUtensorMap* tma_a, int m_row0, int& row) {
    row = m_row0;
    return tma_a;
  }
  template <typename T, int BN>
  __device__ static void run(const Params& w) {
    const GemmReduceParams& p = *w.op;
    if (p.nodes == 1 && threadIdx.x / 32 == 2) open_gate(p, w.gate);
  }
};
template <typename T, int BN>
struct ReduceSideWorkFor : ReduceSideWork {
  __device__ static void side_work(const Params& w, int) { ReduceSideWork::run<T, BN>(w); }
};

}  // namespace gemm_reduce
}  // namespace mk
