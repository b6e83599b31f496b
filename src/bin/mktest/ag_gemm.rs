//! mkAllGatherGemm on the GPU with MK_TEST_NRANKS ranks (processes sharing the GPU under
//! MPS, or one per GPU).
//!
//! Per rank: both dtypes × awkward shapes (rows per rank not a multiple of the tile, N and
//! K not multiples of the tile) against a float64 CPU reference of the gathered GEMM, with
//! the gathered A checked bit for bit; every shape twice with fresh inputs (the device-side
//! epochs advance); capture in a CUDA graph and replay with fresh inputs; and, with several
//! ranks, a rank that never calls: the others stop within the timeout with
//! mkTimeout/mkRemoteError.

use crate::collectives::{async_error, ffi, say, Stream};
use crate::fused_common::{self, FusedCase};
use crate::ranks::RankEnv;
use mkernel::comm::Comm;
use mkernel::cuda::sys;
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::fused::mkAllGatherGemm;
use mkernel::ffi::mkComm_t;
use mkernel::testing::{relative_error, to_f64, tolerance, TestBuffer};
use mkernel::types::mkDataType_t;

pub fn run() -> Result<()> {
    fused_common::run_suite("ag_gemm", |comm, _control, rank, n| correctness(comm, rank, n).and_then(|_| graph_replay(comm, rank, n)), absent_rank)
}

/// One problem: every rank's shard of A, B, and the outputs, with the host copies the
/// reference needs.
pub(crate) struct Case {
    dtype: mkDataType_t,
    rows_per_rank: usize,
    n: usize,
    k: usize,
    nranks: usize,
    rank: usize,
    a_all: TestBuffer,
    b: TestBuffer,
    c: TestBuffer,
    gathered: TestBuffer,
    /// Pass gatheredA (else NULL: the op need not copy the gathered A out).
    pub(crate) with_gathered: bool,
}

impl Case {
    pub(crate) fn new(dtype: mkDataType_t, rows_per_rank: usize, n: usize, k: usize, nranks: usize, rank: usize) -> Result<Case> {
        let m = rows_per_rank * nranks;
        Ok(Case {
            dtype,
            rows_per_rank,
            n,
            k,
            nranks,
            rank,
            a_all: TestBuffer::new(m * k, dtype)?,
            b: TestBuffer::new(n * k, dtype)?,
            c: TestBuffer::new(m * n, dtype)?,
            gathered: TestBuffer::new(m * k, dtype)?,
            with_gathered: true,
        })
    }

    fn m(&self) -> usize {
        self.rows_per_rank * self.nranks
    }

    pub(crate) fn label(&self) -> String {
        format!("{} M={} ({}x{}) N={} K={}", self.dtype.name(), self.m(), self.nranks, self.rows_per_rank, self.n, self.k)
    }

    fn a_local(&self) -> u64 {
        self.a_all.ptr() + (self.rank * self.rows_per_rank * self.k * 2) as u64
    }
}

impl FusedCase for Case {
    /// Fresh inputs: shard s of A from seed (seed, s) on every rank (so every rank knows
    /// the whole A), B from its own seed; outputs poisoned with NaN.
    fn prepare(&self, seed: u64) -> Result<()> {
        let shard = self.rows_per_rank * self.k;
        for s in 0..self.nranks {
            let ptr = self.a_all.ptr() + (s * shard * 2) as u64;
            mkernel::ops::util::fill_random(ptr, shard as u64, self.dtype, seed * 1000 + s as u64, 1.0, std::ptr::null_mut())?;
        }
        self.b.randomize(seed * 1000 + 999, 1.0, std::ptr::null_mut())?;
        self.c.poison(std::ptr::null_mut())?;
        self.gathered.poison(std::ptr::null_mut())?;
        fused_common::sync_default_stream()
    }

    fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        // SAFETY: device buffers of the sizes the op expects.
        unsafe {
            mkAllGatherGemm(
                self.a_local() as *const _,
                self.b.ptr() as *const _,
                self.c.ptr() as *mut _,
                if self.with_gathered { self.gathered.ptr() as *mut _ } else { std::ptr::null_mut() },
                self.m(),
                self.n,
                self.k,
                self.dtype as i32,
                comm,
                stream,
            )
        }
    }

    /// (passed, detail): C against a float64 reference, gathered A bit for bit.
    fn verify(&self) -> Result<(bool, String)> {
        let (m, n, k) = (self.m(), self.n, self.k);
        let a_bytes = self.a_all.download()?;
        let gathered = self.gathered.download()?;
        let a = to_f64(&a_bytes, self.dtype);
        let b = self.b.download_f64()?;
        let c = self.c.download_f64()?;
        let mut reference = vec![0f64; m * n];
        for i in 0..m {
            let row = &a[i * k..(i + 1) * k];
            for j in 0..n {
                let col = &b[j * k..(j + 1) * k];
                reference[i * n + j] = row.iter().zip(col).map(|(x, y)| x * y).sum();
            }
        }
        let err = relative_error(&c, &reference);
        let gathered_ok = !self.with_gathered || gathered == a_bytes;
        let ok = err <= tolerance(self.dtype) && gathered_ok;
        let what = if !self.with_gathered { "not asked for" } else if gathered_ok { "exact" } else { "WRONG" };
        Ok((ok, format!("rel err {err:.2e}, gatheredA {what}")))
    }
}

pub(crate) fn shapes() -> Vec<(usize, usize, usize)> {
    // (rows per rank, N, K): shards that straddle tiles, N and K off the tile grid.
    vec![(97, 264, 72), (128, 520, 136), (200, 1000, 520), (333, 776, 264)]
}

fn correctness(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let stream = Stream::new()?;
    let mut failures = 0;
    let mut checks = 0;
    for dtype in [mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16] {
        for (rows, cols, k) in shapes() {
            let case = Case::new(dtype, rows, cols, k, n, rank)?;
            for round in 0..2u64 {
                case.prepare(17 + round)?;
                ffi("mkAllGatherGemm", case.launch(comm, stream.0), comm)?;
                stream.sync()?;
                if async_error(comm) != mkResult_t::mkSuccess {
                    return Err(MkError::new(async_error(comm), format!("{}: asynchronous error", case.label())));
                }
                let (ok, detail) = case.verify()?;
                checks += 1;
                if !ok {
                    failures += 1;
                }
                if !ok || rank == 0 {
                    say(rank, format!("{} round {round}: {detail} -> {}", case.label(), if ok { "ok" } else { "WRONG" }));
                }
            }
        }
    }
    say(rank, format!("correctness: {checks} checks, {failures} wrong"));
    if failures > 0 {
        return Err(MkError::internal(format!("mkAllGatherGemm: {failures} of {checks} checks wrong")));
    }
    Ok(())
}

fn graph_replay(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    fused_common::graph_replay(comm, rank, "mkAllGatherGemm", &Case::new(mkDataType_t::mkBfloat16, 160, 392, 200, n, rank)?)
}

fn absent_rank(env: &RankEnv, control: &Comm) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let case = Case::new(mkDataType_t::mkBfloat16, 256, 1024, 512, n, rank)?;
    fused_common::absent_rank(env, control, 2, "mkAllGatherGemm (a rank absent)", |comm, stream| {
        case.prepare(5)?;
        Ok(case.launch(comm, stream))
    })
}

