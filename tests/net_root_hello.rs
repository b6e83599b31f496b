//! What the bootstrap root does with hellos from processes that hold the secret, and what a
//! rank that arrives after the root ended is told: every refused hello gets an error reply,
//! a first frame is judged by its length as soon as that arrives, the rendezvous is bounded
//! by the root's own limits whatever a hello asks for, and the hint for a missing root names
//! only causes that can apply.
//!
//! Tests here run one at a time (`serial`): one of them measures this process's peak heap.

use mkernel::bootstrap::frames::SecureStream;
use mkernel::bootstrap::handshake::{self, DialSpec, Purpose, ROOT_ID};
use mkernel::bootstrap::net::Deadline;
use mkernel::bootstrap::root::{start_root, start_root_with, RootLimits};
use mkernel::bootstrap::wire::{Hello, RootReply, MAX_ROOT_REPLY_BYTES};
use mkernel::bootstrap::{Bootstrap, UniqueId, MAX_RANKS};
use mkernel::error::mkResult_t;
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// The system allocator, counting the bytes live now and the most live since a reset.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; the counters do not affect it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    std::env::set_var("MK_SOCKET_IFNAME", "=lo");
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Far above what any exchange here needs; a root that never answers fails at this bound.
fn patient() -> Deadline {
    Deadline::bootstrap(Duration::from_secs(20))
}

/// The rank side of the root protocol by hand, up to the point of sending the hello (the
/// test holds the secret).
fn dial_root(id: &UniqueId, rank: u32) -> SecureStream {
    let spec = DialSpec {
        key: &id.secret,
        session: id.session,
        purpose: Purpose::BootstrapRoot,
        dialer: rank,
        target: ROOT_ID,
    };
    handshake::dial(id.root, spec, &patient(), "hand-made rank").unwrap()
}

fn reply(root: &mut SecureStream) -> mkernel::Result<RootReply> {
    RootReply::decode(&root.recv(MAX_ROOT_REPLY_BYTES, &patient(), &"root reply")?)
}

fn hello(rank: u32, nranks: u32, timeout_ms: u32) -> Hello {
    Hello { rank, nranks, listen: "127.0.0.1:9".parse().unwrap(), host_hash: 1, timeout_ms }
}

/// The root's answer, which must be an error with `code`.
fn expect_error(got: mkernel::Result<RootReply>, code: mkResult_t, who: &str) -> String {
    match got {
        Ok(RootReply::Error(e)) => {
            assert_eq!(e.code, code, "{who}: {e}");
            e.message
        }
        Ok(RootReply::Table(t)) => panic!("{who} got a table of {} ranks", t.len()),
        Err(e) => panic!("{who} got no reply from the root: {e}"),
    }
}

/// Row: a malformed hello (address family 9, or an empty payload) from a holder of the
/// secret ended the root without a reply; the ranks already joined saw only "peer closed".
#[test]
fn a_malformed_hello_gets_an_error_reply_and_so_do_the_ranks_that_joined() {
    let _serial = serial();
    let mut family_9 = hello(1, 2, 20_000).encode();
    family_9[8] = 9; // the listening address's family byte
    for (name, payload) in [("address family 9", family_9), ("an empty payload", Vec::new())] {
        let id = start_root().unwrap();
        let mut joined = dial_root(&id, 0);
        joined.send(&hello(0, 2, 20_000).encode(), &patient(), &"hello").unwrap();
        // Rank 0's hello is in the root's socket before this connection exists, and the
        // root reads handshakes in flight before it accepts: it joins first.
        let mut bad = dial_root(&id, 1);
        bad.send(&payload, &patient(), &"malformed hello").unwrap();
        let told = expect_error(reply(&mut bad), mkResult_t::mkInvalidUsage, name);
        assert!(told.contains("malformed bootstrap hello") && told.contains("rank 1"), "{name}: {told}");
        let joined_told = expect_error(reply(&mut joined), mkResult_t::mkInvalidUsage, "the rank that joined");
        assert_eq!(joined_told, told);
    }
}

/// Row: a first frame that sent only its length field held its slot until the handshake
/// limit, even when that length alone was impossible. The root below would wait ten
/// minutes; the test waits twenty seconds at most.
#[test]
fn an_impossible_hello_length_is_judged_as_soon_as_it_arrives() {
    let _serial = serial();
    let limits = RootLimits { handshake_limit: Duration::from_secs(600), ..RootLimits::default() };
    let (id, _root) = start_root_with(limits).unwrap();
    let mut root = dial_root(&id, 0);
    // Only the length field of a frame, never the payload it announces.
    let mut socket = root.socket();
    socket.write_all(&(1u64 << 40).to_le_bytes()).unwrap();
    let told = expect_error(reply(&mut root), mkResult_t::mkInvalidUsage, "the length-only hello");
    assert!(told.contains(&(1u64 << 40).to_string()), "{told}");
}

/// Row: ranks arriving after the root ended were told it stopped at ROOT_IDLE_LIMIT or its
/// creator exited, when it had ended because its rendezvous was complete.
#[test]
fn a_rank_after_a_complete_rendezvous_is_not_blamed_on_the_idle_limit() {
    let _serial = serial();
    let (id, root) = start_root_with(RootLimits::default()).unwrap();
    Bootstrap::join(&id, 0, 1, Duration::from_secs(20)).expect("a one-rank communicator");
    root.join().unwrap(); // the root ends with its rendezvous
    let e = Bootstrap::join(&id, 0, 1, Duration::from_secs(1)).err().expect("no root to join");
    assert_eq!(e.code, mkResult_t::mkTimeout, "{e}");
    assert!(e.message.contains("its rendezvous is complete or has failed"), "{e}");
    assert!(!e.message.contains("ROOT_IDLE_LIMIT"), "the idle limit has not passed: {e}");
    // A root that did end at its idle limit is named as one that may have.
    let idle = Duration::from_millis(200);
    let (id, root) = start_root_with(RootLimits { idle, ..RootLimits::default() }).unwrap();
    root.join().unwrap();
    let e = Bootstrap::join(&id, 0, 1, Duration::from_secs(1)).err().expect("no root to join");
    assert!(e.message.contains("ROOT_IDLE_LIMIT"), "{e}");
}

/// Row: the first hello set the rendezvous: nranks = MAX_RANKS made the root allocate a
/// slot per claimed rank (about 11 MB), and timeout_ms = u32::MAX would have kept it
/// waiting 49.7 days.
#[test]
fn a_hello_cannot_make_the_root_allocate_per_claimed_rank() {
    let _serial = serial();
    let id = start_root().unwrap();
    let nranks = MAX_RANKS as u32;
    let mut first = dial_root(&id, 0);
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    let before = LIVE.load(Ordering::Relaxed);
    first.send(&hello(0, nranks, u32::MAX).encode(), &patient(), &"hello").unwrap();
    // A second rank 0 ends the rendezvous with "duplicate rank": after the first joined.
    let mut second = dial_root(&id, 0);
    second.send(&hello(0, nranks, u32::MAX).encode(), &patient(), &"hello").unwrap();
    let told = expect_error(reply(&mut second), mkResult_t::mkInvalidUsage, "the duplicate");
    assert!(told.contains("duplicate rank"), "{told}");
    expect_error(reply(&mut first), mkResult_t::mkInvalidUsage, "the first rank 0");
    let grew = PEAK.load(Ordering::Relaxed).saturating_sub(before);
    assert!(grew < 1 << 20, "the heap grew by {grew} bytes for one hello claiming nranks={nranks}");
}

#[test]
fn a_hello_cannot_stretch_the_rendezvous_past_the_roots_limit() {
    let _serial = serial();
    let limits = RootLimits { rendezvous: Duration::from_millis(300), ..RootLimits::default() };
    let (id, _root) = start_root_with(limits).unwrap();
    let mut root = dial_root(&id, 0);
    root.send(&hello(0, 2, u32::MAX).encode(), &patient(), &"hello").unwrap();
    let told = expect_error(reply(&mut root), mkResult_t::mkTimeout, "the lone rank");
    assert!(told.contains("ranks [1] of 2") && told.contains("ROOT_RENDEZVOUS_LIMIT=300 ms"), "{told}");
}
