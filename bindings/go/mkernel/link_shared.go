//go:build !mkernel_static

package mkernel

// Links libmkernel.so. At run time the loader must find libmkernel.so.<major>: build with
// CGO_LDFLAGS="-Wl,-rpath,$(pkg-config --variable=libdir mkernel)", set LD_LIBRARY_PATH, or
// build with -tags mkernel_static.

// #cgo pkg-config: mkernel
import "C"
