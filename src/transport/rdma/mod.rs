//! RDMA transport: puts become RDMA writes, on InfiniBand/RoCE (RC queue pairs) and on
//! AWS EFA (SRD queue pairs). Built into every libmkernel: libibverbs and libefa are
//! loaded at run time (`ibverbs`), so the library still loads, and uses sockets, where they
//! are missing.
//!
//! The protocol lives here, over the narrow `verbs::Verbs` interface:
//! - RC (`SignalOrdering::WriteThenFlag`): a put is RDMA WRITEs of the data, then an 8-byte
//!   inline WRITE of the signal value on the same queue pair. RC places a queue pair's
//!   writes in order, so the signal lands after the data (and after every earlier put to
//!   that peer). Only a put's last work request is signaled; its completion retires the
//!   put's earlier ones too.
//! - SRD (`SignalOrdering::Sequenced`): writes land in any order. Every message to a peer
//!   carries the next number of a per-peer sequence as immediate data: the data as RDMA
//!   WRITE with immediate, the signal as a SEND with immediate whose payload is (signal id,
//!   value). The receiving transport (`sequencer`) writes the signal word itself once every
//!   message numbered before the signal has arrived. Every work request is signaled, since
//!   completions come back in any order.
//! - Back-pressure: a peer's work requests wait in a queue while its send queue holds
//!   `send_queue_depth` of them, or while the device answers ENOMEM (EFA does so before its
//!   nominal depth); completions make room and the queue drains on the next poll.
//! - Errors: a failed completion (peer gone, access error) fails the transport with
//!   `mkRemoteError` naming the peer; the proxy bounds every wait by MK_TIMEOUT_MS.
//!
//! The CPU tests drive this code over an in-memory verbs layer (RC-like and SRD-like):
//! `mkernel_tools::rdma_sim`, outside the library. No part of the `ibverbs` path has run on RDMA hardware (docs/rdma.md).

pub mod abi;
pub mod efa;
pub mod ibverbs;
pub mod sequencer;
pub mod verbs;

use super::staging::DeviceStager;
use super::{check_peers, check_put_ranges, MemoryKind, PostId, PutRequest, Transport, Window};
use crate::error::{MkError, Result};
use sequencer::SignalSequencer;
use std::collections::{HashMap, VecDeque};
use verbs::{
    Completion, CompletionKind, MemoryKeys, PostError, SignalOrdering, Verbs, WorkOp, WorkRequest, SIGNAL_MESSAGE_BYTES,
};

pub use ibverbs::{active_ports, usable_device_count};

const BLOB_MAGIC: &[u8; 4] = b"MKR1";
/// Largest single RDMA WRITE we post (IB's limit is 2^31 bytes).
pub const MAX_WRITE_BYTES: u64 = 1 << 30;

/// A registered region as peers address it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteRegion {
    pub addr: u64,
    pub rkey: u32,
    pub bytes: u64,
}

/// What peers need to reach this rank over RDMA: its port address, its window's keys, and
/// the number of the QP it created for each rank (0 where it has none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaBlob {
    pub lid: u16,
    pub gid: [u8; 16],
    /// ibv_mtu value of the port's active MTU.
    pub mtu: u32,
    /// First packet sequence number of this rank's QPs.
    pub psn: u32,
    pub data: RemoteRegion,
    pub signals: RemoteRegion,
    pub qp_nums: Vec<u32>,
}

impl RdmaBlob {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(64 + 4 * self.qp_nums.len());
        v.extend_from_slice(BLOB_MAGIC);
        v.extend_from_slice(&self.lid.to_le_bytes());
        v.extend_from_slice(&self.gid);
        v.extend_from_slice(&self.mtu.to_le_bytes());
        v.extend_from_slice(&self.psn.to_le_bytes());
        for r in [self.data, self.signals] {
            v.extend_from_slice(&r.addr.to_le_bytes());
            v.extend_from_slice(&r.rkey.to_le_bytes());
            v.extend_from_slice(&r.bytes.to_le_bytes());
        }
        v.extend_from_slice(&(self.qp_nums.len() as u32).to_le_bytes());
        for q in &self.qp_nums {
            v.extend_from_slice(&q.to_le_bytes());
        }
        v
    }

    pub fn decode(b: &[u8], from_rank: usize) -> Result<RdmaBlob> {
        let bad = || {
            MkError::remote(format!(
                "rank {from_rank} sent no RDMA connection data ({} bytes): do all ranks use the same MK_NET and the \
                 same mkernel build?",
                b.len()
            ))
        };
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8]> {
            let s = b.get(at..at + n).ok_or_else(bad)?;
            at += n;
            Ok(s)
        };
        if take(4)? != BLOB_MAGIC {
            return Err(bad());
        }
        let u16_le = |s: &[u8]| u16::from_le_bytes(s.try_into().expect("2 bytes"));
        let u32_le = |s: &[u8]| u32::from_le_bytes(s.try_into().expect("4 bytes"));
        let u64_le = |s: &[u8]| u64::from_le_bytes(s.try_into().expect("8 bytes"));
        let lid = u16_le(take(2)?);
        let gid: [u8; 16] = take(16)?.try_into().expect("16 bytes");
        let mtu = u32_le(take(4)?);
        let psn = u32_le(take(4)?);
        let mut regions = [RemoteRegion::default(); 2];
        for r in &mut regions {
            *r = RemoteRegion { addr: u64_le(take(8)?), rkey: u32_le(take(4)?), bytes: u64_le(take(8)?) };
        }
        let count = u32_le(take(4)?) as usize;
        if count > 1 << 24 {
            return Err(bad());
        }
        let qp_nums = (0..count).map(|_| take(4).map(u32_le)).collect::<Result<Vec<_>>>()?;
        if at != b.len() {
            return Err(bad());
        }
        Ok(RdmaBlob { lid, gid, mtu, psn, data: regions[0], signals: regions[1], qp_nums })
    }
}

/// One RDMA WRITE of a put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteStep {
    /// `bytes` from local data offset `src_offset` to the remote address.
    Data { src_offset: u64, remote_addr: u64, rkey: u32, bytes: u64 },
    /// The 8-byte signal value, inline, to the remote signal word.
    Flag { value: u64, remote_addr: u64, rkey: u32 },
}

/// The writes of a put in posting order (data in chunks of at most `MAX_WRITE_BYTES`, then
/// the flag); the last one is the one to signal. Ranges must already be checked.
pub fn plan_put(put: &PutRequest, remote: &RdmaBlob) -> Vec<WriteStep> {
    plan_put_in_chunks(put, remote, MAX_WRITE_BYTES)
}

/// `plan_put` for a device whose writes carry at most `max_write` bytes (EFA's
/// `max_rdma_size`).
pub fn plan_put_in_chunks(put: &PutRequest, remote: &RdmaBlob, max_write: u64) -> Vec<WriteStep> {
    let max_write = max_write.clamp(1, MAX_WRITE_BYTES);
    let mut steps = Vec::new();
    let mut done = 0;
    while done < put.bytes {
        let bytes = (put.bytes - done).min(max_write);
        steps.push(WriteStep::Data {
            src_offset: put.src_offset + done,
            remote_addr: remote.data.addr + put.dst_offset + done,
            rkey: remote.data.rkey,
            bytes,
        });
        done += bytes;
    }
    if let Some((id, value)) = put.signal {
        steps.push(WriteStep::Flag {
            value,
            remote_addr: remote.signals.addr + 8 * id as u64,
            rkey: remote.signals.rkey,
        });
    }
    steps
}

/// The page-aligned range covering `[base, base + bytes)`: (aligned base, length).
pub fn page_cover(base: u64, bytes: u64, page: u64) -> (u64, u64) {
    let start = base & !(page - 1);
    let end = (base + bytes).div_ceil(page) * page;
    (start, end - start)
}

/// Work requests one put needs with 1 GiB writes: ⌈u32::MAX / MAX_WRITE_BYTES⌉ data writes
/// and a flag (ring commands carry u32 byte counts). Sizes the send queue; a device with a
/// smaller write limit needs more, which wait in the transport's backlog.
pub const MAX_WRITES_PER_COMMAND: u32 = 5;

/// Window sizes as peers see them, for range checks.
pub fn window_limits(blob: &RdmaBlob) -> (u64, u64) {
    (blob.data.bytes, blob.signals.bytes / 8)
}

/// Region sizes of a local window, checked for what RDMA registration needs.
pub fn check_window(window: &Window) -> Result<()> {
    if window.signals.base % 8 != 0 || window.signals.bytes % 8 != 0 {
        return Err(MkError::invalid_argument("signal words must be 8-byte aligned u64s"));
    }
    if window.data.bytes == 0 || window.signals.bytes == 0 {
        return Err(MkError::invalid_argument("an RDMA window needs a nonempty data and signal region"));
    }
    Ok(())
}

/// The signal message payload of the sequenced protocol.
pub fn encode_signal(id: u32, value: u64) -> [u8; SIGNAL_MESSAGE_BYTES] {
    let mut p = [0u8; SIGNAL_MESSAGE_BYTES];
    p[..4].copy_from_slice(&id.to_le_bytes());
    p[8..].copy_from_slice(&value.to_le_bytes());
    p
}

pub fn decode_signal(p: &[u8; SIGNAL_MESSAGE_BYTES]) -> (u32, u64) {
    (u32::from_le_bytes(p[..4].try_into().expect("4 bytes")), u64::from_le_bytes(p[8..].try_into().expect("8 bytes")))
}

/// The work requests of a put in posting order. `next_seq` is the peer's message counter
/// (sequenced ordering only; advanced by one per message).
pub fn plan_work(
    put: &PutRequest,
    post_id: PostId,
    steps: &[WriteStep],
    ordering: SignalOrdering,
    local: &Window,
    data_keys: MemoryKeys,
    next_seq: &mut u32,
) -> Vec<WorkRequest> {
    let n = steps.len() as u32;
    let mut out = Vec::with_capacity(steps.len());
    for (i, step) in steps.iter().enumerate() {
        let last = i as u32 + 1 == n;
        let op = match (*step, ordering) {
            (WriteStep::Data { src_offset, remote_addr, rkey, bytes }, _) => {
                let imm = (ordering == SignalOrdering::Sequenced).then_some(*next_seq);
                WorkOp::Write {
                    local_addr: local.data.base + src_offset,
                    lkey: data_keys.lkey,
                    bytes: bytes as u32,
                    remote_addr,
                    rkey,
                    imm,
                }
            }
            (WriteStep::Flag { value, remote_addr, rkey }, SignalOrdering::WriteThenFlag) => {
                WorkOp::WriteValue { value, remote_addr, rkey }
            }
            (WriteStep::Flag { value, .. }, SignalOrdering::Sequenced) => {
                let id = put.signal.expect("a flag step comes from a signal").0;
                WorkOp::Send { payload: encode_signal(id, value), imm: *next_seq }
            }
        };
        // RC: the last completion implies the earlier ones; SRD: completions come in any order.
        let signaled = match ordering {
            SignalOrdering::WriteThenFlag => last,
            SignalOrdering::Sequenced => {
                *next_seq = next_seq.wrapping_add(1);
                true
            }
        };
        out.push(WorkRequest { id: post_id, op, signaled });
    }
    out
}

/// A put not yet complete.
struct PendingPut {
    peer: usize,
    /// Signaled work requests still to complete.
    remaining: u32,
    /// Work requests the put posts.
    work_requests: u32,
}

#[derive(Default)]
struct PeerState {
    /// Work requests not yet accepted by the send queue, in posting order.
    backlog: VecDeque<WorkRequest>,
    /// Work requests on the send queue (posted, not yet retired by a completion).
    in_queue: u32,
    /// Number of the next message to this peer (sequenced ordering).
    next_seq: u32,
    /// Messages from this peer (sequenced ordering).
    incoming: SignalSequencer,
}

/// The stager that writes device signal words for the sequenced protocol.
struct SignalStager(DeviceStager);

// SAFETY: a stager holds a CUDA stream, pinned host memory and events, which any thread of
// the process may use; the transport uses it from one thread at a time (the proxy's).
unsafe impl Send for SignalStager {}

/// The RDMA transport of one rank, over any `Verbs`.
pub struct RdmaTransport {
    rank: usize,
    nranks: usize,
    /// None once closed.
    verbs: Option<Box<dyn Verbs>>,
    ordering: SignalOrdering,
    /// Largest single write the device takes.
    max_write: u64,
    window: Option<Window>,
    data_keys: MemoryKeys,
    signal_keys: MemoryKeys,
    qp_nums: Vec<u32>,
    remotes: Vec<Option<RdmaBlob>>,
    peers: Vec<PeerState>,
    pending: HashMap<PostId, PendingPut>,
    /// Puts complete since the last poll returned (or needing no work request).
    finished: Vec<PostId>,
    next_post: PostId,
    failed: Option<MkError>,
    /// For a signal region in device memory (sequenced ordering writes signals from the host).
    cuda_context: Option<usize>,
    /// Writes device signal words on its own non-blocking stream (made on first use).
    signal_stager: Option<SignalStager>,
    completions: Vec<Completion>,
    ready_signals: Vec<(u32, u64)>,
}

impl RdmaTransport {
    /// Opens the first (device, port) `MK_IB_HCA` allows, through libibverbs.
    pub fn open(rank: usize, nranks: usize) -> Result<RdmaTransport> {
        Ok(Self::over(rank, nranks, Box::new(ibverbs::IbVerbs::open(rank)?)))
    }

    /// The transport over a given verbs layer (the simulated one in tests).
    pub fn over(rank: usize, nranks: usize, verbs: Box<dyn Verbs>) -> RdmaTransport {
        RdmaTransport {
            rank,
            nranks,
            ordering: verbs.ordering(),
            max_write: verbs.max_write_bytes(),
            verbs: Some(verbs),
            window: None,
            data_keys: MemoryKeys::default(),
            signal_keys: MemoryKeys::default(),
            qp_nums: vec![0; nranks],
            remotes: vec![None; nranks],
            peers: (0..nranks).map(|_| PeerState::default()).collect(),
            pending: HashMap::new(),
            finished: Vec::new(),
            next_post: 0,
            failed: None,
            cuda_context: None,
            signal_stager: None,
            completions: Vec::new(),
            ready_signals: Vec::new(),
        }
    }

    /// The CUDA context (a `CUcontext`) current while signals are written into a device
    /// signal region (sequenced ordering).
    pub fn set_cuda_context(&mut self, context: usize) {
        self.cuda_context = Some(context);
    }

    pub fn ordering(&self) -> SignalOrdering {
        self.ordering
    }

    /// Work requests waiting for room in `peer`'s send queue.
    pub fn backlog(&self, peer: usize) -> usize {
        self.peers.get(peer).map_or(0, |p| p.backlog.len())
    }

    fn verbs(&mut self) -> Result<&mut Box<dyn Verbs>> {
        self.verbs.as_mut().ok_or_else(|| MkError::invalid_usage("the RDMA transport is closed"))
    }

    fn fail(&mut self, e: MkError) -> MkError {
        if self.failed.is_none() {
            self.failed = Some(e.clone());
        }
        self.failed.clone().expect("just set")
    }

    /// Posts `peer`'s waiting work requests while its send queue has room.
    fn drain_backlog(&mut self, peer: usize) -> Result<()> {
        let verbs = self.verbs.as_mut().ok_or_else(|| MkError::invalid_usage("the RDMA transport is closed"))?;
        let depth = verbs.send_queue_depth().max(1);
        let state = &mut self.peers[peer];
        while let Some(work) = state.backlog.front() {
            if state.in_queue >= depth {
                break;
            }
            match verbs.post_send(peer, work) {
                Ok(()) => {
                    state.in_queue += 1;
                    state.backlog.pop_front();
                }
                Err(PostError::QueueFull) if state.in_queue > 0 => break,
                Err(PostError::QueueFull) => {
                    return Err(MkError::system(format!(
                        "{} refused a work request to rank {peer} with an empty send queue (ENOMEM)",
                        verbs.device()
                    )));
                }
                Err(PostError::Failed(e)) => return Err(e.context(format!("posting to rank {peer}"))),
            }
        }
        Ok(())
    }

    /// Writes a signal word of this rank's window (sequenced ordering): after every message
    /// before it arrived, so after its data.
    fn write_local_signal(&mut self, from: usize, id: u32, value: u64) -> Result<()> {
        let window = self.window.expect("connected transports have a window");
        if id as u64 >= window.signal_words() {
            return Err(MkError::remote(format!(
                "rank {from} signalled word {id}, outside this rank's {} signal words",
                window.signal_words()
            )));
        }
        let address = window.signals.base + 8 * id as u64;
        match window.signals.kind {
            MemoryKind::Host => {
                // SAFETY: inside the registered signal region (checked above), 8-byte aligned
                // (check_window); kernels and host waiters read it atomically.
                let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(address as *mut u64) };
                word.store(value, std::sync::atomic::Ordering::Release);
                Ok(())
            }
            MemoryKind::Device => {
                if self.signal_stager.is_none() {
                    let context = self.cuda_context.ok_or_else(super::staging::missing_context)?;
                    self.signal_stager = Some(SignalStager(DeviceStager::new(context)?));
                }
                // A non-blocking stream: the legacy stream would wait for the persistent
                // kernel that waits for this very signal. Stream order keeps signals in order.
                self.signal_stager.as_mut().expect("made above").0.store_u64(address, value)
            }
        }
    }

    fn handle(&mut self, c: Completion) -> Result<()> {
        let peer = c.peer;
        if let Err(why) = &c.status {
            let what = if matches!(c.kind, CompletionKind::Sent { .. }) { "to" } else { "from" };
            return Err(MkError::remote(format!(
                "RDMA transfer {what} rank {peer} failed: {why} (is rank {peer} alive?)"
            )));
        }
        if peer >= self.nranks {
            return Err(MkError::internal(format!("completion names rank {peer} of {}", self.nranks)));
        }
        match c.kind {
            CompletionKind::Sent { id } => {
                let Some(put) = self.pending.get_mut(&id) else {
                    return Err(MkError::internal(format!("completion for unknown put {id} to rank {peer}")));
                };
                // RC: the put's one signaled work request retires all of its work requests.
                let retire = if self.ordering == SignalOrdering::WriteThenFlag { put.work_requests } else { 1 };
                put.remaining = put.remaining.saturating_sub(1);
                let (owner, done) = (put.peer, put.remaining == 0);
                let state = &mut self.peers[owner];
                state.in_queue = state.in_queue.saturating_sub(retire);
                if done {
                    self.pending.remove(&id);
                    self.finished.push(id);
                }
                Ok(())
            }
            CompletionKind::ReceivedWrite { imm } | CompletionKind::ReceivedSend { imm, .. }
                if self.ordering == SignalOrdering::WriteThenFlag =>
            {
                Err(MkError::remote(format!("rank {peer} sent a message with immediate {imm} to an RC transport")))
            }
            CompletionKind::ReceivedWrite { imm } => self.arrive(peer, imm, None),
            CompletionKind::ReceivedSend { imm, payload } => self.arrive(peer, imm, Some(decode_signal(&payload))),
        }
    }

    fn arrive(&mut self, peer: usize, seq: u32, signal: Option<(u32, u64)>) -> Result<()> {
        let mut ready = std::mem::take(&mut self.ready_signals);
        ready.clear();
        let result = self.peers[peer].incoming.arrive(peer, seq, signal, &mut ready);
        let result =
            result.and_then(|()| ready.iter().try_for_each(|&(id, value)| self.write_local_signal(peer, id, value)));
        self.ready_signals = ready;
        result?;
        self.verbs()?.post_receives(peer, 1)
    }
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "ib"
    }

    unsafe fn register(&mut self, window: Window) -> Result<()> {
        if self.window.is_some() {
            return Err(MkError::invalid_usage("the RDMA transport's window is already registered"));
        }
        check_window(&window)?;
        let verbs = self.verbs()?;
        // SAFETY: forwarded from this function's contract.
        let data = unsafe { verbs.register(window.data)? };
        // SAFETY: as above.
        let signals = unsafe { verbs.register(window.signals)? };
        (self.data_keys, self.signal_keys) = (data, signals);
        self.window = Some(window);
        Ok(())
    }

    fn connection_blob(&mut self, peers: &[usize]) -> Result<Vec<u8>> {
        let window = self.window.ok_or_else(|| MkError::invalid_usage("register a window before connecting"))?;
        check_peers(self.rank, self.nranks, self.nranks, peers)?;
        for &p in peers {
            if self.qp_nums[p] == 0 {
                self.qp_nums[p] = self.verbs()?.create_queue_pair(p)?;
            }
        }
        let address = self.verbs()?.address();
        Ok(RdmaBlob {
            lid: address.lid,
            gid: address.gid,
            mtu: address.mtu,
            psn: address.psn,
            data: RemoteRegion { addr: window.data.base, rkey: self.data_keys.rkey, bytes: window.data.bytes },
            signals: RemoteRegion {
                addr: window.signals.base,
                rkey: self.signal_keys.rkey,
                bytes: window.signals.bytes,
            },
            qp_nums: self.qp_nums.clone(),
        }
        .encode())
    }

    fn connect(&mut self, blobs: &[Vec<u8>], peers: &[usize]) -> Result<()> {
        check_peers(self.rank, self.nranks, blobs.len(), peers)?;
        for &p in peers {
            let remote = RdmaBlob::decode(&blobs[p], p)?;
            if remote.qp_nums.len() != self.nranks {
                return Err(MkError::remote(format!(
                    "rank {p}'s RDMA connection data names {} ranks, this communicator has {}",
                    remote.qp_nums.len(),
                    self.nranks
                )));
            }
            let remote_qp = *remote.qp_nums.get(self.rank).filter(|&&q| q != 0).ok_or_else(|| {
                MkError::invalid_usage(format!(
                    "rank {p} has no queue pair for rank {}: every peer must list the other",
                    self.rank
                ))
            })?;
            if self.qp_nums[p] == 0 {
                return Err(MkError::invalid_usage(format!("rank {p} was not among the peers of connection_blob")));
            }
            let sequenced = self.ordering == SignalOrdering::Sequenced;
            let verbs = self.verbs()?;
            verbs.connect(p, &remote, remote_qp)?;
            let receives = verbs.receive_queue_depth();
            if sequenced {
                verbs.post_receives(p, receives)?;
            }
            self.remotes[p] = Some(remote);
        }
        Ok(())
    }

    fn post_put(&mut self, put: &PutRequest) -> Result<PostId> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        self.verbs()?;
        let window = self.window.ok_or_else(|| MkError::invalid_usage("register a window before posting"))?;
        let remote = self.remotes.get(put.peer).and_then(|r| r.as_ref()).ok_or_else(|| {
            MkError::invalid_argument(format!("rank {} is not connected to rank {}", self.rank, put.peer))
        })?;
        let (data_bytes, signal_words) = window_limits(remote);
        check_put_ranges(put, &window, data_bytes, signal_words)?;
        let steps = plan_put_in_chunks(put, remote, self.max_write);
        let id = self.next_post;
        self.next_post += 1;
        if steps.is_empty() {
            self.finished.push(id);
            return Ok(id);
        }
        let state = &mut self.peers[put.peer];
        let work = plan_work(put, id, &steps, self.ordering, &window, self.data_keys, &mut state.next_seq);
        let remaining = work.iter().filter(|w| w.signaled).count() as u32;
        let work_requests = work.len() as u32;
        state.backlog.extend(work);
        self.pending.insert(id, PendingPut { peer: put.peer, remaining, work_requests });
        if let Err(e) = self.drain_backlog(put.peer) {
            return Err(self.fail(e));
        }
        Ok(id)
    }

    fn poll(&mut self, completed: &mut Vec<PostId>) -> Result<()> {
        completed.append(&mut self.finished);
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut batch = std::mem::take(&mut self.completions);
        batch.clear();
        if let Err(e) = self.verbs()?.poll(&mut batch) {
            return Err(self.fail(e));
        }
        let mut outcome = Ok(());
        for c in batch.drain(..) {
            if let Err(e) = self.handle(c) {
                outcome = Err(e);
                break;
            }
        }
        batch.clear();
        self.completions = batch;
        if let Err(e) = outcome {
            completed.append(&mut self.finished);
            return Err(self.fail(e));
        }
        completed.append(&mut self.finished);
        for peer in 0..self.nranks {
            if !self.peers[peer].backlog.is_empty() {
                if let Err(e) = self.drain_backlog(peer) {
                    return Err(self.fail(e));
                }
            }
        }
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        // Dropping the verbs layer releases queue pairs, registrations and the device.
        self.verbs = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::mkResult_t;
    use crate::transport::{MemoryKind, MemoryRegion};

    fn blob() -> RdmaBlob {
        RdmaBlob {
            lid: 0x1234,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            mtu: 5,
            psn: 0xabcdef,
            data: RemoteRegion { addr: 0x7f00_0000_0000, rkey: 0x1111, bytes: 1 << 32 },
            signals: RemoteRegion { addr: 0x7f10_0000_0000, rkey: 0x2222, bytes: 8 * 64 },
            qp_nums: vec![0, 0x77, 0, 0x99],
        }
    }

    #[test]
    fn connection_data_round_trips_and_rejects_garbage() {
        let b = blob();
        let bytes = b.encode();
        assert_eq!(RdmaBlob::decode(&bytes, 2).unwrap(), b);
        for cut in [0, 3, 4, 20, bytes.len() - 1] {
            assert_eq!(RdmaBlob::decode(&bytes[..cut], 2).unwrap_err().code, mkResult_t::mkRemoteError, "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(RdmaBlob::decode(&longer, 2).is_err());
        let mut socket_blob = bytes.clone();
        socket_blob[..4].copy_from_slice(b"MKS1");
        let e = RdmaBlob::decode(&socket_blob, 2).unwrap_err();
        assert!(e.message.contains("MK_NET"), "a socket rank meeting an ib rank is told why: {e}");
    }

    #[test]
    fn put_becomes_data_writes_then_flag() {
        let remote = blob();
        let put = PutRequest { peer: 1, src_offset: 100, dst_offset: 4096, bytes: 5000, signal: Some((3, 42)) };
        assert_eq!(
            plan_put(&put, &remote),
            vec![
                WriteStep::Data { src_offset: 100, remote_addr: remote.data.addr + 4096, rkey: 0x1111, bytes: 5000 },
                WriteStep::Flag { value: 42, remote_addr: remote.signals.addr + 24, rkey: 0x2222 },
            ]
        );
        let signal_only = PutRequest { bytes: 0, ..put };
        assert!(matches!(plan_put(&signal_only, &remote)[..], [WriteStep::Flag { value: 42, .. }]));
        let quiet = PutRequest { signal: None, ..put };
        assert!(matches!(plan_put(&quiet, &remote)[..], [WriteStep::Data { .. }]));
        assert!(plan_put(&PutRequest { bytes: 0, signal: None, ..put }, &remote).is_empty());
    }

    #[test]
    fn large_puts_are_split_and_fit_the_send_queue_budget() {
        let remote = blob();
        let put = PutRequest { peer: 1, src_offset: 0, dst_offset: 8, bytes: u32::MAX as u64, signal: Some((0, 1)) };
        let steps = plan_put(&put, &remote);
        assert_eq!(steps.len() as u32, MAX_WRITES_PER_COMMAND);
        let mut next_src = 0;
        for s in &steps[..steps.len() - 1] {
            let WriteStep::Data { src_offset, remote_addr, bytes, .. } = *s else { panic!("data first") };
            assert_eq!(src_offset, next_src);
            assert_eq!(remote_addr, remote.data.addr + 8 + src_offset);
            assert!(bytes <= MAX_WRITE_BYTES);
            next_src += bytes;
        }
        assert_eq!(next_src, u32::MAX as u64);
        assert!(matches!(steps.last(), Some(WriteStep::Flag { .. })));
        let small = plan_put_in_chunks(&PutRequest { bytes: 10_000, ..put }, &remote, 4096);
        let sizes: Vec<u64> = small
            .iter()
            .filter_map(|s| if let WriteStep::Data { bytes, .. } = s { Some(*bytes) } else { None })
            .collect();
        assert_eq!(sizes, vec![4096, 4096, 10_000 - 8192], "a device's smaller write limit splits puts further");
    }

    #[test]
    fn dmabuf_export_covers_whole_pages() {
        assert_eq!(page_cover(0x10000, 0x1000, 0x1000), (0x10000, 0x1000));
        assert_eq!(page_cover(0x10010, 0x10, 0x1000), (0x10000, 0x1000));
        assert_eq!(page_cover(0x10ff0, 0x20, 0x1000), (0x10000, 0x2000));
        let (b, n) = page_cover(0x7f00_1234_5678, 3 << 20, 1 << 16);
        assert!(
            b <= 0x7f00_1234_5678 && b + n >= 0x7f00_1234_5678 + (3 << 20) && b % (1 << 16) == 0 && n % (1 << 16) == 0
        );
    }

    /// The no-device fallback: on a machine without RDMA devices (CI, the development
    /// machine, the GPU machine) sockets are chosen and opening the RDMA transport is a
    /// clear error, not a crash, whether or not libibverbs loads. With a device it checks
    /// the opposite choice.
    #[test]
    fn without_devices_sockets_are_chosen() {
        use crate::transport::{select_net, NetKind};
        let ports = active_ports();
        let usable = usable_device_count();
        let loaded = ibverbs::library().is_ok();
        if ports.is_empty() {
            assert_eq!(usable, 0);
            assert_eq!(select_net(None, loaded, usable).unwrap(), NetKind::Socket);
            let e = RdmaTransport::open(0, 2).err().expect("no device to open");
            assert_eq!(e.code, mkResult_t::mkSystemError, "{e}");
            assert_eq!(select_net(Some("ib"), loaded, usable).unwrap_err().code, mkResult_t::mkSystemError);
        } else {
            assert_eq!(select_net(None, loaded, ports.len()).unwrap(), NetKind::Ib);
        }
    }

    #[test]
    fn sequenced_puts_number_every_message_and_signal_every_request() {
        let remote = blob();
        let window = Window {
            data: MemoryRegion { base: 0x5000, bytes: 1 << 33, kind: MemoryKind::Host },
            signals: MemoryRegion { base: 0x9000, bytes: 64, kind: MemoryKind::Host },
        };
        let keys = MemoryKeys { lkey: 7, rkey: 8 };
        let put =
            PutRequest { peer: 1, src_offset: 0, dst_offset: 0, bytes: 2 * MAX_WRITE_BYTES + 5, signal: Some((3, 99)) };
        let steps = plan_put(&put, &remote);
        let mut seq = u32::MAX - 1;
        let work = plan_work(&put, 11, &steps, SignalOrdering::Sequenced, &window, keys, &mut seq);
        assert_eq!(work.len(), 4);
        assert_eq!(seq, 2, "four messages advance the wrapping sequence by four");
        let imms: Vec<u32> = work
            .iter()
            .map(|w| match w.op {
                WorkOp::Write { imm: Some(imm), lkey: 7, .. } => imm,
                WorkOp::Send { imm, payload } => {
                    assert_eq!(decode_signal(&payload), (3, 99));
                    imm
                }
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(imms, vec![u32::MAX - 1, u32::MAX, 0, 1]);
        assert!(work.iter().all(|w| w.signaled && w.id == 11));
        let mut unused = 0;
        let rc = plan_work(&put, 12, &steps, SignalOrdering::WriteThenFlag, &window, keys, &mut unused);
        assert_eq!(unused, 0);
        assert_eq!(rc.iter().filter(|w| w.signaled).count(), 1);
        assert!(rc.last().unwrap().signaled);
        assert!(matches!(rc.last().unwrap().op, WorkOp::WriteValue { value: 99, .. }));
        assert!(rc.iter().all(|w| !matches!(w.op, WorkOp::Write { imm: Some(_), .. })));
    }

    #[test]
    fn windows_are_checked() {
        let r = |base, bytes| MemoryRegion { base, bytes, kind: MemoryKind::Device };
        assert!(check_window(&Window { data: r(0x1000, 10), signals: r(0x2000, 16) }).is_ok());
        assert!(check_window(&Window { data: r(0x1000, 10), signals: r(0x2004, 16) }).is_err());
        assert!(check_window(&Window { data: r(0x1000, 0), signals: r(0x2000, 16) }).is_err());
        assert!(check_window(&Window { data: r(0x1000, 10), signals: r(0x2000, 12) }).is_err());
    }
}
