/* libmkernel-nccl in standalone mode with no GPU: versions, error codes and messages,
 * the entry points standalone mode refuses, group bookkeeping, and argument checks. Built
 * against the real nccl.h (NCCL 2.28.9) with -Wall -Wextra -Wpedantic -Werror. */
#include <nccl.h>
#include <stdint.h>
#include "check.h"

int main(void) {
  int version = 0;
  CHECK(ncclGetVersion(&version) == ncclSuccess && version == NCCL_VERSION_CODE,
        "ncclGetVersion gave %d, the header says %d", version, NCCL_VERSION_CODE);
  CHECK_ERR(ncclGetVersion(NULL), ncclInvalidArgument, "ncclGetVersion: version is NULL");
  CHECK(strstr(ncclGetErrorString(ncclInvalidUsage), "invalid usage") != NULL, "error string");
  CHECK(strcmp(ncclGetErrorString((ncclResult_t)42), "unknown result code") == 0, "unknown code");

  /* The entry points standalone mode does not provide: ncclInvalidUsage naming them. */
  ncclComm_t nil = NULL;
  int x = 0;
  void *p = NULL;
  ncclRedOp_t op;
  ncclWindow_t win;
  ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  CHECK_ERR(ncclMemAlloc(&p, 64), ncclInvalidUsage, "ncclMemAlloc is not provided in standalone mode");
  CHECK_ERR(ncclMemFree(p), ncclInvalidUsage, "ncclMemFree");
  CHECK_ERR(ncclCommSplit(nil, 0, 0, &nil, NULL), ncclInvalidUsage, "ncclCommSplit");
  CHECK_ERR(ncclCommShrink(nil, &x, 1, &nil, &cfg, 0), ncclInvalidUsage, "ncclCommShrink");
  CHECK_ERR(ncclCommRevoke(nil, 0), ncclInvalidUsage, "ncclCommRevoke");
  CHECK_ERR(ncclCommRegister(nil, p, 64, &p), ncclInvalidUsage, "ncclCommRegister");
  CHECK_ERR(ncclCommDeregister(nil, p), ncclInvalidUsage, "ncclCommDeregister");
  CHECK_ERR(ncclCommWindowRegister(nil, p, 64, &win, 0), ncclInvalidUsage, "ncclCommWindowRegister");
  CHECK_ERR(ncclCommWindowDeregister(nil, NULL), ncclInvalidUsage, "ncclCommWindowDeregister");
  CHECK_ERR(ncclRedOpCreatePreMulSum(&op, &x, ncclInt32, ncclScalarHostImmediate, nil), ncclInvalidUsage,
            "ncclRedOpCreatePreMulSum");
  CHECK_ERR(ncclRedOpDestroy(ncclSum, nil), ncclInvalidUsage, "ncclRedOpDestroy");
  CHECK_ERR(ncclAlltoAll(p, p, 1, ncclInt8, nil, NULL), ncclInvalidUsage, "ncclAlltoAll");
  CHECK_ERR(ncclGather(p, p, 1, ncclInt8, 0, nil, NULL), ncclInvalidUsage, "ncclGather");
  CHECK_ERR(ncclScatter(p, p, 1, ncclInt8, 0, nil, NULL), ncclInvalidUsage, "ncclScatter");
  CHECK_ERR(ncclSend(p, 1, ncclInt8, 0, nil, NULL), ncclInvalidUsage, "ncclSend");
  CHECK_ERR(ncclRecv(p, 1, ncclInt8, 0, nil, NULL), ncclInvalidUsage, "ncclRecv");
  CHECK_ERR(ncclGroupSimulateEnd(&sim), ncclInvalidUsage, "ncclGroupSimulateEnd");
  CHECK_ERR(ncclCommInitRankScalable(&nil, 2, 0, 0, NULL, NULL), ncclInvalidArgument, "nId must be at least 1");

  /* Group bookkeeping. */
  CHECK_ERR(ncclGroupEnd(), ncclInvalidUsage, "ncclGroupEnd called without a matching ncclGroupStart");
  CHECK(ncclGroupStart() == ncclSuccess && ncclGroupStart() == ncclSuccess, "nested starts");
  CHECK(ncclGroupEnd() == ncclSuccess && ncclGroupEnd() == ncclSuccess, "nested ends");
  CHECK_ERR(ncclGroupEnd(), ncclInvalidUsage, "without a matching ncclGroupStart");

  /* Communicator arguments. */
  float *buf = (float *)(uintptr_t)0x10000;
  ncclComm_t bogus = (ncclComm_t)(uintptr_t)0x1234;
  CHECK_ERR(ncclAllReduce(buf, buf, 4, ncclFloat, ncclSum, NULL, NULL), ncclInvalidArgument, "ncclAllReduce: comm is NULL");
  CHECK_ERR(ncclAllGather(buf, buf, 4, ncclFloat, bogus, NULL), ncclInvalidArgument, "not a live communicator");
  CHECK_ERR(ncclReduceScatter(buf, buf, 4, ncclFloat, ncclAvg, bogus, NULL), ncclInvalidArgument, "not a live communicator");
  CHECK_ERR(ncclBroadcast(buf, buf, 4, ncclFloat, 0, NULL, NULL), ncclInvalidArgument, "ncclBroadcast: comm is NULL");
  CHECK_ERR(ncclBcast(buf, 4, ncclFloat, 0, bogus, NULL), ncclInvalidArgument, "ncclBcast");
  CHECK_ERR(ncclReduce(buf, buf, 4, ncclFloat, ncclMax, 0, NULL, NULL), ncclInvalidArgument, "ncclReduce: comm is NULL");
  CHECK_ERR(ncclCommDestroy(NULL), ncclInvalidArgument, "ncclCommDestroy: comm is NULL");
  CHECK_ERR(ncclCommAbort(bogus), ncclInvalidArgument, "not a live communicator");
  CHECK_ERR(ncclCommFinalize(NULL), ncclInvalidArgument, "comm is NULL");
  ncclResult_t async;
  CHECK_ERR(ncclCommGetAsyncError(NULL, &async), ncclInvalidArgument, "ncclCommGetAsyncError: comm is NULL");
  CHECK_ERR(ncclCommCount(bogus, &x), ncclInvalidArgument, "ncclCommCount");

  /* Init arguments (checked before any GPU is needed). */
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  ncclComm_t comm = bogus;
  CHECK_ERR(ncclCommInitRank(&comm, 0, id, 0), ncclInvalidArgument, "nranks must be positive");
  CHECK(comm == NULL, "a failed init leaves *comm NULL");
  CHECK_ERR(ncclCommInitRank(&comm, 2, id, 2), ncclInvalidArgument, "rank 2 is out of range [0, 2)");
  CHECK_ERR(ncclCommInitRank(NULL, 2, id, 0), ncclInvalidArgument, "comm (the output pointer) is NULL");
  ncclConfig_t bad = NCCL_CONFIG_INITIALIZER;
  bad.magic = 0;
  CHECK_ERR(ncclCommInitRankConfig(&comm, 2, id, 0, &bad), ncclInvalidArgument, "NCCL_CONFIG_INITIALIZER");
  ncclConfig_t blocking2 = NCCL_CONFIG_INITIALIZER;
  blocking2.blocking = 2;
  CHECK_ERR(ncclCommInitRankConfig(&comm, 2, id, 0, &blocking2), ncclInvalidArgument, "blocking is 2, must be 0 or 1");
  CHECK_ERR(ncclCommInitAll(&comm, 0, NULL), ncclInvalidArgument, "ndev must be positive");

  /* A unique id needs no GPU: mkernel's bootstrap root starts. */
  CHECK(ncclGetUniqueId(&id) == ncclSuccess, "ncclGetUniqueId: %s", ncclGetLastError(NULL));
  int nonzero = 0;
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) nonzero |= id.internal[i];
  CHECK(nonzero, "the unique id is all zeros");
  CHECK_ERR(ncclGetUniqueId(NULL), ncclInvalidArgument, "uniqueId is NULL");

  /* A one-rank init: succeeds on a GPU machine, else reports the missing CUDA driver. */
  ncclResult_t r = ncclCommInitRank(&comm, 1, id, 0);
  if (r == ncclSuccess) {
    int n = 0, rank = -1;
    CHECK(ncclCommCount(comm, &n) == ncclSuccess && n == 1, "count %d", n);
    CHECK(ncclCommUserRank(comm, &rank) == ncclSuccess && rank == 0, "rank %d", rank);
    CHECK(ncclCommGetAsyncError(comm, &async) == ncclSuccess && async == ncclSuccess, "async %d", (int)async);
    CHECK(ncclCommDestroy(comm) == ncclSuccess, "destroy");
    CHECK_ERR(ncclCommDestroy(comm), ncclInvalidArgument, "not a live communicator");
  } else {
    CHECK(r == ncclSystemError && strstr(ncclGetLastError(NULL), "CUDA driver") != NULL,
          "init without a GPU returned %d: %s", (int)r, ncclGetLastError(NULL));
    CHECK(comm == NULL, "a failed init leaves *comm NULL");
  }
  return checks_summary("libmkernel-nccl standalone (CPU)");
}
