//! Fused ops of different kernels back to back on one communicator, with no barrier between
//! the ranks: AllGather + GEMM, MoE dispatch + combine, GEMM + AllReduce, ring attention and
//! GEMM + ReduceScatter. MoE's dispatch writes its counts into every rank's region as it
//! starts, so right after the held-back rank's AllGather + GEMM (below) it is the op most
//! exposed to the race the fence closes.
//! All of them keep their buffers in the same fused-op region of every rank, and each
//! orders itself only against its own previous call, so every switch of kernel depends on
//! the fence between them (ops::common::fused_fence): without it a fast rank's next op overwrites
//! what a slow peer is still reading.
//!
//! Per round: fresh inputs for every case (outputs poisoned), the five ops launched one
//! after another on one stream, one bounded wait, every output checked against its float64
//! reference. In each round one rank (a different one each round) is held back: a large
//! memset on its stream before each of its ops, so the others reach each op first and
//! whatever an op lets them finish before the slow rank does, they finish first. Then the
//! sequence captured in one CUDA graph (the slow rank's memsets in it too) and replayed on
//! fresh inputs, each replay followed at once, without a host sync, by a direct
//! AllGather + GEMM: a switch of kernel after a replay the host never saw, which only the
//! fence the graph ends with orders.
//!
//! The nodes suite runs the sequence across emulated nodes too (`across_nodes`), where the
//! fence also exchanges fence numbers between nodes through the proxies.

use crate::collectives::{ffi, say, Stream};
use crate::fused_common::{self, FusedCase};
use crate::outcome::Outcome;
use crate::ranks::RankEnv;
use mkernel::comm::Comm;
use mkernel::cuda::sys;
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::mkComm_t;
use mkernel::types::mkDataType_t;
use mkernel_tools::testing::{CapturedGraph, TestBuffer};
use std::cell::Cell;

pub fn run() -> Result<Outcome> {
    fused_common::run_suite(
        "mixed",
        |comm, _control, rank, n| back_to_back(comm, rank, n, false).and_then(|_| graph_replay(comm, rank, n, false)),
        absent_rank,
    )
}

/// Rounds of the sequence with fresh inputs: enough for every rank of 8 to be the slow one.
const ROUNDS: u64 = 8;

/// Replays of the captured sequence.
const REPLAYS: u64 = 3;

/// Bytes the slow rank's memset writes before each of its ops: ~0.1 ms of an H100's
/// bandwidth, many times one of the sequence's ops, so the others are a whole op ahead.
const DELAY_BYTES: usize = 256 << 20;

/// Holds one rank back: a memset of DELAY_BYTES on its stream before each op while it is
/// the slow rank.
struct Delay {
    scratch: TestBuffer,
    rank: usize,
    slow: Cell<Option<usize>>,
}

impl Delay {
    fn new(rank: usize) -> Result<Delay> {
        Ok(Delay { scratch: TestBuffer::new(DELAY_BYTES, mkDataType_t::mkUint8)?, rank, slow: Cell::new(None) })
    }

    fn enqueue(&self, stream: sys::CUstream) -> Result<()> {
        if self.slow.get() == Some(self.rank) {
            self.scratch.poison(stream)
        } else {
            Ok(())
        }
    }
}

/// A case whose launch on the slow rank comes after the delay.
struct Slowed<'a> {
    case: &'a dyn FusedCase,
    delay: &'a Delay,
}

impl FusedCase for Slowed<'_> {
    fn label(&self) -> String {
        self.case.label()
    }
    fn prepare(&self, seed: u64) -> Result<()> {
        self.case.prepare(seed)
    }
    fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        match self.delay.enqueue(stream) {
            Ok(()) => self.case.launch(comm, stream),
            Err(e) => e.code,
        }
    }
    fn verify(&self) -> Result<(bool, String)> {
        self.case.verify()
    }
}

/// The ops, small enough that a round takes milliseconds (so ranks drift apart by whole
/// ops), each of a different kernel family than the one before it.
struct Sequence {
    all_gather_gemm: crate::ag_gemm::Case,
    /// On one node only (MoE does not run across nodes).
    moe: Option<crate::moe::Case>,
    gemm_all_reduce: crate::gemm_reduce::Case,
    /// Ring attention on one node; across nodes (where ring attention does not run) a second
    /// AllGather + GEMM of another shape.
    third: Box<dyn FusedCase>,
    gemm_reduce_scatter: crate::gemm_reduce::Case,
}

impl Sequence {
    fn new(n: usize, rank: usize, across_nodes: bool) -> Result<Sequence> {
        let bf16 = mkDataType_t::mkBfloat16;
        let third: Box<dyn FusedCase> = match across_nodes {
            true => Box::new(crate::ag_gemm::Case::new(bf16, 64 * n, 256, 512, n, rank)?),
            false => Box::new(crate::ring_attn::Case::new(bf16, 1, 128, 4, 2, 128, true, n, rank)?),
        };
        let mut seq = Sequence {
            all_gather_gemm: crate::ag_gemm::Case::new(bf16, 128, 512, 256, n, rank)?,
            moe: if across_nodes { None } else { Some(moe_case(n, rank)?) },
            gemm_all_reduce: crate::gemm_reduce::Case::new(false, bf16, 256, 512, 256, n, rank)?,
            third,
            gemm_reduce_scatter: crate::gemm_reduce::Case::new(true, bf16, 128 * n, 512, 256, n, rank)?,
        };
        // Across nodes the sums add node partials first (the reference's bound allows for it).
        seq.gemm_all_reduce.node_partials = across_nodes;
        seq.gemm_reduce_scatter.node_partials = across_nodes;
        Ok(seq)
    }

    /// In launch order: a different kernel family after every one.
    fn cases(&self) -> Vec<&dyn FusedCase> {
        let mut cases: Vec<&dyn FusedCase> = vec![&self.all_gather_gemm];
        if let Some(moe) = &self.moe {
            cases.push(moe);
        }
        cases.extend([&self.gemm_all_reduce as &dyn FusedCase, self.third.as_ref(), &self.gemm_reduce_scatter]);
        cases
    }
}

/// A small MoE dispatch + combine (skewed routing, fresh with every seed) whose receive
/// capacity holds any routing: every token's choices on one rank, and each local expert's
/// last block padded.
fn moe_case(n: usize, rank: usize) -> Result<crate::moe::Case> {
    let s = crate::moe::small_sizes();
    let block = mkernel::ops::moe::ROW_BLOCK;
    let capacity = ((n * s.tokens * s.top_k).div_ceil(block) + s.experts / n) * block;
    crate::moe::Case::new(s, n, rank, capacity)
}

/// The sequence on a communicator across (emulated) nodes, where the fence also exchanges
/// fence numbers between nodes: AllGather + GEMM, GEMM + AllReduce, AllGather + GEMM
/// again, GEMM + ReduceScatter, directly and in one graph (the nodes suite runs it).
pub fn across_nodes(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    back_to_back(comm, rank, n, true).and_then(|_| graph_replay(comm, rank, n, true))
}

fn back_to_back(comm: mkComm_t, rank: usize, n: usize, across_nodes: bool) -> Result<()> {
    let seq = Sequence::new(n, rank, across_nodes)?;
    let delay = Delay::new(rank)?;
    let slowed: Vec<Slowed> = seq.cases().into_iter().map(|case| Slowed { case, delay: &delay }).collect();
    let cases: Vec<&dyn FusedCase> = slowed.iter().map(|c| c as &dyn FusedCase).collect();
    let slow_rank_of = |round: u64| delay.slow.set((n > 1).then_some(round as usize % n));
    let (checks, failures) = fused_common::check_rounds_of(
        comm,
        rank,
        "mixed",
        &cases,
        1,
        fused_common::case_rounds(ROUNDS),
        &slow_rank_of,
    )?;
    fused_common::count_checks(rank, "mixed", checks, failures)
}

/// The sequence captured in one graph (the last rank held back inside it), then per replay:
/// fresh inputs, the replay and right behind it a direct AllGather + GEMM on buffers of its
/// own, one wait, every output checked. The graph ends with GEMM + ReduceScatter, so the
/// direct call switches kernels after a replay the host cannot see.
fn graph_replay(comm: mkComm_t, rank: usize, n: usize, across_nodes: bool) -> Result<()> {
    let seq = Sequence::new(n, rank, across_nodes)?;
    let delay = Delay::new(rank)?;
    delay.slow.set((n > 1).then_some(n - 1));
    let slowed: Vec<Slowed> = seq.cases().into_iter().map(|case| Slowed { case, delay: &delay }).collect();
    let direct = crate::ag_gemm::Case::new(mkDataType_t::mkBfloat16, 128, 512, 256, n, rank)?;
    let stream = Stream::for_rank()?;
    for (i, c) in slowed.iter().enumerate() {
        c.prepare(500 + i as u64)?;
    }
    fused_common::peers_ready()?;
    let graph = CapturedGraph::capture(stream.0, |s| {
        slowed.iter().try_for_each(|c| ffi(&format!("mixed {} (captured)", c.label()), c.launch(comm, s), comm))
    })?;
    let mut failures = 0;
    let replays = fused_common::case_rounds(REPLAYS);
    for replay in 0..replays {
        for (i, c) in slowed.iter().enumerate() {
            c.prepare(600 + 10 * i as u64 + replay)?;
        }
        direct.prepare(700 + replay)?;
        fused_common::peers_ready()?;
        graph.launch(stream.0)?;
        ffi(&format!("mixed {} after a replay", direct.label()), direct.launch(comm, stream.0), comm)?;
        fused_common::sync_no_error(comm, &stream, &format!("mixed graph replay {replay} and a direct call"))?;
        let checked = slowed.iter().map(|c| c as &dyn FusedCase).chain([&direct as &dyn FusedCase]);
        for (i, case) in checked.enumerate() {
            let (ok, detail) = case.verify()?;
            crate::outcome::count(1);
            if !ok {
                failures += 1;
                let what = if i == slowed.len() { "direct call after the replay" } else { "in the graph" };
                say(rank, format!("graph replay {replay}, {what}: {} {detail} -> WRONG", case.label()));
            }
        }
    }
    say(
        rank,
        format!(
            "graph capture: {} launches x {replays} replays, each followed by a direct call, {failures} wrong",
            slowed.len()
        ),
    );
    if failures > 0 {
        return Err(MkError::internal("mixed: graph replay or the direct call after it gave wrong results"));
    }
    Ok(())
}

fn absent_rank(env: &RankEnv, control: &Comm) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let seq = Sequence::new(n, rank, false)?;
    fused_common::absent_rank(env, control, 2, "a fused op after another kernel's (a rank absent)", |comm, stream| {
        seq.gemm_all_reduce.prepare(5)?;
        seq.all_gather_gemm.prepare(6)?;
        // The others' AllReduce and the fence after it wait for the absent rank.
        let first = seq.gemm_all_reduce.launch(comm, stream);
        if first != mkResult_t::mkSuccess {
            return Ok(first);
        }
        Ok(seq.all_gather_gemm.launch(comm, stream))
    })
}
