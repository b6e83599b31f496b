/* Shared by the libmkernel-nccl C tests: CHECK counts a failed expectation and goes on. */
#ifndef MK_NCCL_CHECK_H
#define MK_NCCL_CHECK_H
#include <stdio.h>
#include <string.h>

static int checks_failed = 0;
static int checks_passed = 0;

#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (cond) {                                                            \
      checks_passed++;                                                     \
    } else {                                                               \
      checks_failed++;                                                     \
      fprintf(stderr, "%s:%d: FAILED %s: ", __FILE__, __LINE__, #cond);    \
      fprintf(stderr, __VA_ARGS__);                                        \
      fprintf(stderr, "\n");                                               \
    }                                                                      \
  } while (0)

/* The call returned `code` and ncclGetLastError names `text`. */
#define CHECK_ERR(call, code, text)                                                      \
  do {                                                                                   \
    ncclResult_t r_ = (call);                                                            \
    const char *m_ = ncclGetLastError(NULL);                                             \
    CHECK(r_ == (code) && strstr(m_, (text)) != NULL, "%s returned %d (%s), last error '%s'", \
          #call, (int)r_, ncclGetErrorString(r_), m_);                                   \
  } while (0)

static int checks_summary(const char *suite) {
  printf("%s: %d passed, %d failed\n", suite, checks_passed, checks_failed);
  return checks_failed ? 1 : 0;
}
#endif
