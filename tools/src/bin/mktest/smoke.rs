//! The kernel pipeline end to end: the embedded fatbin loads, a kernel runs, and its
//! output matches a host recomputation of the same random stream's statistics.

use crate::outcome::{self, Outcome};
use mkernel::cuda::{self, PrimaryContext};
use mkernel::error::MkError;
use mkernel::types::mkDataType_t;
use mkernel_tools::testing::TestBuffer;

pub fn run() -> mkernel::Result<Outcome> {
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
        outcome::count(1);
        println!(
            "  fill_random {:>8} n={n}: mean {mean:+.4} var {var:.4} out-of-range {bad} -> {}",
            dtype.name(),
            if ok { "ok" } else { "WRONG" }
        );
        if !ok {
            return Err(MkError::internal(format!("fill_random {} produced wrong statistics", dtype.name())));
        }
    }
    // The guard bands around a buffer survive a fill of its payload (the harness's own
    // guard check is exercised before any suite relies on it).
    let buf = TestBuffer::new(4099, mkDataType_t::mkBfloat16)?;
    buf.randomize(7, 1.0, std::ptr::null_mut())?;
    buf.poison(std::ptr::null_mut())?;
    cuda::check("cuCtxSynchronize", unsafe { cuda::sys::cuCtxSynchronize() })?;
    if let Some(what) = buf.guards_intact()? {
        return Err(MkError::internal(format!("fill_random/poison wrote outside the payload: {what}")));
    }
    // ...and a write one element past the end is caught.
    // SAFETY: the trailing guard band lies inside the allocation.
    unsafe { cudarc::driver::result::memset_d8_sync(buf.ptr() + buf.bytes() as u64, 0, 2) }
        .map_err(|e| cuda::cuda_err("cuMemsetD8", e))?;
    if buf.guards_intact()?.is_none() {
        return Err(MkError::internal("a write past the end of a TestBuffer went unnoticed"));
    }
    outcome::count(1);
    println!("  guard bands: intact after fills, a write past the end detected -> ok");
    let _ = cuda::sm_count(0)?;
    Ok(Outcome::Ran)
}
