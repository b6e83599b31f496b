package mkernel

/*
#include <mkernel.h>

// Device pointers and streams cross from Go as integers; the casts live here.
static inline void *mk_go_ptr(uintptr_t p) { return (void *)p; }
static inline int32_t *mk_go_i32(uintptr_t p) { return (int32_t *)p; }
static inline float *mk_go_f32(uintptr_t p) { return (float *)p; }
static inline mkStream_t mk_go_stream(uintptr_t s) { return (mkStream_t)s; }
*/
import "C"

import "unsafe"

func ptr(p DevicePtr) unsafe.Pointer { return C.mk_go_ptr(C.uintptr_t(p)) }
func i32(p DevicePtr) *C.int32_t     { return C.mk_go_i32(C.uintptr_t(p)) }
func f32(p DevicePtr) *C.float       { return C.mk_go_f32(C.uintptr_t(p)) }
func stream(s Stream) C.mkStream_t {
	return C.mk_go_stream(C.uintptr_t(s))
}

// The operations below are stream-ordered and asynchronous: they return once the kernel is
// enqueued on stream. Their rules (shapes, alignment, in-place use, rounding) are those of
// the C functions of the same name in include/mkernel.h. Every rank must make the same
// sequence of calls on a communicator.

// AllGather gathers sendcount elements from every rank into recv (nranks*sendcount
// elements, rank r's at offset r*sendcount) (mkAllGather).
func (c *Comm) AllGather(send, recv DevicePtr, sendcount int, dtype DataType, s Stream) error {
	sz := sizes{op: "mkAllGather"}
	n := sz.of("sendcount", sendcount)
	if sz.err != nil {
		return sz.err
	}
	return c.do("mkAllGather", func(h C.mkComm_t) C.mkResult_t {
		return C.mkAllGather(ptr(send), ptr(recv), n, C.mkDataType_t(dtype), h, stream(s))
	})
}

// ReduceScatter reduces send (nranks*recvcount elements) over the ranks with op and leaves
// block r of the result in rank r's recv (mkReduceScatter).
func (c *Comm) ReduceScatter(send, recv DevicePtr, recvcount int, dtype DataType, op RedOp, s Stream) error {
	sz := sizes{op: "mkReduceScatter"}
	n := sz.of("recvcount", recvcount)
	if sz.err != nil {
		return sz.err
	}
	return c.do("mkReduceScatter", func(h C.mkComm_t) C.mkResult_t {
		return C.mkReduceScatter(ptr(send), ptr(recv), n, C.mkDataType_t(dtype), C.mkRedOp_t(op), h, stream(s))
	})
}

// AllReduce reduces count elements over the ranks with op; every rank receives the whole
// result (mkAllReduce). In place when send == recv.
func (c *Comm) AllReduce(send, recv DevicePtr, count int, dtype DataType, op RedOp, s Stream) error {
	sz := sizes{op: "mkAllReduce"}
	n := sz.of("count", count)
	if sz.err != nil {
		return sz.err
	}
	return c.do("mkAllReduce", func(h C.mkComm_t) C.mkResult_t {
		return C.mkAllReduce(ptr(send), ptr(recv), n, C.mkDataType_t(dtype), C.mkRedOp_t(op), h, stream(s))
	})
}

// AllGatherGemm gathers A's rows ([m/nranks, k] per rank) and computes C = A·Bᵀ ([m, n]);
// gatheredA (0: none) receives the gathered A (mkAllGatherGemm).
func (c *Comm) AllGatherGemm(a, b, out, gatheredA DevicePtr, m, n, k int, dtype DataType, s Stream) error {
	sz := sizes{op: "mkAllGatherGemm"}
	cm, cn, ck := sz.of("m", m), sz.of("n", n), sz.of("k", k)
	if sz.err != nil {
		return sz.err
	}
	return c.do("mkAllGatherGemm", func(h C.mkComm_t) C.mkResult_t {
		return C.mkAllGatherGemm(ptr(a), ptr(b), ptr(out), ptr(gatheredA), cm, cn, ck, C.mkDataType_t(dtype), h, stream(s))
	})
}

// AllGatherScaledGemm gathers A's fp8 rows ([m/nranks, k] per rank, abType Float8e4m3) with
// their fp32 scales (scaleA: this rank's, as mode says) and computes
// C = (A·scaleA)(B·scaleB)ᵀ ([m, n] of cType) on every rank (mkAllGatherScaledGemm).
func (c *Comm) AllGatherScaledGemm(a, scaleA, b, scaleB, out DevicePtr, m, n, k int, abType, cType DataType, mode ScaleMode, s Stream) error {
	sz := sizes{op: "mkAllGatherScaledGemm"}
	cm, cn, ck := sz.of("m", m), sz.of("n", n), sz.of("k", k)
	if sz.err != nil {
		return sz.err
	}
	return c.do("mkAllGatherScaledGemm", func(h C.mkComm_t) C.mkResult_t {
		return C.mkAllGatherScaledGemm(ptr(a), f32(scaleA), ptr(b), f32(scaleB), ptr(out), cm, cn, ck,
			C.mkDataType_t(abType), C.mkDataType_t(cType), C.mkScaleMode_t(mode), h, stream(s))
	})
}

// GemmReduceScatter computes the sum over ranks of A·Bᵀ and leaves this rank's
// [m/nranks, n] rows in out (mkGemmReduceScatter).
func (c *Comm) GemmReduceScatter(a, b, out DevicePtr, m, n, k int, dtype DataType, s Stream) error {
	sz := sizes{op: "mkGemmReduceScatter"}
	cm, cn, ck := sz.of("m", m), sz.of("n", n), sz.of("k", k)
	if sz.err != nil {
		return sz.err
	}
	return c.do("mkGemmReduceScatter", func(h C.mkComm_t) C.mkResult_t {
		return C.mkGemmReduceScatter(ptr(a), ptr(b), ptr(out), cm, cn, ck, C.mkDataType_t(dtype), h, stream(s))
	})
}

// GemmAllReduce computes the sum over ranks of A·Bᵀ ([m, n]) on every rank (mkGemmAllReduce).
func (c *Comm) GemmAllReduce(a, b, out DevicePtr, m, n, k int, dtype DataType, s Stream) error {
	sz := sizes{op: "mkGemmAllReduce"}
	cm, cn, ck := sz.of("m", m), sz.of("n", n), sz.of("k", k)
	if sz.err != nil {
		return sz.err
	}
	return c.do("mkGemmAllReduce", func(h C.mkComm_t) C.mkResult_t {
		return C.mkGemmAllReduce(ptr(a), ptr(b), ptr(out), cm, cn, ck, C.mkDataType_t(dtype), h, stream(s))
	})
}

// ScaledGemmReduceScatter computes the sum over ranks of (A·scaleA)(B·scaleB)ᵀ with fp8 A
// [m, k] and B [n, k] (this rank's K slice, abType Float8e4m3) and their fp32 scales (as mode
// says), and leaves this rank's [m/nranks, n] rows of cType in out (mkScaledGemmReduceScatter).
func (c *Comm) ScaledGemmReduceScatter(a, scaleA, b, scaleB, out DevicePtr, m, n, k int, abType, cType DataType, mode ScaleMode, s Stream) error {
	sz := sizes{op: "mkScaledGemmReduceScatter"}
	cm, cn, ck := sz.of("m", m), sz.of("n", n), sz.of("k", k)
	if sz.err != nil {
		return sz.err
	}
	return c.do("mkScaledGemmReduceScatter", func(h C.mkComm_t) C.mkResult_t {
		return C.mkScaledGemmReduceScatter(ptr(a), f32(scaleA), ptr(b), f32(scaleB), ptr(out), cm, cn, ck,
			C.mkDataType_t(abType), C.mkDataType_t(cType), C.mkScaleMode_t(mode), h, stream(s))
	})
}

// ScaledGemmAllReduce computes the sum over ranks of (A·scaleA)(B·scaleB)ᵀ ([m, n] of cType)
// on every rank, as ScaledGemmReduceScatter takes its operands (mkScaledGemmAllReduce).
func (c *Comm) ScaledGemmAllReduce(a, scaleA, b, scaleB, out DevicePtr, m, n, k int, abType, cType DataType, mode ScaleMode, s Stream) error {
	sz := sizes{op: "mkScaledGemmAllReduce"}
	cm, cn, ck := sz.of("m", m), sz.of("n", n), sz.of("k", k)
	if sz.err != nil {
		return sz.err
	}
	return c.do("mkScaledGemmAllReduce", func(h C.mkComm_t) C.mkResult_t {
		return C.mkScaledGemmAllReduce(ptr(a), f32(scaleA), ptr(b), f32(scaleB), ptr(out), cm, cn, ck,
			C.mkDataType_t(abType), C.mkDataType_t(cType), C.mkScaleMode_t(mode), h, stream(s))
	})
}

// MoeLayoutBytes is the size of the layout buffer MoeDispatchGemm fills (mkMoeLayoutBytes).
func MoeLayoutBytes(tokens, topk, recvCapacity int) (int, error) {
	sz := sizes{op: "mkMoeLayoutBytes"}
	t, k, r := sz.of("tokens", tokens), sz.of("topk", topk), sz.of("recvCapacity", recvCapacity)
	if sz.err != nil {
		return 0, sz.err
	}
	var bytes C.size_t
	err := call("mkMoeLayoutBytes", nil, func() C.mkResult_t { return C.mkMoeLayoutBytes(t, k, r, &bytes) })
	return int(bytes), err
}

// MoeShape is the shape shared by MoeDispatchGemm and MoeGemmCombine.
type MoeShape struct {
	Tokens, Hidden, Ffn, Topk, Experts, RecvCapacity int
	DType                                            DataType
}

func (m MoeShape) c(sz *sizes) (t, hd, f, k, e, r C.size_t) {
	return sz.of("Tokens", m.Tokens), sz.of("Hidden", m.Hidden), sz.of("Ffn", m.Ffn), sz.of("Topk", m.Topk),
		sz.of("Experts", m.Experts), sz.of("RecvCapacity", m.RecvCapacity)
}

// MoeDispatchArgs are the buffers of MoeDispatchGemm: X [tokens, hidden], TopkIdx
// [tokens, topk] int32, W1 [localExperts, ffn, hidden], Y [recvCapacity, ffn], RecvCounts
// [localExperts+1] int32, Layout (MoeLayoutBytes bytes).
type MoeDispatchArgs struct {
	X, TopkIdx, W1, Y, RecvCounts, Layout DevicePtr
	MoeShape
}

// MoeDispatchGemm sends each token to the ranks owning its experts and computes the
// experts' first GEMM there, in one kernel (mkMoeDispatchGemm).
func (c *Comm) MoeDispatchGemm(a MoeDispatchArgs, s Stream) error {
	sz := sizes{op: "mkMoeDispatchGemm"}
	t, hd, f, k, e, r := a.c(&sz)
	if sz.err != nil {
		return sz.err
	}
	return c.do("mkMoeDispatchGemm", func(h C.mkComm_t) C.mkResult_t {
		return C.mkMoeDispatchGemm(ptr(a.X), i32(a.TopkIdx), ptr(a.W1), ptr(a.Y), i32(a.RecvCounts), ptr(a.Layout),
			t, hd, f, k, e, r, C.mkDataType_t(a.DType), h, stream(s))
	})
}

// MoeActivation is the activation MoeDispatchGemmWithOptions fuses into the first GEMM's
// epilogue (mkMoeOptions_t.activation).
type MoeActivation int

const (
	// MoeActNone: Y = X·W1ᵀ, W1 [localExperts, ffn, hidden].
	MoeActNone MoeActivation = C.MK_MOE_ACT_NONE
	// MoeActSilu (SwiGLU) and MoeActGelu (GeGLU, GELU's erf form): W1 is the gated weight
	// [localExperts, 2·ffn, hidden] (per expert the ffn gate rows, then the ffn up rows) and
	// Y [recvCapacity, ffn] = act(X·W_gateᵀ)·(X·W_upᵀ). MoeShape.Ffn is Y's ffn.
	MoeActSilu MoeActivation = C.MK_MOE_ACT_SILU
	MoeActGelu MoeActivation = C.MK_MOE_ACT_GELU
)

// MoeOptions are MoeDispatchGemmWithOptions' choices. ExpertCapacity > 0 is drop mode:
// each rank sends each expert at most ExpertCapacity of its rows, the first in token
// order, and DropCounts ([experts] int32) receives this rank's dropped rows per expert.
// ExpertCapacity 0 is no-drop mode (DropCounts may then be 0). Activation (the zero value
// MoeActNone) is fused into the first GEMM.
type MoeOptions struct {
	ExpertCapacity int
	DropCounts     DevicePtr
	Activation     MoeActivation
}

// MoeDropArgs is the name MoeOptions had when it held the drop mode alone.
type MoeDropArgs = MoeOptions

// options is the mkMoeOptions_t of d: the library's initializer (mkMoeOptionsInit) with
// d's fields set.
func (d MoeOptions) options() (C.mkMoeOptions_t, error) {
	var o C.mkMoeOptions_t
	if err := call("mkMoeOptionsInit", nil, func() C.mkResult_t { return C.mkMoeOptionsInit(&o) }); err != nil {
		return o, err
	}
	if d.ExpertCapacity != 0 {
		o.capacityPolicy = C.MK_MOE_DROP
		o.expertCapacity = C.longlong(d.ExpertCapacity)
	}
	o.activation = C.int(d.Activation)
	return o, nil
}

// MoeDispatchGemmWithOptions is MoeDispatchGemm with a capacity policy and an activation
// (mkMoeDispatchGemmWithOptions, options from mkMoeOptionsInit). An unknown Activation is
// mkInvalidArgument from the library, naming the field.
func (c *Comm) MoeDispatchGemmWithOptions(a MoeDispatchArgs, d MoeOptions, s Stream) error {
	const op = "mkMoeDispatchGemmWithOptions"
	sz := sizes{op: op}
	t, hd, f, k, e, r := a.c(&sz)
	if sz.err != nil {
		return sz.err
	}
	o, err := d.options()
	if err != nil {
		return err
	}
	return c.do(op, func(h C.mkComm_t) C.mkResult_t {
		return C.mkMoeDispatchGemmWithOptions(ptr(a.X), i32(a.TopkIdx), ptr(a.W1), ptr(a.Y), i32(a.RecvCounts),
			i32(d.DropCounts), ptr(a.Layout), t, hd, f, k, e, r, C.mkDataType_t(a.DType), &o, h, stream(s))
	})
}

// MoeCombineArgs are the buffers of MoeGemmCombine: YAct [recvCapacity, ffn], W2
// [localExperts, hidden, ffn], TopkWeights [tokens, topk] float32, Layout (as filled by
// MoeDispatchGemm), Out [tokens, hidden].
type MoeCombineArgs struct {
	YAct, W2, TopkWeights, Layout, Out DevicePtr
	MoeShape
}

// MoeGemmCombine computes the experts' second GEMM and brings each token's weighted sum
// back to its rank, in one kernel (mkMoeGemmCombine).
func (c *Comm) MoeGemmCombine(a MoeCombineArgs, s Stream) error {
	sz := sizes{op: "mkMoeGemmCombine"}
	t, hd, f, k, e, r := a.c(&sz)
	if sz.err != nil {
		return sz.err
	}
	return c.do("mkMoeGemmCombine", func(h C.mkComm_t) C.mkResult_t {
		return C.mkMoeGemmCombine(ptr(a.YAct), ptr(a.W2), f32(a.TopkWeights), ptr(a.Layout), ptr(a.Out),
			t, hd, f, k, e, r, C.mkDataType_t(a.DType), h, stream(s))
	})
}

// RingAttentionArgs are the buffers and shape of RingAttention: Q [batch, seqLocal,
// numHeads, headDim], K and V [batch, seqLocal, numKvHeads, headDim], Out like Q, Lse
// [batch, numHeads, seqLocal] float32 (the log-sum-exp a backward pass needs).
type RingAttentionArgs struct {
	Q, K, V, Out, Lse                              DevicePtr
	Batch, SeqLocal, NumHeads, NumKvHeads, HeadDim int
	SoftmaxScale                                   float32
	Causal                                         bool
	DType                                          DataType
}

// RingAttention is context-parallel attention forward: K/V shards travel around the ranks
// inside the kernel while each rank's queries attend to them (mkRingAttention).
func (c *Comm) RingAttention(a RingAttentionArgs, s Stream) error {
	sz := sizes{op: "mkRingAttention"}
	b, sl, nh, nkv, hd := sz.of("Batch", a.Batch), sz.of("SeqLocal", a.SeqLocal), sz.of("NumHeads", a.NumHeads),
		sz.of("NumKvHeads", a.NumKvHeads), sz.of("HeadDim", a.HeadDim)
	if sz.err != nil {
		return sz.err
	}
	causal := C.int32_t(0)
	if a.Causal {
		causal = 1
	}
	return c.do("mkRingAttention", func(h C.mkComm_t) C.mkResult_t {
		return C.mkRingAttention(ptr(a.Q), ptr(a.K), ptr(a.V), ptr(a.Out), f32(a.Lse), b, sl, nh, nkv, hd,
			C.float(a.SoftmaxScale), causal, C.mkDataType_t(a.DType), h, stream(s))
	})
}

// RingAttentionBackwardArgs are the buffers and shape of RingAttentionBackward: Q, K, V,
// Out and Lse as RingAttention took and produced them, DOut the gradient of Out (like Q),
// and the gradients it writes: DQ like Q, DK and DV like K and V.
type RingAttentionBackwardArgs struct {
	Q, K, V, Out, DOut, Lse, DQ, DK, DV            DevicePtr
	Batch, SeqLocal, NumHeads, NumKvHeads, HeadDim int
	SoftmaxScale                                   float32
	Causal                                         bool
	DType                                          DataType
}

// RingAttentionBackward is the backward pass of RingAttention: dK/dV travel around the
// ranks with K/V inside the kernel, so each rank ends with the gradients of its own shard
// (mkRingAttentionBackward).
func (c *Comm) RingAttentionBackward(a RingAttentionBackwardArgs, s Stream) error {
	sz := sizes{op: "mkRingAttentionBackward"}
	b, sl, nh, nkv, hd := sz.of("Batch", a.Batch), sz.of("SeqLocal", a.SeqLocal), sz.of("NumHeads", a.NumHeads),
		sz.of("NumKvHeads", a.NumKvHeads), sz.of("HeadDim", a.HeadDim)
	if sz.err != nil {
		return sz.err
	}
	causal := C.int32_t(0)
	if a.Causal {
		causal = 1
	}
	return c.do("mkRingAttentionBackward", func(h C.mkComm_t) C.mkResult_t {
		return C.mkRingAttentionBackward(ptr(a.Q), ptr(a.K), ptr(a.V), ptr(a.Out), ptr(a.DOut), f32(a.Lse),
			ptr(a.DQ), ptr(a.DK), ptr(a.DV), b, sl, nh, nkv, hd, C.float(a.SoftmaxScale), causal,
			C.mkDataType_t(a.DType), h, stream(s))
	})
}

// Gemm computes C = A·Bᵀ (A [m, k], B [n, k], C [m, n], row-major) with the engine every
// fused operation is built on, on the calling thread's current context (mkGemm).
func Gemm(a, b, out DevicePtr, m, n, k int, dtype DataType, s Stream) error {
	sz := sizes{op: "mkGemm"}
	cm, cn, ck := sz.of("m", m), sz.of("n", n), sz.of("k", k)
	if sz.err != nil {
		return sz.err
	}
	return call("mkGemm", nil, func() C.mkResult_t {
		return C.mkGemm(ptr(a), ptr(b), ptr(out), cm, cn, ck, C.mkDataType_t(dtype), stream(s))
	})
}

// ScaledGemm computes C = (A·scaleA)(B·scaleB)ᵀ with fp8 A [m, k] and B [n, k] (row-major,
// abType Float8e4m3), fp32 scales in device memory as mode says, and C [m, n] of cType
// (Bfloat16 or Float16), on the calling thread's current context (mkScaledGemm).
func ScaledGemm(a, scaleA, b, scaleB, out DevicePtr, m, n, k int, abType, cType DataType, mode ScaleMode, s Stream) error {
	sz := sizes{op: "mkScaledGemm"}
	cm, cn, ck := sz.of("m", m), sz.of("n", n), sz.of("k", k)
	if sz.err != nil {
		return sz.err
	}
	return call("mkScaledGemm", nil, func() C.mkResult_t {
		return C.mkScaledGemm(ptr(a), f32(scaleA), ptr(b), f32(scaleB), ptr(out), cm, cn, ck,
			C.mkDataType_t(abType), C.mkDataType_t(cType), C.mkScaleMode_t(mode), stream(s))
	})
}

// ScaledGemmMixed is ScaledGemm with A's and B's types given apart: aType Float8e4m3 or
// Float8e5m2 (the gradient of an fp8 backward), bType Float8e4m3 (mkScaledGemmMixed).
func ScaledGemmMixed(a, scaleA, b, scaleB, out DevicePtr, m, n, k int, aType, bType, cType DataType, mode ScaleMode, s Stream) error {
	sz := sizes{op: "mkScaledGemmMixed"}
	cm, cn, ck := sz.of("m", m), sz.of("n", n), sz.of("k", k)
	if sz.err != nil {
		return sz.err
	}
	return call("mkScaledGemmMixed", nil, func() C.mkResult_t {
		return C.mkScaledGemmMixed(ptr(a), f32(scaleA), ptr(b), f32(scaleB), ptr(out), cm, cn, ck,
			C.mkDataType_t(aType), C.mkDataType_t(bType), C.mkDataType_t(cType), C.mkScaleMode_t(mode), stream(s))
	})
}
