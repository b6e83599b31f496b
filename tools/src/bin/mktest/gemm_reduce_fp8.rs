//! mkScaledGemmReduceScatter and mkScaledGemmAllReduce on the GPU with MK_TEST_NRANKS ranks
//! (processes sharing the GPU under MPS, one per GPU, or rank threads with
//! MK_TEST_THREADS=1); one rank runs the scaled GEMM alone.
//!
//! Per rank: both ops × both output types × the three scale modes (block where K is a
//! multiple of 128) × shapes (decode sizes, the smallest K (16) and N (8), M off the tile
//! grid, the one-shot and two-phase AllReduce, partial 128-row blocks of B's scales), each
//! twice with fresh inputs (the device-side epochs advance): once with exact-sum inputs, once
//! quantized as a user quantizes (gemm_fp8.rs says what each proves). Every rank generates
//! every rank's A, B and scales from the same seeds, so it knows every partial; C is checked
//! element by element against float64 of Σ_r (A_r·sA_r)(B_r·sB_r)ᵀ of the dequantized inputs.
//! The bound: each rank's partial is mkScaledGemm's result, within gemm_fp8.rs's bound b_r
//! of its float64 value p_r (its rounding to C's type included); the n partials are summed
//! in fp32 and rounded once: Σ_r b_r (carried through the final rounding: ·(1 + u_C)) plus
//! the sum's Rule::reduction(C, n) bound over Σ_r (|p_r| + b_r). With one rank, b_0 alone.
//! Every row of a small C is checked, else sampled rows; C starts NaN-poisoned, no element
//! may stay non-finite, every buffer's guard bands must be intact, and AllReduce outputs
//! must be bitwise identical on every rank. Per tensor, each rank's scales are its own (the
//! op's contract), so a rank's partial scaled by another's scale fails. Then the C entry
//! points' refusals (nothing written), capture in a CUDA graph with replays on fresh inputs,
//! and, with several ranks, a rank that never calls: the others stop within the timeout.

use crate::collectives::say;
use crate::fused_common::{self, Captured, CheckedOutput, FusedCase, SameOnEveryRank};
use crate::gemm_fp8::{self, Inputs, Operand, Side, BLOCK, MODES, OUTPUTS};
use crate::outcome::Outcome;
use crate::ranks::RankEnv;
use mkernel::comm::Comm;
use mkernel::cuda::sys;
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::fused::{mkScaledGemmAllReduce, mkScaledGemmReduceScatter};
use mkernel::ffi::mkComm_t;
use mkernel::types::{mkDataType_t, mkScaleMode_t};
use mkernel_tools::testing::{check_close, to_f64, unit_roundoff, Rule, TestBuffer};
use std::cell::{Cell, RefCell};
use std::ffi::c_void;

pub fn run() -> Result<Outcome> {
    fused_common::run_suite(
        "gemm_reduce_fp8",
        |comm, control, rank, n| {
            correctness(comm, control, rank, n)
                .and_then(|_| refusals(comm, rank, n))
                .and_then(|_| graph_replay(comm, rank, n))
        },
        absent_rank,
    )
}

/// One problem: this rank's A and B (its K slice) with their scales, C (this rank's rows of
/// the sum, or all of it), each between guard bands; every rank's host inputs of the last
/// `prepare`.
struct Case {
    scatter: bool,
    out: mkDataType_t,
    mode: mkScaleMode_t,
    m: usize,
    n: usize,
    k: usize,
    nranks: usize,
    rank: usize,
    a: TestBuffer,
    scale_a: TestBuffer,
    b: TestBuffer,
    scale_b: TestBuffer,
    c: TestBuffer,
    inputs: Cell<Inputs>,
    /// The seed of the last `prepare` (it also picks the rows checked of a large C).
    seed: Cell<u64>,
    /// Every rank's (A, B) of the last `prepare`.
    host: RefCell<Option<Vec<(Operand, Operand)>>>,
}

/// Scales of an operand of `rows` rows under `mode` (A's layouts; B's block scales are one
/// per 128 rows).
fn scale_count(mode: mkScaleMode_t, side: Side, rows: usize, k: usize) -> usize {
    match (mode, side) {
        (mkScaleMode_t::mkScaleTensor, _) => 1,
        (mkScaleMode_t::mkScaleRowwise, _) => rows,
        (mkScaleMode_t::mkScaleBlock, Side::A) => k / BLOCK * rows,
        (mkScaleMode_t::mkScaleBlock, Side::B) => k / BLOCK * rows.div_ceil(BLOCK),
    }
}

fn scale_bytes(scales: &[f32]) -> Vec<u8> {
    scales.iter().flat_map(|s| s.to_le_bytes()).collect()
}

impl Case {
    #[allow(clippy::too_many_arguments)]
    fn new(
        scatter: bool,
        out: mkDataType_t,
        mode: mkScaleMode_t,
        m: usize,
        n: usize,
        k: usize,
        nranks: usize,
        rank: usize,
    ) -> Result<Case> {
        let f32s = |count| TestBuffer::new(count, mkDataType_t::mkFloat32);
        let rows_out = if scatter { m / nranks } else { m };
        Ok(Case {
            scatter,
            out,
            mode,
            m,
            n,
            k,
            nranks,
            rank,
            a: TestBuffer::new(m * k, mkDataType_t::mkFloat8e4m3)?,
            scale_a: f32s(scale_count(mode, Side::A, m, k))?,
            b: TestBuffer::new(n * k, mkDataType_t::mkFloat8e4m3)?,
            scale_b: f32s(scale_count(mode, Side::B, n, k))?,
            c: TestBuffer::new(rows_out * n, out)?,
            inputs: Cell::new(Inputs::Quantized),
            seed: Cell::new(0),
            host: RefCell::new(None),
        })
    }

    fn op(&self) -> &'static str {
        if self.scatter {
            "mkScaledGemmReduceScatter"
        } else {
            "mkScaledGemmAllReduce"
        }
    }

    /// Rows of the sum this rank receives: [first, end).
    fn output_rows(&self) -> (usize, usize) {
        if self.scatter {
            (self.rank * self.m / self.nranks, (self.rank + 1) * self.m / self.nranks)
        } else {
            (0, self.m)
        }
    }

    /// Rows of the sum checked: all where the float64 references of every rank are cheap,
    /// else the first, the last and a seeded one, and the first row of every owner's block
    /// (another rank reduced it, for the two-phase AllReduce).
    fn rows_to_check(&self) -> Vec<usize> {
        let (r0, r1) = self.output_rows();
        if r1 <= r0 {
            return vec![];
        }
        if (r1 - r0) * self.n * self.k * self.nranks <= 1 << 28 {
            return (r0..r1).collect();
        }
        let mut rows = vec![r0, r1 - 1, r0 + self.seed.get() as usize % (r1 - r0)];
        if !self.scatter {
            rows.extend((0..self.nranks).map(|q| q * self.m / self.nranks));
        }
        rows.sort_unstable();
        rows.dedup();
        rows
    }

    fn call(&self, comm: mkComm_t, stream: sys::CUstream, bad: &Bad) -> mkResult_t {
        let f = if self.scatter { mkScaledGemmReduceScatter } else { mkScaledGemmAllReduce };
        let ab = bad.ab.unwrap_or(mkDataType_t::mkFloat8e4m3);
        // SAFETY: device buffers of the sizes the op expects, or arguments it refuses
        // before any access.
        unsafe {
            f(
                (bad.a.unwrap_or(self.a.ptr()) + bad.a_offset) as *const c_void,
                bad.scale_a.unwrap_or(self.scale_a.ptr()) as *const f32,
                self.b.ptr() as *const c_void,
                bad.scale_b.unwrap_or(self.scale_b.ptr()) as *const f32,
                (self.c.ptr() + bad.c_offset) as *mut c_void,
                bad.m.unwrap_or(self.m),
                self.n,
                bad.k.unwrap_or(self.k),
                ab as i32,
                bad.out.unwrap_or(self.out) as i32,
                bad.mode.unwrap_or(self.mode as i32),
                comm,
                stream,
            )
        }
    }
}

/// One broken argument of a refused call (None: the case's own).
#[derive(Default)]
struct Bad {
    /// A in place of the case's (host memory, say).
    a: Option<u64>,
    a_offset: u64,
    scale_a: Option<u64>,
    scale_b: Option<u64>,
    c_offset: u64,
    m: Option<usize>,
    k: Option<usize>,
    ab: Option<mkDataType_t>,
    out: Option<mkDataType_t>,
    mode: Option<i32>,
}

impl FusedCase for Case {
    fn label(&self) -> String {
        format!(
            "{} e4m3->{} {:?} {:?} M={} N={} K={}",
            if self.scatter { "GEMM+RS" } else { "GEMM+AR" },
            self.out.name(),
            self.mode,
            self.inputs.get(),
            self.m,
            self.n,
            self.k
        )
    }

    /// Fresh inputs: rank r's A and B from seeds (seed, 2r) and (seed, 2r + 1) on every rank
    /// (so every rank knows every partial); this rank's uploaded, C poisoned with NaN.
    fn prepare(&self, seed: u64) -> Result<()> {
        let (m, n, k, mode, inputs) = (self.m, self.n, self.k, self.mode, self.inputs.get());
        let operands: Vec<(Operand, Operand)> = (0..self.nranks as u64)
            .map(|r| {
                (
                    gemm_fp8::operand(Side::A, m, k, mode, inputs, seed * 1000 + 2 * r),
                    gemm_fp8::operand(Side::B, n, k, mode, inputs, seed * 1000 + 2 * r + 1),
                )
            })
            .collect();
        let (a, b) = &operands[self.rank];
        self.a.upload(&a.bytes)?;
        self.scale_a.upload(&scale_bytes(&a.scales))?;
        self.b.upload(&b.bytes)?;
        self.scale_b.upload(&scale_bytes(&b.scales))?;
        self.c.poison(std::ptr::null_mut())?;
        *self.host.borrow_mut() = Some(operands);
        self.seed.set(seed);
        fused_common::sync_default_stream()
    }

    fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        self.call(comm, stream, &Bad::default())
    }

    fn verify(&self) -> Result<(bool, String)> {
        self.verify_with_output().map(|(ok, detail, _)| (ok, detail))
    }
}

impl CheckedOutput for Case {
    /// (passed, detail, raw C): the checked rows element-wise against the float64 sum of the
    /// dequantized partials (`reduced_reference`), no element of C left non-finite (poison),
    /// every guard band intact.
    fn verify_with_output(&self) -> Result<(bool, String, Vec<u8>)> {
        let host = self.host.borrow();
        let host = host.as_ref().ok_or_else(|| MkError::internal("verify before prepare"))?;
        let rows = self.rows_to_check();
        let (want, bound) = reduced_reference(host, &rows, self.n, self.k, self.out, self.inputs.get());
        let raw = self.c.download()?;
        let all = to_f64(&raw, self.out);
        let nonfinite = all.iter().filter(|v| !v.is_finite()).count();
        let first = self.output_rows().0;
        let got: Vec<f64> =
            rows.iter().flat_map(|&r| all[(r - first) * self.n..(r - first + 1) * self.n].iter().copied()).collect();
        let verdict = check_close(&got, &want, &bound, gemm_fp8::l2_limit(self.out, self.inputs.get()));
        let buffers =
            [("C", &self.c), ("A", &self.a), ("scaleA", &self.scale_a), ("B", &self.b), ("scaleB", &self.scale_b)];
        let guards = fused_common::guards_intact(&buffers)?;
        let ok = verdict.passed() && nonfinite == 0 && guards.is_none();
        let detail = format!(
            "C ({} rows): {verdict}, {nonfinite} non-finite{}",
            rows.len(),
            guards.map_or(String::new(), |w| format!("; GUARD {w}"))
        );
        Ok((ok, detail, raw))
    }
}

/// Rows `rows` (every column) of Σ_r (A_r·sA_r)(B_r·sB_r)ᵀ in float64 over every rank's
/// operands, and each element's bound (see the top of this file): each partial within
/// gemm_fp8's bound, the fp32 sum of n partials and its one rounding to `out`.
fn reduced_reference(
    operands: &[(Operand, Operand)],
    rows: &[usize],
    n: usize,
    k: usize,
    out: mkDataType_t,
    inputs: Inputs,
) -> (Vec<f64>, Vec<f64>) {
    let partials: Vec<(Vec<f64>, Vec<f64>)> =
        operands.iter().map(|(a, b)| gemm_fp8::reference(a, b, rows, n, k, out, inputs)).collect();
    combine_partials(&partials, out)
}

/// The float64 sum of the ranks' partials (value, bound per element) and its bound: one
/// rank's alone (the scaled GEMM writes C); with several, every partial's bound, carried
/// through the sum's rounding, plus the fp32 sum's and its rounding's (Rule::reduction over
/// Σ(|p_r| + b_r), a bound on Σ|partial as stored|).
fn combine_partials(partials: &[(Vec<f64>, Vec<f64>)], out: mkDataType_t) -> (Vec<f64>, Vec<f64>) {
    if partials.len() == 1 {
        return partials[0].clone();
    }
    let sum_rule = Rule::reduction(out, partials.len());
    let u = unit_roundoff(out);
    let len = partials[0].0.len();
    let mut value = Vec::with_capacity(len);
    let mut bound = Vec::with_capacity(len);
    for i in 0..len {
        let (mut total, mut magnitude, mut slack) = (0.0, 0.0, 0.0);
        for (v, b) in partials {
            total += v[i];
            magnitude += v[i].abs() + b[i];
            slack += b[i];
        }
        value.push(total);
        bound.push(slack * (1.0 + u) + sum_rule.bound(total, magnitude));
    }
    (value, bound)
}

/// (M, N, K) of each op's cases with `n` ranks. ReduceScatter: decode sizes of 1-16 rows per
/// rank, the smallest K (16) and N (8), rows per rank that straddle tiles, K not a multiple
/// of 128, a partial last 128-row block of B. AllReduce: decode sizes and odd M (one-shot),
/// M = n·384 and n·256 (two-phase with several ranks), M = n·200 + 3 (one-shot: not whole
/// owner blocks).
fn shapes(scatter: bool, n: usize) -> Vec<(usize, usize, usize)> {
    if scatter {
        vec![
            (n, 264, 128),
            (n * 4, 8, 16),
            (n * 16, 136, 256),
            (n * 97, 264, 384),
            (n * 128, 520, 128),
            (n * 200, 1000, 1024),
            (n * 333, 776, 272),
        ]
    } else {
        vec![
            (1, 264, 128),
            (3, 264, 16),
            (16, 8, 256),
            (64, 1032, 384),
            (255, 776, 272),
            (n * 200 + 3, 392, 128),
            (n * 384, 776, 256),
            (n * 256, 1032, 1024),
        ]
    }
}

fn outputs() -> &'static [mkDataType_t] {
    if fused_common::sanitizer_sized() {
        &OUTPUTS[..1]
    } else {
        &OUTPUTS
    }
}

/// Every case, round 0 with exact-sum inputs and round 1 quantized: GEMM+RS then GEMM+AR,
/// AllReduce outputs also bit for bit the same on every rank.
fn correctness(comm: mkComm_t, control: &Comm, rank: usize, n: usize) -> Result<()> {
    let (mut checks, mut failures) = (0, 0);
    for scatter in [true, false] {
        for &out in outputs() {
            for mode in MODES {
                for (m, cols, k) in shapes(scatter, n) {
                    if mode == mkScaleMode_t::mkScaleBlock && k % BLOCK != 0 {
                        continue;
                    }
                    let case = Case::new(scatter, out, mode, m, cols, k, n, rank)?;
                    let checked: &dyn FusedCase =
                        if scatter { &case } else { &SameOnEveryRank { case: &case, control } };
                    let (c, f) = fused_common::check_rounds(comm, rank, case.op(), checked, 31, 2, &|round| {
                        case.inputs.set(if round == 0 { Inputs::ExactSums } else { Inputs::Quantized })
                    })?;
                    checks += c;
                    failures += f;
                }
            }
        }
    }
    fused_common::count_checks(rank, "scaled GEMM + reduction", checks, failures)
}

/// Every rule the entry points check, each broken once per op: mkInvalidArgument, and C
/// (poisoned before) still all poison after: nothing was launched. No rank launches, so
/// the ranks need not agree on anything here.
fn refusals(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let (mut checks, mut failures) = (0, 0);
    // 16-byte aligned host memory: refused as host memory, not for its alignment.
    let host = vec![0u128; (n * 64 * 272).div_ceil(16)];
    for scatter in [true, false] {
        let case =
            Case::new(scatter, mkDataType_t::mkBfloat16, mkScaleMode_t::mkScaleRowwise, n * 64, 264, 272, n, rank)?;
        case.prepare(7)?;
        let mut cases: Vec<(&str, Bad)> = vec![
            ("scaleA NULL", Bad { scale_a: Some(0), ..Default::default() }),
            ("scaleA misaligned", Bad { scale_a: Some(case.scale_a.ptr() + 2), ..Default::default() }),
            ("scaleB NULL", Bad { scale_b: Some(0), ..Default::default() }),
            ("scaleB misaligned", Bad { scale_b: Some(case.scale_b.ptr() + 1), ..Default::default() }),
            ("A misaligned", Bad { a_offset: 8, ..Default::default() }),
            ("A in host memory", Bad { a: Some(host.as_ptr() as u64), ..Default::default() }),
            ("C misaligned", Bad { c_offset: 8, ..Default::default() }),
            ("K = 264 (not a multiple of 16)", Bad { k: Some(264), ..Default::default() }),
            ("block scales with K = 272", Bad { mode: Some(mkScaleMode_t::mkScaleBlock as i32), ..Default::default() }),
            ("scale mode 3", Bad { mode: Some(3), ..Default::default() }),
            ("e5m2 operands", Bad { ab: Some(mkDataType_t::mkFloat8e5m2), ..Default::default() }),
            ("bf16 operands", Bad { ab: Some(mkDataType_t::mkBfloat16), ..Default::default() }),
            ("fp8 C", Bad { out: Some(mkDataType_t::mkFloat8e4m3), ..Default::default() }),
        ];
        if scatter && n > 1 {
            cases.push(("M not divisible by nranks", Bad { m: Some(case.m + 1), ..Default::default() }));
        }
        for (what, bad) in &cases {
            let r = case.call(comm, std::ptr::null_mut(), bad);
            let ok = r == mkResult_t::mkInvalidArgument;
            checks += 1;
            failures += usize::from(!ok);
            if !ok || rank == 0 {
                say(rank, format!("{} {what}: {r:?} -> {}", case.op(), if ok { "ok" } else { "WRONG" }));
            }
        }
        fused_common::sync_default_stream()?;
        let untouched = case.c.download()?.iter().all(|&b| b == 0xff);
        checks += 1;
        failures += usize::from(!untouched);
        say(rank, format!("{} refusals wrote nothing: {}", case.op(), if untouched { "ok" } else { "WRONG" }));
    }
    fused_common::count_checks(rank, "scaled GEMM + reduction refusals", checks, failures)
}

/// One graph of three launches (GEMM+RS with block scales; one-shot GEMM+AR rowwise in
/// fp16; GEMM+AR per tensor, two-phase when n > 1), replayed with fresh inputs, the
/// one-shot GEMM+AR called directly between replays.
fn graph_replay(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    use mkDataType_t::{mkBfloat16, mkFloat16};
    use mkScaleMode_t::{mkScaleBlock, mkScaleRowwise, mkScaleTensor};
    let rs = Case::new(true, mkBfloat16, mkScaleBlock, n * 160, 392, 256, n, rank)?;
    let ar = Case::new(false, mkFloat16, mkScaleRowwise, 33, 264, 128, n, rank)?;
    let ar_two_phase = Case::new(false, mkBfloat16, mkScaleTensor, n * 384, 264, 128, n, rank)?;
    let captured = [
        Captured { case: &rs, capture_seed: 1, replay_seed: 10 },
        Captured { case: &ar, capture_seed: 2, replay_seed: 20 },
        Captured { case: &ar_two_phase, capture_seed: 3, replay_seed: 40 },
    ];
    fused_common::graph_replay_of(comm, rank, "scaled GEMM + reduction", &captured, 1, 30)
}

fn absent_rank(env: &RankEnv, control: &Comm) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let bf16 = mkDataType_t::mkBfloat16;
    let case = Case::new(true, bf16, mkScaleMode_t::mkScaleTensor, n * 256, 1024, 512, n, rank)?;
    fused_common::absent_rank(env, control, 2, "mkScaledGemmReduceScatter (a rank absent)", |comm, stream| {
        case.prepare(5)?;
        Ok(case.launch(comm, stream))
    })?;
    // The one-shot AllReduce (M = 200 is not a multiple of 128): every rank waits for every
    // peer's partials, so the absent rank is seen by all.
    let case = Case::new(false, bf16, mkScaleMode_t::mkScaleBlock, 200, 1024, 512, n, rank)?;
    fused_common::absent_rank(env, control, 3, "mkScaledGemmAllReduce (a rank absent)", |comm, stream| {
        case.prepare(6)?;
        Ok(case.launch(comm, stream))
    })
}

#[cfg(test)]
mod tests {
    //! The bound against the arithmetic the header documents, simulated on the CPU: each
    //! rank's partial rounded to C's type, the partials summed in f32 in rank order and
    //! rounded once; a lost partial fails.
    use super::*;
    use mkernel_tools::testing::round_to;

    /// The ranks' partials as the kernel stores them (the float64 value rounded to `out`:
    /// within each partial's bound, which the scaled GEMM's own suite checks), summed in f32
    /// in rank order, rounded once; `drop` leaves rank r's partial out of element i.
    fn simulated(partials: &[(Vec<f64>, Vec<f64>)], out: mkDataType_t, drop: Option<(usize, usize)>) -> Vec<f64> {
        let stored = |r: usize, i: usize| -> f32 {
            let p = partials[r].0[i];
            if partials.len() > 1 {
                round_to(out, p) as f32
            } else {
                p as f32
            }
        };
        (0..partials[0].0.len())
            .map(|i| {
                let total = (0..partials.len()).filter(|&r| drop != Some((i, r))).fold(0f32, |s, r| s + stored(r, i));
                round_to(out, total as f64)
            })
            .collect()
    }

    #[test]
    fn summed_partials_pass_and_a_missing_one_fails() {
        let (m, n, k) = (6, 40, 256);
        for out in OUTPUTS {
            for mode in MODES {
                for inputs in [Inputs::ExactSums, Inputs::Quantized] {
                    for nr in [1, 2, 4, 8] {
                        let operands: Vec<(Operand, Operand)> = (0..nr as u64)
                            .map(|r| {
                                (
                                    gemm_fp8::operand(Side::A, m, k, mode, inputs, 10 + 2 * r),
                                    gemm_fp8::operand(Side::B, n, k, mode, inputs, 11 + 2 * r),
                                )
                            })
                            .collect();
                        let rows: Vec<usize> = (0..m).collect();
                        let partials: Vec<(Vec<f64>, Vec<f64>)> =
                            operands.iter().map(|(a, b)| gemm_fp8::reference(a, b, &rows, n, k, out, inputs)).collect();
                        let (want, bound) = combine_partials(&partials, out);
                        let (want2, bound2) = reduced_reference(&operands, &rows, n, k, out, inputs);
                        assert_eq!((&want, &bound), (&want2, &bound2));
                        let limit = gemm_fp8::l2_limit(out, inputs);
                        let v = check_close(&simulated(&partials, out, None), &want, &bound, limit);
                        assert!(v.passed(), "{} {mode:?} {inputs:?} {nr} ranks: {v}", out.name());
                        // Exact sums: the element where rank 1's partial is largest loses it.
                        if nr > 1 && inputs == Inputs::ExactSums {
                            let lost = (0..want.len())
                                .max_by(|&i, &j| partials[1].0[i].abs().total_cmp(&partials[1].0[j].abs()))
                                .unwrap();
                            let v = check_close(&simulated(&partials, out, Some((lost, 1))), &want, &bound, limit);
                            assert!(!v.passed() && v.worst.unwrap().index == lost, "{} {nr} ranks: {v}", out.name());
                        }
                    }
                }
            }
        }
    }
}
