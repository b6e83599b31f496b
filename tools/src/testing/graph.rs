//! CUDA graphs of the test driver's and the benchmarks' calls. Every capture of theirs goes
//! through [`CapturedGraph::capture`], in thread-local mode.

use mkernel::cuda::{self, sys};
use mkernel::error::{MkError, Result};

/// The capture mode of every test and benchmark capture: thread-local. In global mode (the
/// driver's default, PyTorch's `capture_error_mode="global"`) a potentially unsafe call from
/// any thread of the process while a capture is open — a synchronous copy or memset, an
/// allocation, a synchronisation, another graph's instantiation — fails with
/// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates that capture. Ranks that run as
/// threads of one process (mktest with MK_TEST_THREADS=1, mkbench --threads) do exactly
/// that to each other: one checks its results or instantiates its graph while another
/// captures. Thread-local mode refuses only the capturing thread's own unsafe calls.
pub const CAPTURE_MODE: sys::CUstreamCaptureMode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;

/// An instantiated CUDA graph captured from what a closure enqueued on one stream;
/// destroyed on drop, whatever happened after the capture.
pub struct CapturedGraph {
    exec: sys::CUgraphExec,
    /// The graph `exec` was made from, destroyed after it.
    _graph: Graph,
}

/// A graph the capture returned, destroyed on drop.
struct Graph(sys::CUgraph);

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: a graph cuStreamEndCapture returned, destroyed once; nothing else owns it.
        unsafe { sys::cuGraphDestroy(self.0) };
    }
}

impl CapturedGraph {
    /// Captures what `issue(stream)` enqueues on `stream` ([`CAPTURE_MODE`]) and
    /// instantiates the graph. The capture is ended whatever `issue` returns, so the stream
    /// is usable again afterwards; the first error of `issue`, the capture's end and the
    /// instantiation is returned, and nothing is left behind. A handle is kept only from a
    /// call that succeeded: the driver promises nothing about an output of a failed call.
    pub fn capture(stream: sys::CUstream, issue: impl FnOnce(sys::CUstream) -> Result<()>) -> Result<CapturedGraph> {
        // SAFETY: capture on the caller's live non-default stream.
        cuda::check("cuStreamBeginCapture", unsafe { sys::cuStreamBeginCapture_v2(stream, CAPTURE_MODE) })?;
        let issued = issue(stream);
        let mut raw: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above on this thread, whatever `issue` returned.
        let ended = unsafe { sys::cuStreamEndCapture(stream, &mut raw) };
        let graph = match ended {
            sys::CUresult::CUDA_SUCCESS if !raw.is_null() => Some(Graph(raw)),
            _ => None,
        };
        match (issued.and(cuda::check("cuStreamEndCapture", ended)), still_capturing(stream)) {
            (Ok(()), Ok(())) => {}
            (Err(e), Ok(())) | (Ok(()), Err(e)) => return Err(e),
            (Err(first), Err(open)) => {
                return Err(MkError::new(first.code, format!("{}; {}", first.message, open.message)))
            }
        }
        let graph = graph.ok_or_else(|| MkError::cuda("cuStreamEndCapture returned no graph"))?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: the graph the capture produced; `exec` is kept only if this succeeds.
        cuda::check("cuGraphInstantiate", unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph.0, 0) })?;
        if exec.is_null() {
            return Err(MkError::cuda("cuGraphInstantiate returned no executable graph"));
        }
        Ok(CapturedGraph { exec, _graph: graph })
    }

    /// One replay of the captured work on `stream` (stream-ordered).
    pub fn launch(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: an instantiated graph and the caller's live stream.
        cuda::check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(self.exec, stream) })
    }
}

/// An error when `stream` is still capturing after its capture was ended: work enqueued
/// on it later would be captured, never run.
fn still_capturing(stream: sys::CUstream) -> Result<()> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: queries the caller's live stream.
    cuda::check("cuStreamIsCapturing", unsafe { sys::cuStreamIsCapturing(stream, &mut status) })?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Err(MkError::cuda(format!(
            "the stream is still capturing ({status:?}) after cuStreamEndCapture; it cannot be used"
        )));
    }
    Ok(())
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        // SAFETY: made by a successful cuGraphInstantiate, destroyed once, before its graph
        // (dropped after this); the caller synchronised the replays.
        unsafe { sys::cuGraphExecDestroy(self.exec) };
    }
}
