//! Bootstrap: the unique id, the authenticated TCP rendezvous, and host-side collectives
//! (allgather, broadcast, barrier) over a ring of sockets between the ranks.
//!
//! Every step is bounded by `MK_BOOTSTRAP_TIMEOUT_MS`; a rank that never arrives gives
//! `mkTimeout`, a peer that dies gives `mkRemoteError`. Every accepted connection, at the
//! root and on the ring, must first answer a random challenge with an HMAC of the unique
//! id's secret; connections that cannot are refused and logged.

pub mod net;
pub mod root;
pub mod sha256;
pub mod unique_id;
pub mod wire;

use crate::error::{MkError, Result};
use crate::{mk_info, mk_warn};
use net::Deadline;
use parking_lot::Mutex;
use std::net::{Shutdown, TcpStream};
pub use unique_id::{UniqueId, UNIQUE_ID_BYTES};
use wire::{Hello, RootReply};

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
    let d = sha256::sha256(&[&host, &boot]);
    u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))
}

struct Ring {
    /// Connection to rank + 1 (we send on it).
    next: TcpStream,
    /// Connection from rank - 1 (we receive on it).
    prev: TcpStream,
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
        let deadline = Deadline::after(timeout);
        let listener = net::bind_listener(net::local_address()?)?;
        let hello = Hello {
            rank: rank as u32,
            nranks: nranks as u32,
            listen: listener.local_addr()?,
            host_hash: host_hash(),
            timeout_ms: timeout.as_millis().min(u32::MAX as u128) as u32,
        };
        let what = format!("rank {rank} joining the bootstrap root at {}", id.root);
        let mut root = net::connect_before(id.root, &deadline, &what)?;
        net::respond(&mut root, &id.secret, id.session, &deadline)?;
        net::send_frame(&mut root, &hello.encode(), &deadline, &what)?;
        let waiting = format!("rank {rank} waiting for all {nranks} ranks at the bootstrap root {}", id.root);
        // The root's own deadline (from the first rank's arrival) ends about when ours does;
        // allow a little longer so its answer, which names the missing ranks, gets here first.
        let reply_deadline = Deadline::after(deadline.remaining(&waiting)? + std::time::Duration::from_secs(2));
        let table = match RootReply::decode(&net::recv_frame(&mut root, &reply_deadline, &waiting)?)? {
            RootReply::Table(t) => t,
            RootReply::Error(e) => return Err(e),
        };
        drop(root);
        if table.len() != nranks || table.iter().enumerate().any(|(r, h)| h.rank as usize != r) {
            return Err(MkError::remote("the bootstrap root sent an inconsistent rank table"));
        }
        mk_info!(Some(rank), "bootstrap rendezvous complete with {nranks} ranks");

        let (ring, shutdown_handles) = if nranks > 1 {
            let next_addr = table[(rank + 1) % nranks].listen;
            let prev_rank = (rank + nranks - 1) % nranks;
            let (next, prev) = std::thread::scope(|s| {
                let connector = s.spawn(|| -> Result<TcpStream> {
                    let what = format!("rank {rank} connecting to rank {}", (rank + 1) % nranks);
                    let mut next = net::connect_before(next_addr, &deadline, &what)?;
                    net::respond(&mut next, &id.secret, id.session, &deadline)?;
                    net::send_frame(&mut next, &(rank as u32).to_le_bytes(), &deadline, &what)?;
                    Ok(next)
                });
                let prev = accept_ring_neighbour(&listener, id, rank, prev_rank, &deadline);
                let next = connector.join().map_err(|_| MkError::internal("ring connector thread panicked"))?;
                Ok::<_, MkError>((next?, prev?))
            })?;
            let handles = vec![next.try_clone()?, prev.try_clone()?];
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
        let deadline = Deadline::after(self.timeout);
        for step in 0..n - 1 {
            let send_idx = (self.rank + n - step) % n;
            let recv_idx = (self.rank + 2 * n - step - 1) % n;
            let what = format!("rank {} bootstrap allgather step {step} (waiting on rank {})", self.rank, (self.rank + n - 1) % n);
            let payload = std::mem::take(&mut blocks[send_idx]);
            let Ring { next, prev } = ring;
            let received = std::thread::scope(|s| {
                let sender = s.spawn(|| net::send_frame(next, &payload, &deadline, &what));
                let got = net::recv_frame(prev, &deadline, &what);
                let sent = sender.join().map_err(|_| MkError::internal("allgather sender panicked"))?;
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

fn accept_ring_neighbour(listener: &std::net::TcpListener, id: &UniqueId, rank: usize, prev_rank: usize, deadline: &Deadline) -> Result<TcpStream> {
    let what = format!("rank {rank} waiting for rank {prev_rank} to connect");
    loop {
        let (mut s, peer) = net::accept_before(listener, deadline, &what)?;
        // A short bound per connection, so a silent intruder cannot use up the whole deadline.
        let hs = Deadline::after(deadline.remaining(&what)?.min(std::time::Duration::from_secs(5)));
        if let Err(e) = net::challenge(&mut s, &id.secret, id.session, &hs) {
            mk_warn!(Some(rank), "refused bootstrap connection from {peer}: {}", e.message);
            continue;
        }
        match net::recv_frame(&mut s, &hs, &what) {
            Ok(b) if b == (prev_rank as u32).to_le_bytes() => return Ok(s),
            Ok(b) => mk_warn!(Some(rank), "refused ring connection from {peer}: it claims to be {b:?}, expected rank {prev_rank}"),
            Err(e) => mk_warn!(Some(rank), "dropped ring connection from {peer}: {}", e.message),
        }
    }
}
