// MoE token dispatch fused with the experts' grouped GEMM (mkMoeDispatchGemm) and the
// grouped GEMM fused with the way back (mkMoeGemmCombine). Semantics and the receive
// layout are defined in src/ops/moe.rs (the host reference); this file is the device side.
//
// Receive layout on owner d: rows grouped by local expert, inside an expert by source
// rank, then by token index; each expert's segment starts on a 128-row boundary (the
// GEMM's BM), so a tile never straddles two experts. Every rank learns every rank's
// per-expert counts at the start of the dispatch (count exchange through the fused-op
// region), so every rank computes every offset itself: no host round trip, graph-capturable.
//
// Dispatch, CTAs [0, compute_ctas): the GEMM engine over (m-block, n-block) tiles of
//   Y = X_recv · W1_eᵀ, m-blocks in the receive layout's order (expert-major, raster groups
//   cut at experts, so an expert's blocks share its weight tiles in L2); before loading a
//   tile's A rows the producer waits for RECV[s, expert] of every source s whose rows the
//   block holds. With a gated w1 (SwiGLU, GeGLU: dispatch_gated) a tile loads an output
//   column block's gate and up rows together and its epilogue writes act(gate) · up. Both kernels' GEMMs schedule tiles dynamically: the GEMM CTAs take them in
//   that order from a ticket counter (MoeRaster, MOE_TILE_NEXT), so they end together.
// Dispatch, the prep (the first CTAs, each a slice of the tokens, before their GEMM): counts
//   this rank's routing per expert and each (token, expert)'s position among this rank's
//   tokens of that expert, exchanges the counts, computes the layout, the m-block tables
//   and the send list into the caller's layout buffer. Then the senders copy
//   token rows (16-byte vectors) into the owners' receive buffers, expert by expert (the
//   send list), and whoever completes a (destination, expert) list raises
//   RECV[this rank, expert] there. The senders are the three idle warps of every GEMM CTA's
//   producer warpgroup (default: no comm CTA), or the comm CTAs when MK_COMM_SMS asks.
// Combine, CTAs [0, compute_ctas): the engine over the same m-blocks, Z = Y' · W2_eᵀ into
//   this rank's fused-op region (TMA stores; remote stores would stall the TMA pipeline),
//   in column bands (band_w), each 64-row slab followed by an epoch-valued flag.
// Combine, the pull: for each own token and column tile, wait for the slabs holding its k
//   rows on their owners, pull them and write out[t] = Σ_j w[t, j] · Z[row(t, j)] (fp32,
//   j in order 0..k-1, rounded once). The idle producer warps of the GEMM CTAs pull the
//   earlier bands' outputs while the later bands compute, every warp the rest after its
//   GEMM; with MK_COMM_SMS, CTAs [compute_ctas, +comm_ctas) pull instead.
//
// Both kernels share one device-side epoch (MOE_EPOCH) and the end-of-kernel handshake
// (MOE_DONE): before a kernel writes into any rank's fused-op region it waits until every
// peer has finished the previous MoE kernel (no one still sends into or pulls from it).
#include "common/gemm/engine.cuh"
#include "common/fused_op.cuh"
#include "common/trace.cuh"
#include "common/moe_raster.cuh"  // band_locate, MoeRaster, ld_cg

// Signal words (MOE_*), layout words (MOE_LAY_*), MOE_MAX_EXPERTS and MOE_WARPS: in
// mk_kernel_abi.h (src/kernel_abi.rs).

namespace mk { namespace moe {

using namespace mk::gemm;

// The MoE kernels' waits: with a back-off (signals.cuh), up to 2 us between polls.
__device__ __forceinline__ bool moe_wait(const WorkspaceView& ws, const uint64_t* flag, uint64_t target, int peer,
                                         uint32_t what, uint32_t op) {
  return mk_wait_geq_backoff<64, 2048, 8>(ws, flag, target, peer, what, op);
}

// Whole CTA: thread 0 waits for one flag (with back-off); every thread learns the outcome.
__device__ __forceinline__ bool moe_cta_wait(const WorkspaceView& ws, const uint64_t* flag, uint64_t target, int peer,
                                             uint32_t op) {
  int ok = 1;
  if (threadIdx.x == 0) ok = moe_wait(ws, flag, target, peer, MK_WAIT_OP_FLAG, op);
  return __syncthreads_and(ok) != 0;
}

// Whole CTA: thread p (< nranks, p != skip) waits for word first_word + p of this rank's
// region to reach target.
__device__ __forceinline__ bool moe_cta_wait_peers(const WorkspaceView& ws, uint32_t first_word, uint64_t target, int skip,
                                                   uint32_t op) {
  int ok = 1;
  const int p = threadIdx.x;
  if (p < ws.nranks && p != skip) ok = moe_wait(ws, mk_signal_word(ws, ws.rank, first_word + p), target, p, MK_WAIT_OP_FLAG, op);
  return __syncthreads_and(ok) != 0;
}

// C tile columns: the scheduler's n_block counts over all experts' B rows; the output has
// only one expert's columns.
struct ExpertDest {
  struct Params {
    const CUtensorMap* tma_c;
    int cols;  // F (dispatch) or H (combine)
  };
  __device__ static const CUtensorMap* map(const Params& p, const SlabInfo& s, int& row, int& col) {
    row = s.row0;
    col = s.col0 % p.cols;
    return p.tma_c;
  }
};

struct ZSlabSignal {
  struct Params {
    uint64_t* flags;
    int tiles_n;
    uint64_t epoch;
    uint64_t trace;
  };
  static constexpr bool enabled = true;
  __device__ static void after_store(const Params& p, const SlabInfo& s) {
    fence_proxy_async_global();  // the TMA (async proxy) writes, then the flag
    const int n = s.tile.n_block % p.tiles_n;
    mk_signal_store(p.flags + ((size_t)s.tile.m_block * p.tiles_n + n) * 2 + s.consumer, p.epoch);
    mk_trace_add(p.trace, MK_TR_ITEMS, 1);
  }
};

// ---- dispatch: the prep -------------------------------------------------------------

// Whole warp: lane l's v -> the sum of lanes 0..l's (a shuffle scan).
__device__ __forceinline__ int warp_inclusive_sum(int v, int lane) {
  for (int d = 1; d < 32; d *= 2) {
    const int u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

// Warp 0 of the calling CTA: a[0..items) -> its exclusive prefix sum, in place (a chunk
// per lane, then a shuffle scan over the lanes' sums). Returns the total (every lane).
__device__ __forceinline__ int warp_exclusive_scan(int* a, int items, int lane) {
  const int chunk = (items + 31) / 32;
  const int i0 = min(items, lane * chunk), i1 = min(items, i0 + chunk);
  int sum = 0;
  for (int i = i0; i < i1; ++i) sum += a[i];
  const int incl = warp_inclusive_sum(sum, lane);
  int pos = incl - sum;
  for (int i = i0; i < i1; ++i) {
    const int c = a[i];
    a[i] = pos;
    pos += c;
  }
  return __shfl_sync(0xffffffffu, incl, 31);
}

// Most choices per token (MoeParams::top_k; ops::moe validates k <= 32).
constexpr int kMaxTopK = 32;

// ids[j] = token t's expert j for j < K <= KMAX (all loads issued together); -1 past K or
// past the tokens (-1 is "no expert": nothing is counted or written for it).
template <int KMAX>
__device__ __forceinline__ void load_ids(int (&ids)[KMAX], const int* idx, int t, int tokens, int K) {
#pragma unroll
  for (int j = 0; j < KMAX; ++j) ids[j] = j < K && t < tokens ? idx[(size_t)t * K + j] : -1;
}

// The prep CTAs' waits for each other's flags (own signal region, this GPU only: gpu
// scope), polls up to 256 ns apart (the moe_wait back-off's 2 us would add up over the
// prep's steps); thread 0 waits, every thread learns the outcome. Downstream waits
// (MkWaitChecks): a prep CTA stuck on a peer's flag must be the one whose timeout names it.
__device__ __forceinline__ bool prep_wait(const WorkspaceView& ws, uint32_t word, uint64_t epoch) {
  int ok = 1;
  if (threadIdx.x == 0)
    ok = mk_wait_geq_backoff<32, 256, 32, MkScope::Gpu, true>(ws, mk_signal_word(ws, ws.rank, word), epoch, ws.rank,
                                                              MK_WAIT_OP_FLAG, MK_OP_MOE_DISPATCH);
  return __syncthreads_and(ok) != 0;
}

// Prep CTA 0, thread 0: this rank's MOE_PROGRESS = epoch · 16 + step (kernel_abi
// MOE_STEP_*), at system scope: a peer's wait that times out reads it, so its message says
// how far this rank's dispatch got.
__device__ __forceinline__ void prep_progress(const WorkspaceView& ws, uint64_t epoch, uint32_t step) {
  if (threadIdx.x == 0 && blockIdx.x == 0) mk_st_relaxed_sys(mk_signal_word(ws, ws.rank, MOE_PROGRESS), epoch * 16 + step);
}

// Thread 0, after a barrier of its CTA: the CTA's writes (fence), then `word` = epoch.
__device__ __forceinline__ void prep_raise(const WorkspaceView& ws, uint32_t word, uint64_t epoch) {
  __threadfence();
  mk_st_release_gpu(mk_signal_word(ws, ws.rank, word), epoch);
}

// Whole CTA, each of the `ctas` prep CTAs: after the CTA's writes, arrive on MOE_PREP_ARRIVE;
// the last arrival sets the counter back to zero, then raises `word` to epoch (release), so
// the next barrier's arrivals, which follow the wait for `word`, count from zero.
__device__ __forceinline__ bool prep_barrier(const WorkspaceView& ws, uint32_t word, uint64_t epoch, int ctas) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (mk_arrive_last(mk_signal_word(ws, ws.rank, MOE_PREP_ARRIVE), (unsigned long long)ctas)) prep_raise(ws, word, epoch);
  }
  return prep_wait(ws, word, epoch);
}

// The prep CTAs' integers in this rank's count-exchange area, after the exchanged counts
// ([nranks][E]; ops::moe::prep_split sizes the CTAs to fit): per prep CTA its tokens'
// count of each expert, which the column scans turn into the count of the tokens before
// the CTA's; each expert's total; this rank's first row of each expert at its owner.
struct PrepScratch {
  int* cta_count;  // [prep_ctas][E]
  int* total;      // [E]
  int* first_row;  // [E]
  __device__ PrepScratch(const MoeParams& p) {
    const WorkspaceView& ws = p.ws;
    cta_count = reinterpret_cast<int*>(reinterpret_cast<char*>(ws.data[ws.rank]) + p.counts_offset) + ws.nranks * p.experts;
    total = cta_count + p.prep_ctas * p.experts;
    first_row = total + p.experts;
  }
};

// The prep's shared memory (ops::moe::prep_smem_bytes): pass 1's per-warp tables, then
// what CTA 0's prep_tables adds.
struct PrepShared {
  uint32_t* bits;  // [MOE_WARPS][E] lanes routed to e
  int* pre;        // [MOE_WARPS][E] tokens of e before the warp
  int* run;        // [E] tokens of e: the CTA's so far (pass 1), the rank's (prep_tables)
  int* cnt;        // [n][E] every rank's counts
  int* off;        // [E] row of own first token of e at its owner
  int* lbase;      // [El + 1] own experts' first rows
  __device__ PrepShared(char* smem, int E, int n) {
    bits = reinterpret_cast<uint32_t*>(smem);
    pre = reinterpret_cast<int*>(bits + MOE_WARPS * E);
    run = pre + MOE_WARPS * E;
    cnt = run + E;
    off = cnt + n * E;
    lbase = off + E;
  }
};

// Whole CTA, prep CTA 0, once the totals are in: exchanges them with every rank, computes
// every destination's layout (expert segments padded to 128 rows), this rank's offsets and
// the send lists' starts, raises MOE_PREP_OFFSETS (the other prep CTAs' pass 2 needs only
// those), then this rank's m-block tables and block order. An overflow (some rank's
// receive buffer too small) goes to recvCounts[E_local] and the layout's overflow word
// before the flag; no table is written then. Returns false if a wait failed.
__device__ __noinline__ bool prep_tables(const MoeParams& p, uint64_t epoch, char* smem) {
  const WorkspaceView& ws = p.ws;
  const int n = ws.nranks, me = ws.rank, E = p.experts, El = p.experts_local;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const PrepShared sh(smem, E, n);
  int *run = sh.run, *cnt = sh.cnt, *off = sh.off, *lbase = sh.lbase;
  __shared__ int overflow, needed_max;
  int* layout = reinterpret_cast<int*>(p.layout);
  const PrepScratch scratch(p);
  // Drop mode: this rank sends its first expert_capacity rows of each expert (token order,
  // ops::moe::kept) and counts the rest as dropped; the counts exchanged are those sent.
  int* drop_counts = reinterpret_cast<int*>(p.drop_counts);
  for (int e = tid; e < E; e += blockDim.x) {
    const int rows = ld_cg(scratch.total + e);
    const int sent = p.expert_capacity > 0 ? min(rows, p.expert_capacity) : rows;
    run[e] = sent;
    if (drop_counts != nullptr) drop_counts[e] = rows - sent;
  }
  if (tid == 0) {
    overflow = 0;
    needed_max = 0;
  }
  __syncthreads();

  // Nobody may still be sending into or pulling from any region of the previous kernel.
  if (!moe_cta_wait_peers(ws, MOE_DONE, epoch - 1, me, MK_OP_MOE_DISPATCH)) return false;
  prep_progress(ws, epoch, MOE_STEP_PEERS_DONE);
  // Count exchange: our counts into every rank's area [me][E], then CNT[me] there.
  for (int q = 0; q < n; ++q) {
    int* dst = reinterpret_cast<int*>(reinterpret_cast<char*>(ws.data[q]) + p.counts_offset) + me * E;
    for (int e = tid; e < E; e += blockDim.x) dst[e] = run[e];
  }
  mk_cta_signal_peers(ws, MOE_CNT, epoch, -1);
  prep_progress(ws, epoch, MOE_STEP_COUNTS_SENT);
  if (!moe_cta_wait_peers(ws, MOE_CNT, epoch, -1, MK_OP_MOE_DISPATCH)) return false;
  prep_progress(ws, epoch, MOE_STEP_COUNTS_IN);
  {
    const int* src = reinterpret_cast<const int*>(reinterpret_cast<const char*>(ws.data[me]) + p.counts_offset);
    for (int i = tid; i < n * E; i += blockDim.x) cnt[i] = ld_cg(src + i);
  }
  __syncthreads();

  // Every destination's layout (thread d): expert segments padded to 128 rows.
  if (tid < n) {
    const int d = tid;
    int base = 0;
    for (int le = 0; le < El; ++le) {
      const int e = d * El + le;
      int rows = 0;
      for (int s = 0; s < n; ++s) {
        if (s == me) off[e] = base + rows;
        rows += cnt[s * E + e];
      }
      if (d == me) lbase[le] = base;
      base += (rows + 127) / 128 * 128;
    }
    if (d == me) lbase[El] = base;
    atomicMax(&needed_max, base);
  }
  __syncthreads();
  int* counts_out = reinterpret_cast<int*>(p.recv_counts);
  for (int le = tid; le < El; le += blockDim.x) {
    int rows = 0;
    for (int s = 0; s < n; ++s) rows += cnt[s * E + me * El + le];
    counts_out[le] = rows;
  }
  // An overflow is this call's outcome, not the communicator's error: every rank computed
  // the same needed_max from the same exchanged counts, so every rank skips the moves and
  // the GEMM alike, ends the kernel through the usual epoch handshake, and the next call
  // starts from a clean state. The caller reads recvCounts[E_local] > recvCapacity.
  if (tid == 0) {
    overflow = needed_max > p.capacity;
    counts_out[El] = needed_max;
    layout[MOE_LAY_OVERFLOW] = overflow;
  }
  // The send lists' starts (host mirror: ops::moe::send_tables): this rank's rows grouped
  // into lists q = le * n + step, one per (local expert le, destination d = (me + step) mod
  // n), each in token order: the senders walk it in that order, so every destination gets
  // every source's rows of its expert 0 first, then expert 1, ..., which is the order the
  // dispatch GEMM takes its blocks (expert-major), and each (source, expert) is flagged
  // once its list is out (MOE_RECV). Pass 2 writes the entries: slots t * K + j (the first
  // j of the token naming that expert). send_row0[q] = first entry of list q, [E] = total.
  int* srow0 = reinterpret_cast<int*>(sh.bits);  // [E + 1] list starts, by q (pass 1's tables are free)
  int* send_row0 = layout + p.lay_send_row0;
  for (int q = tid; q < E; q += blockDim.x) srow0[q] = run[((me + q % n) % n) * El + q / n];
  __syncthreads();
  if (warp == 0) {
    const int total = warp_exclusive_scan(srow0, E, lane);
    if (lane == 0) srow0[E] = total;
  }
  __syncthreads();
  for (int q = tid; q <= E; q += blockDim.x) send_row0[q] = srow0[q];
  for (int e = tid; e < E; e += blockDim.x) scratch.first_row[e] = off[e];
  __syncthreads();
  if (tid == 0) prep_raise(ws, MOE_PREP_OFFSETS, epoch);
  if (overflow) return true;

  // Own m-block tables (thread per local expert): expert and the sources each block holds,
  // and each block's expert segment (first block | blocks << 15: the combine's groups).
  int* mb_expert = layout + p.lay_mb_expert;
  int* mb_src = layout + p.lay_mb_srcmask;
  int* mb_seg = layout + p.lay_mb_seg;
  int* mb_rows = layout + p.lay_mb_rows;
  for (int le = tid; le < El; le += blockDim.x) {
    const int e = me * El + le;
    const int base = lbase[le], nb = (lbase[le + 1] - base) / 128;
    int rows = 0;
    for (int s = 0; s < n; ++s) rows += cnt[s * E + e];
    for (int b = 0; b < nb; ++b) {
      mb_expert[base / 128 + b] = le;
      mb_src[base / 128 + b] = 0;
      mb_seg[base / 128 + b] = base / 128 | nb << 15;
      mb_rows[base / 128 + b] = min(128, rows - b * 128);
    }
    int r0 = base;
    for (int s = 0; s < n; ++s) {
      const int c = cnt[s * E + e];
      if (c > 0)
        for (int b = r0 / 128; b <= (r0 + c - 1) / 128; ++b) mb_src[b] |= 1 << s;
      r0 += c;
    }
  }
  __syncthreads();
  // Block order (host mirror: ops::moe::block_tables): the receive layout's own order
  // (expert-major), as runs of one expert's blocks with raster groups cut at them
  // (MoeRaster): an expert's blocks share its W1 tiles (256 x 7168 x 2 bytes = 3.7 MB at
  // DeepSeek-V3-like sizes) in L2. The senders send expert by expert to every destination
  // and flag each (source, expert), so block b waits only for its own expert's rows. Per
  // block its expert's run: first block | blocks << 15.
  int* order = layout + p.lay_mb_order;
  int* mb_run = layout + p.lay_mb_run;
  for (int le = tid; le < El; le += blockDim.x) {
    const int first = lbase[le] / 128, blocks = lbase[le + 1] / 128 - first;
    for (int b = first; b < first + blocks; ++b) {
      order[b] = b;
      mb_run[b] = first | blocks << 15;
    }
  }
  if (tid == 0) layout[MOE_LAY_TOTAL_MB] = lbase[El] / 128;
  __syncthreads();
  return true;
}

// Whole CTA, each prep CTA c < p.prep_ctas (ops::moe::prep_split; the launch's other CTAs
// wait for MOE_PREP). The layout is the same for any split: positions are in token order.
//   Pass 1, the CTA's tokens [c * prep_tokens, +prep_tokens): per (token, j) its position
//   among the CTA's tokens of that expert (per-warp lane bitmaps and a prefix over warps:
//   no atomics, deterministic), and the CTA's count per expert.
//   Column scans: each expert's counts over the prep CTAs become exclusive prefixes (the
//   tokens of e before the CTA's), and their sum the rank's total.
//   CTA 0: prep_tables (count exchange, offsets, send lists' starts, m-block tables).
//   Pass 2, the same tokens: each row at its owner = pass 1's position + the CTA's prefix +
//   the rank's first row of that expert there; the send-list entries. In drop mode a row
//   whose place among the rank's rows of its expert (prefix + position) reaches
//   expert_capacity is dropped instead (owner and row −1, no entry).
// The last CTA through pass 2 raises MOE_PREP. Returns false if a wait failed (recorded,
// with the abort raised: the other CTAs' waits end too).
template <int KMAX>
__device__ __noinline__ bool prep(const MoeParams& p, uint64_t epoch, char* smem) {
  const WorkspaceView& ws = p.ws;
  const int n = ws.nranks, me = ws.rank, E = p.experts, El = p.experts_local, K = p.top_k;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int c = blockIdx.x, P = p.prep_ctas;
  const int t0 = min(p.tokens, c * p.prep_tokens), t1 = min(p.tokens, t0 + p.prep_tokens);
  const PrepShared sh(smem, E, n);
  uint32_t* bits = sh.bits;
  int *pre = sh.pre, *run = sh.run;
  __shared__ int bad_id;
  int* layout = reinterpret_cast<int*>(p.layout);
  const int* idx = reinterpret_cast<const int*>(p.topk_idx);
  int* lay_dest = layout + p.lay_dest;
  int* lay_row = layout + p.lay_row;
  const PrepScratch scratch(p);

  prep_progress(ws, epoch, MOE_STEP_BEGUN);
  for (int i = tid; i < MOE_WARPS * E; i += blockDim.x) bits[i] = 0;
  for (int i = tid; i < E; i += blockDim.x) run[i] = 0;
  if (tid == 0) bad_id = 0;
  __syncthreads();

  // Pass 1, a thread per token and round. A thread's token's ids are loaded once,
  // together, into registers (KMAX unrolled slots: the smallest of 8, 16, 32 that holds K, since
  // the prep runs once per launch and its instructions come from L2 or memory): loaded per use they would be three
  // chains of K dependent loads per round. A token listing an expert twice is one row.
  for (int c0 = t0; c0 < t1; c0 += blockDim.x) {
    const int t = c0 + tid;
    int ids[KMAX];
    load_ids(ids, idx, t, t1, K);
#pragma unroll
    for (int j = 0; j < KMAX; ++j) {
      const int e = ids[j];
      if (e >= 0 && e < E) atomicOr(&bits[warp * E + e], 1u << lane);
      else if (j < K && t < t1 && e != -1) bad_id = 1;
    }
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x) {
      int s = run[e];
      for (int w = 0; w < MOE_WARPS; ++w) {
        pre[w * E + e] = s;
        s += __popc(bits[w * E + e]);
      }
      run[e] = s;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < KMAX; ++j) {
      if (j < K && t < t1) {
        const int e = ids[j];
        const bool ok = e >= 0 && e < E;
        lay_dest[(size_t)t * K + j] = ok ? e / El : -1;
        lay_row[(size_t)t * K + j] = ok ? pre[warp * E + e] + __popc(bits[warp * E + e] & ((1u << lane) - 1)) : -1;
      }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < KMAX; ++j) {
      const int e = ids[j];
      if (e >= 0 && e < E) bits[warp * E + e] = 0;
    }
    __syncthreads();
  }
  if (tid == 0 && bad_id) mk_record_error(ws, mk_error_word(mkInvalidUsage, me, MK_WAIT_MOE_EXPERT, MK_OP_MOE_DISPATCH));
  for (int e = tid; e < E; e += blockDim.x) scratch.cta_count[c * E + e] = run[e];
  mk_trace_time(p.trace, MK_TR_STEP);
  if (!prep_barrier(ws, MOE_PREP_COUNTED, epoch, P)) return false;
  prep_progress(ws, epoch, MOE_STEP_COUNTED);

  // Column scans: warp w of CTA c takes experts c * MOE_WARPS + w, then every
  // P * MOE_WARPS-th; its lanes scan 32 CTAs' counts at a time.
  for (int e = c * MOE_WARPS + warp; e < E; e += P * MOE_WARPS) {
    int carry = 0;
    for (int b = 0; b < P; b += 32) {
      const int i = b + lane;
      const int v = i < P ? ld_cg(scratch.cta_count + i * E + e) : 0;
      const int incl = warp_inclusive_sum(v, lane);
      if (i < P) scratch.cta_count[i * E + e] = carry + incl - v;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) scratch.total[e] = carry;
  }
  if (!prep_barrier(ws, MOE_PREP_SCANNED, epoch, P)) return false;
  prep_progress(ws, epoch, MOE_STEP_SCANNED);
  mk_trace_time(p.trace, MK_TR_STEP + 1);

  if (c == 0) {
    if (!prep_tables(p, epoch, smem)) return false;
  } else if (!prep_wait(ws, MOE_PREP_OFFSETS, epoch)) {
    return false;
  }
  mk_trace_time(p.trace, MK_TR_STEP + 2);
  if (ld_cg(layout + MOE_LAY_OVERFLOW) == 0) {
    // Pass 2. Per expert: the first row of the CTA's tokens of e at its owner, their
    // first entry in e's send list, and how many of them the drop rule keeps (pass 1's
    // tables are free: MOE_WARPS * E words hold these 3 * E).
    int* row_base = reinterpret_cast<int*>(bits);
    int* send_base = row_base + E;
    int* room = send_base + E;
    const int* send_row0 = layout + p.lay_send_row0;
    int* send = layout + p.lay_send;
    for (int e = tid; e < E; e += blockDim.x) {
      const int before = ld_cg(scratch.cta_count + c * E + e), d = e / El;
      row_base[e] = before + ld_cg(scratch.first_row + e);
      send_base[e] = before + ld_cg(send_row0 + (e - d * El) * n + (d - me + n) % n);
      room[e] = p.expert_capacity > 0 ? p.expert_capacity - before : INT_MAX;
    }
    __syncthreads();
    // A thread per token, its ids and pass 1's positions (its own writes: the same thread
    // had the same token) loaded together into registers.
    for (int t = t0 + tid; t < t1; t += blockDim.x) {
      int ids[KMAX];
      load_ids(ids, idx, t, t1, K);
      int pos[KMAX];
#pragma unroll
      for (int j = 0; j < KMAX; ++j) pos[j] = ids[j] >= 0 && ids[j] < E ? lay_row[(size_t)t * K + j] : 0;
#pragma unroll
      for (int j = 0; j < KMAX; ++j) {
        const int e = ids[j];
        if (e >= 0 && e < E) {
          const int i = t * K + j;
          if (pos[j] >= room[e]) {
            // Dropped: no row at the owner, nothing sent; the combine adds nothing for it.
            lay_dest[i] = -1;
            lay_row[i] = -1;
            continue;
          }
          lay_row[i] = pos[j] + row_base[e];
          bool first = true;  // a token listing one expert twice travels once for it
#pragma unroll
          for (int u = 0; u < j; ++u) first &= ids[u] != e;
          if (first) send[send_base[e] + pos[j]] = i;
        }
      }
    }
  }
  mk_trace_time(p.trace, MK_TR_STEP + 3);
  if (!prep_barrier(ws, MOE_PREP, epoch, P)) return false;
  prep_progress(ws, epoch, MOE_STEP_LAYOUT);
  return true;
}

// The prep for this launch's top-k: the slot loops are unrolled to KMAX, so K <= 8 (the
// common case) runs a quarter of the code of K <= 32.
__device__ __forceinline__ bool prep_for_top_k(const MoeParams& p, uint64_t epoch, char* smem) {
  if (p.top_k <= 8) return prep<8>(p, epoch, smem);
  if (p.top_k <= 16) return prep<16>(p, epoch, smem);
  return prep<kMaxTopK>(p, epoch, smem);
}

// All threads of the warp copy one row (bytes a multiple of 16) to dst, IN_FLIGHT vectors
// in flight per lane (latency-bound otherwise).
template <int IN_FLIGHT>
__device__ __forceinline__ void warp_copy_row(char* dst, const char* src, int vecs, int lane) {
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* d = reinterpret_cast<int4*>(dst);
  int i = lane;
  for (; i + (IN_FLIGHT - 1) * 32 < vecs; i += IN_FLIGHT * 32) {
    int4 v[IN_FLIGHT];
#pragma unroll
    for (int u = 0; u < IN_FLIGHT; ++u) v[u] = s[i + u * 32];
#pragma unroll
    for (int u = 0; u < IN_FLIGHT; ++u) d[i + u * 32] = v[u];
  }
  for (; i < vecs; i += 32) d[i] = s[i];
}

// Registers of the dispatch GEMM's producer warpgroup, whose three idle warps send token
// rows: a send loop spills at 80; the send-list walk (list search, per-list
// counts) spills at 88 (ptxas moves kernel-long values to local memory); at 96 nothing
// spills and the consumers keep 200 (GemmConfig rounds their share down to 8; no spills).
constexpr int kProducerRegs = 96;
// The senders: dedicated CTAs (CtaTeam), or the idle warps of a GEMM CTA's producer
// warpgroup (threads 32..127, named barrier 3; the engine uses barriers 0-2).
using SideWarps = WarpTeam<32, 96, 3>;

// Rows of the send list one grab takes: small, so that the first experts' lists are out
// soon after the start (a side warp copies ~2 GB/s: 8 rows of 14 KB in ~60 us) and the
// grabs stay in list order; one atomic per 8 rows is nothing beside the copies.
constexpr int kSendChunk = 8;

// One sender warp (any warp of the grid; `warps` = how many call this in the launch): grab
// chunks of kSendChunk entries of the send list in order (MOE_GRAB, so faster warps take
// more and the lists go out in order), copy each row (IN_FLIGHT 16-byte vectors in flight
// per lane: 4 for the side warps, whose 96 registers would spill with 8) into its owner's
// receive buffer, and count the rows of each list q = le * n + step copied (MOE_SENT + q);
// whoever completes a list raises RECV[me * E_local + le] at its destination d. The last
// warp to leave resets the grab counters for the next launch.
// ws.data[rank] / ws.signals[rank] read at the use: indexing the parameter's pointer arrays
// with a run-time rank otherwise keeps them in registers, scarce in the side warps
// (ptxas spills the send loop). `ws` lives in the __grid_constant__ kernel parameter:
// the load goes through an asm (volatile: not hoisted out of the caller's loop) with the
// parameter's generic address, which ptxas forms as the parameter window base
// (c[0x0][0x198]) + offset, as for any pointer into the parameter that escapes. With a C++
// volatile load instead, ptxas (CUDA 13.0, sm_90a) drops the window base:
// LD.E.64.STRONG.SYS from the bare offset (0x1f0 + 8 * rank + 0x40 for signals[]), CUDA_ERROR_ILLEGAL_ADDRESS in the first MoE call (compute-sanitizer:
// "Access to 0x230 is out of bounds"). Plain loads become constant-bank loads (correct),
// but make ptxas spill in the dispatch (bn256: 32 B stores, 104 B loads).
__device__ __forceinline__ uint64_t param_word(const uint64_t* a) {
  uint64_t v;
  asm volatile("ld.u64 %0, [%1];" : "=l"(v) : "l"(a));
  return v;
}
__device__ __forceinline__ char* peer_data(const WorkspaceView& ws, int rank) {
  return reinterpret_cast<char*>(param_word(&ws.data[rank]));
}
__device__ __forceinline__ unsigned long long* peer_word(const WorkspaceView& ws, int rank, uint32_t index) {
  return reinterpret_cast<unsigned long long*>(param_word(&ws.signals[rank])) + index;
}

// `stop`: the warp leaves once it has copied a chunk at or past chunk stop - 1 (the burst
// before the GEMM: it counts as one of `warps` and leaves the rest to the side warps).
template <int IN_FLIGHT>
__device__ __forceinline__ void send_rows_warp(const MoeParams& p, uint64_t epoch, int warps, int stop = 0x7fffffff) {
  const WorkspaceView& ws = p.ws;
  const int n = ws.nranks, me = ws.rank, K = p.top_k, E = p.experts, El = p.experts_local;
  const int lane = threadIdx.x % 32;
  const int* layout = reinterpret_cast<const int*>(p.layout);
  const int* row0 = layout + p.lay_send_row0;
  const int* send = layout + p.lay_send;
  const size_t row_bytes = (size_t)p.hidden * 2;
  const int vecs = p.hidden / 8;
  const int total = ld_cg(row0 + E);
  const int chunks = (total + kSendChunk - 1) / kSendChunk;
  unsigned long long* grab = peer_word(ws, me, MOE_GRAB);
  for (;;) {
    int c = 0;
    if (lane == 0) c = (int)atomicAdd(grab, 1ull);
    c = __shfl_sync(0xffffffffu, c, 0);
    if (c >= chunks) break;
    int r = c * kSendChunk;
    const int r1 = min(total, r + kSendChunk);
    // The list holding entry r: the last q with row0[q] <= r (lists may be empty).
    int lo = 0, hi = E - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (ld_cg(row0 + mid) <= r) lo = mid;
      else hi = mid - 1;
    }
    int q = lo;
    while (r < r1) {
      int qend = ld_cg(row0 + q + 1);
      while (qend <= r) qend = ld_cg(row0 + ++q + 1);  // skip empty lists
      const int end = min(r1, qend);
      const int d = (me + q % n) % n;
      char* recv = peer_data(ws, d) + p.buf_offset;
      for (int e = r; e < end; ++e) {
        const int slot = ld_cg(send + e);
        const int row = ld_cg(layout + p.lay_row + slot);
        warp_copy_row<IN_FLIGHT>(recv + (size_t)row * row_bytes, reinterpret_cast<const char*>(p.x) + (size_t)(slot / K) * row_bytes,
                                 vecs, lane);
      }
      __syncwarp();  // the lanes' copies, then lane 0's fence (cumulative) and count
      if (lane == 0) {
        __threadfence_system();
        const unsigned long long rows = (unsigned long long)(end - r);
        const unsigned long long need = (unsigned long long)(qend - ld_cg(row0 + q));
        // The arrival that sends list q's last rows raises its flag.
        if (mk_arrive_last(reinterpret_cast<uint64_t*>(peer_word(ws, me, MOE_SENT + q)), need, rows)) {
          mk_signal_store(reinterpret_cast<uint64_t*>(peer_word(ws, d, MOE_RECV + me * El + q / n)), epoch);
        }
      }
      r = end;
      ++q;
    }
    if (c + 1 >= stop) break;
  }
  if (lane == 0) {
    if (mk_arrive_last(reinterpret_cast<uint64_t*>(peer_word(ws, me, MOE_EXIT)), (unsigned long long)warps))
      *grab = 0;  // every warp has made its last grab
  }
  __syncwarp();
}

// Calls of send_rows_warp in a dispatch launch (each warp's call counts once): the side
// warps of every GEMM CTA, plus every warp of it for the burst before the GEMM (or,
// communication only, all their warps), and every warp of the communication CTAs.
__device__ __forceinline__ int sender_warps(const MoeParams& p) {
  return (p.send_by_gemm_ctas ? p.compute_ctas * (p.gemm ? 3 + (p.burst_lists > 0 ? MOE_WARPS : 0) : MOE_WARPS) : 0) +
         p.comm_ctas * MOE_WARPS;
}

// Whole CTA, in every GEMM CTA of a launch with a GEMM, once its GEMM is done (or skipped):
// the last to arrive resets the tile tickets (MoeRaster) for the next launch, which starts
// after this one ends (stream order). Every CTA's producer thread has taken its last ticket
// (an atomic whose value it used) before the barrier, and the fence orders it before the
// arrival; a CTA that skipped its GEMM (a failed wait, an overflow) took none.
__device__ __forceinline__ void release_tile_tickets(const MoeParams& p) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (mk_arrive_last(reinterpret_cast<uint64_t*>(peer_word(p.ws, p.ws.rank, MOE_TILE_EXIT)), (unsigned long long)p.compute_ctas))
      atomicExch(peer_word(p.ws, p.ws.rank, MOE_TILE_NEXT), 0ull);
  }
}

// Before a tile's A rows are loaded: wait for the rows of the block's expert from every
// source whose rows the m-block holds (one flag per (source, local expert)).
struct SourceAWait {
  struct Params {
    const MoeParams* op;
    const int* srcmask;
    const int* mb_expert;
    uint64_t epoch;
  };
  __device__ static void before_a_load(const Params& w, int m_block, int, int) {
    const WorkspaceView& ws = w.op->ws;
    unsigned mask = (unsigned)ld_cg(w.srcmask + m_block);
    const int le = ld_cg(w.mb_expert + m_block), El = w.op->experts_local;
    const uint64_t t0 = w.op->trace ? mk_globaltimer() : 0;
    while (mask) {
      const int s = __ffs(mask) - 1;
      mask &= mask - 1;
      // A failed wait has recorded the error and raised the abort word; the tile then
      // computes on stale rows and the kernel still ends in bounded time.
      moe_wait(ws, mk_signal_word(ws, ws.rank, MOE_RECV + s * El + le), w.epoch, s, MK_WAIT_OP_FLAG, MK_OP_MOE_DISPATCH);
    }
    if (w.op->trace) mk_trace_add(w.op->trace, MK_TR_WAIT, mk_globaltimer() - t0);  // the producer's waits
    fence_proxy_async_global();  // the senders' generic-proxy stores, then our TMA loads
  }
  __device__ static const CUtensorMap* a_source(const Params&, const CUtensorMap* tma_a, int m_row0, int& row) {
    row = m_row0;
    return tma_a;
  }
  // Unless communication CTAs were asked for (MK_COMM_SMS), the producer warpgroup's idle
  // warps send token rows.
  __device__ static void side_work(const Params& w, int) {
    if (w.op->send_by_gemm_ctas) {
      send_rows_warp<4>(*w.op, w.epoch, sender_warps(*w.op));
      if (w.op->trace) {
        SideWarps::sync();
        if (SideWarps::tid() == 0) mk_trace_stamp(w.op->trace, MK_TR_SIDE);
      }
    }
  }
};

// Communication only (the benchmark's unfused baseline), whole CTA: wait until every
// source's rows of every local expert are here (the flags of the (source, expert) pairs
// with rows, from the exchanged counts).
__device__ __forceinline__ void wait_all_rows(const MoeParams& p, uint64_t epoch) {
  const WorkspaceView& ws = p.ws;
  const int E = p.experts, El = p.experts_local;
  const int* cnt = reinterpret_cast<const int*>(reinterpret_cast<const char*>(ws.data[ws.rank]) + p.counts_offset);
  for (int i = threadIdx.x; i < E; i += blockDim.x) {
    const int s = i / El, le = i % El;
    if (ld_cg(cnt + s * E + ws.rank * El + le) > 0)
      moe_wait(ws, mk_signal_word(ws, ws.rank, MOE_RECV + i), epoch, s, MK_WAIT_OP_FLAG, MK_OP_MOE_DISPATCH);
  }
  __syncthreads();
}

// ---- dispatch with a gated weight (SwiGLU, GeGLU) -------------------------------------
//
// w1 is [E_local, 2·F, H] in Megatron's fused fc1 layout: per expert, rows [0, F) the gate,
// rows [F, 2·F) the up projection. A tile of BN accumulator columns covers BN/2 output
// columns: its B tile is their BN/2 gate rows then the matching BN/2 up rows (two TMA boxes
// per stage, engine.cuh HasSplitB), so one wgmma accumulates gate and up together, and
// every consumer thread holds gate column c and up column c + BN/2 of the same rows
// (acc_col: index i and i + BN/4). The epilogue writes act(gate) · up, fp32, rounded once.
// The scheduler's n-block counts BN-wide tiles over E_local · 2F accumulator columns
// (tiles_n = 2F / BN per expert); Y has F columns.

// MoeParams::activation (ops::moe::Activation): 0 is the plain dispatch's.
enum GateActivation : int { kActSilu = 1, kActGelu = 2 };

// SiLU (SwiGLU): g · sigmoid(g), as torch.nn.functional.silu.
struct SiluGate {
  __device__ static float apply(float g) { return g / (1.0f + __expf(-g)); }
};
// GELU (GeGLU), the erf form g · Φ(g): torch.nn.functional.gelu's default
// (approximate='none'), which megatron-core's glu applies with activation_func = F.gelu.
// Φ(g) = erfc(−g/√2)/2 from Numerical Recipes' Chebyshev fit of erfc (Press et al., §6.2,
// `erfcc`: relative error below 1.2e-7 for every argument, so Φ keeps its relative
// precision in the negative tail, where 1 + erff(g/√2) cancels). Not erff: its branches,
// inlined over 128 live accumulators, spill the consumer's registers (ptxas).
struct GeluGate {
  __device__ static float apply(float g) {
    const float z = fabsf(g) * 0.70710678118654752f;
    const float t = __fdividef(1.0f, fmaf(0.5f, z, 1.0f));
    float p = 0.17087277f;
    p = fmaf(t, p, -0.82215223f);
    p = fmaf(t, p, 1.48851587f);
    p = fmaf(t, p, -1.13520398f);
    p = fmaf(t, p, 0.27886807f);
    p = fmaf(t, p, -0.18628806f);
    p = fmaf(t, p, 0.09678418f);
    p = fmaf(t, p, 0.37409196f);
    p = fmaf(t, p, 1.00002368f);
    p = fmaf(t, p, -1.26551223f);
    const float erfc_z = t * expf(p - z * z);  // erfc(|g|/√2)
    const float cdf = g >= 0.0f ? 1.0f - 0.5f * erfc_z : 0.5f * erfc_z;
    return g * cdf;
  }
};

// The dispatch's A wait, and the gated weight's B rows: tile n_block = e · tiles_n + nb
// covers output columns [nb · BN/2, +BN/2) of local expert e, whose gate rows start at
// e · 2F + nb · BN/2 and up rows F later.
struct GatedSourceAWait : SourceAWait {
  __device__ static int b_halves(const Params& w, int n_block, int half_rows, int& second_row) {
    const int tiles_n = w.op->tiles_n, F = w.op->ffn;
    const int e = n_block / tiles_n, nb = n_block - e * tiles_n;
    const int first = e * 2 * F + nb * half_rows;
    second_row = first + F;
    return first;
  }
};

// The gated dispatch's epilogue: a 64 x BN accumulator slab (gate | up) -> act(gate) · up,
// 64 x BN/2, staged and stored as TmaEpilogue<ExpertDest> stores a plain slab. Keeps the
// plain epilogue's staging size (smem_bytes_per_wg<BN>, of which it uses half) so that the
// ring depth and launch size are the plain dispatch's (mk_check_engine_smem, ops::moe::plan).
struct GatedEpilogue : TmaEpilogue<ExpertDest, TmaStoreOp, NoTileSignal> {
  using Base = TmaEpilogue<ExpertDest, TmaStoreOp, NoTileSignal>;
  struct Params : Base::Params {
    int activation;  // kActSilu or kActGelu (checked on the host)
  };

  template <typename T, int BN>
  __device__ static void store(const Params& p, float (&acc)[BN / 2], const SlabInfo& s) {
    if (s.thread == 0) tma_store_wait_read();  // the previous slab's stores have read the staging
    named_barrier_sync(1 + s.consumer, 128);
    // Uniform over the launch: one staging loop per activation.
    if (p.activation == kActGelu) {
      stage<T, BN, GeluGate>(acc, s);
    } else {
      stage<T, BN, SiluGate>(acc, s);
    }
    fence_proxy_async_smem();
    named_barrier_sync(1 + s.consumer, 128);
    if (s.thread == 0) {
      // Accumulator column col0 = n_block · BN is output column n_block · BN/2 of the
      // E_local · F view: the expert's column is that mod F.
      const int col = (s.col0 / 2) % p.dest.cols;
#pragma unroll
      for (int b = 0; b < BN / 2 / 64; ++b) tma_store_2d(p.dest.tma_c, s.smem + b * 8192, col + b * 64, s.row0);
      tma_store_commit();
    }
  }

 private:
  // The staging of TmaEpilogue::store (128B-swizzled 64 x 64 boxes) over the BN/2 output
  // columns: element i of the gate half and element i + BN/4 (the up column BN/2 later).
  template <typename T, int BN, class Act>
  __device__ static void stage(const float (&acc)[BN / 2], const SlabInfo& s) {
    static_assert((BN / 2) % 64 == 0, "whole 64-column output boxes");
    constexpr int kUp = BN / 4;
    const int warp = s.thread >> 5, lane = s.thread & 31;
    const uint32_t base = smem_addr(s.smem);
#pragma unroll
    for (int j = 0; j < BN / 2 / 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp * 16 + (lane >> 2) + h * 8;
        const uint32_t off = (j >> 3) * 8192 + row * 128 + (((j & 7) ^ (row & 7)) << 4) + (lane & 3) * 4;
        const int i = j * 4 + h * 2;
        const uint32_t v = pack2<T>(Act::apply(acc[i]) * acc[i + kUp], Act::apply(acc[i + 1]) * acc[i + 1 + kUp]);
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + off), "r"(v) : "memory");
      }
    }
  }
};

// The dispatch kernel, plain (Y = X · W1ᵀ, F columns) or gated (Y = act(X · W_gateᵀ) ·
// (X · W_upᵀ) from a [E_local, 2·F, H] w1): the same prep, sends and schedule; only the
// GEMM's B loads, width and epilogue differ.
template <typename T, int BN, bool GATED>
__device__ __forceinline__ void dispatch_kernel(const CUtensorMap* tma_a, const CUtensorMap* tma_b,
                                                const CUtensorMap* tma_c, const MoeParams& p) {
  using Cfg = GemmConfig<T, BN, FusedStages<BN>::value, SHARE_NONE, kProducerRegs>;
  using Epi = std::conditional_t<GATED, GatedEpilogue, TmaEpilogue<ExpertDest, TmaStoreOp, NoTileSignal>>;
  using AWait = std::conditional_t<GATED, GatedSourceAWait, SourceAWait>;
  extern __shared__ __align__(1024) char smem[];
  mk_check_engine_smem<Cfg, Epi>();
  const WorkspaceView& ws = p.ws;
  mk_trace_begin(p.trace, (int)blockIdx.x >= p.compute_ctas);
  const uint64_t epoch = mk_op_epoch_begin(ws, MOE_EPOCH);
  const int* layout = reinterpret_cast<const int*>(p.layout);
  const int j = (int)blockIdx.x - p.compute_ctas;

  // The prep (CTAs [0, prep_ctas)); every CTA then waits for its layout.
  bool ready = true;
  if ((int)blockIdx.x < p.prep_ctas) {
    ready = prep_for_top_k(p, epoch, smem);
    // The prep's generic shared-memory writes, before the engine's TMA loads reuse the space.
    fence_proxy_async_smem();
    __syncthreads();
  }
  ready = ready && prep_wait(ws, MOE_PREP, epoch);
  if (ready && ld_cg(layout + MOE_LAY_OVERFLOW) != 0) ready = false;
  mk_trace_time(p.trace, MK_TR_SETUP);

  if (ready && j < 0) {
    const int total_mb = ld_cg(layout + MOE_LAY_TOTAL_MB);
    if (p.gemm) {
      // Raster groups cut at the (key, expert) runs.
      typename MoeRaster::Params sched{layout + p.lay_mb_order, layout + p.lay_mb_run,
                                       layout + p.lay_mb_expert, layout + p.lay_mb_rows, total_mb, p.tiles_n, p.tiles_n,
                                       max(1, min(p.group_m, total_mb)), peer_word(ws, ws.rank, MOE_TILE_NEXT)};
      typename AWait::Params await{&p, layout + p.lay_mb_srcmask, layout + p.lay_mb_expert, epoch};
      typename Epi::Params epi;
      epi.dest.tma_c = tma_c;
      epi.dest.cols = p.ffn;
      epi.signal.unused = 0;
      if constexpr (GATED) epi.activation = p.activation;
      // The burst: until the first wave's rows are out, every warp sends (the consumers have
      // nothing to do before them; 8 vectors in flight: the launch's 168 registers).
      if (p.send_by_gemm_ctas && p.burst_lists > 0) {
        const int* row0 = layout + p.lay_send_row0;
        const int entries = ld_cg(row0 + min(p.experts, p.burst_lists));
        send_rows_warp<8>(p, epoch, sender_warps(p), (entries + kSendChunk - 1) / kSendChunk);
      }
      // Gated: 2·F accumulator columns (gate | up per tile), F output columns.
      const int gemm_cols = GATED ? 2 * p.ffn : p.ffn;
      gemm_persistent<Cfg, MoeRaster, AWait, Epi>(tma_a, tma_b, GemmShape{total_mb * 128, gemm_cols, p.hidden}, sched,
                                                   await, epi, blockIdx.x, p.compute_ctas, smem);
    } else {
      // Communication only (the benchmark's unfused baseline): the would-be GEMM CTAs send
      // with all their warps; the kernel ends once every source's rows are here.
      if (p.send_by_gemm_ctas) send_rows_warp<8>(p, epoch, sender_warps(p));
      if (blockIdx.x == 0) wait_all_rows(p, epoch);
    }
  } else if (ready) {
    // The communication CTAs (MK_COMM_SMS).
    send_rows_warp<8>(p, epoch, sender_warps(p));
  }
  if (p.trace) {
    __syncthreads();
    mk_trace_time(p.trace, MK_TR_ROLE);
  }
  if (p.gemm && j < 0) release_tile_tickets(p);
  mk_op_epoch_end(ws, MOE_EPOCH, MOE_ARRIVE, MOE_DONE, epoch);
  mk_trace_time(p.trace, MK_TR_END);
}

// The entry points' functions (MK_MOE_ENTRY): the plain dispatch, and the gated one.
template <typename T, int BN>
__device__ __forceinline__ void dispatch(const CUtensorMap* tma_a, const CUtensorMap* tma_b, const CUtensorMap* tma_c,
                                         const MoeParams& p) {
  dispatch_kernel<T, BN, false>(tma_a, tma_b, tma_c, p);
}
template <typename T, int BN>
__device__ __forceinline__ void dispatch_gated(const CUtensorMap* tma_a, const CUtensorMap* tma_b,
                                               const CUtensorMap* tma_c, const MoeParams& p) {
  dispatch_kernel<T, BN, true>(tma_a, tma_b, tma_c, p);
}

// ---- combine ----------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ int4 pack8(const float (&acc)[8]) {
  int4 out;
  T* h = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int i = 0; i < 8; ++i) h[i] = T(acc[i]);
  return out;
}

// Items of the combine's pull: (token t, column tile nb), ordered band-major (the bands
// the combine GEMM computes in order: band_locate, MoeRaster), then by token, then by
// tile. A band's items are ready once the GEMM is through that band.
__device__ __forceinline__ void pull_item(const MoeParams& p, int it, int& t, int& nb) {
  int bw;
  const int col0 = band_locate(p.tokens, p.band_w, it, bw);
  t = it / bw;
  nb = col0 + (it - t * bw);
}

// Items one grab of the pull takes (one atomic per 4 items of ~4.5 KB each).
constexpr int kPullChunk = 4;

// Pulling warps of a combine launch: the communication CTAs' (MK_COMM_SMS), else every
// GEMM CTA's 8 consumer warps after the GEMM plus, with several bands, its 2 side warps
// during it; communication only (the benchmark's baseline): every warp of the GEMM CTAs.
__device__ __forceinline__ int puller_warps(const MoeParams& p) {
  if (p.comm_ctas > 0) return p.comm_ctas * MOE_WARPS;
  if (!p.gemm) return p.compute_ctas * MOE_WARPS;
  return p.compute_ctas * (8 + (p.band_w < p.tiles_n ? 2 : 0));
}

// Brings the 128-byte line holding `p` into L2: no register, no wait (prefetch.L2 on a
// generic address).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.L2 [%0];" ::"l"(p)); }

// One warp (any warp of the grid; puller_warps() call this per launch): grab kPullChunk
// items at a time in item order (MOE_PULL_GRAB: warps that come early, or free, take more)
// and write out[t, tile nb] for each. Warp-synchronous only. The last warp to leave resets
// the counters for the next launch.
// The items of a grab are looked up together: lane i * K + j holds row j of
// item i (min(kPullChunk, 32 / K) items), so the layout reads and the slab-flag acquires
// are one round trip each per batch of items instead of per item, and every row of the
// batch is prefetched into L2 once its flag is seen, so only the first item's loads wait
// for HBM. Looked up one item at a time, an item costs a layout round trip, a flag round
// trip and K / RB row round trips from HBM, each row's load address behind a load of the
// peer's base from the parameter space: the side warps (RB 4: the producer warpgroup's 96
// registers) then cannot keep up with the bands (4 ranks: they pull until the kernel's end).
template <typename T, int BN, int RB = 8>
__device__ __forceinline__ void pull_rows_warp(const MoeParams& p, uint64_t epoch) {
  const WorkspaceView& ws = p.ws;
  const int K = p.top_k, H = p.hidden;
  const int lane = threadIdx.x % 32;
  const int* layout = reinterpret_cast<const int*>(p.layout);
  const float* weights = reinterpret_cast<const float*>(p.topk_weights);
  const int items = p.tokens * p.tiles_n;
  const int batch = max(1, min(kPullChunk, 32 / K));
  const int li = lane / K, lj = lane - li * K;  // this lane's (item in the batch, row)
  unsigned long long* grab = peer_word(ws, ws.rank, MOE_PULL_GRAB);
  bool ok = true;
  while (ok) {
    int c = 0;
    if (lane == 0) c = (int)atomicAdd(grab, 1ull);
    c = __shfl_sync(0xffffffffu, c, 0) * kPullChunk;
    if (c >= items) break;
    const int c1 = min(items, c + kPullChunk);
    for (int b0 = c; b0 < c1 && ok; b0 += batch) {
      const int nitems = min(batch, c1 - b0);
      // Lane (i, j): where row j of item b0 + i lies (null: no row), its weight, its slab flag.
      int dest = -1;
      uint32_t word = 0;
      float w = 0.f;
      const char* src = nullptr;
      if (li < nitems) {
        int t, nb;
        pull_item(p, b0 + li, t, nb);
        const size_t slot = (size_t)t * K + lj;
        dest = ld_cg(layout + p.lay_dest + slot);
        const int row = ld_cg(layout + p.lay_row + slot);
        w = weights[slot];
        if (dest >= 0) {
          word = MOE_TILE + ((uint32_t)(row / 128) * p.tiles_n + nb) * 2 + (row % 128) / 64;
          src = peer_data(ws, dest) + p.buf_offset + ((size_t)row * H + (size_t)nb * BN) * 2;
        }
      }
      const uint64_t t0 = p.trace ? mk_globaltimer() : 0;
      // Every lane checks its row's slab once (acquire); only if some are not there yet does
      // lane 0 wait for those in turn, with back-off (one poller per warp: waiting lanes
      // compete with the GEMM for the memory system).
      bool here = true;
      if (dest >= 0) here = mk_ld_acquire_sys(reinterpret_cast<const uint64_t*>(peer_word(ws, dest, word))) >= epoch;
      unsigned missing = __ballot_sync(0xffffffffu, !here);
      if (missing) {
        int good = 1;
        while (missing) {
          const int u = __ffs(missing) - 1;
          missing &= missing - 1;
          const int du = __shfl_sync(0xffffffffu, dest, u);
          const uint32_t wu = __shfl_sync(0xffffffffu, word, u);
          if (lane == 0 && good)
            good = moe_wait(ws, reinterpret_cast<const uint64_t*>(peer_word(ws, du, wu)), epoch, du, MK_WAIT_OP_FLAG, MK_OP_MOE_COMBINE);
        }
        ok = __shfl_sync(0xffffffffu, good, 0) != 0;
        if (!ok) break;
      }
      __syncwarp();  // the lanes' acquires, then every lane's loads of every row
      if (src != nullptr) {
#pragma unroll
        for (int o = 0; o < BN * 2; o += 128) prefetch_l2(src + o);
      }
      if (p.trace) {
        // Per warp; the trace's per-CTA wait is the sum over the CTA's pulling warps.
        const int rows = __popc(__ballot_sync(0xffffffffu, dest >= 0));
        if (lane == 0) {
          mk_trace_add(p.trace, MK_TR_WAIT, mk_globaltimer() - t0);
          mk_trace_add(p.trace, MK_TR_ITEMS, nitems);
          mk_trace_add(p.trace, MK_TR_BYTES, (uint64_t)(rows + nitems) * BN * 2);
        }
      }
      for (int i = 0; i < nitems; ++i) {
        int t, nb;
        pull_item(p, b0 + i, t, nb);
        // Every lane runs every iteration (the shuffles need the whole warp); lanes past the
        // tile's BN / 8 vectors only shuffle.
        for (int v0 = 0; v0 < BN / 8; v0 += 32) {
          const int v = v0 + lane;
          const bool active = v < BN / 8;
          float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          for (int j0 = 0; j0 < K; j0 += RB) {
            // Up to RB rows' vectors loaded before the first add (latency-bound otherwise); the
            // adds then run in j order.
            int4 z[RB];
            float ww[RB];
            bool has[RB];
#pragma unroll
            for (int u = 0; u < RB; ++u) {
              const int jj = j0 + u;
              const int from = (i * K + jj) & 31;
              const char* su = reinterpret_cast<const char*>(
                  __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(src), from));
              ww[u] = __shfl_sync(0xffffffffu, w, from);
              has[u] = jj < K && su != nullptr;
              if (active && has[u]) z[u] = *reinterpret_cast<const int4*>(su + (size_t)v * 16);
            }
#pragma unroll
            for (int u = 0; u < RB; ++u) {
              if (active && has[u]) {
                const T* h = reinterpret_cast<const T*>(&z[u]);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] += ww[u] * (float)h[e];
              }
            }
          }
          if (active)
            *reinterpret_cast<int4*>(reinterpret_cast<char*>(p.out) + ((size_t)t * H + (size_t)nb * BN + (size_t)v * 8) * 2) =
                pack8<T>(acc);
        }
      }
    }
  }
  if (lane == 0) {
    if (mk_arrive_last(reinterpret_cast<uint64_t*>(peer_word(ws, ws.rank, MOE_PULL_EXIT)), (unsigned long long)puller_warps(p)))
      *grab = 0;  // every warp has made its last grab
  }
  __syncwarp();
}

// The combine GEMM's producer-side hook: nothing to wait for (Y' is local); with several
// column bands the side warps (2 per CTA: warp 1 is the courier) pull from the start,
// band by band as the GEMMs of every rank get through them.
template <typename T, int BN>
struct PullBeside {
  struct Params {
    const MoeParams* op;
    uint64_t epoch;
  };
  __device__ static void before_a_load(const Params&, int, int, int) {}
  __device__ static const CUtensorMap* a_source(const Params&, const CUtensorMap* tma_a, int m_row0, int& row) {
    row = m_row0;
    return tma_a;
  }
  __device__ static void side_work(const Params& w, int) {
    // 4 rows' vectors in flight: with 8, the producer warpgroup's 96 registers spill.
    if (w.op->comm_ctas == 0 && w.op->band_w < w.op->tiles_n) {
      pull_rows_warp<T, BN, 4>(*w.op, w.epoch);
      // The trace's "side warps done after": the later of the two.
      if (w.op->trace && threadIdx.x % 32 == 0)
        atomicMax(reinterpret_cast<unsigned long long*>(mk_trace_slot(w.op->trace, MK_TR_SIDE)), (unsigned long long)mk_globaltimer());
    }
  }
};

// The combine's default epilogue: Z slabs stored and flagged; then, when the launch has no
// dedicated pull CTAs, the consumer warps (8 per CTA, whose registers setmaxnreg raised;
// the producer warps' were lowered) pull and sum items until none is left. With one band
// the pull overlaps only the GEMM's last wave; with several, the side warps have pulled
// the early bands' items during the GEMM.
template <typename T, int BN>
struct PullAfterGemm : TmaEpilogue<ExpertDest, TmaStoreOp, ZSlabSignal> {
  using Base = TmaEpilogue<ExpertDest, TmaStoreOp, ZSlabSignal>;
  struct Params : Base::Params {
    const MoeParams* op;
  };
  __device__ static void finish(const Params& p, const SlabInfo& s) {
    Base::finish(p, s);  // this warpgroup's last slab stored and flagged
    // The trace's "GEMM ... then ... moving data": the later of the two warpgroups.
    if (p.op->trace && threadIdx.x % 128 == 0)
      atomicMax(reinterpret_cast<unsigned long long*>(mk_trace_slot(p.op->trace, MK_TR_GEMM)), (unsigned long long)mk_globaltimer());
    if (p.op->comm_ctas == 0) pull_rows_warp<T, BN>(*p.op, p.signal.epoch);
  }
};

template <typename T, int BN>
__device__ __forceinline__ void combine(const CUtensorMap* tma_a, const CUtensorMap* tma_b, const CUtensorMap* tma_c,
                                        const MoeParams& p) {
  using Cfg = GemmConfig<T, BN, FusedStages<BN>::value, SHARE_NONE, kProducerRegs>;
  using Epi = PullAfterGemm<T, BN>;
  extern __shared__ __align__(1024) char smem[];
  mk_check_engine_smem<Cfg, Epi>();
  const WorkspaceView& ws = p.ws;
  mk_trace_begin(p.trace, (int)blockIdx.x >= p.compute_ctas);
  const uint64_t epoch = mk_op_epoch_begin(ws, MOE_EPOCH);
  const int* layout = reinterpret_cast<const int*>(p.layout);
  // A dispatch that found a receive buffer too small moved nothing (every rank saw it).
  const bool valid = ld_cg(layout + MOE_LAY_OVERFLOW) == 0;
  mk_trace_time(p.trace, MK_TR_SETUP);

  if ((int)blockIdx.x < p.compute_ctas) {
    // Z overwrites our region: every peer must be done with the previous kernel.
    if (valid && moe_cta_wait_peers(ws, MOE_DONE, epoch - 1, ws.rank, MK_OP_MOE_COMBINE)) {
      const int total_mb = ld_cg(layout + MOE_LAY_TOTAL_MB);
      uint64_t* flags = mk_signal_word(ws, ws.rank, MOE_TILE);
      if (p.gemm) {
        // Y' is local: no arrival order to follow. Expert-major (the receive layout's own
        // order), groups cut at expert segments, column bands first (band_w).
        typename MoeRaster::Params sched{nullptr, layout + p.lay_mb_seg,
                                         layout + p.lay_mb_expert, layout + p.lay_mb_rows, total_mb, p.tiles_n, p.band_w,
                                         max(1, min(p.group_m, total_mb)), peer_word(ws, ws.rank, MOE_TILE_NEXT)};
        typename PullBeside<T, BN>::Params await{&p, epoch};
        typename Epi::Params epi;
        epi.dest.tma_c = tma_c;
        epi.dest.cols = p.hidden;
        epi.signal.flags = flags;
        epi.signal.tiles_n = p.tiles_n;
        epi.signal.epoch = epoch;
        epi.signal.trace = p.trace;
        epi.op = &p;
        gemm_persistent<Cfg, MoeRaster, PullBeside<T, BN>, Epi>(tma_a, tma_b, GemmShape{total_mb * 128, p.hidden, p.ffn}, sched,
                                                                 await, epi, blockIdx.x, p.compute_ctas, smem);
      } else {
        // Communication only: Z was written by earlier launches on this stream.
        __threadfence_system();
        const int words = total_mb * p.tiles_n * 2;
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += p.compute_ctas * blockDim.x)
          mk_st_release_sys(flags + i, epoch);
        if (p.comm_ctas == 0) pull_rows_warp<T, BN>(p, epoch);
      }
    }
  } else if (valid) {
    pull_rows_warp<T, BN>(p, epoch);
  }
  if (p.trace) {
    __syncthreads();
    mk_trace_time(p.trace, MK_TR_ROLE);
  }
  if (p.gemm && (int)blockIdx.x < p.compute_ctas) release_tile_tickets(p);
  mk_op_epoch_end(ws, MOE_EPOCH, MOE_ARRIVE, MOE_DONE, epoch);
  mk_trace_time(p.trace, MK_TR_END);
}

}  // namespace moe
}  // namespace mk

#define MK_MOE_ENTRY(NAME, FN, T, BN)                                                                  \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                \
      NAME(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,      \
           const __grid_constant__ CUtensorMap tma_c, const __grid_constant__ MoeParams p) {          \
    mk::moe::FN<T, BN>(&tma_a, &tma_b, &tma_c, p);                                                    \
  }

#include "kernel_instances/moe.inc"  // the entry points: kernels/instances.txt
