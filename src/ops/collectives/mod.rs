//! mkAllGather, mkReduceScatter, mkAllReduce: argument checks, the plan (grid size and
//! piece size, pure and unit-tested), the launch of kernels/collectives.cu, and the
//! decoding of the error words those kernels leave in the host-mapped status block.

use crate::comm::Comm;
use crate::cuda::kernels::{self, Arg, Kernel};
use crate::cuda::sys;
use crate::ensure_arg;
use crate::error::{MkError, Result};
use crate::kernel_abi::{CollectiveParams, MkProtocol, WorkspaceView, MK_LL_MAX_CTAS, MK_LL_PIECE_BYTES};
use crate::ops::common::launch::{DeviceCaps, KernelLaunch};
use crate::types::{mkDataType_t, mkRedOp_t, Element, RawDataType, RawRedOp};

pub mod hier;

/// Threads per CTA of the collective kernels.
pub const THREADS: u32 = crate::kernel_abi::MK_COLLECTIVE_THREADS;
/// Bytes a CTA should have to move before another CTA is worth adding.
pub const MIN_BYTES_PER_CTA: u64 = 64 << 10;
/// Pieces are multiples of this many bytes, so every piece starts 256-byte aligned.
pub const PIECE_ALIGN_BYTES: u64 = 256;
/// Dynamic shared memory per CTA in which the kernels stage their loads (docs/decisions/0104).
/// The loops are bound by load latency (~1 us with several ranks on the GPUs), so bytes in
/// flight per SM set the bandwidth: half of this is in flight per CTA while the other half
/// is consumed. 128 KiB is the least that still gives a reduction of MK_MAX_PEERS sources
/// one vector per source per thread in both halves (2 × 8 × 512 threads × 16 B), and it costs
/// no occupancy: at 512 threads the kernels' 118-128 registers per thread (ptxas) already
/// take more than half of an SM's register file, so a CTA has the SM to itself, and 128 KiB
/// (+1 KiB reserved) of its 228 KiB leaves ~100 KiB of L1. A copy keeps 64 KiB in flight per
/// CTA (8 vectors per thread). Were the kernels ever cut to 64 registers for two CTAs per SM,
/// this would have to drop to ~96 KiB (and reductions of 7-8 sources would stay in registers).
pub const STAGE_BYTES: u32 = 128 << 10;

/// Vectors per source per thread and batch that `stage_bytes` give a CTA of `THREADS`
/// threads reducing `nsrc` sources (kernels/common/reduce_copy.cuh stage_vectors; 0: the
/// kernel keeps that loop in registers).
pub fn stage_vectors(stage_bytes: u32, nsrc: u32) -> u32 {
    stage_bytes / 2 / (THREADS * 16 * nsrc.max(1))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum CollectiveKind {
    AllGather = 1,
    ReduceScatter = 2,
    AllReduce = 3,
}

impl CollectiveKind {
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllGather => "mkAllGather",
            CollectiveKind::ReduceScatter => "mkReduceScatter",
            CollectiveKind::AllReduce => "mkAllReduce",
        }
    }
    /// Elements of sendbuff and recvbuff for a per-call `count` (NCCL's definitions).
    pub fn buffer_counts(self, count: u64, nranks: u64) -> Option<(u64, u64)> {
        let all = count.checked_mul(nranks)?;
        Some(match self {
            CollectiveKind::AllGather => (count, all),
            CollectiveKind::ReduceScatter => (all, count),
            CollectiveKind::AllReduce => (count, count),
        })
    }
    /// Byte offset of sendbuff inside recvbuff for the in-place form (NCCL: AllGather
    /// sendbuff == recvbuff + rank*count; ReduceScatter recvbuff == sendbuff + rank*count;
    /// AllReduce the same buffer), as (which buffer is the larger, offset).
    fn in_place_offset(self, count_bytes: u64, rank: u64) -> u64 {
        match self {
            CollectiveKind::AllReduce => 0,
            _ => count_bytes * rank,
        }
    }
}

/// Grid, piece size and protocol of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollectivePlan {
    pub ctas: u32,
    /// Elements per piece (one CTA step).
    pub chunk: u64,
    pub protocol: MkProtocol,
}

impl CollectivePlan {
    /// The launch of this plan for `dtype`, staging loads in `stage_bytes` of dynamic
    /// shared memory per CTA (0: in registers).
    pub fn kernel_launch(&self, dtype: impl Element, stage_bytes: u32) -> Result<KernelLaunch> {
        Ok(KernelLaunch::new(kernel(dtype)?, self.ctas, THREADS, stage_bytes))
    }
}

/// Plans one call. `count` is elements per rank segment; `cta_slots` and `data_bytes` come
/// from the workspace (the same on every rank, so every rank plans the same steps);
/// `single_rank_ctas` is the grid cap for the one-rank copy (no workspace involved); a
/// message of at most `ll_max_bytes` per segment takes the low-latency protocol.
#[allow(clippy::too_many_arguments)]
pub fn plan(
    kind: CollectiveKind,
    count: u64,
    elem: u64,
    nranks: u64,
    cta_slots: u32,
    data_bytes: u64,
    single_rank_ctas: u32,
    ll_max_bytes: u64,
) -> CollectivePlan {
    let bytes = count * elem;
    let want = bytes.div_ceil(MIN_BYTES_PER_CTA).max(1);
    if nranks == 1 {
        let ctas = want.min(single_rank_ctas.max(1) as u64) as u32;
        return CollectivePlan { ctas, chunk: count.max(1), protocol: MkProtocol::Simple };
    }
    if bytes <= ll_max_bytes {
        // One piece of MK_LL_PIECE_BYTES per source and step (a line per thread); each LL
        // CTA has its own area of the LL region, and a CTA slot's step counter.
        let chunk = (MK_LL_PIECE_BYTES as u64 / elem).max(1);
        let ctas = count.div_ceil(chunk).clamp(1, MK_LL_MAX_CTAS.min(cta_slots.max(1)) as u64);
        return CollectivePlan { ctas: ctas as u32, chunk, protocol: MkProtocol::LowLatency };
    }
    let slots = cta_slots.max(1) as u64;
    let region = (data_bytes / slots) & !255;
    let slot_bytes = (region / 2) & !255;
    // What one slot must hold per element of a piece.
    let per_elem = match kind {
        CollectiveKind::AllGather => elem,
        CollectiveKind::ReduceScatter => elem * nranks,
        CollectiveKind::AllReduce => 2 * elem,
    };
    let align = (PIECE_ALIGN_BYTES / elem).max(1);
    // Largest aligned piece that fits; a slot always holds at least one aligned unit
    // (slots are >= 4 KiB and nranks <= 8, per_elem <= 64 bytes ... 256*8*8 = 16 KiB is the
    // worst case, so fall back to unaligned pieces only there).
    let fit = slot_bytes / per_elem;
    let max_chunk = if fit >= align { fit / align * align } else { fit.max(1) };
    let ctas = want.min(slots);
    let even = count.div_ceil(ctas).div_ceil(align) * align;
    let chunk = even.min(max_chunk).max(1);
    let pieces = count.div_ceil(chunk).max(1);
    CollectivePlan { ctas: pieces.min(ctas) as u32, chunk, protocol: MkProtocol::Simple }
}

/// The collective kernel for `dtype` (kernels/instances.txt's MK_COLLECTIVE_KERNEL lines).
pub fn kernel(dtype: impl Element) -> Result<Kernel> {
    kernels::choose("the collectives", dtype.element(), "MK_COLLECTIVE_KERNEL", &[Arg::Element])
}

/// Validated arguments of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollectiveArgs {
    pub kind: CollectiveKind,
    pub send: u64,
    pub recv: u64,
    /// Elements per rank segment.
    pub count: u64,
    pub dtype: mkDataType_t,
    pub op: mkRedOp_t,
}

/// Argument checks that need no GPU: dtype/op values, NULLs, element alignment, sizes,
/// and overlap (only NCCL's in-place position is allowed).
pub fn validate(
    kind: CollectiveKind,
    send: u64,
    recv: u64,
    count: usize,
    dtype: RawDataType,
    op: Option<RawRedOp>,
    rank: usize,
    nranks: usize,
) -> Result<CollectiveArgs> {
    let dtype = mkDataType_t::collective_type_from_raw(dtype, kind.name(), kind != CollectiveKind::AllGather)?;
    let op = match op {
        Some(o) => mkRedOp_t::from_raw(o)?,
        None => mkRedOp_t::mkSum,
    };
    let count = count as u64;
    let args = CollectiveArgs { kind, send, recv, count, dtype, op };
    if count == 0 {
        return Ok(args);
    }
    let elem = dtype.size() as u64;
    let (send_count, recv_count) = kind
        .buffer_counts(count, nranks as u64)
        .filter(|&(s, r)| {
            s.checked_mul(elem).is_some()
                && r.checked_mul(elem).is_some()
                && s * elem <= isize::MAX as u64
                && r * elem <= isize::MAX as u64
        })
        .ok_or_else(|| MkError::invalid_argument(format!("count {count} × {nranks} ranks × {elem} bytes overflows")))?;
    ensure_arg!(send != 0, "sendbuff is NULL");
    ensure_arg!(recv != 0, "recvbuff is NULL");
    ensure_arg!(send % elem == 0, "sendbuff ({send:#x}) is not aligned to its {elem}-byte {} elements", dtype.name());
    ensure_arg!(recv % elem == 0, "recvbuff ({recv:#x}) is not aligned to its {elem}-byte {} elements", dtype.name());
    let (send_bytes, recv_bytes) = (send_count * elem, recv_count * elem);
    // Buffers from C may sit anywhere: one that runs past the top of the address space
    // is refused, so the ends below (and the in-place offsets inside them) cannot wrap.
    let end = |ptr: u64, bytes: u64, name: &str| {
        ptr.checked_add(bytes).ok_or_else(|| {
            MkError::invalid_argument(format!(
                "{name} ({ptr:#x}) + {bytes} bytes runs past the end of the address space"
            ))
        })
    };
    let (send_end, recv_end) = (end(send, send_bytes, "sendbuff")?, end(recv, recv_bytes, "recvbuff")?);
    let overlap = send < recv_end && recv < send_end;
    if overlap {
        let in_place = match kind {
            CollectiveKind::AllGather => send == recv + kind.in_place_offset(count * elem, rank as u64),
            CollectiveKind::ReduceScatter => recv == send + kind.in_place_offset(count * elem, rank as u64),
            CollectiveKind::AllReduce => send == recv,
        };
        if !in_place {
            let rule = match kind {
                CollectiveKind::AllGather => "in place means sendbuff == recvbuff + rank * sendcount elements",
                CollectiveKind::ReduceScatter => "in place means recvbuff == sendbuff + rank * recvcount elements",
                CollectiveKind::AllReduce => "in place means sendbuff == recvbuff",
            };
            return Err(MkError::invalid_argument(format!("sendbuff and recvbuff overlap but not in place ({rule})")));
        }
    }
    Ok(args)
}

/// Validates, plans and launches one collective on `comm` (stream-ordered, no host sync).
/// A communicator that spans nodes runs the hierarchical kernel (`ops::collectives::hier`).
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
    if comm.topology.spans_nodes() {
        return crate::ops::collectives::hier::collective(comm, kind, send, recv, count, dtype, op, stream);
    }
    comm.check_usable()?;
    let args = validate(kind, send, recv, count, dtype, op, comm.rank, comm.nranks)?;
    let ws = comm.workspace.as_ref().ok_or_else(|| {
        MkError::invalid_usage(
            comm.data_plane_missing.clone().unwrap_or_else(|| "this communicator has no data plane".into()),
        )
    })?;
    if args.count == 0 {
        return Ok(());
    }
    let _ctx = comm.context.enter()?;
    comm.check_buffers(&[(args.send, "sendbuff"), (args.recv, "recvbuff")])?;
    let stage_bytes = STAGE_BYTES;
    let ll_max_bytes = comm.config.tuning.collective_ll_max_bytes;
    launch(&ws.view, &args, single_rank_ctas(DeviceCaps::of(comm)?), stage_bytes, ll_max_bytes, stream)
}

/// Grid cap of the one-rank copy, which no workspace slots bound: the configured cap, else
/// two CTAs per SM.
pub fn single_rank_ctas(caps: DeviceCaps) -> u32 {
    caps.max_ctas.unwrap_or(2 * caps.sms).max(1)
}

/// Launches the collective kernel for validated `args` (the context must be current),
/// staging its loads in `stage_bytes` of dynamic shared memory (0: in registers), by the
/// low-latency protocol up to `ll_max_bytes` per rank segment.
pub fn launch(
    view: &WorkspaceView,
    args: &CollectiveArgs,
    single_rank_ctas: u32,
    stage_bytes: u32,
    ll_max_bytes: u64,
    stream: sys::CUstream,
) -> Result<()> {
    let elem = args.dtype.size() as u64;
    let (nranks, slots) = (view.nranks as u64, view.cta_slots as u32);
    let p = plan(args.kind, args.count, elem, nranks, slots, view.data_bytes, single_rank_ctas, ll_max_bytes);
    let mut params = CollectiveParams {
        ws: *view,
        send: args.send,
        recv: args.recv,
        count: args.count,
        chunk: p.chunk,
        kind: args.kind as i32,
        dtype: args.dtype as i32,
        op: args.op as i32,
        elem_size: elem as i32,
        stage_bytes,
        protocol: p.protocol as u32,
    };
    // The launch raises the function's dynamic shared-memory limit above 48 KiB.
    let kernel_launch = p.kernel_launch(args.dtype, stage_bytes)?;
    // SAFETY: one CollectiveParams by value; the buffers were checked to be device memory
    // of this context's device, large enough as the caller promised.
    unsafe {
        kernel_launch.launch(stream, &mut [(&mut params as *mut CollectiveParams).cast()], Some(args.kind.name()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tuning::COLLECTIVE_LL_MAX_BYTES;
    use crate::types::mkDataType_t::*;

    #[test]
    fn the_launch_is_the_plan() {
        let p = plan(CollectiveKind::AllReduce, 1 << 20, 2, 4, 16, 64 << 20, 264, COLLECTIVE_LL_MAX_BYTES);
        let l = p.kernel_launch(mkBfloat16, STAGE_BYTES).unwrap();
        assert_eq!(
            (l.kernel, l.grid, l.block, l.smem_bytes),
            (crate::cuda::kernels::MK_COLLECTIVE_BF16, p.ctas, 512, 128 << 10)
        );
    }

    #[test]
    fn the_one_rank_copy_takes_two_ctas_per_sm_unless_capped() {
        let caps = |sms, max_ctas| DeviceCaps { sms, max_ctas };
        assert_eq!(single_rank_ctas(caps(132, None)), 264);
        assert_eq!(single_rank_ctas(caps(132, Some(16))), 16);
        assert_eq!(single_rank_ctas(caps(132, Some(500))), 500, "the cap is not bound to the SMs");
        assert_eq!(single_rank_ctas(caps(0, None)), 1);
    }

    fn slot_need(kind: CollectiveKind, chunk: u64, elem: u64, nranks: u64) -> u64 {
        match kind {
            CollectiveKind::AllGather => chunk * elem,
            CollectiveKind::ReduceScatter => chunk * elem * nranks,
            CollectiveKind::AllReduce => 2 * chunk * elem,
        }
    }

    #[test]
    fn plans_fit_the_slots_cover_the_message_and_stay_aligned() {
        let kinds = [CollectiveKind::AllGather, CollectiveKind::ReduceScatter, CollectiveKind::AllReduce];
        for kind in kinds {
            for nranks in [2u64, 3, 4, 8] {
                for elem in [1u64, 2, 4, 8] {
                    for (slots, data) in [(64u32, 256u64 << 20), (8, 4 << 20), (1, 64 << 10), (16, 1 << 20)] {
                        for count in [1u64, 7, 255, 4097, 1_000_003, 300_000_000] {
                            let p = plan(kind, count, elem, nranks, slots, data, 264, 0);
                            assert!(p.ctas >= 1 && p.ctas <= slots, "{kind:?} {p:?}");
                            let slot_bytes = (((data / slots as u64) & !255) / 2) & !255;
                            assert!(
                                slot_need(kind, p.chunk, elem, nranks) <= slot_bytes,
                                "{kind:?} n={nranks} e={elem} {p:?} slot {slot_bytes}"
                            );
                            assert!(p.chunk * p.ctas as u64 >= count.min(p.chunk * p.ctas as u64));
                            assert!(count.div_ceil(p.chunk) >= p.ctas as u64, "no idle CTA: {p:?} count {count}");
                            if count * elem >= 1 << 20 {
                                assert_eq!(p.chunk * elem % 16, 0, "large pieces stay vector-aligned");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn grid_grows_with_size_and_respects_caps() {
        let small = plan(CollectiveKind::AllGather, 1000, 4, 4, 64, 256 << 20, 264, 0);
        assert_eq!(small.ctas, 1);
        let big = plan(CollectiveKind::AllGather, 64 << 20, 4, 4, 16, 256 << 20, 264, COLLECTIVE_LL_MAX_BYTES);
        assert_eq!((big.ctas, big.protocol), (16, MkProtocol::Simple));
        let one = plan(CollectiveKind::AllGather, 256 << 20, 1, 1, 1, 0, 264, COLLECTIVE_LL_MAX_BYTES);
        assert_eq!((one.ctas, one.chunk), (264, 256 << 20));
        let capped = plan(CollectiveKind::AllReduce, 256 << 20, 1, 1, 1, 0, 10, COLLECTIVE_LL_MAX_BYTES);
        assert_eq!(capped.ctas, 10);
    }

    #[test]
    fn small_messages_take_the_low_latency_protocol_one_line_per_thread() {
        use crate::kernel_abi::MK_COLLECTIVE_THREADS;
        let kinds = [CollectiveKind::AllGather, CollectiveKind::ReduceScatter, CollectiveKind::AllReduce];
        for kind in kinds {
            for nranks in [2u64, 3, 8] {
                for elem in [1u64, 2, 4, 8] {
                    for slots in [1u32, 4, 64] {
                        for count in [1u64, 3, 511, 4096, 4097, COLLECTIVE_LL_MAX_BYTES / elem] {
                            let p = plan(kind, count, elem, nranks, slots, 256 << 20, 264, COLLECTIVE_LL_MAX_BYTES);
                            assert_eq!(p.protocol, MkProtocol::LowLatency, "{kind:?} count {count} elem {elem}");
                            // A piece is one 8-byte line per thread, and every CTA has an LL area.
                            assert_eq!(p.chunk * elem, 8 * MK_COLLECTIVE_THREADS as u64);
                            assert!(p.ctas >= 1 && p.ctas <= MK_LL_MAX_CTAS.min(slots), "{p:?}");
                            assert!(count.div_ceil(p.chunk) >= p.ctas as u64, "no idle CTA: {p:?} count {count}");
                        }
                    }
                }
            }
        }
        // Just above the limit, with one rank, or with LL off: the simple protocol.
        let ar = CollectiveKind::AllReduce;
        assert_eq!(
            plan(ar, COLLECTIVE_LL_MAX_BYTES / 4 + 1, 4, 2, 64, 256 << 20, 264, COLLECTIVE_LL_MAX_BYTES).protocol,
            MkProtocol::Simple
        );
        assert_eq!(plan(ar, 16, 4, 1, 64, 256 << 20, 264, COLLECTIVE_LL_MAX_BYTES).protocol, MkProtocol::Simple);
        assert_eq!(plan(ar, 16, 4, 2, 64, 256 << 20, 264, 0).protocol, MkProtocol::Simple);
        // 64 KiB of float over 16 LL CTAs: one piece each.
        let p = plan(ar, 16384, 4, 2, 64, 256 << 20, 264, COLLECTIVE_LL_MAX_BYTES);
        assert_eq!((p.ctas, p.chunk), (16, 1024));
    }

    #[test]
    fn validation_names_the_problem() {
        let v = |k, s, r, c, d, o| validate(k, s, r, c, d, o, 1, 4);
        let ag = CollectiveKind::AllGather;
        let rs = CollectiveKind::ReduceScatter;
        let ar = CollectiveKind::AllReduce;
        let f32_ = mkFloat32 as RawDataType;
        let msg = |r: Result<CollectiveArgs>| r.unwrap_err().message;
        assert!(msg(v(ag, 0, 0x2000, 10, f32_, None)).contains("sendbuff is NULL"));
        assert!(msg(v(ag, 0x1000, 0, 10, f32_, None)).contains("recvbuff is NULL"));
        assert!(msg(v(ar, 0x1000, 0x9000, 10, 99, Some(0))).contains("unknown datatype 99"));
        assert!(msg(v(ar, 0x1000, 0x9000, 10, f32_, Some(7))).contains("unknown reduction op 7"));
        assert!(msg(v(ar, 0x1002, 0x9000, 10, f32_, Some(0))).contains("not aligned"));
        assert!(msg(v(ar, 0x1000, 0x9000, usize::MAX / 2, f32_, Some(0))).contains("overflows"));
        // count 0 is a no-op, even with NULL buffers (as NCCL)
        assert!(v(ar, 0, 0, 0, f32_, Some(0)).is_ok());
        // in place as NCCL defines it
        assert!(v(ar, 0x1000, 0x1000, 10, f32_, Some(0)).is_ok());
        assert!(v(ag, 0x1000 + 40, 0x1000, 10, f32_, None).is_ok(), "rank 1 of 4: recvbuff + 1*10 floats");
        assert!(v(rs, 0x1000, 0x1000 + 40, 10, f32_, Some(0)).is_ok());
        // any other overlap is refused
        assert!(msg(v(ar, 0x1000, 0x1004, 10, f32_, Some(0))).contains("overlap"));
        assert!(msg(v(ag, 0x1000, 0x1000, 10, f32_, None)).contains("recvbuff + rank * sendcount"));
        assert!(msg(v(rs, 0x1000, 0x1000, 10, f32_, Some(0))).contains("sendbuff + rank * recvcount"));
        // disjoint buffers are fine
        assert!(v(rs, 0x1000, 0x1000 + 160, 10, f32_, Some(4)).is_ok());
        // a buffer that wraps the address space is refused, not judged disjoint
        let top = u64::MAX - 15;
        assert!(msg(v(ar, 0x1000, top, 10, f32_, Some(0)))
            .contains("recvbuff (0xfffffffffffffff0) + 40 bytes runs past the end"));
        assert!(msg(v(ag, top, 0x1000, 10, f32_, None))
            .contains("sendbuff (0xfffffffffffffff0) + 40 bytes runs past the end"));
    }

    #[test]
    fn fp8_is_gathered_and_reduced_by_its_own_kernels() {
        use crate::cuda::kernels::{MK_COLLECTIVE_E4M3, MK_COLLECTIVE_E5M2};
        let v = |k, d, op| validate(k, 0x1000, 0x9000, 10, d, op, 1, 4);
        for (fp8, kernel) in [(mkFloat8e4m3, MK_COLLECTIVE_E4M3), (mkFloat8e5m2, MK_COLLECTIVE_E5M2)] {
            for kind in [CollectiveKind::AllGather, CollectiveKind::ReduceScatter, CollectiveKind::AllReduce] {
                let ops: Vec<Option<RawRedOp>> = if kind == CollectiveKind::AllGather {
                    vec![None]
                } else {
                    mkRedOp_t::ALL.iter().map(|&o| Some(o as RawRedOp)).collect()
                };
                for op in ops {
                    let args = v(kind, fp8 as RawDataType, op).unwrap();
                    assert_eq!(args.dtype, fp8);
                    // One-byte elements: an LL piece is its byte size in elements, a simple
                    // piece a multiple of 256 elements.
                    for count in [1u64, 4097, 1 << 20] {
                        let elem = fp8.size() as u64;
                        let p = plan(kind, count, elem, 4, 16, 64 << 20, 264, COLLECTIVE_LL_MAX_BYTES);
                        match p.protocol {
                            MkProtocol::LowLatency => assert_eq!(p.chunk, MK_LL_PIECE_BYTES as u64),
                            MkProtocol::Simple => assert_eq!(p.chunk % PIECE_ALIGN_BYTES, 0, "{p:?}"),
                        }
                        assert_eq!(p.protocol == MkProtocol::LowLatency, count <= COLLECTIVE_LL_MAX_BYTES);
                        let l = p.kernel_launch(args.dtype, STAGE_BYTES).unwrap();
                        assert_eq!(l.kernel, kernel, "{kind:?} {op:?}: the type's own kernel, which widens to float");
                    }
                }
            }
        }
    }

    #[test]
    fn staging_fits_every_reduction_and_one_cta_per_sm() {
        use crate::kernel_abi::MK_MAX_PEERS;
        assert!(stage_vectors(STAGE_BYTES, MK_MAX_PEERS as u32) >= 1, "a reduction of every peer still stages");
        for nsrc in 1..=MK_MAX_PEERS as u32 {
            assert!(2 * nsrc * stage_vectors(STAGE_BYTES, nsrc) * THREADS * 16 <= STAGE_BYTES, "{nsrc} sources");
        }
        assert_eq!(stage_vectors(STAGE_BYTES, 1), 8, "a copy keeps 8 vectors per thread in flight");
        // sm_90: at most 227 KiB of dynamic shared memory per CTA (1 KiB of the SM's 228 reserved).
        const _: () = assert!(STAGE_BYTES <= 227 << 10);
    }
}
