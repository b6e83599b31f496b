//! The GEMM + reduction kernels (kernels/gemm_reduce.cu, kernels/gemm_reduce_early.cu)
//! shared by mkGemmReduceScatter and mkGemmAllReduce: argument checks, the plan
//! (`GemmReducePlan`: the role split of the `gemm_rs` / `gemm_ar` planners, tile, owner
//! order, early sums, grid; pure and CPU-tested), then tensor maps and the launch. The role
//! split, the output rows, the region's bytes and the kernel parameters on one node are also
//! the fp8 ops' (`gemm_reduce_scaled`), which run the same reducers.

use crate::comm::workspace::SymmetricWorkspace;
use crate::comm::Comm;
use crate::cuda::kernels::{self, Arg, Kernel};
use crate::cuda::sys;
use crate::error::{MkError, Result};
use crate::kernel_abi::{self, GemmReduceParams, MkOp, ProxyRingView};
use crate::ops::common::fused_fence::{self, FusedKernel};
use crate::ops::common::fused_workspace::fused_op_workspace;
use crate::ops::common::launch::{self, DeviceCaps, KernelLaunch};
use crate::ops::common::node_layout::NodeLayout;
use crate::ops::dense::{gemm_ar, gemm_reduce_nodes, gemm_rs};
use crate::ops::gemm::engine::{self as engine, PlanOverrides};
use crate::tuning::{Reducers, Tuning};
use crate::types::{mkDataType_t, Element, RawDataType};
use std::ffi::c_void;

/// First signal word of the per-tile flags and the end of this op's range: three flags per
/// tile must fit between them.
pub(crate) const GR_TILE_WORD: u32 = kernel_abi::GR_TILE;
pub(crate) const GR_END_WORD: u32 = kernel_abi::MK_SIG_GR_END;
const TILE_FLAG_WORDS: usize = (GR_END_WORD - GR_TILE_WORD) as usize;
const ROW_BLOCK: usize = 128;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// Each rank gets its M / nranks rows of the sum.
    Scatter,
    /// Every rank gets all of the sum.
    All,
}

impl Reduction {
    pub fn name(self) -> &'static str {
        match self {
            Reduction::Scatter => "mkGemmReduceScatter",
            Reduction::All => "mkGemmAllReduce",
        }
    }
    /// Operation code in error words.
    fn op_code(self) -> i32 {
        match self {
            Reduction::Scatter => MkOp::GemmReduceScatter as i32,
            Reduction::All => MkOp::GemmAllReduce as i32,
        }
    }
}

/// A validated call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmReduceArgs {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub dtype: mkDataType_t,
    pub reduction: Reduction,
    /// Per-CTA timing buffer for `mkbench --trace` (kernels/common/trace.cuh), else 0.
    pub trace: u64,
}

/// Argument checks (no CUDA).
#[allow(clippy::too_many_arguments)]
pub fn validate(
    reduction: Reduction,
    a: u64,
    b: u64,
    c: u64,
    m: usize,
    n: usize,
    k: usize,
    dtype: RawDataType,
    nranks: usize,
) -> Result<GemmReduceArgs> {
    let dtype = mkDataType_t::gemm_type_from_raw(dtype, reduction.name())?;
    if reduction == Reduction::Scatter {
        crate::ensure_arg!(
            m % nranks == 0,
            "M = {m} is not divisible by nranks = {nranks}: each rank receives M / nranks rows of C"
        );
    }
    crate::ensure_arg!(k > 0 && k % 8 == 0, "K = {k} must be a positive multiple of 8 (16-byte rows for TMA)");
    crate::ensure_arg!(n % 8 == 0, "N = {n} must be a multiple of 8: partial rows are moved as 16-byte vectors");
    crate::ensure_arg!(
        m <= i32::MAX as usize && n <= i32::MAX as usize && k <= i32::MAX as usize,
        "M, N and K must each be at most 2^31-1"
    );
    if m > 0 && n > 0 {
        crate::ensure_arg!(a != 0, "A is NULL");
        crate::ensure_arg!(b != 0, "B is NULL");
        crate::ensure_arg!(c != 0, "C is NULL");
    }
    for (ptr, name) in [(a, "A"), (b, "B"), (c, "C")] {
        crate::ensure_arg!(
            ptr % 16 == 0,
            "{name} = {ptr:#x} is not 16-byte aligned (TMA and 16-byte vector stores need it)"
        );
    }
    check_tile_signals(m, n)?;
    Ok(GemmReduceArgs { a, b, c, m, n, k, dtype, reduction, trace: 0 })
}

/// The per-tile signal words hold every tile of M × N at 128 × 128 (the narrowest tiles a
/// planner picks past that many: `tile_signals_fit`), three flags per tile: two stored slabs,
/// and the two-phase AllReduce's "reduced".
pub fn check_tile_signals(m: usize, n: usize) -> Result<()> {
    let tiles = m.div_ceil(ROW_BLOCK) * n.div_ceil(128);
    crate::ensure_arg!(
        tile_signals_fit(tiles),
        "M = {m}, N = {n}: {tiles} tiles of 128x128 exceed the {} per-tile signals of the workspace; split the GEMM",
        TILE_FLAG_WORDS / 3
    );
    Ok(())
}

/// Whether `tiles` tiles' flags (three each) fit in the per-tile signal words.
pub fn tile_signals_fit(tiles: usize) -> bool {
    3 * tiles <= TILE_FLAG_WORDS
}

/// Owner shards whose row blocks compute and reduction interleave: every destination
/// rank when each owns whole 128-row blocks (ReduceScatter, two-phase AllReduce), so all
/// owners reduce while the GEMM runs; 1 (rows in order) otherwise, and for the one-shot
/// AllReduce, where every rank reduces every tile anyway.
pub fn interleave_owners(reduction: Reduction, two_phase: bool, m: usize, nranks: usize) -> usize {
    let owner_blocks = m % nranks == 0 && (m / nranks) % ROW_BLOCK == 0;
    if nranks > 1 && owner_blocks && (reduction == Reduction::Scatter || two_phase) {
        nranks
    } else {
        1
    }
}

/// Raster group of the GEMM + reduction: the engine's L2 group, rounded up to a multiple of
/// the interleaved owners (`tiles_m` is then one too), so that each group holds the same
/// number of every owner's row blocks and a reducer's walk over one owner's tiles
/// (`owned_tile`) follows the compute order exactly.
pub fn reduction_group_m(tiles_m: usize, bn: usize, compute_ctas: usize, owners: usize) -> usize {
    let g = engine::raster_group(tiles_m, bn, compute_ctas);
    if owners > 1 {
        g.div_ceil(owners) * owners
    } else {
        g
    }
}

pub use crate::ops::common::schedule::{grouped_index, grouped_tile, interleaved_tile, owned_tile, Tile};

/// Shared memory after the fused engine's where the side warps stage their early sums
/// (kernels/gemm_reduce_early.cu side_staging_bytes): 16 KiB (or 8) where the 227 KiB leave it
/// beside 1 KiB of static shared memory, else 0 (no early sums). Only the BM 128, BN 256
/// kernels have room (three stages of 48 KiB and 64 KiB of epilogue staging leave 17 KiB);
/// the others' rings use the space for more stages.
pub fn side_staging_bytes(bm: usize, bn: usize) -> usize {
    let free = engine::SMEM_LIMIT.saturating_sub(1024 + engine::fused_smem_bytes(bm, bn));
    if free >= 16384 {
        16384
    } else if free >= 8192 {
        8192
    } else {
        0
    }
}

/// Items of a `total`-item walk that reducer team `j` of `stride` takes (j, j + stride, ...).
pub fn team_items(total: usize, j: usize, stride: usize) -> usize {
    if j < total {
        (total - j).div_ceil(stride)
    } else {
        0
    }
}

/// Early sums: the most reducer items of one GEMM CTA's walk that its side warps may sum
/// during the GEMM (`GemmReduceParams::early_items`, the `mk_gemm_reduce_early_*` kernels;
/// the kernel also never gives them the CTA's last item, whose partial is stored only as
/// its GEMM ends). 0 (off: the other kernels) unless the op is ReduceScatter, the reducers
/// are the GEMM CTAs' warps after the GEMM on one node (`Reducers::Early`, no dedicated
/// CTAs), the kernel has side staging (BM 128, BN 256), and some CTA has two or more items.
///
/// Measured (benches/results/2026-12-03-moe-burst-early-sums-attention.md, one H200, 2 ranks): GEMM+RS M 1024 / 4096, K
/// 1024 (8 / 32 GEMM tiles, 4 / 16 items per CTA) 0.866 -> 0.845, 0.881 -> 0.843 of the
/// unfused sequence. GEMM+AR M 256 lost (K 1024 0.82 -> 0.92, K 3584 0.87 -> 0.94, 4
/// ranks 0.82 -> 0.86): two GEMM tiles per CTA, and beside the GEMM the side warps sum only
/// ~4-6 GB/s per CTA (its TMA loads hold the SM's memory path), so one tile of GEMM time
/// does not cover a tile's sum and the CTA then waits for them; AllReduce stays without.
#[allow(clippy::too_many_arguments)]
pub fn early_items(
    reduction: Reduction,
    reducers: Reducers,
    one_node: bool,
    reduce_ctas: u32,
    bm: usize,
    bn: usize,
    items: usize,
    compute_ctas: usize,
) -> usize {
    if reduction != Reduction::Scatter
        || reducers != Reducers::Early
        || !one_node
        || reduce_ctas != 0
        || side_staging_bytes(bm, bn) == 0
        || compute_ctas == 0
    {
        return 0;
    }
    team_items(items, 0, compute_ctas).saturating_sub(1)
}

/// The one-shot reducer items of a call (the kernel's reduce_tiles walk): the tiles of the
/// 128-row blocks holding rows [row_lo, row_hi).
pub fn reducer_items(row_lo: usize, row_hi: usize, tiles_n: usize) -> usize {
    if row_hi <= row_lo {
        0
    } else {
        ((row_hi - 1) / ROW_BLOCK - row_lo / ROW_BLOCK + 1) * tiles_n
    }
}

/// Rows per piece of an early sum (kernels/gemm_reduce_early.cu kSideRows): the side warps look
/// for the end of the GEMM between pieces, so the CTA's 12 warps wait at most one piece
/// for them.
pub const SIDE_ROWS: usize = 32;

/// Where the CTA's team resumes the walk after its side warps: they completed `done`
/// items and `rows` rows (a multiple of SIDE_ROWS, from the item's first row) of the next
/// one. Team `j` of `stride`, items of `rows_of(i)` rows: returns the (item index, first
/// row offset) pairs the team sums (kernels/gemm_reduce_early.cu reduce_tiles_from).
pub fn team_rest(total: usize, j: usize, stride: usize, done: usize, rows: usize) -> Vec<(usize, usize)> {
    (0..team_items(total, j, stride))
        .skip(done)
        .enumerate()
        .map(|(x, k)| (j + k * stride, if x == 0 { rows } else { 0 }))
        .collect()
}

/// The GEMM + reduction kernel for a dtype, tile width and tile rows (BM 128 or 64), with
/// or without early sums (MK_GEMM_REDUCE_ENTRY and MK_GEMM_REDUCE_EARLY_ENTRY lines; early
/// sums: BN 256, BM 128 only).
pub fn kernel(dtype: impl Element, bn: usize, bm: usize, early: bool) -> Result<Kernel> {
    let op = "GEMM + ReduceScatter / AllReduce";
    if early && bn == 256 && bm == engine::BM {
        return kernels::choose(op, dtype.element(), "MK_GEMM_REDUCE_EARLY_ENTRY", &[Arg::Element]);
    }
    if early {
        return Err(MkError::internal(format!("{op}: early sums need BN 256 and BM 128, not BN {bn}, BM {bm}")));
    }
    kernels::choose(op, dtype.element(), "MK_GEMM_REDUCE_ENTRY", &[Arg::Element, Arg::Int(bn), Arg::Int(bm)])
}

/// Rows per GEMM tile of the fused kernel: the engine planner's (`gemm_table::tile_rows`),
/// 64 when M fits one such tile (the `_bm64` kernels: A stages of 64 rows, so a deeper ring
/// of B fits), else 128. The reduction walks 128-row blocks, so 64-row tiles serve only
/// M ≤ 64, where both agree on the one block.
pub fn tile_rows(m: usize) -> usize {
    crate::ops::gemm::table::tile_rows(m)
}

/// One GEMM + reduction call as the planner sees it: the op, the sizes, this rank's place,
/// and across nodes the node count and the byte offset of the fused-op region in every
/// rank's data window (the node plan's buffers follow it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmReduceShape {
    pub reduction: Reduction,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub nranks: usize,
    pub rank: usize,
    /// Across nodes: (nodes, the fused-op region's offset in every rank's data window).
    pub nodes: Option<(usize, u64)>,
}

/// Everything a GEMM + reduction launch needs, from the shape, the grid and the tuning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmReducePlan {
    pub compute_ctas: u32,
    /// Dedicated reduction CTAs (MK_COMM_SMS); 0: the GEMM CTAs reduce.
    pub reduce_ctas: u32,
    /// AllReduce on one node with large M: reduce by owner, then gather the reduced rows.
    pub two_phase: bool,
    /// Across nodes: the hierarchical reduction's layout and signal words.
    pub node_plan: Option<gemm_reduce_nodes::NodeReducePlan>,
    /// Bytes of the fused-op region the call uses.
    pub op_bytes: u64,
    /// GEMM tile rows (`tile_rows`) and width (`engine::fused_tile_width`).
    pub bm: usize,
    pub bn: usize,
    pub tiles_n: usize,
    /// Owners whose row blocks the tile order interleaves (`interleave_owners`).
    pub interleave: usize,
    pub group_m: usize,
    /// Rows of the sum this rank writes, and its first row in C.
    pub row_lo: usize,
    pub row_hi: usize,
    pub out_row0: usize,
    /// Items each GEMM CTA's side warps sum during the GEMM (`early_items`; > 0 selects the
    /// early-sum kernel).
    pub early_items: usize,
    pub smem_bytes: usize,
    /// CTAs launched: compute_ctas + reduce_ctas.
    pub grid: u32,
}

impl GemmReducePlan {
    /// The launch of this plan for `dtype`.
    pub fn kernel_launch(&self, dtype: impl Element) -> Result<KernelLaunch> {
        let kernel = kernel(dtype, self.bn, self.bm, self.early_items > 0)?;
        Ok(KernelLaunch::new(kernel, self.grid, engine::THREADS, self.smem_bytes as u32))
    }
}

/// Who computes and who sums: the GEMM CTAs, the dedicated reduction CTAs (MK_COMM_SMS), and
/// whether the AllReduce runs in two phases (on one node).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoleSplit {
    pub compute_ctas: u32,
    pub reduce_ctas: u32,
    pub two_phase: bool,
}

/// The role split of `gemm_rs::plan` (ReduceScatter) or `gemm_ar::plan` (AllReduce: one-shot
/// or two-phase) for shape `s` on `grid_ctas` CTAs; `comm_override` is MK_COMM_SMS / config.
pub fn role_split(
    s: &GemmReduceShape,
    grid_ctas: u32,
    comm_override: Option<u32>,
    tuning: &Tuning,
) -> Result<RoleSplit> {
    let GemmReduceShape { reduction, m, n, k, nranks, rank, .. } = *s;
    Ok(match reduction {
        Reduction::Scatter => {
            let p = gemm_rs::plan(&gemm_rs::GemmRsShape { m, n, k, nranks, rank }, grid_ctas, comm_override)?;
            RoleSplit { compute_ctas: p.compute_ctas, reduce_ctas: p.reduce_ctas, two_phase: false }
        }
        Reduction::All => {
            match gemm_ar::plan(m, n, k, nranks, rank, grid_ctas, comm_override, tuning.gemm_ar_one_shot_max_m)? {
                gemm_ar::GemmArPlan::OneShot { compute_ctas, reduce_ctas } => {
                    RoleSplit { compute_ctas, reduce_ctas, two_phase: false }
                }
                gemm_ar::GemmArPlan::TwoPhase(p) => {
                    RoleSplit { compute_ctas: p.compute_ctas, reduce_ctas: p.reduce_ctas, two_phase: true }
                }
            }
        }
    })
}

/// Rows of the sum this rank writes, [row_lo, row_hi), and the row of the sum in C's row 0.
pub fn output_rows(reduction: Reduction, m: usize, nranks: usize, rank: usize) -> (usize, usize, usize) {
    match reduction {
        Reduction::Scatter => (rank * m / nranks, (rank + 1) * m / nranks, rank * m / nranks),
        Reduction::All => (0, m, 0),
    }
}

/// The fused-op region's bytes on one node: P (M·N partials of `element_bytes`) and, for the
/// two-phase AllReduce, R (its reduced rows, as many again).
pub fn one_node_op_bytes(m: usize, n: usize, element_bytes: usize, two_phase: bool) -> u64 {
    let partial_bytes = (m * n * element_bytes) as u64;
    if two_phase {
        2 * partial_bytes
    } else {
        partial_bytes
    }
}

/// Plans a GEMM + reduction on more than one rank: the role split (`gemm_rs::plan` or
/// `gemm_ar::plan`), across nodes the node plan, then the tile, order and early sums.
/// `grid_ctas` is `DeviceCaps::grid_cap`; `comm_override` MK_COMM_SMS / config; the partial
/// products and their sums are elements of `dtype`.
pub fn plan(
    s: &GemmReduceShape,
    dtype: impl Element,
    grid_ctas: u32,
    comm_override: Option<u32>,
    tuning: &Tuning,
) -> Result<GemmReducePlan> {
    let GemmReduceShape { reduction, m, n, nranks, rank, nodes, .. } = *s;
    let RoleSplit { compute_ctas, reduce_ctas, two_phase } = role_split(s, grid_ctas, comm_override, tuning)?;
    // Across nodes the kernel always reduces in its hierarchical phases (the one-node
    // planners only split the CTAs).
    let two_phase = two_phase && nodes.is_none();
    let tiles = m.div_ceil(ROW_BLOCK) * n.div_ceil(128);
    let node_plan = match nodes {
        Some((node_count, partial_offset)) => Some(gemm_reduce_nodes::plan(
            reduction,
            m,
            n,
            dtype.element().bytes,
            node_count,
            nranks,
            partial_offset,
            GR_TILE_WORD,
            tiles,
            GR_END_WORD,
        )?),
        None => None,
    };
    // P (this rank's partial product), and for the two-phase path R (its reduced rows);
    // across nodes also the outbox and inbox of node partials.
    let op_bytes = node_plan.map_or(one_node_op_bytes(m, n, dtype.element().bytes, two_phase), |p| p.op_bytes);
    let bn = engine::fused_tile_width(m, n, compute_ctas as usize);
    let tiles_n = n.div_ceil(bn);
    let interleave = interleave_owners(reduction, two_phase || nodes.is_some(), m, nranks);
    let group_m = reduction_group_m(m.div_ceil(ROW_BLOCK), bn, compute_ctas as usize, interleave);
    let (row_lo, row_hi, out_row0) = output_rows(reduction, m, nranks, rank);
    let bm = tile_rows(m);
    let early = early_items(
        reduction,
        tuning.gemm_reducers,
        nodes.is_none(),
        reduce_ctas,
        bm,
        bn,
        reducer_items(row_lo, row_hi, tiles_n),
        compute_ctas as usize,
    );
    Ok(GemmReducePlan {
        compute_ctas,
        reduce_ctas,
        two_phase,
        node_plan,
        op_bytes,
        bm,
        bn,
        tiles_n,
        interleave,
        group_m,
        row_lo,
        row_hi,
        out_row0,
        early_items: early,
        // Early sums stage in shared memory after the engine's (side_staging_bytes).
        smem_bytes: engine::fused_smem_bytes(bm, bn) + if early > 0 { side_staging_bytes(bm, bn) } else { 0 },
        grid: compute_ctas + reduce_ctas,
    })
}

/// Validated call on `comm`: plan, launch (stream-ordered, no host sync).
pub fn gemm_reduce(comm: &Comm, args: &GemmReduceArgs, stream: sys::CUstream) -> Result<()> {
    comm.check_usable()?;
    let GemmReduceArgs { m, n, k, .. } = *args;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let (nranks, rank) = (comm.nranks, comm.rank);
    let grid = DeviceCaps::of(comm)?.grid_cap();
    let _ctx = comm.context.enter()?;
    comm.check_buffers(&[(args.a, "A"), (args.b, "B"), (args.c, "C")])?;
    if nranks == 1 {
        // The sum over one rank is its product: the engine alone, storing C directly (the
        // fused kernel would store a partial and copy it: 1.3x the GEMM's time).
        let g = crate::ops::gemm::op::validate(args.a, args.b, args.c, m, n, k, args.dtype as RawDataType)?;
        return crate::ops::gemm::op::gemm_with(
            &g,
            PlanOverrides { max_ctas: Some(grid as usize), ..Default::default() },
            stream,
        );
    }
    // Across nodes: this node's workspace (indexed by local rank), the proxy ring and the
    // rank table (src/ops/dense/gemm_reduce_nodes.rs); rows are still owned by global rank.
    let (ws, nodes) = fused_op_workspace(comm, args.reduction.name())?;
    let shape = GemmReduceShape {
        reduction: args.reduction,
        m,
        n,
        k,
        nranks,
        rank,
        nodes: nodes.as_ref().map(|(nl, _)| (nl.nodes, ws.view.data_bytes)),
    };
    let p = plan(&shape, args.dtype, grid, comm.config.comm_ctas, &comm.config.tuning)?;
    let needed = p.op_bytes;
    if needed > ws.view.op_bytes {
        return Err(MkError::invalid_usage(format!(
            "{} keeps this rank's partial product{}{} ({needed} bytes) in the workspace's fused-op region, which holds {}: \
             create the communicator with MK_WORKSPACE_BYTES (or mkConfig_t.workspaceBytes) of at least {needed}",
            args.reduction.name(),
            if p.node_plan.is_some() { ", its node partials" } else { "" },
            if p.two_phase || (p.node_plan.is_some() && args.reduction == Reduction::All) {
                " and its reduced rows"
            } else {
                ""
            },
            ws.view.op_bytes
        )));
    }
    fused_fence::launch_fenced(comm, &ws.view, nodes.as_ref(), FusedKernel::GemmReduce, stream, || {
        launch(args, &shape, &p, ws, nodes.as_ref(), stream)
    })
}

/// The kernel parameters of plan `p` for `shape` on one node (`ws`: its workspace view):
/// output `c`, partials and sums of `element_bytes`, error words naming op `op_code`; no
/// tracing, no early sums, the A box's rows the tile's. Across nodes the caller fills in the
/// node plan's fields.
pub fn one_node_params(
    shape: &GemmReduceShape,
    p: &GemmReducePlan,
    c: u64,
    element_bytes: usize,
    op_code: i32,
    ws: &kernel_abi::WorkspaceView,
) -> GemmReduceParams {
    let GemmReduceShape { m, n, k, nranks, rank, .. } = *shape;
    GemmReduceParams {
        ws: *ws,
        c,
        partial_offset: ws.data_bytes,
        m: m as i32,
        n: n as i32,
        k: k as i32,
        row_lo: p.row_lo as i32,
        row_hi: p.row_hi as i32,
        out_row0: p.out_row0 as i32,
        tiles_n: p.tiles_n as i32,
        group_m: p.group_m as i32,
        compute_ctas: p.compute_ctas as i32,
        reduce_ctas: p.reduce_ctas as i32,
        op: op_code,
        two_phase: p.two_phase as i32,
        reduced_offset: ws.data_bytes + (m * n * element_bytes) as u64,
        rows_per_rank: (m / nranks) as i32,
        interleave: p.interleave as i32,
        nodes: 1,
        global_rank: rank as i32,
        ..GemmReduceParams::default()
    }
}

/// Launches the kernel of plan `p` for validated `args` of `shape` (the context current)
/// on this node's workspace `ws`, and across nodes with the rank table and proxy ring `nodes`.
fn launch(
    args: &GemmReduceArgs,
    shape: &GemmReduceShape,
    p: &GemmReducePlan,
    ws: &SymmetricWorkspace,
    nodes: Option<&(NodeLayout, ProxyRingView)>,
    stream: sys::CUstream,
) -> Result<()> {
    let GemmReduceShape { m, n, k, .. } = *shape;
    // The view is indexed by local rank (the global rank across nodes).
    let partial_base = ws.view.data[ws.view.rank as usize] + ws.view.data_bytes;
    let a_box_rows = engine::a_box_rows(p.bm, m);
    let mut ta = launch::tensor_map(args.a, args.dtype, m, k, a_box_rows, engine::BK)?;
    let mut tb = launch::tensor_map(args.b, args.dtype, n, k, p.bn, engine::BK)?;
    let mut tp = launch::tensor_map(partial_base, args.dtype, m, n, 64, 64)?;
    let mut params = GemmReduceParams {
        a_box_rows: a_box_rows as i32,
        trace: args.trace,
        // One node, no dedicated CTAs: each GEMM CTA's warps reduce after its GEMM (its
        // side warps the earlier tiles during it: early_items).
        early_items: p.early_items as i32,
        ..one_node_params(shape, p, args.c, args.dtype.element().bytes, args.reduction.op_code(), &ws.view)
    };
    if let (Some((nl, ring)), Some(np)) = (nodes, &p.node_plan) {
        params.nodes = nl.nodes as i32;
        params.node = nl.node as i32;
        params.owner_rows = np.owner_rows as i32;
        params.owner_blocks = np.owner_blocks as i32;
        params.net_in_word = np.net_in_word;
        params.net_reduced_word = np.net_reduced_word;
        params.count_node_word = np.count_node_word;
        params.count_final_word = np.count_final_word;
        params.outbox_offset = np.outbox_offset;
        params.inbox_offset = np.inbox_offset;
        params.slab_bytes = np.slab_bytes;
        params.reduced_offset = np.reduced_offset;
        params.ring = *ring;
        params.rank_of = nl.rank_of;
    }
    // Early sums run in their own kernels (BN 256, BM 128: early_items is 0 elsewhere).
    let mut kernel_launch = p.kernel_launch(args.dtype)?;
    if args.trace != 0 {
        // `mkbench --trace`: the twin with the trace hooks (the library's kernel has none).
        kernel_launch.kernel = crate::cuda::kernels::trace_twin(kernel_launch.kernel)?;
    }
    let mut kernel_params: [*mut c_void; 4] = [
        (&mut ta as *mut sys::CUtensorMap).cast(),
        (&mut tb as *mut sys::CUtensorMap).cast(),
        (&mut tp as *mut sys::CUtensorMap).cast(),
        (&mut params as *mut GemmReduceParams).cast(),
    ];
    // SAFETY: the parameters match the kernel (3 tensor maps, GemmReduceParams); the
    // buffers were checked to be device memory of this device, of the caller's sizes.
    unsafe { kernel_launch.launch(stream, &mut kernel_params, Some(args.reduction.name())) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gemm::engine::Epilogue;

    const BF16: mkDataType_t = mkDataType_t::mkBfloat16;

    #[test]
    fn every_plan_launches_a_built_kernel_within_the_shared_memory() {
        let tunings = [
            Tuning::default(),
            Tuning { gemm_reducers: Reducers::After, ..Tuning::default() },
            Tuning { gemm_ar_one_shot_max_m: 0, ..Tuning::default() },
            Tuning { gemm_ar_one_shot_max_m: 16384, ..Tuning::default() },
        ];
        let (mut planned, mut refused) = (0, 0);
        for reduction in [Reduction::Scatter, Reduction::All] {
            for nranks in [2, 3, 4, 8] {
                for rows in [1, 16, 64, 100, 128, 256, 512, 1024, 4096] {
                    for n in [100, 128, 1024, 3584, 8192, 1 << 16] {
                        for (grid, comm) in [(132, None), (132, Some(14)), (132, Some(132)), (66, None), (1, None)] {
                            for nodes in [None, Some((2, 64 << 20)), Some((nranks, 1 << 30))] {
                                for tuning in &tunings {
                                    let m = rows * nranks;
                                    let s =
                                        GemmReduceShape { reduction, m, n, k: 1024, nranks, rank: nranks - 1, nodes };
                                    let Ok(p) = plan(&s, BF16, grid, comm, tuning) else {
                                        refused += 1;
                                        continue;
                                    };
                                    planned += 1;
                                    assert_eq!(p.compute_ctas + p.reduce_ctas, grid, "{s:?}");
                                    assert_eq!(p.node_plan.is_some(), nodes.is_some());
                                    assert!(!p.two_phase || (reduction == Reduction::All && nodes.is_none()));
                                    assert_eq!(p.group_m % p.interleave, 0);
                                    assert!(p.row_lo <= p.row_hi && p.row_hi <= m && p.out_row0 <= p.row_lo);
                                    if p.early_items > 0 {
                                        assert_eq!(
                                            (reduction, p.bm, p.bn, p.reduce_ctas),
                                            (Reduction::Scatter, 128, 256, 0)
                                        );
                                        assert!(nodes.is_none() && tuning.gemm_reducers == Reducers::Early);
                                    }
                                    // The kernel's 1 KiB of static shared memory fits beside.
                                    assert!(p.smem_bytes + 1024 <= engine::SMEM_LIMIT, "{p:?}");
                                    let l = p.kernel_launch(mkDataType_t::mkBfloat16).unwrap();
                                    assert_eq!((l.grid, l.block, l.smem_bytes), (grid, 384, p.smem_bytes as u32));
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(planned > 1000 && refused > 100, "{planned} planned, {refused} refused");
    }

    /// Representative plans: the tile, order, early sums and grid they launch.
    #[test]
    fn the_plan_picks_tile_order_early_sums_and_grid() {
        let t = Tuning::default();
        let rs = |m, n, nranks, rank, grid, nodes| {
            plan(
                &GemmReduceShape { reduction: Reduction::Scatter, m, n, k: 1024, nranks, rank, nodes },
                BF16,
                grid,
                None,
                &t,
            )
            .unwrap()
        };
        // GEMM+RS, 2 ranks × 2048 rows, N 8192, on 32 CTAs: BN 256, owners interleaved, the
        // group sqrt(32·256/128) = 8; early sums (this rank's 16 blocks × 32 tiles over 32
        // CTAs: 16 items per CTA's walk, 15 early), 16 KiB of side staging.
        let p = rs(4096, 8192, 2, 1, 32, None);
        assert_eq!((p.bm, p.bn, p.tiles_n, p.interleave, p.group_m), (128, 256, 32, 2, 8));
        assert_eq!((p.row_lo, p.row_hi, p.out_row0), (2048, 4096, 2048));
        assert_eq!((p.early_items, p.smem_bytes, p.grid, p.op_bytes), (15, 214_128 + 16_384, 32, 4096 * 8192 * 2));
        // Across nodes: no early sums, the node plan's bytes.
        let p = rs(4096, 8192, 4, 1, 32, Some((2, 1 << 20)));
        assert_eq!((p.early_items, p.interleave, p.op_bytes), (0, 4, p.node_plan.unwrap().op_bytes));
        assert!(p.node_plan.is_some());
        // GEMM+AR: small M one-shot with the BM 64 kernel; large M two-phase.
        let ar = |m, grid| {
            plan(
                &GemmReduceShape { reduction: Reduction::All, m, n: 8192, k: 1024, nranks: 4, rank: 2, nodes: None },
                BF16,
                grid,
                None,
                &t,
            )
            .unwrap()
        };
        let p = ar(64, 132);
        assert_eq!(
            (p.bm, p.two_phase, p.row_lo, p.row_hi, p.early_items, p.op_bytes),
            (64, false, 0, 64, 0, 64 * 8192 * 2)
        );
        let p = ar(8192, 132);
        assert_eq!((p.bm, p.two_phase, p.interleave, p.op_bytes), (128, true, 4, 2 * 8192 * 8192 * 2));
        // Dedicated reduction CTAs are launched beside the compute CTAs.
        let s = GemmReduceShape {
            reduction: Reduction::Scatter,
            m: 4096,
            n: 8192,
            k: 1024,
            nranks: 4,
            rank: 0,
            nodes: None,
        };
        let p = plan(&s, BF16, 132, Some(14), &t).unwrap();
        assert_eq!((p.compute_ctas, p.reduce_ctas, p.grid, p.early_items), (118, 14, 132, 0));
    }

    /// The small-M kernels' ring: deeper at bn 256 (4 stages instead of 3), never shallower,
    /// within the shared-memory limit beside the kernel's 1 KiB of static shared memory, and
    /// the bm 128 sizes are the plain engine's.
    #[test]
    fn small_m_tiles_fit_a_deeper_ring() {
        assert_eq!(tile_rows(1), 64);
        assert_eq!(tile_rows(64), 64);
        assert_eq!(tile_rows(65), 128);
        assert_eq!(engine::fused_stages(64, 256), 4);
        assert_eq!(engine::fused_stages(128, 256), 3);
        for bn in [128, 256] {
            assert_eq!(engine::fused_smem_bytes(128, bn), engine::smem_bytes(bn, Epilogue::Tma));
            assert_eq!(engine::fused_stages(128, bn), engine::stages(bn, Epilogue::Tma));
            assert!(engine::fused_stages(64, bn) >= engine::fused_stages(128, bn));
            // kernels/gemm_reduce.cu's static_assert: the reducers' staging fits the ring.
            assert!(engine::fused_stages(64, bn) * (64 + bn) >= engine::fused_stages(128, bn) * (128 + bn));
            assert!(engine::fused_smem_bytes(64, bn) + 1024 <= engine::SMEM_LIMIT, "bn {bn}");
        }
        assert!(kernel(mkDataType_t::mkFloat16, 128, 64, false).is_ok());
    }

    /// Side staging exists only where the ring leaves room (BM 128, BN 256: 17 KiB free),
    /// and with it the launch stays within the shared-memory limit.
    #[test]
    fn side_staging_fits_beside_the_engine() {
        assert_eq!(side_staging_bytes(128, 256), 16384);
        assert_eq!(side_staging_bytes(128, 128), 0);
        assert_eq!(side_staging_bytes(64, 256), 0);
        assert_eq!(side_staging_bytes(64, 128), 0);
        for (bm, bn) in [(128, 256), (128, 128), (64, 256), (64, 128)] {
            assert!(engine::fused_smem_bytes(bm, bn) + side_staging_bytes(bm, bn) + 1024 <= engine::SMEM_LIMIT);
            // Whole batches of the side warps' cp.async staging: 64 threads x 16 bytes x 2
            // sources x 2 buffers.
            assert_eq!(side_staging_bytes(bm, bn) % 4096, 0);
        }
    }

    /// Early sums only for ReduceScatter with the GEMM CTAs reducing after their GEMM on
    /// one node, with side staging and more than one item per CTA; at most all but a
    /// CTA's last item.
    #[test]
    fn early_sums_plan() {
        let rs = |items, ctas| early_items(Reduction::Scatter, Reducers::Early, true, 0, 128, 256, items, ctas);
        // ReduceScatter M 1024 / 4096 at 2 ranks: this rank's 512 / 2048 rows, 32 CTAs.
        assert_eq!(rs(reducer_items(512, 1024, 32), 32), 3);
        assert_eq!(rs(reducer_items(2048, 4096, 32), 32), 15);
        // Odd rows: the blocks holding them.
        assert_eq!(reducer_items(100, 300, 4), 12);
        assert_eq!(reducer_items(5, 5, 4), 0);
        // One item per CTA; AllReduce (M 256: measured slower); no side staging; other
        // modes; across nodes; dedicated reducers.
        assert_eq!(rs(32, 32), 0);
        let items = reducer_items(0, 256, 32);
        assert_eq!(early_items(Reduction::All, Reducers::Early, true, 0, 128, 256, items, 32), 0);
        assert_eq!(early_items(Reduction::Scatter, Reducers::Early, true, 0, 64, 256, 128, 32), 0);
        assert_eq!(early_items(Reduction::Scatter, Reducers::Early, true, 0, 128, 128, 128, 32), 0);
        assert_eq!(early_items(Reduction::Scatter, Reducers::After, true, 0, 128, 256, 128, 32), 0);
        assert_eq!(early_items(Reduction::Scatter, Reducers::Early, false, 0, 128, 256, 128, 32), 0);
        assert_eq!(early_items(Reduction::Scatter, Reducers::Early, true, 4, 128, 256, 128, 28), 0);
        assert!(kernel(mkDataType_t::mkFloat16, 256, 128, true).is_ok());
    }

    /// Side warps and the team after the GEMM sum every row of every item of a team's walk
    /// exactly once, wherever the side warps stopped (within the kernel's limit).
    #[test]
    fn side_and_team_cover_each_walk_once() {
        for &(total, stride, early) in &[(64, 32, 1), (64, 16, 3), (128, 32, 3), (70, 32, 2), (5, 4, 1)] {
            for j in 0..stride {
                let mine = team_items(total, j, stride);
                let limit = early.min(mine.saturating_sub(1));
                for done in 0..=limit {
                    for rows in (0..128).step_by(SIDE_ROWS) {
                        if done == limit && rows > 0 {
                            continue; // the side warps start no item past the limit
                        }
                        let mut seen = vec![0usize; total * 128];
                        for k in 0..done {
                            for r in 0..128 {
                                seen[(j + k * stride) * 128 + r] += 1;
                            }
                        }
                        if rows > 0 {
                            for r in 0..rows {
                                seen[(j + done * stride) * 128 + r] += 1;
                            }
                        }
                        for (i, r0) in team_rest(total, j, stride, done, rows) {
                            for r in r0..128 {
                                seen[i * 128 + r] += 1;
                            }
                        }
                        for i in 0..total {
                            let want = usize::from(i % stride == j);
                            assert!(
                                seen[i * 128..(i + 1) * 128].iter().all(|&c| c == want),
                                "total {total} j {j} done {done} rows {rows} item {i}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn grouped_index_inverts_grouped_tile() {
        for (tiles_m, tiles_n) in [(1, 1), (2, 32), (3, 7), (17, 5), (64, 64)] {
            for group_m in [1, 2, 3, 8, 16] {
                for t in 0..tiles_m * tiles_n {
                    assert_eq!(grouped_index(tiles_m, tiles_n, group_m, grouped_tile(tiles_m, tiles_n, group_m, t)), t);
                }
            }
        }
    }

    #[test]
    fn owners_interleave_only_on_whole_row_blocks() {
        assert_eq!(interleave_owners(Reduction::Scatter, false, 4096, 4), 4);
        assert_eq!(interleave_owners(Reduction::Scatter, false, 4 * 97, 4), 1);
        assert_eq!(interleave_owners(Reduction::All, true, 8192, 8), 8);
        assert_eq!(interleave_owners(Reduction::All, false, 8192, 8), 1);
        assert_eq!(interleave_owners(Reduction::Scatter, false, 4096, 1), 1);
    }

    /// Each owner's reducer teams visit its tiles exactly once, in the order the GEMM
    /// computes them, with every team's share within one tile of the others' -- the
    /// plain stride over all tiles would give one parity of teams every tile at two ranks.
    #[test]
    fn reducers_share_each_owners_tiles_in_compute_order() {
        for &(m, n, bn, ctas, owners) in &[
            (4096, 8192, 256, 32, 2),
            (1024, 8192, 256, 32, 2),
            (8192, 8192, 256, 16, 4),
            (16384, 8192, 256, 32, 8),
            (4096, 3584, 128, 33, 4),
            (1024, 8192, 256, 132, 1),
        ] {
            let (tiles_m, tiles_n) = (m / ROW_BLOCK, n / bn);
            let group_m = reduction_group_m(tiles_m, bn, ctas, owners);
            assert_eq!(group_m % owners, 0);
            let compute: Vec<Tile> =
                (0..tiles_m * tiles_n).map(|t| interleaved_tile(tiles_m, tiles_n, group_m, owners, t)).collect();
            let blocks = tiles_m / owners;
            for q in 0..owners {
                let first = q * blocks;
                let mine: Vec<Tile> =
                    compute.iter().copied().filter(|&(b, _)| b >= first && b < first + blocks).collect();
                let walk: Vec<Tile> =
                    (0..blocks * tiles_n).map(|i| owned_tile(tiles_n, group_m, owners, first, blocks, i)).collect();
                assert_eq!(walk, mine, "owner {q} of M {m} N {n}: reducers walk the compute order");
                let shares: Vec<usize> = (0..ctas).map(|j| (j..walk.len()).step_by(ctas).count()).collect();
                assert!(shares.iter().max().unwrap() - shares.iter().min().unwrap() <= 1, "{shares:?}");
            }
        }
    }

    #[test]
    fn rules_are_named() {
        let bf16 = mkDataType_t::mkBfloat16 as RawDataType;
        let p = 0x1000;
        let err = |r: Result<GemmReduceArgs>| r.unwrap_err().message;
        assert!(err(validate(Reduction::Scatter, p, p, p, 1001, 64, 64, bf16, 4)).contains("divisible"));
        assert!(validate(Reduction::All, p, p, p, 1001, 64, 64, bf16, 4).is_ok(), "AllReduce takes any M");
        assert!(err(validate(Reduction::All, p, p, p, 16, 60, 64, bf16, 4)).contains("multiple of 8"));
        assert!(err(validate(Reduction::All, p, p, p, 16, 64, 12, bf16, 4)).contains("K = 12"));
        assert!(err(validate(Reduction::All, 0, p, p, 16, 64, 64, bf16, 4)).contains("A is NULL"));
        assert!(err(validate(Reduction::All, p, p, 0x1002, 16, 64, 64, bf16, 4)).contains("C = 0x1002"));
        assert!(err(validate(Reduction::All, p, p, p, 16, 64, 64, 99, 4)).contains("unknown datatype 99"));
        assert!(err(validate(Reduction::All, p, p, p, 1 << 20, 1 << 16, 64, bf16, 4)).contains("split the GEMM"));
        assert!(validate(Reduction::All, 0, 0, 0, 0, 64, 64, bf16, 4).is_ok(), "an empty product needs no pointers");
    }
}
