//! Device allocations that free themselves, for the library's own buffers.

use super::{cuda_err, driver};
use crate::error::Result;
use cudarc::driver::result as cu;
use cudarc::driver::sys;

/// A device allocation owned by mkernel; freed on drop (in whatever context is current,
/// which is fine for cuMemFree: the pointer identifies its context).
pub struct DeviceBuffer {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
}

impl DeviceBuffer {
    pub fn alloc(bytes: usize) -> Result<Self> {
        driver()?;
        // SAFETY: a plain allocation in the current context.
        let ptr =
            unsafe { cu::malloc_sync(bytes.max(1)) }.map_err(|e| cuda_err(&format!("cuMemAlloc({bytes} bytes)"), e))?;
        Ok(DeviceBuffer { ptr, bytes })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemAlloc and is freed once.
        let _ = unsafe { cu::free_sync(self.ptr) };
    }
}
