//! GEMM + AllReduce: planning (pure, CPU-tested).
//!
//! Two regimes. For small M (decode, M ≤ 256) the one-shot path: every rank stores its
//! partial tile in its workspace and signals it; every rank reads all n partials of a tile
//! as soon as they are signalled and sums them in rank order — lowest latency, and the
//! same sum order everywhere, so outputs are bitwise identical across ranks. For large M,
//! reduce-scatter then all-gather inside the kernel: each chunk's owner reduces it (as in
//! GEMM + ReduceScatter) and the reduced chunk is then pulled by every rank as it
//! finishes; one owner computes each sum, so ranks again agree bit for bit.

use super::gemm_rs::{self, GemmRsShape};
use crate::error::Result;

/// Largest M that takes the one-shot path by default (MK_GEMM_AR_ONESHOT_MAX_M overrides).
pub const ONE_SHOT_MAX_M: usize = 256;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GemmArPlan {
    /// Every rank reads every partial: `reduce_ctas` dedicated CTAs read and sum while the
    /// rest compute, or (0) the GEMM CTAs do it after their last tile.
    OneShot { compute_ctas: u32, reduce_ctas: u32 },
    /// Reduce-scatter by owner chunks, then all-gather of reduced chunks.
    TwoPhase(gemm_rs::GemmRsPlan),
}

/// Plans the op; `m` may be any value ≥ 1 on the one-shot path (no divisibility needed),
/// while the two-phase path (M above `one_shot_max_m`) needs every rank to own whole
/// 128-row blocks (M divisible by 128·nranks), and falls back to one-shot when it does not.
/// At two ranks both regimes move the same bytes per rank (one-shot reads 2·M·N, two-phase
/// M·N + M·N/2 plus the extra write of R); the two-phase one waits on the owners' flags.
#[allow(clippy::too_many_arguments)] // one shape, the grid and two overrides
pub fn plan(
    m: usize,
    n: usize,
    k: usize,
    nranks: usize,
    rank: usize,
    grid_ctas: u32,
    comm_override: Option<u32>,
    one_shot_max_m: usize,
) -> Result<GemmArPlan> {
    let shape = GemmRsShape { m, n, k, nranks, rank };
    let two_phase_ok = m > one_shot_max_m && m % (nranks * super::ag_gemm::ROW_BLOCK) == 0 && nranks > 1;
    if two_phase_ok {
        return gemm_rs::plan(&shape, grid_ctas, comm_override).map(GemmArPlan::TwoPhase);
    }
    // One-shot: validate N and K with the same rules, ignoring M's divisibility.
    gemm_rs::validate(&GemmRsShape { m: nranks, ..shape })?;
    let reduce_ctas = match comm_override {
        None | Some(0) => 0,
        Some(c) if c >= grid_ctas => {
            return Err(crate::error::MkError::invalid_argument(format!(
                "reduction CTAs = {c} must be below the grid of {grid_ctas} CTAs (0: the GEMM CTAs reduce after their tiles)"
            )))
        }
        Some(c) => c,
    };
    Ok(GemmArPlan::OneShot { compute_ctas: grid_ctas - reduce_ctas, reduce_ctas })
}

/// GEMM + AllReduce by tile owners (kernels/gemm_reduce.cu, the `mk_gemm_allreduce_owner_*`
/// kernels): the one-shot sizes on one node, with 128-row tiles and the GEMM CTAs summing
/// after their GEMM, when `MK_GEMM_REDUCERS=owners` asks for it (not the default: measured
/// no faster than every rank summing every tile on one shared H200). The linear tile order is cut into `nranks` segments, rank r computes from
/// segment r on and owns segment r - 1, which it computes last: its epilogue adds the peers'
/// partials, and the others copy the sum.
pub fn owner_sums(one_shot: bool, one_node: bool, reduce_ctas: u32, reducers: super::gemm_reduce::Reducers, tile_rows: usize) -> bool {
    one_shot && one_node && reduce_ctas == 0 && reducers == super::gemm_reduce::Reducers::Owners && tile_rows == 128
}

/// First linear tile of segment `q` of `tiles` (q = nranks: the end); rank q starts there.
pub fn segment_start(q: usize, tiles: usize, nranks: usize) -> usize {
    q * tiles / nranks
}

/// The rank that owns linear tile `t`: segment q's tiles belong to rank q + 1.
pub fn tile_owner(t: usize, tiles: usize, nranks: usize) -> usize {
    (((t + 1) * nranks - 1) / tiles + 1) % nranks
}

/// Step `i` of a rank's copy walk after its GEMM (kernels/gemm_reduce.cu copy_owned_sums),
/// over `i < (nranks - 1) * ceil(tiles / nranks)`: the owners after `rank` in turn, each
/// owner's tiles in its compute order; `None` where an owner's segment is shorter.
pub fn copy_walk(rank: usize, nranks: usize, tiles: usize, i: usize) -> Option<(usize, usize)> {
    let others = nranks - 1;
    let owner = (rank + 1 + i % others) % nranks;
    let segment = (owner + nranks - 1) % nranks;
    let t = segment_start(segment, tiles, nranks) + i / others;
    (t < segment_start(segment + 1, tiles, nranks)).then_some((owner, t))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every tile has one owner, who computes it no earlier than any peer (its position in
    /// the owner's rotated order is the largest), and owns exactly the last positions of its
    /// own order; each rank's copy walk visits every tile it does not own exactly once, from
    /// that tile's owner.
    #[test]
    fn owners_compute_their_tiles_last_and_copies_cover_the_rest() {
        for nranks in 2..=8 {
            for tiles in [1, 2, 3, 7, 16, 32, 63, 64, 65, 128, 130] {
                let position = |r: usize, t: usize| (t + tiles - segment_start(r, tiles, nranks)) % tiles;
                for t in 0..tiles {
                    let o = tile_owner(t, tiles, nranks);
                    assert!(o < nranks);
                    assert!((0..nranks).all(|r| position(r, t) <= position(o, t)), "tiles {tiles}, n {nranks}, t {t}");
                }
                for r in 0..nranks {
                    let owned = (0..tiles).filter(|&t| tile_owner(t, tiles, nranks) == r).count();
                    for t in 0..tiles {
                        assert_eq!(tile_owner(t, tiles, nranks) == r, position(r, t) >= tiles - owned, "tiles {tiles}, n {nranks}, r {r}");
                    }
                    let mut seen = vec![0; tiles];
                    let longest = tiles.div_ceil(nranks);
                    for i in 0..(nranks - 1) * longest {
                        if let Some((owner, t)) = copy_walk(r, nranks, tiles, i) {
                            assert_ne!(owner, r);
                            assert_eq!(tile_owner(t, tiles, nranks), owner);
                            seen[t] += 1;
                        }
                    }
                    for t in 0..tiles {
                        assert_eq!(seen[t], usize::from(tile_owner(t, tiles, nranks) != r), "tiles {tiles}, n {nranks}, r {r}, t {t}");
                    }
                }
            }
        }
    }

    #[test]
    fn owner_sums_only_for_one_shot_on_one_node_after_the_gemm() {
        use crate::ops::gemm_reduce::Reducers;
        assert!(owner_sums(true, true, 0, Reducers::Owners, 128));
        assert!(!owner_sums(false, true, 0, Reducers::Owners, 128));
        assert!(!owner_sums(true, false, 0, Reducers::Owners, 128));
        assert!(!owner_sums(true, true, 4, Reducers::Owners, 128));
        assert!(!owner_sums(true, true, 0, Reducers::After, 128));
        assert!(!owner_sums(true, true, 0, Reducers::Side, 128));
        assert!(!owner_sums(true, true, 0, Reducers::Owners, 64));
        assert!(!owner_sums(true, true, 0, Reducers::Early, 128));
    }

    #[test]
    fn small_m_is_one_shot_and_any_m_is_accepted() {
        for m in [1, 7, 16, 64, 255, 256] {
            match plan(m, 8192, 1024, 4, 0, 132, None, ONE_SHOT_MAX_M).unwrap() {
                GemmArPlan::OneShot { compute_ctas, reduce_ctas } => assert_eq!(compute_ctas + reduce_ctas, 132),
                p => panic!("M={m}: {p:?}"),
            }
        }
    }

    #[test]
    fn large_divisible_m_is_two_phase_else_one_shot() {
        assert!(matches!(plan(8192, 8192, 1024, 4, 0, 132, None, ONE_SHOT_MAX_M).unwrap(), GemmArPlan::TwoPhase(_)));
        assert!(matches!(plan(8191, 8192, 1024, 4, 0, 132, None, ONE_SHOT_MAX_M).unwrap(), GemmArPlan::OneShot { .. }));
        // Owners must hold whole 128-row blocks: 4 x 160 rows is one-shot.
        assert!(matches!(plan(640, 8192, 1024, 4, 0, 132, None, ONE_SHOT_MAX_M).unwrap(), GemmArPlan::OneShot { .. }));
        assert!(matches!(plan(1024, 8192, 1024, 4, 0, 132, None, ONE_SHOT_MAX_M).unwrap(), GemmArPlan::TwoPhase(_)));
        assert!(matches!(plan(8192, 8192, 1024, 1, 0, 132, None, ONE_SHOT_MAX_M).unwrap(), GemmArPlan::OneShot { .. }));
    }

    #[test]
    fn the_one_shot_bound_is_overridable() {
        assert!(matches!(plan(8192, 8192, 1024, 2, 0, 64, None, 16384).unwrap(), GemmArPlan::OneShot { .. }));
        assert!(matches!(plan(512, 8192, 1024, 2, 0, 64, None, 0).unwrap(), GemmArPlan::TwoPhase(_)));
        assert!(matches!(plan(256, 8192, 1024, 2, 0, 64, None, 0).unwrap(), GemmArPlan::TwoPhase(_)));
    }

    #[test]
    fn bad_n_or_k_is_rejected_on_both_paths() {
        assert!(plan(16, 60, 1024, 4, 0, 132, None, ONE_SHOT_MAX_M).is_err());
        assert!(plan(8192, 8192, 12, 4, 0, 132, None, ONE_SHOT_MAX_M).is_err());
        assert!(plan(16, 64, 64, 4, 0, 132, Some(132), ONE_SHOT_MAX_M).is_err());
        assert_eq!(plan(16, 64, 64, 4, 0, 132, Some(11), ONE_SHOT_MAX_M).unwrap(), GemmArPlan::OneShot { compute_ctas: 121, reduce_ctas: 11 });
    }
}
