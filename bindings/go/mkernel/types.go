package mkernel

// #include <mkernel.h>
import "C"

import "fmt"

// DataType is an element type (mkDataType_t, numbered as ncclDataType_t).
type DataType int32

const (
	Int8     DataType = C.mkInt8
	Uint8    DataType = C.mkUint8
	Int32    DataType = C.mkInt32
	Uint32   DataType = C.mkUint32
	Int64    DataType = C.mkInt64
	Uint64   DataType = C.mkUint64
	Float16  DataType = C.mkFloat16
	Float32  DataType = C.mkFloat32
	Float64  DataType = C.mkFloat64
	Bfloat16 DataType = C.mkBfloat16
	// Float8e4m3 and Float8e5m2 are gathered by AllGather and reduced by ReduceScatter and
	// AllReduce within a node (in float, rounded once); ScaledGemm multiplies Float8e4m3.
	// No unscaled GEMM takes them.
	Float8e4m3 DataType = C.mkFloat8e4m3
	Float8e5m2 DataType = C.mkFloat8e5m2
)

var dataTypeNames = [...]string{"mkInt8", "mkUint8", "mkInt32", "mkUint32", "mkInt64", "mkUint64", "mkFloat16",
	"mkFloat32", "mkFloat64", "mkBfloat16", "mkFloat8e4m3", "mkFloat8e5m2"}

func (t DataType) String() string {
	if t >= 0 && int(t) < len(dataTypeNames) {
		return dataTypeNames[t]
	}
	return fmt.Sprintf("mkDataType_t(%d)", int32(t))
}

// Size is the size of one element in bytes (0 for an unknown type).
func (t DataType) Size() int {
	switch t {
	case Int8, Uint8, Float8e4m3, Float8e5m2:
		return 1
	case Float16, Bfloat16:
		return 2
	case Int32, Uint32, Float32:
		return 4
	case Int64, Uint64, Float64:
		return 8
	}
	return 0
}

// ScaleMode says how ScaledGemm's fp32 scales apply (mkScaleMode_t).
type ScaleMode int32

const (
	// ScaleTensor: one scale for all of A, one for all of B.
	ScaleTensor ScaleMode = C.mkScaleTensor
	// ScaleRowwise: one scale per row of A (M of them) and per row of B (N of them).
	ScaleRowwise ScaleMode = C.mkScaleRowwise
	// ScaleBlock: one per row of A per 128 of K ([K/128][M]), one per 128 x 128 block of B
	// ([K/128][ceil(N/128)]), row-major; K a multiple of 128.
	ScaleBlock ScaleMode = C.mkScaleBlock
)

var scaleModeNames = [...]string{"mkScaleTensor", "mkScaleRowwise", "mkScaleBlock"}

func (m ScaleMode) String() string {
	if m >= 0 && int(m) < len(scaleModeNames) {
		return scaleModeNames[m]
	}
	return fmt.Sprintf("mkScaleMode_t(%d)", int32(m))
}

// RedOp is a reduction operator (mkRedOp_t, numbered as ncclRedOp_t).
type RedOp int32

const (
	Sum  RedOp = C.mkSum
	Prod RedOp = C.mkProd
	Max  RedOp = C.mkMax
	Min  RedOp = C.mkMin
	Avg  RedOp = C.mkAvg
)

var redOpNames = [...]string{"mkSum", "mkProd", "mkMax", "mkMin", "mkAvg"}

func (op RedOp) String() string {
	if op >= 0 && int(op) < len(redOpNames) {
		return redOpNames[op]
	}
	return fmt.Sprintf("mkRedOp_t(%d)", int32(op))
}

// DevicePtr is an address in device memory (a CUdeviceptr), from whatever CUDA binding
// the program uses.
type DevicePtr uintptr

// Stream is a CUDA stream handle (CUstream / cudaStream_t); 0 is the legacy default stream.
type Stream uintptr

// HeaderVersion is MK_VERSION_CODE of the header this package was built against:
// major*10000 + minor*100 + patch.
const HeaderVersion = C.MK_VERSION_CODE

// Version is the library's version (mkGetVersion), in HeaderVersion's encoding.
func Version() (int, error) {
	var v C.int
	err := call("mkGetVersion", nil, func() C.mkResult_t { return C.mkGetVersion(&v) })
	return int(v), err
}

// sizes converts Go ints to size_t, keeping the first negative one as an error.
type sizes struct {
	op  string
	err error
}

func (s *sizes) of(name string, v int) C.size_t {
	if v < 0 && s.err == nil {
		s.err = argumentError(s.op, "%s is negative (%d)", name, v)
	}
	return C.size_t(v)
}
