//! mkGemmReduceScatter and mkGemmAllReduce on the GPU with MK_TEST_NRANKS ranks.
//!
//! Per rank: both ops × both dtypes × shapes (decode sizes: 1-16 rows per rank for
//! GEMM+RS, M = 1..16 for GEMM+AR; K = 8; N = 8; M odd; N, K off the tile grid) against a
//! float64 CPU reference of Σ_r A_r·B_rᵀ element by element (every rank regenerates every
//! rank's inputs from their seeds, one allocation per rank, guard bands checked); AllReduce outputs must be bitwise identical on every
//! rank; every shape twice with fresh inputs; capture in a CUDA graph and replay with fresh
//! inputs; and, with several ranks, a rank that never calls.

use crate::collectives::{async_error, ffi, say, Stream};
use crate::fused_common;
use crate::outcome::{self, Outcome};
use crate::ranks::RankEnv;
use mkernel::comm::Comm;
use mkernel::cuda::{self, sys};
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::fused::{mkGemmAllReduce, mkGemmReduceScatter};
use mkernel::ffi::mkComm_t;
use mkernel::testing::{check_close, to_f64, tolerance, unit_roundoff, Rule, TestBuffer, Verdict};
use mkernel::types::mkDataType_t;

pub fn run() -> Result<Outcome> {
    fused_common::run_suite(
        "gemm_reduce",
        |comm, control, rank, n| {
            correctness(comm, control, rank, n, false).and_then(|_| graph_replay(comm, rank, n, false))
        },
        absent_rank,
    )
}

pub(crate) struct Case {
    scatter: bool,
    dtype: mkDataType_t,
    m: usize,
    n: usize,
    k: usize,
    nranks: usize,
    rank: usize,
    /// Every rank's A and B, one allocation each (each rank regenerates all of them for the
    /// reference and passes its own).
    a_shards: Vec<TestBuffer>,
    b_shards: Vec<TestBuffer>,
    c: TestBuffer,
    /// The communicator spans nodes: each node's partial is rounded once more.
    pub(crate) node_partials: bool,
}

impl Case {
    pub(crate) fn new(
        scatter: bool,
        dtype: mkDataType_t,
        m: usize,
        n: usize,
        k: usize,
        nranks: usize,
        rank: usize,
    ) -> Result<Case> {
        let rows_out = if scatter { m / nranks } else { m };
        Ok(Case {
            scatter,
            dtype,
            m,
            n,
            k,
            nranks,
            rank,
            a_shards: (0..nranks).map(|_| TestBuffer::new(m * k, dtype)).collect::<Result<_>>()?,
            b_shards: (0..nranks).map(|_| TestBuffer::new(n * k, dtype)).collect::<Result<_>>()?,
            c: TestBuffer::new(rows_out * n, dtype)?,
            node_partials: false,
        })
    }

    pub(crate) fn label(&self) -> String {
        format!(
            "{} {} M={} N={} K={}",
            if self.scatter { "GEMM+RS" } else { "GEMM+AR" },
            self.dtype.name(),
            self.m,
            self.n,
            self.k
        )
    }

    pub(crate) fn prepare(&self, seed: u64) -> Result<()> {
        fused_common::fill_shards(&self.a_shards, seed * 100, 1.0)?;
        fused_common::fill_shards(&self.b_shards, seed * 100 + 50, 1.0)?;
        self.c.poison(std::ptr::null_mut())?;
        fused_common::sync_default_stream()
    }

    pub(crate) fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        let (a, b) = (self.a_shards[self.rank].ptr(), self.b_shards[self.rank].ptr());
        let f = if self.scatter { mkGemmReduceScatter } else { mkGemmAllReduce };
        // SAFETY: device buffers of the sizes the op expects.
        unsafe {
            f(
                a as *const _,
                b as *const _,
                self.c.ptr() as *mut _,
                self.m,
                self.n,
                self.k,
                self.dtype as i32,
                comm,
                stream,
            )
        }
    }

    /// (passed, detail, raw output bytes). Each element is Σ_r p_r with p_r rank r's dot
    /// product of K terms: its bound is each partial's (accumulated over K, rounded to the
    /// element type when there are several ranks) plus the fp32 sum of the n partials and
    /// its one rounding, plus one more rounding of the node partials across nodes.
    pub(crate) fn verify(&self) -> Result<(bool, String, Vec<u8>)> {
        let (m, n, k, nr) = (self.m, self.n, self.k, self.nranks);
        let a: Vec<Vec<f64>> = self.a_shards.iter().map(|s| s.download_f64()).collect::<Result<_>>()?;
        let b: Vec<Vec<f64>> = self.b_shards.iter().map(|s| s.download_f64()).collect::<Result<_>>()?;
        let raw = self.c.download()?;
        let (r0, r1) = if self.scatter { (self.rank * m / nr, (self.rank + 1) * m / nr) } else { (0, m) };
        let out = to_f64(&raw, self.dtype);
        let (reference, bounds) = reduced_reference(&a, &b, r0..r1, n, k, self.dtype, self.node_partials);
        let verdict: Verdict = check_close(&out, &reference, &bounds, tolerance(self.dtype));
        let mut buffers: Vec<(&str, &TestBuffer)> = vec![("C", &self.c)];
        buffers
            .extend(self.a_shards.iter().map(|s| ("A shard", s)).chain(self.b_shards.iter().map(|s| ("B shard", s))));
        let guards = fused_common::guards_intact(&buffers)?;
        let ok = verdict.passed() && guards.is_none();
        Ok((ok, format!("{verdict}{}", guards.map_or(String::new(), |w| format!("; GUARD {w}"))), raw))
    }
}

/// Rows `rows` of Σ_r A_r·B_rᵀ in float64 (A_r [M, K], B_r [N, K] per rank) and each
/// element's bound: each rank's partial accumulated over K and, with several ranks, stored
/// in the element type; the n partials summed in fp32 and rounded once; across nodes one
/// more rounding of the node partials.
pub(crate) fn reduced_reference(
    a: &[Vec<f64>],
    b: &[Vec<f64>],
    rows: std::ops::Range<usize>,
    n: usize,
    k: usize,
    dtype: mkDataType_t,
    node_partials: bool,
) -> (Vec<f64>, Vec<f64>) {
    let nr = a.len();
    let u = unit_roundoff(dtype);
    let partial_rule = Rule::reduction(dtype, k);
    let sum_rule = Rule::reduction(dtype, nr);
    let mut reference = Vec::with_capacity(rows.len() * n);
    let mut bounds = Vec::with_capacity(rows.len() * n);
    for i in rows {
        for j in 0..n {
            let (mut total, mut partials_abs, mut partial_slack) = (0.0, 0.0, 0.0);
            for r in 0..nr {
                let (ar, br) = (&a[r][i * k..(i + 1) * k], &b[r][j * k..(j + 1) * k]);
                let (p, mag) = ar.iter().zip(br).fold((0.0, 0.0), |(s, g), (x, y)| (s + x * y, g + (x * y).abs()));
                total += p;
                partials_abs += p.abs();
                // One rank: the GEMM alone, no partial stored in the element type.
                partial_slack += if nr > 1 { partial_rule.bound(p, mag) } else { partial_rule.gamma * mag };
            }
            let node_slack = if node_partials { u * partials_abs } else { 0.0 };
            reference.push(total);
            bounds.push(partial_slack + node_slack + sum_rule.bound(total, partials_abs));
        }
    }
    (reference, bounds)
}

/// `across_nodes`: the communicator spans nodes (the node partials' rounding is allowed for).
pub(crate) fn correctness(comm: mkComm_t, control: &Comm, rank: usize, n: usize, across_nodes: bool) -> Result<()> {
    let stream = Stream::new()?;
    let (mut checks, mut failures) = (0, 0);
    for scatter in [true, false] {
        for dtype in [mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16] {
            // (M, N, K): decode-sized and odd M (AllReduce, one-shot), shards off the tile
            // grid; M = n·384 and n·256 take the two-phase AllReduce when n > 1. N = 4360
            // (18 tiles of 256, the last partial) gives more reducer items than the 8-32
            // CTAs of a shared GPU, with a partial last wave: for GEMM+RS the early-sum
            // kernels (ops::gemm_reduce::early_items), with K = 72 a GEMM short enough that
            // the side warps are often stopped inside an item and the 12 warps finish it.
            // Decode sizes (1-16 rows per rank for GEMM+RS, M = 1..16 for GEMM+AR), K = 8
            // (one MMA step), N = 8, and a partial tile in every dimension.
            let shapes: Vec<(usize, usize, usize)> = if scatter {
                vec![
                    (n, 264, 72),
                    (n * 5, 8, 8),
                    (n * 16, 520, 8),
                    (n * 97, 264, 72),
                    (n * 128, 520, 136),
                    (n * 333, 776, 264),
                    (n * 300, 4360, 72),
                ]
            } else {
                vec![
                    (1, 264, 72),
                    (3, 264, 8),
                    (16, 8, 136),
                    (7, 520, 136),
                    (64, 1032, 256),
                    (255, 776, 264),
                    (n * 200 + 3, 392, 200),
                    (n * 384, 776, 264),
                    (n * 256, 1032, 136),
                    (250, 4360, 72),
                ]
            };
            for (m, cols, k) in shapes {
                let mut case = Case::new(scatter, dtype, m, cols, k, n, rank)?;
                case.node_partials = across_nodes;
                for round in 0..2u64 {
                    case.prepare(7 + round)?;
                    ffi(&case.label(), case.launch(comm, stream.0), comm)?;
                    stream.sync()?;
                    if async_error(comm) != mkResult_t::mkSuccess {
                        return Err(MkError::new(async_error(comm), format!("{}: asynchronous error", case.label())));
                    }
                    let (mut ok, mut detail, raw) = case.verify()?;
                    if !scatter {
                        // Every rank's C must be the same bits.
                        let digest = mkernel::bootstrap::crypto::sha256(&[&raw]);
                        let all = control.bootstrap.allgather(&digest)?;
                        if all.iter().any(|d| d[..] != digest[..]) {
                            ok = false;
                            detail.push_str(", ranks' outputs DIFFER");
                        } else {
                            detail.push_str(", identical on all ranks");
                        }
                    }
                    checks += 1;
                    if !ok {
                        failures += 1;
                    }
                    if !ok || rank == 0 {
                        say(
                            rank,
                            format!("{} round {round}: {detail} -> {}", case.label(), if ok { "ok" } else { "WRONG" }),
                        );
                    }
                }
            }
        }
    }
    outcome::count(checks);
    say(rank, format!("correctness: {checks} checks, {failures} wrong"));
    if failures > 0 {
        return Err(MkError::internal(format!("GEMM + reduction: {failures} of {checks} checks wrong")));
    }
    Ok(())
}

pub(crate) fn graph_replay(comm: mkComm_t, rank: usize, n: usize, across_nodes: bool) -> Result<()> {
    let stream = Stream::new()?;
    let mut rs = Case::new(true, mkDataType_t::mkBfloat16, n * 160, 392, 200, n, rank)?;
    let mut ar = Case::new(false, mkDataType_t::mkFloat16, 33, 264, 136, n, rank)?;
    let mut ar2 = Case::new(false, mkDataType_t::mkBfloat16, n * 384, 264, 136, n, rank)?; // two-phase when n > 1
    let mut ar3 = Case::new(false, mkDataType_t::mkBfloat16, 200, 776, 136, n, rank)?; // one-shot, M not a multiple of 128: every rank sums every tile
    for c in [&mut rs, &mut ar, &mut ar2, &mut ar3] {
        c.node_partials = across_nodes;
    }
    rs.prepare(1)?;
    ar.prepare(2)?;
    ar2.prepare(3)?;
    ar3.prepare(4)?;
    // SAFETY: capture on a live non-default stream; the launches are our ops.
    unsafe {
        cuda::check(
            "cuStreamBeginCapture",
            sys::cuStreamBeginCapture_v2(stream.0, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL),
        )?
    };
    let launched =
        [rs.launch(comm, stream.0), ar.launch(comm, stream.0), ar2.launch(comm, stream.0), ar3.launch(comm, stream.0)];
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above.
    cuda::check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(stream.0, &mut graph) })?;
    for r in launched {
        ffi("captured launch", r, comm)?;
    }
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: graph from the capture.
    cuda::check("cuGraphInstantiate", unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) })?;
    let mut failures = 0;
    for replay in 0..3u64 {
        rs.prepare(10 + replay)?;
        ar.prepare(20 + replay)?;
        ar2.prepare(40 + replay)?;
        ar3.prepare(50 + replay)?;
        // SAFETY: instantiated graph, live stream.
        cuda::check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(exec, stream.0) })?;
        stream.sync()?;
        if async_error(comm) != mkResult_t::mkSuccess {
            return Err(MkError::new(async_error(comm), "asynchronous error during graph replay"));
        }
        for c in [&rs, &ar, &ar2, &ar3] {
            let (ok, detail, _) = c.verify()?;
            outcome::count(1);
            if !ok {
                failures += 1;
                say(rank, format!("graph replay {replay}: {} {detail} -> WRONG", c.label()));
            }
        }
        // A direct call between replays keeps the device-side epochs in step.
        ar.prepare(30 + replay)?;
        ffi("mkGemmAllReduce", ar.launch(comm, stream.0), comm)?;
        stream.sync()?;
        let (ok, detail, _) = ar.verify()?;
        outcome::count(1);
        if !ok {
            failures += 1;
            say(rank, format!("call between replays: {detail} -> WRONG"));
        }
    }
    // SAFETY: destroyed once.
    unsafe {
        sys::cuGraphExecDestroy(exec);
        sys::cuGraphDestroy(graph);
    }
    say(rank, format!("graph capture: 4 launches x 3 replays + 3 direct calls with fresh inputs, {failures} wrong"));
    if failures > 0 {
        return Err(MkError::internal("GEMM + reduction graph replay gave wrong results"));
    }
    Ok(())
}

fn absent_rank(env: &RankEnv, control: &Comm) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let case = Case::new(true, mkDataType_t::mkBfloat16, n * 256, 1024, 512, n, rank)?;
    fused_common::absent_rank(env, control, 2, "mkGemmReduceScatter (a rank absent)", |comm, stream| {
        case.prepare(5)?;
        Ok(case.launch(comm, stream))
    })?;
    // The one-shot AllReduce (M = 200 is not a multiple of 128): every rank waits for every
    // peer's partials, so the absent rank is seen by all.
    let case = Case::new(false, mkDataType_t::mkBfloat16, 200, 1024, 512, n, rank)?;
    fused_common::absent_rank(env, control, 3, "mkGemmAllReduce (a rank absent)", |comm, stream| {
        case.prepare(6)?;
        Ok(case.launch(comm, stream))
    })
}

#[cfg(test)]
mod tests {
    //! The bound against the rounding the header documents, simulated on the CPU: each
    //! rank's partial accumulated in f32 and rounded to the element type, the partials
    //! summed in f32 in rank order (within each node first, across nodes) and rounded once.
    use super::*;
    use mkernel::testing::round_to;

    fn values(seed: u64, n: usize, dtype: mkDataType_t) -> Vec<f64> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                round_to(dtype, (x >> 11) as f64 / (1u64 << 52) as f64 - 1.0)
            })
            .collect()
    }

    fn simulated(
        a: &[Vec<f64>],
        b: &[Vec<f64>],
        m: usize,
        n: usize,
        k: usize,
        dtype: mkDataType_t,
        node_size: usize,
        drop_rank: Option<(usize, usize)>,
    ) -> Vec<f64> {
        let nr = a.len();
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let partial = |r: usize| -> f32 {
                    let p = (0..k).fold(0f32, |s, kk| s + (a[r][i * k + kk] * b[r][j * k + kk]) as f32);
                    if nr > 1 {
                        round_to(dtype, p as f64) as f32
                    } else {
                        p
                    }
                };
                let mut total = 0f32;
                for node in (0..nr).collect::<Vec<_>>().chunks(node_size) {
                    let s =
                        node.iter().filter(|&&r| drop_rank != Some((i * n + j, r))).fold(0f32, |s, &r| s + partial(r));
                    total += if node_size < nr { round_to(dtype, s as f64) as f32 } else { s };
                }
                c[i * n + j] = round_to(dtype, total as f64);
            }
        }
        c
    }

    #[test]
    fn staged_sums_pass_and_a_missing_partial_fails() {
        let (m, n, k) = (24, 40, 264);
        for dtype in [mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16] {
            for (nr, node_size) in [(1, 1), (2, 2), (8, 8), (4, 2)] {
                let a: Vec<Vec<f64>> = (0..nr).map(|r| values(r as u64 + 1, m * k, dtype)).collect();
                let b: Vec<Vec<f64>> = (0..nr).map(|r| values(r as u64 + 100, n * k, dtype)).collect();
                let (reference, bounds) = reduced_reference(&a, &b, 0..m, n, k, dtype, node_size < nr);
                let out = simulated(&a, &b, m, n, k, dtype, node_size, None);
                let v = check_close(&out, &reference, &bounds, tolerance(dtype));
                assert!(v.passed(), "{} {nr} ranks, nodes of {node_size}: {v}", dtype.name());
                if nr > 1 {
                    // Element 77 lost rank 1's partial.
                    let out = simulated(&a, &b, m, n, k, dtype, node_size, Some((77, 1)));
                    let v = check_close(&out, &reference, &bounds, tolerance(dtype));
                    assert!(!v.passed() && v.worst.unwrap().index == 77, "{} {nr} ranks: {v}", dtype.name());
                }
            }
        }
    }
}
