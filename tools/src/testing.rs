//! Support for the GPU test driver (`mktest`) and the benchmarks (`mkbench`): host-side
//! conversions, float64 error measures, device buffers with random contents. Not part of
//! the C ABI.

mod acceptance;
pub mod collective_values;
pub mod fill;
pub mod fp8;
mod graph;
pub use acceptance::{
    accumulation_unit, check_close, check_exact, check_exact_bytes, check_exact_or_nan, gamma, gemm_reference,
    underflow_floor, unit_roundoff, Rule, Verdict, Worst,
};
pub use graph::{CapturedGraph, CAPTURE_MODE};

use cudarc::driver::result as cu;
use mkernel::cuda::{self, memory::DeviceBuffer, sys};
use mkernel::error::Result;
use mkernel::types::mkDataType_t;

pub use mkernel::cuda::gpu_unavailable_reason;

pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

pub fn f32_to_bf16(f: f32) -> u16 {
    if f.is_nan() {
        return 0x7fc0;
    }
    let bits = f.to_bits();
    let round = 0x7fff + ((bits >> 16) & 1);
    ((bits + round) >> 16) as u16
}

pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as i32;
    let mant = (h & 0x3ff) as u32;
    let bits = if exp == 0 {
        if mant == 0 {
            sign
        } else {
            // subnormal: value = mant * 2^-24
            let v = mant as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
    } else if exp == 31 {
        sign | 0x7f80_0000 | (mant << 13)
    } else {
        sign | (((exp - 15 + 127) as u32) << 23) | (mant << 13)
    };
    f32::from_bits(bits)
}

pub fn f32_to_f16(f: f32) -> u16 {
    let bits = f.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    if f.is_nan() {
        return sign | 0x7e00;
    }
    let a = f.abs();
    if a >= 65520.0 {
        return sign | 0x7c00;
    }
    if a < 6.103_515_6e-5 {
        // subnormal half: round to a multiple of 2^-24
        return sign | (a * 16_777_216.0).round_ties_even() as u16;
    }
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    let mant = bits & 0x7f_ffff;
    let mut h = ((exp as u32) << 10) | (mant >> 13);
    let rem = mant & 0x1fff;
    if rem > 0x1000 || (rem == 0x1000 && (h & 1) == 1) {
        h += 1;
    }
    sign | h as u16
}

/// `n` values uniform in [0, 1) from a xorshift sequence seeded by `seed`: the raw inputs of
/// the CPU models of the kernels' rounding, each test mapping them to its range and dtype.
pub fn xorshift_unit(seed: u64, n: usize) -> impl Iterator<Item = f64> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n).map(move |_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 11) as f64 / (1u64 << 53) as f64
    })
}

/// `v` rounded to the nearest value of the float type `dtype` (other types unchanged).
pub fn round_to(dtype: mkDataType_t, v: f64) -> f64 {
    match dtype {
        mkDataType_t::mkBfloat16 => bf16_to_f32(f32_to_bf16(v as f32)) as f64,
        mkDataType_t::mkFloat16 => f16_to_f32(f32_to_f16(v as f32)) as f64,
        mkDataType_t::mkFloat32 => v as f32 as f64,
        _ => v,
    }
}

/// Decodes raw device bytes of `dtype` into f64 values.
pub fn to_f64(bytes: &[u8], dtype: mkDataType_t) -> Vec<f64> {
    use mkDataType_t::*;
    let n = dtype.size();
    bytes
        .chunks_exact(n)
        .map(|c| match dtype {
            mkFloat16 => f16_to_f32(u16::from_le_bytes([c[0], c[1]])) as f64,
            mkBfloat16 => bf16_to_f32(u16::from_le_bytes([c[0], c[1]])) as f64,
            mkFloat32 => f32::from_le_bytes(c.try_into().unwrap()) as f64,
            mkFloat64 => f64::from_le_bytes(c.try_into().unwrap()),
            mkInt8 => c[0] as i8 as f64,
            mkUint8 => c[0] as f64,
            mkInt32 => i32::from_le_bytes(c.try_into().unwrap()) as f64,
            mkUint32 => u32::from_le_bytes(c.try_into().unwrap()) as f64,
            mkInt64 => i64::from_le_bytes(c.try_into().unwrap()) as f64,
            mkUint64 => u64::from_le_bytes(c.try_into().unwrap()) as f64,
            mkFloat8e4m3 => fp8::e4m3_to_f32(c[0]) as f64,
            mkFloat8e5m2 => fp8::e5m2_to_f32(c[0]) as f64,
        })
        .collect()
}

/// ‖out − ref‖₂ / ‖ref‖₂, infinite when any output is NaN or infinite (NaN never passes).
pub fn relative_error(out: &[f64], reference: &[f64]) -> f64 {
    assert_eq!(out.len(), reference.len());
    let mut num = 0.0;
    let mut den = 0.0;
    for (o, r) in out.iter().zip(reference) {
        if !o.is_finite() {
            return f64::INFINITY;
        }
        num += (o - r) * (o - r);
        den += r * r;
    }
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (num / den).sqrt()
    }
}

/// The limit on ‖out − ref‖₂ / ‖ref‖₂ for a result in `dtype`: the second check after the
/// element-wise rule (see `Rule`), a backstop against errors spread thinly over every element.
pub fn tolerance(dtype: mkDataType_t) -> f64 {
    match dtype {
        mkDataType_t::mkBfloat16 => 1e-2,
        mkDataType_t::mkFloat16 => 2e-3,
        mkDataType_t::mkFloat32 => 1e-5,
        _ => 1e-12,
    }
}

/// Bytes of the guard band before and after every `TestBuffer` (a multiple of 128, so
/// the payload keeps the alignment TMA and vector accesses need).
pub const GUARD_BYTES: usize = 512;

/// The byte every guard band holds: neither the poison (0xFF) nor a zero, so a stray write
/// of either, or of data, changes it.
pub const GUARD_BYTE: u8 = 0x5A;

/// A device buffer of `count` elements of `dtype` between two guard bands of
/// `GUARD_BYTES`, filled with `GUARD_BYTE` at allocation: a kernel that writes past either
/// end of its output is caught by `guards_intact`, one that reads past an input reads the
/// guard pattern instead of a neighbour's data.
pub struct TestBuffer {
    pub buf: DeviceBuffer,
    pub count: usize,
    pub dtype: mkDataType_t,
}

impl TestBuffer {
    pub fn new(count: usize, dtype: mkDataType_t) -> Result<Self> {
        let buf = DeviceBuffer::alloc(count * dtype.size() + 2 * GUARD_BYTES)?;
        // SAFETY: the range is this allocation.
        unsafe { cu::memset_d8_sync(buf.ptr, GUARD_BYTE, count * dtype.size() + 2 * GUARD_BYTES) }
            .map_err(|e| cuda::cuda_err("cuMemsetD8", e))?;
        Ok(TestBuffer { buf, count, dtype })
    }
    /// The first element (past the leading guard band).
    pub fn ptr(&self) -> u64 {
        self.buf.ptr + GUARD_BYTES as u64
    }
    pub fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }
    /// Fills with uniform values in [-scale, scale) on the device.
    pub fn randomize(&self, seed: u64, scale: f32, stream: sys::CUstream) -> Result<()> {
        crate::testing::fill::fill_random(self.ptr(), self.count as u64, self.dtype, seed, scale, stream)
    }
    /// Fills every byte with 0xFF: NaN for the floating types, so unwritten outputs fail.
    pub fn poison(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the range is this allocation's payload.
        unsafe { cu::memset_d8_async(self.ptr(), 0xff, self.bytes(), stream) }
            .map_err(|e| cuda::cuda_err("cuMemsetD8Async", e))
    }
    pub fn download(&self) -> Result<Vec<u8>> {
        let mut host = vec![0u8; self.bytes()];
        // SAFETY: host has room for the whole payload.
        unsafe { cu::memcpy_dtoh_sync(&mut host, self.ptr()) }.map_err(|e| cuda::cuda_err("cuMemcpyDtoH", e))?;
        Ok(host)
    }
    pub fn download_f64(&self) -> Result<Vec<f64>> {
        Ok(to_f64(&self.download()?, self.dtype))
    }
    pub fn upload(&self, bytes: &[u8]) -> Result<()> {
        assert_eq!(bytes.len(), self.bytes());
        // SAFETY: the payload holds bytes.len() bytes.
        unsafe { cu::memcpy_htod_sync(self.ptr(), bytes) }.map_err(|e| cuda::cuda_err("cuMemcpyHtoD", e))
    }
    /// None when both guard bands still hold `GUARD_BYTE` everywhere, else which band was
    /// written and where (the byte offset from the payload's edge).
    pub fn guards_intact(&self) -> Result<Option<String>> {
        let mut band = vec![0u8; GUARD_BYTES];
        for (name, at) in [("before", self.buf.ptr), ("after", self.ptr() + self.bytes() as u64)] {
            // SAFETY: each band lies inside this allocation.
            unsafe { cu::memcpy_dtoh_sync(&mut band, at) }.map_err(|e| cuda::cuda_err("cuMemcpyDtoH", e))?;
            if let Some(i) = band.iter().position(|&b| b != GUARD_BYTE) {
                let offset = if name == "before" { GUARD_BYTES - i } else { i + 1 };
                let written = band.iter().filter(|&&b| b != GUARD_BYTE).count();
                return Ok(Some(format!(
                    "{written} byte(s) of the guard band {name} the buffer written ({offset} bytes from its edge)"
                )));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_and_bfloat_round_trip_representable_values() {
        for v in [0.0f32, 1.0, -2.5, 0.099975586, 65504.0, -6.1035156e-5, 5.9604645e-8] {
            assert_eq!(f16_to_f32(f32_to_f16(v)), v, "f16 {v}");
        }
        for v in [0.0f32, 1.0, -2.5, 3.0e38, 1.0e-38] {
            let back = bf16_to_f32(f32_to_bf16(v));
            assert!((back - v).abs() <= v.abs() * 0.004, "bf16 {v} -> {back}");
        }
        assert!(f16_to_f32(f32_to_f16(f32::NAN)).is_nan());
        assert_eq!(f16_to_f32(f32_to_f16(1.0e6)), f32::INFINITY);
        // round to nearest even at the halfway point of 1 + 2^-11
        assert_eq!(f16_to_f32(f32_to_f16(1.0 + 1.0 / 2048.0)), 1.0);
    }

    #[test]
    fn relative_error_rejects_nan() {
        assert_eq!(relative_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!(relative_error(&[1.0, f64::NAN], &[1.0, 2.0]).is_infinite());
        assert!((relative_error(&[1.1], &[1.0]) - 0.1).abs() < 1e-12);
    }
}
