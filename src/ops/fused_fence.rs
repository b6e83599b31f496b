//! The fence between fused ops of different kernels on one communicator.
//!
//! Every fused kernel keeps its buffers in the same fused-op region of each rank, and each
//! orders itself only against its own previous call (its DONE words: a rank may write a
//! peer's buffers once the peer finished the previous call of the same op). A different
//! fused op in between is not covered: a rank that finished mkGemmAllReduce could push
//! mkAllGatherGemm's rows into a peer still summing its partials in the same region. So when
//! a fused op's kernel family differs from the previous fused op's on this communicator, the
//! launch enqueues kernels/fused_fence.cu first: each rank posts its fence number to every
//! peer of its node and waits for theirs, so every peer has finished every fused op before
//! it. Across nodes it also exchanges fence numbers, through the proxy, with the rank of
//! every other node that has this rank's local rank: the only ranks of other nodes a fused
//! op writes to. Every rank makes the same calls in the same order (the communicator's
//! contract), so every rank enqueues the same fences. A fused op captured into a CUDA graph
//! is always fenced, and the first direct fused op after a capture too: a graph may be
//! replayed after any op, and any op may follow a replay.

use crate::comm::Comm;
use crate::cuda::{self, sys};
use crate::error::Result;
use crate::kernel_abi::{FusedFenceParams, ProxyRingView, WorkspaceView};
use crate::ops::hier_collectives::NodeLayout;
use crate::ops::launch::KernelLaunch;

/// The fused kernels that share one epoch and DONE words, and so order themselves against
/// each other: MoE dispatch and combine are one, GEMM + ReduceScatter and + AllReduce another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusedKernel {
    AllGatherGemm,
    GemmReduce,
    Moe,
    RingAttention,
    RingAttentionBackward,
}

/// What a communicator's host side knows of the fused op its device ran last.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LastFused {
    /// No fused op yet.
    #[default]
    Nothing,
    /// The last fused op was called directly and was of this family.
    Direct(FusedKernel),
    /// A fused op was captured into a CUDA graph: whatever ran last on the device (a
    /// replay, or a call before it), the host cannot tell.
    Unknown,
}

/// Whether a fused op of `next` needs the fence first, after `last`, on a communicator of
/// `nranks` ranks (every node's), when its launch is (`capturing`) or is not captured into
/// a graph: a captured op is always fenced, since a graph is replayed after whatever ran
/// before.
pub fn needs_fence(last: LastFused, next: FusedKernel, nranks: usize, capturing: bool) -> bool {
    nranks > 1
        && (capturing
            || match last {
                LastFused::Nothing => false,
                LastFused::Direct(l) => l != next,
                LastFused::Unknown => true,
            })
}

/// What the host knows after launching a fused op of `next`.
pub fn after(next: FusedKernel, capturing: bool) -> LastFused {
    if capturing {
        LastFused::Unknown
    } else {
        LastFused::Direct(next)
    }
}

/// Called by every fused op right before it launches `next` on `stream`, with the node
/// layout and proxy ring of a communicator across nodes: enqueues the fence when
/// needs_fence says so, and records what the host now knows.
pub fn before_launch(
    comm: &Comm,
    view: &WorkspaceView,
    nodes: Option<&(NodeLayout, ProxyRingView)>,
    next: FusedKernel,
    stream: sys::CUstream,
) -> Result<()> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: queries the caller's live stream.
    cuda::check("cuStreamIsCapturing", unsafe { sys::cuStreamIsCapturing(stream, &mut status) })?;
    let capturing = status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut last = comm.last_fused_kernel.lock();
    if needs_fence(*last, next, comm.nranks, capturing) {
        let mut params = FusedFenceParams { ws: *view, nodes: 1, ..Default::default() };
        if let Some((layout, ring)) = nodes {
            params.nodes = layout.nodes as i32;
            params.node = layout.node as i32;
            params.ring = *ring;
            params.rank_of = layout.rank_of;
        }
        let launch = KernelLaunch::new(crate::cuda::kernels::MK_FUSED_FENCE, 1, 32, 0);
        // SAFETY: the kernel takes one FusedFenceParams by value; its pointers are this
        // communicator's mapped workspace and proxy ring.
        unsafe {
            launch.launch(stream, &mut [(&mut params as *mut FusedFenceParams).cast()], Some("the fused-op fence"))?
        };
    }
    *last = after(next, capturing);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use FusedKernel::*;

    #[test]
    fn a_change_of_family_and_every_captured_op_are_fenced() {
        use LastFused::*;
        assert!(!needs_fence(Nothing, AllGatherGemm, 2, false), "the first fused op has nothing before it");
        assert!(!needs_fence(Direct(GemmReduce), GemmReduce, 2, false), "its own DONE words order a family");
        assert!(needs_fence(Direct(GemmReduce), AllGatherGemm, 2, false));
        assert!(needs_fence(Direct(RingAttention), RingAttentionBackward, 4, false));
        assert!(!needs_fence(Direct(Moe), AllGatherGemm, 1, false), "one rank has no peer");
        // Two nodes of one rank each: no local peer, but a rank on the other node.
        assert!(needs_fence(Direct(GemmReduce), AllGatherGemm, 2, false));
        // A graph may be replayed after anything, and anything may follow a replay.
        assert!(needs_fence(Direct(GemmReduce), GemmReduce, 2, true));
        assert!(needs_fence(Nothing, Moe, 2, true));
        assert_eq!(after(Moe, true), Unknown);
        assert!(needs_fence(Unknown, Moe, 2, false));
        assert_eq!(after(Moe, false), Direct(Moe));
    }
}
