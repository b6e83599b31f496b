//! AllGather + GEMM: planning (pure, CPU-tested). Each rank holds `M / nranks` rows of A;
//! pushers copy this rank's rows into every peer's workspace in chunks, each followed by
//! an epoch signal; compute CTAs run the GEMM engine over row blocks in rank-rotated order
//! (local rows first) and wait per row block for the chunks it needs.
//!
//! The pushers are, by default, the three warps of every GEMM CTA's producer warpgroup
//! that the engine leaves idle (its TMA producer is one thread): the push then runs beside
//! the GEMM on every SM and costs the GEMM no CTA. Measured on one H200 with 2 ranks
//! sharing it (benches/results/2026-12-02-fused-dense-ops-time-split.md), dedicated push CTAs cost the GEMM their SMs for the
//! whole kernel while pushing for a fraction of it (idle 85-90% of the kernel), and one
//! CTA pushing a 2 MB chunk alone took 35-200 µs. `MK_COMM_SMS` = c ≥ 1 still selects c
//! dedicated CTAs (all threads copy; useful where a link needs many SMs to saturate).

use crate::comm::workspace::SymmetricWorkspace;
use crate::comm::Comm;
use crate::cuda::kernels::{self, Arg, Kernel};
use crate::cuda::{self, sys};
use crate::error::{MkError, Result};
use crate::kernel_abi::{AgGemmParams, ProxyRingView, MK_AG_GEMM_MAX_CHUNKS, MK_MAX_PEERS};
use crate::ops::common::fused_fence::{self, FusedKernel};
use crate::ops::common::fused_workspace::fused_op_workspace;
use crate::ops::common::launch::{self, DeviceCaps, KernelLaunch};
use crate::ops::common::node_layout::NodeLayout;
use crate::ops::gemm::engine::{self as engine, Epilogue, PlanOverrides};
use crate::types::{mkDataType_t, Element, RawDataType};
use std::ffi::c_void;

/// Chunks are whole row blocks, so one wait covers one block.
pub use crate::ops::gemm::engine::ROW_BLOCK;
/// At most this many signalled chunks per rank: fewer, larger pushes beyond it (the
/// kernel's flag array is sized by the same constant).
pub const MAX_CHUNKS_PER_RANK: usize = MK_AG_GEMM_MAX_CHUNKS;
/// Chunk-flag words the kernel has (AGG_CHUNK, and as many AGG_PUSHED counters):
/// MK_MAX_PEERS × MK_AG_GEMM_MAX_CHUNKS. Across nodes the sources are all R ranks, so each
/// gets 256 / R of them (R ≤ 64: at least 4 chunks per rank).
pub const CHUNK_FLAG_WORDS: usize = MK_MAX_PEERS * MK_AG_GEMM_MAX_CHUNKS;

/// Signal words per source rank for the chunk flags (the kernel's `flag_stride`), which is
/// also the most chunks per rank.
pub fn flag_stride(nranks: usize) -> usize {
    (CHUNK_FLAG_WORDS / nranks.max(1)).min(MAX_CHUNKS_PER_RANK)
}
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgGemmShape {
    /// All gathered rows (as in the unfused GEMM).
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub nranks: usize,
    pub rank: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgGemmPlan {
    pub rows_per_rank: usize,
    /// CTAs dedicated to pushing this rank's shard to peers; 0: the GEMM CTAs' side warps
    /// push (the default), or one rank (nothing to push).
    pub comm_ctas: u32,
    /// CTAs running GEMM tiles.
    pub compute_ctas: u32,
    /// Rows per signalled chunk (a multiple of ROW_BLOCK except for a shard's last chunk).
    pub chunk_rows: usize,
    pub chunks_per_rank: usize,
    /// Flag words per source rank (`flag_stride(nranks)`, ≥ chunks_per_rank).
    pub flag_stride: usize,
    /// Source ranks in the order compute consumes their rows: this rank first, then rank+1,
    /// rank+2, ... (every rank pushes to rank-1 first, rank-2 next, so data arrives in
    /// the order it is consumed).
    pub source_order: Vec<usize>,
    /// The GEMM's tile width (`engine::fused_tile_width` on the compute CTAs): with the
    /// dtype, it names the kernel (`kernel`).
    pub bn: usize,
    /// Raster group of the fused GEMM (`raster_group`).
    pub group_m: usize,
    /// Dynamic shared memory: the engine's, TMA epilogue.
    pub smem_bytes: usize,
    /// CTAs launched: compute_ctas + comm_ctas.
    pub grid: u32,
    /// The m-block of this rank's first own row (its rows start the rotated order).
    pub m_block_base: usize,
}

impl AgGemmPlan {
    /// The launch of this plan for `dtype`.
    pub fn kernel_launch(&self, dtype: impl Element) -> Result<KernelLaunch> {
        let kernel = kernel(dtype, self.bn)?;
        Ok(KernelLaunch::new(kernel, self.grid, engine::THREADS, self.smem_bytes as u32))
    }
}

/// Bytes of `rows` gathered rows of A of `k` elements of `dtype`: the whole gathered A
/// (which the fused-op region must hold across nodes), or one chunk (one proxy put).
pub fn gathered_bytes(dtype: impl Element, rows: usize, k: usize) -> usize {
    dtype.element().bytes_of(rows * k)
}

/// Checks the shape rules; the messages name the rule.
pub fn validate(shape: &AgGemmShape) -> Result<()> {
    let AgGemmShape { m, n, k, nranks, rank } = *shape;
    if nranks == 0 || rank >= nranks {
        return Err(MkError::internal(format!("rank {rank} of {nranks}")));
    }
    if m % nranks != 0 {
        return Err(MkError::invalid_argument(format!(
            "M = {m} is not divisible by nranks = {nranks}: each rank holds M / nranks rows of A"
        )));
    }
    if k == 0 || k % 8 != 0 {
        return Err(MkError::invalid_argument(format!(
            "K = {k} must be a positive multiple of 8 (16-byte rows for TMA)"
        )));
    }
    if n == 0 && m != 0 {
        return Err(MkError::invalid_argument("N must be positive"));
    }
    Ok(())
}

/// How a rank's rows are cut into flagged chunks (the gather's unit of overlap).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunking {
    /// Rows per signalled chunk: whole row blocks (a shard's last chunk may be shorter).
    pub chunk_rows: usize,
    pub chunks_per_rank: usize,
    /// Flag words per source rank (`flag_stride(nranks)`, ≥ chunks_per_rank).
    pub flag_stride: usize,
}

/// The chunks of `rows_per_rank` rows with `nranks` sources: as few whole row blocks per
/// chunk as the flag words allow (mkAllGatherGemm and mkAllGatherScaledGemm).
pub fn chunking(rows_per_rank: usize, nranks: usize) -> Result<Chunking> {
    if nranks > CHUNK_FLAG_WORDS / 4 {
        return Err(MkError::invalid_usage(format!("{nranks} ranks, at most {} are supported", CHUNK_FLAG_WORDS / 4)));
    }
    let blocks_per_rank = rows_per_rank.div_ceil(ROW_BLOCK).max(1);
    let stride = flag_stride(nranks);
    let chunk_rows = blocks_per_rank.div_ceil(stride) * ROW_BLOCK;
    Ok(Chunking { chunk_rows, chunks_per_rank: rows_per_rank.div_ceil(chunk_rows), flag_stride: stride })
}

/// Plans the role split, chunking and order, and the GEMM's tile. `grid_ctas` is the CTAs
/// the kernel may use (`DeviceCaps::grid_cap`: SM count, capped by MK_MAX_CTAS);
/// `comm_override` comes from MK_COMM_SMS / config.
pub fn plan(shape: &AgGemmShape, grid_ctas: u32, comm_override: Option<u32>) -> Result<AgGemmPlan> {
    validate(shape)?;
    let AgGemmShape { m, n, nranks, rank, .. } = *shape;
    let rows_per_rank = m / nranks;
    if grid_ctas < 1 {
        return Err(MkError::invalid_argument("the grid cap (MK_MAX_CTAS) must be at least 1"));
    }
    let comm_ctas = match comm_override {
        _ if nranks == 1 => 0,
        None | Some(0) => 0,
        Some(c) if c >= grid_ctas => {
            return Err(MkError::invalid_argument(format!(
                "communication CTAs = {c} must be below the grid of {grid_ctas} CTAs (0: the GEMM CTAs push)"
            )))
        }
        Some(c) => c,
    };
    let Chunking { chunk_rows, chunks_per_rank, flag_stride: stride } = chunking(rows_per_rank, nranks)?;
    let compute_ctas = grid_ctas - comm_ctas;
    let bn = engine::fused_tile_width(m, n, compute_ctas as usize);
    Ok(AgGemmPlan {
        rows_per_rank,
        comm_ctas,
        compute_ctas,
        chunk_rows,
        chunks_per_rank,
        flag_stride: stride,
        source_order: (0..nranks).map(|i| (rank + i) % nranks).collect(),
        bn,
        group_m: raster_group(m, rows_per_rank, bn, compute_ctas as usize),
        smem_bytes: engine::smem_bytes(bn, Epilogue::Tma),
        grid: compute_ctas + comm_ctas,
        m_block_base: (rank * rows_per_rank) / ROW_BLOCK,
    })
}

/// Raster group of the fused GEMM: the engine's L2-balanced group, capped so that the first
/// wave's m-blocks hold this rank's rows and at most one peer's. Row blocks are consumed
/// own rows first, then rank+1's, …; a group spanning every source makes the first wave
/// wait for the last rank to push (and, with ranks sharing a GPU, to start): at 4 ranks,
/// 128 rows/rank, groups of 4 ran 1.07× unfused, of 2 at 1.00 (docs/decisions/0014-ag-gemm-raster-group.md). Never
/// below 2 m-blocks: one block per wave re-reads all of B per block (group 1: 1.13×).
pub fn raster_group(m: usize, rows_per_rank: usize, bn: usize, compute_ctas: usize) -> usize {
    let tiles_m = m.div_ceil(ROW_BLOCK);
    let own_blocks = (rows_per_rank / ROW_BLOCK).max(1);
    engine::raster_group(tiles_m, bn, compute_ctas).min(own_blocks.max(2)).clamp(1, tiles_m.max(1))
}

/// The chunks (source rank, chunk index) a compute tile covering gathered rows
/// [row0, row0 + rows) must wait for. Row blocks may straddle two shards when
/// M / nranks is not a multiple of ROW_BLOCK.
pub fn chunks_for_rows(plan: &AgGemmPlan, row0: usize, rows: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let end = row0 + rows;
    let mut r = row0;
    while r < end {
        let src = r / plan.rows_per_rank;
        let local = r % plan.rows_per_rank;
        let chunk = local / plan.chunk_rows;
        out.push((src, chunk));
        let chunk_end = (src * plan.rows_per_rank + (chunk + 1) * plan.chunk_rows).min((src + 1) * plan.rows_per_rank);
        r = chunk_end;
    }
    out
}

/// What one rank does across nodes (mirrors kernels/ag_gemm.cu: post_own_rows,
/// push_hier, NodeOrderRaster), for the CPU model of the data flow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRoutes {
    /// Global ranks this rank's own rows are put to through the proxy (the GPU-l rank of
    /// node n+1, n+2, ...), one put per chunk each.
    pub puts: Vec<usize>,
    /// (source, local peer): the rows this rank forwards over NVLink, in order — its own
    /// rows, then those of the GPU-l rank of node n+1, n+2, ... (as they arrive), each to
    /// local rank l-1, l-2, ...
    pub forwards: Vec<(usize, usize)>,
    /// Sources in the order the GEMM consumes their rows (whole-block shards): its own,
    /// its local peers' (l+1, ...), then node n+1's ranks from its GPU-l rank on, ...
    pub tile_sources: Vec<usize>,
}

/// This rank's routes on the node layout `nl` (equal-sized nodes, as `node_layout` checks).
pub fn node_routes(nl: &NodeLayout) -> NodeRoutes {
    let (nodes, local, n, l) = (nl.nodes, nl.local_size, nl.node, nl.local_rank);
    let rank_of = |m: usize, j: usize| nl.rank_of[m * MK_MAX_PEERS + j] as usize;
    let puts = (1..nodes).map(|i| rank_of((n + i) % nodes, l)).collect();
    let mut forwards = Vec::new();
    for i in 0..nodes {
        let s = rank_of((n + i) % nodes, l);
        for jj in 1..local {
            forwards.push((s, rank_of(n, (l + local - jj) % local)));
        }
    }
    let tile_sources = (0..nodes * local).map(|k| rank_of((n + k / local) % nodes, (l + k % local) % local)).collect();
    NodeRoutes { puts, forwards, tile_sources }
}

/// The AllGather + GEMM kernel for `dtype` and tile width `bn` (MK_AG_GEMM_ENTRY lines).
pub fn kernel(dtype: impl Element, bn: usize) -> Result<Kernel> {
    kernels::choose("mkAllGatherGemm", dtype.element(), "MK_AG_GEMM_ENTRY", &[Arg::Element, Arg::Int(bn)])
}

/// A validated mkAllGatherGemm call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgGemmArgs {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub gathered: u64,
    pub shape: AgGemmShape,
    pub dtype: mkDataType_t,
    /// Per-CTA timing buffer for `mkbench --trace` (kernels/common/trace.cuh), else 0.
    pub trace: u64,
}

/// Argument checks (no CUDA). The rules are the GEMM engine's plus divisibility of M.
#[allow(clippy::too_many_arguments)]
pub fn validate_args(
    a: u64,
    b: u64,
    c: u64,
    gathered: u64,
    m: usize,
    n: usize,
    k: usize,
    dtype: RawDataType,
    nranks: usize,
    rank: usize,
) -> Result<AgGemmArgs> {
    let dtype = mkDataType_t::gemm_type_from_raw(dtype, "mkAllGatherGemm")?;
    let shape = AgGemmShape { m, n, k, nranks, rank };
    validate(&shape)?;
    if m > 0 && n > 0 {
        crate::ensure_arg!(a != 0, "A is NULL");
        crate::ensure_arg!(b != 0, "B is NULL");
        crate::ensure_arg!(c != 0, "C is NULL");
    }
    crate::ensure_arg!(n % 8 == 0, "N = {n} must be a multiple of 8: C rows are written with TMA (16-byte rows)");
    crate::ensure_arg!(
        m <= i32::MAX as usize && n <= i32::MAX as usize && k <= i32::MAX as usize,
        "M, N and K must each be at most 2^31-1"
    );
    for (ptr, name) in [(a, "A"), (b, "B"), (c, "C"), (gathered, "gatheredA")] {
        crate::ensure_arg!(
            ptr % 16 == 0,
            "{name} = {ptr:#x} is not 16-byte aligned (TMA and 16-byte vector copies need it)"
        );
    }
    Ok(AgGemmArgs { a, b, c, gathered, shape, dtype, trace: 0 })
}

/// mkAllGatherGemm on `comm`: validate, plan, launch (stream-ordered, no host sync).
pub fn all_gather_gemm(comm: &Comm, args: &AgGemmArgs, stream: sys::CUstream) -> Result<()> {
    comm.check_usable()?;
    let AgGemmShape { m, n, k, nranks, .. } = args.shape;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let _ctx = comm.context.enter()?;
    let grid = DeviceCaps::of(comm)?.grid_cap();
    comm.check_buffers(&[(args.a, "A"), (args.b, "B"), (args.c, "C")])?;
    if args.gathered != 0 {
        comm.check_buffers(&[(args.gathered, "gatheredA")])?;
    }
    if nranks == 1 {
        // Nothing to gather: the engine alone, and the caller's copy of A if asked for.
        let g = crate::ops::gemm::op::validate(args.a, args.b, args.c, m, n, k, args.dtype as RawDataType)?;
        crate::ops::gemm::op::gemm_with(
            &g,
            PlanOverrides { max_ctas: Some(grid as usize), ..Default::default() },
            stream,
        )?;
        if args.gathered != 0 && args.gathered != args.a {
            copy_async(args.gathered, args.a, gathered_bytes(args.dtype, m, k), stream)?;
        }
        return Ok(());
    }
    // Across nodes: this node's workspace (indexed by local rank), the proxy ring and the
    // rank table; rows are still placed by global rank.
    let (ws, nodes) = fused_op_workspace(comm, "mkAllGatherGemm")?;
    let needed = gathered_bytes(args.dtype, m, k) as u64;
    if needed > ws.view.op_bytes {
        return Err(MkError::invalid_usage(format!(
            "mkAllGatherGemm gathers {needed} bytes of A into the workspace's fused-op region, which holds {}: create the \
             communicator with MK_WORKSPACE_BYTES (or mkConfig_t.workspaceBytes) of at least {needed}",
            ws.view.op_bytes
        )));
    }
    let p = plan(&args.shape, grid, comm.config.comm_ctas)?;
    let chunk_bytes = gathered_bytes(args.dtype, p.chunk_rows, k) as u64;
    if nodes.is_some() && chunk_bytes > u32::MAX as u64 {
        return Err(MkError::invalid_usage(format!(
            "mkAllGatherGemm across nodes: a chunk of {} rows × K = {k} is {chunk_bytes} bytes, more than one proxy put moves (4 GiB)",
            p.chunk_rows
        )));
    }
    fused_fence::launch_fenced(comm, &ws.view, nodes.as_ref(), FusedKernel::AllGatherGemm, stream, || {
        launch(args, &p, ws, nodes.as_ref(), stream)
    })
}

/// Launches the fused kernel of plan `p` for validated `args` (the context current) on this
/// node's workspace `ws`, and across nodes with the rank table and proxy ring `nodes`.
fn launch(
    args: &AgGemmArgs,
    p: &AgGemmPlan,
    ws: &SymmetricWorkspace,
    nodes: Option<&(NodeLayout, ProxyRingView)>,
    stream: sys::CUstream,
) -> Result<()> {
    let AgGemmShape { m, n, k, rank, .. } = args.shape;
    // The fused ops' region follows the collectives' data region in every rank's workspace.
    let gathered_base = ws.view.data[ws.view.rank as usize] + ws.view.data_bytes;
    let mut ta = launch::tensor_map(gathered_base, args.dtype, m, k, engine::BM, engine::BK)?;
    let mut tb = launch::tensor_map(args.b, args.dtype, n, k, p.bn, engine::BK)?;
    let mut tc = launch::tensor_map(args.c, args.dtype, m, n, 64, 64)?;
    let mut params = AgGemmParams {
        ws: ws.view,
        a_local: args.a,
        gathered_out: args.gathered,
        gathered_offset: ws.view.data_bytes,
        m: m as i32,
        n: n as i32,
        k: k as i32,
        rows_per_rank: p.rows_per_rank as i32,
        chunk_rows: p.chunk_rows as i32,
        chunks_per_rank: p.chunks_per_rank as i32,
        compute_ctas: p.compute_ctas as i32,
        comm_ctas: p.comm_ctas as i32,
        group_m: p.group_m as i32,
        m_block_base: p.m_block_base as i32,
        trace: args.trace,
        global_rank: rank as i32,
        flag_stride: p.flag_stride as i32,
        nodes: 1,
        ..Default::default()
    };
    if let Some((nl, ring)) = nodes {
        params.nodes = nl.nodes as i32;
        params.node = nl.node as i32;
        params.ring = *ring;
        params.rank_of = nl.rank_of;
    }
    let mut kernel_launch = p.kernel_launch(args.dtype)?;
    if args.trace != 0 {
        // `mkbench --trace`: the twin with the trace hooks (the library's kernel has none).
        kernel_launch.kernel = crate::cuda::kernels::trace_twin(kernel_launch.kernel)?;
    }
    let mut kernel_params: [*mut c_void; 4] = [
        (&mut ta as *mut sys::CUtensorMap).cast(),
        (&mut tb as *mut sys::CUtensorMap).cast(),
        (&mut tc as *mut sys::CUtensorMap).cast(),
        (&mut params as *mut AgGemmParams).cast(),
    ];
    // SAFETY: the parameters match the kernel (3 tensor maps, AgGemmParams); the buffers
    // were checked to be device memory of this device, of the sizes the caller promised.
    unsafe { kernel_launch.launch(stream, &mut kernel_params, Some("mkAllGatherGemm")) }
}

fn copy_async(dst: u64, src: u64, bytes: usize, stream: sys::CUstream) -> Result<()> {
    // SAFETY: both ranges are device memory of the caller's stated sizes.
    unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, stream) }
        .map_err(|e| cuda::cuda_err("cuMemcpyDtoDAsync", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(m: usize, n: usize, k: usize, nranks: usize, rank: usize) -> AgGemmShape {
        AgGemmShape { m, n, k, nranks, rank }
    }

    #[test]
    fn shapes_that_do_not_divide_are_rejected_with_the_rule() {
        let e = plan(&shape(1001, 64, 64, 4, 0), 132, None).unwrap_err();
        assert!(e.message.contains("not divisible by nranks"), "{e}");
        let e = plan(&shape(1024, 64, 60, 4, 0), 132, None).unwrap_err();
        assert!(e.message.contains("multiple of 8"), "{e}");
    }

    #[test]
    fn one_rank_has_no_communication_role() {
        let p = plan(&shape(4096, 8192, 8192, 1, 0), 132, None).unwrap();
        assert_eq!((p.comm_ctas, p.compute_ctas), (0, 132));
        assert_eq!(p.source_order, vec![0]);
    }

    #[test]
    fn side_warps_push_by_default_and_every_cta_computes() {
        for nranks in [2, 4, 8] {
            for rows in [128, 512, 2048, 8192] {
                let p = plan(&shape(rows * nranks, 8192, 8192, nranks, 1), 132, None).unwrap();
                assert_eq!((p.comm_ctas, p.compute_ctas), (0, 132), "{p:?}");
            }
        }
        let p = plan(&shape(4096, 64, 64, 4, 0), 1, None).unwrap();
        assert_eq!((p.comm_ctas, p.compute_ctas), (0, 1));
    }

    #[test]
    fn overrides_are_checked() {
        assert_eq!(plan(&shape(4096, 64, 64, 4, 0), 132, Some(20)).unwrap().comm_ctas, 20);
        assert_eq!(plan(&shape(4096, 64, 64, 4, 0), 132, Some(20)).unwrap().compute_ctas, 112);
        assert_eq!(plan(&shape(4096, 64, 64, 4, 0), 132, Some(0)).unwrap().comm_ctas, 0);
        let e = plan(&shape(4096, 64, 64, 4, 0), 132, Some(132)).unwrap_err();
        assert!(e.message.contains("below the grid"), "{e}");
        assert!(plan(&shape(4096, 64, 64, 4, 0), 0, None).is_err());
        // One rank never pushes, whatever the override.
        assert_eq!(plan(&shape(4096, 64, 64, 1, 0), 132, Some(8)).unwrap().comm_ctas, 0);
    }

    #[test]
    fn the_first_wave_needs_the_own_rows_and_at_most_one_peer() {
        // 4 ranks × 128 rows, 16 CTAs: the engine's group (all 4 blocks) is cut to own + next.
        assert_eq!(engine::raster_group(4, 256, 16), 4);
        assert_eq!(raster_group(512, 128, 256, 16), 2);
        // 4 ranks × 512 rows: 4 own blocks, the engine's 6 is cut to them.
        assert_eq!(raster_group(2048, 512, 256, 16), 4);
        // Enough own rows: the engine's group stands (2048 rows/rank: 16 own blocks).
        assert_eq!(raster_group(8192, 2048, 256, 16), engine::raster_group(64, 256, 16));
        // 2 ranks × 128 rows: both blocks (there are no more).
        assert_eq!(raster_group(256, 128, 256, 32), 2);
        // Shards smaller than a block and one-block problems.
        assert_eq!(raster_group(96, 24, 128, 8), 1);
        assert_eq!(raster_group(200, 100, 128, 8), 2);
    }

    #[test]
    fn local_rows_come_first_then_rotation() {
        let p = plan(&shape(4096, 64, 64, 4, 2), 132, None).unwrap();
        assert_eq!(p.source_order, vec![2, 3, 0, 1]);
    }

    #[test]
    fn chunks_are_capped_and_cover_every_row_once() {
        for rows_per_rank in [1, 100, 128, 129, 1000, 8192, 65536] {
            let p = plan(&shape(rows_per_rank * 3, 64, 64, 3, 0), 132, None).unwrap();
            assert!(p.chunks_per_rank <= MAX_CHUNKS_PER_RANK);
            assert_eq!(p.chunk_rows % ROW_BLOCK, 0);
            assert!(p.chunks_per_rank * p.chunk_rows >= rows_per_rank);
            // Walking all gathered rows in row blocks touches every (source, chunk) pair.
            let mut seen = std::collections::BTreeSet::new();
            let m = rows_per_rank * 3;
            let mut r = 0;
            while r < m {
                let rows = ROW_BLOCK.min(m - r);
                for c in chunks_for_rows(&p, r, rows) {
                    assert!(c.0 < 3 && c.1 < p.chunks_per_rank, "{c:?}");
                    seen.insert(c);
                }
                r += rows;
            }
            assert_eq!(seen.len(), 3 * p.chunks_per_rank, "rows_per_rank={rows_per_rank}");
        }
    }

    #[test]
    fn argument_rules_are_named() {
        let bf16 = mkDataType_t::mkBfloat16 as RawDataType;
        let p = 0x1000u64;
        assert!(validate_args(0, p, p, 0, 256, 64, 64, bf16, 2, 0).unwrap_err().message.contains("A is NULL"));
        assert!(validate_args(p, p, p, 0, 256, 60, 64, bf16, 2, 0).unwrap_err().message.contains("multiple of 8"));
        assert!(validate_args(p, p, p, 0x1008, 256, 64, 64, bf16, 2, 0).unwrap_err().message.contains("gatheredA"));
        assert!(validate_args(p, p, p, 0, 255, 64, 64, bf16, 2, 0).unwrap_err().message.contains("divisible"));
        assert!(validate_args(p, p, p, 0, 256, 64, 64, 77, 2, 0).unwrap_err().message.contains("unknown datatype 77"));
        assert!(validate_args(p, p, p, 0, 256, 64, 64, mkDataType_t::mkFloat32 as RawDataType, 2, 0).is_err());
        assert!(validate_args(p, p, p, 0, 256, 64, 64, bf16, 2, 1).is_ok());
        // An empty GEMM needs no pointers.
        assert!(validate_args(0, 0, 0, 0, 0, 64, 64, bf16, 2, 1).is_ok());
    }

    /// Rank tables for `nranks` ranks in nodes of `rpn` (by rank, as MK_RANKS_PER_NODE), or
    /// by host (interleaved: rank r on host r % nodes).
    fn layouts(nranks: usize, rpn: usize, interleaved: bool) -> Vec<NodeLayout> {
        use crate::ops::common::node_layout::node_layout;
        use crate::transport::topology::{node_of_ranks, Topology};
        let nodes = if interleaved {
            let hosts: Vec<u64> = (0..nranks).map(|r| (r % (nranks / rpn)) as u64 + 7).collect();
            node_of_ranks(&hosts, None)
        } else {
            node_of_ranks(&vec![0; nranks], Some(rpn as u32))
        };
        (0..nranks).map(|r| node_layout(&Topology::new(r, &nodes).unwrap(), &nodes, "x").unwrap()).collect()
    }

    #[test]
    fn across_nodes_every_rank_receives_every_shard_once_and_forwards_only_what_it_holds() {
        for (nranks, rpn) in [(2, 1), (4, 2), (4, 1), (8, 2), (8, 4), (6, 3), (9, 3), (16, 8), (64, 8)] {
            for interleaved in [false, true] {
                let ls = layouts(nranks, rpn, interleaved);
                // held[r]: how many times rank r's gathered buffer received each source's rows
                // (its own count as held from the start: copied into its gathered buffer first).
                let mut held = vec![vec![0usize; nranks]; nranks];
                let rank_of = |nl: &NodeLayout| nl.rank_of[nl.node * MK_MAX_PEERS + nl.local_rank] as usize;
                for nl in &ls {
                    held[rank_of(nl)][rank_of(nl)] = 1;
                }
                // Proxy puts first (they carry only the sender's own rows) ...
                for nl in &ls {
                    let me = rank_of(nl);
                    for peer in node_routes(nl).puts {
                        assert_eq!(ls[peer].local_rank, nl.local_rank, "puts go GPU i to GPU i");
                        assert_ne!(ls[peer].node, nl.node);
                        held[peer][me] += 1;
                    }
                }
                // ... then NVLink forwards, of rows the forwarder holds, to its node's ranks.
                for nl in &ls {
                    let me = rank_of(nl);
                    for (s, j) in node_routes(nl).forwards {
                        assert_eq!(held[me][s], 1, "rank {me} forwards source {s} it does not hold");
                        assert_eq!(ls[j].node, nl.node, "forwards stay in the node");
                        assert_ne!(j, me);
                        held[j][s] += 1;
                    }
                }
                for (r, h) in held.iter().enumerate() {
                    assert!(
                        h.iter().all(|&c| c == 1),
                        "{nranks}/{rpn} interleaved={interleaved}: rank {r} received {h:?}"
                    );
                }
                // Compute order: a permutation, own rows first, then the local peers'.
                for nl in &ls {
                    let order = node_routes(nl).tile_sources;
                    let mut sorted = order.clone();
                    sorted.sort();
                    assert_eq!(sorted, (0..nranks).collect::<Vec<_>>());
                    assert_eq!(order[0], rank_of(nl));
                    assert!(order[..rpn].iter().all(|&s| ls[s].node == nl.node), "{order:?}");
                }
            }
        }
    }

    #[test]
    fn across_nodes_the_flag_words_fit() {
        for nranks in [2, 4, 8, 9, 16, 33, 64] {
            let stride = flag_stride(nranks);
            assert!((4..=MAX_CHUNKS_PER_RANK).contains(&stride));
            // AGG_CHUNK + src * stride + c and AGG_PUSHED + (j * nodes + m) * stride + c.
            assert!(nranks * stride <= CHUNK_FLAG_WORDS);
            for rows in [1, 128, 1000, 65536, 1 << 20] {
                let p = plan(&shape(rows * nranks, 64, 64, nranks, 0), 132, None).unwrap();
                assert!(p.chunks_per_rank <= stride, "{p:?}");
                assert_eq!(p.flag_stride, stride);
            }
        }
        assert_eq!(flag_stride(8), MK_AG_GEMM_MAX_CHUNKS, "one node keeps its 32 chunks per rank");
        assert!(plan(&shape(65 * 128, 64, 64, 65, 0), 132, None).is_err());
    }

    #[test]
    fn every_planned_tile_width_has_a_kernel() {
        for dtype in [mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16] {
            for bn in [128, 256] {
                assert!(kernel(dtype, bn).is_ok(), "{dtype:?} bn {bn}");
            }
        }
    }

    #[test]
    fn every_plan_launches_a_built_kernel_on_its_whole_grid() {
        for nranks in [2, 3, 4, 8] {
            for rows in [1, 24, 100, 128, 256, 512, 1000, 2048, 8192] {
                for n in [64, 128, 1024, 3584, 8192, 28672] {
                    for (grid, comm) in [(132, None), (132, Some(20)), (66, None), (33, None), (16, Some(4)), (1, None)]
                    {
                        for rank in [0, nranks - 1] {
                            let shape = AgGemmShape { m: rows * nranks, n, k: 64, nranks, rank };
                            let p = plan(&shape, grid, comm).unwrap();
                            assert_eq!(p.grid, grid, "push CTAs come out of the grid: {shape:?}");
                            assert_eq!(p.compute_ctas + p.comm_ctas, grid);
                            assert!(p.bn == 128 || p.bn == 256);
                            assert!(p.smem_bytes <= engine::SMEM_LIMIT);
                            let tiles_m = shape.m.div_ceil(ROW_BLOCK);
                            assert!((1..=tiles_m.max(1)).contains(&p.group_m), "{p:?}");
                            assert_eq!(p.m_block_base, rank * rows / ROW_BLOCK);
                            for dtype in [mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16] {
                                let l = p.kernel_launch(dtype).unwrap();
                                assert_eq!((l.grid, l.block, l.smem_bytes), (grid, 384, p.smem_bytes as u32));
                                assert_eq!(l.clusters, crate::ops::common::launch::Clusters::None);
                            }
                        }
                    }
                }
            }
        }
    }

    /// The GEMM's tile, its raster group and shared memory for representative shapes.
    #[test]
    fn the_plan_picks_the_tile_group_and_grid() {
        // 4 ranks × 2048 rows, N 8192 on a whole H200: wide tiles, the engine's group, 3 stages
        // of 48 KiB + 64 KiB of epilogue staging + 1 KiB alignment + barriers and mailbox.
        let p = plan(&shape(8192, 8192, 8192, 4, 1), 132, None).unwrap();
        assert_eq!((p.bn, p.group_m, p.smem_bytes, p.grid, p.m_block_base), (256, 16, 214_128, 132, 16));
        // 2 ranks × 128 rows on 32 CTAs: 64 tiles of 256 fill the grid; both blocks in a group.
        let p = plan(&shape(256, 8192, 1024, 2, 1), 32, None).unwrap();
        assert_eq!((p.bn, p.group_m, p.grid, p.m_block_base), (256, 2, 32, 1));
        // Skinny on a whole GPU: 128 columns (the fused kernels have no 64).
        let p = plan(&shape(256, 4096, 1024, 2, 0), 132, None).unwrap();
        assert_eq!((p.bn, p.group_m, p.grid, p.m_block_base), (128, 2, 132, 0));
        assert_eq!(p.smem_bytes, engine::smem_bytes(128, Epilogue::Tma));
        // Dedicated push CTAs are launched beside the compute CTAs.
        let p = plan(&shape(4096, 8192, 1024, 4, 3), 132, Some(20)).unwrap();
        assert_eq!((p.compute_ctas, p.grid, p.m_block_base), (112, 132, 24));
    }

    #[test]
    fn a_block_straddling_two_shards_waits_for_both() {
        let p = plan(&shape(300, 64, 64, 3, 0), 132, None).unwrap();
        assert_eq!(p.rows_per_rank, 100);
        assert_eq!(chunks_for_rows(&p, 0, 128), vec![(0, 0), (1, 0)]);
        assert_eq!(chunks_for_rows(&p, 256, 44), vec![(2, 0)]);
    }
}
