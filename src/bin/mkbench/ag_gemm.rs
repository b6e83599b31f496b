//! `mkbench ag_gemm`: mkAllGatherGemm beside the unfused sequences it replaces, in the
//! same run:
//!
//!   mkbench ag_gemm [-g ranks] [--rows 128,512,2048,8192] [--nk 8192x8192,28672x8192]
//!                   [--dtype bf16|fp16] [-n iters] [-w warmup] [--trace]
//!
//! Per shape (rows per rank, N, K; M = ranks × rows): the fused op; mkAllGather then our
//! GEMM; mkAllGather then cuBLASLt; cuBLASLt alone on the gathered A; and the two parts
//! alone (mkAllGather, our GEMM) for the overlap efficiency max(t_gemm, t_comm) / t_fused.
//! Times are medians over -n calls after -w warm-up calls, each call timed with CUDA
//! events; the slowest rank's median is reported. TFLOP/s are per rank (2·M·N·K / t).
//! With -g N > 1 the ranks are processes of this binary (run under MPS on one GPU).

use crate::collectives::Events;
use crate::fused_common::{bad, common_flag, for_each_option, run_ranks, print_trace, parse_list, parse_pairs, timed_slowest};
use crate::ranks;
use cudarc::driver::result as cu;
use mkernel::comm::{Comm, CommConfig};
use mkernel::cublaslt::CublasLt;
use mkernel::cuda::{self, PrimaryContext};
use mkernel::error::Result;
use mkernel::ops::ag_gemm::{all_gather_gemm, validate_args, AgGemmArgs};
use mkernel::ops::collectives::{collective, CollectiveKind};
use mkernel::ops::gemm as engine;
use mkernel::testing::TestBuffer;
use mkernel::types::mkDataType_t;

struct Options {
    ranks: usize,
    rows: Vec<usize>,
    nk: Vec<(usize, usize)>,
    dtype: mkDataType_t,
    iters: usize,
    warmup: usize,
    trace: bool,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        ranks: ranks::nranks_requested(),
        rows: vec![128, 512, 2048, 8192],
        nk: vec![(8192, 8192), (28672, 8192)],
        dtype: mkDataType_t::mkBfloat16,
        iters: 10,
        warmup: 3,
        trace: false,
    };
    for_each_option(args, Some(&mut o.trace), |flag, v| {
        match flag {
            f if common_flag(f, v, &mut o.ranks, &mut o.iters, &mut o.warmup)? => {}
            "--rows" => o.rows = parse_list(v, "--rows")?,
            "--nk" => o.nk = parse_pairs(v, "--nk")?,
            "--dtype" => o.dtype = if v == "fp16" { mkDataType_t::mkFloat16 } else { mkDataType_t::mkBfloat16 },
            other => return Err(bad(other)),
        }
        Ok(())
    })?;
    Ok(o)
}

pub fn run(args: &[String]) -> Result<bool> {
    let o = parse(args)?;
    run_ranks("ag_gemm", args, o.ranks, &|rank, n, id, device| rank_main(&o, rank, n, id, device))
}

fn rank_main(o: &Options, rank: usize, n: usize, id: &mkernel::bootstrap::UniqueId, device: i32) -> Result<bool> {
    let ctx = PrimaryContext::retain(device)?;
    let _g = ctx.enter()?;
    let max_m = o.rows.iter().max().copied().unwrap_or(0) * n;
    let max_k = o.nk.iter().map(|x| x.1).max().unwrap_or(0);
    let max_n = o.nk.iter().map(|x| x.0).max().unwrap_or(0);
    let mut cfg = CommConfig::from_env();
    cfg.workspace_bytes = cfg.workspace_bytes.max((max_m * max_k * 2) as u64);
    let comm = Comm::init(id, n as i32, rank as i32, Some(device), cfg)?;
    let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
    let lt = CublasLt::new()?;
    let dtype = o.dtype;
    let a_local = TestBuffer::new(o.rows.iter().max().copied().unwrap_or(0) * max_k, dtype)?;
    let a_gathered = TestBuffer::new(max_m * max_k, dtype)?;
    let b = TestBuffer::new(max_n * max_k, dtype)?;
    let c = TestBuffer::new(max_m * max_n, dtype)?;
    a_local.randomize(11 + rank as u64, 1.0, stream)?;
    b.randomize(99, 1.0, stream)?;
    let events = Events::new(o.iters)?;
    let sms = cuda::sm_count(device)?;
    if rank == 0 {
        println!(
            "# mkbench ag_gemm: {n} rank(s), {}, {sms} SMs, MK_MAX_CTAS={}, warm-up {} + {} timed calls (median of the slowest rank)",
            dtype.name(),
            comm.config.max_ctas.map_or("-".into(), |v| v.to_string()),
            o.warmup,
            o.iters
        );
        println!(
            "# {:>6} {:>6} {:>6} | {:>9} {:>7} | {:>9} {:>9} {:>9} {:>9} | {:>8} {:>8} | {:>7} {:>7} {:>7}",
            "rows", "N", "K", "fused us", "TF/s", "AG+ours", "AG+cuBLAS", "cuBLAS", "ours", "AG us", "", "f/unf", "f/cuBL", "overlap"
        );
    }
    let mut all_ok = true;
    for &(nn, kk) in &o.nk {
        for &rows in &o.rows {
            let m = rows * n;
            let args = validate_args(a_local.ptr(), b.ptr(), c.ptr(), 0, m, nn, kk, dtype as i32, n, rank)?;
            let gemm_args = engine::validate(a_gathered.ptr(), b.ptr(), c.ptr(), m, nn, kk, dtype as i32)?;
            let sms_cap = comm.config.max_ctas.map_or(sms as usize, |v| v as usize);
            let gemm_plan = engine::plan(m, nn, sms_cap, gemm_args.tma_epilogue_ok(), engine::PlanOverrides { max_ctas: Some(sms_cap), ..Default::default() });
            let blas = lt.gemm(m, nn, kk, dtype, dtype)?;
            let ag = || collective(&comm, CollectiveKind::AllGather, a_local.ptr(), a_gathered.ptr(), rows * kk, dtype as i32, None, stream);
            let ours = || engine::launch(&gemm_args, &gemm_plan, stream);
            let cublas = || blas.run(&lt, a_gathered.ptr(), b.ptr(), c.ptr(), stream);
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
            let timed = |what: &str, f: &dyn Fn() -> Result<()>| timed_slowest(&comm, &events, stream, o.warmup, f).and_then(|t| phase(what, t));
            // Every part alone once first, synchronised: under lazy module loading (CUDA's
            // default) the first launch of a kernel can wait for the context to go idle, and
            // across nodes an in-flight hierarchical kernel waits for its proxy's copies, which
            // that load holds up: the first `ours()` after an in-flight mkAllGather stalled
            // until the kernel's timeout. (DESIGN-NOTES: lazy loading across nodes.)
            for (what, part) in [("ours", &ours as &dyn Fn() -> Result<()>), ("cuBLAS", &cublas), ("AllGather", &ag), ("fused", &fused)] {
                part()?;
                // SAFETY: live stream.
                unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
                phase(&format!("{what} alone (warm-up)"), 0.0)?;
            }
            comm.bootstrap.barrier()?;
            let t_fused = timed("fused", &fused)?;
            // Host time to enqueue one call (launch-bound shapes show it in the GPU time too).
            let host_us = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
                let t = std::time::Instant::now();
                for _ in 0..o.iters {
                    f()?;
                }
                let us = t.elapsed().as_secs_f64() * 1e6 / o.iters as f64;
                // SAFETY: live stream.
                unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
                comm.bootstrap.barrier()?;
                Ok(us)
            };
            let host_fused = host_us(&fused).and_then(|t| phase("fused, enqueued back to back", t))?;
            let host_unfused = host_us(&|| ag().and_then(|_| ours())).and_then(|t| phase("AllGather + ours, enqueued back to back", t))?;
            let t_ag_ours = timed("AllGather + ours", &|| ag().and_then(|_| ours()))?;
            let t_ag_blas = timed("AllGather + cuBLAS", &|| ag().and_then(|_| cublas()))?;
            let t_blas = timed("cuBLAS", &cublas)?;
            let t_ours = timed("ours", &ours)?;
            let t_ag = timed("AllGather", &ag)?;
            if o.trace {
                print_trace(&comm, stream, &format!("ag_gemm rows/rank {rows} N {nn} K {kk}"), &|buf| {
                    all_gather_gemm(&comm, &AgGemmArgs { trace: buf, ..args }, stream)
                })?;
            }
            let err = comm.async_error();
            if err != mkernel::error::mkResult_t::mkSuccess {
                all_ok = false;
            }
            if rank == 0 {
                let tf = 2.0 * m as f64 * nn as f64 * kk as f64 / (t_fused * 1e-6) / 1e12;
                println!(
                    "  {:>6} {:>6} {:>6} | {:>9.1} {:>7.1} | {:>9.1} {:>9.1} {:>9.1} {:>9.1} | {:>8.1} {:>8} | {:>7.3} {:>7.3} {:>7.3}{}",
                    rows, nn, kk, t_fused, tf, t_ag_ours, t_ag_blas, t_blas, t_ours, t_ag, "",
                    t_fused / t_ag_ours, t_fused / t_ag_blas, t_ours.max(t_ag) / t_fused,
                    if err == mkernel::error::mkResult_t::mkSuccess { String::new() } else { format!("  ASYNC ERROR {err:?}") }
                );
                println!("  {:>22} host enqueue µs/call: fused {host_fused:.1}, AG+ours {host_unfused:.1}", "");
            }
        }
    }
    // SAFETY: live stream.
    unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
    Ok(all_ok)
}
