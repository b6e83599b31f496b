//! Every `MK_*` environment variable is read here and nowhere else. `KNOBS` (the public
//! ones) and `INTERNAL_KNOBS` (tuning, `MK_INTERNAL_*`, see src/tuning.rs) are the tables of
//! docs/environment.md, and a test fails when the document and these lists disagree. Values
//! are read on each call (cheap, and tests can change them); malformed values fall back to
//! the default with a warning.

use std::time::Duration;

/// (name, default, meaning) of each public knob: docs/environment.md's first table.
pub const KNOBS: &[(&str, &str, &str)] = &[
    (
        "MK_DEBUG",
        "(unset)",
        "WARN or INFO: log to stderr with host:pid [rank] prefixes; INFO also prints the internal tuning, the GEMM tile table and each GEMM shape class's tile the first time it is planned",
    ),
    ("MK_TIMEOUT_MS", "30000", "bound on every in-kernel wait for a peer (the MoE prep's waits for its own flags get 17/16 of it, so the upstream wait names the cause)"),
    ("MK_BOOTSTRAP_TIMEOUT_MS", "30000", "bound on every bootstrap step (connect, rendezvous, allgather)"),
    ("MK_SOCKET_IFNAME", "(first non-loopback)", "interfaces for bootstrap sockets: comma-separated prefixes, '^' excludes, '=' exact"),
    ("MK_RANKS_PER_NODE", "(by host)", "group ranks into nodes of this size (emulates several nodes on one host)"),
    ("MK_COMM_SMS", "(planned per op)", "CTAs given to communication roles in fused kernels"),
    ("MK_MAX_CTAS", "(all SMs)", "cap on any kernel's grid; set it when several ranks share one GPU"),
    ("MK_WORKSPACE_BYTES", "268435456", "symmetric workspace per rank allocated at init: this much for the collectives and as much again for the fused ops"),
    ("MK_NET", "(ib if an RDMA device is usable, else socket)", "inter-node transport: ib or socket"),
    ("MK_IB_HCA", "(every active device)", "RDMA devices to use: comma-separated name[:port] prefixes, '^' excludes, '=' exact"),
];

/// (name, default, meaning) of each internal tuning knob (src/tuning.rs): docs/environment.md's
/// second table. Not part of the interface: names and values may change between releases.
pub const INTERNAL_KNOBS: &[(&str, &str, &str)] = &[
    ("MK_INTERNAL_GEMM_REDUCERS", "early", "who sums the partials of mkGemmReduceScatter / mkGemmAllReduce on one node without MK_COMM_SMS: early (mkGemmReduceScatter with BN 256 tiles and more tiles than CTAs: two idle producer warps of each GEMM CTA sum its earlier tiles during the GEMM, every warp the rest after it; elsewhere as after) or after (every warp of each GEMM CTA, after its GEMM)"),
    ("MK_INTERNAL_GEMM_AR_ONESHOT_MAX_M", "256", "mkGemmAllReduce: the largest M that takes the one-shot path (every rank sums every tile); above it, two-phase (each owner sums its 128-row blocks, the others copy them) where M divides into whole blocks per rank"),
    ("MK_INTERNAL_MOE_BANDS", "4", "mkMoeGemmCombine: column bands of its GEMM (fewer where H / tile width has no such divisor); the pull of band b's outputs runs beside the GEMM of the later bands; 1: pull after the GEMM only"),
    ("MK_INTERNAL_COLLECTIVE_LL_MAX_BYTES", "65536", "mkAllGather / mkReduceScatter / mkAllReduce within a node: the largest message per rank segment (AllReduce: the buffer) that takes the low-latency protocol (data and its step's flag pushed together in 16-byte lines into the peers' LL regions); above it, the simple protocol (staged, flagged, pulled); 0 never takes LL. Every rank must set the same value"),
    ("MK_INTERNAL_MOE_BURST", "auto", "mkMoeDispatchGemm: 1 = before their GEMM, all warps of the GEMM CTAs send the rows of the first local experts, then the side warps send the rest; 0 = the side warps send everything; auto = 1 at 4 or more ranks"),
    ("MK_INTERNAL_RING_BWD_ENGINE", "auto", "mkRingAttentionBackward's engine: auto (one-pass when the workspace's fused-op region holds its dQ sums, else two-pass; the choice depends only on the shape and the workspace, so every rank makes the same) or two-pass (dK/dV items, then dQ items that form S and dP again) or one-pass (dK/dV items also form dQ's partials, summed per query tile in a fixed order: bitwise reproducible) or one-pass-atomic (the same, summed by atomic adds in any order). one-pass needs 4 · batch · heads · ⌈seqLocal / 64⌉ · 64 · headDim bytes more of MK_WORKSPACE_BYTES. Every rank must set the same value"),
];

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn parse_u64(name: &str) -> Option<u64> {
    let v = var(name)?;
    match v.trim().parse::<u64>() {
        Ok(x) => Some(x),
        Err(_) => {
            crate::log::warn(None, format_args!("ignoring {name}={v:?}: not a non-negative integer"));
            None
        }
    }
}

pub fn debug_level() -> Option<String> {
    var("MK_DEBUG").map(|s| s.trim().to_ascii_uppercase())
}

pub fn timeout() -> Duration {
    Duration::from_millis(parse_u64("MK_TIMEOUT_MS").unwrap_or(30_000))
}

pub fn bootstrap_timeout() -> Duration {
    Duration::from_millis(parse_u64("MK_BOOTSTRAP_TIMEOUT_MS").unwrap_or(30_000))
}

pub fn socket_ifname() -> Option<String> {
    var("MK_SOCKET_IFNAME")
}

pub fn ranks_per_node() -> Option<u64> {
    parse_u64("MK_RANKS_PER_NODE").filter(|&n| n > 0)
}

pub fn comm_sms() -> Option<u64> {
    parse_u64("MK_COMM_SMS")
}

pub fn max_ctas() -> Option<u64> {
    parse_u64("MK_MAX_CTAS").filter(|&n| n > 0)
}

pub fn workspace_bytes() -> u64 {
    parse_u64("MK_WORKSPACE_BYTES").unwrap_or(256 << 20)
}

/// `MK_NET` as given (`ib`, `socket`); the transport module validates it.
pub fn net() -> Option<String> {
    var("MK_NET").map(|s| s.trim().to_ascii_lowercase())
}

/// `MK_IB_HCA` as given; the transport module parses it.
pub fn ib_hca() -> Option<String> {
    var("MK_IB_HCA").map(|s| s.trim().to_string())
}

/// A knob with named values (case-insensitive): the value of the one given; None when
/// unset, or malformed (with a warning).
fn one_of<T: Copy>(name: &str, values: &[(&str, T)]) -> Option<T> {
    let given = var(name).map(|s| s.trim().to_ascii_lowercase())?;
    if let Some(&(_, v)) = values.iter().find(|(n, _)| *n == given) {
        return Some(v);
    }
    let names: Vec<&str> = values.iter().map(|(n, _)| *n).collect();
    crate::log::warn(None, format_args!("ignoring {name}={given:?}: expected {}", names.join(", ")));
    None
}

// ---- internal tuning (src/tuning.rs): None when unset ----

/// `MK_INTERNAL_GEMM_REDUCERS`: `early` or `after`.
pub fn internal_gemm_reducers() -> Option<crate::tuning::Reducers> {
    use crate::tuning::Reducers;
    one_of("MK_INTERNAL_GEMM_REDUCERS", &[("early", Reducers::Early), ("after", Reducers::After)])
}

/// `MK_INTERNAL_GEMM_AR_ONESHOT_MAX_M`.
pub fn internal_gemm_ar_one_shot_max_m() -> Option<usize> {
    parse_u64("MK_INTERNAL_GEMM_AR_ONESHOT_MAX_M").map(|m| m as usize)
}

/// `MK_INTERNAL_COLLECTIVE_LL_MAX_BYTES`.
pub fn internal_collective_ll_max_bytes() -> Option<u64> {
    parse_u64("MK_INTERNAL_COLLECTIVE_LL_MAX_BYTES")
}

/// `MK_INTERNAL_MOE_BANDS` (at least 1).
pub fn internal_moe_bands() -> Option<usize> {
    parse_u64("MK_INTERNAL_MOE_BANDS").map(|b| (b as usize).max(1))
}

/// `MK_INTERNAL_RING_BWD_ENGINE`: Some(Some(engine)) for `two-pass`, `one-pass` or
/// `one-pass-atomic`, Some(None) for `auto`.
pub fn internal_ring_bwd_engine() -> Option<Option<crate::tuning::RingBackwardEngine>> {
    use crate::tuning::RingBackwardEngine as E;
    one_of(
        "MK_INTERNAL_RING_BWD_ENGINE",
        &[
            ("auto", None),
            ("two-pass", Some(E::TwoPass)),
            ("one-pass", Some(E::OnePass)),
            ("one-pass-atomic", Some(E::OnePassAtomic)),
        ],
    )
}

/// `MK_INTERNAL_MOE_BURST`: Some(Some(on)) when forced, Some(None) for `auto`.
pub fn internal_moe_burst() -> Option<Option<bool>> {
    one_of("MK_INTERNAL_MOE_BURST", &[("auto", None), ("1", Some(true)), ("0", Some(false))])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/environment.md's two tables are exactly KNOBS and INTERNAL_KNOBS, row by row.
    #[test]
    fn the_environment_document_lists_exactly_these_knobs() {
        let doc = include_str!("../docs/environment.md");
        let rows: Vec<&str> = doc.lines().filter(|l| l.starts_with("| `MK_")).collect();
        let want: Vec<String> = KNOBS
            .iter()
            .chain(INTERNAL_KNOBS)
            .map(|(name, default, meaning)| format!("| `{name}` | {default} | {meaning} |"))
            .collect();
        assert_eq!(rows, want, "docs/environment.md and src/env.rs disagree");
        // Public knobs come first, and none of them is internal.
        assert!(KNOBS.iter().all(|(n, _, _)| !n.starts_with("MK_INTERNAL_")));
        assert!(INTERNAL_KNOBS.iter().all(|(n, _, _)| n.starts_with("MK_INTERNAL_")));
    }

    /// The documented defaults are the ones the code uses.
    #[test]
    fn internal_defaults_are_the_tunings() {
        let t = crate::tuning::Tuning::default();
        let default_of = |name: &str| INTERNAL_KNOBS.iter().find(|(n, _, _)| *n == name).unwrap().1;
        assert_eq!(default_of("MK_INTERNAL_GEMM_AR_ONESHOT_MAX_M"), t.gemm_ar_one_shot_max_m.to_string());
        assert_eq!(default_of("MK_INTERNAL_MOE_BANDS"), t.moe_bands.to_string());
        assert_eq!(default_of("MK_INTERNAL_COLLECTIVE_LL_MAX_BYTES"), t.collective_ll_max_bytes.to_string());
        assert_eq!(default_of("MK_INTERNAL_MOE_BURST"), "auto");
        assert_eq!(t.moe_burst, None);
        assert_eq!(default_of("MK_INTERNAL_GEMM_REDUCERS"), "early");
        assert_eq!(t.gemm_reducers, crate::tuning::Reducers::Early);
        assert_eq!(default_of("MK_INTERNAL_RING_BWD_ENGINE"), "auto");
        assert_eq!(t.ring_bwd_engine, None);
    }
}
