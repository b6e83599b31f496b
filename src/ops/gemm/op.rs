//! `mkGemm`: C[M,N] = A[M,K] · B[N,K]ᵀ (row-major, bf16 or fp16, fp32 accumulate) on the
//! GEMM engine (entry kernels in kernels/gemm.cu): [`validate`] (argument checks, no CUDA),
//! the engine's [`plan`], and [`launch`] (tensor maps + launch).

use crate::cuda::{self, sys};
use crate::error::{MkError, Result};
use crate::ops::common::launch::{current_sm_count, tensor_map};
use crate::ops::gemm::engine::{plan, Epilogue, GemmPlan, PlanOverrides, BK};
use crate::ops::gemm::table as gemm_table;
use crate::types::{mkDataType_t, RawDataType};
use std::ffi::c_void;

/// A GEMM call's arguments after validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmArgs {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub dtype: mkDataType_t,
}

impl GemmArgs {
    /// Whether C can be written with TMA stores (rows 16-byte aligned).
    pub fn tma_epilogue_ok(&self) -> bool {
        self.n % 8 == 0 && self.c % 16 == 0
    }
}

/// Checks mkGemm's arguments (no CUDA call). M == 0 or N == 0 is a valid empty GEMM.
pub fn validate(a: u64, b: u64, c: u64, m: usize, n: usize, k: usize, dtype: RawDataType) -> Result<GemmArgs> {
    let dtype = mkDataType_t::gemm_type_from_raw(dtype, "mkGemm")?;
    crate::ensure_arg!(a != 0, "A is NULL");
    crate::ensure_arg!(b != 0, "B is NULL");
    crate::ensure_arg!(c != 0, "C is NULL");
    crate::ensure_arg!(
        k > 0 && k % 8 == 0,
        "K = {k} must be a positive multiple of 8: TMA reads rows of A and B that must start on 16-byte boundaries (K * 2 bytes)"
    );
    let limit = i32::MAX as usize;
    crate::ensure_arg!(
        m <= limit && n <= limit && k <= limit,
        "M = {m}, N = {n}, K = {k}: each must be at most {limit}"
    );
    crate::ensure_arg!(
        m.div_ceil(64) * n.div_ceil(64) <= limit,
        "M = {m}, N = {n}: more than {limit} tiles of 64x64 (the smallest tile; the tile index is 32-bit); split the GEMM"
    );
    crate::ensure_arg!(a % 16 == 0, "A = {a:#x} is not 16-byte aligned (TMA needs 16-byte aligned base addresses)");
    crate::ensure_arg!(b % 16 == 0, "B = {b:#x} is not 16-byte aligned (TMA needs 16-byte aligned base addresses)");
    crate::ensure_arg!(c % 2 == 0, "C = {c:#x} is not aligned to its 2-byte element type");
    Ok(GemmArgs { a, b, c, m, n, k, dtype })
}

/// Launches the plain GEMM with `plan` on `stream` in the current context.
// The stream handle is only passed to the driver, never dereferenced here.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn launch(args: &GemmArgs, plan: &GemmPlan, stream: sys::CUstream) -> Result<()> {
    if args.m == 0 || args.n == 0 {
        return Ok(());
    }
    let (_, b_rows) = plan.box_rows();
    let a_rows = plan.a_box_rows(args.m);
    let mut ta = tensor_map(args.a, args.dtype, args.m, args.k, a_rows, BK)?;
    let mut tb = tensor_map(args.b, args.dtype, args.n, args.k, b_rows, BK)?;
    // The direct epilogue ignores tma_c; pass any valid map.
    let mut tc =
        if plan.epilogue == Epilogue::Tma { tensor_map(args.c, args.dtype, args.m, args.n, 64, 64)? } else { ta };
    let kernel_launch = plan.kernel_launch(args.dtype)?;
    let mut c = args.c;
    let (mut m, mut n, mut k, mut g) = (args.m as i32, args.n as i32, args.k as i32, plan.group_m as i32);
    let mut a_box = a_rows as i32;
    let mut params: [*mut c_void; 9] = [
        (&mut ta as *mut sys::CUtensorMap).cast(),
        (&mut tb as *mut sys::CUtensorMap).cast(),
        (&mut tc as *mut sys::CUtensorMap).cast(),
        (&mut c as *mut u64).cast(),
        (&mut m as *mut i32).cast(),
        (&mut n as *mut i32).cast(),
        (&mut k as *mut i32).cast(),
        (&mut g as *mut i32).cast(),
        (&mut a_box as *mut i32).cast(),
    ];
    // SAFETY: the parameters match the entry kernels' signature (3 tensor maps, a pointer,
    // 5 ints); A, B and C were validated and cover M×K, N×K and M×N elements (caller's
    // contract); a cluster plan names a cluster kernel, launched in clusters of its size
    // (2 for multicast, split_k for split-K; `kernel_launch`).
    unsafe { kernel_launch.launch(stream, &mut params, None) }
}

/// Runs `f` with a current context: the caller's if it has one (the CUDA runtime's usual
/// case), otherwise device 0's primary context, kept retained for the process.
pub fn with_current_context<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    use std::sync::OnceLock;
    cuda::driver()?;
    let current = cudarc::driver::result::ctx::get_current().map_err(|e| cuda::cuda_err("cuCtxGetCurrent", e))?;
    if current.is_some() {
        return f();
    }
    static DEFAULT: OnceLock<std::result::Result<cuda::PrimaryContext, MkError>> = OnceLock::new();
    let ctx = DEFAULT.get_or_init(|| cuda::PrimaryContext::retain(0)).as_ref().map_err(|e| e.clone())?;
    let _guard = ctx.enter()?;
    f()
}

/// mkGemm's body: validate, plan for the current device, launch.
#[allow(clippy::too_many_arguments)] // mirrors the C signature
pub fn gemm(
    a: u64,
    b: u64,
    c: u64,
    m: usize,
    n: usize,
    k: usize,
    dtype: RawDataType,
    stream: sys::CUstream,
) -> Result<()> {
    let args = validate(a, b, c, m, n, k, dtype)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    with_current_context(|| gemm_with(&args, PlanOverrides::default(), stream))
}

/// Plans (with overrides) and launches in the current context; returns nothing more than
/// [`launch`] but lets benchmarks and fused ops steer the plan.
pub fn gemm_with(args: &GemmArgs, o: PlanOverrides, stream: sys::CUstream) -> Result<()> {
    let sms = current_sm_count()?;
    let p = plan(args.m, args.n, args.k, sms, args.tma_epilogue_ok(), o);
    let ctas = o.max_ctas.unwrap_or(sms).clamp(1, sms.max(1));
    gemm_table::log_choice(args.m, args.n, args.k, ctas, &p);
    launch(args, &p, stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::mkResult_t;

    const BF16: RawDataType = mkDataType_t::mkBfloat16 as RawDataType;

    #[test]
    fn validate_accepts_good_and_names_the_broken_rule() {
        let ok = validate(0x1000, 0x2000, 0x3000, 129, 257, 72, BF16).unwrap();
        assert!(!ok.tma_epilogue_ok(), "N = 257 needs the direct epilogue");
        assert!(validate(0x1000, 0x2000, 0x3000, 128, 256, 64, BF16).unwrap().tma_epilogue_ok());
        assert!(!validate(0x1000, 0x2000, 0x3002, 128, 256, 64, BF16).unwrap().tma_epilogue_ok());
        let err = |r: Result<GemmArgs>| {
            let e = r.unwrap_err();
            assert_eq!(e.code, mkResult_t::mkInvalidArgument);
            e.message
        };
        assert!(err(validate(0, 0x2000, 0x3000, 1, 1, 8, BF16)).contains("A is NULL"));
        assert!(err(validate(0x1000, 0, 0x3000, 1, 1, 8, BF16)).contains("B is NULL"));
        assert!(err(validate(0x1000, 0x2000, 0, 1, 1, 8, BF16)).contains("C is NULL"));
        assert!(err(validate(0x1000, 0x2000, 0x3000, 1, 1, 12, BF16)).contains("multiple of 8"));
        assert!(err(validate(0x1000, 0x2000, 0x3000, 1, 1, 0, BF16)).contains("multiple of 8"));
        assert!(err(validate(0x1008, 0x2000, 0x3000, 1, 1, 8, BF16)).contains("A = 0x1008 is not 16-byte aligned"));
        assert!(err(validate(0x1000, 0x2004, 0x3000, 1, 1, 8, BF16)).contains("B = 0x2004"));
        assert!(err(validate(0x1000, 0x2000, 0x3001, 1, 1, 8, BF16)).contains("C = 0x3001"));
        assert!(err(validate(0x1000, 0x2000, 0x3000, 1, 1, 8, 77)).contains("unknown datatype"));
        assert!(err(validate(0x1000, 0x2000, 0x3000, 1, 1, 8, mkDataType_t::mkFloat32 as i32)).contains("float"));
        assert!(err(validate(0x1000, 0x2000, 0x3000, 1 << 31, 1, 8, BF16)).contains("at most"));
        assert!(err(validate(0x1000, 0x2000, 0x3000, 1 << 30, 1 << 30, 8, BF16)).contains("tiles"));
    }
}
