//! MoE dispatch + grouped GEMM and the way back: the routing semantics and the receive
//! layout, as plain Rust (issue 8). The kernels are not built yet. On the device the same
//! layout will be computed without a host round trip; this module is the definition the
//! kernels and their float64 reference tests share.
//!
//! Semantics. Rank r holds T tokens and, per token, k expert ids (−1 = none) and weights.
//! Experts are spread evenly: rank r owns experts [r·E/n, (r+1)·E/n). Dispatch sends each
//! token once to every rank that owns at least one of its experts (a token routed to two
//! experts of one rank travels once) and appears once per (token, expert) in that rank's
//! expert-grouped rows. Rows are grouped by local expert, and inside an expert by source
//! rank, then by token index: a deterministic order every rank can compute alone.

use crate::error::{MkError, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeShape {
    pub tokens: usize,
    pub top_k: usize,
    pub experts: usize,
    pub nranks: usize,
}

pub fn validate(s: &MoeShape) -> Result<()> {
    crate::ensure_arg!(s.top_k >= 1, "k must be at least 1");
    crate::ensure_arg!(
        s.experts > 0 && s.experts % s.nranks == 0,
        "E = {} must be a positive multiple of nranks = {}: every rank owns E / nranks experts",
        s.experts,
        s.nranks
    );
    Ok(())
}

/// The rank owning expert `e`.
pub fn owner(s: &MoeShape, e: usize) -> usize {
    e / (s.experts / s.nranks)
}

/// One received row: token `token` of `source`, for local expert `local_expert`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReceivedRow {
    pub source: usize,
    pub token: usize,
    pub local_expert: usize,
}

/// What rank `rank` receives, given every rank's routing (`routing[src]` is that rank's
/// [T × k] expert ids): per local expert, its rows in order; also the number of distinct
/// tokens each source sends (what crosses the wire). Out-of-range ids are an error, −1 is
/// "no expert".
pub fn receive_layout(s: &MoeShape, routing: &[Vec<i32>], rank: usize) -> Result<(Vec<Vec<ReceivedRow>>, Vec<usize>)> {
    validate(s)?;
    let per_rank = s.experts / s.nranks;
    let mut rows: Vec<Vec<ReceivedRow>> = vec![Vec::new(); per_rank];
    let mut tokens_from = vec![0usize; s.nranks];
    for (src, ids) in routing.iter().enumerate() {
        if ids.len() != s.tokens * s.top_k {
            return Err(MkError::invalid_argument(format!("routing of rank {src} has {} ids, expected T·k = {}", ids.len(), s.tokens * s.top_k)));
        }
        for t in 0..s.tokens {
            let mut sent = false;
            let mut seen_local = Vec::with_capacity(s.top_k);
            for &e in &ids[t * s.top_k..(t + 1) * s.top_k] {
                if e == -1 {
                    continue;
                }
                if e < 0 || e as usize >= s.experts {
                    return Err(MkError::invalid_argument(format!("expert id {e} of token {t} on rank {src} is outside [0, {})", s.experts)));
                }
                let e = e as usize;
                if owner(s, e) != rank || seen_local.contains(&e) {
                    continue;
                }
                seen_local.push(e);
                rows[e - rank * per_rank].push(ReceivedRow { source: src, token: t, local_expert: e - rank * per_rank });
                sent = true;
            }
            tokens_from[src] += sent as usize;
        }
    }
    Ok((rows, tokens_from))
}

/// Rows needed in the receive buffer; a caller's capacity below it is reported with this
/// number, never silently truncated.
pub fn rows_needed(layout: &[Vec<ReceivedRow>]) -> usize {
    layout.iter().map(Vec::len).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(tokens: usize, top_k: usize, experts: usize, nranks: usize) -> MoeShape {
        MoeShape { tokens, top_k, experts, nranks }
    }

    #[test]
    fn rules_are_named() {
        assert!(validate(&shape(4, 2, 6, 4)).unwrap_err().message.contains("multiple of nranks"));
        assert!(validate(&shape(4, 0, 8, 4)).is_err());
        let s = shape(1, 1, 8, 2);
        assert!(receive_layout(&s, &[vec![8], vec![0]], 0).unwrap_err().message.contains("outside [0, 8)"));
        assert!(receive_layout(&s, &[vec![0, 1], vec![0]], 0).unwrap_err().message.contains("expected T·k = 1"));
    }

    #[test]
    fn every_routed_pair_lands_once_on_its_owner_and_tokens_travel_once() {
        // 3 ranks, 6 experts (2 each), k = 2, skewed: expert 0 takes most, -1 holes, a
        // token routed to two experts of the same rank.
        let s = shape(4, 2, 6, 3);
        let routing = vec![
            vec![0, 1, 0, -1, 0, 5, -1, -1],
            vec![0, 2, 0, 3, 1, 0, 4, 4],
            vec![-1, -1, 0, 1, 5, 4, 0, 2],
        ];
        let mut pairs = 0;
        let mut wire = 0;
        for r in 0..3 {
            let (layout, tokens_from) = receive_layout(&s, &routing, r).unwrap();
            for (le, rows) in layout.iter().enumerate() {
                for w in rows.windows(2) {
                    assert!((w[0].source, w[0].token) < (w[1].source, w[1].token), "ordered by source, then token");
                }
                for row in rows {
                    assert_eq!(row.local_expert, le);
                    let ids = &routing[row.source][row.token * 2..row.token * 2 + 2];
                    assert!(ids.contains(&((r * 2 + le) as i32)));
                }
            }
            pairs += rows_needed(&layout);
            wire += tokens_from.iter().sum::<usize>();
        }
        // Distinct (token, expert) pairs with an expert: count them directly.
        let direct: usize = routing
            .iter()
            .map(|ids| ids.chunks(2).map(|c| { let mut v: Vec<_> = c.iter().filter(|&&e| e >= 0).collect(); v.sort(); v.dedup(); v.len() }).sum::<usize>())
            .sum();
        assert_eq!(pairs, direct);
        // Rank 1's token 3 goes to experts 4 and 4 (one rank, one expert): one row, one send.
        let (layout2, _) = receive_layout(&s, &routing, 2).unwrap();
        assert_eq!(layout2[0].iter().filter(|row| row.source == 1 && row.token == 3).count(), 1);
        assert!(wire < pairs, "tokens for two experts of one rank travel once");
    }

    #[test]
    fn experts_without_tokens_have_empty_groups() {
        let s = shape(3, 1, 8, 2);
        let (layout, tokens_from) = receive_layout(&s, &[vec![0, 0, 0], vec![0, -1, 1]], 1).unwrap();
        assert!(layout.iter().all(Vec::is_empty));
        assert_eq!(tokens_from, vec![0, 0]);
    }
}
