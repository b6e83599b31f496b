/* The C ABI from a C program built against the installed header (pkg-config):
 * version, error strings and their lifetime, every argument error, configs of other
 * sizes and versions, foreign handles, size overflows, and init on a machine without a GPU. */
#define _DEFAULT_SOURCE /* mmap's MAP_ANONYMOUS */
#include <mkernel.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

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

/* The call returned `want` and mkGetLastError(comm) mentions `needle`. */
static void expect_error(mkResult_t got, mkResult_t want, mkComm_t comm, const char* needle, const char* what) {
  const char* msg = mkGetLastError(comm);
  EXPECT(got == want, "%s: got %d (%s), want %d", what, (int)got, mkGetErrorString(got), (int)want);
  EXPECT(msg != NULL && strstr(msg, needle) != NULL, "%s: last error \"%s\" lacks \"%s\"", what, msg ? msg : "(null)", needle);
}

/* Init of one rank with a fresh unique id (a successful init uses its id up). Without a
 * GPU it fails with mkSystemError; with one it succeeds and the communicator is destroyed. */
static mkResult_t init_once(const mkConfig_t* config) {
  mkUniqueId id;
  mkComm_t comm = (mkComm_t)0x1;
  EXPECT(mkGetUniqueId(&id) == mkSuccess, "mkGetUniqueId: %s", mkGetLastError(NULL));
  mkResult_t r = mkCommInitRankConfig(&comm, 1, id, 0, config);
  if (r == mkSuccess) {
    EXPECT(mkCommDestroy(comm) == mkSuccess, "destroy: %s", mkGetLastError(NULL));
  } else {
    EXPECT(comm == NULL, "*comm is NULL after a failed init");
  }
  return r;
}

/* A config of `size` bytes (an older header's struct) placed flush against an inaccessible
 * page: the library may read `size` bytes and not one more. */
static void config_at_the_end_of_a_page(void) {
  long page = sysconf(_SC_PAGESIZE);
  unsigned char* base = mmap(NULL, 2 * (size_t)page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  EXPECT(base != MAP_FAILED, "mmap");
  if (base == MAP_FAILED) return;
  EXPECT(mprotect(base + page, (size_t)page, PROT_NONE) == 0, "mprotect");
  const size_t sizes[] = {offsetof(mkConfig_t, timeoutMs), offsetof(mkConfig_t, bootstrapTimeoutMs),
                          offsetof(mkConfig_t, commCtas), offsetof(mkConfig_t, workspaceBytes)};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    size_t size = sizes[i];
    unsigned char* at = base + page - size;
    /* The struct may be misaligned for mkConfig_t: the library copies it byte by byte. */
    const mkConfig_t* short_config = (const mkConfig_t*)(void*)at;
    mkConfig_t full = MK_CONFIG_INITIALIZER;
    full.size = size;
    full.timeoutMs = 60000;
    memcpy(at, &full, size);
    mkResult_t r = init_once(short_config);
    EXPECT(r == mkSuccess || r == mkSystemError, "short config (%zu bytes) at a page end: %d, %s", size, (int)r, mkGetLastError(NULL));
    if (size > offsetof(mkConfig_t, timeoutMs)) {
      /* The one field inside is read: a bad value there is refused by name. */
      full.timeoutMs = -5;
      memcpy(at, &full, size);
      mkComm_t comm = (mkComm_t)0x1;
      mkUniqueId id;
      memset(&id, 0, sizeof id);
      expect_error(mkCommInitRankConfig(&comm, 1, id, 0, short_config), mkInvalidArgument, NULL, "config->timeoutMs = -5",
                   "short config with a bad field");
    }
  }
  munmap(base, 2 * (size_t)page);
}

/* Configs from other headers: version 0, another major version, a newer (larger) struct. */
static void config_versions(mkUniqueId id) {
  mkComm_t comm = NULL;
  mkConfig_t c = MK_CONFIG_INITIALIZER;
  c.version = 0;
  expect_error(mkCommInitRankConfig(&comm, 1, id, 0, &c), mkInvalidArgument, NULL, "config->version = 0", "config version 0");
  c.version = MK_VERSION(MK_MAJOR + 1, 0, 0);
  expect_error(mkCommInitRankConfig(&comm, 1, id, 0, &c), mkInvalidArgument, NULL, "major version", "config of another major");
  struct {
    mkConfig_t base;
    int future;
    int pad;
  } newer;
  memset(&newer, 0, sizeof newer);
  mkConfigInit(&newer.base);
  newer.base.size = sizeof newer;
  newer.base.timeoutMs = -1; /* refused when read: proves the struct got that far */
  newer.future = MK_CONFIG_UNDEF_INT;
  expect_error(mkCommInitRankConfig(&comm, 1, id, 0, &newer.base), mkInvalidArgument, NULL, "config->timeoutMs = -1",
               "newer config, new field unset");
  newer.future = 3;
  expect_error(mkCommInitRankConfig(&comm, 1, id, 0, &newer.base), mkInvalidArgument, NULL, "newer header",
               "newer config, new field set");
}

/* mkGetLastError's strings stay valid across successful calls and re-reads (ASan would
 * report a use after free), and a thread's message is its own. */
static void error_string_lifetime(void) {
  EXPECT(mkGetVersion(NULL) == mkInvalidArgument, "mkGetVersion(NULL)");
  const char* p = mkGetLastError(NULL);
  const char* q = mkGetLastError(NULL);
  int version = 0;
  EXPECT(mkGetVersion(&version) == mkSuccess, "mkGetVersion");
  EXPECT(strstr(p, "version is NULL") != NULL, "first pointer after a re-read and a success: \"%s\"", p);
  EXPECT(p == q && strcmp(p, q) == 0, "re-reading gives the same string");
  EXPECT(strcmp(mkGetLastError(NULL), p) == 0, "unchanged by a successful call");
}

/* Handles the library did not make are refused by name and never dereferenced. */
static void foreign_handles(void) {
  long on_the_stack[4] = {0};
  mkComm_t fakes[] = {(mkComm_t)(void*)on_the_stack, (mkComm_t)(uintptr_t)0x8, (mkComm_t)(uintptr_t)UINTPTR_MAX};
  for (size_t i = 0; i < sizeof fakes / sizeof fakes[0]; i++) {
    int n = 0;
    mkResult_t async_error = mkSuccess;
    expect_error(mkCommDestroy(fakes[i]), mkInvalidArgument, NULL, "is not a communicator", "destroy of a fake handle");
    expect_error(mkCommAbort(fakes[i]), mkInvalidArgument, NULL, "is not a communicator", "abort of a fake handle");
    expect_error(mkCommCount(fakes[i], &n), mkInvalidArgument, fakes[i], "is not a communicator", "count on a fake handle");
    expect_error(mkCommGetAsyncError(fakes[i], &async_error), mkInvalidArgument, NULL, "is not a communicator",
                 "async error of a fake handle");
    expect_error(mkAllReduce(on_the_stack, on_the_stack, 1, mkFloat32, mkSum, fakes[i], NULL), mkInvalidArgument, NULL,
                 "is not a communicator", "mkAllReduce on a fake handle");
  }
  EXPECT(on_the_stack[0] == 0 && on_the_stack[3] == 0, "a fake handle's memory was written");
}

/* Sizes from C that wrap size_t are refused by name, never wrapped into small ones. */
static void size_overflows(void) {
  size_t bytes = 7;
  expect_error(mkMoeLayoutBytes(SIZE_MAX / 2 + 1, 2, 512, &bytes), mkInvalidArgument, NULL, "tokens = ", "layout: tokens*topk wraps");
  EXPECT(bytes == 7, "*bytes written on failure");
  expect_error(mkMoeLayoutBytes(1, 1, SIZE_MAX, &bytes), mkInvalidArgument, NULL, "recvCapacity = ", "layout: huge recvCapacity");
  EXPECT(mkMoeLayoutBytes(10, 3, 512, &bytes) == mkSuccess && bytes == 4 * (4 + 3 * 30 + 6 * 4 + 1025), "layout bytes");
}

int main(void) {
  int version = -1;
  EXPECT(mkGetVersion(&version) == mkSuccess, "mkGetVersion");
  EXPECT(version == MK_VERSION_CODE, "library version %d != header MK_VERSION_CODE %d", version, MK_VERSION_CODE);
  expect_error(mkGetVersion(NULL), mkInvalidArgument, NULL, "version is NULL", "mkGetVersion(NULL)");

  /* Error strings: every defined code has its own text; unknown codes are named so. */
  for (int i = 0; i <= 8; i++) {
    const char* s = mkGetErrorString((mkResult_t)i);
    EXPECT(s != NULL && strlen(s) > 0, "mkGetErrorString(%d) empty", i);
    for (int j = 0; j < i; j++) EXPECT(strcmp(s, mkGetErrorString((mkResult_t)j)) != 0, "codes %d and %d share a string", i, j);
  }
  EXPECT(strstr(mkGetErrorString((mkResult_t)99), "unknown") != NULL, "unknown code string");
  EXPECT(strstr(mkGetErrorString((mkResult_t)-1), "unknown") != NULL, "negative code string");

  /* Unique id and init argument errors. */
  expect_error(mkGetUniqueId(NULL), mkInvalidArgument, NULL, "uniqueId is NULL", "mkGetUniqueId(NULL)");
  mkUniqueId id;
  EXPECT(mkGetUniqueId(&id) == mkSuccess, "mkGetUniqueId: %s", mkGetLastError(NULL));
  mkComm_t comm = (mkComm_t)0x1;
  mkComm_t comms_for_limits[1];
  expect_error(mkCommInitRank(NULL, 1, id, 0), mkInvalidArgument, NULL, "NULL", "init with NULL out-pointer");
  expect_error(mkCommInitRank(&comm, 0, id, 0), mkInvalidArgument, NULL, "nranks must be positive", "nranks = 0");
  EXPECT(comm == NULL, "*comm is NULL after a failed init");
  expect_error(mkCommInitRank(&comm, -3, id, 0), mkInvalidArgument, NULL, "nranks must be positive", "nranks < 0");
  expect_error(mkCommInitRank(&comm, 2, id, 2), mkInvalidArgument, NULL, "out of range", "rank = nranks");
  expect_error(mkCommInitRank(&comm, 2, id, -1), mkInvalidArgument, NULL, "out of range", "rank < 0");
  expect_error(mkCommInitRank(&comm, INT_MAX, id, 0), mkInvalidArgument, NULL, "exceeds the 65536 ranks", "nranks = INT_MAX");
  expect_error(mkCommInitRank(&comm, 65537, id, 0), mkInvalidArgument, NULL, "exceeds the 65536 ranks", "nranks = 65537");
  expect_error(mkCommInitAll(comms_for_limits, INT_MAX, NULL), mkInvalidArgument, NULL, "exceeds the 65536 ranks", "ndev = INT_MAX");
  mkUniqueId garbage;
  memset(&garbage, 0x41, sizeof garbage);
  expect_error(mkCommInitRank(&comm, 1, garbage, 0), mkInvalidArgument, NULL, "mkGetUniqueId", "garbage unique id");

  mkConfig_t config = MK_CONFIG_INITIALIZER;
  config.magic = 0;
  expect_error(mkCommInitRankConfig(&comm, 1, id, 0, &config), mkInvalidArgument, NULL, "MK_CONFIG_INITIALIZER", "bad config magic");
  mkConfig_t negative = MK_CONFIG_INITIALIZER;
  negative.timeoutMs = -5;
  expect_error(mkCommInitRankConfig(&comm, 1, id, 0, &negative), mkInvalidArgument, NULL, "timeoutMs", "negative timeout");
  expect_error(mkCommInitAll(NULL, 1, NULL), mkInvalidArgument, NULL, "comms is NULL", "mkCommInitAll(NULL)");
  mkComm_t comms[2];
  expect_error(mkCommInitAll(comms, 0, NULL), mkInvalidArgument, NULL, "ndev must be positive", "mkCommInitAll ndev=0");

  config_at_the_end_of_a_page();
  config_versions(id);
  error_string_lifetime();
  foreign_handles();
  size_overflows();

  /* Every call on a NULL communicator. */
  int value = 0;
  mkResult_t async_error = mkSuccess;
  expect_error(mkCommCount(NULL, &value), mkInvalidArgument, NULL, "comm is NULL", "mkCommCount(NULL)");
  expect_error(mkCommUserRank(NULL, &value), mkInvalidArgument, NULL, "comm is NULL", "mkCommUserRank(NULL)");
  expect_error(mkCommCuDevice(NULL, &value), mkInvalidArgument, NULL, "comm is NULL", "mkCommCuDevice(NULL)");
  expect_error(mkCommGetAsyncError(NULL, &async_error), mkInvalidArgument, NULL, "comm is NULL", "mkCommGetAsyncError(NULL)");
  expect_error(mkCommDestroy(NULL), mkInvalidArgument, NULL, "comm is NULL", "mkCommDestroy(NULL)");
  expect_error(mkCommAbort(NULL), mkInvalidArgument, NULL, "comm is NULL", "mkCommAbort(NULL)");

  /* An unknown datatype is rejected before anything touches the GPU. */
  int dummy[8];
  expect_error(mkGemm(dummy, dummy, dummy, 1, 1, 8, (mkDataType_t)77, NULL), mkInvalidArgument, NULL, "unknown datatype 77", "mkGemm dtype 77");
  float lse[8];
  expect_error(mkRingAttention(dummy, dummy, dummy, dummy, lse, 1, 16, 4, 2, 64, 0.125f, 1, mkBfloat16, NULL, NULL),
               mkInvalidArgument, NULL, "comm is NULL", "mkRingAttention(comm NULL)");

  /* A valid single-rank init: without a GPU it must fail cleanly, naming libcuda. */
  mkResult_t r = mkCommInitRank(&comm, 1, id, 0);
  if (r == mkSuccess) {
    int n = 0, rank = -1;
    EXPECT(mkCommCount(comm, &n) == mkSuccess && n == 1, "count");
    EXPECT(mkCommUserRank(comm, &rank) == mkSuccess && rank == 0, "rank");
    expect_error(mkCommCount(comm, NULL), mkInvalidArgument, comm, "count is NULL", "mkCommCount(comm, NULL)");
    EXPECT(mkCommDestroy(comm) == mkSuccess, "destroy");
    printf("test_abi: a GPU is present; init succeeded\n");
  } else {
    expect_error(r, mkSystemError, NULL, "libcuda", "init without a GPU");
    EXPECT(comm == NULL, "*comm is NULL after a failed init");
    expect_error(mkCommInitAll(comms, 2, NULL), mkSystemError, NULL, "libcuda", "mkCommInitAll without a GPU");
    printf("test_abi: no GPU; init failed cleanly: %s\n", mkGetLastError(NULL));
  }

  if (failures) {
    printf("test_abi: FAILED (%d)\n", failures);
    return 1;
  }
  printf("test_abi: OK\n");
  return 0;
}
