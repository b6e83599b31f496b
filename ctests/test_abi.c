/* The C ABI from a C program built against the installed header (pkg-config):
 * version, error strings, every argument error, and init on a machine without a GPU. */
#include <mkernel.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
  expect_error(mkCommInitRank(NULL, 1, id, 0), mkInvalidArgument, NULL, "NULL", "init with NULL out-pointer");
  expect_error(mkCommInitRank(&comm, 0, id, 0), mkInvalidArgument, NULL, "nranks must be positive", "nranks = 0");
  EXPECT(comm == NULL, "*comm is NULL after a failed init");
  expect_error(mkCommInitRank(&comm, -3, id, 0), mkInvalidArgument, NULL, "nranks must be positive", "nranks < 0");
  expect_error(mkCommInitRank(&comm, 2, id, 2), mkInvalidArgument, NULL, "out of range", "rank = nranks");
  expect_error(mkCommInitRank(&comm, 2, id, -1), mkInvalidArgument, NULL, "out of range", "rank < 0");
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
