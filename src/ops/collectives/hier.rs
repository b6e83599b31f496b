//! mkAllGather, mkReduceScatter and mkAllReduce on a communicator that spans nodes: the
//! plan (pure, unit-tested: the slot layout, piece and slice sizes, the rank table) and
//! the launch of kernels/hier_collectives.cu, which moves the data within a node over
//! NVLink and between nodes through the proxy ring, both from the kernel (one launch,
//! stream-ordered and graph-capturable). Routes as `transport::topology` plans them: a shard
//! crosses the network once per node, GPU i ↔ GPU i; reductions sum within the node first.
//!
//! `mktest nodes` (scripts/gpu-run.sh) tests it on a GPU, with nodes emulated on one machine.

use crate::comm::Comm;
use crate::cuda::kernels::{self, Arg, Kernel};
use crate::cuda::sys;
use crate::error::{MkError, Result};
use crate::kernel_abi::{
    HierCollectiveParams, ProxyRingView, WorkspaceView, MK_MAX_NODES, MK_MAX_NODE_RANKS, MK_MAX_PEERS,
};
use crate::ops::collectives::{validate, CollectiveArgs, CollectiveKind, MIN_BYTES_PER_CTA, PIECE_ALIGN_BYTES};
use crate::ops::common::launch::KernelLaunch;
use crate::ops::common::node_layout::{node_layout, NodeLayout};
use crate::types::{Element, RawDataType, RawRedOp};

const _: () = assert!(MK_MAX_NODE_RANKS == MK_MAX_NODES * MK_MAX_PEERS);

/// Threads per CTA.
pub const THREADS: u32 = crate::kernel_abi::MK_HIER_THREADS;
/// Sub-areas of a slot start at multiples of this (the kernels' 16-byte vectors).
pub const SUB_ALIGN: u64 = 16;
/// Most CTA slots with network flags (the signal map gives MK_SIG_NET_CTAS per flag kind).
pub const MAX_NET_CTAS: u32 = crate::kernel_abi::MK_SIG_NET_CTAS;

/// One call's grid, piece size and slot layout (byte offsets inside a CTA's slot).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct HierPlan {
    pub ctas: u32,
    /// Elements per piece.
    pub chunk: u64,
    /// AllReduce: elements per owner slice of a piece (0 otherwise).
    pub slice: u64,
    pub sub_bytes: u64,
    pub stage_off: u64,
    pub outbox_off: u64,
    pub inbox_off: u64,
    pub gather_off: u64,
    pub region_bytes: u64,
    pub slot_bytes: u64,
}

impl HierPlan {
    /// The launch of this plan for `dtype`.
    pub fn kernel_launch(&self, dtype: impl Element) -> Result<KernelLaunch> {
        Ok(KernelLaunch::new(kernel(dtype)?, self.ctas, THREADS, 0))
    }
}

pub(crate) fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// The slot layout for pieces of `chunk` elements; returns the plan with `ctas` unset and
/// the bytes a slot needs.
///  AllGather:     gather area: N sub-pieces (sub m: the piece of node m's rank with this local rank).
///  ReduceScatter: stage: R segments (by owner rank); outbox: N partials; inbox: N partials.
///  AllReduce:     stage: the piece; outbox, inbox, gather: N slices each.
pub fn layout(kind: CollectiveKind, chunk: u64, elem: u64, nodes: u64, local: u64) -> (HierPlan, u64) {
    let ranks = nodes * local;
    let mut p = HierPlan { chunk, ..HierPlan::default() };
    let need = match kind {
        CollectiveKind::AllGather => {
            p.sub_bytes = align_up(chunk * elem, SUB_ALIGN);
            nodes * p.sub_bytes
        }
        CollectiveKind::ReduceScatter => {
            p.sub_bytes = align_up(chunk * elem, SUB_ALIGN);
            p.outbox_off = ranks * p.sub_bytes;
            p.inbox_off = p.outbox_off + nodes * p.sub_bytes;
            p.inbox_off + nodes * p.sub_bytes
        }
        CollectiveKind::AllReduce => {
            // Slices of whole 16-byte vectors keep every slice vector-aligned in the stage.
            let per16 = (16 / elem).max(1);
            p.slice = align_up(chunk.div_ceil(ranks), per16);
            p.sub_bytes = align_up(p.slice * elem, SUB_ALIGN);
            p.outbox_off = align_up(chunk * elem, SUB_ALIGN);
            p.inbox_off = p.outbox_off + nodes * p.sub_bytes;
            p.gather_off = p.inbox_off + nodes * p.sub_bytes;
            p.gather_off + nodes * p.sub_bytes
        }
    };
    (p, need)
}

/// Plans one call. `cta_slots` and `data_bytes` come from the workspace (the minimum over
/// all ranks of all nodes, so every rank plans the same steps and offsets).
pub fn plan(
    kind: CollectiveKind,
    count: u64,
    elem: u64,
    nodes: u64,
    local: u64,
    cta_slots: u32,
    data_bytes: u64,
) -> Result<HierPlan> {
    let slots = cta_slots.clamp(1, MAX_NET_CTAS) as u64;
    // The partition of the data region is by the workspace's cta_slots (as the one-node kernel).
    let region = (data_bytes / cta_slots.max(1) as u64) & !255;
    let slot_bytes = (region / 2) & !255;
    let fits = |chunk: u64| layout(kind, chunk, elem, nodes, local).1 <= slot_bytes;
    if !fits(1) {
        return Err(MkError::invalid_usage(format!(
            "{} across {nodes} nodes of {local} ranks needs slots of at least {} bytes, but the workspace gives {slot_bytes} \
             ({data_bytes} bytes in {cta_slots} CTA slots); raise MK_WORKSPACE_BYTES",
            kind.name(),
            layout(kind, 1, elem, nodes, local).1
        )));
    }
    // Largest piece that fits (need grows with chunk), a multiple of 256 bytes when it can
    // be (searched up to the message rounded up to that multiple).
    let align = (PIECE_ALIGN_BYTES / elem).max(1);
    let (mut lo, mut hi) = (1u64, align_up(count.max(1), align));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let max_chunk = if lo >= align { lo / align * align } else { lo };
    let want = (count * elem).div_ceil(MIN_BYTES_PER_CTA).max(1);
    let ctas = want.min(slots);
    let even = align_up(count.div_ceil(ctas), align);
    let chunk = even.min(max_chunk).max(1);
    let pieces = count.div_ceil(chunk).max(1);
    let (mut p, _) = layout(kind, chunk, elem, nodes, local);
    p.ctas = pieces.min(ctas) as u32;
    p.region_bytes = region;
    p.slot_bytes = slot_bytes;
    Ok(p)
}

/// Bytes each rank sends over the network per byte of the larger buffer (what mkbench's
/// sizes count): AllGather and ReduceScatter (N−1)/R (one piece or one partial per other
/// node, each 1/R of the buffer), AllReduce 2(N−1)/R (a partial and a slice per other node).
/// Network GB/s per rank = algbw × this.
pub fn network_fraction(kind: CollectiveKind, nodes: u64, nranks: u64) -> f64 {
    let f = (nodes.saturating_sub(1)) as f64 / nranks.max(1) as f64;
    match kind {
        CollectiveKind::AllReduce => 2.0 * f,
        _ => f,
    }
}

/// The hierarchical collective kernel for `dtype` (MK_HIER_KERNEL lines).
pub fn kernel(dtype: impl Element) -> Result<Kernel> {
    kernels::choose("the collectives across nodes", dtype.element(), "MK_HIER_KERNEL", &[Arg::Element])
}

/// The kernel's parameters for validated `args`.
pub fn params(
    view: &WorkspaceView,
    ring: ProxyRingView,
    nl: &NodeLayout,
    rank: usize,
    nranks: usize,
    args: &CollectiveArgs,
    p: &HierPlan,
) -> HierCollectiveParams {
    HierCollectiveParams {
        ws: *view,
        ring,
        send: args.send,
        recv: args.recv,
        count: args.count,
        chunk: p.chunk,
        slice: p.slice,
        sub_bytes: p.sub_bytes,
        stage_off: p.stage_off,
        outbox_off: p.outbox_off,
        inbox_off: p.inbox_off,
        gather_off: p.gather_off,
        region_bytes: p.region_bytes,
        slot_bytes: p.slot_bytes,
        kind: args.kind as i32,
        dtype: args.dtype as i32,
        op: args.op as i32,
        elem_size: args.dtype.size() as i32,
        rank: rank as i32,
        nranks: nranks as i32,
        node: nl.node as i32,
        nodes: nl.nodes as i32,
        rank_of: nl.rank_of,
    }
}

/// `validate`'s checks, and a reduction only of a type whose node partials may be stored in
/// the type: fp8 reduces with one rounding (docs/decisions/0075), which a partial stored in
/// fp8 would break, so its reductions across nodes are mkInvalidUsage.
#[allow(clippy::too_many_arguments)]
pub fn validate_across_nodes(
    kind: CollectiveKind,
    send: u64,
    recv: u64,
    count: usize,
    dtype: RawDataType,
    op: Option<RawRedOp>,
    rank: usize,
    nranks: usize,
) -> Result<CollectiveArgs> {
    let args = validate(kind, send, recv, count, dtype, op, rank, nranks)?;
    let reduces = kind != CollectiveKind::AllGather;
    if reduces && !args.dtype.element().accepted.reduce_across_nodes {
        return Err(MkError::invalid_usage(format!(
            "{} of {} across nodes is not supported: its node partials would be stored in the element type, a \
             second rounding that fp8's one-rounding rule excludes (within a node it is supported; across nodes \
             it reduces {})",
            kind.name(),
            args.dtype.element().c_name,
            crate::types::ElementType::names_where(|a| a.reduce_across_nodes)
        )));
    }
    Ok(args)
}

/// Validates, plans and launches one collective on a communicator that spans nodes.
#[allow(clippy::too_many_arguments)]
pub fn collective(
    comm: &Comm,
    kind: CollectiveKind,
    send: u64,
    recv: u64,
    count: usize,
    dtype: RawDataType,
    op: Option<RawRedOp>,
    stream: sys::CUstream,
) -> Result<()> {
    comm.check_usable()?;
    let args = validate_across_nodes(kind, send, recv, count, dtype, op, comm.rank, comm.nranks)?;
    let ws = comm.workspace.as_ref().ok_or_else(|| {
        MkError::invalid_usage(
            comm.data_plane_missing.clone().unwrap_or_else(|| "this communicator has no data plane".into()),
        )
    })?;
    let ring = comm.proxy_ring.ok_or_else(|| MkError::internal("a communicator across nodes without a proxy ring"))?;
    let nl = node_layout(&comm.topology, &comm.nodes, kind.name())?;
    if args.count == 0 {
        return Ok(());
    }
    let elem = args.dtype.size() as u64;
    let plan = plan(
        kind,
        args.count,
        elem,
        nl.nodes as u64,
        nl.local_size as u64,
        ws.view.cta_slots as u32,
        ws.view.data_bytes,
    )?;
    let _ctx = comm.context.enter()?;
    comm.check_buffers(&[(args.send, "sendbuff"), (args.recv, "recvbuff")])?;
    let mut params = params(&ws.view, ring, &nl, comm.rank, comm.nranks, &args, &plan);
    // A type not reduced across nodes (fp8) is only gathered: its bytes move as mkUint8's.
    let kernel_launch = plan.kernel_launch(args.dtype.element().moved_across_nodes_as())?;
    // SAFETY: one HierCollectiveParams by value; the buffers were checked to be device
    // memory of this context's device, as large as the caller promised; the workspace and
    // the ring live as long as the communicator.
    unsafe {
        kernel_launch.launch(
            stream,
            &mut [(&mut params as *mut HierCollectiveParams).cast()],
            Some(&format!("{} across nodes", kind.name())),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::mkResult_t;
    use crate::transport::topology::{node_of_ranks, Topology};

    const KINDS: [CollectiveKind; 3] =
        [CollectiveKind::AllGather, CollectiveKind::ReduceScatter, CollectiveKind::AllReduce];

    /// The sub-areas of a slot, as (offset, bytes) ranges.
    fn areas(kind: CollectiveKind, p: &HierPlan, elem: u64, nodes: u64, local: u64) -> Vec<(u64, u64)> {
        let ranks = nodes * local;
        let subs = |base: u64, k: u64| (0..k).map(move |i| (base + i * p.sub_bytes, p.sub_bytes));
        match kind {
            CollectiveKind::AllGather => subs(p.gather_off, nodes).collect(),
            CollectiveKind::ReduceScatter => {
                subs(p.stage_off, ranks).chain(subs(p.outbox_off, nodes)).chain(subs(p.inbox_off, nodes)).collect()
            }
            CollectiveKind::AllReduce => std::iter::once((p.stage_off, p.chunk * elem))
                .chain(subs(p.outbox_off, nodes))
                .chain(subs(p.inbox_off, nodes))
                .chain(subs(p.gather_off, nodes))
                .collect(),
        }
    }

    #[test]
    fn plans_fit_their_slots_without_overlap_and_cover_the_message() {
        for kind in KINDS {
            for (nodes, local) in [(2u64, 1u64), (2, 2), (2, 4), (4, 2), (8, 8), (3, 3)] {
                for elem in [1u64, 2, 4, 8] {
                    for (slots, data) in [(64u32, 256u64 << 20), (8, 4 << 20), (8, 64 << 10), (16, 1 << 20)] {
                        for count in [1u64, 3, 255, 4097, 1_000_003] {
                            let p = match plan(kind, count, elem, nodes, local, slots, data) {
                                Ok(p) => p,
                                Err(e) => {
                                    assert_eq!(e.code, mkResult_t::mkInvalidUsage);
                                    assert!(e.message.contains("MK_WORKSPACE_BYTES"), "{}", e.message);
                                    continue;
                                }
                            };
                            let what = format!(
                                "{kind:?} {nodes}x{local} e={elem} slots={slots} data={data} count={count}: {p:?}"
                            );
                            assert!(p.ctas >= 1 && p.ctas <= slots.min(MAX_NET_CTAS), "{what}");
                            assert!(count.div_ceil(p.chunk) >= p.ctas as u64, "no idle CTA: {what}");
                            let mut a = areas(kind, &p, elem, nodes, local);
                            a.sort();
                            for w in a.windows(2) {
                                assert!(w[0].0 + w[0].1 <= w[1].0, "overlap {w:?}: {what}");
                            }
                            let end = a.last().map_or(0, |&(o, b)| o + b);
                            assert!(end <= p.slot_bytes, "{what}");
                            assert!(
                                p.slot_bytes * 2 <= p.region_bytes && p.region_bytes * slots as u64 <= data,
                                "{what}"
                            );
                            assert!(a.iter().all(|&(o, _)| o % SUB_ALIGN == 0), "{what}");
                            if kind == CollectiveKind::AllReduce {
                                // Every element of a piece belongs to exactly one owner's slice.
                                assert!(p.slice * nodes * local >= p.chunk && p.slice * elem <= p.sub_bytes, "{what}");
                            } else {
                                assert!(p.chunk * elem <= p.sub_bytes, "{what}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_launch_is_the_plan() {
        let p = plan(CollectiveKind::ReduceScatter, 1 << 20, 4, 2, 4, 16, 256 << 20).unwrap();
        let l = p.kernel_launch(crate::types::mkDataType_t::mkFloat32).unwrap();
        assert_eq!(
            (l.kernel, l.grid, l.block, l.smem_bytes),
            (crate::cuda::kernels::MK_HIER_COLLECTIVE_F32, p.ctas, 512, 0)
        );
    }

    #[test]
    fn fp8_is_gathered_across_nodes_as_bytes_and_its_reductions_refused() {
        use crate::types::mkDataType_t::*;
        let v = |kind, dtype: crate::types::mkDataType_t| {
            validate_across_nodes(kind, 0x1000, 0x100000, 10, dtype as RawDataType, Some(0), 1, 4)
        };
        for fp8 in [mkFloat8e4m3, mkFloat8e5m2] {
            let args = v(CollectiveKind::AllGather, fp8).unwrap();
            let p = plan(CollectiveKind::AllGather, 1 << 20, 1, 2, 2, 16, 256 << 20).unwrap();
            let l = p.kernel_launch(args.dtype.element().moved_across_nodes_as()).unwrap();
            assert_eq!(l.kernel, crate::cuda::kernels::MK_HIER_COLLECTIVE_U8);
            for kind in [CollectiveKind::ReduceScatter, CollectiveKind::AllReduce] {
                let e = v(kind, fp8).unwrap_err();
                assert_eq!(e.code, mkResult_t::mkInvalidUsage);
                let want = format!("{} of {} across nodes is not supported", kind.name(), fp8.element().c_name);
                assert!(e.message.contains(&want), "{}", e.message);
                assert!(!e.message.contains("mkFloat8e5m2 or") && e.message.contains("mkBfloat16"), "{}", e.message);
            }
        }
        // The other types reduce across nodes as before; bad arguments still come first.
        assert!(v(CollectiveKind::AllReduce, mkBfloat16).is_ok());
        let e = validate_across_nodes(CollectiveKind::AllReduce, 0, 0x1000, 10, 10, Some(0), 1, 4).unwrap_err();
        assert_eq!(e.code, mkResult_t::mkInvalidArgument);
    }

    #[test]
    fn too_small_a_workspace_names_the_variable() {
        // 64 ranks' staged segments of one element cannot fit a 512-byte slot.
        let e = plan(CollectiveKind::ReduceScatter, 1000, 8, 8, 8, 64, 64 << 10).unwrap_err();
        assert_eq!(e.code, mkResult_t::mkInvalidUsage);
        assert!(e.message.contains("raise MK_WORKSPACE_BYTES"), "{}", e.message);
    }

    #[test]
    fn the_rank_table_follows_the_topology() {
        // Interleaved hosts: node 0 = ranks 0, 2; node 1 = ranks 1, 3.
        let nodes = [0, 1, 0, 1];
        let t = Topology::new(3, &nodes).unwrap();
        let nl = node_layout(&t, &nodes, "mkAllGather").unwrap();
        assert_eq!((nl.nodes, nl.local_size, nl.node, nl.local_rank), (2, 2, 1, 1));
        assert_eq!(&nl.rank_of[..2], &[0, 2]);
        assert_eq!(&nl.rank_of[MK_MAX_PEERS..MK_MAX_PEERS + 2], &[1, 3]);
        assert!(nl.rank_of[2..MK_MAX_PEERS].iter().all(|&r| r == -1));
        // MK_RANKS_PER_NODE=2 over 6 ranks: three nodes of two.
        let nodes = node_of_ranks(&[0; 6], Some(2));
        let nl = node_layout(&Topology::new(4, &nodes).unwrap(), &nodes, "x").unwrap();
        assert_eq!((nl.nodes, nl.node, nl.local_rank), (3, 2, 0));
        assert_eq!(nl.rank_of[2 * MK_MAX_PEERS + 1], 5);
        // Uneven nodes and too many nodes are refused with mkInvalidUsage.
        let uneven = [0, 0, 1];
        assert_eq!(
            node_layout(&Topology::new(0, &uneven).unwrap(), &uneven, "x").unwrap_err().code,
            mkResult_t::mkInvalidUsage
        );
        let nine = node_of_ranks(&[0; 9], Some(1));
        let e = node_layout(&Topology::new(0, &nine).unwrap(), &nine, "mkAllReduce").unwrap_err();
        assert!(e.code == mkResult_t::mkInvalidUsage && e.message.contains("at most 8 nodes"), "{}", e.message);
    }

    /// A model of the kernel's data flow (the same slot layout, rank table and routes) on
    /// host arrays: every rank's slots, one piece, every kind. Checks the plan's offsets
    /// and the kernel's indexing rules (which sub-piece holds whose data) end to end.
    #[test]
    #[allow(clippy::needless_range_loop)] // indices follow the formulas being checked
    fn model_of_the_kernel_data_flow_gives_the_collective() {
        for (nranks, rpn) in [(4usize, 2u32), (6, 2), (6, 3), (8, 2), (2, 1)] {
            let nodes = node_of_ranks(&vec![0; nranks], Some(rpn));
            let layouts: Vec<NodeLayout> =
                (0..nranks).map(|r| node_layout(&Topology::new(r, &nodes).unwrap(), &nodes, "x").unwrap()).collect();
            let (n_nodes, local) = (layouts[0].nodes, layouts[0].local_size);
            let rank_of = |m: usize, l: usize| layouts[0].rank_of[m * MK_MAX_PEERS + l] as usize;
            for kind in KINDS {
                let count = 37u64; // one piece, elements of 8 bytes (f64 values in the model)
                let p = plan(kind, count, 8, n_nodes as u64, local as u64, 1, 1 << 20).unwrap();
                assert_eq!(p.chunk.min(count), count, "one piece");
                let words = (p.slot_bytes / 8) as usize;
                let mut slot = vec![vec![f64::NAN; words]; nranks];
                let w = |off: u64| (off / 8) as usize;
                let input = |r: usize, i: usize| (r * 1000 + i) as f64;
                let send_len =
                    if kind == CollectiveKind::ReduceScatter { nranks * count as usize } else { count as usize };
                let mut out =
                    vec![
                        vec![
                            f64::NAN;
                            if kind == CollectiveKind::AllGather { nranks * count as usize } else { count as usize }
                        ];
                        nranks
                    ];
                let c = count as usize;
                let sub = w(p.sub_bytes);
                match kind {
                    CollectiveKind::AllGather => {
                        for (r, nl) in layouts.iter().enumerate() {
                            for i in 0..c {
                                slot[r][w(p.gather_off) + nl.node * sub + i] = input(r, i);
                                out[r][r * c + i] = input(r, i);
                            }
                        }
                        // Puts: same offset at the GPU-l rank of every other node.
                        for (r, nl) in layouts.iter().enumerate() {
                            for m in (0..n_nodes).filter(|&m| m != nl.node) {
                                let peer = rank_of(m, nl.local_rank);
                                let at = w(p.gather_off) + nl.node * sub;
                                let v: Vec<f64> = slot[r][at..at + c].to_vec();
                                slot[peer][at..at + c].copy_from_slice(&v);
                            }
                        }
                        for (r, nl) in layouts.iter().enumerate() {
                            for j in 0..local {
                                let src = rank_of(nl.node, j);
                                for m in 0..n_nodes {
                                    let q = rank_of(m, j);
                                    for i in 0..c {
                                        out[r][q * c + i] = slot[src][w(p.gather_off) + m * sub + i];
                                    }
                                }
                            }
                        }
                        for r in 0..nranks {
                            for q in 0..nranks {
                                for i in 0..c {
                                    assert_eq!(out[r][q * c + i], input(q, i), "AG {nranks}/{rpn} rank {r} seg {q}");
                                }
                            }
                        }
                    }
                    CollectiveKind::ReduceScatter | CollectiveKind::AllReduce => {
                        let rs = kind == CollectiveKind::ReduceScatter;
                        // (lo, hi) of owner q's part of the piece.
                        let part = |q: usize| {
                            if rs {
                                (0usize, c)
                            } else {
                                let s = p.slice as usize;
                                ((q * s).min(c), (q * s + s).min(c))
                            }
                        };
                        // Where owner q's contribution sits in a staging area.
                        let staged =
                            |q: usize, i: usize| if rs { w(p.stage_off) + q * sub + i } else { w(p.stage_off) + i };
                        let value = |r: usize, q: usize, i: usize| if rs { input(r, q * c + i) } else { input(r, i) };
                        let _ = send_len;
                        for r in 0..nranks {
                            for q in 0..nranks {
                                let (lo, hi) = part(q);
                                for i in lo..hi {
                                    slot[r][staged(q, i)] = value(r, q, i);
                                }
                            }
                        }
                        // Node partials, then the puts to the owners' inboxes.
                        let before = slot.clone();
                        for (r, nl) in layouts.iter().enumerate() {
                            for m in 0..n_nodes {
                                let o = rank_of(m, nl.local_rank);
                                let (lo, hi) = part(o);
                                let dst = if m == nl.node {
                                    w(p.inbox_off) + nl.node * sub
                                } else {
                                    w(p.outbox_off) + m * sub
                                };
                                for i in lo..hi {
                                    let s: f64 = (0..local).map(|j| before[rank_of(nl.node, j)][staged(o, i)]).sum();
                                    slot[r][dst + i - lo] = s;
                                }
                            }
                        }
                        let snapshot = slot.clone();
                        for (r, nl) in layouts.iter().enumerate() {
                            for m in (0..n_nodes).filter(|&m| m != nl.node) {
                                let peer = rank_of(m, nl.local_rank);
                                let (lo, hi) = part(peer);
                                for i in 0..hi - lo {
                                    slot[peer][w(p.inbox_off) + nl.node * sub + i] =
                                        snapshot[r][w(p.outbox_off) + m * sub + i];
                                }
                            }
                        }
                        for r in 0..nranks {
                            let (lo, hi) = part(r);
                            for i in lo..hi {
                                let s: f64 = (0..n_nodes).map(|m| slot[r][w(p.inbox_off) + m * sub + i - lo]).sum();
                                let expect: f64 = (0..nranks).map(|x| value(x, r, i)).sum();
                                assert_eq!(s, expect, "{kind:?} {nranks}/{rpn} rank {r} element {i}");
                                if !rs {
                                    slot[r][w(p.gather_off) + layouts[r].node * sub + i - lo] = s;
                                }
                            }
                        }
                        if !rs {
                            // AllGather of the slices: puts, then every local rank's gather area.
                            let snapshot = slot.clone();
                            for (r, nl) in layouts.iter().enumerate() {
                                let (lo, hi) = part(r);
                                for m in (0..n_nodes).filter(|&m| m != nl.node) {
                                    let peer = rank_of(m, nl.local_rank);
                                    let at = w(p.gather_off) + nl.node * sub;
                                    slot[peer][at..at + hi - lo].copy_from_slice(&snapshot[r][at..at + hi - lo]);
                                }
                            }
                            for (r, nl) in layouts.iter().enumerate() {
                                for j in 0..local {
                                    for m in 0..n_nodes {
                                        let q = rank_of(m, j);
                                        let (lo, hi) = part(q);
                                        for i in lo..hi {
                                            out[r][i] = slot[rank_of(nl.node, j)][w(p.gather_off) + m * sub + i - lo];
                                        }
                                    }
                                }
                                for i in 0..c {
                                    let expect: f64 = (0..nranks).map(|x| input(x, i)).sum();
                                    assert_eq!(out[r][i], expect, "AR {nranks}/{rpn} rank {r} element {i}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn network_bytes_per_buffer_byte() {
        assert_eq!(network_fraction(CollectiveKind::AllGather, 2, 4), 0.25);
        assert_eq!(network_fraction(CollectiveKind::ReduceScatter, 4, 4), 0.75);
        assert_eq!(network_fraction(CollectiveKind::AllReduce, 2, 4), 0.5);
        assert_eq!(network_fraction(CollectiveKind::AllReduce, 1, 4), 0.0);
    }

    #[test]
    fn network_flags_fit_below_the_fused_ops_words() {
        use crate::kernel_abi::{MK_SIG_MAX_CTAS, MK_SIG_NET_GRANT, MK_SIG_OP_BASE, MK_SIG_READY};
        // The one-node flags (READY, READY2, FREE) end where the network flags begin ...
        assert!(MK_SIG_READY + 3 * MK_SIG_MAX_CTAS * MK_MAX_PEERS as u32 <= MK_SIG_NET_GRANT);
        // ... and three kinds of MAX_NET_CTAS x MK_MAX_NODES words end at the fused ops' base.
        assert!(MK_SIG_NET_GRANT + 3 * MAX_NET_CTAS * MK_MAX_NODES as u32 <= MK_SIG_OP_BASE);
    }
}
