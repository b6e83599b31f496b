//! fp8 AllGather + GEMM (`mkAllGatherScaledGemm`): each rank holds M / nranks rows of A in
//! e4m3 with their fp32 scales; the kernel (kernels/ag_scaled_gemm.cu) gathers the rows and
//! scales of every rank and runs the scaled GEMM (`ops::gemm::scaled`'s mainloop) over each
//! shard as it arrives, as mkAllGatherGemm does for bf16: one byte per element of A on the
//! wire instead of two. [`validate_args`] (the argument rules, no CUDA), [`plan`] (chunks,
//! tile, order: pure), [`GatheredLayout`] (where the gathered rows and scales live and the
//! bytes each rank pushes) and the launch. docs/decisions/0077 says what per-tensor means
//! across ranks and what is left out.

use crate::comm::workspace::SymmetricWorkspace;
use crate::comm::Comm;
use crate::cuda::kernels::{self, Arg, Kernel};
use crate::cuda::sys;
use crate::error::{MkError, Result};
use crate::kernel_abi::{AgGemmParams, AgScaledGemmParams};
use crate::ops::common::fused_fence::{self, FusedKernel};
use crate::ops::common::launch::{self, DeviceCaps, KernelLaunch};
use crate::ops::dense::ag_gemm::{self, Chunking, ROW_BLOCK};
use crate::ops::gemm::engine::{Epilogue, THREADS};
use crate::ops::gemm::scaled::{self, ScaledGemmArgs, BK, BM};
use crate::types::{mkDataType_t, mkScaleMode_t, Accepted, Element, RawDataType, RawScaleMode};
use std::ffi::c_void;

/// The C call's pointers and sizes, before validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgScaledGemmCall {
    /// This rank's rows of A: [m / nranks, k] e4m3.
    pub a: u64,
    /// This rank's scales of its rows (one; m / nranks; [k/128][m / nranks]).
    pub scale_a: u64,
    pub b: u64,
    pub scale_b: u64,
    pub c: u64,
    /// All gathered rows.
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// A validated call: the scaled GEMM's arguments over all gathered rows (`gemm.m` = M,
/// `gemm.a` and `gemm.scale_a` this rank's shard) and the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgScaledGemmArgs {
    pub gemm: ScaledGemmArgs,
    pub nranks: usize,
    pub rank: usize,
}

impl AgScaledGemmArgs {
    pub fn rows_per_rank(&self) -> usize {
        self.gemm.m / self.nranks
    }
}

/// Checks mkAllGatherScaledGemm's arguments (no CUDA call): mkScaledGemm's rules over the
/// gathered shape, then the gather's: M divisible by nranks, N a multiple of 8 and C
/// 16-byte aligned (C is written with TMA stores, as mkAllGatherGemm's).
pub fn validate_args(
    call: &AgScaledGemmCall,
    ab_type: RawDataType,
    c_type: RawDataType,
    mode: RawScaleMode,
    nranks: usize,
    rank: usize,
) -> Result<AgScaledGemmArgs> {
    if nranks == 0 || rank >= nranks {
        return Err(MkError::internal(format!("rank {rank} of {nranks}")));
    }
    let AgScaledGemmCall { a, scale_a, b, scale_b, c, m, n, k } = *call;
    // A and B of one type, e4m3: the gathered rows feed kernels compiled for e4m3 A only.
    let op = "mkAllGatherScaledGemm";
    let takes = |t: &Accepted| t.scaled_gemm;
    let gemm = scaled::validate_for(op, takes, a, scale_a, b, scale_b, c, m, n, k, ab_type, ab_type, c_type, mode)?;
    crate::ensure_arg!(
        m % nranks == 0,
        "M = {m} is not divisible by nranks = {nranks}: each rank holds M / nranks rows of A"
    );
    crate::ensure_arg!(n % 8 == 0, "N = {n} must be a multiple of 8: C rows are written with TMA (16-byte rows)");
    crate::ensure_arg!(c % 16 == 0, "C = {c:#x} is not 16-byte aligned (C is written with TMA stores)");
    Ok(AgScaledGemmArgs { gemm, nranks, rank })
}

/// Where the gathered A lives in every rank's fused-op region, and what one call moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatheredLayout {
    /// Bytes of the gathered rows (M·K, one byte per e4m3 element), at the region's start.
    pub rows_bytes: usize,
    /// Offset of the gathered scales from the region's start (16-byte aligned).
    pub scale_offset: usize,
    /// Bytes of the gathered scales: one fp32 per row per tensor and rowwise (a rank's one
    /// scale is written for each of its rows), [K/128][M] fp32 with block scales.
    pub scale_bytes: usize,
}

impl GatheredLayout {
    pub fn new(m: usize, k: usize, mode: mkScaleMode_t) -> GatheredLayout {
        let rows_bytes = m * k;
        GatheredLayout {
            rows_bytes,
            scale_offset: rows_bytes.next_multiple_of(16),
            scale_bytes: 4 * m * scale_words_per_row(k, mode),
        }
    }
    /// Bytes of the fused-op region the call needs.
    pub fn region_bytes(&self) -> usize {
        self.scale_offset + self.scale_bytes
    }
}

/// Gathered scale words per row: K/128 with block scales, else 1.
pub fn scale_words_per_row(k: usize, mode: mkScaleMode_t) -> usize {
    if mode == mkScaleMode_t::mkScaleBlock {
        k / mkScaleMode_t::BLOCK
    } else {
        1
    }
}

/// Bytes each rank pushes to its peers in one call: its rows and their gathered scales,
/// to each of the nranks − 1 others.
pub fn pushed_bytes(rows_per_rank: usize, k: usize, mode: mkScaleMode_t, nranks: usize) -> usize {
    (nranks - 1) * rows_per_rank * (k + 4 * scale_words_per_row(k, mode))
}

/// What mkAllGatherGemm pushes for the same rows in bf16 or fp16: two bytes per element.
pub fn pushed_bytes_16bit(rows_per_rank: usize, k: usize, nranks: usize) -> usize {
    (nranks - 1) * rows_per_rank * k * 2
}

/// Everything the launch needs, decided from the shape and the grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgScaledGemmPlan {
    pub rows_per_rank: usize,
    pub chunking: Chunking,
    /// The scaled GEMM's tile width (64 or 128) and its dynamic shared memory (TMA stores).
    pub bn: usize,
    pub smem_bytes: usize,
    /// m-blocks per raster group (ag_gemm's rule: the first wave needs this rank's rows and
    /// at most one peer's).
    pub group_m: usize,
    /// The m-block of this rank's first row: the rank-rotated order starts there.
    pub m_block_base: usize,
    /// CTAs: every one runs GEMM tiles and pushes a slice of every chunk (its producer
    /// warpgroup's idle warps), so even a GEMM of few tiles pushes from the whole grid.
    pub grid: u32,
}

impl AgScaledGemmPlan {
    /// The launch of this plan for C of `out`.
    pub fn kernel_launch(&self, out: impl Element) -> Result<KernelLaunch> {
        Ok(KernelLaunch::new(
            kernel(mkDataType_t::mkFloat8e4m3, out, self.bn)?,
            self.grid,
            THREADS,
            self.smem_bytes as u32,
        ))
    }
}

/// The tile width: mkScaledGemm's rule (`scaled::tile_width`).
pub fn tile_width(m: usize, n: usize, ctas: usize) -> usize {
    scaled::tile_width(m, n, ctas)
}

/// Plans a call of `m` gathered rows over `nranks` (m % nranks == 0) on `grid_ctas` CTAs
/// (`DeviceCaps::grid_cap`).
pub fn plan(m: usize, n: usize, nranks: usize, rank: usize, grid_ctas: u32) -> Result<AgScaledGemmPlan> {
    if grid_ctas < 1 {
        return Err(MkError::invalid_argument("the grid cap (MK_MAX_CTAS) must be at least 1"));
    }
    let rows_per_rank = m / nranks;
    let chunking = ag_gemm::chunking(rows_per_rank, nranks)?;
    let bn = tile_width(m, n, grid_ctas as usize);
    Ok(AgScaledGemmPlan {
        rows_per_rank,
        chunking,
        bn,
        smem_bytes: scaled::smem_bytes(bn, Epilogue::Tma),
        group_m: ag_gemm::raster_group(m, rows_per_rank, bn, grid_ctas as usize),
        m_block_base: rank * rows_per_rank / ROW_BLOCK,
        grid: grid_ctas,
    })
}

/// The kernel for A/B of `ab` (e4m3), C of `out` and tile width `bn`: the instance of
/// kernels/instances.txt's MK_AG_SCALED_GEMM_ENTRY lines that has them.
pub fn kernel(ab: impl Element, out: impl Element, bn: usize) -> Result<Kernel> {
    let args = [Arg::Element, Arg::Text(out.element().cuda_type), Arg::Int(bn)];
    kernels::choose("mkAllGatherScaledGemm", ab.element(), "MK_AG_SCALED_GEMM_ENTRY", &args)
}

/// The gathered scale words pusher `part` of `parts` copies for chunk rows
/// [row0, row0 + rows) of rank `src`, as (gathered index, local index) pairs: the CPU
/// model of kernels/ag_scaled_gemm.cu's `slice_of` and `copy_scales` (word j is K block
/// j / rows of local row row0 + j % rows; the gathered array is [K/128][m]).
#[allow(clippy::too_many_arguments)] // the kernel's parameters, one by one
pub fn scale_slice(
    src: usize,
    rows_per_rank: usize,
    m: usize,
    words_per_row: usize,
    local_step: usize,
    row0: usize,
    rows: usize,
    part: usize,
    parts: usize,
) -> Vec<(usize, usize)> {
    let total = rows * words_per_row;
    let slice = total.div_ceil(parts);
    let begin = (part * slice).min(total);
    let end = (begin + slice).min(total);
    (begin..end)
        .map(|j| {
            let (kb, i) = (j / rows, row0 + j % rows);
            (kb * m + src * rows_per_rank + i, (kb * rows_per_rank + i) * local_step)
        })
        .collect()
}

/// mkAllGatherScaledGemm on `comm`: plan, launch (stream-ordered, no host sync). One rank:
/// the scaled GEMM alone.
pub fn all_gather_scaled_gemm(comm: &Comm, args: &AgScaledGemmArgs, stream: sys::CUstream) -> Result<()> {
    comm.check_usable()?;
    let g = &args.gemm;
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    let _ctx = comm.context.enter()?;
    let grid = DeviceCaps::of(comm)?.grid_cap();
    for (ptr, name) in [(g.a, "A"), (g.scale_a, "scaleA"), (g.b, "B"), (g.scale_b, "scaleB"), (g.c, "C")] {
        crate::cuda::pointer::check_device_pointer(ptr, comm.context.device, name)?;
    }
    if args.nranks == 1 {
        // Nothing to gather: mkScaledGemm's kernel on this rank's rows and scales.
        let p = scaled::plan(g.m, g.n, grid as usize, g.tma_epilogue_ok());
        return scaled::launch(g, &p, stream);
    }
    let ws = comm.one_node_workspace("mkAllGatherScaledGemm")?;
    let layout = GatheredLayout::new(g.m, g.k, g.mode);
    let needed = layout.region_bytes() as u64;
    if needed > ws.view.op_bytes {
        return Err(MkError::invalid_usage(format!(
            "mkAllGatherScaledGemm gathers {} bytes of A and {} of its scales into the workspace's fused-op region, \
             which holds {}: create the communicator with MK_WORKSPACE_BYTES (or mkConfig_t.workspaceBytes) of at \
             least {needed}",
            layout.rows_bytes, layout.scale_bytes, ws.view.op_bytes
        )));
    }
    let p = plan(g.m, g.n, args.nranks, args.rank, grid)?;
    fused_fence::launch_fenced(comm, &ws.view, None, FusedKernel::AllGatherGemm, stream, || {
        launch(args, &p, &layout, ws, stream)
    })
}

/// The kernel's parameters for validated `args`, plan `p` and `layout` on workspace `ws`.
pub fn params(
    args: &AgScaledGemmArgs,
    p: &AgScaledGemmPlan,
    layout: &GatheredLayout,
    ws: &crate::kernel_abi::WorkspaceView,
) -> AgScaledGemmParams {
    let g = &args.gemm;
    let tensor = g.mode == mkScaleMode_t::mkScaleTensor;
    AgScaledGemmParams {
        ag: AgGemmParams {
            ws: *ws,
            a_local: g.a,
            gathered_offset: ws.data_bytes,
            m: g.m as i32,
            n: g.n as i32,
            k: g.k as i32,
            rows_per_rank: p.rows_per_rank as i32,
            chunk_rows: p.chunking.chunk_rows as i32,
            chunks_per_rank: p.chunking.chunks_per_rank as i32,
            compute_ctas: p.grid as i32,
            group_m: p.group_m as i32,
            m_block_base: p.m_block_base as i32,
            global_rank: args.rank as i32,
            flag_stride: p.chunking.flag_stride as i32,
            nodes: 1,
            ..Default::default()
        },
        scale_a_local: g.scale_a,
        scale_b: g.scale_b,
        scale_offset: ws.data_bytes + layout.scale_offset as u64,
        scale_a_local_step: if tensor { 0 } else { 1 },
        scale_k_blocks: g.scale_k_blocks(),
        scale_b_step: g.scale_steps().1,
        reserved: 0,
    }
}

fn launch(
    args: &AgScaledGemmArgs,
    p: &AgScaledGemmPlan,
    layout: &GatheredLayout,
    ws: &SymmetricWorkspace,
    stream: sys::CUstream,
) -> Result<()> {
    let g = &args.gemm;
    // The fused ops' region follows the collectives' data region in every rank's workspace.
    let gathered_base = ws.view.data[ws.view.rank as usize] + ws.view.data_bytes;
    let mut ta = launch::tensor_map(gathered_base, g.a_type, g.m, g.k, BM, BK)?;
    let mut tb = launch::tensor_map(g.b, g.b_type, g.n, g.k, p.bn, BK)?;
    let mut tc = launch::tensor_map(g.c, g.out, g.m, g.n, 64, 64)?;
    let mut kernel_params = params(args, p, layout, &ws.view);
    let kernel_launch = p.kernel_launch(g.out)?;
    let mut pointers: [*mut c_void; 4] = [
        (&mut ta as *mut sys::CUtensorMap).cast(),
        (&mut tb as *mut sys::CUtensorMap).cast(),
        (&mut tc as *mut sys::CUtensorMap).cast(),
        (&mut kernel_params as *mut AgScaledGemmParams).cast(),
    ];
    // SAFETY: the parameters match MK_AG_SCALED_GEMM_ENTRY (3 tensor maps, AgScaledGemmParams);
    // the buffers were checked to be device memory of this device, of the sizes the caller
    // promised, and the gathered rows and scales fit in the fused-op region.
    unsafe { kernel_launch.launch(stream, &mut pointers, Some("mkAllGatherScaledGemm")) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::mkResult_t;
    use mkDataType_t::*;
    use mkScaleMode_t::*;

    const E4M3: RawDataType = mkFloat8e4m3 as RawDataType;
    const BF16: RawDataType = mkBfloat16 as RawDataType;

    fn call(m: usize, n: usize, k: usize) -> AgScaledGemmCall {
        AgScaledGemmCall { a: 0x1000, scale_a: 0x5000, b: 0x2000, scale_b: 0x6000, c: 0x3000, m, n, k }
    }

    fn message(r: Result<AgScaledGemmArgs>) -> String {
        let e = r.unwrap_err();
        assert_eq!(e.code, mkResult_t::mkInvalidArgument, "{}", e.message);
        e.message
    }

    #[test]
    fn validate_accepts_every_mode_and_output() {
        for mode in mkScaleMode_t::ALL {
            for out in [BF16, mkFloat16 as RawDataType] {
                let a = validate_args(&call(1024, 512, 256), E4M3, out, mode as RawScaleMode, 4, 3).unwrap();
                assert_eq!((a.gemm.mode, a.gemm.m, a.rows_per_rank(), a.rank), (mode, 1024, 256, 3));
            }
        }
        assert!(validate_args(&call(0, 0, 16), E4M3, BF16, mkScaleTensor as RawScaleMode, 2, 0).is_ok());
    }

    #[test]
    fn validate_names_each_broken_rule() {
        let v = |c: AgScaledGemmCall, mode: mkScaleMode_t, n| validate_args(&c, E4M3, BF16, mode as RawScaleMode, n, 0);
        let good = call(512, 256, 256);
        assert!(message(v(AgScaledGemmCall { scale_a: 0, ..good }, mkScaleRowwise, 2)).contains("scaleA is NULL"));
        assert!(message(v(AgScaledGemmCall { scale_b: 0, ..good }, mkScaleRowwise, 2)).contains("scaleB is NULL"));
        let e = message(v(AgScaledGemmCall { scale_a: 0x5002, ..good }, mkScaleBlock, 2));
        assert!(e.contains("scaleA = 0x5002 is not aligned"), "{e}");
        assert!(message(v(AgScaledGemmCall { a: 0, ..good }, mkScaleTensor, 2)).contains("A is NULL"));
        assert!(message(v(AgScaledGemmCall { a: 0x1008, ..good }, mkScaleTensor, 2)).contains("16-byte aligned"));
        assert!(message(v(AgScaledGemmCall { c: 0x3008, ..good }, mkScaleTensor, 2)).contains("C = 0x3008"));
        assert!(message(v(call(510, 256, 256), mkScaleTensor, 4)).contains("not divisible by nranks = 4"));
        assert!(message(v(call(512, 260, 256), mkScaleTensor, 4)).contains("N = 260 must be a multiple of 8"));
        assert!(message(v(call(512, 256, 200), mkScaleTensor, 4)).contains("positive multiple of 16"));
        let e = message(v(call(512, 256, 272), mkScaleBlock, 4));
        assert!(e.contains("K = 272 must be a multiple of 128 with block scales"), "{e}");
        let e = message(validate_args(&good, E4M3, BF16, 7, 2, 0));
        assert!(e.contains("unknown scale mode 7"), "{e}");
        let e = message(validate_args(&good, mkFloat8e5m2 as RawDataType, BF16, 0, 2, 0));
        assert!(e.contains("A in float8e5m2 is not supported: mkAllGatherScaledGemm takes mkFloat8e4m3 for A"), "{e}");
        assert!(e.contains("no kernel of mkAllGatherScaledGemm does"), "{e}");
        let e = message(validate_args(&good, BF16, BF16, 0, 2, 0));
        assert!(e.contains("A in bfloat16 is not supported"), "{e}");
        let e = message(validate_args(&good, E4M3, E4M3, 0, 2, 0));
        assert!(e.contains("cType float8e4m3 is not supported: mkAllGatherScaledGemm writes C"), "{e}");
    }

    #[test]
    fn the_gathered_layout_fits_rows_then_aligned_scales() {
        let t = GatheredLayout::new(1000, 272, mkScaleTensor);
        assert_eq!((t.rows_bytes, t.scale_offset, t.scale_bytes), (272_000, 272_000, 4000));
        let odd = GatheredLayout::new(3, 16, mkScaleRowwise);
        assert_eq!((odd.rows_bytes, odd.scale_offset, odd.scale_bytes), (48, 48, 12));
        let b = GatheredLayout::new(8, 8192, mkScaleBlock);
        assert_eq!((b.scale_offset, b.scale_bytes, b.region_bytes()), (65536, 4 * 8 * 64, 65536 + 2048));
        for (m, k) in [(1, 16), (7, 48), (333, 144)] {
            assert_eq!(GatheredLayout::new(m, k, mkScaleRowwise).scale_offset % 16, 0, "m {m} k {k}");
        }
    }

    #[test]
    fn the_wire_carries_half_the_bytes_of_bf16_plus_the_scales() {
        for (rows, k, n) in [(128, 8192, 2), (512, 4096, 4), (2048, 7168, 8)] {
            let bf16 = pushed_bytes_16bit(rows, k, n);
            // The rows are exactly half; the scales add 4 bytes per row (per tensor, rowwise)
            // or per row per 128 of K (block: 1/64 of bf16's bytes).
            assert_eq!(pushed_bytes(rows, k, mkScaleRowwise, n), bf16 / 2 + (n - 1) * rows * 4);
            assert_eq!(pushed_bytes(rows, k, mkScaleTensor, n), bf16 / 2 + (n - 1) * rows * 4);
            assert_eq!(pushed_bytes(rows, k, mkScaleBlock, n), bf16 / 2 + bf16 / 64);
            let ratio = pushed_bytes(rows, k, mkScaleBlock, n) as f64 / bf16 as f64;
            assert!((ratio - 0.515625).abs() < 1e-12, "{ratio}");
        }
        assert_eq!(pushed_bytes(256, 1024, mkScaleBlock, 1), 0, "one rank pushes nothing");
    }

    #[test]
    fn plan_chunks_every_row_and_starts_at_own_rows() {
        let p = plan(8192, 8192, 4, 2, 132).unwrap();
        assert_eq!((p.rows_per_rank, p.bn, p.grid, p.m_block_base), (2048, 128, 132, 32));
        assert_eq!(p.smem_bytes, scaled::smem_bytes(128, Epilogue::Tma));
        assert!(p.chunking.chunks_per_rank * p.chunking.chunk_rows >= p.rows_per_rank);
        assert_eq!(p.chunking.chunk_rows % ROW_BLOCK, 0);
        assert!(p.chunking.chunks_per_rank <= p.chunking.flag_stride);
        // Decode rows: few 128-wide tiles, so 64-wide ones; every CTA still pushes.
        let small = plan(16, 4096, 8, 5, 132).unwrap();
        assert_eq!((small.rows_per_rank, small.bn, small.grid, small.m_block_base), (2, 64, 132, 0));
        assert_eq!(small.chunking.chunks_per_rank, 1);
        // The chunking is mkAllGatherGemm's, so both ops flag the same words.
        let bf16 = ag_gemm::plan(&ag_gemm::AgGemmShape { m: 8192, n: 8192, k: 8192, nranks: 4, rank: 2 }, 132, None);
        let bf16 = bf16.unwrap();
        assert_eq!(
            (p.chunking.chunk_rows, p.chunking.chunks_per_rank, p.chunking.flag_stride),
            (bf16.chunk_rows, bf16.chunks_per_rank, bf16.flag_stride)
        );
        assert!(plan(64, 64, 2, 0, 0).is_err());
        assert_eq!(plan(65 * 128, 64, 65, 0, 132).unwrap_err().code, mkResult_t::mkInvalidUsage);
    }

    #[test]
    fn every_planned_kernel_exists_and_fits() {
        for bn in scaled::TILE_WIDTHS {
            for out in [mkBfloat16, mkFloat16] {
                let k = kernel(mkFloat8e4m3, out, bn).unwrap();
                assert!(k.name.starts_with("mk_ag_scaled_gemm_e4m3_"), "{}", k.name);
            }
        }
        let e = kernel(mkFloat8e5m2, mkBfloat16, 128).unwrap_err();
        assert_eq!(e.code, mkResult_t::mkInvalidUsage, "{}", e.message);
        for (m, n) in [(2, 8), (16, 4096), (8192, 8192), (1000, 264)] {
            let p = plan(m, n, 2, 1, 132).unwrap();
            assert!(p.kernel_launch(mkBfloat16).is_ok() && p.kernel_launch(mkFloat16).is_ok(), "{m}x{n}");
        }
    }

    /// The pushers' scale slices of every chunk, over every part, write each gathered word
    /// of the source's rows exactly once, from the local word the mode says: the gathered
    /// array is the scaled GEMM's layout for the gathered rows.
    #[test]
    fn scale_slices_cover_each_gathered_word_once() {
        for (nranks, rows_per_rank, k, mode, parts) in [
            (2, 200, 384, mkScaleBlock, 132),
            (4, 3, 256, mkScaleBlock, 7),
            (3, 333, 16, mkScaleRowwise, 132),
            (8, 1, 16, mkScaleTensor, 132),
            (2, 4096, 128, mkScaleTensor, 5),
        ] {
            let m = rows_per_rank * nranks;
            let words = scale_words_per_row(k, mode);
            let chunking = ag_gemm::chunking(rows_per_rank, nranks).unwrap();
            let step = usize::from(mode != mkScaleTensor);
            let mut written = vec![0u32; m * words];
            for src in 0..nranks {
                for c in 0..chunking.chunks_per_rank {
                    let row0 = c * chunking.chunk_rows;
                    let rows = chunking.chunk_rows.min(rows_per_rank - row0);
                    for part in 0..parts {
                        for (gathered, local) in
                            scale_slice(src, rows_per_rank, m, words, step, row0, rows, part, parts)
                        {
                            written[gathered] += 1;
                            // Gathered word (kb, row) holds the source's local word (kb, row − first row).
                            let (kb, row) = (gathered / m, gathered % m);
                            assert_eq!(row / rows_per_rank, src);
                            let want = if step == 0 { 0 } else { kb * rows_per_rank + row % rows_per_rank };
                            assert_eq!(local, want, "{mode:?} src {src} kb {kb} row {row}");
                        }
                    }
                }
            }
            assert!(
                written.iter().all(|&w| w == 1),
                "{mode:?} {nranks}x{rows_per_rank}: a word missed or written twice"
            );
        }
    }

    #[test]
    fn params_point_the_gemm_at_the_gathered_rows_and_scales() {
        let view = crate::kernel_abi::WorkspaceView { data_bytes: 1 << 20, rank: 1, nranks: 2, ..Default::default() };
        for mode in mkScaleMode_t::ALL {
            let args = validate_args(&call(512, 256, 256), E4M3, BF16, mode as RawScaleMode, 2, 1).unwrap();
            let p = plan(512, 256, 2, 1, 132).unwrap();
            let layout = GatheredLayout::new(512, 256, mode);
            let k = params(&args, &p, &layout, &view);
            assert_eq!((k.ag.gathered_offset, k.scale_offset), (1 << 20, (1 << 20) + 512 * 256));
            assert_eq!((k.ag.a_local, k.scale_a_local, k.scale_b), (0x1000, 0x5000, 0x6000));
            assert_eq!((k.ag.rows_per_rank, k.ag.global_rank, k.ag.comm_ctas, k.ag.gathered_out), (256, 1, 0, 0));
            let want = match mode {
                mkScaleTensor => (0, 0, 0),
                mkScaleRowwise => (1, 0, 1),
                mkScaleBlock => (1, 2, 0),
            };
            assert_eq!((k.scale_a_local_step, k.scale_k_blocks, k.scale_b_step), want, "{mode:?}");
        }
    }
}
