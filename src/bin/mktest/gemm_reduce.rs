//! mkGemmReduceScatter and mkGemmAllReduce on the GPU with MK_TEST_NRANKS ranks.
//!
//! Per rank: both ops × both dtypes × awkward shapes (M from 1 up, odd; N, K off the tile
//! grid) against a float64 CPU reference of Σ_r A_r·B_rᵀ (every rank regenerates every
//! rank's inputs from their seeds); AllReduce outputs must be bitwise identical on every
//! rank; every shape twice with fresh inputs; capture in a CUDA graph and replay with fresh
//! inputs; and, with several ranks, a rank that never calls.

use crate::collectives::{async_error, ffi, say, Stream};
use crate::fused_common;
use crate::ranks::RankEnv;
use mkernel::comm::Comm;
use mkernel::cuda::{self, sys};
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::fused::{mkGemmAllReduce, mkGemmReduceScatter};
use mkernel::ffi::mkComm_t;
use mkernel::ops::util::fill_random;
use mkernel::testing::{relative_error, to_f64, tolerance, TestBuffer};
use mkernel::types::mkDataType_t;

pub fn run() -> Result<()> {
    fused_common::run_suite("gemm_reduce", |comm, control, rank, n| correctness(comm, control, rank, n).and_then(|_| graph_replay(comm, rank, n)), absent_rank)
}

pub(crate) struct Case {
    scatter: bool,
    dtype: mkDataType_t,
    m: usize,
    n: usize,
    k: usize,
    nranks: usize,
    rank: usize,
    /// Every rank's A then every rank's B (each rank regenerates all of them).
    a_all: TestBuffer,
    b_all: TestBuffer,
    c: TestBuffer,
}

impl Case {
    pub(crate) fn new(scatter: bool, dtype: mkDataType_t, m: usize, n: usize, k: usize, nranks: usize, rank: usize) -> Result<Case> {
        let rows_out = if scatter { m / nranks } else { m };
        Ok(Case {
            scatter,
            dtype,
            m,
            n,
            k,
            nranks,
            rank,
            a_all: TestBuffer::new(nranks * m * k, dtype)?,
            b_all: TestBuffer::new(nranks * n * k, dtype)?,
            c: TestBuffer::new(rows_out.max(1) * n, dtype)?,
        })
    }

    pub(crate) fn label(&self) -> String {
        format!("{} {} M={} N={} K={}", if self.scatter { "GEMM+RS" } else { "GEMM+AR" }, self.dtype.name(), self.m, self.n, self.k)
    }

    pub(crate) fn prepare(&self, seed: u64) -> Result<()> {
        let (a_len, b_len) = (self.m * self.k, self.n * self.k);
        for r in 0..self.nranks {
            fill_random(self.a_all.ptr() + (r * a_len * 2) as u64, a_len as u64, self.dtype, seed * 100 + r as u64, 1.0, std::ptr::null_mut())?;
            fill_random(self.b_all.ptr() + (r * b_len * 2) as u64, b_len as u64, self.dtype, seed * 100 + 50 + r as u64, 1.0, std::ptr::null_mut())?;
        }
        self.c.poison(std::ptr::null_mut())?;
        fused_common::sync_default_stream()
    }

    pub(crate) fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        let a = self.a_all.ptr() + (self.rank * self.m * self.k * 2) as u64;
        let b = self.b_all.ptr() + (self.rank * self.n * self.k * 2) as u64;
        let f = if self.scatter { mkGemmReduceScatter } else { mkGemmAllReduce };
        // SAFETY: device buffers of the sizes the op expects.
        unsafe { f(a as *const _, b as *const _, self.c.ptr() as *mut _, self.m, self.n, self.k, self.dtype as i32, comm, stream) }
    }

    /// (passed, detail, raw output bytes).
    pub(crate) fn verify(&self) -> Result<(bool, String, Vec<u8>)> {
        let (m, n, k) = (self.m, self.n, self.k);
        let a = self.a_all.download_f64()?;
        let b = self.b_all.download_f64()?;
        let raw = self.c.download()?;
        let (r0, r1) = if self.scatter { (self.rank * m / self.nranks, (self.rank + 1) * m / self.nranks) } else { (0, m) };
        let out = to_f64(&raw[..(r1 - r0) * n * 2], self.dtype);
        let mut reference = vec![0f64; (r1 - r0) * n];
        for r in 0..self.nranks {
            let (ar, br) = (&a[r * m * k..(r + 1) * m * k], &b[r * n * k..(r + 1) * n * k]);
            for i in r0..r1 {
                for j in 0..n {
                    let dot: f64 = ar[i * k..(i + 1) * k].iter().zip(&br[j * k..(j + 1) * k]).map(|(x, y)| x * y).sum();
                    reference[(i - r0) * n + j] += dot;
                }
            }
        }
        let err = relative_error(&out, &reference);
        Ok((err <= tolerance(self.dtype), format!("rel err {err:.2e}"), raw[..(r1 - r0) * n * 2].to_vec()))
    }
}

pub(crate) fn correctness(comm: mkComm_t, control: &Comm, rank: usize, n: usize) -> Result<()> {
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
            let shapes: Vec<(usize, usize, usize)> = if scatter {
                vec![(n * 97, 264, 72), (n * 128, 520, 136), (n * 333, 776, 264), (n * 300, 4360, 72)]
            } else {
                vec![
                    (1, 264, 72),
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
                let case = Case::new(scatter, dtype, m, cols, k, n, rank)?;
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
                        say(rank, format!("{} round {round}: {detail} -> {}", case.label(), if ok { "ok" } else { "WRONG" }));
                    }
                }
            }
        }
    }
    say(rank, format!("correctness: {checks} checks, {failures} wrong"));
    if failures > 0 {
        return Err(MkError::internal(format!("GEMM + reduction: {failures} of {checks} checks wrong")));
    }
    Ok(())
}

pub(crate) fn graph_replay(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let stream = Stream::new()?;
    let rs = Case::new(true, mkDataType_t::mkBfloat16, n * 160, 392, 200, n, rank)?;
    let ar = Case::new(false, mkDataType_t::mkFloat16, 33, 264, 136, n, rank)?;
    let ar2 = Case::new(false, mkDataType_t::mkBfloat16, n * 384, 264, 136, n, rank)?; // two-phase when n > 1
    let ar3 = Case::new(false, mkDataType_t::mkBfloat16, 200, 776, 136, n, rank)?; // tile owners' sums when n > 1
    rs.prepare(1)?;
    ar.prepare(2)?;
    ar2.prepare(3)?;
    ar3.prepare(4)?;
    // SAFETY: capture on a live non-default stream; the launches are our ops.
    unsafe { cuda::check("cuStreamBeginCapture", sys::cuStreamBeginCapture_v2(stream.0, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL))? };
    let launched = [rs.launch(comm, stream.0), ar.launch(comm, stream.0), ar2.launch(comm, stream.0), ar3.launch(comm, stream.0)];
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
    // The AllReduce tile owners' waits: in the epilogue (for the absent rank's partials)
    // and after the GEMM (for the tiles it owns).
    let case = Case::new(false, mkDataType_t::mkBfloat16, 200, 1024, 512, n, rank)?;
    fused_common::absent_rank(env, control, 3, "mkGemmAllReduce (a rank absent)", |comm, stream| {
        case.prepare(6)?;
        Ok(case.launch(comm, stream))
    })
}

