//! The RDMA transport's protocol over the simulated verbs layer (`mkernel_tools::rdma_sim`),
//! ranks as threads: RC-like (ordered) and SRD-like (reordered messages and completions,
//! immediates through receive queues, ENOMEM before the reported depth) fabrics.
//! - data is never visible before its signal, nor before the signal of any later put to
//!   the same peer, with puts flowing both ways at once;
//! - every put completes exactly once;
//! - a full send queue holds puts back instead of failing them;
//! - a vanished peer and a bad remote key surface as mkRemoteError, within a bound.

// The integration tests' shared helpers (HostWindow), from the library's tests/.
#[path = "../../tests/common/mod.rs"]
mod common;
use common::HostWindow;
use mkernel::error::mkResult_t;
use mkernel::transport::rdma::{RdmaBlob, RdmaTransport};
use mkernel::transport::{PostId, PutRequest, Transport};
use mkernel_tools::rdma_sim::{SimConfig, SimFabric, SimRng};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How long a loop may go without progress before it counts as a hang. The exchanges bound
/// the time between steps that move something, not their whole run, which a loaded machine
/// stretches far beyond this (alone they take a few seconds).
const BOUND: Duration = Duration::from_secs(30);
/// Bytes of each put's slot in the data region.
const SLOT: usize = 3000;

/// Connected transports for `n` ranks over `fabric`, with their windows.
fn connect(fabric: &SimFabric, n: usize, data_bytes: usize, signal_words: usize) -> Vec<(RdmaTransport, HostWindow)> {
    let mut ranks: Vec<(RdmaTransport, HostWindow)> = (0..n)
        .map(|r| {
            (RdmaTransport::over(r, n, Box::new(fabric.endpoint(r))), HostWindow::new(data_bytes, signal_words, 0))
        })
        .collect();
    let peers = |r: usize| (0..n).filter(|&p| p != r).collect::<Vec<_>>();
    for (r, (t, w)) in ranks.iter_mut().enumerate() {
        let _ = r;
        // SAFETY: the window is leaked.
        unsafe { t.register(w.window()).unwrap() };
    }
    let blobs: Vec<Vec<u8>> =
        ranks.iter_mut().enumerate().map(|(r, (t, _))| t.connection_blob(&peers(r)).unwrap()).collect();
    for (r, (t, _)) in ranks.iter_mut().enumerate() {
        t.connect(&blobs, &peers(r)).unwrap();
    }
    ranks
}

/// The bytes rank `from` puts in its slot `j` (content and length from the seed).
fn payload(seed: u64, from: usize, j: usize) -> Vec<u8> {
    let mut rng = SimRng::new(seed ^ ((from as u64) << 32) ^ j as u64);
    let len = 1 + rng.below(SLOT as u64) as usize;
    (0..len).map(|_| rng.next_u64() as u8).collect()
}

/// Put `j` from a rank to its peer: source slot j (in the first `puts` slots) to slot
/// `puts + j` of the destination; every third put unsignaled, the others set signal word
/// (j % words) to j + 1.
fn put_of(peer: usize, seed: u64, from: usize, j: usize, puts: usize, words: usize) -> PutRequest {
    let len = payload(seed, from, j).len() as u64;
    let signal = signalled(j).then_some(((j % words) as u32, j as u64 + 1));
    PutRequest { peer, src_offset: (j * SLOT) as u64, dst_offset: ((puts + j) * SLOT) as u64, bytes: len, signal }
}

fn signalled(j: usize) -> bool {
    j % 3 != 1
}

/// The highest signal value a run of `puts` puts writes.
fn last_signal(puts: usize) -> usize {
    (0..puts).rev().find(|&j| signalled(j)).unwrap() + 1
}

/// One rank of an exchange: posts its puts in random bursts, polls, and checks whenever it
/// sees a signal value v that the data of every put numbered below v from its peer is in
/// place (each signal follows its own data and every earlier put's).
struct ExchangeRank {
    me: usize,
    t: RdmaTransport,
    w: HostWindow,
    seed: u64,
    puts: usize,
    words: usize,
    rng: SimRng,
    posted: usize,
    ids: Vec<PostId>,
    completed: Vec<PostId>,
    /// Puts from the peer whose data is verified.
    verified: usize,
}

impl ExchangeRank {
    fn new(me: usize, t: RdmaTransport, w: HostWindow, seed: u64, puts: usize, words: usize) -> ExchangeRank {
        for j in 0..puts {
            w.fill(j * SLOT, &payload(seed, me, j));
        }
        let rng = SimRng::new(seed.wrapping_add(me as u64));
        ExchangeRank {
            me,
            t,
            w,
            seed,
            puts,
            words,
            rng,
            posted: 0,
            ids: Vec::new(),
            completed: Vec::new(),
            verified: 0,
        }
    }

    fn done(&self) -> bool {
        self.completed.len() == self.puts && self.verified >= last_signal(self.puts)
    }

    /// What has moved so far: puts posted, puts completed, the peer's puts verified.
    fn progress(&self) -> (usize, usize, usize) {
        (self.posted, self.completed.len(), self.verified)
    }

    fn check_signals(&mut self) {
        let peer = 1 - self.me;
        for word in self.w.signals {
            let v = word.load(Ordering::Acquire) as usize;
            while self.verified < v {
                let expected = payload(self.seed, peer, self.verified);
                let got = self.w.slice((self.puts + self.verified) * SLOT, expected.len()).to_vec();
                assert!(
                    got == expected,
                    "rank {}: signal {v} seen before the data of put {} landed",
                    self.me,
                    self.verified
                );
                self.verified += 1;
            }
        }
    }

    fn step(&mut self) {
        for _ in 0..self.rng.below(4) {
            if self.posted < self.puts {
                let put = put_of(1 - self.me, self.seed, self.me, self.posted, self.puts, self.words);
                self.ids.push(self.t.post_put(&put).unwrap());
                self.posted += 1;
            }
        }
        self.t.poll(&mut self.completed).unwrap();
        self.check_signals();
    }

    fn finish(self) -> RdmaTransport {
        let done: BTreeSet<PostId> = self.completed.iter().copied().collect();
        assert_eq!(done.len(), self.completed.len(), "rank {}: a put completed twice", self.me);
        assert_eq!(done, self.ids.iter().copied().collect::<BTreeSet<_>>(), "rank {}: every put completes", self.me);
        self.t
    }
}

fn exchange_ranks(config: SimConfig, puts: usize) -> (SimFabric, Vec<ExchangeRank>) {
    let words = 7;
    let fabric = SimFabric::new(config);
    let ranks = connect(&fabric, 2, 2 * puts * SLOT, words);
    let ranks = ranks
        .into_iter()
        .enumerate()
        .map(|(me, (t, w))| ExchangeRank::new(me, t, w, config.seed, puts, words))
        .collect();
    (fabric, ranks)
}

/// Two ranks put `puts` messages to each other at once, each in its own thread.
fn exchange(config: SimConfig, puts: usize) {
    let (fabric, ranks) = exchange_ranks(config, puts);
    let threads: Vec<_> = ranks
        .into_iter()
        .map(|mut rank| {
            std::thread::spawn(move || {
                let (mut seen, mut moved) = (rank.progress(), Instant::now());
                while !rank.done() {
                    assert!(moved.elapsed() < BOUND, "rank {}: no progress for {BOUND:?} at {seen:?}", rank.me);
                    rank.step();
                    if rank.progress() != seen {
                        (seen, moved) = (rank.progress(), Instant::now());
                    }
                }
                rank.finish()
            })
        })
        .collect();
    let transports: Vec<RdmaTransport> = threads.into_iter().map(|h| h.join().expect("rank thread")).collect();
    drop(transports);
    assert_eq!(fabric.in_flight(), 0, "every message was delivered");
}

/// The same exchange in one thread with one delivery per poll, both ranks checking their
/// signals after every delivery: a signal that lands before its data is always seen.
fn exchange_in_lockstep(config: SimConfig, puts: usize) {
    let (fabric, mut ranks) = exchange_ranks(SimConfig { deliveries_per_poll: 1, ..config }, puts);
    let progress = |ranks: &[ExchangeRank]| (ranks[0].progress(), ranks[1].progress());
    let (mut seen, mut moved) = (progress(&ranks), Instant::now());
    while !ranks.iter().all(ExchangeRank::done) {
        assert!(moved.elapsed() < BOUND, "no progress for {BOUND:?} at {seen:?}");
        for i in 0..2 {
            ranks[i].step();
            ranks[1 - i].check_signals();
        }
        if progress(&ranks) != seen {
            (seen, moved) = (progress(&ranks), Instant::now());
        }
    }
    drop(ranks.into_iter().map(ExchangeRank::finish).collect::<Vec<_>>());
    assert_eq!(fabric.in_flight(), 0, "every message was delivered");
}

#[test]
fn rc_data_never_precedes_its_signal_in_lockstep() {
    for seed in 11..=14 {
        exchange_in_lockstep(SimConfig::rc(seed), 200);
    }
}

#[test]
fn srd_data_never_precedes_its_signal_in_lockstep() {
    for seed in 11..=14 {
        exchange_in_lockstep(SimConfig::srd(seed), 200);
    }
}

#[test]
fn rc_data_never_precedes_its_signal() {
    for seed in 1..=4 {
        exchange(SimConfig::rc(seed), 300);
    }
}

#[test]
fn srd_data_never_precedes_its_signal() {
    for seed in 1..=4 {
        exchange(SimConfig::srd(seed), 300);
    }
}

#[test]
fn srd_with_a_tiny_receive_queue_still_delivers_everything() {
    let config = SimConfig { receive_queue_depth: 1, accepts: 3, ..SimConfig::srd(9) };
    exchange(config, 120);
}

/// Posting far more than the send queue takes succeeds: the rest waits in the backlog and
/// drains as completions free room; nothing is lost or reordered.
#[test]
fn full_send_queues_hold_puts_back() {
    for config in [SimConfig::rc(5), SimConfig::srd(5)] {
        let fabric = SimFabric::new(config);
        let mut ranks = connect(&fabric, 2, 400 * SLOT, 4);
        let (src, dst) = ranks.split_at_mut(1);
        let (sender, sw) = &mut src[0];
        let (receiver, rw) = &mut dst[0];
        for j in 0..200 {
            sw.fill(j * SLOT, &payload(5, 0, j));
        }
        let ids: Vec<PostId> = (0..200)
            .map(|j| sender.post_put(&put_of(1, 5, 0, j, 200, 4)).expect("a full queue is not an error"))
            .collect();
        assert!(sender.backlog(1) > 0, "{:?}: 200 puts exceed the send queue, so some must wait", config.ordering);
        let mut completed = Vec::new();
        let mut ignored = Vec::new();
        let start = Instant::now();
        while completed.len() < ids.len() {
            assert!(start.elapsed() < BOUND, "{:?}: backlog never drained", config.ordering);
            sender.poll(&mut completed).unwrap();
            receiver.poll(&mut ignored).unwrap();
        }
        let start = Instant::now();
        while rw.signals.iter().map(|s| s.load(Ordering::Acquire)).max() != Some(last_signal(200) as u64) {
            assert!(start.elapsed() < BOUND, "{:?}: the last signal never arrived", config.ordering);
            receiver.poll(&mut ignored).unwrap();
            sender.poll(&mut ignored).unwrap();
        }
        for j in 0..200 {
            let expected = payload(5, 0, j);
            assert_eq!(rw.slice((200 + j) * SLOT, expected.len()), expected, "{:?}: put {j}", config.ordering);
        }
        assert_eq!(sender.backlog(1), 0);
        let mut sorted = completed.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, ids);
    }
}

#[test]
fn a_device_that_takes_nothing_is_an_error_not_a_hang() {
    let config = SimConfig { accepts: 0, ..SimConfig::srd(3) };
    let fabric = SimFabric::new(config);
    let mut ranks = connect(&fabric, 2, 2 * SLOT, 4);
    let e = ranks[0].0.post_put(&put_of(1, 3, 0, 0, 1, 4)).unwrap_err();
    assert_eq!(e.code, mkResult_t::mkSystemError, "{e}");
    assert!(e.message.contains("ENOMEM"), "{e}");
}

/// A peer that vanishes mid-stream fails the survivor's transport with mkRemoteError
/// naming it, in bounded time, on both fabrics; later posts fail the same way.
#[test]
fn a_vanished_peer_is_a_remote_error() {
    for config in [SimConfig::rc(8), SimConfig::srd(8)] {
        let fabric = SimFabric::new(config);
        let mut ranks = connect(&fabric, 3, 100 * SLOT, 4);
        for j in 0..50 {
            ranks[0].1.fill(j * SLOT, &payload(8, 0, j));
        }
        for j in 0..20 {
            ranks[0].0.post_put(&put_of(2, 8, 0, j, 50, 4)).unwrap();
        }
        fabric.kill(2);
        for j in 20..50 {
            // Posting may already fail once a completion reported the loss.
            if ranks[0].0.post_put(&put_of(2, 8, 0, j, 50, 4)).is_err() {
                break;
            }
        }
        let start = Instant::now();
        let mut completed = Vec::new();
        let e = loop {
            assert!(start.elapsed() < BOUND, "{:?}: the loss of rank 2 never surfaced", config.ordering);
            if let Err(e) = ranks[0].0.poll(&mut completed) {
                break e;
            }
        };
        assert_eq!(e.code, mkResult_t::mkRemoteError, "{:?}: {e}", config.ordering);
        assert!(e.message.contains("rank 2"), "{e}");
        let again = ranks[0].0.post_put(&put_of(2, 8, 0, 0, 50, 4)).unwrap_err();
        assert_eq!(again.code, mkResult_t::mkRemoteError);
        assert!(completed.len() < 50, "puts to a dead rank cannot all complete");
    }
}

/// A peer advertising a wrong key: the device reports a remote access error, which the
/// transport surfaces as mkRemoteError, and no byte lands.
#[test]
fn a_bad_remote_key_is_a_remote_error() {
    for config in [SimConfig::rc(2), SimConfig::srd(2)] {
        let fabric = SimFabric::new(config);
        let mut ts: Vec<(RdmaTransport, HostWindow)> = (0..2)
            .map(|r| (RdmaTransport::over(r, 2, Box::new(fabric.endpoint(r))), HostWindow::new(SLOT, 2, 0)))
            .collect();
        for (t, w) in ts.iter_mut() {
            // SAFETY: leaked window.
            unsafe { t.register(w.window()).unwrap() };
        }
        let mut blobs: Vec<Vec<u8>> =
            vec![ts[0].0.connection_blob(&[1]).unwrap(), ts[1].0.connection_blob(&[0]).unwrap()];
        let mut wrong = RdmaBlob::decode(&blobs[1], 1).unwrap();
        wrong.data.rkey ^= 0x5a5a;
        blobs[1] = wrong.encode();
        ts[0].0.connect(&blobs, &[1]).unwrap();
        ts[1].0.connect(&blobs, &[0]).unwrap();
        ts[0].1.fill(0, &[7; 100]);
        ts[0]
            .0
            .post_put(&PutRequest { peer: 1, src_offset: 0, dst_offset: 0, bytes: 100, signal: Some((0, 1)) })
            .unwrap();
        let start = Instant::now();
        let mut done = Vec::new();
        let e = loop {
            assert!(start.elapsed() < BOUND);
            let _ = ts[1].0.poll(&mut Vec::new());
            if let Err(e) = ts[0].0.poll(&mut done) {
                break e;
            }
        };
        assert_eq!(e.code, mkResult_t::mkRemoteError, "{e}");
        assert!(e.message.contains("remote access"), "{e}");
        assert!(ts[1].1.slice(0, 100).iter().all(|&b| b == 0), "nothing lands through a wrong key");
        assert_eq!(ts[1].1.signals[0].load(Ordering::Acquire), 0, "no signal either");
    }
}

/// A put outside the peer's window is refused before anything is posted.
#[test]
fn out_of_range_puts_are_refused() {
    let fabric = SimFabric::new(SimConfig::srd(4));
    let mut ranks = connect(&fabric, 2, SLOT, 2);
    let bad = PutRequest { peer: 1, src_offset: 0, dst_offset: SLOT as u64 - 10, bytes: 11, signal: None };
    assert_eq!(ranks[0].0.post_put(&bad).unwrap_err().code, mkResult_t::mkInvalidArgument);
    let bad_signal = PutRequest { peer: 1, src_offset: 0, dst_offset: 0, bytes: 1, signal: Some((2, 1)) };
    assert_eq!(ranks[0].0.post_put(&bad_signal).unwrap_err().code, mkResult_t::mkInvalidArgument);
    assert_eq!(fabric.in_flight(), 0);
}
