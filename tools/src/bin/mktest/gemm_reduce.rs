//! mkGemmReduceScatter and mkGemmAllReduce on the GPU with MK_TEST_NRANKS ranks.
//!
//! Per rank: both ops × both dtypes × shapes (decode sizes: 1-16 rows per rank for
//! GEMM+RS, M = 1..16 for GEMM+AR; K = 8; N = 8; M odd; N, K off the tile grid) against a
//! float64 CPU reference of Σ_r A_r·B_rᵀ element by element (every rank regenerates every
//! rank's inputs from their seeds, one allocation per rank, guard bands checked);
//! AllReduce outputs must be bitwise identical on every rank; every shape twice with fresh
//! inputs; capture in a CUDA graph and replay with fresh inputs; and, with several ranks, a
//! rank that never calls. The cases are a table driven by fused_common's check_rounds,
//! graph_replay_of and absent_rank.

use crate::fused_common::{self, Captured, CheckedOutput, FusedCase, SameOnEveryRank};
use crate::outcome::Outcome;
use crate::ranks::RankEnv;
use mkernel::comm::Comm;
use mkernel::cuda::sys;
use mkernel::error::{mkResult_t, Result};
use mkernel::ffi::fused::{mkGemmAllReduce, mkGemmReduceScatter};
use mkernel::ffi::mkComm_t;
use mkernel::types::mkDataType_t;
use mkernel_tools::testing::{check_close, to_f64, tolerance, unit_roundoff, Rule, TestBuffer, Verdict};

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

    fn op(&self) -> &'static str {
        if self.scatter {
            "mkGemmReduceScatter"
        } else {
            "mkGemmAllReduce"
        }
    }

    /// (passed, detail, raw output bytes). Each element is Σ_r p_r with p_r rank r's dot
    /// product of K terms: its bound is each partial's (accumulated over K, rounded to the
    /// element type when there are several ranks) plus the fp32 sum of the n partials and
    /// its one rounding, plus one more rounding of the node partials across nodes.
    pub(crate) fn verify_with_output(&self) -> Result<(bool, String, Vec<u8>)> {
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

impl FusedCase for Case {
    fn label(&self) -> String {
        format!(
            "{} {} M={} N={} K={}",
            if self.scatter { "GEMM+RS" } else { "GEMM+AR" },
            self.dtype.name(),
            self.m,
            self.n,
            self.k
        )
    }

    fn prepare(&self, seed: u64) -> Result<()> {
        fused_common::fill_shards(&self.a_shards, seed * 100, 1.0)?;
        fused_common::fill_shards(&self.b_shards, seed * 100 + 50, 1.0)?;
        self.c.poison(std::ptr::null_mut())?;
        fused_common::sync_default_stream()
    }

    fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
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

    fn verify(&self) -> Result<(bool, String)> {
        self.verify_with_output().map(|(ok, detail, _)| (ok, detail))
    }
}

impl CheckedOutput for Case {
    fn verify_with_output(&self) -> Result<(bool, String, Vec<u8>)> {
        Case::verify_with_output(self)
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

/// (M, N, K) of each op's cases with `nranks` ranks: decode-sized and odd M (AllReduce,
/// one-shot), shards off the tile grid; M = n·384 and n·256 take the two-phase AllReduce
/// when n > 1. N = 4360 (18 tiles of 256, the last partial) gives more reducer items than
/// the 8-32 CTAs of a shared GPU, with a partial last wave: for GEMM+RS the early-sum
/// kernels (ops::dense::gemm_reduce::early_items), with K = 72 a GEMM short enough that the side
/// warps are often stopped inside an item and the 12 warps finish it. Decode sizes (1-16
/// rows per rank for GEMM+RS, M = 1..16 for GEMM+AR), K = 8 (one MMA step), N = 8, and a
/// partial tile in every dimension.
fn shapes(scatter: bool, n: usize) -> Vec<(usize, usize, usize)> {
    if scatter {
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
    }
}

/// Every case, twice with fresh inputs: GEMM+RS then GEMM+AR, each in both dtypes over
/// its shapes; AllReduce outputs also bit for bit the same on every rank.
/// `across_nodes`: the communicator spans nodes (the node partials' rounding is allowed for).
pub(crate) fn correctness(comm: mkComm_t, control: &Comm, rank: usize, n: usize, across_nodes: bool) -> Result<()> {
    let table = [true, false].into_iter().flat_map(|scatter| {
        fused_common::case_dtypes()
            .iter()
            .flat_map(move |&dtype| shapes(scatter, n).into_iter().map(move |s| (scatter, dtype, s)))
    });
    let (mut checks, mut failures) = (0, 0);
    for (scatter, dtype, (m, cols, k)) in table {
        let mut case = Case::new(scatter, dtype, m, cols, k, n, rank)?;
        case.node_partials = across_nodes;
        let checked: &dyn FusedCase = if scatter { &case } else { &SameOnEveryRank { case: &case, control } };
        let (c, f) = fused_common::check_rounds(comm, rank, case.op(), checked, 7, 2, &|_| ())?;
        checks += c;
        failures += f;
    }
    fused_common::count_checks(rank, "GEMM + reduction", checks, failures)
}

/// One graph of four launches (GEMM+RS; one-shot GEMM+AR; GEMM+AR two-phase when n > 1;
/// one-shot GEMM+AR with M not a multiple of 128, where every rank sums every tile),
/// replayed with fresh inputs, the small GEMM+AR called directly between replays.
pub(crate) fn graph_replay(comm: mkComm_t, rank: usize, n: usize, across_nodes: bool) -> Result<()> {
    let case = |scatter, dtype, m, cols, k| -> Result<Case> {
        let mut case = Case::new(scatter, dtype, m, cols, k, n, rank)?;
        case.node_partials = across_nodes;
        Ok(case)
    };
    let (bf16, f16) = (mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16);
    let rs = case(true, bf16, n * 160, 392, 200)?;
    let ar = case(false, f16, 33, 264, 136)?;
    let ar_two_phase = case(false, bf16, n * 384, 264, 136)?;
    let ar_every_tile = case(false, bf16, 200, 776, 136)?;
    let captured = [
        Captured { case: &rs, capture_seed: 1, replay_seed: 10 },
        Captured { case: &ar, capture_seed: 2, replay_seed: 20 },
        Captured { case: &ar_two_phase, capture_seed: 3, replay_seed: 40 },
        Captured { case: &ar_every_tile, capture_seed: 4, replay_seed: 50 },
    ];
    fused_common::graph_replay_of(comm, rank, "GEMM + reduction", &captured, 1, 30)
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
    use mkernel_tools::testing::{round_to, xorshift_unit};

    /// Values in [-1, 1), rounded to `dtype`.
    fn values(seed: u64, n: usize, dtype: mkDataType_t) -> Vec<f64> {
        xorshift_unit(seed, n).map(|u| round_to(dtype, 2.0 * u - 1.0)).collect()
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
