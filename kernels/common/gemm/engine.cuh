// mkernel's Hopper GEMM engine: C[M,N] = A[M,K] · B[N,K]ᵀ, bf16/fp16 in and out, fp32
// accumulate, all row-major. Persistent and warp-specialised:
//   warpgroup 0      one producer thread: TMA loads of A (BM x 64) and B (BN x 64) tiles,
//                    128-byte swizzled, into a STAGES-deep ring (full/empty mbarriers);
//                    warp 1 is the epilogue's courier when the epilogue flags its slabs
//                    (Epi::kCourier), warps 1-3 (2-3) the AWait hook's side work;
//   warpgroups 1, 2  consumers: each owns 64 rows of the BM=128 tile (a BM=64 tile has
//                    only the first), wgmma m64nBNk16 from shared memory with one batch in
//                    flight, [split-K: CTA 0 of the cluster folds the others' partials,
//                    split_k_fold], then the epilogue policy.
// Compile-time policies make it the core of every fused op:
//   Sched  tile order (scheduler.cuh: GroupedRaster, RankRotatedRaster), static (CTA
//          `cta` takes items cta, cta + num_ctas, ...) or dynamic (HasTickets: tickets);
//   AWait  hook before a tile's A rows are loaded (hooks.cuh: NoAWait; the fused ops' own waits);
//   Epi    what happens to each C tile (epilogue.cuh: TmaStoreEpilogue, DirectStoreEpilogue).
// The CTA count is a run-time argument: a fused kernel gives the engine `num_ctas` of its
// CTAs (ids 0..num_ctas-1) and uses the others for communication.
//
// A tile that overhangs M, N or K is handled by TMA: loads zero-fill, stores clip.
//
// Using it in a fused kernel (see kernels/gemm.cu for the plain case):
//   using Cfg = GemmConfig<__nv_bfloat16, 256, 3>;        // T, BN in {64,128,224,256}, stages
//   using Epi = TmaEpilogue<PeerDest, TmaStoreOp, MySignal>; // or TmaStoreEpilogue, DirectStoreEpilogue<Op>
//   extern "C" __global__ void __launch_bounds__(Cfg::THREADS, 1) my_fused(const __grid_constant__ CUtensorMap ta,
//       const __grid_constant__ CUtensorMap tb, const __grid_constant__ MyParams p) {
//     extern __shared__ __align__(1024) char smem[];
//     if (blockIdx.x >= p.gemm_ctas) { communication_role(p); return; }   // CTA-count split
//     gemm_persistent<Cfg, RankRotatedRaster, MyAWait, Epi>(&ta, &tb, GemmShape{M, N, K}, p.raster,
//         p.wait, p.epi, blockIdx.x, p.gemm_ctas, smem);
//   }
// launched with Cfg::THREADS threads and engine_smem_bytes<Cfg, Epi>() dynamic shared
// memory (Rust: ops::gemm::engine_smem_bytes). Tensor maps that the engine or an epilogue
// reads must live in kernel parameter space (__grid_constant__) or global memory.
// Named barriers 1 and 2 belong to the consumer warpgroups' epilogues, 3 to the AWait
// hook's side work (warps 1-3 of the producer warpgroup; warps 2-3 when the epilogue
// signals its slabs, whose courier is warp 1).
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>
#include <utility>
#include "epilogue.cuh"
#include "hooks.cuh"
#include "ptx.cuh"
#include "scheduler.cuh"
#include "wgmma_ops.cuh"

namespace mk { namespace gemm {

// Whether the scheduler ends a tile's live rows before shape.M, by defining
//   __device__ static int rows_end(const Params&, const TileCoord&, int M);
// (MoE: an expert's last m-block holds fewer than BM rows; rows past the expert's count
// are padding whose products nobody reads). Consumer slabs at or past it skip their wgmmas.
// Tested at compile time so that schedulers without it compile to code free of the hook:
// with the hook's default inlined instead, the AG+GEMM kernel's SASS shifts and it runs
// ~4 % slower at 4 ranks x 2048 rows.
template <class Sched, class = void>
struct HasRowsEnd : std::false_type {};
template <class Sched>
struct HasRowsEnd<Sched, std::void_t<decltype(Sched::rows_end(std::declval<const typename Sched::Params&>(),
                                                              std::declval<const TileCoord&>(), 0))>> : std::true_type {};

// Whether the AWait hook (hooks.cuh) loads each B tile as two halves of BN/2 rows from
// rows it names, by defining
//   __device__ static int b_halves(const Params&, int n_block, int half_rows, int& second_row);
// which returns the first half's first B row and sets the second's (the B tensor map's box
// is then {64, BN/2}). The MoE dispatch's gated weight loads a tile's gate rows and the
// matching up rows this way, so one wgmma accumulates both (the epilogue combines them).
// Tested at compile time: other hooks' producers keep their one B load per stage.
template <class AWait, class = void>
struct HasSplitB : std::false_type {};
template <class AWait>
struct HasSplitB<AWait, std::void_t<decltype(AWait::b_halves(std::declval<const typename AWait::Params&>(), 0, 0,
                                                             std::declval<int&>()))>> : std::true_type {};

// Whether the scheduler hands out its items dynamically, by defining
//   __device__ static unsigned long long* tickets(const Params&);
// a counter in global memory that is zero when the launch starts, shared by the launch's
// GEMM CTAs (the kernel resets it for the next launch once every CTA took its last ticket,
// mk_arrive_last). Ticket t is item t of the same order Sched::tile defines (t < items):
// a CTA takes its next item from the counter as it starts loading its current one, instead
// of cta, cta + num_ctas, ..., so the CTAs that finish early take more items and all end
// within about one item of each other. Each item is computed exactly as under the static
// walk (the same tile, k-blocks and epilogue): only which CTA computes it changes. A
// ticket >= items ends the CTA's loop. The producer thread takes the tickets and hands
// each to the item's other readers (every consumer warp, the courier) through a ring of
// kTicketSlots slots in shared memory with full/empty mbarriers, as the stages are handed
// over. Tested at compile time, so a static scheduler's walk compiles to the plain loop.
// Not built for clusters, split-K or 64-row tiles (static_assert below).
template <class Sched, class = void>
struct HasTickets : std::false_type {};
template <class Sched>
struct HasTickets<Sched, std::void_t<decltype(Sched::tickets(std::declval<const typename Sched::Params&>()))>>
    : std::true_type {};

// The dynamic schedule's hand-off ring (static shared memory of the kernels that use it,
// beside engine_smem_bytes). Slots let the producer run as many items ahead of the slowest
// reader as its stage ring lets it (the courier trails the consumers by up to two items).
constexpr int kTicketSlots = 8;
struct TicketRing {
  uint64_t full[kTicketSlots];   // the producer wrote the slot's ticket (one arrival)
  uint64_t empty[kTicketSlots];  // every reader has read it (one arrival per reader)
  int ticket[kTicketSlots];
};
template <class Sched>
__device__ __forceinline__ TicketRing* ticket_ring() {
  __shared__ TicketRing ring;
  return &ring;
}

// The next ticket: a relaxed atomic whose result is waited for only where it is used (an
// asm, so ptxas does not aggregate it over the warp and wait for the shuffle at once).
__device__ __forceinline__ int take_item_ticket(unsigned long long* counter) {
  unsigned long long v;
  asm volatile("atom.relaxed.gpu.global.add.u64 %0, [%1], 1;" : "=l"(v) : "l"(counter) : "memory");
  return (int)v;
}

// One thread: the k-th ticket of this CTA (k = 0, 1, ...), once the producer wrote it; the
// caller's arrival on empty (after it) lets the producer reuse the slot.
__device__ __forceinline__ int ticket_at(TicketRing* ring, int k) {
  const int s = k % kTicketSlots;
  mbar_wait(&ring->full[s], (k / kTicketSlots) & 1);
  const int t = ring->ticket[s];
  mbar_arrive(&ring->empty[s]);  // release: the read above, then the slot is free
  return t;
}

// Whole warp (converged): lane 0 reads the k-th ticket for the warp, every lane gets it.
__device__ __forceinline__ int warp_ticket_at(TicketRing* ring, int k) {
  int t = 0;
  if (threadIdx.x % 32 == 0) t = ticket_at(ring, k);
  return __shfl_sync(0xffffffffu, t, 0);
}

// The items a CTA's producer thread walks: static (item0, item0 + item_step, ...), or the
// tickets of a dynamic schedule, each handed to the readers before it is returned (also the
// one that ends the walk). started() runs once the item's A rows may be loaded (after
// AWait): the dynamic walk takes the next ticket there, one item ahead, so the atomic's
// round trip overlaps the item's loads (its value is waited for only at the next item),
// and a CTA still waiting for an item's rows has not yet claimed another.
template <class Sched, bool = HasTickets<Sched>::value>
struct ProducerWalk {
  int step;
  __device__ ProducerWalk(const typename Sched::Params&, int item_step) : step(item_step) {}
  __device__ int first(int item0) { return item0; }
  __device__ int next(int t) { return t + step; }
  __device__ void started(const typename Sched::Params&) {}
};
template <class Sched>
struct ProducerWalk<Sched, true> {
  int k = 0;  // tickets handed over
  int ticket;
  __device__ ProducerWalk(const typename Sched::Params& p, int) : ticket(take_item_ticket(Sched::tickets(p))) {}
  __device__ int first(int) { return publish(); }
  __device__ int next(int) { return publish(); }
  __device__ void started(const typename Sched::Params& p) { ticket = take_item_ticket(Sched::tickets(p)); }
  __device__ int publish() {
    TicketRing* ring = ticket_ring<Sched>();
    const int s = k % kTicketSlots;
    mbar_wait(&ring->empty[s], ((k / kTicketSlots) & 1) ^ 1);  // every reader read the slot's last ticket
    ring->ticket[s] = ticket;
    mbar_arrive(&ring->full[s]);  // release: the ticket, then the arrival
    ++k;
    return ticket;
  }
};

// The items a consumer warp walks: static, or the dynamic schedule's tickets as the
// producer hands them over (warp-collective: every lane of the warp calls it).
template <class Sched, bool = HasTickets<Sched>::value>
struct ConsumerWalk {
  int step;
  __device__ explicit ConsumerWalk(int item_step) : step(item_step) {}
  __device__ int first(int item0) { return item0; }
  __device__ int next(int t) { return t + step; }
};
template <class Sched>
struct ConsumerWalk<Sched, true> {
  int k = 0;
  __device__ explicit ConsumerWalk(int) {}
  __device__ int first(int) { return warp_ticket_at(ticket_ring<Sched>(), k++); }
  __device__ int next(int) { return warp_ticket_at(ticket_ring<Sched>(), k++); }
};

// Operand shared by a 2-CTA cluster (TMA multicast): each CTA loads half of it for both.
//   SHARE_NONE  no cluster;
//   SHARE_A     the two CTAs compute n-blocks 2j and 2j+1 of one m-block: A is loaded once
//               (each CTA loads 64 of the 128 rows; A map box {64, 64});
//   SHARE_B     the two CTAs compute m-blocks 2i and 2i+1 of one n-block: B is loaded once
//               (each CTA loads BN/2 rows; B map box {64, BN/2}).
// Launch with cluster dims (2,1,1) and an even grid; the schedule's Params count cluster
// tiles (tiles_n/2 columns for SHARE_A, tiles_m/2 rows for SHARE_B, rounded up).
constexpr int SHARE_NONE = 0, SHARE_A = 1, SHARE_B = 2;

// PRODUCER_REGS_: registers of the producer warpgroup after setmaxnreg (the consumers get
// what is left of the 64K, rounded down to a multiple of 8). 40 suits a lone TMA producer;
// a fused kernel whose hook runs side work in the producer's idle warps takes more.
// BM_: rows per tile, 128 (two consumer slabs of 64) or 64 for small M (no multicast):
// A stages of 64 rows (the A tensor map's box {64, 64}, or fewer rows: GemmShape), so more stages fit beside
// the same B tiles. Consumer 1 then has no rows: with an epilogue that flags its slabs
// (Epi::kCourier; used at M <= 64 only, where its slab lies past row M) it keeps the stage
// and epilogue protocol (see `live` below); otherwise it sits out (kIdleConsumer).
// SPLIT_K_: the CTAs of a cluster (its size is the launch's, 1 to 8, read at run time)
// compute the same C tile over consecutive K ranges and CTA 0 of the cluster adds the
// others' fp32 partials to its own, in cluster rank order, before its epilogue: the sum is
// formed in the same order on every run (split_k_fold). No operand is shared.
template <typename T_, int BN_, int STAGES_, int SHARE_ = SHARE_NONE, int PRODUCER_REGS_ = 40, int BM_ = 128,
          bool SPLIT_K_ = false>
struct GemmConfig {
  using T = T_;
  static constexpr int SHARE = SHARE_;
  // CTAs per cluster that share an operand by multicast (a split-K cluster's size is the launch's).
  static constexpr int CLUSTER = SHARE_ == SHARE_NONE ? 1 : 2;
  static constexpr int BM = BM_;
  static_assert(BM_ == 128 || (BM_ == 64 && SHARE_ == SHARE_NONE), "BM 64 only without a cluster");
  static constexpr bool SPLIT_K = SPLIT_K_;
  static_assert(!SPLIT_K_ || SHARE_ == SHARE_NONE, "a split-K cluster shares no operand");
  // Split-K: one fp32 slab of 64 x BN per consumer slab of the tile, where the CTA leaves
  // its partial for CTA 0 of the cluster to read.
  static constexpr int PART_SLABS = SPLIT_K_ ? BM_ / 64 : 0;
  static constexpr int PART_BYTES = 64 * BN_ * 4;
  static constexpr int BN = BN_;
  static constexpr int BK = 64;  // 64 x 2 bytes = one 128-byte swizzle row
  static constexpr int STAGES = STAGES_;
  static constexpr int CONSUMERS = 2;
  static constexpr int THREADS = 128 * (CONSUMERS + 1);
  static constexpr int PRODUCER_REGS = PRODUCER_REGS_;
  // A CTA of THREADS threads starts with 168 registers each (64K / 384, rounded down to a
  // multiple of 8); setmaxnreg only moves registers between warpgroups, so the consumers'
  // share is what the producer gives up. Asking for more blocks setmaxnreg.inc forever.
  static constexpr int CONSUMER_REGS = ((THREADS * 168 - 128 * PRODUCER_REGS) / (128 * CONSUMERS)) / 8 * 8;
  static_assert(PRODUCER_REGS % 8 == 0 && PRODUCER_REGS >= 24 && CONSUMER_REGS <= 256, "setmaxnreg counts");
  static constexpr int A_STAGE_BYTES = BM * BK * 2;
  static constexpr int B_STAGE_BYTES = BN * BK * 2;
  static constexpr int STAGE_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;
  // Rows this CTA's producer loads per stage (boxes of the tensor maps).
  static constexpr int A_LOAD_ROWS = SHARE == SHARE_A ? BM / 2 : BM;
  static constexpr int B_LOAD_ROWS = SHARE == SHARE_B ? BN / 2 : BN;
  // 224: 128 tiles across N = 28672 (one wave on 132 SMs) where 256 makes 112 and 128 makes 224.
  static_assert(BN == 64 || BN == 128 || BN == 224 || BN == 256, "wgmma N");
  static_assert(sizeof(T) == 2, "16-bit inputs");
};

// The deepest ring of (BM + BN) x 64 stages, at most 8, that fits in 227 KiB beside two
// consumer warpgroups' epilogue staging of STAGING_PER_WG bytes each (mirrors
// ops::gemm::ring_stages): the plain GEMM's PlainStages and the fused ops' FusedStages.
template <int BM, int BN, int STAGING_PER_WG>
struct RingStages {
  static constexpr int fit = (232448 - 1024 - 2 * STAGING_PER_WG - 256) / ((BM + BN) * 64 * 2);
  static constexpr int value = fit > 8 ? 8 : fit;
};

// Split-K's barriers after the mailboxes: per consumer slab, "partials stored" (in CTA 0 of
// the cluster) and "partial read" (in the others).
constexpr int kSplitKBarrierBytes = 4 * 8;

// Shared memory the engine needs for a config and epilogue (plus 1024 for alignment slack).
template <class Cfg, class Epi>
__host__ __device__ constexpr int engine_smem_bytes() {
  return 1024 + Cfg::STAGES * Cfg::STAGE_BYTES + Cfg::CONSUMERS * Epi::template smem_bytes_per_wg<Cfg::BN>() +
         Cfg::PART_SLABS * Cfg::PART_BYTES + 2 * Cfg::STAGES * 8 + kMailboxBytes +
         (Cfg::SPLIT_K ? kSplitKBarrierBytes : 0);
}

// Split-K (Cfg::SPLIT_K), one consumer warpgroup's slab of a tile once its mainloop is
// done: CTA 0 of the cluster waits until the other CTAs have stored their partials of the
// slab, adds them to its own accumulators in rank order 1..split-1 into `sum` (a separate
// array: a non-wgmma write to the accumulators would make ptxas serialise every wgmma)
// and tells each CTA it has read them; the others wait until CTA 0 has read their previous
// partial, store this one (fp32, [float4 j][thread]: conflict-free, contiguous per warp)
// and tell CTA 0. `phase` is the slab's count of tiles so far, mod 2. Returns whether this
// CTA stores the tile (CTA 0).
template <class Cfg>
__device__ __forceinline__ bool split_k_fold(const float (&acc)[Cfg::BN / 2], float (&sum)[Cfg::BN / 2], char* part,
                                             uint64_t* stored, uint64_t* read, int consumer, int thread,
                                             uint32_t rank, uint32_t split, uint32_t& phase) {
  constexpr int VECS = Cfg::BN / 8;  // float4s per thread
  if (rank == 0) {
    mbar_wait_cluster(stored, phase);
#pragma unroll
    for (int i = 0; i < Cfg::BN / 2; ++i) sum[i] = acc[i];
    for (uint32_t r = 1; r < split; ++r) {
      const uint32_t src = cluster_map(part, r) + thread * 16;
#pragma unroll
      for (int j = 0; j < VECS; ++j) {
        const float4 v = ld_shared_cluster_f32x4(src + j * 128 * 16);
        sum[4 * j] += v.x;
        sum[4 * j + 1] += v.y;
        sum[4 * j + 2] += v.z;
        sum[4 * j + 3] += v.w;
      }
    }
    fence_operands(sum);  // every remote load has returned before the barrier
    named_barrier_sync(1 + consumer, 128);
    if (thread == 0)
      for (uint32_t r = 1; r < split; ++r) mbar_arrive_cluster_release(read, r);
  } else {
    mbar_wait_cluster(read, phase ^ 1);  // a fresh barrier: the first wait returns at once
    const uint32_t dst = smem_addr(part) + thread * 16;
#pragma unroll
    for (int j = 0; j < VECS; ++j)
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(dst + j * 128 * 16), "f"(acc[4 * j]),
                   "f"(acc[4 * j + 1]), "f"(acc[4 * j + 2]), "f"(acc[4 * j + 3])
                   : "memory");
    named_barrier_sync(1 + consumer, 128);  // the warpgroup's stores, then thread 0's release
    if (thread == 0) mbar_arrive_cluster_release(stored, 0);
  }
  phase ^= 1;
  return rank == 0;
}

struct GemmShape {
  int M, N, K;
  // Rows of the A tensor map's box when the caller made it shorter than Cfg::A_LOAD_ROWS
  // (0: A_LOAD_ROWS). A plain GEMM whose M is below the tile's rows boxes A at M rows, so
  // the TMA unit fills no rows past A's last: with the full box, 64-wide tiles at
  // N = K = 8192 took 18 % longer at M = 1 than at M = 64 on the same plan. The shared-memory
  // rows past the box keep stale data; they only feed accumulator rows at or past M, which
  // no epilogue stores.
  int a_box_rows = 0;
};

// Runs the engine in one CTA of a kernel launched with Cfg::THREADS threads and
// __launch_bounds__(Cfg::THREADS, 1). `smem` is the dynamic shared memory
// (engine_smem_bytes<Cfg, Epi>() bytes). tma_a / tma_b point at __grid_constant__ tensor
// maps: A dims {K, M}, B dims {K, N}, boxes {64, BM} (or shape.a_box_rows) / {64, BN}, SWIZZLE_128B.
template <class Cfg, class Sched, class AWait, class Epi>
__device__ __forceinline__ void gemm_persistent(const CUtensorMap* tma_a, const CUtensorMap* tma_b, GemmShape shape,
                                                const typename Sched::Params& sched,
                                                const typename AWait::Params& await,
                                                const typename Epi::Params& epi, int cta, int num_ctas,
                                                char* smem_raw) {
  using T = typename Cfg::T;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, STAGES = Cfg::STAGES;
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  char* smem_a = smem;
  char* smem_b = smem_a + STAGES * Cfg::A_STAGE_BYTES;
  char* smem_c = smem_b + STAGES * Cfg::B_STAGE_BYTES;
  constexpr int C_WG_BYTES = Epi::template smem_bytes_per_wg<BN>();
  char* smem_part = smem_c + Cfg::CONSUMERS * C_WG_BYTES;  // split-K partials (PART_SLABS of them)
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_part + Cfg::PART_SLABS * Cfg::PART_BYTES);
  uint64_t* empty = full + STAGES;
  uint64_t* mailboxes = empty + STAGES;  // the epilogue courier's (kMailboxBytes)
  uint64_t* part_stored = mailboxes + 2 * kMailboxWords;  // split-K: 2 + 2 barriers
  uint64_t* part_read = part_stored + 2;

  constexpr int CLUSTER = Cfg::CLUSTER, SHARE = Cfg::SHARE;
  static_assert(!Cfg::SPLIT_K || !Epi::kCourier, "split-K: only CTA 0 of a cluster stores, a courier counts every slab");
  // A 64-row tile's second consumer has no rows. Unless the epilogue counts its slabs (a
  // courier), it takes no part at all: no stage waits, no epilogue.
  constexpr bool kIdleConsumer = BM == 64 && !Epi::kCourier;
  const int wg = threadIdx.x / 128;
  const int tiles_m = (shape.M + BM - 1) / BM;
  const int tiles_n = (shape.N + BN - 1) / BN;
  // Work items are cluster tiles: pairs of C tiles for a 2-CTA cluster.
  const int items_m = SHARE == SHARE_B ? (tiles_m + 1) / 2 : tiles_m;
  const int items_n = SHARE == SHARE_A ? (tiles_n + 1) / 2 : tiles_n;
  const int num_items = items_m * items_n;
  const int k_blocks = (shape.K + BK - 1) / BK;
  // Split-K: the cluster's CTAs take one item together, CTA r its k-blocks [kb0, kb0 + kbs).
  const uint32_t split = Cfg::SPLIT_K ? cluster_nctarank() : 1;
  const uint32_t rank = CLUSTER > 1 || Cfg::SPLIT_K ? cluster_ctarank() : 0;
  const KBlockRange k_range = Cfg::SPLIT_K ? split_k_range(rank, split, k_blocks) : KBlockRange{0, k_blocks};
  const int kb0 = k_range.first, kbs = k_range.count;
  const int group = CLUSTER * (int)split;
  const int item0 = cta / group, item_step = num_ctas / group;
  // C tile of this CTA for a cluster tile.
  auto expand = [&](TileCoord c) {
    if (SHARE == SHARE_A) c.n_block = c.n_block * 2 + (int)rank;
    if (SHARE == SHARE_B) c.m_block = c.m_block * 2 + (int)rank;
    return c;
  };
  constexpr bool kDynamic = HasTickets<Sched>::value;
  static_assert(!kDynamic || (CLUSTER == 1 && !Cfg::SPLIT_K && !kIdleConsumer),
                "a dynamic schedule hands one CTA each item and needs both consumers");

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      // One arrival per consumer warp of the (multicast) cluster.
      mbar_init(&empty[s], (kIdleConsumer ? 1 : Cfg::CONSUMERS) * 4 * CLUSTER);
    }
    if constexpr (Cfg::SPLIT_K) {
      for (int c = 0; c < Cfg::PART_SLABS; ++c) {
        if (split > 1) mbar_init(&part_stored[c], split - 1);  // CTA 0's: one arrival per other CTA
        mbar_init(&part_read[c], 1);                           // the others': CTA 0's arrival
      }
    }
    for (int c = 0; c < Cfg::CONSUMERS; ++c) {
      mbar_init(&mailboxes[c * kMailboxWords], 1);      // a slab handed to the courier
      mbar_init(&mailboxes[c * kMailboxWords + 1], 1);  // the courier took it
    }
    if constexpr (kDynamic) {
      TicketRing* ring = ticket_ring<Sched>();
      for (int s = 0; s < kTicketSlots; ++s) {
        mbar_init(&ring->full[s], 1);
        // Readers: every consumer warp, and the courier.
        mbar_init(&ring->empty[s], Cfg::CONSUMERS * 4 + (Epi::kCourier ? 1 : 0));
      }
    }
    fence_mbar_init();
  }
  if constexpr (CLUSTER > 1 || Cfg::SPLIT_K) {
    cluster_sync();  // the peers' barriers exist before anything is multicast or arrives on them
  } else {
    __syncthreads();
  }

  if (wg == 0) {
    setmaxnreg_dec<Cfg::PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      prefetch_tensor_map(tma_a);
      prefetch_tensor_map(tma_b);
      int stage = 0;
      uint32_t phase = 0;
      // Bytes each stage's loads complete: the TMA credits a box's full size, fill included.
      const uint32_t stage_tx = shape.a_box_rows > 0
                                    ? Cfg::B_STAGE_BYTES + (Cfg::A_STAGE_BYTES / Cfg::A_LOAD_ROWS) * shape.a_box_rows
                                    : Cfg::STAGE_BYTES;
      ProducerWalk<Sched> walk(sched, item_step);
      for (int t = walk.first(item0); t < num_items; t = walk.next(t)) {
        const TileCoord tc = expand(Sched::tile(sched, t));
        const int m0 = tc.m_block * BM, n0 = tc.n_block * BN;
        AWait::before_a_load(await, tc.m_block, m0, BM);
        walk.started(sched);
        for (int kb = kb0; kb < kb0 + kbs; ++kb) {
          // In a cluster this waits until both CTAs' consumers freed the slot (the peer
          // multicasts into it too).
          mbar_wait(&empty[stage], phase ^ 1);
          mbar_expect_tx(&full[stage], stage_tx);
          char* a_dst = smem_a + stage * Cfg::A_STAGE_BYTES;
          char* b_dst = smem_b + stage * Cfg::B_STAGE_BYTES;
          if constexpr (SHARE == SHARE_A) {
            tma_load_2d_multicast(a_dst + rank * (Cfg::A_LOAD_ROWS * BK * 2), tma_a, &full[stage], kb * BK,
                                  m0 + (int)rank * Cfg::A_LOAD_ROWS, 0x3);
          } else {
            // Asked per k-block rather than kept across the loop: the producer has 40 registers.
            int a_row;
            const CUtensorMap* a_map = AWait::a_source(await, tma_a, m0, a_row);
            tma_load_2d(a_dst, a_map, &full[stage], kb * BK, a_row);
          }
          if constexpr (SHARE == SHARE_B) {
            tma_load_2d_multicast(b_dst + rank * (Cfg::B_LOAD_ROWS * BK * 2), tma_b, &full[stage], kb * BK,
                                  n0 + (int)rank * Cfg::B_LOAD_ROWS, 0x3);
          } else if constexpr (HasSplitB<AWait>::value) {
            static_assert(SHARE == SHARE_NONE && (BN / 2) % 8 == 0, "split B: no cluster, whole swizzle atoms");
            // Asked per k-block, as the A source: rows kept across the loop spill the producer's registers.
            int b_second;
            const int b_first = AWait::b_halves(await, tc.n_block, BN / 2, b_second);
            tma_load_2d(b_dst, tma_b, &full[stage], kb * BK, b_first);
            tma_load_2d(b_dst + (BN / 2) * BK * 2, tma_b, &full[stage], kb * BK, b_second);
          } else {
            tma_load_2d(b_dst, tma_b, &full[stage], kb * BK, n0);
          }
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    } else if (Epi::kCourier && threadIdx.x / 32 == 1) {
      static_assert(!Epi::kCourier || Cfg::CONSUMERS == 2, "the courier serves two consumer warpgroups");
      if constexpr (kDynamic) {
        // The courier reads every ticket too: it serves the items in the consumers' order.
        if constexpr (Epi::kCourier) {
          if (threadIdx.x == 32) {
            uint32_t box_phase = 0;
            for (int k = 0; ticket_at(ticket_ring<Sched>(), k) < num_items; ++k)
              Epi::courier_tile(epi, mailboxes, box_phase);
          }
        }
      } else {
        const int tiles = item0 < num_items ? (num_items - item0 + item_step - 1) / item_step : 0;
        if (threadIdx.x == 32) Epi::courier(epi, mailboxes, tiles);
      }
    } else if (threadIdx.x >= 32) {
      AWait::side_work(await, threadIdx.x - 32);
    }
  } else {
    setmaxnreg_inc<Cfg::CONSUMER_REGS>();
    const int consumer = wg - 1;
    const int thread = threadIdx.x % 128;
    const bool warp_leader = (threadIdx.x % 32) == 0;
    int stage = 0;
    uint32_t phase = 0;
    float acc[BN / 2];
    uint32_t part_phase = 0;
    SlabInfo slab;
    slab.M = shape.M;
    slab.N = shape.N;
    slab.consumer = consumer;
    slab.thread = thread;
    slab.smem = smem_c + consumer * C_WG_BYTES;
    slab.mailbox = mailboxes + consumer * kMailboxWords;
    auto release = [&](int s) {
      if (warp_leader) {
        mbar_arrive(&empty[s]);
        if constexpr (CLUSTER > 1) mbar_arrive_cluster(&empty[s], rank ^ 1);
      }
    };
    const int my_items = kIdleConsumer && consumer == 1 ? 0 : num_items;
    ConsumerWalk<Sched> walk(item_step);
    for (int t = walk.first(item0); t < my_items; t = walk.next(t)) {
      const TileCoord tc = expand(Sched::tile(sched, t));
      // A slab entirely at or below row M (M <= 64: consumer 1 on every tile; else the
      // last m-block's lower half when M % 128 is in (0, 64]) multiplies only the rows TMA
      // zero-filled: its wgmmas would take the SM's tensor cores (shared by both consumer
      // warpgroups) for nothing -- half the tensor work of a small-M GEMM. Such a
      // warpgroup still waits for every stage to fill and releases it (the empty barrier
      // counts every consumer warp that takes part: an arrival without the wait could be
      // counted in the wrong phase) and still runs the epilogue, so every epilogue's protocol (slab
      // flags, the courier's mailbox count) is that of a live slab. The accumulators it hands over
      // are stale (the previous tile's, or never written) instead of the zeros the wgmmas
      // would have made: every row of the slab is >= M, which every epilogue clips (TMA:
      // the tensor map's extent; DirectStoreEpilogue: r < M). Zeroing them here would be a
      // non-wgmma definition of the accumulator registers, which makes ptxas serialise
      // every wgmma of the kernel (ptxas warning C7515). An epilogue that writes rows >= M
      // anywhere must not rely on their values.
      // Warpgroup-uniform (tile and consumer), so wgmma stays warpgroup-converged.
      // (With BM = 64 consumer 1's slab lies outside the tile: never live.)
      // A scheduler may end the live rows earlier (HasRowsEnd; rows past it are padding).
      bool live;
      if constexpr (HasRowsEnd<Sched>::value)
        live = consumer * 64 < BM && tc.m_block * BM + consumer * 64 < Sched::rows_end(sched, tc, shape.M);
      else
        live = consumer * 64 < BM && tc.m_block * BM + consumer * 64 < shape.M;
      if (live) {
        int prev = -1;
        for (int kb = 0; kb < kbs; ++kb) {
          mbar_wait(&full[stage], phase);
          const char* a = smem_a + stage * Cfg::A_STAGE_BYTES + consumer * (64 * BK * 2);
          const char* b = smem_b + stage * Cfg::B_STAGE_BYTES;
          wgmma_fence();
#pragma unroll
          for (int k = 0; k < BK / 16; ++k) {
            Wgmma<BN, T>::mma(acc, make_smem_desc_sw128(a + k * 32), make_smem_desc_sw128(b + k * 32),
                              (kb > 0 || k > 0) ? 1 : 0);
          }
          wgmma_commit();
          wgmma_wait<1>();  // the previous k-block's batch is done: release its stage
          if (prev >= 0) release(prev);
          prev = stage;
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
          }
        }
        wgmma_wait<0>();
        fence_operands(acc);
        release(prev);
      } else {
        for (int kb = 0; kb < kbs; ++kb) {
          mbar_wait(&full[stage], phase);
          release(stage);
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
      slab.tile = tc;
      slab.row0 = tc.m_block * BM + consumer * 64;
      slab.col0 = tc.n_block * BN;
      if constexpr (Cfg::SPLIT_K) {
        // A slab of the tile (the other consumer of a 64-row tile sits out); split 1: a
        // launch without clusters, nothing to fold.
        if (split > 1) {
          float sum[BN / 2];
          if (split_k_fold<Cfg>(acc, sum, smem_part + consumer * Cfg::PART_BYTES, &part_stored[consumer],
                                &part_read[consumer], consumer, thread, rank, split, part_phase))
            Epi::template store<T, BN>(epi, sum, slab);
          continue;
        }
      }
      Epi::template store<T, BN>(epi, acc, slab);
    }
    Epi::finish(epi, slab);
  }
  // Every warp leaves converged: its roles ran on single lanes (the producer thread, the
  // courier, a consumer's thread 0 in the epilogue), and a fused kernel may follow with
  // warp-collective .aligned instructions (setmaxnreg, bar.sync), undefined on a diverged warp.
  __syncwarp();
  // No CTA may exit while its peer can still multicast into it, arrive on its barriers or
  // (split-K) read its partials.
  if constexpr (CLUSTER > 1 || Cfg::SPLIT_K) cluster_sync();
}

// After gemm_persistent, in every thread of the CTA: gives each warpgroup the launch's
// 168 registers again (the consumers release what setmaxnreg gave them, then the producer
// warpgroup takes its share back), so code after the GEMM may run on all warps alike.
template <class Cfg>
__device__ __forceinline__ void restore_launch_registers() {
  constexpr int kLaunchRegs = 168;  // 64K / THREADS, rounded down to a multiple of 8 (GemmConfig)
  static_assert(Cfg::THREADS == 384 && Cfg::CLUSTER == 1, "launch registers of a 384-thread CTA");
  // setmaxnreg is warpgroup-collective: every warp of each warpgroup arrives converged,
  // and the producer warpgroup waits at the barrier (asleep) rather than in
  // setmaxnreg.inc's retry loop (SASS: TRY_ALLOC) until the consumers release registers.
  __syncwarp();
  __syncthreads();
  if (threadIdx.x / 128 == 0) {
    setmaxnreg_inc<kLaunchRegs>();
  } else {
    setmaxnreg_dec<kLaunchRegs>();
  }
}

}  // namespace gemm
}  // namespace mk
