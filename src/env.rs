//! Every `MK_*` environment variable is read here and nowhere else, so the README's table
//! and the code cannot drift apart. Values are read on each call (cheap, and tests can
//! change them); malformed values fall back to the default with a warning.

use std::time::Duration;

/// (name, default, meaning) of each knob; the README documents the same list.
pub const KNOBS: &[(&str, &str, &str)] = &[
    ("MK_DEBUG", "(unset)", "WARN or INFO: log to stderr with host:pid [rank] prefixes"),
    ("MK_TIMEOUT_MS", "30000", "bound on every in-kernel wait for a peer"),
    ("MK_BOOTSTRAP_TIMEOUT_MS", "30000", "bound on every bootstrap step (connect, rendezvous, allgather)"),
    ("MK_SOCKET_IFNAME", "(first non-loopback)", "interfaces for bootstrap sockets: comma-separated prefixes, '^' excludes, '=' exact"),
    ("MK_RANKS_PER_NODE", "(by host)", "group ranks into nodes of this size (emulates several nodes on one host)"),
    ("MK_COMM_SMS", "(planned per op)", "CTAs given to communication roles in fused kernels"),
    ("MK_MAX_CTAS", "(all SMs)", "cap on any kernel's grid; set it when several ranks share one GPU"),
    ("MK_WORKSPACE_BYTES", "268435456", "symmetric workspace per rank allocated at init: this much for the collectives and as much again for the fused ops"),
    ("MK_NET", "(ib if an RDMA device is usable, else socket)", "inter-node transport: ib or socket"),
    ("MK_IB_HCA", "(every active device)", "RDMA devices to use: comma-separated name[:port] prefixes, '^' excludes, '=' exact"),
    ("MK_GEMM_REDUCERS", "early", "who sums the partials in mkGemmReduceScatter / mkGemmAllReduce on one node without MK_COMM_SMS: early (GEMM+RS: two idle producer warps of each GEMM CTA sum its earlier tiles during the GEMM, every warp the rest after it; GEMM+AR: as after), after (every warp of each GEMM CTA, after its GEMM) or side (two idle producer warps, during the GEMM; measured 1.6x slower with three) or owners (GEMM+AR at the one-shot sizes above 64 rows: each tile's owner rank, which computes it last, sums it in its GEMM's epilogue and the others copy the sum after their GEMM; elsewhere as after)"),
    ("MK_GEMM_AR_ONESHOT_MAX_M", "256", "mkGemmAllReduce: largest M that takes the one-shot path (every rank sums every tile); above it, two-phase (each owner sums its rows, the others copy them) where M divides into 128-row blocks per rank"),
    ("MK_MOE_ORDER", "auto", "order of the MoE kernels' GEMM row blocks: auto or expert (expert-major, raster groups cut at experts, so an expert's blocks share its weight tiles in L2; the dispatch's senders send expert by expert, flagged per (source, expert)), split (dispatch: own-only blocks, then blocks without the last step's source, then the rest, each expert-major) or arrival (both kernels by the latest source's send step, fixed raster groups: session 8's dispatch)"),
    ("MK_MOE_BANDS", "4", "mkMoeGemmCombine: column bands of the GEMM (fewer where H / tile width has no such divisor); the pull of band b's outputs runs beside the GEMM of the later bands (1: pull after the GEMM only); halving: bands of half the columns left (28 column tiles: 14, 7, 4, 2, 1), so one column's pull is left after the GEMM"),
    ("MK_MOE_BURST", "auto", "mkMoeDispatchGemm: 1 = before their GEMM, all warps of the GEMM CTAs send the rows of the first local experts (those the first wave of tiles needs), then the side warps send the rest; 0 = the side warps send everything; auto = 1 at 4 or more ranks (measured faster at 4 ranks, slower at 2)"),
    ("MK_LOAD_STAGING", "smem", "how the collectives keep loads in flight: smem (cp.async into 128 KiB of shared memory per CTA) or registers (a few vectors per thread); the fused ops' reducers always stage"),
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

/// `MK_GEMM_AR_ONESHOT_MAX_M` (ops::gemm_ar::ONE_SHOT_MAX_M by default).
pub fn gemm_ar_one_shot_max_m() -> usize {
    parse_u64("MK_GEMM_AR_ONESHOT_MAX_M").map_or(crate::ops::gemm_ar::ONE_SHOT_MAX_M, |m| m as usize)
}

/// `MK_MOE_BANDS` (ops::moe::DEFAULT_BANDS by default; at least 1; `halving`:
/// ops::moe::HALVING_BANDS).
pub fn moe_bands() -> usize {
    if var("MK_MOE_BANDS").is_some_and(|v| v.trim().eq_ignore_ascii_case("halving")) {
        return crate::ops::moe::HALVING_BANDS;
    }
    parse_u64("MK_MOE_BANDS").map_or(crate::ops::moe::DEFAULT_BANDS, |b| (b as usize).max(1))
}

/// `MK_MOE_BURST`: Some(on) when forced, None for `auto` (the default; ops::moe::burst_for).
pub fn moe_burst() -> Option<bool> {
    one_of("MK_MOE_BURST", &[("auto", None), ("1", Some(true)), ("0", Some(false))])
}

/// `MK_MOE_ORDER`: 0 arrival, 1 expert, 2 split, 3 auto (the default; ops::moe::order_mode_for
/// turns it into the kernels' OrderMode).
pub fn moe_order() -> u32 {
    one_of("MK_MOE_ORDER", &[("auto", 3), ("expert", 1), ("arrival", 0), ("split", 2)])
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

/// A knob with named values (case-insensitive): the value of the one given, or of the
/// first (the default) when unset or malformed, with a warning.
fn one_of<T: Copy>(name: &str, values: &[(&str, T)]) -> T {
    let Some(given) = var(name).map(|s| s.trim().to_ascii_lowercase()) else {
        return values[0].1;
    };
    if let Some(&(_, v)) = values.iter().find(|(n, _)| *n == given) {
        return v;
    }
    let names: Vec<&str> = values.iter().map(|(n, _)| *n).collect();
    crate::log::warn(None, format_args!("ignoring {name}={given:?}: expected {}", names.join(", ")));
    values[0].1
}

/// `MK_LOAD_STAGING`: true for `smem` (the default), false for `registers`.
pub fn load_staging_smem() -> bool {
    one_of("MK_LOAD_STAGING", &[("smem", true), ("registers", false)])
}

/// `MK_GEMM_REDUCERS`: `early` (the default), `after`, `side` or `owners`.
pub fn gemm_reducers() -> crate::ops::gemm_reduce::Reducers {
    use crate::ops::gemm_reduce::Reducers;
    one_of("MK_GEMM_REDUCERS", &[("early", Reducers::Early), ("after", Reducers::After), ("side", Reducers::Side), ("owners", Reducers::Owners)])
}
