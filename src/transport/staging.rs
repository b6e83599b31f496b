//! Staging device memory through pinned host buffers, for the socket transport's windows
//! in device memory: each transport thread owns one `DeviceStager` (its own non-blocking
//! stream and two pinned chunks) and streams a put chunk by chunk, the copy of one chunk
//! overlapping the socket transfer of the other.
//!
//! The stream must be non-blocking: a copy on the legacy default stream would wait for the
//! persistent kernel that is waiting for this very data.
//!
//! Not yet run on a GPU (the development machine has none); the chunking is unit-tested.

use crate::error::{MkError, Result};
use cudarc::driver::sys;

/// Bytes per staging chunk.
pub const STAGING_CHUNK_BYTES: usize = 4 << 20;

/// (offset, bytes) of each chunk of a `len`-byte transfer.
pub fn chunks(len: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..len.div_ceil(chunk)).map(move |i| (i * chunk, chunk.min(len - i * chunk)))
}

/// A thread's CUDA stream and pinned double buffer.
pub struct DeviceStager {
    stream: sys::CUstream,
    buffers: [*mut u8; 2],
    chunk: usize,
}

fn check(what: &str, r: sys::CUresult) -> Result<()> {
    crate::cuda::check(what, r).map_err(|e| e.context("staging a socket transfer through host memory"))
}

impl DeviceStager {
    /// Makes `context` (a `CUcontext`, retained by the communicator for the transport's
    /// lifetime) current on the calling thread and allocates the stream and buffers.
    pub fn new(context: usize) -> Result<DeviceStager> {
        crate::cuda::driver()?;
        // SAFETY: the communicator keeps the context alive while the transport exists.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(context as sys::CUcontext) })?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: creates a stream in the current context; destroyed in Drop.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        let mut stager = DeviceStager { stream, buffers: [std::ptr::null_mut(); 2], chunk: STAGING_CHUNK_BYTES };
        for b in &mut stager.buffers {
            let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: allocates pinned host memory; freed in Drop.
            check("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut p, STAGING_CHUNK_BYTES, 0) })?;
            *b = p.cast();
        }
        Ok(stager)
    }

    fn buffer(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: each buffer is a live pinned allocation of `chunk` bytes, used by this
        // thread only, and never while a copy into or out of it is in flight (callers sync).
        unsafe { std::slice::from_raw_parts_mut(self.buffers[i % 2], self.chunk) }
    }

    fn sync(&self) -> Result<()> {
        // SAFETY: our stream.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.stream) })
    }

    fn copy_out(&self, buffer: usize, device: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller checked [device, +bytes) lies in the registered device window;
        // the buffer holds `chunk` >= bytes and is not in use by another copy.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(self.buffers[buffer % 2].cast(), device, bytes, self.stream)
        })
    }

    fn copy_in(&self, device: u64, buffer: *const u8, bytes: usize) -> Result<()> {
        // SAFETY: as copy_out, in the other direction.
        check("cuMemcpyHtoDAsync", unsafe { sys::cuMemcpyHtoDAsync_v2(device, buffer.cast(), bytes, self.stream) })
    }

    /// Hands `[device, +len)` to `sink` chunk by chunk, copying the next chunk while the
    /// current one is being sent.
    pub fn send_from_device(&mut self, device: u64, len: usize, sink: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        let plan: Vec<(usize, usize)> = chunks(len, self.chunk).collect();
        if plan.is_empty() {
            return Ok(());
        }
        self.copy_out(0, device, plan[0].1)?;
        self.sync()?;
        for (k, &(_, bytes)) in plan.iter().enumerate() {
            if let Some(&(next_offset, next_bytes)) = plan.get(k + 1) {
                self.copy_out(k + 1, device + next_offset as u64, next_bytes)?;
            }
            let result = sink(&self.buffer(k)[..bytes]);
            // Always wait for the copy in flight before returning (even on error): it
            // writes into our buffer.
            let synced = self.sync();
            result?;
            synced?;
        }
        Ok(())
    }

    /// Fills `[device, +len)` from `source` chunk by chunk (source fills the whole slice
    /// it is given), the copy to the device of one chunk overlapping the receipt of the next.
    /// Returns once every byte is on the device.
    pub fn receive_into_device(&mut self, device: u64, len: usize, source: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()> {
        for (k, (offset, bytes)) in chunks(len, self.chunk).enumerate() {
            // Buffer k % 2 was last used by the copy of chunk k - 2: wait for it.
            if k >= 2 {
                self.sync()?;
            }
            let buffer = self.buffer(k);
            let filled = source(&mut buffer[..bytes]);
            if let Err(e) = filled {
                let _ = self.sync();
                return Err(e);
            }
            self.copy_in(device + offset as u64, self.buffers[k % 2], bytes)?;
        }
        self.sync()
    }

    /// Writes one u64 (a signal word) to device memory, after everything copied before it.
    pub fn store_u64(&mut self, device: u64, value: u64) -> Result<()> {
        self.sync()?;
        self.buffer(0)[..8].copy_from_slice(&value.to_ne_bytes());
        self.copy_in(device, self.buffers[0], 8)?;
        self.sync()
    }
}

impl Drop for DeviceStager {
    fn drop(&mut self) {
        // SAFETY: our stream and buffers, released once, after the last copy finished.
        unsafe {
            sys::cuStreamSynchronize(self.stream);
            for b in self.buffers {
                if !b.is_null() {
                    sys::cuMemFreeHost(b.cast());
                }
            }
            sys::cuStreamDestroy_v2(self.stream);
        }
    }
}

/// Why a device window cannot be staged without a context.
pub fn missing_context() -> MkError {
    MkError::invalid_usage(
        "a socket-transport window in device memory needs the communicator's CUDA context (SocketTransport::set_cuda_context)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_byte_once() {
        for (len, chunk) in [(0, 4), (1, 4), (4, 4), (5, 4), (9, 4), (STAGING_CHUNK_BYTES * 2 + 3, STAGING_CHUNK_BYTES)] {
            let plan: Vec<_> = chunks(len, chunk).collect();
            let mut next = 0;
            for &(offset, bytes) in &plan {
                assert_eq!(offset, next);
                assert!(bytes > 0 && bytes <= chunk);
                next += bytes;
            }
            assert_eq!(next, len, "len {len} chunk {chunk}: {plan:?}");
        }
    }
}
