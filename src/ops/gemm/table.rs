//! The GEMM engine's tile choice as data: a table keyed by shape class (rows of A in
//! buckets, N, K, the CTAs the GEMM may use) that gives the tile rows and width, how many
//! CTAs split K, and the cluster kind; shapes the table does not list take [`rule`].
//! `ops::gemm::engine::plan` asks [`choose`]; at `MK_DEBUG=INFO` the table is printed once and
//! each shape class's choice the first time it is planned.
//!
//! The listed shapes are the (N, K) of a large model's projections at decode and small
//! batch sizes. `mkbench gemm --sweep` times every tile, split and cluster beside cuBLASLt
//! for a shape; a row is changed here when a sweep on the GPU measures a better one.

use crate::ops::gemm::engine::Cluster;

/// Rows of A in the classes the table tells apart: M ≤ 64 fits one 64-row tile; each
/// class up to 512 is a range of half the size above it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MClass {
    /// M ≤ 64 (decode).
    UpTo64,
    /// 64 < M ≤ 128.
    UpTo128,
    /// 128 < M ≤ 256.
    UpTo256,
    /// 256 < M ≤ 512.
    UpTo512,
    /// M > 512.
    Large,
}

impl MClass {
    pub fn of(m: usize) -> MClass {
        match m {
            0..=64 => MClass::UpTo64,
            65..=128 => MClass::UpTo128,
            129..=256 => MClass::UpTo256,
            257..=512 => MClass::UpTo512,
            _ => MClass::Large,
        }
    }
    fn name(self) -> &'static str {
        match self {
            MClass::UpTo64 => "M<=64",
            MClass::UpTo128 => "M<=128",
            MClass::UpTo256 => "M<=256",
            MClass::UpTo512 => "M<=512",
            MClass::Large => "M>512",
        }
    }
}

/// A shape class: the key of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShapeClass {
    pub m: MClass,
    pub n: usize,
    pub k: usize,
    /// CTAs the GEMM may use (the SM count, or a fused op's compute CTAs).
    pub ctas: usize,
}

/// What the planner runs for a shape class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TileChoice {
    /// Rows per tile: 128 (two consumer warpgroups) or 64 (one; A stages half the size).
    pub bm: usize,
    /// Columns per tile: 256, 224, 128 or 64.
    pub bn: usize,
    /// CTAs of a cluster that split K for one tile (1: no split). Split-K kernels exist for
    /// bn 64 and 128 with the TMA epilogue.
    pub split_k: usize,
    /// Operand sharing by multicast (pairs of CTAs); never with split-K or bm 64.
    pub cluster: Cluster,
}

impl TileChoice {
    const fn new(bm: usize, bn: usize, split_k: usize) -> TileChoice {
        TileChoice { bm, bn, split_k, cluster: Cluster::None }
    }
    /// "bm64 bn128 split2" (and the cluster kind, if any).
    pub fn describe(&self) -> String {
        let cluster = match self.cluster {
            Cluster::None => "",
            Cluster::ShareA => " c2a",
            Cluster::ShareB => " c2b",
        };
        format!("bm{} bn{} split{}{cluster}", self.bm, self.bn, self.split_k)
    }
}

/// Most CTAs the rule splits one tile's K over (a cluster may have 8: `gemm::MAX_SPLIT_K`; CTA 0
/// reads the others' partials one after another).
pub const RULE_MAX_SPLIT_K: usize = 4;
/// Fewest 64-wide K blocks each CTA of a split takes: below it the pipeline's fill and the
/// fold cost more than the split gains.
pub const MIN_K_BLOCKS_PER_SPLIT: usize = 8;
/// Tile widths with split-K kernels (the fp32 partial slab beside the ring leaves too
/// few stages at 256).
pub const SPLIT_K_WIDTHS: [usize; 2] = [128, 64];

/// H100 SXM and H200: 132 SMs.
const HOPPER_SMS: usize = 132;

const fn row(m: MClass, n: usize, k: usize, choice: TileChoice) -> (ShapeClass, TileChoice) {
    (ShapeClass { m, n, k, ctas: HOPPER_SMS }, choice)
}

/// The table. Reasons per row (132 SMs; B is N·K·2 bytes, read once when one m-block):
/// - M ≤ 64: all B traffic. 64-row tiles (deeper ring); enough tiles that nearly every SM
///   streams part of B (128 at N 8192 with bn 64, 112 at N 28672 with bn 256: at N 28672
///   the wide tile swept 1.5 % faster than 224 of bn 128 at M 64 on the H100 and 7 % on the
///   H200, within 1 % of it at M 1 and 16).
/// - M ≤ 128, N 8192, K 8192: 128 tiles of 64 × 128 (two m-blocks of one consumer
///   warpgroup each): one wave with no fold, B read by two CTAs through L2; swept 1.02×
///   cuBLAS against 0.94× for 64 tiles of 128 × 128 split over 2 CTAs.
/// - M ≤ 128, N 8192, K 28672: 128 tiles of 64 × 128, as at K 8192; swept 1–2 % faster
///   than 64 tiles of 128 × 128 split over 2 CTAs on the H100, 5 % on the H200.
/// - M ≤ 128, N 28672: 224 tiles of 128 × 128 (1.7 waves); swept 2 % faster than one wave
///   of 112 tiles of 128 × 256 on the H100, 4.6 % on the H200.
/// - 128 < M ≤ 512, N 28672: 128 × 128 tiles (448 at M 256, 896 at M 512 — 3.4 and 6.8
///   waves), where 128 × 256 leaves a partial last wave of wide tiles (224 and 448 tiles:
///   1.7 and 3.4 waves); swept 0.99× and 1.0× cuBLAS against 0.93× and 0.85×. Splitting
///   the wide tiles over 2 CTAs to fill the waves measured 0.75–0.79×: the fold and the
///   shallower ring cost more than the idle slots.
///
/// One table for both GPUs; a row changes where both GPUs' sweeps agree
/// (docs/decisions/0049-one-gemm-table-for-h100-and-h200.md). Measured on an H100 SXM and
/// an H200 (132 SMs each):
/// benches/results/2026-12-05-h100-gemm-table-and-rank-threads.md,
/// benches/results/2026-12-05-h100-gemm-decode-rows.md and
/// benches/results/2026-12-05-h200-moe-gemm-rows.md.
pub const TABLE: &[(ShapeClass, TileChoice)] = &[
    row(MClass::UpTo64, 8192, 8192, TileChoice::new(64, 64, 1)),
    row(MClass::UpTo64, 28672, 8192, TileChoice::new(64, 256, 1)),
    row(MClass::UpTo64, 8192, 28672, TileChoice::new(64, 64, 1)),
    row(MClass::UpTo128, 8192, 8192, TileChoice::new(64, 128, 1)),
    row(MClass::UpTo128, 28672, 8192, TileChoice::new(128, 128, 1)),
    row(MClass::UpTo128, 8192, 28672, TileChoice::new(64, 128, 1)),
    row(MClass::UpTo256, 8192, 8192, TileChoice::new(128, 128, 1)),
    row(MClass::UpTo256, 28672, 8192, TileChoice::new(128, 128, 1)),
    row(MClass::UpTo256, 8192, 28672, TileChoice::new(128, 128, 1)),
    row(MClass::UpTo512, 28672, 8192, TileChoice::new(128, 128, 1)),
];

/// Where a choice came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Table,
    Rule,
}

/// Tile rows for M rows of A: 64 when M fits one such tile (one consumer warpgroup has all
/// the rows, and the A stages shrink so the ring holds more of B), else 128. The GEMM +
/// reduction kernels' `_bm64` choice too (`gemm_reduce::tile_rows`).
pub fn tile_rows(m: usize) -> usize {
    if m <= 64 {
        64
    } else {
        128
    }
}

/// The rule for shapes the table does not list, on `ctas` CTAs:
/// - 64-row tiles at M ≤ 64 (one consumer has all the rows; the A stages shrink);
/// - the widest tile (256) unless it leaves more than half of the CTAs idle: 128, then 64;
/// - split-K over the CTAs a narrow tile count leaves idle, each CTA keeping at least
///   MIN_K_BLOCKS_PER_SPLIT K blocks (at most RULE_MAX_SPLIT_K).
///
/// A partial last wave keeps its wide tiles: splitting them over 2 CTAs to fill the
/// waves measured slower (see [`TABLE`]). A width that makes whole waves (224 at N 28672,
/// docs/decisions/0051-a-224-wide-tile-for-whole-waves.md) or a stream-K schedule
/// (docs/decisions/0050-stream-k-by-the-last-arriver.md) is what would close it; neither is
/// measured, so the rule picks neither.
pub fn rule(m: usize, n: usize, k: usize, ctas: usize) -> TileChoice {
    let ctas = ctas.max(1);
    let bm = tile_rows(m);
    let tiles = |bn: usize| m.div_ceil(bm) * n.div_ceil(bn);
    let k_blocks = k.div_ceil(crate::ops::gemm::engine::BK);
    let max_split = (k_blocks / MIN_K_BLOCKS_PER_SPLIT).clamp(1, RULE_MAX_SPLIT_K);
    let mut bn = 256;
    while bn > 64 && tiles(bn) * 2 < ctas {
        bn /= 2;
    }
    if tiles(bn) * 2 < ctas {
        let split = (ctas / tiles(bn)).min(max_split);
        return TileChoice::new(bm, bn, split.max(1));
    }
    TileChoice::new(bm, bn, 1)
}

/// The choice for a shape on `ctas` CTAs: the table's row for its class, else [`rule`].
pub fn choose(m: usize, n: usize, k: usize, ctas: usize) -> (TileChoice, Source) {
    let class = ShapeClass { m: MClass::of(m), n, k, ctas };
    match TABLE.iter().find(|(c, _)| *c == class) {
        Some(&(_, choice)) => (choice, Source::Table),
        None => (rule(m, n, k, ctas), Source::Rule),
    }
}

/// The tile a plan runs and where it came from, as logged at INFO.
pub fn plan_origin(plan: &crate::ops::gemm::engine::GemmPlan) -> String {
    let source = if plan.source == Source::Table { "table" } else { "rule" };
    let tile = plan.tile();
    if tile == plan.chosen {
        format!("{} ({source})", tile.describe())
    } else {
        format!(
            "{} (the {source} chose {}; adjusted to the epilogue, CTA budget or overrides)",
            tile.describe(),
            plan.chosen.describe()
        )
    }
}

/// One line per table row, as printed at INFO.
pub fn describe_table() -> Vec<String> {
    TABLE
        .iter()
        .map(|(c, t)| format!("gemm table: {} N {} K {} on {} CTAs -> {}", c.m.name(), c.n, c.k, c.ctas, t.describe()))
        .collect()
}

/// Logs the table at INFO once per process, and each plan of a shape class the first time
/// it is made (at most 256, so a caller sweeping shapes cannot grow the set without bound):
/// the tile run, and where it differs, what the table or rule chose before the epilogue,
/// the CTA budget or the caller's overrides changed it. Without INFO (read once per
/// process) it returns at once: it runs on every call.
pub fn log_choice(m: usize, n: usize, k: usize, ctas: usize, plan: &crate::ops::gemm::engine::GemmPlan) {
    use parking_lot::Mutex;
    use std::collections::HashSet;
    use std::sync::OnceLock;
    static INFO: OnceLock<bool> = OnceLock::new();
    if !*INFO.get_or_init(crate::log::info_enabled) {
        return;
    }
    static TABLE_LOGGED: OnceLock<()> = OnceLock::new();
    static SEEN: Mutex<Option<HashSet<(ShapeClass, TileChoice)>>> = Mutex::new(None);
    TABLE_LOGGED.get_or_init(|| {
        for line in describe_table() {
            crate::log::info(None, format_args!("{line}"));
        }
    });
    let class = ShapeClass { m: MClass::of(m), n, k, ctas };
    let tile = plan.tile();
    let mut seen = SEEN.lock();
    let seen = seen.get_or_insert_with(HashSet::new);
    if seen.len() < 256 && seen.insert((class, tile)) {
        crate::log::info(
            None,
            format_args!("gemm plan: M {m} ({}) N {n} K {k} on {ctas} CTAs -> {}", class.m.name(), plan_origin(plan)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_logged_origin_names_an_adjusted_choice() {
        use crate::ops::gemm::engine::{plan, PlanOverrides};
        // M 100 N 4096 K 16384 on 132 SMs: 64 tiles of 128 x 64, each split over 2 CTAs by the rule.
        let tma = plan(100, 4096, 16384, 132, true, PlanOverrides::default());
        assert_eq!(plan_origin(&tma), "bm128 bn64 split2 (rule)");
        // A split needs the TMA epilogue: without it the same choice runs unsplit.
        let direct = plan(100, 4096, 16384, 132, false, PlanOverrides::default());
        assert_eq!(direct.split_k, 1);
        assert!(
            plan_origin(&direct).starts_with("bm128 bn64 split1 (the rule chose bm128 bn64 split2;"),
            "{}",
            plan_origin(&direct)
        );
    }

    #[test]
    fn every_row_is_buildable_and_fits_its_shape() {
        for (c, t) in TABLE {
            assert!(t.bm == 64 || t.bm == 128, "{c:?}");
            assert!([256, 128, 64].contains(&t.bn), "{c:?}");
            assert!((1..=RULE_MAX_SPLIT_K).contains(&t.split_k), "{c:?}");
            if t.split_k > 1 {
                assert!(SPLIT_K_WIDTHS.contains(&t.bn), "{c:?}: no split-K kernel at bn {}", t.bn);
                assert!(c.k / 64 >= t.split_k * MIN_K_BLOCKS_PER_SPLIT, "{c:?}");
                assert!(c.ctas >= t.split_k);
            }
            assert_eq!(t.cluster, Cluster::None, "{c:?}");
            // 64-row tiles for every M that fits one of them; at most two m-blocks of them
            // (past 128 rows, 128-row tiles read B half as often).
            if c.m == MClass::UpTo64 {
                assert_eq!(t.bm, 64, "{c:?}");
            }
            if t.bm == 64 {
                assert!(matches!(c.m, MClass::UpTo64 | MClass::UpTo128), "{c:?}");
            }
        }
        // One row per class.
        for (i, (a, _)) in TABLE.iter().enumerate() {
            assert!(TABLE[i + 1..].iter().all(|(b, _)| b != a), "{a:?} listed twice");
        }
    }

    #[test]
    fn the_table_covers_the_decode_shapes_and_is_found() {
        for m in [1, 16, 64, 128, 256] {
            for (n, k) in [(8192, 8192), (28672, 8192), (8192, 28672)] {
                let (_, source) = choose(m, n, k, 132);
                assert_eq!(source, Source::Table, "M {m} N {n} K {k}");
            }
        }
        assert_eq!(choose(1, 8192, 8192, 132), (TileChoice::new(64, 64, 1), Source::Table));
        assert_eq!(choose(100, 8192, 8192, 132), (TileChoice::new(64, 128, 1), Source::Table));
        assert_eq!(choose(100, 8192, 28672, 132), (TileChoice::new(64, 128, 1), Source::Table));
        // Another SM count (or a fused op's CTA budget) is another class: the rule.
        assert_eq!(choose(1, 8192, 8192, 114).1, Source::Rule);
        assert_eq!(choose(1, 8192, 8192, 64).1, Source::Rule);
    }

    #[test]
    fn m_classes_bound_their_ranges() {
        assert_eq!(MClass::of(0), MClass::UpTo64);
        assert_eq!(MClass::of(64), MClass::UpTo64);
        assert_eq!(MClass::of(65), MClass::UpTo128);
        assert_eq!(MClass::of(128), MClass::UpTo128);
        assert_eq!(MClass::of(129), MClass::UpTo256);
        assert_eq!(MClass::of(512), MClass::UpTo512);
        assert_eq!(MClass::of(513), MClass::Large);
    }

    #[test]
    fn the_rule_narrows_then_splits_k_for_few_tiles() {
        // Large: the widest tile, no split.
        assert_eq!(rule(8192, 8192, 8192, 132), TileChoice::new(128, 256, 1));
        assert_eq!(rule(4096, 4096, 4096, 132), TileChoice::new(128, 256, 1)); // 512 tiles: 97 %
                                                                               // Decode rows: 64-row tiles, narrowed until half the CTAs have a tile.
        assert_eq!(rule(1, 8192, 8192, 132), TileChoice::new(64, 64, 1)); // 128 tiles
        assert_eq!(rule(1, 28672, 8192, 132), TileChoice::new(64, 256, 1)); // 112 tiles
                                                                            // Few tiles even at 64 wide: split K over the idle CTAs.
        assert_eq!(rule(1, 4096, 8192, 132), TileChoice::new(64, 64, 2)); // 64 tiles x 2
        assert_eq!(rule(16, 1024, 8192, 132), TileChoice::new(64, 64, 4)); // 16 tiles x 4 (the cap)
                                                                           // ... but each CTA keeps 8 K blocks.
        assert_eq!(rule(1, 1024, 1024, 132), TileChoice::new(64, 64, 2)); // 16 K blocks
        assert_eq!(rule(1, 1024, 512, 132), TileChoice::new(64, 64, 1));
        assert_eq!(rule(1, 1, 8, 132), TileChoice::new(64, 64, 1));
        // 65..128 rows: two consumers, 128-row tiles.
        assert_eq!(rule(128, 8192, 8192, 132), TileChoice::new(128, 64, 1));
    }

    #[test]
    fn the_rule_keeps_wide_tiles_for_a_partial_last_wave() {
        // 512 x 28672: 448 tiles of 256 on 132 SMs (3.4 waves, 85 % of the slots busy);
        // splitting them measured slower, so the rule keeps the wide unsplit tile. The
        // table lists the measured shapes, where 128-wide unsplit tiles ran faster still.
        assert_eq!(rule(512, 28672, 8192, 132), TileChoice::new(128, 256, 1));
        assert_eq!(rule(384, 28672, 4096, 132), TileChoice::new(128, 256, 1));
        assert_eq!(choose(512, 28672, 8192, 132), (TileChoice::new(128, 128, 1), Source::Table));
        assert_eq!(choose(256, 28672, 8192, 132), (TileChoice::new(128, 128, 1), Source::Table));
        assert_eq!(rule(8192, 28672, 8192, 132), TileChoice::new(128, 256, 1));
    }

    #[test]
    fn the_table_prints_one_line_per_row() {
        let lines = describe_table();
        assert_eq!(lines.len(), TABLE.len());
        assert_eq!(lines[0], "gemm table: M<=64 N 8192 K 8192 on 132 CTAs -> bm64 bn64 split1");
        assert!(lines.iter().any(|l| l == "gemm table: M<=64 N 28672 K 8192 on 132 CTAs -> bm64 bn256 split1"));
    }
}
