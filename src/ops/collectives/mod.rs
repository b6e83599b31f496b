//! mkAllGather, mkReduceScatter, mkAllReduce: argument checks, the plan (grid size and
//! piece size, pure and unit-tested), the launch of kernels/collectives.cu, and the
//! decoding of the error words those kernels leave in the host-mapped status block.

use crate::comm::Comm;
use crate::cuda::kernels::Kernel;
use crate::cuda::sys;
use crate::ensure_arg;
use crate::error::{mkResult_t, MkError, Result};
use crate::kernel_abi::{CollectiveParams, MkOp, MkProtocol, MkWait, WorkspaceView, MK_LL_MAX_CTAS, MK_LL_PIECE_BYTES};
use crate::ops::launch::{DeviceCaps, KernelLaunch};
use crate::types::{mkDataType_t, mkRedOp_t, RawDataType, RawRedOp};

/// Threads per CTA of the collective kernels.
pub const THREADS: u32 = crate::kernel_abi::MK_COLLECTIVE_THREADS;
/// Bytes a CTA should have to move before another CTA is worth adding.
pub const MIN_BYTES_PER_CTA: u64 = 64 << 10;
/// Largest message per rank segment (bytes; AllReduce: the buffer) that takes the
/// low-latency protocol by default (`Tuning::collective_ll_max_bytes`): one piece of
/// MK_LL_PIECE_BYTES per LL CTA. A first choice from the protocol's shape (one one-way trip
/// where the simple protocol takes two to three flag trips and a pull), not yet a measured
/// crossover: `mkbench all_reduce --threads` across it is the measurement that sets it.
pub const LL_MAX_BYTES: u64 = MK_LL_MAX_CTAS as u64 * MK_LL_PIECE_BYTES as u64;
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
    pub fn kernel_launch(&self, dtype: mkDataType_t, stage_bytes: u32) -> KernelLaunch {
        KernelLaunch::new(kernel(dtype), self.ctas, THREADS, stage_bytes)
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

/// The kernel instantiation for a dtype.
pub fn kernel(dtype: mkDataType_t) -> Kernel {
    use crate::cuda::kernels::*;
    use mkDataType_t::*;
    match dtype {
        mkInt8 => MK_COLLECTIVE_I8,
        mkUint8 => MK_COLLECTIVE_U8,
        mkInt32 => MK_COLLECTIVE_I32,
        mkUint32 => MK_COLLECTIVE_U32,
        mkInt64 => MK_COLLECTIVE_I64,
        mkUint64 => MK_COLLECTIVE_U64,
        mkFloat16 => MK_COLLECTIVE_F16,
        mkFloat32 => MK_COLLECTIVE_F32,
        mkFloat64 => MK_COLLECTIVE_F64,
        mkBfloat16 => MK_COLLECTIVE_BF16,
    }
}

/// The name of `kernel(dtype)`.
pub fn kernel_name(dtype: mkDataType_t) -> &'static str {
    kernel(dtype).name
}

/// An error word from the status block: bits 0-7 mkResult_t, 8-15 the peer rank involved
/// (0xff none), 16-23 what was awaited, 24-31 the op (kernels/common/signals.cuh).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ErrorWord(pub u32);

impl ErrorWord {
    pub fn encode(code: mkResult_t, peer: Option<usize>, what: u32, op: u32) -> ErrorWord {
        ErrorWord(
            (code as u32 & 0xff)
                | ((peer.map_or(0xff, |p| p as u32) & 0xff) << 8)
                | ((what & 0xff) << 16)
                | ((op & 0xff) << 24),
        )
    }
    pub fn code(self) -> mkResult_t {
        match self.0 & 0xff {
            0 => mkResult_t::mkInternalError,
            c => mkResult_t::from_i32(c as i32),
        }
    }
    pub fn peer(self) -> Option<usize> {
        match (self.0 >> 8) & 0xff {
            0xff => None,
            p => Some(p as usize),
        }
    }
    fn op_name(self) -> String {
        match MkOp::from_u32(self.0 >> 24) {
            Some(op) => op.api_name().into(),
            None => format!("fused op {}", self.0 >> 24),
        }
    }
    fn what(self) -> Option<MkWait> {
        MkWait::from_u32((self.0 >> 16) & 0xff)
    }
    fn awaited(self) -> &'static str {
        match self.what() {
            Some(MkWait::Ready) => "its staged data",
            Some(MkWait::Ready2) => "its reduced slice",
            Some(MkWait::Free) => "it to finish reading this rank's workspace slot",
            Some(MkWait::OpFlag) => "a fused-op flag",
            Some(MkWait::Net) => "its data over the network",
            Some(MkWait::Grant) => "it to free its slot for this rank's put over the network",
            Some(MkWait::Proxy) => "this rank's inter-node proxy",
            _ => "a signal",
        }
    }
    /// The error mkCommGetAsyncError reports, with a message for mkGetLastError.
    pub fn to_error(self, rank: usize) -> MkError {
        let op = self.op_name();
        let peer = self.peer().map_or("a peer".to_string(), |p| format!("rank {p}"));
        let what = self.what();
        match self.code() {
            // kernels/moe.cu: errors found in the inputs on the device.
            mkResult_t::mkInvalidUsage if what == Some(MkWait::MoeCapacity) => MkError::invalid_usage(format!(
                "{op} on rank {rank}: the receive buffer of {peer} needs more rows than recvCapacity; nothing was moved. \
                 recvCounts[E_local] holds the recvCapacity this routing needs (the most over ranks). Recreate the communicator"
            )),
            mkResult_t::mkInvalidUsage if what == Some(MkWait::MoeExpert) => MkError::invalid_usage(format!(
                "{op} on rank {rank}: topkIdx holds an expert id outside [-1, E); those choices were dropped. Recreate the communicator"
            )),
            // kernels/hier_collectives.cu: this rank's proxy failed; the proxy's own
            // message is in mkGetLastError once the host reads it.
            code if what == Some(MkWait::Proxy) => MkError::new(code, format!(
                "{op} on rank {rank} stopped: its inter-node proxy failed ({code:?}) while sending to or waiting for {peer} \
                 (a lost connection, a ring that stayed full, or a transfer that did not complete within MK_TIMEOUT_MS). \
                 Abort and recreate the communicator"
            )),
            mkResult_t::mkTimeout => MkError::timeout(format!(
                "{op} on rank {rank} timed out waiting for {peer} ({}) after MK_TIMEOUT_MS; that rank is stuck, \
                 never made the call, or died. Abort and recreate the communicator",
                self.awaited()
            )),
            mkResult_t::mkRemoteError => MkError::remote(format!(
                "{op} on rank {rank} stopped because {peer} failed or aborted (it raised the communicator's abort flag). \
                 Abort and recreate the communicator"
            )),
            mkResult_t::mkInvalidUsage => MkError::invalid_usage(format!("{op} on rank {rank} stopped: the communicator was aborted (mkCommAbort)")),
            code => MkError::new(code, format!("{op} on rank {rank} recorded error word {:#010x}", self.0)),
        }
    }
}

/// Checks that `ptr` is device (or managed) memory of `device`, naming `what` otherwise.
/// One driver call per pointer (every op call checks each of its buffers): the memory
/// type, whether it is managed and its device, together.
pub fn check_device_pointer(ptr: u64, device: i32, what: &str) -> Result<()> {
    use sys::CUpointer_attribute::{
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, CU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    };
    let (mut mem_type, mut managed, mut ordinal) = (0u32, 0u32, -1i32);
    let mut attributes =
        [CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL];
    let mut data: [*mut std::ffi::c_void; 3] =
        [(&mut mem_type as *mut u32).cast(), (&mut managed as *mut u32).cast(), (&mut ordinal as *mut i32).cast()];
    // SAFETY: three attributes, each written into its own variable of the type the driver
    // documents (CUmemorytype and a boolean as unsigned int, the ordinal as int). An address
    // the driver does not know is not an error: the attributes stay zero (not device memory).
    let r = unsafe { sys::cuPointerGetAttributes(3, attributes.as_mut_ptr(), data.as_mut_ptr(), ptr) };
    let is_device = r == sys::CUresult::CUDA_SUCCESS && mem_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
    if managed != 0 && r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    if !is_device {
        return Err(MkError::invalid_argument(format!(
            "{what} ({ptr:#x}) is not device memory (allocate it with cudaMalloc on the communicator's device)"
        )));
    }
    if ordinal != device {
        return Err(MkError::invalid_argument(format!(
            "{what} ({ptr:#x}) is memory of device {ordinal}, but the communicator uses device {device}"
        )));
    }
    Ok(())
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
    let dtype = mkDataType_t::from_raw(dtype)?;
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
/// A communicator that spans nodes runs the hierarchical kernel (`ops::hier_collectives`).
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
        return super::hier_collectives::collective(comm, kind, send, recv, count, dtype, op, stream);
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
    check_device_pointer(args.send, comm.context.device, "sendbuff")?;
    check_device_pointer(args.recv, comm.context.device, "recvbuff")?;
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
    let kernel_launch = p.kernel_launch(args.dtype, stage_bytes);
    // SAFETY: one CollectiveParams by value; the buffers were checked to be device memory
    // of this context's device, large enough as the caller promised.
    unsafe {
        kernel_launch.launch(stream, &mut [(&mut params as *mut CollectiveParams).cast()], Some(args.kind.name()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::mkDataType_t::*;

    #[test]
    fn the_launch_is_the_plan() {
        let p = plan(CollectiveKind::AllReduce, 1 << 20, 2, 4, 16, 64 << 20, 264, LL_MAX_BYTES);
        let l = p.kernel_launch(mkBfloat16, STAGE_BYTES);
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
        let big = plan(CollectiveKind::AllGather, 64 << 20, 4, 4, 16, 256 << 20, 264, LL_MAX_BYTES);
        assert_eq!((big.ctas, big.protocol), (16, MkProtocol::Simple));
        let one = plan(CollectiveKind::AllGather, 256 << 20, 1, 1, 1, 0, 264, LL_MAX_BYTES);
        assert_eq!((one.ctas, one.chunk), (264, 256 << 20));
        let capped = plan(CollectiveKind::AllReduce, 256 << 20, 1, 1, 1, 0, 10, LL_MAX_BYTES);
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
                        for count in [1u64, 3, 511, 4096, 4097, LL_MAX_BYTES / elem] {
                            let p = plan(kind, count, elem, nranks, slots, 256 << 20, 264, LL_MAX_BYTES);
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
        assert_eq!(plan(ar, LL_MAX_BYTES / 4 + 1, 4, 2, 64, 256 << 20, 264, LL_MAX_BYTES).protocol, MkProtocol::Simple);
        assert_eq!(plan(ar, 16, 4, 1, 64, 256 << 20, 264, LL_MAX_BYTES).protocol, MkProtocol::Simple);
        assert_eq!(plan(ar, 16, 4, 2, 64, 256 << 20, 264, 0).protocol, MkProtocol::Simple);
        // 64 KiB of float over 16 LL CTAs: one piece each.
        let p = plan(ar, 16384, 4, 2, 64, 256 << 20, 264, LL_MAX_BYTES);
        assert_eq!((p.ctas, p.chunk), (16, 1024));
    }

    #[test]
    fn error_words_decode_to_codes_and_messages() {
        let w = ErrorWord::encode(mkResult_t::mkTimeout, Some(3), 1, 1);
        assert_eq!(w.code(), mkResult_t::mkTimeout);
        assert_eq!(w.peer(), Some(3));
        let e = w.to_error(0);
        assert_eq!(e.code, mkResult_t::mkTimeout);
        assert!(e.message.contains("mkAllGather on rank 0 timed out waiting for rank 3"), "{}", e.message);
        let r = ErrorWord::encode(mkResult_t::mkRemoteError, Some(1), 3, 3).to_error(2);
        assert_eq!(r.code, mkResult_t::mkRemoteError);
        assert!(r.message.contains("mkAllReduce on rank 2 stopped because rank 1"), "{}", r.message);
        let a = ErrorWord::encode(mkResult_t::mkInvalidUsage, None, 2, 2);
        assert_eq!(a.peer(), None);
        assert_eq!(a.to_error(0).code, mkResult_t::mkInvalidUsage);
        // The kernel's encoding (signals.cuh mk_error_word) is the same bit layout.
        assert_eq!(ErrorWord::encode(mkResult_t::mkTimeout, Some(2), 3, 2).0, 8 | (2 << 8) | (3 << 16) | (2 << 24));
        assert_eq!(ErrorWord(0x42).code(), mkResult_t::mkInternalError);
        // kernels/moe.cu: a receive buffer too small (what 5) and a bad expert id (what 6).
        let cap = ErrorWord::encode(mkResult_t::mkInvalidUsage, Some(3), 5, 19).to_error(1);
        assert_eq!(cap.code, mkResult_t::mkInvalidUsage);
        assert!(
            cap.message.contains(
                "mkMoeDispatchGemm on rank 1: the receive buffer of rank 3 needs more rows than recvCapacity"
            ),
            "{}",
            cap.message
        );
        assert!(ErrorWord::encode(mkResult_t::mkInvalidUsage, Some(0), 6, 19)
            .to_error(0)
            .message
            .contains("outside [-1, E)"));
        assert!(ErrorWord::encode(mkResult_t::mkTimeout, Some(2), 4, 20)
            .to_error(0)
            .message
            .contains("mkMoeGemmCombine on rank 0 timed out waiting for rank 2"));
        // kernels/hier_collectives.cu: network waits and proxy failures.
        let net = ErrorWord::encode(mkResult_t::mkTimeout, Some(5), 7, 1).to_error(1);
        assert!(
            net.message.contains("mkAllGather on rank 1 timed out waiting for rank 5 (its data over the network)"),
            "{}",
            net.message
        );
        let proxy = ErrorWord::encode(mkResult_t::mkRemoteError, Some(2), 9, 3).to_error(0);
        assert_eq!(proxy.code, mkResult_t::mkRemoteError);
        assert!(proxy.message.contains("inter-node proxy failed"), "{}", proxy.message);
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
