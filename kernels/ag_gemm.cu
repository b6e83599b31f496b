// AllGather + GEMM in one persistent kernel (mkAllGatherGemm).
//
// CTAs [0, compute_ctas) run the GEMM engine over the gathered A in this rank's workspace,
// row blocks in rank-rotated order (own rows first); before a tile's A rows are loaded the
// producer waits for the chunks covering them. First the whole grid copies this rank's rows
// into its own gathered buffer (copy_own_rows). The pushers (the idle warps of every GEMM
// CTA's producer warpgroup, or CTAs [compute_ctas, +comm_ctas) with MK_COMM_SMS) copy this
// rank's rows, chunk by chunk, into every peer's gathered buffer (rank-1, rank-2, ...: the
// order in which the peers consume them) and raise one epoch-valued flag per chunk in the
// receiver's signal region. With `gathered_out` they then copy the whole gathered A out for
// the caller.
//
// The GEMM reads every row through the one tensor map of the gathered buffer, own rows too,
// although it could read those from the caller's A in place: with a second map for the own
// rows the GEMM runs 7-12 % slower at 2 ranks (N = K = 8192, every tile,
// with pushes and waits switched off, and not cured by prefetching the second map), more
// than the copy costs (47 µs at 2048 rows/rank). Copied by the pushers instead, chunk by
// chunk ahead of the peers' rows, it is slower still (the GEMM's first tiles wait
// on 96 threads per CTA instead of 384).
//
// Epochs live on the device (signal word AGG_EPOCH), so a captured CUDA graph replays
// correctly: every CTA reads the epoch at start; the last CTA to finish advances it and
// tells every peer it has finished reading its gathered buffer (AGG_DONE), which a pusher
// waits for before overwriting that buffer in the next call.
//
// Across nodes (p.nodes > 1; ws is this node's workspace, indexed by local rank l, and
// rows are placed by global rank): this rank's rows are first copied into its own
// gathered buffer by the whole grid (the proxy can only read from the registered window),
// then one pusher thread hands them to the proxy, one put per chunk to the GPU-l rank of
// every other node, into the same rows of that rank's gathered buffer (symmetric offsets),
// the put raising the chunk's flag there. The pushers forward over NVLink, chunk by chunk,
// the rows this rank holds for its node -- its own, then each other node's GPU-l rows as
// their chunks arrive through the proxy -- into every local peer's gathered buffer. So
// every row crosses the network once per node and NVLink once per local peer, and the GEMM
// (own rows, local peers' rows, then the other nodes') waits per chunk as on one node.
// The last CTA's end of the epoch is also sent, through the proxy, to the GPU-l rank of
// every other node (AGG_NET_DONE): their next call's puts wait for it.
//
// The trace hooks stay behind their run-time test in the library's build of this file
// (MK_TRACE_AT_RUN_TIME): compiled out, ptxas allocates the BN 128 kernels' register-tight
// producer warps differently and spills 32 bytes (tests/kernels.rs forbids spills), while
// with the hooks it spills nothing. The C API passes no trace buffer, so each hook is one
// predictable branch.
#define MK_TRACE_AT_RUN_TIME
#include "common/gemm/engine.cuh"
#include "common/fused_op.cuh"
#include "common/ag_gemm.cuh"
#include "common/proxy.cuh"
#include "common/trace.cuh"

// Signal words of this op: AGG_* in mk_kernel_abi.h (src/kernel_abi.rs).

namespace mk { namespace ag_gemm {

using namespace mk::gemm;

// Whether every rank's rows are whole 128-row blocks (no tile mixes two ranks' rows).
__device__ __forceinline__ bool whole_block_shards(const AgGemmParams& p) { return p.rows_per_rank % 128 == 0; }

__device__ __forceinline__ int agg_rank_of(const AgGemmParams& p, int node, int local) {
  return p.rank_of[node * MK_MAX_PEERS + local];
}

// Registers of the GEMM's producer warpgroup, whose three idle warps push: ptxas spills
// the push loop below 80 (measured: 40, 56, 64 all spill); the consumers keep 208, which
// BN = 256 fits without spills (tests/kernels.rs checks both).
constexpr int kProducerRegs = 80;

// The pushers: dedicated CTAs (CtaTeam), or the three idle warps of a GEMM CTA's producer
// warpgroup (threads 32..127, named barrier 3).
using SideWarps = WarpTeam<32, 96, 3>;
// 16-byte loads in flight per pushing thread (fits the producer's kProducerRegs).
constexpr int kPushInFlight = 8;
// Across nodes the forwarding loop keeps more state live: 4 in flight stays within 80.
constexpr int kHierPushInFlight = 4;

// With `gathered_out`, pusher `part` of `parts` copies its slice of every chunk of the
// gathered A out for the caller, as the chunks arrive (global ranks: p.m / rows_per_rank).
template <class Team>
__device__ __forceinline__ bool copy_gathered_out(const AgGemmParams& p, uint64_t epoch, int part, int parts) {
  if (p.gathered_out == 0) return true;
  const int tid = Team::tid(), threads = Team::threads();
  const WorkspaceView& ws = p.ws;
  const int n = p.m / p.rows_per_rank, chunks = p.chunks_per_rank;
  const size_t row_bytes = (size_t)p.k * 2;
  const char* own = reinterpret_cast<const char*>(ws.data[ws.rank]) + p.gathered_offset;
  for (int src = 0; src < n; ++src) {
    for (int c = 0; c < chunks; ++c) {
      int ok = 1;
      if (tid == 0)
        ok = mk_wait_geq_inline(ws, mk_signal_word(ws, ws.rank, agg_chunk(p, src, c)), epoch, src, MK_WAIT_OP_FLAG,
                                MK_OP_ALL_GATHER_GEMM);
      if (!Team::and_all(ok)) return false;
      const size_t first = ((size_t)src * p.rows_per_rank + (size_t)c * p.chunk_rows) * row_bytes;
      const size_t bytes = (size_t)min(p.chunk_rows, p.rows_per_rank - c * p.chunk_rows) * row_bytes;
      const size_t slice = (bytes / 16 + parts - 1) / parts * 16;
      const size_t begin = first + min(bytes, (size_t)part * slice), end = first + min(bytes, (size_t)(part + 1) * slice);
      copy_vectors<kPushInFlight>(reinterpret_cast<char*>(p.gathered_out) + begin, own + begin, end - begin, tid, threads);
    }
  }
  return true;
}

// Pusher `part` of `parts` (the threads of Team) copies its slice of every chunk
// of this rank's rows into every peer's gathered buffer: rank-1 first (it consumes our
// rows next), then rank-2, ... After its slice of chunk c for peer q it counts itself in
// AGG_PUSHED(q, c); the last pusher of that chunk raises the chunk's flag at q. Slicing every chunk across all pushers keeps a chunk's latency
// short (a chunk is at least one 128-row block: 2 MB at K = 8192, 35-200 µs for one CTA).
// Then, with `gathered_out`, the gathered A is copied out for the caller as its chunks
// arrive. Team thread 0 waits.
template <class Team>
__device__ __forceinline__ bool push_chunks(const AgGemmParams& p, uint64_t epoch, int part, int parts) {
  const int tid = Team::tid(), threads = Team::threads();
  const WorkspaceView& ws = p.ws;
  const int n = ws.nranks, me = ws.rank, chunks = p.chunks_per_rank;
  const size_t row_bytes = (size_t)p.k * 2;
  for (int i = 1; i < n; ++i) {
    const int q = (me - i + n) % n;
    int ok = 1;
    uint64_t t0 = 0;
    if (tid == 0) {
      t0 = MK_TRACED(p.trace) ? mk_globaltimer() : 0;
      // q must have finished reading its gathered buffer of our previous call.
      ok = mk_wait_geq_inline(ws, mk_signal_word(ws, me, AGG_DONE + q), epoch - 1, q, MK_WAIT_OP_FLAG, MK_OP_ALL_GATHER_GEMM);
      if (MK_TRACED(p.trace)) mk_trace_add(p.trace, MK_TR_WAIT, mk_globaltimer() - t0);
    }
    if (!Team::and_all(ok)) return false;
    char* peer = reinterpret_cast<char*>(ws.data[q]) + p.gathered_offset + (size_t)me * p.rows_per_rank * row_bytes;
    for (int c = 0; c < chunks; ++c) {
      const size_t first = (size_t)c * p.chunk_rows * row_bytes;
      const size_t bytes = (size_t)min(p.chunk_rows, p.rows_per_rank - c * p.chunk_rows) * row_bytes;
      const size_t slice = (bytes / 16 + parts - 1) / parts * 16;
      const size_t begin = first + min(bytes, (size_t)part * slice), end = first + min(bytes, (size_t)(part + 1) * slice);
      copy_vectors<kPushInFlight>(peer + begin, reinterpret_cast<const char*>(p.a_local) + begin, end - begin, tid, threads);
      Team::sync();
      if (tid == 0) {
        mk_trace_add(p.trace, MK_TR_BYTES, 2ull * (end - begin));
        __threadfence_system();  // our slice (every thread's stores, ordered by the barrier), then the count
        if (mk_arrive_last(mk_signal_word(ws, me, AGG_PUSHED + q * MK_AG_GEMM_MAX_CHUNKS + c), (unsigned long long)parts)) {
          mk_signal_store(mk_signal_word(ws, q, agg_chunk(p, me, c)), epoch);
          mk_trace_add(p.trace, MK_TR_ITEMS, 1);
        }
      }
    }
  }
  return copy_gathered_out<Team>(p, epoch, part, parts);
}

// Across nodes, Team thread 0 of pusher part 0: hands this rank's rows (already in its
// gathered buffer: copy_own_rows) to the proxy, one put per chunk to the GPU-l rank of
// every other node, each raising the chunk's flag there. A node's rank is written only
// after it finished reading its buffer in the previous call (AGG_NET_DONE). *ticket: the
// last command posted (its completion frees the sources for the next call).
__device__ __forceinline__ bool post_own_rows(const AgGemmParams& p, uint64_t epoch, uint64_t* ticket) {
  const WorkspaceView& ws = p.ws;
  const int g = p.global_rank;
  const size_t row_bytes = (size_t)p.k * 2;
  for (int c = 0; c < p.chunks_per_rank; ++c)
    if (!mk_wait_geq_inline(ws, mk_signal_word(ws, ws.rank, agg_chunk(p, g, c)), epoch, g, MK_WAIT_OP_FLAG, MK_OP_ALL_GATHER_GEMM))
      return false;
  for (int i = 1; i < p.nodes; ++i) {
    const int m = (p.node + i) % p.nodes;
    const int peer = agg_rank_of(p, m, ws.rank);
    if (!mk_wait_geq_inline(ws, mk_signal_word(ws, ws.rank, AGG_NET_DONE + m), epoch - 1, peer, MK_WAIT_NET, MK_OP_ALL_GATHER_GEMM))
      return false;
    for (int c = 0; c < p.chunks_per_rank; ++c) {
      const uint64_t at = p.gathered_offset + ((uint64_t)g * p.rows_per_rank + (uint64_t)c * p.chunk_rows) * row_bytes;
      const uint64_t bytes = (uint64_t)min(p.chunk_rows, p.rows_per_rank - c * p.chunk_rows) * row_bytes;
      const int rc = mk_proxy_put(p.ring, (uint32_t)peer, at, at, (uint32_t)bytes, agg_chunk(p, g, c), (uint32_t)epoch, ticket);
      if (rc != mkSuccess) {
        mk_fail(p.ws, mk_error_word((uint32_t)rc, (uint32_t)peer, MK_WAIT_PROXY, MK_OP_ALL_GATHER_GEMM));
        return false;
      }
    }
  }
  return true;
}

// Across nodes, pusher `part` of `parts`: after part 0 has posted the puts of this rank's
// rows, every pusher forwards its slice of the rows this rank holds for its node -- its own
// (from A), then those of the GPU-l rank of node n+1, n+2, ... as each chunk arrives
// through the proxy (from the gathered buffer) -- into every local peer's gathered buffer
// (l-1 first), counting itself in AGG_PUSHED; the last pusher of a chunk raises its flag
// at the peer. Then the copy out for the caller, and part 0 waits until the proxy has
// sent its puts (the next call overwrites their sources).
template <class Team>
__device__ __forceinline__ bool push_hier(const AgGemmParams& p, uint64_t epoch, int part, int parts) {
  const int tid = Team::tid(), threads = Team::threads();
  const WorkspaceView& ws = p.ws;
  const int L = ws.nranks, l = ws.rank, N = p.nodes, g = p.global_rank, chunks = p.chunks_per_rank;
  const size_t row_bytes = (size_t)p.k * 2;
  // The poster's last ticket, in shared memory: a register for it spills the loop below.
  __shared__ uint64_t ticket;
  const bool poster = part == 0 && tid == 0 && N > 1;
  int ok = 1;
  if (tid == 0) {
    const uint64_t t0 = MK_TRACED(p.trace) ? mk_globaltimer() : 0;
    // Every local peer must have finished reading its gathered buffer of our previous call.
    for (int j = 0; j < L && ok; ++j)
      if (j != l)
        ok = mk_wait_geq_inline(ws, mk_signal_word(ws, l, AGG_DONE + j), epoch - 1, agg_rank_of(p, p.node, j),
                                MK_WAIT_OP_FLAG, MK_OP_ALL_GATHER_GEMM);
    if (ok && poster) ok = post_own_rows(p, epoch, &ticket);
    if (MK_TRACED(p.trace)) mk_trace_add(p.trace, MK_TR_WAIT, mk_globaltimer() - t0);
  }
  if (!Team::and_all(ok)) return false;
  const char* own = reinterpret_cast<const char*>(ws.data[l]) + p.gathered_offset;
  for (int i = 0; i < N; ++i) {
    const int m = (p.node + i) % N;
    const int s = agg_rank_of(p, m, l);
    const size_t shard = (size_t)s * p.rows_per_rank * row_bytes;
    const char* from = s == g ? reinterpret_cast<const char*>(p.a_local) : own + shard;
    for (int c = 0; c < chunks; ++c) {
      if (s != g) {
        ok = 1;
        if (tid == 0) {
          const uint64_t t0 = MK_TRACED(p.trace) ? mk_globaltimer() : 0;
          ok = mk_wait_geq_inline(ws, mk_signal_word(ws, l, agg_chunk(p, s, c)), epoch, s, MK_WAIT_NET, MK_OP_ALL_GATHER_GEMM);
          if (MK_TRACED(p.trace)) mk_trace_add(p.trace, MK_TR_WAIT, mk_globaltimer() - t0);
        }
        if (!Team::and_all(ok)) return false;
      }
      const size_t first = (size_t)c * p.chunk_rows * row_bytes;
      const size_t bytes = (size_t)min(p.chunk_rows, p.rows_per_rank - c * p.chunk_rows) * row_bytes;
      const size_t slice = (bytes / 16 + parts - 1) / parts * 16;
      const size_t begin = first + min(bytes, (size_t)part * slice), end = first + min(bytes, (size_t)(part + 1) * slice);
      for (int jj = 1; jj < L; ++jj) {
        const int j = (l - jj + L) % L;
        char* peer = reinterpret_cast<char*>(ws.data[j]) + p.gathered_offset + shard;
        copy_vectors<kHierPushInFlight>(peer + begin, from + begin, end - begin, tid, threads);
        Team::sync();
        if (tid == 0) {
          mk_trace_add(p.trace, MK_TR_BYTES, 2ull * (end - begin));
          __threadfence_system();  // our slice (every thread's stores, ordered by the barrier), then the count
          if (mk_arrive_last(mk_signal_word(ws, l, AGG_PUSHED + (j * N + m) * p.flag_stride + c), (unsigned long long)parts)) {
            mk_signal_store(mk_signal_word(ws, j, agg_chunk(p, s, c)), epoch);
            mk_trace_add(p.trace, MK_TR_ITEMS, 1);
          }
        }
      }
    }
  }
  if (!copy_gathered_out<Team>(p, epoch, part, parts)) return false;
  if (poster) {
    const int rc = mk_proxy_wait_complete(p.ring, ticket);
    if (rc != mkSuccess) ok = 0, mk_fail(p.ws, mk_error_word((uint32_t)rc, 0xff, MK_WAIT_PROXY, MK_OP_ALL_GATHER_GEMM));
  }
  return Team::and_all(ok) != 0;
}

// The pushers' work: across nodes or within one.
template <class Team>
__device__ __forceinline__ void push(const AgGemmParams& p, uint64_t epoch, int part, int parts) {
  if (p.nodes > 1) push_hier<Team>(p, epoch, part, parts);
  else if (p.ws.nranks > 1) push_chunks<Team>(p, epoch, part, parts);
}

// Tile order: own rows first, then (RankRotatedRaster) the next ranks'. Across nodes with
// whole-block shards: own rows, the local peers' (l+1, l+2, ...), then node n+1's ranks
// (its GPU-l rank first: those rows come straight from the proxy), node n+2's, ...
struct NodeOrderRaster {
  struct Params {
    RasterParams r;
    const AgGemmParams* op;
    int blocks_per_rank;  // 0: RankRotatedRaster
  };
  __device__ static TileCoord tile(const Params& s, int t) {
    if (s.blocks_per_rank == 0) return RankRotatedRaster::tile(s.r, t);
    TileCoord c = grouped_tile(s.r.tiles_m, s.r.tiles_n, s.r.group_m, t);
    const AgGemmParams& p = *s.op;
    const int L = p.ws.nranks;
    const int k = c.m_block / s.blocks_per_rank;  // k-th source in the order
    const int m = (p.node + k / L) % p.nodes, j = (p.ws.rank + k % L) % L;
    c.m_block = agg_rank_of(p, m, j) * s.blocks_per_rank + c.m_block % s.blocks_per_rank;
    return c;
  }
};

// Waits, in the engine's producer thread, for every chunk covering rows [row0, row0 + rows).
struct ChunkAWait {
  struct Params {
    const AgGemmParams* op;  // the __grid_constant__ kernel parameter (no local copy)
    uint64_t epoch;
  };
  __device__ static void before_a_load(const Params& w, int, int row0, int rows) {
    const AgGemmParams& p = *w.op;
    const uint64_t t0 = MK_TRACED(p.trace) ? mk_globaltimer() : 0;
    wait_gathered_rows(p, w.epoch, row0, rows, MK_OP_ALL_GATHER_GEMM);
    if (MK_TRACED(p.trace)) mk_trace_add(p.trace, MK_TR_WAIT, mk_globaltimer() - t0);
  }
  __device__ static const CUtensorMap* a_source(const Params&, const CUtensorMap* tma_a, int m_row0, int& row) {
    row = m_row0;
    return tma_a;
  }
  // Without dedicated communication CTAs, the side warps of every GEMM CTA push.
  __device__ static void side_work(const Params& w, int) {
    const AgGemmParams& p = *w.op;
    if (p.comm_ctas == 0) {
      push<SideWarps>(p, w.epoch, blockIdx.x, p.compute_ctas);
      // The push's end, for `mkbench ag_gemm --trace` (does it overlap the whole GEMM?).
      if (SideWarps::tid() == 0) mk_trace_stamp(p.trace, MK_TR_SIDE);
    }
  }
};

// Whole grid, before the GEMM (which reads every row from the gathered buffer; across
// nodes the proxy's puts read the own rows from there too): every CTA copies its slice of
// this rank's rows into the own gathered buffer; the last to finish raises the own-row
// chunk flags.
__device__ __forceinline__ void copy_own_rows(const AgGemmParams& p, uint64_t epoch) {
  const WorkspaceView& ws = p.ws;
  const size_t row_bytes = (size_t)p.k * 2;
  const size_t total = (size_t)p.rows_per_rank * row_bytes;  // a multiple of 16
  const size_t slice = ((total / 16 + gridDim.x - 1) / gridDim.x) * 16;
  const size_t begin = min(total, (size_t)blockIdx.x * slice), end = min(total, begin + slice);
  char* own = reinterpret_cast<char*>(ws.data[ws.rank]) + p.gathered_offset + (size_t)p.global_rank * p.rows_per_rank * row_bytes;
  cta_copy(own + begin, reinterpret_cast<const char*>(p.a_local) + begin, end - begin);
  __syncthreads();
  if (threadIdx.x == 0) {
    if (p.nodes > 1) __threadfence_system();  // the proxy's copy reads them
    else __threadfence();
    if (mk_arrive_last(mk_signal_word(ws, ws.rank, AGG_LOCAL), gridDim.x)) {
      for (int c = 0; c < p.chunks_per_rank; ++c)
        mk_signal_store(mk_signal_word(ws, ws.rank, agg_chunk(p, p.global_rank, c)), epoch);
    }
  }
}

// mk_op_epoch_end across nodes: the last CTA also tells the GPU-l rank of every other node,
// through the proxy, that this rank finished reading its gathered buffer (AGG_NET_DONE).
__device__ __forceinline__ void agg_epoch_end_hier(const AgGemmParams& p, uint64_t epoch) {
  const WorkspaceView& ws = p.ws;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    if (mk_arrive_last(mk_signal_word(ws, ws.rank, AGG_ARRIVE), gridDim.x)) {
      mk_st_release_sys(mk_signal_word(ws, ws.rank, AGG_EPOCH), epoch);
      for (int q = 0; q < ws.nranks; ++q)
        if (q != ws.rank) mk_signal_store(mk_signal_word(ws, q, AGG_DONE + ws.rank), epoch);
      for (int i = 1; i < p.nodes; ++i) {
        const int m = (p.node + i) % p.nodes, peer = agg_rank_of(p, m, ws.rank);
        uint64_t ticket;
        const int rc = mk_proxy_signal(p.ring, (uint32_t)peer, AGG_NET_DONE + p.node, (uint32_t)epoch, &ticket);
        if (rc != mkSuccess) {
          mk_fail(p.ws, mk_error_word((uint32_t)rc, (uint32_t)peer, MK_WAIT_PROXY, MK_OP_ALL_GATHER_GEMM));
          break;
        }
      }
    }
  }
}

template <typename T, int BN>
__device__ __forceinline__ void ag_gemm(const CUtensorMap* tma_a, const CUtensorMap* tma_b, const CUtensorMap* tma_c, const AgGemmParams& p) {
  using Cfg = GemmConfig<T, BN, FusedStages<BN>::value, SHARE_NONE, kProducerRegs>;
  using Epi = TmaStoreEpilogue;
  extern __shared__ __align__(1024) char smem[];
  mk_check_engine_smem<Cfg, Epi>();
  const WorkspaceView& ws = p.ws;
  mk_trace_begin(p.trace, (int)blockIdx.x >= p.compute_ctas);
  const uint64_t epoch = mk_op_epoch_begin(ws, AGG_EPOCH);
  copy_own_rows(p, epoch);
  mk_trace_time(p.trace, MK_TR_SETUP);

  if ((int)blockIdx.x < p.compute_ctas) {
    RasterParams sched;
    sched.tiles_m = (p.m + Cfg::BM - 1) / Cfg::BM;
    sched.tiles_n = (p.n + BN - 1) / BN;
    sched.group_m = p.group_m > 0 ? p.group_m : 1;
    sched.m_block_base = p.m_block_base;
    sched.owners = 1;
    typename NodeOrderRaster::Params order{sched, &p, p.nodes > 1 && whole_block_shards(p) ? p.rows_per_rank / Cfg::BM : 0};
    typename ChunkAWait::Params await{&p, epoch};
    typename Epi::Params epi;
    epi.dest.tma_c = tma_c;
    epi.signal.unused = 0;
    gemm_persistent<Cfg, NodeOrderRaster, ChunkAWait, Epi>(tma_a, tma_b, GemmShape{p.m, p.n, p.k}, order, await, epi,
                                                              blockIdx.x, p.compute_ctas, smem);
  } else {
    push<CtaTeam>(p, epoch, blockIdx.x - p.compute_ctas, p.comm_ctas);
  }
  if (MK_TRACED(p.trace)) {
    __syncthreads();  // a GEMM CTA's thread 0 (the producer) finishes before its consumers
    mk_trace_time(p.trace, MK_TR_ROLE);
  }

  // The last CTA to finish advances the epoch and frees this rank's gathered buffer.
  if (p.nodes > 1) agg_epoch_end_hier(p, epoch);
  else mk_op_epoch_end(ws, AGG_EPOCH, AGG_ARRIVE, AGG_DONE, epoch);
  mk_trace_time(p.trace, MK_TR_END);
}

}  // namespace ag_gemm
}  // namespace mk

#define MK_AG_GEMM_ENTRY(NAME, T, BN)                                                                  \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                \
      NAME(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,       \
           const __grid_constant__ CUtensorMap tma_c,                                                 \
           const __grid_constant__ AgGemmParams p) {                                                  \
    mk::ag_gemm::ag_gemm<T, BN>(&tma_a, &tma_b, &tma_c, p);                                           \
  }

#include "kernel_instances/ag_gemm.inc"  // the entry points: kernels/instances.txt
