//! The GPU the planners size roles for: how fast a whole H100 / H200 computes a GEMM.

/// GEMM rate assumed for a whole H100/H200 when sizing roles (FLOP/s; measured cuBLAS
/// ~700 T), and its SM count: a grid of g CTAs is assumed to compute at g / 132 of it
/// (ranks sharing one GPU get a fraction of its SMs, so their GEMMs take longer and hide
/// more communication).
pub const GEMM_FLOPS_PER_S: f64 = 700e12;
pub const FULL_GPU_SMS: f64 = 132.0;

/// Estimated seconds of an M×N×K GEMM on `ctas` CTAs.
pub fn gemm_seconds(m: usize, n: usize, k: usize, ctas: u32) -> f64 {
    2.0 * m as f64 * n as f64 * k as f64 / (GEMM_FLOPS_PER_S * (ctas as f64 / FULL_GPU_SMS).min(1.0))
}
