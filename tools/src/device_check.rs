//! GPU checks of the device side of the proxy ring (kernels/common/proxy.cuh through the
//! `mk_proxy_test` kernel of kernels/proxy.cu), for the GPU test driver: real device
//! producers, the ring in pinned mapped memory, the head in device memory, a proxy thread
//! draining it into a recording transport. Each check returns what it saw or an error
//! saying what was wrong. Needs a current CUDA context (sm_90) and no peers.
//!
//! `transport_gpu --ignored` runs them on a GPU (scripts/gpu-run.sh).

use cudarc::driver::result as cu;
use mkernel::cuda::{self, memory::DeviceBuffer, sys, LaunchConfig};
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::kernel_abi::ProxyTestParams;
use mkernel::transport::proxy::{Proxy, ProxyOptions, ProxyRing};
use mkernel::transport::{PostId, PutRequest, Transport, Window};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Completes every put at once and remembers it.
#[derive(Clone, Default)]
struct RecordingTransport(Arc<Mutex<(Vec<PutRequest>, Vec<PostId>)>>);

impl Transport for RecordingTransport {
    fn name(&self) -> &'static str {
        "recording"
    }
    unsafe fn register(&mut self, _window: Window) -> Result<()> {
        Ok(())
    }
    fn connection_blob(&mut self, _peers: &[usize]) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }
    fn connect(&mut self, _blobs: &[Vec<u8>], _peers: &[usize]) -> Result<()> {
        Ok(())
    }
    fn post_put(&mut self, put: &PutRequest) -> Result<PostId> {
        let mut s = self.0.lock();
        let id = s.0.len() as PostId;
        s.0.push(*put);
        s.1.push(id);
        Ok(id)
    }
    fn poll(&mut self, completed: &mut Vec<PostId>) -> Result<()> {
        completed.append(&mut self.0.lock().1);
        Ok(())
    }
    fn close(&mut self) -> Result<()> {
        Ok(())
    }
}

/// What one launch of `mk_proxy_test` did.
#[derive(Debug)]
pub struct ProxyCheckOutcome {
    /// Each CTA's final status (an mkResult_t value).
    pub status: Vec<i32>,
    /// Puts the proxy executed, in ring order.
    pub puts: Vec<PutRequest>,
    pub completed: u64,
    pub elapsed: Duration,
}

struct Launch {
    ctas: u32,
    commands_per_cta: u32,
    capacity: u32,
    timeout: Duration,
    start_proxy: bool,
}

fn run(l: &Launch) -> Result<ProxyCheckOutcome> {
    cuda::driver()?;
    let ring = Arc::new(ProxyRing::on_device(l.capacity, l.timeout)?);
    let status = DeviceBuffer::alloc(4 * l.ctas as usize)?;
    // SAFETY: the range is this allocation.
    unsafe { cu::memset_d8_sync(status.ptr, 0xff, 4 * l.ctas as usize) }
        .map_err(|e| cuda::cuda_err("cuMemsetD8", e))?;
    let transport = RecordingTransport::default();
    let proxy = if l.start_proxy {
        Some(Proxy::start(Arc::clone(&ring), Box::new(transport.clone()), ProxyOptions::new(0, l.timeout))?)
    } else {
        None
    };
    let mut params = ProxyTestParams {
        ring: ring.view(),
        status: status.ptr,
        stride: 256,
        commands_per_cta: l.commands_per_cta,
        bytes: 100,
        peer: 1,
        signal_value: 7,
    };
    // A tool kernel: in the tools' fatbin, loadable once registered.
    cuda::register_tool_kernels();
    let f = cuda::kernels::MK_PROXY_TEST.function()?;
    let mut stream: sys::CUstream = std::ptr::null_mut();
    // SAFETY: a stream of the current context, destroyed below.
    cuda::check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
    })?;
    let cfg = LaunchConfig { grid: (l.ctas, 1, 1), block: (32, 1, 1), shared_mem_bytes: 0 };
    let start = Instant::now();
    // SAFETY: one parameter, a ProxyTestParams by value, as the kernel declares; every
    // pointer in it is a live allocation until the stream is synchronised below.
    let launched = unsafe { cuda::launch(f, cfg, stream, &mut [(&mut params as *mut ProxyTestParams).cast()]) };
    // The kernel bounds its own waits by the timeout; allow that plus slack before giving up.
    let finished = launched.and_then(|_| loop {
        // SAFETY: our stream.
        match unsafe { sys::cuStreamQuery(stream) } {
            sys::CUresult::CUDA_SUCCESS => break Ok(()),
            sys::CUresult::CUDA_ERROR_NOT_READY if start.elapsed() < l.timeout * 3 + Duration::from_secs(5) => {
                std::thread::sleep(Duration::from_millis(1))
            }
            sys::CUresult::CUDA_ERROR_NOT_READY => {
                break Err(MkError::timeout("mk_proxy_test did not finish: a device wait is not bounded"))
            }
            r => break cuda::check("mk_proxy_test", r),
        }
    });
    let elapsed = start.elapsed();
    if finished.is_ok() {
        // SAFETY: our stream, idle.
        unsafe { sys::cuStreamDestroy_v2(stream) };
    } // else leak the stream: the kernel may still hold it.
    finished?;
    let mut raw = vec![0u8; 4 * l.ctas as usize];
    // SAFETY: raw holds the whole status allocation.
    unsafe { cu::memcpy_dtoh_sync(&mut raw, status.ptr) }.map_err(|e| cuda::cuda_err("cuMemcpyDtoH", e))?;
    let status = raw.chunks(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
    if let Some(p) = proxy {
        p.stop()?;
    }
    let puts = transport.0.lock().0.clone();
    Ok(ProxyCheckOutcome { status, puts, completed: ring.completed(), elapsed })
}

/// Many CTAs post through a small ring (many laps, back-pressure) to a live proxy: every
/// command must arrive once, intact, in each CTA's order, and every CTA must end with 0.
pub fn check_many_producers() -> Result<ProxyCheckOutcome> {
    let l =
        Launch { ctas: 64, commands_per_cta: 40, capacity: 16, timeout: Duration::from_secs(10), start_proxy: true };
    let out = run(&l)?;
    let total = (l.ctas * l.commands_per_cta) as usize;
    if out.status.iter().any(|&s| s != 0) {
        return Err(MkError::internal(format!("CTA statuses {:?}", out.status)));
    }
    if out.puts.len() != total || out.completed != total as u64 {
        return Err(MkError::internal(format!(
            "{} puts executed, {} completed, {total} posted",
            out.puts.len(),
            out.completed
        )));
    }
    let mut next = vec![0u64; l.ctas as usize];
    for p in &out.puts {
        let (id, value) = p.signal.ok_or_else(|| MkError::internal(format!("put without signal: {p:?}")))?;
        let cta = id as usize;
        let index = *next.get(cta).ok_or_else(|| MkError::internal(format!("signal id {id} out of range")))?;
        let offset = (cta as u64 * l.commands_per_cta as u64 + index) * 256;
        let expect = PutRequest { peer: 1, src_offset: offset, dst_offset: offset, bytes: 100, signal: Some((id, 7)) };
        if *p != expect || value != 7 {
            return Err(MkError::internal(format!("got {p:?}, expected {expect:?}: a command was torn or reordered")));
        }
        next[cta] += 1;
    }
    Ok(out)
}

/// No proxy drains the ring: the CTA that finds it full must give up with mkTimeout after
/// about the timeout, not hang.
pub fn check_full_ring_times_out() -> Result<ProxyCheckOutcome> {
    let l =
        Launch { ctas: 1, commands_per_cta: 5, capacity: 4, timeout: Duration::from_millis(500), start_proxy: false };
    let out = run(&l)?;
    if out.status != [mkResult_t::mkTimeout as i32] {
        return Err(MkError::internal(format!(
            "status {:?}, expected [{}] (mkTimeout)",
            out.status,
            mkResult_t::mkTimeout as i32
        )));
    }
    if out.elapsed < l.timeout {
        return Err(MkError::internal(format!("gave up after {:?}, before the {:?} timeout", out.elapsed, l.timeout)));
    }
    Ok(out)
}
