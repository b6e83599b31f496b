//! mkAllGatherGemm on the GPU with MK_TEST_NRANKS ranks (processes sharing the GPU under
//! MPS, or one per GPU).
//!
//! Per rank: both dtypes × shapes (decode sizes of 1-16 rows per rank, K = 8, rows per rank
//! not a multiple of the tile, N and K not multiples of the tile) against a float64 CPU
//! reference of the gathered GEMM, element by element (testing::Rule), with the gathered A
//! checked bit for bit and every buffer's guard bands intact (each rank's shard is its own
//! allocation); every shape twice with fresh inputs (the device-side
//! epochs advance); capture in a CUDA graph and replay with fresh inputs; and, with several
//! ranks, a rank that never calls: the others stop within the timeout with
//! mkTimeout/mkRemoteError.

use crate::collectives::say;
use crate::fused_common::{self, FusedCase};
use crate::outcome::{self, Outcome};
use crate::ranks::RankEnv;
use mkernel::comm::Comm;
use mkernel::cuda::sys;
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::fused::mkAllGatherGemm;
use mkernel::ffi::mkComm_t;
use mkernel::types::mkDataType_t;
use mkernel_tools::testing::{check_close, check_exact_bytes, gemm_reference, to_f64, tolerance, Rule, TestBuffer};
use std::cell::Cell;

pub fn run() -> Result<Outcome> {
    fused_common::run_suite(
        "ag_gemm",
        |comm, _control, rank, n| correctness(comm, rank, n).and_then(|_| graph_replay(comm, rank, n)),
        absent_rank,
    )
}

/// One problem: every rank's shard of A (one allocation per rank: this rank passes its own,
/// the others' are the reference's copies), B, and the outputs, each between guard bands.
pub(crate) struct Case {
    dtype: mkDataType_t,
    rows_per_rank: usize,
    n: usize,
    k: usize,
    nranks: usize,
    rank: usize,
    a_shards: Vec<TestBuffer>,
    b: TestBuffer,
    c: TestBuffer,
    gathered: TestBuffer,
    /// Pass gatheredA (else NULL: the op need not copy the gathered A out).
    pub(crate) with_gathered: Cell<bool>,
}

impl Case {
    pub(crate) fn new(
        dtype: mkDataType_t,
        rows_per_rank: usize,
        n: usize,
        k: usize,
        nranks: usize,
        rank: usize,
    ) -> Result<Case> {
        let m = rows_per_rank * nranks;
        Ok(Case {
            dtype,
            rows_per_rank,
            n,
            k,
            nranks,
            rank,
            a_shards: (0..nranks).map(|_| TestBuffer::new(rows_per_rank * k, dtype)).collect::<Result<_>>()?,
            b: TestBuffer::new(n * k, dtype)?,
            c: TestBuffer::new(m * n, dtype)?,
            gathered: TestBuffer::new(m * k, dtype)?,
            with_gathered: Cell::new(true),
        })
    }

    fn m(&self) -> usize {
        self.rows_per_rank * self.nranks
    }
}

impl FusedCase for Case {
    fn label(&self) -> String {
        format!(
            "{} M={} ({}x{}) N={} K={}",
            self.dtype.name(),
            self.m(),
            self.nranks,
            self.rows_per_rank,
            self.n,
            self.k
        )
    }

    /// Fresh inputs: shard s of A from seed (seed, s) on every rank (so every rank knows
    /// the whole A), B from its own seed; outputs poisoned with NaN.
    fn prepare(&self, seed: u64) -> Result<()> {
        fused_common::fill_shards(&self.a_shards, seed * 1000, 1.0)?;
        self.b.randomize(seed * 1000 + 999, 1.0, std::ptr::null_mut())?;
        self.c.poison(std::ptr::null_mut())?;
        self.gathered.poison(std::ptr::null_mut())?;
        fused_common::sync_default_stream()
    }

    fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        // SAFETY: device buffers of the sizes the op expects.
        unsafe {
            mkAllGatherGemm(
                self.a_shards[self.rank].ptr() as *const _,
                self.b.ptr() as *const _,
                self.c.ptr() as *mut _,
                if self.with_gathered.get() { self.gathered.ptr() as *mut _ } else { std::ptr::null_mut() },
                self.m(),
                self.n,
                self.k,
                self.dtype as i32,
                comm,
                stream,
            )
        }
    }

    /// (passed, detail): C element-wise against the float64 reference (a dot product of K
    /// terms, rounded once), gathered A bit for bit, every guard band intact.
    fn verify(&self) -> Result<(bool, String)> {
        let (m, n, k) = (self.m(), self.n, self.k);
        let a_bytes = fused_common::download_shards(&self.a_shards)?;
        let a = to_f64(&a_bytes, self.dtype);
        let b = self.b.download_f64()?;
        let c = self.c.download_f64()?;
        let (reference, mag) = gemm_reference(&a, &b, m, n, k);
        let rule = Rule::reduction(self.dtype, k);
        let bounds: Vec<f64> = reference.iter().zip(&mag).map(|(&r, &g)| rule.bound(r, g)).collect();
        let c_verdict = check_close(&c, &reference, &bounds, tolerance(self.dtype));
        let gathered = if self.with_gathered.get() {
            Some(check_exact_bytes(&self.gathered.download()?, &a_bytes, self.dtype))
        } else {
            None
        };
        let mut buffers: Vec<(&str, &TestBuffer)> = vec![("C", &self.c), ("gatheredA", &self.gathered), ("B", &self.b)];
        buffers.extend(self.a_shards.iter().map(|s| ("A shard", s)));
        let guards = fused_common::guards_intact(&buffers)?;
        let ok = c_verdict.passed() && gathered.as_ref().is_none_or(|g| g.passed()) && guards.is_none();
        let g = gathered.map_or("not asked for".to_string(), |g| g.to_string());
        Ok((ok, format!("C: {c_verdict}; gatheredA: {g}{}", guards.map_or(String::new(), |w| format!("; GUARD {w}")))))
    }
}

pub(crate) fn shapes() -> Vec<(usize, usize, usize)> {
    // (rows per rank, N, K): decode sizes (1-16 rows per rank), K = 8 (one MMA step, the
    // smallest K allowed), N = 8, shards that straddle tiles, a partial tile in M, N and K.
    vec![
        (1, 264, 72),
        (4, 8, 8),
        (7, 520, 8),
        (16, 136, 200),
        (97, 264, 72),
        (128, 520, 136),
        (200, 1000, 520),
        (333, 776, 264),
    ]
}

fn correctness(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let (mut checks, mut failures) = (0, 0);
    for &dtype in fused_common::case_dtypes() {
        for (rows, cols, k) in shapes() {
            let case = Case::new(dtype, rows, cols, k, n, rank)?;
            // The second round without gatheredA (the op must not need it).
            let (c, f) = fused_common::check_rounds(comm, rank, "mkAllGatherGemm", &case, 17, 2, &|round| {
                case.with_gathered.set(round == 0)
            })?;
            checks += c;
            failures += f;
        }
    }
    outcome::count(checks);
    say(rank, format!("correctness: {checks} checks, {failures} wrong"));
    if failures > 0 {
        return Err(MkError::internal(format!("mkAllGatherGemm: {failures} of {checks} checks wrong")));
    }
    Ok(())
}

fn graph_replay(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    fused_common::graph_replay(
        comm,
        rank,
        "mkAllGatherGemm",
        &Case::new(mkDataType_t::mkBfloat16, 160, 392, 200, n, rank)?,
    )
}

fn absent_rank(env: &RankEnv, control: &Comm) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let case = Case::new(mkDataType_t::mkBfloat16, 256, 1024, 512, n, rank)?;
    fused_common::absent_rank(env, control, 2, "mkAllGatherGemm (a rank absent)", |comm, stream| {
        case.prepare(5)?;
        Ok(case.launch(comm, stream))
    })
}
