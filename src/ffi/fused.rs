//! Fused communication + compute operations.

use super::{mkComm_t, with_comm};
use crate::cuda::sys::CUstream;
use crate::error::{mkResult_t, MkError};
use crate::types::{RawDataType, RawScaleMode};
use std::ffi::c_void;
use std::os::raw::{c_int, c_longlong, c_uint};

/// AllGather of A's rows across the ranks, then C = A_gathered · Bᵀ, in one persistent
/// kernel: the rows of each peer are consumed by the GEMM as soon as their chunk arrives,
/// this rank's own rows first.
///
/// - `A`: this rank's rows, [M / nranks, K]; rank r holds rows [r·M/n, (r+1)·M/n).
/// - `B`: [N, K] (the nn.Linear weight layout), the same on every rank.
/// - `C`: [M, N], the full product (every rank gets all of C).
/// - `gatheredA`: receives the gathered [M, K] A when non-NULL (for the backward pass).
/// - `M` counts all gathered rows (the unfused GEMM's M); N, K as in that GEMM.
/// - `dtype`: mkBfloat16 or mkFloat16 for A, B, C and gatheredA; fp32 accumulation, C
///   rounded once. Matrices are row-major and densely packed.
///
/// Rules (mkInvalidArgument, with the rule in mkGetLastError): M divisible by nranks, K a
/// positive multiple of 8, N a multiple of 8, every pointer 16-byte aligned device memory
/// of this rank's device. The gathered A (M·K elements) must fit in the communicator's
/// workspace (MK_WORKSPACE_BYTES / mkConfig_t.workspaceBytes), else mkInvalidUsage names
/// the size needed. Needs an sm_90 GPU.
///
/// Stream-ordered and asynchronous, capturable in a CUDA graph. Every rank must call it
/// with the same M, N, K and dtype. A peer that does not arrive within MK_TIMEOUT_MS
/// makes the kernel stop; mkCommGetAsyncError then reports mkTimeout (or mkRemoteError on
/// the ranks that were stopped by the failing one) and C is undefined.
///
/// Across nodes (a communicator spanning hosts, or MK_RANKS_PER_NODE): the same semantics
/// and results (the gathered rows are copied, never summed, so C is as on one node); each
/// rank's rows cross the network once per other node, to the rank with the same local
/// index there (through the proxy, issued from the kernel), and NVLink to the other ranks of
/// each node; the GEMM takes its own rows, then its node's, then the other nodes' as they
/// arrive. Needs nodes of equal size (at most 8 nodes of at most 8 ranks), else
/// mkInvalidUsage. A node that fails or leaves makes the others stop with mkRemoteError or
/// mkTimeout.
#[no_mangle]
pub unsafe extern "C" fn mkAllGatherGemm(
    A: *const c_void,
    B: *const c_void,
    C: *mut c_void,
    gatheredA: *mut c_void,
    M: usize,
    N: usize,
    K: usize,
    dtype: RawDataType,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    with_comm(comm, "mkAllGatherGemm", |c| {
        let args = crate::ops::dense::ag_gemm::validate_args(
            A as u64,
            B as u64,
            C as u64,
            gatheredA as u64,
            M,
            N,
            K,
            dtype,
            c.nranks,
            c.rank,
        )?;
        crate::ops::dense::ag_gemm::all_gather_gemm(c, &args, stream)
    })
}

/// AllGather of A's fp8 rows and their scales across the ranks, then the scaled GEMM
/// C = (A_gathered·sA)(B·sB)ᵀ, in one persistent kernel: mkAllGatherGemm's overlap (each
/// peer's rows consumed as soon as their chunk arrives, this rank's own first) with
/// mkScaledGemm's arithmetic, moving one byte per element of A instead of two.
///
/// - `A`: this rank's rows, [M / nranks, K] of `abType` (mkFloat8e4m3), row-major; rank r
///   holds rows [r·M/n, (r+1)·M/n).
/// - `scaleA`: this rank's scales of its rows (fp32 device memory), as `scaleMode` says:
///   mkScaleTensor: one value, which scales this rank's rows (each rank's shard is
///   dequantized by its own scale; ranks that pass the same value get one scale for the
///   whole gathered A, torch's per-tensor convention); mkScaleRowwise: M / nranks values, one
///   per row; mkScaleBlock: [K/128][M / nranks], one per row per 128 of K (mkScaledGemm's
///   block layout for this rank's rows). The scales travel with the rows.
/// - `B`, `scaleB`: [N, K] e4m3 and its scales, local (a column-parallel weight shard), as
///   mkScaledGemm takes them (one value; N values; [K/128][ceil(N/128)]).
/// - `C`: [M, N] of `cType` (mkBfloat16 or mkFloat16), the full product on every rank.
/// - `M` counts all gathered rows; N, K as in mkScaledGemm.
///
/// Arithmetic as mkScaledGemm's (fp32 sums promoted every 128 of K, scaled as the mode says,
/// C rounded once); rank r's rows of C are what mkScaledGemm gives for rank r's rows and
/// scales. Scale values are not checked (NaN or infinite scales give NaN or infinite C).
///
/// Rules (mkInvalidArgument, the rule named in mkGetLastError, nothing written): abType
/// mkFloat8e4m3 (mkFloat8e5m2 is refused: this op's kernels read e4m3 A and B; e5m2 A is
/// mkScaledGemmMixed's); cType mkBfloat16 or
/// mkFloat16; scaleMode a mkScaleMode_t; M divisible by nranks; K a positive multiple of 16
/// (of 128 with block scales); N a multiple of 8; A, B and C non-NULL and 16-byte aligned;
/// scaleA and scaleB non-NULL and 4-byte aligned; all device memory of this rank's device.
/// The gathered rows and scales (M·K bytes, and 4·M bytes, or 4·M·K/128 with block scales)
/// must fit in the communicator's workspace (MK_WORKSPACE_BYTES /
/// mkConfig_t.workspaceBytes), else mkInvalidUsage names the size needed. One node only: a
/// communicator across nodes gets mkInvalidUsage. Needs an sm_90 GPU.
///
/// Stream-ordered and asynchronous, capturable in a CUDA graph. Every rank must call it
/// with the same M, N, K, types and mode. A peer that does not arrive within MK_TIMEOUT_MS
/// makes the kernel stop; mkCommGetAsyncError then reports mkTimeout (or mkRemoteError)
/// and C is undefined. With one rank, mkScaledGemm.
#[no_mangle]
pub unsafe extern "C" fn mkAllGatherScaledGemm(
    A: *const c_void,
    scaleA: *const f32,
    B: *const c_void,
    scaleB: *const f32,
    C: *mut c_void,
    M: usize,
    N: usize,
    K: usize,
    abType: RawDataType,
    cType: RawDataType,
    scaleMode: RawScaleMode,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    use crate::ops::dense::ag_scaled_gemm::{all_gather_scaled_gemm, validate_args, AgScaledGemmCall};
    with_comm(comm, "mkAllGatherScaledGemm", |c| {
        let call = AgScaledGemmCall {
            a: A as u64,
            scale_a: scaleA as u64,
            b: B as u64,
            scale_b: scaleB as u64,
            c: C as u64,
            m: M,
            n: N,
            k: K,
        };
        let args = validate_args(&call, abType, cType, scaleMode, c.nranks, c.rank)?;
        all_gather_scaled_gemm(c, &args, stream)
    })
}

/// C = Σ over ranks of A·Bᵀ, reduce-scattered by rows, in one persistent kernel: partial
/// tiles are summed as soon as every rank has produced them.
///
/// - `A`: [M, K] with this rank's K columns (K is this rank's share of the contraction).
/// - `B`: [N, K], this rank's K columns of the weight.
/// - `C`: this rank's [M / nranks, N] rows of the sum: rank r gets rows [r·M/n, (r+1)·M/n).
/// - `dtype`: mkBfloat16 or mkFloat16. Rounding: each rank's partial product is accumulated
///   in fp32 and rounded once to `dtype`; the n partials are then added in fp32 in rank
///   order 0..n-1 and the sum rounded once to `dtype`. Across nodes the partials are first
///   added within each node (fp32, rank order, rounded once to `dtype`), then the node
///   partials in node order (fp32, rounded once).
///
/// Rules (mkInvalidArgument): M divisible by nranks; N and K multiples of 8; pointers
/// 16-byte aligned device memory. The partial product (M·N elements) must fit in the
/// communicator's fused-op region (MK_WORKSPACE_BYTES), else mkInvalidUsage names the size.
/// With one rank, the GEMM alone (C = A·Bᵀ). Stream-ordered, capturable in a CUDA graph;
/// waits bounded by MK_TIMEOUT_MS (then mkCommGetAsyncError reports mkTimeout /
/// mkRemoteError and C is undefined).
/// Across nodes (hosts, or MK_RANKS_PER_NODE): partials are summed within each node over
/// NVLink and one node partial per owner crosses the network, GPU i to GPU i, from inside
/// the kernel; the fused-op region then also holds 2·nodes·(M/nranks)·N elements of node
/// partials.
#[no_mangle]
pub unsafe extern "C" fn mkGemmReduceScatter(
    A: *const c_void,
    B: *const c_void,
    C: *mut c_void,
    M: usize,
    N: usize,
    K: usize,
    dtype: RawDataType,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    use crate::ops::dense::gemm_reduce::{gemm_reduce, validate, Reduction};
    with_comm(comm, "mkGemmReduceScatter", |c| {
        let args = validate(Reduction::Scatter, A as u64, B as u64, C as u64, M, N, K, dtype, c.nranks)?;
        gemm_reduce(c, &args, stream)
    })
}

/// C = Σ over ranks of A·Bᵀ on every rank, in one persistent kernel. Small M (≤ 256, or M
/// not a multiple of 128·nranks): one-shot, every rank reads
/// every rank's partial tile as soon as it is signalled and sums it (lowest latency). Larger
/// M: two-phase, each row block is summed once by the rank owning it ([r·M/n, (r+1)·M/n))
/// and copied by the others. With one rank, the GEMM alone.
///
/// - `A`: [M, K] with this rank's K columns; `B`: [N, K] likewise; `C`: [M, N] on every rank.
/// - Any M ≥ 0 (decode shapes included). Rounding as mkGemmReduceScatter; every sum is
///   formed in the same order (rank 0..n-1) whoever forms it, so all ranks' C are bitwise
///   identical.
///
/// Rules, errors and stream semantics as mkGemmReduceScatter (no divisibility of M); the
/// two-phase path also keeps the reduced rows in the fused-op region (2·M·N elements in all).
/// Across nodes: reduce-scatter as mkGemmReduceScatter across nodes (owners hold whole
/// 128-row blocks, ⌈M/128/nranks⌉ each), then each sum is sent back over the network once
/// per node and over NVLink to the node's ranks; C is still bitwise identical on every
/// rank. The fused-op region holds 2·M·N + 2·nodes·rows·N elements (rows per owner).
#[no_mangle]
pub unsafe extern "C" fn mkGemmAllReduce(
    A: *const c_void,
    B: *const c_void,
    C: *mut c_void,
    M: usize,
    N: usize,
    K: usize,
    dtype: RawDataType,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    use crate::ops::dense::gemm_reduce::{gemm_reduce, validate, Reduction};
    with_comm(comm, "mkGemmAllReduce", |c| {
        let args = validate(Reduction::All, A as u64, B as u64, C as u64, M, N, K, dtype, c.nranks)?;
        gemm_reduce(c, &args, stream)
    })
}

/// fp8 GEMM + ReduceScatter: C = Σ over ranks of (A·sA)(B·sB)ᵀ, reduce-scattered by rows, in
/// one persistent kernel: mkGemmReduceScatter's overlap (partial tiles summed as soon as every
/// rank has produced them) with mkScaledGemm's arithmetic on each rank's K slice.
///
/// - `A`: [M, K] of `abType` (mkFloat8e4m3) with this rank's K columns; `scaleA` its fp32
///   scales as `scaleMode` says: mkScaleTensor one value, mkScaleRowwise M values (one per
///   row), mkScaleBlock [K/128][M] (one per row per 128 of K) — mkScaledGemm's layouts, for
///   this rank's A.
/// - `B`: [N, K] e4m3, this rank's K columns of the weight; `scaleB` likewise (one value; N
///   values; [K/128][ceil(N/128)], one per 128 × 128 block).
/// - `C`: this rank's [M / nranks, N] rows of the sum, of `cType` (mkBfloat16 or
///   mkFloat16): rank r gets rows [r·M/n, (r+1)·M/n).
/// - K is this rank's share of the contraction; every rank's scales are its own (a rank's
///   per-tensor scale scales only its own slice).
///
/// Rounding: each rank's partial product is mkScaledGemm's (fp32 sums promoted every 128 of
/// K, scaled as the mode says) rounded once to `cType`; the n partials are then added in
/// fp32 in rank order 0..n-1 and the sum rounded once to `cType`. Scale values are not
/// checked (NaN or infinite scales give NaN or infinite C).
///
/// Rules (mkInvalidArgument, the rule named in mkGetLastError, nothing written): abType
/// mkFloat8e4m3 (mkFloat8e5m2 is refused: this op's kernels multiply e4m3 A and B); cType
/// mkBfloat16 or mkFloat16; scaleMode a mkScaleMode_t; M divisible by nranks; K a positive
/// multiple of 16 (of 128 with block scales); N a multiple of 8; A, B and C non-NULL and
/// 16-byte aligned; scaleA and scaleB non-NULL and 4-byte aligned; all device memory of
/// this rank's device. The partial product (M·N elements of cType) must fit in the
/// communicator's fused-op region (MK_WORKSPACE_BYTES / mkConfig_t.workspaceBytes), else
/// mkInvalidUsage names the size. One node only: a communicator across nodes gets
/// mkInvalidUsage. With one rank, mkScaledGemm. Needs an sm_90 GPU.
///
/// Stream-ordered and asynchronous, capturable in a CUDA graph. Every rank must call it with
/// the same M, N, K, types and mode. A peer that does not arrive within MK_TIMEOUT_MS makes
/// the kernel stop; mkCommGetAsyncError then reports mkTimeout (or mkRemoteError) and C is
/// undefined.
#[no_mangle]
pub unsafe extern "C" fn mkScaledGemmReduceScatter(
    A: *const c_void,
    scaleA: *const f32,
    B: *const c_void,
    scaleB: *const f32,
    C: *mut c_void,
    M: usize,
    N: usize,
    K: usize,
    abType: RawDataType,
    cType: RawDataType,
    scaleMode: RawScaleMode,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    use crate::ops::dense::gemm_reduce::Reduction;
    let call = scaled_gemm_reduce_call(A, scaleA, B, scaleB, C, M, N, K);
    scaled_gemm_reduce(Reduction::Scatter, &call, abType, cType, scaleMode, comm, stream)
}

/// fp8 GEMM + AllReduce: C = Σ over ranks of (A·sA)(B·sB)ᵀ on every rank, in one persistent
/// kernel: mkGemmAllReduce's regimes (one-shot for small M, or M not a multiple of
/// 128·nranks; two-phase above) with mkScaledGemm's arithmetic on each rank's K slice.
///
/// - `A`, `scaleA`, `B`, `scaleB`, `abType`, `scaleMode`: as mkScaledGemmReduceScatter.
/// - `C`: [M, N] of `cType` on every rank. Any M ≥ 0 (decode shapes included).
///
/// Rounding as mkScaledGemmReduceScatter; every sum is formed in rank order 0..n-1 whoever
/// forms it, so all ranks' C are bitwise identical. Rules, errors and stream semantics as
/// mkScaledGemmReduceScatter, without M's divisibility; the two-phase path also keeps the
/// reduced rows in the fused-op region (2·M·N elements of cType in all). One node only.
/// With one rank, mkScaledGemm.
#[no_mangle]
pub unsafe extern "C" fn mkScaledGemmAllReduce(
    A: *const c_void,
    scaleA: *const f32,
    B: *const c_void,
    scaleB: *const f32,
    C: *mut c_void,
    M: usize,
    N: usize,
    K: usize,
    abType: RawDataType,
    cType: RawDataType,
    scaleMode: RawScaleMode,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    use crate::ops::dense::gemm_reduce::Reduction;
    let call = scaled_gemm_reduce_call(A, scaleA, B, scaleB, C, M, N, K);
    scaled_gemm_reduce(Reduction::All, &call, abType, cType, scaleMode, comm, stream)
}

/// The pointers and sizes of a scaled GEMM + reduction call.
#[allow(clippy::too_many_arguments)] // the C call's arguments
fn scaled_gemm_reduce_call(
    a: *const c_void,
    scale_a: *const f32,
    b: *const c_void,
    scale_b: *const f32,
    c: *mut c_void,
    m: usize,
    n: usize,
    k: usize,
) -> crate::ops::dense::gemm_reduce_scaled::ScaledGemmReduceCall {
    crate::ops::dense::gemm_reduce_scaled::ScaledGemmReduceCall {
        a: a as u64,
        scale_a: scale_a as u64,
        b: b as u64,
        scale_b: scale_b as u64,
        c: c as u64,
        m,
        n,
        k,
    }
}

/// mkScaledGemmReduceScatter's and mkScaledGemmAllReduce's body: validate, then run on `comm`.
fn scaled_gemm_reduce(
    reduction: crate::ops::dense::gemm_reduce::Reduction,
    call: &crate::ops::dense::gemm_reduce_scaled::ScaledGemmReduceCall,
    ab_type: RawDataType,
    c_type: RawDataType,
    mode: RawScaleMode,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    use crate::ops::dense::gemm_reduce_scaled::{op_name, scaled_gemm_reduce, validate_args};
    with_comm(comm, op_name(reduction), |c| {
        let args = validate_args(reduction, call, ab_type, c_type, mode, c.nranks, c.rank)?;
        scaled_gemm_reduce(c, &args, stream)
    })
}

/// Bytes of the layout buffer that mkMoeDispatchGemm fills and mkMoeGemmCombine reads:
/// 4·(4 + 3·tokens·topk + 6·recvCapacity/128 + 1025) (int32 words: per (token, choice) the
/// owner rank and the row there, per receive-buffer row block its expert, order, sources,
/// order run, expert segment and rows in use, the send list and its per-(expert,
/// destination) starts). Sizes whose layout would not fit in size_t (or whose words the
/// kernels cannot index with int32) are mkInvalidArgument naming tokens, topk and
/// recvCapacity; `*bytes` is then left as it was.
#[no_mangle]
pub unsafe extern "C" fn mkMoeLayoutBytes(
    tokens: usize,
    topk: usize,
    recvCapacity: usize,
    bytes: *mut usize,
) -> mkResult_t {
    super::guard(None, "mkMoeLayoutBytes", || {
        let size = crate::ops::moe::checked_layout_offsets(tokens, topk, recvCapacity)
            .map(|l| l.words)
            .filter(|&words| words <= i32::MAX as usize)
            .map(|words| words * 4)
            .ok_or_else(|| {
                MkError::invalid_argument(format!(
                    "tokens = {tokens}, topk = {topk}, recvCapacity = {recvCapacity}: the layout would hold more than 2^31 \
                     int32 words (3·tokens·topk + 6·⌈recvCapacity/128⌉ + 1029 words)"
                ))
            })?;
        super::write_out(bytes, size, "bytes")
    })
}

/// MoE token dispatch fused with the experts' first GEMM, in one persistent kernel.
///
/// Each rank holds `tokens` tokens `x` [tokens, hidden] and their routing `topkIdx`
/// [tokens, topk] (int32 expert ids in [0, experts), −1 = no expert). Rank r owns experts
/// [r·E/n, (r+1)·E/n) (E_local = E/n of them) and their weights `w1` [E_local, ffn, hidden]
/// (nn.Linear layout). Each token is copied to every rank that owns one of its experts;
/// there it appears once per (token, expert) (an expert listed twice for a token is one
/// row), and the owner computes Y = x_row · W1_eᵀ for its local expert e.
///
/// - `y` [recvCapacity, ffn]: rows grouped by local expert, in each expert by source rank
///   then token index; expert e's segment starts at row Σ_{e' < e} roundup(recvCounts[e'], 128)
///   and holds recvCounts[e] rows; the rows between segments (padding) are unspecified.
/// - `recvCounts` [E_local + 1] int32: rows per local expert; the last entry is the
///   smallest recvCapacity that fits this routing on every rank.
/// - `layout` (mkMoeLayoutBytes bytes, 16-byte aligned device memory): filled here, read by
///   mkMoeGemmCombine; keep it until then.
/// - Rounding: fp32 accumulation, Y rounded once to `dtype` (mkBfloat16 or mkFloat16).
///
/// Counts and offsets are computed on the device (the ranks exchange per-expert counts
/// inside the kernel): no host synchronisation, capturable in a CUDA graph. Every rank must
/// call it with the same hidden, ffn, topk, experts, recvCapacity and dtype (tokens may
/// differ).
///
/// Overflow: if some rank's rows exceed recvCapacity, every rank finds it in the kernel
/// (each sees every rank's counts) and the call moves nothing: `y` and the rows in the
/// receive buffers are left as they were, and a mkMoeGemmCombine on this layout writes
/// nothing either (`out` keeps its contents). recvCounts is still written, so
/// recvCounts[E_local] > recvCapacity tells the caller, on every rank alike, that the call
/// overflowed and what recvCapacity to call again with. The overflow is not an error of the
/// communicator: mkCommGetAsyncError stays mkSuccess and the next call runs (a larger
/// recvCapacity may need a larger fused-op region: see below).
///
/// Rules (mkInvalidArgument): hidden and ffn positive multiples of 128;
/// recvCapacity a multiple of 128; E a multiple of nranks, at most 1024; 1 ≤ topk ≤ 32;
/// x, w1, y 16-byte aligned. The receive buffer (recvCapacity·hidden elements + 64 KiB)
/// must fit in the workspace's fused-op region (MK_WORKSPACE_BYTES), else mkInvalidUsage
/// names the size. A peer that does not arrive within MK_TIMEOUT_MS stops the kernel:
/// mkCommGetAsyncError reports mkTimeout / mkRemoteError and the outputs are undefined.
#[no_mangle]
pub unsafe extern "C" fn mkMoeDispatchGemm(
    x: *const c_void,
    topkIdx: *const i32,
    w1: *const c_void,
    y: *mut c_void,
    recvCounts: *mut i32,
    layout: *mut c_void,
    tokens: usize,
    hidden: usize,
    ffn: usize,
    topk: usize,
    experts: usize,
    recvCapacity: usize,
    dtype: RawDataType,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    use crate::ops::moe::{dispatch_gemm, validate_dispatch, MoeDims};
    with_comm(comm, "mkMoeDispatchGemm", |c| {
        let dims = MoeDims { tokens, hidden, ffn, top_k: topk, experts, capacity: recvCapacity, nranks: c.nranks };
        let args = validate_dispatch(
            x as u64,
            topkIdx as u64,
            w1 as u64,
            y as u64,
            recvCounts as u64,
            layout as u64,
            dims,
            dtype,
        )?;
        dispatch_gemm(c, &args, true, stream)
    })
}

/// `mkMoeOptions_t.magic`; set by `MK_MOE_OPTIONS_INITIALIZER`.
pub const MK_MOE_OPTIONS_MAGIC: c_uint = 0x6d6b_6d6f;

/// Options of mkMoeDispatchGemmWithOptions, versioned as mkConfig_t is: always start from
/// `MK_MOE_OPTIONS_INITIALIZER` (or mkMoeOptionsInit), then set the fields you want.
/// `size`, `magic` and `version` let one library accept the struct of any header of its
/// major version: a smaller struct's missing fields keep the initializer's values; a
/// larger one (at most 1024 bytes) is accepted when every field this library does not
/// know is 0; `size` below 16, a wrong `magic`, `version` 0 or of another major version:
/// mkInvalidArgument.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct mkMoeOptions_t {
    /// sizeof(mkMoeOptions_t) as the caller compiled it.
    pub size: usize,
    /// Must be MK_MOE_OPTIONS_MAGIC.
    pub magic: c_uint,
    /// MK_VERSION_CODE of the header the caller compiled against.
    pub version: c_uint,
    /// MK_MOE_NO_DROP (0, the initializer's): every row travels, and a call whose rows
    /// exceed recvCapacity moves nothing (see mkMoeDispatchGemm's overflow). MK_MOE_DROP
    /// (1), Megatron's capacity factor with its "position" policy: each rank sends each
    /// expert at most `expertCapacity` of its rows, the first in token order (a token
    /// listing an expert twice takes one place); the rest are dropped.
    pub capacityPolicy: c_int,
    /// Drop mode: rows each rank may send to each expert, in [1, 2^31) (Megatron's
    /// ceil(tokens · topk / experts · capacityFactor) for this rank's tokens). 0 in no-drop
    /// mode (the initializer's).
    pub expertCapacity: c_longlong,
    /// MK_MOE_ACT_NONE (0, the initializer's): `y` = x · w1ᵀ, `w1` [E_local, ffn, hidden].
    /// MK_MOE_ACT_SILU (1, SwiGLU) or MK_MOE_ACT_GELU (2, GeGLU; GELU's erf form, as
    /// torch.nn.functional.gelu): `w1` is [E_local, 2·ffn, hidden] in Megatron's fused fc1
    /// layout (per expert, rows [0, ffn) the gate, rows [ffn, 2·ffn) the up projection) and
    /// `y` [recvCapacity, ffn] = act(x · w_gateᵀ) · (x · w_upᵀ), computed in fp32 and
    /// rounded once.
    pub activation: c_int,
    /// Must be 0 (the initializer's). Keeps the struct free of tail padding: a library of
    /// an older header reads a newer struct's bytes past its own as fields that must be
    /// unset, and padding would hold whatever the caller's stack held.
    pub reserved: c_int,
}

impl mkMoeOptions_t {
    /// The value of `MK_MOE_OPTIONS_INITIALIZER` for this library's header.
    pub fn initializer() -> mkMoeOptions_t {
        mkMoeOptions_t {
            size: std::mem::size_of::<mkMoeOptions_t>(),
            magic: MK_MOE_OPTIONS_MAGIC,
            version: crate::version_code() as c_uint,
            capacityPolicy: crate::ops::moe::MK_MOE_NO_DROP,
            expertCapacity: 0,
            activation: crate::ops::moe::MK_MOE_ACT_NONE,
            reserved: 0,
        }
    }
}

/// How a caller's `mkMoeOptions_t` of any version is read; every field's unset value is 0.
const MOE_OPTIONS: super::versioned::VersionedStruct = super::versioned::VersionedStruct {
    arg: "options",
    type_name: "mkMoeOptions_t",
    initializer: "MK_MOE_OPTIONS_INITIALIZER",
    init_fn: "mkMoeOptionsInit",
    magic: MK_MOE_OPTIONS_MAGIC,
    fields: &[
        (std::mem::offset_of!(mkMoeOptions_t, magic), 4),
        (std::mem::offset_of!(mkMoeOptions_t, version), 4),
        (std::mem::offset_of!(mkMoeOptions_t, capacityPolicy), 4),
        (std::mem::offset_of!(mkMoeOptions_t, expertCapacity), 8),
        (std::mem::offset_of!(mkMoeOptions_t, activation), 4),
        (std::mem::offset_of!(mkMoeOptions_t, reserved), 4),
    ],
    unset_word: |w| w == 0,
};
const _: () = assert!(std::mem::offset_of!(mkMoeOptions_t, capacityPolicy) == super::versioned::HEADER_BYTES);

/// Fills `*options` with what `MK_MOE_OPTIONS_INITIALIZER` gives: this library's size,
/// magic and version, no-drop mode. For callers that cannot use the macro (cgo, ctypes).
#[no_mangle]
pub unsafe extern "C" fn mkMoeOptionsInit(options: *mut mkMoeOptions_t) -> mkResult_t {
    super::guard(None, "mkMoeOptionsInit", || super::write_out(options, mkMoeOptions_t::initializer(), "options"))
}

/// The capacity policy and activation a caller's options (NULL: the initializer's) and
/// `dropCounts` ask for.
///
/// # Safety
/// `options`, when non-NULL, must point to at least `options->size` readable bytes.
pub unsafe fn moe_options(
    options: *const mkMoeOptions_t,
    drop_counts: u64,
) -> crate::error::Result<(crate::ops::moe::CapacityPolicy, crate::ops::moe::Activation)> {
    let o = if options.is_null() {
        mkMoeOptions_t::initializer()
    } else {
        MOE_OPTIONS.read(options, mkMoeOptions_t::initializer())?
    };
    let policy = crate::ops::moe::CapacityPolicy::from_raw(o.capacityPolicy, o.expertCapacity, drop_counts)?;
    Ok((policy, crate::ops::moe::Activation::from_raw(o.activation, o.reserved)?))
}

/// The capacity policy a caller's options ask for (`moe_options`).
///
/// # Safety
/// As `moe_options`.
pub unsafe fn capacity_policy(
    options: *const mkMoeOptions_t,
    drop_counts: u64,
) -> crate::error::Result<crate::ops::moe::CapacityPolicy> {
    moe_options(options, drop_counts).map(|(policy, _)| policy)
}

/// mkMoeDispatchGemm with options (`mkMoeOptions_t`; NULL = the initializer's, which is
/// mkMoeDispatchGemm itself) and one more output:
///
/// - `dropCounts` [experts] int32: per expert, how many of this rank's rows (distinct
///   (token, expert) pairs) the drop rule dropped; zeros in no-drop mode. Required in drop
///   mode, may be NULL in no-drop mode. Written also when the call overflows.
///
/// In drop mode a dropped choice has no row at its owner: `y` and recvCounts hold the kept
/// rows only, and mkMoeGemmCombine adds nothing for it (a token whose every choice was
/// dropped gets 0). Each expert then receives at most nranks · expertCapacity rows, so a
/// recvCapacity of E_local · roundup(nranks · expertCapacity, 128) never overflows.
/// Everything is decided on the device: capturable in a CUDA graph. Each rank caps its own
/// rows, so ranks may pass different expertCapacity values (Megatron's capacity follows
/// each rank's token count).
///
/// With `options->activation` MK_MOE_ACT_SILU (SwiGLU) or MK_MOE_ACT_GELU (GeGLU), `w1` is
/// the gated weight [E_local, 2·ffn, hidden] (Megatron's fused fc1 layout: per expert the
/// ffn gate rows, then the ffn up rows) and `y` [recvCapacity, ffn] = act(gate) · up, formed
/// in the GEMM's epilogue (fp32, one rounding): the unactivated [rows, 2·ffn] never goes to
/// memory. Drop mode and the gated weight combine freely.
///
/// Rules (mkInvalidArgument, before launch): capacityPolicy MK_MOE_NO_DROP or MK_MOE_DROP;
/// drop mode needs expertCapacity in [1, 2^31) and dropCounts; no-drop mode needs
/// expertCapacity 0; dropCounts 4-byte aligned device memory; activation one of
/// MK_MOE_ACT_NONE, MK_MOE_ACT_SILU, MK_MOE_ACT_GELU and reserved 0; a gated `w1` whose
/// allocation ends before E_local · 2·ffn · hidden elements (e.g. a plain [E_local, ffn,
/// hidden] weight) is refused where the driver knows the allocation's extent (memory
/// suballocated from a larger block, as PyTorch's caching allocator does, is checked only
/// against that block); the rest as mkMoeDispatchGemm.
#[no_mangle]
pub unsafe extern "C" fn mkMoeDispatchGemmWithOptions(
    x: *const c_void,
    topkIdx: *const i32,
    w1: *const c_void,
    y: *mut c_void,
    recvCounts: *mut i32,
    dropCounts: *mut i32,
    layout: *mut c_void,
    tokens: usize,
    hidden: usize,
    ffn: usize,
    topk: usize,
    experts: usize,
    recvCapacity: usize,
    dtype: RawDataType,
    options: *const mkMoeOptions_t,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    use crate::ops::moe::{dispatch_gemm, validate_dispatch, MoeDims};
    with_comm(comm, "mkMoeDispatchGemmWithOptions", |c| {
        let dims = MoeDims { tokens, hidden, ffn, top_k: topk, experts, capacity: recvCapacity, nranks: c.nranks };
        let mut args = validate_dispatch(
            x as u64,
            topkIdx as u64,
            w1 as u64,
            y as u64,
            recvCounts as u64,
            layout as u64,
            dims,
            dtype,
        )?;
        let (policy, activation) = moe_options(options, dropCounts as u64)?;
        crate::ops::moe::validate_activation(&dims, activation)?;
        args.policy = policy;
        args.activation = activation;
        dispatch_gemm(c, &args, true, stream)
    })
}

/// The experts' second GEMM fused with the way back, in one persistent kernel.
///
/// On the owner: Z = Y'_e · W2_eᵀ for its rows (`yAct` [recvCapacity, ffn] in the layout of
/// mkMoeDispatchGemm's `y`, e.g. the activation of it; `w2` [E_local, hidden, ffn]),
/// rounded to `dtype`. Each source rank then pulls its tokens' rows from the owners and
/// writes `out` [tokens, hidden]: out[t] = Σ_j topkWeights[t, j] · Z[t, topkIdx[t, j]],
/// summed in fp32 in j order 0..topk−1 (an expert listed twice counts twice; a token with no
/// expert gets 0), rounded once. `topkWeights` [tokens, topk] fp32; `layout` as filled by the
/// preceding mkMoeDispatchGemm of this communicator with the same tokens, hidden, topk,
/// experts and recvCapacity (`ffn` may differ: the layout does not depend on it). Rules,
/// errors and stream semantics as mkMoeDispatchGemm.
#[no_mangle]
pub unsafe extern "C" fn mkMoeGemmCombine(
    yAct: *const c_void,
    w2: *const c_void,
    topkWeights: *const f32,
    layout: *const c_void,
    out: *mut c_void,
    tokens: usize,
    hidden: usize,
    ffn: usize,
    topk: usize,
    experts: usize,
    recvCapacity: usize,
    dtype: RawDataType,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    use crate::ops::moe::{gemm_combine, validate_combine, MoeDims};
    with_comm(comm, "mkMoeGemmCombine", |c| {
        let dims = MoeDims { tokens, hidden, ffn, top_k: topk, experts, capacity: recvCapacity, nranks: c.nranks };
        let args =
            validate_combine(yAct as u64, w2 as u64, topkWeights as u64, layout as u64, out as u64, dims, dtype)?;
        gemm_combine(c, &args, true, stream)
    })
}

/// Context-parallel attention forward (ring attention) in one persistent kernel: every
/// rank's queries attend to the keys and values of the whole global sequence, whose
/// shards are spread over the ranks; the K/V blocks travel between ranks inside the
/// kernel, overlapped with the attention on the block in hand.
///
/// - `q`: [batch, seqLocal, numHeads, headDim]; `k`, `v`: [batch, seqLocal, numKvHeads,
///   headDim] (GQA: query head h uses K/V head h / (numHeads / numKvHeads)); `out`: like
///   `q`; `lse`: [batch, numHeads, seqLocal] fp32, the natural-log log-sum-exp of each
///   query's scaled scores (what a backward pass needs). All densely packed, row-major.
/// - Layout of the global sequence of S = nranks · seqLocal tokens. Non-causal
///   (`causal` = 0): contiguous shards, rank r holds tokens [r·seqLocal, (r+1)·seqLocal).
///   Causal (`causal` = 1): zigzag, for load balance: the sequence is cut into 2·nranks
///   chunks of seqLocal / 2 tokens and rank r holds chunk r followed by chunk
///   2·nranks − 1 − r (local token i < seqLocal/2 is global r·seqLocal/2 + i, the others
///   (2·nranks − 1 − r)·seqLocal/2 + i − seqLocal/2). Query at global position i sees
///   keys at positions ≤ i.
/// - out = softmax(softmaxScale · q·kᵀ [masked]) · v with fp32 scores, fp32 softmax and
///   accumulation; the probabilities are rounded to `dtype` before the product with v
///   (as FlashAttention does) and out is rounded once. The exponentials use the GPU's
///   exp2 approximation (relative error about 2^-22), and a probability below 2^-126 of
///   its row's maximum counts as 0 (far below the output's rounding).
/// - `dtype`: mkBfloat16 or mkFloat16 for q, k, v, out; `headDim` 64 or 128.
///
/// Rules (mkInvalidArgument, with the rule in mkGetLastError): numKvHeads divides
/// numHeads; causal needs an even seqLocal; softmaxScale finite and positive; q, k, v, out
/// 16-byte aligned and lse 4-byte aligned device memory of this rank's device. With more
/// than one rank this rank's K and V (2 · batch · seqLocal · numKvHeads · headDim
/// elements) must fit in the communicator's fused-op region (MK_WORKSPACE_BYTES /
/// mkConfig_t.workspaceBytes), else mkInvalidUsage names the size needed. Needs an sm_90 GPU.
///
/// Stream-ordered and asynchronous, capturable in a CUDA graph. Every rank must call it
/// with the same shape, scale, causal flag and dtype. A peer that does not arrive within
/// MK_TIMEOUT_MS makes the kernel stop; mkCommGetAsyncError then reports mkTimeout (or
/// mkRemoteError on the ranks stopped by the failing one) and out/lse are undefined.
#[no_mangle]
pub unsafe extern "C" fn mkRingAttention(
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    out: *mut c_void,
    lse: *mut f32,
    batch: usize,
    seqLocal: usize,
    numHeads: usize,
    numKvHeads: usize,
    headDim: usize,
    softmaxScale: f32,
    causal: i32,
    dtype: RawDataType,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    use crate::ops::attention::ring_attention::{ring_attention, validate_args};
    with_comm(comm, "mkRingAttention", |c| {
        let args = validate_args(
            q as u64,
            k as u64,
            v as u64,
            out as u64,
            lse as u64,
            batch,
            seqLocal,
            numHeads,
            numKvHeads,
            headDim,
            softmaxScale,
            causal,
            dtype,
            c.nranks,
            c.rank,
        )?;
        ring_attention(c, &args, stream)
    })
}

/// The gradients of mkRingAttention (context-parallel attention backward) in one
/// persistent kernel: dq of this rank's queries, and dk/dv of this rank's K/V shard, whose
/// gradient sums the contributions of every rank's queries. The K/V blocks travel between
/// ranks inside the kernel as in the forward, and each block's dK/dV accumulator (fp32)
/// travels with it, so the sum ends on the block's owner.
///
/// - Layouts, GQA, dtypes, head dims and the causal zigzag are mkRingAttention's: `q`,
///   `out`, `dout`, `dq`: [batch, seqLocal, numHeads, headDim]; `k`, `v`, `dk`, `dv`:
///   [batch, seqLocal, numKvHeads, headDim]; `lse`: [batch, numHeads, seqLocal] fp32. `out`
///   and `lse` are what mkRingAttention returned for q, k, v (the same softmaxScale and
///   causal flag); `dout` is the gradient of the loss with respect to `out`.
/// - With P = exp(softmaxScale · q·kᵀ [masked] − lse): delta = rowsum(dout ∘ out) (in fp32:
///   each run of 8 elements of d a chain of fused multiply-adds from zero, the runs added in
///   order of d), dP = dout·vᵀ, dS = P ∘ (dP − delta),
///   dv = Pᵀ·dout, dk = softmaxScale · dSᵀ·q, dq = softmaxScale · dS·k. Scores, P, dP and
///   dS are fp32; P and dS are rounded to `dtype` before their products (as
///   FlashAttention does), which accumulate in fp32; dq, dk, dv are rounded once. The
///   exponentials use the GPU's exp2 approximation (relative error about 2^-22) with
///   lse · log2(e) formed in fp32.
/// - Summation order, fixed: dq over ring steps (K/V of ranks r, r − 1, …), within a step
///   over 64-key tiles in order; dk/dv of a 128-key block over the ranks b − 1, b − 2, …,
///   b (b the block's owner), each rank's partial added to the running sum as its 64-query
///   tiles come (query heads of a GQA group in order, each its tiles in order). No
///   atomics: results are bitwise reproducible from run to run for the same inputs, rank
///   count and shape (and the same on every GPU of one model).
///
/// Rules as mkRingAttention's (mkInvalidArgument, with the rule), and dout, dq, dk, dv
/// 16-byte aligned device memory of this rank's device. The communicator's fused-op region
/// (MK_WORKSPACE_BYTES / mkConfig_t.workspaceBytes) must hold the row values, 8 ·
/// batch · numHeads · ⌈seqLocal / 64⌉ · 64 bytes, and with n > 1 ranks also this rank's K
/// and V (2 · batch · seqLocal · numKvHeads · headDim elements) and the travelling sums,
/// (n − 1) · batch · numKvHeads · ⌈seqLocal / 128⌉ · 128 · headDim · 8 bytes; else
/// mkInvalidUsage names the size needed (also above 32704 128-key blocks of batch ×
/// numKvHeads per rank). Needs an sm_90 GPU.
///
/// Stream-ordered and asynchronous, capturable in a CUDA graph. Every rank must call it
/// with the same shape, scale, causal flag and dtype. A peer that does not arrive within
/// MK_TIMEOUT_MS makes the kernel stop; mkCommGetAsyncError then reports mkTimeout (or
/// mkRemoteError on the ranks stopped by the failing one) and dq/dk/dv are undefined.
#[no_mangle]
pub unsafe extern "C" fn mkRingAttentionBackward(
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    out: *const c_void,
    dout: *const c_void,
    lse: *const f32,
    dq: *mut c_void,
    dk: *mut c_void,
    dv: *mut c_void,
    batch: usize,
    seqLocal: usize,
    numHeads: usize,
    numKvHeads: usize,
    headDim: usize,
    softmaxScale: f32,
    causal: i32,
    dtype: RawDataType,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    use crate::ops::attention::ring_attention_backward::{ring_attention_backward, validate_args};
    with_comm(comm, "mkRingAttentionBackward", |c| {
        let args = validate_args(
            q as u64,
            k as u64,
            v as u64,
            out as u64,
            dout as u64,
            lse as u64,
            dq as u64,
            dk as u64,
            dv as u64,
            batch,
            seqLocal,
            numHeads,
            numKvHeads,
            headDim,
            softmaxScale,
            causal,
            dtype,
            c.nranks,
            c.rank,
        )?;
        ring_attention_backward(c, &args, stream)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::thread_last_error;
    use crate::types::mkDataType_t;

    // No GPU needed: fails before any CUDA call (the argument rules themselves are tested
    // on ops::dense::ag_scaled_gemm::validate_args).
    #[test]
    fn all_gather_scaled_gemm_rejects_a_null_comm() {
        let p = 0x10000 as *mut c_void;
        let sc = 0x20000 as *const f32;
        let e4m3 = mkDataType_t::mkFloat8e4m3 as RawDataType;
        let bf16 = mkDataType_t::mkBfloat16 as RawDataType;
        let r = unsafe {
            mkAllGatherScaledGemm(
                p,
                sc,
                p,
                sc,
                p,
                256,
                256,
                256,
                e4m3,
                bf16,
                1,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(r, mkResult_t::mkInvalidArgument);
        assert!(thread_last_error().contains("mkAllGatherScaledGemm: comm is NULL"), "{}", thread_last_error());
    }

    // No GPU needed: fails before any CUDA call (the argument rules themselves are tested
    // on ops::dense::gemm_reduce_scaled::validate_args).
    #[test]
    fn scaled_gemm_reductions_reject_a_null_comm() {
        let p = 0x10000 as *mut c_void;
        let sc = 0x20000 as *const f32;
        let e4m3 = mkDataType_t::mkFloat8e4m3 as RawDataType;
        let bf16 = mkDataType_t::mkBfloat16 as RawDataType;
        let (comm, stream) = (std::ptr::null_mut(), std::ptr::null_mut());
        for (f, name) in [
            (mkScaledGemmReduceScatter as ScaledReduction, "mkScaledGemmReduceScatter"),
            (mkScaledGemmAllReduce, "mkScaledGemmAllReduce"),
        ] {
            let r = unsafe { f(p, sc, p, sc, p, 256, 256, 256, e4m3, bf16, 1, comm, stream) };
            assert_eq!(r, mkResult_t::mkInvalidArgument, "{name}");
            let e = thread_last_error();
            assert!(e.contains(&format!("{name}: comm is NULL")), "{e}");
        }
    }

    type ScaledReduction = unsafe extern "C" fn(
        *const c_void,
        *const f32,
        *const c_void,
        *const f32,
        *mut c_void,
        usize,
        usize,
        usize,
        RawDataType,
        RawDataType,
        RawScaleMode,
        mkComm_t,
        CUstream,
    ) -> mkResult_t;

    // No GPU needed: these fail before any CUDA call (the argument rules themselves are
    // tested on ops::moe::validate_dispatch / validate_combine).
    #[test]
    fn moe_entry_points_reject_a_null_comm_and_size_the_layout() {
        let p = 0x10000 as *mut c_void;
        let bf16 = mkDataType_t::mkBfloat16 as RawDataType;
        let s = std::ptr::null_mut();
        unsafe {
            let r = mkMoeDispatchGemm(
                p,
                p as *const i32,
                p,
                p,
                p as *mut i32,
                p,
                4,
                256,
                256,
                2,
                8,
                512,
                bf16,
                std::ptr::null_mut(),
                s,
            );
            assert_eq!(r, mkResult_t::mkInvalidArgument);
            assert!(thread_last_error().contains("mkMoeDispatchGemm: comm is NULL"), "{}", thread_last_error());
            let r =
                mkMoeGemmCombine(p, p, p as *const f32, p, p, 4, 256, 256, 2, 8, 512, bf16, std::ptr::null_mut(), s);
            assert_eq!(r, mkResult_t::mkInvalidArgument);
            assert!(thread_last_error().contains("mkMoeGemmCombine: comm is NULL"));
            let mut bytes = 0usize;
            assert_eq!(mkMoeLayoutBytes(10, 3, 512, &mut bytes), mkResult_t::mkSuccess);
            assert_eq!(bytes, 4 * (4 + 3 * 30 + 6 * 4 + 1025));
            assert_eq!(mkMoeLayoutBytes(10, 3, 512, std::ptr::null_mut()), mkResult_t::mkInvalidArgument);
            assert!(thread_last_error().contains("bytes is NULL"));
            // Sizes that wrap size_t (or pass the kernels' int32 word index) are refused by name.
            for (t, k, cap) in
                [(usize::MAX / 2 + 1, 2, 512), (usize::MAX / 3, 1, 128), (1, 1, usize::MAX), (1 << 30, 2, 0)]
            {
                bytes = 7;
                assert_eq!(mkMoeLayoutBytes(t, k, cap, &mut bytes), mkResult_t::mkInvalidArgument, "{t} {k} {cap}");
                assert!(
                    thread_last_error().contains(&format!("tokens = {t}, topk = {k}, recvCapacity = {cap}")),
                    "{}",
                    thread_last_error()
                );
                assert_eq!(bytes, 7);
            }
        }
    }

    #[test]
    fn moe_options_are_read_by_version_and_their_rules_named() {
        use crate::ops::moe::{CapacityPolicy, MK_MOE_DROP};
        let mut o = std::mem::MaybeUninit::<mkMoeOptions_t>::zeroed();
        assert_eq!(unsafe { mkMoeOptionsInit(o.as_mut_ptr()) }, mkResult_t::mkSuccess);
        let o = unsafe { o.assume_init() };
        assert_eq!((o.size, o.magic, o.capacityPolicy, o.expertCapacity), (40, MK_MOE_OPTIONS_MAGIC, 0, 0));
        assert_eq!((o.activation, o.reserved), (0, 0));
        assert_eq!(o.version as i32, crate::version_code());
        assert_eq!(unsafe { mkMoeOptionsInit(std::ptr::null_mut()) }, mkResult_t::mkInvalidArgument);
        let counts = 0x1000;
        // NULL options and the initializer's: no-drop mode.
        let no_drop = CapacityPolicy::NoDrop { drop_counts: 0 };
        assert_eq!(unsafe { capacity_policy(std::ptr::null(), 0) }.unwrap(), no_drop);
        assert_eq!(unsafe { capacity_policy(&o, 0) }.unwrap(), no_drop);
        let drop = mkMoeOptions_t { capacityPolicy: MK_MOE_DROP, expertCapacity: 40, ..o };
        assert_eq!(
            unsafe { capacity_policy(&drop, counts) }.unwrap(),
            CapacityPolicy::Drop { expert_capacity: 40, drop_counts: counts }
        );
        // An older header's struct (the three header fields only) reads as the initializer.
        let older = mkMoeOptions_t { size: 16, ..drop };
        assert_eq!(unsafe { capacity_policy(&older, 0) }.unwrap(), no_drop);
        // The activation: read with the policy; a header without it (32 bytes) reads as none.
        use crate::ops::moe::{Activation, MK_MOE_ACT_GELU, MK_MOE_ACT_SILU};
        let swiglu = mkMoeOptions_t { activation: MK_MOE_ACT_SILU, ..drop };
        assert_eq!(unsafe { moe_options(&swiglu, counts) }.unwrap().1, Activation::Silu);
        let geglu = mkMoeOptions_t { activation: MK_MOE_ACT_GELU, ..o };
        assert_eq!(unsafe { moe_options(&geglu, 0) }.unwrap(), (no_drop, Activation::Gelu));
        assert_eq!(unsafe { moe_options(&mkMoeOptions_t { size: 32, ..swiglu }, counts) }.unwrap().1, Activation::None);
        let act_err = |o: &mkMoeOptions_t| unsafe { moe_options(o, 0) }.unwrap_err().message;
        assert!(act_err(&mkMoeOptions_t { activation: 3, ..o }).contains("options->activation = 3 is none of"));
        assert!(act_err(&mkMoeOptions_t { reserved: 1, ..o }).contains("options->reserved = 1 must be 0"));
        let err = |o: &mkMoeOptions_t, counts: u64| unsafe { capacity_policy(o, counts) }.unwrap_err().message;
        assert!(err(&mkMoeOptions_t { magic: 1, ..o }, 0).contains("options->magic is wrong"));
        assert!(err(&mkMoeOptions_t { version: 0, ..o }, 0).contains("options->version = 0"));
        assert!(err(&mkMoeOptions_t { size: 8, ..o }, 0).contains("options->size = 8"));
        // A newer header's struct: accepted while its new fields are 0 (two fields: no
        // padding bytes, which hold whatever was there).
        #[repr(C)]
        struct Newer {
            base: mkMoeOptions_t,
            future: c_int,
            spare: c_int,
        }
        let newer =
            |future| Newer { base: mkMoeOptions_t { size: std::mem::size_of::<Newer>(), ..drop }, future, spare: 0 };
        assert!(unsafe { capacity_policy((&newer(0) as *const Newer).cast(), counts) }.is_ok());
        let e = unsafe { capacity_policy((&newer(1) as *const Newer).cast(), counts) }.unwrap_err().message;
        assert!(e.contains("options comes from a newer header") && e.contains("byte offset 40"), "{e}");
        assert!(err(&drop, 0).contains("dropCounts is NULL"));
    }
}
