//! fp8 GEMM + ReduceScatter and GEMM + AllReduce (`mkScaledGemmReduceScatter`,
//! `mkScaledGemmAllReduce`): every rank holds its K slice of A [M, K_r] and B [N, K_r] in
//! e4m3 with fp32 scales; the kernel (kernels/gemm_reduce_scaled.cu) runs the scaled GEMM's
//! mainloop (`ops::gemm::scaled`) on them, stores each rank's partial product rounded once to
//! C's type, and sums the n partials in fp32 in rank order with mkGemmReduceScatter's and
//! mkGemmAllReduce's reducers. [`validate_args`] (mkScaledGemm's rules through
//! `scaled::validate_for`, then the reduction's), [`plan`] (the reduction's role split,
//! tile and order: pure) and the launch. docs/decisions/0080 says what the scales mean per
//! rank and what is left out.

use crate::comm::workspace::SymmetricWorkspace;
use crate::comm::Comm;
use crate::cuda::kernels::{self, Arg, Kernel};
use crate::cuda::sys;
use crate::error::{MkError, Result};
use crate::kernel_abi::{MkOp, ScaledGemmReduceParams, WorkspaceView};
use crate::ops::common::fused_fence::{self, FusedKernel};
use crate::ops::common::launch::{self, DeviceCaps, KernelLaunch};
use crate::ops::dense::gemm_reduce::{self, GemmReducePlan, GemmReduceShape, Reduction, RoleSplit};
use crate::ops::gemm::engine::THREADS;
use crate::ops::gemm::scaled::{self, ScaledGemmArgs, BK, BM};
use crate::tuning::Tuning;
use crate::types::{Accepted, Element, RawDataType, RawScaleMode};
use std::ffi::c_void;

/// The C entry point of a reduction.
pub fn op_name(reduction: Reduction) -> &'static str {
    op(reduction).api_name()
}

/// The op code the kernel's error words carry.
fn op(reduction: Reduction) -> MkOp {
    match reduction {
        Reduction::Scatter => MkOp::ScaledGemmReduceScatter,
        Reduction::All => MkOp::ScaledGemmAllReduce,
    }
}

/// The C call's pointers and sizes, before validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaledGemmReduceCall {
    /// This rank's K slice of A, [m, k] e4m3.
    pub a: u64,
    /// Its scales: one; m; [k/128][m].
    pub scale_a: u64,
    /// This rank's K slice of B, [n, k] e4m3.
    pub b: u64,
    /// Its scales: one; n; [k/128][ceil(n/128)].
    pub scale_b: u64,
    /// ReduceScatter: this rank's [m / nranks, n] rows of the sum; AllReduce: [m, n].
    pub c: u64,
    pub m: usize,
    pub n: usize,
    /// This rank's share of the contraction.
    pub k: usize,
}

/// A validated call: the scaled GEMM of this rank's K slice, the reduction and the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaledGemmReduceArgs {
    pub gemm: ScaledGemmArgs,
    pub reduction: Reduction,
    pub nranks: usize,
    pub rank: usize,
}

/// Checks the arguments (no CUDA call): mkScaledGemm's rules over this rank's product (A and B
/// of one type, e4m3: the kernels multiply e4m3 only), then the reduction's: M divisible by
/// nranks for ReduceScatter, N a multiple of 8 and C 16-byte aligned (partial rows and sums
/// move as 16-byte vectors), and the tiles within the workspace's per-tile signals.
#[allow(clippy::too_many_arguments)] // mirrors the C signature
pub fn validate_args(
    reduction: Reduction,
    call: &ScaledGemmReduceCall,
    ab_type: RawDataType,
    c_type: RawDataType,
    mode: RawScaleMode,
    nranks: usize,
    rank: usize,
) -> Result<ScaledGemmReduceArgs> {
    if nranks == 0 || rank >= nranks {
        return Err(MkError::internal(format!("rank {rank} of {nranks}")));
    }
    let ScaledGemmReduceCall { a, scale_a, b, scale_b, c, m, n, k } = *call;
    let takes = |t: &Accepted| t.scaled_gemm;
    let op = op_name(reduction);
    let gemm = scaled::validate_for(op, takes, a, scale_a, b, scale_b, c, m, n, k, ab_type, ab_type, c_type, mode)?;
    if reduction == Reduction::Scatter {
        crate::ensure_arg!(
            m % nranks == 0,
            "M = {m} is not divisible by nranks = {nranks}: each rank receives M / nranks rows of C"
        );
    }
    crate::ensure_arg!(n % 8 == 0, "N = {n} must be a multiple of 8: partial rows are moved as 16-byte vectors");
    crate::ensure_arg!(c % 16 == 0, "C = {c:#x} is not 16-byte aligned (the sums are stored as 16-byte vectors)");
    gemm_reduce::check_tile_signals(m, n)?;
    Ok(ScaledGemmReduceArgs { gemm, reduction, nranks, rank })
}

/// The tile width: mkScaledGemm's rule over the compute CTAs, kept at 128 where 64-wide
/// tiles' flags would not fit the per-tile signals (validation counts 128-wide tiles).
pub fn tile_width(m: usize, n: usize, compute_ctas: usize) -> usize {
    let bn = scaled::tile_width(m, n, compute_ctas);
    if gemm_reduce::tile_signals_fit(m.div_ceil(BM) * n.div_ceil(bn)) {
        bn
    } else {
        128
    }
}

/// Plans a call on more than one rank of one node (`s.nodes` None): the reduction's role
/// split (`gemm_reduce::role_split`: one-shot or two-phase AllReduce, dedicated reduction
/// CTAs with MK_COMM_SMS), the scaled GEMM's 128-row tiles of [`tile_width`], owners
/// interleaved as mkGemmReduceScatter's; partials and sums in `out` (C's type).
pub fn plan(
    s: &GemmReduceShape,
    out: impl Element,
    grid_ctas: u32,
    comm_override: Option<u32>,
    tuning: &Tuning,
) -> Result<GemmReducePlan> {
    let GemmReduceShape { reduction, m, n, nranks, rank, nodes, .. } = *s;
    if nodes.is_some() {
        return Err(MkError::internal(format!("{} plans one node only", op_name(reduction))));
    }
    let RoleSplit { compute_ctas, reduce_ctas, two_phase } =
        gemm_reduce::role_split(s, grid_ctas, comm_override, tuning)?;
    let bn = tile_width(m, n, compute_ctas as usize);
    let interleave = gemm_reduce::interleave_owners(reduction, two_phase, m, nranks);
    let (row_lo, row_hi, out_row0) = gemm_reduce::output_rows(reduction, m, nranks, rank);
    Ok(GemmReducePlan {
        compute_ctas,
        reduce_ctas,
        two_phase,
        node_plan: None,
        op_bytes: gemm_reduce::one_node_op_bytes(m, n, out.element().bytes, two_phase),
        bm: BM,
        bn,
        tiles_n: n.div_ceil(bn),
        interleave,
        group_m: gemm_reduce::reduction_group_m(m.div_ceil(BM), bn, compute_ctas as usize, interleave),
        row_lo,
        row_hi,
        out_row0,
        early_items: 0,
        smem_bytes: scaled::smem_bytes_with_courier(bn),
        grid: compute_ctas + reduce_ctas,
    })
}

/// The kernel for A and B of `ab` (e4m3), C of `out` and tile width `bn`: the instance of
/// kernels/instances.txt's MK_GEMM_REDUCE_SCALED_ENTRY lines that has them.
pub fn kernel(ab: impl Element, out: impl Element, bn: usize) -> Result<Kernel> {
    let args = [Arg::Element, Arg::Text(out.element().cuda_type), Arg::Int(bn)];
    kernels::choose(
        "mkScaledGemmReduceScatter / mkScaledGemmAllReduce",
        ab.element(),
        "MK_GEMM_REDUCE_SCALED_ENTRY",
        &args,
    )
}

/// The launch of plan `p` for A and B of `ab`, C of `out`.
pub fn kernel_launch(p: &GemmReducePlan, ab: impl Element, out: impl Element) -> Result<KernelLaunch> {
    Ok(KernelLaunch::new(kernel(ab, out, p.bn)?, p.grid, THREADS, p.smem_bytes as u32))
}

/// The kernel's parameters for validated `args`, its `shape`, plan `p`, on workspace `ws`.
pub fn params(
    args: &ScaledGemmReduceArgs,
    shape: &GemmReduceShape,
    p: &GemmReducePlan,
    ws: &WorkspaceView,
) -> ScaledGemmReduceParams {
    let g = &args.gemm;
    let (scale_a_step, scale_b_step) = g.scale_steps();
    ScaledGemmReduceParams {
        gr: gemm_reduce::one_node_params(shape, p, g.c, g.out.element().bytes, op(args.reduction) as i32, ws),
        scale_a: g.scale_a,
        scale_b: g.scale_b,
        scale_a_step,
        scale_b_step,
        scale_k_blocks: g.scale_k_blocks(),
        reserved: 0,
    }
}

/// mkScaledGemmReduceScatter / mkScaledGemmAllReduce on `comm`: plan, launch
/// (stream-ordered, no host sync). One rank: the scaled GEMM alone, writing C.
pub fn scaled_gemm_reduce(comm: &Comm, args: &ScaledGemmReduceArgs, stream: sys::CUstream) -> Result<()> {
    comm.check_usable()?;
    let g = &args.gemm;
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    let name = op_name(args.reduction);
    let _ctx = comm.context.enter()?;
    let grid = DeviceCaps::of(comm)?.grid_cap();
    for (ptr, what) in [(g.a, "A"), (g.scale_a, "scaleA"), (g.b, "B"), (g.scale_b, "scaleB"), (g.c, "C")] {
        crate::cuda::pointer::check_device_pointer(ptr, comm.context.device, what)?;
    }
    if args.nranks == 1 {
        // The sum over one rank is its product: mkScaledGemm's kernel writing C.
        let p = scaled::plan(g.m, g.n, grid as usize, g.tma_epilogue_ok());
        return scaled::launch(g, &p, stream);
    }
    let ws = comm.one_node_workspace(name)?;
    let shape = GemmReduceShape {
        reduction: args.reduction,
        m: g.m,
        n: g.n,
        k: g.k,
        nranks: args.nranks,
        rank: args.rank,
        nodes: None,
    };
    let p = plan(&shape, g.out, grid, comm.config.comm_ctas, &comm.config.tuning)?;
    let needed = p.op_bytes;
    if needed > ws.view.op_bytes {
        return Err(MkError::invalid_usage(format!(
            "{name} keeps this rank's partial product{} ({needed} bytes, in C's type) in the workspace's fused-op \
             region, which holds {}: create the communicator with MK_WORKSPACE_BYTES (or mkConfig_t.workspaceBytes) \
             of at least {needed}",
            if p.two_phase { " and its reduced rows" } else { "" },
            ws.view.op_bytes
        )));
    }
    // The signal words are mkGemmReduceScatter's and mkGemmAllReduce's: one fence state.
    fused_fence::launch_fenced(comm, &ws.view, None, FusedKernel::GemmReduce, stream, || {
        launch(args, &shape, &p, ws, stream)
    })
}

fn launch(
    args: &ScaledGemmReduceArgs,
    shape: &GemmReduceShape,
    p: &GemmReducePlan,
    ws: &SymmetricWorkspace,
    stream: sys::CUstream,
) -> Result<()> {
    let g = &args.gemm;
    // P, this rank's partial product in C's type, at the start of the fused-op region.
    let partial_base = ws.view.data[ws.view.rank as usize] + ws.view.data_bytes;
    let mut ta = launch::tensor_map(g.a, g.a_type, g.m, g.k, BM, BK)?;
    let mut tb = launch::tensor_map(g.b, g.b_type, g.n, g.k, p.bn, BK)?;
    let mut tp = launch::tensor_map(partial_base, g.out, g.m, g.n, 64, 64)?;
    let mut kernel_params = params(args, shape, p, &ws.view);
    let kernel_launch = kernel_launch(p, g.a_type, g.out)?;
    let mut pointers: [*mut c_void; 4] = [
        (&mut ta as *mut sys::CUtensorMap).cast(),
        (&mut tb as *mut sys::CUtensorMap).cast(),
        (&mut tp as *mut sys::CUtensorMap).cast(),
        (&mut kernel_params as *mut ScaledGemmReduceParams).cast(),
    ];
    // SAFETY: the parameters match MK_GEMM_REDUCE_SCALED_ENTRY (3 tensor maps,
    // ScaledGemmReduceParams); the buffers were checked to be device memory of this device,
    // of the sizes the caller promised, and P (and R) fit in the fused-op region.
    unsafe { kernel_launch.launch(stream, &mut pointers, Some(op_name(args.reduction))) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::mkResult_t;
    use crate::ops::gemm::engine::{Epilogue, SMEM_LIMIT};
    use crate::tuning::Reducers;
    use crate::types::{mkDataType_t, mkScaleMode_t};
    use mkDataType_t::*;
    use mkScaleMode_t::*;

    const E4M3: RawDataType = mkFloat8e4m3 as RawDataType;
    const BF16: RawDataType = mkBfloat16 as RawDataType;

    fn call(m: usize, n: usize, k: usize) -> ScaledGemmReduceCall {
        ScaledGemmReduceCall { a: 0x1000, scale_a: 0x5000, b: 0x2000, scale_b: 0x6000, c: 0x3000, m, n, k }
    }

    fn message(r: Result<ScaledGemmReduceArgs>) -> String {
        let e = r.unwrap_err();
        assert_eq!(e.code, mkResult_t::mkInvalidArgument, "{}", e.message);
        e.message
    }

    fn shape(reduction: Reduction, m: usize, n: usize, k: usize, nranks: usize, rank: usize) -> GemmReduceShape {
        GemmReduceShape { reduction, m, n, k, nranks, rank, nodes: None }
    }

    #[test]
    fn validate_accepts_every_mode_output_and_reduction() {
        for reduction in [Reduction::Scatter, Reduction::All] {
            for mode in mkScaleMode_t::ALL {
                for out in [BF16, mkFloat16 as RawDataType] {
                    let a =
                        validate_args(reduction, &call(1024, 512, 256), E4M3, out, mode as RawScaleMode, 4, 3).unwrap();
                    assert_eq!((a.gemm.mode, a.gemm.m, a.gemm.k, a.reduction, a.rank), (mode, 1024, 256, reduction, 3));
                    assert_eq!((a.gemm.a_type, a.gemm.b_type), (mkFloat8e4m3, mkFloat8e4m3));
                }
            }
        }
        // AllReduce takes any M; an empty product is valid.
        assert!(validate_args(Reduction::All, &call(1001, 64, 128), E4M3, BF16, 1, 4, 0).is_ok());
        assert!(validate_args(Reduction::Scatter, &call(0, 0, 16), E4M3, BF16, 0, 2, 0).is_ok());
    }

    /// mkScaledGemm's rules (NULL and misaligned scales, K, block K, modes, types) come
    /// through `scaled::validate_for` naming this op; then the reduction's own.
    #[test]
    fn validate_names_each_broken_rule() {
        let v = |r: Reduction, c: ScaledGemmReduceCall, mode: mkScaleMode_t, n| {
            validate_args(r, &c, E4M3, BF16, mode as RawScaleMode, n, 0)
        };
        let rs = Reduction::Scatter;
        let good = call(512, 256, 256);
        assert!(
            message(v(rs, ScaledGemmReduceCall { scale_a: 0, ..good }, mkScaleRowwise, 2)).contains("scaleA is NULL")
        );
        assert!(message(v(rs, ScaledGemmReduceCall { scale_b: 0, ..good }, mkScaleBlock, 2)).contains("scaleB is NULL"));
        let e = message(v(rs, ScaledGemmReduceCall { scale_a: 0x5002, ..good }, mkScaleBlock, 2));
        assert!(e.contains("scaleA = 0x5002 is not aligned"), "{e}");
        let e = message(v(Reduction::All, ScaledGemmReduceCall { scale_b: 0x6001, ..good }, mkScaleTensor, 2));
        assert!(e.contains("scaleB = 0x6001 is not aligned"), "{e}");
        assert!(message(v(rs, ScaledGemmReduceCall { a: 0, ..good }, mkScaleTensor, 2)).contains("A is NULL"));
        assert!(
            message(v(rs, ScaledGemmReduceCall { b: 0x2008, ..good }, mkScaleTensor, 2)).contains("16-byte aligned")
        );
        // C: 2-byte aligned passes mkScaledGemm's rule, not the reduction's 16 bytes.
        let e = message(v(rs, ScaledGemmReduceCall { c: 0x3008, ..good }, mkScaleTensor, 2));
        assert!(e.contains("C = 0x3008 is not 16-byte aligned"), "{e}");
        assert!(message(v(rs, call(510, 256, 256), mkScaleTensor, 4)).contains("not divisible by nranks = 4"));
        assert!(v(Reduction::All, call(510, 256, 256), mkScaleTensor, 4).is_ok(), "AllReduce takes any M");
        assert!(message(v(rs, call(512, 260, 256), mkScaleTensor, 4)).contains("N = 260 must be a multiple of 8"));
        assert!(message(v(rs, call(512, 256, 200), mkScaleTensor, 4)).contains("positive multiple of 16"));
        let e = message(v(rs, call(512, 256, 272), mkScaleBlock, 4));
        assert!(e.contains("K = 272 must be a multiple of 128 with block scales"), "{e}");
        let e = message(v(Reduction::All, call(1 << 20, 1 << 16, 128), mkScaleTensor, 4));
        assert!(e.contains("split the GEMM"), "{e}");
        let e = message(validate_args(rs, &good, E4M3, BF16, 7, 2, 0));
        assert!(e.contains("unknown scale mode 7"), "{e}");
        let e = message(validate_args(rs, &good, mkFloat8e5m2 as RawDataType, BF16, 0, 2, 0));
        assert!(
            e.contains("A in float8e5m2 is not supported: mkScaledGemmReduceScatter takes mkFloat8e4m3 for A"),
            "{e}"
        );
        let e = message(validate_args(Reduction::All, &good, BF16, BF16, 0, 2, 0));
        assert!(e.contains("A in bfloat16 is not supported: mkScaledGemmAllReduce"), "{e}");
        let e = message(validate_args(rs, &good, E4M3, E4M3, 0, 2, 0));
        assert!(e.contains("cType float8e4m3 is not supported: mkScaledGemmReduceScatter writes C"), "{e}");
        assert_eq!(validate_args(rs, &good, E4M3, BF16, 0, 2, 2).unwrap_err().code, mkResult_t::mkInternalError);
    }

    /// Every plan over the reductions, rank counts, shapes, grids and tunings launches a
    /// built kernel within the shared memory, its flags within the signal words, and covers
    /// this rank's rows of the sum.
    #[test]
    fn every_plan_launches_a_built_kernel_within_the_shared_memory() {
        let tunings = [
            Tuning::default(),
            Tuning { gemm_reducers: Reducers::After, ..Tuning::default() },
            Tuning { gemm_ar_one_shot_max_m: 0, ..Tuning::default() },
        ];
        let (mut planned, mut refused) = (0, 0);
        for reduction in [Reduction::Scatter, Reduction::All] {
            for nranks in [2, 3, 4, 8] {
                for rows in [1, 16, 64, 100, 128, 256, 1024] {
                    for n in [8, 128, 264, 1024, 8192] {
                        for (grid, comm) in [(132, None), (132, Some(14)), (66, None), (1, None)] {
                            for tuning in &tunings {
                                let m = rows * nranks;
                                let s = shape(reduction, m, n, 256, nranks, nranks - 1);
                                // Refused exactly where the bf16 op's planner refuses.
                                let bf16 = gemm_reduce::plan(&s, mkBfloat16, grid, comm, tuning);
                                let Ok(p) = plan(&s, mkBfloat16, grid, comm, tuning) else {
                                    assert!(bf16.is_err(), "{s:?}");
                                    refused += 1;
                                    continue;
                                };
                                assert!(bf16.is_ok(), "{s:?}");
                                planned += 1;
                                assert_eq!(p.compute_ctas + p.reduce_ctas, grid, "{s:?}");
                                assert!(!p.two_phase || reduction == Reduction::All, "{s:?}");
                                assert_eq!((p.bm, p.early_items, p.node_plan), (BM, 0, None), "{s:?}");
                                assert!(scaled::TILE_WIDTHS.contains(&p.bn), "{s:?}");
                                assert!(p.tiles_n * p.bn >= n && (p.tiles_n - 1) * p.bn < n, "{s:?}");
                                assert!(gemm_reduce::tile_signals_fit(m.div_ceil(BM) * p.tiles_n), "{s:?}");
                                assert_eq!(p.group_m % p.interleave, 0);
                                assert!(p.row_lo <= p.row_hi && p.row_hi <= m && p.out_row0 <= p.row_lo);
                                // The kernel's 1 KiB of static shared memory fits beside.
                                assert!(p.smem_bytes + 1024 <= SMEM_LIMIT, "{p:?}");
                                for out in [mkBfloat16, mkFloat16] {
                                    let l = kernel_launch(&p, mkFloat8e4m3, out).unwrap();
                                    assert_eq!((l.grid, l.block, l.smem_bytes), (grid, 384, p.smem_bytes as u32));
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(planned > 1000, "{planned} planned, {refused} refused");
    }

    /// Representative plans: the role split is the bf16 op's (one-shot and two-phase
    /// AllReduce, dedicated CTAs), the tile the scaled GEMM's, P in C's type.
    #[test]
    fn the_plan_splits_roles_as_the_bf16_op_and_tiles_as_the_scaled_gemm() {
        let t = Tuning::default();
        // GEMM+RS, 2 ranks × 2048 rows, N 8192 on 32 CTAs: 128-wide tiles, owners interleaved,
        // P of M·N bf16.
        let p = plan(&shape(Reduction::Scatter, 4096, 8192, 1024, 2, 1), mkBfloat16, 32, None, &t).unwrap();
        assert_eq!((p.bm, p.bn, p.tiles_n, p.interleave, p.two_phase), (128, 128, 64, 2, false));
        assert_eq!((p.row_lo, p.row_hi, p.out_row0, p.grid), (2048, 4096, 2048, 32));
        assert_eq!((p.op_bytes, p.smem_bytes), (4096 * 8192 * 2, scaled::smem_bytes(128, Epilogue::Tma) + 64));
        // Decode-sized AllReduce: one-shot, 64-wide tiles (few 128-wide ones), every row.
        let p = plan(&shape(Reduction::All, 16, 4096, 512, 4, 2), mkFloat16, 132, None, &t).unwrap();
        assert_eq!((p.bn, p.two_phase, p.interleave, p.row_lo, p.row_hi), (64, false, 1, 0, 16));
        assert_eq!(p.op_bytes, 16 * 4096 * 2);
        // Large AllReduce: two-phase, P and R.
        let p = plan(&shape(Reduction::All, 8192, 8192, 1024, 4, 2), mkBfloat16, 132, None, &t).unwrap();
        assert_eq!((p.two_phase, p.interleave, p.op_bytes), (true, 4, 2 * 8192 * 8192 * 2));
        // The bf16 planners' role split, whatever the element type.
        for (s, comm) in [
            (shape(Reduction::Scatter, 4096, 8192, 1024, 4, 0), Some(14)),
            (shape(Reduction::All, 8192, 8192, 1024, 4, 3), None),
            (shape(Reduction::All, 200, 1024, 256, 2, 1), Some(8)),
        ] {
            let bf16 = gemm_reduce::plan(&s, mkBfloat16, 132, comm, &t).unwrap();
            let fp8 = plan(&s, mkBfloat16, 132, comm, &t).unwrap();
            assert_eq!(
                (fp8.compute_ctas, fp8.reduce_ctas, fp8.two_phase, fp8.row_lo, fp8.row_hi, fp8.op_bytes),
                (bf16.compute_ctas, bf16.reduce_ctas, bf16.two_phase, bf16.row_lo, bf16.row_hi, bf16.op_bytes),
                "{s:?}"
            );
        }
        // Across nodes is refused before the kernel (mkInvalidUsage from the communicator);
        // the planner itself takes one node only.
        let nodes = GemmReduceShape { nodes: Some((2, 1 << 20)), ..shape(Reduction::Scatter, 512, 512, 128, 4, 0) };
        assert_eq!(plan(&nodes, mkBfloat16, 132, None, &t).unwrap_err().code, mkResult_t::mkInternalError);
    }

    /// 64-wide tiles only where their flags fit the signal words: the validation counts
    /// 128-wide tiles, so a tile width that doubles the tiles must still fit.
    #[test]
    fn narrow_tiles_only_where_their_flags_fit() {
        assert_eq!(tile_width(128, 4096, 132), 64);
        assert_eq!(tile_width(8192, 8192, 132), 128);
        // The most 128-row blocks whose flags fit at N = 128 (one tile column): valid, while
        // twice as many tiles would not fit.
        let blocks = (1..).take_while(|&b| gemm_reduce::tile_signals_fit(b)).last().unwrap();
        let m = blocks * BM;
        assert!(gemm_reduce::check_tile_signals(m, 128).is_ok());
        assert!(!gemm_reduce::tile_signals_fit(2 * blocks));
        // More CTAs than 128-wide tiles: mkScaledGemm's rule asks for 64-wide ones, whose
        // flags do not fit, so the tile stays 128 wide; plans over the rule's grid agree.
        assert_eq!(scaled::tile_width(m, 128, blocks + 1), 64);
        assert_eq!(tile_width(m, 128, blocks + 1), 128);
        let s = shape(Reduction::All, m, 128, 128, 2, 0);
        let p = plan(&s, mkBfloat16, blocks as u32 + 1, None, &Tuning::default()).unwrap();
        assert_eq!((p.bn, p.tiles_n), (128, 1));
    }

    #[test]
    fn every_kernel_exists_and_e5m2_has_none() {
        for bn in scaled::TILE_WIDTHS {
            for out in [mkBfloat16, mkFloat16] {
                let k = kernel(mkFloat8e4m3, out, bn).unwrap();
                assert!(k.name.starts_with("mk_gemm_reduce_scaled_e4m3_"), "{}", k.name);
            }
        }
        let e = kernel(mkFloat8e5m2, mkBfloat16, 128).unwrap_err();
        assert_eq!(e.code, mkResult_t::mkInvalidUsage, "{}", e.message);
        assert!(kernel(mkFloat8e4m3, mkBfloat16, 256).is_err());
    }

    /// The kernel's parameters: the bf16 op's one-node fields over C's type (R after P of
    /// M·N two-byte elements), this op's code, and the scales as mkScaledGemm passes them.
    #[test]
    fn params_carry_the_scales_and_the_ops_code() {
        let view = WorkspaceView { data_bytes: 1 << 20, rank: 1, nranks: 4, ..Default::default() };
        let t = Tuning::default();
        for reduction in [Reduction::Scatter, Reduction::All] {
            for mode in mkScaleMode_t::ALL {
                let args =
                    validate_args(reduction, &call(2048, 512, 256), E4M3, BF16, mode as RawScaleMode, 4, 1).unwrap();
                let s = shape(reduction, 2048, 512, 256, 4, 1);
                let p = plan(&s, mkBfloat16, 132, None, &t).unwrap();
                let k = params(&args, &s, &p, &view);
                assert_eq!((k.scale_a, k.scale_b, k.reserved), (0x5000, 0x6000, 0));
                let want = match mode {
                    mkScaleTensor => (0, 0, 0),
                    mkScaleRowwise => (1, 1, 0),
                    mkScaleBlock => (0, 0, 2),
                };
                assert_eq!((k.scale_a_step, k.scale_b_step, k.scale_k_blocks), want, "{mode:?}");
                let gr = k.gr;
                assert_eq!((gr.c, gr.partial_offset, gr.reduced_offset), (0x3000, 1 << 20, (1 << 20) + 2048 * 512 * 2));
                assert_eq!(
                    (gr.m, gr.n, gr.k, gr.nodes, gr.early_items, gr.a_box_rows, gr.trace),
                    (2048, 512, 256, 1, 0, 0, 0)
                );
                assert_eq!((gr.row_lo, gr.row_hi), (p.row_lo as i32, p.row_hi as i32));
                assert_eq!(gr.op, op(reduction) as i32);
                assert_eq!(MkOp::from_u32(gr.op as u32).unwrap().api_name(), op_name(reduction));
            }
        }
    }
}
