//! The narrow interface between the RDMA transport and a verbs provider.
//!
//! `RdmaTransport` (mod.rs) holds the protocol: what to post for a put, when a put is
//! complete, how a receiver turns immediates into signals, back-pressure when a send queue
//! is full, and errors. A `Verbs` implementation holds only the device: queue pairs, memory
//! registration, posting one work request, reading completions. Two implement it:
//! `ibverbs::IbVerbs` (libibverbs and libefa loaded at run time) and the tools crate's
//! `rdma_sim::SimVerbs` (an in-memory fabric that behaves like RC or like SRD, for tests).

use super::RdmaBlob;
use crate::error::{MkError, Result};
use crate::transport::MemoryRegion;

/// How a device keeps a put's signal behind its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalOrdering {
    /// RC (InfiniBand, RoCE): a queue pair's writes land in order, so an 8-byte write of
    /// the signal value after the data writes lands after them.
    WriteThenFlag,
    /// SRD (EFA): writes of one queue pair land in any order. Every message carries a
    /// per-peer sequence number as immediate data; the receiving transport writes a
    /// signal once every earlier message from that peer has arrived.
    Sequenced,
}

/// Keys of a registered region.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryKeys {
    pub lkey: u32,
    pub rkey: u32,
}

/// This device's address as peers need it (filled into `RdmaBlob`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortAddress {
    pub lid: u16,
    pub gid: [u8; 16],
    pub mtu: u32,
    pub psn: u32,
}

/// Bytes a signal message carries (SRD): signal id (u32 LE), 4 zero bytes, value (u64 LE).
pub const SIGNAL_MESSAGE_BYTES: usize = 16;

/// One work request on a peer's send queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    /// Returned in its completion (the transport puts the post id here).
    pub id: u64,
    pub op: WorkOp,
    /// Whether it produces a completion.
    pub signaled: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkOp {
    /// RDMA WRITE of local `[local_addr, +bytes)` (registered with `lkey`) to the peer's
    /// `remote_addr` (`rkey`); with `imm`, the peer's receive queue gets the value.
    Write { local_addr: u64, lkey: u32, bytes: u32, remote_addr: u64, rkey: u32, imm: Option<u32> },
    /// RDMA WRITE of 8 bytes copied at post time (inline) to `remote_addr`.
    WriteValue { value: u64, remote_addr: u64, rkey: u32 },
    /// SEND of an inline payload with immediate data into one of the peer's receives.
    Send { payload: [u8; SIGNAL_MESSAGE_BYTES], imm: u32 },
}

/// Why a post was not accepted.
#[derive(Debug)]
pub enum PostError {
    /// The send queue has no room now (ENOMEM): retry after completions.
    QueueFull,
    Failed(MkError),
}

/// What a completion reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompletionKind {
    /// A signaled work request this side posted finished (`id` is its `WorkRequest::id`).
    Sent { id: u64 },
    /// A peer's RDMA WRITE with immediate data landed here (its data is in place).
    ReceivedWrite { imm: u32 },
    /// A peer's SEND landed in one of this side's receives.
    ReceivedSend { imm: u32, payload: [u8; SIGNAL_MESSAGE_BYTES] },
}

/// One entry of the completion queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The peer whose queue pair it belongs to.
    pub peer: usize,
    pub kind: CompletionKind,
    /// `Err(reason)` when the work request failed (for receives: the peer's message).
    pub status: std::result::Result<(), String>,
}

/// One rank's device, as the transport uses it. One queue pair per peer; one completion
/// queue for sends and receives. Used from one thread.
pub trait Verbs: Send {
    /// Device name, for messages ("mlx5_0", "efa_0", "sim").
    fn device(&self) -> &str;
    fn ordering(&self) -> SignalOrdering;
    fn address(&self) -> PortAddress;
    /// Registers memory the NIC reads (local sources) and writes (peers' puts).
    ///
    /// # Safety
    /// The region must stay valid until the `Verbs` is dropped.
    unsafe fn register(&mut self, region: MemoryRegion) -> Result<MemoryKeys>;
    /// Creates the queue pair for `peer`; returns its number (nonzero).
    fn create_queue_pair(&mut self, peer: usize) -> Result<u32>;
    /// Connects `peer`'s queue pair to the peer's (`remote_qp` from its blob).
    fn connect(&mut self, peer: usize, remote: &RdmaBlob, remote_qp: u32) -> Result<()>;
    /// Bytes one RDMA write may carry at most.
    fn max_write_bytes(&self) -> u64 {
        super::MAX_WRITE_BYTES
    }
    /// Work requests one queue pair holds at most (what the device granted).
    fn send_queue_depth(&self) -> u32;
    /// Receives one queue pair holds at most (0 where the ordering needs none).
    fn receive_queue_depth(&self) -> u32;
    /// Posts one work request on `peer`'s send queue.
    fn post_send(&mut self, peer: usize, wr: &WorkRequest) -> std::result::Result<(), PostError>;
    /// Posts `count` receives on `peer`'s queue pair (each takes one SEND or WRITE with
    /// immediate, with room for `SIGNAL_MESSAGE_BYTES`).
    fn post_receives(&mut self, peer: usize, count: u32) -> Result<()>;
    /// Appends completions that arrived (never blocks).
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()>;
}
