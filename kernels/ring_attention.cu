// Ring attention forward (mkRingAttention): context-parallel flash attention with the
// K/V ring inside one persistent kernel. The plan (layouts, ring steps, causal block
// visibility) is ops::ring_attention in Rust; this kernel follows it.
//
// Roles and phases of one launch (every CTA, 8 warps):
//   1. publish: after every peer has said it finished reading this rank's workspace in
//      the previous call (RING_DONE), every CTA copies its slice of this rank's K and V
//      into the rank's own fused-op region; the last CTA to finish raises RING_KV + me in
//      every peer's signal region (one epoch-valued flag per rank and call).
//   2. compute: persistent over work items (batch, head, 128-query block). For ring step
//      s = 0..n-1 the item attends to the K/V that started on rank (me - s) mod n: step 0
//      from the caller's k/v, later steps straight from the source rank's workspace over
//      the peer mapping, after a bounded wait for its RING_KV flag (once per CTA and
//      source). One online softmax (fp32, exp2) runs across all steps, so no per-step
//      merge is needed. Fully masked 64-key blocks (causal) are skipped; partial ones and
//      the tail beyond seqLocal are masked elementwise by global token position.
//   3. the last CTA advances the epoch and raises RING_DONE + me in every peer's region.
// Each rank pulls every peer's K/V once, which is the traffic of a ring (every rank
// receives n-1 blocks) without relaying through intermediate ranks: within one node the
// peer is one NVLink hop away, so relaying would only add latency (DESIGN-NOTES.md).
//
// Math engine (FA3-style without warp specialisation): two warpgroups, 64 query rows
// each; S = Q·Kᵀ by wgmma from shared memory (Q and K K-major, 128-byte swizzle), the
// online softmax on the fp32 accumulators, then O += P·V by wgmma with P straight from
// the score registers (A from registers) and V as an MN-major B operand. Q and 128-key
// K/V tiles are loaded by cp.async (all 256 threads) into the swizzled layout, K/V
// double-buffered so the next tile loads while this one is multiplied.
//
// Gathered mode (p.kv_gathered != 0, used by the unfused baseline and at one rank): the
// K/V of every source rank lie in one local buffer, shard after shard; no signals.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "common/cp_async.cuh"
#include "common/fused_op.cuh"
#include "common/gemm/wgmma_rs_ops.cuh"

#define MK_OP_RING_ATTN 21
// Signal words of this op: [MK_SIG_RING_BASE, +65536).
#define RING_EPOCH (MK_SIG_RING_BASE + 0)   // last completed epoch of this rank
#define RING_ARRIVE (MK_SIG_RING_BASE + 1)  // CTAs of the running launch that have finished
#define RING_COPIED (MK_SIG_RING_BASE + 2)  // CTAs of the running launch that copied their K/V slice
#define RING_DONE (MK_SIG_RING_BASE + 8)    // + q: rank q finished reading this rank's K/V of epoch e
#define RING_KV (MK_SIG_RING_BASE + 16)     // + src: src's K/V of epoch e is in its workspace (written by src)

namespace mk { namespace ring_attn {

constexpr int BM = 128;  // queries per work item (2 warpgroups x 64 rows)
constexpr int BN = 128;  // keys per tile
constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

template <typename T>
struct Mma;  // the packing of two fp32 into a b32 register of T
template <>
struct Mma<__nv_bfloat16> {
  __device__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <>
struct Mma<__half> {
  __device__ static uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

// Element offset of (row, 16-byte chunk) in a tile of R rows stored as wgmma's K-major
// 128-byte-swizzle layout: 64-element column blocks of R rows x 128 bytes, chunk c of row
// r at c ^ (r & 7) inside its block (the tile must start 1024-byte aligned).
template <int R>
__device__ __forceinline__ int swz(int row, int chunk) {
  return (chunk >> 3) * (R * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

// Global token position of local token i on `rank` (ops::ring_attention::rank_spans):
// contiguous shards, or zigzag chunks rank and 2n-1-rank of seq/2 tokens. Monotonic in i.
__device__ __forceinline__ int token_pos(int rank, int i, int seq, int n, bool causal) {
  if (!causal) return rank * seq + i;
  const int half = seq >> 1;
  return i < half ? rank * half + i : (2 * n - 1 - rank) * half + (i - half);
}

// Loads `rows` valid rows (of BR) starting at token row0 of a [.., seq, heads, D] tensor
// (row stride `stride` elements) into a swizzled tile; rows past `rows` are zero-filled.
template <typename T, int D, int BR>
__device__ __forceinline__ void load_tile(T* tile, const T* base, int rows, int stride) {
  constexpr int CHUNKS = D / 8;
  for (int idx = threadIdx.x; idx < BR * CHUNKS; idx += THREADS) {
    const int r = idx / CHUNKS, c = idx % CHUNKS;
    const bool valid = r < rows;
    const T* src = valid ? base + (size_t)r * stride + c * 8 : base;
    cp_async16(tile + swz<BR>(r, c), src, valid ? 16 : 0);
  }
}

// All threads of the CTA copy `bytes` (a multiple of 16) from src to dst.
__device__ __forceinline__ void cta_copy(char* dst, const char* src, size_t bytes) {
  constexpr int kInFlight = 8;
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* d = reinterpret_cast<int4*>(dst);
  const size_t n = bytes / 16, stride = blockDim.x;
  size_t i = threadIdx.x;
  for (; i + (kInFlight - 1) * stride < n; i += kInFlight * stride) {
    int4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) v[u] = s[i + u * stride];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) d[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) d[i] = s[i];
}

// Phase 1: this CTA's slice of K and V into the own workspace; the last CTA raises the
// K/V flag in every peer. False when a wait gave up (the CTA then skips to the end).
__device__ __forceinline__ bool publish_kv(const RingAttnParams& p, uint64_t epoch) {
  const WorkspaceView& ws = p.ws;
  // Peers read our workspace during their previous call: wait until all have finished.
  if (!mk_cta_wait_peers(ws, RING_DONE, epoch - 1, ws.rank, MK_WAIT_OP_FLAG, MK_OP_RING_ATTN)) return false;
  const size_t bytes = (size_t)p.kv_elems * 2;  // one of K, V
  const size_t slice = ((bytes / 16 + gridDim.x - 1) / gridDim.x) * 16;
  const size_t begin = min(bytes, (size_t)blockIdx.x * slice), end = min(bytes, begin + slice);
  char* own = reinterpret_cast<char*>(ws.data[ws.rank]) + p.kv_offset;
  cta_copy(own + begin, reinterpret_cast<const char*>(p.k) + begin, end - begin);
  cta_copy(own + bytes + begin, reinterpret_cast<const char*>(p.v) + begin, end - begin);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    unsigned long long* copied = reinterpret_cast<unsigned long long*>(mk_signal_word(ws, ws.rank, RING_COPIED));
    if (atomicAdd(copied, 1ull) == gridDim.x - 1) {
      *copied = 0;  // every CTA has arrived; the next launch starts after this one ends
      for (int q = 0; q < ws.nranks; ++q)
        if (q != ws.rank) mk_signal_store(mk_signal_word(ws, q, RING_KV + ws.rank), epoch);
    }
  }
  return true;
}

template <typename T, int D>
struct Attn {
  static constexpr int KSTEPS = D / 16;  // k-steps of Q·Kᵀ (over d)
  static constexpr int PSTEPS = BN / 16; // k-steps of P·V (over keys)
  static constexpr int SREG = BN / 2;    // score accumulators per thread (m64nBN)
  static constexpr int OREG = D / 2;     // output accumulators per thread (m64nD)
  static constexpr int TILE = BN * D;    // elements of one K or V tile

  // Descriptor of an MN-major 128-byte-swizzled B operand (V: [key][d], d contiguous):
  // 8-key groups 1024 bytes apart (stride byte offset), 64-wide d blocks `block_bytes`
  // apart (leading byte offset), as CUTLASS's canonical MN-major SW128 layout.
  __device__ static uint64_t desc_mn_sw128(const void* p, uint32_t block_bytes) {
    uint64_t desc = (uint64_t(smem_u32(p)) & 0x3FFFF) >> 4;
    desc |= uint64_t(block_bytes >> 4) << 16;
    desc |= uint64_t(1024 >> 4) << 32;
    desc |= uint64_t(1) << 62;
    return desc;
  }

  // Phase 2. Returns false when a wait gave up.
  __device__ static bool run(const RingAttnParams& p, uint64_t epoch, char* smem_raw) {
    using mk::gemm::make_smem_desc_sw128;
    // 128-byte swizzle repeats every 1024 bytes: tiles start 1024-aligned.
    char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    T* sQ = reinterpret_cast<T*>(smem);
    T* sK = sQ + BM * D;    // [2][BN x D]
    T* sV = sK + 2 * TILE;  // [2][BN x D]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wg = warp / 4;  // warpgroup: query rows 64·wg ..
    const int g = lane / 4, t = lane % 4;
    const int row_base = 64 * wg + 16 * (warp % 4) + g;  // this thread's rows: row_base, row_base + 8
    const int S = p.seq_local, n = p.nranks, me = p.rank;
    const bool causal = p.causal != 0;
    const int q_stride = p.heads * D, kv_stride = p.kv_heads * D;
    const int nkb = (S + BN - 1) / BN;
    const float sl = p.scale_log2;
    uint32_t acquired = 1u << me;  // sources whose K/V this CTA may read

    for (int item = blockIdx.x; item < p.num_items; item += gridDim.x) {
      // Heaviest query blocks first (causal: later local tokens see more keys).
      const int qb = p.q_blocks - 1 - item % p.q_blocks;
      const int bh = item / p.q_blocks;
      const int h = bh % p.heads, b = bh / p.heads;
      const int hk = h / (p.heads / p.kv_heads);
      const int q0 = qb * BM, q_rows = min(BM, S - q0);
      const int qmin = token_pos(me, q0, S, n, causal), qmax = token_pos(me, q0 + q_rows - 1, S, n, causal);

      // Next visible key block at or after (s, kb); false past the last step.
      auto next_visible = [&](int& s, int& kb) -> bool {
        for (; s < n; ++s, kb = 0) {
          const int src = (me - s + n) % n;
          if (kb < nkb && (!causal || token_pos(src, kb * BN, S, n, causal) <= qmax)) return true;
        }
        return false;
      };
      // Bounded wait (whole CTA, uniform) before reading source `src`'s workspace.
      auto ensure = [&](int src) -> bool {
        if (acquired & (1u << src)) return true;
        if (!mk_cta_wait(p.ws, mk_signal_word(p.ws, me, RING_KV + src), epoch, src, MK_WAIT_OP_FLAG, MK_OP_RING_ATTN))
          return false;
        acquired |= 1u << src;
        return true;
      };
      auto kv_base = [&](int src, bool value) -> const T* {
        const size_t off = ((size_t)b * S * p.kv_heads + hk) * D;
        if (p.kv_gathered != 0)
          return reinterpret_cast<const T*>(value ? p.v_gathered : p.kv_gathered) + (size_t)src * p.kv_elems + off;
        if (src == me) return reinterpret_cast<const T*>(value ? p.v : p.k) + off;
        const T* ws_k = reinterpret_cast<const T*>(p.ws.data[src] + p.kv_offset);
        return ws_k + (value ? p.kv_elems : 0) + off;
      };
      auto issue = [&](int s, int kb, int buf) {
        const int src = (me - s + n) % n;
        const int k0 = kb * BN, rows = min(BN, S - k0);
        load_tile<T, D, BN>(sK + buf * TILE, kv_base(src, false) + (size_t)k0 * kv_stride, rows, kv_stride);
        load_tile<T, D, BN>(sV + buf * TILE, kv_base(src, true) + (size_t)k0 * kv_stride, rows, kv_stride);
        cp_async_commit();
      };

      // Q tile, then the first K/V tile.
      load_tile<T, D, BM>(sQ, reinterpret_cast<const T*>(p.q) + ((size_t)b * S * p.heads + h) * D + (size_t)q0 * q_stride,
                          q_rows, q_stride);
      cp_async_commit();
      int s = 0, kb = 0;
      bool more = next_visible(s, kb);  // step 0 always has the query's own token
      if (more && p.kv_gathered == 0 && !ensure((me - s + n) % n)) { cp_async_wait<0>(); return false; }
      if (more) issue(s, kb, 0);

      float acc[OREG];
#pragma unroll
      for (int i = 0; i < OREG; ++i) acc[i] = 0.f;
      float m_row[2] = {-INFINITY, -INFINITY}, l_row[2] = {0.f, 0.f};
      int buf = 0;
      // This warpgroup's 64 query rows of the Q tile (A operand, K-major SW128).
      const char* q_wg = reinterpret_cast<const char*>(sQ) + 64 * wg * 128;

      while (more) {
        const int cs = s, ckb = kb;
        int ns = s, nkb_ = kb + 1;
        more = next_visible(ns, nkb_);
        if (more) {
          if (p.kv_gathered == 0 && !ensure((me - ns + n) % n)) { cp_async_wait<0>(); return false; }
          issue(ns, nkb_, buf ^ 1);
          cp_async_wait<1>();
        } else {
          cp_async_wait<0>();
        }
        mk::gemm::fence_proxy_async_smem();  // cp.async (generic proxy) writes, then wgmma reads
        __syncthreads();
        const char* tK = reinterpret_cast<const char*>(sK + buf * TILE);
        const char* tV = reinterpret_cast<const char*>(sV + buf * TILE);

        // S = Q·Kᵀ: this warpgroup's 64 rows x BN keys.
        float sc[SREG];
#pragma unroll
        for (int i = 0; i < SREG; ++i) sc[i] = 0.f;
        mk::gemm::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
          const int cb = kk / 4, ko = (kk % 4) * 32;  // 64-wide d block, 16-element step inside it
          mk::gemm::Wgmma<BN, T>::mma(sc, make_smem_desc_sw128(q_wg + cb * (BM * 128) + ko),
                                      make_smem_desc_sw128(tK + cb * (BN * 128) + ko), kk > 0);
        }
        mk::gemm::wgmma_commit();
        mk::gemm::wgmma_wait<0>();
        mk::gemm::fence_operands(sc);

        // Mask: keys past seqLocal, and (causal) keys after the query.
        const int src = (me - cs + n) % n;
        const int k0 = ckb * BN, k_rows = min(BN, S - k0);
        const bool need_mask = k_rows < BN || (causal && token_pos(src, k0 + k_rows - 1, S, n, causal) > qmin);
        if (need_mask) {
          const int qp0 = token_pos(me, q0 + row_base, S, n, causal);
          const int qp1 = token_pos(me, q0 + row_base + 8, S, n, causal);
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int kl = j * 8 + 2 * t + e;
              const int kp = token_pos(src, k0 + kl, S, n, causal);
              const bool out = kl >= k_rows;
              if (out || (causal && kp > qp0)) sc[4 * j + e] = -INFINITY;
              if (out || (causal && kp > qp1)) sc[4 * j + 2 + e] = -INFINITY;
            }
          }
        }

        // Online softmax (exp2 with the scale folded in), rows row_base and row_base + 8.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = m_row[r];
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * r], sc[4 * j + 2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
          // A row with no visible key yet keeps max -inf: subtract 0 so exp2(-inf) = 0.
          const float msc = mx == -INFINITY ? 0.f : mx * sl;
          const float alpha = exp2f(m_row[r] * sl - msc);
          m_row[r] = mx;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
            sc[4 * j + 2 * r] = exp2f(sc[4 * j + 2 * r] * sl - msc);
            sc[4 * j + 2 * r + 1] = exp2f(sc[4 * j + 2 * r + 1] * sl - msc);
            sum += sc[4 * j + 2 * r] + sc[4 * j + 2 * r + 1];
          }
          l_row[r] = l_row[r] * alpha + sum;  // this thread's share; the quad sums at the end
#pragma unroll
          for (int j = 0; j < D / 8; ++j) {
            acc[4 * j + 2 * r] *= alpha;
            acc[4 * j + 2 * r + 1] *= alpha;
          }
        }

        // O += P·V: P from the score registers (accumulator layout = A-fragment layout by
        // pairs of 8-key blocks), V as the MN-major B operand.
        uint32_t pa[PSTEPS][4];
#pragma unroll
        for (int kk = 0; kk < PSTEPS; ++kk) {
          pa[kk][0] = Mma<T>::pack(sc[8 * kk + 0], sc[8 * kk + 1]);
          pa[kk][1] = Mma<T>::pack(sc[8 * kk + 2], sc[8 * kk + 3]);
          pa[kk][2] = Mma<T>::pack(sc[8 * kk + 4], sc[8 * kk + 5]);
          pa[kk][3] = Mma<T>::pack(sc[8 * kk + 6], sc[8 * kk + 7]);
        }
        mk::gemm::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < PSTEPS; ++kk)
          mk::gemm::WgmmaRsT<D, T>::mma(acc, pa[kk], desc_mn_sw128(tV + kk * 16 * 128, BN * 128));
        mk::gemm::wgmma_commit();
        mk::gemm::wgmma_wait<0>();
        mk::gemm::fence_operands(acc);
        __syncthreads();  // this buffer is refilled two tiles from now
        s = ns;
        kb = nkb_;
        buf ^= 1;
      }

      // Epilogue: normalise, store O rows and the log-sum-exp.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float l = l_row[r];
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
        const int row = q0 + row_base + 8 * r;
        if (row < S) {
          const float inv = l > 0.f ? 1.f / l : 0.f;
          T* o = reinterpret_cast<T*>(p.out) + ((size_t)b * S * p.heads + h) * D + (size_t)row * q_stride;
#pragma unroll
          for (int j = 0; j < D / 8; ++j)
            *reinterpret_cast<uint32_t*>(o + j * 8 + 2 * t) = Mma<T>::pack(acc[4 * j + 2 * r] * inv, acc[4 * j + 2 * r + 1] * inv);
          if (t == 0) {
            float* lse = reinterpret_cast<float*>(p.lse) + ((size_t)b * p.heads + h) * S + row;
            *lse = l > 0.f ? (m_row[r] * sl + log2f(l)) * 0.69314718055994531f : -INFINITY;
          }
        }
      }
      __syncthreads();  // sQ is refilled by the next item
    }
    return true;
  }
};
template <typename T, int D>
__device__ __forceinline__ void ring_attention(const RingAttnParams& p) {
  extern __shared__ __align__(1024) char smem[];
  uint32_t dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < uint32_t((BM + 4 * BN) * D * 2 + 1024)) __trap();  // host plan and kernel disagree
  const bool ring = p.kv_gathered == 0 && p.nranks > 1;
  uint64_t epoch = 0;
  bool ok = true;
  if (ring) {
    epoch = mk_op_epoch_begin(p.ws, RING_EPOCH);
    ok = publish_kv(p, epoch);
  }
  // A failed wait has recorded the error and raised the abort word: skip to the end, so
  // the kernel still ends in bounded time.
  if (ok) Attn<T, D>::run(p, epoch, smem);
  if (ring) mk_op_epoch_end(p.ws, RING_EPOCH, RING_ARRIVE, RING_DONE, epoch);
}

}  // namespace ring_attn
}  // namespace mk

#define MK_RING_ATTN_ENTRY(NAME, T, D)                                                                   \
  extern "C" __global__ void __launch_bounds__(mk::ring_attn::THREADS, 1) NAME(const __grid_constant__ RingAttnParams p) { \
    mk::ring_attn::ring_attention<T, D>(p);                                                              \
  }

MK_RING_ATTN_ENTRY(mk_ring_attn_bf16_d128, __nv_bfloat16, 128)
MK_RING_ATTN_ENTRY(mk_ring_attn_bf16_d64, __nv_bfloat16, 64)
MK_RING_ATTN_ENTRY(mk_ring_attn_f16_d128, __half, 128)
MK_RING_ATTN_ENTRY(mk_ring_attn_f16_d64, __half, 64)
