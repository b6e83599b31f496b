// Ring attention backward (mkRingAttentionBackward): the gradients of context-parallel
// flash attention with the K/V ring and the travelling dK/dV accumulators inside one
// persistent kernel. The plan (layouts, ring steps, the accumulators' chain, causal
// visibility, the ticket order) is ops::ring_attention_backward in Rust; this kernel
// follows it.
//
// Phases of one launch (every CTA, 12 warps):
//   1. publish (more than one rank): after every peer has said it finished reading this
//      rank's workspace in the previous call (RING_BWD_DONE), every CTA copies its slice
//      of K and V into the rank's fused-op region; the last raises RING_BWD_KV + me in
//      every peer (as the forward does, with this op's own words).
//   2. rows: every CTA writes its share of the per-query values (lse · log2 e, delta =
//      rowsum(dout ∘ out) in fp32) into the own region, padded with zeros to 64-token
//      tiles; a grid barrier (RING_BWD_ROWS_*) follows.
//   3. compute, persistent over tickets (a counter in the rank's signal region):
//      - dK/dV items first, ring step by ring step: item (s, i) is the 128-key block i of
//        the K/V that started on rank src = (me + s + 1) mod n, against every query of
//        this rank (every head of the block's GQA group); its dK/dV partial (fp32,
//        registers) is added to the accumulator the ring successor (me + 1) formed at
//        step s - 1 (read from its region after a bounded wait on RING_BWD_CHAIN + i),
//        and the sum goes to this rank's slot for step s, announced to the predecessor
//        (me - 1), which continues the chain. At s = n - 1 the block is the rank's own:
//        the sum is final and goes to dk/dv. So a block's gradient is summed over the
//        ranks src - 1, src - 2, ..., src in that order, every run;
//      - then dQ items (batch, head, 128 queries): every visible K/V tile of every ring
//        step, in step order, accumulated in registers and stored once.
//   4. the last CTA advances the epoch and raises RING_BWD_DONE + me in every peer.
//
// Engine (wgmma, TMA loads, one producer thread, two consumer warpgroups; not yet
// pipelined inside a warpgroup): an item holds two 128-row X tiles (dK/dV: K and V of
// the source; dQ: Q and dout) and streams 64-row Y tiles (dK/dV: Q and dout of one head,
// with their 64 row values; dQ: K and V of one source) through a 2-slot ring. Per Y tile
// each warpgroup (64 rows of X) computes
//   A = X1 · Y1ᵀ, B = X2 · Y2ᵀ                    (SS wgmma, both K-major)
//   P = exp2(A · scale log2 e - lse2), dS = P ∘ (B - delta)   (masked entries 0)
//   dK/dV items: dV += P · Y2, dK += dS · Y1       (register-A wgmma, Y MN-major)
//   dQ items:    dQ += dS · Y1
// where in a dK/dV item A = Sᵀ (rows keys, columns queries) and in a dQ item A = S. P and
// dS are rounded to the element type before their products (as FlashAttention does);
// dK and dQ are scaled by softmaxScale once, at the end. Every sum has a fixed order, so
// results are bitwise reproducible run to run (no atomics).
//
// One-pass engine (ONE_PASS, the _one_pass_ kernels; MK_INTERNAL_RING_BWD_ENGINE,
// docs/decisions/0071-one-pass-attention-backward.md): there are no dQ items. A dK/dV item
// walks its query tiles last first, and per tile each warpgroup also stores its dS (rows =
// keys, as held) into a shared dS tile; after a barrier of both warpgroups,
//   dQ_partial = dS · K   (SS wgmma, both operands MN-major; D = 128: each warpgroup 64
//                          columns over the 128 keys; D = 64: each its 64 keys, summed in
//                          shared memory, warpgroup 0 first)
// goes as 64 x D fp32 through a 2-slot ring to the dQ writer (lane 0 of warp 9), which adds
// it to the query tile's sum in this rank's workspace with one bulk operation: in the
// tile's turn order (ticket order, dq_turn; a bounded wait on the tile's turn word), so
// every sum has one order, or with p.dq_atomic in any order. After the engine a grid
// barrier, then every CTA writes its share of dq = softmaxScale · sum (finish_dq).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "common/fused_op.cuh"
#include "common/gemm/wgmma_rs_ops.cuh"
#include "common/gemm/wgmma_tt_ops.cuh"
#include "common/ring_attention.cuh"

// Signal words of this op: RING_BWD_* in mk_kernel_abi.h (src/kernel_abi.rs).

namespace mk { namespace ring_attn_bwd {

using namespace mk::ring_attn;

constexpr int BX = 128;  // rows of an item's X tiles (2 warpgroups x 64)
constexpr int BY = 64;   // rows of a streamed Y tile
constexpr int CONSUMER_WARPS = 8;
constexpr int PRODUCER_THREADS = 128;
constexpr int THREADS = CONSUMER_WARPS * 32 + PRODUCER_THREADS;  // ops::ring_attention_backward::THREADS
constexpr int X_STAGES = 2;  // the next item's X loads while this one runs
constexpr int Y_STAGES = 2;
constexpr int CHAIN_BARRIER = 1;  // the 256 consumer threads, around the dK/dV chain
// The one-pass engine (ONE_PASS, docs/decisions/0071-one-pass-attention-backward.md): the
// dK/dV items also form dQ's partial per query tile, which the dQ writer sums in global
// memory; there are no dQ items.
constexpr int ONE_PASS_X_STAGES = 1;  // an item spans every query tile: no X prefetch needed
constexpr int DQ_STAGES = 2;          // dQ partial slots between the consumers and the dQ writer
constexpr int DS_BARRIER = 2;         // the 256 consumer threads: both halves of dS are stored
constexpr int DQ_SUM_BARRIER = 3;     // D = 64: warpgroup 0's half of the dQ partial is stored
// Registers after setmaxnreg, as the forward: (384·168 − 128·56) / 256 = 224.
constexpr int LAUNCH_REGS = 168;
constexpr int PRODUCER_REGS = 56;
constexpr int CONSUMER_REGS = (THREADS * LAUNCH_REGS - PRODUCER_THREADS * PRODUCER_REGS) / (CONSUMER_WARPS * 32) / 8 * 8;
static_assert(CONSUMER_REGS == 224, "setmaxnreg split");

// Dynamic shared memory (ops::ring_attention_backward::smem_bytes): X_STAGES pairs of X
// tiles, Y_STAGES pairs of Y tiles, Y_STAGES x 64 row values (float2), 1 KiB to align.
// One-pass: one pair of X tiles, the Y ring and row values, two dS tiles (128 keys x 64
// queries, 16-bit) and DQ_STAGES dQ partials (64 queries x D, fp32).
template <int D, bool ONE_PASS = false>
__host__ __device__ constexpr int smem_bytes() {
  return (ONE_PASS ? ONE_PASS_X_STAGES : X_STAGES) * 2 * BX * D * 2 + Y_STAGES * 2 * BY * D * 2 + Y_STAGES * BY * 8 +
         (ONE_PASS ? 2 * BX * BY * 2 + DQ_STAGES * BY * D * 4 : 0) + 1024;
}
static_assert(smem_bytes<128>() <= 227 * 1024, "a CTA may opt in to 227 KiB of shared memory");
// ptxas pads the static barriers to 1 KiB (the dynamic part is declared 1024-aligned), and
// the driver lets a CTA have 227 KiB of both together: the one-pass D = 128 kernel takes
// exactly that.
static_assert(smem_bytes<128, true>() + 1024 <= 227 * 1024, "with the static barriers");

// TMA descriptors (ops::ring_attention_backward::BwdMaps), every one 4-D [batch][token]
// [head][d], box {64 d, 1 head, 64 tokens, 1 batch}: q and dout of this rank, K and V of
// every source at the address this rank reads them from.
struct BwdMaps {
  CUtensorMap q;
  CUtensorMap dout;
  CUtensorMap k[MK_MAX_PEERS];
  CUtensorMap v[MK_MAX_PEERS];
};

struct Pipeline {
  uint64_t x_full[X_STAGES], x_empty[X_STAGES];
  uint64_t y_full[Y_STAGES], y_empty[Y_STAGES];
  int abort_item;  // the item (this CTA's count) / Y tile at which the producer stopped
  int abort_tile;
  int task[X_STAGES];  // the ticket whose X is in the slot, or -1: no more
};

// One-pass: the hand-off of dQ partials from the consumers to the dQ writer. Partial number
// t (counted over the CTA's tiles, as the Y tiles) lives in slot t % DQ_STAGES;
//   full[st]: every consumer warp stored its part (CONSUMER_WARPS arrivals, after
//     fence.proxy.async: the writer reads the slot with a bulk copy);
//   empty[st]: the writer's bulk operation has read the slot (1 arrival);
//   tile[st]: (batch · heads + head, query tile, ring step, key block) of the partial;
//   last: the consumers' tile count once they stop (normally or at an abort): the writer
//     ends at the partial of that number, which arrives without data.
struct DqPipeline {
  uint64_t full[DQ_STAGES], empty[DQ_STAGES];
  int4 tile[DQ_STAGES];
  int last;
};

// The value of item i's chain word once ring step s of epoch e is stored.
__device__ __forceinline__ uint64_t chain_value(uint64_t epoch, int n, int s) {
  return (epoch - 1) * (uint64_t)n + (uint64_t)s + 1;
}

// Local queries of `rank` whose global position is below `pos`: a prefix, since
// positions grow with the local index (ops::ring_attention_backward::tokens_before).
__device__ __forceinline__ int tokens_before(const RingAttnBwdParams& p, int rank, int pos) {
  if (p.causal == 0) return min(max(pos - rank * p.seq_local, 0), p.seq_local);
  const int half = p.seq_local >> 1;
  return min(max(pos - rank * half, 0), half) + min(max(pos - (2 * p.nranks - 1 - rank) * half, 0), p.seq_local - half);
}

// One ticket: a dK/dV item (ring step s, block index i) or a dQ item.
struct Task {
  bool kv;
  int s, i, src, b, h, hk, row0;  // row0: first row of the X tiles
  int first_tile;                  // dK/dV: the first query tile any key of the block sees
  __device__ Task(const RingAttnBwdParams& p, int t) {
    const int n = p.nranks;
    kv = t < n * p.kv_items;
    if (kv) {
      s = t / p.kv_items;
      i = t - s * p.kv_items;
      src = p.rank + s + 1;
      src -= src >= n ? n : 0;
      src -= src >= n ? n : 0;
      const int kb = i % p.k_blocks;
      hk = (i / p.k_blocks) % p.kv_heads;
      b = i / (p.k_blocks * p.kv_heads);
      h = 0;
      row0 = kb * BX;
      first_tile = p.causal != 0 ? tokens_before(p, p.rank, token_pos(src, row0, p.seq_local, n, true)) / BY : 0;
    } else {
      const int j = t - n * p.kv_items;
      const int qb = p.q_blocks - 1 - j % p.q_blocks;  // heaviest first
      const int bh = j / p.q_blocks;
      s = 0;
      i = j;
      src = p.rank;
      h = bh % p.heads;
      b = bh / p.heads;
      hk = h / (p.heads / p.kv_heads);
      row0 = qb * BX;
      first_tile = 0;
    }
  }
};

// The Y tiles of a task, which the producer and the consumers walk alike. dK/dV: the
// heads of the group in order, each its query tiles first_tile.. q_tiles - 1. dQ: ring
// steps in order (source me, me - 1, ...), each the source's key tiles that the item's
// last query sees (a prefix).
struct Walk {
  int a = -1, j = 0, end = 0, src = 0;  // a: head in the group or ring step; j: tile
  // The Y tile of the walk's position. DOWN (the one-pass engine): a dK/dV item takes its
  // query tiles last first, so every key block of a head meets query tile m at about the
  // same time after its start, the order in which dQ's partials are summed (dq_turn).
  template <bool DOWN>
  __device__ __forceinline__ int y_tile(const RingAttnBwdParams& p, const Task& t) const {
    return DOWN && t.kv ? p.q_tiles - 1 + t.first_tile - j : j;
  }
  __device__ __forceinline__ bool next(const RingAttnBwdParams& p, const Task& t) {
    if (++j < end) return true;
    if (t.kv) {
      const int group = p.heads / p.kv_heads;
      if (++a >= group || t.first_tile >= p.q_tiles) return false;
      j = t.first_tile;
      end = p.q_tiles;
      return true;
    }
    const int q_last = min(t.row0 + BX, p.seq_local) - 1;
    const int qmax = token_pos(p.rank, q_last, p.seq_local, p.nranks, p.causal != 0);
    while (++a < p.nranks) {
      src = ring_src(p.rank, a, p.nranks);
      const int count = p.causal != 0 ? tokens_before(p, src, qmax + 1) : p.seq_local;
      end = (count + BY - 1) / BY;
      if (end > 0) {
        j = 0;
        return true;
      }
    }
    return false;
  }
};

// fp32 dot product of 8 elements of T held in two int4, in order.
template <typename T>
__device__ __forceinline__ float dot8(int4 a, int4 b);
template <>
__device__ __forceinline__ float dot8<__nv_bfloat16>(int4 a, int4 b) {
  const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&b);
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 u = __bfloat1622float2(x[e]), w = __bfloat1622float2(y[e]);
    s = fmaf(u.x, w.x, s);
    s = fmaf(u.y, w.y, s);
  }
  return s;
}
template <>
__device__ __forceinline__ float dot8<__half>(int4 a, int4 b) {
  const __half2* x = reinterpret_cast<const __half2*>(&a);
  const __half2* y = reinterpret_cast<const __half2*>(&b);
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 u = __half22float2(x[e]), w = __half22float2(y[e]);
    s = fmaf(u.x, w.x, s);
    s = fmaf(u.y, w.y, s);
  }
  return s;
}

// One-pass: the dQ sums of this rank's query tiles (fp32, 64 x D per tile in tile order
// (batch · heads + head) · q_tiles + tile, each row's float2 pairs permuted by dq_pair) and
// one turn word per tile (how many partials are in the sum).
__device__ __forceinline__ float* dq_sums(const RingAttnBwdParams& p) {
  return reinterpret_cast<float*>(reinterpret_cast<char*>(p.ws.data[p.rank]) + p.dq_sums_offset);
}
__device__ __forceinline__ uint64_t* dq_turns(const RingAttnBwdParams& p) {
  return reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(p.ws.data[p.rank]) + p.dq_turns_offset);
}
// The float2 position of pair f (columns 2f, 2f + 1) in row `row` of a dQ partial or sum:
// XOR-permuted by the row so that the consumers' stores of a fragment (8 rows x 4 pairs
// per warp instruction) fall on distinct banks. A permutation inside each row for D = 64
// and 128 (pairs 0..D/2-1, 8 | D/2).
__device__ __forceinline__ int dq_pair(int row, int f) { return f ^ ((row & 7) << 2); }
// threadIdx.x read anew (volatile: not merged with the kernel's first read). Where the
// consumers test for thread 0 per tile, reusing the first read keeps "thread 0" live across
// the engine, also in the 56-register loading warps, where the D = 64 one-pass kernel then
// spills it.
__device__ __forceinline__ int fresh_thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// One-pass: the key blocks of source `src` whose dK/dV item walks query tile m of this
// rank: a prefix, as the walk starts at the tile of the first query at or after the block's
// first key (ops::ring_attention_backward::dq_key_blocks). Causal: the blocks that start at
// or before the tile's last query, every block for the last tile when it is partial.
__device__ __forceinline__ int dq_key_blocks(const RingAttnBwdParams& p, int src, int m) {
  const int last = (m + 1) * BY;
  if (p.causal == 0 || last > p.seq_local) return p.k_blocks;
  const int qpos = token_pos(p.rank, last - 1, p.seq_local, p.nranks, true);
  return (tokens_before(p, src, qpos + 1) + BX - 1) / BX;
}
// The number of partials summed into query tile m before the one of the dK/dV item at ring
// step s, key block kb: the partials of a tile are summed in ticket order (ring step, then
// key block), so every sum has one order, run to run, and no partial waits for a later
// ticket (ops::ring_attention_backward::dq_turn).
__device__ __forceinline__ int dq_turn(const RingAttnBwdParams& p, int m, int s, int kb) {
  int turn = kb;
  for (int a = 0; a < s; ++a) {
    int src = p.rank + a + 1;
    src -= src >= p.nranks ? p.nranks : 0;
    src -= src >= p.nranks ? p.nranks : 0;
    turn += dq_key_blocks(p, src, m);
  }
  return turn;
}

// Phase 2 (whole CTA): the row values of this CTA's share, then the grid barrier. Entry
// (b·heads + h)·q_tiles·64 + q holds (lse · log2 e, delta) of query q (zeros past
// seqLocal). One-pass: also the dQ turn words to 0 and, with atomic sums, the dQ sums to 0.
// False when the barrier's wait gave up.
template <typename T, int D, bool ONE_PASS>
__device__ __forceinline__ bool write_rows(const RingAttnBwdParams& p, uint64_t epoch) {
  const int pad = p.q_tiles * BY;
  const size_t total = (size_t)p.batch * p.heads * pad;
  float2* rows = reinterpret_cast<float2*>(reinterpret_cast<char*>(p.ws.data[p.ws.rank]) + p.rows_offset);
  const float* lse = reinterpret_cast<const float*>(p.lse);
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
    const int bh = (int)(e / pad), q = (int)(e - (size_t)bh * pad);
    float2 v = make_float2(0.f, 0.f);
    if (q < p.seq_local) {
      const int b = bh / p.heads, h = bh - b * p.heads;
      const size_t off = (((size_t)b * p.seq_local + q) * p.heads + h) * D;
      const int4* o = reinterpret_cast<const int4*>(reinterpret_cast<const T*>(p.out) + off);
      const int4* g = reinterpret_cast<const int4*>(reinterpret_cast<const T*>(p.dout) + off);
      float delta = 0.f;
#pragma unroll
      for (int c = 0; c < D / 8; ++c) delta += dot8<T>(o[c], g[c]);
      v = make_float2(lse[(size_t)bh * p.seq_local + q] * 1.4426950408889634f, delta);
    }
    rows[e] = v;
  }
  if constexpr (ONE_PASS) {
    const size_t tiles = (size_t)p.batch * p.heads * p.q_tiles;
    uint64_t* turns = dq_turns(p);
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < tiles; e += (size_t)gridDim.x * blockDim.x)
      turns[e] = 0;
    if (p.dq_atomic != 0) {
      float4* sums = reinterpret_cast<float4*>(dq_sums(p));
      const size_t n4 = tiles * BY * D / 4;
      for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n4; e += (size_t)gridDim.x * blockDim.x)
        sums[e] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (mk_arrive_last(mk_signal_word(p.ws, p.ws.rank, RING_BWD_ROWS_ARRIVE), gridDim.x))
      mk_st_release_sys(mk_signal_word(p.ws, p.ws.rank, RING_BWD_ROWS_READY), epoch);
  }
  return mk_cta_wait(p.ws, mk_signal_word(p.ws, p.ws.rank, RING_BWD_ROWS_READY), epoch, p.ws.rank, MK_WAIT_OP_FLAG,
                     MK_OP_RING_ATTENTION_BACKWARD);
}

// A 1-D bulk copy global -> shared that completes on `bar` (16-byte aligned, bytes % 16 == 0).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   gemm::smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(gemm::smem_addr(bar))
               : "memory");
}

// A 1-D bulk copy shared -> global, and its reduce-add form (fp32, element-wise atomic adds
// at the destination), both in the thread's bulk group (16-byte aligned, bytes % 16 == 0).
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(gemm::smem_addr(src)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
               "r"(gemm::smem_addr(src)), "r"(bytes)
               : "memory");
}

template <typename T, int D, bool ONE_PASS>
struct Engine {
  static constexpr int XS = ONE_PASS ? ONE_PASS_X_STAGES : X_STAGES;  // slots of the X ring
  static constexpr int XT = BX * D;  // elements of one X tile
  static constexpr int YT = BY * D;
  static constexpr int KSTEPS = D / 16;  // k-steps of X·Yᵀ
  static constexpr int PSTEPS = BY / 16; // k-steps of the products over Y's rows
  static constexpr int SREG = BY / 2;    // accumulators of an m64n64 tile per thread
  static constexpr int OREG = D / 2;     // of an m64nD tile

  // The producer (lane 0 of warp 8): every load, in the consumers' order.
  __device__ static bool produce(const RingAttnBwdParams& p, const BwdMaps& maps, uint64_t epoch, T* sX, T* sY,
                                 float2* sRows, Pipeline& pl) {
    using namespace mk::gemm;
    const int me = p.rank;
    uint32_t acquired = 1u << me;
    auto ensure = [&](int src) -> bool {
      if (acquired & (1u << src)) return true;
      if (!mk_wait_geq_inline(p.ws, mk_signal_word(p.ws, me, RING_BWD_KV + src), epoch, src, MK_WAIT_OP_FLAG,
                              MK_OP_RING_ATTENTION_BACKWARD))
        return false;
      fence_proxy_async_global();
      acquired |= 1u << src;
      return true;
    };
    // The row values were written by other CTAs' generic stores: acquire their flag in
    // this thread and order it before the bulk copies (async proxy).
    (void)mk_ld_acquire_sys(mk_signal_word(p.ws, me, RING_BWD_ROWS_READY));
    fence_proxy_async_global();
    // 64-row boxes: a 128-row X tile is two per 64-wide d block (the swizzled layout of
    // a 128-row tile: d block c at c·128·64 elements, rows 64.. at 64·64 inside it).
    auto load_x = [&](T* dst, const CUtensorMap* map, uint64_t* bar, int head, int row0, int b) {
#pragma unroll
      for (int c = 0; c < D / 64; ++c) {
        tma_load_4d(dst + c * (BX * 64), map, bar, c * 64, head, row0, b);
        tma_load_4d(dst + c * (BX * 64) + BY * 64, map, bar, c * 64, head, row0 + BY, b);
      }
    };
    auto load_y = [&](T* dst, const CUtensorMap* map, uint64_t* bar, int head, int row0, int b) {
#pragma unroll
      for (int c = 0; c < D / 64; ++c) tma_load_4d(dst + c * (BY * 64), map, bar, c * 64, head, row0, b);
    };
    uint64_t* own_signals = mk_signal_word(p.ws, me, 0);
    int tile = 0;
    for (int k = 0;; ++k) {
      const int ticket = take_ticket(reinterpret_cast<unsigned long long*>(mk_signal_word(p.ws, me, RING_BWD_SCHED_NEXT)));
      const int task = ticket < p.num_tickets ? ticket : -1;
      const int xs = k % XS;
      mbar_wait(&pl.x_empty[xs], ((k / XS) & 1) ^ 1);
      pl.task[xs] = task;
      if (task < 0) {
        mbar_arrive(&pl.x_full[xs]);  // no bytes: "no more items"
        break;
      }
      const Task t(p, task);
      // Another wait of this rank or a peer gave up: stop at this item (a peer's failure
      // recorded as this rank's mkRemoteError, when no wait of its own saw it).
      if ((t.kv && !ensure(t.src)) ||
          mk_abort_seen(p.ws, own_signals, MK_WAIT_OP_FLAG, MK_OP_RING_ATTENTION_BACKWARD)) {
        *reinterpret_cast<volatile int*>(&pl.abort_item) = k;
        mbar_arrive(&pl.x_full[xs]);
        return false;
      }
      mbar_expect_tx(&pl.x_full[xs], 2 * XT * sizeof(T));
      T* x1 = sX + xs * 2 * XT;
      if (t.kv) {
        load_x(x1, &maps.k[t.src], &pl.x_full[xs], t.hk, t.row0, t.b);
        load_x(x1 + XT, &maps.v[t.src], &pl.x_full[xs], t.hk, t.row0, t.b);
      } else {
        load_x(x1, &maps.q, &pl.x_full[xs], t.h, t.row0, t.b);
        load_x(x1 + XT, &maps.dout, &pl.x_full[xs], t.h, t.row0, t.b);
      }
      Walk w;
      while (w.next(p, t)) {
        const int st = tile % Y_STAGES;
        const uint32_t ph = (tile / Y_STAGES) & 1;
        const bool ok = t.kv || ensure(w.src);
        mbar_wait(&pl.y_empty[st], ph ^ 1);
        if (!ok) {
          *reinterpret_cast<volatile int*>(&pl.abort_tile) = tile;
          mbar_arrive(&pl.y_full[st]);
          return false;
        }
        T* y1 = sY + st * 2 * YT;
        const int yt = w.template y_tile<ONE_PASS>(p, t);
        if (t.kv) {
          const int h = t.hk * (p.heads / p.kv_heads) + w.a;
          mbar_expect_tx(&pl.y_full[st], 2 * YT * sizeof(T) + BY * 8);
          load_y(y1, &maps.q, &pl.y_full[st], h, yt * BY, t.b);
          load_y(y1 + YT, &maps.dout, &pl.y_full[st], h, yt * BY, t.b);
          const char* rows = reinterpret_cast<const char*>(p.ws.data[me]) + p.rows_offset +
                             (((size_t)t.b * p.heads + h) * p.q_tiles + yt) * (BY * 8);
          bulk_load(sRows + st * BY, rows, BY * 8, &pl.y_full[st]);
        } else {
          mbar_expect_tx(&pl.y_full[st], 2 * YT * sizeof(T));
          load_y(y1, &maps.k[w.src], &pl.y_full[st], t.hk, yt * BY, t.b);
          load_y(y1 + YT, &maps.v[w.src], &pl.y_full[st], t.hk, yt * BY, t.b);
        }
        ++tile;
      }
    }
    return true;
  }

  // The shared-memory pieces of the one-pass engine's dQ (unused by the two-pass one).
  struct DqSlots {
    T* ds;           // [2][BX x BY]: dS of tiles of even and odd number, rows = keys
    float* partial;  // [DQ_STAGES][BY x D]: the dQ partials handed to the writer
    DqPipeline* pipe;
  };

  // The two consumer warpgroups. Tickets come dK/dV items first, then dQ items (none in
  // the one-pass engine), so the consumers run two loops, one per kind (no wgmma under a
  // branch on the kind: ptxas would serialise them). `tile` ends as the number of Y tiles
  // consumed. Returns false when the producer stopped early.
  __device__ static bool consume(const RingAttnBwdParams& p, uint64_t epoch, const T* sX, const T* sY,
                                 const float2* sRows, Pipeline& pl, const DqSlots& dq, int& tile) {
    const int kv_tickets = p.nranks * p.kv_items;
    int k = 0;
    int task = wait_x(pl, k);
    while (task >= 0 && task < kv_tickets) {
      if (!item<true>(p, epoch, Task(p, task), k, tile, sX, sY, sRows, pl, dq)) return false;
      task = wait_x(pl, ++k);
    }
    if constexpr (!ONE_PASS) {
      while (task >= kv_tickets) {
        if (!item<false>(p, epoch, Task(p, task), k, tile, sX, sY, sRows, pl, dq)) return false;
        task = wait_x(pl, ++k);
      }
    }
    return task == -1;
  }

  // Waits for the X tiles of this CTA's k-th item: its ticket, -1 when there are no more,
  // -2 when the producer stopped.
  __device__ static int wait_x(Pipeline& pl, int k) {
    gemm::mbar_wait(&pl.x_full[k % XS], (k / XS) & 1);
    if (k >= *reinterpret_cast<volatile int*>(&pl.abort_item)) return -2;
    return *reinterpret_cast<volatile int*>(&pl.task[k % XS]);
  }

  // One item (KV: a dK/dV item; else a dQ item) whose X tiles are in slot k % XS; `tile`
  // counts the Y tiles consumed. One-pass: every tile of a dK/dV item also hands dQ's
  // partial over its 128 keys, dS·K, to the dQ writer. False when the producer stopped.
  template <bool KV>
  __device__ static bool item(const RingAttnBwdParams& p, uint64_t epoch, const Task& t, int k, int& tile, const T* sX,
                              const T* sY, const float2* sRows, Pipeline& pl, const DqSlots& dq) {
    using namespace mk::gemm;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wg = warp / 4;
    const int t4 = lane % 4;
    const int row_in_x = 64 * wg + 16 * (warp % 4) + lane / 4;  // this thread's X rows: row_in_x, + 8
    const int S = p.seq_local, n = p.nranks, me = p.rank;
    const bool causal = p.causal != 0;
    const float sl = p.scale_log2;
    const int xs = k % XS;
    const T* x1 = sX + xs * 2 * XT;
    const uint64_t xd1 = make_smem_desc_sw128(x1) + ((64 * wg * 128) >> 4);
    const uint64_t xd2 = xd1 + ((XT * sizeof(T)) >> 4);
    // This thread's two X rows: keys of the source (dK/dV) or queries of this rank (dQ).
    const int xrank = KV ? t.src : me;
    int xrow[2], xpos[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      xrow[r] = t.row0 + row_in_x + 8 * r;
      xpos[r] = token_pos(xrank, min(xrow[r], S - 1), S, n, causal);
    }
    // The first and last valid positions of this warpgroup's 64 X rows (which tiles to mask).
    const int xpos_first = token_pos(xrank, min(t.row0 + 64 * wg, S - 1), S, n, causal);
    const int xpos_last = token_pos(xrank, min(t.row0 + 64 * wg + 63, S - 1), S, n, causal);
    const bool x_tail = t.row0 + 64 * wg + 64 > S;

    float acc_a[OREG];           // dK (dK/dV items) or dQ
    float acc_b[KV ? OREG : 1];  // dV
    float dqv[ONE_PASS ? 32 : 1];  // one-pass: dQ's partial of the tile (an m64n64 fragment)
#pragma unroll
    for (int e = 0; e < (ONE_PASS ? 32 : 1); ++e) dqv[e] = 0.f;  // defined before the first wgmma
    bool chain_ok = true;
    if constexpr (KV) {
      chain_ok = chain_in(p, epoch, t, acc_a, acc_b);
    } else {
#pragma unroll
      for (int e = 0; e < OREG; ++e) acc_a[e] = 0.f;
    }
    // dQ: the rows' values in registers; dK/dV: per query column, from shared memory.
    float2 rowv[2] = {make_float2(0.f, 0.f), make_float2(0.f, 0.f)};
    if (!KV) {
      const float2* rows = reinterpret_cast<const float2*>(reinterpret_cast<const char*>(p.ws.data[me]) + p.rows_offset) +
                           ((size_t)t.b * p.heads + t.h) * p.q_tiles * BY;
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (xrow[r] < S) rowv[r] = __ldcg(rows + xrow[r]);
    }
    Walk w;
    while (w.next(p, t)) {
      const int st = tile % Y_STAGES;
      mbar_wait(&pl.y_full[st], (tile / Y_STAGES) & 1);
      if (tile >= *reinterpret_cast<volatile int*>(&pl.abort_tile)) return false;
      const T* y1 = sY + st * 2 * YT;
      const uint64_t yd1 = make_smem_desc_sw128(y1);
      const uint64_t yd2 = yd1 + ((YT * sizeof(T)) >> 4);
      float sa[SREG], sb[SREG];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        const int cb = kk / 4, ko = (kk % 4) * 32;
        Wgmma<BY, T>::mma(sa, xd1 + ((cb * (BX * 128) + ko) >> 4), yd1 + ((cb * (BY * 128) + ko) >> 4), kk > 0);
      }
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        const int cb = kk / 4, ko = (kk % 4) * 32;
        Wgmma<BY, T>::mma(sb, xd2 + ((cb * (BX * 128) + ko) >> 4), yd2 + ((cb * (BY * 128) + ko) >> 4), kk > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_operands(sa);
      fence_operands(sb);
      // Y rows of this tile: queries of this rank (dK/dV) or keys of w.src (dQ).
      const int yt = w.template y_tile<ONE_PASS>(p, t);
      const int y0 = yt * BY;
      const int yrank = KV ? me : w.src;
      bool need_mask = x_tail || y0 + BY > S;
      if (causal) {
        // Visible: key position <= query position.
        need_mask = need_mask || (KV ? xpos_last > token_pos(yrank, y0, S, n, true)
                                     : token_pos(yrank, min(y0 + BY, S) - 1, S, n, true) > xpos_first);
      }
      // P and dS in place of the two products: sa = P, sb = dS.
#pragma unroll
      for (int jj = 0; jj < BY / 8; ++jj) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int ycol = 8 * jj + 2 * t4 + e;
          const float2 colv = KV ? sRows[st * BY + ycol] : make_float2(0.f, 0.f);
          bool col_ok = true;
          int ypos = 0;
          if (need_mask) {
            col_ok = y0 + ycol < S;
            ypos = token_pos(yrank, min(y0 + ycol, S - 1), S, n, causal);
          }
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int idx = 4 * jj + 2 * r + e;
            const float2 rv = KV ? colv : rowv[r];
            bool vis = true;
            if (need_mask) {
              vis = col_ok && xrow[r] < S;
              if (causal) vis = vis && (KV ? xpos[r] <= ypos : ypos <= xpos[r]);
            }
            const float pr = vis ? exp2_ftz(sa[idx] * sl - rv.x) : 0.f;
            sb[idx] = vis ? pr * (sb[idx] - rv.y) : 0.f;
            sa[idx] = pr;
          }
        }
      }
      uint32_t pd[PSTEPS][4];
      if constexpr (KV) {
        uint32_t pp[PSTEPS][4];
#pragma unroll
        for (int kk = 0; kk < PSTEPS; ++kk)
#pragma unroll
          for (int q = 0; q < 4; ++q) pp[kk][q] = Mma<T>::pack(sa[8 * kk + 2 * q], sa[8 * kk + 2 * q + 1]);
#pragma unroll
        for (int kk = 0; kk < PSTEPS; ++kk)
#pragma unroll
          for (int q = 0; q < 4; ++q) pd[kk][q] = Mma<T>::pack(sb[8 * kk + 2 * q], sb[8 * kk + 2 * q + 1]);
        if constexpr (ONE_PASS) {
          // dS as rounded for dK into this tile's dS buffer, rows = this warpgroup's keys:
          // pd[kk][q] holds row row_in_x + 8 (q & 1), query columns 8 (2 kk + q / 2) + 2 t4 + {0, 1}.
          // Both halves are needed by both warpgroups' dQ products: the barrier, after the
          // fence that makes these generic stores visible to wgmma (async proxy). The buffer
          // of tile + 2 is free then: each warpgroup reaches this barrier for tile + 1 only
          // after its dQ product of `tile` completed.
          T* ds = dq.ds + (tile & 1) * (BX * BY);
#pragma unroll
          for (int kk = 0; kk < PSTEPS; ++kk)
#pragma unroll
            for (int q = 0; q < 4; ++q)
              *reinterpret_cast<uint32_t*>(ds + swz<BX>(row_in_x + 8 * (q & 1), 2 * kk + (q >> 1)) + 2 * t4) = pd[kk][q];
          fence_proxy_async_smem();
          named_barrier_sync(DS_BARRIER, 256);
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < PSTEPS; ++kk)  // dV += P·dout
          WgmmaRsT<D, T>::mma(acc_b, pp[kk], desc_mn_sw128(y1 + YT + kk * 16 * 64, BY * 128));
      } else {
#pragma unroll
        for (int kk = 0; kk < PSTEPS; ++kk)
#pragma unroll
          for (int q = 0; q < 4; ++q) pd[kk][q] = Mma<T>::pack(sb[8 * kk + 2 * q], sb[8 * kk + 2 * q + 1]);
        wgmma_fence();
      }
#pragma unroll
      for (int kk = 0; kk < PSTEPS; ++kk)  // dK += dS·q, or dQ += dS·k
        WgmmaRsT<D, T>::mma(acc_a, pd[kk], desc_mn_sw128(y1 + kk * 16 * 64, BY * 128));
      if constexpr (ONE_PASS && KV) {
        // dQ's partial of this query tile, dS·K, both operands MN-major (rows = keys). D = 128:
        // this warpgroup's 64 columns (d block wg of K) over all 128 keys. D = 64: all 64
        // columns over this warpgroup's 64 keys; the two halves are added in hand_dq.
        const T* ds = dq.ds + (tile & 1) * (BX * BY);
        constexpr int DQ_KSTEPS = D == 128 ? BX / 16 : BX / 32;
        const int key0 = D == 128 ? 0 : 64 * wg;
        const T* kd = x1 + (D == 128 ? wg * (BX * 64) : 0);
#pragma unroll
        for (int kk = 0; kk < DQ_KSTEPS; ++kk)
          WgmmaTT<64, T>::mma(dqv, desc_mn_sw128(ds + (key0 + 16 * kk) * 64, BY * 128),
                              desc_mn_sw128(kd + (key0 + 16 * kk) * 64, BX * 128), kk > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_operands(acc_a);
      if constexpr (KV) fence_operands(acc_b);
      if constexpr (ONE_PASS && KV) fence_operands(dqv);
      if (lane == 0) mbar_arrive(&pl.y_empty[st]);  // this warp's wgmmas that read the tile are done
      if constexpr (ONE_PASS && KV)
        hand_dq(dq, dqv, tile, make_int4((t.b * p.heads + t.hk * (p.heads / p.kv_heads) + w.a), yt, t.s, t.row0 / BX));
      ++tile;
    }
    if (lane == 0) mbar_arrive(&pl.x_empty[xs]);  // every wgmma that read X has completed
    if constexpr (KV) {
      chain_out(p, epoch, t, chain_ok, acc_a, acc_b, row_in_x);
    } else {
      store_rows(p, acc_a, p.dq, p.heads, t.h, t.b, t.row0 + row_in_x, p.scale);
    }
    __syncwarp();  // converged before the next wgmma (.aligned)
    return true;
  }

  // One-pass, all 256 consumer threads: dQ's partial of Y tile `tile` (an m64n64 fragment
  // per warpgroup, see item) into slot tile % DQ_STAGES as 64 rows x D fp32 (pairs placed
  // by dq_pair), then handed to the writer with the tile's coordinates `where`.
  __device__ static void hand_dq(const DqSlots& dq, const float (&dqv)[32], int tile, int4 where) {
    using namespace mk::gemm;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4, t4 = lane % 4;
    const int st = tile % DQ_STAGES;
    mbar_wait(&dq.pipe->empty[st], ((tile / DQ_STAGES) & 1) ^ 1);
    float* out = dq.partial + st * (BY * D);
    const int row0 = 16 * (warp % 4) + lane / 4;  // this thread's query rows: row0, row0 + 8
    auto at = [&](int r, int f) { return reinterpret_cast<float2*>(out + (row0 + 8 * r) * D) + dq_pair(row0, f); };
    if constexpr (D == 128) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) *at(r, 32 * wg + 4 * j + t4) = make_float2(dqv[4 * j + 2 * r], dqv[4 * j + 2 * r + 1]);
    } else {
      // Warpgroup 0's keys first, then warpgroup 1 adds its own: one order every run.
      if (wg == 0) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int r = 0; r < 2; ++r) *at(r, 4 * j + t4) = make_float2(dqv[4 * j + 2 * r], dqv[4 * j + 2 * r + 1]);
      }
      named_barrier_sync(DQ_SUM_BARRIER, 256);
      if (wg == 1) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float2* a = at(r, 4 * j + t4);
            const float2 v = *a;
            *a = make_float2(v.x + dqv[4 * j + 2 * r], v.y + dqv[4 * j + 2 * r + 1]);
          }
      }
    }
    if (fresh_thread_index() == 0) dq.pipe->tile[st] = where;
    fence_proxy_async_smem();  // the writer's bulk operation reads the slot through the async proxy
    __syncwarp();
    if (lane == 0) mbar_arrive(&dq.pipe->full[st]);
  }

  // One-pass, all 256 consumer threads, after their last tile (or at an abort): tells the
  // writer that `tiles` partials came, through the slot of partial number `tiles`.
  __device__ static void end_dq(const DqSlots& dq, int tiles) {
    using namespace mk::gemm;
    const int st = tiles % DQ_STAGES;
    mbar_wait(&dq.pipe->empty[st], ((tiles / DQ_STAGES) & 1) ^ 1);
    if (fresh_thread_index() == 0) *reinterpret_cast<volatile int*>(&dq.pipe->last) = tiles;
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(&dq.pipe->full[st]);
  }

  // One-pass, the dQ writer (lane 0 of warp 9): adds each partial to its query tile's sum
  // in this rank's workspace, in the tile's turn order (dq_turn): it waits (bounded) until
  // the tile's turn word says every earlier partial is in, stores (first turn) or adds its
  // own by one bulk operation, waits for it to complete and raises the turn word. With
  // p.dq_atomic the sums start at zero (write_rows) and every partial is added at once,
  // in whatever order the CTAs come (fp32 sums then differ in their last bits run to run).
  // After a wait gave up (the error is recorded and the abort raised) the writer only
  // frees the slots, so that the consumers reach the end.
  __device__ static void write_dq(const RingAttnBwdParams& p, const DqSlots& dq) {
    using namespace mk::gemm;
    constexpr uint32_t BYTES = BY * D * 4;
    float* sums = dq_sums(p);
    uint64_t* turns = dq_turns(p);
    // The turn words (and, atomic, the sums) were zeroed by other CTAs' generic stores
    // before the row values' grid barrier: acquire its flag in this thread and order it
    // before the bulk operations (async proxy), as the producer does for the row values.
    (void)mk_ld_acquire_sys(mk_signal_word(p.ws, p.rank, RING_BWD_ROWS_READY));
    fence_proxy_async_global();
    bool ok = true;
    for (int t = 0;; ++t) {
      const int st = t % DQ_STAGES;
      mbar_wait(&dq.pipe->full[st], (t / DQ_STAGES) & 1);
      if (t >= *reinterpret_cast<volatile int*>(&dq.pipe->last)) break;
      const int4 where = dq.pipe->tile[st];  // after the wait on full[st] (its "memory" clobber: read anew)
      const size_t tile = (size_t)where.x * p.q_tiles + where.y;
      const float* src = dq.partial + st * (BY * D);
      float* dst = sums + tile * (BY * D);
      const int turn = p.dq_atomic != 0 ? 1 : dq_turn(p, where.y, where.z, where.w);
      if (ok && p.dq_atomic == 0 && turn > 0) {
        ok = mk_wait_geq_backoff<32, 256, 64, MkScope::Gpu>(p.ws, turns + tile, (uint64_t)turn, p.rank, MK_WAIT_OP_FLAG,
                                                            MK_OP_RING_ATTENTION_BACKWARD);
        fence_proxy_async_global();  // the acquired sum before this thread's bulk operation
      }
      if (ok) {
        if (turn == 0) bulk_store(dst, src, BYTES);
        else bulk_reduce_add_f32(dst, src, BYTES);
        tma_store_commit();
        tma_store_wait_read();
      }
      mbar_arrive(&dq.pipe->empty[st]);
      if (ok && p.dq_atomic == 0) {
        tma_store_wait_all();
        fence_proxy_async_global();  // the completed bulk writes before the turn word
        mk_st_release_gpu(turns + tile, (uint64_t)turn + 1);
      }
    }
    tma_store_wait_all();
    fence_proxy_async_global();
  }

  // Rows row0 and row0 + 8 of an m64nD fragment, times `mul`, rounded to T, into a
  // [batch][seqLocal][heads][D] tensor (rows past seqLocal are not stored).
  __device__ static void store_rows(const RingAttnBwdParams& p, const float (&acc)[OREG], uint64_t dst, int heads, int h,
                                    int b, int row0, float mul) {
    const int t4 = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 8 * r;
      if (row >= p.seq_local) continue;
      T* o = reinterpret_cast<T*>(dst) + (((size_t)b * p.seq_local + row) * heads + h) * D + 2 * t4;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *reinterpret_cast<uint32_t*>(o + 8 * j) = Mma<T>::pack(acc[4 * j + 2 * r] * mul, acc[4 * j + 2 * r + 1] * mul);
    }
  }

  // The dK/dV chain of item (s, i), all 256 consumer threads. chain_in, before the item:
  // the accumulators start from the sum the ring successor formed at step s - 1 (read
  // from its region after bounded waits), or from 0 at s = 0; the partial is added on
  // top of it in the item's tile order. chain_out, after the item: the sum goes to this
  // rank's slot for the predecessor (s < n - 1), or to dk/dv (s = n - 1, the rank's own
  // block). A wait that gives up has raised the abort word: the sum is then dropped (the
  // outputs are undefined) and the producer stops at its next item. (A bounded wait in
  // chain_out, after the item, spills at D = 128: every wait is in chain_in.)
  __device__ static float4* slot(const RingAttnBwdParams& p, int rank, int s, int i) {
    constexpr size_t SLOT = (size_t)2 * (OREG / 4) * 256;  // float4 of one item's dK and dV
    return reinterpret_cast<float4*>(reinterpret_cast<char*>(p.ws.data[rank]) + p.slots_offset) +
           ((size_t)s * p.kv_items + i) * SLOT;
  }
  __device__ static bool chain_in(const RingAttnBwdParams& p, uint64_t epoch, const Task& t, float (&dk)[OREG],
                                  float (&dv)[OREG]) {
    using namespace mk::gemm;
    constexpr int VEC = OREG / 4;
    const int ct = threadIdx.x, n = p.nranks, me = p.rank;
    int ok = 1;
    if (t.s > 0) {
      const int succ = me + 1 == n ? 0 : me + 1, pred = me == 0 ? n - 1 : me - 1;
      const uint64_t prev = chain_value(epoch, n, t.s - 1);
      // First this rank's own step s - 1 of the item (another CTA's, maybe still running),
      // so the predecessor's word, which only grows, is raised in step order; then the
      // successor's sum of step s - 1.
      if (ct == 0)
        ok = mk_wait_geq_inline(p.ws, mk_signal_word(p.ws, pred, RING_BWD_CHAIN + t.i), prev, me, MK_WAIT_OP_FLAG,
                                MK_OP_RING_ATTENTION_BACKWARD) &&
             mk_wait_geq_inline(p.ws, mk_signal_word(p.ws, me, RING_BWD_CHAIN + t.i), prev, succ, MK_WAIT_OP_FLAG,
                                MK_OP_RING_ATTENTION_BACKWARD);
      ok = named_barrier_and(CHAIN_BARRIER, 256, ok);
    }
    if (t.s > 0 && ok) {
      const float4* in = slot(p, me + 1 == n ? 0 : me + 1, t.s - 1, t.i);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float4 a = __ldcg(in + v * 256 + ct), c = __ldcg(in + (VEC + v) * 256 + ct);
        dk[4 * v] = a.x, dk[4 * v + 1] = a.y, dk[4 * v + 2] = a.z, dk[4 * v + 3] = a.w;
        dv[4 * v] = c.x, dv[4 * v + 1] = c.y, dv[4 * v + 2] = c.z, dv[4 * v + 3] = c.w;
      }
    } else {
#pragma unroll
      for (int e = 0; e < OREG; ++e) dk[e] = dv[e] = 0.f;
    }
    return ok != 0;
  }
  __device__ static void chain_out(const RingAttnBwdParams& p, uint64_t epoch, const Task& t, bool ok,
                                   const float (&dk)[OREG], const float (&dv)[OREG], int row_in_x) {
    using namespace mk::gemm;
    constexpr int VEC = OREG / 4;
    const int ct = threadIdx.x, n = p.nranks, me = p.rank;
    if (t.s == n - 1) {
      store_rows(p, dk, p.dk, p.kv_heads, t.hk, t.b, t.row0 + row_in_x, p.scale);
      store_rows(p, dv, p.dv, p.kv_heads, t.hk, t.b, t.row0 + row_in_x, 1.f);
      return;
    }
    float4* out = slot(p, me, t.s, t.i);
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      __stcg(out + v * 256 + ct, make_float4(dk[4 * v], dk[4 * v + 1], dk[4 * v + 2], dk[4 * v + 3]));
      __stcg(out + (VEC + v) * 256 + ct, make_float4(dv[4 * v], dv[4 * v + 1], dv[4 * v + 2], dv[4 * v + 3]));
    }
    named_barrier_sync(CHAIN_BARRIER, 256);
    if (ct == 0 && ok)
      mk_signal_store(mk_signal_word(p.ws, me == 0 ? n - 1 : me - 1, RING_BWD_CHAIN + t.i), chain_value(epoch, n, t.s));
  }

  // Phase 3 (every thread of the CTA). Returns false when a wait gave up.
  __device__ static bool run(const RingAttnBwdParams& p, const BwdMaps& maps, uint64_t epoch, char* smem_raw) {
    __shared__ Pipeline pl;
    __shared__ DqPipeline dq_pipe;  // one-pass only
    char* smem = smem_raw + ((1024 - (gemm::smem_addr(smem_raw) & 1023)) & 1023);
    T* sX = reinterpret_cast<T*>(smem);  // [XS][2][BX x D]
    T* sY = sX + XS * 2 * XT;            // [Y_STAGES][2][BY x D]
    float2* sRows = reinterpret_cast<float2*>(sY + Y_STAGES * 2 * YT);  // [Y_STAGES][BY]
    // One-pass: [2][BX x BY] dS tiles and [DQ_STAGES][BY x D] fp32 partials (1024-aligned:
    // the row values take 1 KiB).
    T* sDs = reinterpret_cast<T*>(sRows + Y_STAGES * BY);
    const DqSlots dq{sDs, reinterpret_cast<float*>(sDs + 2 * BX * BY), &dq_pipe};
    if (threadIdx.x == 0) {
      if constexpr (ONE_PASS) {
        for (int s = 0; s < DQ_STAGES; ++s) {
          gemm::mbar_init(&dq_pipe.full[s], CONSUMER_WARPS);
          gemm::mbar_init(&dq_pipe.empty[s], 1);
        }
        dq_pipe.last = INT_MAX;
      }
      for (int s = 0; s < XS; ++s) {
        gemm::mbar_init(&pl.x_full[s], 1);
        gemm::mbar_init(&pl.x_empty[s], CONSUMER_WARPS);
      }
      for (int s = 0; s < Y_STAGES; ++s) {
        gemm::mbar_init(&pl.y_full[s], 1);
        gemm::mbar_init(&pl.y_empty[s], CONSUMER_WARPS);
      }
      pl.abort_item = INT_MAX;
      pl.abort_tile = INT_MAX;
      gemm::fence_mbar_init();
    }
    __syncthreads();
    bool ok;
    if (threadIdx.x >= CONSUMER_WARPS * 32) {
      gemm::setmaxnreg_dec<PRODUCER_REGS>();
      ok = true;
      if (threadIdx.x == CONSUMER_WARPS * 32) {
        gemm::prefetch_tensor_map(&maps.q);
        gemm::prefetch_tensor_map(&maps.dout);
        ok = produce(p, maps, epoch, sX, sY, sRows, pl);
      }
      if constexpr (ONE_PASS) {
        if (threadIdx.x == CONSUMER_WARPS * 32 + 32) write_dq(p, dq);
      }
      __syncwarp();
      gemm::setmaxnreg_inc<LAUNCH_REGS>();
    } else {
      gemm::setmaxnreg_inc<CONSUMER_REGS>();
      int tiles = 0;
      ok = consume(p, epoch, sX, sY, sRows, pl, dq, tiles);
      if constexpr (ONE_PASS) end_dq(dq, tiles);
      __syncwarp();
      gemm::setmaxnreg_dec<LAUNCH_REGS>();
    }
    return ok;
  }
};

// One-pass, after the engine (whole CTA, every CTA): once every CTA's dQ writer is done (a
// grid barrier), dq = softmaxScale · the sums, rounded to T. False when the barrier's wait
// gave up or `ok` is false (then dq is not written).
template <typename T, int D>
__device__ __forceinline__ bool finish_dq(const RingAttnBwdParams& p, uint64_t epoch, bool ok) {
  __syncthreads();  // this CTA's writer has completed its bulk operations (write_dq)
  if (threadIdx.x == 0) {
    __threadfence();
    if (mk_arrive_last(mk_signal_word(p.ws, p.ws.rank, RING_BWD_DQ_ARRIVE), gridDim.x))
      mk_st_release_sys(mk_signal_word(p.ws, p.ws.rank, RING_BWD_DQ_READY), epoch);
  }
  if (!mk_cta_wait(p.ws, mk_signal_word(p.ws, p.ws.rank, RING_BWD_DQ_READY), epoch, p.ws.rank, MK_WAIT_OP_FLAG,
                   MK_OP_RING_ATTENTION_BACKWARD) ||
      !ok)
    return false;
  const float* sums = dq_sums(p);
  uint32_t* dq = reinterpret_cast<uint32_t*>(p.dq);
  constexpr int PAIRS = D / 2;
  const size_t total = (size_t)p.batch * p.seq_local * p.heads * PAIRS;  // dq's element pairs, in order
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
    const int f = (int)(e % PAIRS);
    const size_t row = e / PAIRS;  // (b · seqLocal + q) · heads + h
    const int h = (int)(row % p.heads);
    const size_t bq = row / p.heads;
    const int q = (int)(bq % p.seq_local), b = (int)(bq / p.seq_local);
    const int r = q % BY;
    const float* tile = sums + (((size_t)b * p.heads + h) * p.q_tiles + q / BY) * (BY * D);
    const float2 v = __ldcg(reinterpret_cast<const float2*>(tile + r * D) + dq_pair(r, f));
    dq[e] = Mma<T>::pack(v.x * p.scale, v.y * p.scale);
  }
  return true;
}

template <typename T, int D, bool ONE_PASS>
__device__ __forceinline__ void ring_attention_backward(const RingAttnBwdParams& p, const BwdMaps& maps) {
  extern __shared__ __align__(1024) char smem[];
  uint32_t dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < uint32_t(smem_bytes<D, ONE_PASS>()) || blockDim.x != THREADS) __trap();
  const uint64_t epoch = mk_op_epoch_begin(p.ws, RING_BWD_EPOCH);
  bool ok = true;
  if (p.nranks > 1)
    ok = publish_kv(p.ws, reinterpret_cast<const void*>(p.k), reinterpret_cast<const void*>(p.v), p.kv_elems,
                    p.kv_offset, epoch, RING_BWD_DONE, RING_BWD_COPIED, RING_BWD_KV, MK_OP_RING_ATTENTION_BACKWARD);
  // A failed wait has recorded the error and raised the abort word: skip to the end.
  if (ok) ok = write_rows<T, D, ONE_PASS>(p, epoch);
  if (ok) ok = Engine<T, D, ONE_PASS>::run(p, maps, epoch, smem);
  if constexpr (ONE_PASS) finish_dq<T, D>(p, epoch, ok);
  // The last CTA to have taken its last ticket resets the counter for the next launch (as
  // the forward's dynamic schedule).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (mk_arrive_last(mk_signal_word(p.ws, p.ws.rank, RING_BWD_SCHED_DONE), gridDim.x))
      atomicExch(reinterpret_cast<unsigned long long*>(mk_signal_word(p.ws, p.ws.rank, RING_BWD_SCHED_NEXT)), 0ull);
  }
  mk_op_epoch_end(p.ws, RING_BWD_EPOCH, RING_BWD_ARRIVE, RING_BWD_DONE, epoch);
}

}  // namespace ring_attn_bwd
}  // namespace mk

#define MK_RING_ATTN_BWD_ENTRY(NAME, T, D)                                                               \
  extern "C" __global__ void __launch_bounds__(mk::ring_attn_bwd::THREADS, 1) NAME(                      \
      const __grid_constant__ RingAttnBwdParams p, const __grid_constant__ mk::ring_attn_bwd::BwdMaps maps) { \
    mk::ring_attn_bwd::ring_attention_backward<T, D, false>(p, maps);                                    \
  }
// The one-pass engine (MK_INTERNAL_RING_BWD_ENGINE, docs/decisions/0071-one-pass-attention-backward.md).
#define MK_RING_ATTN_BWD_ONE_PASS_ENTRY(NAME, T, D)                                                      \
  extern "C" __global__ void __launch_bounds__(mk::ring_attn_bwd::THREADS, 1) NAME(                      \
      const __grid_constant__ RingAttnBwdParams p, const __grid_constant__ mk::ring_attn_bwd::BwdMaps maps) { \
    mk::ring_attn_bwd::ring_attention_backward<T, D, true>(p, maps);                                     \
  }

#include "kernel_instances/ring_attention_backward.inc"  // the entry points: kernels/instances.txt
