//! A reconnecting slowloris against each listener, on loopback: a stranger without the
//! secret keeps as many connections open as the listener has handshake slots, or several
//! times that, never sends a byte, and reconnects at once whenever the listener closes one.
//! An honest job beside it must still start, every time.
//!
//! Each case is bounded: the attacker holds a fixed number of sockets, stops at the end of
//! the case, and the honest job has a timeout far above what it needs (the verdict is
//! whether it started, never how fast).
//!
//! Tests here run one at a time (`serial`): the ring case finds a rank's listener among this
//! process's listening sockets, so no other test may open one meanwhile.

mod common;
use common::listeners::listening_ports;
use common::HostWindow;
use mkernel::bootstrap::root::{start_root, ROOT_MAX_IN_FLIGHT};
use mkernel::bootstrap::{Bootstrap, UniqueId, RING_MAX_IN_FLIGHT};
use mkernel::transport::socket::{SocketBlob, SocketTransport, TRANSPORT_MAX_IN_FLIGHT};
use mkernel::transport::{PutRequest, Transport, TransportAuth};
use std::collections::HashSet;
use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Far above the second or so the honest job needs under these attacks.
const HONEST_TIMEOUT: Duration = Duration::from_secs(20);
/// The attacker's sockets, as multiples of the listener's handshake slots.
const SLOT_MULTIPLES: [usize; 2] = [1, 4];

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    std::env::set_var("MK_SOCKET_IFNAME", "=lo");
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the attacker did, for the test's log.
#[derive(Debug)]
struct AttackCounts {
    connects: usize,
    /// Connections that were handed a handshake slot (a ready challenge).
    slots_won: usize,
    /// The most slots it held at once, as it saw them: it notices a close only on its next
    /// poll, so this can exceed the listener's slot count.
    peak_held: usize,
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    connects: AtomicUsize,
    slots_won: AtomicUsize,
    held: AtomicUsize,
    peak_held: AtomicUsize,
}

/// The stranger: one thread polling `sockets` silent connections to `target`.
struct Slowloris {
    shared: Arc<Shared>,
    thread: JoinHandle<()>,
}

/// One of the attacker's connections and whether the listener gave it a slot.
struct Held {
    socket: TcpStream,
    in_slot: bool,
}

impl std::fmt::Display for AttackCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} connects, {} slots won, at most {} held at once", self.connects, self.slots_won, self.peak_held)
    }
}

impl Slowloris {
    fn start(target: SocketAddr, sockets: usize) -> Slowloris {
        let shared = Arc::new(Shared::default());
        let s = Arc::clone(&shared);
        let thread = std::thread::spawn(move || attack(target, sockets, &s));
        Slowloris { shared, thread }
    }

    /// Waits until the attacker has connected each of its sockets once and holds `slots`
    /// slots (0: the listener may not be accepting yet).
    fn wait_until(&self, sockets: usize, slots: usize) {
        let start = Instant::now();
        while self.shared.connects.load(Ordering::Relaxed) < sockets || self.shared.held.load(Ordering::Relaxed) < slots
        {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the attack never got going: {} of {sockets} connected, {} of {slots} slots",
                self.shared.connects.load(Ordering::Relaxed),
                self.shared.held.load(Ordering::Relaxed)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn stop(self) -> AttackCounts {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap();
        AttackCounts {
            connects: self.shared.connects.load(Ordering::Relaxed),
            slots_won: self.shared.slots_won.load(Ordering::Relaxed),
            peak_held: self.shared.peak_held.load(Ordering::Relaxed),
        }
    }
}

fn connect(target: SocketAddr, shared: &Shared) -> Option<Held> {
    let socket = TcpStream::connect_timeout(&target, Duration::from_secs(1)).ok()?;
    socket.set_nonblocking(true).ok()?;
    shared.connects.fetch_add(1, Ordering::Relaxed);
    Some(Held { socket, in_slot: false })
}

fn attack(target: SocketAddr, sockets: usize, shared: &Shared) {
    let mut held: Vec<Option<Held>> = (0..sockets).map(|_| connect(target, shared)).collect();
    let mut buf = [0u8; 64];
    while !shared.stop.load(Ordering::Relaxed) {
        // Reconnect at once whatever the listener closed (or a connect that failed).
        for h in held.iter_mut().filter(|h| h.is_none()) {
            *h = connect(target, shared);
        }
        let mut fds: Vec<libc::pollfd> = held
            .iter()
            .flatten()
            .map(|h| libc::pollfd { fd: h.socket.as_raw_fd(), events: libc::POLLIN, revents: 0 })
            .collect();
        // SAFETY: `fds` is a valid array of its length.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 20) };
        if ready <= 0 {
            continue;
        }
        let mut ready_fds = fds.iter().filter(|f| f.revents != 0).map(|f| f.fd).collect::<HashSet<_>>();
        for slot in held.iter_mut() {
            let Some(h) = slot else { continue };
            if !ready_fds.remove(&h.socket.as_raw_fd()) {
                continue;
            }
            let closed = match h.socket.read(&mut buf) {
                Ok(0) => true,
                // A challenge: "MKA2", then status 0 for a slot (1 says busy, and a close follows).
                Ok(n) => {
                    if !h.in_slot && n >= 5 && &buf[..4] == b"MKA2" && buf[4] == 0 {
                        h.in_slot = true;
                        shared.slots_won.fetch_add(1, Ordering::Relaxed);
                        let now = shared.held.fetch_add(1, Ordering::Relaxed) + 1;
                        shared.peak_held.fetch_max(now, Ordering::Relaxed);
                    }
                    false
                }
                Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted),
            };
            if closed {
                if h.in_slot {
                    shared.held.fetch_sub(1, Ordering::Relaxed);
                }
                *slot = None;
            }
        }
    }
}

fn join_ranks(
    id: UniqueId,
    ranks: std::ops::Range<usize>,
    nranks: usize,
) -> Vec<JoinHandle<mkernel::Result<Bootstrap>>> {
    ranks.map(|r| std::thread::spawn(move || Bootstrap::join(&id, r, nranks, HONEST_TIMEOUT))).collect()
}

/// Every rank joined; an allgather over the ring they built returns every rank's bytes.
fn assert_job_started(joins: Vec<JoinHandle<mkernel::Result<Bootstrap>>>, what: &str) {
    let boots: Vec<Bootstrap> = joins
        .into_iter()
        .enumerate()
        .map(|(r, h)| h.join().unwrap().unwrap_or_else(|e| panic!("{what}: rank {r} failed to join: {e}")))
        .collect();
    let n = boots.len();
    let gathered: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
        let hs: Vec<_> = boots.iter().map(|b| s.spawn(move || b.allgather(&[b.rank() as u8]).unwrap())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let expected: Vec<Vec<u8>> = (0..n).map(|r| vec![r as u8]).collect();
    assert!(gathered.iter().all(|g| *g == expected), "{what}: allgather gave {gathered:?}");
}

/// The root: the attacker holds every one of its slots before any rank arrives.
#[test]
fn a_reconnecting_slowloris_at_the_root_does_not_stop_the_job() {
    let _serial = serial();
    for multiple in SLOT_MULTIPLES {
        let sockets = multiple * ROOT_MAX_IN_FLIGHT;
        let id = start_root().unwrap();
        let attacker = Slowloris::start(id.root, sockets);
        attacker.wait_until(sockets, ROOT_MAX_IN_FLIGHT);
        let start = Instant::now();
        assert_job_started(join_ranks(id, 0..3, 3), &format!("{sockets} attacking sockets at the root"));
        let counts = attacker.stop();
        eprintln!("root, {sockets} attacking sockets: job started in {:?}; attacker: {counts}", start.elapsed());
        assert!(counts.peak_held >= ROOT_MAX_IN_FLIGHT, "the attacker never held every slot: {counts:?}");
    }
}

/// Rank 0's ring listener (which rank 2 dials): the attacker's connections are queued there
/// before the ring forms, and take every slot once rank 0 starts accepting.
#[test]
fn a_reconnecting_slowloris_at_a_ring_listener_does_not_stop_the_job() {
    let _serial = serial();
    for multiple in SLOT_MULTIPLES {
        let sockets = multiple * RING_MAX_IN_FLIGHT;
        let id = start_root().unwrap();
        let before = listening_ports();
        let mut joins = join_ranks(id, 0..1, 3);
        // Rank 0's ring listener is the one new listening socket of this process.
        let start = Instant::now();
        let port = loop {
            let new: Vec<u16> = listening_ports().difference(&before).copied().collect();
            if let [p] = new[..] {
                break p;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "rank 0's listener never appeared: {new:?}");
            std::thread::sleep(Duration::from_millis(5));
        };
        let attacker = Slowloris::start(SocketAddr::from(([127, 0, 0, 1], port)), sockets);
        attacker.wait_until(sockets, 0);
        joins.extend(join_ranks(id, 1..3, 3));
        assert_job_started(joins, &format!("{sockets} attacking sockets at rank 0's ring listener"));
        let counts = attacker.stop();
        eprintln!("ring, {sockets} attacking sockets: job started in {:?}; attacker: {counts}", start.elapsed());
        assert!(counts.peak_held >= RING_MAX_IN_FLIGHT, "the attacker never held every slot: {counts:?}");
    }
}

/// Rank 0's transport listener, which ranks 1 and 2 dial: the attacker's connections are
/// queued there before the transports connect, and take every slot once rank 0 accepts.
#[test]
fn a_reconnecting_slowloris_at_a_transport_listener_does_not_stop_the_job() {
    let _serial = serial();
    for multiple in SLOT_MULTIPLES {
        let sockets = multiple * TRANSPORT_MAX_IN_FLIGHT;
        let auth = TransportAuth::new(&[7; 16], 3);
        let mut transports: Vec<SocketTransport> =
            (0..3).map(|r| SocketTransport::new(r, 3, auth, HONEST_TIMEOUT).unwrap()).collect();
        let windows: Vec<HostWindow> = (0..3).map(|_| HostWindow::new(64, 1, 0)).collect();
        for (t, w) in transports.iter_mut().zip(&windows) {
            // SAFETY: the leaked windows outlive the transports.
            unsafe { t.register(w.window()).unwrap() };
        }
        let blobs: Vec<Vec<u8>> = transports
            .iter_mut()
            .enumerate()
            .map(|(r, t)| t.connection_blob(&(0..3).filter(|&p| p != r).collect::<Vec<_>>()).unwrap())
            .collect();
        let listen0 = SocketBlob::decode(&blobs[0], 0).unwrap().listen;
        let attacker = Slowloris::start(listen0, sockets);
        attacker.wait_until(sockets, 0);
        let start = Instant::now();
        let results: Vec<mkernel::Result<()>> = std::thread::scope(|s| {
            let hs: Vec<_> = transports
                .iter_mut()
                .enumerate()
                .map(|(r, t)| {
                    let blobs = &blobs;
                    s.spawn(move || t.connect(blobs, &(0..3).filter(|&p| p != r).collect::<Vec<_>>()))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, res) in results.into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("{sockets} attacking sockets: rank {r}'s transport failed to connect: {e}"));
        }
        let elapsed = start.elapsed();
        // The connection the attacker fought over carries a put.
        windows[2].fill(0, b"queued");
        transports[2]
            .post_put(&PutRequest { peer: 0, src_offset: 0, dst_offset: 8, bytes: 6, signal: Some((0, 5)) })
            .unwrap();
        let put_start = Instant::now();
        while windows[0].signals[0].load(Ordering::Acquire) != 5 {
            assert!(put_start.elapsed() < HONEST_TIMEOUT, "the put never landed");
            std::thread::yield_now();
        }
        // The put's bytes are in place once its signal is seen (acquire).
        assert_eq!(windows[0].slice(8, 6), b"queued");
        let counts = attacker.stop();
        // Close all at once: each waits for the others' Close messages.
        std::thread::scope(|s| {
            for t in transports.iter_mut() {
                s.spawn(move || t.close().unwrap());
            }
        });
        eprintln!("transport, {sockets} attacking sockets: connected in {elapsed:?}; attacker: {counts}");
        assert!(counts.peak_held >= TRANSPORT_MAX_IN_FLIGHT, "the attacker never held every slot: {counts:?}");
    }
}
