//! GEMM + ReduceScatter: planning (pure, CPU-tested).
//!
//! Every rank computes P = A·Bᵀ over its K slice; rank o owns rows [o·M/n, (o+1)·M/n) of
//! the sum. Compute CTAs store partial tiles in their own workspace (no remote stores in
//! the epilogue: Hopper's TMA pipeline stalls on them, PEERS.md) and raise a signal per
//! (owner, chunk); reduction CTAs on each owner pull that chunk's partials from every rank
//! once all are signalled, sum them in fp32 in rank order (the same on every run) and
//! write C. Tiles are ordered chunk-major, owners rotated by rank, so every owner gets its
//! first chunk early and the traffic at any moment is spread over all owners.

use crate::error::{MkError, Result};

pub use super::ag_gemm::ROW_BLOCK;
/// Chunks per owner shard, at most: reduction pipelines against compute at this grain.
pub const MAX_CHUNKS_PER_OWNER: usize = 16;
/// Bytes/s one reduction CTA pulls and sums (reads of peers' partials over NVLink).
pub const REDUCE_BYTES_PER_CTA_PER_S: f64 = 25e9;
use super::ag_gemm::gemm_seconds;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmRsShape {
    pub m: usize,
    pub n: usize,
    /// This rank's K slice.
    pub k: usize,
    pub nranks: usize,
    pub rank: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GemmRsPlan {
    pub rows_per_rank: usize,
    pub reduce_ctas: u32,
    pub compute_ctas: u32,
    pub chunk_rows: usize,
    pub chunks_per_owner: usize,
    /// (owner, chunk) in the order this rank computes them.
    pub order: Vec<(usize, usize)>,
}

pub fn validate(shape: &GemmRsShape) -> Result<()> {
    let GemmRsShape { m, n, k, nranks, .. } = *shape;
    if m % nranks != 0 {
        return Err(MkError::invalid_argument(format!(
            "M = {m} is not divisible by nranks = {nranks}: each rank receives M / nranks rows of C"
        )));
    }
    if k == 0 || k % 8 != 0 {
        return Err(MkError::invalid_argument(format!("K = {k} must be a positive multiple of 8 (16-byte rows for TMA)")));
    }
    if n % 8 != 0 {
        return Err(MkError::invalid_argument(format!(
            "N = {n} must be a multiple of 8: partial rows are moved as 16-byte vectors"
        )));
    }
    Ok(())
}

pub fn plan(shape: &GemmRsShape, grid_ctas: u32, reduce_override: Option<u32>) -> Result<GemmRsPlan> {
    validate(shape)?;
    let GemmRsShape { m, n, k, nranks, rank } = *shape;
    let rows_per_rank = m / nranks;
    if grid_ctas < 2 {
        return Err(MkError::invalid_argument(format!(
            "GEMM + ReduceScatter needs at least 2 CTAs (compute and reduce); the grid cap is {grid_ctas}"
        )));
    }
    let reduce_ctas = match reduce_override {
        Some(c) if c == 0 || c >= grid_ctas => {
            return Err(MkError::invalid_argument(format!(
                "reduction CTAs = {c} must be in [1, {grid_ctas}) for a grid of {grid_ctas} CTAs"
            )))
        }
        Some(c) => c,
        None => {
            // Read every rank's partial of our rows (2-byte elements) within half the GEMM.
            let bytes = nranks as f64 * rows_per_rank as f64 * n as f64 * 2.0;
            let gemm_s = gemm_seconds(m, n, k, grid_ctas);
            let needed = (bytes / (REDUCE_BYTES_PER_CTA_PER_S * 0.5 * gemm_s.max(1e-9))).ceil() as u32;
            needed.clamp(4, 64).min(grid_ctas / 2).max(1)
        }
    };
    let blocks = rows_per_rank.div_ceil(ROW_BLOCK).max(1);
    let chunk_rows = blocks.div_ceil(MAX_CHUNKS_PER_OWNER) * ROW_BLOCK;
    let chunks_per_owner = rows_per_rank.div_ceil(chunk_rows).max(1);
    let mut order = Vec::with_capacity(nranks * chunks_per_owner);
    for chunk in 0..chunks_per_owner {
        for i in 1..=nranks {
            order.push(((rank + i) % nranks, chunk));
        }
    }
    Ok(GemmRsPlan { rows_per_rank, reduce_ctas, compute_ctas: grid_ctas - reduce_ctas, chunk_rows, chunks_per_owner, order })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(m: usize, n: usize, k: usize, nranks: usize, rank: usize) -> GemmRsShape {
        GemmRsShape { m, n, k, nranks, rank }
    }

    #[test]
    fn rules_are_named() {
        assert!(plan(&shape(1001, 64, 64, 2, 0), 132, None).unwrap_err().message.contains("divisible by nranks"));
        assert!(plan(&shape(1024, 60, 64, 2, 0), 132, None).unwrap_err().message.contains("multiple of 8"));
        assert!(plan(&shape(1024, 64, 4, 2, 0), 132, None).unwrap_err().message.contains("K = 4"));
    }

    #[test]
    fn order_is_chunk_major_with_rotated_owners_and_covers_everything_once() {
        let p = plan(&shape(4 * 4096, 8192, 1024, 4, 1), 132, None).unwrap();
        assert_eq!(&p.order[..4], &[(2, 0), (3, 0), (0, 0), (1, 0)]);
        let mut all = p.order.clone();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 4 * p.chunks_per_owner);
        assert_eq!(p.order.len(), all.len());
        // At every step the ranks write to different owners (no n-to-1 hot spot).
        for step in 0..p.order.len() {
            let owners: std::collections::BTreeSet<usize> = (0..4)
                .map(|r| plan(&shape(4 * 4096, 8192, 1024, 4, r), 132, None).unwrap().order[step].0)
                .collect();
            assert_eq!(owners.len(), 4);
        }
    }

    #[test]
    fn reduction_share_shrinks_as_k_grows() {
        let thin = plan(&shape(4 * 1024, 8192, 1024, 4, 0), 132, None).unwrap();
        let thick = plan(&shape(4 * 1024, 8192, 3584, 4, 0), 132, None).unwrap();
        assert!(thin.reduce_ctas >= thick.reduce_ctas, "{thin:?} {thick:?}");
        for p in [&thin, &thick] {
            assert_eq!(p.reduce_ctas + p.compute_ctas, 132);
            assert!(p.reduce_ctas >= 4 && p.reduce_ctas <= 64);
        }
        let small_grid = plan(&shape(4 * 1024, 8192, 1024, 4, 0), 6, None).unwrap();
        assert_eq!(small_grid.reduce_ctas + small_grid.compute_ctas, 6);
        assert!(small_grid.compute_ctas >= 3);
    }

    #[test]
    fn chunks_cover_awkward_shards() {
        for rows in [1, 127, 128, 129, 1000, 4096, 16384] {
            let p = plan(&shape(rows * 3, 64, 64, 3, 0), 132, None).unwrap();
            assert!(p.chunks_per_owner <= MAX_CHUNKS_PER_OWNER);
            assert!(p.chunks_per_owner * p.chunk_rows >= rows);
            assert!((p.chunks_per_owner - 1) * p.chunk_rows < rows);
        }
    }
}
