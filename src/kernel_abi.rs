//! Parameter structs shared by Rust launchers and CUDA kernels. build.rs turns this file
//! into `mk_kernel_abi.h` (cbindgen), which every kernel includes, so the two sides cannot
//! disagree about a field's offset. Keep it plain `#[repr(C)]` data with fixed-size fields.

/// Fills a device buffer with reproducible pseudo-random values, uniform in [-1, 1)
/// scaled by `scale` (test and benchmark inputs: never zeros).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FillRandomParams {
    /// Device pointer to the buffer.
    pub data: u64,
    /// Number of elements.
    pub count: u64,
    /// Seed; different seeds give unrelated streams.
    pub seed: u64,
    /// Element type as an `mkDataType_t` value (floating types only).
    pub dtype: i32,
    pub scale: f32,
}
