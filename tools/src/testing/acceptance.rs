//! The acceptance rule every GPU suite applies to a floating-point result, element by
//! element, and the exact comparison for results that involve no arithmetic.
//!
//! An output element passes when `|out − ref| ≤ atol + rtol·|ref|`, where `ref` is the
//! float64 reference and the two tolerances follow from how the library states the element
//! is formed (docs/testing.md derives them):
//! - `rtol` is the unit roundoff `u` of the output type (half an ulp relative: bf16 2⁻⁸,
//!   f16 2⁻¹¹, f32 2⁻²⁴): the one final rounding of a correctly computed value.
//! - `atol` is the accumulation error of a reduction of `n` terms in fp32,
//!   `γₙ·Σ|termᵢ|` with `γₙ = n·u_acc / (1 − n·u_acc)` (Higham's worst-case bound, any
//!   order of additions), plus half the smallest subnormal of the output type. `u_acc` is
//!   2⁻²³, twice fp32's unit roundoff, so that an accumulator that truncates instead of
//!   rounding (tensor cores may) is still covered; float64 accumulates with 2⁻⁵².
//!   Intermediate roundings the library documents (a rank's partial product stored in the
//!   element type, a node's partial) add `u·|partial|` each.
//!
//! The bound is a worst case, so a correct kernel cannot fail it, and it is per element, so
//! a wrong tile, a skipped K step or a handful of stale elements fail it although they
//! barely move a global norm. The relative L2 norm (`relative_error` within `tolerance`)
//! stays as a second check. Gathers, copies, Max/Min and integer results are compared
//! exactly (bit for bit, or value for value where ±0 may differ).

use mkernel::types::mkDataType_t;
use std::fmt;

/// Unit roundoff of a floating-point type: half an ulp at 1.0 (0 for integers: exact).
pub fn unit_roundoff(dtype: mkDataType_t) -> f64 {
    match dtype {
        mkDataType_t::mkBfloat16 => 2f64.powi(-8),
        mkDataType_t::mkFloat16 => 2f64.powi(-11),
        mkDataType_t::mkFloat32 => 2f64.powi(-24),
        mkDataType_t::mkFloat64 => 2f64.powi(-53),
        _ => 0.0,
    }
}

/// The unit of one addition in the accumulator the library uses for `dtype` (fp32 for the
/// 16- and 32-bit floats, float64 for float64), doubled to cover truncating adders.
pub fn accumulation_unit(dtype: mkDataType_t) -> f64 {
    match dtype {
        mkDataType_t::mkFloat64 => 2f64.powi(-52),
        mkDataType_t::mkBfloat16 | mkDataType_t::mkFloat16 | mkDataType_t::mkFloat32 => 2f64.powi(-23),
        _ => 0.0,
    }
}

/// γₙ = n·u / (1 − n·u): the relative bound on the error of n additions (or
/// multiplications) with unit `u`, whatever their order.
pub fn gamma(n: usize, u: f64) -> f64 {
    let nu = n as f64 * u;
    assert!(nu < 0.5, "γ undefined: {n} operations with unit {u:e}");
    nu / (1.0 - nu)
}

/// Half the smallest subnormal of `dtype`: the most a rounding near zero can change a
/// value by, where the relative bound does not hold.
pub fn underflow_floor(dtype: mkDataType_t) -> f64 {
    match dtype {
        mkDataType_t::mkFloat16 => 2f64.powi(-25),
        mkDataType_t::mkBfloat16 => 2f64.powi(-134),
        mkDataType_t::mkFloat32 => 2f64.powi(-150),
        mkDataType_t::mkFloat64 => 2f64.powi(-1075),
        _ => 0.0,
    }
}

/// `|out − ref| ≤ floor + gamma·magnitude + rtol·|ref|` for one reduction, where
/// `magnitude` is Σ|termᵢ| of the element's terms. Second-order terms (products of two
/// roundoffs) are covered by a 1 % margin.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rule {
    pub rtol: f64,
    pub gamma: f64,
    pub floor: f64,
}

impl Rule {
    /// A dot product (or any sum) of `terms` terms accumulated in the library's accumulator
    /// and rounded once to `dtype`: a GEMM element with K = `terms`, a collective's sum
    /// over `terms` ranks.
    pub fn reduction(dtype: mkDataType_t, terms: usize) -> Rule {
        Rule {
            rtol: unit_roundoff(dtype),
            gamma: gamma(terms.max(1), accumulation_unit(dtype)),
            floor: underflow_floor(dtype),
        }
    }

    /// The largest |out − ref| this rule accepts for an element with this reference value
    /// and Σ|terms|.
    pub fn bound(&self, reference: f64, magnitude: f64) -> f64 {
        1.01 * (self.floor + self.gamma * magnitude + self.rtol * reference.abs())
    }
}

/// Float64 C = A·Bᵀ (row-major, B as [N, K]) with each element's Σ|aᵢ·bᵢ|, the
/// magnitude the acceptance bound scales with.
pub fn gemm_reference(a: &[f64], b: &[f64], m: usize, n: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut c = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for i in 0..m {
        let ar = &a[i * k..(i + 1) * k];
        for j in 0..n {
            let br = &b[j * k..(j + 1) * k];
            let (mut s, mut s_abs) = (0.0, 0.0);
            for (x, y) in ar.iter().zip(br) {
                let p = x * y;
                s += p;
                s_abs += p.abs();
            }
            c[i * n + j] = s;
            mag[i * n + j] = s_abs;
        }
    }
    (c, mag)
}

/// The element whose error used the largest share of its bound.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Worst {
    pub index: usize,
    pub got: f64,
    pub want: f64,
    /// The bound at this element (0 for an exact comparison).
    pub bound: f64,
}

/// The outcome of comparing a result with its reference.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    pub elements: usize,
    /// Elements outside their bound (or different, for an exact comparison).
    pub wrong: usize,
    pub nonfinite: usize,
    /// The largest |out − ref| / bound (∞ where a bound is 0 and the element differs).
    pub worst_ratio: f64,
    pub worst: Option<Worst>,
    /// The norms of the relative L2 error and its limit (None: exact comparison).
    pub l2: Option<L2>,
}

/// A norm is a statistic: over fewer elements than this, one correctly rounded element whose
/// terms cancel (a bf16 sum of four ranks across two nodes rounds twice) carries
/// ‖out − ref‖₂ / ‖ref‖₂ past the limit while inside its own bound, so below it the
/// element-wise bounds judge alone.
pub const MIN_L2_ELEMENTS: usize = 64;

/// ‖out − ref‖₂² and ‖ref‖₂², kept apart so that parts of one result fold exactly.
/// A reference that is zero everywhere has no scale to be relative to: any rounding at all
/// (a gradient whose terms cancel exactly in float64, say) puts the norm at ∞, so there
/// the element-wise bounds judge alone, as they do below `MIN_L2_ELEMENTS`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct L2 {
    pub err_sq: f64,
    pub ref_sq: f64,
    pub limit: f64,
}

impl L2 {
    /// ‖out − ref‖₂ / ‖ref‖₂ (0 when both are 0, ∞ when only the reference is).
    pub fn relative(&self) -> f64 {
        if self.ref_sq == 0.0 {
            if self.err_sq == 0.0 {
                0.0
            } else {
                f64::INFINITY
            }
        } else {
            (self.err_sq / self.ref_sq).sqrt()
        }
    }
}

impl Verdict {
    pub fn passed(&self) -> bool {
        let l2_ok = match self.l2 {
            Some(l2) if self.elements >= MIN_L2_ELEMENTS && l2.ref_sq > 0.0 => l2.relative() <= l2.limit,
            _ => true,
        };
        self.wrong == 0 && self.nonfinite == 0 && l2_ok
    }

    /// Folds another part of the same result into this one (indices of `other` offset by
    /// this part's length).
    pub fn and(mut self, other: Verdict) -> Verdict {
        if other.worst_ratio > self.worst_ratio || self.worst.is_none() {
            self.worst_ratio = other.worst_ratio;
            self.worst = other.worst.map(|w| Worst { index: w.index + self.elements, ..w });
        }
        self.elements += other.elements;
        self.wrong += other.wrong;
        self.nonfinite += other.nonfinite;
        self.l2 = match (self.l2, other.l2) {
            (Some(a), Some(b)) => {
                Some(L2 { err_sq: a.err_sq + b.err_sq, ref_sq: a.ref_sq + b.ref_sq, limit: a.limit.min(b.limit) })
            }
            (a, b) => a.or(b),
        };
        self
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.l2.is_some() { "outside bound" } else { "differ" };
        write!(f, "{} of {} {kind}", self.wrong, self.elements)?;
        if self.nonfinite > 0 {
            write!(f, ", {} non-finite", self.nonfinite)?;
        }
        if let Some(w) = self.worst {
            if self.l2.is_some() {
                write!(
                    f,
                    ", worst [{}]: got {:.6e} want {:.6e} (|err| {:.2e}, bound {:.2e}, {:.2} of it)",
                    w.index,
                    w.got,
                    w.want,
                    (w.got - w.want).abs(),
                    w.bound,
                    self.worst_ratio
                )?;
            } else if self.wrong > 0 || self.nonfinite > 0 {
                write!(f, ", first [{}]: got {:.6e} want {:.6e}", w.index, w.got, w.want)?;
            }
        }
        if let Some(l2) = self.l2 {
            write!(f, ", rel L2 {:.2e} (limit {:.0e}", l2.relative(), l2.limit)?;
            if self.elements < MIN_L2_ELEMENTS {
                write!(f, ", not judged below {MIN_L2_ELEMENTS} elements")?;
            } else if l2.ref_sq == 0.0 {
                write!(f, ", not judged: the reference is zero")?;
            }
            write!(f, ")")?;
        }
        Ok(())
    }
}

/// Element-wise: `|out[i] − reference[i]| ≤ bounds[i]`, NaN and ∞ never pass; then, over
/// at least `MIN_L2_ELEMENTS` elements and a reference not zero everywhere, the global
/// relative L2 norm within `l2_limit` (`super::tolerance(dtype)`).
pub fn check_close(out: &[f64], reference: &[f64], bounds: &[f64], l2_limit: f64) -> Verdict {
    assert_eq!(out.len(), reference.len());
    assert_eq!(out.len(), bounds.len());
    let mut v = Verdict { elements: out.len(), wrong: 0, nonfinite: 0, worst_ratio: 0.0, worst: None, l2: None };
    for (i, ((&o, &r), &b)) in out.iter().zip(reference).zip(bounds).enumerate() {
        let err = (o - r).abs();
        let ratio = if !o.is_finite() {
            v.nonfinite += 1;
            f64::INFINITY
        } else if err <= b {
            if b > 0.0 {
                err / b
            } else {
                0.0
            }
        } else {
            v.wrong += 1;
            if b > 0.0 {
                err / b
            } else {
                f64::INFINITY
            }
        };
        if v.worst.is_none() || ratio > v.worst_ratio {
            v.worst_ratio = ratio;
            v.worst = Some(Worst { index: i, got: o, want: r, bound: b });
        }
    }
    let (mut err_sq, mut ref_sq) = (0.0, 0.0);
    for (&o, &r) in out.iter().zip(reference) {
        err_sq += (o - r) * (o - r);
        ref_sq += r * r;
    }
    v.l2 = Some(L2 { err_sq, ref_sq, limit: l2_limit });
    v
}

/// Value for value (for results in which the op does no rounding: Max/Min, integers, a
/// gather decoded to f64). NaN never equals anything; +0 equals −0.
pub fn check_exact(out: &[f64], want: &[f64]) -> Verdict {
    assert_eq!(out.len(), want.len());
    let mut v = Verdict { elements: out.len(), wrong: 0, nonfinite: 0, worst_ratio: 0.0, worst: None, l2: None };
    for (i, (&o, &w)) in out.iter().zip(want).enumerate() {
        if o != w {
            if v.wrong == 0 {
                v.worst = Some(Worst { index: i, got: o, want: w, bound: 0.0 });
                v.worst_ratio = f64::INFINITY;
            }
            v.wrong += 1;
        }
    }
    v
}

/// Value for value where the defined result is a number (+0 equals -0), and NaN exactly
/// where the defined result is NaN (an fp8 Sum with a NaN source): a NaN where a number is
/// due, or a number where NaN is due, is wrong.
pub fn check_exact_or_nan(out: &[f64], want: &[f64]) -> Verdict {
    assert_eq!(out.len(), want.len());
    let mut v = Verdict { elements: out.len(), wrong: 0, nonfinite: 0, worst_ratio: 0.0, worst: None, l2: None };
    for (i, (&o, &w)) in out.iter().zip(want).enumerate() {
        let same = if w.is_nan() { o.is_nan() } else { o == w };
        if !same {
            if v.wrong == 0 {
                v.worst = Some(Worst { index: i, got: o, want: w, bound: 0.0 });
                v.worst_ratio = f64::INFINITY;
            }
            v.wrong += 1;
        }
    }
    v
}

/// Bit for bit, element by element (a gather, a copy): the first differing element is
/// reported with its decoded values.
pub fn check_exact_bytes(out: &[u8], want: &[u8], dtype: mkDataType_t) -> Verdict {
    assert_eq!(out.len(), want.len());
    let es = dtype.size();
    let mut v = Verdict { elements: out.len() / es, wrong: 0, nonfinite: 0, worst_ratio: 0.0, worst: None, l2: None };
    for (i, (o, w)) in out.chunks_exact(es).zip(want.chunks_exact(es)).enumerate() {
        if o != w {
            if v.wrong == 0 {
                let (got, wanted) = (super::to_f64(o, dtype)[0], super::to_f64(w, dtype)[0]);
                v.worst = Some(Worst { index: i, got, want: wanted, bound: 0.0 });
                v.worst_ratio = f64::INFINITY;
            }
            v.wrong += 1;
        }
    }
    v
}

#[cfg(test)]
mod tests {
    //! The rule against realistic results and realistic failures, on the CPU: a correct
    //! result is the float64 reference accumulated in f32 (blocked as a tensor-core GEMM
    //! accumulates: chunks of 16 products, each chunk added to the running sum) and rounded
    //! to the output type; the failures are what a broken kernel produces.
    use super::*;
    use crate::testing::{relative_error, round_to, tolerance};
    use mkDataType_t::{mkBfloat16 as BF16, mkFloat16 as F16, mkFloat32 as F32};

    struct Rng(u64);
    impl Rng {
        /// Uniform in [-1, 1), representable in `dtype` (as the suites' random inputs).
        fn value(&mut self, dtype: mkDataType_t) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            round_to(dtype, (self.0 >> 11) as f64 / (1u64 << 52) as f64 - 1.0)
        }
        fn values(&mut self, dtype: mkDataType_t, n: usize) -> Vec<f64> {
            (0..n).map(|_| self.value(dtype)).collect()
        }
    }

    /// A tile (rows lo..hi, columns lo..hi) and the range of K its accumulation skipped.
    type SkippedSteps = ((usize, usize, usize, usize), (usize, usize));

    /// A correct GEMM as the GPU forms it: fp32 accumulation in chunks of 16 products,
    /// `k_skipped` (a range of K) left out in the rows and columns of `skip_tile`, then one
    /// rounding to `dtype`.
    fn gpu_like_gemm(
        a: &[f64],
        b: &[f64],
        m: usize,
        n: usize,
        k: usize,
        dtype: mkDataType_t,
        skip: Option<SkippedSteps>,
    ) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let skipping =
                    skip.filter(|&((r0, r1, c0, c1), _)| (r0..r1).contains(&i) && (c0..c1).contains(&j)).map(|s| s.1);
                let mut acc = 0f32;
                for k0 in (0..k).step_by(16) {
                    let mut chunk = 0f32;
                    for kk in k0..(k0 + 16).min(k) {
                        if skipping.is_some_and(|(s0, s1)| (s0..s1).contains(&kk)) {
                            continue;
                        }
                        chunk += (a[i * k + kk] * b[j * k + kk]) as f32;
                    }
                    acc += chunk;
                }
                c[i * n + j] = round_to(dtype, acc as f64);
            }
        }
        c
    }

    fn gemm_verdict(out: &[f64], reference: &[f64], mag: &[f64], dtype: mkDataType_t, k: usize) -> Verdict {
        let rule = Rule::reduction(dtype, k);
        let bounds: Vec<f64> = reference.iter().zip(mag).map(|(&r, &m)| rule.bound(r, m)).collect();
        check_close(out, reference, &bounds, tolerance(dtype))
    }

    #[test]
    fn correctly_rounded_gemm_results_pass_in_every_dtype() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        for dtype in [BF16, F16, F32] {
            for (m, n, k) in [(1, 1, 8), (33, 65, 72), (64, 96, 2048)] {
                let (a, b) = (rng.values(dtype, m * k), rng.values(dtype, n * k));
                let (reference, mag) = gemm_reference(&a, &b, m, n, k);
                let out = gpu_like_gemm(&a, &b, m, n, k, dtype, None);
                let v = gemm_verdict(&out, &reference, &mag, dtype, k);
                assert!(v.passed(), "{} {m}x{n}x{k}: {v}", dtype.name());
                // The bound is a worst case, but not a vacuous one: over many elements the
                // real error reaches a visible share of it (at K = 2048 in f16 about 0.1,
                // where the accumulation term dominates).
                assert!(dtype == F32 || m * n < 100 || v.worst_ratio > 0.05, "{} {m}x{n}x{k}: {v}", dtype.name());
            }
        }
    }

    /// Replaces elements of `out` (in `candidates` order) by `replacement(i)` for as long as
    /// the relative L2 norm stays within `limit`: the most damage a norm-only check admits.
    /// Returns how many were replaced.
    fn corrupt_within_norm_budget(
        out: &mut [f64],
        reference: &[f64],
        limit: f64,
        candidates: impl Iterator<Item = usize>,
        replacement: impl Fn(usize) -> f64,
    ) -> usize {
        let den: f64 = reference.iter().map(|r| r * r).sum();
        let mut num: f64 = out.iter().zip(reference).map(|(o, r)| (o - r) * (o - r)).sum();
        let mut replaced = 0;
        for i in candidates {
            let new = replacement(i);
            let next = num - (out[i] - reference[i]).powi(2) + (new - reference[i]).powi(2);
            if next > limit * limit * den {
                break;
            }
            num = next;
            out[i] = new;
            replaced += 1;
        }
        replaced
    }

    #[test]
    fn a_tile_that_skipped_one_k_step_fails() {
        let (m, n, k) = (256, 128, 2048);
        let mut rng = Rng(77);
        for dtype in [BF16, F16] {
            let (a, b) = (rng.values(dtype, m * k), rng.values(dtype, n * k));
            let (reference, mag) = gemm_reference(&a, &b, m, n, k);
            // A 128x128 tile whose consumer skipped the K step [1024, 1088).
            let out = gpu_like_gemm(&a, &b, m, n, k, dtype, Some(((128, 256, 0, 128), (1024, 1088))));
            let v = gemm_verdict(&out, &reference, &mag, dtype, k);
            assert!(!v.passed(), "{}: {v}", dtype.name());
            assert!(v.wrong > 128 * 128 / 2, "most of the tile is caught: {v}");
            let w = v.worst.unwrap();
            assert!(
                (128..256).contains(&(w.index / n)) && w.index % n < 128,
                "the worst element lies in the tile: {v}"
            );
            // One K step of 16 (a single wgmma) in one 64x64 block is caught too.
            let out = gpu_like_gemm(&a, &b, m, n, k, dtype, Some(((0, 64, 64, 128), (512, 528))));
            let v = gemm_verdict(&out, &reference, &mag, dtype, k);
            assert!(!v.passed() && v.wrong > 64 * 64 / 4, "{}: {v}", dtype.name());
        }
    }

    #[test]
    fn a_zero_reference_is_judged_by_the_bounds_alone() {
        // A gradient whose terms cancel exactly in float64 (one key: dS = P(dP − δ) = 0),
        // computed with rounding: tiny, inside every bound, and at ∞ relative to zero.
        let n = 4 * MIN_L2_ELEMENTS;
        let reference = vec![0.0; n];
        let bounds = vec![4.8e-3; n];
        let rounded: Vec<f64> = (0..n).map(|i| if i % 3 == 0 { 0.0 } else { 3.9e-9 * (i % 7) as f64 }).collect();
        let v = check_close(&rounded, &reference, &bounds, tolerance(BF16));
        assert!(v.l2.unwrap().relative().is_infinite() && v.passed(), "{v}");
        assert!(v.to_string().contains("reference is zero"), "{v}");
        // Past one bound, or NaN anywhere, still fails.
        let mut past = rounded.clone();
        past[100] = 5e-3;
        assert!(!check_close(&past, &reference, &bounds, tolerance(BF16)).passed());
        let mut nan = rounded;
        nan[7] = f64::NAN;
        assert!(!check_close(&nan, &reference, &bounds, tolerance(BF16)).passed());
        // A part with a zero reference folded into a nonzero whole is judged by the norm.
        let whole = check_close(&past[..n / 2], &reference[..n / 2], &bounds[..n / 2], tolerance(BF16))
            .and(check_close(&[1.0; 64], &[1.0; 64], &[0.1; 64], tolerance(BF16)));
        assert!(whole.l2.unwrap().ref_sq > 0.0);
    }

    #[test]
    fn the_norm_judges_only_enough_elements_and_folds_exactly() {
        // One bf16 sum whose terms cancel: inside its bound, far past the norm's limit.
        let one = check_close(&[-0.3828125], &[-0.376953125], &[9.38e-3], tolerance(BF16));
        assert!(one.passed(), "{one}");
        assert!(one.l2.unwrap().relative() > tolerance(BF16));
        assert!(one.to_string().contains("not judged"), "{one}");
        // The same relative error on every element of a large result fails on the norm alone.
        let n = 4 * MIN_L2_ELEMENTS;
        let reference: Vec<f64> = (0..n).map(|i| 1.0 + i as f64 / n as f64).collect();
        let out: Vec<f64> = reference.iter().map(|r| r * (1.0 + 2.0 * tolerance(BF16))).collect();
        let bounds: Vec<f64> = reference.iter().map(|r| r * 0.1).collect();
        let whole = check_close(&out, &reference, &bounds, tolerance(BF16));
        assert!(whole.wrong == 0 && !whole.passed(), "{whole}");
        // Parts fold into the verdict of the whole, small parts included.
        let folded = [(0, 5), (5, 130), (130, n)]
            .iter()
            .map(|&(a, b)| check_close(&out[a..b], &reference[a..b], &bounds[a..b], tolerance(BF16)))
            .reduce(Verdict::and)
            .unwrap();
        assert_eq!(folded.passed(), whole.passed());
        let (f, w) = (folded.l2.unwrap().relative(), whole.l2.unwrap().relative());
        assert!((f - w).abs() <= 1e-12 * w, "{f} vs {w}");
    }

    #[test]
    fn zeroed_elements_that_the_global_norm_admits_fail() {
        let (m, n, k) = (128, 512, 520);
        let mut rng = Rng(99);
        let dtype = BF16;
        let (a, b) = (rng.values(dtype, m * k), rng.values(dtype, n * k));
        let (reference, mag) = gemm_reference(&a, &b, m, n, k);
        let mut out = gpu_like_gemm(&a, &b, m, n, k, dtype, None);
        // As many zeros as the global norm's budget leaves room for, spread over the output:
        // a norm-only check accepts this result.
        let zeroed = corrupt_within_norm_budget(
            &mut out,
            &reference,
            tolerance(dtype),
            (0..m * n).map(|z| (z * 7919 + 13) % (m * n)),
            |_| 0.0,
        );
        assert!(zeroed >= 2, "{zeroed}");
        assert!(relative_error(&out, &reference) <= tolerance(dtype), "the norm alone accepts it");
        let v = gemm_verdict(&out, &reference, &mag, dtype, k);
        assert!(!v.passed(), "{v}");
        // (A zeroed element whose reference lies within its bound of 0 may pass.)
        assert!(v.wrong * 4 >= zeroed * 3, "{zeroed} zeroed: {v}");
    }

    #[test]
    fn stale_elements_of_a_gather_fail_the_exact_check() {
        // A bf16 AllGather of 8 ranks x 100,003 elements that left elements of the previous
        // call's data behind, as many as the global norm admits: fresh and stale values
        // share one distribution, so the norm moves by only sqrt(2·stale / total).
        let (ranks, count) = (8, 100_003);
        let mut rng = Rng(5);
        let fresh: Vec<f64> = rng.values(BF16, ranks * count);
        let stale: Vec<f64> = rng.values(BF16, ranks * count);
        let mut out = fresh.clone();
        let len = out.len();
        let n_stale = corrupt_within_norm_budget(
            &mut out,
            &fresh,
            tolerance(BF16),
            (0..len).map(|s| (s * 2663 + 17) % len),
            |i| stale[i],
        );
        assert!(n_stale >= 20, "{n_stale}");
        assert!(relative_error(&out, &fresh) <= tolerance(BF16), "the norm alone accepts it");
        let encode = |v: &[f64]| {
            v.iter().flat_map(|&x| crate::testing::f32_to_bf16(x as f32).to_le_bytes()).collect::<Vec<u8>>()
        };
        let v = check_exact_bytes(&encode(&out), &encode(&fresh), BF16);
        assert!(!v.passed(), "{v}");
        assert!(v.wrong > n_stale * 9 / 10, "{v}"); // a stale value may equal the fresh one
        assert_eq!(v.worst.unwrap().index, 17, "the first stale element is reported: {v}");
        assert!(check_exact_bytes(&encode(&fresh), &encode(&fresh), BF16).passed());
    }

    #[test]
    fn max_and_min_are_exact_one_ulp_is_wrong() {
        let mut rng = Rng(11);
        let ranks: Vec<Vec<f64>> = (0..4).map(|_| rng.values(F16, 1000)).collect();
        let max: Vec<f64> = (0..1000).map(|i| ranks.iter().map(|r| r[i]).fold(f64::MIN, f64::max)).collect();
        assert!(check_exact(&max, &max).passed());
        let mut off = max.clone();
        off[500] = crate::testing::f16_to_f32(crate::testing::f32_to_f16(off[500] as f32) + 1) as f64;
        let v = check_exact(&off, &max);
        assert!(!v.passed() && v.wrong == 1 && v.worst.unwrap().index == 500, "{v}");
        assert!(!check_exact(&[f64::NAN], &[f64::NAN]).passed(), "NaN never passes");
    }

    #[test]
    fn a_sum_over_ranks_rounded_once_passes_and_a_missing_rank_fails() {
        // ReduceScatter/AllReduce Sum over 8 ranks, fp32 accumulation in rank order.
        let (ranks, count) = (8, 20_000);
        let mut rng = Rng(3);
        for dtype in [BF16, F16, F32] {
            let inputs: Vec<Vec<f64>> = (0..ranks).map(|_| rng.values(dtype, count)).collect();
            let sum = |skip: Option<usize>| -> Vec<f64> {
                (0..count)
                    .map(|i| {
                        round_to(
                            dtype,
                            (0..ranks).filter(|&r| Some(r) != skip).fold(0f32, |s, r| s + inputs[r][i] as f32) as f64,
                        )
                    })
                    .collect()
            };
            let reference: Vec<f64> = (0..count).map(|i| inputs.iter().map(|r| r[i]).sum()).collect();
            let mag: Vec<f64> = (0..count).map(|i| inputs.iter().map(|r| r[i].abs()).sum()).collect();
            let rule = Rule::reduction(dtype, ranks);
            let bounds: Vec<f64> = reference.iter().zip(&mag).map(|(&r, &m)| rule.bound(r, m)).collect();
            let v = check_close(&sum(None), &reference, &bounds, tolerance(dtype));
            assert!(v.passed(), "{}: {v}", dtype.name());
            // One rank's contribution missing in 40 elements (a block that was not summed).
            let mut out = sum(None);
            let short = sum(Some(5));
            out[1000..1040].copy_from_slice(&short[1000..1040]);
            let v = check_close(&out, &reference, &bounds, tolerance(dtype));
            assert!(!v.passed() && v.wrong >= 36, "{}: {v}", dtype.name());
        }
    }

    #[test]
    fn nan_and_infinity_never_pass_and_the_worst_element_is_reported() {
        let v = check_close(&[1.0, f64::NAN, 3.0], &[1.0, 2.0, 3.0], &[1.0; 3], 1.0);
        assert!(!v.passed() && v.nonfinite == 1 && v.worst.unwrap().index == 1, "{v}");
        let v = check_close(&[1.0, 2.5, 3.0], &[1.0, 2.0, 3.0], &[0.1; 3], 1.0);
        assert!(!v.passed() && v.wrong == 1, "{v}");
        assert!(format!("{v}").contains("worst [1]: got 2.5"), "{v}");
        // A zero bound (an exactly zero reference with nothing summed) demands exactly 0.
        assert!(!check_close(&[1e-30], &[0.0], &[0.0], 1.0).passed());
    }

    #[test]
    fn nan_passes_only_where_it_is_the_defined_result() {
        let nan = f64::NAN;
        assert!(check_exact_or_nan(&[1.0, nan, -0.0], &[1.0, nan, 0.0]).passed());
        let v = check_exact_or_nan(&[1.0, nan, 3.0], &[1.0, 2.0, 3.0]);
        assert!(!v.passed() && v.wrong == 1 && v.worst.unwrap().index == 1, "NaN where a number is due: {v}");
        let v = check_exact_or_nan(&[1.0, 448.0], &[1.0, nan]);
        assert!(!v.passed() && v.wrong == 1, "a number where NaN is due: {v}");
        assert!(!check_exact_or_nan(&[0.5], &[0.4375]).passed());
    }

    #[test]
    fn verdicts_combine_with_offset_indices() {
        let a = check_exact(&[1.0, 2.0], &[1.0, 2.0]);
        let b = check_exact(&[1.0, 5.0], &[1.0, 2.0]);
        let both = a.and(b);
        assert_eq!((both.elements, both.wrong, both.worst.unwrap().index), (4, 1, 3));
    }

    #[test]
    fn the_bound_grows_with_the_reduction_length_and_the_type() {
        assert!(Rule::reduction(BF16, 4096).gamma > Rule::reduction(BF16, 64).gamma);
        assert!(Rule::reduction(BF16, 8).rtol > Rule::reduction(F16, 8).rtol);
        assert!(Rule::reduction(F16, 8).rtol > Rule::reduction(F32, 8).rtol);
        assert_eq!(Rule::reduction(mkDataType_t::mkInt32, 8).bound(5.0, 10.0), 0.0);
    }
}
