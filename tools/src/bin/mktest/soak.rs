//! The soak: every public op called over and over in a random order with random legal
//! shapes, for MK_SOAK_SECONDS (default 60), with MK_TEST_NRANKS ranks (processes sharing
//! the GPU under MPS, or one per GPU).
//!
//! The ops: mkAllGather, mkReduceScatter and mkAllReduce (every dtype and reduction op, in
//! and out of place), mkGemm, mkAllGatherGemm (with and without gatheredA),
//! mkGemmReduceScatter, mkGemmAllReduce (one-shot and two-phase), mkMoeDispatchGemm followed
//! by mkMoeGemmCombine, and mkRingAttention (causal and not, GQA, D 64 and 128). Calls come
//! in rounds, each round every op once in a shuffled order; the first round always runs to
//! its end, so even a zero duration calls every op. Every call has fresh random inputs and
//! NaN-poisoned outputs and is checked element by element against the float64 reference and
//! acceptance rule of the op's own suite (their `Case` types do the work), guard bands
//! included; mkGemmAllReduce's output must also be the same bits on every rank. A wrong
//! result is reported (call index, the call, the verdict) and the soak goes on, so the ranks
//! stay in step; an error (an asynchronous error, a wait past 30 s) ends it at once. At the
//! end each rank prints how many calls of each op it made and how many were wrong.
//!
//! Every rank draws the same calls from one seed: the parent process takes MK_TEST_SEED (a
//! u64, decimal or 0x-hex) or picks a fresh one, prints it and hands it to the rank
//! processes in MK_TEST_SEED; ranks a launcher started without it derive it from the unique
//! ids they share. Rank 0 alone reads the clock: before every call it tells the others
//! (a broadcast on the control communicator) whether another call follows, so all ranks
//! make the same calls. MK_TEST_SEED=<seed> replays a run's sequence at the same rank count.
//!
//! Shapes are bounded so that one call's float64 reference costs a rank at most
//! `REFERENCE_BUDGET` multiply-adds and its buffers fit the fused-op region with room to
//! spare: a call takes well under a second and a few MB per rank, and 4 ranks on one GPU
//! under MPS (MK_MAX_CTAS caps their grids, as scripts/gpu-run.sh sets it) soak for minutes.

use crate::ag_gemm::Case as AllGatherGemmCase;
use crate::collectives::{
    async_error, config, control_comm, destroy, ffi, init_comm, longest_op_timeout, say, suite_timeout_ms, timed_sync,
    Case as CollectiveCase, Stream,
};
use crate::fused_common::{self, FusedCase};
use crate::gemm_reduce::Case as GemmReduceCase;
use crate::moe;
use crate::outcome::{self, Outcome};
use crate::ranks::{self, RankEnv};
use crate::ring_attn::Case as RingAttentionCase;
use mkernel::bootstrap::root::start_root;
use mkernel::comm::Comm;
use mkernel::cuda::{sys, PrimaryContext};
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::gemm::mkGemm;
use mkernel::ffi::mkComm_t;
use mkernel::ops::collectives::CollectiveKind;
use mkernel::types::{mkDataType_t, mkRedOp_t, Element};
use mkernel_tools::testing::collective_values::splitmix;
use mkernel_tools::testing::TestBuffer;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The seed of the soak's and the chaos suite's random choices.
pub(crate) const ENV_SEED: &str = "MK_TEST_SEED";
const ENV_SECONDS: &str = "MK_SOAK_SECONDS";
const DEFAULT_SECONDS: u64 = 60;
const IDS: usize = 2; // control, main
/// Workspace of the soak's communicator: this much for the collectives, as much again for
/// the fused ops (every call's fused-op buffers fit in a quarter of it).
pub(crate) const WORKSPACE_BYTES: usize = 64 << 20;
/// The most a call's float64 reference may cost one rank: multiply-adds, or for the
/// collectives 8 per input element generated (every rank regenerates every rank's inputs).
pub(crate) const REFERENCE_BUDGET: usize = 50_000_000;

pub fn run() -> Result<Outcome> {
    if let Some(env) = ranks::child_env(IDS)? {
        let seed = shared_seed(&env)?;
        rank_main(&env, seed)?;
        return Ok(Outcome::Ran);
    }
    let n = ranks::nranks_requested();
    let seed = seed_from_env()?.unwrap_or_else(fresh_seed);
    let seconds = soak_seconds()?;
    println!("  soak: seed {seed:#x} ({ENV_SEED}={seed:#x} replays it), {seconds} s, {n} rank(s)");
    if n > 1 {
        println!("  starting {n} rank processes");
        // The last call starts before the duration ends; start-up and that call fit easily.
        let deadline = Duration::from_secs(seconds + 240);
        ranks::spawn_with_env(&["soak".to_string()], n, IDS, deadline, &[(ENV_SEED, format!("{seed:#x}"))], |_| 0)?;
        return Ok(Outcome::Spawned { nranks: n });
    }
    let ids = (0..IDS).map(|_| start_root()).collect::<Result<Vec<_>>>()?;
    rank_main(&RankEnv { rank: 0, nranks: 1, ids, device: 0 }, seed)?;
    Ok(Outcome::Ran)
}

// ---------------------------------------------------------------- seeds and the generator

/// MK_SOAK_SECONDS (default 60).
fn soak_seconds() -> Result<u64> {
    match std::env::var(ENV_SECONDS) {
        Err(_) => Ok(DEFAULT_SECONDS),
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|_| MkError::invalid_argument(format!("{ENV_SECONDS}={v:?} is not a whole number of seconds"))),
    }
}

/// MK_TEST_SEED, when set.
pub(crate) fn seed_from_env() -> Result<Option<u64>> {
    let Ok(v) = std::env::var(ENV_SEED) else { return Ok(None) };
    parse_seed(&v)
        .map(Some)
        .ok_or_else(|| MkError::invalid_argument(format!("{ENV_SEED}={v:?} is not a u64 (decimal, or hex with 0x)")))
}

fn parse_seed(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// A seed nobody chose: the clock and the process id.
pub(crate) fn fresh_seed() -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    splitmix(nanos ^ (u64::from(std::process::id()) << 40))
}

/// The seed every rank of a run shares: MK_TEST_SEED (set by the parent for the rank
/// processes it starts), else one derived from the unique ids, which every rank holds alike
/// (each carries a fresh secret).
pub(crate) fn shared_seed(env: &RankEnv) -> Result<u64> {
    if let Some(seed) = seed_from_env()? {
        return Ok(seed);
    }
    Ok(env.ids.iter().flat_map(|id| id.to_bytes()).fold(0x5eed, |h, b| splitmix(h ^ u64::from(b))))
}

/// The generator every rank runs in step. Integers only, so ranks on different hosts draw
/// the same values.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub(crate) fn next(&mut self) -> u64 {
        let out = splitmix(self.0);
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        out
    }

    /// Uniform in [0, n).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in [lo, hi].
    pub(crate) fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    /// In [lo, hi] (1 ≤ lo ≤ hi), every power-of-two band equally likely: sizes of 1-3 as
    /// often as sizes in the hundreds.
    pub(crate) fn sized(&mut self, lo: usize, hi: usize) -> usize {
        let bits = |x: usize| (usize::BITS - x.leading_zeros()) as usize;
        let b = self.range(bits(lo), bits(hi));
        self.range((1usize << (b - 1)).max(lo), ((1usize << b) - 1).min(hi))
    }

    pub(crate) fn coin(&mut self) -> bool {
        self.next() >> 63 == 1
    }

    pub(crate) fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

/// One call of a public op: everything that decides its shape (the data come from a seed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    Collective {
        kind: CollectiveKind,
        dtype: mkDataType_t,
        op: mkRedOp_t,
        count: usize,
        in_place: bool,
    },
    Gemm {
        dtype: mkDataType_t,
        m: usize,
        n: usize,
        k: usize,
    },
    /// `rows` per rank (M = rows · nranks).
    AllGatherGemm {
        dtype: mkDataType_t,
        rows: usize,
        n: usize,
        k: usize,
        with_gathered: bool,
    },
    GemmReduce {
        scatter: bool,
        dtype: mkDataType_t,
        m: usize,
        n: usize,
        k: usize,
    },
    /// As moe::Sizes, plus the receive capacity's blocks beyond what the routing needs.
    Moe {
        dtype: mkDataType_t,
        tokens: usize,
        tokens_odd: usize,
        hidden: usize,
        ffn: usize,
        top_k: usize,
        experts: usize,
        spread: usize,
        slack: usize,
    },
    RingAttention {
        dtype: mkDataType_t,
        batch: usize,
        seq_local: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        causal: bool,
    },
}

impl Call {
    /// The public ops the call makes, in order.
    pub(crate) fn ops(&self) -> &'static [&'static str] {
        match self {
            Call::Collective { kind: CollectiveKind::AllGather, .. } => &["mkAllGather"],
            Call::Collective { kind: CollectiveKind::ReduceScatter, .. } => &["mkReduceScatter"],
            Call::Collective { kind: CollectiveKind::AllReduce, .. } => &["mkAllReduce"],
            Call::Gemm { .. } => &["mkGemm"],
            Call::AllGatherGemm { .. } => &["mkAllGatherGemm"],
            Call::GemmReduce { scatter: true, .. } => &["mkGemmReduceScatter"],
            Call::GemmReduce { scatter: false, .. } => &["mkGemmAllReduce"],
            Call::Moe { .. } => &["mkMoeDispatchGemm", "mkMoeGemmCombine"],
            Call::RingAttention { .. } => &["mkRingAttention"],
        }
    }

    pub(crate) fn is_fused(&self) -> bool {
        !matches!(self, Call::Collective { .. } | Call::Gemm { .. })
    }

    /// The host's cost of the call's float64 reference on one rank (`REFERENCE_BUDGET`'s
    /// units), an upper bound where the routing decides it.
    pub(crate) fn reference_cost(&self, nranks: usize) -> usize {
        match *self {
            Call::Collective { kind, count, .. } => {
                let inputs = if kind == CollectiveKind::ReduceScatter { nranks * count } else { count };
                8 * nranks * inputs
            }
            Call::Gemm { m, n, k, .. } => m * n * k,
            Call::AllGatherGemm { rows, n, k, .. } => rows * nranks * n * k,
            // Each rank's rows of every rank's partial.
            Call::GemmReduce { scatter: true, m, n, k, .. } => m * n * k,
            Call::GemmReduce { scatter: false, m, n, k, .. } => nranks * m * n * k,
            Call::Moe { tokens, tokens_odd, hidden, ffn, top_k, experts, .. } => {
                let t = tokens.max(tokens_odd);
                // Rows received (each source's tokens once per distinct local expert), then
                // every token's choices combined.
                (nranks * t * top_k.min(experts / nranks) + t * top_k) * hidden * ffn
            }
            Call::RingAttention { batch, seq_local, heads, head_dim, .. } => {
                2 * batch * heads * seq_local * nranks * seq_local * head_dim
            }
        }
    }

    /// Bytes the call keeps in the fused-op region (an upper bound for the MoE pair).
    pub(crate) fn region_bytes(&self, nranks: usize) -> usize {
        match *self {
            Call::Collective { .. } | Call::Gemm { .. } => 0,
            Call::AllGatherGemm { rows, k, .. } => rows * nranks * k * 2,
            // The two-phase AllReduce keeps the reduced rows as well.
            Call::GemmReduce { m, n, .. } => 2 * m * n * 2,
            Call::Moe { tokens, tokens_odd, hidden, top_k, experts, .. } => {
                let local = experts / nranks;
                let rows = nranks * tokens.max(tokens_odd) * top_k.min(local) + local * moe_block();
                (64 << 10) + (rows + 2 * moe_block()) * hidden * 2
            }
            Call::RingAttention { batch, seq_local, kv_heads, head_dim, .. } => {
                2 * batch * seq_local * kv_heads * head_dim * 2
            }
        }
    }
}

fn moe_block() -> usize {
    mkernel::ops::moe::ROW_BLOCK
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    AllGather,
    ReduceScatter,
    AllReduce,
    Gemm,
    AllGatherGemm,
    GemmReduceScatter,
    GemmAllReduce,
    Moe,
    RingAttention,
}

const KINDS: [Kind; 9] = [
    Kind::AllGather,
    Kind::ReduceScatter,
    Kind::AllReduce,
    Kind::Gemm,
    Kind::AllGatherGemm,
    Kind::GemmReduceScatter,
    Kind::GemmAllReduce,
    Kind::Moe,
    Kind::RingAttention,
];

/// Checks in one round (the MoE pair checks twice): the suite's floor.
pub(crate) const CHECKS_PER_ROUND: usize = KINDS.len() + 1;

const GEMM_TYPES: [mkDataType_t; 2] = [mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16];

/// A call of `kind` with a random legal shape within the budgets (drawn again until one fits).
fn draw(kind: Kind, rng: &mut Rng, nranks: usize) -> Call {
    loop {
        let call = draw_once(kind, rng, nranks);
        if call.reference_cost(nranks) <= REFERENCE_BUDGET && call.region_bytes(nranks) <= WORKSPACE_BYTES / 4 {
            return call;
        }
    }
}

/// The types mkReduceScatter and mkAllReduce take (every type: fp8 in float, rounded once).
fn reducing_types() -> Vec<mkDataType_t> {
    mkDataType_t::ALL.into_iter().filter(|t| t.element().accepted.reduce).collect()
}

/// The rules each op's validator states: K (and N where C rows go out by TMA) multiples of
/// 8, M divisible by nranks for the scatter and gather ops, MoE sizes multiples of 128 and
/// E a multiple of nranks, ring attention's D 64 or 128, kv heads dividing heads, an even
/// causal seqLocal. Sizes reach the decode end (1 row, 1 token, K = 8, N = 8).
fn draw_once(kind: Kind, rng: &mut Rng, nranks: usize) -> Call {
    let dtype = rng.pick(&GEMM_TYPES);
    let collective = |rng: &mut Rng, kind: CollectiveKind| Call::Collective {
        kind,
        dtype: if kind == CollectiveKind::AllGather {
            rng.pick(&mkDataType_t::ALL)
        } else {
            rng.pick(&reducing_types())
        },
        op: if kind == CollectiveKind::AllGather { mkRedOp_t::mkSum } else { rng.pick(&mkRedOp_t::ALL) },
        count: rng.sized(1, 1 << 17),
        in_place: rng.coin(),
    };
    match kind {
        Kind::AllGather => collective(rng, CollectiveKind::AllGather),
        Kind::ReduceScatter => collective(rng, CollectiveKind::ReduceScatter),
        Kind::AllReduce => collective(rng, CollectiveKind::AllReduce),
        Kind::Gemm => Call::Gemm { dtype, m: rng.sized(1, 1024), n: rng.sized(1, 1024), k: 8 * rng.sized(1, 128) },
        Kind::AllGatherGemm => Call::AllGatherGemm {
            dtype,
            rows: rng.sized(1, 256),
            n: 8 * rng.sized(1, 128),
            k: 8 * rng.sized(1, 96),
            with_gathered: rng.coin(),
        },
        Kind::GemmReduceScatter => Call::GemmReduce {
            scatter: true,
            dtype,
            m: nranks * rng.sized(1, 256),
            n: 8 * rng.sized(1, 128),
            k: 8 * rng.sized(1, 96),
        },
        Kind::GemmAllReduce => {
            // A quarter of them whole 128-row blocks per rank (two-phase above 256 rows).
            let m = if rng.below(4) == 0 { nranks * 128 * rng.range(1, 2) } else { rng.sized(1, 512) };
            Call::GemmReduce { scatter: false, dtype, m, n: 8 * rng.sized(1, 128), k: 8 * rng.sized(1, 96) }
        }
        Kind::Moe => {
            let local = rng.sized(1, (mkernel::ops::moe::MAX_EXPERTS / nranks).clamp(1, 32));
            let experts = local * nranks;
            Call::Moe {
                dtype,
                tokens: rng.sized(1, 64),
                tokens_odd: if rng.below(4) == 0 { 0 } else { rng.sized(1, 64) },
                hidden: 128 * rng.range(1, 4),
                ffn: 128 * rng.range(1, 4),
                top_k: rng.range(1, 8),
                experts,
                spread: rng.range(1, experts),
                slack: rng.below(3),
            }
        }
        Kind::RingAttention => {
            let kv_heads = rng.pick(&[1, 2, 4, 8]);
            let causal = rng.coin();
            let seq_local = rng.sized(1, 256);
            Call::RingAttention {
                dtype,
                batch: rng.range(1, 2),
                seq_local: if causal { seq_local + seq_local % 2 } else { seq_local },
                heads: kv_heads * rng.pick(&[1, 2, 4]),
                kv_heads,
                head_dim: rng.pick(&[64, 128]),
                causal,
            }
        }
    }
}

/// The soak's calls in order: rounds of every op once, shuffled, each call with a random
/// legal shape and a data seed of its own. The same seed and rank count give the same calls.
pub(crate) struct Plan {
    rng: Rng,
    nranks: usize,
    round: Vec<Kind>,
}

impl Plan {
    pub(crate) fn new(seed: u64, nranks: usize) -> Plan {
        Plan { rng: Rng::new(seed), nranks, round: Vec::new() }
    }

    /// The next call and its data seed (below 2^32, so the suites' seed arithmetic stays
    /// far from overflow).
    pub(crate) fn next_call(&mut self) -> (Call, u64) {
        if self.round.is_empty() {
            self.round = KINDS.to_vec();
            self.rng.shuffle(&mut self.round);
        }
        let kind = self.round.pop().expect("a round holds every kind");
        let call = draw(kind, &mut self.rng, self.nranks);
        (call, 1 + (self.rng.next() >> 32))
    }
}

// ---------------------------------------------------------------- running a call

/// One call's buffers and check, for every op but the MoE pair (`moe_pair`).
pub(crate) enum Live {
    Collective(CollectiveCase),
    Gemm { a: TestBuffer, b: TestBuffer, c: TestBuffer, m: usize, n: usize, k: usize },
    AllGatherGemm(AllGatherGemmCase),
    GemmReduce { case: GemmReduceCase, scatter: bool },
    RingAttention(RingAttentionCase),
}

impl Live {
    pub(crate) fn new(call: &Call, rank: usize, nranks: usize) -> Result<Live> {
        Ok(match *call {
            Call::Collective { kind, dtype, op, count, in_place } => {
                Live::Collective(CollectiveCase::new(kind, dtype, op, count, in_place, rank, nranks)?)
            }
            Call::Gemm { dtype, m, n, k } => Live::Gemm {
                a: TestBuffer::new(m * k, dtype)?,
                b: TestBuffer::new(n * k, dtype)?,
                c: TestBuffer::new(m * n, dtype)?,
                m,
                n,
                k,
            },
            Call::AllGatherGemm { dtype, rows, n, k, with_gathered } => {
                let case = AllGatherGemmCase::new(dtype, rows, n, k, nranks, rank)?;
                case.with_gathered.set(with_gathered);
                Live::AllGatherGemm(case)
            }
            Call::GemmReduce { scatter, dtype, m, n, k } => {
                Live::GemmReduce { case: GemmReduceCase::new(scatter, dtype, m, n, k, nranks, rank)?, scatter }
            }
            Call::RingAttention { dtype, batch, seq_local, heads, kv_heads, head_dim, causal } => Live::RingAttention(
                RingAttentionCase::new(dtype, batch, seq_local, heads, kv_heads, head_dim, causal, nranks, rank)?,
            ),
            Call::Moe { .. } => return Err(MkError::internal("the MoE pair runs through moe_pair")),
        })
    }

    /// Fresh inputs from `seed` (every rank's, where the reference needs them), outputs
    /// poisoned, the fills finished before the op's stream may start.
    pub(crate) fn prepare(&mut self, seed: u64) -> Result<()> {
        match self {
            Live::Collective(case) => case.prepare(seed),
            Live::Gemm { a, b, c, .. } => {
                let null = std::ptr::null_mut();
                a.randomize(seed, 1.0, null)?;
                b.randomize(seed + 1, 1.0, null)?;
                c.poison(null)?;
                fused_common::sync_default_stream()
            }
            Live::AllGatherGemm(case) => case.prepare(seed),
            Live::GemmReduce { case, .. } => case.prepare(seed),
            Live::RingAttention(case) => case.prepare(seed),
        }
    }

    /// The call itself (stream-ordered); an error the library returns, with its message.
    pub(crate) fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> Result<()> {
        match self {
            Live::Collective(case) => case.launch(comm, stream),
            Live::Gemm { a, b, c, m, n, k } => ffi(
                "mkGemm",
                // SAFETY: device buffers of the sizes mkGemm expects.
                unsafe {
                    mkGemm(
                        a.ptr() as *const _,
                        b.ptr() as *const _,
                        c.ptr() as *mut _,
                        *m,
                        *n,
                        *k,
                        c.dtype as i32,
                        stream,
                    )
                },
                std::ptr::null_mut(),
            ),
            Live::AllGatherGemm(case) => ffi("mkAllGatherGemm", case.launch(comm, stream), comm),
            Live::GemmReduce { case, .. } => ffi(&case.label(), case.launch(comm, stream), comm),
            Live::RingAttention(case) => ffi("mkRingAttention", case.launch(comm, stream), comm),
        }
    }

    /// (passed, detail, and for mkGemmAllReduce the output's bytes, which every rank must
    /// hold bit for bit).
    pub(crate) fn verify(&self) -> Result<(bool, String, Option<Vec<u8>>)> {
        match self {
            Live::Collective(case) => case.verify().map(|(ok, detail)| (ok, detail, None)),
            Live::Gemm { a, b, c, m, n, k } => {
                let (ok, detail) = crate::gemm::verify(c, &crate::gemm::cpu_reference(a, b, *m, *n, *k)?)?;
                let guards = fused_common::guards_intact(&[("A", a), ("B", b)])?;
                let guard_note = guards.as_ref().map_or(String::new(), |w| format!("; GUARD {w}"));
                Ok((ok && guards.is_none(), format!("{detail}{guard_note}"), None))
            }
            Live::AllGatherGemm(case) => case.verify().map(|(ok, detail)| (ok, detail, None)),
            Live::GemmReduce { case, scatter } => {
                case.verify_with_output().map(|(ok, detail, raw)| (ok, detail, if *scatter { None } else { Some(raw) }))
            }
            Live::RingAttention(case) => case.verify().map(|(ok, detail)| (ok, detail, None)),
        }
    }
}

/// Waits (bounded) for the stream and requires no asynchronous error on `comm`.
pub(crate) fn finish(comm: mkComm_t, stream: &Stream, what: &str) -> Result<()> {
    timed_sync(stream, longest_op_timeout()).map_err(|e| e.context(what.to_string()))?;
    let code = async_error(comm);
    if code != mkResult_t::mkSuccess {
        return Err(MkError::new(code, format!("{what}: asynchronous error {code:?}")));
    }
    Ok(())
}

/// One call on this rank: each op's (name, passed, detail).
fn run_call(
    comm: mkComm_t,
    control: &Comm,
    stream: &Stream,
    rank: usize,
    nranks: usize,
    call: &Call,
    seed: u64,
) -> Result<Vec<(&'static str, bool, String)>> {
    if let Call::Moe { .. } = call {
        return moe_pair(comm, stream, rank, nranks, call, seed);
    }
    let op = call.ops()[0];
    let mut live = Live::new(call, rank, nranks)?;
    live.prepare(seed)?;
    live.launch(comm, stream.0)?;
    finish(comm, stream, op)?;
    let (mut ok, mut detail, identical) = live.verify()?;
    if let Some(raw) = identical {
        let digest = mkernel::bootstrap::crypto::sha256(&[&raw]);
        let all = control.bootstrap.allgather(&digest)?;
        if all.iter().any(|d| d[..] != digest[..]) {
            ok = false;
            detail.push_str(", ranks' outputs DIFFER");
        }
    }
    Ok(vec![(op, ok, detail)])
}

/// mkMoeDispatchGemm, then mkMoeGemmCombine on a fresh Y' (as the moe suite's `run_once`),
/// the receive capacity what the routing needs plus `slack` blocks.
fn moe_pair(
    comm: mkComm_t,
    stream: &Stream,
    rank: usize,
    nranks: usize,
    call: &Call,
    seed: u64,
) -> Result<Vec<(&'static str, bool, String)>> {
    let Call::Moe { dtype, tokens, tokens_odd, hidden, ffn, top_k, experts, spread, slack } = *call else {
        return Err(MkError::internal("moe_pair takes a MoE call"));
    };
    let sizes = moe::Sizes { tokens, tokens_odd, hidden, ffn, top_k, experts, dtype, spread };
    let case = moe::Case::new(sizes, nranks, rank, moe::capacity_for(&sizes, nranks, seed, slack)?)?;
    let inputs = case.fresh_inputs(seed)?;
    ffi("mkMoeDispatchGemm", case.dispatch(comm, stream.0), comm)?;
    finish(comm, stream, "mkMoeDispatchGemm")?;
    let (dispatch_ok, dispatch_detail) = case.verify_dispatch(&inputs)?;
    ffi("mkMoeGemmCombine", case.combine(comm, stream.0), comm)?;
    finish(comm, stream, "mkMoeGemmCombine")?;
    let (combine_ok, combine_detail) = case.verify_combine(&inputs)?;
    Ok(vec![
        ("mkMoeDispatchGemm", dispatch_ok, format!("{} {dispatch_detail}", case.label())),
        ("mkMoeGemmCombine", combine_ok, format!("{} {combine_detail}", case.label())),
    ])
}

// ---------------------------------------------------------------- the rank's soak

fn rank_main(env: &RankEnv, seed: u64) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let ctx = PrimaryContext::retain(env.device)?;
    let _g = ctx.enter()?;
    // The control communicator: whether another call follows, and the AllReduce digests.
    let control = control_comm(env)?;
    let comm = init_comm(env, &env.ids[1], &config(suite_timeout_ms(), WORKSPACE_BYTES as i64))?;
    // An error returns at once (the others' next call or broadcast then fails); wrong
    // results are counted and the ranks finish together.
    let (checks, failures) = soak(comm, &control, rank, n, seed)?;
    control.bootstrap.barrier()?;
    destroy(comm)?;
    outcome::count(checks);
    if failures > 0 {
        return Err(MkError::internal(format!(
            "soak: {failures} of {checks} checks wrong ({ENV_SEED}={seed:#x} replays the calls at {n} rank(s))"
        )));
    }
    Ok(())
}

/// Calls until rank 0 says the time is up; returns (checks, wrong).
fn soak(comm: mkComm_t, control: &Comm, rank: usize, n: usize, seed: u64) -> Result<(usize, usize)> {
    let seconds = if rank == 0 { soak_seconds()? } else { 0 };
    let stream = Stream::new()?;
    let mut plan = Plan::new(seed, n);
    // Per op: calls, wrong.
    let mut tally: BTreeMap<&'static str, (usize, usize)> = BTreeMap::new();
    let mut collective_types: BTreeSet<(&'static str, &'static str)> = BTreeSet::new();
    let start = Instant::now();
    let mut reported = start;
    let mut index = 0usize;
    loop {
        // Rank 0 decides whether another call follows; the first round always completes.
        let more = rank == 0 && (index < KINDS.len() || start.elapsed() < Duration::from_secs(seconds));
        if control.bootstrap.broadcast(&[u8::from(more)], 0)? != [1] {
            break;
        }
        let (call, data_seed) = plan.next_call();
        let results = run_call(comm, control, &stream, rank, n, &call, data_seed)
            .map_err(|e| e.context(format!("soak call {index}, {call:?}, data seed {data_seed} (seed {seed:#x})")))?;
        if let Call::Collective { dtype, .. } = call {
            collective_types.insert((call.ops()[0], dtype.name()));
        }
        for (op, ok, detail) in results {
            let entry = tally.entry(op).or_default();
            entry.0 += 1;
            if !ok {
                entry.1 += 1;
                say(rank, format!("soak call {index}: {op} {call:?} data seed {data_seed}: {detail} -> WRONG"));
            }
        }
        index += 1;
        if rank == 0 && reported.elapsed() >= Duration::from_secs(30) {
            reported = Instant::now();
            let wrong: usize = tally.values().map(|t| t.1).sum();
            say(rank, format!("soak: {index} calls in {:.0} s, {wrong} wrong so far", start.elapsed().as_secs_f64()));
        }
    }
    let checks: usize = tally.values().map(|t| t.0).sum();
    let failures: usize = tally.values().map(|t| t.1).sum();
    say(
        rank,
        format!(
            "soak: {index} calls ({checks} checks) in {:.1} s, {failures} wrong, seed {seed:#x}",
            start.elapsed().as_secs_f64()
        ),
    );
    if rank == 0 || failures > 0 {
        for (op, (calls, wrong)) in &tally {
            let types = collective_types.iter().filter(|(o, _)| o == op).count();
            let types =
                if types > 0 { format!(" ({types} of {} dtypes)", mkDataType_t::ALL.len()) } else { String::new() };
            say(rank, format!("  {op:<20} {calls:>6} calls, {wrong} wrong{types}"));
        }
    }
    Ok((checks, failures))
}

/// The rules the library's validators and workspace checks apply, for the generator's tests
/// (16-byte aligned stand-ins for the pointers; the MoE pair's capacity from `data_seed`'s
/// routing, as the call makes it).
#[cfg(test)]
pub(crate) fn check_legal(call: &Call, nranks: usize, data_seed: u64) -> Result<()> {
    use mkernel::ops::attention::ring_attention;
    use mkernel::ops::dense::{ag_gemm, gemm_reduce};
    use mkernel::ops::gemm::op as gemm_op;
    use mkernel::ops::moe as moe_ops;
    let p = |i: u64| 0x10_0000 * i;
    let region = WORKSPACE_BYTES;
    let fits = |what: &str, bytes: usize| {
        if bytes > region {
            Err(MkError::invalid_usage(format!("{what}: {bytes} bytes exceed the fused-op region")))
        } else {
            Ok(())
        }
    };
    match *call {
        Call::Collective { kind, count, .. } => {
            if count == 0 || kind.buffer_counts(count as u64, nranks as u64).is_none() {
                return Err(MkError::invalid_argument(format!("count {count}")));
            }
            Ok(())
        }
        Call::Gemm { dtype, m, n, k } => gemm_op::validate(p(1), p(2), p(3), m, n, k, dtype as i32).map(|_| ()),
        Call::AllGatherGemm { dtype, rows, n, k, .. } => {
            ag_gemm::validate_args(p(1), p(2), p(3), p(4), rows * nranks, n, k, dtype as i32, nranks, 0)?;
            fits("gathered A", rows * nranks * k * 2)
        }
        Call::GemmReduce { scatter, dtype, m, n, k } => {
            let reduction = if scatter { gemm_reduce::Reduction::Scatter } else { gemm_reduce::Reduction::All };
            gemm_reduce::validate(reduction, p(1), p(2), p(3), m, n, k, dtype as i32, nranks)?;
            fits("partials", 2 * m * n * 2)
        }
        Call::Moe { dtype, tokens, tokens_odd, hidden, ffn, top_k, experts, spread, slack } => {
            let sizes = moe::Sizes { tokens, tokens_odd, hidden, ffn, top_k, experts, dtype, spread };
            let capacity = moe::capacity_for(&sizes, nranks, data_seed, slack)?;
            let dims =
                moe_ops::MoeDims { tokens: tokens.max(tokens_odd), hidden, ffn, top_k, experts, capacity, nranks };
            moe_ops::validate_dims(&dims)?;
            fits("receive buffer", moe_ops::COUNTS_BYTES + capacity * hidden * 2)
        }
        Call::RingAttention { dtype, batch, seq_local, heads, kv_heads, head_dim, causal } => {
            ring_attention::validate_args(
                p(1),
                p(2),
                p(3),
                p(4),
                p(5),
                batch,
                seq_local,
                heads,
                kv_heads,
                head_dim,
                0.1,
                i32::from(causal),
                dtype as i32,
                nranks,
                0,
            )?;
            fits("K and V", 2 * batch * seq_local * kv_heads * head_dim * 2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every call the generator makes is one the library accepts, within the host budget and
    /// the fused-op region, at every rank count; each round calls every op once.
    #[test]
    fn generated_calls_are_legal_and_cover_every_op_each_round() {
        for nranks in 1..=8 {
            for seed in [1u64, 2, 0xdead_beef, u64::MAX] {
                let mut plan = Plan::new(seed, nranks);
                let mut moe_capacity_seen = false;
                for round in 0..60 {
                    let mut ops = BTreeSet::new();
                    for _ in 0..KINDS.len() {
                        let (call, data_seed) = plan.next_call();
                        assert!((1..=1 << 32).contains(&data_seed));
                        check_legal(&call, nranks, data_seed)
                            .unwrap_or_else(|e| panic!("{nranks} ranks: {call:?}: {}", e.message));
                        assert!(call.reference_cost(nranks) <= REFERENCE_BUDGET, "{call:?}");
                        if let Call::Moe { dtype, tokens, tokens_odd, hidden, ffn, top_k, experts, spread, slack } =
                            call
                        {
                            // The capacity the call will use (its data seed's routing) fits the
                            // bound the generator checked.
                            let sizes = moe::Sizes { tokens, tokens_odd, hidden, ffn, top_k, experts, dtype, spread };
                            let capacity = moe::capacity_for(&sizes, nranks, data_seed, slack).unwrap();
                            assert!(
                                (64 << 10) + capacity * hidden * 2 <= call.region_bytes(nranks),
                                "{call:?}: capacity {capacity}"
                            );
                            moe_capacity_seen = true;
                        }
                        ops.insert(call.ops()[0]);
                    }
                    assert_eq!(ops.len(), KINDS.len(), "round {round} at {nranks} ranks: {ops:?}");
                }
                assert!(moe_capacity_seen);
            }
        }
    }

    /// The sizes reach both ends: decode shapes and the larger ones, every collective dtype.
    #[test]
    fn shapes_span_decode_to_large() {
        let mut plan = Plan::new(42, 4);
        let (mut small_k, mut big_gemm, mut one_row, mut two_phase, mut causal_odd) =
            (false, false, false, false, false);
        let mut types = BTreeSet::new();
        for _ in 0..3000 {
            match plan.next_call().0 {
                Call::Gemm { k: 8, .. } => small_k = true,
                Call::Gemm { m, n, .. } if m * n >= 256 * 256 => big_gemm = true,
                Call::AllGatherGemm { rows: 1, .. } => one_row = true,
                Call::GemmReduce { scatter: false, m, .. } if m % (4 * 128) == 0 && m > 256 => two_phase = true,
                Call::RingAttention { causal, seq_local, .. } => {
                    assert!(!causal || seq_local % 2 == 0);
                    causal_odd |= causal && (seq_local / 2) % 2 == 1;
                }
                Call::Collective { dtype, .. } => {
                    types.insert(dtype.name());
                }
                _ => {}
            }
        }
        assert!(small_k && big_gemm && one_row && two_phase && causal_odd);
        assert_eq!(types.len(), mkDataType_t::ALL.len());
    }

    /// The legality check rejects what the library rejects (else the test above proves nothing).
    #[test]
    fn illegal_calls_are_rejected() {
        let bf16 = mkDataType_t::mkBfloat16;
        for call in [
            Call::Gemm { dtype: bf16, m: 4, n: 4, k: 12 },
            Call::AllGatherGemm { dtype: bf16, rows: 4, n: 12, k: 8, with_gathered: false },
            Call::AllGatherGemm { dtype: bf16, rows: 8192, n: 8, k: 4096, with_gathered: false },
            Call::GemmReduce { scatter: true, dtype: bf16, m: 5, n: 8, k: 8 },
            Call::GemmReduce { scatter: false, dtype: bf16, m: 5, n: 8, k: 0 },
            Call::Moe {
                dtype: bf16,
                tokens: 4,
                tokens_odd: 4,
                hidden: 100,
                ffn: 128,
                top_k: 2,
                experts: 4,
                spread: 4,
                slack: 0,
            },
            Call::RingAttention {
                dtype: bf16,
                batch: 1,
                seq_local: 5,
                heads: 4,
                kv_heads: 2,
                head_dim: 64,
                causal: true,
            },
            Call::RingAttention {
                dtype: bf16,
                batch: 1,
                seq_local: 4,
                heads: 4,
                kv_heads: 3,
                head_dim: 64,
                causal: false,
            },
        ] {
            assert!(check_legal(&call, 2, 1).is_err(), "{call:?}");
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_calls_and_another_seed_others() {
        let calls = |seed| {
            let mut plan = Plan::new(seed, 4);
            (0..200).map(|_| plan.next_call()).collect::<Vec<_>>()
        };
        assert_eq!(calls(7), calls(7));
        assert_ne!(calls(7), calls(8));
    }

    #[test]
    fn seeds_parse_in_decimal_and_hex() {
        assert_eq!(parse_seed("123"), Some(123));
        assert_eq!(parse_seed(" 0xff "), Some(255));
        assert_eq!(parse_seed("0XFF"), Some(255));
        assert_eq!(parse_seed(&format!("{:#x}", u64::MAX)), Some(u64::MAX));
        assert_eq!(parse_seed("12abc"), None);
        assert_eq!(parse_seed(""), None);
    }

    #[test]
    fn sized_draws_stay_in_range_and_reach_both_ends() {
        let mut rng = Rng::new(3);
        let (mut lo_seen, mut hi_seen) = (false, false);
        for _ in 0..20_000 {
            let v = rng.sized(3, 300);
            assert!((3..=300).contains(&v));
            lo_seen |= v == 3;
            hi_seen |= v == 300;
        }
        assert!(lo_seen && hi_seen);
        assert_eq!(Rng::new(5).sized(1, 1), 1);
    }
}
