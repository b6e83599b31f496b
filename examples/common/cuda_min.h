/* The few CUDA driver API calls the examples need, loaded from libcuda.so.1 at run time
 * (as mkernel itself loads it), so that the examples build without the CUDA toolkit.
 *
 * Call cuda_min_load() (or cuda_min_gpu_count()) first, then the driver functions through
 * the cuda_min struct, checked with CU(...). Device pointers are CUdeviceptr; CUstream is
 * the same type as cudaStream_t and mkStream_t. */
#ifndef MKERNEL_EXAMPLES_CUDA_MIN_H
#define MKERNEL_EXAMPLES_CUDA_MIN_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Exit code of an example that could not run here (the automake / ctest convention). */
#define EXIT_SKIPPED 77

typedef int CUresult; /* CUDA_SUCCESS is 0 */
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef unsigned long long CUdeviceptr;

enum { CU_ATTR_CC_MAJOR = 75, CU_ATTR_CC_MINOR = 76, CU_STREAM_NON_BLOCKING = 1 };

static struct {
  void *lib;
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuDeviceGetCount)(int *);
  CUresult (*cuDeviceGet)(CUdevice *, int);
  CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
  CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
  CUresult (*cuStreamCreate)(CUstream *, unsigned int);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuGetErrorString)(CUresult, const char **);
  const char *unavailable; /* why the driver cannot be used; NULL once it can */
} cuda_min;

static inline int cuda_min_fail(const char *call, CUresult r) {
  const char *text = NULL;
  if (cuda_min.cuGetErrorString) cuda_min.cuGetErrorString(r, &text);
  fprintf(stderr, "%s failed: CUDA error %d (%s)\n", call, r, text ? text : "no description");
  return -1;
}

/* CU(cuda_min.cuMemAlloc(&ptr, bytes)): 0, or -1 after printing the call and the error. */
#define CU(call) cuda_min_check(#call, (call))

static inline int cuda_min_check(const char *call, CUresult r) { return r == 0 ? 0 : cuda_min_fail(call, r); }

/* Loads libcuda.so.1 and runs cuInit once. 0 when the driver is usable. */
static inline int cuda_min_load(void) {
  static int loaded = 0;
  if (loaded) return cuda_min.unavailable ? -1 : 0;
  loaded = 1;
  cuda_min.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!cuda_min.lib) {
    cuda_min.unavailable = "libcuda.so.1 (the NVIDIA driver) cannot be loaded";
    return -1;
  }
  struct { void **slot; const char *name; } syms[] = {
      {(void **)&cuda_min.cuInit, "cuInit"},
      {(void **)&cuda_min.cuDeviceGetCount, "cuDeviceGetCount"},
      {(void **)&cuda_min.cuDeviceGet, "cuDeviceGet"},
      {(void **)&cuda_min.cuDeviceGetAttribute, "cuDeviceGetAttribute"},
      {(void **)&cuda_min.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"},
      {(void **)&cuda_min.cuCtxSetCurrent, "cuCtxSetCurrent"},
      {(void **)&cuda_min.cuMemAlloc, "cuMemAlloc_v2"},
      {(void **)&cuda_min.cuMemFree, "cuMemFree_v2"},
      {(void **)&cuda_min.cuMemcpyHtoD, "cuMemcpyHtoD_v2"},
      {(void **)&cuda_min.cuMemcpyDtoH, "cuMemcpyDtoH_v2"},
      {(void **)&cuda_min.cuStreamCreate, "cuStreamCreate"},
      {(void **)&cuda_min.cuStreamSynchronize, "cuStreamSynchronize"},
      {(void **)&cuda_min.cuStreamDestroy, "cuStreamDestroy_v2"},
      {(void **)&cuda_min.cuGetErrorString, "cuGetErrorString"},
  };
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
    *syms[i].slot = dlsym(cuda_min.lib, syms[i].name);
    if (!*syms[i].slot) {
      cuda_min.unavailable = "libcuda.so.1 lacks a driver API function the examples use";
      return -1;
    }
  }
  if (cuda_min.cuInit(0) != 0) {
    cuda_min.unavailable = "cuInit failed (no GPU visible to this process?)";
    return -1;
  }
  return 0;
}

/* How many of the devices 0, 1, ... (counted from 0, stopping at the first other one) are
 * GPUs mkernel's kernels run on: compute capability 9.0 (H100, H200). 0 when there are
 * none, with the reason in *why. */
static inline int cuda_min_gpu_count(const char **why) {
  int count = 0, usable = 0;
  if (cuda_min_load() != 0) {
    *why = cuda_min.unavailable;
    return 0;
  }
  if (cuda_min.cuDeviceGetCount(&count) != 0 || count == 0) {
    *why = "the driver sees no GPU";
    return 0;
  }
  for (int i = 0; i < count; i++) {
    CUdevice dev;
    int major = 0, minor = 0;
    if (cuda_min.cuDeviceGet(&dev, i) != 0) break;
    cuda_min.cuDeviceGetAttribute(&major, CU_ATTR_CC_MAJOR, dev);
    cuda_min.cuDeviceGetAttribute(&minor, CU_ATTR_CC_MINOR, dev);
    if (major != 9 || minor != 0) break;
    usable++;
  }
  if (usable == 0) *why = "GPU 0 is not an sm_90 GPU (H100/H200), which mkernel's kernels need";
  return usable;
}

/* Makes device `ordinal`'s primary context current on this thread (as cudaSetDevice does);
 * mkernel uses the same primary context. */
static inline int cuda_min_set_device(int ordinal) {
  CUdevice dev;
  CUcontext ctx;
  if (cuda_min_load() != 0) {
    fprintf(stderr, "cuda_min_set_device: %s\n", cuda_min.unavailable);
    return -1;
  }
  if (CU(cuda_min.cuDeviceGet(&dev, ordinal)) != 0) return -1;
  if (CU(cuda_min.cuDevicePrimaryCtxRetain(&ctx, dev)) != 0) return -1;
  return CU(cuda_min.cuCtxSetCurrent(ctx));
}

#ifdef __cplusplus
}
#endif

#endif /* MKERNEL_EXAMPLES_CUDA_MIN_H */
