//! mkScaledGemm on the GPU (A in e4m3 or e5m2, B in e4m3, fp32 scales, bf16 or fp16 C),
//! element by element against float64 of the dequantized inputs, with fresh random inputs,
//! NaN-poisoned outputs and guard bands checked for every check. Two kinds of input:
//! - exact sums: A and B hold small integers (|v| ≤ 4, exact in e4m3 and e5m2), so every
//!   partial sum the tensor cores form inside a stage (|Σ| ≤ 128·16 = 2¹¹) and every
//!   promoted fp32 sum of them (|Σ| ≤ 16·K < 2²⁴) is an exact integer, whatever the
//!   accumulator's width (the fp8 tensor cores keep at least 13 fraction bits past the
//!   largest addend's binade, and integers up to 2¹¹ need none). What is left is the
//!   scales' fp32 roundings and C's one rounding, a bound so tight that one missed K stage,
//!   a wrong scale or a misplaced tile fails it;
//! - quantized: uniform values in [-1, 1) scaled as a user quantizes them (the amax of the
//!   tensor, of each row, or of each block to the type's largest value, 448 for e4m3 and
//!   57344 for e5m2), rounded to the operand's type. The reference multiplies the same
//!   dequantized values, so the quantization (2 mantissa bits in e5m2, 3 in e4m3) is part
//!   of the inputs, not of the error, and the bound is the same for both types of A. It
//!   follows the kernel's accumulation: inside each 128-wide stage, four wgmma k32 steps
//!   that each align 33 addends to the largest one's binade and keep 13 fraction bits
//!   (DeepSeek-V3 §3.3.2; truncation), so each step errs by at most
//!   33·2⁻¹³·2·(Σ|stage terms|); the stages' promotion into fp32 by γ_{K/128+1}(2⁻²³); the
//!   scales' roundings and C's.
//!
//! Both types of A, every tile width (64, 128), both epilogues (TMA; direct where N % 8 ≠ 0
//! or forced), both output types and the three scale modes (block where K is a multiple of
//! 128), M from 1 (decode) to 4096; large shapes are checked on sampled rows (every
//! column). Then the C entry points: real calls of mkScaledGemm and of mkScaledGemmMixed
//! with e5m2 A and their refusals (NULL and misaligned scales, K not a multiple of 16, B in
//! e5m2, a bad scale mode), nothing written; and one call of each captured in a CUDA graph,
//! replayed three times on fresh inputs, each replay checked.

use crate::outcome::{self, Outcome};
use mkernel::cuda::{self, PrimaryContext};
use mkernel::error::{mkResult_t, MkError};
use mkernel::ops::gemm::engine::Epilogue;
use mkernel::ops::gemm::scaled::{self, ScaledGemmArgs, ScaledPlan, TILE_WIDTHS};
use mkernel::types::{mkDataType_t, mkScaleMode_t};
use mkernel_tools::testing::fp8::{e4m3_to_f32, e5m2_to_f32, f32_to_e4m3, f32_to_e5m2, E4M3_MAX, E5M2_MAX};
use mkernel_tools::testing::{
    check_close, gamma, to_f64, tolerance, underflow_floor, unit_roundoff, xorshift_unit, CapturedGraph, TestBuffer,
};
use std::ffi::c_void;

pub(crate) const OUTPUTS: [mkDataType_t; 2] = [mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16];
pub(crate) const MODES: [mkScaleMode_t; 3] =
    [mkScaleMode_t::mkScaleTensor, mkScaleMode_t::mkScaleRowwise, mkScaleMode_t::mkScaleBlock];
/// A block scale's side (and a stage's K).
pub(crate) const BLOCK: usize = mkScaleMode_t::BLOCK;
/// A's types (B is e4m3): e5m2 A is the gradient of an fp8 backward.
pub(crate) const A_TYPES: [mkDataType_t; 2] = [mkDataType_t::mkFloat8e4m3, mkDataType_t::mkFloat8e5m2];

/// An fp8 type's encoding as the host sees it.
struct Fp8Format {
    /// A byte's value.
    decode: fn(u8) -> f32,
    /// A value rounded to the nearest byte (ties to even, saturating).
    encode: fn(f32) -> u8,
    /// The largest finite value.
    largest: f32,
}

fn fp8_format(dtype: mkDataType_t) -> Fp8Format {
    match dtype {
        mkDataType_t::mkFloat8e4m3 => Fp8Format { decode: e4m3_to_f32, encode: f32_to_e4m3, largest: E4M3_MAX },
        mkDataType_t::mkFloat8e5m2 => Fp8Format { decode: e5m2_to_f32, encode: f32_to_e5m2, largest: E5M2_MAX },
        other => panic!("{other:?} is not an fp8 type"),
    }
}

fn sync() -> mkernel::Result<()> {
    cudarc::driver::result::ctx::synchronize()
        .map_err(|e| cuda::cuda_err("cuCtxSynchronize (after the scaled GEMM kernel)", e))
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Inputs {
    ExactSums,
    Quantized,
}

/// Which operand: A's block scales are one per row per 128 of K, B's one per 128 rows.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Side {
    A,
    B,
}

/// One operand on the host: its fp8 bytes (row-major, `rows` × `k`) and its fp32 scales as
/// the mode lays them out (one; one per row; [K/128][M] for A or [K/128][ceil(N/128)] for B).
pub(crate) struct Operand {
    /// The bytes' type: mkFloat8e4m3 or mkFloat8e5m2.
    pub(crate) dtype: mkDataType_t,
    pub(crate) bytes: Vec<u8>,
    /// The bytes' values in `dtype`.
    pub(crate) values: Vec<f64>,
    pub(crate) scales: Vec<f32>,
    pub(crate) mode: mkScaleMode_t,
    pub(crate) side: Side,
    pub(crate) rows: usize,
}

impl Operand {
    fn row(&self, row: usize, k: usize) -> &[f64] {
        &self.values[row * k..(row + 1) * k]
    }
    /// The scale of `row`'s elements in K block `kb`.
    fn scale(&self, row: usize, kb: usize) -> f64 {
        let i = match (self.mode, self.side) {
            (mkScaleMode_t::mkScaleTensor, _) => 0,
            (mkScaleMode_t::mkScaleRowwise, _) => row,
            (mkScaleMode_t::mkScaleBlock, Side::A) => kb * self.rows + row,
            (mkScaleMode_t::mkScaleBlock, Side::B) => kb * self.rows.div_ceil(BLOCK) + row / BLOCK,
        };
        self.scales[i] as f64
    }
}

/// The scale group of element (row, k): the elements that share its scale.
fn group(mode: mkScaleMode_t, side: Side, row: usize, k: usize) -> (usize, usize) {
    match (mode, side) {
        (mkScaleMode_t::mkScaleTensor, _) => (0, 0),
        (mkScaleMode_t::mkScaleRowwise, _) => (row, 0),
        (mkScaleMode_t::mkScaleBlock, Side::A) => (row, k / BLOCK),
        (mkScaleMode_t::mkScaleBlock, Side::B) => (row / BLOCK, k / BLOCK),
    }
}

/// Fresh e4m3 inputs for `rows` × `k` of `side` under `mode`.
pub(crate) fn operand(side: Side, rows: usize, k: usize, mode: mkScaleMode_t, inputs: Inputs, seed: u64) -> Operand {
    operand_in(mkDataType_t::mkFloat8e4m3, side, rows, k, mode, inputs, seed)
}

/// Fresh inputs of fp8 type `dtype` for `rows` × `k` of `side` under `mode`.
pub(crate) fn operand_in(
    dtype: mkDataType_t,
    side: Side,
    rows: usize,
    k: usize,
    mode: mkScaleMode_t,
    inputs: Inputs,
    seed: u64,
) -> Operand {
    let Fp8Format { decode, encode, largest } = fp8_format(dtype);
    let kb = k.div_ceil(BLOCK);
    let (n_scales, index): (usize, Box<dyn Fn(usize, usize) -> usize>) = match (mode, side) {
        (mkScaleMode_t::mkScaleTensor, _) => (1, Box::new(|_, _| 0)),
        (mkScaleMode_t::mkScaleRowwise, _) => (rows, Box::new(|r, _| r)),
        (mkScaleMode_t::mkScaleBlock, Side::A) => (kb * rows, Box::new(move |r, b| b * rows + r)),
        (mkScaleMode_t::mkScaleBlock, Side::B) => {
            (kb * rows.div_ceil(BLOCK), Box::new(move |r, b| b * rows.div_ceil(BLOCK) + r))
        }
    };
    let unit: Vec<f64> = xorshift_unit(seed, rows * k + n_scales).collect();
    let (values, draws) = unit.split_at(rows * k);
    let (bytes, scales): (Vec<u8>, Vec<f32>) = match inputs {
        Inputs::ExactSums => {
            // Integers in [-4, 4]; scales 2^[-5, 1) with a mantissa that is no power of 2, so
            // their products round. The range keeps |C| far below fp16's 65504 at K = 8192
            // (sA·sB < 7.6, |a·b| <= 16: a random-sign sum of 8192 terms stays near 1e4).
            let bytes = values.iter().map(|u| encode(((u * 9.0).floor() - 4.0) as f32)).collect();
            let scales = draws.iter().map(|u| (2f64.powf(6.0 * u - 5.0) * 1.37) as f32).collect();
            (bytes, scales)
        }
        Inputs::Quantized => {
            // x uniform in [-1, 1); each scale group's amax maps to the type's largest value:
            // scale = amax / largest, stored x / scale rounded to the type, so the
            // dequantized value is the stored value · scale.
            let x: Vec<f32> = values.iter().map(|u| (2.0 * u - 1.0) as f32).collect();
            let mut amax = vec![1e-6f32; n_scales];
            for (i, v) in x.iter().enumerate() {
                let (g, b) = group(mode, side, i / k, i % k);
                let s = &mut amax[index(g, b)];
                *s = s.max(v.abs());
            }
            let scales: Vec<f32> = amax.iter().map(|a| a / largest).collect();
            let bytes = x
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    let (g, b) = group(mode, side, i / k, i % k);
                    encode(v / scales[index(g, b)])
                })
                .collect();
            (bytes, scales)
        }
    };
    let table: Vec<f64> = (0..=255u8).map(|b| decode(b) as f64).collect();
    let values = bytes.iter().map(|&b| table[b as usize]).collect();
    Operand { dtype, bytes, values, scales, mode, side, rows }
}

/// Float64 reference and per-element bound of the given rows of C (every column):
/// ref = Σ_kb sA·sB·S_kb over the 128-wide K blocks, S_kb = Σ_{k in kb} a·b. The bound: C's
/// rounding (u_C·|ref|) and underflow floor; the scales' fp32 roundings (two per term, 2⁻²³
/// relative, on |ref| for one scale of the whole sum, on Σ_kb|sA·sB·S_kb| for block scales)
/// and the fp32 promotion of the K/128 stage sums (γ_{K/128+1}(2⁻²³)·Σ_kb|sA·sB·S_kb|); for
/// quantized inputs also the fp8 accumulator's truncation inside each stage.
pub(crate) fn reference(
    a: &Operand,
    b: &Operand,
    rows: &[usize],
    n: usize,
    k: usize,
    out: mkDataType_t,
    inputs: Inputs,
) -> (Vec<f64>, Vec<f64>) {
    let u_out = unit_roundoff(out);
    let floor = underflow_floor(out);
    let u_scale = 2f64.powi(-23);
    let blocks = k.div_ceil(BLOCK);
    // A stage of the fp8 accumulator: 4 wgmma k32 steps, each at most 33 addends truncated
    // at 13 fraction bits below a binade of at most 2·Σ|stage terms|.
    let stage_rel = if inputs == Inputs::ExactSums { 0.0 } else { 4.0 * 33.0 * 2f64.powi(-13) * 2.0 };
    let promote = gamma(blocks + 1, u_scale);
    let per_row: Vec<(Vec<f64>, Vec<f64>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = rows
            .iter()
            .map(|&r| {
                scope.spawn(move || {
                    let mut value = Vec::with_capacity(n);
                    let mut bound = Vec::with_capacity(n);
                    let arow = a.row(r, k);
                    for c in 0..n {
                        let brow = b.row(c, k);
                        let (mut v, mut mag_blocks, mut mag_terms) = (0.0, 0.0, 0.0);
                        for kb in 0..blocks {
                            let (lo, hi) = (kb * BLOCK, ((kb + 1) * BLOCK).min(k));
                            let (mut sum, mut abs) = (0.0, 0.0);
                            for (x, y) in arow[lo..hi].iter().zip(&brow[lo..hi]) {
                                sum += x * y;
                                abs += (x * y).abs();
                            }
                            let s = a.scale(r, kb) * b.scale(c, kb);
                            v += sum * s;
                            mag_blocks += (sum * s).abs();
                            mag_terms += abs * s.abs();
                        }
                        let scaling =
                            u_scale * if a.mode == mkScaleMode_t::mkScaleBlock { mag_blocks } else { v.abs() };
                        value.push(v);
                        bound.push(
                            1.01 * (floor + u_out * v.abs() + scaling + promote * mag_blocks + stage_rel * mag_terms),
                        );
                    }
                    (value, bound)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("reference thread")).collect()
    });
    let mut value = Vec::with_capacity(rows.len() * n);
    let mut bound = Vec::with_capacity(rows.len() * n);
    for (v, b) in per_row {
        value.extend(v);
        bound.extend(b);
    }
    (value, bound)
}

/// The relative-L2 backstop (testing::tolerance) of a result: C's type's for exact sums;
/// for quantized inputs bf16's for both outputs, since there the fp8 tensor cores' sums
/// (13 fraction bits, truncated, over every 32 of K) err by more than fp16's rounding.
pub(crate) fn l2_limit(out: mkDataType_t, inputs: Inputs) -> f64 {
    match inputs {
        Inputs::ExactSums => tolerance(out),
        Inputs::Quantized => tolerance(mkDataType_t::mkBfloat16),
    }
}

/// Device copies of an operand's bytes and scales.
pub(crate) fn upload(op: &Operand) -> mkernel::Result<(TestBuffer, TestBuffer)> {
    let bytes = TestBuffer::new(op.bytes.len(), op.dtype)?;
    let scales = TestBuffer::new(op.scales.len(), mkDataType_t::mkFloat32)?;
    upload_into(op, &bytes, &scales)?;
    Ok((bytes, scales))
}

/// An operand's bytes and scales copied into device buffers of their sizes.
fn upload_into(op: &Operand, bytes: &TestBuffer, scales: &TestBuffer) -> mkernel::Result<()> {
    bytes.upload(&op.bytes)?;
    scales.upload(&op.scales.iter().flat_map(|s| s.to_le_bytes()).collect::<Vec<u8>>())
}

/// Rows of C checked: all where the float64 reference of every row is cheap (M·N·K up to
/// 2^28 multiply-adds), else the first, the last and two random ones. The reference runs on
/// the host for every case, scale mode and output type, so a shape such as 64×7168×8192
/// checked whole (3.8e9 per reference) kept the suite past two minutes on a GPU machine.
fn rows_to_check(m: usize, n: usize, k: usize, seed: u64) -> Vec<usize> {
    if m * n * k <= 1 << 28 || m <= 2 {
        return (0..m).collect();
    }
    let mut rows =
        vec![0, m - 1, 1 + (seed as usize) % (m - 2), 1 + (seed.wrapping_mul(0x9e37_79b9) as usize >> 7) % (m - 2)];
    rows.sort_unstable();
    rows.dedup();
    rows
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
    let mut seed = 0xf8f8_0000u64 + std::process::id() as u64;
    let (mut checks, mut failures) = (0usize, 0usize);

    let cases = [
        Case { m: 1, n: 64, k: 16 },
        Case { m: 1, n: 4096, k: 4096 },
        Case { m: 16, n: 300, k: 144 },
        Case { m: 129, n: 257, k: 272 },
        // Block scales over a partial last block of B's rows (N = 300) and of A's tile.
        Case { m: 129, n: 300, k: 384 },
        Case { m: 200, n: 1000, k: 1040 },
        Case { m: 512, n: 1024, k: 2048 },
        Case { m: 4096, n: 4096, k: 4096 },
        Case { m: 64, n: 7168, k: 8192 },
    ];
    for case in &cases {
        let (m, n, k) = (case.m, case.n, case.k);
        let inputs_of_each_a =
            A_TYPES.iter().flat_map(|&t| [Inputs::ExactSums, Inputs::Quantized].map(move |i| (t, i)));
        for (a_type, inputs) in inputs_of_each_a {
            for mode in MODES.into_iter().filter(|&mode| mode != mkScaleMode_t::mkScaleBlock || k % BLOCK == 0) {
                seed += 2;
                let a = operand_in(a_type, Side::A, m, k, mode, inputs, seed);
                let b = operand(Side::B, n, k, mode, inputs, seed + 1);
                let (a_dev, sa_dev) = upload(&a)?;
                let (b_dev, sb_dev) = upload(&b)?;
                let rows = rows_to_check(m, n, k, seed);
                for out in OUTPUTS {
                    let (want, bound) = reference(&a, &b, &rows, n, k, out, inputs);
                    let c = TestBuffer::new(m * n, out)?;
                    let args = ScaledGemmArgs {
                        a: a_dev.ptr(),
                        scale_a: sa_dev.ptr(),
                        b: b_dev.ptr(),
                        scale_b: sb_dev.ptr(),
                        c: c.ptr(),
                        m,
                        n,
                        k,
                        a_type,
                        b_type: mkDataType_t::mkFloat8e4m3,
                        out,
                        mode,
                    };
                    let planned = scaled::plan(m, n, sms, args.tma_epilogue_ok());
                    // The planned kernel, then every other tile width and the direct epilogue.
                    let mut plans: Vec<ScaledPlan> = vec![planned];
                    for bn in TILE_WIDTHS {
                        for epilogue in [Epilogue::Tma, Epilogue::Direct] {
                            let p = scaled::plan_tile(m, n, sms, bn, epilogue);
                            let allowed = epilogue == Epilogue::Direct || args.tma_epilogue_ok();
                            if allowed && !plans.contains(&p) {
                                plans.push(p);
                            }
                        }
                    }
                    for plan in plans {
                        c.poison(s)?;
                        scaled::launch(&args, &plan, s)
                            .map_err(|e| e.context(format!("M {m} N {n} K {k} {plan:?}")))?;
                        sync().map_err(|e| e.context(format!("M {m} N {n} K {k} {plan:?}")))?;
                        let all = to_f64(&c.download()?, out);
                        let nonfinite = all.iter().filter(|v| !v.is_finite()).count();
                        let got: Vec<f64> =
                            rows.iter().flat_map(|&r| all[r * n..(r + 1) * n].iter().copied()).collect();
                        let verdict = check_close(&got, &want, &bound, l2_limit(out, inputs));
                        let guards = c.guards_intact()?;
                        let ok = verdict.passed() && nonfinite == 0 && guards.is_none();
                        checks += 1;
                        failures += usize::from(!ok);
                        println!(
                            "  scaled gemm {m:>4}x{n:>5}x{k:>5} {}xe4m3->{} {:?} {:?} bn {} {:?} ctas {:>3}{}, {} rows: {verdict}, {nonfinite} non-finite{} -> {}",
                            a_type.name(),
                            out.name(),
                            mode,
                            inputs,
                            plan.bn,
                            plan.epilogue,
                            plan.grid,
                            if plan == planned { " (planned)" } else { "" },
                            rows.len(),
                            guards.map_or(String::new(), |w| format!("; GUARD {w}")),
                            if ok { "ok" } else { "WRONG" }
                        );
                    }
                }
            }
        }
    }

    for (c2, f2) in [entry_point(&mut seed)?, graph_replay(&mut seed)?] {
        checks += c2;
        failures += f2;
    }

    outcome::count(checks);
    println!("  gemm_fp8: {checks} checks, {failures} failed");
    if failures > 0 {
        return Err(MkError::internal(format!("{failures} of {checks} scaled GEMM checks failed")));
    }
    Ok(Outcome::Ran)
}

/// A scaled GEMM through the C ABI: mkScaledGemm where A's type is B's (its one abType),
/// else mkScaledGemmMixed. Returns its result; the arguments are device pointers of the
/// sizes stated or pointers the call refuses before any access.
#[allow(clippy::too_many_arguments)] // mirrors the C signature
fn call_entry(
    a: u64,
    sa: u64,
    b: u64,
    sb: u64,
    c: u64,
    (m, n, k): (usize, usize, usize),
    (a_type, b_type, out): (mkDataType_t, mkDataType_t, mkDataType_t),
    mode: i32,
    stream: mkernel::cuda::sys::CUstream,
) -> mkResult_t {
    let (a, sa, b, sb, c) =
        (a as *const c_void, sa as *const f32, b as *const c_void, sb as *const f32, c as *mut c_void);
    // SAFETY: the caller's contract above; `stream` is live (or NULL, the legacy stream).
    unsafe {
        if a_type == b_type {
            mkernel::ffi::gemm::mkScaledGemm(a, sa, b, sb, c, m, n, k, a_type as i32, out as i32, mode, stream)
        } else {
            let (ta, tb, tc) = (a_type as i32, b_type as i32, out as i32);
            mkernel::ffi::gemm::mkScaledGemmMixed(a, sa, b, sb, c, m, n, k, ta, tb, tc, mode, stream)
        }
    }
}

/// The C entry points: for each type of A a real call (rowwise, bf16; mkScaledGemm for e4m3
/// A, mkScaledGemmMixed for e5m2 A), then each refusal, with C poisoned before and still all
/// poison after (nothing written). Returns (checks, failures).
fn entry_point(seed: &mut u64) -> mkernel::Result<(usize, usize)> {
    let s = std::ptr::null_mut();
    let (m, n, k) = (300, 520, 272);
    let mode = mkScaleMode_t::mkScaleRowwise;
    let (e4m3, e5m2) = (mkDataType_t::mkFloat8e4m3, mkDataType_t::mkFloat8e5m2);
    let out = mkDataType_t::mkBfloat16;
    let c = TestBuffer::new(m * n, out)?;
    let rows: Vec<usize> = (0..m).collect();
    let (mut checks, mut failures) = (0, 0);
    let mut last = None;
    for a_type in A_TYPES {
        *seed += 2;
        let a = operand_in(a_type, Side::A, m, k, mode, Inputs::Quantized, *seed);
        let b = operand(Side::B, n, k, mode, Inputs::Quantized, *seed + 1);
        let (a_dev, sa_dev) = upload(&a)?;
        let (b_dev, sb_dev) = upload(&b)?;
        let (want, bound) = reference(&a, &b, &rows, n, k, out, Inputs::Quantized);
        c.poison(s)?;
        let (pa, psa, pb, psb) = (a_dev.ptr(), sa_dev.ptr(), b_dev.ptr(), sb_dev.ptr());
        let r = call_entry(pa, psa, pb, psb, c.ptr(), (m, n, k), (a_type, e4m3, out), mode as i32, s);
        sync()?;
        let verdict = check_close(&c.download_f64()?, &want, &bound, l2_limit(out, Inputs::Quantized));
        let ok = r == mkResult_t::mkSuccess && verdict.passed() && c.guards_intact()?.is_none();
        checks += 1;
        failures += usize::from(!ok);
        let entry = if a_type == e4m3 { "mkScaledGemm" } else { "mkScaledGemmMixed" };
        println!(
            "  {entry} {m}x{n}x{k} {}xe4m3 rowwise -> bf16: {r:?} {verdict} -> {}",
            a_type.name(),
            if ok { "ok" } else { "WRONG" }
        );
        last = Some((a_dev, sa_dev, b_dev, sb_dev));
    }
    let (a_dev, sa_dev, b_dev, sb_dev) = last.expect("A_TYPES is not empty");

    // C poisoned again: the refused calls below must leave it so.
    c.poison(s)?;
    sync()?;
    let (pa, psa, pb, psb) = (a_dev.ptr(), sa_dev.ptr(), b_dev.ptr(), sb_dev.ptr());
    let call = |a: u64, sa: u64, b: u64, sb: u64, k: usize, types: (mkDataType_t, mkDataType_t), mode: i32| {
        call_entry(a, sa, b, sb, c.ptr(), (m, n, k), (types.0, types.1, out), mode, s)
    };
    let rowwise = mode as i32;
    let block = mkScaleMode_t::mkScaleBlock as i32;
    let refusals: [(&str, mkResult_t); 10] = [
        ("scaleA NULL", call(pa, 0, pb, psb, k, (e4m3, e4m3), rowwise)),
        ("scaleB NULL", call(pa, psa, pb, 0, k, (e4m3, e4m3), rowwise)),
        ("scaleA misaligned", call(pa, psa + 2, pb, psb, k, (e4m3, e4m3), rowwise)),
        ("A misaligned", call(pa + 8, psa, pb, psb, k, (e4m3, e4m3), rowwise)),
        ("K = 264 (not a multiple of 16)", call(pa, psa, pb, psb, 264, (e4m3, e4m3), rowwise)),
        ("B in e5m2 refused (mkScaledGemm, abType e5m2)", call(pa, psa, pb, psb, k, (e5m2, e5m2), rowwise)),
        ("B in e5m2 refused (mkScaledGemmMixed, e4m3 A)", {
            // SAFETY: as call_entry's: live buffers, a call refused before any access.
            unsafe {
                mkernel::ffi::gemm::mkScaledGemmMixed(
                    pa as *const c_void,
                    psa as *const f32,
                    pb as *const c_void,
                    psb as *const f32,
                    c.ptr() as *mut c_void,
                    m,
                    n,
                    k,
                    e4m3 as i32,
                    e5m2 as i32,
                    out as i32,
                    rowwise,
                    s,
                )
            }
        }),
        ("e5m2 A, scaleB NULL", call(pa, psa, pb, 0, k, (e5m2, e4m3), rowwise)),
        ("scale mode 3", call(pa, psa, pb, psb, k, (e4m3, e4m3), 3)),
        ("block scales with K = 272 (not a multiple of 128)", call(pa, psa, pb, psb, k, (e5m2, e4m3), block)),
    ];
    for (what, r) in refusals {
        let ok = r == mkResult_t::mkInvalidArgument;
        checks += 1;
        failures += usize::from(!ok);
        println!("  scaled GEMM entry {what}: {r:?} -> {}", if ok { "ok" } else { "WRONG" });
    }
    // Nothing was written by the refused calls: C is still all poison (0xFF bytes).
    let untouched = c.download()?.iter().all(|&b| b == 0xff);
    checks += 1;
    failures += usize::from(!untouched);
    println!("  scaled GEMM refusals wrote nothing: {}", if untouched { "ok" } else { "WRONG" });
    Ok((checks, failures))
}

/// How many times a captured scaled GEMM is replayed.
const REPLAYS: u64 = 3;

/// One scaled GEMM call per type of A (mkScaledGemm for e4m3, mkScaledGemmMixed for e5m2;
/// block scales, partial tiles in M and N, fp16 out) captured in a CUDA graph on a
/// non-default stream, then replayed three times, each time on fresh inputs and scales
/// copied into the captured buffers and C poisoned, and each replay checked element-wise:
/// the graph recomputes from what the buffers hold, not from what they held at capture.
/// Returns (checks, failures).
fn graph_replay(seed: &mut u64) -> mkernel::Result<(usize, usize)> {
    let (m, n, k) = (200, 392, 512);
    let mode = mkScaleMode_t::mkScaleBlock;
    let out = mkDataType_t::mkFloat16;
    let rows: Vec<usize> = (0..m).collect();
    let (mut checks, mut failures) = (0, 0);
    for a_type in A_TYPES {
        *seed += 2;
        let fresh = |seed: u64| {
            let a = operand_in(a_type, Side::A, m, k, mode, Inputs::Quantized, seed);
            (a, operand(Side::B, n, k, mode, Inputs::Quantized, seed + 1))
        };
        let (a, b) = fresh(*seed);
        let (a_dev, sa_dev) = upload(&a)?;
        let (b_dev, sb_dev) = upload(&b)?;
        let c = TestBuffer::new(m * n, out)?;
        let stream = cudarc::driver::result::stream::create(cudarc::driver::result::stream::StreamKind::NonBlocking)
            .map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
        // The call's own result is checked below, as a wrong result is: a capture that
        // fails otherwise ends the suite with its error.
        let mut r = mkResult_t::mkInternalError;
        let (pa, psa, pb, psb) = (a_dev.ptr(), sa_dev.ptr(), b_dev.ptr(), sb_dev.ptr());
        let types = (a_type, mkDataType_t::mkFloat8e4m3, out);
        let graph = CapturedGraph::capture(stream, |s| {
            r = call_entry(pa, psa, pb, psb, c.ptr(), (m, n, k), types, mode as i32, s);
            Ok(())
        });
        let mut ok = r == mkResult_t::mkSuccess;
        let mut details = Vec::new();
        match graph {
            Ok(graph) => {
                for replay in 0..REPLAYS {
                    *seed += 2;
                    let (a, b) = fresh(*seed);
                    upload_into(&a, &a_dev, &sa_dev)?;
                    upload_into(&b, &b_dev, &sb_dev)?;
                    c.poison(std::ptr::null_mut())?;
                    sync()?;
                    graph.launch(stream)?;
                    sync()?;
                    let (want, bound) = reference(&a, &b, &rows, n, k, out, Inputs::Quantized);
                    let verdict = check_close(&c.download_f64()?, &want, &bound, l2_limit(out, Inputs::Quantized));
                    let replay_ok = verdict.passed() && c.guards_intact()?.is_none();
                    details.push(format!("replay {replay}: {verdict}{}", if replay_ok { "" } else { " WRONG" }));
                    ok &= replay_ok;
                }
            }
            Err(e) => {
                ok = false;
                details.push(format!("capture failed: {}", e.message));
            }
        }
        // SAFETY: destroyed once, after the last replay completed (or the capture failed);
        // the graph was dropped at the end of its match arm.
        let _ = unsafe { cudarc::driver::result::stream::destroy(stream) };
        checks += 1;
        failures += usize::from(!ok);
        println!(
            "  scaled GEMM in a CUDA graph {m}x{n}x{k} {}xe4m3 block -> {}: {r:?}, {REPLAYS} replays: {} -> {}",
            a_type.name(),
            out.name(),
            details.join(" | "),
            if ok { "ok" } else { "WRONG" }
        );
    }
    Ok((checks, failures))
}
