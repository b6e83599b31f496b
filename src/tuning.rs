//! Internal tuning: the settings that choose between kernel variants, or the sizes where one
//! path gives way to another, that are not part of the public interface. Each has a default
//! that the measurements in benches/ chose, and an `MK_INTERNAL_*` variable (read by
//! src/env.rs, documented in docs/environment.md) to override it when measuring. They are
//! parsed once per process and printed at `MK_DEBUG=INFO`, one line each, as NCCL prints
//! its tuning.

use crate::kernel_abi::{MK_LL_MAX_CTAS, MK_LL_PIECE_BYTES};
use std::sync::OnceLock;

/// Who sums the partials of GEMM + ReduceScatter / AllReduce on one node without dedicated
/// reduction CTAs (`Tuning::gemm_reducers`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reducers {
    /// GEMM+RS: the producer warpgroup's two idle warps of each GEMM CTA sum its earlier
    /// tiles while the GEMM computes the later ones (`early_items`); every warp sums the
    /// rest after the GEMM. GEMM+AR: as `After`. The default.
    Early,
    /// Every warp of each GEMM CTA, after its GEMM.
    After,
}

/// mkRingAttentionBackward's engine (`Tuning::ring_bwd_engine`,
/// docs/decisions/0071-one-pass-attention-backward.md). Unset (`auto`), a call takes OnePass
/// when the workspace holds its dQ sums and TwoPass otherwise (`choose_engine`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingBackwardEngine {
    /// dK/dV items (S, dP, dV, dK per tile), then dQ items (S, dP, dQ): seven GEMM-units per
    /// (key, query) pair, no sums across CTAs but the dK/dV chain.
    TwoPass,
    /// dK/dV items also form dQ's partial per query tile (five GEMM-units per pair); the
    /// partials are summed in each tile's fixed turn order: bitwise reproducible.
    OnePass,
    /// OnePass with the partials summed by atomic adds in arrival order (not reproducible
    /// bit for bit).
    OnePassAtomic,
}

impl RingBackwardEngine {
    pub fn name(self) -> &'static str {
        match self {
            RingBackwardEngine::TwoPass => "two-pass",
            RingBackwardEngine::OnePass => "one-pass",
            RingBackwardEngine::OnePassAtomic => "one-pass-atomic",
        }
    }

    /// Whether a second call on the same inputs gives the same bits.
    pub fn reproducible(self) -> bool {
        self != RingBackwardEngine::OnePassAtomic
    }
}

/// mkGemmAllReduce: the largest M that takes the one-shot path by default
/// (`Tuning::gemm_ar_one_shot_max_m`).
pub const GEMM_AR_ONE_SHOT_MAX_M: usize = 256;

/// mkMoeGemmCombine: column bands of its GEMM by default (`Tuning::moe_bands`). The pull of a
/// token's output tile needs the tile's slabs of all its k rows, on up to k experts anywhere in
/// the expert-major order, so without bands nothing can be pulled before the GEMM's end (4
/// ranks: the pull, ~2.6 ms alone, runs after a ~11 ms GEMM). With b bands the GEMM finishes
/// band 0 (every block, its first H / b columns) after ~1/b of its time, and the side warps
/// pull band 0's outputs while bands 1.. compute; each band reads A (Y') again: b x 168 MB per
/// rank at DeepSeek-V3-like sizes, beside ~1.8 GB of W2 tiles read once.
pub const MOE_BANDS: usize = 4;

/// The collectives within a node: the largest message per rank segment (bytes; AllReduce: the
/// buffer) that takes the low-latency protocol by default (`Tuning::collective_ll_max_bytes`):
/// one piece of MK_LL_PIECE_BYTES per LL CTA. A first choice from the protocol's shape (one
/// one-way trip where the simple protocol takes two to three flag trips and a pull), not yet a
/// measured crossover: `mkbench all_reduce --threads` across it is the measurement that sets
/// it.
pub const COLLECTIVE_LL_MAX_BYTES: u64 = MK_LL_MAX_CTAS as u64 * MK_LL_PIECE_BYTES as u64;

/// One process's tuning (copied into every communicator's config).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// GEMM + ReduceScatter / AllReduce on one node without dedicated reduction CTAs: who
    /// sums the partials (MK_INTERNAL_GEMM_REDUCERS).
    pub gemm_reducers: Reducers,
    /// mkGemmAllReduce: the largest M that takes the one-shot path (MK_INTERNAL_GEMM_AR_ONESHOT_MAX_M).
    pub gemm_ar_one_shot_max_m: usize,
    /// mkMoeGemmCombine: column bands of its GEMM, at least 1 (MK_INTERNAL_MOE_BANDS).
    pub moe_bands: usize,
    /// mkMoeDispatchGemm: every warp of the GEMM CTAs sends the first wave's rows before the
    /// GEMM; None: by rank count, `ops::moe::burst_for` (MK_INTERNAL_MOE_BURST).
    pub moe_burst: Option<bool>,
    /// The collectives within a node: the largest message per rank segment (bytes) that takes
    /// the low-latency protocol; 0 never (MK_INTERNAL_COLLECTIVE_LL_MAX_BYTES).
    pub collective_ll_max_bytes: u64,
    /// mkRingAttentionBackward's engine (MK_INTERNAL_RING_BWD_ENGINE); None: chosen per call
    /// by the workspace (`ops::attention::ring_attention_backward::choose_engine`).
    pub ring_bwd_engine: Option<RingBackwardEngine>,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            gemm_reducers: Reducers::Early,
            gemm_ar_one_shot_max_m: GEMM_AR_ONE_SHOT_MAX_M,
            moe_bands: MOE_BANDS,
            moe_burst: None,
            collective_ll_max_bytes: COLLECTIVE_LL_MAX_BYTES,
            ring_bwd_engine: None,
        }
    }
}

static PROCESS_TUNING: OnceLock<Tuning> = OnceLock::new();

impl Tuning {
    /// The defaults, overridden by the `MK_INTERNAL_*` variables that are set.
    pub fn from_env() -> Tuning {
        let d = Tuning::default();
        Tuning {
            gemm_reducers: crate::env::internal_gemm_reducers().unwrap_or(d.gemm_reducers),
            gemm_ar_one_shot_max_m: crate::env::internal_gemm_ar_one_shot_max_m().unwrap_or(d.gemm_ar_one_shot_max_m),
            moe_bands: crate::env::internal_moe_bands().unwrap_or(d.moe_bands),
            moe_burst: crate::env::internal_moe_burst().unwrap_or(d.moe_burst),
            collective_ll_max_bytes: crate::env::internal_collective_ll_max_bytes()
                .unwrap_or(d.collective_ll_max_bytes),
            ring_bwd_engine: crate::env::internal_ring_bwd_engine().unwrap_or(d.ring_bwd_engine),
        }
    }

    /// This process's tuning: read from the environment on first use, and then logged at INFO.
    pub fn process() -> Tuning {
        *PROCESS_TUNING.get_or_init(|| {
            let t = Tuning::from_env();
            for line in t.describe() {
                crate::log::info(None, format_args!("{line}"));
            }
            t
        })
    }

    /// One line per setting: `NAME = value`, and whether the environment set it.
    pub fn describe(&self) -> Vec<String> {
        let d = Tuning::default();
        let burst = |b: Option<bool>| match b {
            None => "auto".to_string(),
            Some(b) => (b as u8).to_string(),
        };
        let reducers = |r: Reducers| match r {
            Reducers::Early => "early",
            Reducers::After => "after",
        };
        let rows = [
            (
                "MK_INTERNAL_GEMM_REDUCERS",
                reducers(self.gemm_reducers).to_string(),
                self.gemm_reducers == d.gemm_reducers,
            ),
            (
                "MK_INTERNAL_GEMM_AR_ONESHOT_MAX_M",
                self.gemm_ar_one_shot_max_m.to_string(),
                self.gemm_ar_one_shot_max_m == d.gemm_ar_one_shot_max_m,
            ),
            ("MK_INTERNAL_MOE_BANDS", self.moe_bands.to_string(), self.moe_bands == d.moe_bands),
            ("MK_INTERNAL_MOE_BURST", burst(self.moe_burst), self.moe_burst == d.moe_burst),
            (
                "MK_INTERNAL_COLLECTIVE_LL_MAX_BYTES",
                self.collective_ll_max_bytes.to_string(),
                self.collective_ll_max_bytes == d.collective_ll_max_bytes,
            ),
            (
                "MK_INTERNAL_RING_BWD_ENGINE",
                self.ring_bwd_engine.map_or("auto", RingBackwardEngine::name).to_string(),
                self.ring_bwd_engine == d.ring_bwd_engine,
            ),
        ];
        rows.into_iter()
            .map(|(name, value, default)| {
                format!("tuning: {name} = {value}{}", if default { "" } else { " (set by environment)" })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn description_names_every_setting_and_marks_overrides() {
        let d = Tuning::default().describe();
        assert_eq!(d.len(), 6);
        assert!(d[5].ends_with("MK_INTERNAL_RING_BWD_ENGINE = auto"), "{}", d[5]);
        assert!(d.iter().all(|l| l.starts_with("tuning: MK_INTERNAL_") && !l.contains("environment")), "{d:?}");
        assert!(d[0].ends_with("= early"), "{}", d[0]);
        let t = Tuning { gemm_reducers: Reducers::After, moe_burst: Some(false), ..Tuning::default() }.describe();
        assert_eq!(t[0], "tuning: MK_INTERNAL_GEMM_REDUCERS = after (set by environment)");
        assert_eq!(t[3], "tuning: MK_INTERNAL_MOE_BURST = 0 (set by environment)");
        assert!(!t[1].contains("environment") && !t[2].contains("environment"));
    }
}
