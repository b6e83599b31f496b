//! mkRingAttention on the GPU with MK_TEST_NRANKS ranks (processes sharing the GPU under
//! MPS, or one per GPU).
//!
//! Per rank: both dtypes × shapes (decode-sized shards of 1, 2, 16 tokens; GQA 4:1, 2:1,
//! 1:1, 17:1; seqLocal off the 64/128 tile
//! grid; D 64 and 128; causal zigzag and non-causal contiguous; more work items than SMs)
//! against a float64 reference of
//! attention over the gathered global sequence, out and lse both checked; every shape
//! twice with fresh inputs (the device-side epochs advance), outputs poisoned with NaN
//! before every call; argument errors on a live communicator; capture in a CUDA graph and
//! replay with fresh inputs, with direct calls between replays; and, with several ranks,
//! a rank that never calls: the others stop within the timeout with mkTimeout/mkRemoteError.
//!
//! Acceptance, element by element (testing::Rule's terms, derived in docs/testing.md): a
//! query row's scores q·k carry an fp32 accumulation error δs ≤ scale·γ_D·max_j Σ|q·k_j|
//! (+ 2⁻²²·|s| for the scaling), the exponentials a relative 2⁻²¹, each rescale of the
//! running sum 2⁻²², the probabilities are rounded to the element type (u) before P·V, and
//! P·V and the row sum accumulate S terms in fp32 (γ_S). So with M = Σ_j P_j·|v_j|,
//! |Δout| ≤ (u + γ_S + 2.2·(δs + 2⁻²¹) + blocks·2⁻²²)·M + 2u·|out| (the final rounding,
//! and once more where the row sum is formed from the rounded probabilities), and
//! |Δlse| ≤ 2.2·(δs + 2⁻²¹) + γ_S + blocks·2⁻²² + 2⁻²³·|lse|. Every rank's K and V
//! shard is its own allocation; every buffer's guard bands are checked.

use crate::collectives::{say, Stream};
use crate::fused_common::{self, FusedCase};
use crate::outcome::{self, Outcome};
use crate::ranks::RankEnv;
use mkernel::comm::Comm;
use mkernel::cuda::sys;
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::fused::mkRingAttention;
use mkernel::ffi::mkComm_t;
use mkernel::ffi::query::mkGetLastError;
use mkernel::ops::attention::ring_attention::{token_pos, RingShape};
use mkernel::types::mkDataType_t;
use mkernel_tools::testing::{
    accumulation_unit, check_close, gamma, tolerance, underflow_floor, unit_roundoff, TestBuffer,
};

pub fn run() -> Result<Outcome> {
    fused_common::run_suite(
        "ring_attn",
        |comm, _control, rank, n| {
            correctness(comm, rank, n)
                .and_then(|_| argument_errors(comm, rank, n))
                .and_then(|_| graph_replay(comm, rank, n))
        },
        absent_rank,
    )
}

pub(crate) struct Case {
    dtype: mkDataType_t,
    shape: RingShape,
    rank: usize,
    scale: f32,
    q: TestBuffer,
    /// Every rank's K (and V) shard, one allocation each: every rank knows the whole
    /// sequence for the reference and passes its own shard to the op.
    k_shards: Vec<TestBuffer>,
    v_shards: Vec<TestBuffer>,
    out: TestBuffer,
    lse: TestBuffer,
}

impl Case {
    pub(crate) fn new(
        dtype: mkDataType_t,
        batch: usize,
        seq_local: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        causal: bool,
        nranks: usize,
        rank: usize,
    ) -> Result<Case> {
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
            k_shards: (0..nranks).map(|_| TestBuffer::new(shard, dtype)).collect::<Result<_>>()?,
            v_shards: (0..nranks).map(|_| TestBuffer::new(shard, dtype)).collect::<Result<_>>()?,
            out: TestBuffer::new(q_elems, dtype)?,
            lse: TestBuffer::new(batch * heads * seq_local, mkDataType_t::mkFloat32)?,
        })
    }
}

/// A ring attention case's name in the suites' lines (forward and backward alike).
pub(crate) fn shape_label(dtype: mkDataType_t, s: &RingShape) -> String {
    format!(
        "{} B={} S_local={} H={} H_kv={} D={} {}",
        dtype.name(),
        s.batch,
        s.seq_local,
        s.heads,
        s.kv_heads,
        s.head_dim,
        if s.causal { "causal" } else { "full" }
    )
}

impl FusedCase for Case {
    fn label(&self) -> String {
        shape_label(self.dtype, &self.shape)
    }

    /// Fresh inputs (shard s of K/V from seeds (seed, s) on every rank; Q per rank) and
    /// NaN-poisoned outputs.
    fn prepare(&self, seed: u64) -> Result<()> {
        fused_common::fill_shards(&self.k_shards, seed * 1000, 1.0)?;
        fused_common::fill_shards(&self.v_shards, seed * 1000 + 500, 1.0)?;
        self.q.randomize(seed * 1000 + 900 + self.rank as u64, 2.0, std::ptr::null_mut())?;
        self.out.poison(std::ptr::null_mut())?;
        self.lse.poison(std::ptr::null_mut())?;
        fused_common::sync_default_stream()
    }

    fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        let s = &self.shape;
        // SAFETY: device buffers of the sizes the op expects.
        unsafe {
            mkRingAttention(
                self.q.ptr() as *const _,
                self.k_shards[self.rank].ptr() as *const _,
                self.v_shards[self.rank].ptr() as *const _,
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

    /// (passed, detail): out and lse element by element against float64 attention over
    /// the global sequence (bounds as the module comment derives them), guard bands intact.
    fn verify(&self) -> Result<(bool, String)> {
        let s = &self.shape;
        let q = self.q.download_f64()?;
        let k: Vec<f64> = self.k_shards.iter().map(|b| b.download_f64()).collect::<Result<Vec<_>>>()?.concat();
        let v: Vec<f64> = self.v_shards.iter().map(|b| b.download_f64()).collect::<Result<Vec<_>>>()?.concat();
        let out = self.out.download_f64()?;
        let lse = self.lse.download_f64()?;
        let r = attention_reference(s, self.rank, self.scale as f64, &q, &k, &v, self.dtype);
        let (ref_out, out_bound, ref_lse, lse_bound) = (r.out, r.out_bound, r.lse, r.lse_bound);
        let out_verdict = check_close(&out, &ref_out, &out_bound, tolerance(self.dtype));
        let lse_verdict = check_close(&lse, &ref_lse, &lse_bound, LSE_L2_LIMIT);
        let mut buffers: Vec<(&str, &TestBuffer)> = vec![("out", &self.out), ("lse", &self.lse), ("q", &self.q)];
        buffers
            .extend(self.k_shards.iter().map(|b| ("K shard", b)).chain(self.v_shards.iter().map(|b| ("V shard", b))));
        let guards = fused_common::guards_intact(&buffers)?;
        let ok = out_verdict.passed() && lse_verdict.passed() && guards.is_none();
        Ok((
            ok,
            format!(
                "out: {out_verdict}; lse: {lse_verdict}{}",
                guards.map_or(String::new(), |w| format!("; GUARD {w}"))
            ),
        ))
    }
}

/// The relative L2 limit on lse (about 5 in magnitude, fp32, each within its bound of a
/// few 1e-4 at most): the second check after the element-wise one.
const LSE_L2_LIMIT: f64 = 1e-4;

/// Attention of this rank's queries over the global sequence in float64, with each
/// element's bound (the module comment derives them). `k` and `v` hold every rank's shard
/// in rank order.
struct AttentionReference {
    out: Vec<f64>,
    out_bound: Vec<f64>,
    lse: Vec<f64>,
    lse_bound: Vec<f64>,
}

#[allow(clippy::needless_range_loop)] // indices follow the bound's formula
fn attention_reference(
    s: &RingShape,
    rank: usize,
    scale: f64,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dtype: mkDataType_t,
) -> AttentionReference {
    let (d, h, hkv, sl, n) = (s.head_dim, s.heads, s.kv_heads, s.seq_local, s.nranks);
    let shard = s.batch * sl * hkv * d;
    let u = unit_roundoff(dtype);
    let u_acc = accumulation_unit(mkDataType_t::mkFloat32);
    let (exp_err, rescale_err) = (2f64.powi(-21), 2f64.powi(-22));
    let rows = s.batch * sl * h;
    let mut r = AttentionReference {
        out: vec![0f64; rows * d],
        out_bound: vec![0f64; rows * d],
        lse: vec![0f64; rows],
        lse_bound: vec![0f64; rows],
    };
    let mut scores = Vec::with_capacity(n * sl);
    for b in 0..s.batch {
        for hh in 0..h {
            let hk = hh / (h / hkv);
            for i in 0..sl {
                let qpos = token_pos(s, rank, i);
                let qrow = &q[((b * sl + i) * h + hh) * d..][..d];
                scores.clear();
                let mut dot_mag_max = 0f64;
                for src in 0..n {
                    for j in 0..sl {
                        if s.causal && token_pos(s, src, j) > qpos {
                            continue;
                        }
                        let base = src * shard + ((b * sl + j) * hkv + hk) * d;
                        let (dot, mag) = qrow
                            .iter()
                            .zip(&k[base..base + d])
                            .fold((0.0, 0.0), |(a, g), (x, y)| (a + x * y, g + (x * y).abs()));
                        dot_mag_max = dot_mag_max.max(mag);
                        scores.push((scale * dot, base));
                    }
                }
                let mx = scores.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
                let s_max = scores.iter().map(|x| x.0.abs()).fold(0.0, f64::max);
                let sum: f64 = scores.iter().map(|x| (x.0 - mx).exp()).sum();
                let row = ((b * sl + i) * h + hh) * d;
                let mut mag = vec![0f64; d];
                for &(sc, base) in &scores {
                    let p = (sc - mx).exp() / sum;
                    for c in 0..d {
                        r.out[row + c] += p * v[base + c];
                        mag[c] += p * v[base + c].abs();
                    }
                }
                let keys = scores.len();
                let blocks = keys.div_ceil(64) as f64;
                let score_err = scale * gamma(d, u_acc) * dot_mag_max + 2f64.powi(-22) * s_max;
                let factor = u + gamma(keys.max(1), u_acc) + 2.2 * (score_err + exp_err) + blocks * rescale_err;
                for c in 0..d {
                    r.out_bound[row + c] =
                        1.01 * (underflow_floor(dtype) + factor * mag[c] + 2.0 * u * r.out[row + c].abs());
                }
                let li = (b * h + hh) * sl + i;
                r.lse[li] = mx + sum.ln();
                r.lse_bound[li] = 1.01
                    * (2.2 * (score_err + exp_err)
                        + gamma(keys.max(1), u_acc)
                        + blocks * rescale_err
                        + 2f64.powi(-23) * r.lse[li].abs());
            }
        }
    }
    r
}

/// Query rows per rank (batch · seqLocal · heads) of the shapes a sanitizer-sized run keeps
/// (fused_common::sanitizer_sized): all but the many-head ones, whose extra items the
/// sanitizer runs' grid cap gives the small shapes too.
pub(crate) const SANITIZE_QUERY_ROWS: usize = 1024;

/// (batch, seqLocal, heads, kvHeads, headDim, causal)
fn shapes() -> Vec<(usize, usize, usize, usize, usize, bool)> {
    vec![
        // Decode-sized shards: 1, 2 and 16 tokens per rank (far below one 64-key tile).
        (1, 1, 4, 2, 128, false),
        (2, 2, 4, 4, 64, true),
        (1, 16, 8, 1, 64, true),
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
    let (mut checks, mut failures) = (0, 0);
    for &dtype in fused_common::case_dtypes() {
        for (b, sl, h, hkv, d, causal) in shapes() {
            // Sanitizer-sized: the shapes of at most SANITIZE_QUERY_ROWS query rows per rank.
            if fused_common::sanitizer_sized() && b * sl * h > SANITIZE_QUERY_ROWS {
                continue;
            }
            let case = Case::new(dtype, b, sl, h, hkv, d, causal, n, rank)?;
            let (c, f) = fused_common::check_rounds(comm, rank, "mkRingAttention", &case, 17, 2, &|_| {})?;
            checks += c;
            failures += f;
        }
    }
    outcome::count(checks);
    say(rank, format!("correctness: {checks} checks, {failures} wrong"));
    if failures > 0 {
        return Err(MkError::internal(format!("mkRingAttention: {failures} of {checks} checks wrong")));
    }
    Ok(())
}

/// Bad arguments on a live communicator: the call fails with the rule and launches nothing.
fn argument_errors(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let stream = Stream::for_rank()?;
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
    // Host memory among device buffers, twice: the buffers the communicator approved before
    // are not asked about again, the host one is, each time (a refused call remembers nothing).
    let host = vec![0u128; 4096];
    let hp = host.as_ptr() as *mut std::ffi::c_void;
    for _ in 0..2 {
        // SAFETY: as above, rejected before any access.
        let r = unsafe { mkRingAttention(p, p, p, hp, p.cast(), 1, 16, 4, 2, 64, 0.1, 0, bf16, comm, stream.0) };
        let msg = last_error(comm);
        if r != mkResult_t::mkInvalidArgument || !msg.contains("out (") || !msg.contains("is not device memory") {
            return Err(MkError::internal(format!("host out: got {r:?} \"{msg}\"")));
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
    outcome::count(cases.len() + 2 + usize::from(n > 1));
    say(rank, "argument errors: rejected with the rule");
    Ok(())
}

fn last_error(comm: mkComm_t) -> String {
    // SAFETY: a live communicator; the string stays valid until its next call.
    unsafe { std::ffi::CStr::from_ptr(mkGetLastError(comm)) }.to_string_lossy().into_owned()
}

fn graph_replay(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    fused_common::graph_replay(
        comm,
        rank,
        "mkRingAttention",
        &Case::new(mkDataType_t::mkBfloat16, 1, 192, 4, 2, 128, true, n, rank)?,
    )
}

fn absent_rank(env: &RankEnv, control: &Comm) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let case = Case::new(mkDataType_t::mkBfloat16, 1, 256, 4, 2, 128, true, n, rank)?;
    fused_common::absent_rank(env, control, 2, "mkRingAttention (a rank absent)", |comm, stream| {
        case.prepare(5)?;
        Ok(case.launch(comm, stream))
    })
}

#[cfg(test)]
mod tests {
    //! The bounds against a flash-attention computation simulated on the CPU as the header
    //! describes the kernel's: fp32 scores, an online softmax over 64-key blocks with fp32
    //! rescaling, the probabilities rounded to the element type before P·V, fp32
    //! accumulation, the row sum from the unrounded probabilities, out rounded once.
    use super::*;
    use mkernel_tools::testing::{round_to, xorshift_unit};

    /// Values in [-scale, 3·scale), rounded to `dtype`.
    fn values(seed: u64, n: usize, dtype: mkDataType_t, scale: f64) -> Vec<f64> {
        xorshift_unit(seed, n).map(|u| round_to(dtype, scale * (4.0 * u - 1.0))).collect()
    }

    /// (out, lse) as the kernel forms them; `drop_block` leaves one 64-key block out of one
    /// query row (a block that never arrived).
    fn simulated(
        s: &RingShape,
        rank: usize,
        scale: f32,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        dtype: mkDataType_t,
        drop_block: Option<(usize, usize)>,
    ) -> (Vec<f64>, Vec<f64>) {
        let (d, h, hkv, sl, n) = (s.head_dim, s.heads, s.kv_heads, s.seq_local, s.nranks);
        let shard = s.batch * sl * hkv * d;
        let mut out = vec![0f64; s.batch * sl * h * d];
        let mut lse = vec![0f64; s.batch * h * sl];
        for b in 0..s.batch {
            for hh in 0..h {
                let hk = hh / (h / hkv);
                for i in 0..sl {
                    let qpos = token_pos(s, rank, i);
                    let row = (b * sl + i) * h + hh;
                    let keys: Vec<usize> = (0..n)
                        .flat_map(|src| {
                            (0..sl)
                                .filter(move |&j| !(s.causal && token_pos(s, src, j) > qpos))
                                .map(move |j| src * shard + ((b * sl + j) * hkv + hk) * d)
                        })
                        .collect();
                    let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
                    let mut acc = vec![0f32; d];
                    for (blk, block) in keys.chunks(64).enumerate() {
                        if drop_block == Some((row, blk)) {
                            continue;
                        }
                        let sc: Vec<f32> = block
                            .iter()
                            .map(|&base| scale * (0..d).fold(0f32, |a, c| a + (q[row * d + c] * k[base + c]) as f32))
                            .collect();
                        let m_new = sc.iter().fold(m, |a, &x| a.max(x));
                        let rescale = (m - m_new).exp();
                        l *= rescale;
                        acc.iter_mut().for_each(|x| *x *= rescale);
                        for (&base, &x) in block.iter().zip(&sc) {
                            let p = (x - m_new).exp();
                            l += p;
                            let p_rounded = round_to(dtype, p as f64) as f32;
                            for c in 0..d {
                                acc[c] += p_rounded * v[base + c] as f32;
                            }
                        }
                        m = m_new;
                    }
                    for c in 0..d {
                        out[row * d + c] = round_to(dtype, (acc[c] / l) as f64);
                    }
                    lse[(b * h + hh) * sl + i] = (m + l.ln()) as f64;
                }
            }
        }
        (out, lse)
    }

    #[test]
    fn flash_attention_passes_and_a_missing_block_fails() {
        for dtype in [mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16] {
            for (causal, d, nranks, seq_local) in [(false, 64, 2, 72), (true, 128, 3, 130), (true, 64, 1, 2)] {
                let s = RingShape { batch: 1, seq_local, heads: 4, kv_heads: 2, head_dim: d, causal, nranks };
                let scale = 1.5 / (d as f32).sqrt();
                let q = values(1, seq_local * 4 * d, dtype, 2.0);
                let k = values(2, nranks * seq_local * 2 * d, dtype, 1.0);
                let v = values(3, nranks * seq_local * 2 * d, dtype, 1.0);
                let rank = nranks - 1;
                let r = attention_reference(&s, rank, scale as f64, &q, &k, &v, dtype);
                let (out, lse) = simulated(&s, rank, scale, &q, &k, &v, dtype, None);
                let vo = check_close(&out, &r.out, &r.out_bound, tolerance(dtype));
                let vl = check_close(&lse, &r.lse, &r.lse_bound, LSE_L2_LIMIT);
                assert!(
                    vo.passed() && vl.passed(),
                    "{} causal {causal} D {d} n {nranks}: out {vo}; lse {vl}",
                    dtype.name()
                );
                if nranks * seq_local > 64 {
                    // The last query row's first key block never arrived.
                    let last_row = seq_local * 4 - 1;
                    let (out, lse) = simulated(&s, rank, scale, &q, &k, &v, dtype, Some((last_row, 0)));
                    let vo = check_close(&out, &r.out, &r.out_bound, tolerance(dtype));
                    let vl = check_close(&lse, &r.lse, &r.lse_bound, LSE_L2_LIMIT);
                    assert!(!vo.passed() && !vl.passed(), "{} causal {causal}: out {vo}; lse {vl}", dtype.name());
                }
            }
        }
    }
}
