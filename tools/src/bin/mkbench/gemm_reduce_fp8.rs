//! `mkbench gemm_rs_fp8` and `mkbench gemm_ar_fp8`: mkScaledGemmReduceScatter /
//! mkScaledGemmAllReduce (e4m3 A and B with rowwise scales, bf16 C) beside the bf16 fused op
//! of the same shape and the unfused fp8 sequence they replace, in the same run:
//!
//!   mkbench gemm_rs_fp8 [-g ranks] [--m 1024,4096,16384] [--nk 8192x1024,8192x3584] [-n iters] [-w warmup] [--blocks B] [--threads]
//!   mkbench gemm_ar_fp8 [-g ranks] [--m 1,64,256,2048,8192] [--nk ...]
//!
//! Per shape (M, N, K per rank), in the shared protocol (measure.rs; the slowest rank per
//! call; median, p10, p90):
//!   fused_fp8      the fp8 fused op, rowwise scales (torch's async-TP fp8 recipe)
//!   fused_bf16     mkGemmReduceScatter / mkGemmAllReduce on bf16 A and B of the same shape
//!   scaled+coll    mkScaledGemm into a bf16 partial, then mkReduceScatter / mkAllReduce (sum)
//!   scaled         mkScaledGemm alone (the overlap ceiling)
//! The fused fp8 output is checked once per shape against the unfused one (#wrong = 1 when
//! the relative error exceeds bf16's band). TFLOP/s are per rank (2·M·N·K / t).

use crate::fused_common::{bad, measure_slowest, run_ranks, sync_stream, Timed};
use crate::gemm_reduce::Options;
use crate::measure::Progress;
use crate::record::{self, Json};
use crate::timing::Events;
use cudarc::driver::result as cu;
use mkernel::comm::CommConfig;
use mkernel::cuda::{self, PrimaryContext};
use mkernel::error::{mkResult_t, Result};
use mkernel::ops::collectives::{collective, CollectiveKind};
use mkernel::ops::dense::gemm_reduce::{self, Reduction};
use mkernel::ops::dense::gemm_reduce_scaled::{self, ScaledGemmReduceCall};
use mkernel::ops::gemm::scaled;
use mkernel::types::{mkDataType_t, mkRedOp_t, mkScaleMode_t, RawScaleMode};
use mkernel_tools::testing::fp8::{f32_to_e4m3, E4M3_MAX};
use mkernel_tools::testing::{relative_error, tolerance, xorshift_unit, TestBuffer};

/// Parses the options without touching a GPU (`op` is gemm_rs_fp8 or gemm_ar_fp8).
pub fn check(op: &str, args: &[String]) -> Result<()> {
    let reduction = if op == "gemm_ar_fp8" { Reduction::All } else { Reduction::Scatter };
    parse(reduction, args).map(|_| ())
}

fn parse(reduction: Reduction, args: &[String]) -> Result<Options> {
    let ms = match reduction {
        Reduction::Scatter => vec![1024, 4096, 16384],
        Reduction::All => vec![1, 64, 256, 2048, 8192],
    };
    let o = Options::parse(args, ms, false)?;
    if let Some(&(nn, k)) = o.nk.iter().find(|&&(nn, k)| k % 16 != 0 || nn % 8 != 0) {
        return Err(bad(&format!("--nk: {nn}x{k}: N must be a multiple of 8 and K of 16 for e4m3 operands")));
    }
    Ok(o)
}

pub fn gemm_rs_fp8(args: &[String]) -> Result<bool> {
    run(Reduction::Scatter, "gemm_rs_fp8", args)
}

pub fn gemm_ar_fp8(args: &[String]) -> Result<bool> {
    run(Reduction::All, "gemm_ar_fp8", args)
}

fn run(reduction: Reduction, name: &str, args: &[String]) -> Result<bool> {
    let o = parse(reduction, args)?;
    run_ranks(name, args, o.common.ranks, o.common.threads, &|rank, n, id, device| {
        rank_main(reduction, &o, rank, n, id, device)
    })
}

/// A buffer of `count` e4m3 values from uniform [-448, 448).
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
    let bf16 = mkDataType_t::mkBfloat16;
    let e4m3 = mkDataType_t::mkFloat8e4m3;
    let rowwise = mkScaleMode_t::mkScaleRowwise;
    let max_m = o.ms.iter().copied().max().unwrap_or(1).next_multiple_of(n);
    let max_n = o.nk.iter().map(|x| x.0).max().unwrap_or(8);
    let max_k = o.nk.iter().map(|x| x.1).max().unwrap_or(16);
    let mut cfg = CommConfig::from_env();
    // P and, for the two-phase AllReduce, R: M·N bf16 each, for either op.
    cfg.workspace_bytes = cfg.workspace_bytes.max((max_m * max_n * 2 * 2) as u64);
    let comm = crate::fused_common::init_comm(id, n, rank, device, cfg)?;
    let stream =
        cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
    let a_fp8 = e4m3_buffer(max_m * max_k, 11 + rank as u64)?;
    let sa_fp8 = scale_buffer(max_m, 21 + rank as u64)?;
    let b_fp8 = e4m3_buffer(max_n * max_k, 31 + rank as u64)?;
    let sb_fp8 = scale_buffer(max_n, 41 + rank as u64)?;
    let a_bf16 = TestBuffer::new(max_m * max_k, bf16)?;
    let b_bf16 = TestBuffer::new(max_n * max_k, bf16)?;
    a_bf16.randomize(51 + rank as u64, 1.0, stream)?;
    b_bf16.randomize(61 + rank as u64, 1.0, stream)?;
    let partial = TestBuffer::new(max_m * max_n, bf16)?;
    let out = TestBuffer::new(max_m * max_n, bf16)?;
    let out_ref = TestBuffer::new(max_m * max_n, bf16)?;
    let protocol = o.common.protocol;
    let events = Events::new(protocol.iters)?;
    let sms = cuda::sm_count(device)? as usize;
    let cap = comm.config.max_ctas.map_or(sms, |v| v as usize);
    let (label, kind) = match reduction {
        Reduction::Scatter => ("fp8 GEMM+ReduceScatter", CollectiveKind::ReduceScatter),
        Reduction::All => ("fp8 GEMM+AllReduce", CollectiveKind::AllReduce),
    };
    if rank == 0 {
        println!(
            "# mkbench {label}: {n} rank(s), e4m3 rowwise -> bf16 beside bf16, {sms} SMs, MK_MAX_CTAS={}, warm-up {} then {} interleaved blocks of {} calls (median of the slowest rank per call)",
            comm.config.max_ctas.map_or("-".into(), |v| v.to_string()),
            protocol.warmup,
            protocol.blocks,
            protocol.iters
        );
        println!(
            "# {:>6} {:>6} {:>6} | {:>9} {:>7} | {:>9} {:>11} {:>9} | {:>8} {:>8} {:>6}",
            "M", "N", "K", "fp8 us", "TF/s", "bf16 us", "scaled+coll", "scaled", "fp8/bf16", "f/unf", "#wrong"
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
            let call = ScaledGemmReduceCall {
                a: a_fp8.ptr(),
                scale_a: sa_fp8.ptr(),
                b: b_fp8.ptr(),
                scale_b: sb_fp8.ptr(),
                c: out.ptr(),
                m,
                n: nn,
                k: kk,
            };
            let fp8_args = gemm_reduce_scaled::validate_args(
                reduction,
                &call,
                e4m3 as i32,
                bf16 as i32,
                rowwise as RawScaleMode,
                n,
                rank,
            )?;
            let bf16_args =
                gemm_reduce::validate(reduction, a_bf16.ptr(), b_bf16.ptr(), out.ptr(), m, nn, kk, bf16 as i32, n)?;
            let scaled_args = scaled::validate(
                "mkScaledGemm",
                a_fp8.ptr(),
                sa_fp8.ptr(),
                b_fp8.ptr(),
                sb_fp8.ptr(),
                partial.ptr(),
                m,
                nn,
                kk,
                e4m3 as i32,
                e4m3 as i32,
                bf16 as i32,
                rowwise as RawScaleMode,
            )?;
            let scaled_plan = scaled::plan(m, nn, cap, scaled_args.tma_epilogue_ok());
            let count = if reduction == Reduction::Scatter { m / n * nn } else { m * nn };
            let coll_into = |dst: u64| {
                collective(&comm, kind, partial.ptr(), dst, count, bf16 as i32, Some(mkRedOp_t::mkSum as i32), stream)
            };
            let fused_fp8 = || gemm_reduce_scaled::scaled_gemm_reduce(&comm, &fp8_args, stream);
            let fused_bf16 = || gemm_reduce::gemm_reduce(&comm, &bf16_args, stream);
            let scaled_alone = || scaled::launch(&scaled_args, &scaled_plan, stream);
            let unfused = || {
                scaled_alone()?;
                coll_into(out_ref.ptr())
            };
            // Each part once, synchronised (lazy module loading), then the check: the fused
            // output against the unfused sequence's.
            for part in [&fused_fp8 as &dyn Fn() -> Result<()>, &fused_bf16, &unfused] {
                part()?;
                sync_stream(stream)?;
            }
            out.poison(stream)?;
            out_ref.poison(stream)?;
            comm.bootstrap.barrier()?;
            unfused()?;
            fused_fp8()?;
            sync_stream(stream)?;
            comm.bootstrap.barrier()?;
            let (got, want) = (out.download_f64()?, out_ref.download_f64()?);
            let rel_err = relative_error(&got[..count], &want[..count]);
            #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN error counts as wrong
            let wrong = !(rel_err <= tolerance(bf16));
            all_ok &= !wrong;
            let names = ["fused_fp8", "fused_bf16", "scaled+coll", "scaled"];
            let timed = [
                Timed::Calls(&fused_fp8),
                Timed::Calls(&fused_bf16),
                Timed::Calls(&unfused),
                Timed::Calls(&scaled_alone),
            ];
            let meas = measure_slowest(&comm, &events, stream, protocol, &timed)?;
            let err = comm.async_error();
            if err != mkResult_t::mkSuccess {
                all_ok = false;
            }
            if rank == 0 {
                let t = |i: usize| meas.stats[i].median;
                let tf = 2.0 * m as f64 * nn as f64 * kk as f64 / (t(0) * 1e-6) / 1e12;
                println!(
                    "  {:>6} {:>6} {:>6} | {:>9.1} {:>7.1} | {:>9.1} {:>11.1} {:>9.1} | {:>8.3} {:>8.3} {:>6}{}",
                    m,
                    nn,
                    kk,
                    t(0),
                    tf,
                    t(1),
                    t(2),
                    t(3),
                    t(0) / t(1),
                    t(0) / t(2),
                    u8::from(wrong),
                    if err == mkResult_t::mkSuccess { String::new() } else { format!("  ASYNC ERROR {err:?}") }
                );
                record::row(
                    record::shape(
                        &[("ranks", n), ("m", m), ("n", nn), ("k", kk)],
                        &[("ab", "float8e4m3"), ("c", bf16.name()), ("scales", "rowwise")],
                    ),
                    record::measured_contenders(&names, &meas),
                    &[
                        ("rel_err", Json::num(rel_err)),
                        ("wrong", Json::Bool(wrong)),
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
        let d = parse(Reduction::Scatter, &[]).unwrap();
        assert_eq!((&d.ms[..], &d.nk[..]), (&[1024, 4096, 16384][..], &[(8192, 1024), (8192, 3584)][..]));
        assert_eq!(parse(Reduction::All, &[]).unwrap().ms, [1, 64, 256, 2048, 8192]);
        let o = parse(Reduction::All, &args("--m 3 --nk 16x32 -w 1")).unwrap();
        assert_eq!((&o.ms[..], &o.nk[..], o.common.protocol.warmup), (&[3][..], &[(16, 32)][..], 1));
        assert!(parse(Reduction::Scatter, &args("--nk 16x24")).err().is_some_and(|e| e.message.contains("of 16")));
        assert!(parse(Reduction::Scatter, &args("--nk 12x32")).err().is_some_and(|e| e.message.contains("of 8")));
        assert!(check("gemm_ar_fp8", &args("--m 1,2")).is_ok());
    }
}
