/* libmkernel-nccl in interpose mode over the stand-in NCCL (fake_nccl.c), no GPU: calls
 * reach the real library with its own communicator, its results and messages come back
 * unchanged, and what it lacks is refused by name. MK_NCCL_ROUTE=nccl is not needed: with
 * no GPU the mkernel attach fails and every call of the communicator goes to NCCL. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <nccl.h>
#include "check.h"

int main(void) {
  int version = 0;
  CHECK(ncclGetVersion(&version) == ncclSuccess && version == 22707, "the real NCCL's version, got %d", version);
  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id) == ncclSuccess && id.internal[0] == 42, "the real NCCL's unique id");
  ncclComm_t comm = NULL;
  CHECK(ncclCommInitRank(&comm, 1, id, 0) == ncclSuccess && comm != NULL, "init: %s", ncclGetLastError(NULL));
  CHECK(comm != (ncclComm_t)0x5eed, "the program gets libmkernel-nccl's handle, not the real communicator");
  int n = 0;
  CHECK(ncclCommCount(comm, &n) == ncclSuccess && n == 1, "count through the real NCCL");
  ncclResult_t async = ncclInternalError;
  CHECK(ncclCommGetAsyncError(comm, &async) == ncclSuccess && async == ncclSuccess, "async %d", (int)async);
  float *buf = (float *)0x10000;
  CHECK(ncclAllReduce(buf, buf, 4, ncclFloat, ncclSum, comm, NULL) == ncclSuccess, "AllReduce forwarded");
  CHECK(ncclBroadcast(buf, buf, 4, ncclFloat, 0, comm, NULL) == ncclSuccess, "Broadcast forwarded");
  /* The real ncclBcast calls the exported ncclBroadcast with its own communicator. */
  CHECK(ncclBcast(buf, 4, ncclFloat, 0, comm, NULL) == ncclSuccess, "Bcast forwarded: %s", ncclGetLastError(comm));
  CHECK(ncclGroupStart() == ncclSuccess, "group start");
  CHECK(ncclSend(buf, 4, ncclFloat, 0, comm, NULL) == ncclSuccess, "Send forwarded in a group");
  CHECK(ncclGroupEnd() == ncclSuccess, "group end");
  /* The real NCCL's error and its message, unchanged. */
  CHECK(ncclRecv(buf, 4, ncclFloat, 0, comm, NULL) == ncclRemoteError, "Recv's error comes back");
  CHECK(strcmp(ncclGetLastError(comm), "fake NCCL: the peer went away") == 0, "last error '%s'", ncclGetLastError(comm));
  CHECK(strcmp(ncclGetErrorString(ncclRemoteError), "fake: remote error") == 0, "the real error strings");
  /* A function the real NCCL lacks is refused by name. */
  /* Looked up at run time: the program links the stand-in, which has no ncclAlltoAll. */
  ncclResult_t (*alltoall)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) = NULL;
  void *sym = dlsym(RTLD_DEFAULT, "ncclAlltoAll");
  memcpy(&alltoall, &sym, sizeof alltoall);
  CHECK(alltoall != NULL, "libmkernel-nccl provides ncclAlltoAll");
  if (alltoall) CHECK_ERR(alltoall(buf, buf, 4, ncclFloat, comm, NULL), ncclInvalidUsage, "has no ncclAlltoAll");
  CHECK(ncclCommDestroy(comm) == ncclSuccess, "destroy");
  CHECK_ERR(ncclCommCount(comm, &n), ncclInvalidArgument, "not a live communicator");
  return checks_summary("libmkernel-nccl interpose (CPU, stand-in NCCL)");
}
