//! Collectives over the communicator's NVLink data plane (and, across nodes, through each
//! rank's proxy: NVLink within a node, GPU i ↔ GPU i between nodes).

use super::{mkComm_t, with_comm};
use crate::cuda::sys::CUstream;
use crate::error::mkResult_t;
use crate::ops::collectives::{collective, CollectiveKind};
use crate::types::{RawDataType, RawRedOp};
use std::ffi::c_void;

/// Gathers `sendcount` elements from every rank: rank r's `sendbuff` lands in every
/// rank's `recvbuff` at offset r * sendcount (recvbuff holds nranks * sendcount elements).
///
/// In place when `sendbuff == recvbuff + rank * sendcount` elements (as NCCL); any other
/// overlap is mkInvalidArgument. Every dtype is supported (the data is copied bit for bit).
/// `sendcount == 0` does nothing. Buffers are device memory of the communicator's device,
/// aligned to their element size.
///
/// Stream-ordered and asynchronous: returns once the kernel is enqueued on `stream`; every
/// rank must make the same sequence of collective calls on the communicator. Safe to
/// capture in a CUDA graph (replays keep their own step count on the device). When a peer
/// does not arrive within MK_TIMEOUT_MS, or fails, the kernel stops instead of hanging:
/// mkCommGetAsyncError then reports mkTimeout or mkRemoteError and the communicator
/// refuses new operations (abort and recreate it).
///
/// Across nodes (ranks on several hosts, or MK_RANKS_PER_NODE): every node must hold the
/// same number of ranks (at most 8 nodes of at most 8 ranks), else mkInvalidUsage. Each
/// shard crosses the network once per node, to the rank with the owner's local rank, and
/// is forwarded over NVLink there. Tested only between nodes emulated on one GPU (see the
/// README's status).
#[no_mangle]
pub unsafe extern "C" fn mkAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: RawDataType,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    with_comm(comm, "mkAllGather", |c| {
        collective(c, CollectiveKind::AllGather, sendbuff as u64, recvbuff as u64, sendcount, datatype, None, stream)
    })
}

/// Reduces `sendbuff` (nranks * recvcount elements) over all ranks with `op` and leaves
/// block r of the result (elements r * recvcount .. (r+1) * recvcount) in rank r's
/// `recvbuff` (recvcount elements).
///
/// In place when `recvbuff == sendbuff + rank * recvcount` elements. Ops: mkSum, mkProd,
/// mkMax, mkMin, mkAvg (sum divided by nranks; integer division for integer types), for
/// every dtype. Sources combine in rank order. Half, bfloat16, mkFloat8e4m3 and
/// mkFloat8e5m2 accumulate in float and round once; integers wrap. fp8 rounds to nearest
/// even with saturation: a result beyond the largest finite value (448 for e4m3, 57344 for
/// e5m2), infinite ones included, becomes that value with its sign; NaN stays NaN (as
/// NCCL's conversion). NaN in any source makes mkSum, mkProd and mkAvg NaN; mkMax and mkMin
/// of floating types ignore NaN sources (NaN only when every source is NaN).
/// Otherwise as mkAllGather (stream order, graphs, timeouts).
///
/// Across nodes the contributions are first combined within each node (in local-rank
/// order), then the nodes' partial results in node order; each partial is stored in the
/// element type, so half and bfloat16 round once more per node. mkAvg divides once, by
/// nranks, at the end. fp8 is not reduced across nodes (a partial stored in fp8 would
/// round twice): mkInvalidUsage.
#[no_mangle]
pub unsafe extern "C" fn mkReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: RawDataType,
    op: RawRedOp,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    with_comm(comm, "mkReduceScatter", |c| {
        collective(
            c,
            CollectiveKind::ReduceScatter,
            sendbuff as u64,
            recvbuff as u64,
            recvcount,
            datatype,
            Some(op),
            stream,
        )
    })
}

/// Reduces `count` elements over all ranks with `op`; every rank receives the whole result
/// in `recvbuff` (bit-identical on every rank). In place when `sendbuff == recvbuff`.
/// Ops and types as mkReduceScatter; otherwise as mkAllGather. Across nodes each piece is
/// reduce-scattered in slices (as mkReduceScatter across nodes) and the slices all-gathered.
#[no_mangle]
pub unsafe extern "C" fn mkAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    op: RawRedOp,
    comm: mkComm_t,
    stream: CUstream,
) -> mkResult_t {
    with_comm(comm, "mkAllReduce", |c| {
        collective(c, CollectiveKind::AllReduce, sendbuff as u64, recvbuff as u64, count, datatype, Some(op), stream)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::thread_last_error;

    #[test]
    fn null_comm_is_invalid_argument() {
        let p = 0x10000 as *mut c_void;
        unsafe {
            assert_eq!(
                mkAllGather(p, p, 4, 7, std::ptr::null_mut(), std::ptr::null_mut()),
                mkResult_t::mkInvalidArgument
            );
            assert!(thread_last_error().contains("mkAllGather: comm is NULL"));
            assert_eq!(
                mkReduceScatter(p, p, 4, 7, 0, std::ptr::null_mut(), std::ptr::null_mut()),
                mkResult_t::mkInvalidArgument
            );
            assert_eq!(
                mkAllReduce(p, p, 4, 7, 0, std::ptr::null_mut(), std::ptr::null_mut()),
                mkResult_t::mkInvalidArgument
            );
            assert!(thread_last_error().contains("mkAllReduce: comm is NULL"));
        }
    }
}
