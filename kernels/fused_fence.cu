// The fence a communicator runs between two fused ops of different kernels
// (ops::fused_fence). Each fused kernel's own handshake (its DONE words) orders it against
// its own previous call only, but every fused kernel uses the same fused-op region: without
// this fence, a rank that finished mkGemmAllReduce could push mkAllGatherGemm's rows into a
// peer that is still summing its partials there.
//
// One CTA of 32 threads. Thread q < MK_MAX_PEERS posts this rank's fence number to local
// peer q and waits for q's. Across nodes, thread 0 first hands one signal per other node m
// to the proxy (for the rank of node m with this rank's local rank: the only ranks of other
// nodes a fused op writes to), and thread MK_MAX_PEERS + m waits for that rank's. When the
// kernel ends, every rank this one writes to has finished every fused op before the fence
// (each posts only after its previous kernel ended, in stream order, and a kernel drains its
// proxy puts before it ends), so the next op may write their regions.
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
  if (threadIdx.x == 0) {
    fence = *seq + 1;
    posted = 1;
    for (int m = 0; m < p.nodes; ++m) {
      if (m == p.node) continue;
      const int peer = p.rank_of[m * MK_MAX_PEERS + ws.rank];
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
  const int q = threadIdx.x, m = q - MK_MAX_PEERS;
  int ok = posted;
  if (ok && q < ws.nranks && q != ws.rank) {
    mk_signal_store(mk_signal_word(ws, q, MK_SIG_FENCE_DONE + ws.rank), fence);
    ok = mk_wait_geq(ws, mk_signal_word(ws, ws.rank, MK_SIG_FENCE_DONE + q), fence, q, MK_WAIT_OP_FLAG,
                     MK_OP_FUSED_FENCE);
  }
  if (ok && m >= 0 && m < p.nodes && m != p.node) {
    ok = mk_wait_geq(ws, mk_signal_word(ws, ws.rank, MK_SIG_FENCE_NET_DONE + m), (uint32_t)fence,
                     p.rank_of[m * MK_MAX_PEERS + ws.rank], MK_WAIT_NET, MK_OP_FUSED_FENCE);
  }
  // Thread 0 counts the fence once every wait has ended (a failed one recorded its error).
  if (__syncthreads_and(ok) && threadIdx.x == 0) *seq = fence;
}
