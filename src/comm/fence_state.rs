//! What a communicator's host side records of the fused ops it launched, and the fences
//! between fused ops of different kernels that the record asks for (the protocol:
//! `ops::common::fused_fence`). Plain Rust, no CUDA.

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

/// What a communicator's host side knows of the fused ops it launched.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FenceState {
    /// The family of the last fused op called directly (not captured); None before the first.
    pub last_direct: Option<FusedKernel>,
    /// The capture sequence (cuStreamGetCaptureInfo's id) whose last captured fused op was
    /// followed by a fence in the graph: the next fused op of that capture needs none before it.
    pub capture: Option<u64>,
}

/// The fences around one fused op's launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fences {
    pub before: bool,
    pub after: bool,
}

impl FenceState {
    /// The fences a fused op of `next` needs on a communicator of `nranks` ranks (every
    /// node's), launched directly (`capture` None) or into capture sequence `capture`; records
    /// the launch. A direct op is fenced when its family differs from the last direct op's
    /// (graphs in between end with a fence). A captured op is followed by a fence, and the
    /// first of its capture is preceded by one.
    pub fn plan(&mut self, next: FusedKernel, nranks: usize, capture: Option<u64>) -> Fences {
        if nranks <= 1 {
            return Fences { before: false, after: false };
        }
        match capture {
            Some(id) => {
                let before = self.capture != Some(id);
                self.capture = Some(id);
                Fences { before, after: true }
            }
            None => {
                let before = self.last_direct.is_some_and(|last| last != next);
                self.last_direct = Some(next);
                Fences { before, after: false }
            }
        }
    }

    /// The state after a launch planned from `before` failed: the direct record as it was
    /// (the op may not have run), and no capture whose graph is known to end with a fence.
    pub fn after_failure(before: FenceState) -> FenceState {
        FenceState { capture: None, ..before }
    }
}
