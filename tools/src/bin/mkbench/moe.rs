//! `mkbench moe`: mkMoeDispatchGemm and mkMoeGemmCombine beside the unfused sequences, in
//! the same run:
//!
//!   mkbench moe [-g ranks] [--tokens 4096] [--hidden 7168] [--ffn 2048] [--experts 256] [--topk 8] [-n iters] [-w warmup] [--blocks B] [--trace] [--threads]
//!
//! The baseline per direction is the token exchange plus a grouped GEMM from cuBLAS
//! (cublas_grouped.rs: one cublasGemmGroupedBatchedEx call over the local experts, each
//! with its own row count). Unfused dispatch = the same kernel with its GEMM switched off
//! (the token exchange alone: count exchange, 16-byte-vector copies into the owners'
//! receive buffers, signals; it ends once every row is here), then the grouped GEMM on the
//! received rows. Unfused combine = the grouped GEMM into the workspace, then the combine
//! kernel with its GEMM switched off (pull and weighted sum). Extras: each part alone, and
//! the exchange with one GEMM-engine launch per expert capped to MK_MAX_CTAS
//! (`per_expert_gemms_capped`). Without cuBLAS's grouped GEMM (no libcublas, or older than
//! 12.5) the per-expert launches are the baseline and the record says so.
//! Each direction's fused output is checked once against its baseline's (received rows of
//! Y; every token of the output). Then the shared protocol (measure.rs: interleaved
//! blocks, the slowest rank per call; median, p10, p90; every contender's host enqueue µs
//! per call), with CUDA-graph replays of GRAPH_CALLS captured calls of the fused ops and
//! of the baselines. Uniform routing (k distinct experts per token), bf16, Y' = Y.
//! Bandwidth as DeepEP counts it: bytes of the (token, expert) rows a rank sends (dispatch)
//! or receives back (combine) / time of the exchange alone; TFLOP/s per rank =
//! 2·rows·F·H / time, rows = the most rows any rank received. `--trace` adds, per
//! direction, one traced call of the fused kernel: per role (GEMM / send or pull CTAs)
//! where the time went (kernels/common/trace.cuh; the pull CTAs' waits are summed over
//! their 12 warps, the GEMM CTAs count 64-row Z slabs as items).

use crate::cublas_grouped::{Cublas, ExpertGemm, GroupedGemm};
use crate::fused_common::{bad, capture_everywhere, measure_slowest, print_trace, run_ranks, Timed};
use crate::fused_options::{FusedDefaults, FusedOptions};
use crate::measure::{Measured, Protocol, GRAPH_CALLS};
use crate::record::{self, Json};
use crate::timing::Events;
use cudarc::driver::result as cu;
use mkernel::comm::CommConfig;
use mkernel::cuda::{self, PrimaryContext};
use mkernel::error::{mkResult_t, Result};
use mkernel::ops::gemm::{engine, op as gemm_op};
use mkernel::ops::moe::{
    self, device_layout, dispatch_gemm, gemm_combine, validate_combine, validate_dispatch, MoeDims, MoeShape,
};
use mkernel::types::mkDataType_t;
use mkernel_tools::testing::{relative_error, tolerance, TestBuffer};

struct Options {
    common: FusedOptions,
    tokens: usize,
    hidden: usize,
    ffn: usize,
    experts: usize,
    top_k: usize,
}

/// Parses the options without touching a GPU.
pub fn check(_op: &str, args: &[String]) -> Result<()> {
    parse(args).map(|_| ())
}

fn parse(args: &[String]) -> Result<Options> {
    let (mut tokens, mut hidden, mut ffn, mut experts, mut top_k) = (4096, 7168, 2048, 256, 8);
    let common = FusedOptions::parse(args, FusedDefaults { warmup: 3, takes_trace: true }, |flag, v| {
        let target = match flag {
            "--tokens" => &mut tokens,
            "--hidden" => &mut hidden,
            "--ffn" => &mut ffn,
            "--experts" => &mut experts,
            "--topk" => &mut top_k,
            _ => return Ok(false),
        };
        *target = v.parse().map_err(|_| bad(flag))?;
        Ok(true)
    })?;
    Ok(Options { common, tokens, hidden, ffn, experts, top_k })
}

pub fn run(args: &[String]) -> Result<bool> {
    let o = parse(args)?;
    run_ranks("moe", args, o.common.ranks, o.common.threads, &|rank, n, id, device| rank_main(&o, rank, n, id, device))
}

/// Uniform routing: k distinct experts per token, from a per-rank seed.
fn routing(o: &Options, n: usize) -> Vec<Vec<i32>> {
    (0..n)
        .map(|r| {
            let mut s = 0x2545_F491_4F6C_DD1Du64 ^ (r as u64 + 1);
            let mut v = Vec::with_capacity(o.tokens * o.top_k);
            for _ in 0..o.tokens {
                let mut chosen: Vec<i32> = Vec::with_capacity(o.top_k);
                while chosen.len() < o.top_k {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    let e = (s % o.experts as u64) as i32;
                    if !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                v.extend(chosen);
            }
            v
        })
        .collect()
}

fn rank_main(o: &Options, rank: usize, n: usize, id: &mkernel::bootstrap::UniqueId, device: i32) -> Result<bool> {
    let ctx = PrimaryContext::retain(device)?;
    let _g = ctx.enter()?;
    let dtype = mkDataType_t::mkBfloat16;
    let (t, h, f, k, e) = (o.tokens, o.hidden, o.ffn, o.top_k, o.experts);
    let el = e / n;
    let ids = routing(o, n);
    let layout = device_layout(&MoeShape::new(t, k, e, n), &ids, rank)?;
    let cap = layout.rows_needed;
    let dims = MoeDims { tokens: t, hidden: h, ffn: f, top_k: k, experts: e, capacity: cap, nranks: n };
    let mut cfg = CommConfig::from_env();
    cfg.workspace_bytes = cfg.workspace_bytes.max((moe::COUNTS_BYTES + cap * h * 2) as u64);
    let comm = crate::fused_common::init_comm(id, n, rank, device, cfg)?;
    let stream =
        cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
    let x = TestBuffer::new(t * h, dtype)?;
    let w1 = TestBuffer::new(el * f * h, dtype)?;
    let w2 = TestBuffer::new(el * h * f, dtype)?;
    let y = TestBuffer::new(cap * f, dtype)?;
    let out = TestBuffer::new(t * h, dtype)?;
    let idx = TestBuffer::new(t * k, mkDataType_t::mkInt32)?;
    let wts = TestBuffer::new(t * k, mkDataType_t::mkFloat32)?;
    let counts = TestBuffer::new(el + 1, mkDataType_t::mkInt32)?;
    let lay = TestBuffer::new(moe::layout_offsets(t, k, cap).words, mkDataType_t::mkInt32)?;
    x.randomize(5 + rank as u64, 1.0, stream)?;
    w1.randomize(50 + rank as u64, 0.05, stream)?;
    w2.randomize(80 + rank as u64, 0.05, stream)?;
    wts.randomize(90 + rank as u64, 1.0, stream)?;
    idx.upload(&ids[rank].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
    let dargs = validate_dispatch(x.ptr(), idx.ptr(), w1.ptr(), y.ptr(), counts.ptr(), lay.ptr(), dims, dtype as i32)?;
    let cargs = validate_combine(y.ptr(), w2.ptr(), wts.ptr(), lay.ptr(), out.ptr(), dims, dtype as i32)?;
    let recv = moe::region_buffer(&comm).expect("data plane");
    // The baseline's grouped GEMMs (cuBLAS), and the per-expert engine launches (capped).
    let blas = Cublas::new(stream);
    let experts1: Vec<ExpertGemm> = (0..el)
        .map(|le| ExpertGemm {
            a: recv + (layout.expert_base[le] * h * 2) as u64,
            w: w1.ptr() + (le * f * h * 2) as u64,
            c: y.ptr() + (layout.expert_base[le] * f * 2) as u64,
            rows: layout.recv_counts[le],
        })
        .collect();
    let experts2: Vec<ExpertGemm> = (0..el)
        .map(|le| ExpertGemm {
            a: y.ptr() + (layout.expert_base[le] * f * 2) as u64,
            w: w2.ptr() + (le * h * f * 2) as u64,
            c: recv + (layout.expert_base[le] * h * 2) as u64,
            rows: layout.recv_counts[le],
        })
        .collect();
    let grouped = match &blas {
        Ok(b) => Ok((b, GroupedGemm::new(&experts1, f, h, dtype)?, GroupedGemm::new(&experts2, h, f, dtype)?)),
        Err(e) => Err(e.message.clone()),
    };
    // Every rank has cuBLAS's grouped GEMM or none uses it (the contenders must match).
    let everywhere = comm.bootstrap.allgather(&[u8::from(grouped.is_ok())])?.iter().all(|v| v.first() == Some(&1));
    let grouped = match grouped {
        Ok(g) if everywhere => Ok(g),
        Ok(_) => Err("another rank has no cuBLAS grouped GEMM".to_string()),
        Err(why) => Err(why),
    };
    let sms = cuda::sm_count(device)? as usize;
    let grid = comm.config.max_ctas.map_or(sms, |v| v as usize);
    let engine_gemms =
        |experts: &[ExpertGemm], n_out: usize, k_in: usize| -> Result<Vec<(gemm_op::GemmArgs, engine::GemmPlan)>> {
            experts
                .iter()
                .filter(|x| x.rows > 0)
                .map(|x| {
                    let a = gemm_op::validate(x.a, x.w, x.c, x.rows, n_out, k_in, dtype as i32)?;
                    let p = engine::plan(
                        x.rows,
                        n_out,
                        k_in,
                        grid,
                        a.tma_epilogue_ok(),
                        engine::PlanOverrides { max_ctas: Some(grid), ..Default::default() },
                    );
                    Ok((a, p))
                })
                .collect()
        };
    let g1 = engine_gemms(&experts1, f, h)?;
    let g2 = engine_gemms(&experts2, h, f)?;
    let events = Events::new(o.common.protocol.iters)?;
    let capped1 = || g1.iter().try_for_each(|(a, p)| gemm_op::launch(a, p, stream));
    let capped2 = || g2.iter().try_for_each(|(a, p)| gemm_op::launch(a, p, stream));
    let grouped1 = || grouped.as_ref().map_err(|why| bad(why)).and_then(|(b, g, _)| g.run(b));
    let grouped2 = || grouped.as_ref().map_err(|why| bad(why)).and_then(|(b, _, g)| g.run(b));
    // Each dispatch rebuilds the same layout the combines read (the check runs a dispatch
    // first), so the contenders may run in any order.
    let fused_dispatch = || dispatch_gemm(&comm, &dargs, true, stream);
    let exchange_dispatch = || dispatch_gemm(&comm, &dargs, false, stream);
    let grouped_dispatch = || exchange_dispatch().and_then(|_| grouped1());
    let capped_dispatch = || exchange_dispatch().and_then(|_| capped1());
    let fused_combine = || gemm_combine(&comm, &cargs, true, stream);
    let exchange_combine = || gemm_combine(&comm, &cargs, false, stream);
    let grouped_combine = || grouped2().and_then(|_| exchange_combine());
    let capped_combine = || capped2().and_then(|_| exchange_combine());
    let has_grouped = grouped.is_ok();
    let (base_dispatch, base_combine): (&dyn Fn() -> Result<()>, &dyn Fn() -> Result<()>) =
        if has_grouped { (&grouped_dispatch, &grouped_combine) } else { (&capped_dispatch, &capped_combine) };
    let (base_dispatch_name, base_combine_name) = if has_grouped {
        ("exchange+grouped_gemm", "grouped_gemm+exchange")
    } else {
        ("exchange+per_expert_gemms_capped", "per_expert_gemms_capped+exchange")
    };

    // The check, once per direction: the baseline's output, then the fused op's, each into
    // a poisoned buffer; every rank done (synchronised, a barrier) between the steps, so no
    // step's writes meet a peer's reads of the step before.
    let sync = || -> Result<()> {
        // SAFETY: live stream.
        unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
        comm.bootstrap.barrier()
    };
    let run_into = |buf: &TestBuffer, f: &dyn Fn() -> Result<()>| -> Result<Vec<f64>> {
        buf.poison(stream)?;
        sync()?;
        f()?;
        sync()?;
        buf.download_f64()
    };
    let valid_rows = |v: &[f64]| -> Vec<f64> {
        (0..el)
            .flat_map(|le| {
                let (base, rows) = (layout.expert_base[le], layout.recv_counts[le]);
                v[base * f..(base + rows) * f].iter().copied()
            })
            .collect()
    };
    let y_ref = valid_rows(&run_into(&y, base_dispatch)?);
    let y_fused = valid_rows(&run_into(&y, &fused_dispatch)?);
    let out_ref = run_into(&out, base_combine)?;
    let out_fused = run_into(&out, &fused_combine)?;
    let rel_err = [relative_error(&y_fused, &y_ref), relative_error(&out_fused, &out_ref)];
    // The worst rank's relative error per direction (NaN, from any rank, stays NaN).
    let rel_all = comm.bootstrap.allgather(&[rel_err[0].to_le_bytes(), rel_err[1].to_le_bytes()].concat())?;
    let worst = |i: usize| {
        rel_all.iter().map(|b| f64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"))).fold(
            0.0f64,
            |a, r| {
                if r.is_nan() || a.is_nan() {
                    f64::NAN
                } else {
                    a.max(r)
                }
            },
        )
    };
    // Written so that a NaN error counts as wrong (every comparison with NaN is false).
    #[allow(clippy::neg_cmp_op_on_partial_ord)]
    let wrong_any = [0, 1].map(|i| !(worst(i) <= tolerance(dtype)));

    // (direction, name, how it is timed).
    let mut contenders: Vec<(&str, &str, Timed)> = vec![
        ("dispatch", "fused", Timed::Calls(&fused_dispatch)),
        ("dispatch", base_dispatch_name, Timed::Calls(base_dispatch)),
        ("dispatch", "exchange", Timed::Calls(&exchange_dispatch)),
        ("combine", "fused", Timed::Calls(&fused_combine)),
        ("combine", base_combine_name, Timed::Calls(base_combine)),
        ("combine", "exchange", Timed::Calls(&exchange_combine)),
    ];
    if has_grouped {
        contenders.extend([
            ("dispatch", "grouped_gemm", Timed::Calls(&grouped1 as &dyn Fn() -> Result<()>)),
            ("dispatch", "exchange+per_expert_gemms_capped", Timed::Calls(&capped_dispatch)),
            ("combine", "grouped_gemm", Timed::Calls(&grouped2)),
            ("combine", "per_expert_gemms_capped+exchange", Timed::Calls(&capped_combine)),
        ]);
    } else {
        contenders.extend([
            ("dispatch", "per_expert_gemms_capped", Timed::Calls(&capped1 as &dyn Fn() -> Result<()>)),
            ("combine", "per_expert_gemms_capped", Timed::Calls(&capped2)),
        ]);
    }
    let protocol = Protocol { warmup: o.common.protocol.warmup.max(1), ..o.common.protocol };
    let timed: Vec<Timed> = contenders.iter().map(|c| c.2).collect();
    let mut meas = measure_slowest(&comm, &events, stream, protocol, &timed)?;
    // Graph replays in a second interleaved pass, the baselines captured last: whether
    // cuBLAS's grouped GEMM can be captured is cuBLAS's business, and a capture it refuses
    // must not touch the direct calls' timing.
    let graphs_fused = capture_everywhere(&comm, stream, GRAPH_CALLS, &[&fused_dispatch, &fused_combine])?;
    let graphs_base = capture_everywhere(&comm, stream, GRAPH_CALLS, &[base_dispatch, base_combine])?;
    let graph_names = [
        format!("{base_dispatch_name}{}", crate::measure::GRAPH_SUFFIX),
        format!("{base_combine_name}{}", crate::measure::GRAPH_SUFFIX),
    ];
    let mut graph_contenders: Vec<(&str, &str, Timed)> = Vec::new();
    if let Ok(g) = &graphs_fused {
        graph_contenders.push(("dispatch", "fused_graph", Timed::Graph(&g[0])));
        graph_contenders.push(("combine", "fused_graph", Timed::Graph(&g[1])));
    }
    if let Ok(g) = &graphs_base {
        graph_contenders.push(("dispatch", &graph_names[0], Timed::Graph(&g[0])));
        graph_contenders.push(("combine", &graph_names[1], Timed::Graph(&g[1])));
    }
    if !graph_contenders.is_empty() {
        let timed: Vec<Timed> = graph_contenders.iter().map(|c| c.2).collect();
        let graphs = measure_slowest(&comm, &events, stream, protocol, &timed)?;
        meas.stats.extend(graphs.stats);
        meas.host_us.extend(graphs.host_us);
        contenders.extend(graph_contenders);
    }
    let index = |direction: &str, name: &str| contenders.iter().position(|c| c.0 == direction && c.1 == name);
    let of = |direction: &str, name: &str| index(direction, name).map(|i| meas.median(i));
    let host_of = |direction: &str, name: &str| index(direction, name).map_or(f64::NAN, |i| meas.host_us[i]);
    if o.common.trace {
        print_trace(&comm, stream, "moe dispatch", &|buf| {
            dispatch_gemm(&comm, &moe::DispatchArgs { trace: buf, ..dargs }, true, stream)
        })?;
        print_trace(&comm, stream, "moe combine", &|buf| {
            gemm_combine(&comm, &moe::CombineArgs { trace: buf, ..cargs }, true, stream)
        })?;
    }
    let err = comm.async_error();
    let rows: usize = layout.recv_counts.iter().sum();
    let sent_rows: usize = layout
        .slots
        .iter()
        .enumerate()
        .filter(|(i, s)| s.is_some() && !ids[rank][i / k * k..*i].contains(&ids[rank][*i]))
        .count();
    let all = comm.bootstrap.allgather(&[(rows as u64).to_le_bytes(), (sent_rows as u64).to_le_bytes()].concat())?;
    let max_rows = all.iter().map(|v| u64::from_le_bytes(v[..8].try_into().unwrap())).max().unwrap_or(0) as f64;
    if rank == 0 {
        let tf = |us: f64| 2.0 * max_rows * f as f64 * h as f64 / (us * 1e-6) / 1e12;
        let gbs = |us: f64| sent_rows as f64 * h as f64 * 2.0 / (us * 1e-6) / 1e9;
        let opt = |t: Option<f64>| t.map_or("-".to_string(), |t| format!("{t:.1}"));
        println!(
            "# mkbench moe: {n} rank(s), bf16, T={t}/rank, H={h}, F={f}, E={e}, k={k}, {sms} SMs, MK_MAX_CTAS={}, recvCapacity={cap}, rows/rank <= {max_rows}, warm-up {} then {} interleaved blocks of {} calls (median of the slowest rank per call); graphs of {GRAPH_CALLS} calls",
            comm.config.max_ctas.map_or("-".into(), |v| v.to_string()),
            protocol.warmup,
            protocol.blocks,
            protocol.iters
        );
        match &grouped {
            Ok(_) => println!(
                "# baseline: exchange + cuBLAS grouped GEMM (cublasGemmGroupedBatchedEx, one group per local expert)"
            ),
            Err(why) => println!(
                "# baseline: exchange + one GEMM-engine launch per expert, capped (no cuBLAS grouped GEMM: {why})"
            ),
        }
        if let Err(why) = &graphs_fused {
            println!("# no graph replay of the fused ops: {why}");
        }
        if let Err(why) = &graphs_base {
            println!("# no graph replay of the baselines: {why}");
        }
        println!(
            "# {:<9} | {:>10} {:>7} | {:>10} {:>7} | {:>9} | {:>10} {:>7} | {:>9} {:>8} | {:>9} | {:>9} {:>9} | {:>11} | {:>7} {:>7}",
            "direction", "fused us", "TF/s", "base us", "TF/s", "fused/base", "exchange us", "GB/s", "grouped us", "TF/s",
            "capped us", "graph f", "graph b", "host f/b us", "#wrong", "rel err"
        );
        for (i, (direction, base)) in
            [("dispatch", base_dispatch_name), ("combine", base_combine_name)].into_iter().enumerate()
        {
            let t_fused = of(direction, "fused").unwrap_or(f64::NAN);
            let t_base = of(direction, base).unwrap_or(f64::NAN);
            let t_x = of(direction, "exchange").unwrap_or(f64::NAN);
            let t_g = of(direction, "grouped_gemm");
            let capped_name = if direction == "dispatch" {
                "exchange+per_expert_gemms_capped"
            } else {
                "per_expert_gemms_capped+exchange"
            };
            println!(
                "  {:<9} | {:>10.1} {:>7.1} | {:>10.1} {:>7.1} | {:>9.3} | {:>10.1} {:>7.1} | {:>9} {:>8} | {:>9} | {:>9} {:>9} | {:>11} | {:>7} {:>7.1e}{}",
                direction,
                t_fused,
                tf(t_fused),
                t_base,
                tf(t_base),
                t_fused / t_base,
                t_x,
                gbs(t_x),
                opt(t_g),
                t_g.map_or("-".into(), |t| format!("{:.1}", tf(t))),
                opt(of(direction, capped_name)),
                opt(of(direction, "fused_graph")),
                opt(of(direction, &graph_names[i])),
                format!("{:.1}/{:.1}", host_of(direction, "fused"), host_of(direction, base)),
                u8::from(wrong_any[i]),
                worst(i),
                if err == mkResult_t::mkSuccess { String::new() } else { format!("  ASYNC ERROR {err:?}") }
            );
            let idx: Vec<usize> = (0..contenders.len()).filter(|&j| contenders[j].0 == direction).collect();
            let names: Vec<&str> = idx.iter().map(|&j| contenders[j].1).collect();
            let sub = Measured {
                stats: idx.iter().map(|&j| meas.stats[j]).collect(),
                host_us: idx.iter().map(|&j| meas.host_us[j]).collect(),
            };
            record::row(
                record::shape(
                    &[("ranks", n), ("tokens", t), ("hidden", h), ("ffn", f), ("experts", e), ("topk", k)],
                    &[("direction", direction), ("dtype", dtype.name())],
                ),
                record::measured_contenders(&names, &sub),
                &[
                    ("async_error", Json::Bool(err != mkResult_t::mkSuccess)),
                    ("baseline", Json::str(base)),
                    ("fused_over_baseline", Json::num(t_fused / t_base)),
                    ("rel_err", Json::num(worst(i))),
                    ("wrong", Json::Bool(wrong_any[i])),
                ],
            );
        }
        record::config(
            "baseline",
            Json::str(match &grouped {
                Ok(_) => "exchange + cuBLAS grouped GEMM (cublasGemmGroupedBatchedEx, one group per local expert)"
                    .to_string(),
                Err(why) => {
                    format!("exchange + one GEMM-engine launch per expert, capped (no cuBLAS grouped GEMM: {why})")
                }
            }),
        );
    }
    // SAFETY: live stream.
    unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
    drop(graphs_fused);
    drop(graphs_base);
    Ok(err == mkResult_t::mkSuccess && wrong_any == [false, false])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused_options::command_line as args;

    #[test]
    fn the_moe_shape_parses_beside_the_common_options() {
        let d = parse(&[]).unwrap();
        assert_eq!((d.tokens, d.hidden, d.ffn, d.experts, d.top_k), (4096, 7168, 2048, 256, 8));
        assert_eq!(d.common.protocol, Protocol { warmup: 3, ..Protocol::DEFAULT });
        let o = parse(&args("--tokens 16 --hidden 128 --ffn 64 --experts 8 --topk 2 -g 2 --trace")).unwrap();
        assert_eq!((o.tokens, o.hidden, o.ffn, o.experts, o.top_k), (16, 128, 64, 8, 2));
        assert_eq!((o.common.ranks, o.common.trace), (2, true));
        assert_eq!(parse(&args("--topk two")).err().map(|e| e.message).as_deref(), Some("mkbench: bad --topk"));
    }
}
