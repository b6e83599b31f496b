//! The GEMM engine on its own.

use super::guard;
use crate::cuda::sys::CUstream;
use crate::error::mkResult_t;
use crate::types::RawDataType;
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
        }
    }
}
