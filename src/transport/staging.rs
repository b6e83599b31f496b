//! Staging device memory through pinned host buffers, for the socket transport's windows
//! in device memory: each transport thread owns one `DeviceStager` (its own non-blocking
//! stream, a ring of `STAGING_BUFFERS` pinned chunks, one event per chunk).
//!
//! Nothing here waits for the whole stream: every copy records its buffer's event, and a
//! thread waits only for the one buffer it is about to reuse or read. So
//! - a sender issues the device→host copies of the next chunks (of this put and of puts
//!   queued behind it) while it writes the current one to the socket (`start_copy_out` /
//!   `finish_copy_out`, in order);
//! - a receiver hands each chunk to a host→device copy and goes back to the socket at once,
//!   and the signal word is written by the stream itself (`cuStreamWriteValue64`) behind
//!   the data copies: data before signal by stream order, with no host round trip. Where
//!   stream memory operations are not available it falls back to synchronising the stream
//!   and copying the word (three CUDA round trips per message).
//!
//! The stream must be non-blocking: a copy on the legacy default stream would wait for the
//! persistent kernel that is waiting for this very data.

use crate::error::{MkError, Result};
use cudarc::driver::sys;

/// Bytes per staging chunk.
pub const STAGING_CHUNK_BYTES: usize = 1 << 20;
/// Pinned chunks per transport thread: how far a sender's copies run ahead of its writes,
/// and how many host→device copies a receiver keeps in flight.
pub const STAGING_BUFFERS: usize = 8;
/// Bytes in front of each chunk, so a put's first chunk goes out in one write with its
/// frame header (which must fit here).
pub const STAGING_HEADROOM: usize = 64;

/// (offset, bytes) of each chunk of a `len`-byte transfer.
pub fn chunks(len: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..len.div_ceil(chunk)).map(move |i| (i * chunk, chunk.min(len - i * chunk)))
}

/// The `index`-th chunk (counting from 0) of the concatenation of transfers `lens` (each
/// split by `chunk`), skipping the first `skip` chunks of the first transfer: (transfer,
/// offset, bytes). What a sender's copy-ahead walks over its queue of puts.
pub fn nth_chunk(
    lens: impl IntoIterator<Item = usize>,
    skip: usize,
    index: usize,
    chunk: usize,
) -> Option<(usize, usize, usize)> {
    let chunk = chunk.max(1);
    let mut left = index;
    for (t, len) in lens.into_iter().enumerate() {
        let first = if t == 0 { skip } else { 0 };
        let n = len.div_ceil(chunk).saturating_sub(first);
        if left < n {
            let offset = (first + left) * chunk;
            return Some((t, offset, chunk.min(len - offset)));
        }
        left -= n;
    }
    None
}

/// Count, total and longest of one kind of CUDA call (for the transport threads' INFO log).
#[derive(Clone, Copy, Default, Debug)]
pub struct CallTime {
    pub calls: u64,
    pub total: std::time::Duration,
    pub max: std::time::Duration,
}

impl CallTime {
    fn add(&mut self, since: std::time::Instant) {
        let d = since.elapsed();
        self.calls += 1;
        self.total += d;
        self.max = self.max.max(d);
    }
}

impl std::fmt::Display for CallTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let avg = if self.calls == 0 { 0.0 } else { self.total.as_secs_f64() * 1e6 / self.calls as f64 };
        write!(f, "{} x {avg:.1} us (max {:.0} us)", self.calls, self.max.as_secs_f64() * 1e6)
    }
}

/// Where a stager's time went: waits for buffers' copies, issuing copies, signal writes.
#[derive(Clone, Copy, Default, Debug)]
pub struct StagerTimes {
    pub wait: CallTime,
    pub issue: CallTime,
    pub signal: CallTime,
}

/// A thread's CUDA stream, pinned chunk ring and events.
pub struct DeviceStager {
    stream: sys::CUstream,
    /// Each `STAGING_HEADROOM + chunk` bytes; the chunk's data starts after the headroom.
    buffers: Vec<*mut u8>,
    events: Vec<sys::CUevent>,
    /// Whether a copy into or out of buffer i was issued and not yet waited for.
    busy: Vec<bool>,
    /// The buffer `acquire` hands out next (round robin: buffers are used in issue order).
    next: usize,
    chunk: usize,
    /// Pinned word the fallback signal store copies from.
    word: *mut u64,
    /// Whether `cuStreamWriteValue64` may be used (device attribute, then the first call).
    stream_mem_ops: bool,
    pub times: StagerTimes,
}

fn check(what: &str, r: sys::CUresult) -> Result<()> {
    crate::cuda::check(what, r).map_err(|e| e.context("staging a socket transfer through host memory"))
}

impl DeviceStager {
    /// Makes `context` (a `CUcontext`, retained by the communicator for the transport's
    /// lifetime) current on the calling thread, a transport thread, sets that thread's
    /// stream-capture mode to relaxed for its life, and allocates the stream, buffers and
    /// events. Relaxed: its copies, allocations and event waits, made while the kernels of
    /// earlier calls move data, must neither be refused by nor invalidate a capture that an
    /// application thread has open in global mode (CUDA's default).
    pub fn new(context: usize) -> Result<DeviceStager> {
        crate::cuda::driver()?;
        // SAFETY: the communicator keeps the context alive while the transport exists.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(context as sys::CUcontext) })?;
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: sets the calling thread's mode; the previous one is not needed back.
        check("cuThreadExchangeStreamCaptureMode", unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) })?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: creates a stream in the current context; destroyed in Drop.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        let mut stager = DeviceStager {
            stream,
            buffers: Vec::with_capacity(STAGING_BUFFERS),
            events: Vec::with_capacity(STAGING_BUFFERS),
            busy: vec![false; STAGING_BUFFERS],
            next: 0,
            chunk: STAGING_CHUNK_BYTES,
            word: std::ptr::null_mut(),
            stream_mem_ops: false,
            times: StagerTimes::default(),
        };
        for _ in 0..STAGING_BUFFERS {
            let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: allocates pinned host memory; freed in Drop.
            check("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut p, STAGING_HEADROOM + STAGING_CHUNK_BYTES, 0) })?;
            stager.buffers.push(p.cast());
            let mut e: sys::CUevent = std::ptr::null_mut();
            // SAFETY: creates an event in the current context; destroyed in Drop.
            check("cuEventCreate", unsafe {
                sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            })?;
            stager.events.push(e);
        }
        let mut w: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: as the buffers.
        check("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut w, 8, 0) })?;
        stager.word = w.cast();
        let mut dev: sys::CUdevice = 0;
        // SAFETY: writes one CUdevice of the current context.
        check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) })?;
        stager.stream_mem_ops = crate::cuda::device_attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
        )
        .is_ok_and(|v| v != 0);
        Ok(stager)
    }

    /// The next buffer in round-robin order, once the copy last issued on it has finished.
    fn acquire(&mut self) -> Result<usize> {
        let i = self.next;
        self.next = (i + 1) % self.buffers.len();
        self.wait(i)?;
        Ok(i)
    }

    /// Waits for the copy last issued on buffer `i`, if any.
    fn wait(&mut self, i: usize) -> Result<()> {
        if self.busy[i] {
            let t = std::time::Instant::now();
            // SAFETY: our event, recorded on our stream.
            check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.events[i]) })?;
            self.times.wait.add(t);
            self.busy[i] = false;
        }
        Ok(())
    }

    fn record(&mut self, i: usize) -> Result<()> {
        // SAFETY: our event and stream.
        check("cuEventRecord", unsafe { sys::cuEventRecord(self.events[i], self.stream) })?;
        self.busy[i] = true;
        Ok(())
    }

    fn data_ptr(&self, i: usize) -> *mut u8 {
        // SAFETY: each buffer holds STAGING_HEADROOM + chunk bytes.
        unsafe { self.buffers[i].add(STAGING_HEADROOM) }
    }

    pub fn chunk_bytes(&self) -> usize {
        self.chunk
    }

    pub fn buffer_count(&self) -> usize {
        self.buffers.len()
    }

    /// Starts copying `[device, +bytes)` (at most one chunk) into the next buffer and
    /// returns it. Buffers are handed out round robin, so a caller that keeps at most
    /// `buffer_count()` copies outstanding and finishes them in order never waits here for
    /// a buffer it has not finished with.
    pub fn start_copy_out(&mut self, device: u64, bytes: usize) -> Result<usize> {
        assert!(bytes <= self.chunk, "a staged copy is at most one chunk");
        let i = self.acquire()?;
        let t = std::time::Instant::now();
        // SAFETY: the caller checked [device, +bytes) lies in the registered device window;
        // the buffer holds `chunk` >= bytes after its headroom and no copy is using it.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(self.data_ptr(i).cast(), device, bytes, self.stream)
        })?;
        self.record(i)?;
        self.times.issue.add(t);
        Ok(i)
    }

    /// Waits for buffer `i`'s copy (from `start_copy_out`) and returns the whole buffer:
    /// `STAGING_HEADROOM` free bytes, then the chunk's data. Valid until the buffer's next
    /// `start_copy_out`.
    pub fn finish_copy_out(&mut self, i: usize) -> Result<&mut [u8]> {
        self.wait(i)?;
        // SAFETY: a live pinned allocation of headroom + chunk bytes, used by this thread
        // only, with no copy in flight (just waited).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.buffers[i], STAGING_HEADROOM + self.chunk) })
    }

    /// Fills `[device, +len)` from `source` chunk by chunk (source fills the whole slice
    /// it is given), each chunk's copy to the device overlapping the receipt of the next.
    /// Returns with the last copies possibly still in flight: work issued later on this
    /// stager (`store_u64`) runs after them.
    pub fn receive_into_device(
        &mut self,
        device: u64,
        len: usize,
        source: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        for (offset, bytes) in chunks(len, self.chunk) {
            let i = self.acquire()?;
            // SAFETY: as finish_copy_out: no copy uses buffer i (acquire waited).
            let buffer = unsafe { std::slice::from_raw_parts_mut(self.data_ptr(i), bytes) };
            source(buffer)?;
            let t = std::time::Instant::now();
            // SAFETY: the caller checked [device, +len) lies in the registered window; the
            // buffer stays untouched until its event says the copy finished.
            check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(device + offset as u64, self.data_ptr(i).cast(), bytes, self.stream)
            })?;
            self.record(i)?;
            self.times.issue.add(t);
        }
        Ok(())
    }

    /// Writes one u64 (a signal word) to device memory after everything issued before it
    /// on this stager (stream order; the write carries a memory barrier, so a kernel that
    /// sees the value sees the data copied before it). Does not wait for it.
    pub fn store_u64(&mut self, device: u64, value: u64) -> Result<()> {
        let t = std::time::Instant::now();
        let r = self.store_u64_inner(device, value);
        self.times.signal.add(t);
        r
    }

    fn store_u64_inner(&mut self, device: u64, value: u64) -> Result<()> {
        if self.stream_mem_ops {
            // SAFETY: `device` is an 8-byte aligned signal word of the registered window.
            let r = unsafe {
                sys::cuStreamWriteValue64_v2(
                    self.stream,
                    device,
                    value,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                )
            };
            if r == sys::CUresult::CUDA_SUCCESS {
                return Ok(());
            }
            // Not enqueued: fall back for good (ordering is kept: nothing was issued).
            crate::mk_warn!(
                None,
                "socket transport: cuStreamWriteValue64 failed ({r:?}); signals fall back to synchronised copies"
            );
            self.stream_mem_ops = false;
        }
        self.sync()?;
        // SAFETY: our pinned word; no copy reads it (the stream is idle after the sync).
        unsafe { self.word.write_volatile(value) };
        // SAFETY: as above; `device` is a signal word of the registered window.
        check("cuMemcpyHtoDAsync", unsafe { sys::cuMemcpyHtoDAsync_v2(device, self.word.cast(), 8, self.stream) })?;
        self.sync()
    }

    /// Waits until every copy issued so far has finished (at once when none is in flight).
    pub fn finish_all(&mut self) -> Result<()> {
        if !self.busy.iter().any(|&b| b) {
            return Ok(());
        }
        let t = std::time::Instant::now();
        let r = self.sync();
        self.times.wait.add(t);
        r
    }

    fn sync(&mut self) -> Result<()> {
        // SAFETY: our stream.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.stream) })?;
        self.busy.iter_mut().for_each(|b| *b = false);
        Ok(())
    }
}

impl Drop for DeviceStager {
    fn drop(&mut self) {
        // SAFETY: our stream, buffers and events, released once, after the last copy finished.
        unsafe {
            sys::cuStreamSynchronize(self.stream);
            for &b in &self.buffers {
                sys::cuMemFreeHost(b.cast());
            }
            for &e in &self.events {
                sys::cuEventDestroy_v2(e);
            }
            if !self.word.is_null() {
                sys::cuMemFreeHost(self.word.cast());
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
        for (len, chunk) in [(0, 4), (1, 4), (4, 4), (5, 4), (9, 4), (STAGING_CHUNK_BYTES * 2 + 3, STAGING_CHUNK_BYTES)]
        {
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

    #[test]
    fn nth_chunk_walks_the_queue_in_send_order() {
        // Transfers of 9, 0 (a signal), 4 and 1 bytes in chunks of 4; 1 chunk of the first sent.
        let lens = [9usize, 0, 4, 1];
        let all: Vec<_> = (0..).map_while(|k| nth_chunk(lens, 1, k, 4)).collect();
        assert_eq!(all, vec![(0, 4, 4), (0, 8, 1), (2, 0, 4), (3, 0, 1)]);
        // The same as chunks() per transfer, in order, when nothing is skipped.
        let flat: Vec<_> =
            lens.iter().enumerate().flat_map(|(t, &l)| chunks(l, 4).map(move |(o, b)| (t, o, b))).collect();
        assert_eq!((0..).map_while(|k| nth_chunk(lens, 0, k, 4)).collect::<Vec<_>>(), flat);
        assert_eq!(nth_chunk([0usize; 3], 0, 0, 4), None);
    }
}
