//! The Hopper GEMM engine's planner (kernels/common/gemm), which every op plans with:
//! [`plan`] (tile, split-K, epilogue, grid, raster group: pure arithmetic, unit-tested; the
//! tile and split come from the table of `ops::gemm::table`), the kernel of a plan, and the
//! engine's constants. The mkGemm op on it is `ops::gemm::op`.

use crate::cuda::kernels::{self, Arg, Kernel};
use crate::error::{MkError, Result};
use crate::ops::common::launch::{Clusters, KernelLaunch};
use crate::ops::gemm::table::{self as gemm_table, TileChoice};
use crate::types::{mkDataType_t, Element};

pub use crate::ops::gemm::smem::{
    engine_smem_bytes, fused_smem_bytes, fused_stages, smem_bytes, stages, tile_smem_bytes, tile_stages, Epilogue, BK,
    BM, OPERAND_BYTES, SMEM_LIMIT, TILE_ROWS, TILE_WIDTHS,
};

/// The GEMM's row block: the rows of its tallest tile. The fused ops align what they
/// signal (AllGather + GEMM's chunks, MoE's expert segments) to it, so one wait covers
/// whole tiles.
pub const ROW_BLOCK: usize = BM;

/// Threads per CTA: one producer warpgroup + two consumer warpgroups.
pub const THREADS: u32 = 384;

/// 2-CTA clusters whose CTAs share one operand through TMA multicast (kernels/common/gemm
/// SHARE_A / SHARE_B): half the L2→SM traffic for that operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cluster {
    /// One CTA per work item.
    None,
    /// Two CTAs on n-blocks 2j, 2j+1 of one m-block load A once (tile widths 64, 128).
    ShareA,
    /// Two CTAs on m-blocks 2i, 2i+1 of one n-block load B once (tile widths 128, 256).
    ShareB,
}

impl Cluster {
    /// CTAs per cluster.
    pub fn size(self) -> usize {
        if self == Cluster::None {
            1
        } else {
            2
        }
    }
    /// Whether kernels/gemm.cu has this cluster kind for a tile width and epilogue.
    pub fn compiled_for(self, bn: usize, epilogue: Epilogue) -> bool {
        gemm_kernel(mkDataType_t::mkBfloat16, bn, epilogue, self).is_ok()
    }
}

/// Optional overrides of the planner's choices (benchmarks and tuning; fused ops pass
/// their CTA budget here).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanOverrides {
    /// Tile rows (128 or 64; any other value is ignored).
    pub bm: Option<usize>,
    /// Tile width (64, 128, 224 or 256; any other value is ignored).
    pub bn: Option<usize>,
    /// CTAs that split K for one tile, 1 to 8 (falls back to 1 where no split-K kernel
    /// exists: widths 64 and 128 with the TMA epilogue, without a multicast cluster; and is
    /// lowered to the K blocks and to the CTA budget).
    pub split_k: Option<usize>,
    /// m-blocks per raster group.
    pub group_m: Option<usize>,
    /// Upper bound on the number of CTAs (the engine's CTA-count parameter).
    pub max_ctas: Option<usize>,
    /// 2-CTA cluster kind (falls back to none where no kernel exists or the shared
    /// dimension has an odd number of tiles).
    pub cluster: Option<Cluster>,
}

/// Everything the launch needs, decided from the shape and the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmPlan {
    /// Tile rows: 128, or 64 (one consumer warpgroup; A boxed {64, 64} or `a_box_rows`).
    pub bm: usize,
    pub bn: usize,
    /// CTAs of a cluster that compute one tile over consecutive K ranges (1: no split);
    /// CTA 0 adds the others' fp32 partials in rank order, the same on every run.
    pub split_k: usize,
    pub epilogue: Epilogue,
    pub stages: usize,
    pub smem_bytes: usize,
    pub tiles_m: usize,
    pub tiles_n: usize,
    /// Raster group passed to the kernel: m-blocks walked together (pairs of m-blocks
    /// for Cluster::ShareB).
    pub group_m: usize,
    /// Persistent CTAs: min(tiles, SMs, max_ctas), a whole number of clusters (pairs for
    /// multicast, split_k CTAs per tile for split-K; the launch may lower it further to
    /// what can be co-resident as clusters).
    pub grid: usize,
    pub cluster: Cluster,
    /// What the table or the rule chose (`ops::gemm::table`), before the epilogue, the CTA
    /// budget and the overrides adjusted it; logged at INFO.
    pub chosen: TileChoice,
    pub source: gemm_table::Source,
}

impl GemmPlan {
    pub fn tiles(&self) -> usize {
        self.tiles_m * self.tiles_n
    }
    /// The entry kernel (kernels/gemm.cu) this plan runs for `dtype`: an error for a type
    /// no GEMM kernel is compiled for, or a combination no kernel is built for (the planner
    /// never makes one).
    pub fn kernel(&self, dtype: impl Element) -> Result<Kernel> {
        if self.bm == BM && self.split_k == 1 {
            gemm_kernel(dtype, self.bn, self.epilogue, self.cluster)
        } else if self.cluster == Cluster::None {
            gemm_tile_kernel(dtype, self.bm, self.bn, self.epilogue, self.split_k > 1)
        } else {
            Err(MkError::internal(format!("no GEMM kernel for {self:?}: split-K or 64-row tiles in a cluster")))
        }
    }
    /// The tile as the table states it.
    pub fn tile(&self) -> TileChoice {
        TileChoice { bm: self.bm, bn: self.bn, split_k: self.split_k, cluster: self.cluster }
    }
    /// The name of `kernel(dtype)` ("" where there is none).
    pub fn kernel_name(&self, dtype: impl Element) -> &'static str {
        self.kernel(dtype).map_or("", |k| k.name)
    }
    /// Rows of the A box and of the B box a CTA loads: a CTA of a cluster loads half of
    /// the shared operand (multicast to both).
    pub fn box_rows(&self) -> (usize, usize) {
        let a_rows = if self.cluster == Cluster::ShareA { self.bm / 2 } else { self.bm };
        let b_rows = if self.cluster == Cluster::ShareB { self.bn / 2 } else { self.bn };
        (a_rows, b_rows)
    }
    /// Rows of the A box for `m` rows of A: `box_rows().0`, or `m` where A has fewer rows
    /// (one tile's worth), so the TMA unit fills no rows past A's last (the engine's
    /// `GemmShape::a_box_rows` says why); the kernel credits each stage with this box and
    /// never stores the accumulator rows past M that the box leaves stale.
    pub fn a_box_rows(&self, m: usize) -> usize {
        a_box_rows(self.box_rows().0, m)
    }
    /// The launch of this plan for `dtype`: its kernel, `grid` CTAs of THREADS, its shared
    /// memory, in 2-CTA clusters for a multicast plan and clusters of split_k CTAs for a
    /// split-K plan (co-resident clusters: the launch may lower the grid to what the GPU
    /// holds at once).
    pub fn kernel_launch(&self, dtype: impl Element) -> Result<KernelLaunch> {
        let kernel = self.kernel(dtype)?;
        let clusters = if self.cluster != Cluster::None {
            Clusters::Of(2)
        } else if self.split_k > 1 {
            Clusters::Of(self.split_k as u32)
        } else {
            Clusters::None
        };
        Ok(KernelLaunch { clusters, ..KernelLaunch::new(kernel, self.grid as u32, THREADS, self.smem_bytes as u32) })
    }
}

/// The plain-GEMM kernel for an element type, tile width, epilogue and cluster kind: the
/// instance of kernels/instances.txt that has them.
pub fn gemm_kernel(dtype: impl Element, bn: usize, epilogue: Epilogue, cluster: Cluster) -> Result<Kernel> {
    let tma = Arg::Bool(epilogue == Epilogue::Tma);
    let element = dtype.element();
    match cluster {
        Cluster::None => kernels::choose("mkGemm", element, "MK_GEMM_ENTRY", &[Arg::Element, Arg::Int(bn), tma]),
        Cluster::ShareA | Cluster::ShareB => {
            let shared = Arg::Text(if cluster == Cluster::ShareA { "mk::gemm::SHARE_A" } else { "mk::gemm::SHARE_B" });
            kernels::choose("mkGemm", element, "MK_GEMM_ENTRY_SHARE", &[Arg::Element, Arg::Int(bn), tma, shared])
        }
    }
}

/// The plain-GEMM kernel without multicast for 64- or 128-row tiles, split-K or not (the
/// 128-row unsplit ones are [`gemm_kernel`]'s).
pub fn gemm_tile_kernel(
    dtype: impl Element,
    bm: usize,
    bn: usize,
    epilogue: Epilogue,
    split_k: bool,
) -> Result<Kernel> {
    if bm == BM && !split_k {
        return gemm_kernel(dtype, bn, epilogue, Cluster::None);
    }
    let args = [Arg::Element, Arg::Int(bn), Arg::Bool(epilogue == Epilogue::Tma), Arg::Int(bm), Arg::Bool(split_k)];
    kernels::choose("mkGemm", dtype.element(), "MK_GEMM_ENTRY_TILE", &args)
}

/// Most CTAs a split-K cluster may have (the portable cluster size).
pub const MAX_SPLIT_K: usize = 8;

/// Raster group: as many m-blocks as balance the A rows and B rows one wave of `ctas`
/// tiles touches (g·BM ≈ (ctas/g)·BN), so the wave's operands stay in L2.
pub fn raster_group(tiles_m: usize, bn: usize, ctas: usize) -> usize {
    raster_group_of(tiles_m, BM, bn, ctas)
}

/// [`raster_group`] for `bm`-row tiles and `ctas` concurrent tiles.
fn raster_group_of(tiles_m: usize, bm: usize, bn: usize, ctas: usize) -> usize {
    let g = ((ctas * bn) as f64 / bm as f64).sqrt().round() as usize;
    g.clamp(1, tiles_m.max(1))
}

/// Picks the tile, split-K, epilogue, grid and raster group for C[m, n] = A[m, k]·B[n, k]ᵀ
/// on `sms` SMs.
///
/// The tile (rows, width, split-K, cluster kind) is the table's for the shape class, else
/// the rule's (`ops::gemm::table::choose`); overrides replace any part of it. A split needs
/// a split-K kernel (widths 64 and 128, the TMA epilogue, no multicast) and a K block per
/// CTA, else it falls back to 1; multicast needs 128-row tiles.
pub fn plan(m: usize, n: usize, k: usize, sms: usize, tma_epilogue_ok: bool, o: PlanOverrides) -> GemmPlan {
    let sms = sms.max(1);
    let ctas_cap = o.max_ctas.unwrap_or(sms).clamp(1, sms);
    let (choice, source) = gemm_table::choose(m, n, k, ctas_cap);
    let bm = o.bm.filter(|b| TILE_ROWS.contains(b)).unwrap_or(choice.bm);
    let bn = o.bn.filter(|b| TILE_WIDTHS.contains(b)).unwrap_or(choice.bn);
    let epilogue = if tma_epilogue_ok { Epilogue::Tma } else { Epilogue::Direct };
    let tiles_m = m.div_ceil(bm);
    let tiles_n = n.div_ceil(bn);
    let mut cluster = o.cluster.unwrap_or(choice.cluster);
    let even = match cluster {
        Cluster::None => true,
        Cluster::ShareA => tiles_n % 2 == 0,
        Cluster::ShareB => tiles_m % 2 == 0,
    };
    if !even || bm != BM || !cluster.compiled_for(bn, epilogue) || ctas_cap < 2 {
        cluster = Cluster::None;
    }
    let mut split_k =
        o.split_k.unwrap_or(choice.split_k).clamp(1, MAX_SPLIT_K).min(k.div_ceil(BK)).min(ctas_cap).max(1);
    if split_k > 1
        && (cluster != Cluster::None || gemm_tile_kernel(mkDataType_t::mkBfloat16, bm, bn, epilogue, true).is_err())
    {
        split_k = 1;
    }
    let grid = if split_k > 1 {
        (tiles_m * tiles_n).min(ctas_cap / split_k).max(1) * split_k
    } else {
        let cs = cluster.size();
        ((tiles_m * tiles_n).min(ctas_cap) / cs * cs).max(1)
    };
    let group_m = o.group_m.unwrap_or_else(|| raster_group_of(tiles_m, bm, bn, grid / split_k));
    let group_m = if cluster == Cluster::ShareB {
        group_m.div_ceil(2).clamp(1, tiles_m.div_ceil(2))
    } else {
        group_m.clamp(1, tiles_m.max(1))
    };
    GemmPlan {
        bm,
        bn,
        split_k,
        epilogue,
        stages: tile_stages(bm, bn, split_k > 1, epilogue),
        smem_bytes: tile_smem_bytes(bm, bn, split_k > 1, epilogue),
        tiles_m,
        tiles_n,
        group_m,
        grid,
        cluster,
        chosen: choice,
        source,
    }
}

/// Tile width of a fused op's GEMM on `ctas` compute CTAs: the plain engine's choice for
/// the shape on that many SMs, with 64 raised to 128 (the fused kernels are built for
/// widths 256 and 128). Planned without K: the fused kernels do not split K (their
/// epilogues flag every slab), and the table's widths for a class assume its split.
pub fn fused_tile_width(m: usize, n: usize, ctas: usize) -> usize {
    let tile = plan(m, n, 0, ctas, true, PlanOverrides { max_ctas: Some(ctas), ..Default::default() });
    if tile.bn >= 256 {
        256
    } else {
        128
    }
}

/// Rows of an A tensor-map box for `m` rows of A where a CTA loads `load_rows` per tile: no
/// taller than A (the engine's `GemmShape::a_box_rows` says why), and at least 1.
pub fn a_box_rows(load_rows: usize, m: usize) -> usize {
    load_rows.min(m.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smem_fits_and_mirrors_kernel_stages() {
        // Values the kernels were built and measured with (kernels/gemm.cu PlainStages).
        assert_eq!(stages(256, Epilogue::Tma), 3);
        assert_eq!(stages(128, Epilogue::Tma), 6);
        assert_eq!(stages(64, Epilogue::Tma), 8);
        assert_eq!(stages(256, Epilogue::Direct), 4);
        for bn in TILE_WIDTHS {
            for e in [Epilogue::Tma, Epilogue::Direct] {
                assert!(smem_bytes(bn, e) <= SMEM_LIMIT, "bn {bn} {e:?}");
                assert!(stages(bn, e) >= 3);
            }
        }
        // 64-row tiles: half the A stage, a deeper ring (kernels/gemm.cu PlainStages<64, ...>).
        assert_eq!(tile_stages(64, 256, false, Epilogue::Tma), 4);
        assert_eq!(tile_stages(64, 128, false, Epilogue::Tma), 8);
        // Split-K: the fp32 partial slabs take ring stages.
        assert_eq!(tile_stages(128, 128, true, Epilogue::Tma), 4);
        assert_eq!(tile_stages(128, 64, true, Epilogue::Tma), 7);
        assert_eq!(tile_stages(64, 128, true, Epilogue::Tma), 6);
        assert_eq!(tile_stages(64, 64, true, Epilogue::Tma), 8);
        for bm in TILE_ROWS {
            for bn in TILE_WIDTHS {
                for e in [Epilogue::Tma, Epilogue::Direct] {
                    for split in [false, true] {
                        if split && gemm_tile_kernel(mkDataType_t::mkBfloat16, bm, bn, e, true).is_err() {
                            continue;
                        }
                        assert!(tile_smem_bytes(bm, bn, split, e) <= SMEM_LIMIT, "bm {bm} bn {bn} {e:?} {split}");
                        assert!(tile_stages(bm, bn, split, e) >= 3, "bm {bm} bn {bn} {e:?} {split}");
                        assert!(gemm_tile_kernel(mkDataType_t::mkFloat16, bm, bn, e, split).is_ok() || split);
                    }
                }
            }
        }
        assert_eq!(
            tile_smem_bytes(64, 128, true, Epilogue::Tma),
            1024 + 6 * 192 * 128 + 2 * 64 * 128 * 2 + 64 * 128 * 4 + 2 * 6 * 8 + 64 + 32
        );
    }

    #[test]
    fn the_224_wide_tile_fills_whole_waves_at_28672_columns() {
        let wide = PlanOverrides { bn: Some(224), ..Default::default() };
        // 128 tiles across N: one wave of 128 CTAs up to 128 rows, two (132 + 124) at 256.
        for (m, bm, tiles, grid) in [(16, 64, 128, 128), (128, 128, 128, 128), (256, 128, 256, 132)] {
            let p = plan(m, 28672, 8192, 132, true, wide);
            assert_eq!((p.bm, p.bn, p.tiles_n, p.tiles(), p.grid), (bm, 224, 128, tiles, grid), "M {m}");
        }
        let p = plan(256, 28672, 8192, 132, true, wide);
        assert_eq!(p.kernel_name(mkDataType_t::mkBfloat16), "mk_gemm_bf16_bn224_tma");
        assert_eq!(p.kernel_name(mkDataType_t::mkFloat16), "mk_gemm_f16_bn224_tma");
        let direct = plan(16, 28672, 8192, 132, false, wide);
        assert_eq!(direct.kernel_name(mkDataType_t::mkBfloat16), "mk_gemm_bf16_bn224_direct_bm64");
        // Staging holds the three whole 64-column boxes per warpgroup (the last 32 columns
        // leave from registers), which leaves room for four stages of 128 + 224 rows.
        assert_eq!(p.stages, 4);
        assert_eq!(p.smem_bytes, 1024 + 4 * (128 + 224) * 128 + 2 * 64 * 192 * 2 + 2 * 4 * 8 + 64);
        // No split-K or multicast kernel at this width: the plan runs without either.
        let o = PlanOverrides { split_k: Some(2), cluster: Some(Cluster::ShareB), ..wide };
        let p = plan(256, 28672, 8192, 132, true, o);
        assert_eq!((p.bn, p.split_k, p.cluster), (224, 1, Cluster::None));
        assert!(p.kernel(mkDataType_t::mkBfloat16).is_ok());
    }

    #[test]
    fn large_shapes_use_the_wide_tile_and_every_sm() {
        let p = plan(8192, 8192, 8192, 132, true, PlanOverrides::default());
        assert_eq!((p.bn, p.epilogue, p.tiles_m, p.tiles_n, p.grid), (256, Epilogue::Tma, 64, 32, 132));
        assert_eq!(p.group_m, 16); // sqrt(132 * 256 / 128) = 16.2
        assert_eq!(p.kernel_name(mkDataType_t::mkBfloat16), "mk_gemm_bf16_bn256_tma");
        assert_eq!(p.kernel_name(mkDataType_t::mkFloat16), "mk_gemm_f16_bn256_tma");
    }

    #[test]
    fn the_a_box_stops_at_the_last_row_of_a() {
        // Fewer rows than a tile: the box has exactly A's rows, so the TMA fills none.
        let p = plan(1, 8192, 8192, 132, true, PlanOverrides::default());
        assert_eq!((p.box_rows().0, p.a_box_rows(1)), (64, 1));
        assert_eq!(p.a_box_rows(5), 5);
        assert_eq!(p.a_box_rows(64), 64);
        let p = plan(100, 4096, 4096, 132, true, PlanOverrides::default());
        assert_eq!((p.bm, p.a_box_rows(100)), (128, 100));
        // 64-row tiles over more rows: one m-block's rows per box.
        let p = plan(100, 8192, 8192, 132, true, PlanOverrides::default());
        assert_eq!((p.bm, p.a_box_rows(100)), (64, 64));
        // A tile's rows or more: the full box (the last m-block's overhang stays filled).
        let p = plan(4096, 4096, 4096, 132, true, PlanOverrides::default());
        assert_eq!(p.a_box_rows(4096), p.box_rows().0);
        assert_eq!(p.a_box_rows(129), p.box_rows().0);
        // A cluster sharing A loads half the tile's rows per CTA: at most that many.
        let o = PlanOverrides { bn: Some(128), cluster: Some(Cluster::ShareA), ..PlanOverrides::default() };
        let p = plan(4096, 4096, 4096, 132, true, o);
        assert_eq!(p.cluster, Cluster::ShareA);
        assert_eq!((p.a_box_rows(4096), p.a_box_rows(40)), (64, 40));
        // M = 0 never launches; the box stays a legal size.
        assert_eq!(p.a_box_rows(0), 1);
    }

    #[test]
    fn skinny_shapes_narrow_the_tile_to_fill_the_sms() {
        // M = 128: 32 tiles of 256 would idle 100 SMs; 64-wide tiles give 128.
        let p = plan(128, 8192, 4096, 132, true, PlanOverrides::default());
        assert_eq!((p.bm, p.bn, p.split_k, p.grid, p.group_m), (128, 64, 1, 128, 1));
        // M = 512: 128 tiles of 256 already fill the GPU.
        assert_eq!(plan(512, 8192, 4096, 132, true, PlanOverrides::default()).bn, 256);
        // Tiny problems: one tile, one CTA.
        let p = plan(1, 1, 8, 132, false, PlanOverrides::default());
        assert_eq!((p.bm, p.bn, p.grid, p.tiles(), p.epilogue), (64, 64, 1, 1, Epilogue::Direct));
        assert_eq!(p.kernel_name(mkDataType_t::mkBfloat16), "mk_gemm_bf16_bn64_direct_bm64");
    }

    #[test]
    fn small_m_takes_the_table_and_splits_k() {
        let bf16 = mkDataType_t::mkBfloat16;
        // Decode rows: 64-row tiles, 128 tiles of 64 columns.
        let p = plan(1, 8192, 8192, 132, true, PlanOverrides::default());
        assert_eq!((p.bm, p.bn, p.split_k, p.grid, p.source), (64, 64, 1, 128, gemm_table::Source::Table));
        assert_eq!(p.kernel_name(bf16), "mk_gemm_bf16_bn64_tma_bm64");
        assert_eq!(p.box_rows(), (64, 64));
        // M = 128, K = 8192: 128 tiles of 64 x 128, two m-blocks.
        let p = plan(128, 8192, 8192, 132, true, PlanOverrides::default());
        assert_eq!((p.bm, p.bn, p.split_k, p.tiles(), p.grid), (64, 128, 1, 128, 128));
        assert_eq!(p.kernel_name(bf16), "mk_gemm_bf16_bn128_tma_bm64");
        // M = 128, K = 28672: the same 128 tiles of 64 x 128.
        let p = plan(128, 8192, 28672, 132, true, PlanOverrides::default());
        assert_eq!((p.bm, p.bn, p.split_k, p.tiles(), p.grid), (64, 128, 1, 128, 128));
        // M = 100, N = 4096, K = 16384: 64 tiles of 128 x 64, each split over a cluster of 2 CTAs.
        let p = plan(100, 4096, 16384, 132, true, PlanOverrides::default());
        assert_eq!((p.bm, p.bn, p.split_k, p.tiles(), p.grid), (128, 64, 2, 64, 128));
        assert_eq!(p.kernel_name(mkDataType_t::mkFloat16), "mk_gemm_f16_bn64_tma_splitk");
        // Few tiles: the rule splits K over the idle SMs (clusters of 4 at most).
        let p = plan(16, 1024, 8192, 132, true, PlanOverrides::default());
        assert_eq!((p.bm, p.bn, p.split_k, p.grid), (64, 64, 4, 64));
        assert_eq!(p.kernel_name(bf16), "mk_gemm_bf16_bn64_tma_bm64_splitk");
        // No split where there is no split-K kernel (direct epilogue), or too short a K.
        let p = plan(16, 1024, 8192, 132, false, PlanOverrides::default());
        assert_eq!((p.split_k, p.grid), (1, 16));
        let p =
            plan(16, 1024, 8192, 132, true, PlanOverrides { split_k: Some(8), bn: Some(256), ..Default::default() });
        assert_eq!((p.split_k, p.bn), (1, 256));
        let p = plan(16, 1024, 128, 132, true, PlanOverrides { split_k: Some(8), ..Default::default() });
        assert_eq!(p.split_k, 2); // two K blocks
                                  // A split the CTA budget cannot hold is lowered to it; the grid is whole clusters.
        let p =
            plan(1, 64, 8192, 132, true, PlanOverrides { split_k: Some(8), max_ctas: Some(6), ..Default::default() });
        assert_eq!((p.split_k, p.grid), (6, 6));
        let p = plan(
            1,
            8192,
            8192,
            132,
            true,
            PlanOverrides { split_k: Some(3), max_ctas: Some(100), ..Default::default() },
        );
        assert_eq!((p.split_k, p.grid), (3, 99));
        // Multicast clusters need 128-row tiles and no split.
        let p = plan(1, 8192, 8192, 132, true, PlanOverrides { cluster: Some(Cluster::ShareA), ..Default::default() });
        assert_eq!((p.cluster, p.bm), (Cluster::None, 64));
        let p = plan(
            1,
            8192,
            8192,
            132,
            true,
            PlanOverrides { bm: Some(128), bn: Some(64), cluster: Some(Cluster::ShareA), ..Default::default() },
        );
        assert_eq!((p.cluster, p.bm, p.split_k), (Cluster::ShareA, 128, 1));
    }

    #[test]
    fn overrides_cap_ctas_and_fix_the_tile() {
        let o = PlanOverrides { bn: Some(128), group_m: Some(4), max_ctas: Some(100), ..Default::default() };
        let p = plan(4096, 4096, 4096, 132, true, o);
        assert_eq!((p.bn, p.group_m, p.grid), (128, 4, 100));
        // A CTA cap above the SM count is clamped to the SMs (one CTA per SM).
        let p = plan(4096, 4096, 4096, 132, true, PlanOverrides { max_ctas: Some(1000), ..Default::default() });
        assert_eq!(p.grid, 132);
        // group never exceeds the m-blocks
        assert_eq!(plan(256, 65536, 4096, 132, true, PlanOverrides::default()).group_m, 2);
    }

    #[test]
    fn clusters_pair_tiles_and_fall_back_where_they_cannot() {
        let with = |m, n, bn, c| {
            plan(m, n, 4096, 132, true, PlanOverrides { bn: Some(bn), cluster: Some(c), ..Default::default() })
        };
        // Large: pairs of m-blocks share B; the raster group counts pairs; even grid.
        let p = with(8192, 8192, 256, Cluster::ShareB);
        assert_eq!((p.cluster, p.group_m, p.grid), (Cluster::ShareB, 8, 132));
        assert_eq!(p.kernel_name(mkDataType_t::mkBfloat16), "mk_gemm_bf16_bn256_tma_c2b");
        // Skinny: pairs of n-blocks share A.
        let p = plan(
            128,
            8192,
            4096,
            132,
            true,
            PlanOverrides { bn: Some(64), cluster: Some(Cluster::ShareA), ..Default::default() },
        );
        assert_eq!((p.cluster, p.grid, p.group_m), (Cluster::ShareA, 128, 1));
        assert_eq!(p.kernel_name(mkDataType_t::mkFloat16), "mk_gemm_f16_bn64_tma_c2a");
        // Odd number of tiles along the shared direction, no such kernel, direct epilogue,
        // or a single CTA: no cluster.
        assert_eq!(with(384, 8192, 256, Cluster::ShareB).cluster, Cluster::None); // 3 m-blocks
        assert_eq!(with(8192, 8192, 256, Cluster::ShareA).cluster, Cluster::None); // no bn256 c2a kernel
        assert_eq!(
            plan(8192, 8190, 4096, 132, false, PlanOverrides { cluster: Some(Cluster::ShareB), ..Default::default() })
                .cluster,
            Cluster::None
        );
        let p = plan(
            256,
            256,
            4096,
            132,
            true,
            PlanOverrides { max_ctas: Some(1), cluster: Some(Cluster::ShareB), ..Default::default() },
        );
        assert_eq!((p.cluster, p.grid), (Cluster::None, 1));
        // An odd CTA budget rounds down to whole clusters.
        let p = plan(
            8192,
            8192,
            4096,
            132,
            true,
            PlanOverrides { max_ctas: Some(101), cluster: Some(Cluster::ShareB), ..Default::default() },
        );
        assert_eq!(p.grid, 100);
    }

    /// The launch carries the plan as the kernel reads it: grid, 384 threads, the plan's
    /// shared memory, clusters exactly for cluster plans, and half boxes of the shared operand.
    #[test]
    fn the_launch_is_the_plan() {
        let bf16 = mkDataType_t::mkBfloat16;
        let with = |m, n, c: Option<Cluster>, bn: Option<usize>| {
            plan(m, n, 4096, 132, true, PlanOverrides { bn, cluster: c, ..Default::default() })
        };
        for (p, clusters, boxes) in [
            (with(8192, 8192, None, None), Clusters::None, (128, 256)),
            (with(128, 8192, None, None), Clusters::None, (128, 64)),
            (with(8192, 8192, Some(Cluster::ShareB), Some(256)), Clusters::Of(2), (128, 128)),
            (with(128, 8192, Some(Cluster::ShareA), Some(64)), Clusters::Of(2), (64, 64)),
            (plan(1, 1, 8, 132, false, PlanOverrides::default()), Clusters::None, (64, 64)),
            (plan(100, 4096, 16384, 132, true, PlanOverrides::default()), Clusters::Of(2), (128, 64)),
            (plan(16, 1024, 8192, 132, true, PlanOverrides::default()), Clusters::Of(4), (64, 64)),
        ] {
            let l = p.kernel_launch(bf16).unwrap();
            assert_eq!(l.kernel, p.kernel(bf16).unwrap());
            assert_eq!(
                (l.grid, l.block, l.smem_bytes, l.clusters),
                (p.grid as u32, 384, p.smem_bytes as u32, clusters)
            );
            assert_eq!(p.box_rows(), boxes, "{p:?}");
        }
        assert!(with(8192, 8192, None, None).kernel_launch(mkDataType_t::mkFloat32).is_err());
    }

    /// Whatever the shape, SM count, CTA budget, epilogue and overrides, the plan is one the
    /// launch can honour: a kernel for both dtypes, clusters of at most 8 that divide the
    /// grid, no more CTAs than the budget or than the tiles' clusters, shared memory within
    /// the limit, a split only with the TMA epilogue and never past the K blocks, multicast
    /// only with 128-row tiles, and the A box as tall as the rows a CTA loads.
    #[test]
    fn every_plan_is_launchable() {
        let mut plans = 0;
        for sms in [132, 114, 16, 1] {
            for m in [1, 5, 63, 64, 65, 128, 129, 257, 1000] {
                for n in [8, 64, 264, 1024, 8192, 28672] {
                    for k in [0, 8, 136, 520, 8192] {
                        for tma in [true, false] {
                            for max_ctas in [None, Some(5), Some(7), Some(66)] {
                                for split_k in [None, Some(1), Some(3), Some(8), Some(16)] {
                                    for (bm, bn, cluster) in [
                                        (None, None, None),
                                        (Some(64), Some(256), None),
                                        (Some(128), Some(64), Some(Cluster::ShareA)),
                                        (None, Some(128), Some(Cluster::ShareB)),
                                        (Some(96), Some(96), None),
                                    ] {
                                        let o =
                                            PlanOverrides { bm, bn, split_k, max_ctas, cluster, ..Default::default() };
                                        let p = plan(m, n, k, sms, tma, o);
                                        let cap = max_ctas.unwrap_or(sms).min(sms);
                                        let what = format!("{m}x{n}x{k} on {sms} SMs, tma {tma}, {o:?}: {p:?}");
                                        for dtype in [mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16] {
                                            let l = p.kernel_launch(dtype).unwrap_or_else(|e| panic!("{what}: {e:?}"));
                                            let size = match l.clusters {
                                                Clusters::None => 1,
                                                Clusters::Of(s) => s as usize,
                                            };
                                            assert!(size <= MAX_SPLIT_K, "{what}");
                                            assert!(l.grid as usize % size == 0 && l.grid as usize >= size, "{what}");
                                        }
                                        assert!(p.grid <= cap, "{what}");
                                        assert!(p.grid / (p.split_k * p.cluster.size()) <= p.tiles().max(1), "{what}");
                                        assert!(p.smem_bytes <= SMEM_LIMIT && p.stages >= 3, "{what}");
                                        if p.split_k > 1 {
                                            assert!(p.split_k <= k.div_ceil(BK), "{what}");
                                            assert_eq!(
                                                (p.epilogue, p.cluster),
                                                (Epilogue::Tma, Cluster::None),
                                                "{what}"
                                            );
                                        }
                                        if p.cluster != Cluster::None {
                                            assert_eq!(p.bm, BM, "{what}");
                                        }
                                        let a_rows = if p.cluster == Cluster::ShareA { p.bm / 2 } else { p.bm };
                                        assert_eq!(p.box_rows().0, a_rows, "{what}");
                                        assert!(p.group_m >= 1, "{what}");
                                        plans += 1;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(plans, 4 * 9 * 6 * 5 * 2 * 4 * 5 * 5);
    }
}
