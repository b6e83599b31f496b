// Package mkernel is the Go binding of mkernel, fused communication + compute CUDA kernels
// with an NCCL-shaped C ABI (include/mkernel.h), through cgo and pkg-config.
//
// A communicator (Comm) is made on every rank from one UniqueID (GetUniqueID on one rank,
// passed to the others out of band) with CommInitRank, or for several ranks in one process
// with CommInitAll. Operations take device pointers (DevicePtr) and a CUDA stream (Stream),
// are stream-ordered and never synchronise the host.
//
// Every function returns an error value; a failed library call gives an *Error carrying the
// result code and the library's message. The Result codes are sentinels:
//
//	if errors.Is(err, mkernel.InvalidArgument) { ... }
//	var e *mkernel.Error
//	if errors.As(err, &e) { log.Print(e.Code, e.Message) }
//
// The message of a failed call is read on the OS thread that made the call (the library
// keeps it per thread, or per communicator), so it never belongs to another goroutine's call.
//
// Linking: pkg-config finds mkernel (set PKG_CONFIG_PATH=<prefix>/lib/pkgconfig); the build
// tag mkernel_static links libmkernel.a instead of libmkernel.so. See docs/go.md.
package mkernel
