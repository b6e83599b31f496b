// AllGather, ReduceScatter and AllReduce over the symmetric workspace (NVLink / CUDA IPC).
//
// One persistent grid per call; CTA b owns a fixed part of every rank's data region
// (WorkspaceView.cta_slots parts, so the partition never changes between calls) split into
// two slots used on alternate steps. Each CTA walks its pieces of the message (piece g goes
// to CTA g % grid); one piece is one step, numbered by a per-CTA counter that only grows
// (MK_SIG_SEQ + b), so flags need no reset and graph replays keep counting on the device.
// A step:
//   1. wait until every peer has finished reading this rank's slot of step-2 (FREE flags),
//   2. stage this rank's input piece into its own slot (AllGather also writes its own
//      output segment from the same registers),
//   3. post READY to every peer, wait for every peer's READY,
//   4. read the peers' slots over NVLink / IPC (pull): copy (AllGather), reduce this rank's
//      segment (ReduceScatter), or reduce this rank's slice, post READY2, and gather the
//      other slices (AllReduce: reduce-scatter + all-gather inside the piece),
//   5. post FREE to every peer.
// Every wait is bounded (common/signals.cuh). With one rank the op is a plain copy.
// Small messages take the low-latency protocol instead (collective_ll below; the host's
// plan picks it, the same on every rank).
// Launched with p.stage_bytes of dynamic shared memory (the host always passes ops::collectives::STAGE_BYTES), the copies
// and reductions stage their loads there with cp.async (common/reduce_copy.cuh): a CTA
// then keeps tens of KiB in flight instead of a few vectors per thread, which is what
// bounds it when several ranks share the GPUs (~1 us per load).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include "mk_kernel_abi.h"
#include "mkernel.h"
#include "common/ll_line.cuh"
#include "common/reduce_copy.cuh"
#include "common/signals.cuh"

// ---- the low-latency protocol (p.protocol == MK_PROTOCOL_LOW_LATENCY) ----
// A sender writes every 8 bytes of its piece, with a flag of the step beside each half, as
// one 16-byte line straight into each peer's LL region (common/ll_line.cuh); the receiver
// polls its own region until both flags of a line are the step's. Data and flag travel in
// one store, so a step costs one one-way trip: no staging copy, no fence, no flag round
// trip. Safety without a free-slot wait: a line of step s lands in the CTA's area for
// parity s & 1, which its reader finished reading at step s - 2, before it sent anything of
// step s - 1 -- and the sender has received all of step s - 1. Only this protocol writes
// the LL region (zeroed at init), so a stale line holds an older step (same parity, at most
// s - 2), never s. At the end of a step each rank posts FREE(s) to its peers, which the
// simple protocol's wait for step s - 2 expects whichever protocol ran step s.

// The lines of `source`'s piece for CTA b at `step` in `owner`'s LL region (right after its
// signal region; layout: MK_LL_BYTES in mk_kernel_abi.h).
__device__ __forceinline__ uint4* ll_lines(const WorkspaceView& ws, int owner, uint32_t b, uint64_t step, int source) {
  char* region = reinterpret_cast<char*>(ws.signals[owner]) + (uint64_t)MK_SIG_WORDS * 8;
  return reinterpret_cast<uint4*>(region + (((uint64_t)b * 2 + (step & 1)) * MK_MAX_PEERS + source) * MK_LL_SOURCE_BYTES);
}

__device__ __forceinline__ void ll_put(uint4* line, uint2 v, LlFlags flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(line), "r"(v.x), "r"(flag.lo), "r"(v.y),
               "r"(flag.hi)
               : "memory");
}

__device__ __forceinline__ bool ll_try(const uint4* line, LlFlags flag, uint2& v) {
  uint32_t lo, f1, hi, f2;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(lo), "=r"(f1), "=r"(hi), "=r"(f2) : "l"(line) : "memory");
  v = make_uint2(lo, hi);
  return ll_flags_match(f1, f2, flag);
}

// One thread: polls `line` until it carries `flag` (bounded as every wait: abort word,
// timeout, host abort). False: the wait gave up with the error recorded.
__device__ __forceinline__ bool ll_get(const WorkspaceView& ws, const uint4* line, LlFlags flag, int peer, uint32_t op,
                                       uint2& v) {
  if (ll_try(line, flag, v)) return true;
  MkWaitChecks checks(ws);
  for (uint32_t spin = 1;; ++spin) {
    if (ll_try(line, flag, v)) return true;
    if ((spin & 31) == 0 && !checks.keep_waiting(peer, MK_WAIT_READY, op, line, flag.lo)) return false;
  }
}

// acc (in Traits<T>::Acc) op= the elements of an 8-byte line; `first` starts the sum.
template <typename T>
__device__ __forceinline__ void ll_accumulate(typename Traits<T>::Acc (&acc)[8 / sizeof(T)], uint2 v, bool first, int op) {
  const T* t = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int k = 0; k < (int)(8 / sizeof(T)); ++k)
    acc[k] = first ? Traits<T>::load(t[k]) : combine<typename Traits<T>::Acc>(acc[k], Traits<T>::load(t[k]), op);
}

// The pieces of this CTA by the low-latency protocol: thread t moves line t of each piece
// (MK_LL_PIECE_BYTES = 8 bytes x threads). AllGather and AllReduce send their piece to every
// peer; ReduceScatter sends each peer the piece of that peer's segment. Reductions combine
// the sources in rank order 0..n-1 and round once, as the simple protocol does, so every
// rank's AllReduce result is bitwise the same.
template <typename T>
__device__ __forceinline__ void collective_ll(const CollectiveParams& p) {
  const WorkspaceView& ws = p.ws;
  const int rank = ws.rank, nranks = ws.nranks;
  const uint64_t es = (uint64_t)p.elem_size;
  const char* send = reinterpret_cast<const char*>(p.send);
  char* recv = reinterpret_cast<char*>(p.recv);
  const uint32_t b = blockIdx.x, opk = (uint32_t)p.kind, i = threadIdx.x;
  uint64_t* seq_word = mk_signal_word(ws, rank, MK_SIG_SEQ + b);
  const uint32_t freed = MK_SIG_FREE + b * MK_MAX_PEERS;
  uint64_t step = *seq_word;
  const uint64_t npieces = (p.count + p.chunk - 1) / p.chunk;
  for (uint64_t g = b; g < npieces; g += gridDim.x) {
    ++step;
    const LlFlags flag = ll_flags(step);
    const uint64_t off = g * p.chunk;
    const uint64_t nb = min(p.chunk, p.count - off) * es;  // bytes of this piece per source
    const bool mine = (uint64_t)i * 8 < nb;                // this thread has a line
    bool ok = true;
    if (mine) {
      // This rank's line of its own segment (AllGather, AllReduce: the piece itself).
      const bool scatter = p.kind == MK_OP_REDUCE_SCATTER;
      const uint2 own = ll_read(send + ((scatter ? (uint64_t)rank * p.count : 0) + off) * es, nb, i);
      // Send: the same line to every peer, or (ReduceScatter) peer q's segment's line.
      for (int k = 1; k < nranks; ++k) {
        const int q = (rank + k) % nranks;
        const uint2 v = scatter ? ll_read(send + ((uint64_t)q * p.count + off) * es, nb, i) : own;
        ll_put(ll_lines(ws, q, b, step, rank) + i, v, flag);
      }
      // Receive: each source's line in rank order, this rank's from `own`.
      if (p.kind == MK_OP_ALL_GATHER) {
        for (int q = 0; q < nranks && ok; ++q) {
          char* out = recv + ((uint64_t)q * p.count + off) * es;
          uint2 v = own;
          if (q == rank && out == send + off * es) continue;  // in place: already there
          if (q != rank) ok = ll_get(ws, ll_lines(ws, rank, b, step, q) + i, flag, q, opk, v);
          if (ok) ll_write(out, nb, i, v);
        }
      } else {
        typename Traits<T>::Acc acc[8 / sizeof(T)];
        for (int q = 0; q < nranks && ok; ++q) {
          uint2 v = own;
          if (q != rank) ok = ll_get(ws, ll_lines(ws, rank, b, step, q) + i, flag, q, opk, v);
          if (ok) ll_accumulate<T>(acc, v, q == 0, p.op);
        }
        if (ok) {
          uint2 out;
          T* o = reinterpret_cast<T*>(&out);
#pragma unroll
          for (int k = 0; k < (int)(8 / sizeof(T)); ++k) o[k] = Traits<T>::store(finalize(acc[k], p.op, nranks));
          ll_write(recv + off * es, nb, i, out);
        }
      }
    }
    if (!__syncthreads_and(ok)) return;
    // FREE(step) for the simple protocol's slot-reuse wait; it orders nothing (this step
    // read no peer's slot), so a relaxed store.
    if ((int)i < nranks && (int)i != rank) mk_st_relaxed_sys(mk_signal_word(ws, i, freed + rank), step);
  }
  if (i == 0) *seq_word = step;
}

template <typename T>
__device__ __forceinline__ void collective(const CollectiveParams& p) {
  const WorkspaceView& ws = p.ws;
  const int rank = ws.rank, nranks = ws.nranks;
  const uint64_t es = (uint64_t)p.elem_size;
  char* send = reinterpret_cast<char*>(p.send);
  char* recv = reinterpret_cast<char*>(p.recv);

  if (nranks == 1) {
    // sum/avg/prod/max/min of one value is the value: a copy (nothing when in place).
    if (send != recv)
      copy_range(recv, nullptr, send, p.count * es, p.elem_size, (uint64_t)blockIdx.x * blockDim.x + threadIdx.x,
                 (uint64_t)gridDim.x * blockDim.x, p.stage_bytes);
    return;
  }
  if (p.protocol == MK_PROTOCOL_LOW_LATENCY) {
    collective_ll<T>(p);
    return;
  }

  const int b = blockIdx.x;
  const uint32_t opk = (uint32_t)p.kind;
  const uint64_t chunk = p.chunk;
  const uint32_t stage = p.stage_bytes;
  const uint64_t npieces = (p.count + chunk - 1) / chunk;
  uint64_t* seq_word = mk_signal_word(ws, rank, MK_SIG_SEQ + b);
  const uint32_t ready = MK_SIG_READY + b * MK_MAX_PEERS;
  const uint32_t ready2 = MK_SIG_READY2 + b * MK_MAX_PEERS;
  const uint32_t freed = MK_SIG_FREE + b * MK_MAX_PEERS;
  uint64_t step = *seq_word;

  for (uint64_t g = b; g < npieces; g += gridDim.x) {
    ++step;
    const uint64_t off = g * chunk;
    const uint64_t n = min(chunk, p.count - off);
    // This CTA's part of the data region and the step's slot in it, recomputed every step
    // (a division per piece) rather than held across the loop: the kernel is at its
    // register cap (512 threads), and the empty asm keeps the compiler from hoisting it.
    uint64_t data_bytes = ws.data_bytes;
    asm volatile("" : "+l"(data_bytes));
    const uint64_t region = (data_bytes / (uint64_t)ws.cta_slots) & ~255ull;
    const uint64_t slot_bytes = (region / 2) & ~255ull;
    const uint64_t slot_off = (uint64_t)b * region + (step & 1) * slot_bytes;
    char* mine = reinterpret_cast<char*>(ws.data[rank]) + slot_off;

    // 1. this rank's slot is free once every peer has read it at step - 2
    if (step > 2 && !mk_cta_wait_peers(ws, freed, step - 2, rank, MK_WAIT_FREE, opk)) return;

    // 2. stage
    if (p.kind == MK_OP_ALL_GATHER) {
      char* own_out = recv + ((uint64_t)rank * p.count + off) * es;
      const char* in = send + off * es;
      cta_copy(mine, own_out == in ? nullptr : own_out, in, n * es, p.elem_size, stage);
    } else if (p.kind == MK_OP_REDUCE_SCATTER) {
      for (int q = 0; q < nranks; ++q)
        cta_copy(mine + (uint64_t)q * chunk * es, nullptr, send + ((uint64_t)q * p.count + off) * es, n * es, p.elem_size, stage);
    } else {
      cta_copy(mine, nullptr, send + off * es, n * es, p.elem_size, stage);
    }

    // 3. publish, then wait for every peer's piece
    mk_cta_signal_peers(ws, ready, step, rank);
    if (!mk_cta_wait_peers(ws, ready, step, rank, MK_WAIT_READY, opk)) return;

    // 4. consume
    if (p.kind == MK_OP_ALL_GATHER) {
      for (int i = 1; i < nranks; ++i) {
        int q = (rank + i) % nranks;
        cta_copy(recv + ((uint64_t)q * p.count + off) * es, nullptr,
                 reinterpret_cast<const char*>(ws.data[q]) + slot_off, n * es, p.elem_size, stage);
      }
    } else if (p.kind == MK_OP_REDUCE_SCATTER) {
      const char* src[MK_MAX_PEERS];
#pragma unroll
      for (int q = 0; q < MK_MAX_PEERS; ++q)
        src[q] = q < nranks ? reinterpret_cast<const char*>(ws.data[q]) + slot_off + (uint64_t)rank * chunk * es : nullptr;
      cta_reduce<T>(reinterpret_cast<T*>(recv + off * es), nullptr, src, nranks, n, p.op, nranks, stage);
    } else {
      // slices of 16-byte multiples keep every slice vector-aligned in the slots
      const uint64_t per16 = 16 / es;
      const uint64_t slice = ((n + nranks - 1) / nranks + per16 - 1) / per16 * per16;
      const uint64_t lo = min(n, (uint64_t)rank * slice), hi = min(n, lo + slice);
      const char* src[MK_MAX_PEERS];
#pragma unroll
      for (int q = 0; q < MK_MAX_PEERS; ++q)
        src[q] = q < nranks ? reinterpret_cast<const char*>(ws.data[q]) + slot_off + lo * es : nullptr;
      cta_reduce<T>(reinterpret_cast<T*>(mine + (chunk + lo) * es), reinterpret_cast<T*>(recv + (off + lo) * es), src, nranks,
                    hi - lo, p.op, nranks, stage);
      mk_cta_signal_peers(ws, ready2, step, rank);
      if (!mk_cta_wait_peers(ws, ready2, step, rank, MK_WAIT_READY2, opk)) return;
      for (int i = 1; i < nranks; ++i) {
        int q = (rank + i) % nranks;
        const uint64_t qlo = min(n, (uint64_t)q * slice), qhi = min(n, qlo + slice);
        cta_copy(recv + (off + qlo) * es, nullptr, reinterpret_cast<const char*>(ws.data[q]) + slot_off + (chunk + qlo) * es,
                 (qhi - qlo) * es, p.elem_size, stage);
      }
    }

    // 5. tell every peer its slot of this step has been read
    mk_cta_signal_peers(ws, freed, step, rank);
  }
  if (threadIdx.x == 0) *seq_word = step;
}

#define MK_COLLECTIVE_KERNEL(NAME, T)                                                                \
  extern "C" __global__ void __launch_bounds__(MK_COLLECTIVE_THREADS) NAME(                        \
      const __grid_constant__ CollectiveParams p) {                                                  \
    collective<T>(p);                                                                                \
  }


// ---- benchmark check: float32 results against the inputs' generator, on the device ----
// A tool kernel (mkbench only): compiled into collectives_tools.fatbin, not the library.
// The same stream as mk_fill_random in util.cu (SplitMix64 of seed and index).
#ifdef MK_TOOL_KERNELS
__device__ __forceinline__ uint64_t check_splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
__device__ __forceinline__ float check_uniform(uint64_t seed, uint64_t i) {
  uint32_t r = (uint32_t)(check_splitmix64(seed * 0x632be59bd9b4e019ull + i) >> 40);
  return (float)r * (2.0f / 16777216.0f) - 1.0f;
}

extern "C" __global__ void mk_collective_check(CollectiveCheckParams c) {
  const float* out = reinterpret_cast<const float*>(c.out);
  uint64_t total = c.kind == MK_OP_ALL_GATHER ? c.count * (uint64_t)c.nranks : c.count;
  uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  unsigned long long wrong = 0;
  for (uint64_t j = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; j < total; j += stride) {
    double expect = 0.0;
    if (c.kind == MK_OP_ALL_GATHER) {
      expect = check_uniform(c.seed_base + j / c.count, j % c.count);
    } else {
      uint64_t i = c.kind == MK_OP_REDUCE_SCATTER ? (uint64_t)c.rank * c.count + j : j;
      for (int p = 0; p < c.nranks; ++p) expect += (double)check_uniform(c.seed_base + p, i);
      if (c.op == mkAvg) expect /= c.nranks;
    }
    double d = fabs((double)out[j] - expect);
    if (!(d <= 1e-6 * c.nranks + 1e-6 * fabs(expect))) ++wrong;
  }
  if (wrong) atomicAdd(reinterpret_cast<unsigned long long*>(c.wrong), wrong);
}
#endif  // MK_TOOL_KERNELS

#include "kernel_instances/collectives.inc"  // the entry points: kernels/instances.txt
