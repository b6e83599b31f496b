//! The rendezvous root: one thread per unique id. It admits connections that prove the
//! secret (see `handshake`), collects every rank's hello (listening address and host), and
//! answers each rank with the full table, or with one error (duplicate rank, mismatched or
//! out-of-range nranks, ranks missing).
//!
//! Handshakes run concurrently inside the root's one thread (`Acceptor`), so silent or slow
//! connections neither hold up real ranks nor start threads. The thread always ends: when
//! the rendezvous is answered, when the first rank's `MK_BOOTSTRAP_TIMEOUT_MS` (at most
//! `ROOT_RENDEZVOUS_LIMIT`) runs out, or when no rank proves the secret within
//! `ROOT_IDLE_LIMIT` of `mkGetUniqueId` (an id nobody uses). It blocks in `poll(2)` between
//! events. What a rendezvous holds grows with the ranks that join, not with the rank count
//! a hello claims.

use super::acceptor::{Accepted, Acceptor, AcceptorConfig};
use super::frames::SecureStream;
use super::handshake::{Purpose, HANDSHAKE_LIMIT, PROOF_GRACE, ROOT_ID};
use super::net::{self, Deadline, BOOTSTRAP_TIMEOUT_VAR};
use super::unique_id::UniqueId;
use super::wire::{Hello, RootReply, HELLO_BYTES};
use super::MAX_RANKS;
use crate::error::{mkResult_t, MkError, Result};
use crate::{mk_info, mk_warn};
use std::collections::BTreeMap;
use std::net::TcpListener;
use std::thread::JoinHandle;
use std::time::Duration;

/// How long a root waits for its first rank before it stops listening.
pub const ROOT_IDLE_LIMIT: Duration = Duration::from_secs(3600);
/// The longest rendezvous, counted from the first rank's hello, whatever
/// `MK_BOOTSTRAP_TIMEOUT_MS` that rank asks for.
pub const ROOT_RENDEZVOUS_LIMIT: Duration = Duration::from_secs(3600);
/// Handshakes the root runs at once; connections beyond it wait in the listener's queue.
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
    /// A slot held without a proof while others wait (`PROOF_GRACE`).
    pub proof_grace: Duration,
    /// The rendezvous at most, from the first rank's hello (`ROOT_RENDEZVOUS_LIMIT`).
    pub rendezvous: Duration,
}

impl Default for RootLimits {
    fn default() -> Self {
        RootLimits {
            idle: ROOT_IDLE_LIMIT,
            max_in_flight: ROOT_MAX_IN_FLIGHT,
            handshake_limit: HANDSHAKE_LIMIT,
            proof_grace: PROOF_GRACE,
            rendezvous: ROOT_RENDEZVOUS_LIMIT,
        }
    }
}

/// Binds the root's socket and starts its thread; returns the id to hand to every rank.
pub fn start_root() -> Result<UniqueId> {
    start_root_with(RootLimits::default()).map(|(id, _)| id)
}

/// `start_root` with explicit bounds; also returns the root's thread, which ends on its own.
pub fn start_root_with(limits: RootLimits) -> Result<(UniqueId, JoinHandle<()>)> {
    let listener = net::bind_listener(net::local_address()?)?;
    let id = UniqueId::new(listener.local_addr()?)?.with_root_idle_limit(limits.idle);
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

/// What a rank that finds nothing listening at `id`'s root address is told: every way a
/// root ends that can apply. The idle limit is named only once it has passed for this id.
pub fn ended_root_hint(id: &UniqueId) -> String {
    let idle = if id.root_idle_limit_passed() {
        ", or at its ROOT_IDLE_LIMIT if no rank joined by then (that time has passed for this id)"
    } else {
        ""
    };
    format!(
        "nothing listens at the bootstrap root's address, so the root of this unique id has ended. A root ends once \
         its rendezvous is complete or has failed (a unique id serves one communicator, and every rank must join \
         within the first rank's MK_BOOTSTRAP_TIMEOUT_MS), or when the process that called mkGetUniqueId exits{idle}; \
         that process's log (MK_DEBUG=INFO) says which"
    )
}

fn serve(listener: &TcpListener, id: &UniqueId, limits: RootLimits) -> Result<()> {
    let config = AcceptorConfig {
        key: &id.secret,
        session: id.session,
        purpose: Purpose::BootstrapRoot,
        me: ROOT_ID,
        max_in_flight: limits.max_in_flight,
        handshake_limit: limits.handshake_limit,
        proof_grace: limits.proof_grace,
        first_frame_max: Some(HELLO_BYTES),
        log_rank: None,
    };
    let mut acceptor = Acceptor::new(listener, config);
    let idle = Deadline::after(limits.idle, "ROOT_IDLE_LIMIT");
    let mut rendezvous = Rendezvous::default();
    loop {
        let deadline = rendezvous.deadline.unwrap_or(idle);
        let accepted = acceptor.next(&deadline, &|_| true, "bootstrap rendezvous");
        let Accepted { stream, dialer, first_frame } = match accepted {
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
        let hello = match first_frame {
            Some(Ok(bytes)) => Hello::decode(&bytes),
            Some(Err(e)) => Err(e),
            None => Err(MkError::internal("the root's acceptor returned no hello")),
        };
        let admitted = match hello {
            Ok(hello) => rendezvous.admit(stream, hello, limits.rendezvous),
            Err(e) => Err(rendezvous.refuse(
                stream,
                dialer,
                MkError::invalid_usage(format!(
                    "the process joining as rank {dialer} proved the unique id's secret but sent a malformed \
                     bootstrap hello ({}); every rank must run the same mkernel build",
                    e.message
                )),
            )),
        };
        match admitted {
            Ok(true) => {
                mk_info!(None, "bootstrap root on {}: all {} ranks joined; closing", id.root, rendezvous.nranks);
                return Ok(());
            }
            Ok(false) => {}
            Err(e) => return Err(e),
        }
    }
}

#[derive(Default)]
struct Rendezvous {
    /// The ranks that joined so far, by rank.
    joined: BTreeMap<u32, (SecureStream, Hello)>,
    nranks: u32,
    /// Set by the first rank: its MK_BOOTSTRAP_TIMEOUT_MS from then, at most the root's
    /// rendezvous limit.
    deadline: Option<Deadline>,
}

impl Rendezvous {
    /// Checks one hello (against the bounds and the ranks before it); answers everyone when
    /// the table is complete (true) or the hello is an error (then returns it). `limit`
    /// bounds the rendezvous when this is the first hello.
    fn admit(&mut self, stream: SecureStream, hello: Hello, limit: Duration) -> Result<bool> {
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
        } else if self.joined.contains_key(&hello.rank) {
            Some(MkError::invalid_usage(format!("duplicate rank: two processes joined as rank {}", hello.rank)))
        } else {
            None
        };
        if let Some(e) = error {
            return Err(self.refuse(stream, hello.rank, e));
        }
        if self.deadline.is_none() {
            // The clock starts with the first rank, which cannot stretch it past the root's limit.
            self.nranks = hello.nranks;
            let asked = Duration::from_millis(u64::from(hello.timeout_ms));
            self.deadline = Some(if asked <= limit {
                Deadline::after(asked, BOOTSTRAP_TIMEOUT_VAR)
            } else {
                Deadline::after(limit, "ROOT_RENDEZVOUS_LIMIT")
            });
        }
        mk_info!(Some(hello.rank as usize), "joined the bootstrap");
        self.joined.insert(hello.rank, (stream, hello));
        if self.joined.len() == self.nranks as usize {
            let table: Vec<Hello> = self.joined.values().map(|(_, h)| h.clone()).collect();
            self.reply_all(&RootReply::Table(table));
            return Ok(true);
        }
        Ok(false)
    }

    /// Answers `stream` (rank `rank`) and every rank that joined with `e`, which ends the
    /// rendezvous; returns `e`.
    fn refuse(&mut self, mut stream: SecureStream, rank: u32, e: MkError) -> MkError {
        let reply = RootReply::Error(e.clone());
        reply_to(std::iter::once((&mut stream, rank)), &reply);
        self.reply_all(&reply);
        e
    }

    fn missing_ranks_error(&self, deadline: &Deadline) -> MkError {
        const LISTED: usize = 32;
        let missing = (0..self.nranks).filter(|r| !self.joined.contains_key(r));
        let count = missing.clone().count();
        let mut list: Vec<String> = missing.take(LISTED).map(|r| r.to_string()).collect();
        if count > LISTED {
            list.push(format!("and {} more", count - LISTED));
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
        reply_to(self.joined.iter_mut().map(|(&rank, (s, _))| (s, rank)), reply);
    }
}

/// Sends `reply` to every rank in `ranks`, all within one `HANDSHAKE_LIMIT`.
fn reply_to<'s>(ranks: impl Iterator<Item = (&'s mut SecureStream, u32)>, reply: &RootReply) {
    let bytes = reply.encode();
    let deadline = Deadline::after(HANDSHAKE_LIMIT, super::handshake::HANDSHAKE_LIMIT_NAME);
    for (s, rank) in ranks {
        if let Err(e) = s.send(&bytes, &deadline, &"bootstrap root reply") {
            mk_warn!(Some(rank as usize), "bootstrap root could not answer this rank: {e}");
        }
    }
}
