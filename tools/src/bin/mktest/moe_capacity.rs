//! The MoE dispatch's two answers to rows beyond the room it has, on the GPU with
//! MK_TEST_NRANKS ranks:
//! - no-drop mode, recvCapacity one block short: the call moves nothing (y and the
//!   combine's out keep their NaN poison), every rank reads the same needed capacity in
//!   recvCounts[E_local], the communicator records no error, and a retry with that capacity
//!   on the same communicator is checked element-wise against float64;
//! - drop mode (mkMoeDispatchGemmWithOptions): a cap below the hot expert's rows, so rows
//!   are dropped on every rank; Y, recvCounts, the drop counts and the combine (dropped
//!   choices add nothing) against the host mirror and float64, then in a CUDA graph.

use crate::collectives::{async_error, ffi, last_error, say, Stream};
use crate::fused_common::{self, FusedCase};
use crate::moe::{capacity_for, capacity_with_drop, routing, tokens_of, Case, Sizes};
use crate::outcome;
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::mkComm_t;
use mkernel::ops::moe::{drop_counts, MoeShape, ROW_BLOCK};
use mkernel::types::mkDataType_t;

/// Skewed routing (a hot expert takes about a third of the choices) over 8 experts.
fn sizes() -> Sizes {
    Sizes {
        tokens: 200,
        tokens_odd: 150,
        hidden: 256,
        ffn: 128,
        top_k: 2,
        experts: 8,
        dtype: mkDataType_t::mkBfloat16,
        spread: 8,
    }
}

/// True when every value is NaN: the poison `fresh_inputs` wrote is still there.
fn untouched(values: &[f64]) -> bool {
    values.iter().all(|v| v.is_nan())
}

/// No-drop mode: an overflowing call, then the retry with the capacity it reported.
pub fn overflow_then_retry(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let stream = Stream::for_rank()?;
    let (s, seed) = (sizes(), 77);
    let needed = capacity_for(&s, n, seed, 0)?;
    let short = Case::new(s, n, rank, needed - ROW_BLOCK)?;
    short.prepare(seed)?;
    fused_common::peers_ready()?;
    // The dispatch and a combine on its layout: neither may move anything.
    ffi("mkMoeDispatchGemm (recvCapacity too small)", short.dispatch(comm, stream.0), comm)?;
    ffi("mkMoeGemmCombine after the overflow", short.combine(comm, stream.0), comm)?;
    fused_common::sync_no_error(comm, &stream, "MoE overflow: the calls end without an error")?;
    let counts = short.recv_counts()?;
    let reported = *counts.last().unwrap() as usize;
    let (y_kept, out_kept) = (untouched(&short.y().download_f64()?), untouched(&short.out().download_f64()?));
    let ok = reported == needed && y_kept && out_kept && async_error(comm) == mkResult_t::mkSuccess;
    say(
        rank,
        format!(
            "MoE overflow: recvCapacity {} for {needed} rows: recvCounts[E_local] {reported}, y untouched {y_kept}, out \
             untouched {out_kept}, communicator {:?} -> {}",
            needed - ROW_BLOCK,
            async_error(comm),
            if ok { "ok" } else { "WRONG" }
        ),
    );
    outcome::count(1);
    if !ok {
        return Err(MkError::internal(format!(
            "MoE capacity overflow not handled as specified (last error: {})",
            last_error(comm)
        )));
    }
    // The retry: the capacity the call reported, on the same communicator, checked.
    let retry = Case::new(s, n, rank, reported)?;
    let (checks, failures) =
        fused_common::check_rounds(comm, rank, "MoE retry after an overflow", &retry, seed, 1, &|_| {})?;
    fused_common::count_checks(rank, "MoE retry after an overflow", checks, failures)
}

/// The drop-mode cap of the test: rows per (rank, expert) at capacity factor 1 of the even
/// ranks' tokens, below what the hot expert gets from each rank.
fn expert_capacity(s: &Sizes) -> usize {
    (s.tokens * s.top_k).div_ceil(s.experts)
}

/// Drop mode: rounds checked against the host mirror and float64, then graph replays.
pub fn drop_mode(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let s = sizes();
    let cap = expert_capacity(&s);
    let (first_seed, rounds) = (300, 2);
    let seeds: Vec<u64> = (first_seed..first_seed + rounds).chain(fused_common::graph_replay_seeds()).collect();
    let mut recv_capacity = 0;
    for &seed in &seeds {
        recv_capacity = recv_capacity.max(capacity_with_drop(&s, n, seed, 0, Some(cap))?);
        // The test means something only if rows are dropped: the hot expert's, at least.
        let (ids, _) = routing(&s, n, seed);
        let dropped: usize = (0..n)
            .map(|r| {
                let shape =
                    MoeShape { expert_capacity: Some(cap), ..MoeShape::new(tokens_of(&s, r), s.top_k, s.experts, n) };
                drop_counts(&shape, &ids[r]).iter().sum::<usize>()
            })
            .sum();
        if dropped == 0 {
            return Err(MkError::internal(format!("MoE drop mode: seed {seed} drops no row at cap {cap}")));
        }
    }
    let case = Case::with_policy(s, n, rank, recv_capacity, Some(cap))?;
    let (checks, failures) =
        fused_common::check_rounds(comm, rank, "MoE drop mode", &case, first_seed, rounds, &|_| {})?;
    fused_common::count_checks(rank, "MoE drop mode", checks, failures)?;
    fused_common::graph_replay(comm, rank, "MoE drop mode dispatch+combine", &case)
}
