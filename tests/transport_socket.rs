//! Socket transport on loopback: ranks as threads and as separate processes (this test
//! binary re-runs itself as a rank), data-then-signal ordering for large and odd sizes,
//! GPU i ↔ GPU i peers from the topology, a wrong secret refused, a killed peer giving
//! mkRemoteError and a stopped one mkTimeout within the timeout.

mod common;
use common::HostWindow;
use mkernel::bootstrap::handshake::{self, DialSpec, Purpose};
use mkernel::bootstrap::net::Deadline;
use mkernel::bootstrap::{root::start_root, Bootstrap, UniqueId, UNIQUE_ID_BYTES};
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::transport::socket::{SocketBlob, SocketTransport};
use mkernel::transport::topology::{node_of_ranks, Topology};
use mkernel::transport::{connect_through_bootstrap, MemoryKind, PostId, PutRequest, Transport, TransportAuth};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const ROLE: &str = "MK_TEST_TRANSPORT_RANK";
/// Message sizes every rank sends to every peer: tiny, odd, page-straddling, multi-MiB.
const SIZES: &[usize] = &[1, 3, 4095, 4097, 65_537, 1 << 20, (4 << 20) + 13];

fn loopback() {
    std::env::set_var("MK_SOCKET_IFNAME", "=lo");
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn pattern(from: usize, message: usize, i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 9) ^ message.wrapping_mul(7) ^ from.wrapping_mul(101)) as u8
}

/// Offsets of each message inside one sender's area.
fn message_offsets() -> (Vec<usize>, usize) {
    let mut offsets = Vec::new();
    let mut at = 0;
    for &s in SIZES {
        offsets.push(at);
        at += s;
    }
    (offsets, at)
}

fn signal_value(from: usize, message: usize) -> u64 {
    ((from as u64) << 32) | (message as u64 + 1)
}

fn wait_all_posted(t: &mut SocketTransport, ids: &[PostId], limit: Duration) -> Result<()> {
    let start = Instant::now();
    let mut done = Vec::new();
    while !ids.iter().all(|id| done.contains(id)) {
        t.poll(&mut done)?;
        if start.elapsed() > limit {
            return Err(MkError::timeout("puts did not complete"));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}

/// One rank of the exchange: every rank puts every message of `SIZES` to each of its
/// peers (source area at offset 0; sender r's messages land in area r + 1 of the peer) with
/// a signal per message, then checks what its peers put into it as each signal arrives.
fn run_exchange_rank(
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    peers_of: fn(usize, usize) -> Vec<usize>,
) -> Result<()> {
    let timeout = Duration::from_secs(20);
    let boot = Bootstrap::join(id, rank, nranks, timeout)?;
    let (offsets, area) = message_offsets();
    let window = HostWindow::new(area * (nranks + 1), SIZES.len() * nranks, 0);
    for (m, &size) in SIZES.iter().enumerate() {
        let bytes: Vec<u8> = (0..size).map(|i| pattern(rank, m, i)).collect();
        window.fill(offsets[m], &bytes);
    }
    let mut t = SocketTransport::new(rank, nranks, TransportAuth::from_unique_id(id), timeout)?;
    // SAFETY: the window's memory is leaked: valid for the rest of the process.
    unsafe { t.register(window.window())? };
    let peers = peers_of(rank, nranks);
    connect_through_bootstrap(&mut t, &boot, &peers)?;

    let mut ids = Vec::new();
    for &p in &peers {
        for (m, &size) in SIZES.iter().enumerate() {
            let put = PutRequest {
                peer: p,
                src_offset: offsets[m] as u64,
                dst_offset: (area * (rank + 1) + offsets[m]) as u64,
                bytes: size as u64,
                signal: Some(((rank * SIZES.len() + m) as u32, signal_value(rank, m))),
            };
            ids.push(t.post_put(&put)?);
        }
    }
    // Check each incoming message the moment its signal shows: data must already be there.
    let start = Instant::now();
    for &p in &peers {
        for (m, &size) in SIZES.iter().enumerate() {
            let word = &window.signals[p * SIZES.len() + m];
            while word.load(Ordering::Acquire) != signal_value(p, m) {
                if start.elapsed() > timeout {
                    return Err(MkError::timeout(format!("rank {rank}: message {m} from rank {p} never signalled")));
                }
                std::hint::spin_loop();
            }
            let got = window.slice(area * (p + 1) + offsets[m], size);
            if let Some(i) = (0..size).find(|&i| got[i] != pattern(p, m, i)) {
                return Err(MkError::internal(format!(
                    "rank {rank}: message {m} ({size} bytes) from rank {p} was signalled before byte {i} arrived"
                )));
            }
        }
    }
    wait_all_posted(&mut t, &ids, timeout)?;
    boot.barrier()?;
    t.close()
}

fn all_others(rank: usize, nranks: usize) -> Vec<usize> {
    (0..nranks).filter(|&r| r != rank).collect()
}

/// GPU i ↔ GPU i: nodes of two ranks (MK_RANKS_PER_NODE=2), peers on the other nodes.
fn rail_peers(rank: usize, nranks: usize) -> Vec<usize> {
    let nodes = node_of_ranks(&vec![0; nranks], Some(2));
    Topology::new(rank, &nodes).unwrap().inter_node_peers()
}

#[test]
fn ranks_as_threads_exchange_all_to_all() {
    loopback();
    let id = start_root().unwrap();
    let n = 3;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n).map(|r| s.spawn(move || run_exchange_rank(&id, r, n, all_others))).collect();
        for (r, h) in handles.into_iter().enumerate() {
            h.join().unwrap().unwrap_or_else(|e| panic!("rank {r}: {e}"));
        }
    });
}

/// Entry point of a child rank process (ignored in a normal run; a no-op without its role).
#[test]
#[ignore = "child-process entry point: its parent test runs it with --ignored --exact"]
fn child_rank_entry() {
    let Ok(spec) = std::env::var(ROLE) else { return };
    let parts: Vec<&str> = spec.split(':').collect();
    let id = UniqueId::from_bytes(&<[u8; UNIQUE_ID_BYTES]>::try_from(unhex(parts[1])).unwrap()).unwrap();
    let rank: usize = parts[2].parse().unwrap();
    let nranks: usize = parts[3].parse().unwrap();
    match parts[0] {
        "exchange" => {
            run_exchange_rank(&id, rank, nranks, rail_peers).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            println!("CHILD-OK rank {rank}");
        }
        "connect-then-wait" => {
            let timeout = Duration::from_secs(30);
            let boot = Bootstrap::join(&id, rank, nranks, timeout).unwrap();
            let window = HostWindow::new(64 << 20, 4, 0);
            let mut t = SocketTransport::new(rank, nranks, TransportAuth::from_unique_id(&id), timeout).unwrap();
            // SAFETY: leaked window.
            unsafe { t.register(window.window()).unwrap() };
            connect_through_bootstrap(&mut t, &boot, &all_others(rank, nranks)).unwrap();
            std::thread::sleep(Duration::from_secs(60)); // the parent kills or stops us
        }
        other => panic!("unknown child role {other}"),
    }
}

fn spawn_rank(role: &str, id: &UniqueId, rank: usize, nranks: usize) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_rank_entry", "--nocapture", "--test-threads=1"])
        .env(ROLE, format!("{role}:{}:{rank}:{nranks}", hex(&id.to_bytes())))
        .env("MK_SOCKET_IFNAME", "=lo")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn ranks_as_processes_exchange_with_rail_peers() {
    loopback();
    let id = start_root().unwrap();
    let n = 4; // two emulated nodes of two ranks: 0 ↔ 2 and 1 ↔ 3
    let children: Vec<Child> = (0..n).map(|r| spawn_rank("exchange", &id, r, n)).collect();
    for (r, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(&format!("CHILD-OK rank {r}")),
            "rank {r} failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn wrong_secret_is_refused() {
    loopback();
    let timeout = Duration::from_millis(1500);
    let window0 = HostWindow::new(4096, 1, 0);
    let window1 = HostWindow::new(4096, 1, 0);
    let good = TransportAuth::new(&[1; 16], 7);
    let bad = TransportAuth::new(&[2; 16], 7);
    let mut t0 = SocketTransport::new(0, 2, good, timeout).unwrap();
    let mut t1 = SocketTransport::new(1, 2, bad, timeout).unwrap();
    // SAFETY: leaked windows.
    unsafe {
        t0.register(window0.window()).unwrap();
        t1.register(window1.window()).unwrap();
    }
    let blobs = vec![t0.connection_blob(&[1]).unwrap(), t1.connection_blob(&[0]).unwrap()];
    let start = Instant::now();
    let (r0, r1) = std::thread::scope(|s| {
        let h = s.spawn(|| t1.connect(&blobs, &[0]));
        let r0 = t0.connect(&blobs, &[1]);
        (r0, h.join().unwrap())
    });
    let e0 = r0.unwrap_err();
    assert_eq!(e0.code, mkResult_t::mkTimeout, "rank 0 never accepts the impostor: {e0}");
    let e1 = r1.unwrap_err();
    assert_eq!(e1.code, mkResult_t::mkInvalidUsage, "rank 0 refused the impostor's proof: {e1}");
    assert!(e1.message.contains("authentication failed"), "rank 1 is told why: {e1}");
    assert!(start.elapsed() < timeout + Duration::from_secs(3));
    assert_eq!(
        t0.post_put(&PutRequest { peer: 1, src_offset: 0, dst_offset: 0, bytes: 1, signal: None }).unwrap_err().code,
        mkResult_t::mkInvalidArgument,
        "no connection, no put"
    );
}

/// Rank 0 here, rank 1 a child process that connects and then is killed or stopped.
fn connect_to_child(timeout: Duration) -> (SocketTransport, Child, HostWindow) {
    loopback();
    let id = start_root().unwrap();
    let child = spawn_rank("connect-then-wait", &id, 1, 2);
    let boot = Bootstrap::join(&id, 0, 2, Duration::from_secs(20)).unwrap();
    let window = HostWindow::new(64 << 20, 4, 0);
    let mut t = SocketTransport::new(0, 2, TransportAuth::from_unique_id(&id), timeout).unwrap();
    // SAFETY: leaked window.
    unsafe { t.register(window.window()).unwrap() };
    connect_through_bootstrap(&mut t, &boot, &[1]).unwrap();
    // connect_through_bootstrap ends in a barrier: the child has connected too.
    (t, child, window)
}

fn poll_until_error(t: &mut SocketTransport, limit: Duration) -> MkError {
    let start = Instant::now();
    let mut done = Vec::new();
    loop {
        if let Err(e) = t.poll(&mut done) {
            return e;
        }
        assert!(start.elapsed() < limit, "no error within {limit:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn killed_peer_is_a_remote_error_within_the_timeout() {
    let timeout = Duration::from_secs(3);
    let (mut t, mut child, _window) = connect_to_child(timeout);
    child.kill().unwrap();
    child.wait().unwrap();
    let start = Instant::now();
    let e = poll_until_error(&mut t, timeout);
    assert_eq!(e.code, mkResult_t::mkRemoteError, "{e}");
    assert!(e.message.contains("rank 1"), "{e}");
    assert!(start.elapsed() < timeout);
    let put = PutRequest { peer: 1, src_offset: 0, dst_offset: 0, bytes: 8, signal: Some((0, 1)) };
    assert_eq!(t.post_put(&put).unwrap_err().code, mkResult_t::mkRemoteError);
    assert_eq!(t.close().unwrap_err().code, mkResult_t::mkRemoteError);
}

#[test]
fn stopped_peer_is_a_timeout_not_a_hang() {
    let timeout = Duration::from_secs(1);
    let (mut t, mut child, _window) = connect_to_child(timeout);
    // SAFETY: plain signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGSTOP) }, 0);
    // Far more than the socket buffers hold: the sender blocks, then gives up.
    let start = Instant::now();
    for _ in 0..4 {
        let put = PutRequest { peer: 1, src_offset: 0, dst_offset: 0, bytes: 60 << 20, signal: Some((0, 1)) };
        if t.post_put(&put).is_err() {
            break;
        }
    }
    let e = poll_until_error(&mut t, Duration::from_secs(10));
    let waited = start.elapsed();
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(e.code, mkResult_t::mkTimeout, "{e}");
    assert!(waited < Duration::from_secs(8), "gave up after {waited:?}");
    let closing = Instant::now();
    assert!(t.close().is_err());
    assert!(closing.elapsed() < Duration::from_secs(5), "close is bounded too");
}

#[test]
fn puts_outside_either_window_are_rejected_before_sending() {
    loopback();
    let id = start_root().unwrap();
    let timeout = Duration::from_secs(10);
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || -> Result<()> {
                    let boot = Bootstrap::join(&id, rank, 2, timeout)?;
                    // Rank 0 has the bigger window; rank 1's is 1000 bytes with 2 signals.
                    let window = if rank == 0 { HostWindow::new(8192, 8, 0) } else { HostWindow::new(1000, 2, 0) };
                    let mut t = SocketTransport::new(rank, 2, TransportAuth::from_unique_id(&id), timeout)?;
                    // SAFETY: leaked window.
                    unsafe { t.register(window.window())? };
                    connect_through_bootstrap(&mut t, &boot, &[1 - rank])?;
                    if rank == 0 {
                        let ok =
                            PutRequest { peer: 1, src_offset: 7000, dst_offset: 900, bytes: 100, signal: Some((1, 5)) };
                        for bad in [
                            PutRequest { dst_offset: 901, ..ok },
                            PutRequest { src_offset: 8100, ..ok },
                            PutRequest { signal: Some((2, 5)), ..ok },
                            PutRequest { peer: 0, ..ok },
                            PutRequest { peer: 5, ..ok },
                        ] {
                            let e = t.post_put(&bad).unwrap_err();
                            assert_eq!(e.code, mkResult_t::mkInvalidArgument, "{bad:?}: {e}");
                        }
                        let id = t.post_put(&ok)?;
                        wait_all_posted(&mut t, &[id], timeout)?;
                    } else {
                        let start = Instant::now();
                        while window.signals[1].load(Ordering::Acquire) != 5 {
                            assert!(start.elapsed() < timeout, "the valid put never arrived");
                            std::hint::spin_loop();
                        }
                    }
                    boot.barrier()?;
                    t.close()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, res) in results.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

#[test]
fn device_windows_need_a_cuda_context() {
    loopback();
    let mut t = SocketTransport::new(0, 2, TransportAuth::new(&[1; 16], 1), Duration::from_secs(1)).unwrap();
    let host = HostWindow::new(64, 1, 0);
    let mut device = host.window();
    device.data.kind = MemoryKind::Device;
    // SAFETY: leaked memory; rejected before anything uses it.
    let e = unsafe { t.register(device) }.unwrap_err();
    assert_eq!(e.code, mkResult_t::mkInvalidUsage, "{e}");
    assert!(e.message.contains("CUDA context"), "{e}");
    // SAFETY: leaked memory.
    unsafe { t.register(host.window()).unwrap() };
}

/// A put frame as the wire carries it: kind, signal id, bytes, destination, signal value.
fn raw_frame(kind: u32, signal_id: u32, bytes: u64, dst_offset: u64, signal_value: u64) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&kind.to_le_bytes());
    f.extend_from_slice(&signal_id.to_le_bytes());
    f.extend_from_slice(&bytes.to_le_bytes());
    f.extend_from_slice(&dst_offset.to_le_bytes());
    f.extend_from_slice(&signal_value.to_le_bytes());
    f
}

/// Rank 1 played by hand (it knows the key): it connects to rank 0 and sends `frames`.
/// Returns rank 0's transport, its window, and the raw socket.
fn hand_made_peer(frames: &[Vec<u8>]) -> (SocketTransport, HostWindow, std::net::TcpStream) {
    loopback();
    let auth = TransportAuth::new(&[9; 16], 99);
    let window = HostWindow::new(1000, 2, 0);
    let mut t = SocketTransport::new(0, 2, auth, Duration::from_secs(5)).unwrap();
    // SAFETY: leaked window.
    unsafe { t.register(window.window()).unwrap() };
    let mine = SocketBlob::decode(&t.connection_blob(&[1]).unwrap(), 0).unwrap();
    let fake = SocketBlob { listen: "127.0.0.1:9".parse().unwrap(), data_bytes: 1000, signal_words: 2 };
    let blobs = vec![mine.encode(), fake.encode()];
    let sock = std::thread::scope(|s| {
        let dialer = s.spawn(|| {
            let d = Deadline::after(Duration::from_secs(5), "test");
            let spec =
                DialSpec { key: &auth.key, session: auth.session, purpose: Purpose::Transport, dialer: 1, target: 0 };
            handshake::dial(mine.listen, spec, &d, "fake rank 1").unwrap().into_socket()
        });
        t.connect(&blobs, &[1]).unwrap();
        dialer.join().unwrap()
    });
    let mut sock = sock;
    for f in frames {
        std::io::Write::write_all(&mut sock, f).unwrap();
    }
    (t, window, sock)
}

#[test]
fn hostile_frames_are_remote_errors_and_write_nothing() {
    let cases: Vec<(&str, Vec<Vec<u8>>)> = vec![
        ("past the end of the data region", vec![raw_frame(1, u32::MAX, 100, 901, 0), vec![0xAB; 100]]),
        ("offset overflowing u64", vec![raw_frame(1, u32::MAX, 16, u64::MAX - 7, 0), vec![0xAB; 16]]),
        ("signal word out of range", vec![raw_frame(1, 2, 4, 0, 5), vec![0xAB; 4]]),
        ("unknown message kind", vec![raw_frame(77, u32::MAX, 0, 0, 0)]),
    ];
    for (what, frames) in cases {
        let (mut t, window, _sock) = hand_made_peer(&frames);
        let e = poll_until_error(&mut t, Duration::from_secs(5));
        assert_eq!(e.code, mkResult_t::mkRemoteError, "{what}: {e}");
        assert!(window.slice(0, 1000).iter().all(|&b| b == 0), "{what}: the window was written");
        assert!(window.signals.iter().all(|w| w.load(Ordering::Acquire) == 0), "{what}: a signal was written");
    }
    // The same peer sending a valid put is accepted: the rejections above were about the frames.
    let (mut t, window, _sock) = hand_made_peer(&[raw_frame(1, 1, 4, 996, 5), vec![0xAB; 4]]);
    let start = Instant::now();
    while window.signals[1].load(Ordering::Acquire) != 5 {
        assert!(start.elapsed() < Duration::from_secs(5), "the valid put never landed");
        std::thread::yield_now();
    }
    assert_eq!(window.slice(996, 4), &[0xAB; 4]);
    let mut done = Vec::new();
    t.poll(&mut done).unwrap();
}

#[test]
fn abort_does_not_wait_for_a_silent_peer() {
    // The hand-made peer never says Close: close() would wait out the 5 s timeout.
    let (mut t, _window, _sock) = hand_made_peer(&[]);
    let start = Instant::now();
    t.abort();
    // Well under the 5 s a close would wait, with room for a loaded machine.
    assert!(start.elapsed() < Duration::from_secs(3), "abort waited {:?}", start.elapsed());
    let put = PutRequest { peer: 1, src_offset: 0, dst_offset: 0, bytes: 1, signal: None };
    assert!(t.post_put(&put).is_err(), "an aborted transport takes no puts");
}

#[test]
fn one_signal_covers_every_earlier_put_to_the_peer() {
    loopback();
    let id = start_root().unwrap();
    let timeout = Duration::from_secs(10);
    let (chunks, chunk) = (50usize, 64usize << 10);
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || -> Result<()> {
                    let boot = Bootstrap::join(&id, rank, 2, timeout)?;
                    let window = HostWindow::new(chunks * chunk, 1, 0);
                    let mut t = SocketTransport::new(rank, 2, TransportAuth::from_unique_id(&id), timeout)?;
                    // SAFETY: leaked window.
                    unsafe { t.register(window.window())? };
                    connect_through_bootstrap(&mut t, &boot, &[1 - rank])?;
                    if rank == 0 {
                        let bytes: Vec<u8> = (0..chunks * chunk).map(|i| pattern(0, i / chunk, i)).collect();
                        window.fill(0, &bytes);
                        let mut ids = Vec::new();
                        for c in 0..chunks {
                            let at = (c * chunk) as u64;
                            ids.push(t.post_put(&PutRequest {
                                peer: 1,
                                src_offset: at,
                                dst_offset: at,
                                bytes: chunk as u64,
                                signal: None,
                            })?);
                        }
                        ids.push(t.post_put(&PutRequest {
                            peer: 1,
                            src_offset: 0,
                            dst_offset: 0,
                            bytes: 0,
                            signal: Some((0, 1)),
                        })?);
                        wait_all_posted(&mut t, &ids, timeout)?;
                    } else {
                        let start = Instant::now();
                        while window.signals[0].load(Ordering::Acquire) != 1 {
                            assert!(start.elapsed() < timeout, "the signal never arrived");
                            std::hint::spin_loop();
                        }
                        let got = window.slice(0, chunks * chunk);
                        if let Some(i) = (0..chunks * chunk).find(|&i| got[i] != pattern(0, i / chunk, i)) {
                            panic!("byte {i} (chunk {}) was not there when the later signal was", i / chunk);
                        }
                    }
                    boot.barrier()?;
                    t.close()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, res) in results.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}
