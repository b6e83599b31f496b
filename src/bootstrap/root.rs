//! The rendezvous root: one thread per unique id. It admits connections that prove the
//! secret, collects every rank's listening address and host, and answers each rank with
//! the full table, or with one error (duplicate rank, mismatched nranks, ranks missing).
//!
//! Each accepted connection is checked on a thread of its own, so a silent or slow
//! intruder cannot hold up the real ranks.

use super::net::{self, Deadline};
use super::unique_id::UniqueId;
use super::wire::{Hello, RootReply};
use crate::error::{MkError, Result};
use crate::{mk_info, mk_warn};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

/// How long the root waits for the first rank before giving up (a unique id nobody uses).
const ROOT_IDLE_LIMIT: Duration = Duration::from_secs(24 * 3600);
/// Bound on one connection's handshake.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(5);

/// Binds the root's socket and starts its thread; returns the id to hand to every rank.
pub fn start_root() -> Result<UniqueId> {
    let listener = net::bind_listener(net::local_address()?)?;
    let id = UniqueId::new(listener.local_addr()?)?;
    std::thread::Builder::new()
        .name("mk-bootstrap-root".into())
        .spawn(move || {
            if let Err(e) = serve(listener, id) {
                mk_warn!(None, "bootstrap root on {} ended: {e}", id.root);
            }
        })
        .map_err(|e| MkError::system(format!("cannot start the bootstrap root thread: {e}")))?;
    mk_info!(None, "bootstrap root listening on {}", id.root);
    Ok(id)
}

fn reply_all(joined: &mut [Option<(TcpStream, Hello)>], reply: &RootReply) {
    let bytes = reply.encode();
    let deadline = Deadline::after(HANDSHAKE_LIMIT);
    for (s, h) in joined.iter_mut().flatten() {
        if let Err(e) = net::send_frame(s, &bytes, &deadline, &"bootstrap root reply") {
            mk_warn!(Some(h.rank as usize), "bootstrap root could not answer this rank: {e}");
        }
    }
}

/// Accepts connections until `done`, handing each to a handshake thread that forwards
/// authenticated hellos to the root's loop.
fn accept_loop(listener: TcpListener, id: UniqueId, done: Arc<AtomicBool>, hellos: mpsc::Sender<(TcpStream, Hello)>) {
    let forever = Deadline::after(ROOT_IDLE_LIMIT);
    while !done.load(Ordering::Acquire) {
        let (mut stream, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if forever.remaining(&"bootstrap root").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => {
                mk_warn!(None, "bootstrap root accept failed: {e}");
                continue;
            }
        };
        let hellos = hellos.clone();
        std::thread::spawn(move || {
            let hs = Deadline::after(HANDSHAKE_LIMIT);
            let checked = stream
                .set_nonblocking(false)
                .map_err(MkError::from)
                .and_then(|_| net::challenge(&mut stream, &id.secret, id.session, &hs))
                .and_then(|_| net::recv_frame(&mut stream, &hs, &"bootstrap hello"))
                .and_then(|b| Hello::decode(&b));
            match checked {
                Ok(hello) => {
                    let _ = hellos.send((stream, hello));
                }
                Err(e) => mk_warn!(None, "refused bootstrap connection from {peer}: {}", e.message),
            }
        });
    }
}

fn serve(listener: TcpListener, id: UniqueId) -> Result<()> {
    let done = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel();
    {
        let done = done.clone();
        std::thread::spawn(move || accept_loop(listener, id, done, tx));
    }
    let result = rendezvous(&rx);
    done.store(true, Ordering::Release);
    result
}

fn rendezvous(rx: &mpsc::Receiver<(TcpStream, Hello)>) -> Result<()> {
    let mut joined: Vec<Option<(TcpStream, Hello)>> = Vec::new();
    let mut deadline = Deadline::after(ROOT_IDLE_LIMIT);
    let mut nranks = 0u32;
    loop {
        let left = deadline.remaining(&"bootstrap rendezvous");
        let next = left.and_then(|d| {
            rx.recv_timeout(d).map_err(|_| {
                let missing: Vec<String> =
                    joined.iter().enumerate().filter(|(_, j)| j.is_none()).map(|(r, _)| r.to_string()).collect();
                MkError::timeout(format!(
                    "ranks [{}] of {nranks} never joined the bootstrap within MK_BOOTSTRAP_TIMEOUT_MS={} ms",
                    missing.join(", "),
                    deadline.total().as_millis()
                ))
            })
        });
        let (stream, hello) = match next {
            Ok(x) => x,
            Err(e) => {
                reply_all(&mut joined, &RootReply::Error(e.clone()));
                return Err(e);
            }
        };
        if joined.is_empty() {
            nranks = hello.nranks;
            joined.resize_with(nranks as usize, || None);
            // The clock for the whole rendezvous starts when the first rank arrives.
            deadline = Deadline::after(Duration::from_millis(hello.timeout_ms as u64));
        }
        let error = if hello.nranks != nranks {
            Some(MkError::invalid_usage(format!(
                "mismatched nranks: rank {} called init with nranks={} but another rank used nranks={nranks}",
                hello.rank, hello.nranks
            )))
        } else if hello.rank >= nranks {
            Some(MkError::invalid_usage(format!("rank {} is out of range for nranks={nranks}", hello.rank)))
        } else if joined[hello.rank as usize].is_some() {
            Some(MkError::invalid_usage(format!("duplicate rank: two processes joined as rank {}", hello.rank)))
        } else {
            None
        };
        if let Some(e) = error {
            let reply = RootReply::Error(e.clone());
            reply_all(&mut [Some((stream, hello))], &reply);
            reply_all(&mut joined, &reply);
            return Err(e);
        }
        mk_info!(Some(hello.rank as usize), "joined the bootstrap");
        let rank = hello.rank as usize;
        joined[rank] = Some((stream, hello));
        if joined.iter().all(Option::is_some) {
            let table: Vec<Hello> = joined.iter().flatten().map(|(_, h)| h.clone()).collect();
            reply_all(&mut joined, &RootReply::Table(table));
            return Ok(());
        }
    }
}
