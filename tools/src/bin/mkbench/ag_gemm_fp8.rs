//! `mkbench ag_gemm_fp8`: mkAllGatherScaledGemm (e4m3 rows with rowwise scales) beside
//! mkAllGatherGemm in bf16 at the same shapes, and beside the unfused fp8 sequence it
//! replaces, in the same run:
//!
//!   mkbench ag_gemm_fp8 [-g ranks] [--rows 128,512,2048] [--nk 8192x8192,28672x8192]
//!                       [-n iters] [-w warmup] [--blocks B] [--threads]
//!
//! Per shape (rows per rank, N, K; M = ranks × rows), in the shared protocol (measure.rs;
//! the slowest rank per call; median, p10, p90):
//!   fused_fp8       mkAllGatherScaledGemm, rowwise scales (torch's async-TP fp8 recipe)
//!   fused_bf16      mkAllGatherGemm on bf16 A and B of the same shape
//!   ag_fp8+scaled   mkAllGather of the e4m3 rows and of their scales, then mkScaledGemm
//!   scaled          mkScaledGemm alone on the gathered A (the overlap ceiling)
//! and the bytes each rank pushes per call, fp8 (rows and scales) and bf16, from the plans
//! (ops::dense::ag_scaled_gemm::pushed_bytes). The fused fp8 output is checked once per
//! shape against the unfused one (#wrong = 1 when the relative error exceeds bf16's band).
//! TFLOP/s are per rank (2·M·N·K / t).

use crate::fused_common::{bad, measure_slowest, run_ranks, sync_stream, Timed};
use crate::fused_options::{parse_list, parse_pairs, FusedDefaults, FusedOptions};
use crate::measure::{Progress, Protocol};
use crate::record::{self, Json};
use crate::timing::Events;
use cudarc::driver::result as cu;
use mkernel::comm::CommConfig;
use mkernel::cuda::{self, PrimaryContext};
use mkernel::error::Result;
use mkernel::ops::collectives::{collective, CollectiveKind};
use mkernel::ops::dense::ag_gemm;
use mkernel::ops::dense::ag_scaled_gemm::{self, AgScaledGemmCall, GatheredLayout};
use mkernel::ops::gemm::scaled;
use mkernel::types::{mkDataType_t, mkScaleMode_t, RawScaleMode};
use mkernel_tools::testing::fp8::{f32_to_e4m3, E4M3_MAX};
use mkernel_tools::testing::{relative_error, tolerance, xorshift_unit, TestBuffer};

struct Options {
    common: FusedOptions,
    rows: Vec<usize>,
    nk: Vec<(usize, usize)>,
}

/// Parses the options without touching a GPU.
pub fn check(_op: &str, args: &[String]) -> Result<()> {
    parse(args).map(|_| ())
}

fn parse(args: &[String]) -> Result<Options> {
    let mut rows = vec![128, 512, 2048];
    let mut nk = vec![(8192, 8192), (28672, 8192)];
    let defaults = FusedDefaults { warmup: Protocol::DEFAULT.warmup, takes_trace: false };
    let common = FusedOptions::parse(args, defaults, |flag, v| {
        match flag {
            "--rows" => rows = parse_list(v, "--rows")?,
            "--nk" => nk = parse_pairs(v, "--nk")?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    if let Some(&(_, k)) = nk.iter().find(|&&(_, k)| k % 16 != 0) {
        return Err(bad(&format!("--nk: K = {k} must be a multiple of 16 for e4m3 rows")));
    }
    Ok(Options { common, rows, nk })
}

pub fn run(args: &[String]) -> Result<bool> {
    let o = parse(args)?;
    run_ranks("ag_gemm_fp8", args, o.common.ranks, o.common.threads, &|rank, n, id, device| {
        rank_main(&o, rank, n, id, device)
    })
}

/// A buffer of `count` e4m3 values from uniform [-448, 448) (scaled so the rowwise scales
/// below stay in a realistic range).
fn e4m3_buffer(count: usize, seed: u64) -> Result<TestBuffer> {
    let buf = TestBuffer::new(count, mkDataType_t::mkFloat8e4m3)?;
    let bytes: Vec<u8> = xorshift_unit(seed, count).map(|u| f32_to_e4m3(((2.0 * u - 1.0) as f32) * E4M3_MAX)).collect();
    buf.upload(&bytes)?;
    Ok(buf)
}

/// `count` fp32 scales of about 1/448 (a row of unit amax quantized to e4m3's range).
fn scale_buffer(count: usize, seed: u64) -> Result<TestBuffer> {
    let buf = TestBuffer::new(count, mkDataType_t::mkFloat32)?;
    let bytes: Vec<u8> =
        xorshift_unit(seed, count).flat_map(|u| (((0.5 + u) as f32) / E4M3_MAX).to_le_bytes()).collect();
    buf.upload(&bytes)?;
    Ok(buf)
}

fn rank_main(o: &Options, rank: usize, n: usize, id: &mkernel::bootstrap::UniqueId, device: i32) -> Result<bool> {
    let ctx = PrimaryContext::retain(device)?;
    let _g = ctx.enter()?;
    let max_rows = o.rows.iter().max().copied().unwrap_or(0);
    let max_m = max_rows * n;
    let max_k = o.nk.iter().map(|x| x.1).max().unwrap_or(0);
    let max_n = o.nk.iter().map(|x| x.0).max().unwrap_or(0);
    let mut cfg = CommConfig::from_env();
    // bf16's gathered A is the larger of the two ops' needs.
    cfg.workspace_bytes = cfg.workspace_bytes.max((max_m * max_k * 2) as u64);
    let comm = crate::fused_common::init_comm(id, n, rank, device, cfg)?;
    let stream =
        cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
    let bf16 = mkDataType_t::mkBfloat16;
    let a_fp8 = e4m3_buffer(max_rows * max_k, 11 + rank as u64)?;
    let sa_fp8 = scale_buffer(max_rows, 21 + rank as u64)?;
    let b_fp8 = e4m3_buffer(max_n * max_k, 99)?;
    let sb_fp8 = scale_buffer(max_n, 98)?;
    let a_gathered = TestBuffer::new(max_m * max_k, mkDataType_t::mkFloat8e4m3)?;
    let sa_gathered = TestBuffer::new(max_m, mkDataType_t::mkFloat32)?;
    let a_bf16 = TestBuffer::new(max_rows * max_k, bf16)?;
    let b_bf16 = TestBuffer::new(max_n * max_k, bf16)?;
    let c = TestBuffer::new(max_m * max_n, bf16)?;
    let c_ref = TestBuffer::new(max_m * max_n, bf16)?;
    a_bf16.randomize(31 + rank as u64, 1.0, stream)?;
    b_bf16.randomize(97, 1.0, stream)?;
    let protocol = o.common.protocol;
    let events = Events::new(protocol.iters)?;
    let sms = cuda::sm_count(device)?;
    let sms_cap = comm.config.max_ctas.map_or(sms as usize, |v| v as usize);
    let rowwise = mkScaleMode_t::mkScaleRowwise;
    if rank == 0 {
        println!(
            "# mkbench ag_gemm_fp8: {n} rank(s), e4m3 rowwise -> bf16 beside bf16, {sms} SMs, MK_MAX_CTAS={}, warm-up {} then {} interleaved blocks of {} calls (median of the slowest rank per call)",
            comm.config.max_ctas.map_or("-".into(), |v| v.to_string()),
            protocol.warmup,
            protocol.blocks,
            protocol.iters
        );
        println!(
            "# {:>6} {:>6} {:>6} | {:>9} {:>7} | {:>9} {:>9} {:>9} | {:>11} {:>11} {:>6} | {:>8} {:>6}",
            "rows",
            "N",
            "K",
            "fp8 us",
            "TF/s",
            "bf16 us",
            "unfused",
            "scaled",
            "fp8 bytes",
            "bf16 bytes",
            "ratio",
            "fp8/bf16",
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
            let call = AgScaledGemmCall {
                a: a_fp8.ptr(),
                scale_a: sa_fp8.ptr(),
                b: b_fp8.ptr(),
                scale_b: sb_fp8.ptr(),
                c: c.ptr(),
                m,
                n: nn,
                k: kk,
            };
            let e4m3 = mkDataType_t::mkFloat8e4m3 as i32;
            let fp8_args = ag_scaled_gemm::validate_args(&call, e4m3, bf16 as i32, rowwise as RawScaleMode, n, rank)?;
            let bf16_args =
                ag_gemm::validate_args(a_bf16.ptr(), b_bf16.ptr(), c.ptr(), 0, m, nn, kk, bf16 as i32, n, rank)?;
            let unfused_args = scaled::validate(
                "mkScaledGemm",
                a_gathered.ptr(),
                sa_gathered.ptr(),
                b_fp8.ptr(),
                sb_fp8.ptr(),
                c_ref.ptr(),
                m,
                nn,
                kk,
                e4m3,
                e4m3,
                bf16 as i32,
                rowwise as RawScaleMode,
            )?;
            let scaled_plan = scaled::plan(m, nn, sms_cap, unfused_args.tma_epilogue_ok());
            let fused_fp8 = || ag_scaled_gemm::all_gather_scaled_gemm(&comm, &fp8_args, stream);
            let fused_bf16 = || ag_gemm::all_gather_gemm(&comm, &bf16_args, stream);
            let gather = |src: u64, dst: u64, count: usize, dtype: mkDataType_t| {
                collective(&comm, CollectiveKind::AllGather, src, dst, count, dtype as i32, None, stream)
            };
            let scaled_alone = || scaled::launch(&unfused_args, &scaled_plan, stream);
            let unfused = || {
                gather(a_fp8.ptr(), a_gathered.ptr(), rows * kk, mkDataType_t::mkFloat8e4m3)?;
                gather(sa_fp8.ptr(), sa_gathered.ptr(), rows, mkDataType_t::mkFloat32)?;
                scaled_alone()
            };
            // Each part once, synchronised (lazy module loading), then the check: the fused
            // output against the unfused sequence's.
            for part in [&fused_fp8 as &dyn Fn() -> Result<()>, &fused_bf16, &unfused] {
                part()?;
                sync_stream(stream)?;
            }
            c.poison(stream)?;
            c_ref.poison(stream)?;
            comm.bootstrap.barrier()?;
            unfused()?;
            fused_fp8()?;
            sync_stream(stream)?;
            let (out, reference) = (c.download_f64()?, c_ref.download_f64()?);
            let rel_err = relative_error(&out[..m * nn], &reference[..m * nn]);
            #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN error counts as wrong
            let wrong = !(rel_err <= tolerance(bf16));
            all_ok &= !wrong;
            comm.bootstrap.barrier()?;
            let names = ["fused_fp8", "fused_bf16", "ag_fp8+scaled", "scaled"];
            let timed = [
                Timed::Calls(&fused_fp8),
                Timed::Calls(&fused_bf16),
                Timed::Calls(&unfused),
                Timed::Calls(&scaled_alone),
            ];
            let meas = measure_slowest(&comm, &events, stream, protocol, &timed)?;
            let err = comm.async_error();
            if err != mkernel::error::mkResult_t::mkSuccess {
                all_ok = false;
            }
            if rank == 0 {
                let t = |i: usize| meas.stats[i].median;
                let fp8_bytes = ag_scaled_gemm::pushed_bytes(rows, kk, rowwise, n);
                let bf16_bytes = ag_scaled_gemm::pushed_bytes_16bit(rows, kk, n);
                let ratio = if bf16_bytes > 0 { fp8_bytes as f64 / bf16_bytes as f64 } else { f64::NAN };
                let tf = 2.0 * m as f64 * nn as f64 * kk as f64 / (t(0) * 1e-6) / 1e12;
                println!(
                    "  {:>6} {:>6} {:>6} | {:>9.1} {:>7.1} | {:>9.1} {:>9.1} {:>9.1} | {:>11} {:>11} {:>6.3} | {:>8.3} {:>6}{}",
                    rows, nn, kk, t(0), tf, t(1), t(2), t(3), fp8_bytes, bf16_bytes, ratio, t(0) / t(1), u8::from(wrong),
                    if err == mkernel::error::mkResult_t::mkSuccess { String::new() } else { format!("  ASYNC ERROR {err:?}") }
                );
                let layout = GatheredLayout::new(m, kk, rowwise);
                record::row(
                    record::shape(
                        &[("ranks", n), ("rows", rows), ("m", m), ("n", nn), ("k", kk)],
                        &[("ab", "float8e4m3"), ("c", bf16.name()), ("scales", "rowwise")],
                    ),
                    record::measured_contenders(&names, &meas),
                    &[
                        ("rel_err", Json::num(rel_err)),
                        ("wrong", Json::Bool(wrong)),
                        ("pushed_bytes_fp8", Json::num(fp8_bytes as f64)),
                        ("pushed_bytes_bf16", Json::num(bf16_bytes as f64)),
                        ("workspace_bytes_fp8", Json::num(layout.region_bytes() as f64)),
                        ("fp8_over_bf16", Json::num(t(0) / t(1))),
                        ("fused_over_unfused", Json::num(t(0) / t(2))),
                    ],
                );
            }
        }
    }
    sync_stream(stream)?;
    Ok(all_ok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused_options::command_line as args;

    #[test]
    fn shapes_parse_beside_the_common_options() {
        let d = parse(&[]).unwrap();
        assert_eq!((&d.rows[..], &d.nk[..]), (&[128, 512, 2048][..], &[(8192, 8192), (28672, 8192)][..]));
        let o = parse(&args("--rows 64 --nk 16x32 -w 1")).unwrap();
        assert_eq!((&o.rows[..], &o.nk[..], o.common.protocol.warmup), (&[64][..], &[(16, 32)][..], 1));
        assert!(parse(&args("--nk 16x24")).err().is_some_and(|e| e.message.contains("multiple of 16")));
    }
}
