//! TCP transport between proxies: one connection per peer pair, a sender thread and a
//! receiver thread per peer, puts staged through host memory (windows in device memory go
//! through `staging::DeviceStager`'s pinned buffers).
//!
//! Connections are authenticated both ways with the bootstrap's handshake
//! (`bootstrap::handshake`, purpose `Transport`, bound to the dialing and the accepting
//! rank), keyed by `TransportAuth` (derived from the unique id's secret): a process that
//! does not know the id cannot write into a window. The higher rank of a pair dials (and
//! retries until `MK_TIMEOUT_MS`), the lower accepts, many handshakes at once with a bound
//! on those in flight (`bootstrap::acceptor`), so silent connections cannot stall it.
//!
//! Wire: every message is a 32-byte `Frame` header, then `bytes` of data for a put. The
//! receiver copies the data into its window, then stores the signal word with release
//! semantics, so the signal is visible only after the data (TCP keeps one connection's
//! bytes in order). A put completes locally when its bytes are written to the socket.
//! A `Close` frame ends a connection cleanly; any other end of it is the peer's failure.

use super::staging::{missing_context, nth_chunk, DeviceStager, STAGING_HEADROOM};
use super::{check_peers, check_put_ranges, MemoryKind, PostId, PutRequest, Transport, TransportAuth, Window};
use crate::bootstrap::acceptor::{Acceptor, AcceptorConfig};
use crate::bootstrap::handshake::{self, DialSpec, Purpose, HANDSHAKE_LIMIT, PROOF_GRACE};
use crate::bootstrap::net::{self, Deadline, TRANSPORT_TIMEOUT_VAR};
use crate::bootstrap::unique_id::{decode_addr, encode_addr, ENCODED_ADDR_BYTES};
use crate::error::{MkError, Result};
use crate::mk_warn;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const BLOB_MAGIC: &[u8; 4] = b"MKS1";
const BLOB_BYTES: usize = 4 + ENCODED_ADDR_BYTES + 16;
const FRAME_BYTES: usize = 32;
const FRAME_PUT: u32 = 1;
const FRAME_CLOSE: u32 = 2;
/// Puts up to this size are sent with their header in one write.
const SMALL_PUT_BYTES: usize = 64 << 10;
/// Handshakes a rank's transport listener runs at once (more wait in its queue).
pub const TRANSPORT_MAX_IN_FLIGHT: usize = 32;
/// How often an idle receiver looks at the closing flag.
const IDLE_POLL: Duration = Duration::from_millis(100);

/// A message header on the wire (little-endian).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Frame {
    kind: u32,
    /// Signal word index, or u32::MAX for none.
    signal_id: u32,
    bytes: u64,
    dst_offset: u64,
    signal_value: u64,
}

impl Frame {
    fn encode(&self) -> [u8; FRAME_BYTES] {
        let mut b = [0u8; FRAME_BYTES];
        b[0..4].copy_from_slice(&self.kind.to_le_bytes());
        b[4..8].copy_from_slice(&self.signal_id.to_le_bytes());
        b[8..16].copy_from_slice(&self.bytes.to_le_bytes());
        b[16..24].copy_from_slice(&self.dst_offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.signal_value.to_le_bytes());
        b
    }

    fn decode(b: &[u8; FRAME_BYTES]) -> Frame {
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        Frame {
            kind: u32_at(0),
            signal_id: u32_at(4),
            bytes: u64_at(8),
            dst_offset: u64_at(16),
            signal_value: u64_at(24),
        }
    }

    fn close() -> Frame {
        Frame { kind: FRAME_CLOSE, signal_id: u32::MAX, bytes: 0, dst_offset: 0, signal_value: 0 }
    }
}

/// What peers learn about this rank: where to connect and how big its window is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SocketBlob {
    pub listen: SocketAddr,
    pub data_bytes: u64,
    pub signal_words: u64,
}

impl SocketBlob {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(BLOB_BYTES);
        v.extend_from_slice(BLOB_MAGIC);
        encode_addr(&self.listen, &mut v);
        v.extend_from_slice(&self.data_bytes.to_le_bytes());
        v.extend_from_slice(&self.signal_words.to_le_bytes());
        v
    }

    pub fn decode(b: &[u8], from_rank: usize) -> Result<SocketBlob> {
        if b.len() != BLOB_BYTES || &b[..4] != BLOB_MAGIC {
            return Err(MkError::remote(format!(
                "rank {from_rank} sent no socket-transport connection data ({} bytes): do all ranks use the same \
                 MK_NET and the same mkernel build?",
                b.len()
            )));
        }
        let listen = decode_addr(&b[4..4 + ENCODED_ADDR_BYTES])?;
        let o = 4 + ENCODED_ADDR_BYTES;
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        Ok(SocketBlob { listen, data_bytes: u64_at(o), signal_words: u64_at(o + 8) })
    }
}

/// State shared by the transport and its peer threads.
#[derive(Default)]
struct Shared {
    error: Mutex<Option<MkError>>,
    completed: Mutex<Vec<PostId>>,
    closing: AtomicBool,
}

impl Shared {
    fn fail(&self, rank: usize, e: MkError) {
        let mut slot = self.error.lock();
        if slot.is_none() {
            mk_warn!(Some(rank), "socket transport: {}", e.message);
            *slot = Some(e);
        }
    }

    fn error(&self) -> Option<MkError> {
        self.error.lock().clone()
    }
}

#[derive(Clone, Copy)]
enum SendJob {
    Put { id: PostId, frame: Frame, src: usize, len: usize },
    Close,
}

struct PeerLink {
    jobs: Option<mpsc::Sender<SendJob>>,
    sender: Option<JoinHandle<()>>,
    receiver: Option<JoinHandle<()>>,
    /// A handle on the socket to shut it down when the peer does not close in time.
    socket: TcpStream,
    data_bytes: u64,
    signal_words: u64,
}

/// The TCP transport of one rank.
pub struct SocketTransport {
    rank: usize,
    nranks: usize,
    auth: TransportAuth,
    timeout: Duration,
    listener: TcpListener,
    window: Option<Window>,
    peers: Vec<Option<PeerLink>>,
    next_post: PostId,
    shared: Arc<Shared>,
    closed: bool,
    /// The communicator's CUDA context (a `CUcontext`), for windows in device memory.
    cuda_context: Option<usize>,
}

impl SocketTransport {
    /// Lets the transport stage windows in device memory through pinned host buffers, using
    /// `context` (which must outlive the transport) on its own threads.
    pub fn set_cuda_context(&mut self, context: cudarc::driver::sys::CUcontext) {
        self.cuda_context = Some(context as usize);
    }

    /// Listens on the bootstrap's interface (`MK_SOCKET_IFNAME`). `timeout` bounds
    /// connecting, every send, every partially received message, and closing.
    pub fn new(rank: usize, nranks: usize, auth: TransportAuth, timeout: Duration) -> Result<SocketTransport> {
        if rank >= nranks {
            return Err(MkError::invalid_argument(format!("rank {rank} is out of range [0, {nranks})")));
        }
        let listener = net::bind_listener(net::local_address()?)?;
        Ok(SocketTransport {
            rank,
            nranks,
            auth,
            timeout,
            listener,
            window: None,
            peers: (0..nranks).map(|_| None).collect(),
            next_post: 0,
            shared: Arc::new(Shared::default()),
            closed: false,
            cuda_context: None,
        })
    }

    /// Connecting side: the handshake as `self.rank` dialing `peer`, retried until the deadline.
    fn dial(&self, peer: usize, addr: SocketAddr, deadline: &Deadline) -> Result<TcpStream> {
        let what = format!("rank {} connecting its socket transport to rank {peer} at {addr}", self.rank);
        let spec = DialSpec {
            key: &self.auth.key,
            session: self.auth.session,
            purpose: Purpose::Transport,
            dialer: self.rank as u32,
            target: peer as u32,
        };
        Ok(handshake::dial(addr, spec, deadline, &what)?.into_socket())
    }

    /// Accepting side: accepts authenticated connections until every rank in `expected` has
    /// connected; strangers, wrong proofs and unexpected ranks are logged and dropped.
    fn accept_peers(&self, expected: &[usize], deadline: &Deadline) -> Result<Vec<(usize, TcpStream)>> {
        let config = AcceptorConfig {
            key: &self.auth.key,
            session: self.auth.session,
            purpose: Purpose::Transport,
            me: self.rank as u32,
            max_in_flight: TRANSPORT_MAX_IN_FLIGHT,
            handshake_limit: HANDSHAKE_LIMIT,
            proof_grace: PROOF_GRACE,
            first_frame_max: None,
            log_rank: Some(self.rank),
        };
        let mut acceptor = Acceptor::new(&self.listener, config);
        let mut got: Vec<(usize, TcpStream)> = Vec::new();
        while got.len() < expected.len() {
            let missing: Vec<usize> = expected.iter().copied().filter(|p| !got.iter().any(|(r, _)| r == p)).collect();
            let what = format!("rank {} waiting for ranks {missing:?} to connect their socket transports", self.rank);
            let accepted = acceptor.next(deadline, &|d| missing.contains(&(d as usize)), &what)?;
            got.push((accepted.dialer as usize, accepted.stream.into_socket()));
        }
        Ok(got)
    }

    fn start_peer(&mut self, peer: usize, socket: TcpStream, blob: &SocketBlob) -> Result<()> {
        let window = self.window.expect("connect checks registration");
        socket.set_nodelay(true)?;
        let send_socket = socket.try_clone()?;
        let recv_socket = socket.try_clone()?;
        let (jobs, queue) = mpsc::channel();
        let link = Link { rank: self.rank, peer, window, timeout: self.timeout, shared: Arc::clone(&self.shared) };
        let context = self.cuda_context;
        let sender_link = link.clone();
        let sender = std::thread::Builder::new()
            .name(format!("mk-sock-tx-{}-{peer}", self.rank))
            .spawn(move || {
                let sending = || send_loop(&sender_link, send_socket, queue, Staging { context, stager: None });
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(sending)).is_err() {
                    sender_link.shared.fail(sender_link.rank, thread_panicked("sender", peer));
                }
            })
            .map_err(|e| MkError::system(format!("cannot start a transport thread: {e}")))?;
        let receiver = std::thread::Builder::new()
            .name(format!("mk-sock-rx-{}-{peer}", self.rank))
            .spawn(move || {
                let receiving = || receive_loop(&link, recv_socket, Staging { context, stager: None });
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(receiving)) {
                    Ok(Ok(())) => {}
                    // A connection cut by our own close() is not a failure.
                    Ok(Err(_)) if link.shared.closing.load(Ordering::Acquire) => {}
                    Ok(Err(e)) => link.shared.fail(link.rank, e),
                    Err(_) => link.shared.fail(link.rank, thread_panicked("receiver", peer)),
                }
            })
            .map_err(|e| MkError::system(format!("cannot start a transport thread: {e}")))?;
        self.peers[peer] = Some(PeerLink {
            jobs: Some(jobs),
            sender: Some(sender),
            receiver: Some(receiver),
            socket,
            data_bytes: blob.data_bytes,
            signal_words: blob.signal_words,
        });
        Ok(())
    }
}

/// A transport thread's panic, reported as the error of the calls that use the transport.
fn thread_panicked(role: &str, peer: usize) -> MkError {
    MkError::internal(format!("the socket transport's {role} thread for rank {peer} panicked"))
}

fn lost_peer(peer: usize, e: std::io::Error, timeout: Duration, doing: &str) -> MkError {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => MkError::timeout(format!(
            "rank {peer} did not make progress {doing} within MK_TIMEOUT_MS={} ms",
            timeout.as_millis()
        )),
        ErrorKind::UnexpectedEof => {
            MkError::remote(format!("rank {peer} closed its connection {doing} (did it exit?)"))
        }
        _ => MkError::remote(format!("connection to rank {peer} failed {doing}: {e}")),
    }
}

/// What a peer's sender and receiver threads share.
#[derive(Clone)]
struct Link {
    rank: usize,
    peer: usize,
    window: Window,
    timeout: Duration,
    shared: Arc<Shared>,
}

/// Where a transport thread's window lives: host memory it reads and writes directly, or
/// device memory it stages (the stager is created on the thread's first device transfer).
struct Staging {
    context: Option<usize>,
    stager: Option<DeviceStager>,
}

impl Staging {
    fn stager(&mut self) -> Result<&mut DeviceStager> {
        if self.stager.is_none() {
            let context = self.context.ok_or_else(missing_context)?;
            self.stager = Some(DeviceStager::new(context)?);
        }
        Ok(self.stager.as_mut().expect("just created"))
    }
}

/// Puts a sender takes off its queue ahead of the one it is writing, so that their
/// staging copies can start while it writes (device windows).
const SEND_LOOKAHEAD: usize = 64;

/// Where a transport thread's time went; logged at MK_DEBUG=INFO when the thread ends.
#[derive(Default)]
struct ThreadStats {
    messages: u64,
    bytes: u64,
    /// Waiting for work (sender: an empty queue; receiver: the next header).
    idle: Duration,
    /// In socket writes (sender) or reads of message bodies (receiver).
    socket: Duration,
    /// Issuing and waiting for staging copies and signal writes.
    cuda: Duration,
}

impl ThreadStats {
    fn timed<T>(slot: &mut Duration, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        *slot += t.elapsed();
        r
    }

    fn log(&self, rank: usize, what: &str, staging: &Staging) {
        let calls = staging.stager.as_ref().map(|s| {
            format!("; copies issued {}, buffer waits {}, signals {}", s.times.issue, s.times.wait, s.times.signal)
        });
        crate::mk_info!(
            Some(rank),
            "socket transport {what}: {} messages, {:.1} MB; idle {:.1} ms, socket {:.1} ms, staging {:.1} ms{}",
            self.messages,
            self.bytes as f64 / 1e6,
            self.idle.as_secs_f64() * 1e3,
            self.socket.as_secs_f64() * 1e3,
            self.cuda.as_secs_f64() * 1e3,
            calls.unwrap_or_default()
        );
    }
}

fn send_loop(link: &Link, mut socket: TcpStream, queue: mpsc::Receiver<SendJob>, mut staging: Staging) {
    let Link { rank, peer, window, timeout, ref shared } = *link;
    if let Err(e) = socket.set_write_timeout(Some(timeout)) {
        shared.fail(rank, MkError::system(format!("socket to rank {peer}: {e}")));
        return;
    }
    let sending = |e: std::io::Error| lost_peer(peer, e, timeout, "while this rank sent to it");
    let mut jobs: VecDeque<SendJob> = VecDeque::new();
    // Device windows: the buffers of the staging copies issued for the first unsent chunks
    // of `jobs`, in send order, and how many chunks of the front job are already sent.
    let mut ahead = CopyAhead::default();
    let mut stats = ThreadStats::default();
    loop {
        if jobs.is_empty() {
            match ThreadStats::timed(&mut stats.idle, || next_job(&queue)) {
                Ok(job) => jobs.push_back(job),
                Err(_) => break, // close() or cut() dropped the queue
            }
        }
        while jobs.len() < SEND_LOOKAHEAD {
            match queue.try_recv() {
                Ok(job) => jobs.push_back(job),
                Err(_) => break,
            }
        }
        let result = match jobs[0] {
            SendJob::Put { id, frame, src, len } => {
                stats.messages += 1;
                stats.bytes += len as u64;
                let sent = if window.data.kind == MemoryKind::Device {
                    staging.stager().and_then(|stager| {
                        ahead.send_front(&jobs, stager, &mut socket, &frame, len, &mut stats).map_err(|e| match e {
                            SendError::Io(e) => sending(e),
                            SendError::Mk(e) => e,
                        })
                    })
                } else {
                    send_host_put(&mut socket, &frame, src, len, &mut stats).map_err(sending)
                };
                sent.map(|_| shared.completed.lock().push(id))
            }
            SendJob::Close => socket.write_all(&Frame::close().encode()).map_err(sending),
        };
        jobs.pop_front();
        ahead.front_sent = 0;
        if let Err(e) = result {
            shared.fail(rank, e);
            return;
        }
    }
    stats.log(rank, &format!("sender to rank {peer}"), &staging);
}

/// How long an idle sender polls its queue before it blocks: the proxy hands over the
/// commands of one collective tens of µs apart, and waking a blocked thread costs about
/// as much again.
const SENDER_SPIN: Duration = Duration::from_micros(200);

/// The next job: polled for `SENDER_SPIN`, then waited for without limit (an idle
/// connection is fine; close() ends the queue).
fn next_job(queue: &mpsc::Receiver<SendJob>) -> std::result::Result<SendJob, mpsc::RecvError> {
    let start = Instant::now();
    loop {
        match queue.try_recv() {
            Ok(job) => return Ok(job),
            Err(mpsc::TryRecvError::Disconnected) => return Err(mpsc::RecvError),
            Err(mpsc::TryRecvError::Empty) if start.elapsed() < SENDER_SPIN => std::thread::yield_now(),
            Err(mpsc::TryRecvError::Empty) => return queue.recv(),
        }
    }
}

/// A put from a window in host memory.
fn send_host_put(
    socket: &mut TcpStream,
    frame: &Frame,
    src: usize,
    len: usize,
    stats: &mut ThreadStats,
) -> std::io::Result<()> {
    // SAFETY: `register`'s contract keeps the window valid until close, and post_put
    // checked that [src, src + len) lies in its data region.
    let data = unsafe { std::slice::from_raw_parts(src as *const u8, len) };
    ThreadStats::timed(&mut stats.socket, || {
        if len <= SMALL_PUT_BYTES {
            // One write for header and data: small puts (signals, tiles' tails) are bound
            // by system calls, not bandwidth.
            let mut message = Vec::with_capacity(FRAME_BYTES + len);
            message.extend_from_slice(&frame.encode());
            message.extend_from_slice(data);
            socket.write_all(&message)
        } else {
            socket.write_all(&frame.encode())?;
            socket.write_all(data)
        }
    })
}

enum SendError {
    Io(std::io::Error),
    Mk(MkError),
}

impl From<MkError> for SendError {
    fn from(e: MkError) -> Self {
        SendError::Mk(e)
    }
}

/// A sender's copy-ahead over its queue (device windows): the device→host copies of the
/// next chunks, of the put being written and of the puts queued behind it, run while the
/// current chunk goes to the socket, so a put's staging latency is hidden behind the
/// previous put's write instead of adding to it.
#[derive(Default)]
struct CopyAhead {
    /// Staging buffers with copies issued, for the first unsent chunks of the queue in order.
    issued: VecDeque<usize>,
    /// Chunks of the queue's front put already written.
    front_sent: usize,
}

impl CopyAhead {
    /// Writes the front put of `jobs` (its frame, then its data chunk by chunk, the first
    /// chunk in the same write as the frame).
    fn send_front(
        &mut self,
        jobs: &VecDeque<SendJob>,
        stager: &mut DeviceStager,
        socket: &mut TcpStream,
        frame: &Frame,
        len: usize,
        stats: &mut ThreadStats,
    ) -> std::result::Result<(), SendError> {
        const _: () = assert!(FRAME_BYTES <= STAGING_HEADROOM);
        let header = frame.encode();
        if len == 0 {
            return ThreadStats::timed(&mut stats.socket, || socket.write_all(&header)).map_err(SendError::Io);
        }
        let chunk = stager.chunk_bytes();
        for k in 0..len.div_ceil(chunk) {
            ThreadStats::timed(&mut stats.cuda, || self.top_up(jobs, stager))?;
            let i = self.issued.pop_front().expect("the current chunk's copy is issued first");
            let bytes = chunk.min(len - k * chunk);
            let buffer = ThreadStats::timed(&mut stats.cuda, || stager.finish_copy_out(i))?;
            let from = if k == 0 {
                buffer[STAGING_HEADROOM - FRAME_BYTES..STAGING_HEADROOM].copy_from_slice(&header);
                STAGING_HEADROOM - FRAME_BYTES
            } else {
                STAGING_HEADROOM
            };
            ThreadStats::timed(&mut stats.socket, || socket.write_all(&buffer[from..STAGING_HEADROOM + bytes]))
                .map_err(SendError::Io)?;
            self.front_sent += 1;
        }
        Ok(())
    }

    /// Issues copies for the next unsent chunks until every staging buffer is in use (the
    /// buffer of the chunk just written is free again: the write copied it into the socket).
    fn top_up(&mut self, jobs: &VecDeque<SendJob>, stager: &mut DeviceStager) -> Result<()> {
        let lens = || jobs.iter().map(|j| if let SendJob::Put { len, .. } = j { *len } else { 0 });
        while self.issued.len() < stager.buffer_count() {
            let Some((t, offset, bytes)) = nth_chunk(lens(), self.front_sent, self.issued.len(), stager.chunk_bytes())
            else {
                break;
            };
            let SendJob::Put { src, .. } = jobs[t] else { unreachable!("only puts have chunks") };
            self.issued.push_back(stager.start_copy_out((src + offset) as u64, bytes)?);
        }
        Ok(())
    }
}

/// Reads exactly `buf`, waiting without limit for the first byte only when `idle_ok`
/// (between messages); returns false on a clean end of stream before any byte.
fn read_message_part(
    socket: &mut TcpStream,
    buf: &mut [u8],
    idle_ok: bool,
    shared: &Shared,
    peer: usize,
    timeout: Duration,
) -> Result<bool> {
    let mut got = 0;
    let mut last_progress = Instant::now();
    while got < buf.len() {
        match socket.read(&mut buf[got..]) {
            Ok(0) if got == 0 && idle_ok && shared.closing.load(Ordering::Acquire) => return Ok(false),
            Ok(0) => {
                return Err(lost_peer(peer, ErrorKind::UnexpectedEof.into(), timeout, "while sending to this rank"))
            }
            Ok(n) => {
                got += n;
                last_progress = Instant::now();
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if got == 0 && idle_ok {
                    continue; // idle between messages: fine for as long as it lasts
                }
                if last_progress.elapsed() >= timeout {
                    return Err(lost_peer(peer, e, timeout, "in the middle of a message to this rank"));
                }
            }
            // close() shut the socket after the peer failed to say Close in time.
            Err(_) if shared.closing.load(Ordering::Acquire) => return Ok(false),
            Err(e) => return Err(lost_peer(peer, e, timeout, "while sending to this rank")),
        }
    }
    Ok(true)
}

/// Checks a header from the wire before anything is written: true for a put inside this
/// rank's window, false for Close, `mkRemoteError` for anything else.
fn accept_frame(frame: &Frame, window: &Window, peer: usize) -> Result<bool> {
    match frame.kind {
        FRAME_CLOSE => return Ok(false),
        FRAME_PUT => {}
        k => return Err(MkError::remote(format!("rank {peer} sent an unknown transport message kind {k}"))),
    }
    let in_data = frame.dst_offset.checked_add(frame.bytes).is_some_and(|end| end <= window.data.bytes);
    let in_signals = frame.signal_id == u32::MAX || (frame.signal_id as u64) < window.signal_words();
    if !in_data || !in_signals {
        return Err(MkError::remote(format!(
            "rank {peer} sent a put outside this rank's window ({frame:?}; data {} bytes, {} signal words)",
            window.data.bytes,
            window.signal_words()
        )));
    }
    Ok(true)
}

fn receive_loop(link: &Link, mut socket: TcpStream, mut staging: Staging) -> Result<()> {
    let mut stats = ThreadStats::default();
    let result = receive_messages(link, &mut socket, &mut staging, &mut stats);
    stats.log(link.rank, &format!("receiver from rank {}", link.peer), &staging);
    result
}

fn receive_messages(link: &Link, socket: &mut TcpStream, staging: &mut Staging, stats: &mut ThreadStats) -> Result<()> {
    let Link { peer, window, timeout, ref shared, .. } = *link;
    socket.set_read_timeout(Some(IDLE_POLL))?;
    loop {
        let mut header = [0u8; FRAME_BYTES];
        if !ThreadStats::timed(&mut stats.idle, || read_message_part(socket, &mut header, true, shared, peer, timeout))?
        {
            return Ok(());
        }
        let frame = Frame::decode(&header);
        if !accept_frame(&frame, &window, peer)? {
            return Ok(()); // the peer closed cleanly
        }
        stats.messages += 1;
        stats.bytes += frame.bytes;
        let dst_addr = window.data.base + frame.dst_offset;
        let mut complete = true;
        if window.data.kind == MemoryKind::Device {
            let stager = staging.stager()?;
            let started = Instant::now();
            let mut reading = Duration::ZERO;
            // The copies to the device may still run when this returns; the signal below is
            // written by the same stream, after them.
            stager.receive_into_device(dst_addr, frame.bytes as usize, &mut |chunk| {
                let r =
                    ThreadStats::timed(&mut reading, || read_message_part(socket, chunk, false, shared, peer, timeout));
                match r? {
                    true => Ok(()),
                    false => Err(MkError::remote("the transport closed in the middle of a message")),
                }
            })?;
            stats.socket += reading;
            stats.cuda += started.elapsed().saturating_sub(reading);
        } else if frame.bytes > 0 {
            // SAFETY: the range was checked against the registered data region just above,
            // and `register`'s contract keeps it valid until close.
            let dst = unsafe { std::slice::from_raw_parts_mut(dst_addr as *mut u8, frame.bytes as usize) };
            complete =
                ThreadStats::timed(&mut stats.socket, || read_message_part(socket, dst, false, shared, peer, timeout))?;
        }
        if !complete {
            return Ok(()); // closing
        }
        if frame.signal_id != u32::MAX {
            let signal_addr = window.signals.base + 8 * frame.signal_id as u64;
            if window.signals.kind == MemoryKind::Device {
                // Stream-ordered after the data copies of this and every earlier message.
                let stager = staging.stager()?;
                ThreadStats::timed(&mut stats.cuda, || stager.store_u64(signal_addr, frame.signal_value))?;
            } else {
                if window.data.kind == MemoryKind::Device {
                    // The host store below is not ordered after the staging copies: wait
                    // for those of this message and earlier ones (none left: no call).
                    let stager = staging.stager()?;
                    ThreadStats::timed(&mut stats.cuda, || stager.finish_all())?;
                }
                // SAFETY: signal_id < signal words (checked above); the signal region is
                // 8-byte aligned (checked by register) and valid until close.
                let word = unsafe { &*(signal_addr as *const AtomicU64) };
                // Release: the data copied above is visible before the signal value.
                word.store(frame.signal_value, Ordering::Release);
            }
        }
    }
}

impl Transport for SocketTransport {
    fn name(&self) -> &'static str {
        "socket"
    }

    unsafe fn register(&mut self, window: Window) -> Result<()> {
        if self.window.is_some() {
            return Err(MkError::invalid_usage("the socket transport's window is already registered"));
        }
        for (name, region) in [("data", window.data), ("signal", window.signals)] {
            if region.kind == MemoryKind::Device && self.cuda_context.is_none() {
                return Err(missing_context().context(format!("registering the {name} region")));
            }
            if region.base == 0 && region.bytes > 0 {
                return Err(MkError::invalid_argument(format!("the {name} region is NULL")));
            }
        }
        if window.signals.base % 8 != 0 || window.signals.bytes % 8 != 0 {
            return Err(MkError::invalid_argument("signal words must be 8-byte aligned u64s"));
        }
        self.window = Some(window);
        Ok(())
    }

    fn connection_blob(&mut self, _peers: &[usize]) -> Result<Vec<u8>> {
        let window = self.window.ok_or_else(|| MkError::invalid_usage("register a window before connecting"))?;
        Ok(SocketBlob {
            listen: self.listener.local_addr()?,
            data_bytes: window.data.bytes,
            signal_words: window.signal_words(),
        }
        .encode())
    }

    fn connect(&mut self, blobs: &[Vec<u8>], peers: &[usize]) -> Result<()> {
        if self.window.is_none() {
            return Err(MkError::invalid_usage("register a window before connecting"));
        }
        check_peers(self.rank, self.nranks, blobs.len(), peers)?;
        let decoded: Vec<(usize, SocketBlob)> =
            peers.iter().map(|&p| SocketBlob::decode(&blobs[p], p).map(|b| (p, b))).collect::<Result<_>>()?;
        let deadline = Deadline::after(self.timeout, TRANSPORT_TIMEOUT_VAR);
        let (lower, higher): (Vec<_>, Vec<_>) = decoded.iter().partition(|(p, _)| *p < self.rank);
        let higher_ranks: Vec<usize> = higher.iter().map(|(p, _)| *p).collect();
        // Dial the lower ranks while accepting the higher ones: every pair has one dialer.
        let (dialed, accepted) = std::thread::scope(|s| {
            let dialer =
                std::thread::Builder::new().name(format!("mk-sock-dial-{}", self.rank)).spawn_scoped(s, || {
                    lower
                        .iter()
                        .map(|(p, b)| self.dial(*p, b.listen, &deadline).map(|sock| (*p, sock)))
                        .collect::<Result<Vec<_>>>()
                });
            let dialer = match dialer {
                Ok(d) => d,
                Err(e) => {
                    let e = MkError::system(format!("cannot start the transport dialer thread: {e}"));
                    return (Err(e), Ok(Vec::new()));
                }
            };
            let accepted = self.accept_peers(&higher_ranks, &deadline);
            let dialed =
                dialer.join().unwrap_or_else(|_| Err(MkError::internal("the transport dialer thread panicked")));
            (dialed, accepted)
        });
        let mut sockets = dialed?;
        sockets.extend(accepted?);
        for (p, sock) in sockets {
            let blob = decoded.iter().find(|(r, _)| *r == p).expect("a listed peer").1;
            self.start_peer(p, sock, &blob)?;
        }
        Ok(())
    }

    fn post_put(&mut self, put: &PutRequest) -> Result<PostId> {
        if let Some(e) = self.shared.error() {
            return Err(e);
        }
        if self.closed {
            return Err(MkError::invalid_usage("the socket transport is closed"));
        }
        let window = self.window.ok_or_else(|| MkError::invalid_usage("register a window before posting"))?;
        let Some(link) = self.peers.get(put.peer).and_then(|l| l.as_ref()) else {
            return Err(MkError::invalid_argument(format!("rank {} is not connected to rank {}", self.rank, put.peer)));
        };
        check_put_ranges(put, &window, link.data_bytes, link.signal_words)?;
        let id = self.next_post;
        let (signal_id, signal_value) = put.signal.unwrap_or((u32::MAX, 0));
        let frame = Frame { kind: FRAME_PUT, signal_id, bytes: put.bytes, dst_offset: put.dst_offset, signal_value };
        let job =
            SendJob::Put { id, frame, src: (window.data.base + put.src_offset) as usize, len: put.bytes as usize };
        let sent = link.jobs.as_ref().is_some_and(|jobs| jobs.send(job).is_ok());
        if !sent {
            return Err(self
                .shared
                .error()
                .unwrap_or_else(|| MkError::remote(format!("the connection to rank {} is gone", put.peer))));
        }
        self.next_post += 1;
        Ok(id)
    }

    fn poll(&mut self, completed: &mut Vec<PostId>) -> Result<()> {
        completed.append(&mut self.shared.completed.lock());
        match self.shared.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn abort(&mut self) {
        self.cut();
    }

    fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        self.shared.closing.store(true, Ordering::Release);
        // Queue a Close behind every pending put; senders exit when their queue ends.
        for link in self.peers.iter_mut().flatten() {
            if let Some(jobs) = link.jobs.take() {
                let _ = jobs.send(SendJob::Close);
            }
        }
        for link in self.peers.iter_mut().flatten() {
            if let Some(t) = link.sender.take() {
                let _ = t.join(); // bounded: every write has the send timeout
            }
        }
        // Give each peer until the deadline to send its own Close, then cut the connection.
        let deadline = Instant::now() + self.timeout;
        for link in self.peers.iter_mut().flatten() {
            if let Some(t) = link.receiver.take() {
                while !t.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(2));
                }
                let _ = link.socket.shutdown(Shutdown::Both);
                let _ = t.join();
            }
        }
        match self.shared.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl SocketTransport {
    /// Cuts every connection at once: nothing waits for the peers or for queued puts.
    fn cut(&mut self) {
        self.closed = true;
        self.shared.closing.store(true, Ordering::Release);
        for link in self.peers.iter_mut().flatten() {
            link.jobs.take();
            let _ = link.socket.shutdown(Shutdown::Both);
        }
        for link in self.peers.iter_mut().flatten() {
            for t in [link.sender.take(), link.receiver.take()].into_iter().flatten() {
                let _ = t.join(); // prompt: their socket is shut
            }
        }
    }
}

impl Drop for SocketTransport {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::mkResult_t;

    #[test]
    fn frames_round_trip() {
        let f = Frame { kind: FRAME_PUT, signal_id: 9, bytes: 1 << 40, dst_offset: 77, signal_value: u64::MAX - 1 };
        assert_eq!(Frame::decode(&f.encode()), f);
        assert_eq!(Frame::decode(&Frame::close().encode()).kind, FRAME_CLOSE);
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config {
            cases: 4000,
            failure_persistence: None,
            ..Default::default()
        })]

        /// Any 32 header bytes: a put is accepted only inside the window; nothing panics.
        #[test]
        fn any_header_is_a_put_inside_the_window_close_or_an_error(
            header in proptest::array::uniform32(proptest::prelude::any::<u8>()),
            small_kind in proptest::prelude::any::<bool>(),
            data_bytes in 0u64..1 << 20,
            signal_words in 0u64..64,
        ) {
            let mut header = header;
            if small_kind {
                header[0] %= 4;
                header[1..4].fill(0);
            }
            let region = |bytes| crate::transport::MemoryRegion { base: 0x1000, bytes, kind: MemoryKind::Host };
            let window = Window { data: region(data_bytes), signals: region(8 * signal_words) };
            let frame = Frame::decode(&header);
            proptest::prop_assert_eq!(Frame::decode(&frame.encode()), frame);
            match accept_frame(&frame, &window, 1) {
                Ok(true) => {
                    proptest::prop_assert_eq!(frame.kind, FRAME_PUT);
                    let end = u128::from(frame.dst_offset) + u128::from(frame.bytes);
                    proptest::prop_assert!(end <= u128::from(data_bytes));
                    proptest::prop_assert!(frame.signal_id == u32::MAX || u64::from(frame.signal_id) < signal_words);
                }
                Ok(false) => proptest::prop_assert_eq!(frame.kind, FRAME_CLOSE),
                Err(e) => proptest::prop_assert_eq!(e.code, mkResult_t::mkRemoteError),
            }
        }
    }

    #[test]
    fn blobs_round_trip_and_reject_foreign_data() {
        let b = SocketBlob { listen: "127.0.0.1:4242".parse().unwrap(), data_bytes: 1 << 33, signal_words: 64 };
        assert_eq!(SocketBlob::decode(&b.encode(), 3).unwrap(), b);
        let v6 = SocketBlob { listen: "[::1]:9".parse().unwrap(), ..b };
        assert_eq!(SocketBlob::decode(&v6.encode(), 3).unwrap(), v6);
        let mut wrong = b.encode();
        wrong[0] = b'X';
        assert_eq!(SocketBlob::decode(&wrong, 3).unwrap_err().code, mkResult_t::mkRemoteError);
        assert_eq!(SocketBlob::decode(&[], 3).unwrap_err().code, mkResult_t::mkRemoteError);
    }
}
