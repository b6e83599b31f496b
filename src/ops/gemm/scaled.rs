//! `mkScaledGemm` and `mkScaledGemmMixed`: C[M,N] = (A·sA)(B·sB)ᵀ with A [M,K] in fp8 e4m3
//! or e5m2 and B [N,K] in e4m3 (both K-major), fp32 scales per tensor, per row or per block
//! (A 1×128, B 128×128), fp32 accumulation promoted every 128 of K, C in bf16 or fp16
//! rounded once (kernels/scaled_gemm.cu). [`validate`] (argument rules, no CUDA), [`plan`]
//! (tile, grid, ring: pure) and [`launch`]. docs/decisions/0063 says why it is an entry
//! point of its own and what it leaves out; 0079 how A and B take different fp8 types.

use crate::cuda::kernels::{self, Arg, Kernel};
use crate::cuda::sys;
use crate::error::Result;
use crate::ops::common::launch::{current_sm_count, tensor_map, KernelLaunch};
use crate::ops::gemm::engine::{raster_group, Epilogue, SMEM_LIMIT, THREADS};
use crate::ops::gemm::op::with_current_context;
use crate::types::{mkDataType_t, mkScaleMode_t, Accepted, Element, ElementType, RawDataType, RawScaleMode};
use std::ffi::c_void;

/// Rows of A (and C) per tile: two consumer warpgroups of 64.
pub const BM: usize = 128;
/// K per pipeline stage and per promotion: 128 one-byte elements, one 128-byte swizzle row.
/// The fp32 sums take each stage's tensor-core sums once the stage's wgmmas are done.
pub const BK: usize = 128;
/// Tile widths the kernels are compiled for: the stage's sums and the promoted sums both
/// live in registers (2 × BN/2 per thread), which rules out wider tiles.
pub const TILE_WIDTHS: [usize; 2] = [128, 64];
/// K must be a multiple of this: TMA reads rows of A and B (K bytes each) that start on
/// 16-byte boundaries.
pub const K_MULTIPLE: usize = 16;

/// A call's arguments after validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaledGemmArgs {
    pub a: u64,
    pub scale_a: u64,
    pub b: u64,
    pub scale_b: u64,
    pub c: u64,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// A's element type (mkFloat8e4m3 or mkFloat8e5m2: the kernel is chosen by it).
    pub a_type: mkDataType_t,
    /// B's element type (mkFloat8e4m3).
    pub b_type: mkDataType_t,
    /// C's element type (mkBfloat16 or mkFloat16).
    pub out: mkDataType_t,
    pub mode: mkScaleMode_t,
}

impl ScaledGemmArgs {
    /// Whether C can be written with TMA stores (rows 16-byte aligned).
    pub fn tma_epilogue_ok(&self) -> bool {
        self.n % 8 == 0 && self.c % 16 == 0
    }
    /// The kernel's scale steps: scale_a[r · step_a] scales row r of A (0: one per tensor;
    /// unused with block scales).
    pub fn scale_steps(&self) -> (i32, i32) {
        match self.mode {
            mkScaleMode_t::mkScaleTensor | mkScaleMode_t::mkScaleBlock => (0, 0),
            mkScaleMode_t::mkScaleRowwise => (1, 1),
        }
    }
    /// The kernel's `scale_k_blocks`: K / 128 with block scales (a row of either scale
    /// array), 0 for the other modes.
    pub fn scale_k_blocks(&self) -> i32 {
        if self.mode == mkScaleMode_t::mkScaleBlock {
            (self.k / mkScaleMode_t::BLOCK) as i32
        } else {
            0
        }
    }
}

/// Checks the arguments of mkScaledGemm (`a_type` == `b_type`: its one abType) and
/// mkScaledGemmMixed (no CUDA call); `op` names the entry point in the messages. M == 0 or
/// N == 0 is a valid empty GEMM. The scales' values are not read here: they are device
/// memory (see docs/ops/scaled_gemm.md).
#[allow(clippy::too_many_arguments)] // mirrors the C signature
pub fn validate(
    op: &str,
    a: u64,
    scale_a: u64,
    b: u64,
    scale_b: u64,
    c: u64,
    m: usize,
    n: usize,
    k: usize,
    a_type: RawDataType,
    b_type: RawDataType,
    c_type: RawDataType,
    mode: RawScaleMode,
) -> Result<ScaledGemmArgs> {
    validate_for(op, |t| t.scaled_gemm_a, a, scale_a, b, scale_b, c, m, n, k, a_type, b_type, c_type, mode)
}

/// [`validate`] for an op that runs the scaled GEMM with A of the types `a_takes` accepts
/// (B: `Accepted::scaled_gemm`, e4m3, for every op); `op` names it in the messages that say
/// what it takes.
#[allow(clippy::too_many_arguments)] // mirrors the C signature
pub fn validate_for(
    op: &str,
    a_takes: fn(&Accepted) -> bool,
    a: u64,
    scale_a: u64,
    b: u64,
    scale_b: u64,
    c: u64,
    m: usize,
    n: usize,
    k: usize,
    a_type: RawDataType,
    b_type: RawDataType,
    c_type: RawDataType,
    mode: RawScaleMode,
) -> Result<ScaledGemmArgs> {
    let a_type = mkDataType_t::from_raw(a_type)?;
    let b_type = mkDataType_t::from_raw(b_type)?;
    let (a_accepted, b_accepted) = (a_type.element().accepted, b_type.element().accepted);
    crate::ensure_arg!(
        a_takes(&a_accepted),
        "A in {} is not supported: {op} takes {} for A{}",
        a_type.name(),
        ElementType::names_where(a_takes),
        if a_accepted.scaled_gemm_a {
            format!(" (mkScaledGemm takes it for A; no kernel of {op} does)")
        } else {
            String::new()
        }
    );
    crate::ensure_arg!(
        b_accepted.scaled_gemm,
        "B in {} is not supported: {op} takes {} for B{}",
        b_type.name(),
        ElementType::names_where(|t| t.scaled_gemm),
        if a_takes(&b_accepted) {
            format!(" (only A may be {}: mkScaledGemmMixed takes A's type apart from B's)", b_type.element().c_name)
        } else {
            String::new()
        }
    );
    let out = mkDataType_t::from_raw(c_type)?;
    crate::ensure_arg!(
        out.is_gemm_type(),
        "cType {} is not supported: {op} writes C as {}",
        out.name(),
        ElementType::gemm_names()
    );
    let mode = mkScaleMode_t::from_raw(mode)?;
    crate::ensure_arg!(a != 0, "A is NULL");
    crate::ensure_arg!(b != 0, "B is NULL");
    crate::ensure_arg!(c != 0, "C is NULL");
    crate::ensure_arg!(scale_a != 0, "scaleA is NULL");
    crate::ensure_arg!(scale_b != 0, "scaleB is NULL");
    crate::ensure_arg!(
        k > 0 && k % K_MULTIPLE == 0,
        "K = {k} must be a positive multiple of {K_MULTIPLE}: TMA reads rows of A and B that must start on 16-byte boundaries (K one-byte elements)"
    );
    crate::ensure_arg!(
        mode != mkScaleMode_t::mkScaleBlock || k % mkScaleMode_t::BLOCK == 0,
        "K = {k} must be a multiple of {} with block scales (one scale per {} of K)",
        mkScaleMode_t::BLOCK,
        mkScaleMode_t::BLOCK
    );
    let limit = i32::MAX as usize;
    crate::ensure_arg!(
        m <= limit && n <= limit && k <= limit,
        "M = {m}, N = {n}, K = {k}: each must be at most {limit}"
    );
    crate::ensure_arg!(
        m.div_ceil(BM) * n.div_ceil(64) <= limit,
        "M = {m}, N = {n}: more than {limit} tiles of {BM}x64 (the tile index is 32-bit); split the GEMM"
    );
    crate::ensure_arg!(a % 16 == 0, "A = {a:#x} is not 16-byte aligned (TMA needs 16-byte aligned base addresses)");
    crate::ensure_arg!(b % 16 == 0, "B = {b:#x} is not 16-byte aligned (TMA needs 16-byte aligned base addresses)");
    crate::ensure_arg!(c % 2 == 0, "C = {c:#x} is not aligned to its 2-byte element type");
    crate::ensure_arg!(scale_a % 4 == 0, "scaleA = {scale_a:#x} is not aligned to its 4-byte fp32 scales");
    crate::ensure_arg!(scale_b % 4 == 0, "scaleB = {scale_b:#x} is not aligned to its 4-byte fp32 scales");
    Ok(ScaledGemmArgs { a, scale_a, b, scale_b, c, m, n, k, a_type, b_type, out, mode })
}

/// Everything the launch needs, decided from the shape and the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaledPlan {
    pub bn: usize,
    pub epilogue: Epilogue,
    pub stages: usize,
    pub smem_bytes: usize,
    pub tiles_m: usize,
    pub tiles_n: usize,
    /// m-blocks per raster group (L2 reuse of B).
    pub group_m: usize,
    /// Persistent CTAs: min(tiles, SMs).
    pub grid: usize,
}

impl ScaledPlan {
    /// The kernel of this plan for A of `a`, B of `b` and C of `out`.
    pub fn kernel(&self, a: impl Element, b: impl Element, out: impl Element) -> Result<Kernel> {
        kernel(a, b, out, self.bn, self.epilogue)
    }
    /// The launch of this plan: `grid` CTAs of THREADS with its shared memory.
    pub fn kernel_launch(&self, a: impl Element, b: impl Element, out: impl Element) -> Result<KernelLaunch> {
        Ok(KernelLaunch::new(self.kernel(a, b, out)?, self.grid as u32, THREADS, self.smem_bytes as u32))
    }
}

/// The kernel for A of `a`, B of `b`, C of `out`, a tile width and an epilogue: the instance
/// of kernels/instances.txt's MK_SCALED_GEMM_ENTRY lines that has them (A's type first:
/// the types a kernel is compiled for are named by A's).
pub fn kernel(a: impl Element, b: impl Element, out: impl Element, bn: usize, epilogue: Epilogue) -> Result<Kernel> {
    let args = [
        Arg::Element,
        Arg::Text(b.element().cuda_type),
        Arg::Text(out.element().cuda_type),
        Arg::Int(bn),
        Arg::Bool(epilogue == Epilogue::Tma),
    ];
    kernels::choose("mkScaledGemm", a.element(), "MK_SCALED_GEMM_ENTRY", &args)
}

/// Shared memory of one consumer warpgroup's epilogue staging: 64 rows × bn two-byte outputs
/// for TMA stores, none for direct stores.
fn staging_per_wg(bn: usize, epilogue: Epilogue) -> usize {
    if epilogue == Epilogue::Tma {
        64 * bn * 2
    } else {
        0
    }
}

/// Ring depth: the deepest ring of (BM + bn) × BK-byte stages, at most 8, that fits beside
/// the staging (`ScaledConfig::STAGES` in kernels/common/gemm/scaled_mainloop.cuh, the same formula).
pub fn stages(bn: usize, epilogue: Epilogue) -> usize {
    ((SMEM_LIMIT - 1024 - 2 * staging_per_wg(bn, epilogue) - 256) / ((BM + bn) * BK)).min(8)
}

/// Dynamic shared memory of a kernel (`ScaledConfig::smem_bytes`; the kernel traps when it
/// gets less): alignment slack, ring, staging, the stages' full and empty barriers.
pub fn smem_bytes(bn: usize, epilogue: Epilogue) -> usize {
    let s = stages(bn, epilogue);
    1024 + s * (BM + bn) * BK + 2 * staging_per_wg(bn, epilogue) + 2 * s * 8
}

/// Dynamic shared memory of a kernel whose epilogue flags its slabs through the courier
/// (TMA stores, `scaled_smem_bytes<Cfg, Epi>` in kernels/common/gemm/scaled_mainloop.cuh):
/// [`smem_bytes`] and the courier's mailboxes after the stage barriers.
pub fn smem_bytes_with_courier(bn: usize) -> usize {
    smem_bytes(bn, Epilogue::Tma) + crate::ops::gemm::smem::MAILBOX_BYTES
}

/// The tile width for `m` × `n` on `ctas` CTAs: 128 columns, or 64 where 128-wide tiles would
/// number fewer than the CTAs (more, narrower tiles fill more of the GPU).
pub fn tile_width(m: usize, n: usize, ctas: usize) -> usize {
    if m.div_ceil(BM) * n.div_ceil(128) < ctas.max(1) && n > 64 {
        64
    } else {
        128
    }
}

/// Plans a call: [`tile_width`]'s tiles, the grouped raster, one persistent CTA per SM at most.
pub fn plan(m: usize, n: usize, sms: usize, tma_epilogue_ok: bool) -> ScaledPlan {
    let bn = tile_width(m, n, sms);
    let epilogue = if tma_epilogue_ok { Epilogue::Tma } else { Epilogue::Direct };
    plan_tile(m, n, sms, bn, epilogue)
}

/// The plan of a given tile width (one of [`TILE_WIDTHS`]) and epilogue (TMA only where the
/// call allows it: `ScaledGemmArgs::tma_epilogue_ok`): [`plan`]'s choice, or a test's or a
/// benchmark's.
pub fn plan_tile(m: usize, n: usize, sms: usize, bn: usize, epilogue: Epilogue) -> ScaledPlan {
    let sms = sms.max(1);
    let (tiles_m, tiles_n) = (m.div_ceil(BM), n.div_ceil(bn));
    let grid = (tiles_m * tiles_n).clamp(1, sms);
    ScaledPlan {
        bn,
        epilogue,
        stages: stages(bn, epilogue),
        smem_bytes: smem_bytes(bn, epilogue),
        tiles_m,
        tiles_n,
        group_m: raster_group(tiles_m, bn, grid),
        grid,
    }
}

/// Launches `plan` on `stream` in the current context.
// The stream handle is only passed to the driver, never dereferenced here.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn launch(args: &ScaledGemmArgs, plan: &ScaledPlan, stream: sys::CUstream) -> Result<()> {
    if args.m == 0 || args.n == 0 {
        return Ok(());
    }
    let mut ta = tensor_map(args.a, args.a_type, args.m, args.k, BM, BK)?;
    let mut tb = tensor_map(args.b, args.b_type, args.n, args.k, plan.bn, BK)?;
    // The direct epilogue ignores tma_c; pass any valid map.
    let mut tc =
        if plan.epilogue == Epilogue::Tma { tensor_map(args.c, args.out, args.m, args.n, 64, 64)? } else { ta };
    let kernel_launch = plan.kernel_launch(args.a_type, args.b_type, args.out)?;
    let (mut c, mut scale_a, mut scale_b) = (args.c, args.scale_a, args.scale_b);
    let (mut m, mut n, mut k, mut g) = (args.m as i32, args.n as i32, args.k as i32, plan.group_m as i32);
    let (mut step_a, mut step_b) = args.scale_steps();
    let mut scale_k_blocks = args.scale_k_blocks();
    let mut params: [*mut c_void; 13] = [
        (&mut ta as *mut sys::CUtensorMap).cast(),
        (&mut tb as *mut sys::CUtensorMap).cast(),
        (&mut tc as *mut sys::CUtensorMap).cast(),
        (&mut c as *mut u64).cast(),
        (&mut scale_a as *mut u64).cast(),
        (&mut scale_b as *mut u64).cast(),
        (&mut m as *mut i32).cast(),
        (&mut n as *mut i32).cast(),
        (&mut k as *mut i32).cast(),
        (&mut g as *mut i32).cast(),
        (&mut step_a as *mut i32).cast(),
        (&mut step_b as *mut i32).cast(),
        (&mut scale_k_blocks as *mut i32).cast(),
    ];
    // SAFETY: the parameters match MK_SCALED_GEMM_ENTRY's signature (3 tensor maps, 3
    // pointers, 7 ints); A, B, C and the scales were validated and cover M×K, N×K, M×N and
    // the mode's scale counts (caller's contract).
    unsafe { kernel_launch.launch(stream, &mut params, None) }
}

/// The body of mkScaledGemm and mkScaledGemmMixed (`op`): validate, plan for the current
/// device, launch.
#[allow(clippy::too_many_arguments)] // mirrors the C signature
pub fn scaled_gemm(
    op: &str,
    a: u64,
    scale_a: u64,
    b: u64,
    scale_b: u64,
    c: u64,
    m: usize,
    n: usize,
    k: usize,
    a_type: RawDataType,
    b_type: RawDataType,
    c_type: RawDataType,
    mode: RawScaleMode,
    stream: sys::CUstream,
) -> Result<()> {
    let args = validate(op, a, scale_a, b, scale_b, c, m, n, k, a_type, b_type, c_type, mode)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    with_current_context(|| {
        let p = plan(args.m, args.n, current_sm_count()?, args.tma_epilogue_ok());
        launch(&args, &p, stream)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::mkResult_t;
    use mkDataType_t::*;
    use mkScaleMode_t::*;

    const E4M3: RawDataType = mkFloat8e4m3 as RawDataType;
    const E5M2: RawDataType = mkFloat8e5m2 as RawDataType;
    const BF16: RawDataType = mkBfloat16 as RawDataType;
    const TENSOR: RawScaleMode = mkScaleTensor as RawScaleMode;
    const ROWWISE: RawScaleMode = mkScaleRowwise as RawScaleMode;
    const BLOCK: RawScaleMode = mkScaleBlock as RawScaleMode;

    /// validate with good pointers (A, sA, B, sB, C) and the given sizes and types (A and B
    /// of one type, as mkScaledGemm's abType gives them).
    fn check(
        m: usize,
        n: usize,
        k: usize,
        ab: RawDataType,
        out: RawDataType,
        mode: RawScaleMode,
    ) -> Result<ScaledGemmArgs> {
        check_mixed(m, n, k, ab, ab, out, mode)
    }

    /// validate with A's and B's types apart (mkScaledGemmMixed).
    fn check_mixed(
        m: usize,
        n: usize,
        k: usize,
        a: RawDataType,
        b: RawDataType,
        out: RawDataType,
        mode: RawScaleMode,
    ) -> Result<ScaledGemmArgs> {
        validate("mkScaledGemm", 0x1000, 0x5000, 0x2000, 0x6000, 0x3000, m, n, k, a, b, out, mode)
    }

    fn message(r: Result<ScaledGemmArgs>) -> String {
        let e = r.unwrap_err();
        assert_eq!(e.code, mkResult_t::mkInvalidArgument, "{}", e.message);
        e.message
    }

    #[test]
    fn validate_accepts_both_modes_and_outputs() {
        let a = check(129, 257, 160, E4M3, BF16, ROWWISE).unwrap();
        assert_eq!((a.a_type, a.b_type, a.out, a.mode), (mkFloat8e4m3, mkFloat8e4m3, mkBfloat16, mkScaleRowwise));
        assert_eq!(a.scale_steps(), (1, 1));
        assert!(!a.tma_epilogue_ok(), "N = 257 needs the direct epilogue");
        assert_eq!(a.scale_k_blocks(), 0);
        let t = check(128, 256, 128, E4M3, mkFloat16 as RawDataType, TENSOR).unwrap();
        assert_eq!((t.scale_steps(), t.scale_k_blocks()), ((0, 0), 0));
        let b = check(100, 300, 1024, E4M3, BF16, BLOCK).unwrap();
        assert_eq!((b.mode, b.scale_steps(), b.scale_k_blocks()), (mkScaleBlock, (0, 0), 8));
        assert!(t.tma_epilogue_ok());
        assert!(check(0, 0, 16, E4M3, BF16, TENSOR).is_ok(), "an empty GEMM is valid");
    }

    #[test]
    fn validate_names_each_broken_rule() {
        let v = |a, sa, b, sb, c| validate("mkScaledGemm", a, sa, b, sb, c, 4, 4, 32, E4M3, E4M3, BF16, ROWWISE);
        assert!(message(v(0, 0x5000, 0x2000, 0x6000, 0x3000)).contains("A is NULL"));
        assert!(message(v(0x1000, 0, 0x2000, 0x6000, 0x3000)).contains("scaleA is NULL"));
        assert!(message(v(0x1000, 0x5000, 0, 0x6000, 0x3000)).contains("B is NULL"));
        assert!(message(v(0x1000, 0x5000, 0x2000, 0, 0x3000)).contains("scaleB is NULL"));
        assert!(message(v(0x1000, 0x5000, 0x2000, 0x6000, 0)).contains("C is NULL"));
        assert!(message(v(0x1008, 0x5000, 0x2000, 0x6000, 0x3000)).contains("A = 0x1008 is not 16-byte aligned"));
        assert!(message(v(0x1000, 0x5000, 0x2004, 0x6000, 0x3000)).contains("B = 0x2004 is not 16-byte aligned"));
        assert!(message(v(0x1000, 0x5000, 0x2000, 0x6000, 0x3001)).contains("C = 0x3001"));
        assert!(message(v(0x1000, 0x5002, 0x2000, 0x6000, 0x3000)).contains("scaleA = 0x5002 is not aligned"));
        assert!(message(v(0x1000, 0x5000, 0x2000, 0x6001, 0x3000)).contains("scaleB = 0x6001 is not aligned"));
        for k in [0, 8, 24, 100] {
            assert!(message(check(4, 4, k, E4M3, BF16, TENSOR)).contains("positive multiple of 16"), "K = {k}");
        }
        assert!(message(check(1 << 31, 1, 16, E4M3, BF16, TENSOR)).contains("at most"));
        assert!(message(check(1 << 30, 1 << 30, 16, E4M3, BF16, TENSOR)).contains("tiles"));
        assert!(message(check(4, 4, 32, E4M3, BF16, 3)).contains("unknown scale mode 3"));
        for k in [16, 144, 1040] {
            let e = message(check(4, 4, k, E4M3, BF16, BLOCK));
            assert!(e.contains(&format!("K = {k} must be a multiple of 128 with block scales")), "{e}");
        }
        assert!(message(check(4, 4, 32, E4M3, BF16, -1)).contains("unknown scale mode -1"));
        assert!(message(check(4, 4, 32, 99, BF16, TENSOR)).contains("unknown datatype 99"));
        assert!(message(check(4, 4, 32, E4M3, 99, TENSOR)).contains("unknown datatype 99"));
    }

    #[test]
    fn validate_takes_e5m2_for_a_only() {
        for mode in [TENSOR, ROWWISE, BLOCK] {
            for out in [BF16, mkFloat16 as RawDataType] {
                let args = check_mixed(129, 300, 256, E5M2, E4M3, out, mode).unwrap();
                assert_eq!((args.a_type, args.b_type), (mkFloat8e5m2, mkFloat8e4m3), "mode {mode}");
            }
        }
        // B in e5m2, alone or with A (mkScaledGemm's one abType): refused, saying only A may be.
        for (a, b) in [(E4M3, E5M2), (E5M2, E5M2)] {
            let e = message(check_mixed(4, 4, 32, a, b, BF16, TENSOR));
            assert!(e.contains("B in float8e5m2 is not supported: mkScaledGemm takes mkFloat8e4m3 for B"), "{e}");
            assert!(e.contains("only A may be mkFloat8e5m2"), "{e}");
        }
    }

    #[test]
    fn validate_refuses_types_it_has_no_kernels_for() {
        let e = message(check(4, 4, 32, BF16, BF16, TENSOR));
        assert!(
            e.contains("A in bfloat16 is not supported: mkScaledGemm takes mkFloat8e4m3 or mkFloat8e5m2 for A"),
            "{e}"
        );
        assert!(message(check(4, 4, 32, mkInt8 as RawDataType, BF16, TENSOR)).contains("A in int8"));
        let e = message(check_mixed(4, 4, 32, E4M3, BF16, BF16, TENSOR));
        assert!(e.contains("B in bfloat16 is not supported") && !e.contains("only A"), "{e}");
        let out = message(check(4, 4, 32, E4M3, mkFloat32 as RawDataType, TENSOR));
        assert!(out.contains("cType float is not supported") && out.contains("mkFloat16 or mkBfloat16"), "{out}");
        assert!(message(check(4, 4, 32, E4M3, E4M3, TENSOR)).contains("cType float8e4m3"));
    }

    #[test]
    fn every_planned_kernel_exists_and_fits() {
        for bn in TILE_WIDTHS {
            for epilogue in [Epilogue::Tma, Epilogue::Direct] {
                for out in [mkBfloat16, mkFloat16] {
                    let k = kernel(mkFloat8e4m3, mkFloat8e4m3, out, bn, epilogue).unwrap();
                    assert!(k.name.starts_with("mk_scaled_gemm_e4m3_"), "{}", k.name);
                    let k = kernel(mkFloat8e5m2, mkFloat8e4m3, out, bn, epilogue).unwrap();
                    assert!(k.name.starts_with("mk_scaled_gemm_e5m2_"), "{}", k.name);
                }
                assert!(stages(bn, epilogue) >= 4, "bn {bn} {epilogue:?}: a ring deep enough to hide TMA latency");
                assert!(smem_bytes(bn, epilogue) <= SMEM_LIMIT, "bn {bn} {epilogue:?}");
            }
        }
        // The values ScaledConfig (kernels/common/gemm/scaled_mainloop.cuh) computes (same formula).
        assert_eq!((stages(128, Epilogue::Tma), smem_bytes(128, Epilogue::Tma)), (6, 1024 + 6 * 32768 + 32768 + 96));
        assert_eq!((stages(64, Epilogue::Tma), smem_bytes(64, Epilogue::Tma)), (8, 1024 + 8 * 24576 + 16384 + 128));
        assert_eq!((stages(128, Epilogue::Direct), smem_bytes(128, Epilogue::Direct)), (7, 1024 + 7 * 32768 + 112));
        // No kernel for e5m2 B nor for a 256-wide tile: errors, not another kernel.
        let e = kernel(mkFloat8e5m2, mkFloat8e5m2, mkBfloat16, 128, Epilogue::Tma).unwrap_err();
        assert_eq!(e.code, mkResult_t::mkInternalError, "{}", e.message);
        let e = kernel(mkBfloat16, mkFloat8e4m3, mkBfloat16, 128, Epilogue::Tma).unwrap_err();
        assert_eq!(e.code, mkResult_t::mkInvalidUsage);
        assert!(e.message.contains("compiled for mkFloat8e4m3, mkFloat8e5m2"), "{}", e.message);
        let e = kernel(mkFloat8e4m3, mkFloat8e4m3, mkBfloat16, 256, Epilogue::Tma).unwrap_err();
        assert_eq!(e.code, mkResult_t::mkInternalError);
    }

    #[test]
    fn plan_fills_the_gpu_and_covers_c() {
        let p = plan(4096, 4096, 132, true);
        assert_eq!((p.bn, p.tiles_m, p.tiles_n, p.grid), (128, 32, 32, 132));
        assert_eq!(p.epilogue, Epilogue::Tma);
        // Few 128-wide tiles: 64-wide ones give the SMs more work.
        let small = plan(128, 4096, 132, true);
        assert_eq!((small.bn, small.tiles_n, small.grid), (64, 64, 64));
        // N at most 64 keeps 128-wide tiles (one tile column either way).
        assert_eq!(plan(1, 64, 132, false).bn, 128);
        assert_eq!(plan(1, 64, 132, false).epilogue, Epilogue::Direct);
        for (m, n) in [(1, 1), (1, 7168), (300, 300), (8192, 28672), (64, 129)] {
            let p = plan(m, n, 132, true);
            assert!(p.tiles_m * BM >= m && p.tiles_n * p.bn >= n, "{m}x{n}: {p:?}");
            assert!(p.grid >= 1 && p.grid <= 132 && p.grid <= p.tiles_m * p.tiles_n, "{m}x{n}: {p:?}");
            assert!(p.group_m >= 1 && p.group_m <= p.tiles_m, "{m}x{n}: {p:?}");
            assert!(p.kernel_launch(mkFloat8e4m3, mkFloat8e4m3, mkBfloat16).is_ok());
            assert!(p.kernel_launch(mkFloat8e5m2, mkFloat8e4m3, mkFloat16).is_ok());
        }
    }
}
