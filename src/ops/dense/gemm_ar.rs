//! GEMM + AllReduce: planning (pure, CPU-tested).
//!
//! Two regimes. For small M (decode, M ≤ 256) the one-shot path: every rank stores its
//! partial tile in its workspace and signals it; every rank reads all n partials of a tile
//! as soon as they are signalled and sums them in rank order — lowest latency, and the
//! same sum order everywhere, so outputs are bitwise identical across ranks. For large M,
//! reduce-scatter then all-gather inside the kernel: each chunk's owner reduces it (as in
//! GEMM + ReduceScatter) and the reduced chunk is then pulled by every rank as it
//! finishes; one owner computes each sum, so ranks again agree bit for bit.

use crate::error::Result;
use crate::ops::dense::gemm_rs::{self, GemmRsShape};

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
    let two_phase_ok = m > one_shot_max_m && m % (nranks * crate::ops::gemm::engine::ROW_BLOCK) == 0 && nranks > 1;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tuning::GEMM_AR_ONE_SHOT_MAX_M;

    #[test]
    fn small_m_is_one_shot_and_any_m_is_accepted() {
        for m in [1, 7, 16, 64, 255, 256] {
            match plan(m, 8192, 1024, 4, 0, 132, None, GEMM_AR_ONE_SHOT_MAX_M).unwrap() {
                GemmArPlan::OneShot { compute_ctas, reduce_ctas } => assert_eq!(compute_ctas + reduce_ctas, 132),
                p => panic!("M={m}: {p:?}"),
            }
        }
    }

    #[test]
    fn large_divisible_m_is_two_phase_else_one_shot() {
        assert!(matches!(
            plan(8192, 8192, 1024, 4, 0, 132, None, GEMM_AR_ONE_SHOT_MAX_M).unwrap(),
            GemmArPlan::TwoPhase(_)
        ));
        assert!(matches!(
            plan(8191, 8192, 1024, 4, 0, 132, None, GEMM_AR_ONE_SHOT_MAX_M).unwrap(),
            GemmArPlan::OneShot { .. }
        ));
        // Owners must hold whole 128-row blocks: 4 x 160 rows is one-shot.
        assert!(matches!(
            plan(640, 8192, 1024, 4, 0, 132, None, GEMM_AR_ONE_SHOT_MAX_M).unwrap(),
            GemmArPlan::OneShot { .. }
        ));
        assert!(matches!(
            plan(1024, 8192, 1024, 4, 0, 132, None, GEMM_AR_ONE_SHOT_MAX_M).unwrap(),
            GemmArPlan::TwoPhase(_)
        ));
        assert!(matches!(
            plan(8192, 8192, 1024, 1, 0, 132, None, GEMM_AR_ONE_SHOT_MAX_M).unwrap(),
            GemmArPlan::OneShot { .. }
        ));
    }

    #[test]
    fn the_one_shot_bound_is_overridable() {
        assert!(matches!(plan(8192, 8192, 1024, 2, 0, 64, None, 16384).unwrap(), GemmArPlan::OneShot { .. }));
        assert!(matches!(plan(512, 8192, 1024, 2, 0, 64, None, 0).unwrap(), GemmArPlan::TwoPhase(_)));
        assert!(matches!(plan(256, 8192, 1024, 2, 0, 64, None, 0).unwrap(), GemmArPlan::TwoPhase(_)));
    }

    #[test]
    fn bad_n_or_k_is_rejected_on_both_paths() {
        assert!(plan(16, 60, 1024, 4, 0, 132, None, GEMM_AR_ONE_SHOT_MAX_M).is_err());
        assert!(plan(8192, 8192, 12, 4, 0, 132, None, GEMM_AR_ONE_SHOT_MAX_M).is_err());
        assert!(plan(16, 64, 64, 4, 0, 132, Some(132), GEMM_AR_ONE_SHOT_MAX_M).is_err());
        assert_eq!(
            plan(16, 64, 64, 4, 0, 132, Some(11), GEMM_AR_ONE_SHOT_MAX_M).unwrap(),
            GemmArPlan::OneShot { compute_ctas: 121, reduce_ctas: 11 }
        );
    }
}
