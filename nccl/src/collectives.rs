//! The collectives that run on mkernel: AllReduce, AllGather and ReduceScatter map to
//! mkernel's kernels one to one; Broadcast and Reduce (standalone mode) are composed from
//! mkernel's AllReduce, which has no rooted form:
//!
//! - Broadcast: the non-root ranks zero their `recvbuff` (cuMemsetD8Async on the stream),
//!   then every rank all-reduces with ncclSum over the buffer's bytes read as unsigned
//!   integers (uint32/uint64 for 4- and 8-byte types, uint8 otherwise), root from its
//!   `sendbuff`. x + 0 + ... + 0 = x exactly for unsigned integers, so every rank gets the
//!   root's bytes bit for bit (NaN payloads and -0.0 included). It moves what an AllReduce
//!   moves, about twice a ring broadcast.
//! - Reduce: an AllReduce whose result lands in `recvbuff` on the root and, on the other
//!   ranks, in a scratch buffer allocated and freed on the stream (cuMemAllocAsync /
//!   cuMemFreeAsync), so their `recvbuff` (which may be NULL) is never written.

use crate::abi::*;
use crate::error::{NcclError, Result};
use crate::handle::{CommHandle, MkComm};
use mkernel::cuda::{check, sys};
use mkernel::ops::collectives::{collective, CollectiveKind};
use mkernel::types::{mkDataType_t, mkRedOp_t, Element, ElementType};
use std::os::raw::c_int;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollOp {
    AllReduce { send: usize, recv: usize, count: usize, dtype: ncclDataType_t, op: ncclRedOp_t },
    AllGather { send: usize, recv: usize, count: usize, dtype: ncclDataType_t },
    ReduceScatter { send: usize, recv: usize, count: usize, dtype: ncclDataType_t, op: ncclRedOp_t },
    Broadcast { send: usize, recv: usize, count: usize, dtype: ncclDataType_t, root: c_int },
    Reduce { send: usize, recv: usize, count: usize, dtype: ncclDataType_t, op: ncclRedOp_t, root: c_int },
}

/// One collective and where it runs, as a group queues it until ncclGroupEnd.
pub struct Queued {
    pub comm: Arc<CommHandle>,
    pub op: CollOp,
    pub stream: usize,
}

/// Whether mkernel runs this data type and operator, as its type table says: a move (`op`
/// None: AllGather, Broadcast) of a type it gathers, a reduction of a type it reduces (all
/// twelve, fp8 in float with one rounding) with one of the five built-in ops.
pub fn mkernel_supports(dtype: ncclDataType_t, op: Option<ncclRedOp_t>) -> bool {
    let Ok(t) = mkDataType_t::from_raw(dtype) else { return false };
    let accepted = t.element().accepted;
    match op {
        None => accepted.gather,
        Some(o) => accepted.reduce && (0..ncclNumOps).contains(&o),
    }
}

impl CollOp {
    pub fn name(&self) -> &'static str {
        match self {
            CollOp::AllReduce { .. } => "AllReduce",
            CollOp::AllGather { .. } => "AllGather",
            CollOp::ReduceScatter { .. } => "ReduceScatter",
            CollOp::Broadcast { .. } => "Broadcast",
            CollOp::Reduce { .. } => "Reduce",
        }
    }

    fn dtype_op(&self) -> (ncclDataType_t, Option<ncclRedOp_t>) {
        match *self {
            CollOp::AllReduce { dtype, op, .. }
            | CollOp::ReduceScatter { dtype, op, .. }
            | CollOp::Reduce { dtype, op, .. } => (dtype, Some(op)),
            CollOp::AllGather { dtype, .. } | CollOp::Broadcast { dtype, .. } => (dtype, None),
        }
    }

    /// Whether mkernel runs this op on a communicator that spans nodes (`spans_nodes`) or
    /// not: a reduction across nodes only of a type whose node partials may be stored in
    /// the type (fp8 rounds once, so in interpose mode its reductions across nodes go to
    /// the real NCCL).
    pub fn runs_on_mkernel(&self, spans_nodes: bool) -> bool {
        let (dtype, op) = self.dtype_op();
        let across_ok =
            || mkDataType_t::from_raw(dtype).map(|t| t.element().accepted.reduce_across_nodes).unwrap_or(false);
        !(spans_nodes && op.is_some()) || across_ok()
    }

    /// The checks made when the call is made (also inside a group): a data type and an
    /// operator mkernel runs, a root that is a rank.
    pub fn check(&self, nranks: usize) -> Result<()> {
        let (dtype, op) = self.dtype_op();
        if !(0..ncclNumTypes).contains(&dtype) {
            return Err(NcclError::invalid_argument(format!(
                "datatype {dtype} is not an ncclDataType_t (0..{ncclNumTypes})"
            )));
        }
        if !mkernel_supports(dtype, op.map(|_| ncclSum)) {
            return Err(NcclError::invalid_argument(format!(
                "{} is not supported by mkernel's {} (they take {})",
                datatype_name(dtype),
                if op.is_some() { "reductions" } else { "moves" },
                ElementType::names_where(|a| if op.is_some() { a.reduce } else { a.gather })
            )));
        }
        if let Some(op) = op.filter(|&o| !(0..ncclNumOps).contains(&o)) {
            return Err(NcclError::invalid_argument(format!(
                "op {op} is not a built-in ncclRedOp_t (ncclSum .. ncclAvg); operators from ncclRedOpCreatePreMulSum \
                 need a real NCCL (interpose mode)"
            )));
        }
        if let CollOp::Broadcast { root, .. } | CollOp::Reduce { root, .. } = *self {
            if root < 0 || root as usize >= nranks {
                return Err(NcclError::invalid_argument(format!(
                    "root {root} is not a rank of this communicator (0..{nranks})"
                )));
            }
        }
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)] // mkernel::ops::collectives::collective's arguments, plus the comm
fn kind_call(
    comm: &MkComm,
    kind: CollectiveKind,
    send: usize,
    recv: usize,
    count: usize,
    dtype: c_int,
    op: Option<c_int>,
    stream: usize,
) -> Result<()> {
    collective(comm, kind, send as u64, recv as u64, count, dtype, op, stream as sys::CUstream).map_err(NcclError::from)
}

/// Runs one collective on mkernel (stream-ordered; nothing waits on the host).
pub fn run(comm: &MkComm, op: &CollOp, stream: usize) -> Result<()> {
    let ar = CollectiveKind::AllReduce;
    let sum = Some(mkRedOp_t::mkSum as c_int);
    match *op {
        CollOp::AllReduce { send, recv, count, dtype, op } => {
            kind_call(comm, ar, send, recv, count, dtype, Some(op), stream)
        }
        CollOp::AllGather { send, recv, count, dtype } => {
            kind_call(comm, CollectiveKind::AllGather, send, recv, count, dtype, None, stream)
        }
        CollOp::ReduceScatter { send, recv, count, dtype, op } => {
            kind_call(comm, CollectiveKind::ReduceScatter, send, recv, count, dtype, Some(op), stream)
        }
        CollOp::Broadcast { send, recv, count, dtype, root } => {
            if count == 0 {
                return Ok(());
            }
            let elem = datatype_size(dtype).expect("checked");
            let bytes = count
                .checked_mul(elem)
                .ok_or_else(|| NcclError::invalid_argument(format!("count {count} × {elem} bytes overflows")))?;
            let (as_type, n) = match elem {
                4 => (mkDataType_t::mkUint32, count),
                8 => (mkDataType_t::mkUint64, count),
                _ => (mkDataType_t::mkUint8, bytes),
            };
            if comm.rank == root as usize {
                kind_call(comm, ar, send, recv, n, as_type as c_int, sum, stream)
            } else {
                if recv == 0 {
                    return Err(NcclError::invalid_argument("recvbuff is NULL"));
                }
                {
                    let _ctx = comm.context.enter()?;
                    // SAFETY: recv is the caller's buffer of `bytes` bytes on this device.
                    check("cuMemsetD8Async (zeroing recvbuff)", unsafe {
                        sys::cuMemsetD8Async(recv as sys::CUdeviceptr, 0, bytes, stream as sys::CUstream)
                    })?;
                }
                kind_call(comm, ar, recv, recv, n, as_type as c_int, sum, stream)
            }
        }
        CollOp::Reduce { send, recv, count, dtype, op, root } => {
            if comm.rank == root as usize {
                return kind_call(comm, ar, send, recv, count, dtype, Some(op), stream);
            }
            if count == 0 {
                return Ok(());
            }
            let bytes = count
                .checked_mul(datatype_size(dtype).expect("checked"))
                .ok_or_else(|| NcclError::invalid_argument(format!("count {count} overflows")))?;
            let _ctx = comm.context.enter()?;
            let mut scratch: sys::CUdeviceptr = 0;
            // SAFETY: stream-ordered allocation on the caller's stream, freed below on it.
            check("cuMemAllocAsync (Reduce scratch on a non-root rank)", unsafe {
                sys::cuMemAllocAsync(&mut scratch, bytes, stream as sys::CUstream)
            })?;
            let r = kind_call(comm, ar, send, scratch as usize, count, dtype, Some(op), stream);
            // SAFETY: frees the allocation above after the AllReduce on the same stream.
            let freed = check("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(scratch, stream as sys::CUstream) });
            r.and(freed.map_err(NcclError::from))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_time_checks_name_the_rule() {
        let ar = |dtype, op| CollOp::AllReduce { send: 0x1000, recv: 0x1000, count: 4, dtype, op };
        assert!(ar(7, 4).check(2).is_ok(), "float avg");
        for fp8 in [ncclFloat8e4m3, ncclFloat8e5m2] {
            for op in 0..ncclNumOps {
                assert!(ar(fp8, op).check(2).is_ok(), "fp8 reduces in float with one rounding");
            }
        }
        let ag = |dtype| CollOp::AllGather { send: 0x1000, recv: 0x2000, count: 4, dtype };
        assert!(ag(10).check(2).is_ok() && ag(11).check(2).is_ok(), "fp8 is gathered");
        assert!(ar(12, 0).check(2).unwrap_err().message.contains("not an ncclDataType_t"));
        assert!(ar(7, 5).check(2).unwrap_err().message.contains("not a built-in ncclRedOp_t"));
        let b = |root| CollOp::Broadcast { send: 0, recv: 0, count: 1, dtype: 0, root };
        assert!(b(1).check(2).is_ok());
        assert!(b(2).check(2).unwrap_err().message.contains("root 2 is not a rank"));
        assert!(b(-1).check(2).is_err());
        let r = CollOp::Reduce { send: 0, recv: 0, count: 1, dtype: 9, op: 2, root: 3 };
        assert!(r.check(4).is_ok());
        assert!(r.check(3).is_err());
    }

    #[test]
    fn mkernel_runs_its_twelve_types_and_five_ops() {
        assert!((0..=11).all(|t| mkernel_supports(t, Some(0)) && mkernel_supports(t, None)));
        assert!(mkernel_supports(ncclFloat8e4m3, Some(4)) && mkernel_supports(ncclFloat8e5m2, Some(2)));
        assert!(!mkernel_supports(12, None) && !mkernel_supports(-1, Some(0)));
        assert!((0..5).all(|o| mkernel_supports(7, Some(o))));
        assert!(!mkernel_supports(7, Some(5)), "PreMulSum operators go to NCCL");
    }

    #[test]
    fn fp8_reductions_across_nodes_go_to_nccl() {
        let ar = |dtype| CollOp::AllReduce { send: 0x1000, recv: 0x1000, count: 4, dtype, op: ncclSum };
        let rs = |dtype| CollOp::ReduceScatter { send: 0x1000, recv: 0x1000, count: 4, dtype, op: 2 };
        let ag = |dtype| CollOp::AllGather { send: 0x1000, recv: 0x2000, count: 4, dtype };
        for fp8 in [ncclFloat8e4m3, ncclFloat8e5m2] {
            assert!(ar(fp8).runs_on_mkernel(false) && rs(fp8).runs_on_mkernel(false), "within a node");
            assert!(!ar(fp8).runs_on_mkernel(true) && !rs(fp8).runs_on_mkernel(true), "across nodes");
            assert!(ag(fp8).runs_on_mkernel(true), "gathered across nodes as bytes");
        }
        assert!(ar(9).runs_on_mkernel(true) && ar(7).runs_on_mkernel(true), "bfloat16 and float");
    }
}
