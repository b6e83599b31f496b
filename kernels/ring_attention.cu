// Ring attention forward (mkRingAttention): context-parallel flash attention with the
// K/V ring inside one persistent kernel. The plan (layouts, ring steps, causal block
// visibility) is ops::ring_attention in Rust; this kernel follows it.
//
// Roles and phases of one launch (every CTA, 12 warps):
//   1. publish: after every peer has said it finished reading this rank's workspace in
//      the previous call (RING_DONE), every CTA copies its slice of this rank's K and V
//      into the rank's own fused-op region; the last CTA to finish raises RING_KV + me in
//      every peer's signal region (one epoch-valued flag per rank and call).
//   2. compute: persistent over work items (batch, head, 128-query block). For ring step
//      s = 0..n-1 the item attends to the K/V that started on rank (me - s) mod n: step 0
//      from the caller's k/v, later steps straight from the source rank's workspace over
//      the peer mapping, after a bounded wait for its RING_KV flag (once per CTA and
//      source). One online softmax (fp32, exp2) runs across all steps, so no per-step
//      merge is needed. Fully masked 128-key blocks (causal) are skipped; partial ones and
//      the tail beyond seqLocal are masked elementwise by global token position.
//   3. the last CTA advances the epoch and raises RING_DONE + me in every peer's region.
// Each rank pulls every peer's K/V once, which is the traffic of a ring (every rank
// receives n-1 blocks) without relaying through intermediate ranks: within one node the
// peer is one NVLink hop away, so relaying would only add latency (docs/decisions/0022-ring-attention-pull-not-relay.md).
//
// Math engine (FlashAttention-3 style, warp-specialised):
//   warps 0-7   two consumer warpgroups, 64 query rows each: S = Q·Kᵀ by wgmma from
//               shared memory (Q and K K-major, 128-byte swizzle), the online softmax on
//               the fp32 accumulators, O += P·V by wgmma with P from registers (A from
//               registers) and V as an MN-major B operand. Pipelined inside the
//               warpgroup: S_t is issued before O is rescaled and P_{t-1}·V_{t-1} issued,
//               and the softmax of S_t runs while that product is on the tensor cores;
//               the tiles of all of a CTA's items are one stream, so an item's first S
//               runs beside the previous item's last P·V, whose epilogue (O staged
//               through the finished item's Q tile, 16-byte stores) follows.
//               No CTA-wide barrier per tile: the two warpgroups take turns issuing
//               their GEMMs (pingpong, FA3 §3.1, two named barriers), so one's softmax
//               runs while the other's GEMMs hold the tensor cores.
//   warps 8-11  the producer warpgroup, of which one thread works: every load, by TMA
//               (cp.async.bulk.tensor, 128-byte swizzle): Q per item into a ring of
//               Q_STAGES slots, K and V tiles through two rings of KV_STAGES slots, with
//               full/empty mbarriers (K of tile t is loaded before V of tile t-1, the order
//               the consumers need them in, also across items). It also makes the bounded
//               waits for the sources' RING_KV flags, and stops the consumers at the tile
//               where one gave up (Pipeline::abort_tile). Warps 9-11 and lanes 1-31 of
//               warp 8 only give their registers to the math warps.
// Items: with a workspace (every mkRingAttention call) the producer takes tickets from a
// counter in the rank's signal region, in the section order of sched_item (heaviest items
// first, lightest last: CTAs end evenly); without one (gathered mode) each CTA walks a
// fixed snake (cta_item). Either way the producer tells the consumers each item (q_item).
// Tensor maps (RingAttnMaps, encoded on the host per launch): Q, and K and V of every
// source rank at the address this rank reads them from (own tensors, a peer's workspace
// through the peer mapping, which is an ordinary device address in this process, or the
// gathered buffer), each 4-D [batch][token][head][d] so that tokens past seqLocal are out
// of bounds and arrive as zeros.
//
// Gathered mode (p.kv_gathered != 0, used by the unfused baseline and at one rank): the
// K/V of every source rank lie in one local buffer, shard after shard; no signals.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "common/fused_op.cuh"
#include "common/ring_attention.cuh"
#include "common/gemm/wgmma_rs_ops.cuh"
#include "common/trace.cuh"

// Signal words of this op: RING_* in mk_kernel_abi.h (src/kernel_abi.rs).

namespace mk { namespace ring_attn {

// `mkbench ring_attn --trace` runs the `_trace` twin of each kernel (TRACED = true, a third
// parameter: the buffer); the kernels the library launches are TRACED = false, where every
// hook below compiles away (their SASS is the same as without the hooks). MK_TRACE_WORDS
// u64 per CTA at trace + blockIdx.x * MK_TRACE_WORDS, times from %globaltimer (ns):
//   0 start   1 K/V published (= start at one rank)   2 thread 0's consumer done
//   3 end     4 / 5 / 8 ns thread 0 (warpgroup 0) waited for K / V / Q to land
//   6 items | K/V tiles << 32 (the producer's count)   7 SM id
//   9 ns thread 128 (warpgroup 1) waited for K and V
// Only the waits that did not succeed at the first try are timed.
enum RingTrace { TR_WAIT_K = 4, TR_WAIT_V = 5, TR_COUNT = 6, TR_WAIT_Q = 8, TR_WAIT_KV1 = 9 };

constexpr int BM = 128;  // queries per work item (2 warpgroups x 64 rows)
constexpr int BN = 128;  // keys per tile
constexpr int CONSUMER_WARPS = 8;                  // warps 0-7: two math warpgroups
constexpr int PRODUCER_THREADS = 128;              // warps 8-11: every load of the engine
constexpr int THREADS = CONSUMER_WARPS * 32 + PRODUCER_THREADS;  // ops::ring_attention::THREADS
constexpr int KV_STAGES = 2;                       // slots of the K ring and of the V ring
constexpr int Q_STAGES = 2;                        // slots of the Q ring: the next item's Q loads during this one
// Registers after setmaxnreg. A CTA of 384 threads starts with 168 each (a sub-partition
// holds 3 of its 12 warps: 16K / 96, rounded down to a multiple of 8); the producer
// needs few, the math warps hold O, S and P (64 + 64 + 32 at D = 128) and the rest of the
// softmax. The consumers' share is what the producers give up:
// (384·168 − 128·56) / 256 = 224. 56 is the least at which the TMA producer does not
// spill at all (tests/kernels.rs): at 48 the D = 64 kernels spill 4 bytes, at 40 (which
// would give the consumers 232) every kernel spills 32 bytes in the per-item bookkeeping
// and the bounded wait's slow path (its per-tile loop stays clean), at 24 and 32 in the
// per-tile loop too. (A lone 9th producer warp would cap every thread at 168: its
// sub-partition holds 3 warps.)
constexpr int LAUNCH_REGS = 168;
constexpr int PRODUCER_REGS = 56;
constexpr int CONSUMER_REGS = (THREADS * LAUNCH_REGS - PRODUCER_THREADS * PRODUCER_REGS) / (CONSUMER_WARPS * 32) / 8 * 8;
static_assert(CONSUMER_REGS == 224, "setmaxnreg split");
constexpr int TURN_BARRIER = 2;                    // + wg: consumer warpgroup wg's turn to issue (2, 3)

// Dynamic shared memory (ops::ring_attention::smem_bytes): the Q ring, the K and V rings,
// and 1 KiB to align them to the 128-byte swizzle's 1024-byte period (193 KiB at D = 128).
template <int D>
__host__ __device__ constexpr int smem_bytes() {
  return (Q_STAGES * BM + 2 * KV_STAGES * BN) * D * 2 + 1024;
}
static_assert(smem_bytes<128>() <= 227 * 1024, "a CTA may opt in to 227 KiB of shared memory");


// TMA descriptors of the engine's loads (ops::ring_attention::RingAttnMaps; a second
// __grid_constant__ kernel parameter). Every map is 4-D, innermost first: d (box 64 =
// one 128-byte swizzle row), head (box 1), token (box BM = BN rows), batch (box 1); K and
// V of source rank `src` in k[src] / v[src] (only src < nranks are encoded).
struct RingAttnMaps {
  CUtensorMap q;
  CUtensorMap k[MK_MAX_PEERS];
  CUtensorMap v[MK_MAX_PEERS];
};

// Phase 1: this CTA's slice of K and V into the own workspace; the last CTA raises the
// K/V flag in every peer. False when a wait gave up (the CTA then skips to the end).
__device__ __forceinline__ bool publish_kv(const RingAttnParams& p, uint64_t epoch) {
  return publish_kv(p.ws, reinterpret_cast<const void*>(p.k), reinterpret_cast<const void*>(p.v), p.kv_elems, p.kv_offset,
                    epoch, RING_DONE, RING_COPIED, RING_KV, MK_OP_RING_ATTENTION);
}

// Barriers of the load pipeline (static shared memory beside the dynamic tiles).
//   q_full[qs], k_full[st], v_full[st]: the tile's TMA boxes have landed (1 arrival, the
//     producer's arrive.expect_tx, plus the tile's bytes). TMA writes through the async
//     proxy, which wgmma reads through: no proxy fence after the wait (loads by cp.async
//     would need fence.proxy.async, a MEMBAR, after each of these waits);
//   k_empty[st], v_empty[st]: every consumer warp's wgmmas that read the tile have
//     completed (8 arrivals: lane 0 of each consumer warp after its wgmma wait);
//   q_empty[qs]: every consumer warp has stored its O rows, which it stages through the
//     item's Q tile (8 arrivals, lane 0 of each warp after the warp's reads and a
//     fence.proxy.async: generic accesses before the TMA's next write of the slot).
// K/V tile number t (counted over all items of this CTA, the same sequence for the
// producer and both consumer warpgroups) lives in slot t % KV_STAGES and completes phase
// (t / KV_STAGES) & 1 of its slot's barriers; Q of the CTA's k-th item, slot k % Q_STAGES,
// phase (k / Q_STAGES) & 1.
struct Pipeline {
  uint64_t q_full[Q_STAGES], q_empty[Q_STAGES];
  uint64_t k_full[KV_STAGES], k_empty[KV_STAGES];
  uint64_t v_full[KV_STAGES], v_empty[KV_STAGES];
  // The K/V tile at which the producer's bounded wait gave up (INT_MAX: none). Written
  // before the producer arrives on that tile's k_full without data, so both consumer
  // warpgroups stop at the same tile.
  int abort_tile;
  // Written by the consumers after every softmax and never read (Attn::consume, `anchor`).
  int anchor;
  // The work item whose Q is in slot qs, or -1: the CTA has no more items. Written by the
  // producer before it arrives on q_full[qs] (a release), read by the consumers after
  // their wait on it: with the dynamic schedule only the producer knows the items.
  int q_item[Q_STAGES];
};

// The k-th work item of this CTA, or -1 past its last. Items are dealt in rounds of
// gridDim.x, forward in even rounds and backward in odd ones (a snake): in causal
// attention the items of a head come heaviest first, and a plain round robin hands the
// same CTAs the heavy end of every round (the busiest CTA ~7 % above the mean at S = 8K,
// 32 heads, 132 CTAs; ~3 % with the snake). A round still spans one or two heads, so the
// CTAs running at the same time share their K/V in L2. A CTA's items are increasing.
__device__ __forceinline__ int cta_item(const RingAttnParams& p, int k) {
  // 32-bit unsigned: k · g stays below num_items + g < 2^32 (num_items < 2^31), and
  // 64-bit arithmetic here costs the 56-register producer a spill.
  const unsigned g = gridDim.x;
  const unsigned i = (unsigned)k * g + ((k & 1) ? g - 1 - blockIdx.x : blockIdx.x);
  return i < (unsigned)p.num_items ? (int)i : -1;
}

// The work item that ticket i of the dynamic schedule stands for (the host's mirror and
// its tests: ops::ring_attention::sched_item): sections of p.sched_section (batch, head)
// pairs in turn, inside one heaviest query block first with the section's pairs
// alternating, so the CTAs that take tickets together share the section's K/V in L2 and
// the call ends on its lightest items (greedy list scheduling then ends evenly: causal
// items of one head range from 1 to q_blocks tiles).
__device__ __forceinline__ int sched_item(const RingAttnParams& p, int i) {
  const int pairs = p.batch * p.heads, per_section = p.sched_section * p.q_blocks;
  const int sec = i / per_section;
  const int len = min(p.sched_section, pairs - sec * p.sched_section);
  const int r = i - sec * per_section;
  return (sec * p.sched_section + r % len) * p.q_blocks + r / len;
}

// One work item: (batch, head, 128-query block) and the query positions it covers.
struct Item {
  int b, h, hk, q0, q_rows, qmin, qmax;
  __device__ Item(const RingAttnParams& p, int item) {
    // Heaviest query blocks first (causal: later local tokens see more keys).
    const int qb = p.q_blocks - 1 - item % p.q_blocks;
    const int bh = item / p.q_blocks;
    h = bh % p.heads;
    b = bh / p.heads;
    hk = h / (p.heads / p.kv_heads);
    q0 = qb * BM;
    q_rows = min(BM, p.seq_local - q0);
    const bool causal = p.causal != 0;
    qmin = token_pos(p.rank, q0, p.seq_local, p.nranks, causal);
    qmax = token_pos(p.rank, q0 + q_rows - 1, p.seq_local, p.nranks, causal);
  }
};

// The 128-key blocks of source `src` that queries up to position qmax see: a prefix
// [0, n) of its blocks, since local positions grow with the local index (block kb is
// visible iff its first key's position is at most qmax, i.e. kb·BN is below the count of
// src's keys at or before qmax). Fully masked blocks (causal) are the rest.
__device__ __forceinline__ int visible_blocks(const RingAttnParams& p, int src, int qmax) {
  int count = p.seq_local;  // non-causal: every key
  if (p.causal != 0) {
    const int half = p.seq_local >> 1;  // zigzag chunks src and 2n-1-src
    count = min(max(qmax - src * half + 1, 0), half) +
            min(max(qmax - (2 * p.nranks - 1 - src) * half + 1, 0), p.seq_local - half);
  }
  return (count + BN - 1) / BN;
}

// A work item's walk over its visible blocks, which the producer and the consumers take
// alike: ring steps in order; inside a step, its visible blocks [0, nvis) starting at
// block rot = (the item's query block) mod nvis and wrapping around. The rotation
// staggers the CTAs' K/V streams: without it every item of a round starts at block 0 and
// the CTAs read each K/V tile at the same moment, so the first read of every tile (from
// HBM) holds up all of them, where staggered streams find it in L2, brought in by the
// CTA ahead. Causal, one rank: the diagonal block first, then 0 up. The online softmax
// does not depend on the order (within rounding).
struct Walk {
  int s = -1, i = 0, nvis = 0, rot = 0;
  __device__ __forceinline__ int block() const {
    const int b = i + rot;
    return b < nvis ? b : b - nvis;
  }
  // Moves to the next visible block; false past the last ring step.
  __device__ __forceinline__ bool next(const RingAttnParams& p, int qmax, int qblock) {
    if (++i < nvis) return true;
    while (++s < p.nranks) {
      nvis = visible_blocks(p, ring_src(p.rank, s, p.nranks), qmax);
      if (nvis > 0) {
        i = 0;
        rot = qblock < nvis ? qblock : qblock % nvis;  // no division in the usual case
        return true;
      }
    }
    return false;
  }
};

template <typename T, int D, bool TRACED>
struct Attn {
  static constexpr int KSTEPS = D / 16;  // k-steps of Q·Kᵀ (over d)
  static constexpr int PSTEPS = BN / 16; // k-steps of P·V (over keys)
  static constexpr int SREG = BN / 2;    // score accumulators per thread (m64nBN)
  static constexpr int OREG = D / 2;     // output accumulators per thread (m64nD)
  static constexpr int TILE = BN * D;    // elements of one K or V tile

  // The producer (one thread: lane 0 of warp 8): per item of this CTA its Q, then its
  // visible K/V tiles in ring order, into the slot rings; the only loads of the engine.
  // Each tile is D / 64 TMA boxes of 128 rows x 128 bytes (the swz<> layout); rows past
  // seqLocal are outside the map and arrive as zeros (masked keys must meet V = 0, never
  // NaN). Returns false when a wait gave up.
  __device__ static bool produce(const RingAttnParams& p, const RingAttnMaps& maps, uint64_t epoch, T* sQ, T* sK, T* sV,
                                 Pipeline& pl, const uint64_t& trace) {
    using namespace mk::gemm;
    static_assert(BM == BN, "Q, K and V tiles share the box shape");
    constexpr uint32_t TILE_BYTES = BN * D * sizeof(T);
    const int n = p.nranks, me = p.rank;
    uint32_t acquired = 1u << me;  // sources whose K/V this CTA may read
    // Bounded wait before the first read of source `src`'s workspace: its RING_KV flag
    // of this epoch (the inline form: no calls after setmaxnreg). The flag is observed
    // through the generic proxy and the data read by TMA (async proxy): the proxy fence
    // orders the acquire before this thread's later TMA reads.
    auto ensure = [&](int src) -> bool {
      if (p.kv_gathered != 0 || (acquired & (1u << src))) return true;
      if (!mk_wait_geq_inline(p.ws, mk_signal_word(p.ws, me, RING_KV + src), epoch, src, MK_WAIT_OP_FLAG,
                              MK_OP_RING_ATTENTION))
        return false;
      fence_proxy_async_global();
      acquired |= 1u << src;
      return true;
    };
    // The D / 64 boxes of one 128-row tile: rows row0.. of `head` in batch b.
    auto load_tile = [&](T* dst, const CUtensorMap* map, uint64_t* bar, int head, int row0, int b) {
#pragma unroll
      for (int c = 0; c < D / 64; ++c) tma_load_4d(dst + c * (BN * 64), map, bar, c * 64, head, row0, b);
    };
    int tile = 0;  // K/V tiles issued so far (all items of this CTA)
    // K of tile t, then V of tile t-1: the consumers need V one tile later than K (they
    // multiply P_{t-1}·V_{t-1} while S_t = Q·K_tᵀ is computed), also across items (an
    // item's last P·V runs beside the next item's first S).
    int v_src = 0, v_row = 0, v_b = 0, v_hk = 0;  // where V of tile `tile - 1` comes from
    auto load_v = [&](int t) {
      const int st = t % KV_STAGES;
      mbar_wait(&pl.v_empty[st], ((t / KV_STAGES) & 1) ^ 1);
      mbar_expect_tx(&pl.v_full[st], TILE_BYTES);
      load_tile(sV + st * TILE, &maps.v[v_src], &pl.v_full[st], v_hk, v_row, v_b);
    };
    // Dynamic schedule: the next item's ticket is taken right after the current item's
    // first tile is issued, where the producer would wait for the next K slot anyway
    // (about a tile's compute); ptxas makes even a one-lane atomic a warp-aggregated one
    // whose result shuffle waits for the round trip at once, so where it sits matters.
    // (The counter's address is recomputed from the parameters at each use and the first
    // tile is recognised from the walk: the 56-register producer has none to spare.)
    const bool dynamic = p.sched_dynamic != 0;
    auto tickets = [&] { return reinterpret_cast<unsigned long long*>(mk_signal_word(p.ws, p.ws.rank, RING_SCHED_NEXT)); };
    int ticket = dynamic ? take_ticket(tickets()) : 0;
    for (int k = 0;; ++k) {
      const int item = dynamic ? (ticket < p.num_items ? sched_item(p, ticket) : -1) : cta_item(p, k);
      // Q into slot k % Q_STAGES, free once the consumers have stored the O rows of item
      // k - Q_STAGES, which they stage through it. Every tile they need before that (K of
      // item k-1's first tile, V of item k-2's last) was issued in the previous item.
      const int qs = k % Q_STAGES;
      mbar_wait(&pl.q_empty[qs], ((k / Q_STAGES) & 1) ^ 1);
      pl.q_item[qs] = item;  // published by the arrive below (release), read after the consumers' wait
      if (item < 0) {
        mbar_arrive(&pl.q_full[qs]);  // the one expected arrival, no bytes: "no more items"
        if constexpr (TRACED) *mk_trace_slot(trace, TR_COUNT) = (uint64_t)k | ((uint64_t)tile << 32);
        break;
      }
      const Item it(p, item);
      mbar_expect_tx(&pl.q_full[qs], BM * D * sizeof(T));
      load_tile(sQ + qs * BM * D, &maps.q, &pl.q_full[qs], it.h, it.q0, it.b);
      Walk w;
      while (w.next(p, it.qmax, it.q0 / BM)) {
        const int s = w.s, kb = w.block();
        const int st = tile % KV_STAGES;
        const uint32_t ph = (tile / KV_STAGES) & 1;
        const int src = ring_src(me, s, n);
        const bool ok = ensure(src);
        // The slot's previous tile is consumed (also before an abort: completing the
        // next phase early would let a consumer miss the one it waits for).
        mbar_wait(&pl.k_empty[st], ph ^ 1);
        if (!ok) {
          *reinterpret_cast<volatile int*>(&pl.abort_tile) = tile;
          mbar_arrive(&pl.k_full[st]);  // the one expected arrival, no bytes: the phase completes without data
          // Every box issued so far is waited for by the consumers before they stop
          // (Q and K up to tile - 1, V up to tile - 2): none lands after the CTA moves on.
          return false;
        }
        mbar_expect_tx(&pl.k_full[st], TILE_BYTES);
        load_tile(sK + st * TILE, &maps.k[src], &pl.k_full[st], it.hk, kb * BN, it.b);
        if (tile > 0) load_v(tile - 1);
        if (dynamic && s == 0 && w.i == 0) ticket = take_ticket(tickets());  // the item's first tile
        v_src = src;
        v_row = kb * BN;
        v_b = it.b;
        v_hk = it.hk;
        ++tile;
      }
    }
    if (tile > 0) load_v(tile - 1);
    return true;
  }

  // The two consumer warpgroups (warps 0-7), 64 query rows each, pipelined inside the
  // warpgroup (FlashAttention-3 §3.2): while the softmax of tile t runs on the CUDA
  // cores, the tensor cores compute P_{t-1}·V_{t-1}, and S_t = Q·K_tᵀ is issued before O
  // is rescaled. One score register set (S_t as fp32) and P_{t-1} packed to 16 bits for
  // the register-A wgmma. The tiles of all of the CTA's items form one stream: the first
  // S of an item is issued before the previous item's last P·V, and that item's epilogue
  // follows the softmax of the new S, so the tensor cores do not wait for an epilogue
  // and a pipeline fill per item (causal items average half the tiles of non-causal
  // ones, so this per-item cost weighs twice). Returns false when the producer gave up.
  __device__ static bool consume(const RingAttnParams& p, T* sQ, const T* sK, const T* sV, Pipeline& pl, const uint64_t& trace) {
    using namespace mk::gemm;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wg = warp / 4;  // warpgroup: query rows 64·wg ..
    const int g = lane / 4, t4 = lane % 4;
    const int row_base = 64 * wg + 16 * (warp % 4) + g;  // this thread's rows: row_base, row_base + 8
    const int S = p.seq_local, n = p.nranks, me = p.rank;
    const bool causal = p.causal != 0;
    const int q_stride = p.heads * D;
    const float sl = p.scale_log2;

    auto release = [&](uint64_t* bar) {
      if (lane == 0) mbar_arrive(bar);  // after this warp's wgmma wait: its reads are done
    };
    // TRACED: the time of the waits for landed tiles that do not succeed at once.
    uint64_t waited_k = 0, waited_v = 0, waited_q = 0;
    auto wait_full = [&](uint64_t* bar, uint32_t parity, uint64_t& waited) {
      if constexpr (TRACED) {
        if (!mbar_try_wait(bar, parity)) {
          const uint64_t t0 = mk_globaltimer();
          mbar_wait(bar, parity);
          waited += mk_globaltimer() - t0;
        }
      } else {
        mbar_wait(bar, parity);
      }
    };
    // Pingpong: the warpgroups issue their GEMMs of a tile in turns, 0 then 1. Barrier
    // TURN_BARRIER + wg completes with this warpgroup's bar.sync (128) and the other's
    // bar.arrive (128) after it issued; warpgroup 0 arrives on its own barrier once to
    // start. Both warpgroups walk the same tiles and take one turn per tile (the CTA's
    // final P·V is outside the turns), so the counts match; the one arrival left at the
    // end is dropped with the CTA. A turn starts only after wait_k succeeded: at an abort
    // both stop before the same turn, and no one waits for an arrival that will not come.
    // (Immediate barrier ids: a computed id makes ptxas reserve all 16.)
    auto turn_begin = [&] {
      if (wg == 0) named_barrier_sync(TURN_BARRIER, 2 * 128);
      else named_barrier_sync(TURN_BARRIER + 1, 2 * 128);
    };
    auto turn_end = [&] {
      if (wg == 0) named_barrier_arrive(TURN_BARRIER + 1, 2 * 128);
      else named_barrier_arrive(TURN_BARRIER, 2 * 128);
    };
    // Waits for the Q of the CTA's k-th item and returns the item (-1: there is none).
    auto wait_q = [&](int k) -> int {
      wait_full(&pl.q_full[k % Q_STAGES], (k / Q_STAGES) & 1, waited_q);  // TMA wrote it: no proxy fence (Pipeline)
      return *reinterpret_cast<volatile int*>(&pl.q_item[k % Q_STAGES]);
    };
    // Waits for tile t's K; false when the producer gave up at this tile.
    auto wait_k = [&](int t) -> bool {
      wait_full(&pl.k_full[t % KV_STAGES], (t / KV_STAGES) & 1, waited_k);
      return t < *reinterpret_cast<volatile int*>(&pl.abort_tile);
    };
    // Descriptor of this warpgroup's 64 query rows of the k-th item's Q tile. The operands'
    // descriptors of the k-steps are this plus the step's byte offset / 16: the start
    // address field is address / 16 in 14 bits and shared memory ends below 256 KiB, so
    // the sum never carries out of it. Computed once per item (not per k-step inside the
    // turn, where the slot-dependent address takes 4 vector instructions and an R2UR per
    // wgmma).
    auto q_desc = [&](int k) -> uint64_t {
      return make_smem_desc_sw128(reinterpret_cast<const char*>(sQ + (k % Q_STAGES) * BM * D) + 64 * wg * 128);
    };
    // S = Q·K_tᵀ for this warpgroup's 64 query rows (Q descriptor qd).
    auto issue_s = [&](float (&sc)[SREG], uint64_t qd, int t) {
      const uint64_t kd = make_smem_desc_sw128(sK + (t % KV_STAGES) * TILE);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        const int cb = kk / 4, ko = (kk % 4) * 32;  // 64-wide d block, 16-element (32-byte) step inside it
        Wgmma<BN, T>::mma(sc, qd + ((cb * (BM * 128) + ko) >> 4), kd + ((cb * (BN * 128) + ko) >> 4), kk > 0);
      }
      wgmma_commit();
    };
    // O += P·V of tile t: P from registers (the accumulator layout of S is the A-fragment
    // layout by pairs of 8-key blocks), V as the MN-major B operand.
    auto issue_pv = [&](float (&acc)[OREG], const uint32_t (&pa)[PSTEPS][4], int t) {
      wait_full(&pl.v_full[t % KV_STAGES], (t / KV_STAGES) & 1, waited_v);
      const char* tV = reinterpret_cast<const char*>(sV + (t % KV_STAGES) * TILE);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < PSTEPS; ++kk) WgmmaRsT<D, T>::mma(acc, pa[kk], desc_mn_sw128(tV + kk * 16 * 128, BN * 128));
      wgmma_commit();
    };
    // Mask (keys past seqLocal; causal: keys after the query) and online softmax of the
    // scores of key block kb of step s for the item whose first query is local q0: sc
    // becomes P (fp32, exp2 with the scale folded in), m_row / l_row advance, alpha is
    // the factor O must be rescaled by before P·V.
    auto softmax = [&](float (&sc)[SREG], int q0, int qmin, int s, int kb, float (&m_row)[2], float (&l_row)[2],
                       float (&alpha)[2]) {
      const int src = ring_src(me, s, n);
      const int k0 = kb * BN, k_rows = min(BN, S - k0);
      const bool need_mask = k_rows < BN || (causal && token_pos(src, k0 + k_rows - 1, S, n, causal) > qmin);
      if (need_mask) {
        const int half = S >> 1;
        if (!causal || k0 >= half || k0 + k_rows <= half) {
          // The tile's keys lie in one span of consecutive positions kp0 + kl (a shard, or
          // one zigzag chunk): key kl is masked for the query at position qp iff
          // kl >= k_rows or (causal) kl > qp - kp0, one compare per score against a
          // per-row limit.
          const int kp0 = token_pos(src, k0, S, n, causal);
          int lim[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            lim[r] = k_rows - 1;
            if (causal) lim[r] = min(lim[r], token_pos(me, q0 + row_base + 8 * r, S, n, causal) - kp0);
            lim[r] -= 2 * t4;  // compare the tile-constant j * 8 + e
          }
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if (j * 8 + e > lim[0]) sc[4 * j + e] = -INFINITY;
              if (j * 8 + e > lim[1]) sc[4 * j + 2 + e] = -INFINITY;
            }
          }
        } else {
          // The tile straddles the two zigzag chunks (seqLocal / 2 not a multiple of 128):
          // the position of every key.
          const int qp0 = token_pos(me, q0 + row_base, S, n, causal);
          const int qp1 = token_pos(me, q0 + row_base + 8, S, n, causal);
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int kl = j * 8 + 2 * t4 + e;
              const int kp = token_pos(src, k0 + kl, S, n, causal);
              const bool out = kl >= k_rows;
              if (out || kp > qp0) sc[4 * j + e] = -INFINITY;
              if (out || kp > qp1) sc[4 * j + 2 + e] = -INFINITY;
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // The row maximum as a tree (depth log2(BN / 4) + 1 instead of a chain of BN / 4
        // dependent FMNMX): the softmax's first phase is latency-bound, each warp's max
        // feeds the shuffles and every exponential after it. fmaxf is exact, so the
        // order does not change the result.
        float part[BN / 8];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) part[j] = fmaxf(sc[4 * j + 2 * r], sc[4 * j + 2 * r + 1]);
        static_assert(BN / 8 == 16, "tree levels below");
#pragma unroll
        for (int j = 0; j < 8; ++j) part[j] = fmaxf(part[j], part[j + 8]);
#pragma unroll
        for (int j = 0; j < 4; ++j) part[j] = fmaxf(part[j], part[j + 4]);
        part[0] = fmaxf(part[0], part[2]);
        part[1] = fmaxf(part[1], part[3]);
        part[0] = fmaxf(part[0], part[1]);
        float mx = fmaxf(m_row[r], part[0]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        // A row with no visible key yet keeps max -inf: subtract 0 so exp2(-inf) = 0.
        const float msc = mx == -INFINITY ? 0.f : mx * sl;
        alpha[r] = exp2_ftz(m_row[r] * sl - msc);
        m_row[r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          sc[4 * j + 2 * r] = exp2_ftz(sc[4 * j + 2 * r] * sl - msc);
          sc[4 * j + 2 * r + 1] = exp2_ftz(sc[4 * j + 2 * r + 1] * sl - msc);
          sum += sc[4 * j + 2 * r] + sc[4 * j + 2 * r + 1];
        }
        l_row[r] = l_row[r] * alpha[r] + sum;  // this thread's share; the quad sums at the end
      }
    };
    // Keeps the softmax ahead of the wgmma wait<0> that follows it. ptxas otherwise moves
    // that WARPGROUP.DEPBAR to the top of the softmax (the packing of P after it writes
    // the registers the in-flight P·V reads, and its scheduler interleaves the packs with
    // the exponentials), and the softmax does not overlap P·V: without the anchor, every
    // MUFU.EX2 of the loop comes after the DEPBAR in the SASS. A shared-memory store
    // of a value that depends on every exponential (the row sums) stays before the wait.
    auto anchor = [&](const float (&l_row)[2]) {
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(gemm::smem_addr(&pl.anchor)), "r"(__float_as_uint(l_row[0] + l_row[1]))
                   : "memory");
    };
    auto pack = [&](uint32_t (&pa)[PSTEPS][4], const float (&sc)[SREG]) {
#pragma unroll
      for (int kk = 0; kk < PSTEPS; ++kk) {
        pa[kk][0] = Mma<T>::pack(sc[8 * kk + 0], sc[8 * kk + 1]);
        pa[kk][1] = Mma<T>::pack(sc[8 * kk + 2], sc[8 * kk + 3]);
        pa[kk][2] = Mma<T>::pack(sc[8 * kk + 4], sc[8 * kk + 5]);
        pa[kk][3] = Mma<T>::pack(sc[8 * kk + 6], sc[8 * kk + 7]);
      }
    };
    auto rescale = [&](float (&acc)[OREG], const float (&alpha)[2]) {
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        acc[4 * j + 0] *= alpha[0];
        acc[4 * j + 1] *= alpha[0];
        acc[4 * j + 2] *= alpha[1];
        acc[4 * j + 3] *= alpha[1];
      }
    };
    // Epilogue of the CTA's k-th item: O = acc / l and the log-sum-exp. O goes through
    // this warp's 16 rows of the item's Q tile (every S of the item has completed, so the
    // rows are free, and no other warp touches them): each thread holds 4-byte pieces of 2
    // rows, written in the tile's swizzle (conflict-free: the 8 rows of a piece column
    // fall on 8 different 16-byte chunks), then read back as 16-byte chunks of whole rows,
    // so every global store is 16 bytes and each warp store covers two 256-byte rows
    // (instead of 8 rows x 16 bytes of 4-byte stores). Then the Q slot goes back to the
    // producer.
    auto epilogue = [&](const float (&acc)[OREG], const Item& it, int k, const float (&m_fin)[2],
                        const float (&l_fin)[2]) {
      T* tQ = sQ + (k % Q_STAGES) * BM * D;
      float inv[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float l = l_fin[r];
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
        inv[r] = l > 0.f ? 1.f / l : 0.f;
        const int row = it.q0 + row_base + 8 * r;
        if (t4 == 0 && row < S) {
          float* lse = reinterpret_cast<float*>(p.lse) + ((size_t)it.b * p.heads + it.h) * S + row;
          *lse = l > 0.f ? (m_fin[r] * sl + log2f(l)) * 0.69314718055994531f : -INFINITY;
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
          *reinterpret_cast<uint32_t*>(tQ + swz<BM>(row_base + 8 * r, j) + 2 * t4) =
              Mma<T>::pack(acc[4 * j + 2 * r] * inv[r], acc[4 * j + 2 * r + 1] * inv[r]);
      }
      __syncwarp();
      constexpr int CHUNKS = D / 8;                 // 16-byte chunks of a row
      constexpr int PER_LANE = 16 * CHUNKS / 32;    // of the warp's 16 rows
      const int wrow = 64 * wg + 16 * (warp % 4);   // the warp's first row of the tile
      T* o = reinterpret_cast<T*>(p.out) + ((size_t)it.b * S * p.heads + it.h) * D;
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) {
        const int idx = i * 32 + lane, rr = idx / CHUNKS, c = idx % CHUNKS;
        const int row = it.q0 + wrow + rr;
        if (row < S)
          *reinterpret_cast<int4*>(o + (size_t)row * q_stride + c * 8) =
              *reinterpret_cast<const int4*>(tQ + swz<BM>(wrow + rr, c));
      }
      // Every lane's generic accesses of the slot (the O staging) come before lane 0
      // releases it to the producer, whose next TMA write of it is an async-proxy write.
      fence_proxy_async_smem();
      __syncwarp();
      release(&pl.q_empty[k % Q_STAGES]);
      __syncwarp();  // converged again before the next wgmma and bar.sync (.aligned)
    };

    float sc[SREG];
#pragma unroll
    for (int i = 0; i < SREG; ++i) sc[i] = 0.f;  // defined before the first wgmma (which overwrites it)
    if (wg == 0) named_barrier_arrive(TURN_BARRIER, 2 * 128);  // warpgroup 0 has the first turn
    int item = wait_q(0);
    if (item < 0) return true;
    Item it(p, item);  // the item of the tile being computed
    int k = 0;         // its number among this CTA's items (Q slot k % Q_STAGES)
    Walk w;
    w.next(p, it.qmax, it.q0 / BM);  // true: step 0 holds the queries' own keys

    // Tile 0: S, softmax, P; nothing to overlap with yet.
    if (!wait_k(0)) return false;
    uint64_t qd = q_desc(0);  // Q of the item of the tile being computed
    turn_begin();
    issue_s(sc, qd, 0);
    turn_end();
    wgmma_wait<0>();
    fence_operands(sc);
    release(&pl.k_empty[0]);
    float m_row[2] = {-INFINITY, -INFINITY}, l_row[2] = {0.f, 0.f}, alpha[2];
    softmax(sc, it.q0, it.qmin, w.s, w.block(), m_row, l_row, alpha);
    float acc[OREG];
#pragma unroll
    for (int i = 0; i < OREG; ++i) acc[i] = 0.f;
    uint32_t pa[PSTEPS][4];
    pack(pa, sc);
    int tile = 1;  // K/V tiles consumed so far (the producer's numbering)
    // Steady state, tile t = `tile`: S_t issued, O rescaled, P_{t-1}·V_{t-1} issued; the
    // softmax of S_t overlaps that product. When t is the first tile of the next item,
    // P_{t-1}·V_{t-1} completes the finished item, whose epilogue then runs.
    for (;;) {
      const Item fin = it;  // the item P_{t-1}·V_{t-1} belongs to
      const bool boundary = !w.next(p, it.qmax, it.q0 / BM);
      if (boundary) {
        item = wait_q(k + 1);
        if (item < 0) break;
        it = Item(p, item);
        w = Walk();
        w.next(p, it.qmax, it.q0 / BM);  // true, as for tile 0
        qd = q_desc(k + 1);
      }
      if (!wait_k(tile)) return false;  // nothing in flight: the last wait was wait<0>
      turn_begin();
      issue_s(sc, qd, tile);
      rescale(acc, alpha);  // O is not in flight (P·V of t-2 was waited for)
      issue_pv(acc, pa, tile - 1);
      turn_end();
      wgmma_wait<1>();  // S_t done (groups complete in order), P_{t-1}·V_{t-1} may run on
      fence_operands(sc);
      release(&pl.k_empty[tile % KV_STAGES]);
      const float m_fin[2] = {m_row[0], m_row[1]}, l_fin[2] = {l_row[0], l_row[1]};
      if (boundary) {  // a new online softmax; alpha becomes 0, which O = 0 ignores
        m_row[0] = m_row[1] = -INFINITY;
        l_row[0] = l_row[1] = 0.f;
      }
      softmax(sc, it.q0, it.qmin, w.s, w.block(), m_row, l_row, alpha);
      anchor(l_row);
      wgmma_wait<0>();  // P_{t-1}·V_{t-1} done: its V slot and the P registers are free
      fence_operands(acc);
      release(&pl.v_empty[(tile - 1) % KV_STAGES]);
      pack(pa, sc);
      if (boundary) {
        epilogue(acc, fin, k, m_fin, l_fin);
#pragma unroll
        for (int i = 0; i < OREG; ++i) acc[i] = 0.f;
        ++k;
      }
      ++tile;
    }
    // The CTA's last item: its final P·V and epilogue.
    rescale(acc, alpha);
    issue_pv(acc, pa, tile - 1);
    wgmma_wait<0>();
    fence_operands(acc);
    release(&pl.v_empty[(tile - 1) % KV_STAGES]);
    epilogue(acc, it, k, m_row, l_row);
    if constexpr (TRACED) {
      if (lane == 0 && warp % 4 == 0) {
        if (wg == 0) {
          *mk_trace_slot(trace, TR_WAIT_K) = waited_k;
          *mk_trace_slot(trace, TR_WAIT_V) = waited_v;
          *mk_trace_slot(trace, TR_WAIT_Q) = waited_q;
        } else {
          *mk_trace_slot(trace, TR_WAIT_KV1) = waited_k + waited_v;
        }
      }
    }
    return true;
  }

  // Phase 2 (every thread of the CTA). Returns false when a wait gave up.
  __device__ static bool run(const RingAttnParams& p, const RingAttnMaps& maps, uint64_t epoch, char* smem_raw, const uint64_t& trace) {
    __shared__ Pipeline pl;
    // 128-byte swizzle repeats every 1024 bytes: tiles start 1024-aligned.
    char* smem = smem_raw + ((1024 - (gemm::smem_addr(smem_raw) & 1023)) & 1023);
    T* sQ = reinterpret_cast<T*>(smem);      // [Q_STAGES][BM x D]
    T* sK = sQ + Q_STAGES * BM * D;          // [KV_STAGES][BN x D]
    T* sV = sK + KV_STAGES * TILE;           // [KV_STAGES][BN x D]
    if (threadIdx.x == 0) {
      for (int qs = 0; qs < Q_STAGES; ++qs) {
        mk::gemm::mbar_init(&pl.q_full[qs], 1);
        mk::gemm::mbar_init(&pl.q_empty[qs], CONSUMER_WARPS);
      }
      for (int st = 0; st < KV_STAGES; ++st) {
        mk::gemm::mbar_init(&pl.k_full[st], 1);
        mk::gemm::mbar_init(&pl.v_full[st], 1);
        mk::gemm::mbar_init(&pl.k_empty[st], CONSUMER_WARPS);
        mk::gemm::mbar_init(&pl.v_empty[st], CONSUMER_WARPS);
      }
      pl.abort_tile = INT_MAX;
      mk::gemm::fence_mbar_init();
    }
    __syncthreads();
    bool ok;
    // Registers move from the loaders to the math warps for the engine, and back after it
    // (the consumers give theirs up first) so the code after it runs on every warp alike.
    if (threadIdx.x >= CONSUMER_WARPS * 32) {
      mk::gemm::setmaxnreg_dec<PRODUCER_REGS>();
      ok = true;
      if (threadIdx.x == CONSUMER_WARPS * 32) {
        mk::gemm::prefetch_tensor_map(&maps.q);
        for (int src = 0; src < p.nranks; ++src) {
          mk::gemm::prefetch_tensor_map(&maps.k[src]);
          mk::gemm::prefetch_tensor_map(&maps.v[src]);
        }
        ok = produce(p, maps, epoch, sQ, sK, sV, pl, trace);
      }
      __syncwarp();  // setmaxnreg is .aligned: single-lane work above must have reconverged
      mk::gemm::setmaxnreg_inc<LAUNCH_REGS>();
    } else {
      mk::gemm::setmaxnreg_inc<CONSUMER_REGS>();
      ok = consume(p, sQ, sK, sV, pl, trace);
      __syncwarp();
      mk::gemm::setmaxnreg_dec<LAUNCH_REGS>();
    }
    return ok;
  }
};
template <typename T, int D, bool TRACED>
__device__ __forceinline__ void ring_attention(const RingAttnParams& p, const RingAttnMaps& maps, const uint64_t& trace) {
  extern __shared__ __align__(1024) char smem[];
  uint32_t dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  // The host plan and the kernel disagree: trap rather than run out of bounds or hang.
  if (dyn_smem < uint32_t(smem_bytes<D>()) || blockDim.x != THREADS) __trap();
  if constexpr (TRACED) mk_trace_begin(trace, false);
  const bool ring = p.kv_gathered == 0 && p.nranks > 1;
  uint64_t epoch = 0;
  bool ok = true;
  if (ring) {
    epoch = mk_op_epoch_begin(p.ws, RING_EPOCH);
    ok = publish_kv(p, epoch);
  }
  if constexpr (TRACED) mk_trace_time(trace, MK_TR_SETUP);
  // A failed wait has recorded the error and raised the abort word: skip to the end, so
  // the kernel still ends in bounded time.
  if (ok) Attn<T, D, TRACED>::run(p, maps, epoch, smem, trace);
  if constexpr (TRACED) mk_trace_time(trace, MK_TR_ROLE);
  if (p.sched_dynamic != 0) {
    // The last CTA to have taken its last ticket resets the counter for the next launch
    // (stream order: it starts after this one ends). Every CTA's tickets precede its
    // arrival here (its producer thread took them before the barrier), and the fence
    // orders them before the arrival; a CTA that stopped early (a failed wait) took
    // fewer, which the reset forgets too.
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (mk_arrive_last(mk_signal_word(p.ws, p.ws.rank, RING_SCHED_DONE), gridDim.x))
        atomicExch(reinterpret_cast<unsigned long long*>(mk_signal_word(p.ws, p.ws.rank, RING_SCHED_NEXT)), 0ull);
    }
  }
  if (ring) mk_op_epoch_end(p.ws, RING_EPOCH, RING_ARRIVE, RING_DONE, epoch);
  if constexpr (TRACED) mk_trace_time(trace, MK_TR_END);
}

}  // namespace ring_attn
}  // namespace mk

// Each kernel and its `_trace` twin (mkbench --trace only: a `tool` kernel, built into the
// ring_attention_tools fatbin, which the library does not embed; a third parameter, the buffer,
// read where used from the parameter space like p: held in a register, it costs the
// 56-register producer a spill).
#define MK_RING_ATTN_ENTRY(NAME, T, D)                                                                   \
  extern "C" __global__ void __launch_bounds__(mk::ring_attn::THREADS, 1) NAME(const __grid_constant__ RingAttnParams p, \
                                                                                 const __grid_constant__ mk::ring_attn::RingAttnMaps maps) { \
    const uint64_t no_trace = 0;                                                                         \
    mk::ring_attn::ring_attention<T, D, false>(p, maps, no_trace);                                       \
  }
#define MK_RING_ATTN_TRACE_ENTRY(NAME, T, D)                                                             \
  extern "C" __global__ void __launch_bounds__(mk::ring_attn::THREADS, 1) NAME(                          \
      const __grid_constant__ RingAttnParams p, const __grid_constant__ mk::ring_attn::RingAttnMaps maps, const __grid_constant__ uint64_t trace) { \
    mk::ring_attn::ring_attention<T, D, true>(p, maps, trace);                                           \
  }

#include "kernel_instances/ring_attention.inc"  // the entry points: kernels/instances.txt
