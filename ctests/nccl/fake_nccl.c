/* A stand-in for the real libnccl.so.2, for testing interpose mode without a GPU: a few of
 * NCCL's functions that answer as NCCL would, each checking it receives its own
 * communicator (never libmkernel-nccl's handle), and writing what it saw to stderr.
 *
 * Like NCCL's ncclCommEnsureReady, the queries and collectives first ask the exported
 * ncclCommGetAsyncError about their communicator. That call binds to the first definition
 * in the process, which in interpose mode is libmkernel-nccl's, and it passes the real
 * communicator. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <nccl.h>
#include <stdio.h>
#include <string.h>

static struct ncclComm *const token = (struct ncclComm *)0x5eed;
static const char *last = "";

#define OWN(comm)                                                        \
  do {                                                                   \
    if ((comm) != token) {                                               \
      last = "fake NCCL: a communicator that is not mine";               \
      return ncclInvalidArgument;                                        \
    }                                                                    \
  } while (0)

typedef ncclResult_t (*async_error_fn)(ncclComm_t, ncclResult_t *);

/* Fails the call unless the exported ncclCommGetAsyncError says the communicator is ready. */
#define READY(comm)                                                                  \
  do {                                                                               \
    void *sym = dlsym(RTLD_DEFAULT, "ncclCommGetAsyncError");                        \
    async_error_fn get = NULL;                                                       \
    memcpy(&get, &sym, sizeof get);                                                  \
    ncclResult_t state = ncclInternalError;                                          \
    if (get == NULL || get((comm), &state) != ncclSuccess || state != ncclSuccess) { \
      last = "fake NCCL: ncclCommGetAsyncError refused my own communicator";         \
      return ncclInvalidArgument;                                                    \
    }                                                                                \
  } while (0)

ncclResult_t ncclGetVersion(int *version) { *version = 22707; return ncclSuccess; }
const char *ncclGetErrorString(ncclResult_t r) { return r == ncclRemoteError ? "fake: remote error" : "fake: other"; }
const char *ncclGetLastError(ncclComm_t comm) { (void)comm; return last; }
ncclResult_t ncclGetUniqueId(ncclUniqueId *id) { id->internal[0] = 42; return ncclSuccess; }
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  if (nranks != 1 || rank != 0 || id.internal[0] != 42) return ncclInvalidArgument;
  *comm = token;
  return ncclSuccess;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *e) { OWN(comm); *e = ncclSuccess; return ncclSuccess; }
ncclResult_t ncclCommCount(const ncclComm_t comm, int *n) { OWN(comm); READY(comm); *n = 1; return ncclSuccess; }
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *r) { OWN(comm); READY(comm); *r = 0; return ncclSuccess; }
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *d) { OWN(comm); READY(comm); *d = 0; return ncclSuccess; }
ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, ncclDataType_t t, ncclRedOp_t o, ncclComm_t comm,
                           cudaStream_t st) {
  (void)s; (void)r; (void)n; (void)t; (void)o; (void)st;
  OWN(comm);
  READY(comm);
  fprintf(stderr, "fake NCCL: ncclAllReduce\n");
  return ncclSuccess;
}
ncclResult_t ncclBroadcast(const void *s, void *r, size_t n, ncclDataType_t t, int root, ncclComm_t comm, cudaStream_t st) {
  (void)s; (void)r; (void)n; (void)t; (void)root; (void)st;
  OWN(comm);
  READY(comm);
  return ncclSuccess;
}
/* As NCCL's: ncclBcast is the exported ncclBroadcast in place. */
ncclResult_t ncclBcast(void *buff, size_t n, ncclDataType_t t, int root, ncclComm_t comm, cudaStream_t st) {
  OWN(comm);
  void *sym = dlsym(RTLD_DEFAULT, "ncclBroadcast");
  ncclResult_t (*broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = NULL;
  memcpy(&broadcast, &sym, sizeof broadcast);
  return broadcast ? broadcast(buff, buff, n, t, root, comm, st) : ncclInternalError;
}
ncclResult_t ncclSend(const void *s, size_t n, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t st) {
  (void)s; (void)n; (void)t; (void)peer; (void)st;
  OWN(comm);
  READY(comm);
  return ncclSuccess;
}
ncclResult_t ncclRecv(void *r, size_t n, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t st) {
  (void)r; (void)n; (void)t; (void)peer; (void)st;
  OWN(comm);
  last = "fake NCCL: the peer went away";
  return ncclRemoteError;
}
ncclResult_t ncclGroupStart(void) { return ncclSuccess; }
ncclResult_t ncclGroupEnd(void) { return ncclSuccess; }
ncclResult_t ncclCommDestroy(ncclComm_t comm) { OWN(comm); fprintf(stderr, "fake NCCL: destroyed\n"); return ncclSuccess; }
