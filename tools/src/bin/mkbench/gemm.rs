//! `mkbench gemm`: the GEMM engine (mkGemm's kernels) against cuBLASLt in the same run.
//!
//! Per shape and dtype: random inputs (uniform [-1, 1)) in enough rotating sets to exceed
//! 2× the 50 MB L2, warm-up, then 9 timed blocks per contender, interleaved so both see
//! the same clocks and temperature; each block is CUDA-event timed over several launches,
//! and the median block is reported. Our result is checked against cuBLAS's (#wrong).
//!
//! Options: --dtype bf16|fp16|both (both) · --shape MxNxK (repeatable; default: 5 large
//! and 4 skinny shapes, one of them a partial last wave, then the decode-sized table
//! M ∈ {1, 16, 64, 128, 256} × (N, K) ∈ {(8192, 8192), (28672, 8192), (8192, 28672)}) ·
//! --sweep (also time every tile height and width, split-K over 2 to 4 CTAs and the
//! multicast clusters, and name the fastest: how a row of `ops::gemm::table::TABLE` is
//! chosen) · --json PATH (the run's record, docs/benchmarks.md: per shape both
//! contenders' block times as median / p10 / p90, the host's enqueue µs per launch, the
//! plan, the relative error).
//!
//! Targets, checked without --shape: on the large shapes a geomean ratio (cuBLASLt time /
//! ours) ≥ 0.95 and every ratio ≥ 0.85; on the decode table every ratio ≥ 1.0; on every
//! shape ≥ 0.95.

use crate::measure::{host_enqueue_us, Progress, Stats};
use crate::record;
use cudarc::driver::result as cu;
use mkernel::cuda::{self, sys, PrimaryContext};
use mkernel::error::MkError;
use mkernel::ops::gemm::engine::{self as gemm, Cluster, PlanOverrides};
use mkernel::ops::gemm::op::{self as gemm_op, GemmArgs};
use mkernel::ops::gemm::table::MClass;
use mkernel::types::mkDataType_t;
use mkernel_tools::cublaslt::CublasLt;
use mkernel_tools::testing::{relative_error, tolerance, TestBuffer};

const LARGE: [(usize, usize, usize); 5] =
    [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 28672, 8192), (16384, 8192, 8192), (8192, 8192, 28672)];
/// Few rows; 512 × 28672 × 8192 leaves a partial last wave of 128 × 256 tiles (448 on 132 SMs).
const SKINNY: [(usize, usize, usize); 4] =
    [(128, 8192, 8192), (512, 8192, 8192), (2048, 8192, 8192), (512, 28672, 8192)];
/// Decode-sized rows (M) against the (N, K) of a large model's projections.
const SMALL_M: [usize; 5] = [1, 16, 64, 128, 256];
const SMALL_M_NK: [(usize, usize); 3] = [(8192, 8192), (28672, 8192), (8192, 28672)];

/// The shapes run without --shape: LARGE, SKINNY, then SMALL_M × SMALL_M_NK, each once.
fn default_shape_list() -> Vec<(usize, usize, usize)> {
    let mut shapes: Vec<(usize, usize, usize)> = LARGE.into_iter().chain(SKINNY).collect();
    for (n, k) in SMALL_M_NK {
        for m in SMALL_M {
            if !shapes.contains(&(m, n, k)) {
                shapes.push((m, n, k));
            }
        }
    }
    shapes
}

/// The --sweep variants: (tile rows, width, split-K, multicast, raster group).
fn sweep_variants() -> Vec<(usize, usize, usize, Cluster, Option<usize>)> {
    let mut v = Vec::new();
    for bm in gemm::TILE_ROWS {
        for bn in gemm::TILE_WIDTHS {
            for split_k in [1, 2, 3, 4] {
                let clusters: &[Cluster] = if bm == gemm::BM && split_k == 1 {
                    &[Cluster::None, Cluster::ShareA, Cluster::ShareB]
                } else {
                    &[Cluster::None]
                };
                for &cluster in clusters {
                    for group in [None, Some(8usize)] {
                        v.push((bm, bn, split_k, cluster, group));
                    }
                }
            }
        }
    }
    v
}

struct Row {
    dtype: mkDataType_t,
    shape: (usize, usize, usize),
    ours_us: f64,
    cublas_us: f64,
    wrong: bool,
}

fn tflops(shape: (usize, usize, usize), us: f64) -> f64 {
    2.0 * shape.0 as f64 * shape.1 as f64 * shape.2 as f64 / us / 1e6
}

fn parse_shape(s: &str) -> Option<(usize, usize, usize)> {
    let v: Vec<usize> = s.split('x').map(|p| p.parse().ok()).collect::<Option<_>>()?;
    (v.len() == 3).then(|| (v[0], v[1], v[2]))
}

struct Timer {
    start: sys::CUevent,
    end: sys::CUevent,
}

impl Timer {
    fn new() -> mkernel::Result<Self> {
        let mk =
            || cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| cuda::cuda_err("cuEventCreate", e));
        Ok(Timer { start: mk()?, end: mk()? })
    }
    /// Mean microseconds per call of `f(i)` over `n` calls on `stream`.
    fn time(
        &self,
        stream: sys::CUstream,
        n: usize,
        mut f: impl FnMut(usize) -> mkernel::Result<()>,
    ) -> mkernel::Result<f64> {
        // SAFETY: events created by this timer, stream live.
        unsafe {
            cu::event::record(self.start, stream).map_err(|e| cuda::cuda_err("cuEventRecord", e))?;
            for i in 0..n {
                f(i)?;
            }
            cu::event::record(self.end, stream).map_err(|e| cuda::cuda_err("cuEventRecord", e))?;
            cu::event::synchronize(self.end).map_err(|e| cuda::cuda_err("cuEventSynchronize", e))?;
            Ok(cu::event::elapsed(self.start, self.end).map_err(|e| cuda::cuda_err("cuEventElapsedTime", e))? as f64
                * 1e3
                / n as f64)
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// The options (`--json` is taken by main.rs for every bench).
struct Options {
    dtypes: Vec<mkDataType_t>,
    shapes: Vec<(usize, usize, usize)>,
    sweep: bool,
}

pub fn check(_op: &str, args: &[String]) -> mkernel::Result<()> {
    parse(args).map(|_| ())
}

fn parse(args: &[String]) -> mkernel::Result<Options> {
    let mut dtypes = vec![mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16];
    let mut shapes: Vec<(usize, usize, usize)> = Vec::new();
    let mut sweep = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--dtype" => {
                dtypes = match it.next().map(|s| s.as_str()) {
                    Some("bf16") => vec![mkDataType_t::mkBfloat16],
                    Some("fp16") => vec![mkDataType_t::mkFloat16],
                    Some("both") => dtypes,
                    other => {
                        return Err(MkError::invalid_argument(format!(
                            "--dtype takes bf16, fp16 or both, not {other:?}"
                        )))
                    }
                }
            }
            "--shape" => shapes.push(
                it.next()
                    .and_then(|s| parse_shape(s))
                    .ok_or_else(|| MkError::invalid_argument("--shape takes MxNxK, e.g. 8192x8192x8192"))?,
            ),
            "--sweep" => sweep = true,
            other => {
                return Err(MkError::invalid_argument(format!(
                    "unknown option {other:?} (see src/bin/mkbench/gemm.rs)"
                )))
            }
        }
    }
    Ok(Options { dtypes, shapes, sweep })
}

pub fn run(args: &[String]) -> mkernel::Result<bool> {
    let Options { dtypes, mut shapes, sweep } = parse(args)?;
    let default_shapes = shapes.is_empty();
    if default_shapes {
        shapes = default_shape_list();
    }

    let ctx = PrimaryContext::retain(0)?;
    let _g = ctx.enter()?;
    let stream =
        cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
    let sms = cuda::sm_count(0)? as usize;
    let lt = CublasLt::new()?;
    let timer = Timer::new()?;
    let mut rows = Vec::new();
    let mut progress = Progress::new(dtypes.len() * shapes.len());

    println!(
        "# mkbench gemm: C[M,N] = A[M,K]·B[N,K]ᵀ, row-major, fp32 accumulate; {sms} SMs; times are medians of 9 blocks"
    );
    println!(
        "# {:>5} {:>6} {:>6} {:>6}  {:>10} {:>9}  {:>10} {:>9}  {:>6}  {:>8} {:>6}  {:>11}  plan",
        "dtype",
        "M",
        "N",
        "K",
        "mk(us)",
        "TFLOP/s",
        "cublas(us)",
        "TFLOP/s",
        "ratio",
        "rel_err",
        "#wrong",
        "host mk/cuB"
    );
    for &dtype in &dtypes {
        for &shape in &shapes {
            let (m, n, k) = shape;
            progress.step(&format!("{} M {m} N {n} K {k}", dtype.name()));
            let set_bytes = (m * k + n * k) * dtype.size();
            let sets = 2usize.max((200usize << 20).div_ceil(set_bytes));
            let mut inputs = Vec::with_capacity(sets);
            for s in 0..sets {
                let a = TestBuffer::new(m * k, dtype)?;
                let b = TestBuffer::new(n * k, dtype)?;
                a.randomize(1000 + 2 * s as u64, 1.0, stream)?;
                b.randomize(1001 + 2 * s as u64, 1.0, stream)?;
                inputs.push((a, b));
            }
            let c = TestBuffer::new(m * n, dtype)?;
            let c_ref = TestBuffer::new(m * n, dtype)?;
            let cublas = lt.gemm(m, n, k, dtype, dtype)?;
            let args_for = |i: usize| GemmArgs {
                a: inputs[i % sets].0.ptr(),
                b: inputs[i % sets].1.ptr(),
                c: c.ptr(),
                m,
                n,
                k,
                dtype,
            };
            let tma_ok = args_for(0).tma_epilogue_ok();
            let default_plan = gemm::plan(m, n, k, sms, tma_ok, PlanOverrides::default());

            // Correctness on this shape: ours vs cuBLAS (same inputs), both poisoned first.
            c.poison(stream)?;
            c_ref.poison(stream)?;
            gemm_op::launch(&args_for(0), &default_plan, stream)?;
            cublas.run(&lt, inputs[0].0.ptr(), inputs[0].1.ptr(), c_ref.ptr(), stream)?;
            // SAFETY: stream is live.
            unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
            let rel_err = relative_error(&c.download_f64()?, &c_ref.download_f64()?);
            // Written so that a NaN error counts as wrong (every comparison with NaN is false).
            #[allow(clippy::neg_cmp_op_on_partial_ord)]
            let wrong = !(rel_err <= tolerance(dtype));

            let mut contenders: Vec<(String, gemm::GemmPlan)> = vec![("mk".into(), default_plan)];
            if sweep {
                for (bm, bn, split_k, cluster, group) in sweep_variants() {
                    let o = PlanOverrides {
                        bm: Some(bm),
                        bn: Some(bn),
                        split_k: Some(split_k),
                        group_m: group,
                        max_ctas: None,
                        cluster: Some(cluster),
                    };
                    let p = gemm::plan(m, n, k, sms, tma_ok, o);
                    // Only what was asked for (a fallback repeats another variant); narrow
                    // tiles and splits only where tiles are few or the last wave is partial.
                    if p.cluster != cluster || p.split_k != split_k || p.bm != bm {
                        continue;
                    }
                    if (bn < 256 || split_k > 1 || bm < gemm::BM) && p.tiles() > 8 * sms {
                        continue;
                    }
                    if p != default_plan && !contenders.iter().any(|(_, q)| *q == p) {
                        contenders.push((format!("{}_g{}", p.tile().describe().replace(' ', "_"), p.group_m), p));
                    }
                }
            }
            let flops = 2.0 * (m * n * k) as f64;
            let inner = ((2e-3 / (flops / 700e12)) as usize + 1).clamp(3, 50);
            let mut times: Vec<Vec<f64>> = vec![Vec::new(); contenders.len() + 1];
            for rep in 0..10 {
                let n_iter = if rep == 0 { 2 * inner } else { inner }; // rep 0 = warm-up, discarded
                let t = timer.time(stream, n_iter, |i| {
                    cublas.run(&lt, inputs[i % sets].0.ptr(), inputs[i % sets].1.ptr(), c_ref.ptr(), stream)
                })?;
                if rep > 0 {
                    times[0].push(t);
                }
                for (ci, (_, p)) in contenders.iter().enumerate() {
                    let t = timer.time(stream, n_iter, |i| gemm_op::launch(&args_for(i), p, stream))?;
                    if rep > 0 {
                        times[ci + 1].push(t);
                    }
                }
            }
            let cublas_us = median(times[0].clone());
            let ours_us = median(times[1].clone());
            // Host µs to enqueue one launch, back to back (the GPU catches up after).
            let sync = || {
                // SAFETY: stream is live.
                unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))
            };
            let host_mk = host_enqueue_us(inner, || gemm_op::launch(&args_for(0), &default_plan, stream))?;
            sync()?;
            let host_cublas =
                host_enqueue_us(inner, || cublas.run(&lt, inputs[0].0.ptr(), inputs[0].1.ptr(), c_ref.ptr(), stream))?;
            sync()?;
            let variants: Vec<(String, f64)> = contenders
                .iter()
                .zip(&times[1..])
                .map(|((name, _), t)| (name.clone(), tflops(shape, median(t.clone()))))
                .collect();
            let plan = format!(
                "{} g{} ctas{} {:?} ({:?})",
                default_plan.tile().describe(),
                default_plan.group_m,
                default_plan.grid,
                default_plan.epilogue,
                default_plan.source,
            );
            let fastest = variants
                .iter()
                .max_by(|a, b| a.1.partial_cmp(&b.1).unwrap_or(std::cmp::Ordering::Equal))
                .map(|(n, t)| format!(" fastest {n} ({:.3}x cuBLASLt)", t / tflops(shape, cublas_us)))
                .unwrap_or_default();
            println!(
                "  {:>5} {:>6} {:>6} {:>6}  {:>10.1} {:>9.1}  {:>10.1} {:>9.1}  {:>6.3}  {:>8.1e} {:>6}  {:>11}  {plan}{}",
                if dtype == mkDataType_t::mkBfloat16 { "bf16" } else { "fp16" },
                m,
                n,
                k,
                ours_us,
                tflops(shape, ours_us),
                cublas_us,
                tflops(shape, cublas_us),
                cublas_us / ours_us,
                rel_err,
                u8::from(wrong),
                format!("{host_mk:.1}/{host_cublas:.1}"),
                if sweep {
                    variants.iter().map(|(n, t)| format!(" {n}={t:.0}")).collect::<String>() + &fastest
                } else {
                    String::new()
                }
            );
            // A table row for ops::gemm::table::TABLE where a swept variant beat the plan by 2 %.
            if let Some((i, _)) = variants.iter().enumerate().max_by(|a, b| a.1 .1.total_cmp(&b.1 .1)) {
                let (best, planned) = (variants[i].1, variants[0].1);
                if i > 0 && best > 1.02 * planned {
                    let t = contenders[i].1.tile();
                    println!(
                        "# table row: row(MClass::{:?}, {n}, {k}, TileChoice {{ bm: {}, bn: {}, split_k: {}, cluster: Cluster::{:?} }}), // {:.3}x cuBLASLt, planned {:.3}x{}",
                        MClass::of(m),
                        t.bm,
                        t.bn,
                        t.split_k,
                        t.cluster,
                        best / tflops(shape, cublas_us),
                        planned / tflops(shape, cublas_us),
                        if contenders[i].1.group_m != default_plan.group_m { " (another raster group)" } else { "" }
                    );
                }
            }
            let mut recorded = vec![
                record::contender("mk", Stats::of(&times[1]), Some(host_mk)),
                record::contender("cublaslt", Stats::of(&times[0]), Some(host_cublas)),
            ];
            recorded.extend(
                contenders
                    .iter()
                    .zip(&times[1..])
                    .skip(1)
                    .map(|((name, _), t)| record::contender(name, Stats::of(t), None)),
            );
            record::row(
                record::shape(
                    &[("m", m), ("n", n), ("k", k)],
                    &[
                        ("dtype", dtype.name()),
                        (
                            "set",
                            if LARGE.contains(&shape) {
                                "large"
                            } else if SKINNY.contains(&shape) {
                                "skinny"
                            } else if SMALL_M.contains(&m) && SMALL_M_NK.contains(&(n, k)) {
                                "small_m"
                            } else {
                                "given"
                            },
                        ),
                    ],
                ),
                recorded,
                &[
                    ("plan", record::Json::str(plan)),
                    ("rel_err", record::Json::num(rel_err)),
                    ("wrong", record::Json::Bool(wrong)),
                ],
            );
            rows.push(Row { dtype, shape, ours_us, cublas_us, wrong });
        }
    }

    let mut target_met = true;
    let verdict = |met: bool| if met { "target met" } else { "TARGET MISSED" };
    for &dtype in &dtypes {
        let ratios: Vec<((usize, usize, usize), f64)> =
            rows.iter().filter(|r| r.dtype == dtype).map(|r| (r.shape, r.cublas_us / r.ours_us)).collect();
        let min_of = |keep: &dyn Fn(&(usize, usize, usize)) -> bool| {
            ratios.iter().filter(|(s, _)| keep(s)).map(|(_, r)| *r).fold(f64::INFINITY, f64::min)
        };
        let large: Vec<f64> = ratios.iter().filter(|(s, _)| LARGE.contains(s)).map(|(_, r)| *r).collect();
        let min = min_of(&|_| true);
        if large.is_empty() {
            println!("# {}: min ratio {min:.3}", dtype.name());
            continue;
        }
        let geo = (large.iter().map(|r| r.ln()).sum::<f64>() / large.len() as f64).exp();
        let met = geo >= 0.95 && min_of(&|s| LARGE.contains(s)) >= 0.85;
        target_met &= met;
        println!(
            "# {}: geomean ratio over {} large shapes {geo:.3} (target >= 0.95), min ratio {:.3} (target >= 0.85) -> {}",
            dtype.name(),
            large.len(),
            min_of(&|s| LARGE.contains(s)),
            verdict(met)
        );
        let decode = min_of(&|&(m, n, k)| SMALL_M.contains(&m) && SMALL_M_NK.contains(&(n, k)));
        if decode.is_finite() {
            target_met &= decode >= 1.0;
            println!(
                "# {}: min ratio over the decode table {decode:.3} (target >= 1.0) -> {}",
                dtype.name(),
                verdict(decode >= 1.0)
            );
        }
        target_met &= min >= 0.95;
        println!(
            "# {}: min ratio over every shape {min:.3} (target >= 0.95) -> {}",
            dtype.name(),
            verdict(min >= 0.95)
        );
    }
    if default_shapes {
        println!("# performance target: {}", if target_met { "met" } else { "MISSED" });
    }
    let wrong = rows.iter().filter(|r| r.wrong).count();
    println!("# #wrong: {wrong} of {} shapes (ours vs cuBLASLt, rel err band bf16 1e-2, fp16 2e-3)", rows.len());

    // SAFETY: created above, no work pending after the last synchronize.
    let _ = unsafe { cu::stream::destroy(stream) };
    Ok(wrong == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_shapes_start_from_one_row_and_never_repeat() {
        let shapes = default_shape_list();
        for (n, k) in SMALL_M_NK {
            for m in SMALL_M {
                assert_eq!(shapes.iter().filter(|&&s| s == (m, n, k)).count(), 1, "M {m} N {n} K {k}");
            }
        }
        assert!(shapes.contains(&(1, 8192, 28672)));
        assert_eq!(shapes.len(), LARGE.len() + SKINNY.len() + SMALL_M.len() * SMALL_M_NK.len() - 1);
        assert!(parse(&["--shape".into(), "1x8192x8192".into()]).is_ok());
    }
}
