// Hello all-reduce from Go: two ranks of one communicator in this process
// (mkernel.CommInitAll), on GPUs 0 and 1, or both on GPU 0 when there is one. Rank r holds
// (r+1)·(1 + i%5) at element i; after AllReduce(Sum) every rank holds 3·(1 + i%5).
// Exit 0: correct; 77: no GPU.
//
// The binding takes device pointers and streams from whatever CUDA binding a program uses;
// this example gets them from the CUDA driver through examples/common/cuda_min.h.
package main

/*
#cgo CFLAGS: -I${SRCDIR}/../common
#cgo LDFLAGS: -ldl
#include <stdint.h>
#include "cuda_min.h"

static int gpu_count(const char **why) { return cuda_min_gpu_count(why); }
static int set_device(int dev) { return cuda_min_set_device(dev); }
static int alloc(CUdeviceptr *p, size_t bytes) { return CU(cuda_min.cuMemAlloc(p, bytes)); }
static int upload(CUdeviceptr dst, const void *src, size_t bytes) { return CU(cuda_min.cuMemcpyHtoD(dst, src, bytes)); }
static int download(void *dst, CUdeviceptr src, size_t bytes) { return CU(cuda_min.cuMemcpyDtoH(dst, src, bytes)); }
static int stream_create(CUstream *s) { return CU(cuda_min.cuStreamCreate(s, CU_STREAM_NON_BLOCKING)); }
static int stream_sync(CUstream s) { return CU(cuda_min.cuStreamSynchronize(s)); }
static void release(CUdeviceptr p, CUstream s) { cuda_min.cuMemFree(p); cuda_min.cuStreamDestroy(s); }
static uintptr_t stream_handle(CUstream s) { return (uintptr_t)s; }
*/
import "C"

import (
	"fmt"
	"os"
	"runtime"
	"unsafe"

	"mkernel"
)

const (
	nranks      = 2
	count       = 1 << 20
	exitSkipped = 77
)

func main() {
	// The current CUDA context belongs to the OS thread: keep this goroutine on one.
	runtime.LockOSThread()
	os.Exit(run())
}

func run() int {
	var why *C.char
	ngpus := int(C.gpu_count(&why))
	devices := []int{0, 0}
	if ngpus > 1 {
		devices[1] = 1
	}
	comms, err := mkernel.CommInitAll(devices)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		if ngpus == 0 {
			fmt.Printf("allreduce_go: SKIPPED (%s)\n", C.GoString(why))
			return exitSkipped
		}
		return 1
	}
	defer func() {
		for _, c := range comms {
			c.Destroy()
		}
	}()

	bufs := make([]C.CUdeviceptr, nranks)
	streams := make([]C.CUstream, nranks)
	host := make([]float32, count)
	bytes := C.size_t(count * 4)
	for r := 0; r < nranks; r++ {
		for i := range host {
			host[i] = float32((r + 1) * (1 + i%5))
		}
		if C.set_device(C.int(devices[r])) != 0 || C.alloc(&bufs[r], bytes) != 0 ||
			C.upload(bufs[r], unsafe.Pointer(&host[0]), bytes) != 0 || C.stream_create(&streams[r]) != 0 {
			return 1
		}
		defer C.release(bufs[r], streams[r])
	}
	for r, c := range comms { // every rank enqueues before any waits
		buf := mkernel.DevicePtr(bufs[r])
		if err := c.AllReduce(buf, buf, count, mkernel.Float32, mkernel.Sum, mkernel.Stream(C.stream_handle(streams[r]))); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	wrong := 0
	for r, c := range comms {
		if C.set_device(C.int(devices[r])) != 0 || C.stream_sync(streams[r]) != 0 ||
			C.download(unsafe.Pointer(&host[0]), bufs[r], bytes) != 0 {
			return 1
		}
		if err := c.AsyncError(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		for i, v := range host {
			if v != float32(3*(1+i%5)) {
				wrong++
			}
		}
	}
	status := "OK"
	if wrong > 0 {
		status = "FAILED"
	}
	fmt.Printf("allreduce_go: %s: %d ranks on GPUs %d,%d summed %d floats, %d wrong\n", status, nranks, devices[0], devices[1], count, wrong)
	if wrong > 0 {
		return 1
	}
	return 0
}
