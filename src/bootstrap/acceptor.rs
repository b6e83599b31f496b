//! Accepts authenticated connections on a listener, many handshakes at once, on the calling
//! thread: a `poll(2)` loop over the listener and every connection still in its handshake.
//!
//! Bounds, so that silent, slow or junk connections cannot stall the real peers or use up
//! the process: at most `max_in_flight` handshakes at a time (a connection beyond that gets
//! a "busy" challenge and is closed, and an honest dialer retries); each handshake must
//! finish within `handshake_limit` of its accept (mkernel's `HANDSHAKE_LIMIT`); and every
//! byte read before authentication goes into a fixed-size buffer (the first frame after it
//! is bounded by `first_frame_max`). No thread is started per connection.

use super::frames::{FrameCounter, FrameKeys, SecureStream, LENGTH_BYTES};
use super::handshake::{AcceptorSide, Challenge, ChallengeStatus, Purpose, PROOF_BYTES};
use super::net::{poll_fds, Deadline};
use crate::bootstrap::crypto::TAG_BYTES;
use crate::error::Result;
use crate::mk_warn;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// What an acceptor checks and how much it lets in.
#[derive(Clone, Copy)]
pub struct AcceptorConfig<'k> {
    pub key: &'k [u8],
    pub session: u64,
    pub purpose: Purpose,
    /// This endpoint's id, which dialers must name as their target.
    pub me: u32,
    pub max_in_flight: usize,
    pub handshake_limit: Duration,
    /// The largest frame a dialer sends right after the handshake; None when it sends none.
    pub first_frame_max: Option<usize>,
    /// The rank that logs refusals (None for the root).
    pub log_rank: Option<usize>,
}

/// A connection that completed the handshake (and its first frame, when configured).
pub struct Accepted {
    pub stream: SecureStream,
    pub dialer: u32,
    pub first_frame: Option<Vec<u8>>,
}

enum Stage {
    Proof,
    FirstFrame { dialer: u32, keys: FrameKeys },
}

struct Pending<'k> {
    socket: TcpStream,
    peer: SocketAddr,
    deadline: Instant,
    side: AcceptorSide<'k>,
    stage: Stage,
    buf: Vec<u8>,
}

enum Progress {
    More,
    Done(Accepted),
    Dropped(String),
}

pub struct Acceptor<'l, 'k> {
    listener: &'l TcpListener,
    config: AcceptorConfig<'k>,
    pending: Vec<Pending<'k>>,
    /// The last failure of accept(2) itself, for the timeout message.
    accept_trouble: Option<String>,
}

impl<'l, 'k> Acceptor<'l, 'k> {
    /// `listener` must be non-blocking (as `net::bind_listener` makes it).
    pub fn new(listener: &'l TcpListener, config: AcceptorConfig<'k>) -> Self {
        Acceptor { listener, config, pending: Vec::new(), accept_trouble: None }
    }

    /// Connections in their handshake now.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Waits for the next connection that proves the key as a dialer `wanted` accepts.
    /// `mkTimeout` at `deadline`, naming `what` and the deadline's variable.
    pub fn next(&mut self, deadline: &Deadline, wanted: &dyn Fn(u32) -> bool, what: &str) -> Result<Accepted> {
        loop {
            let now = Instant::now();
            let limit = self.config.handshake_limit;
            self.pending.retain(|p| {
                let alive = p.deadline > now;
                if !alive {
                    refused(
                        &self.config,
                        p.peer,
                        &format!("no handshake within HANDSHAKE_LIMIT={} ms", limit.as_millis()),
                    );
                }
                alive
            });
            let left = match deadline.remaining(&what) {
                Ok(left) => left,
                Err(mut e) => {
                    if let Some(t) = &self.accept_trouble {
                        e.message.push_str(&format!(" (accepting connections failed: {t})"));
                    }
                    return Err(e);
                }
            };
            let wait = self.pending.iter().map(|p| p.deadline.saturating_duration_since(now)).fold(left, Duration::min);
            let mut fds: Vec<libc::pollfd> = std::iter::once(self.listener.as_raw_fd())
                .chain(self.pending.iter().map(|p| p.socket.as_raw_fd()))
                .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
                .collect();
            if poll_fds(&mut fds, wait)? == 0 {
                continue;
            }
            for i in (0..self.pending.len()).rev() {
                if fds[i + 1].revents == 0 {
                    continue;
                }
                match advance(&mut self.pending[i], &self.config, wanted, deadline, what) {
                    Progress::More => {}
                    Progress::Done(accepted) => {
                        self.pending.remove(i);
                        return Ok(accepted);
                    }
                    Progress::Dropped(why) => {
                        let p = self.pending.remove(i);
                        refused(&self.config, p.peer, &why);
                    }
                }
            }
            if fds[0].revents != 0 {
                self.accept_new()?;
            }
        }
    }

    /// Takes every connection waiting on the listener: a handshake slot for each while
    /// there are free ones, a "busy" challenge for the rest.
    fn accept_new(&mut self) -> Result<()> {
        loop {
            let (socket, peer) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::ConnectionAborted) => continue,
                Err(e) => {
                    // Out of descriptors or memory: let the in-flight handshakes end, then retry.
                    mk_warn!(self.config.log_rank, "{} listener: accept failed: {e}", self.config.purpose.describe());
                    self.accept_trouble = Some(e.to_string());
                    std::thread::sleep(Duration::from_millis(10));
                    return Ok(());
                }
            };
            if socket.set_nonblocking(true).is_err() {
                continue;
            }
            let _ = socket.set_nodelay(true);
            if self.pending.len() >= self.config.max_in_flight {
                let busy = Challenge { status: ChallengeStatus::Busy, purpose: self.config.purpose, nonce: [0; 16] };
                let _ = (&socket).write(&busy.encode());
                continue;
            }
            let side = AcceptorSide::new(self.config.key, self.config.session, self.config.purpose, self.config.me)?;
            let challenge = side.challenge();
            // A new socket's send buffer is empty: the challenge fits whole or the peer is gone.
            if !matches!((&socket).write(&challenge), Ok(n) if n == challenge.len()) {
                continue;
            }
            let deadline = Instant::now() + self.config.handshake_limit;
            self.pending.push(Pending {
                socket,
                peer,
                deadline,
                side,
                stage: Stage::Proof,
                buf: Vec::with_capacity(PROOF_BYTES),
            });
        }
    }
}

fn refused(config: &AcceptorConfig<'_>, peer: SocketAddr, why: &str) {
    mk_warn!(config.log_rank, "refused {} connection from {peer}: {why}", config.purpose.describe());
}

/// Reads what `buf` still lacks of `need` bytes; false at end of stream.
fn fill(socket: &mut TcpStream, buf: &mut Vec<u8>, need: usize) -> std::io::Result<bool> {
    let mut chunk = [0u8; 512];
    while buf.len() < need {
        let want = (need - buf.len()).min(chunk.len());
        match socket.read(&mut chunk[..want]) {
            Ok(0) => return Ok(false),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(true),
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

fn advance(
    p: &mut Pending<'_>,
    config: &AcceptorConfig<'_>,
    wanted: &dyn Fn(u32) -> bool,
    deadline: &Deadline,
    what: &str,
) -> Progress {
    let need = match p.stage {
        Stage::Proof => PROOF_BYTES,
        Stage::FirstFrame { .. } if p.buf.len() < LENGTH_BYTES => LENGTH_BYTES,
        Stage::FirstFrame { .. } => {
            let n = u64::from_le_bytes(p.buf[..LENGTH_BYTES].try_into().expect("8 bytes"));
            let max = config.first_frame_max.unwrap_or(0);
            if n > max as u64 {
                return Progress::Dropped(format!("its first frame has {n} bytes (limit {max})"));
            }
            LENGTH_BYTES + n as usize + TAG_BYTES
        }
    };
    match fill(&mut p.socket, &mut p.buf, need) {
        Ok(true) => {}
        Ok(false) => return Progress::Dropped("it closed the connection during the handshake".into()),
        Err(e) => return Progress::Dropped(format!("handshake read failed: {e}")),
    }
    if p.buf.len() < need {
        return Progress::More;
    }
    match p.stage {
        Stage::Proof => {
            let (verdict, outcome) = p.side.check(&p.buf, wanted);
            // The socket's send buffer holds only the 22-byte challenge: the verdict fits.
            let sent = matches!((&p.socket).write(&verdict), Ok(n) if n == verdict.len());
            match outcome {
                Err(refusal) => Progress::Dropped(refusal.to_string()),
                Ok(_) if !sent => Progress::Dropped("it went away before the verdict".into()),
                Ok((dialer, keys)) => {
                    p.buf.clear();
                    if config.first_frame_max.is_some() {
                        p.stage = Stage::FirstFrame { dialer, keys };
                        // The frame may already be here; poll would report it again anyway.
                        return Progress::More;
                    }
                    finish(p, dialer, keys, None)
                }
            }
        }
        Stage::FirstFrame { dialer, keys } => {
            if p.buf.len() == LENGTH_BYTES {
                return Progress::More; // the length is in; read the rest next time
            }
            let max = config.first_frame_max.unwrap_or(0);
            match FrameCounter::new(keys.recv).open(&mut &p.buf[..], max, deadline, &what) {
                Ok(frame) => finish(p, dialer, keys, Some(frame)),
                Err(e) => Progress::Dropped(e.message),
            }
        }
    }
}

fn finish(p: &mut Pending<'_>, dialer: u32, keys: FrameKeys, first_frame: Option<Vec<u8>>) -> Progress {
    let socket = match p.socket.try_clone().and_then(|s| s.set_nonblocking(false).map(|_| s)) {
        Ok(s) => s,
        Err(e) => return Progress::Dropped(format!("cannot use the connection: {e}")),
    };
    let frames = u64::from(first_frame.is_some());
    Progress::Done(Accepted {
        stream: SecureStream::new(socket, p.peer, keys).with_received(frames),
        dialer,
        first_frame,
    })
}
