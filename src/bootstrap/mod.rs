//! Bootstrap: the unique id, the authenticated TCP rendezvous, and host-side collectives
//! (allgather, broadcast, barrier) over a ring of sockets between the ranks.
//!
//! Every step is bounded by `MK_BOOTSTRAP_TIMEOUT_MS`; a rank that never arrives gives
//! `mkTimeout`, a peer that dies gives `mkRemoteError`. Every connection, to the root and
//! on the ring, starts with a mutual handshake proving the unique id's secret in both
//! directions (`handshake`), and every frame after it carries a MAC (`frames`). The threat
//! model and every bound are in docs/security.md.

pub mod acceptor;
pub mod crypto;
pub mod frames;
pub mod handshake;
pub mod net;
pub mod root;
pub mod unique_id;
pub mod wire;

use crate::error::{MkError, Result};
use crate::mk_info;
use acceptor::{Acceptor, AcceptorConfig};
use frames::SecureStream;
use handshake::{DialSpec, Purpose, HANDSHAKE_LIMIT, PROOF_GRACE, ROOT_ID};
use net::Deadline;
use parking_lot::Mutex;
use std::net::{Shutdown, TcpStream};
pub use unique_id::{UniqueId, UNIQUE_ID_BYTES};
use wire::{Hello, RootReply, MAX_ROOT_REPLY_BYTES};

/// Largest payload a rank sends in one bootstrap collective; a peer's frame over it is a
/// protocol error, not an allocation.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// Handshakes a rank's ring listener runs at once (more wait in its queue).
pub const RING_MAX_IN_FLIGHT: usize = 16;

/// The most ranks a communicator may have. Every rank count that comes from C or from the
/// network is checked against it before anything is sized by it (the root's tables grow
/// with the rank count: about 100 bytes a rank at this bound).
pub const MAX_RANKS: usize = 65536;

/// A hash naming this host (hostname and boot id), so ranks can be grouped into nodes.
pub fn host_hash() -> u64 {
    let mut host = [0u8; 256];
    // SAFETY: the buffer is writable for its length.
    unsafe { libc::gethostname(host.as_mut_ptr().cast(), host.len()) };
    let boot = std::fs::read("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let d = crypto::sha256(&[&host, &boot]);
    u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))
}

struct Ring {
    /// Connection to rank + 1 (we send on it).
    next: SecureStream,
    /// Connection from rank - 1 (we receive on it).
    prev: SecureStream,
}

/// One rank's view of the bootstrap after the rendezvous.
pub struct Bootstrap {
    rank: usize,
    nranks: usize,
    host_hashes: Vec<u64>,
    ring: Mutex<Option<Ring>>,
    /// Clones of the ring sockets, so `abort` can shut them while a collective blocks.
    shutdown_handles: Vec<TcpStream>,
    timeout: std::time::Duration,
}

impl Bootstrap {
    /// Joins the communicator named by `id` as `rank` of `nranks`.
    /// `timeout` bounds the rendezvous and, later, each collective.
    pub fn join(id: &UniqueId, rank: usize, nranks: usize, timeout: std::time::Duration) -> Result<Bootstrap> {
        if nranks == 0 || nranks > MAX_RANKS || rank >= nranks {
            return Err(MkError::invalid_argument(format!(
                "rank {rank} of nranks {nranks}: nranks must be in [1, {MAX_RANKS}] (MAX_RANKS) and rank below it"
            )));
        }
        let deadline = Deadline::bootstrap(timeout);
        let listener = net::bind_listener(net::local_address()?)?;
        let hello = Hello {
            rank: rank as u32,
            nranks: nranks as u32,
            listen: listener.local_addr()?,
            host_hash: host_hash(),
            timeout_ms: timeout.as_millis().min(u32::MAX as u128) as u32,
        };
        let what = format!("rank {rank} joining the bootstrap root at {}", id.root);
        let spec = DialSpec {
            key: &id.secret,
            session: id.session,
            purpose: Purpose::BootstrapRoot,
            dialer: rank as u32,
            target: ROOT_ID,
        };
        let mut root = handshake::dial(id.root, spec, &deadline, &what).map_err(|mut e| {
            if e.code == crate::error::mkResult_t::mkTimeout && e.message.contains("refused") {
                e.message.push_str("; ");
                e.message.push_str(&root::ended_root_hint(id));
            }
            e
        })?;
        root.send(&hello.encode(), &deadline, &what)?;
        let waiting = format!("rank {rank} waiting for all {nranks} ranks at the bootstrap root {}", id.root);
        // The root's own deadline (from the first rank's arrival) ends about when ours does;
        // allow a little longer so its answer, which names the missing ranks, gets here first.
        let reply_deadline = Deadline::bootstrap(deadline.remaining(&waiting)? + std::time::Duration::from_secs(2));
        let reply = root.recv(MAX_ROOT_REPLY_BYTES, &reply_deadline, &waiting).map_err(|mut e| {
            if e.code == crate::error::mkResult_t::mkRemoteError {
                e.message.push_str(
                    " (the bootstrap root ended without answering: see the log of the process that called \
                     mkGetUniqueId)",
                );
            }
            e
        })?;
        let table = match RootReply::decode(&reply)? {
            RootReply::Table(t) => t,
            RootReply::Error(e) => return Err(e),
        };
        drop(root);
        if table.len() != nranks || table.iter().enumerate().any(|(r, h)| h.rank as usize != r) {
            return Err(MkError::remote("the bootstrap root sent an inconsistent rank table"));
        }
        mk_info!(Some(rank), "bootstrap rendezvous complete with {nranks} ranks");

        let (ring, shutdown_handles) = if nranks > 1 {
            let next_rank = (rank + 1) % nranks;
            let next_addr = table[next_rank].listen;
            let prev_rank = (rank + nranks - 1) % nranks;
            let (next, prev) = std::thread::scope(|s| {
                let connector = std::thread::Builder::new()
                    .name(format!("mk-boot-ring-{rank}"))
                    .spawn_scoped(s, || {
                        let what = format!("rank {rank} connecting to rank {next_rank} (bootstrap ring)");
                        let spec = DialSpec {
                            key: &id.secret,
                            session: id.session,
                            purpose: Purpose::BootstrapRing,
                            dialer: rank as u32,
                            target: next_rank as u32,
                        };
                        handshake::dial(next_addr, spec, &deadline, &what)
                    })
                    .map_err(|e| MkError::system(format!("cannot start the bootstrap ring connector thread: {e}")))?;
                let config = AcceptorConfig {
                    key: &id.secret,
                    session: id.session,
                    purpose: Purpose::BootstrapRing,
                    me: rank as u32,
                    max_in_flight: RING_MAX_IN_FLIGHT,
                    handshake_limit: HANDSHAKE_LIMIT,
                    proof_grace: PROOF_GRACE,
                    first_frame_max: None,
                    log_rank: Some(rank),
                };
                let what = format!("rank {rank} waiting for rank {prev_rank} to connect (bootstrap ring)");
                let prev = Acceptor::new(&listener, config).next(&deadline, &|d| d as usize == prev_rank, &what);
                let next =
                    connector.join().map_err(|_| MkError::internal("the bootstrap ring connector thread panicked"))?;
                Ok::<_, MkError>((next?, prev?.stream))
            })?;
            let handles = vec![next.socket().try_clone()?, prev.socket().try_clone()?];
            (Some(Ring { next, prev }), handles)
        } else {
            (None, Vec::new())
        };
        Ok(Bootstrap {
            rank,
            nranks,
            host_hashes: table.iter().map(|h| h.host_hash).collect(),
            ring: Mutex::new(ring),
            shutdown_handles,
            timeout,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// Host hash of every rank, in rank order.
    pub fn host_hashes(&self) -> &[u64] {
        &self.host_hashes
    }

    /// Gathers one byte string from every rank (lengths may differ), in rank order.
    pub fn allgather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.nranks;
        let mut blocks: Vec<Vec<u8>> = vec![Vec::new(); n];
        blocks[self.rank] = mine.to_vec();
        let mut guard = self.ring.lock();
        let Some(ring) = guard.as_mut() else { return Ok(blocks) };
        if mine.len() > MAX_MESSAGE_BYTES {
            return Err(MkError::invalid_argument(format!(
                "bootstrap allgather of {} bytes exceeds MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}",
                mine.len()
            )));
        }
        let deadline = Deadline::bootstrap(self.timeout);
        for step in 0..n - 1 {
            let send_idx = (self.rank + n - step) % n;
            let recv_idx = (self.rank + 2 * n - step - 1) % n;
            let what = format!(
                "rank {} bootstrap allgather step {step} (waiting on rank {})",
                self.rank,
                (self.rank + n - 1) % n
            );
            let payload = std::mem::take(&mut blocks[send_idx]);
            let Ring { next, prev } = ring;
            let received = std::thread::scope(|s| {
                let sender = std::thread::Builder::new()
                    .name(format!("mk-boot-send-{}", self.rank))
                    .spawn_scoped(s, || next.send(&payload, &deadline, &what))
                    .map_err(|e| MkError::system(format!("cannot start the bootstrap allgather sender thread: {e}")))?;
                let got = prev.recv(MAX_MESSAGE_BYTES, &deadline, &what);
                let sent =
                    sender.join().map_err(|_| MkError::internal("the bootstrap allgather sender thread panicked"))?;
                sent?;
                got
            });
            blocks[send_idx] = payload;
            blocks[recv_idx] = received?;
        }
        Ok(blocks)
    }

    /// Every rank gets `root`'s bytes (the others' `mine` is ignored).
    pub fn broadcast(&self, mine: &[u8], root: usize) -> Result<Vec<u8>> {
        if root >= self.nranks {
            return Err(MkError::invalid_argument(format!("broadcast root {root} out of range")));
        }
        let contribution: &[u8] = if self.rank == root { mine } else { &[] };
        Ok(std::mem::take(&mut self.allgather(contribution)?[root]))
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.allgather(&[]).map(|_| ())
    }

    /// Unblocks any collective in progress on this rank and makes later ones fail.
    pub fn abort(&self) {
        for s in &self.shutdown_handles {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}
