//! The GEMM engine's ring depth and dynamic shared memory per tile: what the planner
//! launches each kernel with. The kernels check the same numbers at compile time:
//! kernels/gemm_planned_tiles.inc lists [`tile_stages`] and [`tile_smem_bytes`] for every
//! [`TILE_ROWS`] × [`TILE_WIDTHS`] × split-K or not × [`Epilogue`] (the compiled tiles among
//! them), which kernels/gemm.cu makes its `PlannedTile` and every plain-GEMM kernel checks
//! against its own `PlainStages` and `engine_smem_bytes`, and [`fused_stages`] and
//! [`fused_smem_bytes`] for every tile rows × width, which kernels/common/fused_op.cuh makes
//! its `PlannedFused` and every fused kernel checks its `FusedStages` ring and
//! `engine_smem_bytes` against (`mk_check_engine_smem`). The kernel's formula lays out its
//! shared memory and this one sizes the launch. The list is generated from this file and
//! committed; this file's test fails when the two differ (`MK_UPDATE_PLANNED_TILES=1 cargo
//! test --release --lib planned_tiles` writes it again), so a change to one formula fails
//! the kernels' build or that test until the other agrees (docs/decisions/0062).

/// Rows of A (and C) per tile: two consumer warpgroups of 64 rows. The plain GEMM also has
/// 64-row tiles (`GemmPlan::bm`), used at small M.
pub const BM: usize = 128;
/// Tile rows the plain-GEMM kernels are compiled for.
pub const TILE_ROWS: [usize; 2] = [128, 64];
/// Bytes of an operand element in the engine's ring and epilogue staging. The engine is
/// laid out for 16-bit operands (its swizzle rows, its wgmma shapes); an engine for 8-bit
/// operands is a new layout here and in kernels/common/gemm, not another element size.
pub const OPERAND_BYTES: usize = 2;
/// K per pipeline stage: 64 two-byte elements = one 128-byte swizzle row.
pub const BK: usize = 128 / OPERAND_BYTES;
/// Largest dynamic shared memory a Hopper CTA can have (227 KiB).
pub const SMEM_LIMIT: usize = 232_448;
/// Tile widths the entry kernels are compiled for. 224 is not a power of two for the waves:
/// 28672 (a large model's FFN width) is 128 tiles of 224, one per SM of 132 at up to 128
/// rows and two waves at 256, where 256 makes 112 and 128 makes 224; its last 32 columns
/// leave from registers (no 64-column box fits them).
pub const TILE_WIDTHS: [usize; 4] = [256, 224, 128, 64];

/// How C tiles leave the CTA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// Swizzled shared-memory staging + TMA bulk stores (needs N % 8 == 0, 16-byte aligned C).
    Tma,
    /// Bounds-checked stores from registers (any N, any 2-byte aligned C).
    Direct,
}

/// Pipeline depth of the plain-GEMM kernels with 128-row tiles and no split:
/// [`tile_stages`] of that tile.
pub fn stages(bn: usize, epilogue: Epilogue) -> usize {
    tile_stages(BM, bn, false, epilogue)
}

/// Pipeline depth of a plain-GEMM kernel: the deepest ring that fits next to the
/// epilogue's staging buffers and, for split-K, the fp32 partial slabs (one of 64 × bn per
/// 64 rows of the tile), at most 8. `PlainStages` in kernels/gemm.cu, checked there.
pub fn tile_stages(bm: usize, bn: usize, split_k: bool, epilogue: Epilogue) -> usize {
    ring_stages(bm, bn, epilogue_staging_per_wg(bn, epilogue) + split_k_partials_bytes(bm, bn, split_k) / 2)
}

/// The split-K partial slabs of a CTA (kernels/common/gemm/engine.cuh PART_SLABS × PART_BYTES).
fn split_k_partials_bytes(bm: usize, bn: usize, split_k: bool) -> usize {
    if split_k {
        bm / 64 * 64 * bn * 4
    } else {
        0
    }
}

/// Split-K's four mbarriers after the mailboxes (kSplitKBarrierBytes).
const SPLIT_K_BARRIER_BYTES: usize = 32;

/// Shared memory of one consumer warpgroup's epilogue staging: TmaEpilogue 64 rows of the
/// columns its 64-wide boxes store (all of a tile whose width is a multiple of 64, the
/// whole boxes of one that is not: `kBoxedCols`), two bytes each; DirectStoreEpilogue none.
fn epilogue_staging_per_wg(bn: usize, epilogue: Epilogue) -> usize {
    if epilogue == Epilogue::Tma {
        64 * (bn / 64 * 64) * OPERAND_BYTES
    } else {
        0
    }
}

/// The deepest ring of `bm`- and `bn`-row stages (at most 8) that fits in the shared-memory
/// limit beside two warpgroups' epilogue staging; the formula of `PlainStages` and
/// `FusedStages<BN, BM>` in the kernels.
fn ring_stages(bm: usize, bn: usize, staging_per_wg: usize) -> usize {
    ((SMEM_LIMIT - 1024 - 2 * staging_per_wg - 256) / ((bm + bn) * BK * OPERAND_BYTES)).min(8)
}

/// Dynamic shared memory the engine needs for a tile shape, ring depth and epilogue
/// staging per consumer warpgroup: `engine_smem_bytes` in kernels/common/gemm/engine.cuh
/// (kernels/gemm.cu checks it through [`tile_smem_bytes`]); fused kernels that carve
/// their own shared memory after the engine's add theirs to it.
pub fn engine_smem_bytes(bm: usize, bn: usize, stages: usize, staging_per_wg: usize) -> usize {
    1024 + stages * (bm + bn) * BK * OPERAND_BYTES + 2 * staging_per_wg + 2 * stages * 8 + MAILBOX_BYTES
}

/// Ring depth of a fused engine with the TMA epilogue and `bm`-row tiles (128, or 64 for
/// the small-M GEMM + reduce kernels): `FusedStages<BN, BM>` in
/// kernels/common/fused_op.cuh, checked there (`stages(bn, Epilogue::Tma)` at bm 128).
pub fn fused_stages(bm: usize, bn: usize) -> usize {
    ring_stages(bm, bn, epilogue_staging_per_wg(bn, Epilogue::Tma))
}

/// Dynamic shared memory of a fused engine with the TMA epilogue and `bm`-row tiles
/// (`smem_bytes(bn, Epilogue::Tma)` at bm 128); kernels/common/fused_op.cuh checks it.
pub fn fused_smem_bytes(bm: usize, bn: usize) -> usize {
    engine_smem_bytes(bm, bn, fused_stages(bm, bn), epilogue_staging_per_wg(bn, Epilogue::Tma))
}

/// The epilogue courier's mailbox after the stage barriers (kMailboxBytes in
/// kernels/common/gemm/epilogue.cuh): two slots of two mbarriers and a slab's coordinates.
pub const MAILBOX_BYTES: usize = 64;

/// Dynamic shared memory of a plain-GEMM kernel with 128-row tiles and no split.
pub fn smem_bytes(bn: usize, epilogue: Epilogue) -> usize {
    tile_smem_bytes(BM, bn, false, epilogue)
}

/// Dynamic shared memory of a plain-GEMM kernel (the kernel traps if it gets less).
pub fn tile_smem_bytes(bm: usize, bn: usize, split_k: bool, epilogue: Epilogue) -> usize {
    engine_smem_bytes(bm, bn, tile_stages(bm, bn, split_k, epilogue), epilogue_staging_per_wg(bn, epilogue))
        + split_k_partials_bytes(bm, bn, split_k)
        + if split_k { SPLIT_K_BARRIER_BYTES } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kernels/gemm_planned_tiles.inc from the formulas above: two lists, each read only
    /// where its macro is defined, `MK_PLANNED_TILE(BM, BN, TMA_EPI, SPLIT_K, stages,
    /// bytes)` and `MK_PLANNED_FUSED(BM, BN, stages, bytes)`. One file for both: the same
    /// arithmetic, one place that writes it.
    fn planned_tiles() -> String {
        let mut text = String::from(
            "// Generated from src/ops/gemm/smem.rs by its test `committed_planned_tiles_are_fresh`\n\
             // (MK_UPDATE_PLANNED_TILES=1 cargo test --release --lib planned_tiles). Do not edit.\n\
             #ifdef MK_PLANNED_TILE\n",
        );
        for bm in TILE_ROWS {
            for bn in TILE_WIDTHS {
                for split_k in [false, true] {
                    for epilogue in [Epilogue::Tma, Epilogue::Direct] {
                        let (stages, bytes) =
                            (tile_stages(bm, bn, split_k, epilogue), tile_smem_bytes(bm, bn, split_k, epilogue));
                        let tma = epilogue == Epilogue::Tma;
                        text.push_str(&format!("MK_PLANNED_TILE({bm}, {bn}, {tma}, {split_k}, {stages}, {bytes})\n"));
                    }
                }
            }
        }
        text.push_str("#endif\n#ifdef MK_PLANNED_FUSED\n");
        for bm in TILE_ROWS {
            for bn in TILE_WIDTHS {
                let (stages, bytes) = (fused_stages(bm, bn), fused_smem_bytes(bm, bn));
                text.push_str(&format!("MK_PLANNED_FUSED({bm}, {bn}, {stages}, {bytes})\n"));
            }
        }
        text.push_str("#endif\n");
        text
    }

    #[test]
    fn committed_planned_tiles_are_fresh() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/gemm_planned_tiles.inc");
        let generated = planned_tiles();
        if std::env::var("MK_UPDATE_PLANNED_TILES").is_ok_and(|v| v == "1") {
            std::fs::write(&path, &generated).expect("writing kernels/gemm_planned_tiles.inc");
        }
        let committed = std::fs::read_to_string(&path).expect("kernels/gemm_planned_tiles.inc");
        assert!(
            committed == generated,
            "kernels/gemm_planned_tiles.inc differs from src/ops/gemm/smem.rs: write it again with \
             `MK_UPDATE_PLANNED_TILES=1 cargo test --release --lib planned_tiles` and commit it"
        );
    }
}
