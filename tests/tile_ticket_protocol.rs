//! The GEMM engine's dynamic tile schedule on the CPU: a port of the ticket hand-off in
//! `gemm_persistent` (kernels/common/gemm/engine.cuh: `ProducerWalk`, `ConsumerWalk`,
//! `ticket_at`, the courier's walk) and of the MoE kernels' counter reset
//! (kernels/moe.cu `release_tile_tickets`). One host thread per role of each CTA: the
//! producer thread takes tickets from the launch's counter, one item ahead, and hands each
//! through a ring of `kTicketSlots` slots with full/empty mbarriers (modelled with their
//! phase and arrival count) to the CTA's readers, every consumer warp and the courier.
//! The readers are held back as in the kernel, since whether the ring can deadlock depends
//! on it: the producer fills a ring of `STAGES` operand stages (k-blocks) that the consumer
//! warps free one k-block late (`wgmma_wait<1>`); each consumer warpgroup's thread 0 hands
//! its previous slab to the courier when it reaches its next epilogue (or `finish`), while
//! the warpgroup's other warps wait at its named barrier; the courier takes both slabs of
//! a tile before it reads the next ticket. So the producer runs up to STAGES / k-blocks items
//! ahead of the consumers and the courier trails them: with short K the ring fills and the
//! producer waits for the courier. CTAs whose GEMM is skipped (a failed wait, an overflow)
//! take no ticket and still arrive on the exit counter.
//! Whatever the threads' timing, every item must be computed by exactly one CTA, every
//! reader of a CTA must see exactly the tickets its producer took, in order, ending with
//! one past the items, the courier must flag exactly the CTA's items, each running CTA must
//! take exactly one ticket past the items, and the last CTA to arrive must leave the counter
//! at zero for the next launch. A phase mixed up shows as a wrong sequence or a hang. Not
//! modelled: the device memory model (the mutex in `Mbarrier` orders more than
//! .release/.acquire do). Keep it in step with the kernels.

mod common;
use common::mbarrier::Mbarrier;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// kTicketSlots in engine.cuh.
const SLOTS: usize = 8;
/// Consumer warps per CTA: two warpgroups of four.
const CONSUMER_WARPS: usize = 8;
const WARPGROUP: usize = 4;

/// One CTA's ticket ring (engine.cuh `TicketRing`).
struct Ring {
    full: Vec<Mbarrier>,
    empty: Vec<Mbarrier>,
    ticket: Vec<AtomicU64>,
}

impl Ring {
    fn new(readers: u32) -> Ring {
        Ring {
            full: (0..SLOTS).map(|_| Mbarrier::new(1, "ticket ring")).collect(),
            empty: (0..SLOTS).map(|_| Mbarrier::new(readers, "ticket ring")).collect(),
            ticket: (0..SLOTS).map(|_| AtomicU64::new(u64::MAX)).collect(),
        }
    }
    /// `ProducerWalk::publish`: the k-th ticket into its slot.
    fn publish(&self, k: usize, t: u64) {
        let s = k % SLOTS;
        self.empty[s].wait((((k / SLOTS) & 1) ^ 1) as u32);
        self.ticket[s].store(t, Ordering::Relaxed);
        self.full[s].arrive(); // the mutex orders the store before the arrival, as .release does
    }
    /// `ticket_at`: the k-th ticket, then the reader's arrival on the slot's empty barrier.
    fn ticket_at(&self, k: usize) -> u64 {
        let s = k % SLOTS;
        self.full[s].wait(((k / SLOTS) & 1) as u32);
        let t = self.ticket[s].load(Ordering::Relaxed);
        self.empty[s].arrive();
        t
    }
}

/// One CTA's operand stages (engine.cuh `full` / `empty`): the producer's arrival fills a
/// stage, one arrival per consumer warp frees it.
struct Stages {
    full: Vec<Mbarrier>,
    empty: Vec<Mbarrier>,
}

impl Stages {
    fn new(stages: usize) -> Stages {
        Stages {
            full: (0..stages).map(|_| Mbarrier::new(1, "stage ring")).collect(),
            empty: (0..stages).map(|_| Mbarrier::new(CONSUMER_WARPS as u32, "stage ring")).collect(),
        }
    }
}

/// A position in a ring of barriers: slot and parity, advanced as the engine advances
/// `stage` and `phase`.
#[derive(Clone, Copy, Default)]
struct Cursor {
    slot: usize,
    phase: u32,
}

impl Cursor {
    fn advance(&mut self, slots: usize) {
        self.slot += 1;
        if self.slot == slots {
            self.slot = 0;
            self.phase ^= 1;
        }
    }
}

/// A consumer warpgroup's courier mailbox (epilogue.cuh): full (a slab handed over), empty
/// (the courier took it), and the slab's item.
struct Mailbox {
    full: Mbarrier,
    empty: Mbarrier,
    item: AtomicU64,
}

/// A warpgroup's named barrier (bar.sync over its four warps), as an mbarrier that every
/// warp arrives on and then waits for: its waits are bounded, so a hang fails the test.
struct NamedBarrier(Mbarrier);

impl NamedBarrier {
    /// `phase`: the calling warp's count of its syncs on this barrier, mod 2.
    fn sync(&self, phase: &mut u32) {
        self.0.arrive();
        self.0.wait(*phase);
        *phase ^= 1;
    }
}

/// One CTA's shared memory: the rings, the mailboxes and a named barrier per warpgroup.
struct Cta {
    ring: Ring,
    stages: Stages,
    boxes: [Mailbox; 2],
    named: [NamedBarrier; 2],
}

impl Cta {
    fn new(courier: bool, stages: usize) -> Cta {
        let mailbox = || Mailbox {
            full: Mbarrier::new(1, "courier mailbox"),
            empty: Mbarrier::new(1, "courier mailbox"),
            item: AtomicU64::new(u64::MAX),
        };
        Cta {
            ring: Ring::new(CONSUMER_WARPS as u32 + courier as u32),
            stages: Stages::new(stages),
            boxes: [mailbox(), mailbox()],
            named: [(); 2].map(|_| NamedBarrier(Mbarrier::new(WARPGROUP as u32, "named barrier"))),
        }
    }
}

/// A pseudo-random pause of 0..max_us microseconds (a small LCG per thread).
fn pause(x: &mut u64, max_us: u64) {
    *x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let us = (*x >> 33) % (max_us + 1);
    if us > 0 {
        std::thread::sleep(Duration::from_micros(us));
    }
}

/// One launch on the shared counters.
#[derive(Clone, Copy, Debug)]
struct Launch {
    /// GEMM CTAs; the first `skipped` of them skip their GEMM (they take no ticket).
    ctas: usize,
    skipped: usize,
    items: u64,
    /// Whether the epilogue flags its slabs (the combine's courier reads the tickets too).
    courier: bool,
    /// Operand stages and k-blocks per item: the producer runs about stages / k_blocks
    /// items ahead of the consumers.
    stages: usize,
    k_blocks: usize,
}

/// The producer thread: returns the tickets it took (handed over), in order.
fn producer(cta: &Cta, l: Launch, next: &AtomicU64, mut x: u64) -> Vec<u64> {
    let mut taken = Vec::new();
    let mut stage = Cursor::default();
    let mut ticket = next.fetch_add(1, Ordering::Relaxed); // ProducerWalk's constructor
    for k in 0.. {
        let t = ticket;
        cta.ring.publish(k, t);
        taken.push(t);
        if t >= l.items {
            break;
        }
        pause(&mut x, 30); // AWait, before started()
        ticket = next.fetch_add(1, Ordering::Relaxed); // started(): one item ahead
        for _ in 0..l.k_blocks {
            cta.stages.empty[stage.slot].wait(stage.phase ^ 1);
            pause(&mut x, 5); // the TMA loads
            cta.stages.full[stage.slot].arrive();
            stage.advance(l.stages);
        }
    }
    taken
}

/// Thread 0 of a consumer warpgroup (TmaEpilogue `signal_pending`): hands the pending slab
/// to the courier once it took the previous one.
fn hand_over(mailbox: &Mailbox, pending: &mut Option<u64>, box_phase: &mut u32) {
    if let Some(item) = pending.take() {
        mailbox.empty.wait(*box_phase ^ 1);
        mailbox.item.store(item, Ordering::Relaxed);
        mailbox.full.arrive();
        *box_phase ^= 1;
    }
}

/// Consumer warp `w`: returns the tickets it read, in order.
fn consumer(cta: &Cta, l: Launch, w: usize, mut x: u64) -> Vec<u64> {
    let (group, leader) = (w / WARPGROUP, w % WARPGROUP == 0);
    let mut seen = Vec::new();
    let mut stage = Cursor::default();
    let (mut pending, mut box_phase, mut named_phase) = (None, 0u32, 0u32);
    for k in 0.. {
        let t = cta.ring.ticket_at(k);
        seen.push(t);
        if t >= l.items {
            break;
        }
        // The mainloop: a stage is freed once the next k-block's wgmmas are issued.
        let mut prev: Option<usize> = None;
        for _ in 0..l.k_blocks {
            cta.stages.full[stage.slot].wait(stage.phase);
            pause(&mut x, 10);
            if let Some(p) = prev {
                cta.stages.empty[p].arrive();
            }
            prev = Some(stage.slot);
            stage.advance(l.stages);
        }
        cta.stages.empty[prev.unwrap()].arrive();
        // The epilogue: thread 0 hands over the previous slab, then the warpgroup's barriers.
        if l.courier && leader {
            hand_over(&cta.boxes[group], &mut pending, &mut box_phase);
        }
        cta.named[group].sync(&mut named_phase);
        pause(&mut x, 10);
        cta.named[group].sync(&mut named_phase);
        if leader {
            pending = Some(t);
        }
    }
    // finish
    if l.courier && leader {
        hand_over(&cta.boxes[group], &mut pending, &mut box_phase);
    }
    seen
}

/// The courier: one tile's two slabs per ticket; returns the tickets it read and per
/// warpgroup the items it flagged.
fn courier(cta: &Cta, l: Launch, mut x: u64) -> (Vec<u64>, [Vec<u64>; 2]) {
    let (mut seen, mut flagged) = (Vec::new(), [Vec::new(), Vec::new()]);
    let mut box_phase = 0u32;
    for k in 0.. {
        let t = cta.ring.ticket_at(k);
        seen.push(t);
        if t >= l.items {
            break;
        }
        for (c, mailbox) in cta.boxes.iter().enumerate() {
            mailbox.full.wait(box_phase);
            flagged[c].push(mailbox.item.load(Ordering::Relaxed));
            pause(&mut x, 20); // the slab's flag
            mailbox.empty.arrive();
        }
        box_phase ^= 1;
    }
    (seen, flagged)
}

/// One launch on the shared counters; returns per running CTA the items its consumers
/// computed.
fn launch(l: Launch, next: &AtomicU64, exit: &AtomicU64, seed: u64) -> Vec<Vec<u64>> {
    let ctas: Vec<Cta> = (0..l.ctas).map(|_| Cta::new(l.courier, l.stages)).collect();
    let computed = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for (c, cta) in ctas.iter().enumerate() {
            let computed = &computed;
            // A CTA: its roles in threads of their own; once all have left (the CTA's
            // __syncthreads), release_tile_tickets' arrival.
            s.spawn(move || {
                if c >= l.skipped {
                    let (taken, seen, courier_seen) = std::thread::scope(|r| {
                        let producer = r.spawn(move || producer(cta, l, next, seed ^ (c as u64) << 8));
                        let warps: Vec<_> = (0..CONSUMER_WARPS)
                            .map(|w| r.spawn(move || consumer(cta, l, w, seed ^ ((c * 16 + w) as u64) << 16)))
                            .collect();
                        let courier = l.courier.then(|| r.spawn(move || courier(cta, l, seed ^ (c as u64) << 40)));
                        let taken = producer.join().unwrap();
                        let seen: Vec<Vec<u64>> = warps.into_iter().map(|h| h.join().unwrap()).collect();
                        (taken, seen, courier.map(|h| h.join().unwrap()))
                    });
                    for (w, s) in seen.iter().enumerate() {
                        assert_eq!(s, &taken, "CTA {c}: consumer warp {w} saw other tickets than its producer took");
                    }
                    assert!(taken.windows(2).all(|p| p[0] < p[1]), "CTA {c}: tickets increase: {taken:?}");
                    assert_eq!(taken.iter().filter(|&&t| t >= l.items).count(), 1, "CTA {c}: one ticket ends the walk");
                    let items: Vec<u64> = taken.into_iter().filter(|&t| t < l.items).collect();
                    if let Some((courier_seen, flagged)) = courier_seen {
                        assert_eq!(courier_seen[..items.len()], items[..], "CTA {c}: the courier's tickets");
                        for f in &flagged {
                            assert_eq!(f, &items, "CTA {c}: the courier flags the CTA's items, in order");
                        }
                    }
                    computed.lock().unwrap().push(items);
                }
                // release_tile_tickets: the last of the launch's CTAs resets both counters.
                if exit.fetch_add(1, Ordering::AcqRel) + 1 == l.ctas as u64 {
                    let running = (l.ctas - l.skipped) as u64;
                    assert_eq!(
                        next.load(Ordering::Relaxed),
                        l.items + running,
                        "every running CTA takes the items it computes and one ticket past them"
                    );
                    exit.store(0, Ordering::Relaxed);
                    next.store(0, Ordering::Relaxed);
                }
            });
        }
    });
    computed.into_inner().unwrap()
}

#[test]
fn every_item_once_every_reader_in_step_and_the_counter_back_at_zero() {
    let (next, exit) = (AtomicU64::new(0), AtomicU64::new(0));
    // Launches one after another on the same counters (stream order), as dispatch and
    // combine alternate; 0 items: every CTA's first ticket ends its walk. One k-block per
    // item with 8 stages lets the producer run past the ticket ring, which must then wait
    // for its slowest reader (the courier) without a deadlock.
    let launches = [
        Launch { ctas: 4, skipped: 0, items: 37, courier: true, stages: 3, k_blocks: 4 },
        Launch { ctas: 3, skipped: 0, items: 0, courier: false, stages: 6, k_blocks: 2 },
        Launch { ctas: 5, skipped: 2, items: 120, courier: false, stages: 8, k_blocks: 1 },
        Launch { ctas: 1, skipped: 0, items: 9, courier: true, stages: 8, k_blocks: 1 },
        Launch { ctas: 6, skipped: 1, items: 5, courier: true, stages: 3, k_blocks: 2 },
        Launch { ctas: 2, skipped: 0, items: 64, courier: true, stages: 8, k_blocks: 1 },
        Launch { ctas: 3, skipped: 3, items: 0, courier: true, stages: 3, k_blocks: 1 },
        Launch { ctas: 4, skipped: 0, items: 50, courier: true, stages: 6, k_blocks: 3 },
    ];
    for (round, l) in launches.into_iter().enumerate() {
        let per_cta = launch(l, &next, &exit, 0x5eed + round as u64);
        let mut all: Vec<u64> = per_cta.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..l.items).collect::<Vec<_>>(), "round {round} {l:?}: every item exactly once");
        assert_eq!(
            (next.load(Ordering::Relaxed), exit.load(Ordering::Relaxed)),
            (0, 0),
            "round {round}: the counters are zero for the next launch"
        );
    }
}
