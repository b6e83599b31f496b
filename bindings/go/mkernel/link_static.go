//go:build mkernel_static

package mkernel

// Links libmkernel.a (go build -tags mkernel_static): the program needs no libmkernel.so.

// #cgo pkg-config: mkernel-static
import "C"
