/* Hello all-reduce across two processes: rank 0 makes the unique id and passes it to rank 1
 * through a file (any out-of-band channel works: MPI, a TCP store, a shared file system).
 *
 *   allreduce_two_procs ID_FILE        forks: the parent runs rank 0, the child rank 1
 *   allreduce_two_procs ID_FILE RANK   runs one rank; start the other with the same ID_FILE
 *                                      (on another host, ID_FILE on a shared file system;
 *                                      rank 1 reads any ID_FILE it finds: start rank 0 first
 *                                      or remove a stale one)
 *
 * Rank r runs on GPU r when there are two GPUs, else on GPU 0 (two processes share one GPU
 * at once only under MPS: start `nvidia-cuda-mps-control -d` first, as for mktest). Rank r
 * holds (r+1)·(1 + i%5) at element i; after mkAllReduce(sum) both hold 3·(1 + i%5).
 * Exit 0: correct; 77: no GPU. */
#define _POSIX_C_SOURCE 200809L
#include <mkernel.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "cuda_min.h"

enum { COUNT = 1 << 20, ID_WAIT_SECONDS = 60 };

/* Rank 0: writes the id under a temporary name, then renames it, so rank 1 never reads half. */
static int write_id(const char *path, const mkUniqueId *id) {
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
  FILE *f = fopen(tmp, "wb");
  if (!f) return perror(tmp), -1;
  int ok = fwrite(id, sizeof *id, 1, f) == 1;
  ok = (fclose(f) == 0) && ok;
  if (!ok || rename(tmp, path) != 0) return perror(path), unlink(tmp), -1;
  return 0;
}

/* Rank 1: waits for the file (bounded), then reads the 128 bytes. */
static int read_id(const char *path, mkUniqueId *id) {
  for (int tries = 0; tries < ID_WAIT_SECONDS * 10; tries++) {
    FILE *f = fopen(path, "rb");
    if (f) {
      int ok = fread(id, sizeof *id, 1, f) == 1;
      fclose(f);
      if (ok) return 0;
    }
    nanosleep(&(struct timespec){0, 100 * 1000 * 1000}, NULL);
  }
  fprintf(stderr, "rank 1: no unique id in %s after %d s (is rank 0 running?)\n", path, ID_WAIT_SECONDS);
  return -1;
}

static int run_rank(int rank, const char *id_path) {
  const char *why = "";
  int ngpus = cuda_min_gpu_count(&why), dev = ngpus > 1 ? rank : 0;
  mkUniqueId id;
  if (rank == 0 && (mkGetUniqueId(&id) != mkSuccess || write_id(id_path, &id) != 0)) {
    fprintf(stderr, "rank 0: could not publish the unique id: %s\n", mkGetLastError(NULL));
    return 1;
  }
  if (rank == 1 && read_id(id_path, &id) != 0) return 1;
  if (ngpus > 0 && cuda_min_set_device(dev) != 0) return 1; /* mkCommInitRank uses the current device */
  mkComm_t comm;
  if (mkCommInitRank(&comm, 2, id, rank) != mkSuccess) {
    fprintf(stderr, "rank %d: %s\n", rank, mkGetLastError(NULL));
    if (ngpus == 0) printf("allreduce_two_procs rank %d: SKIPPED (%s)\n", rank, why);
    return ngpus == 0 ? EXIT_SKIPPED : 1;
  }
  if (rank == 0) unlink(id_path); /* both ranks have joined: the id has served its purpose */

  static float host[COUNT];
  for (int i = 0; i < COUNT; i++) host[i] = (float)((rank + 1) * (1 + i % 5));
  CUdeviceptr buf;
  CUstream stream;
  if (CU(cuda_min.cuMemAlloc(&buf, sizeof host)) || CU(cuda_min.cuMemcpyHtoD(buf, host, sizeof host)) ||
      CU(cuda_min.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING)))
    return 1;
  if (mkAllReduce((void *)buf, (void *)buf, COUNT, mkFloat32, mkSum, comm, stream) != mkSuccess) {
    fprintf(stderr, "rank %d: %s\n", rank, mkGetLastError(comm));
    return 1;
  }
  mkResult_t async = mkSuccess;
  if (CU(cuda_min.cuStreamSynchronize(stream)) || CU(cuda_min.cuMemcpyDtoH(host, buf, sizeof host)) ||
      mkCommGetAsyncError(comm, &async) != mkSuccess || async != mkSuccess) {
    fprintf(stderr, "rank %d: the all-reduce failed: %s\n", rank, mkGetErrorString(async));
    return 1;
  }
  int wrong = 0;
  for (int i = 0; i < COUNT; i++) wrong += host[i] != (float)(3 * (1 + i % 5));
  cuda_min.cuMemFree(buf);
  cuda_min.cuStreamDestroy(stream);
  mkCommDestroy(comm);
  printf("allreduce_two_procs rank %d: %s: GPU %d summed %d floats with rank %d, %d wrong\n", rank,
         wrong ? "FAILED" : "OK", dev, COUNT, 1 - rank, wrong);
  return wrong ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc == 3 && (strcmp(argv[2], "0") == 0 || strcmp(argv[2], "1") == 0)) return run_rank(atoi(argv[2]), argv[1]);
  if (argc != 2) {
    fprintf(stderr, "usage: %s ID_FILE [RANK]\n", argv[0]);
    return 2;
  }
  /* Fork before anything touches CUDA: a CUDA context does not survive fork. */
  unlink(argv[1]);
  fflush(stdout);
  pid_t child = fork();
  if (child < 0) return perror("fork"), 1;
  if (child == 0) {
    int rc = run_rank(1, argv[1]);
    fflush(stdout);
    _exit(rc);
  }
  int rc0 = run_rank(0, argv[1]), status = 0;
  int waited = waitpid(child, &status, 0) == child && WIFEXITED(status);
  unlink(argv[1]);
  if (!waited) return 1;
  int rc1 = WEXITSTATUS(status);
  if (rc0 == EXIT_SKIPPED && rc1 == EXIT_SKIPPED) return EXIT_SKIPPED;
  return rc0 == 0 && rc1 == 0 ? 0 : 1;
}
