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
        // Gathered only (no arithmetic): any value of the format will do.
        mkFloat8e4m3 => bytes.push(crate::testing::fp8::f32_to_e4m3(u)),
        mkFloat8e5m2 => bytes.push((f32_to_f16(u) >> 8) as u8),
    }
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
