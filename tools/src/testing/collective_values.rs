//! The values the collectives' checks feed and expect, shared by the test driver and the
//! benchmarks so both judge a collective by the same inputs and the same exact result.

use super::{f32_to_bf16, f32_to_f16};
use mkernel::types::{mkDataType_t, mkRedOp_t};

/// SplitMix64: a stateless mix of a counter into 64 well-spread bits.
pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

pub fn is_float(t: mkDataType_t) -> bool {
    use mkDataType_t::*;
    matches!(t, mkFloat16 | mkBfloat16 | mkFloat32 | mkFloat64)
}

/// Appends one element of `dtype` drawn from the random bits `r`. Floats uniform in [-1, 1)
/// (for products, ±[0.75, 1.25), so 8 factors stay clear of half's subnormals); signed
/// integers in [-3, 3]; unsigned in [1, 4] (products of 8 ranks wrap in 8 bits).
pub fn push_element(bytes: &mut Vec<u8>, dtype: mkDataType_t, r: u64, for_prod: bool) {
    use mkDataType_t::*;
    let mut u = (r >> 40) as f32 * (2.0 / 16_777_216.0) - 1.0;
    if for_prod {
        u = u.signum() * (0.75 + 0.5 * u.abs());
    }
    let si = (r % 7) as i64 - 3;
    let ui = (r % 4) + 1;
    match dtype {
        mkFloat16 => bytes.extend_from_slice(&f32_to_f16(u).to_le_bytes()),
        mkBfloat16 => bytes.extend_from_slice(&f32_to_bf16(u).to_le_bytes()),
        mkFloat32 => bytes.extend_from_slice(&u.to_le_bytes()),
        mkFloat64 => bytes.extend_from_slice(&(u as f64 + (r & 0xff) as f64 * 1e-12).to_le_bytes()),
        mkInt8 => bytes.push(si as i8 as u8),
        mkUint8 => bytes.push(ui as u8),
        mkInt32 => bytes.extend_from_slice(&(si as i32).to_le_bytes()),
        mkUint32 => bytes.extend_from_slice(&(ui as u32).to_le_bytes()),
        mkInt64 => bytes.extend_from_slice(&si.to_le_bytes()),
        mkUint64 => bytes.extend_from_slice(&ui.to_le_bytes()),
        mkFloat8e4m3 | mkFloat8e5m2 => bytes.push(fp8_element(dtype == mkFloat8e4m3, r, for_prod)),
    }
}

/// One random finite fp8 code from the bits `r`: uniform over every finite code of the
/// format (so subnormals, zeros of both signs and values up to the largest finite, 448 or
/// 57344, all come up, and sums of a few ranks saturate); for products, a magnitude in
/// [0.5, 2) with either sign, so a product of 8 ranks stays well inside the format.
pub fn fp8_element(e4m3: bool, r: u64, for_prod: bool) -> u8 {
    let sign = if r & (1 << 63) != 0 { 0x80u8 } else { 0 };
    if for_prod {
        // The codes of [0.5, 2): exponents 6 and 7 of e4m3 (bias 7), 14 and 15 of e5m2 (bias 15).
        return sign | if e4m3 { 0x30 + (r % 16) as u8 } else { 0x38 + (r % 8) as u8 };
    }
    // The positive finite codes are 0..=0x7E (e4m3) and 0..=0x7B (e5m2); the sign bit makes
    // the negative ones.
    let positive = if e4m3 { 0x7F } else { 0x7C };
    sign | (r % positive) as u8
}

pub fn is_fp8(t: mkDataType_t) -> bool {
    matches!(t, mkDataType_t::mkFloat8e4m3 | mkDataType_t::mkFloat8e5m2)
}

/// What mkReduceScatter and mkAllReduce give for one fp8 element: the ranks' values (exact
/// in f32) combined in rank order in f32 arithmetic, mkAvg divided by the ranks in f32,
/// then rounded once to the format with saturation (`__NV_SATFINITE`). f32 addition and
/// multiplication are IEEE's on the host and the GPU (no FMA among them, no flush to zero),
/// so this is the device's result bit for bit. Max and Min ignore NaN (f32::max, as the
/// kernels' fmaxf); a NaN value makes Sum, Prod and Avg NaN.
pub fn fp8_reduction(vals: &[f64], op: mkRedOp_t, dtype: mkDataType_t) -> f64 {
    use super::fp8::{e4m3_to_f32, e5m2_to_f32, f32_to_e4m3, f32_to_e5m2};
    let mut acc = vals[0] as f32;
    for &v in &vals[1..] {
        let v = v as f32;
        acc = match op {
            mkRedOp_t::mkSum | mkRedOp_t::mkAvg => acc + v,
            mkRedOp_t::mkProd => acc * v,
            mkRedOp_t::mkMax => acc.max(v),
            mkRedOp_t::mkMin => acc.min(v),
        };
    }
    if op == mkRedOp_t::mkAvg {
        acc /= vals.len() as f32;
    }
    let rounded = match dtype {
        mkDataType_t::mkFloat8e4m3 => e4m3_to_f32(f32_to_e4m3(acc)),
        _ => e5m2_to_f32(f32_to_e5m2(acc)),
    };
    rounded as f64
}

/// An exact integer wrapped to `dtype`'s width, as the kernels' integer arithmetic wraps.
pub fn wrap_int(v: i128, dtype: mkDataType_t) -> i128 {
    use mkDataType_t::*;
    match dtype {
        mkInt8 => v as i8 as i128,
        mkUint8 => v as u8 as i128,
        mkInt32 => v as i32 as i128,
        mkUint32 => v as u32 as i128,
        mkInt64 => v as i64 as i128,
        mkUint64 => v as u64 as i128,
        _ => v,
    }
}

/// The exact reduction of one element over the ranks' values: float64 for floats; integers
/// wrap at every step as the kernels' arithmetic does, and an integer Avg is the wrapped sum
/// divided by the ranks, truncating (C division).
pub fn exact_reduction(vals: &[f64], op: mkRedOp_t, dtype: mkDataType_t) -> f64 {
    let n = vals.len();
    if is_float(dtype) {
        return match op {
            mkRedOp_t::mkSum => vals.iter().sum(),
            mkRedOp_t::mkAvg => vals.iter().sum::<f64>() / n as f64,
            mkRedOp_t::mkProd => vals.iter().product(),
            mkRedOp_t::mkMax => vals.iter().copied().fold(f64::MIN, f64::max),
            mkRedOp_t::mkMin => vals.iter().copied().fold(f64::MAX, f64::min),
        };
    }
    let ints: Vec<i128> = vals.iter().map(|&v| v as i128).collect();
    let r = match op {
        mkRedOp_t::mkSum => wrap_int(ints.iter().sum(), dtype),
        mkRedOp_t::mkProd => ints.iter().fold(1i128, |a, b| wrap_int(a * b, dtype)),
        mkRedOp_t::mkMax => *ints.iter().max().expect("one rank at least"),
        mkRedOp_t::mkMin => *ints.iter().min().expect("one rank at least"),
        mkRedOp_t::mkAvg => wrap_int(ints.iter().sum(), dtype) / n as i128,
    };
    r as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_wrap_at_every_step() {
        use mkDataType_t::*;
        // 4^4 = 256 wraps to 0 in 8 bits; the sum of 8 × 100 wraps in i8.
        assert_eq!(exact_reduction(&[4.0; 4], mkRedOp_t::mkProd, mkUint8), 0.0);
        assert_eq!(exact_reduction(&[100.0; 8], mkRedOp_t::mkSum, mkInt8), (800i32 as i8) as f64);
        assert_eq!(exact_reduction(&[-3.0, 2.0], mkRedOp_t::mkAvg, mkInt32), 0.0);
        assert_eq!(exact_reduction(&[0.5, -1.5], mkRedOp_t::mkAvg, mkFloat32), -0.5);
    }

    #[test]
    fn fp8_reductions_widen_combine_in_f32_and_round_once() {
        use crate::testing::fp8::{e4m3_to_f32, E4M3_MAX, E5M2_MAX};
        use mkDataType_t::*;
        use mkRedOp_t::*;
        let sub = e4m3_to_f32(0x01) as f64; // 2^-9, the smallest e4m3 subnormal
                                            // Eight values from the smallest subnormal to near the largest: their f32 sum is
                                            // exact (19 bits of span), so one rounding of it is the rounding of the exact sum.
        let vals = [sub, 3.0 * sub, 0.015625, 0.4375, 1.0, 2.5, 13.0, 96.0];
        let exact: f64 = vals.iter().sum();
        assert_eq!(
            fp8_reduction(&vals, mkSum, mkFloat8e4m3),
            e4m3_to_f32(crate::testing::fp8::f32_to_e4m3(exact as f32)) as f64
        );
        assert_eq!(fp8_reduction(&vals, mkSum, mkFloat8e4m3), 112.0, "112.96... rounds once, to 112");
        // Rounding after every addition would give 1.0 here (1.0625 ties to the even 1.0,
        // twice); one rounding of the f32 sum keeps both small addends.
        let stepwise = [1.0, 0.0625, 0.0625];
        assert_eq!(fp8_reduction(&stepwise, mkSum, mkFloat8e4m3), 1.125, "1.125 exactly, not 1 + 0 + 0");
        // Saturation, in both formats, for sums and for an infinite e5m2 value.
        assert_eq!(fp8_reduction(&[448.0, 448.0], mkSum, mkFloat8e4m3), E4M3_MAX as f64);
        assert_eq!(fp8_reduction(&[-448.0, -32.0], mkSum, mkFloat8e4m3), -(E4M3_MAX as f64));
        assert_eq!(fp8_reduction(&[57344.0, 57344.0], mkSum, mkFloat8e5m2), E5M2_MAX as f64);
        assert_eq!(fp8_reduction(&[f64::INFINITY, 1.0], mkSum, mkFloat8e5m2), E5M2_MAX as f64);
        // Avg divides the f32 sum once: (448 + 448) / 2 = 448, not saturate-then-halve (224).
        assert_eq!(fp8_reduction(&[448.0, 448.0], mkAvg, mkFloat8e4m3), 448.0);
        assert_eq!(fp8_reduction(&[448.0, 448.0, 448.0, 448.0], mkAvg, mkFloat8e4m3), 448.0);
        assert_eq!(fp8_reduction(&[1.0, 0.125], mkAvg, mkFloat8e4m3), 0.5625);
        // NaN: Sum, Prod, Avg propagate it; Max and Min ignore it unless every value is NaN.
        let nan = f64::NAN;
        assert!(fp8_reduction(&[1.0, nan], mkSum, mkFloat8e4m3).is_nan());
        assert!(fp8_reduction(&[nan, 1.0], mkProd, mkFloat8e5m2).is_nan());
        assert!(fp8_reduction(&[1.0, nan, 2.0], mkAvg, mkFloat8e4m3).is_nan());
        assert_eq!(fp8_reduction(&[nan, -3.0, 2.0], mkMax, mkFloat8e4m3), 2.0);
        assert_eq!(fp8_reduction(&[-3.0, nan], mkMin, mkFloat8e5m2), -3.0);
        assert!(fp8_reduction(&[nan, nan], mkMax, mkFloat8e4m3).is_nan());
        // Subnormal results survive (no flush to zero).
        assert_eq!(fp8_reduction(&[sub, sub], mkSum, mkFloat8e4m3), 2.0 * sub);
        assert_eq!(fp8_reduction(&[sub, 0.5], mkProd, mkFloat8e4m3), 0.0, "2^-10 ties to the even zero");
    }

    #[test]
    fn fp8_elements_are_finite_and_cover_the_range() {
        use crate::testing::fp8::{e4m3_to_f32, e5m2_to_f32};
        for (e4m3, max) in [(true, 448.0f32), (false, 57344.0)] {
            let decode = if e4m3 { e4m3_to_f32 } else { e5m2_to_f32 };
            let vals: Vec<f32> = (0..20_000u64).map(|i| decode(fp8_element(e4m3, splitmix(i), false))).collect();
            assert!(vals.iter().all(|v| v.is_finite()));
            assert!(vals.iter().any(|v| v.abs() == max), "the largest finite value comes up");
            assert!(
                vals.iter().any(|&v| v != 0.0 && v.abs() < if e4m3 { 2f32.powi(-6) } else { 2f32.powi(-14) }),
                "subnormals"
            );
            assert!(vals.iter().any(|&v| v < 0.0) && vals.iter().any(|&v| v > 0.0));
            for i in 0..2_000u64 {
                let v = decode(fp8_element(e4m3, splitmix(i), true)).abs();
                assert!((0.5..2.0).contains(&v), "{v}");
            }
        }
    }

    #[test]
    fn elements_stay_in_their_documented_ranges() {
        for i in 0..10_000u64 {
            let r = splitmix(i);
            let mut b = Vec::new();
            push_element(&mut b, mkDataType_t::mkFloat32, r, true);
            let f = f32::from_le_bytes(b[..4].try_into().unwrap()).abs();
            assert!((0.75..=1.25).contains(&f), "{f}");
            b.clear();
            push_element(&mut b, mkDataType_t::mkUint8, r, false);
            assert!((1..=4).contains(&b[0]));
            b.clear();
            push_element(&mut b, mkDataType_t::mkInt64, r, false);
            assert!((-3..=3).contains(&i64::from_le_bytes(b[..8].try_into().unwrap())));
        }
    }
}
