//! Launchers for kernels/util.cu: device-side random fills for tests and benchmarks.

use crate::cuda::{self, sys, LaunchConfig};
use crate::error::{MkError, Result};
use crate::kernel_abi::FillRandomParams;
use crate::types::mkDataType_t;

/// Fills `count` elements at `data` with uniform values in [-scale, scale) from `seed`.
pub fn fill_random(
    data: u64,
    count: u64,
    dtype: mkDataType_t,
    seed: u64,
    scale: f32,
    stream: sys::CUstream,
) -> Result<()> {
    use mkDataType_t::*;
    if !matches!(dtype, mkFloat16 | mkBfloat16 | mkFloat32 | mkFloat64 | mkInt32) {
        return Err(MkError::invalid_argument(format!("fill_random does not support {}", dtype.name())));
    }
    let f = crate::cuda::kernels::MK_FILL_RANDOM.function()?;
    let mut p = FillRandomParams { data, count, seed, dtype: dtype as i32, scale };
    let blocks = count.div_ceil(256).clamp(1, 4096) as u32;
    let cfg = LaunchConfig { grid: (blocks, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the kernel takes one FillRandomParams by value; data is the caller's buffer.
    unsafe { cuda::launch(f, cfg, stream, &mut [(&mut p as *mut FillRandomParams).cast()]) }
}
