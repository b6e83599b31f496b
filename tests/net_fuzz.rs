//! Property tests for every parser of bytes that come from the network: bootstrap frames,
//! root messages, the unique id, the handshake messages and checks, and the socket
//! transport's connection blob. Arbitrary bytes must give an error, never a panic, a hang
//! or an allocation sized by the input; whatever parses must round-trip.
//!
//! CI runs a few thousand cases of each (seconds). For a long run by hand:
//! `MK_FUZZ_CASES=1000000 cargo test --release --test net_fuzz -- --include-ignored`
//! (the ignored `long_fuzz_of_every_parser` runs all of them with that many cases).

use mkernel::bootstrap::acceptor::{Acceptor, AcceptorConfig};
use mkernel::bootstrap::frames::FrameCounter;
use mkernel::bootstrap::handshake::{
    self, AcceptorSide, Challenge, DialSpec, DialerSide, Proof, Purpose, Verdict, CHALLENGE_BYTES, HANDSHAKE_LIMIT,
    PROOF_BYTES, PROOF_GRACE, VERDICT_BYTES,
};
use mkernel::bootstrap::net::{self, Deadline};
use mkernel::bootstrap::wire::{Hello, RootReply, HELLO_BYTES};
use mkernel::bootstrap::{UniqueId, UNIQUE_ID_BYTES};
use mkernel::transport::socket::SocketBlob;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::io::Write;
use std::time::Duration;

type Outcome = std::result::Result<(), TestCaseError>;

const CI_CASES: u32 = 3000;

fn config(cases: u32) -> Config {
    Config { cases, failure_persistence: None, ..Config::default() }
}

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..max)
}

fn deadline() -> Deadline {
    Deadline::bootstrap(Duration::from_secs(1))
}

/// Arbitrary bytes are never a valid frame (no key), and a length field is bounded first.
fn frame_from_junk(junk: &[u8], max: usize) -> Outcome {
    let r = FrameCounter::new([1; 32]).open(&mut &junk[..], max, &deadline(), &"fuzz");
    prop_assert!(r.is_err());
    Ok(())
}

/// A sealed frame opens once, in order, and fails after any change to one byte.
fn frame_round_trip(payload: &[u8], flip: usize) -> Outcome {
    let mut tx = FrameCounter::new([2; 32]);
    let wire = tx.seal(payload);
    prop_assert_eq!(
        FrameCounter::new([2; 32]).open(&mut &wire[..], payload.len(), &deadline(), &"fuzz").unwrap(),
        payload
    );
    let mut bad = wire.clone();
    let i = flip % bad.len();
    bad[i] ^= 1 << (flip % 8);
    prop_assert!(FrameCounter::new([2; 32]).open(&mut &bad[..], payload.len() + 4096, &deadline(), &"fuzz").is_err());
    Ok(())
}

fn hello(b: &[u8]) -> Outcome {
    if let Ok(h) = Hello::decode(b) {
        prop_assert_eq!(b.len(), HELLO_BYTES);
        prop_assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
    }
    Ok(())
}

fn root_reply(b: &[u8]) -> Outcome {
    if let Ok(r) = RootReply::decode(b) {
        prop_assert_eq!(RootReply::decode(&r.encode()).unwrap(), r.clone());
        if let RootReply::Error(e) = r {
            prop_assert!(e.code != mkernel::error::mkResult_t::mkSuccess, "an error reply must fail the join");
        }
    }
    Ok(())
}

/// A table header claiming up to u32::MAX hellos is refused without reading them.
fn root_reply_count(n: u32, body: &[u8]) -> Outcome {
    let mut b = vec![0u8];
    b.extend_from_slice(&n.to_le_bytes());
    b.extend_from_slice(body);
    if let Ok(RootReply::Table(t)) = RootReply::decode(&b) {
        prop_assert_eq!(t.len() as u64, u64::from(n));
        prop_assert_eq!(body.len(), t.len() * HELLO_BYTES);
    }
    Ok(())
}

fn unique_id(b: &[u8; UNIQUE_ID_BYTES]) -> Outcome {
    if let Ok(id) = UniqueId::from_bytes(b) {
        prop_assert_eq!(UniqueId::from_bytes(&id.to_bytes()).unwrap(), id);
    }
    Ok(())
}

fn handshake_messages(b: &[u8]) -> Outcome {
    if let Ok(c) = Challenge::decode(b) {
        prop_assert_eq!(&c.encode()[..], b);
    }
    if let Ok(p) = Proof::decode(b) {
        prop_assert_eq!(&p.encode()[..], b);
    }
    if let Ok(v) = Verdict::decode(b) {
        prop_assert_eq!(&v.encode()[..], b);
    }
    Ok(())
}

/// Without the key no proof passes, whatever the bytes; with a valid challenge, no
/// arbitrary verdict passes the dialer's check either.
fn handshake_checks(proof: &[u8], challenge: &[u8], verdict: &[u8]) -> Outcome {
    let acceptor = AcceptorSide::new(&[3; 16], 9, Purpose::Transport, 0).unwrap();
    prop_assert!(acceptor.check(proof, &|_| true).1.is_err());
    let spec = DialSpec { key: &[3; 16], session: 9, purpose: Purpose::Transport, dialer: 1, target: 0 };
    for c in [challenge, &acceptor.challenge()[..]] {
        if let Ok(Some((side, _))) = DialerSide::answer(spec, c, [5; 16]) {
            prop_assert!(side.finish(verdict, "127.0.0.1:1".parse().unwrap()).is_err());
        }
    }
    Ok(())
}

fn socket_blob(b: &[u8]) -> Outcome {
    if let Ok(blob) = SocketBlob::decode(b, 1) {
        prop_assert_eq!(SocketBlob::decode(&blob.encode(), 1).unwrap(), blob);
    }
    Ok(())
}

/// Junk on a real listener: never accepted, and an honest dialer that comes next gets in.
fn acceptor_with_junk(junk: &[u8]) -> Outcome {
    let key = [4u8; 16];
    let listener = net::bind_listener("127.0.0.1".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let _ = s.write_all(junk);
    let honest = std::thread::spawn(move || {
        let spec = DialSpec { key: &key, session: 1, purpose: Purpose::BootstrapRoot, dialer: 0, target: 7 };
        let mut stream = handshake::dial(addr, spec, &Deadline::bootstrap(Duration::from_secs(3)), "honest")?;
        stream.send(b"hi", &Deadline::bootstrap(Duration::from_secs(3)), &"first frame")
    });
    let config = AcceptorConfig {
        key: &key,
        session: 1,
        purpose: Purpose::BootstrapRoot,
        me: 7,
        max_in_flight: 4,
        handshake_limit: HANDSHAKE_LIMIT,
        proof_grace: PROOF_GRACE,
        first_frame_max: Some(16),
        log_rank: None,
    };
    let got =
        Acceptor::new(&listener, config).next(&Deadline::bootstrap(Duration::from_secs(3)), &|_| true, "fuzz").unwrap();
    let first_frame = got.first_frame.and_then(Result::ok);
    prop_assert_eq!(first_frame.as_deref(), Some(&b"hi"[..]));
    prop_assert_eq!(got.dialer, 0);
    honest.join().unwrap().unwrap();
    drop(s);
    Ok(())
}

fn run_all(cases: u32) {
    // A fresh runner per property: a runner counts cases across its runs.
    let r = || TestRunner::new(config(cases));
    r().run(&(bytes(256), 0usize..300), |(b, max)| frame_from_junk(&b, max)).unwrap();
    r().run(&(bytes(512), any::<usize>()), |(p, flip)| frame_round_trip(&p, flip)).unwrap();
    r().run(&bytes(2 * HELLO_BYTES), |b| hello(&b)).unwrap();
    r().run(&bytes(8 * HELLO_BYTES), |b| root_reply(&b)).unwrap();
    r().run(&(any::<u32>(), bytes(4 * HELLO_BYTES)), |(n, b)| root_reply_count(n, &b)).unwrap();
    r().run(&proptest::array::uniform32(any::<u8>()), |head| {
        // The magic and address family are where decoding branches; keep them plausible often.
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[..32].copy_from_slice(&head);
        if head[0] % 2 == 0 {
            b[..4].copy_from_slice(b"MKU1");
            b[4] = if head[1] % 2 == 0 { 4 } else { 6 };
        }
        unique_id(&b)
    })
    .unwrap();
    r().run(&bytes(PROOF_BYTES + 8), |b| handshake_messages(&b)).unwrap();
    r().run(&(bytes(PROOF_BYTES + 4), bytes(CHALLENGE_BYTES + 4), bytes(VERDICT_BYTES + 4)), |(p, c, v)| {
        handshake_checks(&p, &c, &v)
    })
    .unwrap();
    r().run(&bytes(64), |b| socket_blob(&b)).unwrap();
}

proptest! {
    #![proptest_config(config(CI_CASES))]

    #[test]
    fn junk_is_never_a_frame(b in bytes(256), max in 0usize..300) { frame_from_junk(&b, max)? }

    #[test]
    fn frames_round_trip_and_detect_any_flipped_bit(p in bytes(512), flip in any::<usize>()) { frame_round_trip(&p, flip)? }

    #[test]
    fn hellos_parse_or_fail(b in bytes(2 * HELLO_BYTES)) { hello(&b)? }

    #[test]
    fn root_replies_parse_or_fail(b in bytes(8 * HELLO_BYTES)) { root_reply(&b)? }

    #[test]
    fn root_table_counts_are_bounded(n in any::<u32>(), b in bytes(4 * HELLO_BYTES)) { root_reply_count(n, &b)? }

    #[test]
    fn unique_ids_parse_or_fail(head in proptest::array::uniform32(any::<u8>()), magic in any::<bool>(), v4 in any::<bool>()) {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[..32].copy_from_slice(&head);
        if magic {
            b[..4].copy_from_slice(b"MKU1");
            b[4] = if v4 { 4 } else { 6 };
        }
        unique_id(&b)?
    }

    #[test]
    fn handshake_messages_parse_or_fail(b in bytes(PROOF_BYTES + 8)) { handshake_messages(&b)? }

    #[test]
    fn no_junk_passes_a_handshake_check(p in bytes(PROOF_BYTES + 4), c in bytes(CHALLENGE_BYTES + 4), v in bytes(VERDICT_BYTES + 4)) {
        handshake_checks(&p, &c, &v)?
    }

    #[test]
    fn socket_blobs_parse_or_fail(b in bytes(64)) { socket_blob(&b)? }
}

proptest! {
    // Each case opens sockets on loopback: fewer cases.
    #![proptest_config(config(48))]

    #[test]
    fn junk_on_a_listener_never_blocks_an_honest_dialer(junk in bytes(200)) {
        std::env::set_var("MK_DEBUG", "ERROR"); // the refusals are expected; keep the output short
        acceptor_with_junk(&junk)?
    }
}

#[test]
#[ignore = "long: run by hand (see the file's header)"]
fn long_fuzz_of_every_parser() {
    let cases = std::env::var("MK_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    run_all(cases);
}
