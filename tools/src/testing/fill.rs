//! Launchers for kernels/util.cu: device-side random fills for tests and benchmarks (tool
//! kernels, in the tools' fatbin: registered here before the first launch).

use mkernel::cuda::sys;
use mkernel::error::{MkError, Result};
use mkernel::kernel_abi::FillRandomParams;
use mkernel::ops::common::launch::KernelLaunch;
use mkernel::types::mkDataType_t;

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
    mkernel::cuda::register_tool_kernels();
    let mut p = FillRandomParams { data, count, seed, dtype: dtype as i32, scale };
    let kernel_launch = KernelLaunch::new(mkernel::cuda::kernels::MK_FILL_RANDOM, fill_grid(count), THREADS, 0);
    // SAFETY: the kernel takes one FillRandomParams by value; data is the caller's buffer.
    unsafe { kernel_launch.launch(stream, &mut [(&mut p as *mut FillRandomParams).cast()], None) }
}

/// Threads per block of the fill kernel.
const THREADS: u32 = 256;

/// Blocks of a fill of `count` elements: one element per thread, at most 4096 blocks (the
/// kernel strides over the rest).
pub fn fill_grid(count: u64) -> u32 {
    count.div_ceil(THREADS as u64).clamp(1, 4096) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_blocks_cover_the_elements_up_to_4096() {
        for (count, blocks) in [(0, 1), (1, 1), (256, 1), (257, 2), (4096 * 256, 4096), (u64::MAX / 2, 4096)] {
            assert_eq!(fill_grid(count), blocks, "{count}");
        }
    }
}
