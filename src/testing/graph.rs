//! CUDA graphs of the test driver's and the benchmarks' calls.

use crate::cuda::{self, sys};
use crate::error::Result;

/// An instantiated CUDA graph captured from what a closure enqueued on one stream;
/// destroyed on drop, whatever happened after the capture.
pub struct CapturedGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

impl CapturedGraph {
    /// Captures what `issue(stream)` enqueues on `stream` (global capture mode) and
    /// instantiates the graph. The capture is ended whatever `issue` returns; the first error
    /// of `issue`, the capture's end and the instantiation is returned, and nothing is left
    /// behind.
    pub fn capture(stream: sys::CUstream, issue: impl FnOnce(sys::CUstream) -> Result<()>) -> Result<CapturedGraph> {
        // SAFETY: capture on the caller's live non-default stream.
        cuda::check("cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        })?;
        let issued = issue(stream);
        let mut g = CapturedGraph { graph: std::ptr::null_mut(), exec: std::ptr::null_mut() };
        // SAFETY: ends the capture begun above, whatever `issue` returned.
        let ended = cuda::check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(stream, &mut g.graph) });
        issued.and(ended)?;
        // SAFETY: the graph the capture produced.
        cuda::check("cuGraphInstantiate", unsafe { sys::cuGraphInstantiateWithFlags(&mut g.exec, g.graph, 0) })?;
        Ok(g)
    }

    /// One replay of the captured work on `stream` (stream-ordered).
    pub fn launch(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: an instantiated graph and the caller's live stream.
        cuda::check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(self.exec, stream) })
    }
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        // SAFETY: each handle made once by `capture` (null where that step did not happen),
        // destroyed once; the caller synchronised the replays.
        unsafe {
            if !self.exec.is_null() {
                sys::cuGraphExecDestroy(self.exec);
            }
            if !self.graph.is_null() {
                sys::cuGraphDestroy(self.graph);
            }
        }
    }
}
