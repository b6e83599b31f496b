// AllGather, ReduceScatter and AllReduce across nodes: NVLink within a node through the
// node's symmetric workspace (as kernels/collectives.cu), GPU i <-> GPU i between nodes
// through this rank's proxy ring (common/proxy.cuh), both issued from the kernel, so the
// op is one stream-ordered, graph-capturable launch. Routes: src/transport/topology.rs.
//
// Same skeleton as the one-node kernel: CTA b owns a fixed part of every rank's data region
// (region_bytes at b * region_bytes, the same on every rank of every node) split into two
// slots used on alternate steps; a step moves one piece; steps are numbered by a per-CTA
// counter that only grows (MK_SIG_SEQ + b). Every rank runs the same plan, so a slot offset
// names the same bytes on the GPU-i peer of another node: inter-node puts are symmetric.
//
// Inter-node flow control: the peer on node m may put step s into this rank's slot only
// after this rank's grant (its word MK_SIG_NET_GRANT + b*MK_MAX_NODES + node := s), which
// this rank posts at the start of step s, once its local peers have finished reading the
// slot of step s-2 (FREE) and its own proxy has sent what it read from it (completion of
// the step's commands). Each put carries its own arrival flag (NET_READY / NET_READY2 +
// b*MK_MAX_NODES + source node := s), written by the receiving proxy after the data.
//
// A step, per kind (l = this rank's local rank, n its node, L ranks per node, N nodes):
//  AllGather:  stage the own piece as sub-piece n of the gather area -> put it to the
//              gather area of every other node's GPU-l rank -> wait for their sub-pieces
//              -> READY to the local peers -> copy every local rank j's N sub-pieces
//              (sub m of rank j is the piece of rank_of(m, j)) -> FREE.
//  ReduceScatter: stage all R segments -> READY -> for each node m, sum the node's L
//              staged segments owned by rank_of(m, l) (the node reducer of that owner)
//              into the outbox (m != n) or the own inbox sub n -> FREE -> put outbox m
//              to inbox sub n of rank_of(m, l) -> wait for the N-1 partials -> sum the N
//              partials in node order into the output.
//  AllReduce:  ReduceScatter of the piece's R slices as above (the sum lands in the
//              output and in gather sub n), then AllGather of the slices as above.
// Partial sums are stored in the element type (half/bfloat16: one rounding per node
// partial, stated in the header). avg divides once, by R, at the end.
//
// Every wait is bounded (ws.timeout_ns) and also stops on the abort word, mkCommAbort, and
// the proxy's error word; a failure records an error word naming the global rank awaited
// and raises the abort word of every rank of this node (value: 1 + this global rank).
//
// `mktest nodes` (scripts/gpu-run.sh) tests it on a GPU, with nodes emulated on one machine.
#include <stdint.h>
#include "mk_kernel_abi.h"
#include "mkernel.h"
#include "common/proxy.cuh"
#include "common/reduce_copy.cuh"
#include "common/signals.cuh"

__device__ __forceinline__ int rank_of(const HierCollectiveParams& p, int node, int local) {
  return p.rank_of[node * MK_MAX_PEERS + local];
}

// Records `word` and stops this node's ranks (their waits see the abort word).
__device__ __forceinline__ void hier_fail(const HierCollectiveParams& p, uint32_t word) {
  mk_record_error(p.ws, word);
  for (int l = 0; l < p.ws.nranks; ++l) mk_st_release_sys(mk_signal_word(p.ws, l, MK_SIG_ABORT), (uint64_t)p.rank + 1);
}

// One thread: waits until *flag >= target; `peer` is the global rank expected to post it.
__device__ __noinline__ bool hier_wait(const HierCollectiveParams& p, const uint64_t* flag, uint64_t target, int peer,
                                       uint32_t what) {
  if (mk_ld_acquire_sys(flag) >= target) return true;
  const WorkspaceView& ws = p.ws;
  const uint32_t op = (uint32_t)p.kind;
  const uint64_t* abort_word = mk_signal_word(ws, ws.rank, MK_SIG_ABORT);
  const uint32_t* host_abort = &mk_status(ws)->host_abort;
  const uint32_t* proxy_error = &reinterpret_cast<const ProxyRingControl*>(p.ring.control)->error;
  const uint64_t start = mk_globaltimer();
  // The host's abort flag and the proxy's error word live in host memory: every read
  // crosses PCIe, and many waiters reading them every few µs slow whatever else uses the
  // link (MkWaitChecks in signals.cuh; here: this path's own staging copies). Read them
  // once per kHostCheckNs: an abort or a proxy failure is noticed within a millisecond.
  uint64_t next_host_check = start + MkWaitChecks::kHostCheckNs;
  for (uint32_t spin = 1;; ++spin) {
    if (mk_ld_acquire_sys(flag) >= target) return true;
    if ((spin & 31) == 0) {
      uint64_t raised = mk_ld_relaxed_sys(abort_word);
      if (raised != 0) {
        mk_record_error(ws, mk_error_word(mkRemoteError, (uint32_t)(raised - 1), what, op));
        return false;
      }
      const uint64_t now = mk_globaltimer();
      if (now >= next_host_check) {
        next_host_check = now + MkWaitChecks::kHostCheckNs;
        if (mk_ld_relaxed_sys_u32(host_abort) != 0) {
          hier_fail(p, mk_error_word(mkInvalidUsage, 0xff, what, op));
          return false;
        }
        uint32_t failed = mk_proxy_load_acquire_u32(proxy_error);
        if (failed != 0) {
          hier_fail(p, mk_error_word(failed, (uint32_t)peer, MK_WAIT_PROXY, op));
          return false;
        }
      }
      if (now - start > ws.timeout_ns) {
        hier_fail(p, mk_error_word(mkTimeout, (uint32_t)peer, what, op));
        return false;
      }
      __nanosleep(64);
    }
  }
}

// Whole CTA: thread j (< L, j != l) waits for word first + j of this rank (posted by local
// rank j); every thread learns whether all waits succeeded.
__device__ __forceinline__ bool hier_wait_local(const HierCollectiveParams& p, uint32_t first, uint64_t target, uint32_t what) {
  int ok = 1;
  int j = threadIdx.x;
  if (j < p.ws.nranks && j != p.ws.rank)
    ok = hier_wait(p, mk_signal_word(p.ws, p.ws.rank, first + j), target, rank_of(p, p.node, j), what);
  return __syncthreads_and(ok) != 0;
}

// Whole CTA: thread m (< N, m != n) waits for word first + m of this rank (posted by the
// proxy of node m's GPU-l rank).
__device__ __forceinline__ bool hier_wait_net(const HierCollectiveParams& p, uint32_t first, uint64_t target, uint32_t what) {
  int ok = 1;
  int m = threadIdx.x;
  if (m < p.nodes && m != p.node)
    ok = hier_wait(p, mk_signal_word(p.ws, p.ws.rank, first + m), target, rank_of(p, m, p.ws.rank), what);
  return __syncthreads_and(ok) != 0;
}

// Thread 0: grants step `step` of this rank's slot to the GPU-l rank of every other node.
__device__ __forceinline__ bool hier_grant(const HierCollectiveParams& p, int b, uint64_t step, uint64_t* ticket) {
  for (int m = 0; m < p.nodes; ++m) {
    if (m == p.node) continue;
    int peer = rank_of(p, m, p.ws.rank);
    int rc = mk_proxy_signal(p.ring, (uint32_t)peer, MK_SIG_NET_GRANT + b * MK_MAX_NODES + p.node, (uint32_t)step, ticket);
    if (rc != mkSuccess) {
      hier_fail(p, mk_error_word((uint32_t)rc, (uint32_t)peer, MK_WAIT_PROXY, (uint32_t)p.kind));
      return false;
    }
  }
  return true;
}

// Thread 0, after hier_publish: for every other node m, waits for its grant of `step`,
// then puts part(m) = {src, dst, bytes} (offsets in the data regions) to rank_of(m, l),
// setting its word first + n := step (first: this CTA's NET_READY or NET_READY2 base).
struct HierPart {
  uint64_t src, dst, bytes;
};
// Whole CTA: every thread's writes of a put's source reach the point the proxy's copy
// reads from before thread 0 publishes the command.
__device__ __forceinline__ void hier_publish() {
  __threadfence_system();
  __syncthreads();
}

template <class Part>
__device__ __forceinline__ bool hier_send(const HierCollectiveParams& p, int b, uint64_t step, uint32_t first, uint64_t* ticket,
                                          Part part) {
  for (int m = 0; m < p.nodes; ++m) {
    if (m == p.node) continue;
    int peer = rank_of(p, m, p.ws.rank);
    if (!hier_wait(p, mk_signal_word(p.ws, p.ws.rank, MK_SIG_NET_GRANT + b * MK_MAX_NODES + m), step, peer, MK_WAIT_GRANT))
      return false;
    HierPart q = part(m);
    int rc = mk_proxy_put(p.ring, (uint32_t)peer, q.src, q.dst, (uint32_t)q.bytes, first + p.node,
                          (uint32_t)step, ticket);
    if (rc != mkSuccess) {
      hier_fail(p, mk_error_word((uint32_t)rc, (uint32_t)peer, MK_WAIT_PROXY, (uint32_t)p.kind));
      return false;
    }
  }
  return true;
}

// Thread 0: waits until the proxy has carried out `ticket` and everything before it.
__device__ __forceinline__ bool hier_drain(const HierCollectiveParams& p, uint64_t ticket) {
  int rc = mk_proxy_wait_complete(p.ring, ticket);
  if (rc != mkSuccess) {
    hier_fail(p, mk_error_word((uint32_t)rc, 0xff, MK_WAIT_PROXY, (uint32_t)p.kind));
    return false;
  }
  return true;
}

// [lo, hi) of owner q's slice of an AllReduce piece of `nel` elements.
__device__ __forceinline__ void slice_of(const HierCollectiveParams& p, int q, uint64_t nel, uint64_t* lo, uint64_t* hi) {
  *lo = min(nel, (uint64_t)q * p.slice);
  *hi = min(nel, *lo + p.slice);
}

template <typename T>
__device__ __forceinline__ void hier_collective(const HierCollectiveParams& p) {
  const WorkspaceView& ws = p.ws;
  const int L = ws.nranks, l = ws.rank, N = p.nodes, n = p.node, R = p.nranks;
  const uint64_t es = (uint64_t)p.elem_size, sub = p.sub_bytes;
  char* send = reinterpret_cast<char*>(p.send);
  char* recv = reinterpret_cast<char*>(p.recv);
  const int b = blockIdx.x;
  const uint64_t chunk = p.chunk;
  const uint64_t npieces = (p.count + chunk - 1) / chunk;
  uint64_t* seq_word = mk_signal_word(ws, l, MK_SIG_SEQ + b);
  const uint32_t ready = MK_SIG_READY + b * MK_MAX_PEERS;
  const uint32_t ready2 = MK_SIG_READY2 + b * MK_MAX_PEERS;
  const uint32_t freed = MK_SIG_FREE + b * MK_MAX_PEERS;
  // This CTA's network arrival flags (+ source node); hier_send writes word + p.node at the peer.
  const uint32_t net_ready = MK_SIG_NET_READY + b * MK_MAX_NODES;
  const uint32_t net_ready2 = MK_SIG_NET_READY2 + b * MK_MAX_NODES;
  // Node partials are plain sums (products, max, min) of the node's values; avg divides
  // once, by R, when the N partials are combined.
  const int partial_op = p.op == mkAvg ? mkSum : p.op;
  uint64_t step = *seq_word;
  // Thread 0: the last command posted in each slot parity (its sources are in that slot).
  uint64_t last_ticket[2] = {0, 0};
  bool posted[2] = {false, false};
  uint64_t final_ticket = 0;
  bool any_posted = false;

  for (uint64_t g = b; g < npieces; g += gridDim.x) {
    ++step;
    const int par = (int)(step & 1);
    const uint64_t off = g * chunk;
    const uint64_t nel = min(chunk, p.count - off);
    const uint64_t slot_off = (uint64_t)b * p.region_bytes + (uint64_t)par * p.slot_bytes;
    char* mine = reinterpret_cast<char*>(ws.data[l]) + slot_off;

    // 1. This rank's slot is free: its proxy has sent what it read from it two steps ago,
    //    and its local peers have read it. Then the other nodes may write into it.
    int ok = 1;
    if (threadIdx.x == 0 && posted[par]) ok = hier_drain(p, last_ticket[par]);
    if (!__syncthreads_and(ok)) return;
    if (step > 2 && !hier_wait_local(p, freed, step - 2, MK_WAIT_FREE)) return;
    if (threadIdx.x == 0) {
      ok = hier_grant(p, b, step, &last_ticket[par]);
      posted[par] = true;
    }
    if (!__syncthreads_and(ok)) return;

    if (p.kind == MK_OP_ALL_GATHER) {
      char* gather = mine + p.gather_off;
      const uint64_t bytes = nel * es;
      char* own_out = recv + ((uint64_t)p.rank * p.count + off) * es;
      const char* in = send + off * es;
      cta_copy(gather + (uint64_t)n * sub, own_out == in ? nullptr : own_out, in, bytes, p.elem_size);
      hier_publish();
      const uint64_t at = slot_off + p.gather_off + (uint64_t)n * sub;
      if (threadIdx.x == 0)
        ok = hier_send(p, b, step, net_ready, &last_ticket[par], [&](int) { return HierPart{at, at, bytes}; });
      if (!__syncthreads_and(ok)) return;
      if (!hier_wait_net(p, net_ready, step, MK_WAIT_NET)) return;
      mk_cta_signal_peers(ws, ready, step, l);
      if (!hier_wait_local(p, ready, step, MK_WAIT_READY)) return;
      for (int i = 0; i < L; ++i) {
        const int j = (l + i) % L;
        const char* theirs = reinterpret_cast<const char*>(ws.data[j]) + slot_off + p.gather_off;
        for (int m = 0; m < N; ++m) {
          if (j == l && m == n) continue;
          const int q = rank_of(p, m, j);
          cta_copy(recv + ((uint64_t)q * p.count + off) * es, nullptr, theirs + (uint64_t)m * sub, bytes, p.elem_size);
        }
      }
      mk_cta_signal_peers(ws, freed, step, l);
    } else if (p.kind == MK_OP_REDUCE_SCATTER) {
      const uint64_t bytes = nel * es;
      for (int q = 0; q < R; ++q)
        cta_copy(mine + p.stage_off + (uint64_t)q * sub, nullptr, send + ((uint64_t)q * p.count + off) * es, bytes, p.elem_size);
      mk_cta_signal_peers(ws, ready, step, l);
      if (!hier_wait_local(p, ready, step, MK_WAIT_READY)) return;
      for (int m = 0; m < N; ++m) {
        const int o = rank_of(p, m, l);
        const char* src[MK_MAX_PEERS];
#pragma unroll
        for (int j = 0; j < MK_MAX_PEERS; ++j)
          src[j] = j < L ? reinterpret_cast<const char*>(ws.data[j]) + slot_off + p.stage_off + (uint64_t)o * sub : nullptr;
        char* dst = mine + (m == n ? p.inbox_off + (uint64_t)n * sub : p.outbox_off + (uint64_t)m * sub);
        cta_reduce<T>(reinterpret_cast<T*>(dst), nullptr, src, L, nel, partial_op, 1);
      }
      mk_cta_signal_peers(ws, freed, step, l);  // done reading the local peers' slots
      hier_publish();
      if (threadIdx.x == 0)
        ok = hier_send(p, b, step, net_ready, &last_ticket[par], [&](int m) {
          return HierPart{slot_off + p.outbox_off + (uint64_t)m * sub, slot_off + p.inbox_off + (uint64_t)n * sub, bytes};
        });
      if (!__syncthreads_and(ok)) return;
      if (!hier_wait_net(p, net_ready, step, MK_WAIT_NET)) return;
      const char* parts[MK_MAX_PEERS];
#pragma unroll
      for (int m = 0; m < MK_MAX_PEERS; ++m) parts[m] = m < N ? mine + p.inbox_off + (uint64_t)m * sub : nullptr;
      cta_reduce<T>(reinterpret_cast<T*>(recv + off * es), nullptr, parts, N, nel, p.op, R);
      __syncthreads();  // the inbox is read before the next step's grant lets it be overwritten
    } else {
      // AllReduce: the piece's R slices are reduce-scattered, then all-gathered.
      cta_copy(mine + p.stage_off, nullptr, send + off * es, nel * es, p.elem_size);
      mk_cta_signal_peers(ws, ready, step, l);
      if (!hier_wait_local(p, ready, step, MK_WAIT_READY)) return;
      for (int m = 0; m < N; ++m) {
        uint64_t lo, hi;
        slice_of(p, rank_of(p, m, l), nel, &lo, &hi);
        const char* src[MK_MAX_PEERS];
#pragma unroll
        for (int j = 0; j < MK_MAX_PEERS; ++j)
          src[j] = j < L ? reinterpret_cast<const char*>(ws.data[j]) + slot_off + p.stage_off + lo * es : nullptr;
        char* dst = mine + (m == n ? p.inbox_off + (uint64_t)n * sub : p.outbox_off + (uint64_t)m * sub);
        cta_reduce<T>(reinterpret_cast<T*>(dst), nullptr, src, L, hi - lo, partial_op, 1);
      }
      hier_publish();
      if (threadIdx.x == 0)
        ok = hier_send(p, b, step, net_ready, &last_ticket[par], [&](int m) {
          uint64_t lo, hi;
          slice_of(p, rank_of(p, m, l), nel, &lo, &hi);
          return HierPart{slot_off + p.outbox_off + (uint64_t)m * sub, slot_off + p.inbox_off + (uint64_t)n * sub, (hi - lo) * es};
        });
      if (!__syncthreads_and(ok)) return;
      if (!hier_wait_net(p, net_ready, step, MK_WAIT_NET)) return;
      uint64_t lo, hi;
      slice_of(p, p.rank, nel, &lo, &hi);
      const char* parts[MK_MAX_PEERS];
#pragma unroll
      for (int m = 0; m < MK_MAX_PEERS; ++m) parts[m] = m < N ? mine + p.inbox_off + (uint64_t)m * sub : nullptr;
      cta_reduce<T>(reinterpret_cast<T*>(recv + (off + lo) * es), reinterpret_cast<T*>(mine + p.gather_off + (uint64_t)n * sub),
                    parts, N, hi - lo, p.op, R);
      hier_publish();
      const uint64_t at = slot_off + p.gather_off + (uint64_t)n * sub;
      if (threadIdx.x == 0)
        ok = hier_send(p, b, step, net_ready2, &last_ticket[par], [&](int) { return HierPart{at, at, (hi - lo) * es}; });
      if (!__syncthreads_and(ok)) return;
      if (!hier_wait_net(p, net_ready2, step, MK_WAIT_NET)) return;
      mk_cta_signal_peers(ws, ready2, step, l);
      if (!hier_wait_local(p, ready2, step, MK_WAIT_READY2)) return;
      for (int i = 0; i < L; ++i) {
        const int j = (l + i) % L;
        const char* theirs = reinterpret_cast<const char*>(ws.data[j]) + slot_off + p.gather_off;
        for (int m = 0; m < N; ++m) {
          if (j == l && m == n) continue;
          uint64_t qlo, qhi;
          slice_of(p, rank_of(p, m, j), nel, &qlo, &qhi);
          cta_copy(recv + (off + qlo) * es, nullptr, theirs + (uint64_t)m * sub, (qhi - qlo) * es, p.elem_size);
        }
      }
      mk_cta_signal_peers(ws, freed, step, l);
    }
    if (threadIdx.x == 0) {
      final_ticket = last_ticket[par];
      any_posted = true;
    }
  }
  if (threadIdx.x == 0) {
    // The next call may overwrite these slots: let the proxy finish reading them first.
    if (any_posted) hier_drain(p, final_ticket);
    *seq_word = step;
  }
}

#define MK_HIER_KERNEL(NAME, T)                                                                  \
  extern "C" __global__ void __launch_bounds__(MK_HIER_THREADS) NAME(                          \
      const __grid_constant__ HierCollectiveParams p) {                                          \
    hier_collective<T>(p);                                                                       \
  }

#include "kernel_instances/hier_collectives.inc"  // the entry points: kernels/instances.txt
