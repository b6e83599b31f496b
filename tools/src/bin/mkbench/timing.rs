//! The GPU side of the timing: CUDA events around each call, and CUDA graphs of captured
//! calls for replay times. mkernel's ops keep their step counters and epochs on the device
//! (docs/architecture.md, Signals), so replays of a captured op stay in step with each
//! other and with direct calls.

use cudarc::driver::result as cu;
use mkernel::cuda::{self, sys};
use mkernel::error::Result;
use mkernel_tools::testing::CapturedGraph;
use std::time::Instant;

/// Pairs of CUDA events, one pair per timed call.
pub(crate) struct Events {
    pairs: Vec<(sys::CUevent, sys::CUevent)>,
}

impl Events {
    pub(crate) fn new(n: usize) -> Result<Self> {
        let mk =
            || cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| cuda::cuda_err("cuEventCreate", e));
        Ok(Events { pairs: (0..n.max(1)).map(|_| Ok((mk()?, mk()?))).collect::<Result<_>>()? })
    }

    /// GPU microseconds of each of `calls` calls of `f` (at most one per event pair), each
    /// call timed on its own, in call order, with `before()` enqueued ahead of each call
    /// outside its timing (an L2 flush for cold-cache times).
    pub(crate) fn times_us_after(
        &self,
        stream: sys::CUstream,
        calls: usize,
        before: impl FnMut() -> Result<()>,
        f: impl FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        Ok(self.timed_calls(stream, calls, before, f)?.into_iter().map(|(gpu, _)| gpu).collect())
    }

    /// Per call of `f` (at most one per event pair; `before()` enqueued ahead of each,
    /// outside both timings): (GPU µs between its events, host µs the call took to
    /// enqueue), in call order.
    pub(crate) fn timed_calls(
        &self,
        stream: sys::CUstream,
        calls: usize,
        mut before: impl FnMut() -> Result<()>,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<Vec<(f64, f64)>> {
        let pairs = &self.pairs[..calls.min(self.pairs.len())];
        let mut host = Vec::with_capacity(pairs.len());
        let mut times = Vec::with_capacity(pairs.len());
        // SAFETY: live events and stream.
        unsafe {
            for &(a, b) in pairs {
                before()?;
                cu::event::record(a, stream).map_err(|e| cuda::cuda_err("cuEventRecord", e))?;
                let t = Instant::now();
                f()?;
                host.push(t.elapsed().as_secs_f64() * 1e6);
                cu::event::record(b, stream).map_err(|e| cuda::cuda_err("cuEventRecord", e))?;
            }
            for (&(a, b), h) in pairs.iter().zip(host) {
                cu::event::synchronize(b).map_err(|e| cuda::cuda_err("cuEventSynchronize", e))?;
                let ms = cu::event::elapsed(a, b).map_err(|e| cuda::cuda_err("cuEventElapsedTime", e))?;
                times.push((ms as f64 * 1e3, h));
            }
        }
        Ok(times)
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        for &(a, b) in &self.pairs {
            // SAFETY: created in new, destroyed once; no call in flight uses them after the
            // synchronisations in timed_calls.
            unsafe {
                let _ = cu::event::destroy(a);
                let _ = cu::event::destroy(b);
            }
        }
    }
}

/// `calls` calls of one contender captured into a CUDA graph and instantiated: one replay
/// runs them back to back with no host launch between them.
pub(crate) struct GraphOfCalls {
    graph: CapturedGraph,
    pub calls: usize,
}

impl GraphOfCalls {
    /// Captures `calls` calls of `f` on `stream` (thread-local mode: ranks that are threads
    /// of this process capture side by side, testing::CAPTURE_MODE) and instantiates the
    /// graph; on an error nothing is left behind and the stream is usable.
    pub(crate) fn capture(stream: sys::CUstream, calls: usize, f: &dyn Fn() -> Result<()>) -> Result<GraphOfCalls> {
        let graph = CapturedGraph::capture(stream, |_| (0..calls).try_for_each(|_| f()))?;
        Ok(GraphOfCalls { graph, calls })
    }

    /// One replay of the captured calls on `stream`.
    pub(crate) fn launch(&self, stream: sys::CUstream) -> Result<()> {
        self.graph.launch(stream)
    }
}
