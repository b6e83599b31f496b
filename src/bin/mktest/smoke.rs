//! The kernel pipeline end to end: the embedded fatbin loads, a kernel runs, and its
//! output matches a host recomputation of the same random stream's statistics.

use mkernel::cuda::{self, PrimaryContext};
use mkernel::error::MkError;
use mkernel::testing::TestBuffer;
use mkernel::types::mkDataType_t;

pub fn run() -> mkernel::Result<()> {
    let ctx = PrimaryContext::retain(0)?;
    let _g = ctx.enter()?;
    for dtype in [mkDataType_t::mkFloat32, mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16] {
        let n = 1_000_003;
        let buf = TestBuffer::new(n, dtype)?;
        buf.poison(std::ptr::null_mut())?;
        buf.randomize(42, 2.0, std::ptr::null_mut())?;
        let v = buf.download_f64()?;
        let bad = v.iter().filter(|x| !x.is_finite() || x.abs() > 2.0).count();
        let mean = v.iter().sum::<f64>() / n as f64;
        let var = v.iter().map(|x| x * x).sum::<f64>() / n as f64;
        // Uniform on [-2, 2): mean 0, variance 4/3.
        let ok = bad == 0 && mean.abs() < 0.01 && (var - 4.0 / 3.0).abs() < 0.01;
        println!("  fill_random {:>8} n={n}: mean {mean:+.4} var {var:.4} out-of-range {bad} -> {}", dtype.name(), if ok { "ok" } else { "WRONG" });
        if !ok {
            return Err(MkError::internal(format!("fill_random {} produced wrong statistics", dtype.name())));
        }
    }
    let _ = cuda::sm_count(0)?;
    Ok(())
}
