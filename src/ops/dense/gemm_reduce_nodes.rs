//! mkGemmReduceScatter and mkGemmAllReduce on a communicator that spans nodes: the plan
//! (pure, CPU-tested: row ownership, buffer layout, signal words) for the hierarchical
//! path of kernels/common/gemm_reduce.cuh.
//!
//! R ranks in N nodes of L; rank g = (node n, local rank l). Every rank computes its
//! partial product P = A·Bᵀ ([M, N], its K slice) into its own workspace, as on one node.
//! Global rank q owns rows [q·rows, (q+1)·rows) of the sum (`owner_rows`). Then, inside the
//! same kernel, while the GEMM runs:
//!
//! 1. node reduction (NVLink): local rank l sums the L partials of its node for the rows of
//!    every owner with local rank l — rank_of(m, l) for each node m — as their tiles are
//!    stored, into slab m of its outbox (m ≠ n) or of its inbox (m = n). Each 128-row block
//!    of an owner's rows (an "owner block") is counted as it fills; the team that completes
//!    a block of outbox slab m hands it to the proxy: one put to rank_of(m, l)'s inbox slab
//!    n, raising its flag NET_IN + n·MB + block there (GPU i ↔ GPU i, once per block);
//! 2. final reduction: for each of its own blocks, g waits for the N node partials (its own
//!    slab n and the N−1 that arrived) and sums them in node order 0..N−1 into C;
//! 3. AllReduce only: the sum also goes to g's R (the global [M, N] layout) and, one put per
//!    block, into the R of rank_of(m, l) on every other node (flag NET_REDUCED + n·MB +
//!    block there); then every rank copies each block it does not own from the R of the
//!    local rank that holds it (its owner, or the owner's GPU-i counterpart on this node).
//!
//! So each partial crosses NVLink once and the network once per node, in node partials,
//! as the hierarchical mkReduceScatter moves it; the fp32 sum is rounded once per node
//! partial and once at the end (stated in the header). Flow control across calls: a rank
//! puts into another node's inbox or R only after that rank said, at the start of its own
//! next call (once its local peers finished reading its R), that it is done with them
//! (NET_DONE + node, through the proxy); puts are drained before the kernel ends, so the
//! next call may overwrite the outbox.

use crate::error::{MkError, Result};
use crate::ops::collectives::hier::align_up;
use crate::ops::dense::gemm_reduce::Reduction;

/// Rows of an owner block, and of a GEMM tile.
pub const BLOCK_ROWS: usize = 128;

/// Rows each owner holds: ReduceScatter's M / R (the API's rows per rank); AllReduce's
/// whole 128-row blocks, ⌈tiles / R⌉ of them (the last owners may hold fewer rows, or
/// none, when M is small: then fewer ranks reduce, and the result is still complete).
pub fn owner_rows(reduction: Reduction, m: usize, nranks: usize) -> usize {
    match reduction {
        Reduction::Scatter => m / nranks,
        Reduction::All => m.div_ceil(BLOCK_ROWS).div_ceil(nranks) * BLOCK_ROWS,
    }
}

/// Rows [lo, hi) of the sum owned by global rank q.
pub fn owner_range(rows: usize, m: usize, q: usize) -> (usize, usize) {
    ((q * rows).min(m), ((q + 1) * rows).min(m))
}

/// Where things are, as GemmReduceParams (src/kernel_abi.rs) holds them. Byte offsets
/// are from the start of every rank's data region (the proxy's window); word indexes are
/// absolute in the signal region. The layout is the same on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeReducePlan {
    pub owner_rows: usize,
    /// MB: owner blocks per owner, ⌈owner_rows / 128⌉.
    pub owner_blocks: usize,
    /// P: [M, N], this rank's partial product.
    pub partial_offset: u64,
    /// Outbox and inbox: N slabs of [owner_rows, N] each (slab m at + m · slab_bytes).
    pub outbox_offset: u64,
    pub inbox_offset: u64,
    pub slab_bytes: u64,
    /// AllReduce: R, [M, N]; 0 for ReduceScatter.
    pub reduced_offset: u64,
    /// Bytes from `partial_offset` to the end of the last buffer.
    pub op_bytes: u64,
    /// NET_IN + m·MB + b: node m's partial of this rank's block b is in inbox slab m.
    pub net_in_word: u32,
    /// NET_REDUCED + m·MB + b: the sum of block b of rank_of(m, l) is in this rank's R.
    pub net_reduced_word: u32,
    /// Counters of elements reduced per (slab m, block b), and (AllReduce) per own block
    /// (in [COUNT_WORD, COUNT_END_WORD)).
    pub count_node_word: u32,
    pub count_final_word: u32,
    /// One past the last word used.
    pub end_word: u32,
}

/// Signal words of the element counters: a fixed range of their own (GR_COUNT .. GR_TILE of
/// src/kernel_abi.rs, which the kernels use too). A counter must read 0 when a call starts, and the words after the
/// tile flags move with the shape: a counter placed there would start from a flag another
/// shape's call left in it (an epoch), never reach its total, and hang the call (seen on the
/// GPU: the first call after a larger shape). Completed counters are reset to 0.
pub const COUNT_WORD: u32 = crate::kernel_abi::GR_COUNT;
pub const COUNT_END_WORD: u32 = crate::kernel_abi::GR_TILE;

/// Plans one call. The epoch-valued flags go after the op's two per-tile slab flags (which
/// take `2 · tiles` words from `tile_word`) and before `end_word`; the counters in
/// [COUNT_WORD, COUNT_END_WORD).
#[allow(clippy::too_many_arguments)]
pub fn plan(
    reduction: Reduction,
    m: usize,
    n: usize,
    elem: usize,
    nodes: usize,
    nranks: usize,
    partial_offset: u64,
    tile_word: u32,
    tiles: usize,
    end_word: u32,
) -> Result<NodeReducePlan> {
    let what = match reduction {
        Reduction::Scatter => "mkGemmReduceScatter",
        Reduction::All => "mkGemmAllReduce",
    };
    let rows = owner_rows(reduction, m, nranks);
    let blocks = rows.div_ceil(BLOCK_ROWS).max(1);
    let row_bytes = (n * elem) as u64;
    if BLOCK_ROWS as u64 * row_bytes > u32::MAX as u64 {
        return Err(MkError::invalid_usage(format!(
            "{what} across nodes: N = {n} makes a block of {BLOCK_ROWS} rows {} bytes, more than one proxy put moves (4 GiB)",
            BLOCK_ROWS as u64 * row_bytes
        )));
    }
    let p_bytes = align_up(m as u64 * row_bytes, 256);
    let slab_bytes = align_up(rows as u64 * row_bytes, 256);
    let outbox_offset = partial_offset + p_bytes;
    let inbox_offset = outbox_offset + nodes as u64 * slab_bytes;
    let after_inbox = inbox_offset + nodes as u64 * slab_bytes;
    let (reduced_offset, end) = match reduction {
        Reduction::Scatter => (0, after_inbox),
        Reduction::All => (after_inbox, after_inbox + p_bytes),
    };
    let flags = (nodes * blocks) as u64;
    let net_in_word = tile_word as u64 + 2 * tiles as u64;
    let net_reduced_word = net_in_word + flags;
    let last = net_reduced_word + flags;
    if last > end_word as u64 {
        return Err(MkError::invalid_usage(format!(
            "{what} across nodes: M = {m}, N = {n} need {} signal words (2 per 128x128 tile, 2 per node and owner block) but the op has {}; split the GEMM",
            last - tile_word as u64,
            end_word - tile_word
        )));
    }
    let count_node_word = COUNT_WORD as u64;
    let count_final_word = count_node_word + flags;
    if count_final_word + blocks as u64 > COUNT_END_WORD as u64 {
        return Err(MkError::invalid_usage(format!(
            "{what} across nodes: M = {m} gives each of the {nranks} ranks {blocks} blocks of 128 rows, and ({nodes} nodes + 1) x {blocks} counters exceed the op's {}; split the GEMM",
            COUNT_END_WORD - COUNT_WORD
        )));
    }
    Ok(NodeReducePlan {
        owner_rows: rows,
        owner_blocks: blocks,
        partial_offset,
        outbox_offset,
        inbox_offset,
        slab_bytes,
        reduced_offset,
        op_bytes: end - partial_offset,
        net_in_word: net_in_word as u32,
        net_reduced_word: net_reduced_word as u32,
        count_node_word: count_node_word as u32,
        count_final_word: count_final_word as u32,
        end_word: last as u32,
    })
}

/// One inter-node put of the plan (what the kernel posts), for tests and mkbench's
/// byte counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodePut {
    pub from: usize,
    pub to: usize,
    pub src_offset: u64,
    pub dst_offset: u64,
    pub bytes: u64,
    pub signal_word: u32,
}

/// The puts global rank (node n, local l) posts in one call: phase 1 (node partials of the
/// owners rank_of(m, l), m ≠ n) and, for AllReduce, phase 3 (its own sums to rank_of(m, l)).
pub fn puts_of(
    plan: &NodeReducePlan,
    reduction: Reduction,
    m_rows: usize,
    n_cols: usize,
    elem: usize,
    rank_of: &dyn Fn(usize, usize) -> usize,
    nodes: usize,
    node: usize,
    local: usize,
) -> Vec<NodePut> {
    let row_bytes = (n_cols * elem) as u64;
    let me = rank_of(node, local);
    let mut puts = Vec::new();
    for m in (0..nodes).filter(|&m| m != node) {
        let q = rank_of(m, local);
        let (lo, hi) = owner_range(plan.owner_rows, m_rows, q);
        for b in 0..plan.owner_blocks {
            let (b0, b1) = (lo + b * BLOCK_ROWS, (lo + (b + 1) * BLOCK_ROWS).min(hi));
            if b0 >= b1 {
                continue;
            }
            let within = (b * BLOCK_ROWS) as u64 * row_bytes;
            puts.push(NodePut {
                from: me,
                to: q,
                src_offset: plan.outbox_offset + m as u64 * plan.slab_bytes + within,
                dst_offset: plan.inbox_offset + node as u64 * plan.slab_bytes + within,
                bytes: (b1 - b0) as u64 * row_bytes,
                signal_word: plan.net_in_word + (node * plan.owner_blocks + b) as u32,
            });
        }
    }
    if reduction == Reduction::All {
        let (lo, hi) = owner_range(plan.owner_rows, m_rows, me);
        for m in (0..nodes).filter(|&m| m != node) {
            for b in 0..plan.owner_blocks {
                let (b0, b1) = (lo + b * BLOCK_ROWS, (lo + (b + 1) * BLOCK_ROWS).min(hi));
                if b0 >= b1 {
                    continue;
                }
                let at = plan.reduced_offset + b0 as u64 * row_bytes;
                puts.push(NodePut {
                    from: me,
                    to: rank_of(m, local),
                    src_offset: at,
                    dst_offset: at,
                    bytes: (b1 - b0) as u64 * row_bytes,
                    signal_word: plan.net_reduced_word + (node * plan.owner_blocks + b) as u32,
                });
            }
        }
    }
    puts
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::ops::dense::gemm_reduce::{GR_END_WORD as END_WORD, GR_TILE_WORD as TILE_WORD};

    fn tiles(m: usize, n: usize) -> usize {
        m.div_ceil(128) * n.div_ceil(128)
    }

    /// Rank tables: nodes of `local` ranks, by rank (contiguous) or interleaved by host.
    fn rank_of(nodes: usize, local: usize, interleaved: bool) -> impl Fn(usize, usize) -> usize {
        move |m, l| if interleaved { l * nodes + m } else { m * local + l }
    }

    #[test]
    fn owners_cover_every_row_once() {
        for reduction in [Reduction::Scatter, Reduction::All] {
            for (m, r) in [(4096, 4), (12, 4), (1, 4), (333 * 8, 8), (2, 2), (129, 2), (16384, 16)] {
                if reduction == Reduction::Scatter && m % r != 0 {
                    continue;
                }
                let rows = owner_rows(reduction, m, r);
                let mut seen = vec![0u8; m];
                for q in 0..r {
                    let (lo, hi) = owner_range(rows, m, q);
                    assert!(lo <= hi && hi <= m);
                    seen[lo..hi].iter_mut().for_each(|s| *s += 1);
                }
                assert!(seen.iter().all(|&s| s == 1), "{reduction:?} M={m} R={r}");
                if reduction == Reduction::All {
                    assert_eq!(rows % 128, 0, "AllReduce owners hold whole blocks");
                }
            }
        }
        assert_eq!(owner_rows(Reduction::Scatter, 4096, 4), 1024);
        assert_eq!(owner_rows(Reduction::All, 16, 4), 128, "small M: rank 0 owns it all");
        assert_eq!(owner_range(128, 16, 1), (16, 16));
    }

    #[test]
    fn buffers_do_not_overlap_and_words_stay_in_range() {
        for reduction in [Reduction::Scatter, Reduction::All] {
            let (m, n, nodes, r) = (4096, 8192, 2, 4);
            let p = plan(reduction, m, n, 2, nodes, r, 1 << 20, TILE_WORD, tiles(m, n), END_WORD).unwrap();
            let p_end = p.partial_offset + (m * n * 2) as u64;
            assert!(p.outbox_offset >= p_end);
            assert!(p.inbox_offset >= p.outbox_offset + nodes as u64 * (p.owner_rows * n * 2) as u64);
            if reduction == Reduction::All {
                assert!(p.reduced_offset >= p.inbox_offset + nodes as u64 * p.slab_bytes);
                assert_eq!(p.op_bytes, p.reduced_offset + (m * n * 2) as u64 - p.partial_offset);
            }
            assert_eq!(p.net_in_word, TILE_WORD + 2 * tiles(m, n) as u32);
            let flags = (nodes * p.owner_blocks) as u32;
            assert_eq!(p.net_reduced_word, p.net_in_word + flags);
            assert_eq!(p.end_word, p.net_reduced_word + flags);
            assert!(p.end_word <= END_WORD);
            // The counters keep their own fixed range, clear of every shape's flags.
            assert_eq!(p.count_node_word, COUNT_WORD);
            assert_eq!(p.count_final_word, p.count_node_word + flags);
            assert!(p.count_final_word + p.owner_blocks as u32 <= COUNT_END_WORD);
            const _: () = assert!(COUNT_END_WORD <= TILE_WORD);
        }
    }

    /// The counters end where the tile flags begin, and both lie in the op's own range.
    #[test]
    fn the_counter_range_ends_at_the_tile_flags() {
        use crate::kernel_abi::{GR_NET_DONE, MK_MAX_NODES};
        assert_eq!(COUNT_END_WORD, TILE_WORD);
        assert!(COUNT_WORD >= GR_NET_DONE + MK_MAX_NODES as u32, "the counters start after the per-node flags");
    }

    #[test]
    fn oversized_calls_are_refused_with_the_rule() {
        let err = plan(Reduction::Scatter, 1 << 17, 1 << 14, 2, 2, 4, 0, TILE_WORD, tiles(1 << 17, 1 << 14), END_WORD)
            .unwrap_err();
        assert!(err.message.contains("split the GEMM"), "{}", err.message);
        let err = plan(Reduction::All, 128, 1 << 24, 2, 2, 4, 0, TILE_WORD, 1, END_WORD).unwrap_err();
        assert!(err.message.contains("4 GiB"), "{}", err.message);
        // 8 nodes of 2, M = 2^18: 128 blocks per owner, 9 x 128 counters.
        let err =
            plan(Reduction::Scatter, 1 << 18, 128, 2, 8, 16, 0, TILE_WORD, tiles(1 << 18, 128), END_WORD).unwrap_err();
        assert!(err.message.contains("counters"), "{}", err.message);
    }

    /// Every inbox slab (m, block) of every rank is written by exactly one put, from node m's
    /// rank with the same local rank, from the matching outbox slab; AllReduce sums reach
    /// every other node's same local rank at the same offsets.
    #[test]
    fn puts_pair_up_across_nodes() {
        for interleaved in [false, true] {
            for (nodes, local) in [(2, 2), (2, 1), (4, 2), (3, 2), (8, 8)] {
                let r = nodes * local;
                for reduction in [Reduction::Scatter, Reduction::All] {
                    for m in [r * 128 * 3, r * 97, r] {
                        let n = 264;
                        let p = plan(reduction, m, n, 2, nodes, r, 4096, TILE_WORD, tiles(m, n), END_WORD).unwrap();
                        let ro = rank_of(nodes, local, interleaved);
                        let mut all = Vec::new();
                        for node in 0..nodes {
                            for l in 0..local {
                                all.extend(puts_of(&p, reduction, m, n, 2, &ro, nodes, node, l));
                            }
                        }
                        let node_of = |g: usize| (0..nodes).find(|&x| (0..local).any(|y| ro(x, y) == g)).unwrap();
                        let local_of = |g: usize| (0..local).find(|&y| (0..nodes).any(|x| ro(x, y) == g)).unwrap();
                        let mut words = std::collections::HashSet::new();
                        for put in &all {
                            assert_ne!(node_of(put.from), node_of(put.to), "puts cross nodes");
                            assert_eq!(local_of(put.from), local_of(put.to), "GPU i to GPU i");
                            assert!(put.bytes > 0 && put.bytes <= (128 * n * 2) as u64);
                            assert!(words.insert((put.to, put.signal_word)), "one put per flag: {put:?}");
                            assert!(put.signal_word < p.end_word);
                        }
                        // The rows each rank receives in its inbox: every owned row, once per other node.
                        for g in 0..r {
                            let (lo, hi) = owner_range(p.owner_rows, m, g);
                            let received: u64 = all
                                .iter()
                                .filter(|x| x.to == g && x.signal_word < p.net_reduced_word)
                                .map(|x| x.bytes)
                                .sum();
                            assert_eq!(
                                received,
                                ((hi - lo) * n * 2 * (nodes - 1)) as u64,
                                "rank {g} {reduction:?} M={m}"
                            );
                            if reduction == Reduction::All {
                                let sums: u64 = all
                                    .iter()
                                    .filter(|x| x.to == g && x.signal_word >= p.net_reduced_word)
                                    .map(|x| x.bytes)
                                    .sum();
                                // The sums of the owners with its local rank on the other nodes.
                                let expect: usize = (0..nodes)
                                    .filter(|&x| x != node_of(g))
                                    .map(|x| {
                                        let (a, b) = owner_range(p.owner_rows, m, ro(x, local_of(g)));
                                        (b - a) * n * 2
                                    })
                                    .sum();
                                assert_eq!(sums, expect as u64);
                            }
                        }
                    }
                }
            }
        }
    }

    /// The data flow, simulated on the CPU with the plan's offsets (byte buffers as the data
    /// regions, rows as the kernel forms them): node partials, the puts, the final sums in
    /// node order and the AllReduce gather give Σ over ranks on every rank.
    #[test]
    #[allow(clippy::needless_range_loop)] // indices follow the formulas being checked
    fn the_plan_computes_the_sum() {
        for (nodes, local, interleaved) in [(2, 2, false), (2, 2, true), (3, 1, false), (2, 3, true)] {
            let r = nodes * local;
            for reduction in [Reduction::Scatter, Reduction::All] {
                for m in [r * 128 * 2, r * 3, 5 * r] {
                    let n = 16;
                    let p = plan(reduction, m, n, 4, nodes, r, 64, TILE_WORD, tiles(m, n), END_WORD).unwrap();
                    let ro = rank_of(nodes, local, interleaved);
                    let size = (p.partial_offset + p.op_bytes) as usize;
                    // Region per global rank, f32 "elements" (4 bytes) to keep sums exact.
                    let mut mem = vec![vec![0f32; size / 4]; r];
                    let value = |g: usize, i: usize, j: usize| ((g * 7 + i * 3 + j) % 11) as f32;
                    let at = |off: u64, row: usize, col: usize| off as usize / 4 + row * n + col;
                    for (g, region) in mem.iter_mut().enumerate() {
                        for i in 0..m {
                            for j in 0..n {
                                region[at(p.partial_offset, i, j)] = value(g, i, j);
                            }
                        }
                    }
                    // 1. node reduction into outbox / inbox slabs.
                    for node in 0..nodes {
                        for l in 0..local {
                            let me = ro(node, l);
                            for mm in 0..nodes {
                                let (lo, hi) = owner_range(p.owner_rows, m, ro(mm, l));
                                let base = if mm == node { p.inbox_offset } else { p.outbox_offset }
                                    + mm as u64 * p.slab_bytes;
                                for i in lo..hi {
                                    for j in 0..n {
                                        let s: f32 =
                                            (0..local).map(|x| mem[ro(node, x)][at(p.partial_offset, i, j)]).sum();
                                        mem[me][at(base, i - lo, j)] = s;
                                    }
                                }
                            }
                        }
                    }
                    let mut all_puts = Vec::new();
                    for node in 0..nodes {
                        for l in 0..local {
                            all_puts.extend(puts_of(&p, reduction, m, n, 4, &ro, nodes, node, l));
                        }
                    }
                    let apply = |mem: &mut Vec<Vec<f32>>, put: &NodePut| {
                        let (s, d, len) =
                            (put.src_offset as usize / 4, put.dst_offset as usize / 4, put.bytes as usize / 4);
                        let data = mem[put.from][s..s + len].to_vec();
                        mem[put.to][d..d + len].copy_from_slice(&data);
                    };
                    for put in all_puts.iter().filter(|x| x.signal_word < p.net_reduced_word) {
                        apply(&mut mem, put);
                    }
                    // 2. final sums in node order.
                    let mut out = vec![vec![0f32; m * n]; r];
                    for g in 0..r {
                        let (lo, hi) = owner_range(p.owner_rows, m, g);
                        for i in lo..hi {
                            for j in 0..n {
                                let s: f32 = (0..nodes)
                                    .map(|x| mem[g][at(p.inbox_offset + x as u64 * p.slab_bytes, i - lo, j)])
                                    .sum();
                                out[g][i * n + j] = s;
                                if reduction == Reduction::All {
                                    mem[g][at(p.reduced_offset, i, j)] = s;
                                }
                            }
                        }
                    }
                    if reduction == Reduction::All {
                        for put in all_puts.iter().filter(|x| x.signal_word >= p.net_reduced_word) {
                            apply(&mut mem, put);
                        }
                        // 3. copy every other block from the local rank holding it.
                        for node in 0..nodes {
                            for l in 0..local {
                                let me = ro(node, l);
                                for mm in 0..nodes {
                                    for x in 0..local {
                                        let (lo, hi) = owner_range(p.owner_rows, m, ro(mm, x));
                                        if ro(mm, x) == me {
                                            continue;
                                        }
                                        for i in lo..hi {
                                            for j in 0..n {
                                                out[me][i * n + j] = mem[ro(node, x)][at(p.reduced_offset, i, j)];
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                    for g in 0..r {
                        let (lo, hi) =
                            if reduction == Reduction::Scatter { owner_range(p.owner_rows, m, g) } else { (0, m) };
                        for i in lo..hi {
                            for j in 0..n {
                                let want: f32 = (0..r).map(|x| value(x, i, j)).sum();
                                assert_eq!(
                                    out[g][i * n + j],
                                    want,
                                    "{reduction:?} nodes {nodes}x{local} M={m} rank {g} ({i},{j})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
