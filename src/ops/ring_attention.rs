//! Ring attention (context parallel, forward): argument rules and the ring's plan, pure
//! and CPU-tested. The kernel (issue 9) is not built yet; this fixes the layout and the
//! per-step work so the kernel and its tests share one definition.
//!
//! Layout. The global sequence of length S = n · S_local is cut into blocks:
//! - non-causal: n contiguous shards, rank r holds tokens [r·S_local, (r+1)·S_local);
//! - causal (zigzag, for load balance): 2n chunks of S_local / 2 tokens, rank r holds chunk
//!   r then chunk 2n−1−r (so S_local must be even).
//! At ring step s (0 ≤ s < n) rank r attends with its queries to the K/V that started on
//! rank (r − s) mod n.

use crate::error::{MkError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingShape {
    pub batch: usize,
    pub seq_local: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub nranks: usize,
}

/// Checks the rules the header will state; messages name the rule.
pub fn validate(s: &RingShape) -> Result<()> {
    crate::ensure_arg!(s.head_dim == 64 || s.head_dim == 128, "headDim = {} is not supported: 64 or 128", s.head_dim);
    crate::ensure_arg!(s.kv_heads > 0 && s.heads % s.kv_heads == 0, "numKvHeads = {} must divide numHeads = {} (GQA)", s.kv_heads, s.heads);
    crate::ensure_arg!(!s.causal || s.seq_local % 2 == 0, "seqLocal = {} must be even for causal attention: each rank holds two zigzag chunks of seqLocal / 2 tokens", s.seq_local);
    if s.seq_local.checked_mul(s.nranks).is_none() {
        return Err(MkError::invalid_argument("seqLocal × nranks overflows"));
    }
    Ok(())
}

/// A span of global token positions, [start, start + len).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub start: usize,
    pub len: usize,
}

/// The global positions a rank's local tokens stand for, in local order.
pub fn rank_spans(s: &RingShape, rank: usize) -> Vec<Span> {
    if s.causal {
        let half = s.seq_local / 2;
        let n = s.nranks;
        vec![Span { start: rank * half, len: half }, Span { start: (2 * n - 1 - rank) * half, len: half }]
    } else {
        vec![Span { start: rank * s.seq_local, len: s.seq_local }]
    }
}

/// How a block of queries sees a block of keys under the causal mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Visibility {
    /// Every key precedes or equals every query: no mask needed.
    Full,
    /// Some pairs are masked: apply the causal mask elementwise.
    Partial,
    /// Every key follows every query: skip the block.
    None,
}

pub fn visibility(causal: bool, q: Span, k: Span) -> Visibility {
    if !causal || q.start >= k.start + k.len - 1 {
        Visibility::Full
    } else if k.start > q.start + q.len - 1 {
        Visibility::None
    } else {
        Visibility::Partial
    }
}

/// One unit of a ring step's work: a local query span against a K/V span held this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockPair {
    pub q: Span,
    pub k: Span,
    pub visibility: Visibility,
}

/// The work of `rank` at ring step `step`: every (query span, key span) pair that is not
/// fully masked, and the rank whose K/V it uses.
pub fn step_work(s: &RingShape, rank: usize, step: usize) -> (usize, Vec<BlockPair>) {
    let n = s.nranks;
    let source = (rank + n - step % n) % n;
    let mut pairs = Vec::new();
    for q in rank_spans(s, rank) {
        for k in rank_spans(s, source) {
            let v = visibility(s.causal, q, k);
            if v != Visibility::None {
                pairs.push(BlockPair { q, k, visibility: v });
            }
        }
    }
    (source, pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(seq_local: usize, causal: bool, nranks: usize) -> RingShape {
        RingShape { batch: 1, seq_local, heads: 32, kv_heads: 8, head_dim: 128, causal, nranks }
    }

    #[test]
    fn rules_are_named() {
        assert!(validate(&RingShape { head_dim: 96, ..shape(1024, false, 4) }).unwrap_err().message.contains("headDim"));
        assert!(validate(&RingShape { kv_heads: 5, ..shape(1024, false, 4) }).unwrap_err().message.contains("divide"));
        assert!(validate(&shape(1023, true, 4)).unwrap_err().message.contains("even"));
        assert!(validate(&shape(1023, false, 4)).is_ok());
    }

    #[test]
    fn spans_tile_the_sequence_exactly_once() {
        for causal in [false, true] {
            for n in 1..=8 {
                let s = shape(2 * 37, causal, n);
                let mut covered = vec![0u8; s.seq_local * n];
                for r in 0..n {
                    for sp in rank_spans(&s, r) {
                        covered[sp.start..sp.start + sp.len].iter_mut().for_each(|c| *c += 1);
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "causal={causal} n={n}");
            }
        }
    }

    /// Counts (query, key) token pairs the plan computes, with the causal mask applied
    /// elementwise on partial blocks, against a direct count over the global sequence.
    fn visible_pairs(s: &RingShape, rank: usize) -> usize {
        (0..s.nranks)
            .flat_map(|step| step_work(s, rank, step).1)
            .map(|p| match p.visibility {
                Visibility::Full => p.q.len * p.k.len,
                Visibility::Partial => (0..p.q.len)
                    .map(|i| (0..p.k.len).filter(|&j| p.k.start + j <= p.q.start + i).count())
                    .sum(),
                Visibility::None => unreachable!("skipped blocks are not planned"),
            })
            .sum()
    }

    #[test]
    fn every_visible_pair_is_computed_once_and_masked_blocks_are_skipped() {
        for n in 1..=8 {
            let s = shape(16, true, n);
            for r in 0..n {
                let direct: usize = rank_spans(&s, r).iter().map(|q| (0..q.len).map(|i| q.start + i + 1).sum::<usize>()).sum();
                assert_eq!(visible_pairs(&s, r), direct, "n={n} rank={r}");
            }
            let s = shape(16, false, n);
            for r in 0..n {
                assert_eq!(visible_pairs(&s, r), 16 * 16 * n);
            }
        }
    }

    #[test]
    fn zigzag_balances_causal_work_across_ranks() {
        let s = shape(64, true, 8);
        let work: Vec<usize> = (0..8).map(|r| visible_pairs(&s, r)).collect();
        let (lo, hi) = (work.iter().min().unwrap(), work.iter().max().unwrap());
        assert_eq!(lo, hi, "zigzag gives every rank the same causal work: {work:?}");
    }

    #[test]
    fn step_zero_is_local_and_the_ring_visits_every_rank() {
        for n in 1..=8 {
            let s = shape(8, false, n);
            for r in 0..n {
                assert_eq!(step_work(&s, r, 0).0, r);
                let mut seen: Vec<usize> = (0..n).map(|st| step_work(&s, r, st).0).collect();
                seen.sort();
                assert_eq!(seen, (0..n).collect::<Vec<_>>());
            }
        }
    }
}
