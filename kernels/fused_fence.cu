// The fence a communicator runs between two fused ops of different kernels
// (ops::fused_fence). Each fused kernel's own handshake (its DONE words) orders it against
// its own previous call only, but every fused kernel uses the same fused-op region: without
// this fence, a rank that finished mkGemmAllReduce could push mkAllGatherGemm's rows into a
// peer that is still summing its partials there. One CTA of 32 threads: thread q posts this
// rank's fence number to peer q and waits for q's, so when the kernel ends every peer has
// finished every fused op before the fence (each posts only after its previous kernel ended,
// in stream order) and the next op may write any rank's region.
#include <stdint.h>
#include "mk_kernel_abi.h"
#include "mkernel.h"
#include "common/signals.cuh"

extern "C" __global__ void __launch_bounds__(32) mk_fused_fence(const __grid_constant__ WorkspaceView ws) {
  __shared__ uint64_t fence;
  uint64_t* seq = mk_signal_word(ws, ws.rank, MK_SIG_FENCE_SEQ);
  if (threadIdx.x == 0) fence = *seq + 1;
  __syncthreads();
  const int q = threadIdx.x;
  int ok = 1;
  if (q < ws.nranks && q != ws.rank) {
    mk_signal_store(mk_signal_word(ws, q, MK_SIG_FENCE_DONE + ws.rank), fence);
    ok = mk_wait_geq(ws, mk_signal_word(ws, ws.rank, MK_SIG_FENCE_DONE + q), fence, q, MK_WAIT_OP_FLAG, MK_OP_FUSED_FENCE);
  }
  // Thread 0 counts the fence once every wait has ended (a failed one recorded its error).
  if (__syncthreads_and(ok) && threadIdx.x == 0) *seq = fence;
}
