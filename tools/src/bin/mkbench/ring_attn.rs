//! `mkbench ring_attn`: mkRingAttention beside the unfused ring it replaces, in the same run:
//!
//!   mkbench ring_attn [-g ranks] [--seq 8192,16384,32768] [--heads 32] [--kv-heads 32]
//!                     [--dim 128] [--causal 0,1] [-n iters] [-w warmup] [--trace] [--threads]
//!                     [--unfused 0|1] [--rest-ms ms] [--blocks B] [--dtype bf16|fp16]
//!
//! Per (global S, causal): the fused op; the unfused ring (mkAllGather of K, mkAllGather of
//! V, then the same attention kernel over the gathered K/V, no overlap); and its two parts
//! alone (attention over gathered K/V; the two AllGathers) for the overlap efficiency
//! max(t_attn, t_comm) / t_fused; CUDA-graph replays of GRAPH_CALLS captured calls of the
//! fused op and of the unfused ring (time per call). Every contender records the host's
//! enqueue µs per call. Batch 1, `--dtype` bf16 (the default) or fp16, recorded in each
//! row's shape (`dtype`) and the config. The fused output is checked once per case
//! against the unfused ring's. Times follow the shared protocol (measure.rs: -w warm-up,
//! then --blocks interleaved blocks of -n calls, the slowest rank per call; median, p10,
//! p90). TFLOP/s per rank: 4·H·S_local·
//! S·D (non-causal), half of it causal (the FlashAttention convention). The single-GPU
//! baseline (torch SDPA, cuDNN and flash backends) is a separate script
//! (benches/sdpa_baseline.py), run in the same GPU session. The H200 lowers its clocks under
//! sustained attention (power), so a case measured after long ones reads slower: for a
//! fair comparison with that script, `--unfused 0` measures the fused op alone and
//! `--rest-ms` idles the GPU before each case (the script takes the same options), cases in
//! the order given (`--causal 1,0` runs the causal ones first). `--trace`: one more fused call
//! per case, by the kernel's `_trace` twin with a per-CTA timing buffer, summarised per rank
//! (trace_summary).

use crate::fused_common::{bad, capture_everywhere, measure_slowest, run_ranks, trace_words, Timed};
use crate::fused_options::{half_dtype_name, parse_half_dtype, parse_list, FusedDefaults, FusedOptions};
use crate::measure::{Progress, GRAPH_CALLS};
use crate::record::{self, Json};
use crate::timing::Events;
use cudarc::driver::result as cu;
use mkernel::comm::CommConfig;
use mkernel::cuda::{self, PrimaryContext};
use mkernel::error::Result;
use mkernel::ops::attention::ring_attention::{
    attention_gathered, ring_attention, validate_args, workspace_bytes, RingArgs, RingShape,
};
use mkernel::ops::collectives::{collective, CollectiveKind};
use mkernel::types::mkDataType_t;
use mkernel_tools::testing::{relative_error, tolerance, TestBuffer};

struct Options {
    common: FusedOptions,
    cases: Cases,
    /// 0: only the fused op (no unfused ring, no attention alone, no AllGathers).
    unfused: usize,
}

/// The cases both ring-attention benches sweep (this one and `ring_attn_bwd`), batch 1,
/// and the idle time before each: `--seq S,...` (global), `--causal 0,1` (in this order),
/// `--heads`, `--kv-heads`, `--dim`, `--dtype bf16|fp16`, `--rest-ms`.
pub struct Cases {
    pub seq: Vec<usize>,
    pub heads: usize,
    pub kv_heads: usize,
    pub dim: usize,
    pub causal: Vec<usize>,
    /// The element type of q, k, v and the outputs (bf16 or fp16).
    pub dtype: mkDataType_t,
    /// Idle time before each case (after the stream has drained), in ms.
    pub rest_ms: u64,
}

impl Default for Cases {
    fn default() -> Cases {
        Cases {
            seq: vec![8192, 16384, 32768],
            heads: 32,
            kv_heads: 32,
            dim: 128,
            causal: vec![0, 1],
            dtype: mkDataType_t::mkBfloat16,
            rest_ms: 0,
        }
    }
}

impl Cases {
    /// Reads one of the options above into its field; false when `flag` is not one of them.
    pub fn flag(&mut self, flag: &str, v: &str) -> Result<bool> {
        match flag {
            "--seq" => self.seq = parse_list(v, "--seq")?,
            "--heads" => self.heads = v.parse().map_err(|_| bad("--heads"))?,
            "--kv-heads" => self.kv_heads = v.parse().map_err(|_| bad("--kv-heads"))?,
            "--dim" => self.dim = v.parse().map_err(|_| bad("--dim"))?,
            "--causal" => self.causal = parse_list(v, "--causal")?,
            "--dtype" => self.dtype = parse_half_dtype(v)?,
            "--rest-ms" => self.rest_ms = v.parse().map_err(|_| bad("--rest-ms"))?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The idle time before a case: lets `stream` drain, then sleeps `--rest-ms`.
    pub fn rest(&self, stream: mkernel::cuda::sys::CUstream) -> Result<()> {
        if self.rest_ms > 0 {
            // SAFETY: live stream.
            unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
            std::thread::sleep(std::time::Duration::from_millis(self.rest_ms));
        }
        Ok(())
    }
}

/// The forward's FLOPs on one rank of `n`, batch 1: 4·H·S_local·S·D, half of it causal (the
/// FlashAttention convention: the masked half is not counted).
pub fn forward_flops(heads: usize, seq_local: usize, seq: usize, dim: usize, causal: bool) -> f64 {
    4.0 * heads as f64 * seq_local as f64 * seq as f64 * dim as f64 * if causal { 0.5 } else { 1.0 }
}

/// Parses the options without touching a GPU.
pub fn check(_op: &str, args: &[String]) -> Result<()> {
    parse(args).map(|_| ())
}

fn parse(args: &[String]) -> Result<Options> {
    let (mut cases, mut unfused) = (Cases::default(), 1);
    let common = FusedOptions::parse(args, FusedDefaults { warmup: 2, takes_trace: true }, |flag, v| {
        match flag {
            f if cases.flag(f, v)? => {}
            "--unfused" => unfused = v.parse().map_err(|_| bad("--unfused"))?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(Options { common, cases, unfused })
}

pub fn run(args: &[String]) -> Result<bool> {
    let o = parse(args)?;
    run_ranks("ring_attn", args, o.common.ranks, o.common.threads, &|rank, n, id, device| {
        rank_main(&o, rank, n, id, device)
    })
}

fn rank_main(o: &Options, rank: usize, n: usize, id: &mkernel::bootstrap::UniqueId, device: i32) -> Result<bool> {
    let ctx = PrimaryContext::retain(device)?;
    let _g = ctx.enter()?;
    let dtype = o.cases.dtype;
    let max_sl = o.cases.seq.iter().max().copied().unwrap_or(0) / n;
    let shape_of = |sl: usize, causal: bool| RingShape {
        batch: 1,
        seq_local: sl,
        heads: o.cases.heads,
        kv_heads: o.cases.kv_heads,
        head_dim: o.cases.dim,
        causal,
        nranks: n,
    };
    let mut cfg = CommConfig::from_env();
    // The fused op's K/V copy, and the collectives' staging for the unfused AllGathers.
    cfg.workspace_bytes = cfg.workspace_bytes.max(workspace_bytes(&shape_of(max_sl, false), dtype));
    let comm = crate::fused_common::init_comm(id, n, rank, device, cfg)?;
    let stream =
        cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
    let q_elems = max_sl * o.cases.heads * o.cases.dim;
    let kv_elems = max_sl * o.cases.kv_heads * o.cases.dim;
    let q = TestBuffer::new(q_elems, dtype)?;
    let k = TestBuffer::new(kv_elems, dtype)?;
    let v = TestBuffer::new(kv_elems, dtype)?;
    let out = TestBuffer::new(q_elems, dtype)?;
    let out_ref = TestBuffer::new(q_elems, dtype)?;
    let lse_ref = TestBuffer::new(max_sl * o.cases.heads, mkDataType_t::mkFloat32)?;
    let protocol = o.common.protocol;
    let lse = TestBuffer::new(max_sl * o.cases.heads, mkDataType_t::mkFloat32)?;
    let kg = TestBuffer::new(kv_elems * n, dtype)?;
    let vg = TestBuffer::new(kv_elems * n, dtype)?;
    q.randomize(11 + rank as u64, 1.0, stream)?;
    k.randomize(21 + rank as u64, 1.0, stream)?;
    v.randomize(31 + rank as u64, 1.0, stream)?;
    let events = Events::new(protocol.iters)?;
    let sms = cuda::sm_count(device)? as u32;
    let grid_cap = comm.config.max_ctas.map_or(sms, |c| c.min(sms));
    if rank == 0 {
        println!(
            "# mkbench ring_attn: {n} rank(s), {}, B=1 H={} H_kv={} D={}, {sms} SMs, MK_MAX_CTAS={}, warm-up {} + {} timed calls (median of the slowest rank)",
            half_dtype_name(dtype),
            o.cases.heads,
            o.cases.kv_heads,
            o.cases.dim,
            comm.config.max_ctas.map_or("-".into(), |v| v.to_string()),
            protocol.warmup,
            protocol.iters
        );
        println!(
            "# {:>6} {:>6} {:>6} | {:>10} {:>7} | {:>10} {:>10} {:>10} | {:>7} {:>7}",
            "S", "S_loc", "causal", "fused us", "TF/s", "unfused us", "attn us", "AGx2 us", "f/unf", "overlap"
        );
        record::config("dtype", Json::str(half_dtype_name(dtype)));
    }
    let mut all_ok = true;
    let mut progress = (rank == 0).then(|| Progress::new(o.cases.causal.len() * o.cases.seq.len()));
    for &causal in &o.cases.causal {
        for &s_global in &o.cases.seq {
            if let Some(p) = progress.as_mut() {
                p.step(&format!("S {s_global} causal {causal}"));
            }
            let sl = s_global / n;
            let args = validate_args(
                q.ptr(),
                k.ptr(),
                v.ptr(),
                out.ptr(),
                lse.ptr(),
                1,
                sl,
                o.cases.heads,
                o.cases.kv_heads,
                o.cases.dim,
                1.0 / (o.cases.dim as f32).sqrt(),
                causal as i32,
                dtype as i32,
                n,
                rank,
            )?;
            let count = sl * o.cases.kv_heads * o.cases.dim;
            let fused = || ring_attention(&comm, &args, stream);
            let gather = || {
                if n == 1 {
                    return Ok(());
                }
                collective(&comm, CollectiveKind::AllGather, k.ptr(), kg.ptr(), count, dtype as i32, None, stream)?;
                collective(&comm, CollectiveKind::AllGather, v.ptr(), vg.ptr(), count, dtype as i32, None, stream)
            };
            let (kp, vp) = if n == 1 { (k.ptr(), v.ptr()) } else { (kg.ptr(), vg.ptr()) };
            let attn = || attention_gathered(&args, kp, vp, grid_cap, stream);
            // The fused output against the unfused one (gather K, V, then attention), once per shape.
            let ref_args = RingArgs { out: out_ref.ptr(), lse: lse_ref.ptr(), ..args };
            out.poison(stream)?;
            out_ref.poison(stream)?;
            comm.bootstrap.barrier()?;
            gather()?;
            attention_gathered(&ref_args, kp, vp, grid_cap, stream)?;
            fused()?;
            // SAFETY: live stream.
            unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
            comm.bootstrap.barrier()?;
            let elems = sl * o.cases.heads * o.cases.dim;
            let (got, want) = (out.download_f64()?, out_ref.download_f64()?);
            let rel_err = relative_error(&got[..elems], &want[..elems]);
            #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN error counts as wrong
            let wrong = !(rel_err <= tolerance(dtype));
            all_ok &= !wrong;
            o.cases.rest(stream)?;
            let unfused_seq = || gather().and_then(|_| attn());
            let mut contenders: Vec<(&str, Timed)> = vec![("fused", Timed::Calls(&fused))];
            if o.unfused != 0 {
                contenders.extend([
                    ("mk_all_gather+attention", Timed::Calls(&unfused_seq)),
                    ("attention", Timed::Calls(&attn)),
                ]);
                if n > 1 {
                    contenders.push(("mk_all_gather", Timed::Calls(&gather)));
                }
            }
            let graphs = if o.unfused != 0 {
                capture_everywhere(&comm, stream, GRAPH_CALLS, &[&fused, &unfused_seq])?
            } else {
                capture_everywhere(&comm, stream, GRAPH_CALLS, &[&fused])?
            };
            if let Ok(g) = &graphs {
                contenders.push(("fused_graph", Timed::Graph(&g[0])));
                if let Some(u) = g.get(1) {
                    contenders.push(("mk_all_gather+attention_graph", Timed::Graph(u)));
                }
            }
            let (names, timed): (Vec<&str>, Vec<Timed>) = contenders.into_iter().unzip();
            let meas = measure_slowest(&comm, &events, stream, protocol, &timed)?;
            let stats = &meas.stats;
            let med = |name: &str| names.iter().position(|c| *c == name).map(|i| meas.median(i));
            let t_fused = stats[0].median;
            let t_unfused = med("mk_all_gather+attention").unwrap_or(f64::NAN);
            let t_attn = med("attention").unwrap_or(f64::NAN);
            let t_comm = if o.unfused == 0 { f64::NAN } else { med("mk_all_gather").unwrap_or(0.0) };
            let err = comm.async_error();
            if err != mkernel::error::mkResult_t::mkSuccess {
                all_ok = false;
            }
            if rank == 0 {
                let flops = forward_flops(o.cases.heads, sl, s_global, o.cases.dim, causal == 1);
                let tf = flops / (t_fused * 1e-6) / 1e12;
                println!(
                    "  {:>6} {:>6} {:>6} | {:>10.1} {:>7.1} | {:>10.1} {:>10.1} {:>10.1} | {:>7.3} {:>7.3}{}",
                    s_global,
                    sl,
                    causal,
                    t_fused,
                    tf,
                    t_unfused,
                    t_attn,
                    t_comm,
                    t_fused / t_unfused,
                    t_attn.max(t_comm) / t_fused,
                    if err == mkernel::error::mkResult_t::mkSuccess {
                        String::new()
                    } else {
                        format!("  ASYNC ERROR {err:?}")
                    }
                );
                let opt = |t: Option<f64>| t.map_or("-".to_string(), |t| format!("{t:.1}"));
                println!(
                    "  {:>20} fused p10/p90 {:.1}/{:.1} µs, graph {} (unfused {}) µs/call; host enqueue µs/call: fused {:.1}{}; rel err vs unfused {rel_err:.1e}{}",
                    "",
                    stats[0].p10,
                    stats[0].p90,
                    opt(med("fused_graph")),
                    opt(med("mk_all_gather+attention_graph")),
                    meas.host_us[0],
                    names
                        .iter()
                        .position(|c| *c == "mk_all_gather+attention")
                        .map_or(String::new(), |i| format!(", unfused {:.1}", meas.host_us[i])),
                    if wrong { "  WRONG" } else { "" }
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
                            ("heads", o.cases.heads),
                            ("dim", o.cases.dim),
                            ("causal", causal),
                        ],
                        &[("dtype", half_dtype_name(dtype))],
                    ),
                    record::measured_contenders(&names, &meas),
                    &[
                        ("rel_err", Json::num(rel_err)),
                        ("wrong", Json::Bool(wrong)),
                        (
                            "baseline",
                            Json::str(
                                "mk_all_gather+attention (attention: our kernel; cuDNN in benches/sdpa_baseline.py)",
                            ),
                        ),
                        ("async_error", Json::Bool(err != mkernel::error::mkResult_t::mkSuccess)),
                    ],
                );
            }
            if o.common.trace {
                let words =
                    trace_words(&comm, stream, &|buf| ring_attention(&comm, &RingArgs { trace: buf, ..args }, stream))?;
                println!("{}", trace_summary(&format!("S {s_global} causal {causal} rank {rank}"), &words));
            }
        }
    }
    // SAFETY: live stream.
    unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
    Ok(all_ok)
}

/// One line (and a second) from the ring-attention kernel's trace words (layout:
/// kernels/ring_attention.cu `RingTrace`): the kernel's span; per CTA the compute time
/// (warpgroup 0's consumer, from K/V published to its last item stored), how long before
/// the last CTA it finished (the imbalance), its items and tiles; and how long warpgroup 0
/// waited for K, V and Q to land, warpgroup 1 for K and V (medians and maxima, and the
/// sum as a share of the compute time).
fn trace_summary(label: &str, words: &[u64]) -> String {
    use mkernel::kernel_abi::MK_TRACE_WORDS;
    let ctas: Vec<&[u64]> = words.chunks(MK_TRACE_WORDS).filter(|w| w[0] != 0).collect();
    if ctas.is_empty() {
        return format!("trace {label}: no CTA recorded");
    }
    let us = |ns: u64| ns as f64 / 1e3;
    let stats = |mut v: Vec<u64>| -> (f64, f64, f64) {
        v.sort_unstable();
        (us(v[0]), us(v[v.len() / 2]), us(v[v.len() - 1]))
    };
    let first = ctas.iter().map(|w| w[0]).min().unwrap_or(0);
    let last_end = ctas.iter().map(|w| w[3]).max().unwrap_or(first);
    let last_done = ctas.iter().map(|w| w[2]).max().unwrap_or(first);
    let compute: Vec<u64> = ctas.iter().map(|w| w[2].saturating_sub(w[1])).collect();
    let busy: u64 = compute.iter().sum::<u64>().max(1);
    let (c_min, c_med, c_max) = stats(compute.clone());
    let (_, idle_med, idle_max) = stats(ctas.iter().map(|w| last_done.saturating_sub(w[2])).collect());
    let (_, start_med, start_max) = stats(ctas.iter().map(|w| w[1].saturating_sub(first)).collect());
    let items: Vec<u64> = ctas.iter().map(|w| w[6] & 0xffff_ffff).collect();
    let tiles: Vec<u64> = ctas.iter().map(|w| w[6] >> 32).collect();
    let mean = |v: &[u64]| v.iter().sum::<u64>() as f64 / v.len() as f64;
    let share = |slot: usize| 100.0 * ctas.iter().map(|w| w[slot]).sum::<u64>() as f64 / busy as f64;
    let (_, k_med, k_max) = stats(ctas.iter().map(|w| w[4]).collect());
    let (_, v_med, v_max) = stats(ctas.iter().map(|w| w[5]).collect());
    let (_, q_med, q_max) = stats(ctas.iter().map(|w| w[8]).collect());
    let (_, kv1_med, kv1_max) = stats(ctas.iter().map(|w| w[9]).collect());
    format!(
        "trace {label}: {} CTAs, kernel {:.1} µs, compute starts after {start_med:.1} (max {start_max:.1}) µs, compute per CTA {c_min:.1} / {c_med:.1} / {c_max:.1} µs (min / median / max), \
         done before the last CTA {idle_med:.1} (max {idle_max:.1}) µs, items {:.1} (min {} max {}), tiles {:.1} (min {} max {}) per CTA\n    \
         waits of warpgroup 0: K {k_med:.1} (max {k_max:.1}) µs = {:.2} %, V {v_med:.1} (max {v_max:.1}) µs = {:.2} %, Q {q_med:.1} (max {q_max:.1}) µs = {:.2} %; \
         warpgroup 1 K+V {kv1_med:.1} (max {kv1_max:.1}) µs = {:.2} % of the compute time",
        ctas.len(),
        us(last_end - first),
        mean(&items),
        items.iter().min().unwrap(),
        items.iter().max().unwrap(),
        mean(&tiles),
        tiles.iter().min().unwrap(),
        tiles.iter().max().unwrap(),
        share(4),
        share(5),
        share(8),
        share(9),
    )
}

#[cfg(test)]
mod tests {
    use super::{parse, trace_summary};

    #[test]
    fn fair_measurement_options_parse() {
        let args: Vec<String> = "--seq 8192,16384 --causal 1,0 --unfused 0 --rest-ms 1000 -w 3 -n 10 --trace"
            .split(' ')
            .map(String::from)
            .collect();
        let o = parse(&args).unwrap();
        assert_eq!(
            (o.cases.seq, o.cases.causal, o.unfused, o.cases.rest_ms, o.common.trace),
            (vec![8192, 16384], vec![1, 0], 0, 1000, true)
        );
        assert_eq!((o.common.protocol.warmup, o.common.protocol.iters), (3, 10));
        let o = parse(&[]).unwrap();
        assert_eq!((o.unfused, o.cases.rest_ms, o.common.trace), (1, 0, false), "defaults: every column, no rest");
        assert!(parse(&["--rest-ms".into(), "x".into()]).is_err());
    }

    #[test]
    fn dtype_defaults_to_bf16_and_takes_fp16() {
        use crate::fused_options::command_line as args;
        use mkernel::types::mkDataType_t;
        assert_eq!(parse(&[]).unwrap().cases.dtype, mkDataType_t::mkBfloat16);
        let o = parse(&args("--dtype fp16 --seq 4096 --unfused 0")).unwrap();
        assert_eq!((o.cases.dtype, &o.cases.seq[..], o.unfused), (mkDataType_t::mkFloat16, &[4096][..], 0));
        assert_eq!(parse(&args("--dtype bf16")).unwrap().cases.dtype, mkDataType_t::mkBfloat16);
        for bad in ["--dtype fp8", "--dtype float16", "--dtype"] {
            assert!(parse(&args(bad)).err().is_some_and(|e| e.message.contains("--dtype")), "{bad}");
        }
    }
    use mkernel::kernel_abi::MK_TRACE_WORDS;

    #[test]
    fn trace_summary_reads_the_kernel_layout() {
        // Two CTAs: start 1000 / 1000 ns, compute from 2000 to 12000 and 2000 to 10000 ns.
        let mut w = vec![0u64; 3 * MK_TRACE_WORDS];
        for (c, done, k, v, q, kv1, items, tiles) in
            [(0usize, 12_000u64, 500u64, 300u64, 100u64, 700u64, 3u64, 40u64), (1, 10_000, 1500, 0, 0, 0, 2, 30)]
        {
            let x = &mut w[c * MK_TRACE_WORDS..(c + 1) * MK_TRACE_WORDS];
            x[0] = 1000;
            x[1] = 2000;
            x[2] = done;
            x[3] = done + 100;
            x[4] = k;
            x[5] = v;
            x[6] = items | tiles << 32;
            x[8] = q;
            x[9] = kv1;
        }
        let s = trace_summary("t", &w);
        assert!(s.starts_with("trace t: 2 CTAs, kernel 11.1 µs"), "{s}");
        assert!(s.contains("compute per CTA 8.0 / 10.0 / 10.0 µs"), "{s}");
        assert!(s.contains("done before the last CTA 2.0 (max 2.0) µs"), "{s}");
        assert!(s.contains("items 2.5 (min 2 max 3), tiles 35.0 (min 30 max 40)"), "{s}");
        // K: 2000 ns of 18000 ns compute.
        assert!(s.contains("K 1.5 (max 1.5) µs = 11.11 %"), "{s}");
    }
}
