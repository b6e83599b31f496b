//! GEMM + ReduceScatter: planning (pure, CPU-tested).
//!
//! Every rank computes P = A·Bᵀ over its K slice; rank o owns rows [o·M/n, (o+1)·M/n) of
//! the sum. Compute CTAs store partial tiles in their own workspace (no remote stores in
//! the epilogue: Hopper's TMA pipeline stalls on them, docs/decisions/0009) and raise a flag per
//! 64-row slab; the reduction on each owner pulls a tile's partials from every rank once
//! all are flagged, sums them in fp32 in rank order (the same on every run) and writes C.
//! Every rank computes the tiles in the same order, the owners' row blocks interleaved
//! (block 0 of every owner, then block 1, …; `tile_order`), so every owner's reduction
//! can start early and the traffic is spread over all owners.
//!
//! Two designs for who reduces, kernels/gemm_reduce.cu and gemm_reduce_early.cu, chosen here:
//! - after the GEMM (default, `reduce_ctas` = 0): every CTA computes; each CTA's consumer
//!   warpgroups reduce once its own last tile is stored, so the reduction overlaps the
//!   GEMM's last wave and the GEMM keeps every SM;
//! - dedicated reduction CTAs (`MK_COMM_SMS` = c ≥ 1): c CTAs reduce while the others
//!   compute, overlapping the whole GEMM but taking c SMs from it.
//!
//! Measured on one H200 with ranks sharing it (benches/results/2026-12-02-fused-dense-ops-time-split.md):
//! the dedicated CTAs spent 40–75% of their time waiting for tiles, and their SMs cost the
//! GEMM more than the overlap gained; the default is the faster one there.

use crate::error::{MkError, Result};

pub use crate::ops::gemm::engine::ROW_BLOCK;

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
    /// Dedicated reduction CTAs; 0: the GEMM CTAs reduce after their last tile.
    pub reduce_ctas: u32,
    pub compute_ctas: u32,
}

/// The row blocks (m-block indexes) in the order every rank computes them and every owner
/// reduces them: owners interleaved — block 0 of every owner's rows, then block 1, … —
/// when each owns whole 128-row blocks (kernels/common/gemm/scheduler.cuh
/// OwnerInterleavedRaster), else in row order.
pub fn tile_order(m: usize, nranks: usize) -> Vec<usize> {
    let tiles_m = m.div_ceil(ROW_BLOCK);
    let interleave = nranks > 1 && m % nranks == 0 && (m / nranks) % ROW_BLOCK == 0;
    (0..tiles_m).map(|l| if interleave { (l % nranks) * (tiles_m / nranks) + l / nranks } else { l }).collect()
}

pub fn validate(shape: &GemmRsShape) -> Result<()> {
    let GemmRsShape { m, n, k, nranks, .. } = *shape;
    if m % nranks != 0 {
        return Err(MkError::invalid_argument(format!(
            "M = {m} is not divisible by nranks = {nranks}: each rank receives M / nranks rows of C"
        )));
    }
    if k == 0 || k % 8 != 0 {
        return Err(MkError::invalid_argument(format!(
            "K = {k} must be a positive multiple of 8 (16-byte rows for TMA)"
        )));
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
    let GemmRsShape { m, nranks, .. } = *shape;
    let rows_per_rank = m / nranks;
    if grid_ctas < 1 {
        return Err(MkError::invalid_argument("the grid cap (MK_MAX_CTAS) must be at least 1"));
    }
    let reduce_ctas = match reduce_override {
        None | Some(0) => 0,
        Some(c) if c >= grid_ctas => {
            return Err(MkError::invalid_argument(format!(
                "reduction CTAs = {c} must be below the grid of {grid_ctas} CTAs (0: the GEMM CTAs reduce after their tiles)"
            )))
        }
        Some(c) => c,
    };
    Ok(GemmRsPlan { rows_per_rank, reduce_ctas, compute_ctas: grid_ctas - reduce_ctas })
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
    fn order_interleaves_owners_and_covers_every_block_once() {
        let order = tile_order(4 * 512, 4);
        assert_eq!(&order[..6], &[0, 4, 8, 12, 1, 5]);
        let mut all = order.clone();
        all.sort();
        assert_eq!(all, (0..16).collect::<Vec<_>>());
        // Shards off the block grid stay in row order.
        assert_eq!(tile_order(3 * 100, 3), vec![0, 1, 2]);
        assert_eq!(tile_order(1000, 1), (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn gemm_ctas_reduce_by_default_and_overrides_are_checked() {
        let p = plan(&shape(4 * 1024, 8192, 1024, 4, 0), 132, None).unwrap();
        assert_eq!((p.reduce_ctas, p.compute_ctas), (0, 132));
        let p = plan(&shape(4 * 1024, 8192, 1024, 4, 0), 132, Some(14)).unwrap();
        assert_eq!((p.reduce_ctas, p.compute_ctas), (14, 118));
        assert!(plan(&shape(4 * 1024, 8192, 1024, 4, 0), 132, Some(132))
            .unwrap_err()
            .message
            .contains("below the grid"));
        assert_eq!(plan(&shape(4 * 1024, 8192, 1024, 4, 0), 1, None).unwrap().compute_ctas, 1);
    }
}
