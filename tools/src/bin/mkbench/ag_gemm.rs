//! `mkbench ag_gemm`: mkAllGatherGemm beside the unfused sequences it replaces, in the
//! same run:
//!
//!   mkbench ag_gemm [-g ranks] [--rows 128,512,2048,8192] [--nk 8192x8192,28672x8192]
//!                   [--dtype bf16|fp16] [-n iters] [-w warmup] [--trace] [--threads]
//!
//! Per shape (rows per rank, N, K; M = ranks × rows), each contender in the shared
//! protocol (measure.rs: interleaved blocks, -w warm-up, --blocks blocks of -n calls, the
//! slowest rank per call; median, p10, p90):
//!   fused          mkAllGatherGemm
//!   AG+cuBLAS      mkAllGather, then cuBLASLt on all the SMs (the fair unfused baseline)
//!   CE+cuBLAS      the copy-engine AllGather (copy_engine.rs, a lower bound), then cuBLASLt
//!   cuBLAS         cuBLASLt alone on the gathered A: the overlap ceiling
//!   AG+ours(cap)   mkAllGather, then our GEMM capped to MK_MAX_CTAS (extra column)
//!   ours(cap), AG, CE   the parts alone, for overlap = max(t_gemm, t_comm) / t_fused
//!   graphs         CUDA-graph replays of GRAPH_CALLS captured calls of the fused op and of
//!                  AG+cuBLAS (time per call, the host's launches out of the way)
//! The fused output is checked once per shape against AG+cuBLAS (#wrong = 1 when the
//! relative error exceeds the dtype's band). Every contender records the host's enqueue µs
//! per call. TFLOP/s are per rank (2·M·N·K / t). With -g N > 1 the ranks are processes of
//! this binary (run under MPS on one GPU).

use crate::copy_engine::PeerShards;
use crate::fused_common::{
    bad, capture_everywhere, measure_cold_slowest, measure_slowest, print_trace, run_ranks, L2Flush, Timed,
};
use crate::fused_options::{parse_half_dtype, parse_list, parse_pairs, FusedDefaults, FusedOptions};
use crate::measure::{Progress, Protocol, GRAPH_CALLS};
use crate::record::{self, Json};
use crate::timing::Events;
use cudarc::driver::result as cu;
use mkernel::comm::CommConfig;
use mkernel::cuda::{self, PrimaryContext};
use mkernel::error::Result;
use mkernel::ops::collectives::{collective, CollectiveKind};
use mkernel::ops::dense::ag_gemm::{all_gather_gemm, validate_args, AgGemmArgs};
use mkernel::ops::gemm::{engine, op as gemm_op};
use mkernel::types::mkDataType_t;
use mkernel_tools::cublaslt::CublasLt;
use mkernel_tools::testing::{relative_error, tolerance, TestBuffer};

struct Options {
    common: FusedOptions,
    rows: Vec<usize>,
    nk: Vec<(usize, usize)>,
    dtype: mkDataType_t,
}

/// Parses the options without touching a GPU.
pub fn check(_op: &str, args: &[String]) -> Result<()> {
    parse(args).map(|_| ())
}

fn parse(args: &[String]) -> Result<Options> {
    let mut rows = vec![128, 512, 2048, 8192];
    let mut nk = vec![(8192, 8192), (28672, 8192)];
    let mut dtype = mkDataType_t::mkBfloat16;
    let defaults = FusedDefaults { warmup: Protocol::DEFAULT.warmup, takes_trace: true };
    let common = FusedOptions::parse(args, defaults, |flag, v| {
        match flag {
            "--rows" => rows = parse_list(v, "--rows")?,
            "--nk" => nk = parse_pairs(v, "--nk")?,
            "--dtype" => dtype = parse_half_dtype(v)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(Options { common, rows, nk, dtype })
}

pub fn run(args: &[String]) -> Result<bool> {
    let o = parse(args)?;
    run_ranks("ag_gemm", args, o.common.ranks, o.common.threads, &|rank, n, id, device| {
        rank_main(&o, rank, n, id, device)
    })
}

fn rank_main(o: &Options, rank: usize, n: usize, id: &mkernel::bootstrap::UniqueId, device: i32) -> Result<bool> {
    let ctx = PrimaryContext::retain(device)?;
    let _g = ctx.enter()?;
    let max_m = o.rows.iter().max().copied().unwrap_or(0) * n;
    let max_k = o.nk.iter().map(|x| x.1).max().unwrap_or(0);
    let max_n = o.nk.iter().map(|x| x.0).max().unwrap_or(0);
    let mut cfg = CommConfig::from_env();
    cfg.workspace_bytes = cfg.workspace_bytes.max((max_m * max_k * 2) as u64);
    let comm = crate::fused_common::init_comm(id, n, rank, device, cfg)?;
    let stream =
        cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
    let lt = CublasLt::new()?;
    let dtype = o.dtype;
    let a_local = TestBuffer::new(o.rows.iter().max().copied().unwrap_or(0) * max_k, dtype)?;
    let a_gathered = TestBuffer::new(max_m * max_k, dtype)?;
    let b = TestBuffer::new(max_n * max_k, dtype)?;
    let c = TestBuffer::new(max_m * max_n, dtype)?;
    let c_ref = TestBuffer::new(max_m * max_n, dtype)?;
    let max_rows = o.rows.iter().max().copied().unwrap_or(0);
    let elem = if dtype == mkDataType_t::mkFloat32 { 4 } else { 2 };
    // The copy-engine baseline's shard buffers, sized for the largest shard; absent (with
    // the reason printed) where CUDA IPC is not available.
    let shards = if n > 1 {
        PeerShards::new(&comm.bootstrap, rank, n, max_rows * max_k * elem).map_err(|e| e.message)
    } else {
        Err("one rank".into())
    };
    let protocol = o.common.protocol;
    let l2_flush = L2Flush::new()?;
    a_local.randomize(11 + rank as u64, 1.0, stream)?;
    b.randomize(99, 1.0, stream)?;
    let events = Events::new(protocol.iters)?;
    let sms = cuda::sm_count(device)?;
    if rank == 0 {
        println!(
            "# mkbench ag_gemm: {n} rank(s), {}, {sms} SMs, MK_MAX_CTAS={} (our GEMM's cap; cuBLAS uncapped), warm-up {} then {} interleaved blocks of {} calls (median of the slowest rank per call)",
            dtype.name(),
            comm.config.max_ctas.map_or("-".into(), |v| v.to_string()),
            protocol.warmup,
            protocol.blocks,
            protocol.iters
        );
        if let Err(why) = &shards {
            println!("# copy-engine AllGather baseline: absent ({why})");
        }
        println!(
            "# {:>6} {:>6} {:>6} | {:>9} {:>7} | {:>9} {:>9} {:>9} | {:>9} {:>9} {:>8} {:>8} | {:>7} {:>7} {:>6}",
            "rows",
            "N",
            "K",
            "fused us",
            "TF/s",
            "AG+cuBLAS",
            "CE+cuBLAS",
            "cuBLAS",
            "AG+ours*",
            "ours*",
            "AG us",
            "CE us",
            "f/unf",
            "overlap",
            "#wrong"
        );
    }
    let mut all_ok = true;
    let mut progress = (rank == 0).then(|| Progress::new(o.nk.len() * o.rows.len()));
    for &(nn, kk) in &o.nk {
        for &rows in &o.rows {
            if let Some(p) = progress.as_mut() {
                p.step(&format!("rows/rank {rows} N {nn} K {kk}"));
            }
            let m = rows * n;
            let args = validate_args(a_local.ptr(), b.ptr(), c.ptr(), 0, m, nn, kk, dtype as i32, n, rank)?;
            let gemm_args = gemm_op::validate(a_gathered.ptr(), b.ptr(), c.ptr(), m, nn, kk, dtype as i32)?;
            let sms_cap = comm.config.max_ctas.map_or(sms as usize, |v| v as usize);
            let gemm_plan = engine::plan(
                m,
                nn,
                kk,
                sms_cap,
                gemm_args.tma_epilogue_ok(),
                engine::PlanOverrides { max_ctas: Some(sms_cap), ..Default::default() },
            );
            let blas = lt.gemm(m, nn, kk, dtype, dtype)?;
            let ag = || {
                collective(
                    &comm,
                    CollectiveKind::AllGather,
                    a_local.ptr(),
                    a_gathered.ptr(),
                    rows * kk,
                    dtype as i32,
                    None,
                    stream,
                )
            };
            let ours = || gemm_op::launch(&gemm_args, &gemm_plan, stream);
            let cublas = || blas.run(&lt, a_gathered.ptr(), b.ptr(), c_ref.ptr(), stream);
            let cublas_ref = &cublas;
            let fused = || all_gather_gemm(&comm, &args, stream);
            // Which part failed, with the kernel's error word decoded (op, peer, what it awaited).
            let phase = |what: &str, t: f64| -> Result<f64> {
                let code = comm.async_error();
                if code == mkernel::error::mkResult_t::mkSuccess {
                    return Ok(t);
                }
                // SAFETY: the comm's NUL-terminated last-error string, alive while comm is.
                let msg = unsafe { std::ffi::CStr::from_ptr(comm.last_error_ptr()) }.to_string_lossy().into_owned();
                Err(mkernel::error::MkError::new(code, format!("rows/rank {rows} N {nn} K {kk}, {what}: {msg}")))
            };
            // Every part alone once first, synchronised: under lazy module loading (CUDA's
            // default) the first launch of a kernel can wait for the context to go idle, and
            // across nodes an in-flight hierarchical kernel waits for its proxy's copies, which
            // that load holds up: the first `ours()` after an in-flight mkAllGather stalls
            // until the kernel's timeout. (docs/decisions/0030-preload-kernels-across-nodes.md)
            for (what, part) in
                [("ours", &ours as &dyn Fn() -> Result<()>), ("cuBLAS", &cublas), ("AllGather", &ag), ("fused", &fused)]
            {
                part()?;
                // SAFETY: live stream.
                unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
                phase(&format!("{what} alone (warm-up)"), 0.0)?;
            }
            // The fused output against the unfused one (AllGather then cuBLAS), once per shape.
            c.poison(stream)?;
            c_ref.poison(stream)?;
            comm.bootstrap.barrier()?;
            ag()?;
            cublas_ref()?;
            fused()?;
            // SAFETY: live stream.
            unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
            phase("verification", 0.0)?;
            let (out, reference) = (c.download_f64()?, c_ref.download_f64()?);
            let rel_err = relative_error(&out[..m * nn], &reference[..m * nn]);
            #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN error counts as wrong
            let wrong = !(rel_err <= tolerance(dtype));
            all_ok &= !wrong;
            if let Ok(sh) = &shards {
                sh.stage(a_local.ptr(), rows * kk * elem, stream)?;
            }
            comm.bootstrap.barrier()?;
            let ce = || {
                shards
                    .as_ref()
                    .map_err(|why| bad(why))
                    .and_then(|sh| sh.all_gather(a_gathered.ptr(), rows * kk * elem, stream))
            };
            let ag_blas = || ag().and_then(|_| cublas());
            let ag_ours = || ag().and_then(|_| ours());
            let mut contenders: Vec<(&str, Timed)> = vec![
                ("fused", Timed::Calls(&fused)),
                ("ag_mk+cublaslt", Timed::Calls(&ag_blas)),
                ("cublaslt", Timed::Calls(&cublas)),
                ("ag_mk+ours_capped", Timed::Calls(&ag_ours)),
                ("ours_capped", Timed::Calls(&ours)),
                ("ag_mk", Timed::Calls(&ag)),
            ];
            let ce_blas = || ce().and_then(|_| cublas());
            if shards.is_ok() {
                contenders.push(("ag_copy_engine+cublaslt", Timed::Calls(&ce_blas)));
                contenders.push(("ag_copy_engine", Timed::Calls(&ce)));
            }
            let graphs = capture_everywhere(&comm, stream, GRAPH_CALLS, &[&fused, &ag_blas])?;
            if let Ok(g) = &graphs {
                contenders.push(("fused_graph", Timed::Graph(&g[0])));
                contenders.push(("ag_mk+cublaslt_graph", Timed::Graph(&g[1])));
            }
            let (names, timed): (Vec<&str>, Vec<Timed>) = contenders.into_iter().unzip();
            let meas = measure_slowest(&comm, &events, stream, protocol, &timed)
                .and_then(|s| phase("timed blocks", 0.0).map(|_| s))?;
            let stats = &meas.stats;
            let cold_fused = measure_cold_slowest(&comm, &events, stream, protocol, &l2_flush, &fused)?;
            let cold_base = measure_cold_slowest(&comm, &events, stream, protocol, &l2_flush, &ag_blas)?;
            let (host_fused, host_unfused) = (meas.host_us[0], meas.host_us[1]);
            let med = |name: &str| names.iter().position(|n| *n == name).map(|i| meas.median(i));
            if o.common.trace {
                print_trace(&comm, stream, &format!("ag_gemm rows/rank {rows} N {nn} K {kk}"), &|buf| {
                    all_gather_gemm(&comm, &AgGemmArgs { trace: buf, ..args }, stream)
                })?;
            }
            let err = comm.async_error();
            if err != mkernel::error::mkResult_t::mkSuccess {
                all_ok = false;
            }
            if rank == 0 {
                let t_fused = stats[0].median;
                let (t_ag_blas, t_blas, t_ag_ours, t_ours, t_ag) =
                    (stats[1].median, stats[2].median, stats[3].median, stats[4].median, stats[5].median);
                let t_ce_blas = med("ag_copy_engine+cublaslt");
                let t_ce = med("ag_copy_engine");
                let best_unfused = t_ce_blas.map_or(t_ag_blas, |t| t.min(t_ag_blas));
                let opt = |t: Option<f64>| t.map_or("-".to_string(), |t| format!("{t:.1}"));
                let tf = 2.0 * m as f64 * nn as f64 * kk as f64 / (t_fused * 1e-6) / 1e12;
                println!(
                    "  {:>6} {:>6} {:>6} | {:>9.1} {:>7.1} | {:>9.1} {:>9} {:>9.1} | {:>9.1} {:>9.1} {:>8.1} {:>8} | {:>7.3} {:>7.3} {:>6}{}",
                    rows, nn, kk, t_fused, tf, t_ag_blas, opt(t_ce_blas), t_blas, t_ag_ours, t_ours, t_ag, opt(t_ce),
                    t_fused / best_unfused, t_blas.max(t_ag.min(t_ce.unwrap_or(f64::INFINITY))) / t_fused, u8::from(wrong),
                    if err == mkernel::error::mkResult_t::mkSuccess { String::new() } else { format!("  ASYNC ERROR {err:?}") }
                );
                println!(
                    "  {:>22} fused p10/p90 {:.1}/{:.1} µs, cold L2 {:.1} (baseline {:.1}) µs, graph {} (baseline {}) µs/call; host enqueue µs/call: fused {host_fused:.1}, AG+cuBLAS {host_unfused:.1}; rel err {rel_err:.1e}",
                    "", stats[0].p10, stats[0].p90, cold_fused.median, cold_base.median,
                    opt(med("fused_graph")), opt(med("ag_mk+cublaslt_graph"))
                );
                if let Err(why) = &graphs {
                    println!("  {:>22} no graph replay: {why}", "");
                }
                let recorded = record::fused_contenders(&names, &meas, "ag_mk+cublaslt", (cold_fused, cold_base));
                record::row(
                    record::shape(
                        &[("ranks", n), ("rows", rows), ("m", m), ("n", nn), ("k", kk)],
                        &[("dtype", dtype.name())],
                    ),
                    recorded,
                    &[
                        ("rel_err", Json::num(rel_err)),
                        ("wrong", Json::Bool(wrong)),
                        ("baseline", Json::str("best of ag_mk+cublaslt and ag_copy_engine+cublaslt")),
                        ("fused_over_baseline", Json::num(t_fused / best_unfused)),
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
    fn shapes_and_dtype_parse_beside_the_common_options() {
        let d = parse(&[]).unwrap();
        assert_eq!(
            (&d.rows[..], &d.nk[..], d.dtype),
            (&[128, 512, 2048, 8192][..], &[(8192, 8192), (28672, 8192)][..], mkDataType_t::mkBfloat16)
        );
        assert_eq!((d.common.protocol, d.common.trace), (Protocol::DEFAULT, false));
        let o = parse(&args("--rows 64 --nk 16x32 --dtype fp16 --trace -w 1")).unwrap();
        assert_eq!((&o.rows[..], &o.nk[..], o.dtype), (&[64][..], &[(16, 32)][..], mkDataType_t::mkFloat16));
        assert_eq!((o.common.trace, o.common.protocol.warmup), (true, 1));
        assert!(parse(&args("--dtype fp8")).err().is_some_and(|e| e.message.contains("--dtype (bf16 or fp16)")));
    }
}
