//! AllGather + GEMM: planning (pure, CPU-tested). Each rank holds `M / nranks` rows of A;
//! communication CTAs push this rank's rows into every peer's workspace in chunks, each
//! followed by an epoch signal; compute CTAs run the GEMM engine over row blocks in
//! rank-rotated order (local rows first) and wait per row block for the chunks it needs.

use crate::error::{MkError, Result};

/// The GEMM's row-block height; chunks are whole row blocks so one wait covers one block.
pub const ROW_BLOCK: usize = 128;
/// At most this many signalled chunks per rank: fewer, larger pushes beyond it.
pub const MAX_CHUNKS_PER_RANK: usize = 32;
/// Per-CTA push bandwidth assumed when sizing the communication role (bytes/s): TMA or
/// 16-byte stores from one SM move ~25-30 GB/s over NVLink (PEERS.md, GEMM-NOTES.md).
pub const PUSH_BYTES_PER_CTA_PER_S: f64 = 25e9;
/// GEMM rate assumed for the whole GPU when sizing roles (FLOP/s; measured cuBLAS ~700 T).
pub const GEMM_FLOPS_PER_S: f64 = 700e12;

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
    /// CTAs pushing this rank's shard to peers (0 with one rank).
    pub comm_ctas: u32,
    /// CTAs running GEMM tiles.
    pub compute_ctas: u32,
    /// Rows per signalled chunk (a multiple of ROW_BLOCK except for a shard's last chunk).
    pub chunk_rows: usize,
    pub chunks_per_rank: usize,
    /// Source ranks in the order compute consumes their rows: this rank first, then the
    /// ones whose data arrives next (rank+1, rank+2, ...; every rank pushes in that order).
    pub source_order: Vec<usize>,
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
        return Err(MkError::invalid_argument(format!("K = {k} must be a positive multiple of 8 (16-byte rows for TMA)")));
    }
    if n == 0 && m != 0 {
        return Err(MkError::invalid_argument("N must be positive"));
    }
    Ok(())
}

/// Plans the role split, chunking and order. `grid_ctas` is the CTAs the kernel may use
/// (SM count, capped by MK_MAX_CTAS); `comm_override` comes from MK_COMM_SMS / config.
pub fn plan(shape: &AgGemmShape, grid_ctas: u32, comm_override: Option<u32>) -> Result<AgGemmPlan> {
    validate(shape)?;
    let AgGemmShape { m, n, k, nranks, rank } = *shape;
    let rows_per_rank = m / nranks;
    if grid_ctas < 2 && nranks > 1 {
        return Err(MkError::invalid_argument(format!(
            "a fused kernel needs at least 2 CTAs (one to communicate, one to compute); the grid cap is {grid_ctas}"
        )));
    }
    let comm_ctas = if nranks == 1 {
        0
    } else if let Some(c) = comm_override {
        if c == 0 || c >= grid_ctas {
            return Err(MkError::invalid_argument(format!(
                "communication CTAs = {c} must be in [1, {}) for a grid of {grid_ctas} CTAs",
                grid_ctas
            )));
        }
        c
    } else {
        // Enough pushers that the shard reaches every peer within half the GEMM's time,
        // so compute rarely waits; at least one per peer up to 16 (mKernel's best static
        // splits for AG+GEMM were 2-16 SMs).
        let push_bytes = (nranks - 1) as f64 * rows_per_rank as f64 * k as f64 * 2.0;
        let gemm_s = 2.0 * m as f64 * n as f64 * k as f64 / GEMM_FLOPS_PER_S;
        let needed = (push_bytes / (PUSH_BYTES_PER_CTA_PER_S * 0.5 * gemm_s.max(1e-9))).ceil() as u32;
        needed.clamp((nranks - 1).min(16) as u32, 16).min(grid_ctas / 2).max(1)
    };
    let blocks_per_rank = rows_per_rank.div_ceil(ROW_BLOCK).max(1);
    let blocks_per_chunk = blocks_per_rank.div_ceil(MAX_CHUNKS_PER_RANK);
    let chunk_rows = blocks_per_chunk * ROW_BLOCK;
    Ok(AgGemmPlan {
        rows_per_rank,
        comm_ctas,
        compute_ctas: grid_ctas - comm_ctas,
        chunk_rows,
        chunks_per_rank: rows_per_rank.div_ceil(chunk_rows),
        source_order: (0..nranks).map(|i| (rank + i) % nranks).collect(),
    })
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
    fn roles_fill_the_grid_and_grow_with_communication_share() {
        for nranks in [2, 4, 8] {
            for rows in [128, 512, 2048, 8192] {
                for (n, k) in [(8192, 8192), (28672, 8192)] {
                    let p = plan(&shape(rows * nranks, n, k, nranks, 1), 132, None).unwrap();
                    assert_eq!(p.comm_ctas + p.compute_ctas, 132);
                    assert!(p.comm_ctas >= 1 && p.comm_ctas <= 16, "{p:?}");
                }
            }
        }
        // A wide GEMM hides the same push with fewer pushers than a narrow one.
        let narrow = plan(&shape(8 * 128, 1024, 8192, 8, 0), 132, None).unwrap();
        let wide = plan(&shape(8 * 128, 28672, 8192, 8, 0), 132, None).unwrap();
        assert!(narrow.comm_ctas >= wide.comm_ctas);
        // A small grid (ranks sharing a GPU) keeps at least half for compute.
        let small = plan(&shape(4 * 4096, 1024, 8192, 4, 0), 8, None).unwrap();
        assert!(small.compute_ctas >= 4 && small.comm_ctas >= 1);
    }

    #[test]
    fn overrides_are_checked() {
        assert_eq!(plan(&shape(4096, 64, 64, 4, 0), 132, Some(20)).unwrap().comm_ctas, 20);
        assert!(plan(&shape(4096, 64, 64, 4, 0), 132, Some(0)).is_err());
        assert!(plan(&shape(4096, 64, 64, 4, 0), 132, Some(132)).is_err());
        assert!(plan(&shape(4096, 64, 64, 4, 0), 1, None).is_err());
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
    fn a_block_straddling_two_shards_waits_for_both() {
        let p = plan(&shape(300, 64, 64, 3, 0), 132, None).unwrap();
        assert_eq!(p.rows_per_rank, 100);
        assert_eq!(chunks_for_rows(&p, 0, 128), vec![(0, 0), (1, 0)]);
        assert_eq!(chunks_for_rows(&p, 256, 44), vec![(2, 0)]);
    }
}
