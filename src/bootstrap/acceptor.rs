//! Accepts authenticated connections on a listener, many handshakes at once, on the calling
//! thread: a `poll(2)` loop over the listener and every connection still in its handshake.
//!
//! Bounds, so that silent, slow or junk connections cannot stall the real peers or use up
//! the process: at most `max_in_flight` handshakes at a time; each must finish within
//! `handshake_limit` of its accept (mkernel's `HANDSHAKE_LIMIT`); and every byte read before
//! authentication goes into a fixed-size buffer (the first frame after it is bounded by
//! `first_frame_max`). No thread is started per connection.
//!
//! Fair admission: while every slot is taken, the listener is not polled, so newcomers wait
//! in the kernel's accept queue, first come first served (its length is `LISTEN_BACKLOG`).
//! Once the oldest connection that has not proved the key has held its slot for
//! `proof_grace` (a proof is one round trip), the next connection in the queue takes that
//! slot and the holder is closed. A stranger who reconnects at once after every close
//! therefore lines up behind the dialers already waiting, instead of winning every freed
//! slot: an honest dialer waits about `proof_grace` for every `max_in_flight` connections
//! ahead of it, however fast the others reconnect. Connections that proved the key are never
//! closed to make room.

use super::frames::{FrameCounter, FrameKeys, SecureStream, LENGTH_BYTES};
use super::handshake::{AcceptorSide, Purpose, PROOF_BYTES};
use super::net::{poll_fds, Deadline};
use crate::bootstrap::crypto::TAG_BYTES;
use crate::error::{MkError, Result};
use crate::{mk_info, mk_warn};
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
    /// How long a connection keeps its slot without sending its proof while others wait
    /// (mkernel's `PROOF_GRACE`).
    pub proof_grace: Duration,
    /// The largest frame a dialer sends right after the handshake; None when it sends none.
    pub first_frame_max: Option<usize>,
    /// The rank that logs refusals (None for the root).
    pub log_rank: Option<usize>,
}

/// A connection that completed the handshake (and its first frame, when configured).
pub struct Accepted {
    pub stream: SecureStream,
    pub dialer: u32,
    /// The first frame's payload; an error when the dialer, which proved the key, sent a
    /// frame that is too long or fails its check. The stream is still good for a reply.
    pub first_frame: Option<Result<Vec<u8>>>,
}

enum Stage {
    Proof,
    FirstFrame { dialer: u32, keys: FrameKeys },
}

struct Pending<'k> {
    socket: TcpStream,
    peer: SocketAddr,
    accepted_at: Instant,
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

/// Whether the listener's next connection can have a slot now.
enum Admission {
    /// A slot is free.
    Free,
    /// Every slot is taken; the connection at this index has held its slot without a proof
    /// for `proof_grace` and makes way for the next one.
    Evict(usize),
    /// Every slot is taken and none can be freed before this time (None: not until a
    /// handshake ends).
    Wait(Option<Instant>),
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
            let admission = self.admission(now);
            let mut wait =
                self.pending.iter().map(|p| p.deadline.saturating_duration_since(now)).fold(left, Duration::min);
            if let Admission::Wait(Some(at)) = admission {
                wait = wait.min(at.saturating_duration_since(now));
            }
            // The listener is polled only when its next connection could have a slot: the
            // rest stay in the kernel's accept queue, in the order they came.
            let listening = !matches!(admission, Admission::Wait(_));
            let mut fds: Vec<libc::pollfd> = self
                .pending
                .iter()
                .map(|p| p.socket.as_raw_fd())
                .chain(listening.then(|| self.listener.as_raw_fd()))
                .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
                .collect();
            if poll_fds(&mut fds, wait)? == 0 {
                continue;
            }
            // Handshakes first, so a proof that arrived with a crowd of newcomers counts
            // before anyone is closed to make room.
            for i in (0..self.pending.len()).rev() {
                if fds[i].revents == 0 {
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
            if listening && fds.last().is_some_and(|fd| fd.revents != 0) {
                self.accept_waiting()?;
            }
        }
    }

    fn admission(&self, now: Instant) -> Admission {
        if self.pending.len() < self.config.max_in_flight {
            return Admission::Free;
        }
        let oldest_unproven = self
            .pending
            .iter()
            .enumerate()
            .filter(|(_, p)| matches!(p.stage, Stage::Proof))
            .min_by_key(|(_, p)| p.accepted_at);
        match oldest_unproven {
            Some((i, p)) if now >= p.accepted_at + self.config.proof_grace => Admission::Evict(i),
            Some((_, p)) => Admission::Wait(Some(p.accepted_at + self.config.proof_grace)),
            None => Admission::Wait(None),
        }
    }

    /// Takes connections from the listener's queue, oldest first, while they can have a slot.
    fn accept_waiting(&mut self) -> Result<()> {
        loop {
            let admission = self.admission(Instant::now());
            if matches!(admission, Admission::Wait(_)) {
                return Ok(());
            }
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
            if let Admission::Evict(i) = admission {
                let p = self.pending.remove(i);
                mk_info!(
                    self.config.log_rank,
                    "closed {} connection from {}: no proof within PROOF_GRACE={} ms while others waited",
                    self.config.purpose.describe(),
                    p.peer,
                    self.config.proof_grace.as_millis()
                );
            }
            self.start_handshake(socket, peer)?;
        }
    }

    fn start_handshake(&mut self, socket: TcpStream, peer: SocketAddr) -> Result<()> {
        if socket.set_nonblocking(true).is_err() {
            return Ok(());
        }
        let _ = socket.set_nodelay(true);
        let side = AcceptorSide::new(self.config.key, self.config.session, self.config.purpose, self.config.me)?;
        let challenge = side.challenge();
        // A new socket's send buffer is empty: the challenge fits whole or the peer is gone.
        if !matches!((&socket).write(&challenge), Ok(n) if n == challenge.len()) {
            return Ok(());
        }
        let accepted_at = Instant::now();
        self.pending.push(Pending {
            socket,
            peer,
            accepted_at,
            deadline: accepted_at + self.config.handshake_limit,
            side,
            stage: Stage::Proof,
            buf: Vec::with_capacity(PROOF_BYTES),
        });
        Ok(())
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
    let max = config.first_frame_max.unwrap_or(0);
    loop {
        let need = match p.stage {
            Stage::Proof => PROOF_BYTES,
            Stage::FirstFrame { .. } if p.buf.len() < LENGTH_BYTES => LENGTH_BYTES,
            Stage::FirstFrame { dialer, keys } => {
                let n = u64::from_le_bytes(p.buf[..LENGTH_BYTES].try_into().expect("8 bytes"));
                if n > max as u64 {
                    // Judged on the length alone: the rest need not arrive.
                    let e = MkError::remote(format!("a first frame of {n} bytes, over the limit of {max}"));
                    return finish(p, dialer, keys, Some(Err(e)));
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
                    Err(refusal) => return Progress::Dropped(refusal.to_string()),
                    Ok(_) if !sent => return Progress::Dropped("it went away before the verdict".into()),
                    Ok((dialer, keys)) if config.first_frame_max.is_some() => {
                        p.buf.clear();
                        p.stage = Stage::FirstFrame { dialer, keys };
                    }
                    Ok((dialer, keys)) => return finish(p, dialer, keys, None),
                }
            }
            // The length is in: judge it before waiting for the rest.
            Stage::FirstFrame { .. } if need == LENGTH_BYTES => {}
            Stage::FirstFrame { dialer, keys } => {
                let frame = FrameCounter::new(keys.recv).open(&mut &p.buf[..], max, deadline, &what);
                return finish(p, dialer, keys, Some(frame));
            }
        }
    }
}

fn finish(p: &mut Pending<'_>, dialer: u32, keys: FrameKeys, first_frame: Option<Result<Vec<u8>>>) -> Progress {
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
