//! Fused ops of different kernels back to back on one communicator, with no barrier between
//! the ranks: AllGather + GEMM, GEMM + AllReduce, GEMM + ReduceScatter and ring attention.
//! All of them keep their buffers in the same fused-op region of every rank, and each
//! orders itself only against its own previous call, so every switch of kernel depends on
//! the fence between them (ops::fused_fence): without it a fast rank's next op overwrites
//! what a slow peer is still reading.
//!
//! Per round: fresh inputs for every case (outputs poisoned), the four ops launched one
//! after another on one stream, one bounded wait, every output checked against its float64
//! reference. Then the sequence captured in one CUDA graph and replayed on fresh inputs,
//! with a direct call between replays (a graph may be replayed after any op).
//!
//! The nodes suite runs the sequence across emulated nodes too (`across_nodes`), where the
//! fence also exchanges fence numbers between nodes through the proxies.

use crate::fused_common::{self, Captured, FusedCase};
use crate::outcome::Outcome;
use crate::ranks::RankEnv;
use mkernel::comm::Comm;
use mkernel::error::{mkResult_t, Result};
use mkernel::ffi::mkComm_t;
use mkernel::types::mkDataType_t;

pub fn run() -> Result<Outcome> {
    fused_common::run_suite(
        "mixed",
        |comm, _control, rank, n| back_to_back(comm, rank, n, false).and_then(|_| graph_replay(comm, rank, n, false)),
        absent_rank,
    )
}

/// Rounds of the sequence with fresh inputs.
const ROUNDS: u64 = 6;

/// Four ops, small enough that a round takes milliseconds (so ranks drift apart by whole
/// ops), each of a different kernel family than the one before it.
struct Sequence {
    all_gather_gemm: crate::ag_gemm::Case,
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
    fn cases(&self) -> [&dyn FusedCase; 4] {
        [&self.all_gather_gemm, &self.gemm_all_reduce, self.third.as_ref(), &self.gemm_reduce_scatter]
    }
}

/// The sequence on a communicator across (emulated) nodes, where the fence also exchanges
/// fence numbers between nodes: AllGather + GEMM, GEMM + AllReduce, AllGather + GEMM
/// again, GEMM + ReduceScatter, directly and in one graph (the nodes suite runs it).
pub fn across_nodes(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    back_to_back(comm, rank, n, true).and_then(|_| graph_replay(comm, rank, n, true))
}

fn back_to_back(comm: mkComm_t, rank: usize, n: usize, across_nodes: bool) -> Result<()> {
    let seq = Sequence::new(n, rank, across_nodes)?;
    let (checks, failures) = fused_common::check_rounds_of(comm, rank, "mixed", &seq.cases(), 1, ROUNDS, &|_| {})?;
    fused_common::count_checks(rank, "mixed", checks, failures)
}

fn graph_replay(comm: mkComm_t, rank: usize, n: usize, across_nodes: bool) -> Result<()> {
    let seq = Sequence::new(n, rank, across_nodes)?;
    let captured: Vec<Captured> = seq
        .cases()
        .into_iter()
        .enumerate()
        .map(|(i, case)| Captured { case, capture_seed: 500 + i as u64, replay_seed: 600 + 10 * i as u64 })
        .collect();
    fused_common::graph_replay_of(comm, rank, "mixed", &captured, 1, 700)
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
