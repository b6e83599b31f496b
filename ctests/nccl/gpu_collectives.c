/* libmkernel-nccl on a GPU, standalone mode, in the style of nccl-tests: N ranks (argv[1])
 * of one process on GPU 0, created inside a group from one thread, driven by grouped
 * collectives on their own streams. For AllReduce, AllGather, ReduceScatter, Broadcast and
 * Reduce, every data type and operator mkernel runs, sizes from 8 B up, out of place and
 * in place: fresh random inputs, outputs poisoned before each call, results compared with
 * a float64 (or exact integer) reference; each row prints time, bandwidths and #wrong.
 * Then: a non-blocking init polled through ncclCommGetAsyncError, ncclCommInitAll with a
 * repeated device, and ncclCommAbort from another thread stopping a collective that can
 * never complete. Ends with "N passed, M failed". */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <nccl.h>
#include "check.h"

#define MAXR 8
#define CUDA(call)                                                                                \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));    \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)
#define NCCL(call)                                                                                \
  do {                                                                                            \
    ncclResult_t r_ = (call);                                                                     \
    if (r_ != ncclSuccess) {                                                                      \
      fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call, ncclGetErrorString(r_), \
              ncclGetLastError(NULL));                                                            \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)

enum { AR, AG, RS, BC, RD, NCOLL };
static const char *coll_names[] = {"AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce"};
/* The two fp8 types (10, 11): gathered and broadcast bit for bit; reduced in float and
 * rounded once to the type, with saturation (docs/decisions/0075). */
static const char *type_names[] = {"int8",  "uint8",    "int32",  "uint32",  "int64",  "uint64",
                                   "half",  "float",    "double", "bfloat16", "f8e4m3", "f8e5m2"};
static const size_t type_sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
static const char *op_names[] = {"sum", "prod", "max", "min", "avg"};

static int nranks;
static ncclComm_t comms[MAXR];
static cudaStream_t streams[MAXR];

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* IEEE half and bfloat16 from and to double (round to nearest even). */
static uint16_t to_half(double d) {
  float f = (float)d;
  uint32_t x; memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000, mant = x & 0x7fffff;
  int exp = (int)((x >> 23) & 0xff) - 127 + 15;
  if (exp >= 31) return (uint16_t)(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return (uint16_t)sign;
    mant |= 0x800000;
    uint32_t shift = (uint32_t)(14 - exp), half = mant >> shift, rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) half++;
    return (uint16_t)(sign | half);
  }
  uint32_t h = sign | ((uint32_t)exp << 10) | (mant >> 13), rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
  return (uint16_t)h;
}
static double from_half(uint16_t h) {
  int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v = exp == 0 ? ldexp(mant, -24) : exp == 31 ? (mant ? NAN : INFINITY) : ldexp(mant | 0x400, exp - 25);
  return (h & 0x8000) ? -v : v;
}
static uint16_t to_bf16(double d) {
  float f = (float)d;
  uint32_t x; memcpy(&x, &f, 4);
  x += 0x7fff + ((x >> 16) & 1);
  return (uint16_t)(x >> 16);
}
static double from_bf16(uint16_t b) {
  uint32_t x = (uint32_t)b << 16;
  float f; memcpy(&f, &x, 4);
  return f;
}

static int is_float(int t) { return t >= ncclFloat16 && t <= ncclBfloat16; }
static int is_fp8(int t) { return t == ncclFloat8e4m3 || t == ncclFloat8e5m2; }

/* fp8 codes: e4m3 ("fn": no infinities, NaN at 0x7f/0xff, largest 448) and e5m2 (half's
 * upper byte, largest 57344). Positive codes 0..=max increase in value. */
static double from_fp8(uint8_t b, int t) {
  if (t == ncclFloat8e5m2) return from_half((uint16_t)(b << 8));
  if ((b & 0x7f) == 0x7f) return NAN;
  int exp = (b >> 3) & 0xf, mant = b & 7;
  double v = exp == 0 ? ldexp(mant, -9) : ldexp(8 + mant, exp - 10);
  return (b & 0x80) ? -v : v;
}
static uint8_t fp8_max_code(int t) { return t == ncclFloat8e4m3 ? 0x7e : 0x7b; }
/* f rounded to the nearest code, ties to the even one, saturated to the largest finite
 * value (infinities too), NaN to 0x7f: __NV_SATFINITE's conversion. */
static uint8_t to_fp8(float f, int t) {
  if (isnan(f)) return 0x7f;
  uint8_t sign = signbit(f) ? 0x80 : 0, hi = fp8_max_code(t), lo = 0;
  double a = fmin(fabs((double)f), from_fp8(hi, t));
  while (hi - lo > 1) {
    uint8_t mid = (uint8_t)((lo + hi) / 2);
    if (from_fp8(mid, t) <= a) lo = mid; else hi = mid;
  }
  double dl = a - from_fp8(lo, t), dh = from_fp8(hi, t) - a;
  uint8_t code = (dl < dh || (dl == dh && lo % 2 == 0)) ? lo : hi;
  return (uint8_t)(sign | (a <= from_fp8(lo, t) ? lo : code));
}
/* An fp8 reduction as mkernel defines it: the values in float, combined in rank order,
 * avg divided once, then rounded once to the type (returned decoded). */
static double fp8_reduce_ref(int t, int op, const double *v, int n) {
  float acc = (float)v[0];
  for (int r = 1; r < n; r++) {
    float x = (float)v[r];
    switch (op) {
      case ncclSum: case ncclAvg: acc += x; break;
      case ncclProd: acc *= x; break;
      case ncclMax: acc = fmaxf(acc, x); break;
      default: acc = fminf(acc, x); break;
    }
  }
  if (op == ncclAvg) acc /= (float)n;
  return from_fp8(to_fp8(acc, t), t);
}

/* Element i of a buffer as double (floats) or int64 bits widened (integers). */
static double get(const void *buf, int t, size_t i) {
  switch (t) {
    case ncclInt8: return ((const int8_t *)buf)[i];
    case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return ((const uint8_t *)buf)[i];
    case ncclInt32: return ((const int32_t *)buf)[i];
    case ncclUint32: return ((const uint32_t *)buf)[i];
    case ncclInt64: return (double)((const int64_t *)buf)[i];
    case ncclUint64: return (double)((const uint64_t *)buf)[i];
    case ncclFloat16: return from_half(((const uint16_t *)buf)[i]);
    case ncclFloat32: return ((const float *)buf)[i];
    case ncclFloat64: return ((const double *)buf)[i];
    default: return from_bf16(((const uint16_t *)buf)[i]);
  }
}
/* Stores v rounded (floats) or wrapped to the type (integers, two's complement). */
static void put(void *buf, int t, size_t i, double v) {
  int64_t w = is_float(t) ? 0 : (int64_t)v;
  switch (t) {
    case ncclInt8: ((int8_t *)buf)[i] = (int8_t)(uint8_t)(uint64_t)w; break;
    case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: ((uint8_t *)buf)[i] = (uint8_t)(uint64_t)w; break;
    case ncclInt32: ((int32_t *)buf)[i] = (int32_t)(uint32_t)(uint64_t)w; break;
    case ncclUint32: ((uint32_t *)buf)[i] = (uint32_t)(uint64_t)w; break;
    case ncclInt64: ((int64_t *)buf)[i] = w; break;
    case ncclUint64: ((uint64_t *)buf)[i] = (uint64_t)w; break;
    case ncclFloat16: ((uint16_t *)buf)[i] = to_half(v); break;
    case ncclFloat32: ((float *)buf)[i] = (float)v; break;
    case ncclFloat64: ((double *)buf)[i] = v; break;
    default: ((uint16_t *)buf)[i] = to_bf16(v); break;
  }
}

/* Random inputs every type holds exactly: multiples of 1/4 in [-2, 2] for floats, small
 * integers for integers (no sum of up to 8 ranks overflows; products wrap as the type's).
 * fp8 (as its code): any byte for a move, NaN patterns included; a reduction's operands are
 * any finite code (subnormals to the largest), for prod magnitudes in [0.5, 2). */
static double random_value(int t, int reduces, int op) {
  if (is_fp8(t) && !reduces) return rand() % 256;
  if (is_fp8(t)) {
    int sign = (rand() & 1) ? 0x80 : 0;
    if (op == ncclProd) return sign | (t == ncclFloat8e4m3 ? 0x30 + rand() % 16 : 0x38 + rand() % 8);
    return sign | rand() % (fp8_max_code(t) + 1);
  }
  int r = rand() % 17;
  if (is_float(t)) return (r - 8) / 4.0;
  if (t == ncclUint8 || t == ncclUint32 || t == ncclUint64) return r % 9;
  return r - 8;
}

/* The reference: op over the ranks' values, in float64 (floats) or exact integers reduced
 * modulo the type (sum and prod wrap; avg is the sum divided by nranks, truncated). */
static double reduce_ref(int t, int op, const double *v, int n) {
  double acc = v[0];
  int64_t iacc = (int64_t)v[0];
  for (int r = 1; r < n; r++) {
    switch (op) {
      case ncclSum: case ncclAvg: acc += v[r]; iacc += (int64_t)v[r]; break;
      case ncclProd: acc *= v[r]; iacc = (int64_t)((uint64_t)iacc * (uint64_t)(int64_t)v[r]); break;
      case ncclMax: acc = v[r] > acc ? v[r] : acc; iacc = (int64_t)acc; break;
      default: acc = v[r] < acc ? v[r] : acc; iacc = (int64_t)acc; break;
    }
  }
  if (is_float(t)) return op == ncclAvg ? acc / n : acc;
  if (op == ncclAvg) return (double)(iacc / n);
  return (double)iacc;
}

/* Values compare equal after rounding to the type; halves and bfloat16 within one rounding
 * of a sum formed in float (mkernel rounds once; products of 4 ranks are not exact in half). */
static int matches(int t, double got, double want) {
  if (isnan(got)) return 0;
  if (!is_float(t)) {
    uint8_t a[8] = {0}, b[8] = {0};
    put(a, t, 0, got);
    put(b, t, 0, want);
    return memcmp(a, b, type_sizes[t]) == 0;
  }
  double tol = t == ncclFloat16 ? 1.0 / 1024 : t == ncclBfloat16 ? 1.0 / 128 : t == ncclFloat32 ? 1e-6 : 1e-12;
  return fabs(got - want) <= tol * fmax(1.0, fabs(want));
}

typedef struct {
  void *send[MAXR], *recv[MAXR];
  void *host_in[MAXR], *host_out;
  size_t send_bytes, recv_bytes;
} Buffers;

/* Runs one call on every rank inside a group. */
static ncclResult_t launch(int coll, int t, int op, int root, size_t count, Buffers *b, int in_place) {
  ncclResult_t first = ncclSuccess;
  NCCL(ncclGroupStart());
  for (int r = 0; r < nranks; r++) {
    size_t e = type_sizes[t];
    char *s = b->send[r], *d = b->recv[r];
    if (in_place) {
      if (coll == AG) s = d + (size_t)r * count * e;
      else if (coll == RS) { s = d; d = d + (size_t)r * count * e; }
      else s = d;
    }
    ncclResult_t x;
    switch (coll) {
      case AR: x = ncclAllReduce(s, d, count, t, op, comms[r], streams[r]); break;
      case AG: x = ncclAllGather(s, d, count, t, comms[r], streams[r]); break;
      case RS: x = ncclReduceScatter(s, d, count, t, op, comms[r], streams[r]); break;
      case BC: x = ncclBroadcast(s, d, count, t, root, comms[r], streams[r]); break;
      default: x = ncclReduce(s, d, count, t, op, root, comms[r], streams[r]); break;
    }
    if (first == ncclSuccess) first = x;
  }
  ncclResult_t end = ncclGroupEnd();
  return first != ncclSuccess ? first : end;
}

/* One row half: poisons outputs, writes inputs, runs, checks; returns #wrong (-1: the call
 * failed) and the time of `iters` further calls. */
static long run_checked(int coll, int t, int op, int root, size_t count, Buffers *b, int in_place, double *usec) {
  size_t e = type_sizes[t], n_in = coll == RS ? count * nranks : count, n_out = coll == AG ? count * nranks : coll == RS ? count : count;
  int reduces = coll == AR || coll == RS || coll == RD;
  for (int r = 0; r < nranks; r++) {
    for (size_t i = 0; i < n_in; i++) put(b->host_in[r], t, i, random_value(t, reduces, op));
    CUDA(cudaMemset(b->recv[r], 0xff, b->recv_bytes));
    if (!in_place) CUDA(cudaMemcpy(b->send[r], b->host_in[r], n_in * e, cudaMemcpyHostToDevice));
    else {
      size_t off = coll == AG ? (size_t)r * count * e : 0;
      CUDA(cudaMemcpy((char *)b->recv[r] + off, b->host_in[r], n_in * e, cudaMemcpyHostToDevice));
    }
  }
  CUDA(cudaDeviceSynchronize());
  if (launch(coll, t, op, root, count, b, in_place) != ncclSuccess) {
    fprintf(stderr, "%s %s %s: %s\n", coll_names[coll], type_names[t], op_names[op], ncclGetLastError(NULL));
    return -1;
  }
  for (int r = 0; r < nranks; r++) CUDA(cudaStreamSynchronize(streams[r]));
  long wrong = 0;
  double v[MAXR];
  for (int r = 0; r < nranks; r++) {
    CUDA(cudaMemcpy(b->host_out, b->recv[r], b->recv_bytes, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n_out; i++) {
      double want;
      if (coll == AG) {
        want = get(b->host_in[i / count], t, i % count);
      } else if (coll == BC) {
        want = get(b->host_in[root], t, i);
      } else {
        size_t src = coll == RS ? (size_t)r * count + i : i;
        for (int q = 0; q < nranks; q++)
          v[q] = is_fp8(t) ? from_fp8((uint8_t)get(b->host_in[q], t, src), t) : get(b->host_in[q], t, src);
        want = is_fp8(t) ? fp8_reduce_ref(t, op, v, nranks) : reduce_ref(t, op, v, nranks);
      }
      size_t at = in_place && coll == RS ? (size_t)r * count + i : i;
      if (coll == RD && r != root) {
        /* A non-root rank's recvbuff is never written: it keeps the poison. */
        if (!in_place) wrong += ((unsigned char *)b->host_out)[at * e] != 0xff;
        continue;
      }
      if (is_fp8(t) && reduces) {
        /* Value for value (+0 equals -0): the rule fixes every bit of the rounding. */
        wrong += !(from_fp8((uint8_t)get(b->host_out, t, at), t) == want);
        continue;
      }
      wrong += !matches(t, get(b->host_out, t, at), want);
    }
  }
  int iters = count * e >= (1 << 20) ? 5 : 20;
  double t0 = now();
  for (int it = 0; it < iters; it++)
    if (launch(coll, t, op, root, count, b, in_place) != ncclSuccess) return -1;
  for (int r = 0; r < nranks; r++) CUDA(cudaStreamSynchronize(streams[r]));
  *usec = (now() - t0) * 1e6 / iters;
  return wrong;
}

static void sweep(size_t max_bytes, long *rows, long *bad_rows) {
  Buffers b;
  size_t cap = max_bytes * nranks;
  for (int r = 0; r < nranks; r++) {
    CUDA(cudaMalloc(&b.send[r], cap));
    CUDA(cudaMalloc(&b.recv[r], cap));
    b.host_in[r] = malloc(cap);
  }
  b.host_out = malloc(cap);
  printf("# nranks %d on one GPU (standalone)\n", nranks);
  printf("# %13s %12s %14s %9s %6s %5s  %9s %7s %7s %6s  %9s %7s %7s %6s\n", "collective", "size", "count", "type",
         "redop", "root", "time(us)", "algbw", "busbw", "#wrong", "time(us)", "algbw", "busbw", "#wrong");
  for (int coll = 0; coll < NCOLL; coll++) {
    int reduces = coll == AR || coll == RS || coll == RD;
    double factor = coll == AR ? 2.0 * (nranks - 1) / nranks : (coll == AG || coll == RS) ? (double)(nranks - 1) / nranks : 1.0;
    for (int t = 0; t < 12; t++) {
      for (int op = 0; op < (reduces ? 5 : 1); op++) {
        for (size_t bytes = 8; bytes <= max_bytes; bytes *= 8) {
          size_t full = bytes / type_sizes[t];
          if (full == 0) continue;
          /* `bytes` is the larger buffer, as nccl-tests sizes AllGather and ReduceScatter. */
          size_t count = (coll == AG || coll == RS) ? full / nranks : full;
          if (count == 0) continue;
          int root = (coll == BC || coll == RD) ? nranks - 1 : -1;
          b.send_bytes = b.recv_bytes = (coll == AG || coll == RS) ? count * nranks * type_sizes[t] : count * type_sizes[t];
          double us[2] = {0, 0};
          long wrong[2];
          printf("  %13s %12zu %14zu %9s %6s %5d", coll_names[coll], count * type_sizes[t] * ((coll == AG || coll == RS) ? nranks : 1),
                 count, type_names[t], reduces ? op_names[op] : "none", root);
          for (int ip = 0; ip < 2; ip++) {
            wrong[ip] = run_checked(coll, t, op, root < 0 ? 0 : root, count, &b, ip, &us[ip]);
            double algbw = (double)b.send_bytes / (us[ip] * 1e3);
            if (coll == AG) algbw = (double)b.recv_bytes / (us[ip] * 1e3);
            printf("  %9.2f %7.2f %7.2f %6ld", us[ip], algbw, algbw * factor, wrong[ip]);
          }
          printf("\n");
          (*rows)++;
          if (wrong[0] != 0 || wrong[1] != 0) (*bad_rows)++;
        }
      }
    }
  }
  for (int r = 0; r < nranks; r++) {
    cudaFree(b.send[r]);
    cudaFree(b.recv[r]);
    free(b.host_in[r]);
  }
  free(b.host_out);
}

static void *abort_later(void *comm) {
  struct timespec d = {0, 300 * 1000 * 1000};
  nanosleep(&d, NULL);
  NCCL(ncclCommAbort((ncclComm_t)comm));
  return NULL;
}

int main(int argc, char **argv) {
  nranks = argc > 1 ? atoi(argv[1]) : 2;
  size_t max_bytes = argc > 2 ? (size_t)atoll(argv[2]) : (size_t)4 << 20;
  if (nranks < 1 || nranks > MAXR) { fprintf(stderr, "nranks must be 1..%d\n", MAXR); return 2; }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  srand(1234 + nranks);
  CUDA(cudaSetDevice(0));
  int version = 0;
  NCCL(ncclGetVersion(&version));
  printf("# ncclGetVersion: %d\n", version);

  /* Several ranks initialised by one thread inside a group. */
  ncclUniqueId id;
  NCCL(ncclGetUniqueId(&id));
  NCCL(ncclGroupStart());
  for (int r = 0; r < nranks; r++) {
    CUDA(cudaSetDevice(0));
    NCCL(ncclCommInitRank(&comms[r], nranks, id, r));
  }
  NCCL(ncclGroupEnd());
  for (int r = 0; r < nranks; r++) {
    int n = 0, rank = -1, dev = -1;
    NCCL(ncclCommCount(comms[r], &n));
    NCCL(ncclCommUserRank(comms[r], &rank));
    NCCL(ncclCommCuDevice(comms[r], &dev));
    CHECK(n == nranks && rank == r && dev == 0, "queries of rank %d: %d %d %d", r, n, rank, dev);
    CUDA(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
  }
  long rows = 0, bad_rows = 0;
  sweep(max_bytes, &rows, &bad_rows);
  CHECK(bad_rows == 0, "%ld of %ld rows have wrong values or failed calls", bad_rows, rows);
  printf("# rows %ld, with #wrong or errors %ld\n", rows, bad_rows);
  for (int r = 0; r < nranks; r++) {
    ncclResult_t async;
    NCCL(ncclCommGetAsyncError(comms[r], &async));
    CHECK(async == ncclSuccess, "async error %d on rank %d", (int)async, r);
    NCCL(ncclCommFinalize(comms[r]));
    NCCL(ncclCommDestroy(comms[r]));
  }

  /* Non-blocking init: ncclInProgress until every rank has joined, then usable. */
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  NCCL(ncclGetUniqueId(&id));
  NCCL(ncclGroupStart());
  for (int r = 0; r < nranks; r++) {
    ncclResult_t x = ncclCommInitRankConfig(&comms[r], nranks, id, r, &config);
    CHECK(x == ncclSuccess || x == ncclInProgress, "non-blocking init in a group returned %d", (int)x);
  }
  ncclResult_t end = ncclGroupEnd();
  CHECK(end == ncclInProgress || end == ncclSuccess, "ncclGroupEnd of non-blocking inits returned %d", (int)end);
  int saw_progress = end == ncclInProgress;
  for (int r = 0; r < nranks; r++) {
    ncclResult_t state = ncclInProgress;
    double t0 = now();
    while (state == ncclInProgress && now() - t0 < 60) NCCL(ncclCommGetAsyncError(comms[r], &state));
    CHECK(state == ncclSuccess, "non-blocking init of rank %d ended in %d: %s", r, (int)state, ncclGetLastError(comms[r]));
  }
  CHECK(saw_progress, "ncclGroupEnd of non-blocking inits did not report ncclInProgress");
  {
    Buffers b;
    for (int r = 0; r < nranks; r++) {
      CUDA(cudaMalloc(&b.send[r], 4096 * nranks));
      CUDA(cudaMalloc(&b.recv[r], 4096 * nranks));
      b.host_in[r] = malloc(4096 * nranks);
    }
    b.host_out = malloc(4096 * nranks);
    b.send_bytes = b.recv_bytes = 1024 * 4;
    double us;
    CHECK(run_checked(AR, ncclFloat32, ncclAvg, 0, 1024, &b, 0, &us) == 0, "AllReduce avg after a non-blocking init");
    for (int r = 0; r < nranks; r++) {
      cudaFree(b.send[r]);
      cudaFree(b.recv[r]);
      free(b.host_in[r]);
    }
    free(b.host_out);
  }
  for (int r = 0; r < nranks; r++) NCCL(ncclCommDestroy(comms[r]));

  /* ncclCommInitAll with the device repeated. */
  int devlist[MAXR] = {0};
  NCCL(ncclCommInitAll(comms, nranks, devlist));
  for (int r = 0; r < nranks; r++) {
    int rank = -1;
    NCCL(ncclCommUserRank(comms[r], &rank));
    CHECK(rank == r, "ncclCommInitAll rank %d", rank);
  }

  /* ncclCommAbort from another thread stops a collective that cannot complete (the other
   * ranks never call it), long before MK_TIMEOUT_MS. */
  if (nranks > 1) {
    float *x;
    CUDA(cudaMalloc((void **)&x, 1 << 20));
    NCCL(ncclAllReduce(x, x, 1 << 18, ncclFloat, ncclSum, comms[0], streams[0]));
    pthread_t th;
    pthread_create(&th, NULL, abort_later, comms[0]);
    double t0 = now();
    cudaError_t e = cudaStreamSynchronize(streams[0]);
    double waited = now() - t0;
    pthread_join(th, NULL);
    CHECK(waited < 10.0, "the stream waited %.1f s after ncclCommAbort (%s)", waited, cudaGetErrorString(e));
    for (int r = 1; r < nranks; r++) NCCL(ncclCommAbort(comms[r]));
  } else {
    NCCL(ncclCommDestroy(comms[0]));
  }
  return checks_summary(nranks == 1 ? "libmkernel-nccl GPU suite, 1 rank" : "libmkernel-nccl GPU suite");
}
