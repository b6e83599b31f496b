// Epilogue policies: what a consumer warpgroup does with its 64 x BN fp32 accumulator
// slab of a C tile. Called once per tile by each of the two consumer warpgroups (128
// threads each, in parallel), while the producer is already loading the next tile.
//
// Policy interface (duck-typed):
//   struct Epilogue {
//     struct Params { ... };
//     template <int BN> static constexpr int smem_bytes_per_wg();   // staging, 1024-aligned
//     template <typename T, int BN>
//     __device__ static void store(const Params&, float (&acc)[BN / 2], const SlabInfo&);
//     __device__ static void finish(const Params&, const SlabInfo&);  // after the last tile
//     static constexpr bool kCourier;  // true: the engine runs courier() in warp 1 of the
//     __device__ static void courier(const Params&, uint64_t* mailboxes, int tiles);  // producer warpgroup
//     // With a dynamic schedule (HasTickets, engine.cuh), one tile of the courier's work:
//     __device__ static void courier_tile(const Params&, uint64_t* mailboxes, uint32_t& phase);
//   };
// Accumulator layout (wgmma m64nBNk16, fp32): see acc_row / acc_col below.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>
#include "ptx.cuh"
#include "scheduler.cuh"

namespace mk { namespace gemm {

struct SlabInfo {
  TileCoord tile;
  int row0;      // first C row of this warpgroup's 64-row slab
  int col0;      // first C column of the tile
  int M, N;      // C extent (the slab may overhang it)
  int consumer;  // 0 or 1: which consumer warpgroup (named barrier 1 + consumer is free to use)
  int thread;    // 0..127 inside the warpgroup
  char* smem;    // this warpgroup's staging area (smem_bytes_per_wg bytes, 1024-aligned)
  // A signalling epilogue's slab whose stores are issued but not yet signalled (thread 0
  // of the warpgroup keeps it across calls; see TmaEpilogue).
  mutable TileCoord signal_tile;
  mutable int signal_row0;
  mutable bool signal_pending = false;
  // This warpgroup's slot of the courier mailbox (kMailboxWords words: full and empty
  // mbarriers, then the slab's m-block, n-block and first row) and its phase.
  uint64_t* mailbox;
  mutable uint32_t mailbox_phase = 0;
};

// The courier mailbox: one slot per consumer warpgroup, after the engine's stage barriers.
constexpr int kMailboxWords = 4;
constexpr int kMailboxBytes = 2 * kMailboxWords * 8;

// Element i of the accumulator array of `thread` (0..127) holds C[row0 + acc_row][col0 + acc_col].
__device__ __forceinline__ int acc_row(int i, int thread) {
  return (thread >> 5) * 16 + ((thread & 31) >> 2) + ((i >> 1) & 1) * 8;
}
__device__ __forceinline__ int acc_col(int i, int thread) { return (i >> 2) * 8 + (thread & 3) * 2 + (i & 1); }

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// ---- TMA epilogue and its policies ---------------------------------------------------

// Where a slab's TMA stores go: a tensor map and the (row, column) of the slab in it.
// Policy interface: struct { struct Params; __device__ static const CUtensorMap*
//   map(const Params&, const SlabInfo&, int& row, int& col); }  (called by one thread,
// the store thread, right before it issues the slab's stores: a Dest may wait there; one
// that declares `static constexpr bool kMayRefuse = true` may return nullptr to store
// nothing).
template <class Dest, class = void>
struct DestMayRefuse : std::false_type {};
template <class Dest>
struct DestMayRefuse<Dest, std::void_t<decltype(Dest::kMayRefuse)>> : std::bool_constant<Dest::kMayRefuse> {};
// A Dest may also combine the staged slab before it is stored: one that declares
// `static constexpr bool kCombines = true` has
//   template <typename T, int BN> __device__ static bool combine(const Params&, const SlabInfo&);
// called by all 128 threads of the warpgroup once the slab (rounded to T) sits in the
// staging buffer, with no barrier since the staging stores: it must synchronise the
// warpgroup (named barrier 1 + consumer, 128 threads) before reading another thread's part,
// may rewrite the staging buffer (each thread then fences its own writes for the TMA store,
// as the staging itself), and returns false to store nothing (every thread the same value).
// A slab not stored is still handed to the courier (which counts every slab of every
// tile): a Dest that refuses must also keep its Signal from raising the flag.
// GEMM + AllReduce's tile owners add their peers' partials there (gemm_reduce.cu).
template <class Dest, class = void>
struct DestCombines : std::false_type {};
template <class Dest>
struct DestCombines<Dest, std::void_t<decltype(Dest::kCombines)>> : std::bool_constant<Dest::kCombines> {};

struct LocalDest {
  struct Params {
    const CUtensorMap* tma_c;  // C: dims {N, M}, box {64, 64}, CU_TENSOR_MAP_SWIZZLE_128B
    // C itself, for the columns of a tile past its last whole 64-column box (widths that
    // are not a multiple of 64; see TmaEpilogue::store_tail): row-major, `ldc` elements
    // per row. Unread at the other widths.
    void* c;
    long long ldc;
  };
  __device__ static const CUtensorMap* map(const Params& p, const SlabInfo& s, int& row, int& col) {
    row = s.row0;
    col = s.col0;
    return p.tma_c;
  }
};

// How the boxes are written (the Op policy): TMA bulk tensor stores.
struct TmaStoreOp {
  __device__ static void box(const CUtensorMap* m, const void* src, int col, int row) { tma_store_2d(m, src, col, row); }
};

// What happens once a slab's stores are complete and visible (e.g. raise a peer's flag).
// Policy interface: struct { struct Params; static constexpr bool enabled;
//   __device__ static void after_store(const Params&, const SlabInfo&); }  (one thread;
// the engine waits for the slab's bulk stores first, only when enabled). The signal of a
// slab is given when the warpgroup reaches its next epilogue (or finish), not right
// after the store is issued: waiting there for the stores to complete would stall the
// whole warpgroup's next mainloop (wgmma is warpgroup-collective) once per tile, which
// measured 2–6x slower GEMMs with short K.
struct NoTileSignal {
  struct Params {
    int unused;
  };
  static constexpr bool enabled = false;
  __device__ static void after_store(const Params&, const SlabInfo&) {}
};

// Default: registers -> 128B-swizzled shared memory (conflict-free 4-byte stores) ->
// TMA bulk tensor stores of 64x64 boxes; TMA clips rows >= M and columns >= N.
// The store of tile i overlaps the mainloop of tile i+1; the staging buffer is reused
// only after the previous stores have read it. Needs N % 8 == 0 and a 16-byte aligned C
// (the tensor map's row stride); the host plans DirectStoreEpilogue otherwise.
//
// With a Signal, the slab's flag is not raised by the consumer warpgroup: its thread 0
// waits for the stores to complete (only the issuing thread can) and hands the slab to a
// courier thread (warp 1 of the producer warpgroup, idle otherwise) through a one-slot
// mailbox per warpgroup (mbarriers: release / acquire at CTA scope, so the courier's
// system-scope release covers the stores too). A system-scope release stalls the issuing
// warp until its memory operations drain -- on the consumer's thread 0 it would hold the
// whole warpgroup's next wgmma, once per tile (the fused GEMM phase then runs ~10 % slower
// than the plain GEMM).
template <class Dest = LocalDest, class Op = TmaStoreOp, class Signal = NoTileSignal>
struct TmaEpilogue {
  struct Params {
    typename Dest::Params dest;
    typename Signal::Params signal;
  };
  static constexpr bool kCourier = Signal::enabled;
  // Columns of a BN-wide tile that leave through 64 x 64 TMA boxes: all of them, or, for a
  // width that is not a multiple of 64 (224: three boxes and 32 columns), the whole boxes;
  // the rest leave from registers (store_tail). Staging holds the boxed columns only.
  template <int BN>
  static constexpr int kBoxedCols = BN / 64 * 64;
  template <int BN>
  __host__ __device__ static constexpr int smem_bytes_per_wg() {
    return 64 * kBoxedCols<BN> * 2;
  }

  template <typename T, int BN>
  __device__ static void store(const Params& p, float (&acc)[BN / 2], const SlabInfo& s) {
    constexpr int kBoxed = kBoxedCols<BN>;
    // A tail goes straight to C: only the plain GEMM's destination, stored whole and not
    // signalled (a peer's buffer, a combining Dest or a flag would need the tail too).
    static_assert(kBoxed == BN || (std::is_same<Dest, LocalDest>::value && std::is_same<Op, TmaStoreOp>::value &&
                                   !Signal::enabled),
                  "a tile width that is not a multiple of 64 only with the plain TMA store epilogue");
    const int warp = s.thread >> 5, lane = s.thread & 31;
    // The previous tile's stores must have finished reading the staging buffer; a
    // signalling epilogue waits for them to complete and signals that slab now (they were
    // issued a whole mainloop ago, so this rarely waits).
    if (s.thread == 0) {
      if constexpr (Signal::enabled) {
        signal_pending(p, s);
      } else {
        tma_store_wait_read();
      }
    }
    named_barrier_sync(1 + s.consumer, 128);
    const uint32_t base = smem_addr(s.smem);
#pragma unroll
    for (int j = 0; j < kBoxed / 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp * 16 + (lane >> 2) + h * 8;
        const uint32_t off = (j >> 3) * 8192 + row * 128 + (((j & 7) ^ (row & 7)) << 4) + (lane & 3) * 4;
        const uint32_t v = pack2<T>(acc[j * 4 + h * 2], acc[j * 4 + h * 2 + 1]);
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + off), "r"(v) : "memory");
      }
    }
    bool store_slab = true;
    if constexpr (DestCombines<Dest>::value) store_slab = Dest::template combine<T, BN>(p.dest, s);
    fence_proxy_async_smem();
    named_barrier_sync(1 + s.consumer, 128);
    if (s.thread == 0) {
      if (store_slab) {
        int row, col;
        const CUtensorMap* m = Dest::map(p.dest, s, row, col);
        // A Dest with kMayRefuse returns nullptr to store nothing (a fused op whose start
        // wait failed); checked only for such Dests, so the others' code has no check.
        if (!DestMayRefuse<Dest>::value || m != nullptr) {
#pragma unroll
          for (int b = 0; b < BN / 64; ++b) Op::box(m, s.smem + b * 8192, col + b * 64, row);
        }
      }
      tma_store_commit();
      if constexpr (Signal::enabled) {
        s.signal_tile = s.tile;
        s.signal_row0 = s.row0;
        s.signal_pending = true;
      }
    }
    if constexpr (kBoxed < BN) store_tail<T, BN>(p, acc, s);
  }

  // The columns past the whole boxes (kBoxedCols..BN-1 of the tile), from registers: each
  // thread writes its pairs of adjacent columns as one 4-byte store, rows >= M and columns
  // >= N skipped. A pair never straddles N: the TMA epilogue needs N % 8 == 0 and pairs
  // start at even columns. 4-byte aligned: C is 16-byte aligned (the same condition).
  template <typename T, int BN>
  __device__ static void store_tail(const Params& p, const float (&acc)[BN / 2], const SlabInfo& s) {
    T* c = static_cast<T*>(p.dest.c);
#pragma unroll
    for (int i = kBoxedCols<BN> / 2; i < BN / 2; i += 2) {
      const int r = s.row0 + acc_row(i, s.thread);
      const int col = s.col0 + acc_col(i, s.thread);
      if (r < s.M && col < s.N)
        *reinterpret_cast<uint32_t*>(c + (long long)r * p.dest.ldc + col) = pack2<T>(acc[i], acc[i + 1]);
    }
  }

  __device__ static void finish(const Params& p, const SlabInfo& s) {
    if (s.thread == 0) {
      if constexpr (Signal::enabled) {
        signal_pending(p, s);
      } else {
        tma_store_wait_all();
      }
    }
  }

  // The courier (one thread): raises the flag of every slab the two consumer warpgroups
  // hand over, `tiles` tiles' worth (this CTA's share of the schedule), in the order of
  // the tiles; returns after the last.
  __device__ static void courier(const Params& p, uint64_t* mailboxes, int tiles) {
    uint32_t phase = 0;
    for (int i = 0; i < tiles; ++i) courier_tile(p, mailboxes, phase);
  }

  // One tile of the courier's work: the two slabs of the CTA's next tile (a dynamic
  // schedule's courier calls it once per ticket, not knowing its tile count ahead).
  __device__ static void courier_tile(const Params& p, uint64_t* mailboxes, uint32_t& phase) {
    for (int c = 0; c < 2; ++c) {
      uint64_t* box = mailboxes + c * kMailboxWords;
      mbar_wait(&box[0], phase);
      const int* info = reinterpret_cast<const int*>(box + 2);
      SlabInfo done;
      done.tile = TileCoord{info[0], info[1]};
      done.row0 = info[2];
      done.consumer = c;
      Signal::after_store(p.signal, done);
      mbar_arrive(&box[1]);  // the slot is free again
    }
    phase ^= 1;
  }

 private:
  // Thread 0 of a consumer warpgroup: waits for the issued stores to complete, then hands
  // the pending slab to the courier (waiting, rarely, until it took the previous one).
  __device__ static void signal_pending(const Params&, const SlabInfo& s) {
    tma_store_wait_all();
    if (!s.signal_pending) return;
    fence_proxy_async_global();  // the completed async-proxy stores, then the hand-off
    uint64_t* box = s.mailbox;
    mbar_wait(&box[1], s.mailbox_phase ^ 1);
    int* info = reinterpret_cast<int*>(box + 2);
    info[0] = s.signal_tile.m_block;
    info[1] = s.signal_tile.n_block;
    info[2] = s.signal_row0;
    mbar_arrive(&box[0]);
    s.mailbox_phase ^= 1;
    s.signal_pending = false;
  }
};

// The plain GEMM's epilogue: TMA stores into C.
using TmaStoreEpilogue = TmaEpilogue<>;

// Register -> global stores through a plain pointer, every element bounds-checked: any
// N and alignment, any destination (a peer's mapped buffer too). Op::apply does the
// per-element write (StoreOp: plain store; AddOp: atomic add, for reductions into a
// shared buffer). Slower than the TMA epilogue; the plain GEMM uses it only when
// N % 8 != 0 or C is not 16-byte aligned.
struct StoreOp {
  template <typename T>
  __device__ static void apply(T* p, float v) {
    *p = static_cast<T>(v);
  }
};
struct AddOp {
  template <typename T>
  __device__ static void apply(T* p, float v) {
    atomicAdd(p, static_cast<T>(v));
  }
};

template <class Op = StoreOp>
struct DirectStoreEpilogue {
  struct Params {
    void* c;
    long long ldc;  // elements between rows
  };
  template <int BN>
  __host__ __device__ static constexpr int smem_bytes_per_wg() {
    return 0;
  }
  static constexpr bool kCourier = false;
  __device__ static void courier(const Params&, uint64_t*, int) {}
  template <typename T, int BN>
  __device__ static void store(const Params& p, float (&acc)[BN / 2], const SlabInfo& s) {
    T* c = static_cast<T*>(p.c);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const int r = s.row0 + acc_row(i, s.thread);
      const int col = s.col0 + acc_col(i, s.thread);
      if (r < s.M && col < s.N) Op::apply(c + (long long)r * p.ldc + col, acc[i]);
    }
  }
  __device__ static void finish(const Params&, const SlabInfo&) {}
};

}  // namespace gemm
}  // namespace mk
