/* Hello all-reduce: two ranks of one communicator in one process (mkCommInitAll), on GPUs
 * 0 and 1, or both on GPU 0 when there is one. Rank r holds (r+1)·(1 + i%5) at element i;
 * after mkAllReduce(sum) every rank holds 3·(1 + i%5). Exit 0: correct; 77: no GPU. */
#include <mkernel.h>
#include <stdio.h>
#include "cuda_min.h"

enum { NRANKS = 2, COUNT = 1 << 20 };
static float host[COUNT];

int main(void) {
  const char *why = "";
  int ngpus = cuda_min_gpu_count(&why), devs[NRANKS] = {0, ngpus > 1 ? 1 : 0};
  mkComm_t comms[NRANKS];
  if (mkCommInitAll(comms, NRANKS, devs) != mkSuccess) {
    fprintf(stderr, "%s\n", mkGetLastError(NULL));
    if (ngpus == 0) printf("allreduce_init_all: SKIPPED (%s)\n", why);
    return ngpus == 0 ? EXIT_SKIPPED : 1;
  }
  CUdeviceptr buf[NRANKS];
  CUstream stream[NRANKS];
  for (int r = 0; r < NRANKS; r++) { /* each rank: its buffer (in place) and stream */
    for (int i = 0; i < COUNT; i++) host[i] = (float)((r + 1) * (1 + i % 5));
    if (cuda_min_set_device(devs[r]) || CU(cuda_min.cuMemAlloc(&buf[r], sizeof host)) ||
        CU(cuda_min.cuMemcpyHtoD(buf[r], host, sizeof host)) || CU(cuda_min.cuStreamCreate(&stream[r], CU_STREAM_NON_BLOCKING)))
      return 1;
  }
  for (int r = 0; r < NRANKS; r++) /* every rank enqueues before any waits */
    if (mkAllReduce((void *)buf[r], (void *)buf[r], COUNT, mkFloat32, mkSum, comms[r], stream[r]) != mkSuccess) {
      fprintf(stderr, "rank %d: %s\n", r, mkGetLastError(comms[r]));
      return 1;
    }
  int wrong = 0;
  for (int r = 0; r < NRANKS; r++) {
    mkResult_t async = mkSuccess;
    if (cuda_min_set_device(devs[r]) || CU(cuda_min.cuStreamSynchronize(stream[r])) ||
        CU(cuda_min.cuMemcpyDtoH(host, buf[r], sizeof host)) || mkCommGetAsyncError(comms[r], &async) || async) {
      fprintf(stderr, "rank %d: %s\n", r, async ? mkGetErrorString(async) : "see above");
      return 1;
    }
    for (int i = 0; i < COUNT; i++) wrong += host[i] != (float)(3 * (1 + i % 5));
    cuda_min.cuMemFree(buf[r]);
    cuda_min.cuStreamDestroy(stream[r]);
    mkCommDestroy(comms[r]);
  }
  printf("allreduce_init_all: %s: %d ranks on GPUs %d,%d summed %d floats, %d wrong\n", wrong ? "FAILED" : "OK",
         NRANKS, devs[0], devs[1], COUNT, wrong);
  return wrong ? 1 : 0;
}
