// The fence a communicator runs between two fused ops of different kernels
// (ops::fused_fence). Each fused kernel's own handshake (its DONE words) orders it against
// its own previous call only, but every fused kernel uses the same fused-op region: without
// this fence, a rank that finished mkGemmAllReduce could push mkAllGatherGemm's rows into a
// peer that is still summing its partials there.
//
// One CTA of 32 threads. Thread q < MK_MAX_PEERS posts this rank's fence number to local
// peer q and waits for q's. Across nodes, once every local peer has posted, thread 0 hands
// one signal per other node m to the proxy (for the rank of node m with this rank's local
// rank: the only ranks of other nodes a fused op writes to), and thread MK_MAX_PEERS + m
// waits for that rank's. When the kernel ends, every rank of every node has finished every
// fused op before the fence (each posts only after its previous kernel ended, in stream
// order, and a kernel drains its proxy puts before it ends), so the next op may write the
// regions of its local peers and of its GPU-l peers.
// The signal waits for the local peers because they may still read this rank's region for
// an earlier op (GEMM + reduction across nodes sums its local peers' partials and copies
// reduced rows out of their R): a rank of another node may put into this rank's region only
// once this rank's whole node is done with it, as GEMM + reduction's own GR_NET_DONE says.
//
// Across nodes the signal carries the fence number's low 32 bits, as the fused ops' own
// signals carry their epochs: a communicator runs fewer than 2^32 fences.
#include <stdint.h>
#include "mk_kernel_abi.h"
#include "mkernel.h"
#include "common/proxy.cuh"
#include "common/signals.cuh"

static_assert(MK_MAX_PEERS + MK_MAX_NODES <= 32, "one thread per local peer and per node");

extern "C" __global__ void __launch_bounds__(32) mk_fused_fence(const __grid_constant__ FusedFenceParams p) {
  const WorkspaceView& ws = p.ws;
  __shared__ uint64_t fence;
  __shared__ int posted;
  uint64_t* seq = mk_signal_word(ws, ws.rank, MK_SIG_FENCE_SEQ);
  if (threadIdx.x == 0) fence = *seq + 1;
  __syncthreads();
  const int q = threadIdx.x, m = q - MK_MAX_PEERS;
  int ok = 1;
  if (q < ws.nranks && q != ws.rank) {
    mk_signal_store(mk_signal_word(ws, q, MK_SIG_FENCE_DONE + ws.rank), fence);
    // The error word names a global rank; q is a local one.
    const int peer = p.nodes > 1 ? p.rank_of[p.node * MK_MAX_PEERS + q] : q;
    ok = mk_wait_geq(ws, mk_signal_word(ws, ws.rank, MK_SIG_FENCE_DONE + q), fence, peer, MK_WAIT_OP_FLAG,
                     MK_OP_FUSED_FENCE);
  }
  // A failed wait recorded its error; the fence is not counted.
  if (!__syncthreads_and(ok)) return;
  if (threadIdx.x == 0) {
    posted = 1;
    for (int n = 0; n < p.nodes; ++n) {
      if (n == p.node) continue;
      const int peer = p.rank_of[n * MK_MAX_PEERS + ws.rank];
      uint64_t ticket;
      const int rc = mk_proxy_signal(p.ring, (uint32_t)peer, MK_SIG_FENCE_NET_DONE + p.node, (uint32_t)fence, &ticket);
      if (rc != mkSuccess) {
        mk_fail(ws, mk_error_word((uint32_t)rc, (uint32_t)peer, MK_WAIT_PROXY, MK_OP_FUSED_FENCE));
        posted = 0;
        break;
      }
    }
  }
  __syncthreads();
  ok = posted;
  if (ok && m >= 0 && m < p.nodes && m != p.node) {
    ok = mk_wait_geq(ws, mk_signal_word(ws, ws.rank, MK_SIG_FENCE_NET_DONE + m), (uint32_t)fence,
                     p.rank_of[m * MK_MAX_PEERS + ws.rank], MK_WAIT_NET, MK_OP_FUSED_FENCE);
  }
  // Thread 0 counts the fence once every wait has ended (a failed one recorded its error).
  if (__syncthreads_and(ok) && threadIdx.x == 0) *seq = fence;
}
