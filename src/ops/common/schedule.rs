//! Host mirrors of the device tile schedules (kernels/common/gemm/scheduler.cuh and the
//! reducers' walks in kernels/common/gemm_reduce.cuh), in one place: the planners use them,
//! and the CPU ports of the protocols and their tests check what the kernels will do.
//! `tests/schedule_vectors.rs` compiles scheduler.cuh as host C++ and checks the first three
//! against it tile by tile.

/// A tile (m-block, n-block).
pub type Tile = (usize, usize);

/// The engine's grouped raster (kernels/common/gemm/scheduler.cuh grouped_tile): tile `t`.
pub fn grouped_tile(tiles_m: usize, tiles_n: usize, group_m: usize, t: usize) -> Tile {
    let per_group = group_m * tiles_n;
    let (group, in_group) = (t / per_group, t % per_group);
    let first_m = group * group_m;
    let rows = (tiles_m - first_m).min(group_m);
    (first_m + in_group % rows, in_group / rows)
}

/// The inverse of `grouped_tile` (scheduler.cuh grouped_index): the linear index of a tile.
pub fn grouped_index(tiles_m: usize, tiles_n: usize, group_m: usize, (m, n): Tile) -> usize {
    let group = m / group_m;
    let first_m = group * group_m;
    let rows = (tiles_m - first_m).min(group_m);
    group * group_m * tiles_n + n * rows + (m - first_m)
}

/// The compute order of the GEMM + reduction (scheduler.cuh interleaved_tile): the grouped
/// raster over `owners` interleaved equal shards of the row blocks.
pub fn interleaved_tile(tiles_m: usize, tiles_n: usize, group_m: usize, owners: usize, t: usize) -> Tile {
    let (m, n) = grouped_tile(tiles_m, tiles_n, group_m, t);
    if owners > 1 {
        let per_owner = tiles_m / owners;
        ((m % owners) * per_owner + m / owners, n)
    } else {
        (m, n)
    }
}

/// Tile `i` of row blocks [first, first + blocks) in the order the GEMM computes them: what
/// the kernel's reducer teams walk, team j taking i = j, j + stride, ...
/// (kernels/common/gemm_reduce.cuh owned_tile).
pub fn owned_tile(tiles_n: usize, group_m: usize, owners: usize, first: usize, blocks: usize, i: usize) -> Tile {
    let (m, n) = grouped_tile(blocks, tiles_n, (group_m / owners.max(1)).max(1), i);
    (first + m, n)
}
