//! fp8 on the host: decoding the two OCP formats NCCL names (e4m3 "fn": no infinities, one
//! NaN pattern per sign, largest 448; e5m2: IEEE-like, largest 57344) and rounding to e4m3,
//! for the references and inputs of the fp8 tests and benchmarks. Written here rather than
//! taken from a crate: it is twenty lines, and the tests need the exact OCP semantics
//! (saturation, the "fn" NaN) spelled out next to the bounds that rely on them.

/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The value of an e4m3 byte (NaN for 0x7F and 0xFF).
pub fn e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((byte >> 3) & 0xF) as i32;
    let man = (byte & 0x7) as f32;
    if exp == 0xF && byte & 0x7 == 0x7 {
        return f32::NAN;
    }
    if exp == 0 {
        return sign * man / 8.0 * 2f32.powi(-6);
    }
    sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
}

/// The value of an e5m2 byte (infinities and NaNs as IEEE half's upper byte).
pub fn e5m2_to_f32(byte: u8) -> f32 {
    crate::testing::f16_to_f32((byte as u16) << 8)
}

/// Largest finite e5m2 value.
pub const E5M2_MAX: f32 = 57344.0;

/// `v` rounded to the nearest e4m3 value, ties to even, saturated to ±448 (the conversion
/// torch's and cuda_fp8.h's `__NV_SATFINITE` make); NaN stays NaN (0x7F).
pub fn f32_to_e4m3(v: f32) -> u8 {
    round_satfinite(v, e4m3_to_f32, 0x7E, 0x7F)
}

/// `v` rounded to the nearest e5m2 value, ties to even, saturated to ±57344 (infinities
/// too: `__NV_SATFINITE`); NaN stays NaN (0x7F).
pub fn f32_to_e5m2(v: f32) -> u8 {
    round_satfinite(v, e5m2_to_f32, 0x7B, 0x7F)
}

/// Rounding to a format whose positive codes `0..=max_code` increase in value (both fp8
/// formats): nearest, ties to the even code (an even mantissa), magnitudes past the largest
/// finite value (infinite ones included) saturated to it; NaN to `nan_code`.
fn round_satfinite(v: f32, decode: fn(u8) -> f32, max_code: u8, nan_code: u8) -> u8 {
    if v.is_nan() {
        return nan_code;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs().min(decode(max_code));
    let (mut lo, mut hi) = (0u8, max_code);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if decode(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (dl, dh) = (a - decode(lo), decode(hi) - a);
    let code = if dl < dh || (dl == dh && lo % 2 == 0) { lo } else { hi };
    sign | if a <= decode(lo) { lo } else { code }
}

/// Whether `code` is a finite value of `e4m3` (true) or e5m2 (false).
pub fn is_finite_code(code: u8, e4m3: bool) -> bool {
    if e4m3 {
        code & 0x7F != 0x7F
    } else {
        code & 0x7F < 0x7C
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_decodes_the_ocp_table() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9), "smallest subnormal");
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6), "smallest normal");
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        assert_eq!(e4m3_to_f32(0x78), 256.0, "exponent 15 is finite in e4m3fn");
    }

    #[test]
    fn e5m2_decodes_as_the_upper_byte_of_half() {
        assert_eq!(e5m2_to_f32(0x3C), 1.0);
        assert_eq!(e5m2_to_f32(0x7B), 57344.0);
        assert_eq!(e5m2_to_f32(0x7C), f32::INFINITY);
        assert!(e5m2_to_f32(0x7F).is_nan());
    }

    #[test]
    fn rounding_to_e4m3_is_nearest_even_and_saturates() {
        for code in (0u8..=0x7E).chain(0x80..=0xFE) {
            assert_eq!(f32_to_e4m3(e4m3_to_f32(code)) & 0x7F, code & 0x7F, "code {code:#x} round trips");
        }
        assert_eq!(f32_to_e4m3(1.0625), 0x38, "halfway between 1 and 1.125: to the even 1.0");
        assert_eq!(f32_to_e4m3(1.1875), 0x3A, "halfway between 1.125 and 1.25: to the even 1.25");
        assert_eq!(f32_to_e4m3(1.05), 0x38);
        assert_eq!(f32_to_e4m3(1.07), 0x39, "past the midpoint 1.0625");
        assert_eq!(f32_to_e4m3(1.1), 0x39);
        assert_eq!(f32_to_e4m3(1.0e6), 0x7E);
        assert_eq!(f32_to_e4m3(-1.0e6), 0xFE);
        assert_eq!(f32_to_e4m3(-2.0), 0xC0);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7F);
        assert_eq!(f32_to_e4m3(2f32.powi(-11)), 0x00, "below half the smallest subnormal: zero");
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7E, "saturated, not NaN");
        assert_eq!(f32_to_e4m3(464.0), 0x7E, "past 448 (even beyond the next step) saturates");
    }

    #[test]
    fn rounding_to_e5m2_is_nearest_even_and_saturates() {
        for code in (0u8..=0x7B).chain(0x80..=0xFB) {
            assert_eq!(f32_to_e5m2(e5m2_to_f32(code)), code, "code {code:#x} round trips");
        }
        assert_eq!(f32_to_e5m2(1.125), 0x3C, "halfway between 1 and 1.25: to the even 1.0");
        assert_eq!(f32_to_e5m2(1.375), 0x3E, "halfway between 1.25 and 1.5: to the even 1.5");
        assert_eq!(f32_to_e5m2(2f32.powi(-17)), 0x00, "half the smallest subnormal: to the even zero");
        assert_eq!(f32_to_e5m2(1.5 * 2f32.powi(-17)), 0x01);
        assert_eq!(f32_to_e5m2(65504.0), 0x7B, "beyond 57344 saturates");
        assert_eq!(f32_to_e5m2(f32::NEG_INFINITY), 0xFB, "infinities saturate too");
        assert_eq!(f32_to_e5m2(f32::NAN), 0x7F);
        assert!((0..=255u8).filter(|&c| is_finite_code(c, false)).all(|c| e5m2_to_f32(c).is_finite()));
        assert!((0..=255u8).filter(|&c| is_finite_code(c, true)).all(|c| e4m3_to_f32(c).is_finite()));
        assert_eq!((0..=255u8).filter(|&c| is_finite_code(c, true)).count(), 254);
        assert_eq!((0..=255u8).filter(|&c| is_finite_code(c, false)).count(), 248);
    }
}
