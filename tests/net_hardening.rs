//! The bootstrap and socket transport under hostile connections on loopback: silent
//! connections to every listener, a flood at the root, an insider claiming nranks =
//! i32::MAX, an unused unique id, a fake root, replayed and reflected proofs, and the
//! messages a user sees (which variable a timeout names, what a wrong secret says).
//!
//! Tests here run one at a time (`serial`): the ring test finds a rank's listener among
//! this process's listening sockets, so no other test may open one meanwhile.

mod common;
use common::listeners::listening_ports;
use mkernel::bootstrap::acceptor::{Acceptor, AcceptorConfig};
use mkernel::bootstrap::handshake::{
    self, Challenge, ChallengeStatus, DialSpec, DialerSide, Purpose, Verdict, VerdictStatus, CHALLENGE_BYTES,
    HANDSHAKE_LIMIT, PROOF_BYTES, PROOF_GRACE, ROOT_ID, VERDICT_BYTES,
};
use mkernel::bootstrap::net::{self, Deadline};
use mkernel::bootstrap::root::{start_root, start_root_with, RootLimits};
use mkernel::bootstrap::wire::{Hello, RootReply, MAX_ROOT_REPLY_BYTES};
use mkernel::bootstrap::{Bootstrap, UniqueId, MAX_RANKS};
use mkernel::error::mkResult_t;
use mkernel::transport::socket::{SocketBlob, SocketTransport};
use mkernel::transport::{MemoryKind, MemoryRegion, PutRequest, Transport, TransportAuth, Window};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    std::env::set_var("MK_SOCKET_IFNAME", "=lo");
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn threads_in_this_process() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status.lines().find_map(|l| l.strip_prefix("Threads:")).unwrap().trim().parse().unwrap()
}

fn silent_connections(addr: SocketAddr, count: usize) -> Vec<TcpStream> {
    (0..count).map(|_| TcpStream::connect(addr).unwrap()).collect()
}

fn join_all(id: UniqueId, nranks: usize, timeout: Duration) -> Vec<mkernel::Result<Bootstrap>> {
    let handles: Vec<_> =
        (0..nranks).map(|r| std::thread::spawn(move || Bootstrap::join(&id, r, nranks, timeout))).collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Row: silent connections to a rank's bootstrap ring listener, accepted one at a time
/// with a 5 s handshake each, used up the whole bootstrap timeout.
#[test]
fn silent_connections_to_a_ring_listener_do_not_fail_the_job() {
    let _serial = serial();
    let id = start_root().unwrap();
    let before = listening_ports();
    let timeout = Duration::from_secs(4);
    let rank0 = std::thread::spawn(move || Bootstrap::join(&id, 0, 2, timeout));
    // Rank 0's ring listener is the one new listening socket of this process.
    let start = Instant::now();
    let port = loop {
        let new: Vec<u16> = listening_ports().difference(&before).copied().collect();
        if let [p] = new[..] {
            break p;
        }
        assert!(start.elapsed() < Duration::from_secs(2), "rank 0's listener never appeared: {new:?}");
        std::thread::sleep(Duration::from_millis(5));
    };
    // Three connections that never speak, queued before rank 1 (which dials rank 0) exists.
    let _silent = silent_connections(SocketAddr::from(([127, 0, 0, 1], port)), 3);
    let rank1 = std::thread::spawn(move || Bootstrap::join(&id, 1, 2, timeout));
    let (b0, b1) = (rank0.join().unwrap(), rank1.join().unwrap());
    let (b0, b1) = (b0.expect("rank 0 joins despite the silent connections"), b1.expect("rank 1 joins"));
    let other = std::thread::spawn(move || b1.allgather(b"one").unwrap());
    assert_eq!(b0.allgather(b"zero").unwrap(), vec![b"zero".to_vec(), b"one".to_vec()]);
    other.join().unwrap();
    assert!(start.elapsed() < Duration::from_secs(3), "bring-up took {:?}", start.elapsed());
}

/// A host window leaked for the test's lifetime (the transport's threads write into it).
fn leaked_window(bytes: usize, signal_words: usize) -> (Window, *mut u8, &'static [AtomicU64]) {
    let data = Box::leak(vec![0u8; bytes].into_boxed_slice()).as_mut_ptr();
    let signals: &'static [AtomicU64] = Box::leak((0..signal_words).map(|_| AtomicU64::new(0)).collect());
    let window = Window {
        data: MemoryRegion { base: data as u64, bytes: bytes as u64, kind: MemoryKind::Host },
        signals: MemoryRegion { base: signals.as_ptr() as u64, bytes: 8 * signal_words as u64, kind: MemoryKind::Host },
    };
    (window, data, signals)
}

/// Row: one silent connection to a rank's transport listener before its peer dialed
/// failed the whole job with mkTimeout.
#[test]
fn silent_connections_to_a_transport_listener_do_not_fail_the_job() {
    let _serial = serial();
    let timeout = Duration::from_secs(3);
    let auth = TransportAuth::new(&[4; 16], 11);
    let mut t0 = SocketTransport::new(0, 2, auth, timeout).unwrap();
    let mut t1 = SocketTransport::new(1, 2, auth, timeout).unwrap();
    let (w0, data0, signals0) = leaked_window(64, 1);
    let (w1, data1, _) = leaked_window(64, 1);
    // SAFETY: leaked windows outlive the transports.
    unsafe {
        t0.register(w0).unwrap();
        t1.register(w1).unwrap();
    }
    let blobs = vec![t0.connection_blob(&[1]).unwrap(), t1.connection_blob(&[0]).unwrap()];
    let listen0 = SocketBlob::decode(&blobs[0], 0).unwrap().listen;
    let _silent = silent_connections(listen0, 3);
    let start = Instant::now();
    let (r0, r1) = std::thread::scope(|s| {
        let h = s.spawn(|| t1.connect(&blobs, &[0]));
        (t0.connect(&blobs, &[1]), h.join().unwrap())
    });
    r0.expect("rank 0 connects despite the silent connections");
    r1.expect("rank 1 connects");
    assert!(start.elapsed() < Duration::from_secs(2), "connecting took {:?}", start.elapsed());
    // SAFETY: in bounds of the leaked window; nothing reads it before the put is posted.
    unsafe { std::ptr::copy_nonoverlapping(b"hello".as_ptr(), data1, 5) };
    t1.post_put(&PutRequest { peer: 0, src_offset: 0, dst_offset: 8, bytes: 5, signal: Some((0, 77)) }).unwrap();
    while signals0[0].load(Ordering::Acquire) != 77 {
        assert!(start.elapsed() < Duration::from_secs(5), "the put never landed");
        std::thread::yield_now();
    }
    // SAFETY: in bounds; the put's bytes are in place once its signal is seen (acquire).
    assert_eq!(unsafe { std::slice::from_raw_parts(data0.add(8), 5) }, b"hello");
    // Close both at once: each waits for the other's Close message.
    std::thread::scope(|s| {
        s.spawn(|| t1.close().unwrap());
        t0.close().unwrap();
    });
}

/// Row: silent connections to the root; also the thread-per-connection flood. The root
/// starts no thread per connection, leaves connections beyond its in-flight bound in its
/// listener's queue, and real ranks, queued behind them, still join.
#[test]
fn a_flood_of_silent_connections_at_the_root_starts_no_threads_and_ranks_still_join() {
    let _serial = serial();
    let limits = RootLimits {
        idle: Duration::from_secs(30),
        max_in_flight: 16,
        handshake_limit: Duration::from_millis(500),
        proof_grace: Duration::from_millis(100),
        ..RootLimits::default()
    };
    let (id, _root) = start_root_with(limits).unwrap();
    let threads_before = threads_in_this_process();
    let silent = silent_connections(id.root, 300);
    std::thread::sleep(Duration::from_millis(200)); // the root has accepted what it will
    let threads_during = threads_in_this_process();
    assert!(
        threads_during <= threads_before + 2,
        "threads grew from {threads_before} to {threads_during} under the flood"
    );
    let start = Instant::now();
    for r in join_all(id, 3, Duration::from_secs(15)) {
        r.expect("a real rank joins despite the flood");
    }
    // The queue ahead of the ranks drains 16 connections per 100 ms proof grace: about 2 s.
    assert!(start.elapsed() < Duration::from_secs(10), "joining took {:?}", start.elapsed());
    drop(silent);
}

/// Speaks the rank side of the root protocol by hand (the test knows the secret).
fn hand_made_hello(id: &UniqueId, hello: &Hello) -> mkernel::Result<RootReply> {
    let deadline = Deadline::bootstrap(Duration::from_secs(5));
    let spec = DialSpec {
        key: &id.secret,
        session: id.session,
        purpose: Purpose::BootstrapRoot,
        dialer: hello.rank,
        target: ROOT_ID,
    };
    let mut root = handshake::dial(id.root, spec, &deadline, "hand-made rank")?;
    root.send(&hello.encode(), &deadline, &"hand-made hello")?;
    RootReply::decode(&root.recv(MAX_ROOT_REPLY_BYTES, &deadline, &"root reply")?)
}

/// Row: a rank that knows the secret and claims nranks = INT_MAX made the root allocate
/// about 137 GB and abort the process.
#[test]
fn nranks_int_max_is_refused_cleanly() {
    let _serial = serial();
    // Through the library: refused before anything is sent.
    let id = start_root().unwrap();
    let e = Bootstrap::join(&id, 0, i32::MAX as usize, Duration::from_secs(2)).err().expect("nranks = i32::MAX");
    assert_eq!(e.code, mkResult_t::mkInvalidArgument, "{e}");
    assert!(e.message.contains("MAX_RANKS"), "{e}");
    // By hand, at the root: the root answers with an error and this process lives on.
    for nranks in [i32::MAX as u32, u32::MAX, MAX_RANKS as u32 + 1, 0] {
        let id = start_root().unwrap();
        let hello = Hello { rank: 0, nranks, listen: "127.0.0.1:9".parse().unwrap(), host_hash: 1, timeout_ms: 2000 };
        match hand_made_hello(&id, &hello).unwrap() {
            RootReply::Error(e) => {
                assert_eq!(e.code, mkResult_t::mkInvalidUsage, "{e}");
                assert!(e.message.contains("MAX_RANKS") && e.message.contains(&nranks.to_string()), "{e}");
            }
            RootReply::Table(t) => panic!("nranks={nranks} got a table of {}", t.len()),
        }
    }
}

/// Row: an unused id kept two threads, a port and a 2 ms polling loop for 24 h.
#[test]
fn an_unused_roots_thread_ends_within_its_idle_limit() {
    let _serial = serial();
    let idle = Duration::from_millis(300);
    let (id, root) = start_root_with(RootLimits { idle, ..RootLimits::default() }).unwrap();
    // Connections that never prove the secret do not keep it alive.
    let silent = silent_connections(id.root, 2);
    let start = Instant::now();
    while !root.is_finished() {
        assert!(start.elapsed() < idle + Duration::from_secs(2), "the root thread outlived its idle limit");
        std::thread::sleep(Duration::from_millis(10));
    }
    root.join().unwrap();
    let e = TcpStream::connect(id.root).expect_err("the root's port is closed");
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
    drop(silent);
    // A rank that arrives after it reports which limit ended the root.
    let e = Bootstrap::join(&id, 0, 1, Duration::from_millis(300)).err().unwrap();
    assert_eq!(e.code, mkResult_t::mkTimeout, "{e}");
    assert!(e.message.contains("MK_BOOTSTRAP_TIMEOUT_MS=300 ms"), "{e}");
}

/// Row: a wrong secret reached the joiner as "Connection reset by peer".
#[test]
fn a_wrong_secret_is_an_authentication_failure_on_the_joiner() {
    let _serial = serial();
    let id = start_root().unwrap();
    let mut forged = id;
    forged.secret[15] ^= 0x80;
    let e = Bootstrap::join(&forged, 0, 1, Duration::from_secs(3)).err().expect("a forged id must not join");
    assert_eq!(e.code, mkResult_t::mkInvalidUsage, "{e}");
    assert!(e.message.contains("authentication failed") && e.message.contains(&id.root.to_string()), "{e}");
    // The root is still there for the real rank.
    assert_eq!(Bootstrap::join(&id, 0, 1, Duration::from_secs(3)).unwrap().nranks(), 1);
}

/// A listener that plays a root without the secret: it sends a challenge and accepts any
/// proof with a made-up acceptor proof. Returns the bytes it received after that.
fn fake_root(listener: TcpListener) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        listener.set_nonblocking(false).unwrap();
        let (mut s, _) = listener.accept().unwrap();
        let challenge = Challenge { status: ChallengeStatus::Ready, purpose: Purpose::BootstrapRoot, nonce: [3; 16] };
        s.write_all(&challenge.encode()).unwrap();
        let mut proof = [0u8; PROOF_BYTES];
        s.read_exact(&mut proof).unwrap();
        s.write_all(&Verdict { status: VerdictStatus::Accepted, tag: [0x42; 32] }.encode()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut after = Vec::new();
        let _ = s.read_to_end(&mut after);
        after
    })
}

/// Row: authentication was one-way; a joiner never checked the root it dialed.
#[test]
fn a_joiner_refuses_a_root_that_cannot_prove_the_secret() {
    let _serial = serial();
    let listener = net::bind_listener("127.0.0.1".parse().unwrap()).unwrap();
    let id = UniqueId::new(listener.local_addr().unwrap()).unwrap();
    let fake = fake_root(listener);
    let e = Bootstrap::join(&id, 0, 2, Duration::from_secs(3)).err().expect("the fake root must be refused");
    assert_eq!(e.code, mkResult_t::mkRemoteError, "{e}");
    assert!(e.message.contains("did not prove it knows the unique id's secret"), "{e}");
    assert!(fake.join().unwrap().is_empty(), "the joiner sent its hello to an unproven root");
}

fn acceptor_config(key: &[u8], me: u32) -> AcceptorConfig<'_> {
    AcceptorConfig {
        key,
        session: 5,
        purpose: Purpose::Transport,
        me,
        max_in_flight: 8,
        handshake_limit: HANDSHAKE_LIMIT,
        proof_grace: PROOF_GRACE,
        first_frame_max: None,
        log_rank: Some(me as usize),
    }
}

/// Row: the transport used the same proof in both directions, so a listener's own proof
/// could be reflected back to it. Replayed and reflected proofs are refused; an honest
/// dialer on the same listener gets in.
#[test]
fn replayed_and_reflected_proofs_are_refused_by_a_listener() {
    let _serial = serial();
    let key = [8u8; 16];
    let listener = net::bind_listener("127.0.0.1".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let attacker = std::thread::spawn(move || {
        let spec = DialSpec { key: &key, session: 5, purpose: Purpose::Transport, dialer: 1, target: 0 };
        let mut verdicts = Vec::new();
        // An honest exchange, recorded by an eavesdropper.
        let mut s = TcpStream::connect(addr).unwrap();
        let mut challenge = [0u8; CHALLENGE_BYTES];
        s.read_exact(&mut challenge).unwrap();
        let (side, proof) = DialerSide::answer(spec, &challenge, [1; 16]).unwrap().unwrap();
        s.write_all(&proof).unwrap();
        let mut verdict = [0u8; VERDICT_BYTES];
        s.read_exact(&mut verdict).unwrap();
        side.finish(&verdict, addr).expect("the honest dialer is accepted");
        // Replay the recorded proof, then reflect the listener's own verdict tag as a proof.
        let reflected = {
            let mut p = proof;
            p[28..].copy_from_slice(&verdict[1..]);
            p
        };
        for bytes in [proof, reflected] {
            let mut s = TcpStream::connect(addr).unwrap();
            s.read_exact(&mut challenge).unwrap();
            s.write_all(&bytes).unwrap();
            let mut v = [0u8; VERDICT_BYTES];
            s.read_exact(&mut v).unwrap();
            verdicts.push(Verdict::decode(&v).unwrap().status);
        }
        verdicts
    });
    let mut acceptor = Acceptor::new(&listener, acceptor_config(&key, 0));
    let deadline = Deadline::after(Duration::from_secs(3), "test");
    let first = acceptor.next(&deadline, &|d| d == 1, "test listener").unwrap();
    assert_eq!(first.dialer, 1);
    // Neither replay nor reflection completes a handshake: the listener times out.
    let short = Deadline::after(Duration::from_millis(500), "test");
    let e = acceptor.next(&short, &|_| true, "test listener").err().expect("no second handshake");
    assert_eq!(e.code, mkResult_t::mkTimeout);
    assert_eq!(attacker.join().unwrap(), vec![VerdictStatus::WrongProof, VerdictStatus::WrongProof]);
}

/// Dialers retry until the deadline: a listener that drops the first connection and is
/// busy for the second still completes the handshake on a later attempt.
#[test]
fn a_dialer_retries_dropped_and_busy_attempts() {
    let _serial = serial();
    let key = [9u8; 16];
    let listener = net::bind_listener("127.0.0.1".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let dialer = std::thread::spawn(move || {
        let spec = DialSpec { key: &key, session: 5, purpose: Purpose::Transport, dialer: 2, target: 0 };
        handshake::dial(addr, spec, &Deadline::after(Duration::from_secs(3), "test"), "retrying dialer")
            .map(|s| s.peer())
    });
    let wait = |l: &TcpListener| loop {
        match l.accept() {
            Ok((s, _)) => break s,
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    drop(wait(&listener)); // dropped without a word
    let mut busy = wait(&listener);
    busy.write_all(&Challenge { status: ChallengeStatus::Busy, purpose: Purpose::Transport, nonce: [0; 16] }.encode())
        .unwrap();
    drop(busy);
    let mut acceptor = Acceptor::new(&listener, acceptor_config(&key, 0));
    let got = acceptor.next(&Deadline::after(Duration::from_secs(3), "test"), &|d| d == 2, "test listener").unwrap();
    assert_eq!(got.dialer, 2);
    assert_eq!(dialer.join().unwrap().unwrap(), addr);
}

/// Row: every timeout message named MK_BOOTSTRAP_TIMEOUT_MS, even for transport waits.
#[test]
fn timeout_messages_name_the_variable_that_governs_them() {
    let _serial = serial();
    // A transport whose peer never dials: MK_TIMEOUT_MS.
    let auth = TransportAuth::new(&[1; 16], 1);
    let mut t0 = SocketTransport::new(0, 2, auth, Duration::from_millis(300)).unwrap();
    let (w0, _, _) = leaked_window(64, 1);
    // SAFETY: leaked window.
    unsafe { t0.register(w0).unwrap() };
    let fake = SocketBlob { listen: "127.0.0.1:9".parse().unwrap(), data_bytes: 64, signal_words: 1 };
    let blobs = vec![t0.connection_blob(&[1]).unwrap(), fake.encode()];
    let e = t0.connect(&blobs, &[1]).unwrap_err();
    assert_eq!(e.code, mkResult_t::mkTimeout, "{e}");
    assert!(e.message.contains("MK_TIMEOUT_MS=300 ms") && !e.message.contains("BOOTSTRAP"), "{e}");
    // A listener that accepts but never answers: the joiner's MK_BOOTSTRAP_TIMEOUT_MS.
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let id = UniqueId::new(mute.local_addr().unwrap()).unwrap();
    let e = Bootstrap::join(&id, 0, 2, Duration::from_millis(300)).err().unwrap();
    assert_eq!(e.code, mkResult_t::mkTimeout, "{e}");
    assert!(e.message.contains("MK_BOOTSTRAP_TIMEOUT_MS=300 ms"), "{e}");
    // The per-connection bound is a constant, and says so.
    let d = Deadline::bootstrap(Duration::from_secs(60)).capped(Duration::ZERO, handshake::HANDSHAKE_LIMIT_NAME);
    assert!(d.remaining(&"a handshake").unwrap_err().message.contains("HANDSHAKE_LIMIT"));
}
