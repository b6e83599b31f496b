/* mkCommAbort from a watchdog thread (NCCL's pattern, as PyTorch uses it), on a GPU:
 *
 * 1. A blocked operation: two ranks share GPU 0 (mkCommInitAll), only rank 0 starts an
 *    AllReduce, so its kernel waits for rank 1 (MK_TIMEOUT_MS is set far away). The main
 *    thread blocks in cuStreamSynchronize; another thread polls the communicator; a
 *    watchdog thread aborts it. The synchronisation must return promptly, the poller must
 *    only ever see success or "was aborted", and later calls are refused by name.
 * 2. Calls racing the abort: one thread issues operations on a communicator in a loop
 *    while the watchdog aborts it; every call returns success or a clear refusal.
 * 3. Live-handle checks on real communicators: queries work, a destroyed or aborted handle
 *    is mkInvalidArgument (a second destroy included).
 *
 * The CUDA driver is loaded with dlopen, so the test builds anywhere; without a driver, a
 * GPU, or a supported GPU it prints SKIPPED and exits 77 (automake's code for a skip). */
#define _DEFAULT_SOURCE
#include <dlfcn.h>
#include <mkernel.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SKIP 77

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void* CUcontext;
typedef void* CUstream;

static struct {
  CUresult (*init)(unsigned);
  CUresult (*device_count)(int*);
  CUresult (*primary_retain)(CUcontext*, int);
  CUresult (*ctx_set_current)(CUcontext);
  CUresult (*mem_alloc)(CUdeviceptr*, size_t);
  CUresult (*mem_free)(CUdeviceptr);
  CUresult (*stream_create)(CUstream*, unsigned);
  CUresult (*stream_sync)(CUstream);
} cu;

static int failures = 0;

#define EXPECT(cond, ...)                                   \
  do {                                                      \
    if (!(cond)) {                                          \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);  \
      fprintf(stderr, __VA_ARGS__);                         \
      fprintf(stderr, "\n");                                \
      failures++;                                           \
    }                                                       \
  } while (0)

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

static int skip(const char* why) {
  printf("test_watchdog: SKIPPED (%s)\n", why);
  return SKIP;
}

static int load_driver(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) return 0;
#define LOAD(field, name) *(void**)&cu.field = dlsym(lib, name)
  LOAD(init, "cuInit");
  LOAD(device_count, "cuDeviceGetCount");
  LOAD(primary_retain, "cuDevicePrimaryCtxRetain");
  LOAD(ctx_set_current, "cuCtxSetCurrent");
  LOAD(mem_alloc, "cuMemAlloc_v2");
  LOAD(mem_free, "cuMemFree_v2");
  LOAD(stream_create, "cuStreamCreate");
  LOAD(stream_sync, "cuStreamSynchronize");
#undef LOAD
  return cu.init && cu.device_count && cu.primary_retain && cu.ctx_set_current && cu.mem_alloc && cu.mem_free &&
         cu.stream_create && cu.stream_sync;
}

/* The call failed with `want` and this thread's message mentions `needle`. */
static void expect_refused(mkResult_t got, mkResult_t want, const char* needle, const char* what) {
  const char* msg = mkGetLastError(NULL);
  EXPECT(got == want, "%s: got %d, want %d (%s)", what, (int)got, (int)want, msg);
  EXPECT(strstr(msg, needle) != NULL, "%s: \"%s\" lacks \"%s\"", what, msg, needle);
}

struct watchdog {
  mkComm_t comm;
  long delay_ms;
  mkResult_t result;
  double aborted_at;
};

static void* watchdog_main(void* arg) {
  struct watchdog* w = arg;
  sleep_ms(w->delay_ms);
  w->aborted_at = now_s();
  w->result = mkCommAbort(w->comm);
  return NULL;
}

struct poller {
  mkComm_t comm;
  atomic_int stop;
  long successes;
  int refused_ok;
};

/* Queries the communicator until it is refused; only success or "was aborted" may come. */
static void* poller_main(void* arg) {
  struct poller* p = arg;
  while (!atomic_load(&p->stop)) {
    mkResult_t async_error = mkSuccess;
    int n = 0;
    mkResult_t r = mkCommGetAsyncError(p->comm, &async_error);
    if (r == mkSuccess) r = mkCommCount(p->comm, &n);
    if (r == mkSuccess) {
      p->successes++;
      EXPECT(n == 2, "mkCommCount gave %d", n);
      continue;
    }
    const char* msg = mkGetLastError(NULL);
    EXPECT(r == mkInvalidArgument && strstr(msg, "was aborted"), "poller: %d (%s)", (int)r, msg);
    p->refused_ok = r == mkInvalidArgument;
    break;
  }
  return NULL;
}

struct issuer {
  mkComm_t comm;
  CUdeviceptr buf;
  CUstream stream;
  long launched;
  int refused_ok;
};

/* Issues AllReduces until the communicator refuses them. */
static void* issuer_main(void* arg) {
  struct issuer* s = arg;
  for (;;) {
    mkResult_t r = mkAllReduce((void*)s->buf, (void*)s->buf, 256, mkFloat32, mkSum, s->comm, (mkStream_t)s->stream);
    if (r == mkSuccess) {
      s->launched++;
      continue;
    }
    const char* msg = mkGetLastError(NULL);
    /* Refused by the registry (the handle is closed) or by the communicator (aborted). */
    s->refused_ok = (r == mkInvalidArgument && strstr(msg, "was aborted")) || (r == mkInvalidUsage && strstr(msg, "aborted"));
    EXPECT(s->refused_ok, "issuer: %d (%s)", (int)r, msg);
    return NULL;
  }
}

/* 1: both ranks made; 0: failed, with the reason in `why`; -1: the machine cannot run the
 * kernels (the platform check at init: GPU generation or driver). */
static int init_pair(mkComm_t comms[2], char* why, size_t why_len) {
  int devs[2] = {0, 0};
  mkResult_t r = mkCommInitAll(comms, 2, devs);
  if (r != mkSuccess) {
    const char* msg = mkGetLastError(NULL);
    snprintf(why, why_len, "mkCommInitAll: %s: %s", mkGetErrorString(r), msg);
    int platform = (r == mkInvalidUsage && strstr(msg, "compute capability")) || (r == mkSystemError && strstr(msg, "driver"));
    return platform ? -1 : 0;
  }
  return 1;
}

int main(void) {
  if (!load_driver()) return skip("no CUDA driver (libcuda.so.1)");
  int ndev = 0;
  if (cu.init(0) != 0 || cu.device_count(&ndev) != 0 || ndev < 1) return skip("no GPU");
  /* Far beyond the test's bounds: only the abort can end the wait. */
  setenv("MK_TIMEOUT_MS", "120000", 1);
  setenv("MK_MAX_CTAS", "8", 1);

  mkComm_t comms[2];
  char why[1024];
  int made = init_pair(comms, why, sizeof why);
  if (made < 0) return skip(why); /* no supported GPU or driver: not this test's subject */
  if (made == 0) {
    fprintf(stderr, "FAIL: %s\n", why);
    return 1;
  }
  CUcontext ctx = NULL;
  CUdeviceptr buf = 0;
  CUstream stream = NULL;
  if (cu.primary_retain(&ctx, 0) != 0 || cu.ctx_set_current(ctx) != 0 || cu.mem_alloc(&buf, 1 << 20) != 0 ||
      cu.stream_create(&stream, 1 /* CU_STREAM_NON_BLOCKING */) != 0) {
    fprintf(stderr, "FAIL: CUDA setup\n");
    return 1;
  }

  /* 3 (first half): queries on live handles. */
  int n = 0, rank = -1;
  EXPECT(mkCommCount(comms[0], &n) == mkSuccess && n == 2, "count");
  EXPECT(mkCommUserRank(comms[1], &rank) == mkSuccess && rank == 1, "rank");

  /* 1: a blocked operation, aborted by a watchdog. */
  EXPECT(mkAllReduce((void*)buf, (void*)buf, 1024, mkFloat32, mkSum, comms[0], (mkStream_t)stream) == mkSuccess,
         "mkAllReduce on rank 0: %s", mkGetLastError(comms[0]));
  struct poller poller = {.comm = comms[0]};
  struct watchdog dog = {.comm = comms[0], .delay_ms = 500};
  pthread_t poller_thread, dog_thread;
  pthread_create(&poller_thread, NULL, poller_main, &poller);
  pthread_create(&dog_thread, NULL, watchdog_main, &dog);
  double start = now_s();
  CUresult sync = cu.stream_sync(stream);
  double returned = now_s();
  pthread_join(dog_thread, NULL);
  atomic_store(&poller.stop, 1);
  pthread_join(poller_thread, NULL);
  EXPECT(dog.result == mkSuccess, "mkCommAbort from the watchdog: %d", (int)dog.result);
  EXPECT(returned - start >= 0.4, "the stream finished before the abort (%.3f s): the kernel did not wait for rank 1", returned - start);
  EXPECT(returned - dog.aborted_at < 10.0, "the blocked stream returned %.3f s after the abort", returned - dog.aborted_at);
  printf("test_watchdog: blocked AllReduce returned %.3f s after the abort (cuStreamSynchronize = %d); poller made %ld calls\n",
         returned - dog.aborted_at, sync, poller.successes);
  EXPECT(poller.successes > 0, "the poller never got in before the abort");
  EXPECT(poller.refused_ok, "the poller was not refused after the abort");
  expect_refused(mkCommCount(comms[0], &n), mkInvalidArgument, "was aborted", "count after abort");
  expect_refused(mkCommDestroy(comms[0]), mkInvalidArgument, "was aborted", "destroy after abort");
  expect_refused(mkCommAbort(comms[0]), mkInvalidArgument, "was aborted", "abort after abort");
  EXPECT(mkCommDestroy(comms[1]) == mkSuccess, "destroy rank 1: %s", mkGetLastError(NULL));
  /* 3 (second half): a destroyed handle. */
  expect_refused(mkCommUserRank(comms[1], &rank), mkInvalidArgument, "was destroyed", "rank after destroy");
  expect_refused(mkCommDestroy(comms[1]), mkInvalidArgument, "was destroyed", "second destroy");

  /* 2: operations racing the abort. */
  if (sync != 0) {
    printf("test_watchdog: the aborted kernel left the context unusable (%d); skipping part 2\n", sync);
  } else if (init_pair(comms, why, sizeof why) != 1) {
    EXPECT(0, "second communicator: %s", why);
  } else {
    struct issuer issuer = {.comm = comms[0], .buf = buf, .stream = stream};
    struct watchdog dog2 = {.comm = comms[0], .delay_ms = 100};
    pthread_t issuer_thread;
    pthread_create(&issuer_thread, NULL, issuer_main, &issuer);
    pthread_create(&dog_thread, NULL, watchdog_main, &dog2);
    pthread_join(dog_thread, NULL);
    pthread_join(issuer_thread, NULL);
    EXPECT(dog2.result == mkSuccess, "second abort: %d (%s)", (int)dog2.result, mkGetLastError(NULL));
    start = now_s();
    sync = cu.stream_sync(stream);
    printf("test_watchdog: %ld AllReduces issued before the refusal; their stream drained in %.3f s (%d)\n", issuer.launched,
           now_s() - start, sync);
    EXPECT(now_s() - start < 10.0, "the aborted operations kept the stream busy");
    EXPECT(mkCommDestroy(comms[1]) == mkSuccess, "destroy rank 1: %s", mkGetLastError(NULL));
  }
  cu.mem_free(buf);

  if (failures) {
    printf("test_watchdog: FAILED (%d)\n", failures);
    return 1;
  }
  printf("test_watchdog: OK\n");
  return 0;
}
