//! The GEMM engine on its own.

use super::guard;
use crate::cuda::sys::CUstream;
use crate::error::mkResult_t;
use crate::types::{RawDataType, RawScaleMode};
use std::ffi::c_void;

/// C = A * B^T on the GPU, the engine every fused operation is built on, alone (for tests
/// and comparisons with cuBLAS).
///
/// A is [M, K], B is [N, K] (the nn.Linear weight layout) and C is [M, N], all row-major,
/// densely packed, device memory of the current CUDA context's device, of type `dtype`:
/// mkBfloat16 or mkFloat16. Products accumulate in fp32; C is rounded to `dtype` once.
/// Requires an sm_90 GPU (H100/H200).
///
/// Deterministic: the same call on the same device gives the same bits on every run. The
/// order of the fp32 sums depends on the shape and the SM count only (through the planned
/// tile and split-K): where K is split over s CTAs, s partial sums over consecutive K
/// ranges are added in K order before C is rounded. Results may differ in the last bits
/// between shapes that plan differently, and from other GEMM libraries.
///
/// Rules (each violation returns mkInvalidArgument, with the rule named in mkGetLastError):
/// A, B and C non-NULL; K a positive multiple of 8; A and B 16-byte aligned; C aligned to
/// its element size; M, N, K at most INT_MAX. Any M and N are allowed (M == 0 or N == 0
/// does nothing). C must not overlap A or B. Fastest when N % 8 == 0 and C is 16-byte
/// aligned (C is then written with TMA stores).
///
/// Stream-ordered and asynchronous: returns once the kernel is enqueued on `stream`
/// (NULL = the legacy default stream); safe to capture in a CUDA graph. Uses the calling
/// thread's current context, or device 0's primary context when there is none.
#[no_mangle]
pub unsafe extern "C" fn mkGemm(
    A: *const c_void,
    B: *const c_void,
    C: *mut c_void,
    M: usize,
    N: usize,
    K: usize,
    dtype: RawDataType,
    stream: CUstream,
) -> mkResult_t {
    guard(None, "mkGemm", || crate::ops::gemm::op::gemm(A as u64, B as u64, C as u64, M, N, K, dtype, stream))
}

/// C = (A * scaleA) * (B * scaleB)^T with fp8 A and B: the scaled GEMM of fp8 training and
/// inference (torch._scaled_mm's convention: the scales dequantize A and B).
///
/// A is [M, K] and B is [N, K], both row-major (K-major, as fp8 tensor cores read them) and
/// densely packed, both of type `abType`: mkFloat8e4m3. (An e5m2 A, the gradient of an fp8
/// backward, times an e4m3 B is mkScaledGemmMixed, which takes the two types apart.) C is
/// [M, N] row-major of type `cType`: mkBfloat16 or mkFloat16. All device memory of the
/// current CUDA context's device. `scaleA` and `scaleB` are fp32 in device memory, as
/// `scaleMode` says:
/// - mkScaleTensor: one value each; C[m][n] = scaleA[0] * scaleB[0] * sum_k A[m][k] * B[n][k];
/// - mkScaleRowwise: scaleA[M] (one per row of A) and scaleB[N] (one per row of B, a column
///   of C); C[m][n] = scaleA[m] * scaleB[n] * sum_k A[m][k] * B[n][k];
/// - mkScaleBlock (DeepSeek-V3's): scaleA[K/128][M] (one per row of A per 128 of K) and
///   scaleB[K/128][ceil(N/128)] (one per 128 x 128 block of B), row-major (the memory of
///   torch's 1x128 and 128x128 scales), K a multiple of 128;
///   C[m][n] = sum_b scaleA[b][m] * scaleB[b][n/128] * sum_{k in block b} A[m][k] * B[n][k].
///
/// Products are exact in fp32; the tensor cores' sums are added into fp32 every 128 of K (the
/// fp8 tensor cores accumulate with fewer bits than fp32), multiplied by their block's scales
/// first in block mode; per tensor and rowwise, the scales multiply the fp32 sum once; C is
/// rounded to `cType` once. Requires an sm_90 GPU (H100/H200).
///
/// The scales are read by the kernel, not checked by the host: a NaN or infinite scale, or
/// NaN or an infinity in A or B, gives NaN or infinite values in C (as in cuBLASLt and
/// torch._scaled_mm).
///
/// Rules (each violation returns mkInvalidArgument, with the rule named in mkGetLastError):
/// A, B, C, scaleA, scaleB non-NULL; K a positive multiple of 16 (of 128 with block scales);
/// A and B 16-byte aligned;
/// C 2-byte aligned; the scales 4-byte aligned; M, N, K at most INT_MAX; abType mkFloat8e4m3
/// (mkFloat8e5m2 would make B e5m2, which is refused: only A may be e5m2); cType mkBfloat16
/// or mkFloat16; scaleMode a mkScaleMode_t. Any M and N (M == 0 or N == 0 does nothing). C
/// must not overlap the inputs. Fastest when N % 8 == 0 and C is 16-byte aligned (TMA
/// stores).
///
/// Deterministic, stream-ordered and asynchronous as mkGemm; safe to capture in a CUDA
/// graph. Uses the calling thread's current context, or device 0's primary context.
#[no_mangle]
pub unsafe extern "C" fn mkScaledGemm(
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
    stream: CUstream,
) -> mkResult_t {
    guard(None, "mkScaledGemm", || {
        let (a, sa, b, sb, c) = (A as u64, scaleA as u64, B as u64, scaleB as u64, C as u64);
        crate::ops::gemm::scaled::scaled_gemm(
            "mkScaledGemm",
            a,
            sa,
            b,
            sb,
            c,
            M,
            N,
            K,
            abType,
            abType,
            cType,
            scaleMode,
            stream,
        )
    })
}

/// mkScaledGemm with A's and B's types given apart: `aType` mkFloat8e4m3 or mkFloat8e5m2,
/// `bType` mkFloat8e4m3. An e5m2 A is the gradient of an fp8 backward (dgrad: dY·W, wgrad:
/// dYᵀ·X, with dY quantized to e5m2 for its range and W, X to e4m3), multiplied on the
/// tensor cores as e5m2 × e4m3 with every scale mode, the same promotion and rounding as
/// mkScaledGemm. With `aType` == `bType` == mkFloat8e4m3 it is mkScaledGemm.
///
/// Rules: mkScaledGemm's, with `aType` mkFloat8e4m3 or mkFloat8e5m2 and `bType`
/// mkFloat8e4m3 (B in mkFloat8e5m2 is refused with mkInvalidArgument: only A may be e5m2;
/// the kernels multiply e5m2 by e4m3 only). Deterministic, stream-ordered, asynchronous and
/// safe to capture in a CUDA graph, as mkScaledGemm.
#[no_mangle]
pub unsafe extern "C" fn mkScaledGemmMixed(
    A: *const c_void,
    scaleA: *const f32,
    B: *const c_void,
    scaleB: *const f32,
    C: *mut c_void,
    M: usize,
    N: usize,
    K: usize,
    aType: RawDataType,
    bType: RawDataType,
    cType: RawDataType,
    scaleMode: RawScaleMode,
    stream: CUstream,
) -> mkResult_t {
    guard(None, "mkScaledGemmMixed", || {
        let (a, sa, b, sb, c) = (A as u64, scaleA as u64, B as u64, scaleB as u64, C as u64);
        let op = "mkScaledGemmMixed";
        crate::ops::gemm::scaled::scaled_gemm(op, a, sa, b, sb, c, M, N, K, aType, bType, cType, scaleMode, stream)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::thread_last_error;
    use crate::types::mkDataType_t;

    // Argument errors come back before any CUDA call, so these run without a GPU.
    #[test]
    fn bad_arguments_are_invalid_argument_with_a_message() {
        let p = 0x10000 as *mut c_void;
        let bf16 = mkDataType_t::mkBfloat16 as RawDataType;
        let null = std::ptr::null_mut::<c_void>();
        let s = std::ptr::null_mut();
        let check = |r: mkResult_t, needle: &str| {
            assert_eq!(r, mkResult_t::mkInvalidArgument, "{needle}");
            let msg = thread_last_error();
            assert!(msg.starts_with("mkGemm: ") && msg.contains(needle), "{msg:?} lacks {needle:?}");
        };
        unsafe {
            check(mkGemm(null, p, p, 1, 1, 8, bf16, s), "A is NULL");
            check(mkGemm(p, p, null, 1, 1, 8, bf16, s), "C is NULL");
            check(mkGemm(p, p, p, 4, 4, 20, bf16, s), "multiple of 8");
            check(mkGemm(0x10008 as *const c_void, p, p, 4, 4, 8, bf16, s), "16-byte aligned");
            check(mkGemm(p, p, p, 4, 4, 8, 1234, s), "unknown datatype 1234");
            check(mkGemm(p, p, p, 4, 4, 8, mkDataType_t::mkFloat32 as RawDataType, s), "not supported");
            check(mkGemm(p, p, p, 4, 4, 8, mkDataType_t::mkFloat8e4m3 as RawDataType, s), "mkScaledGemm takes them");
            check(mkGemm(p, p, p, 4, 4, 8, mkDataType_t::mkFloat8e5m2 as RawDataType, s), "not supported");
        }
    }

    #[test]
    fn scaled_gemm_refuses_bad_arguments_before_any_cuda_call() {
        use crate::types::mkScaleMode_t;
        let p = 0x10000 as *mut c_void;
        let sc = 0x20000 as *const f32;
        let e4m3 = mkDataType_t::mkFloat8e4m3 as RawDataType;
        let bf16 = mkDataType_t::mkBfloat16 as RawDataType;
        let row = mkScaleMode_t::mkScaleRowwise as RawScaleMode;
        let s = std::ptr::null_mut();
        let check = |r: mkResult_t, needle: &str| {
            assert_eq!(r, mkResult_t::mkInvalidArgument, "{needle}");
            let msg = thread_last_error();
            assert!(msg.starts_with("mkScaledGemm: ") && msg.contains(needle), "{msg:?} lacks {needle:?}");
        };
        unsafe {
            check(mkScaledGemm(p, std::ptr::null(), p, sc, p, 4, 4, 32, e4m3, bf16, row, s), "scaleA is NULL");
            check(mkScaledGemm(p, sc, p, std::ptr::null(), p, 4, 4, 32, e4m3, bf16, row, s), "scaleB is NULL");
            check(mkScaledGemm(p, 0x20002 as *const f32, p, sc, p, 4, 4, 32, e4m3, bf16, row, s), "scaleA = 0x20002");
            check(mkScaledGemm(p, sc, p, sc, p, 4, 4, 40, e4m3, bf16, row, s), "multiple of 16");
            check(mkScaledGemm(p, sc, p, sc, p, 4, 4, 32, e4m3, bf16, 7, s), "unknown scale mode 7");
            check(mkScaledGemm(p, sc, p, sc, p, 4, 4, 32, bf16, bf16, row, s), "A in bfloat16");
            let e5m2 = mkDataType_t::mkFloat8e5m2 as RawDataType;
            check(mkScaledGemm(p, sc, p, sc, p, 4, 4, 32, e5m2, bf16, row, s), "only A may be mkFloat8e5m2");
            check(mkScaledGemm(p, sc, p, sc, p, 4, 4, 32, e4m3, e4m3, row, s), "cType float8e4m3");
        }
    }

    #[test]
    fn scaled_gemm_mixed_refuses_e5m2_b_before_any_cuda_call() {
        use crate::types::mkScaleMode_t;
        let p = 0x10000 as *mut c_void;
        let sc = 0x20000 as *const f32;
        let e4m3 = mkDataType_t::mkFloat8e4m3 as RawDataType;
        let e5m2 = mkDataType_t::mkFloat8e5m2 as RawDataType;
        let bf16 = mkDataType_t::mkBfloat16 as RawDataType;
        let block = mkScaleMode_t::mkScaleBlock as RawScaleMode;
        let s = std::ptr::null_mut();
        let check = |r: mkResult_t, needle: &str| {
            assert_eq!(r, mkResult_t::mkInvalidArgument, "{needle}");
            let msg = thread_last_error();
            assert!(msg.starts_with("mkScaledGemmMixed: ") && msg.contains(needle), "{msg:?} lacks {needle:?}");
        };
        unsafe {
            let e = "B in float8e5m2 is not supported: mkScaledGemmMixed takes mkFloat8e4m3 for B (only A may be";
            check(mkScaledGemmMixed(p, sc, p, sc, p, 4, 4, 128, e4m3, e5m2, bf16, block, s), e);
            check(mkScaledGemmMixed(p, sc, p, sc, p, 4, 4, 128, e5m2, e5m2, bf16, block, s), e);
            check(mkScaledGemmMixed(p, sc, p, sc, p, 4, 4, 128, bf16, e4m3, bf16, block, s), "A in bfloat16");
            // e5m2 A passes the type rules; the next rule broken is the one reported.
            check(mkScaledGemmMixed(p, sc, p, sc, p, 4, 4, 144, e5m2, e4m3, bf16, block, s), "multiple of 128");
            check(
                mkScaledGemmMixed(p, std::ptr::null(), p, sc, p, 4, 4, 128, e5m2, e4m3, bf16, block, s),
                "scaleA is NULL",
            );
        }
    }
}
