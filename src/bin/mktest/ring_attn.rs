//! mkRingAttention on the GPU with MK_TEST_NRANKS ranks (processes sharing the GPU under
//! MPS, or one per GPU).
//!
//! Per rank: both dtypes × shapes (GQA 4:1, 2:1, 1:1, 17:1; seqLocal off the 64/128 tile
//! grid; D 64 and 128; causal zigzag and non-causal contiguous; more work items than SMs)
//! against a float64 reference of
//! attention over the gathered global sequence, out and lse both checked; every shape
//! twice with fresh inputs (the device-side epochs advance), outputs poisoned with NaN
//! before every call; argument errors on a live communicator; capture in a CUDA graph and
//! replay with fresh inputs, with direct calls between replays; and, with several ranks,
//! a rank that never calls: the others stop within the timeout with mkTimeout/mkRemoteError.
//!
//! Tolerances: the kernel rounds the softmax probabilities to the input dtype before the
//! product with V and rounds out once; for bf16 (8-bit mantissa) that gives relative L2
//! errors of a few 1e-3, for fp16 a few 1e-4, so out must be within the library's GEMM
//! tolerances (1e-2, 2e-3). lse is computed in fp32 from the exact inputs: |Δlse| ≤ 1e-3.

use crate::collectives::{async_error, ffi, say, Stream};
use crate::fused_common::{self, FusedCase};
use crate::ranks::RankEnv;
use mkernel::comm::Comm;
use mkernel::cuda::sys;
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::fused::mkRingAttention;
use mkernel::ffi::mkComm_t;
use mkernel::ffi::query::mkGetLastError;
use mkernel::ops::ring_attention::{token_pos, RingShape};
use mkernel::testing::{relative_error, tolerance, TestBuffer};
use mkernel::types::mkDataType_t;

pub fn run() -> Result<()> {
    fused_common::run_suite(
        "ring_attn",
        |comm, _control, rank, n| correctness(comm, rank, n).and_then(|_| argument_errors(comm, rank, n)).and_then(|_| graph_replay(comm, rank, n)),
        absent_rank,
    )
}

const LSE_TOLERANCE: f64 = 1e-3;

struct Case {
    dtype: mkDataType_t,
    shape: RingShape,
    rank: usize,
    scale: f32,
    q: TestBuffer,
    /// Every rank's K (and V) shard, shard s at s · shard_elems: every rank knows the whole
    /// sequence for the reference and passes its own shard to the op.
    k_all: TestBuffer,
    v_all: TestBuffer,
    out: TestBuffer,
    lse: TestBuffer,
}

impl Case {
    fn new(dtype: mkDataType_t, batch: usize, seq_local: usize, heads: usize, kv_heads: usize, head_dim: usize, causal: bool, nranks: usize, rank: usize) -> Result<Case> {
        let shape = RingShape { batch, seq_local, heads, kv_heads, head_dim, causal, nranks };
        let q_elems = batch * seq_local * heads * head_dim;
        let shard = batch * seq_local * kv_heads * head_dim;
        Ok(Case {
            dtype,
            shape,
            rank,
            // Larger than 1/sqrt(D) so the softmax is peaked and the running max matters.
            scale: 1.5 / (head_dim as f32).sqrt(),
            q: TestBuffer::new(q_elems, dtype)?,
            k_all: TestBuffer::new(shard * nranks, dtype)?,
            v_all: TestBuffer::new(shard * nranks, dtype)?,
            out: TestBuffer::new(q_elems, dtype)?,
            lse: TestBuffer::new(batch * heads * seq_local, mkDataType_t::mkFloat32)?,
        })
    }

    fn shard_elems(&self) -> usize {
        let s = &self.shape;
        s.batch * s.seq_local * s.kv_heads * s.head_dim
    }

    fn label(&self) -> String {
        let s = &self.shape;
        format!(
            "{} B={} S_local={} H={} H_kv={} D={} {}",
            self.dtype.name(),
            s.batch,
            s.seq_local,
            s.heads,
            s.kv_heads,
            s.head_dim,
            if s.causal { "causal" } else { "full" }
        )
    }
}

impl FusedCase for Case {
    /// Fresh inputs (shard s of K/V from seeds (seed, s) on every rank; Q per rank) and
    /// NaN-poisoned outputs.
    fn prepare(&self, seed: u64) -> Result<()> {
        let shard = self.shard_elems();
        let es = self.dtype.size();
        for s in 0..self.shape.nranks {
            let off = (s * shard * es) as u64;
            mkernel::ops::util::fill_random(self.k_all.ptr() + off, shard as u64, self.dtype, seed * 1000 + s as u64, 1.0, std::ptr::null_mut())?;
            mkernel::ops::util::fill_random(self.v_all.ptr() + off, shard as u64, self.dtype, seed * 1000 + 500 + s as u64, 1.0, std::ptr::null_mut())?;
        }
        self.q.randomize(seed * 1000 + 900 + self.rank as u64, 2.0, std::ptr::null_mut())?;
        self.out.poison(std::ptr::null_mut())?;
        self.lse.poison(std::ptr::null_mut())?;
        fused_common::sync_default_stream()
    }

    fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        let s = &self.shape;
        let off = (self.rank * self.shard_elems() * self.dtype.size()) as u64;
        // SAFETY: device buffers of the sizes the op expects.
        unsafe {
            mkRingAttention(
                self.q.ptr() as *const _,
                (self.k_all.ptr() + off) as *const _,
                (self.v_all.ptr() + off) as *const _,
                self.out.ptr() as *mut _,
                self.lse.ptr() as *mut f32,
                s.batch,
                s.seq_local,
                s.heads,
                s.kv_heads,
                s.head_dim,
                self.scale,
                s.causal as i32,
                self.dtype as i32,
                comm,
                stream,
            )
        }
    }

    /// (passed, detail): out and lse against float64 attention over the global sequence.
    fn verify(&self) -> Result<(bool, String)> {
        let s = &self.shape;
        let (d, h, hkv, sl, n) = (s.head_dim, s.heads, s.kv_heads, s.seq_local, s.nranks);
        let q = self.q.download_f64()?;
        let k = self.k_all.download_f64()?;
        let v = self.v_all.download_f64()?;
        let out = self.out.download_f64()?;
        let lse = self.lse.download_f64()?;
        let shard = self.shard_elems();
        let scale = self.scale as f64;
        let mut ref_out = vec![0f64; out.len()];
        let mut ref_lse = vec![0f64; lse.len()];
        let mut scores = Vec::with_capacity(n * sl);
        for b in 0..s.batch {
            for hh in 0..h {
                let hk = hh / (h / hkv);
                for i in 0..sl {
                    let qpos = token_pos(s, self.rank, i);
                    let qrow = &q[((b * sl + i) * h + hh) * d..][..d];
                    scores.clear();
                    for src in 0..n {
                        for j in 0..sl {
                            if s.causal && token_pos(s, src, j) > qpos {
                                continue;
                            }
                            let base = src * shard + ((b * sl + j) * hkv + hk) * d;
                            let dot: f64 = qrow.iter().zip(&k[base..base + d]).map(|(x, y)| x * y).sum();
                            scores.push((scale * dot, base));
                        }
                    }
                    let mx = scores.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = scores.iter().map(|x| (x.0 - mx).exp()).sum();
                    let o = &mut ref_out[((b * sl + i) * h + hh) * d..][..d];
                    for &(sc, base) in &scores {
                        let p = (sc - mx).exp() / sum;
                        for (od, vd) in o.iter_mut().zip(&v[base..base + d]) {
                            *od += p * vd;
                        }
                    }
                    ref_lse[(b * h + hh) * sl + i] = mx + sum.ln();
                }
            }
        }
        let err = relative_error(&out, &ref_out);
        let lse_err = lse.iter().zip(&ref_lse).map(|(a, b)| if a.is_finite() { (a - b).abs() } else { f64::INFINITY }).fold(0.0, f64::max);
        let ok = err <= tolerance(self.dtype) && lse_err <= LSE_TOLERANCE;
        Ok((ok, format!("out rel err {err:.2e}, lse max abs err {lse_err:.2e}")))
    }
}

/// (batch, seqLocal, heads, kvHeads, headDim, causal)
fn shapes() -> Vec<(usize, usize, usize, usize, usize, bool)> {
    vec![
        (1, 64, 4, 4, 64, false),
        (2, 200, 4, 2, 128, false),
        (1, 384, 4, 1, 128, true),
        (2, 130, 4, 2, 64, true),
        (1, 256, 4, 4, 128, true),
        (1, 72, 4, 1, 64, false),
        // More work items (136 heads × 2 query blocks) than SMs: every CTA runs several, so
        // the kernel's load rings carry their slot phases across items, even at one rank.
        (1, 130, 136, 8, 64, true),
        // D = 128 with 4-5 items per CTA of one short tile each (seqLocal below one tile):
        // every tile starts an item, so each Q slot is reused with both phases and every
        // epilogue runs beside the next item's first S.
        (1, 8, 600, 8, 128, true),
        // D = 128, 2-3 items per CTA of two tiles per step (a full one and an 8-key tail),
        // 8-row tail query blocks: the staged O store must skip rows past seqLocal.
        (1, 136, 140, 4, 128, false),
    ]
}

fn correctness(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let stream = Stream::new()?;
    let mut failures = 0;
    let mut checks = 0;
    for dtype in [mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16] {
        for (b, sl, h, hkv, d, causal) in shapes() {
            let case = Case::new(dtype, b, sl, h, hkv, d, causal, n, rank)?;
            for round in 0..2u64 {
                case.prepare(17 + round)?;
                ffi("mkRingAttention", case.launch(comm, stream.0), comm)?;
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
        return Err(MkError::internal(format!("mkRingAttention: {failures} of {checks} checks wrong")));
    }
    Ok(())
}

/// Bad arguments on a live communicator: the call fails with the rule and launches nothing.
fn argument_errors(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let stream = Stream::new()?;
    let buf = TestBuffer::new(1 << 16, mkDataType_t::mkBfloat16)?;
    let p = buf.ptr() as *mut std::ffi::c_void;
    let bf16 = mkDataType_t::mkBfloat16 as i32;
    let cases: [(usize, usize, usize, f32, i32, &str); 4] = [
        (96, 4, 2, 0.1, 0, "headDim"),
        (64, 4, 3, 0.1, 0, "divide"),
        (64, 4, 2, -1.0, 0, "softmaxScale"),
        (64, 4, 2, 0.1, 7, "causal"),
    ];
    for (d, h, hkv, scale, causal, needle) in cases {
        // SAFETY: the call must fail its checks before touching the buffers.
        let r = unsafe { mkRingAttention(p, p, p, p, p.cast(), 1, 16, h, hkv, d, scale, causal, bf16, comm, stream.0) };
        let msg = last_error(comm);
        if r != mkResult_t::mkInvalidArgument || !msg.contains(needle) {
            return Err(MkError::internal(format!("bad argument ({needle}): got {r:?} \"{msg}\"")));
        }
    }
    // A K/V copy larger than the fused-op region is mkInvalidUsage naming the variable.
    if n > 1 {
        let huge = 1usize << 22;
        // SAFETY: as above, rejected before any access.
        let r = unsafe { mkRingAttention(p, p, p, p, p.cast(), 1, huge, 4, 4, 128, 0.1, 0, bf16, comm, stream.0) };
        let msg = last_error(comm);
        if r != mkResult_t::mkInvalidUsage || !msg.contains("MK_WORKSPACE_BYTES") {
            return Err(MkError::internal(format!("oversized K/V: got {r:?} \"{msg}\"")));
        }
    }
    say(rank, "argument errors: rejected with the rule");
    Ok(())
}

fn last_error(comm: mkComm_t) -> String {
    // SAFETY: a live communicator; the string stays valid until its next call.
    unsafe { std::ffi::CStr::from_ptr(mkGetLastError(comm)) }.to_string_lossy().into_owned()
}

fn graph_replay(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    fused_common::graph_replay(comm, rank, "mkRingAttention", &Case::new(mkDataType_t::mkBfloat16, 1, 192, 4, 2, 128, true, n, rank)?)
}

fn absent_rank(env: &RankEnv, control: &Comm) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let case = Case::new(mkDataType_t::mkBfloat16, 1, 256, 4, 2, 128, true, n, rank)?;
    fused_common::absent_rank(env, control, 2, "mkRingAttention (a rank absent)", |comm, stream| {
        case.prepare(5)?;
        Ok(case.launch(comm, stream))
    })
}
