//! The rendezvous root: one thread per unique id. It admits connections that prove the
//! secret (see `handshake`), collects every rank's hello (listening address and host), and
//! answers each rank with the full table, or with one error (duplicate rank, mismatched or
//! out-of-range nranks, ranks missing).
//!
//! Handshakes run concurrently inside the root's one thread (`Acceptor`), so silent or slow
//! connections neither hold up real ranks nor start threads. The thread always ends: when
//! the rendezvous is answered, when the first rank's `MK_BOOTSTRAP_TIMEOUT_MS` runs out, or
//! when no rank proves the secret within `ROOT_IDLE_LIMIT` of `mkGetUniqueId` (an id nobody
//! uses). It blocks in `poll(2)` between events.

use super::acceptor::{Accepted, Acceptor, AcceptorConfig};
use super::frames::SecureStream;
use super::handshake::{Purpose, HANDSHAKE_LIMIT, ROOT_ID};
use super::net::{self, Deadline, BOOTSTRAP_TIMEOUT_VAR};
use super::unique_id::UniqueId;
use super::wire::{Hello, RootReply, HELLO_BYTES};
use super::MAX_RANKS;
use crate::error::{mkResult_t, MkError, Result};
use crate::{mk_info, mk_warn};
use std::net::TcpListener;
use std::thread::JoinHandle;
use std::time::Duration;

/// How long a root waits for its first rank before it stops listening.
pub const ROOT_IDLE_LIMIT: Duration = Duration::from_secs(3600);
/// Handshakes the root runs at once; connections beyond it are told to retry.
pub const ROOT_MAX_IN_FLIGHT: usize = 64;

/// A root's bounds; `RootLimits::default()` is what `mkGetUniqueId` uses.
#[derive(Clone, Copy, Debug)]
pub struct RootLimits {
    /// Until the first rank proves the secret (`ROOT_IDLE_LIMIT`).
    pub idle: Duration,
    /// Handshakes in flight (`ROOT_MAX_IN_FLIGHT`).
    pub max_in_flight: usize,
    /// One handshake, from accept to the hello (`HANDSHAKE_LIMIT`).
    pub handshake_limit: Duration,
}

impl Default for RootLimits {
    fn default() -> Self {
        RootLimits { idle: ROOT_IDLE_LIMIT, max_in_flight: ROOT_MAX_IN_FLIGHT, handshake_limit: HANDSHAKE_LIMIT }
    }
}

/// Binds the root's socket and starts its thread; returns the id to hand to every rank.
pub fn start_root() -> Result<UniqueId> {
    start_root_with(RootLimits::default()).map(|(id, _)| id)
}

/// `start_root` with explicit bounds; also returns the root's thread, which ends on its own.
pub fn start_root_with(limits: RootLimits) -> Result<(UniqueId, JoinHandle<()>)> {
    let listener = net::bind_listener(net::local_address()?)?;
    let id = UniqueId::new(listener.local_addr()?)?;
    let thread = std::thread::Builder::new()
        .name("mk-bootstrap-root".into())
        .spawn(move || {
            // A panic must not escape a library thread: the ranks' connections close as it
            // unwinds, and they report that the root went away.
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve(&listener, &id, limits))) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => mk_warn!(None, "bootstrap root on {} ended: {e}", id.root),
                Err(_) => mk_warn!(None, "bootstrap root on {} ended: internal error (panic)", id.root),
            }
        })
        .map_err(|e| MkError::system(format!("cannot start the bootstrap root thread: {e}")))?;
    mk_info!(None, "bootstrap root listening on {}", id.root);
    Ok((id, thread))
}

fn serve(listener: &TcpListener, id: &UniqueId, limits: RootLimits) -> Result<()> {
    let config = AcceptorConfig {
        key: &id.secret,
        session: id.session,
        purpose: Purpose::BootstrapRoot,
        me: ROOT_ID,
        max_in_flight: limits.max_in_flight,
        handshake_limit: limits.handshake_limit,
        first_frame_max: Some(HELLO_BYTES),
        log_rank: None,
    };
    let mut acceptor = Acceptor::new(listener, config);
    let idle = Deadline::after(limits.idle, "ROOT_IDLE_LIMIT");
    let mut rendezvous = Rendezvous::default();
    loop {
        let deadline = rendezvous.deadline.unwrap_or(idle);
        let accepted = acceptor.next(&deadline, &|_| true, "bootstrap rendezvous");
        let Accepted { stream, first_frame, .. } = match accepted {
            Ok(a) => a,
            Err(e) if e.code == mkResult_t::mkTimeout && rendezvous.deadline.is_none() => {
                mk_info!(
                    None,
                    "bootstrap root on {}: no rank joined within ROOT_IDLE_LIMIT={} s; closing",
                    id.root,
                    limits.idle.as_secs()
                );
                return Ok(());
            }
            Err(e) => {
                let e = if e.code == mkResult_t::mkTimeout { rendezvous.missing_ranks_error(&deadline) } else { e };
                rendezvous.reply_all(&RootReply::Error(e.clone()));
                return Err(e);
            }
        };
        let hello = first_frame
            .ok_or_else(|| MkError::internal("the root's acceptor returned no hello"))
            .and_then(|b| Hello::decode(&b));
        match hello.and_then(|h| rendezvous.admit(stream, h)) {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => return Err(e),
        }
    }
}

#[derive(Default)]
struct Rendezvous {
    joined: Vec<Option<(SecureStream, Hello)>>,
    nranks: u32,
    /// Set by the first rank: its MK_BOOTSTRAP_TIMEOUT_MS from then.
    deadline: Option<Deadline>,
}

impl Rendezvous {
    /// Checks one hello (against the bounds and the ranks before it); answers everyone when
    /// the table is complete (true) or the hello is an error (then returns it).
    fn admit(&mut self, stream: SecureStream, hello: Hello) -> Result<bool> {
        let error = if hello.nranks == 0 || hello.nranks as usize > MAX_RANKS {
            Some(MkError::invalid_usage(format!(
                "rank {} called init with nranks={}, outside [1, {MAX_RANKS}] (MAX_RANKS)",
                hello.rank, hello.nranks
            )))
        } else if self.deadline.is_some() && hello.nranks != self.nranks {
            Some(MkError::invalid_usage(format!(
                "mismatched nranks: rank {} called init with nranks={} but another rank used nranks={}",
                hello.rank, hello.nranks, self.nranks
            )))
        } else if hello.rank >= hello.nranks {
            Some(MkError::invalid_usage(format!("rank {} is out of range for nranks={}", hello.rank, hello.nranks)))
        } else if self.joined.get(hello.rank as usize).is_some_and(Option::is_some) {
            Some(MkError::invalid_usage(format!("duplicate rank: two processes joined as rank {}", hello.rank)))
        } else {
            None
        };
        let mut one = [Some((stream, hello.clone()))];
        if let Some(e) = error {
            let reply = RootReply::Error(e.clone());
            reply_to(&mut one, &reply);
            self.reply_all(&reply);
            return Err(e);
        }
        if self.deadline.is_none() {
            // Sized only after the bound check above; the clock starts with the first rank.
            self.nranks = hello.nranks;
            self.joined.resize_with(hello.nranks as usize, || None);
            self.deadline =
                Some(Deadline::after(Duration::from_millis(u64::from(hello.timeout_ms)), BOOTSTRAP_TIMEOUT_VAR));
        }
        mk_info!(Some(hello.rank as usize), "joined the bootstrap");
        let [entry] = one;
        self.joined[hello.rank as usize] = entry;
        if self.joined.iter().all(Option::is_some) {
            let table: Vec<Hello> = self.joined.iter().flatten().map(|(_, h)| h.clone()).collect();
            self.reply_all(&RootReply::Table(table));
            return Ok(true);
        }
        Ok(false)
    }

    fn missing_ranks_error(&self, deadline: &Deadline) -> MkError {
        const LISTED: usize = 32;
        let missing: Vec<usize> = self.joined.iter().enumerate().filter(|(_, j)| j.is_none()).map(|(r, _)| r).collect();
        let mut list: Vec<String> = missing.iter().take(LISTED).map(usize::to_string).collect();
        if missing.len() > LISTED {
            list.push(format!("and {} more", missing.len() - LISTED));
        }
        MkError::timeout(format!(
            "ranks [{}] of {} never joined the bootstrap within {}={} ms",
            list.join(", "),
            self.nranks,
            deadline.governed_by(),
            deadline.total().as_millis()
        ))
    }

    fn reply_all(&mut self, reply: &RootReply) {
        reply_to(&mut self.joined, reply);
    }
}

/// Sends `reply` to every rank in `joined`, all within one `HANDSHAKE_LIMIT`.
fn reply_to(joined: &mut [Option<(SecureStream, Hello)>], reply: &RootReply) {
    let bytes = reply.encode();
    let deadline = Deadline::after(HANDSHAKE_LIMIT, super::handshake::HANDSHAKE_LIMIT_NAME);
    for (s, h) in joined.iter_mut().flatten() {
        if let Err(e) = s.send(&bytes, &deadline, &"bootstrap root reply") {
            mk_warn!(Some(h.rank as usize), "bootstrap root could not answer this rank: {e}");
        }
    }
}
