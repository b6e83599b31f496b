// Proxy ring test kernel: exercises kernels/common/proxy.cuh end to end on a GPU (each
// CTA's thread 0 posts puts and waits for their completion) and keeps the header compiled
// by every build. Launched by the proxy GPU test; parameters in src/kernel_abi.rs. A tool
// kernel: compiled into proxy_tools.fatbin only, never into the library.
#include <stdint.h>
#include "mk_kernel_abi.h"
#include "common/proxy.cuh"

#ifdef MK_TOOL_KERNELS
extern "C" __global__ void mk_proxy_test(ProxyTestParams p) {
  if (threadIdx.x != 0) return;
  int* status = reinterpret_cast<int*>(p.status);
  uint64_t ticket = 0;
  int rc = mkSuccess;
  for (uint32_t i = 0; i < p.commands_per_cta && rc == mkSuccess; ++i) {
    uint64_t offset = ((uint64_t)blockIdx.x * p.commands_per_cta + i) * p.stride;
    rc = mk_proxy_put(p.ring, p.peer, offset, offset, p.bytes, blockIdx.x, p.signal_value, &ticket);
  }
  if (rc == mkSuccess && p.commands_per_cta > 0) rc = mk_proxy_wait_complete(p.ring, ticket);
  status[blockIdx.x] = rc;
}
#endif  // MK_TOOL_KERNELS
