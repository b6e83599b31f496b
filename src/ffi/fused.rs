//! Fused communication + compute operations.

use super::{mkComm_t, with_comm};
use crate::cuda::sys::CUstream;
use crate::error::mkResult_t;
use crate::types::RawDataType;
use std::ffi::c_void;

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
        let args = crate::ops::ag_gemm::validate_args(A as u64, B as u64, C as u64, gatheredA as u64, M, N, K, dtype, c.nranks, c.rank)?;
        crate::ops::ag_gemm::all_gather_gemm(c, &args, stream)
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
///   order 0..n-1 and the sum rounded once to `dtype`.
///
/// Rules (mkInvalidArgument): M divisible by nranks; N and K multiples of 8; pointers
/// 16-byte aligned device memory. The partial product (M·N elements) must fit in the
/// communicator's fused-op region (MK_WORKSPACE_BYTES), else mkInvalidUsage names the size.
/// Stream-ordered, capturable in a CUDA graph; waits bounded by MK_TIMEOUT_MS (then
/// mkCommGetAsyncError reports mkTimeout / mkRemoteError and C is undefined).
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
    use crate::ops::gemm_reduce::{gemm_reduce, validate, Reduction};
    with_comm(comm, "mkGemmReduceScatter", |c| {
        let args = validate(Reduction::Scatter, A as u64, B as u64, C as u64, M, N, K, dtype, c.nranks)?;
        gemm_reduce(c, &args, stream)
    })
}

/// C = Σ over ranks of A·Bᵀ on every rank, in one persistent kernel (one-shot: every rank
/// reads every rank's partial tile as soon as it is signalled and sums it).
///
/// - `A`: [M, K] with this rank's K columns; `B`: [N, K] likewise; `C`: [M, N] on every rank.
/// - Any M ≥ 0 (decode shapes included). Rounding as mkGemmReduceScatter; the partials are
///   added in the same order on every rank, so all ranks' C are bitwise identical.
///
/// Rules, errors and stream semantics as mkGemmReduceScatter (no divisibility of M).
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
    use crate::ops::gemm_reduce::{gemm_reduce, validate, Reduction};
    with_comm(comm, "mkGemmAllReduce", |c| {
        let args = validate(Reduction::All, A as u64, B as u64, C as u64, M, N, K, dtype, c.nranks)?;
        gemm_reduce(c, &args, stream)
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
///   (as FlashAttention does) and out is rounded once.
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
    use crate::ops::ring_attention::{ring_attention, validate_args};
    with_comm(comm, "mkRingAttention", |c| {
        let args = validate_args(
            q as u64, k as u64, v as u64, out as u64, lse as u64, batch, seqLocal, numHeads, numKvHeads, headDim, softmaxScale, causal,
            dtype, c.nranks, c.rank,
        )?;
        ring_attention(c, &args, stream)
    })
}
