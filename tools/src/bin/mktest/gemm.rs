//! mkGemm on the GPU: float64 CPU reference on small and awkward shapes, cuBLASLt (fp32
//! output, with Σ|a·b| from cuBLASLt on |A|, |B| for the bound) on large ones, element by
//! element (testing::Rule; the cuBLASLt reference's own accumulation error is allowed for
//! too), both dtypes, every tile width, both tile heights (128, 64), split-K over 2 and 4
//! CTAs (on the whole GPU and on 5 CTAs, where each cluster takes many tiles), both
//! epilogues, fresh random inputs, NaN-poisoned outputs and guard bands checked for every
//! check; then the decode shapes (M 1..256 against the (N, K) of a large model's
//! projections) with a float64 reference on sampled rows, each planned, forced split and
//! unsplit, and the planned call repeated and rerun on half the SMs, bit for bit the same;
//! then the public entry point mkGemm (argument errors, a real call) and mkGemm captured in
//! a CUDA graph and replayed.

use crate::outcome::{self, Outcome};
use mkernel::cuda::{self, PrimaryContext};
use mkernel::error::{mkResult_t, MkError};
use mkernel::ops::gemm::engine::{self as gemm, Cluster, PlanOverrides, TILE_ROWS, TILE_WIDTHS};
use mkernel::ops::gemm::op::{self as gemm_op, GemmArgs};
use mkernel::types::mkDataType_t;
use mkernel_tools::cublaslt::CublasLt;
use mkernel_tools::testing::{check_close, gemm_reference, tolerance, CapturedGraph, Rule, TestBuffer, Verdict};
use std::ffi::c_void;

const DTYPES: [mkDataType_t; 2] = [mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16];

fn sync() -> mkernel::Result<()> {
    cudarc::driver::result::ctx::synchronize()
        .map_err(|e| cuda::cuda_err("cuCtxSynchronize (after the GEMM kernel)", e))
}

/// The reference of C = A·Bᵀ and each element's bound.
pub(crate) struct Reference {
    value: Vec<f64>,
    bound: Vec<f64>,
}

/// float64 on the CPU: the bound is testing::Rule's for a dot product of K terms.
pub(crate) fn cpu_reference(
    a: &TestBuffer,
    b: &TestBuffer,
    m: usize,
    n: usize,
    k: usize,
) -> mkernel::Result<Reference> {
    let (value, mag) = gemm_reference(&a.download_f64()?, &b.download_f64()?, m, n, k);
    let rule = Rule::reduction(a.dtype, k);
    let bound = value.iter().zip(&mag).map(|(&r, &g)| rule.bound(r, g)).collect();
    Ok(Reference { value, bound })
}

/// cuBLASLt with fp32 output, for shapes too large for the CPU: Σ|a·b| comes from a second
/// cuBLASLt GEMM of |A| and |B|, and the bound allows the reference's own fp32
/// accumulation (another γ_K·Σ|a·b|) and rounding (2⁻²⁴·|ref|) besides the kernel's.
fn cublas_reference(
    lt: &CublasLt,
    a: &TestBuffer,
    b: &TestBuffer,
    m: usize,
    n: usize,
    k: usize,
) -> mkernel::Result<Reference> {
    let s = std::ptr::null_mut();
    let product = |x: &TestBuffer, y: &TestBuffer| -> mkernel::Result<Vec<f64>> {
        let r32 = TestBuffer::new(m * n, mkDataType_t::mkFloat32)?;
        r32.poison(s)?;
        lt.gemm(m, n, k, x.dtype, mkDataType_t::mkFloat32)?.run(lt, x.ptr(), y.ptr(), r32.ptr(), s)?;
        sync()?;
        r32.download_f64()
    };
    let absolute = |x: &TestBuffer| -> mkernel::Result<TestBuffer> {
        let abs = TestBuffer::new(x.count, x.dtype)?;
        // bf16 and f16 keep the sign in bit 15.
        let bytes: Vec<u8> = x
            .download()?
            .chunks_exact(2)
            .flat_map(|c| (u16::from_le_bytes([c[0], c[1]]) & 0x7fff).to_le_bytes())
            .collect();
        abs.upload(&bytes)?;
        Ok(abs)
    };
    let value = product(a, b)?;
    let mag = product(&absolute(a)?, &absolute(b)?)?;
    let rule = Rule::reduction(a.dtype, k);
    let bound = value.iter().zip(&mag).map(|(&r, &g)| rule.bound(r, 2.0 * g) + 2f64.powi(-24) * r.abs()).collect();
    Ok(Reference { value, bound })
}

/// C against the reference element by element, its guard bands intact.
pub(crate) fn verify(c: &TestBuffer, reference: &Reference) -> mkernel::Result<(bool, String)> {
    let verdict: Verdict = check_close(&c.download_f64()?, &reference.value, &reference.bound, tolerance(c.dtype));
    let guards = c.guards_intact()?;
    Ok((
        verdict.passed() && guards.is_none(),
        format!("{verdict}{}", guards.map_or(String::new(), |w| format!("; GUARD {w}"))),
    ))
}

/// Decode-sized rows (M) against the (N, K) of a large model's projections: the shapes
/// `mkbench gemm` times beside cuBLASLt (its SMALL_M table).
const DECODE_M: [usize; 5] = [1, 16, 64, 128, 256];
const DECODE_NK: [(usize, usize); 3] = [(8192, 8192), (28672, 8192), (8192, 28672)];

/// Float64 reference of the given rows of C = A·Bᵀ (row after row, every column), each row
/// on its own thread.
fn sampled_reference(a: &[f64], b: &[f64], rows: &[usize], n: usize, k: usize, dtype: mkDataType_t) -> Reference {
    let per_row: Vec<(Vec<f64>, Vec<f64>)> = std::thread::scope(|scope| {
        let handles: Vec<_> =
            rows.iter().map(|&r| scope.spawn(move || gemm_reference(&a[r * k..(r + 1) * k], b, 1, n, k))).collect();
        handles.into_iter().map(|h| h.join().expect("reference thread")).collect()
    });
    let rule = Rule::reduction(dtype, k);
    let mut value = Vec::with_capacity(rows.len() * n);
    let mut bound = Vec::with_capacity(rows.len() * n);
    for (v, mag) in per_row {
        bound.extend(v.iter().zip(&mag).map(|(&r, &g)| rule.bound(r, g)));
        value.extend(v);
    }
    Reference { value, bound }
}

/// The decode shapes (bf16): A fresh per shape, B per (N, K); C poisoned before every
/// call. Each shape runs its planned kernel and a forced alternative (split over 2 CTAs if
/// the plan does not split, else unsplit), checked on sampled rows (the first, the last and
/// two random ones: every n-block and the whole of K) against float64, with every element
/// of C finite and its guard bands intact; the planned call is then repeated, and rerun
/// with half the SMs (another grid, the same tiles and K split), and both must match the
/// first bit for bit. Returns (checks, failures).
fn decode_shapes(sms: usize, seed: &mut u64) -> mkernel::Result<(usize, usize)> {
    let s = std::ptr::null_mut();
    let dtype = mkDataType_t::mkBfloat16;
    let (mut checks, mut failures) = (0usize, 0usize);
    for (n, k) in DECODE_NK {
        let b = TestBuffer::new(n * k, dtype)?;
        *seed += 1;
        b.randomize(*seed, 1.0, s)?;
        sync()?;
        let b64 = b.download_f64()?;
        for m in DECODE_M {
            let a = TestBuffer::new(m * k, dtype)?;
            let c = TestBuffer::new(m * n, dtype)?;
            *seed += 1;
            a.randomize(*seed, 1.0, s)?;
            sync()?;
            let a64 = a.download_f64()?;
            let mut rows = vec![0, m - 1];
            if m > 2 {
                rows.push(1 + (*seed as usize) % (m - 2));
                rows.push(1 + (seed.wrapping_mul(0x9e37_79b9) as usize >> 7) % (m - 2));
            }
            rows.sort_unstable();
            rows.dedup();
            let reference = sampled_reference(&a64, &b64, &rows, n, k, dtype);
            let args = GemmArgs { a: a.ptr(), b: b.ptr(), c: c.ptr(), m, n, k, dtype };
            let planned = gemm::plan(m, n, k, sms, args.tma_epilogue_ok(), PlanOverrides::default());
            let other = PlanOverrides {
                bn: Some(planned.bn.min(128)),
                split_k: Some(if planned.split_k > 1 { 1 } else { 2 }),
                ..Default::default()
            };
            let forced = gemm::plan(m, n, k, sms, args.tma_epilogue_ok(), other);
            let half = gemm::plan(
                m,
                n,
                k,
                sms,
                args.tma_epilogue_ok(),
                PlanOverrides {
                    bm: Some(planned.bm),
                    bn: Some(planned.bn),
                    split_k: Some(planned.split_k),
                    max_ctas: Some(sms / 2),
                    ..Default::default()
                },
            );
            let run = |plan: &gemm::GemmPlan| -> mkernel::Result<Vec<u8>> {
                c.poison(s)?;
                gemm_op::launch(&args, plan, s).map_err(|e| e.context(format!("M {m} N {n} K {k} {plan:?}")))?;
                sync().map_err(|e| e.context(format!("M {m} N {n} K {k} {plan:?}")))?;
                c.download()
            };
            let mut first: Option<Vec<u8>> = None;
            for (what, plan) in [("planned", planned), ("forced", forced)] {
                let bytes = run(&plan)?;
                let all = mkernel_tools::testing::to_f64(&bytes, dtype);
                let nonfinite = all.iter().filter(|v| !v.is_finite()).count();
                let sampled: Vec<f64> = rows.iter().flat_map(|&r| all[r * n..(r + 1) * n].iter().copied()).collect();
                let verdict = check_close(&sampled, &reference.value, &reference.bound, tolerance(dtype));
                let guards = c.guards_intact()?;
                let ok = verdict.passed() && nonfinite == 0 && guards.is_none();
                checks += 1;
                failures += usize::from(!ok);
                println!(
                    "  decode gemm {m:>4}x{n:>5}x{k:>5} bf16 {what:<7} {} ctas {:>3}, rows {rows:?}: {verdict}, {nonfinite} non-finite{} -> {}",
                    plan.tile().describe(),
                    plan.grid,
                    guards.map_or(String::new(), |w| format!("; GUARD {w}")),
                    if ok { "ok" } else { "WRONG" }
                );
                if what == "planned" {
                    first = Some(bytes);
                }
            }
            let first = first.expect("the planned run");
            for (what, plan) in [("repeated", planned), ("half the SMs", half)] {
                let same = run(&plan)? == first;
                checks += 1;
                failures += usize::from(!same);
                println!(
                    "  decode gemm {m:>4}x{n:>5}x{k:>5} bf16 {what}: {} ctas {:>3} -> {}",
                    plan.tile().describe(),
                    plan.grid,
                    if same { "bitwise identical" } else { "DIFFERS (not deterministic)" }
                );
            }
        }
    }
    Ok((checks, failures))
}

struct Case {
    m: usize,
    n: usize,
    k: usize,
}

pub fn run() -> mkernel::Result<Outcome> {
    let ctx = PrimaryContext::retain(0)?;
    let _g = ctx.enter()?;
    let s = std::ptr::null_mut();
    let sms = cuda::sm_count(0)? as usize;
    let mut seed = 0x5eed_0000u64 + std::process::id() as u64;
    let mut failures = 0usize;
    let mut checks = 0usize;
    let mut not_planned = 0usize;

    // Decode rows (M = 1..16), K = 8, N = 8, and a partial tile in every dimension.
    let mut small = vec![
        Case { m: 1, n: 1, k: 8 },
        Case { m: 16, n: 8, k: 8 },
        Case { m: 5, n: 264, k: 136 },
        Case { m: 129, n: 257, k: 72 },
        Case { m: 1000, n: 3000, k: 520 },
        // N ends inside the register-stored columns of a 224-wide tile (640..671 of its third).
        Case { m: 77, n: 648, k: 200 },
    ];
    // A few random awkward shapes (different every run; printed so a failure can be replayed).
    let mut rng = seed;
    let mut next = |lo: usize, hi: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        lo + (rng as usize) % (hi - lo)
    };
    for _ in 0..4 {
        small.push(Case { m: next(1, 700), n: next(1, 700), k: 8 * next(1, 100) });
    }
    let large =
        [Case { m: 4096, n: 4096, k: 4096 }, Case { m: 2048, n: 8192, k: 8192 }, Case { m: 333, n: 8192, k: 2056 }];
    let lt = CublasLt::new()?;

    for dtype in DTYPES {
        for (is_large, case) in small.iter().map(|c| (false, c)).chain(large.iter().map(|c| (true, c))) {
            let (m, n, k) = (case.m, case.n, case.k);
            let a = TestBuffer::new(m * k, dtype)?;
            let b = TestBuffer::new(n * k, dtype)?;
            let c = TestBuffer::new(m * n, dtype)?;
            seed += 2;
            a.randomize(seed, 1.0, s)?;
            b.randomize(seed + 1, 1.0, s)?;
            let reference =
                if is_large { cublas_reference(&lt, &a, &b, m, n, k)? } else { cpu_reference(&a, &b, m, n, k)? };
            let args = GemmArgs { a: a.ptr(), b: b.ptr(), c: c.ptr(), m, n, k, dtype };
            let mut variants = Vec::new();
            for bm in TILE_ROWS {
                for bn in TILE_WIDTHS {
                    for cluster in [Cluster::None, Cluster::ShareA, Cluster::ShareB] {
                        for split_k in [1, 2, 4] {
                            for ctas in [sms, 5] {
                                for force_direct in [false, true] {
                                    variants.push((bm, bn, cluster, split_k, ctas, force_direct));
                                }
                            }
                        }
                    }
                }
            }
            for (bm, bn, cluster, split_k, ctas, force_direct) in variants {
                let multicast = cluster != Cluster::None;
                if multicast && (bm != gemm::BM || split_k > 1) {
                    continue; // never built
                }
                if force_direct && (ctas != sms || !args.tma_epilogue_ok() || multicast || split_k > 1) {
                    continue;
                }
                // The large shapes take the 64-row and split variants on the whole GPU only.
                if is_large && (bm != gemm::BM || split_k > 1) && (ctas != sms || split_k > 2) {
                    continue;
                }
                let tma_ok = args.tma_epilogue_ok() && !force_direct;
                let o = PlanOverrides {
                    bm: Some(bm),
                    bn: Some(bn),
                    split_k: Some(split_k),
                    group_m: None,
                    max_ctas: Some(ctas),
                    cluster: Some(cluster),
                };
                let plan = gemm::plan(m, n, k, sms, tma_ok, o);
                if plan.cluster != cluster || plan.split_k != split_k {
                    // No such kernel, an odd tile count, or too few K blocks: covered by
                    // the variants without (counted and printed; the suite's floor bounds
                    // how many skip).
                    not_planned += 1;
                    continue;
                }
                c.poison(s)?;
                gemm_op::launch(&args, &plan, s)
                    .map_err(|e| e.context(format!("{} {m}x{n}x{k} {plan:?}", dtype.name())))?;
                sync().map_err(|e| e.context(format!("{} {m}x{n}x{k} {plan:?}", dtype.name())))?;
                let (ok, detail) = verify(&c, &reference)?;
                checks += 1;
                if !ok {
                    failures += 1;
                }
                println!(
                    "  {} gemm {:>5}x{:>5}x{:>5} {:>8} bm{:<3} bn{:<3} split{} {:?} {:?} ctas {:>3}: {detail} -> {}",
                    if is_large { "cublas" } else { "cpu64 " },
                    m,
                    n,
                    k,
                    dtype.name(),
                    plan.bm,
                    bn,
                    plan.split_k,
                    plan.epilogue,
                    plan.cluster,
                    plan.grid,
                    if ok { "ok" } else { "WRONG" }
                );
            }
        }
    }

    let (c2, f2) = decode_shapes(sms, &mut seed)?;
    checks += c2;
    failures += f2;

    // The public entry point: a real call through mkGemm, then argument errors.
    for dtype in DTYPES {
        let (m, n, k) = (300, 520, 136);
        let a = TestBuffer::new(m * k, dtype)?;
        let b = TestBuffer::new(n * k, dtype)?;
        let c = TestBuffer::new(m * n, dtype)?;
        a.randomize(seed + 100, 1.0, s)?;
        b.randomize(seed + 101, 1.0, s)?;
        c.poison(s)?;
        // SAFETY: valid device buffers of the stated sizes.
        let r = unsafe {
            mkernel::ffi::gemm::mkGemm(
                a.ptr() as *const c_void,
                b.ptr() as *const c_void,
                c.ptr() as *mut c_void,
                m,
                n,
                k,
                dtype as i32,
                s,
            )
        };
        sync()?;
        let (verified, detail) = verify(&c, &cpu_reference(&a, &b, m, n, k)?)?;
        let ok = r == mkResult_t::mkSuccess && verified;
        checks += 1;
        failures += usize::from(!ok);
        println!("  mkGemm {m}x{n}x{k} {}: {r:?} {detail} -> {}", dtype.name(), if ok { "ok" } else { "WRONG" });

        // Misaligned A (by one element) must be rejected, not mis-computed.
        // SAFETY: rejected before any access.
        let r = unsafe {
            mkernel::ffi::gemm::mkGemm(
                (a.ptr() + 2) as *const c_void,
                b.ptr() as *const c_void,
                c.ptr() as *mut c_void,
                m,
                n,
                k,
                dtype as i32,
                s,
            )
        };
        let ok = r == mkResult_t::mkInvalidArgument;
        checks += 1;
        failures += usize::from(!ok);
        println!("  mkGemm misaligned A {}: {r:?} -> {}", dtype.name(), if ok { "ok" } else { "WRONG" });
    }

    // mkGemm inside a CUDA graph (stream capture on a non-default stream), replayed twice
    // with the inputs changed in between: the graph must recompute, not replay stale data.
    // The second shape plans split-K (a cluster launch, 64-row tiles) on an H100 or H200.
    for (dtype, (m, n, k)) in DTYPES.iter().flat_map(|&d| [(d, (512, 1024, 512)), (d, (64, 1024, 4096))]) {
        let a = TestBuffer::new(m * k, dtype)?;
        let b = TestBuffer::new(n * k, dtype)?;
        let c = TestBuffer::new(m * n, dtype)?;
        let stream = cudarc::driver::result::stream::create(cudarc::driver::result::stream::StreamKind::NonBlocking)
            .map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
        // The call's own result is checked below, as a wrong result is: a capture that
        // fails otherwise ends the suite with its error.
        let mut r = mkResult_t::mkInternalError;
        let graph = CapturedGraph::capture(stream, |s| {
            // SAFETY: device buffers of m×k, n×k and m×n elements; `s` is the capturing stream.
            r = unsafe {
                mkernel::ffi::gemm::mkGemm(
                    a.ptr() as *const c_void,
                    b.ptr() as *const c_void,
                    c.ptr() as *mut c_void,
                    m,
                    n,
                    k,
                    dtype as i32,
                    s,
                )
            };
            Ok(())
        })?;
        let mut ok = r == mkResult_t::mkSuccess;
        let mut details = Vec::new();
        for round in 0..2u64 {
            a.randomize(seed + 200 + 2 * round, 1.0, s)?;
            b.randomize(seed + 201 + 2 * round, 1.0, s)?;
            c.poison(s)?;
            sync()?;
            graph.launch(stream)?;
            sync()?;
            let (verified, detail) = verify(&c, &cpu_reference(&a, &b, m, n, k)?)?;
            details.push(detail);
            ok &= verified;
        }
        drop(graph);
        // SAFETY: destroyed once, after the last launch completed.
        let _ = unsafe { cudarc::driver::result::stream::destroy(stream) };
        checks += 1;
        failures += usize::from(!ok);
        println!(
            "  mkGemm in a CUDA graph {m}x{n}x{k} {} ({}): {r:?}, 2 replays: {} -> {}",
            dtype.name(),
            gemm::plan(m, n, k, sms, true, PlanOverrides::default()).tile().describe(),
            details.join(" | "),
            if ok { "ok" } else { "WRONG" }
        );
    }

    outcome::count(checks);
    println!("  gemm: {checks} checks, {failures} failed; {not_planned} (tile, split, cluster) variants not planned for their shape");
    if failures > 0 {
        return Err(MkError::internal(format!("{failures} of {checks} GEMM checks failed")));
    }
    Ok(Outcome::Ran)
}
