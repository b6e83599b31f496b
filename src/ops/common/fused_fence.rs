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
//! every other node that has this rank's local rank (the only ranks of other nodes a fused
//! op writes to), once every peer of its own node has posted, since those peers may still
//! read its region for an earlier op. Every rank makes the same calls in the same order
//! (the communicator's contract), so every rank enqueues the same fences.
//!
//! The host cannot see when a captured CUDA graph is replayed, so a graph carries its own
//! fences: a fence before its first fused op (the replay may follow any op) and one after
//! each captured fused op (any op may follow the replay). A replay then leaves every rank
//! as a fence does, and the direct calls' record (`FenceState::last_direct`) stays true
//! whatever graphs run between them.

pub use crate::comm::fence_state::{FenceState, Fences, FusedKernel};
use crate::comm::Comm;
use crate::cuda::{self, sys};
use crate::error::Result;
use crate::kernel_abi::{FusedFenceParams, ProxyRingView, WorkspaceView};
use crate::ops::common::launch::KernelLaunch;
use crate::ops::common::node_layout::NodeLayout;

/// The capture sequence `stream` is being captured into, if any.
pub fn capture_of(stream: sys::CUstream) -> Result<Option<u64>> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    // SAFETY: queries the caller's live stream; the optional outputs are NULL.
    cuda::check("cuStreamGetCaptureInfo", unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut status,
            &mut id,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    })?;
    Ok((status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE).then_some(id))
}

/// Enqueues kernels/fused_fence.cu on `stream` for the workspace `view`, and across nodes
/// the node layout and proxy ring `nodes`.
fn enqueue_fence(
    view: &WorkspaceView,
    nodes: Option<&(NodeLayout, ProxyRingView)>,
    stream: sys::CUstream,
) -> Result<()> {
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
    unsafe { launch.launch(stream, &mut [(&mut params as *mut FusedFenceParams).cast()], Some("the fused-op fence")) }
}

/// Every fused op's launch of `next` on `stream`: `launch` enqueues the op's kernel, with
/// the fences FenceState::plan asks for around it, on the workspace `view` and, across
/// nodes, the node layout and proxy ring `nodes`.
pub fn launch_fenced(
    comm: &Comm,
    view: &WorkspaceView,
    nodes: Option<&(NodeLayout, ProxyRingView)>,
    next: FusedKernel,
    stream: sys::CUstream,
    launch: impl FnOnce() -> Result<()>,
) -> Result<()> {
    // One rank has no peer to fence against: `plan` asks for no fence and records nothing
    // there, so the capture state (a driver call) is not asked for either.
    let capture = if comm.nranks > 1 { capture_of(stream)? } else { None };
    let mut state = comm.fused_fence.lock();
    let before = *state;
    let fences = state.plan(next, comm.nranks, capture);
    let launched = (|| {
        if fences.before {
            enqueue_fence(view, nodes, stream)?;
        }
        launch()?;
        if fences.after {
            enqueue_fence(view, nodes, stream)?;
        }
        Ok(())
    })();
    if launched.is_err() {
        *state = FenceState::after_failure(before);
    }
    launched
}

#[cfg(test)]
mod tests {
    use super::*;
    use FusedKernel::*;

    /// What each rank's device runs, in order (every rank makes the same calls).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Item {
        Fence,
        Op(FusedKernel),
    }

    /// A host's calls on one communicator. Direct calls may come while a capture is open
    /// (on another stream); a replay runs a graph that EndCapture made.
    #[derive(Clone, Copy, Debug)]
    enum Call {
        Direct(FusedKernel),
        BeginCapture,
        Captured(FusedKernel),
        EndCapture,
        Replay(usize),
    }

    type Planner = fn(&mut FenceState, FusedKernel, usize, Option<u64>) -> Fences;

    fn emit(into: &mut Vec<Item>, f: Fences, k: FusedKernel) {
        into.extend(f.before.then_some(Item::Fence));
        into.push(Item::Op(k));
        into.extend(f.after.then_some(Item::Fence));
    }

    /// The device's order of fences and fused ops for `calls` on `nranks` ranks, the fences
    /// chosen by `plan`. A fence stands for a barrier of every rank of every node
    /// (tests/fused_fence_protocol.rs checks that the kernel is one).
    fn device_order(calls: &[Call], nranks: usize, plan: Planner) -> Vec<Item> {
        let mut state = FenceState::default();
        let (mut device, mut graphs, mut open) = (Vec::new(), Vec::<Vec<Item>>::new(), None);
        for (id, call) in calls.iter().enumerate() {
            match *call {
                Call::Direct(k) => emit(&mut device, plan(&mut state, k, nranks, None), k),
                Call::BeginCapture => open = Some((id as u64 + 1, Vec::new())),
                Call::Captured(k) => {
                    let (capture, graph) = open.as_mut().expect("a capture is open");
                    emit(graph, plan(&mut state, k, nranks, Some(*capture)), k)
                }
                Call::EndCapture => graphs.push(open.take().expect("a capture is open").1),
                Call::Replay(g) => device.extend_from_slice(&graphs[g]),
            }
        }
        device
    }

    /// The first two fused ops of different families with no fence between them: a rank
    /// could start the second while a peer still runs the first.
    fn race(device: &[Item]) -> Option<(usize, usize)> {
        let mut last: Option<(usize, FusedKernel)> = None;
        for (i, item) in device.iter().enumerate() {
            match *item {
                Item::Fence => last = None,
                Item::Op(k) => {
                    if let Some((j, _)) = last.filter(|&(_, l)| l != k) {
                        return Some((j, i));
                    }
                    last = Some((i, k));
                }
            }
        }
        None
    }

    /// Random call sequences: direct calls, captures of one to three ops (with direct calls
    /// between their captured ops), replays of any graph made so far.
    fn random_calls(seed: u64, len: usize) -> Vec<Call> {
        const KINDS: [FusedKernel; 3] = [AllGatherGemm, GemmReduce, Moe];
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n) as usize
        };
        let (mut calls, mut graphs, mut open) = (Vec::new(), 0, false);
        while calls.len() < len {
            let call = match next(5) {
                0 | 1 => Call::Direct(KINDS[next(3)]),
                2 if !open => Call::BeginCapture,
                2 | 3 if open => Call::Captured(KINDS[next(3)]),
                4 if open => Call::EndCapture,
                _ if graphs > 0 => Call::Replay(next(graphs as u64)),
                _ => continue,
            };
            match call {
                Call::BeginCapture => open = true,
                Call::EndCapture => (open, graphs) = (false, graphs + 1),
                _ => {}
            }
            calls.push(call);
        }
        if open {
            calls.push(Call::EndCapture);
        }
        calls
    }

    /// Fences only in front of captured ops and of the first direct op after a capture:
    /// not enough, since the host cannot see a replay (kept to show the model catches it).
    fn fenced_before_captures_only(
        s: &mut FenceState,
        next: FusedKernel,
        nranks: usize,
        capture: Option<u64>,
    ) -> Fences {
        let before =
            nranks > 1 && (capture.is_some() || s.capture.is_some() || s.last_direct.is_some_and(|last| last != next));
        match capture {
            Some(_) => s.capture = Some(0),
            None => (s.capture, s.last_direct) = (None, Some(next)),
        }
        Fences { before, after: false }
    }

    #[test]
    fn direct_calls_are_fenced_where_the_family_changes() {
        let mut s = FenceState::default();
        assert_eq!(s.plan(AllGatherGemm, 2, None), Fences { before: false, after: false }, "nothing before it");
        assert_eq!(s.plan(AllGatherGemm, 2, None), Fences { before: false, after: false }, "its own DONE words");
        assert_eq!(s.plan(GemmReduce, 2, None), Fences { before: true, after: false });
        assert_eq!(s.plan(RingAttention, 4, None), Fences { before: true, after: false });
        assert_eq!(s.plan(RingAttentionBackward, 4, None), Fences { before: true, after: false });
        // Two nodes of one rank each: no local peer, but a rank on the other node.
        assert_eq!(s.plan(Moe, 2, None), Fences { before: true, after: false });
        let mut one = FenceState::default();
        assert_eq!(one.plan(Moe, 1, None), Fences { before: false, after: false });
        assert_eq!(one.plan(AllGatherGemm, 1, Some(3)), Fences { before: false, after: false }, "no peer");
    }

    #[test]
    fn a_graph_starts_with_a_fence_and_ends_every_fused_op_with_one() {
        let mut s = FenceState { last_direct: Some(GemmReduce), capture: None };
        assert_eq!(s.plan(GemmReduce, 2, Some(7)), Fences { before: true, after: true }, "a replay follows anything");
        assert_eq!(s.plan(GemmReduce, 2, Some(7)), Fences { before: false, after: true });
        assert_eq!(s.plan(Moe, 2, Some(7)), Fences { before: false, after: true });
        assert_eq!(s.plan(Moe, 2, Some(8)), Fences { before: true, after: true }, "another capture");
        // The graphs leave the direct record alone: their fences keep it true.
        assert_eq!(s.last_direct, Some(GemmReduce));
        assert_eq!(s.plan(GemmReduce, 2, None), Fences { before: false, after: false });
    }

    #[test]
    fn a_failed_launch_leaves_no_capture_that_ends_with_a_fence() {
        let before = FenceState { last_direct: Some(Moe), capture: Some(7) };
        assert_eq!(FenceState::after_failure(before), FenceState { last_direct: Some(Moe), capture: None });
        let mut s = FenceState::after_failure(before);
        assert!(s.plan(Moe, 2, Some(7)).before);
    }

    #[test]
    fn no_two_fused_ops_of_different_families_run_unfenced_whatever_the_graphs() {
        use Call::*;
        // Replays between direct calls of one family: the direct record says nothing changed.
        let hole =
            [BeginCapture, Captured(Moe), EndCapture, Replay(0), Direct(GemmReduce), Replay(0), Direct(GemmReduce)];
        assert_eq!(race(&device_order(&hole, 2, FenceState::plan)), None);
        assert!(race(&device_order(&hole, 2, fenced_before_captures_only)).is_some());
        let mut caught = 0;
        for seed in 0..4000 {
            let calls = random_calls(seed, 3 + seed as usize % 12);
            let device = device_order(&calls, 2, FenceState::plan);
            assert_eq!(race(&device), None, "{calls:?} runs {device:?}");
            caught += race(&device_order(&calls, 2, fenced_before_captures_only)).is_some() as usize;
        }
        assert!(caught > 0, "the model never caught the weaker rule");
    }

    #[test]
    fn runs_of_one_family_cost_no_fence() {
        use Call::*;
        let calls = [Direct(GemmReduce); 6];
        assert!(!device_order(&calls, 8, FenceState::plan).contains(&Item::Fence));
        let alternating = [Direct(GemmReduce), Direct(Moe), Direct(GemmReduce), Direct(Moe)];
        let fences = device_order(&alternating, 8, FenceState::plan).iter().filter(|i| **i == Item::Fence).count();
        assert_eq!(fences, 3);
    }
}
