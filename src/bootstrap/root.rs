//! The rendezvous root: one thread per unique id. It admits connections that prove the
//! secret, collects every rank's listening address and host, and answers each rank with
//! the full table, or with one error (duplicate rank, mismatched nranks, ranks missing).

use super::net::{self, Deadline};
use super::unique_id::UniqueId;
use super::wire::{Hello, RootReply};
use crate::error::{MkError, Result};
use crate::{mk_info, mk_warn};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// How long the root waits for the first rank before giving up (a unique id nobody uses).
const ROOT_IDLE_LIMIT: Duration = Duration::from_secs(24 * 3600);
/// Bound on one connection's handshake, so a silent intruder cannot stall the root.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(5);

/// Binds the root's socket and starts its thread; returns the id to hand to every rank.
pub fn start_root() -> Result<UniqueId> {
    let listener = net::bind_listener(net::local_address()?)?;
    let id = UniqueId::new(listener.local_addr()?)?;
    let thread_id = id;
    std::thread::Builder::new()
        .name("mk-bootstrap-root".into())
        .spawn(move || {
            if let Err(e) = serve(listener, &thread_id) {
                mk_warn!(None, "bootstrap root on {} ended: {e}", thread_id.root);
            }
        })
        .map_err(|e| MkError::system(format!("cannot start the bootstrap root thread: {e}")))?;
    mk_info!(None, "bootstrap root listening on {}", id.root);
    Ok(id)
}

fn reply_all(joined: &mut [Option<(TcpStream, Hello)>], reply: &RootReply, deadline: &Deadline) {
    let bytes = reply.encode();
    for (s, h) in joined.iter_mut().flatten() {
        if let Err(e) = net::send_frame(s, &bytes, deadline, &"bootstrap root reply") {
            mk_warn!(Some(h.rank as usize), "bootstrap root could not answer this rank: {e}");
        }
    }
}

fn serve(listener: TcpListener, id: &UniqueId) -> Result<()> {
    let mut joined: Vec<Option<(TcpStream, Hello)>> = Vec::new();
    let mut nranks: Option<u32> = None;
    let mut deadline = Deadline::after(ROOT_IDLE_LIMIT);
    loop {
        let missing = || -> String {
            let m: Vec<String> = joined.iter().enumerate().filter(|(_, j)| j.is_none()).map(|(r, _)| r.to_string()).collect();
            m.join(", ")
        };
        let what = format!("bootstrap rendezvous (missing ranks: {})", missing());
        let (mut stream, peer) = match net::accept_before(&listener, &deadline, &what) {
            Ok(x) => x,
            Err(e) => {
                let reply = RootReply::Error(e.clone());
                reply_all(&mut joined, &reply, &Deadline::after(HANDSHAKE_LIMIT));
                return Err(e);
            }
        };
        let hs = Deadline::after(HANDSHAKE_LIMIT);
        if let Err(e) = net::challenge(&mut stream, &id.secret, id.session, &hs) {
            mk_warn!(None, "refused bootstrap connection from {peer}: {}", e.message);
            continue;
        }
        let hello = match net::recv_frame(&mut stream, &hs, &"bootstrap hello").and_then(|b| Hello::decode(&b)) {
            Ok(h) => h,
            Err(e) => {
                mk_warn!(None, "dropped bootstrap connection from {peer}: {}", e.message);
                continue;
            }
        };
        let n = *nranks.get_or_insert(hello.nranks);
        if joined.is_empty() {
            joined.resize_with(n as usize, || None);
            // The clock for the whole rendezvous starts when the first rank arrives.
            deadline = Deadline::after(crate::env::bootstrap_timeout());
        }
        let error = if hello.nranks != n {
            Some(MkError::invalid_usage(format!(
                "mismatched nranks: rank {} called init with nranks={} but an earlier rank used nranks={n}",
                hello.rank, hello.nranks
            )))
        } else if hello.rank >= n {
            Some(MkError::invalid_usage(format!("rank {} is out of range for nranks={n}", hello.rank)))
        } else if joined[hello.rank as usize].is_some() {
            Some(MkError::invalid_usage(format!("duplicate rank: two processes joined as rank {}", hello.rank)))
        } else {
            None
        };
        if let Some(e) = error {
            let mut offender = Some((stream, hello));
            let reply = RootReply::Error(e.clone());
            reply_all(std::slice::from_mut(&mut offender), &reply, &hs);
            reply_all(&mut joined, &reply, &Deadline::after(HANDSHAKE_LIMIT));
            return Err(e);
        }
        mk_info!(Some(hello.rank as usize), "joined the bootstrap from {peer}");
        let rank = hello.rank as usize;
        joined[rank] = Some((stream, hello));
        if joined.iter().all(Option::is_some) {
            let table: Vec<Hello> = joined.iter().flatten().map(|(_, h)| h.clone()).collect();
            reply_all(&mut joined, &RootReply::Table(table), &Deadline::after(HANDSHAKE_LIMIT));
            return Ok(());
        }
    }
}
