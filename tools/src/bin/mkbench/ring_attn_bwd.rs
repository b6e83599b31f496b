//! `mkbench ring_attn_bwd`: mkRingAttentionBackward, alone and after its forward, in the
//! shared protocol:
//!
//!   mkbench ring_attn_bwd [-g ranks] [--seq 8192,16384,32768] [--heads 32] [--kv-heads 32]
//!                         [--dim 128] [--causal 0,1] [-n iters] [-w warmup] [--blocks B]
//!                         [--rest-ms ms] [--threads] [--dtype bf16|fp16]
//!
//! Per (global S, causal), batch 1, `--dtype` bf16 (the default) or fp16 (recorded in each
//! row's shape and the config), softmax scale 1/√D, inputs uniform in [-1, 1):
//! mkRingAttention once (its out and lse feed the backward, as in training), then the check,
//! then the contenders, timed as measure.rs says (-w warm-up, --blocks interleaved blocks of
//! -n calls, the slowest rank per call; median, p10, p90; host enqueue µs per call):
//! `fused`, the backward alone; `forward+backward`, mkRingAttention then
//! mkRingAttentionBackward; and CUDA-graph replays of GRAPH_CALLS captured calls of each
//! (`fused_graph`, `forward+backward_graph`). There is no unfused ring backward in the
//! library to set beside it: the single-GPU baseline is torch SDPA's backward
//! (`benches/sdpa_baseline.py --backward`, cuDNN and flash backends), run in the same GPU
//! session with the same options.
//!
//! TFLOP/s per rank, the FlashAttention convention: the backward counts 2.5 × the forward's
//! 4·H·S_local·S·D (5 GEMMs of the forward's size against its 2), forward + backward 3.5 ×;
//! causal cases half of that.
//!
//! The check, once per case on every rank, before timing (dq, dk, dv poisoned with NaN
//! before each call): a second backward call into other buffers must give the same bits
//! (the header promises bitwise reproducible results; under the opt-in one-pass-atomic engine
//! the bits that differ are counted, not failed); every element of dq, dk, dv must be
//! finite; and sampled rows of dq (local queries at both ends of each zigzag half and one
//! more, for the first and last head) and of dk, dv (the same local keys, for the first and
//! last KV head) are recomputed in float64 from the definition in the header, over every
//! rank's q, k, v, dout and the forward's out and lse (gathered with mkAllGather): the
//! relative L2 error of each must stay within 2 × tolerance(dtype), the limit mktest's
//! ring_attn_bwd suite puts on its whole tensors (that suite checks every element against
//! the float64 gradient with per-element bounds, on small shapes).

use crate::fused_common::{capture_everywhere, measure_slowest, run_ranks, Timed};
use crate::fused_options::{half_dtype_name, FusedDefaults, FusedOptions};
use crate::measure::{Progress, GRAPH_CALLS};
use crate::record::{self, Json};
use crate::ring_attn::{forward_flops, Cases};
use crate::timing::Events;
use cudarc::driver::result as cu;
use mkernel::comm::{Comm, CommConfig};
use mkernel::cuda::{self, sys, PrimaryContext};
use mkernel::error::{mkResult_t, Result};
use mkernel::ops::attention::ring_attention::{ring_attention, token_pos, RingShape};
use mkernel::ops::attention::ring_attention_backward::{
    plan, ring_attention_backward, validate_args, workspace_layout, RingBackwardArgs,
};
use mkernel::ops::collectives::{collective, CollectiveKind};
use mkernel::types::mkDataType_t;
use mkernel_tools::testing::{bf16_to_f32, f16_to_f32, relative_error, tolerance, TestBuffer};

/// The backward's FLOPs over the forward's (FlashAttention's benchmark convention).
const BACKWARD_OVER_FORWARD: f64 = 2.5;

struct Options {
    common: FusedOptions,
    cases: Cases,
}

/// Parses the options without touching a GPU.
pub fn check(_op: &str, args: &[String]) -> Result<()> {
    parse(args).map(|_| ())
}

fn parse(args: &[String]) -> Result<Options> {
    let mut cases = Cases::default();
    let common = FusedOptions::parse(args, FusedDefaults { warmup: 2, takes_trace: false }, |f, v| cases.flag(f, v))?;
    Ok(Options { common, cases })
}

pub fn run(args: &[String]) -> Result<bool> {
    let o = parse(args)?;
    run_ranks("ring_attn_bwd", args, o.common.ranks, o.common.threads, &|rank, n, id, device| {
        rank_main(&o, rank, n, id, device)
    })
}

/// The device tensors of one rank, sized for the largest case.
struct Tensors {
    q: TestBuffer,
    k: TestBuffer,
    v: TestBuffer,
    dout: TestBuffer,
    out: TestBuffer,
    lse: TestBuffer,
    /// The timed calls' outputs and the second call's, for the bitwise comparison.
    grads: [TestBuffer; 3],
    again: [TestBuffer; 3],
    /// With several ranks, every rank's q, k, v, dout, out, lse (mkAllGather), for the check.
    gathered: Option<[TestBuffer; 6]>,
}

fn rank_main(o: &Options, rank: usize, n: usize, id: &mkernel::bootstrap::UniqueId, device: i32) -> Result<bool> {
    let ctx = PrimaryContext::retain(device)?;
    let _g = ctx.enter()?;
    let c = &o.cases;
    let dtype = c.dtype;
    let max_sl = c.seq.iter().max().copied().unwrap_or(0) / n;
    let shape_of = |sl: usize, causal: bool| RingShape {
        batch: 1,
        seq_local: sl,
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.dim,
        causal,
        nranks: n,
    };
    let largest = shape_of(max_sl, false);
    let mut cfg = CommConfig::from_env();
    // The forward's K/V copy; the backward's K/V copy, row values and travelling sums; and
    // the collectives' staging for the check's gathers.
    cfg.workspace_bytes = cfg
        .workspace_bytes
        .max(mkernel::ops::attention::ring_attention::workspace_bytes(&largest, dtype))
        .max(workspace_layout(&largest, &plan(&largest, 1), dtype).bytes);
    let comm = crate::fused_common::init_comm(id, n, rank, device, cfg)?;
    let stream =
        cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
    let q_elems = max_sl * c.heads * c.dim;
    let kv_elems = max_sl * c.kv_heads * c.dim;
    let lse_elems = max_sl * c.heads;
    let f32_type = mkDataType_t::mkFloat32;
    let t = Tensors {
        q: TestBuffer::new(q_elems, dtype)?,
        k: TestBuffer::new(kv_elems, dtype)?,
        v: TestBuffer::new(kv_elems, dtype)?,
        dout: TestBuffer::new(q_elems, dtype)?,
        out: TestBuffer::new(q_elems, dtype)?,
        lse: TestBuffer::new(lse_elems, f32_type)?,
        grads: [TestBuffer::new(q_elems, dtype)?, TestBuffer::new(kv_elems, dtype)?, TestBuffer::new(kv_elems, dtype)?],
        again: [TestBuffer::new(q_elems, dtype)?, TestBuffer::new(kv_elems, dtype)?, TestBuffer::new(kv_elems, dtype)?],
        gathered: if n > 1 {
            Some([
                TestBuffer::new(n * q_elems, dtype)?,
                TestBuffer::new(n * kv_elems, dtype)?,
                TestBuffer::new(n * kv_elems, dtype)?,
                TestBuffer::new(n * q_elems, dtype)?,
                TestBuffer::new(n * q_elems, dtype)?,
                TestBuffer::new(n * lse_elems, f32_type)?,
            ])
        } else {
            None
        },
    };
    t.q.randomize(11 + rank as u64, 1.0, stream)?;
    t.k.randomize(21 + rank as u64, 1.0, stream)?;
    t.v.randomize(31 + rank as u64, 1.0, stream)?;
    t.dout.randomize(41 + rank as u64, 1.0, stream)?;
    let protocol = o.common.protocol;
    let events = Events::new(protocol.iters)?;
    if rank == 0 {
        println!(
            "# mkbench ring_attn_bwd: {n} rank(s), {}, B=1 H={} H_kv={} D={}, MK_MAX_CTAS={}, warm-up {} + {} blocks of {} timed calls (median of the slowest rank)",
            half_dtype_name(dtype),
            c.heads,
            c.kv_heads,
            c.dim,
            comm.config.max_ctas.map_or("-".into(), |v| v.to_string()),
            protocol.warmup,
            protocol.blocks,
            protocol.iters
        );
        println!(
            "# TF/s per rank: backward 2.5 x, forward+backward 3.5 x the forward's 4·H·S_local·S·D, half when causal"
        );
        println!(
            "# {:>6} {:>6} {:>6} | {:>10} {:>7} | {:>10} {:>7} | {:>10} {:>10} | {:>8} {:>8} {:>8} {:>5}",
            "S",
            "S_loc",
            "causal",
            "bwd us",
            "TF/s",
            "f+b us",
            "TF/s",
            "bwd graph",
            "f+b graph",
            "err dq",
            "err dk",
            "err dv",
            "bits"
        );
        record::config(
            "flops",
            Json::str(
                "per rank: backward 2.5 x and forward+backward 3.5 x the forward's 4*H*S_local*S*D, half when causal",
            ),
        );
        record::config("dtype", Json::str(half_dtype_name(dtype)));
        record::config("kv_heads", Json::num(c.kv_heads as f64));
        // MK_INTERNAL_RING_BWD_ENGINE as set; `auto` takes one-pass where the workspace holds it.
        let engine = mkernel::tuning::Tuning::process().ring_bwd_engine;
        record::config("engine", Json::str(engine.map_or("auto", |e| e.name())));
    }
    let mut all_ok = true;
    let mut progress = (rank == 0).then(|| Progress::new(c.causal.len() * c.seq.len()));
    for &causal in &c.causal {
        for &s_global in &c.seq {
            if let Some(p) = progress.as_mut() {
                p.step(&format!("S {s_global} causal {causal}"));
            }
            let sl = s_global / n;
            let scale = 1.0 / (c.dim as f32).sqrt();
            let args_into = |g: &[TestBuffer; 3]| {
                validate_args(
                    t.q.ptr(),
                    t.k.ptr(),
                    t.v.ptr(),
                    t.out.ptr(),
                    t.dout.ptr(),
                    t.lse.ptr(),
                    g[0].ptr(),
                    g[1].ptr(),
                    g[2].ptr(),
                    1,
                    sl,
                    c.heads,
                    c.kv_heads,
                    c.dim,
                    scale,
                    causal as i32,
                    dtype as i32,
                    n,
                    rank,
                )
            };
            let args = args_into(&t.grads)?;
            let verdict = check_case(&comm, &t, &args, &args_into(&t.again)?, stream)?;
            let wrong = !verdict
                .passed(dtype, mkernel::tuning::Tuning::process().ring_bwd_engine.is_none_or(|e| e.reproducible()));
            all_ok &= !wrong;
            c.rest(stream)?;
            let backward = || ring_attention_backward(&comm, &args, stream);
            let forward_backward = || ring_attention(&comm, &args.forward, stream).and_then(|_| backward());
            let mut contenders: Vec<(&str, Timed)> =
                vec![("fused", Timed::Calls(&backward)), ("forward+backward", Timed::Calls(&forward_backward))];
            let graphs = capture_everywhere(&comm, stream, GRAPH_CALLS, &[&backward, &forward_backward])?;
            if let Ok(g) = &graphs {
                contenders.push(("fused_graph", Timed::Graph(&g[0])));
                contenders.push(("forward+backward_graph", Timed::Graph(&g[1])));
            }
            let (names, timed): (Vec<&str>, Vec<Timed>) = contenders.into_iter().unzip();
            let meas = measure_slowest(&comm, &events, stream, protocol, &timed)?;
            let err = comm.async_error();
            all_ok &= err == mkResult_t::mkSuccess;
            if rank == 0 {
                let med = |name: &str| names.iter().position(|x| *x == name).map(|i| meas.median(i));
                let opt = |t: Option<f64>| t.map_or("-".to_string(), |t| format!("{t:.1}"));
                let fwd = forward_flops(c.heads, sl, s_global, c.dim, causal == 1);
                let tf = |flops: f64, us: f64| flops / (us * 1e-6) / 1e12;
                let (t_bwd, t_both) = (meas.median(0), meas.median(1));
                println!(
                    "  {:>6} {:>6} {:>6} | {:>10.1} {:>7.1} | {:>10.1} {:>7.1} | {:>10} {:>10} | {:>8.1e} {:>8.1e} {:>8.1e} {:>5}{}{}",
                    s_global,
                    sl,
                    causal,
                    t_bwd,
                    tf(BACKWARD_OVER_FORWARD * fwd, t_bwd),
                    t_both,
                    tf((BACKWARD_OVER_FORWARD + 1.0) * fwd, t_both),
                    opt(med("fused_graph")),
                    opt(med("forward+backward_graph")),
                    verdict.rel_err[0],
                    verdict.rel_err[1],
                    verdict.rel_err[2],
                    if verdict.unrepeated == 0 { "same" } else { "DIFF" },
                    if wrong { "  WRONG" } else { "" },
                    if err == mkResult_t::mkSuccess { String::new() } else { format!("  ASYNC ERROR {err:?}") }
                );
                println!(
                    "  {:>20} p10/p90 µs: bwd {:.1}/{:.1}, f+b {:.1}/{:.1}; host enqueue µs/call: bwd {:.1}, f+b {:.1}; \
                     {} non-finite, {} changed in a second call (all ranks)",
                    "",
                    meas.stats[0].p10,
                    meas.stats[0].p90,
                    meas.stats[1].p10,
                    meas.stats[1].p90,
                    meas.host_us[0],
                    meas.host_us[1],
                    verdict.nonfinite,
                    verdict.unrepeated
                );
                if let Err(why) = &graphs {
                    println!("  {:>20} no graph replay: {why}", "");
                }
                record::row(
                    record::shape(
                        &[
                            ("ranks", n),
                            ("seq", s_global),
                            ("seq_per_rank", sl),
                            ("heads", c.heads),
                            ("kv_heads", c.kv_heads),
                            ("dim", c.dim),
                            ("causal", causal),
                        ],
                        &[("dtype", half_dtype_name(dtype))],
                    ),
                    record::measured_contenders(&names, &meas),
                    &[
                        ("rel_err", Json::num(verdict.rel_err.iter().cloned().fold(0.0, f64::max))),
                        ("rel_err_dq", Json::num(verdict.rel_err[0])),
                        ("rel_err_dk", Json::num(verdict.rel_err[1])),
                        ("rel_err_dv", Json::num(verdict.rel_err[2])),
                        ("nonfinite", Json::num(verdict.nonfinite as f64)),
                        ("unrepeated", Json::num(verdict.unrepeated as f64)),
                        ("wrong", Json::Bool(wrong)),
                        (
                            "baseline",
                            Json::str("none in process; torch SDPA backward in benches/sdpa_baseline.py --backward"),
                        ),
                        ("async_error", Json::Bool(err != mkResult_t::mkSuccess)),
                    ],
                );
            }
        }
    }
    // SAFETY: live stream.
    unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
    Ok(all_ok)
}

/// What the check of one case found, over every rank: the relative L2 errors of the sampled
/// rows of dq, dk, dv against float64 (the largest rank's), the non-finite elements of dq,
/// dk, dv and the elements a second call changed (summed over ranks).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Verdict {
    rel_err: [f64; 3],
    nonfinite: usize,
    unrepeated: usize,
}

impl Verdict {
    /// `dtype`: the gradients' type, whose tolerance sets the limit. `must_repeat`: the
    /// engine promises the same bits from a second call (all but one-pass-atomic, whose
    /// differing bits are reported, not failed).
    fn passed(&self, dtype: mkDataType_t, must_repeat: bool) -> bool {
        let limit = 2.0 * tolerance(dtype);
        // A NaN error fails.
        self.rel_err.iter().all(|e| *e <= limit) && self.nonfinite == 0 && (self.unrepeated == 0 || !must_repeat)
    }
}

/// The forward once, the backward twice (into `args`'s and `again`'s outputs, each poisoned
/// first), then the checks of the module comment; every rank returns the same verdict.
fn check_case(
    comm: &Comm,
    t: &Tensors,
    args: &RingBackwardArgs,
    again: &RingBackwardArgs,
    stream: sys::CUstream,
) -> Result<Verdict> {
    let s = args.forward.shape;
    let (rank, n) = (args.forward.rank, s.nranks);
    for b in t.grads.iter().chain(&t.again).chain([&t.out, &t.lse]) {
        b.poison(stream)?;
    }
    comm.bootstrap.barrier()?;
    ring_attention(comm, &args.forward, stream)?;
    ring_attention_backward(comm, args, stream)?;
    ring_attention_backward(comm, again, stream)?;
    let q_elems = s.seq_local * s.heads * s.head_dim;
    let kv_elems = s.seq_local * s.kv_heads * s.head_dim;
    let lse_elems = s.seq_local * s.heads;
    let own = [&t.q, &t.k, &t.v, &t.dout, &t.out, &t.lse];
    let counts = [q_elems, kv_elems, kv_elems, q_elems, q_elems, lse_elems];
    if let Some(g) = &t.gathered {
        for ((src, dst), count) in own.iter().zip(g).zip(counts) {
            collective(comm, CollectiveKind::AllGather, src.ptr(), dst.ptr(), count, src.dtype as i32, None, stream)?;
        }
    }
    // SAFETY: live stream.
    unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
    comm.bootstrap.barrier()?;
    let grads: Vec<Vec<u16>> =
        t.grads.iter().zip([q_elems, kv_elems, kv_elems]).map(|(b, c)| halves(b, c)).collect::<Result<_>>()?;
    let mut unrepeated = 0;
    let mut nonfinite = 0;
    for (i, b) in t.again.iter().enumerate() {
        let second = halves(b, grads[i].len())?;
        unrepeated += grads[i].iter().zip(&second).filter(|(a, b)| a != b).count();
        nonfinite += grads[i].iter().filter(|&&h| !decode(b.dtype, h).is_finite()).count();
    }
    // Every rank's inputs and the forward's outputs, rank-major.
    let sources: Vec<&TestBuffer> = t.gathered.as_ref().map_or(own.to_vec(), |g| g.iter().collect());
    let all: Vec<Vec<u16>> = sources[..5].iter().zip(counts).map(|(b, c)| halves(b, n * c)).collect::<Result<_>>()?;
    let lse: Vec<f32> = sources[5].download()?[..4 * n * lse_elems]
        .chunks_exact(4)
        .map(|w| f32::from_le_bytes(w.try_into().expect("4 bytes")))
        .collect();
    // Every 16-bit tensor here (inputs, forward outputs, gradients) is in the case's dtype.
    let dtype = t.q.dtype;
    fn global<'a>(bits: &'a [u16], dtype: mkDataType_t, s: &RingShape, heads: usize) -> Global<'a> {
        Global::bits(bits, dtype, s.seq_local, heads, s.head_dim)
    }
    let inputs = Inputs {
        q: global(&all[0], dtype, &s, s.heads),
        k: global(&all[1], dtype, &s, s.kv_heads),
        v: global(&all[2], dtype, &s, s.kv_heads),
        dout: global(&all[3], dtype, &s, s.heads),
        out: global(&all[4], dtype, &s, s.heads),
        lse: &lse,
    };
    let got = [
        global(&grads[0], dtype, &s, s.heads),
        global(&grads[1], dtype, &s, s.kv_heads),
        global(&grads[2], dtype, &s, s.kv_heads),
    ];
    let rel_err = sampled_errors(&s, args.forward.softmax_scale as f64, &inputs, rank, &got, 7 + rank);
    // Every rank's findings, so that every rank (and the record) has the same verdict.
    let mine: Vec<u8> = rel_err
        .iter()
        .chain(&[nonfinite as f64, unrepeated as f64])
        .flat_map(|x| if x.is_nan() { f64::INFINITY } else { *x }.to_le_bytes())
        .collect();
    let mut v = Verdict { rel_err: [0.0; 3], nonfinite: 0, unrepeated: 0 };
    for r in comm.bootstrap.allgather(&mine)? {
        let x: Vec<f64> = r.chunks_exact(8).map(|w| f64::from_le_bytes(w.try_into().expect("8 bytes"))).collect();
        for (e, xe) in v.rel_err.iter_mut().zip(&x) {
            *e = e.max(*xe);
        }
        v.nonfinite += x[3] as usize;
        v.unrepeated += x[4] as usize;
    }
    Ok(v)
}

/// The first `count` 16-bit elements of a device buffer.
fn halves(b: &TestBuffer, count: usize) -> Result<Vec<u16>> {
    Ok(b.download()?[..2 * count].chunks_exact(2).map(|w| u16::from_le_bytes([w[0], w[1]])).collect())
}

fn decode(dtype: mkDataType_t, bits: u16) -> f64 {
    match dtype {
        mkDataType_t::mkFloat16 => f16_to_f32(bits) as f64,
        _ => bf16_to_f32(bits) as f64,
    }
}

/// Elements of a tensor: the device's bits, or float64 values (the CPU tests).
#[derive(Clone, Copy)]
enum Elems<'a> {
    Bits(&'a [u16], mkDataType_t),
    #[cfg_attr(not(test), allow(dead_code))]
    Values(&'a [f64]),
}

/// A [token][head][d] tensor (batch 1) of every rank, rank-major (as an AllGather leaves
/// it; one rank's own tensor is rank 0 of one), read as float64 row by row.
#[derive(Clone, Copy)]
struct Global<'a> {
    elems: Elems<'a>,
    seq_local: usize,
    heads: usize,
    dim: usize,
}

impl<'a> Global<'a> {
    fn bits(bits: &'a [u16], dtype: mkDataType_t, seq_local: usize, heads: usize, dim: usize) -> Global<'a> {
        Global { elems: Elems::Bits(bits, dtype), seq_local, heads, dim }
    }

    fn row(&self, rank: usize, i: usize, head: usize) -> Vec<f64> {
        let at = ((rank * self.seq_local + i) * self.heads + head) * self.dim;
        match self.elems {
            Elems::Bits(b, dtype) => b[at..at + self.dim].iter().map(|&h| decode(dtype, h)).collect(),
            Elems::Values(v) => v[at..at + self.dim].to_vec(),
        }
    }
}

/// Every rank's q, k, v, dout, the forward's out, and its lse ([rank][head][token]).
struct Inputs<'a> {
    q: Global<'a>,
    k: Global<'a>,
    v: Global<'a>,
    dout: Global<'a>,
    out: Global<'a>,
    lse: &'a [f32],
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// One query row of the check: q, dout, delta = dout · out, and the forward's lse.
struct Query {
    q: Vec<f64>,
    dout: Vec<f64>,
    delta: f64,
    lse: f64,
}

impl Inputs<'_> {
    fn query(&self, s: &RingShape, rank: usize, i: usize, h: usize) -> Query {
        let (q, dout) = (self.q.row(rank, i, h), self.dout.row(rank, i, h));
        let delta = dot(&dout, &self.out.row(rank, i, h));
        Query { q, dout, delta, lse: self.lse[(rank * s.heads + h) * s.seq_local + i] as f64 }
    }
}

/// P and dS = P(dP − delta) of a query against key row `k`, value row `v`, in float64, from
/// the forward's lse and out (the header's definition).
fn p_ds(scale: f64, x: &Query, k: &[f64], v: &[f64]) -> (f64, f64) {
    let p = (scale * dot(&x.q, k) - x.lse).exp();
    (p, p * (dot(&x.dout, v) - x.delta))
}

/// dq of local query `i` of head `h` on `rank`, in float64: scale · Σ dS · k over every
/// visible key of every rank.
fn dq_row(s: &RingShape, scale: f64, x: &Inputs, rank: usize, i: usize, h: usize) -> Vec<f64> {
    let hk = h / (s.heads / s.kv_heads);
    let query = x.query(s, rank, i, h);
    let mut dq = vec![0.0; s.head_dim];
    for src in 0..s.nranks {
        for j in 0..s.seq_local {
            if s.causal && token_pos(s, src, j) > token_pos(s, rank, i) {
                continue;
            }
            let k = x.k.row(src, j, hk);
            let (_, ds) = p_ds(scale, &query, &k, &x.v.row(src, j, hk));
            for (d, kc) in dq.iter_mut().zip(&k) {
                *d += scale * ds * kc;
            }
        }
    }
    dq
}

/// dk and dv of local key `j` of KV head `hk` on `rank`, in float64: dk = scale · Σ dS · q,
/// dv = Σ P · dout over every query that sees it, of every rank and every head of the group.
fn dkdv_row(s: &RingShape, scale: f64, x: &Inputs, rank: usize, j: usize, hk: usize) -> (Vec<f64>, Vec<f64>) {
    let group = s.heads / s.kv_heads;
    let (k, v) = (x.k.row(rank, j, hk), x.v.row(rank, j, hk));
    let (mut dk, mut dv) = (vec![0.0; s.head_dim], vec![0.0; s.head_dim]);
    for qr in 0..s.nranks {
        for i in 0..s.seq_local {
            if s.causal && token_pos(s, qr, i) < token_pos(s, rank, j) {
                continue;
            }
            for h in hk * group..(hk + 1) * group {
                let query = x.query(s, qr, i, h);
                let (p, ds) = p_ds(scale, &query, &k, &v);
                for c in 0..s.head_dim {
                    dk[c] += scale * ds * query.q[c];
                    dv[c] += p * query.dout[c];
                }
            }
        }
    }
    (dk, dv)
}

/// The local rows the float64 check recomputes: the first and last of each zigzag half
/// (both edges of both chunks) and one more from `seed`, each for the first and last head
/// of `heads`.
fn sample_rows(seq_local: usize, heads: usize, seed: usize) -> Vec<(usize, usize)> {
    let mut idx = vec![0, (seq_local / 2).saturating_sub(1), seq_local / 2, seq_local - 1, seed * 7919 % seq_local];
    idx.sort_unstable();
    idx.dedup();
    let mut hs = vec![0, heads - 1];
    hs.dedup();
    idx.iter().flat_map(|&i| hs.iter().map(move |&h| (i, h))).collect()
}

/// The relative L2 errors of `got` (this rank's dq, dk, dv, as rank 0 of one) on the
/// sampled rows against float64.
fn sampled_errors(s: &RingShape, scale: f64, x: &Inputs, rank: usize, got: &[Global; 3], seed: usize) -> [f64; 3] {
    let (mut want, mut have) = ([vec![], vec![], vec![]], [vec![], vec![], vec![]]);
    for (i, h) in sample_rows(s.seq_local, s.heads, seed) {
        want[0].extend(dq_row(s, scale, x, rank, i, h));
        have[0].extend(got[0].row(0, i, h));
    }
    for (j, hk) in sample_rows(s.seq_local, s.kv_heads, seed) {
        let (dk, dv) = dkdv_row(s, scale, x, rank, j, hk);
        want[1].extend(dk);
        want[2].extend(dv);
        have[1].extend(got[1].row(0, j, hk));
        have[2].extend(got[2].row(0, j, hk));
    }
    [0, 1, 2].map(|t| relative_error(&have[t], &want[t]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused_options::command_line as args;
    use crate::measure::Protocol;
    use mkernel_tools::testing::{f32_to_bf16, f32_to_f16, xorshift_unit};

    #[test]
    fn options_parse_and_typos_are_refused() {
        let o = parse(&args(
            "-g 4 --threads --seq 4096,8192 --causal 1,0 --heads 16 --kv-heads 4 --dim 64 -n 7 -w 1 --blocks 3 --rest-ms 500",
        ))
        .unwrap();
        let want = Protocol { warmup: 1, blocks: 3, iters: 7 };
        assert_eq!((o.common.ranks, o.common.threads, o.common.protocol), (4, true, want));
        let c = &o.cases;
        assert_eq!(
            (&c.seq[..], &c.causal[..], c.heads, c.kv_heads, c.dim, c.rest_ms),
            (&[4096, 8192][..], &[1, 0][..], 16, 4, 64, 500)
        );
        assert_eq!(c.dtype, mkDataType_t::mkBfloat16, "bf16 unless --dtype says otherwise");
        let d = parse(&[]).unwrap();
        assert_eq!(
            (&d.cases.seq[..], d.cases.heads, d.cases.dim, d.common.threads),
            (&[8192, 16384, 32768][..], 32, 128, false)
        );
        assert_eq!(parse(&args("--dtype fp16 --dim 64")).unwrap().cases.dtype, mkDataType_t::mkFloat16);
        for bad in ["--unfused 0", "--trace", "--seq 1,x", "--blocks 0", "-n 0", "--heads", "--dtype fp8", "--dtype"] {
            assert!(parse(&args(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn sampled_rows_cover_both_zigzag_halves_and_both_end_heads() {
        let rows = sample_rows(256, 32, 3);
        for i in [0, 127, 128, 255] {
            assert!(rows.contains(&(i, 0)) && rows.contains(&(i, 31)), "{i}");
        }
        assert_eq!(sample_rows(1, 1, 5), vec![(0, 0)], "one token, one head");
    }

    /// The float64 forward: out and lse (as the kernel stores it, f32) of every rank's queries.
    fn forward(s: &RingShape, scale: f64, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f32>) {
        let (d, h, hkv, sl, n) = (s.head_dim, s.heads, s.kv_heads, s.seq_local, s.nranks);
        let mut out = vec![0.0; q.len()];
        let mut lse = vec![0.0f32; n * h * sl];
        let row =
            |t: &[f64], heads: usize, r: usize, i: usize, hh: usize| t[((r * sl + i) * heads + hh) * d..][..d].to_vec();
        for r in 0..n {
            for i in 0..sl {
                for hh in 0..h {
                    let hk = hh / (h / hkv);
                    let qr = row(q, h, r, i, hh);
                    let mut sc = vec![];
                    for src in 0..n {
                        for j in 0..sl {
                            if !s.causal || token_pos(s, src, j) <= token_pos(s, r, i) {
                                sc.push((scale * dot(&qr, &row(k, hkv, src, j, hk)), row(v, hkv, src, j, hk)));
                            }
                        }
                    }
                    let mx = sc.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
                    let l = mx + sc.iter().map(|x| (x.0 - mx).exp()).sum::<f64>().ln();
                    lse[(r * h + hh) * sl + i] = l as f32;
                    for (p, vr) in sc.iter().map(|x| ((x.0 - l).exp(), &x.1)) {
                        for c in 0..d {
                            out[((r * sl + i) * h + hh) * d + c] += p * vr[c];
                        }
                    }
                }
            }
        }
        (out, lse)
    }

    /// The float64 rows match central differences of L = Σ dout · out (out over every
    /// rank's queries), causal and not, with GQA; rows from bf16 bits read as their values;
    /// and a gradient off by one bf16 step in one element is seen by the relative error.
    #[test]
    fn gradient_rows_match_central_differences() {
        for (causal, n) in [(true, 2), (false, 3)] {
            let s = RingShape { batch: 1, seq_local: 4, heads: 4, kv_heads: 2, head_dim: 8, causal, nranks: n };
            let scale = 0.7;
            let vals = |seed: u64, heads: usize| -> Vec<f64> {
                xorshift_unit(seed, n * s.seq_local * heads * s.head_dim).map(|u| 2.0 * u - 1.0).collect()
            };
            let (q, k, v, dout) = (vals(1, 4), vals(2, 2), vals(3, 2), vals(4, 4));
            let (out, lse) = forward(&s, scale, &q, &k, &v);
            let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 { dot(&forward(&s, scale, q, k, v).0, &dout) };
            fn g(t: &[f64], heads: usize) -> Global<'_> {
                Global { elems: Elems::Values(t), seq_local: 4, heads, dim: 8 }
            }
            let x = Inputs { q: g(&q, 4), k: g(&k, 2), v: g(&v, 2), dout: g(&dout, 4), out: g(&out, 4), lse: &lse };
            let rank = n - 1;
            let eps = 1e-5;
            for (i, h) in [(0, 0), (3, 3), (1, 2)] {
                let dq = dq_row(&s, scale, &x, rank, i, h);
                for c in [0, 5] {
                    let at = ((rank * 4 + i) * 4 + h) * 8 + c;
                    let bump = |e: f64| {
                        let mut q2 = q.clone();
                        q2[at] += e;
                        loss(&q2, &k, &v)
                    };
                    let numeric = (bump(eps) - bump(-eps)) / (2.0 * eps);
                    // The lse went through f32: a relative error of about 1e-7 in P.
                    assert!(
                        (numeric - dq[c]).abs() < 1e-5 * (1.0 + dq[c].abs()),
                        "dq {i} {h} {c}: {numeric} vs {}",
                        dq[c]
                    );
                }
            }
            for (j, hk) in [(0, 0), (3, 1), (2, 0)] {
                let (dk, dv) = dkdv_row(&s, scale, &x, rank, j, hk);
                for c in [1, 7] {
                    let at = ((rank * 4 + j) * 2 + hk) * 8 + c;
                    let numeric = |which: usize| {
                        let bump = |e: f64| {
                            let (mut k2, mut v2) = (k.clone(), v.clone());
                            if which == 0 {
                                k2[at] += e
                            } else {
                                v2[at] += e
                            }
                            loss(&q, &k2, &v2)
                        };
                        (bump(eps) - bump(-eps)) / (2.0 * eps)
                    };
                    assert!((numeric(0) - dk[c]).abs() < 1e-5 * (1.0 + dk[c].abs()), "dk {j} {hk} {c}");
                    assert!((numeric(1) - dv[c]).abs() < 1e-5 * (1.0 + dv[c].abs()), "dv {j} {hk} {c}");
                }
            }
            // This rank's gradients as bf16 or fp16 bits pass; with one sampled dv element
            // pushed far off, dv fails and dq, dk do not.
            let own = |t: &[f64], heads: usize, encode: fn(f32) -> u16| -> Vec<u16> {
                let len = s.seq_local * heads * 8;
                t[rank * len..][..len].iter().map(|&x| encode(x as f32)).collect()
            };
            let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; k.len()]);
            for i in 0..4 {
                for h in 0..4 {
                    let at = ((rank * 4 + i) * 4 + h) * 8;
                    dq[at..at + 8].copy_from_slice(&dq_row(&s, scale, &x, rank, i, h));
                }
                for hk in 0..2 {
                    let at = ((rank * 4 + i) * 2 + hk) * 8;
                    let (a, b) = dkdv_row(&s, scale, &x, rank, i, hk);
                    dk[at..at + 8].copy_from_slice(&a);
                    dv[at..at + 8].copy_from_slice(&b);
                }
            }
            let encoders =
                [(mkDataType_t::mkBfloat16, f32_to_bf16 as fn(f32) -> u16), (mkDataType_t::mkFloat16, f32_to_f16)];
            for (dtype, encode) in encoders {
                let (bq, bk, mut bv) = (own(&dq, 4, encode), own(&dk, 2, encode), own(&dv, 2, encode));
                let got = |bv: &[u16]| -> [f64; 3] {
                    let t = [
                        Global::bits(&bq, dtype, 4, 4, 8),
                        Global::bits(&bk, dtype, 4, 2, 8),
                        Global::bits(bv, dtype, 4, 2, 8),
                    ];
                    sampled_errors(&s, scale, &x, rank, &t, 1)
                };
                let e = got(&bv);
                assert!(e.iter().all(|&e| e < 4e-3), "{dtype:?} {e:?}");
                bv[(3 * 2 + 1) * 8 + 2] = encode(10.0);
                let e = got(&bv);
                assert!(e[0] < 4e-3 && e[1] < 4e-3 && e[2] > 2.0 * tolerance(dtype), "{dtype:?} {e:?}");
                assert!(!Verdict { rel_err: e, nonfinite: 0, unrepeated: 0 }.passed(dtype, true));
            }
        }
    }

    /// The verdict's limit is 2 × the tolerance of the gradients' type: an error bf16 allows
    /// fails fp16; a NaN error, a non-finite element or a changed bit fails either.
    #[test]
    fn the_verdict_limit_follows_the_dtype() {
        let (bf, fp) = (mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16);
        for dtype in [bf, fp] {
            let v = |rel_err, nonfinite, unrepeated| Verdict { rel_err, nonfinite, unrepeated };
            assert!(!v([f64::NAN, 0.0, 0.0], 0, 0).passed(dtype, true), "NaN fails");
            assert!(!v([0.0; 3], 0, 1).passed(dtype, true));
            assert!(!v([0.0; 3], 1, 0).passed(dtype, true));
            assert!(v([1e-3; 3], 0, 0).passed(dtype, true));
            assert!(v([1e-3; 3], 0, 5).passed(dtype, false), "atomic sums differ");
            assert!(!v([1e-3; 3], 1, 5).passed(dtype, false));
        }
        let between = [0.0, 0.0, 1.5 * 2.0 * tolerance(fp)];
        assert!(between[2] < 2.0 * tolerance(bf));
        let v = Verdict { rel_err: between, nonfinite: 0, unrepeated: 0 };
        assert!(v.passed(bf, true) && !v.passed(fp, true));
    }
}
