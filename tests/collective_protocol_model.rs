//! A model of one CTA slot of kernels/collectives.cu's two protocols, run under random
//! interleavings of the ranks' steps, with calls of either protocol in any order on the
//! same step counter: every read must see the data its writer wrote for that step (so no
//! write lands on a slot or line before its last reader is done), and some rank can always
//! move until all are done (no deadlock). It checks the argument the kernel's comments make
//! for the low-latency protocol's missing free-slot wait, and that the FREE it posts keeps
//! the simple protocol's slot reuse sound after it.
//!
//! The model, per rank r and step s (parity s & 1), for AllReduce (the simple protocol's
//! longest form):
//! - simple: wait FREE ≥ s − 2 from every peer; stage own data into own slot; post READY = s;
//!   wait every peer's READY ≥ s; read every peer's slot; stage the reduced slice; post
//!   READY2 = s; wait every READY2 ≥ s; read every peer's reduced slice; post FREE = s.
//! - low latency: write a line {s, data} into every peer's LL area for parity s & 1, source
//!   r; wait until every peer's line in own area has flag == s and read it; post FREE = s.
//!
//! Every read is two actions (its start and its end), each of which must see the expected
//! value, so a write landing in the middle of a read is caught too.

use std::collections::HashMap;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Protocol {
    Simple,
    LowLatency,
}

/// What a location holds: the writer, the step and the kind of value (distinct per kind).
type Value = (usize, u64, u8);
const STAGED: u8 = 0;
const REDUCED: u8 = 1;
const LINE: u8 = 2;

/// Shared memory of all ranks: data locations and flag words.
#[derive(Default)]
struct Memory {
    /// (owner, parity, kind) for the simple slots; (owner, parity, source) for LL lines.
    slots: HashMap<(usize, u64, u8), Value>,
    lines: HashMap<(usize, u64, usize), (u64, Value)>,
    /// (owner, word, source) -> value: READY, READY2, FREE flags in the owner's region.
    flags: HashMap<(usize, u8, usize), u64>,
}

const READY: u8 = 0;
const READY2: u8 = 1;
const FREE: u8 = 2;

impl Memory {
    fn flag(&self, owner: usize, word: u8, source: usize) -> u64 {
        self.flags.get(&(owner, word, source)).copied().unwrap_or(0)
    }
}

/// One rank's program: a list of atomic actions per step, executed in order.
#[derive(Clone, Copy, Debug)]
enum Action {
    WaitFlag { word: u8, at_least: u64 },
    Stage { kind: u8 },
    Post { word: u8 },
    ReadSlot { peer: usize, kind: u8, end: bool },
    PutLine { peer: usize },
    ReadLine { peer: usize, end: bool },
}

fn program(rank: usize, n: usize, protocols: &[Protocol]) -> Vec<(u64, Action)> {
    let peers: Vec<usize> = (0..n).filter(|&q| q != rank).collect();
    let mut p = Vec::new();
    for (i, &protocol) in protocols.iter().enumerate() {
        let s = i as u64 + 1;
        let mut push = |a: Action| p.push((s, a));
        match protocol {
            Protocol::Simple => {
                push(Action::WaitFlag { word: FREE, at_least: s.saturating_sub(2) });
                push(Action::Stage { kind: STAGED });
                push(Action::Post { word: READY });
                push(Action::WaitFlag { word: READY, at_least: s });
                for &q in &peers {
                    push(Action::ReadSlot { peer: q, kind: STAGED, end: false });
                    push(Action::ReadSlot { peer: q, kind: STAGED, end: true });
                }
                push(Action::Stage { kind: REDUCED });
                push(Action::Post { word: READY2 });
                push(Action::WaitFlag { word: READY2, at_least: s });
                for &q in &peers {
                    push(Action::ReadSlot { peer: q, kind: REDUCED, end: false });
                    push(Action::ReadSlot { peer: q, kind: REDUCED, end: true });
                }
                push(Action::Post { word: FREE });
            }
            Protocol::LowLatency => {
                for &q in &peers {
                    push(Action::PutLine { peer: q });
                }
                for &q in &peers {
                    push(Action::ReadLine { peer: q, end: false });
                    push(Action::ReadLine { peer: q, end: true });
                }
                push(Action::Post { word: FREE });
            }
        }
    }
    p
}

/// Whether `a` of rank r at step s can run now (waits); runs it when it can. A read that
/// sees the wrong value is an error.
fn try_run(m: &mut Memory, r: usize, n: usize, s: u64, a: Action) -> Result<bool, String> {
    let parity = s & 1;
    match a {
        Action::WaitFlag { word, at_least } => Ok((0..n).filter(|&q| q != r).all(|q| m.flag(r, word, q) >= at_least)),
        Action::Stage { kind } => {
            m.slots.insert((r, parity, kind), (r, s, kind));
            Ok(true)
        }
        Action::Post { word } => {
            for q in (0..n).filter(|&q| q != r) {
                m.flags.insert((q, word, r), s);
            }
            Ok(true)
        }
        Action::ReadSlot { peer, kind, end } => match m.slots.get(&(peer, parity, kind)) {
            Some(&v) if v == (peer, s, kind) => Ok(true),
            other => Err(format!(
                "rank {r} step {s}: {} of reading rank {peer}'s slot (kind {kind}) saw {other:?}",
                if end { "end" } else { "start" }
            )),
        },
        Action::PutLine { peer } => {
            m.lines.insert((peer, parity, r), (s, (r, s, LINE)));
            Ok(true)
        }
        Action::ReadLine { peer, end } => match m.lines.get(&(r, parity, peer)) {
            // The kernel polls for flag == s: anything else is "not yet".
            Some(&(flag, v)) if flag == s => {
                if v == (peer, s, LINE) {
                    Ok(true)
                } else {
                    Err(format!("rank {r} step {s}: line from {peer} carries step {s} but holds {v:?}"))
                }
            }
            Some(&(flag, _)) if end => {
                Err(format!("rank {r} step {s}: the line from {peer} changed to step {flag} while being read"))
            }
            _ => Ok(false),
        },
    }
}

/// Runs every rank's program under one random interleaving; Err on a wrong read or a
/// deadlock.
fn run(n: usize, protocols: &[Protocol], seed: u64) -> Result<(), String> {
    let programs: Vec<_> = (0..n).map(|r| program(r, n, protocols)).collect();
    let mut pc = vec![0usize; n];
    let mut m = Memory::default();
    let mut rng = seed | 1;
    loop {
        let live: Vec<usize> = (0..n).filter(|&r| pc[r] < programs[r].len()).collect();
        if live.is_empty() {
            return Ok(());
        }
        // Try the live ranks in a random rotation; the first that can move does.
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let start = (rng % live.len() as u64) as usize;
        let mut moved = false;
        for i in 0..live.len() {
            let r = live[(start + i) % live.len()];
            let (s, a) = programs[r][pc[r]];
            if try_run(&mut m, r, n, s, a)? {
                pc[r] += 1;
                moved = true;
                break;
            }
        }
        if !moved {
            return Err(format!("deadlock at {:?}", (0..n).map(|r| programs[r].get(pc[r])).collect::<Vec<_>>()));
        }
    }
}

#[test]
fn any_mix_of_the_two_protocols_reads_what_was_written_and_never_deadlocks() {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for n in 2..=4 {
        for case in 0..300 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let steps = 1 + (rng % 7) as usize;
            let protocols: Vec<Protocol> = (0..steps)
                .map(|i| if (rng >> (8 + i)) & 1 == 1 { Protocol::LowLatency } else { Protocol::Simple })
                .collect();
            for seed in 0..20u64 {
                run(n, &protocols, rng ^ seed.wrapping_mul(0x2545_f491_4f6c_dd1d))
                    .unwrap_or_else(|e| panic!("n {n} case {case} {protocols:?} seed {seed}: {e}"));
            }
        }
    }
}

/// The model can fail: without the FREE a low-latency step posts, a simple step after two
/// low-latency ones waits for a FREE of step s − 2 that nobody posts.
#[test]
fn low_latency_steps_without_their_free_post_deadlock_the_simple_step_after() {
    let n = 2;
    let protocols = [Protocol::LowLatency, Protocol::LowLatency, Protocol::Simple];
    let programs: Vec<Vec<(u64, Action)>> = (0..n)
        .map(|r| {
            program(r, n, &protocols)
                .into_iter()
                .filter(|&(s, a)| !(s <= 2 && matches!(a, Action::Post { word: FREE })))
                .collect()
        })
        .collect();
    let mut pc = vec![0usize; n];
    let mut m = Memory::default();
    let outcome = loop {
        if (0..n).all(|r| pc[r] == programs[r].len()) {
            break Ok(());
        }
        let mut moved = false;
        for r in 0..n {
            if pc[r] < programs[r].len() {
                let (s, a) = programs[r][pc[r]];
                if try_run(&mut m, r, n, s, a).unwrap() {
                    pc[r] += 1;
                    moved = true;
                }
            }
        }
        if !moved {
            break Err(pc.clone());
        }
    };
    assert!(outcome.is_err(), "the FREE of the low-latency steps is what lets step 3 reuse its slot");
    // With the posts, the same sequence completes.
    run(n, &protocols, 7).unwrap();
}
