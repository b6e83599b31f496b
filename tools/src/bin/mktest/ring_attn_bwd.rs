//! mkRingAttentionBackward on the GPU with MK_TEST_NRANKS ranks (processes sharing the GPU
//! under MPS, or one per GPU).
//!
//! Per rank: both dtypes × shapes (decode-sized shards; GQA 4:1, 2:1, 1:1; seqLocal off
//! the 64/128 tile grid; D 64 and 128; causal zigzag and non-causal; more tickets than
//! SMs) against the float64 gradient of attention over the gathered global sequence: each
//! call runs mkRingAttention (its out and lse feed the backward, as in training), then
//! mkRingAttentionBackward; dq, dk and dv are poisoned with NaN before every call and
//! checked element by element; every shape twice with fresh inputs (the device-side
//! epochs advance); argument errors on a live communicator; forward and backward captured
//! in one CUDA graph and replayed with fresh inputs, direct calls between replays; and,
//! with several ranks, a rank that never calls: the others stop within the timeout.
//!
//! Acceptance (testing::Rule's terms): with exact scores s, P = exp(s − lse), δ = dout·out,
//! dP = dout·v, dS = P(dP − δ), the kernel's P carries a relative error e_P ≤ δs + e_lse +
//! 2⁻²¹ + 2⁻²³(|s| + |lse|) (δs the fp32 score error, e_lse the forward's lse bound), δ
//! the rounding of out (≤ (3u + e_P)·Σ P|v| per element) and γ_D, dP γ_D·Σ|dout·v|; P and
//! dS are rounded (u) before fp32 sums of N terms (γ_N, the chain's adds included). So
//! |ΔdS| ≤ e_P·P|dP − δ| + P(γ_D Σ|dout·v| + Δδ) + u|dS|, and
//! |Δdv| ≤ Σ (e_P + u + γ_N)·P|dout| + u|dv|, |Δdk| ≤ scale·Σ (|ΔdS| + γ_N|dS|)·|q| + u|dk|,
//! |Δdq| ≤ scale·Σ (|ΔdS| + γ_N|dS|)·|k| + u|dq|; the bounds carry a factor 1.5 for the
//! second-order terms and the approximations above.

use crate::collectives::{say, Stream};
use crate::fused_common::{self, FusedCase};
use crate::outcome::{self, Outcome};
use crate::ranks::RankEnv;
use mkernel::comm::Comm;
use mkernel::cuda::sys;
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::fused::{mkRingAttention, mkRingAttentionBackward};
use mkernel::ffi::mkComm_t;
use mkernel::ffi::query::mkGetLastError;
use mkernel::ops::attention::ring_attention::{token_pos, RingShape};
use mkernel::types::mkDataType_t;
use mkernel_tools::testing::{
    accumulation_unit, check_close, gamma, tolerance, underflow_floor, unit_roundoff, TestBuffer,
};

pub fn run() -> Result<Outcome> {
    fused_common::run_suite(
        "ring_attn_bwd",
        |comm, _control, rank, n| {
            correctness(comm, rank, n)
                .and_then(|_| argument_errors(comm, rank))
                .and_then(|_| graph_replay(comm, rank, n))
        },
        absent_rank,
    )
}

struct Case {
    dtype: mkDataType_t,
    shape: RingShape,
    rank: usize,
    scale: f32,
    /// Every rank's shard of q, k, v and dout, one allocation each: every rank knows the
    /// whole sequence for the reference and passes its own shards to the ops.
    q: Vec<TestBuffer>,
    k: Vec<TestBuffer>,
    v: Vec<TestBuffer>,
    dout: Vec<TestBuffer>,
    out: TestBuffer,
    lse: TestBuffer,
    dq: TestBuffer,
    dk: TestBuffer,
    dv: TestBuffer,
}

impl Case {
    #[allow(clippy::too_many_arguments)]
    fn new(
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
        let kv_elems = batch * seq_local * kv_heads * head_dim;
        let shards = |elems: usize| (0..nranks).map(|_| TestBuffer::new(elems, dtype)).collect::<Result<Vec<_>>>();
        Ok(Case {
            dtype,
            shape,
            rank,
            scale: 1.5 / (head_dim as f32).sqrt(),
            q: shards(q_elems)?,
            k: shards(kv_elems)?,
            v: shards(kv_elems)?,
            dout: shards(q_elems)?,
            out: TestBuffer::new(q_elems, dtype)?,
            lse: TestBuffer::new(batch * heads * seq_local, mkDataType_t::mkFloat32)?,
            dq: TestBuffer::new(q_elems, dtype)?,
            dk: TestBuffer::new(kv_elems, dtype)?,
            dv: TestBuffer::new(kv_elems, dtype)?,
        })
    }

    /// The backward alone on this rank's tensors and the forward's out and lse.
    ///
    /// # Safety
    /// `comm` is a live communicator; the buffers are the sizes the shape gives.
    unsafe fn backward(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        let (s, r) = (&self.shape, self.rank);
        mkRingAttentionBackward(
            self.q[r].ptr() as *const _,
            self.k[r].ptr() as *const _,
            self.v[r].ptr() as *const _,
            self.out.ptr() as *const _,
            self.dout[r].ptr() as *const _,
            self.lse.ptr() as *const f32,
            self.dq.ptr() as *mut _,
            self.dk.ptr() as *mut _,
            self.dv.ptr() as *mut _,
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

impl FusedCase for Case {
    fn label(&self) -> String {
        crate::ring_attn::shape_label(self.dtype, &self.shape)
    }

    /// Fresh inputs (shard s of every tensor from seeds (seed, s) on every rank) and
    /// NaN-poisoned outputs.
    fn prepare(&self, seed: u64) -> Result<()> {
        fused_common::fill_shards(&self.q, seed * 1000 + 100, 2.0)?;
        fused_common::fill_shards(&self.k, seed * 1000 + 200, 1.0)?;
        fused_common::fill_shards(&self.v, seed * 1000 + 300, 1.0)?;
        fused_common::fill_shards(&self.dout, seed * 1000 + 400, 1.0)?;
        for b in [&self.out, &self.lse, &self.dq, &self.dk, &self.dv] {
            b.poison(std::ptr::null_mut())?;
        }
        fused_common::sync_default_stream()
    }

    /// The forward, then the backward on its out and lse, on one stream.
    fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        fused_common::launch_back_to_back(self, comm, stream)
    }

    fn ops(&self) -> usize {
        2
    }

    fn launch_op(&self, i: usize, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        if i > 0 {
            // SAFETY: device buffers of the sizes the op expects; the forward's out and lse
            // were queued before it on this stream.
            return unsafe { self.backward(comm, stream) };
        }
        let s = &self.shape;
        let r = self.rank;
        // SAFETY: device buffers of the sizes the ops expect.
        unsafe {
            mkRingAttention(
                self.q[r].ptr() as *const _,
                self.k[r].ptr() as *const _,
                self.v[r].ptr() as *const _,
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

    fn verify(&self) -> Result<(bool, String)> {
        let all = |b: &[TestBuffer]| -> Result<Vec<Vec<f64>>> { b.iter().map(|x| x.download_f64()).collect() };
        let (q, k, v, dout) = (all(&self.q)?, all(&self.k)?, all(&self.v)?, all(&self.dout)?);
        let r = gradient_reference(&self.shape, self.rank, self.scale as f64, &q, &k, &v, &dout, self.dtype);
        let limit = 2.0 * tolerance(self.dtype);
        let dq = check_close(&self.dq.download_f64()?, &r.dq, &r.dq_bound, limit);
        let dk = check_close(&self.dk.download_f64()?, &r.dk, &r.dk_bound, limit);
        let dv = check_close(&self.dv.download_f64()?, &r.dv, &r.dv_bound, limit);
        let mut buffers: Vec<(&str, &TestBuffer)> =
            vec![("dq", &self.dq), ("dk", &self.dk), ("dv", &self.dv), ("out", &self.out), ("lse", &self.lse)];
        for (name, set) in [("q", &self.q), ("k", &self.k), ("v", &self.v), ("dout", &self.dout)] {
            buffers.extend(set.iter().map(|b| (name, b)));
        }
        let guards = fused_common::guards_intact(&buffers)?;
        let ok = dq.passed() && dk.passed() && dv.passed() && guards.is_none();
        Ok((ok, format!("dq: {dq}; dk: {dk}; dv: {dv}{}", guards.map_or(String::new(), |w| format!("; GUARD {w}")))))
    }
}

/// This rank's dq, dk, dv in float64 and each element's bound.
struct GradientReference {
    dq: Vec<f64>,
    dq_bound: Vec<f64>,
    dk: Vec<f64>,
    dk_bound: Vec<f64>,
    dv: Vec<f64>,
    dv_bound: Vec<f64>,
}

/// The gradients of attention over the global sequence, with the bounds of the module
/// comment; `q[r]`, `k[r]`, `v[r]`, `dout[r]` are rank r's shards. `drop_source` leaves the
/// keys of one rank out of head 0's sums: a ring step lost (the CPU test of the bounds).
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
fn gradient_reference_with(
    s: &RingShape,
    rank: usize,
    scale: f64,
    q: &[Vec<f64>],
    k: &[Vec<f64>],
    v: &[Vec<f64>],
    dout: &[Vec<f64>],
    dtype: mkDataType_t,
    drop_source: Option<usize>,
) -> GradientReference {
    let (d, h, hkv, sl, n) = (s.head_dim, s.heads, s.kv_heads, s.seq_local, s.nranks);
    let total = n * sl;
    let u = unit_roundoff(dtype);
    let ua = accumulation_unit(mkDataType_t::mkFloat32);
    // (rank, local index) of every global position.
    let mut at = vec![(0, 0); total];
    for r in 0..n {
        for i in 0..sl {
            at[token_pos(s, r, i)] = (r, i);
        }
    }
    let row = |t: &[Vec<f64>], heads: usize, b: usize, pos: usize, head: usize| -> Vec<f64> {
        let (r, i) = at[pos];
        t[r][((b * sl + i) * heads + head) * d..][..d].to_vec()
    };
    let q_len = s.batch * sl * h * d;
    let kv_len = s.batch * sl * hkv * d;
    let mut g = GradientReference {
        dq: vec![0.0; q_len],
        dq_bound: vec![0.0; q_len],
        dk: vec![0.0; kv_len],
        dk_bound: vec![0.0; kv_len],
        dv: vec![0.0; kv_len],
        dv_bound: vec![0.0; kv_len],
    };
    // Magnitudes summed per element before the bounds are formed.
    let mut dk_mag = vec![0.0; kv_len];
    let mut dv_mag = vec![0.0; kv_len];
    let mut dq_mag = vec![0.0; q_len];
    let mut counts = vec![0usize; kv_len / d.max(1)];
    for b in 0..s.batch {
        for hh in 0..h {
            let hk = hh / (h / hkv);
            let keys: Vec<Vec<f64>> = (0..total).map(|p| row(k, hkv, b, p, hk)).collect();
            let values: Vec<Vec<f64>> = (0..total).map(|p| row(v, hkv, b, p, hk)).collect();
            for qp in 0..total {
                let (qr, qi) = at[qp];
                let qrow = row(q, h, b, qp, hh);
                let grow = row(dout, h, b, qp, hh);
                let visible: Vec<usize> = (0..total)
                    .filter(|&kp| (!s.causal || kp <= qp) && !(hh == 0 && drop_source == Some(at[kp].0)))
                    .collect();
                let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(a, c)| a * c).sum::<f64>();
                let mag = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(a, c)| (a * c).abs()).sum::<f64>();
                let sc: Vec<f64> = visible.iter().map(|&kp| scale * dot(&qrow, &keys[kp])).collect();
                // The lse over every visible key (dropped keys still count in the
                // forward's lse, as they would in a backward that loses a ring step).
                let all_sc: Vec<f64> =
                    (0..total).filter(|&kp| !s.causal || kp <= qp).map(|kp| scale * dot(&qrow, &keys[kp])).collect();
                let mx = all_sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = mx + all_sc.iter().map(|x| (x - mx).exp()).sum::<f64>().ln();
                let p: Vec<f64> = sc.iter().map(|x| (x - lse).exp()).collect();
                let mut o = vec![0.0; d];
                let mut o_mag = vec![0.0; d];
                for (j, &kp) in visible.iter().enumerate() {
                    for c in 0..d {
                        o[c] += p[j] * values[kp][c];
                        o_mag[c] += p[j] * values[kp][c].abs();
                    }
                }
                let delta = dot(&grow, &o);
                let keys_n = all_sc.len();
                let blocks = keys_n.div_ceil(64) as f64;
                let dots_max = visible.iter().map(|&kp| mag(&qrow, &keys[kp])).fold(0.0, f64::max);
                let s_max = sc.iter().map(|x| x.abs()).fold(0.0, f64::max);
                let score_err = scale * gamma(d, ua) * dots_max + 2f64.powi(-22) * s_max;
                let lse_err = 2.2 * (score_err + 2f64.powi(-21))
                    + gamma(keys_n.max(1), ua)
                    + blocks * 2f64.powi(-22)
                    + 2f64.powi(-23) * lse.abs();
                let e_p = score_err + lse_err + 2f64.powi(-21) + 2f64.powi(-23) * (s_max + lse.abs());
                let delta_err = (0..d).map(|c| grow[c].abs() * (3.0 * u + e_p + gamma(d, ua)) * o_mag[c]).sum::<f64>();
                let mine = qr == rank;
                for (j, &kp) in visible.iter().enumerate() {
                    let (kr, ki) = at[kp];
                    let dp = dot(&grow, &values[kp]);
                    let ds = p[j] * (dp - delta);
                    let ds_err = e_p * p[j] * (dp - delta).abs()
                        + p[j] * (gamma(d, ua) * mag(&grow, &values[kp]) + delta_err)
                        + u * ds.abs();
                    if mine {
                        let base = ((b * sl + qi) * h + hh) * d;
                        for c in 0..d {
                            g.dq[base + c] += scale * ds * keys[kp][c];
                            g.dq_bound[base + c] += scale * ds_err * keys[kp][c].abs();
                            dq_mag[base + c] += scale * ds.abs() * keys[kp][c].abs();
                        }
                    }
                    if kr == rank {
                        let kbase = ((b * sl + ki) * hkv + hk) * d;
                        counts[kbase / d] += 1;
                        for c in 0..d {
                            g.dk[kbase + c] += scale * ds * qrow[c];
                            g.dk_bound[kbase + c] += scale * ds_err * qrow[c].abs();
                            dk_mag[kbase + c] += scale * ds.abs() * qrow[c].abs();
                            g.dv[kbase + c] += p[j] * grow[c];
                            g.dv_bound[kbase + c] += (e_p + u) * p[j] * grow[c].abs();
                            dv_mag[kbase + c] += p[j] * grow[c].abs();
                        }
                    }
                }
                if mine {
                    let base = ((b * sl + qi) * h + hh) * d;
                    let gn = gamma(keys_n.max(1), ua);
                    for c in 0..d {
                        g.dq_bound[base + c] = 1.5
                            * (underflow_floor(dtype)
                                + g.dq_bound[base + c]
                                + gn * dq_mag[base + c]
                                + u * g.dq[base + c].abs());
                    }
                }
            }
        }
    }
    for e in 0..kv_len {
        let gn = gamma(counts[e / d.max(1)] + n + 1, ua);
        g.dk_bound[e] = 1.5 * (underflow_floor(dtype) + g.dk_bound[e] + gn * dk_mag[e] + u * g.dk[e].abs());
        g.dv_bound[e] = 1.5 * (underflow_floor(dtype) + g.dv_bound[e] + gn * dv_mag[e] + u * g.dv[e].abs());
    }
    g
}

#[allow(clippy::too_many_arguments)]
fn gradient_reference(
    s: &RingShape,
    rank: usize,
    scale: f64,
    q: &[Vec<f64>],
    k: &[Vec<f64>],
    v: &[Vec<f64>],
    dout: &[Vec<f64>],
    dtype: mkDataType_t,
) -> GradientReference {
    gradient_reference_with(s, rank, scale, q, k, v, dout, dtype, None)
}

/// (batch, seqLocal, heads, kvHeads, headDim, causal). The reference costs (n·seqLocal)² per
/// head: the shapes stay small enough for 8 ranks.
fn shapes() -> Vec<(usize, usize, usize, usize, usize, bool)> {
    vec![
        // Decode-sized shards: 1, 2 and 16 tokens per rank.
        (1, 1, 4, 2, 128, false),
        (2, 2, 4, 4, 64, true),
        (1, 16, 8, 1, 64, true),
        // One tile, then shards off the 64/128 grid (tails in X and Y tiles, zigzag
        // chunks that straddle a tile).
        (1, 64, 4, 4, 64, false),
        (2, 72, 4, 1, 64, false),
        (1, 130, 4, 2, 128, true),
        (1, 200, 2, 2, 128, false),
        (1, 136, 4, 1, 64, true),
        // More tickets than SMs (160 dQ items): every CTA runs several items, so the X and
        // Y rings carry their phases across items and kinds.
        (1, 64, 160, 8, 64, false),
    ]
}

fn correctness(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let (mut checks, mut failures) = (0, 0);
    for &dtype in fused_common::case_dtypes() {
        for (b, sl, h, hkv, d, causal) in shapes() {
            if fused_common::sanitizer_sized() && b * sl * h > crate::ring_attn::SANITIZE_QUERY_ROWS {
                continue;
            }
            let case = Case::new(dtype, b, sl, h, hkv, d, causal, n, rank)?;
            let (c, f) = fused_common::check_rounds(comm, rank, "mkRingAttentionBackward", &case, 23, 2, &|_| {})?;
            checks += c;
            failures += f;
        }
    }
    fused_common::count_checks(rank, "mkRingAttentionBackward", checks, failures)
}

/// Bad arguments on a live communicator: the call fails with the rule and launches nothing.
fn argument_errors(comm: mkComm_t, rank: usize) -> Result<()> {
    let stream = Stream::for_rank()?;
    let buf = TestBuffer::new(1 << 16, mkDataType_t::mkBfloat16)?;
    let p = buf.ptr() as *mut std::ffi::c_void;
    let bf16 = mkDataType_t::mkBfloat16 as i32;
    let null = std::ptr::null_mut();
    let cases: [(usize, usize, *mut std::ffi::c_void, f32, &str); 4] = [
        (96, 2, p, 0.1, "headDim"),
        (64, 3, p, 0.1, "divide"),
        (64, 2, p, -1.0, "softmaxScale"),
        (64, 2, null, 0.1, "dk is NULL"),
    ];
    for (d, hkv, dk, scale, needle) in cases {
        // SAFETY: the call must fail its checks before touching the buffers.
        let r = unsafe {
            mkRingAttentionBackward(p, p, p, p, p, p.cast(), p, dk, p, 1, 16, 4, hkv, d, scale, 0, bf16, comm, stream.0)
        };
        // SAFETY: a live communicator; the message stays valid until its next call.
        let msg = unsafe { std::ffi::CStr::from_ptr(mkGetLastError(comm)) }.to_string_lossy().into_owned();
        if r != mkResult_t::mkInvalidArgument || !msg.contains(needle) {
            return Err(MkError::internal(format!("bad argument ({needle}): got {r:?} \"{msg}\"")));
        }
    }
    // Host memory after eight device buffers, twice: refused each time, naming the buffer.
    let host = vec![0u128; 4096];
    let hp = host.as_ptr() as *mut std::ffi::c_void;
    for _ in 0..2 {
        // SAFETY: as above, rejected before any access.
        let r = unsafe {
            mkRingAttentionBackward(p, p, p, p, p, p.cast(), p, p, hp, 1, 16, 4, 2, 64, 0.1, 0, bf16, comm, stream.0)
        };
        // SAFETY: a live communicator; the message stays valid until its next call.
        let msg = unsafe { std::ffi::CStr::from_ptr(mkGetLastError(comm)) }.to_string_lossy().into_owned();
        if r != mkResult_t::mkInvalidArgument || !msg.contains("dv (") || !msg.contains("is not device memory") {
            return Err(MkError::internal(format!("host dv: got {r:?} \"{msg}\"")));
        }
    }
    outcome::count(cases.len() + 2);
    say(rank, "argument errors: rejected with the rule");
    Ok(())
}

fn graph_replay(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    fused_common::graph_replay(
        comm,
        rank,
        "mkRingAttention + mkRingAttentionBackward",
        &Case::new(mkDataType_t::mkBfloat16, 1, 130, 4, 2, 128, true, n, rank)?,
    )
}

fn absent_rank(env: &RankEnv, control: &Comm) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let case = Case::new(mkDataType_t::mkBfloat16, 1, 128, 4, 2, 128, true, n, rank)?;
    // The backward alone (out and lse left poisoned, outputs undefined): the bounded waits
    // for the absent rank's K/V and dK/dV sums are what is checked.
    fused_common::absent_rank(env, control, 3, "mkRingAttentionBackward (a rank absent)", |comm, stream| {
        case.prepare(7)?;
        // SAFETY: the harness's live communicator; the case's buffers.
        Ok(unsafe { case.backward(comm, stream) })
    })
}

#[cfg(test)]
mod tests {
    //! The reference and its bounds on the CPU: the float64 gradient matches central
    //! differences of float64 attention, and gradients that miss a ring step fail the
    //! bounds.
    use super::*;
    use mkernel::ops::attention::ring_attention_backward::chain_order;
    use mkernel_tools::testing::{round_to, xorshift_unit};

    fn values(seed: u64, n: usize, dtype: mkDataType_t, scale: f64) -> Vec<f64> {
        xorshift_unit(seed, n).map(|u| round_to(dtype, scale * (4.0 * u - 1.0))).collect()
    }

    /// L = Σ dout · out over every rank's queries, in float64.
    #[allow(clippy::needless_range_loop)] // ranks index several tensors alike
    fn loss(s: &RingShape, scale: f64, q: &[Vec<f64>], k: &[Vec<f64>], v: &[Vec<f64>], dout: &[Vec<f64>]) -> f64 {
        let (d, h, hkv, sl, n) = (s.head_dim, s.heads, s.kv_heads, s.seq_local, s.nranks);
        let mut total = 0.0;
        for r in 0..n {
            for hh in 0..h {
                let hk = hh / (h / hkv);
                for i in 0..sl {
                    let qp = token_pos(s, r, i);
                    let qrow = &q[r][(i * h + hh) * d..][..d];
                    let mut sc = Vec::new();
                    for src in 0..n {
                        for j in 0..sl {
                            if !s.causal || token_pos(s, src, j) <= qp {
                                let krow = &k[src][(j * hkv + hk) * d..][..d];
                                sc.push((scale * qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>(), src, j));
                            }
                        }
                    }
                    let mx = sc.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = sc.iter().map(|x| (x.0 - mx).exp()).sum();
                    for c in 0..d {
                        let o: f64 =
                            sc.iter().map(|&(x, src, j)| (x - mx).exp() / sum * v[src][(j * hkv + hk) * d + c]).sum();
                        total += dout[r][(i * h + hh) * d + c] * o;
                    }
                }
            }
        }
        total
    }

    /// The kernel's arithmetic, step by step on the CPU: the forward's lse (fp32) and out
    /// (rounded to the element type), lse · log2 e and delta in fp32, P = 2^(s·scale·log2 e −
    /// lse2) in fp32 with the exp2 approximation's error (2^-22, one sign for every P), P
    /// and dS rounded before their products, fp32 sums in the kernel's orders (dq over
    /// ring steps r, r − 1, …; dk/dv along the chain r − 1, r − 2, …, r, each rank's
    /// heads and queries in order), scale and the final rounding at the end. Returns this
    /// rank's dq, dk, dv.
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    fn emulate_kernel(
        s: &RingShape,
        rank: usize,
        scale: f32,
        q: &[Vec<f64>],
        k: &[Vec<f64>],
        v: &[Vec<f64>],
        dout: &[Vec<f64>],
        dtype: mkDataType_t,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (d, h, hkv, sl, n) = (s.head_dim, s.heads, s.kv_heads, s.seq_local, s.nranks);
        let group = h / hkv;
        let at = |t: &[Vec<f64>], heads: usize, r: usize, b: usize, i: usize, head: usize| -> Vec<f32> {
            t[r][((b * sl + i) * heads + head) * d..][..d].iter().map(|&x| x as f32).collect()
        };
        let dot32 = |x: &[f32], y: &[f32]| x.iter().zip(y).fold(0f32, |acc, (a, c)| a.mul_add(*c, acc));
        let visible =
            |qr: usize, qi: usize, kr: usize, ki: usize| !s.causal || token_pos(s, kr, ki) <= token_pos(s, qr, qi);
        // The forward's outputs and the kernel's row values, per (rank, batch, head, query).
        let mut rows = vec![(0f32, 0f32); n * s.batch * h * sl];
        let row_index = |r: usize, b: usize, hh: usize, i: usize| ((r * s.batch + b) * h + hh) * sl + i;
        for r in 0..n {
            for b in 0..s.batch {
                for hh in 0..h {
                    for i in 0..sl {
                        let qrow: Vec<f64> = q[r][((b * sl + i) * h + hh) * d..][..d].to_vec();
                        let mut sc = Vec::new();
                        for kr in 0..n {
                            for ki in 0..sl {
                                if visible(r, i, kr, ki) {
                                    let krow = &k[kr][((b * sl + ki) * hkv + hh / group) * d..][..d];
                                    let x: f64 = qrow.iter().zip(krow).map(|(a, c)| a * c).sum();
                                    sc.push((scale as f64 * x, kr, ki));
                                }
                            }
                        }
                        let mx = sc.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
                        let sum: f64 = sc.iter().map(|x| (x.0 - mx).exp()).sum();
                        let lse = (mx + sum.ln()) as f32;
                        let mut delta = 0f32;
                        for c in 0..d {
                            let o: f64 = sc
                                .iter()
                                .map(|&(x, kr, ki)| {
                                    (x - mx).exp() / sum * v[kr][((b * sl + ki) * hkv + hh / group) * d + c]
                                })
                                .sum();
                            let g = dout[r][((b * sl + i) * h + hh) * d + c] as f32;
                            delta = (round_to(dtype, o) as f32).mul_add(g, delta);
                        }
                        rows[row_index(r, b, hh, i)] = (lse * std::f32::consts::LOG2_E, delta);
                    }
                }
            }
        }
        let sl2 = scale * std::f32::consts::LOG2_E;
        // P and dS of (query qi of rank qr, key ki of rank kr), each rounded to the element type.
        let p_ds = |b: usize, hh: usize, qr: usize, qi: usize, kr: usize, ki: usize| -> (f32, f32) {
            let (lse2, delta) = rows[row_index(qr, b, hh, qi)];
            let score = dot32(&at(q, h, qr, b, qi, hh), &at(k, hkv, kr, b, ki, hh / group));
            let p = (2f32.powf(score * sl2 - lse2) as f64 * (1.0 + 2f64.powi(-22))) as f32;
            let dp = dot32(&at(dout, h, qr, b, qi, hh), &at(v, hkv, kr, b, ki, hh / group));
            (round_to(dtype, p as f64) as f32, round_to(dtype, (p * (dp - delta)) as f64) as f32)
        };
        let mut dq = vec![0.0; s.batch * sl * h * d];
        let mut dk = vec![0.0; s.batch * sl * hkv * d];
        let mut dv = vec![0.0; s.batch * sl * hkv * d];
        for b in 0..s.batch {
            for hh in 0..h {
                for qi in 0..sl {
                    let mut acc = vec![0f32; d];
                    for step in 0..n {
                        let src = (rank + n - step) % n;
                        for ki in 0..sl {
                            if visible(rank, qi, src, ki) {
                                let (_, ds) = p_ds(b, hh, rank, qi, src, ki);
                                let krow = at(k, hkv, src, b, ki, hh / group);
                                for c in 0..d {
                                    acc[c] = ds.mul_add(krow[c], acc[c]);
                                }
                            }
                        }
                    }
                    for c in 0..d {
                        dq[((b * sl + qi) * h + hh) * d + c] = round_to(dtype, (acc[c] * scale) as f64);
                    }
                }
            }
            for hk in 0..hkv {
                for ki in 0..sl {
                    let (mut acc_k, mut acc_v) = (vec![0f32; d], vec![0f32; d]);
                    for qr in chain_order(rank, n) {
                        for hh in hk * group..(hk + 1) * group {
                            for qi in 0..sl {
                                if visible(qr, qi, rank, ki) {
                                    let (p, ds) = p_ds(b, hh, qr, qi, rank, ki);
                                    let (qrow, grow) = (at(q, h, qr, b, qi, hh), at(dout, h, qr, b, qi, hh));
                                    for c in 0..d {
                                        acc_k[c] = ds.mul_add(qrow[c], acc_k[c]);
                                        acc_v[c] = p.mul_add(grow[c], acc_v[c]);
                                    }
                                }
                            }
                        }
                    }
                    for c in 0..d {
                        let e = ((b * sl + ki) * hkv + hk) * d + c;
                        dk[e] = round_to(dtype, (acc_k[c] * scale) as f64);
                        dv[e] = round_to(dtype, acc_v[c] as f64);
                    }
                }
            }
        }
        (dq, dk, dv)
    }

    /// A kernel that computes what the header states, in its rounding order, passes the
    /// suite's bounds on shapes like the suite's (off-grid shards, GQA, both dtypes, D 64
    /// and 128): the bounds do not fail a correct kernel.
    #[test]
    fn the_kernels_arithmetic_passes_the_bounds() {
        for (dtype, n, seq_local, heads, kv_heads, d, causal) in [
            (mkDataType_t::mkBfloat16, 3, 130, 4, 2, 128, true),
            (mkDataType_t::mkFloat16, 3, 130, 4, 2, 128, true),
            (mkDataType_t::mkFloat16, 2, 72, 4, 1, 64, false),
            (mkDataType_t::mkBfloat16, 4, 64, 2, 2, 64, false),
        ] {
            let s = RingShape { batch: 1, seq_local, heads, kv_heads, head_dim: d, causal, nranks: n };
            let scale = 1.5 / (d as f32).sqrt();
            let uniform = |seed: u64, len: usize, sc: f64| -> Vec<f64> {
                xorshift_unit(seed, len).map(|u| round_to(dtype, sc * (2.0 * u - 1.0))).collect()
            };
            let shard = |seed: u64, hs: usize, sc: f64| -> Vec<Vec<f64>> {
                (0..n).map(|r| uniform(seed * 10 + r as u64, seq_local * hs * d, sc)).collect()
            };
            let (q, k, v, dout) =
                (shard(1, heads, 2.0), shard(2, kv_heads, 1.0), shard(3, kv_heads, 1.0), shard(4, heads, 1.0));
            for rank in [0, n - 1] {
                let g = gradient_reference(&s, rank, scale as f64, &q, &k, &v, &dout, dtype);
                let (dq, dk, dv) = emulate_kernel(&s, rank, scale, &q, &k, &v, &dout, dtype);
                for (name, got, want, bound) in
                    [("dq", &dq, &g.dq, &g.dq_bound), ("dk", &dk, &g.dk, &g.dk_bound), ("dv", &dv, &g.dv, &g.dv_bound)]
                {
                    let verdict = check_close(got, want, bound, 2.0 * tolerance(dtype));
                    assert!(verdict.passed(), "{s:?} {dtype:?} rank {rank} {name}: {verdict}");
                }
            }
        }
    }

    #[test]
    fn reference_gradient_matches_central_differences_and_a_lost_ring_step_fails() {
        let dtype = mkDataType_t::mkBfloat16;
        for (causal, n) in [(true, 2), (false, 3)] {
            let s = RingShape { batch: 1, seq_local: 4, heads: 2, kv_heads: 1, head_dim: 64, causal, nranks: n };
            let scale = 1.5 / 8.0;
            let shard = |seed: u64, heads: usize, sc: f64| -> Vec<Vec<f64>> {
                (0..n).map(|r| values(seed * 10 + r as u64, 4 * heads * 64, dtype, sc)).collect()
            };
            let (q, k, v, dout) = (shard(1, 2, 2.0), shard(2, 1, 1.0), shard(3, 1, 1.0), shard(4, 2, 1.0));
            let rank = n - 1;
            let g = gradient_reference(&s, rank, scale, &q, &k, &v, &dout, dtype);
            let eps = 1e-5;
            // One element of each gradient of this rank's shard.
            for (which, idx) in [(0usize, 70usize), (1, 5), (2, 130)] {
                let bump = |delta: f64| {
                    let (mut q2, mut k2, mut v2) = (q.clone(), k.clone(), v.clone());
                    match which {
                        0 => q2[rank][idx] += delta,
                        1 => k2[rank][idx] += delta,
                        _ => v2[rank][idx] += delta,
                    }
                    loss(&s, scale, &q2, &k2, &v2, &dout)
                };
                let numeric = (bump(eps) - bump(-eps)) / (2.0 * eps);
                let analytic = [&g.dq, &g.dk, &g.dv][which][idx];
                assert!(
                    (numeric - analytic).abs() < 1e-6 * (1.0 + analytic.abs()),
                    "{which} {idx}: {numeric} vs {analytic}"
                );
            }
            // The gradients as a kernel would give them when a ring step is lost for head
            // 0: dq without rank 0's keys (which every query of this rank sees), dk/dv
            // of this rank's shard without its own keys' terms.
            let missing = gradient_reference_with(&s, rank, scale, &q, &k, &v, &dout, dtype, Some(0));
            let vq = check_close(&missing.dq, &g.dq, &g.dq_bound, 2.0 * tolerance(dtype));
            assert!(!vq.passed(), "causal={causal}: a lost ring step passed dq: {vq}");
            let lost_own = gradient_reference_with(&s, rank, scale, &q, &k, &v, &dout, dtype, Some(rank));
            let vk = check_close(&lost_own.dk, &g.dk, &g.dk_bound, 2.0 * tolerance(dtype));
            let vv = check_close(&lost_own.dv, &g.dv, &g.dv_bound, 2.0 * tolerance(dtype));
            assert!(!vk.passed() && !vv.passed(), "causal={causal}: a lost block passed dk {vk} / dv {vv}");
        }
    }
}
