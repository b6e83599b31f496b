//! `mkbench gemm_rs` and `mkbench gemm_ar`: mkGemmReduceScatter / mkGemmAllReduce beside
//! the unfused sequences they replace, in the same run:
//!
//!   mkbench gemm_rs [-g ranks] [--m 1024,4096,16384] [--nk 8192x1024,8192x3584] [-n iters] [-w warmup] [--trace] [--threads]
//!   mkbench gemm_ar [-g ranks] [--m 1,16,64,256,2048,8192,16384] [--nk ...]
//!
//! Per shape, in the shared protocol (measure.rs: interleaved blocks, --blocks blocks of
//! -n calls after -w warm-up, the slowest rank per call; median, p10, p90): the fused op;
//! cuBLASLt on all the SMs then mkReduceScatter / mkAllReduce (the fair baseline);
//! cuBLASLt alone (the overlap ceiling); our GEMM capped to MK_MAX_CTAS then the collective
//! (an extra column); our GEMM and the collective alone (overlap efficiency
//! max(t_gemm, t_comm) / t_fused); CUDA-graph replays of GRAPH_CALLS captured calls of the
//! fused op and of the baseline (time per call, the host's launches out of the way). The
//! fused output is checked once per shape against cuBLASLt + collective. Every contender
//! records the host's enqueue µs per call. TFLOP/s per rank = 2·M·N·K / t. bf16. The
//! copy-engine collective is not offered here: a reduction needs SMs to add.

use crate::fused_common::{
    capture_everywhere, measure_cold_slowest, measure_slowest, print_trace, run_ranks, L2Flush, Timed,
};
use crate::fused_options::{parse_list, parse_pairs, FusedDefaults, FusedOptions};
use crate::measure::{Progress, Protocol, GRAPH_CALLS};
use crate::record::{self, Json};
use crate::timing::Events;
use cudarc::driver::result as cu;
use mkernel::comm::CommConfig;
use mkernel::cuda::{self, PrimaryContext};
use mkernel::error::{mkResult_t, Result};
use mkernel::ops::collectives::{collective, CollectiveKind};
use mkernel::ops::dense::gemm_reduce::{gemm_reduce, validate, GemmReduceArgs, Reduction};
use mkernel::ops::gemm::{engine, op as gemm_op};
use mkernel::types::{mkDataType_t, mkRedOp_t};
use mkernel_tools::cublaslt::CublasLt;
use mkernel_tools::testing::{relative_error, tolerance, TestBuffer};

/// The options of the GEMM + reduction benches (bf16 and fp8): the fused ones, the M list
/// and the N×K pairs.
pub(crate) struct Options {
    pub(crate) common: FusedOptions,
    pub(crate) ms: Vec<usize>,
    pub(crate) nk: Vec<(usize, usize)>,
}

impl Options {
    /// `--m` and `--nk` beside the fused options, from these defaults.
    pub(crate) fn parse(args: &[String], ms: Vec<usize>, takes_trace: bool) -> Result<Options> {
        let (mut ms, mut nk) = (ms, vec![(8192, 1024), (8192, 3584)]);
        let defaults = FusedDefaults { warmup: Protocol::DEFAULT.warmup, takes_trace };
        let common = FusedOptions::parse(args, defaults, |flag, v| {
            match flag {
                "--m" => ms = parse_list(v, "--m")?,
                "--nk" => nk = parse_pairs(v, "--nk")?,
                _ => return Ok(false),
            }
            Ok(true)
        })?;
        Ok(Options { common, ms, nk })
    }
}

/// Parses the options without touching a GPU (`op` is gemm_rs or gemm_ar).
pub fn check(op: &str, args: &[String]) -> Result<()> {
    let reduction = if op == "gemm_ar" { Reduction::All } else { Reduction::Scatter };
    parse(reduction, args).map(|_| ())
}

fn parse(reduction: Reduction, args: &[String]) -> Result<Options> {
    let ms = match reduction {
        Reduction::Scatter => vec![1024, 4096, 16384],
        Reduction::All => vec![1, 16, 64, 256, 2048, 8192, 16384],
    };
    Options::parse(args, ms, true)
}

pub fn gemm_rs(args: &[String]) -> Result<bool> {
    run(Reduction::Scatter, "gemm_rs", args)
}

pub fn gemm_ar(args: &[String]) -> Result<bool> {
    run(Reduction::All, "gemm_ar", args)
}

fn run(reduction: Reduction, name: &str, args: &[String]) -> Result<bool> {
    let o = parse(reduction, args)?;
    run_ranks(name, args, o.common.ranks, o.common.threads, &|rank, n, id, device| {
        rank_main(reduction, &o, rank, n, id, device)
    })
}

fn rank_main(
    reduction: Reduction,
    o: &Options,
    rank: usize,
    n: usize,
    id: &mkernel::bootstrap::UniqueId,
    device: i32,
) -> Result<bool> {
    let ctx = PrimaryContext::retain(device)?;
    let _g = ctx.enter()?;
    let dtype = mkDataType_t::mkBfloat16;
    let max_m = o.ms.iter().copied().max().unwrap_or(1).next_multiple_of(n);
    let max_n = o.nk.iter().map(|x| x.0).max().unwrap_or(8);
    let max_k = o.nk.iter().map(|x| x.1).max().unwrap_or(8);
    let mut cfg = CommConfig::from_env();
    // P, and R for the two-phase AllReduce; across nodes also the node partials (src/ops/dense/gemm_reduce_nodes.rs).
    cfg.workspace_bytes = cfg.workspace_bytes.max((max_m * max_n * 2 * 4) as u64);
    let comm = crate::fused_common::init_comm(id, n, rank, device, cfg)?;
    let stream =
        cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
    let lt = CublasLt::new()?;
    let a = TestBuffer::new(max_m * max_k, dtype)?;
    let b = TestBuffer::new(max_n * max_k, dtype)?;
    let partial = TestBuffer::new(max_m * max_n, dtype)?;
    let out = TestBuffer::new(max_m * max_n, dtype)?;
    let out_ref = TestBuffer::new(max_m * max_n, dtype)?;
    let protocol = o.common.protocol;
    let l2_flush = L2Flush::new()?;
    a.randomize(5 + rank as u64, 1.0, stream)?;
    b.randomize(50 + rank as u64, 1.0, stream)?;
    let events = Events::new(protocol.iters)?;
    let sms = cuda::sm_count(device)? as usize;
    let cap = comm.config.max_ctas.map_or(sms, |v| v as usize);
    let (label, kind) = match reduction {
        Reduction::Scatter => ("GEMM+ReduceScatter", CollectiveKind::ReduceScatter),
        Reduction::All => ("GEMM+AllReduce", CollectiveKind::AllReduce),
    };
    if rank == 0 {
        println!(
            "# mkbench {label}: {n} rank(s), bf16, {sms} SMs, MK_MAX_CTAS={}, warm-up {} then {} interleaved blocks of {} calls (median of the slowest rank per call; cuBLAS uncapped)",
            comm.config.max_ctas.map_or("-".into(), |v| v.to_string()),
            protocol.warmup,
            protocol.blocks,
            protocol.iters
        );
        println!(
            "# {:>6} {:>6} {:>6} | {:>9} {:>7} | {:>9} {:>9} {:>9} {:>9} {:>9} | {:>7} {:>7} {:>7}",
            "M",
            "N",
            "K",
            "fused us",
            "TF/s",
            "ours+coll",
            "cuBL+coll",
            "cuBLAS",
            "ours",
            "coll",
            "f/unf",
            "f/cuBL",
            "overlap"
        );
    }
    let mut all_ok = true;
    let mut progress = (rank == 0).then(|| Progress::new(o.nk.len() * o.ms.len()));
    for &(nn, kk) in &o.nk {
        for &m0 in &o.ms {
            if let Some(p) = progress.as_mut() {
                p.step(&format!("M {m0} N {nn} K {kk}"));
            }
            let m = if reduction == Reduction::Scatter { m0.next_multiple_of(n) } else { m0 };
            let args = validate(reduction, a.ptr(), b.ptr(), out.ptr(), m, nn, kk, dtype as i32, n)?;
            let gemm_args = gemm_op::validate(a.ptr(), b.ptr(), partial.ptr(), m, nn, kk, dtype as i32)?;
            let plan = engine::plan(
                m,
                nn,
                kk,
                cap,
                gemm_args.tma_epilogue_ok(),
                engine::PlanOverrides { max_ctas: Some(cap), ..Default::default() },
            );
            let blas = lt.gemm(m, nn, kk, dtype, dtype)?;
            let count = if reduction == Reduction::Scatter { m / n * nn } else { m * nn };
            let coll = || {
                collective(
                    &comm,
                    kind,
                    partial.ptr(),
                    out.ptr(),
                    count,
                    dtype as i32,
                    Some(mkRedOp_t::mkSum as i32),
                    stream,
                )
            };
            let ours = || gemm_op::launch(&gemm_args, &plan, stream);
            let cublas = || blas.run(&lt, a.ptr(), b.ptr(), partial.ptr(), stream);
            let fused = || gemm_reduce(&comm, &args, stream);
            // The fused output against the unfused one (cuBLAS, then the collective), once per shape.
            let out_count = count;
            out.poison(stream)?;
            out_ref.poison(stream)?;
            comm.bootstrap.barrier()?;
            cublas()?;
            collective(
                &comm,
                kind,
                partial.ptr(),
                out_ref.ptr(),
                count,
                dtype as i32,
                Some(mkRedOp_t::mkSum as i32),
                stream,
            )?;
            fused()?;
            // SAFETY: live stream.
            unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
            comm.bootstrap.barrier()?;
            let (got, want) = (out.download_f64()?, out_ref.download_f64()?);
            let rel_err = relative_error(&got[..out_count], &want[..out_count]);
            #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN error counts as wrong
            let wrong = !(rel_err <= tolerance(dtype));
            all_ok &= !wrong;
            let ours_coll = || ours().and_then(|_| coll());
            let blas_coll = || cublas().and_then(|_| coll());
            let mut contenders: Vec<(&str, Timed)> = vec![
                ("fused", Timed::Calls(&fused)),
                ("cublaslt+mk_collective", Timed::Calls(&blas_coll)),
                ("cublaslt", Timed::Calls(&cublas)),
                ("ours_capped+mk_collective", Timed::Calls(&ours_coll)),
                ("ours_capped", Timed::Calls(&ours)),
                ("mk_collective", Timed::Calls(&coll)),
            ];
            let graphs = capture_everywhere(&comm, stream, GRAPH_CALLS, &[&fused, &blas_coll])?;
            if let Ok(g) = &graphs {
                contenders.push(("fused_graph", Timed::Graph(&g[0])));
                contenders.push(("cublaslt+mk_collective_graph", Timed::Graph(&g[1])));
            }
            let (names, timed): (Vec<&str>, Vec<Timed>) = contenders.into_iter().unzip();
            let meas = measure_slowest(&comm, &events, stream, protocol, &timed)?;
            let stats = &meas.stats;
            let cold_fused = measure_cold_slowest(&comm, &events, stream, protocol, &l2_flush, &fused)?;
            let cold_base = measure_cold_slowest(&comm, &events, stream, protocol, &l2_flush, &blas_coll)?;
            let med = |name: &str| names.iter().position(|n| *n == name).map(|i| meas.median(i));
            let [t_fused, t_blas_coll, t_blas, t_ours_coll, t_ours, t_coll] =
                [0, 1, 2, 3, 4, 5].map(|i| meas.median(i));
            let (host_fused, host_unfused) = (meas.host_us[0], meas.host_us[1]);
            if o.common.trace {
                print_trace(&comm, stream, &format!("{label} M {m} N {nn} K {kk}"), &|buf| {
                    gemm_reduce(&comm, &GemmReduceArgs { trace: buf, ..args }, stream)
                })?;
            }
            let err = comm.async_error();
            all_ok &= err == mkResult_t::mkSuccess;
            if rank == 0 {
                let tf = 2.0 * m as f64 * nn as f64 * kk as f64 / (t_fused * 1e-6) / 1e12;
                println!(
                    "  {:>6} {:>6} {:>6} | {:>9.1} {:>7.1} | {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} | {:>7.3} {:>7.3} {:>7.3}{}",
                    m, nn, kk, t_fused, tf, t_ours_coll, t_blas_coll, t_blas, t_ours, t_coll,
                    t_fused / t_ours_coll, t_fused / t_blas_coll, t_ours.max(t_coll) / t_fused,
                    if err == mkResult_t::mkSuccess { String::new() } else { format!("  ASYNC ERROR {err:?}") }
                );
                let graph = |t: Option<f64>| t.map_or("-".to_string(), |t| format!("{t:.1}"));
                println!(
                    "  {:>22} fused p10/p90 {:.1}/{:.1} µs, cold L2 {:.1} (baseline {:.1}) µs, graph {} (baseline {}) µs/call; host enqueue µs/call: fused {host_fused:.1}, cuBLAS+coll {host_unfused:.1}; rel err {rel_err:.1e}{}",
                    "", stats[0].p10, stats[0].p90, cold_fused.median, cold_base.median,
                    graph(med("fused_graph")), graph(med("cublaslt+mk_collective_graph")), if wrong { "  WRONG" } else { "" }
                );
                if let Err(why) = &graphs {
                    println!("  {:>22} no graph replay: {why}", "");
                }
                let recorded =
                    record::fused_contenders(&names, &meas, "cublaslt+mk_collective", (cold_fused, cold_base));
                record::row(
                    record::shape(
                        &[("ranks", n), ("m", m), ("n", nn), ("k", kk)],
                        &[("op", label), ("dtype", dtype.name())],
                    ),
                    recorded,
                    &[
                        ("rel_err", Json::num(rel_err)),
                        ("wrong", Json::Bool(wrong)),
                        ("baseline", Json::str("cublaslt+mk_collective")),
                        ("fused_over_baseline", Json::num(t_fused / t_blas_coll)),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused_options::command_line as args;

    #[test]
    fn each_reduction_has_its_rows_and_both_take_the_common_options() {
        let rs = parse(Reduction::Scatter, &[]).unwrap();
        let ar = parse(Reduction::All, &[]).unwrap();
        assert_eq!(rs.ms, [1024, 4096, 16384]);
        assert_eq!(ar.ms, [1, 16, 64, 256, 2048, 8192, 16384]);
        assert_eq!((&ar.nk[..], ar.common.protocol), (&[(8192, 1024), (8192, 3584)][..], Protocol::DEFAULT));
        let o = parse(Reduction::All, &args("--m 8,16 --nk 64x128 --threads --blocks 2")).unwrap();
        assert_eq!(
            (&o.ms[..], &o.nk[..], o.common.threads, o.common.protocol.blocks),
            (&[8, 16][..], &[(64, 128)][..], true, 2)
        );
        assert!(parse(Reduction::Scatter, &args("--rows 8")).is_err(), "ag_gemm's flag");
    }
}
