//! The GEMM engine's dynamic tile schedule on the CPU: a port of the ticket hand-off in
//! `gemm_persistent` (kernels/common/gemm/engine.cuh: `ProducerWalk`, `ConsumerWalk`,
//! `ticket_at`, the courier's walk) and of the MoE kernels' counter reset
//! (kernels/moe.cu `release_tile_tickets`). One host thread per role of each CTA: the
//! producer thread takes tickets from the launch's counter, one item ahead, and hands each
//! through a ring of `kTicketSlots` slots with full/empty mbarriers (modelled with their
//! phase and arrival count) to the CTA's readers, every consumer warp and the courier.
//! Whatever the threads' timing, every item must be computed by exactly one CTA, every
//! reader of a CTA must see exactly the tickets its producer took, in order, ending with
//! one past the items, and the last CTA to arrive must leave the counter at zero for the
//! next launch. A phase mixed up shows as a wrong sequence or a hang. Keep it in step with
//! the kernels.

mod common;
use common::mbarrier::Mbarrier;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// kTicketSlots in engine.cuh.
const SLOTS: usize = 8;
/// Consumer warps per CTA (two warpgroups of four) and the courier: the empty barrier's count.
const CONSUMER_WARPS: usize = 8;

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

/// A pseudo-random pause of 0..max_us microseconds (a small LCG per thread).
fn pause(x: &mut u64, max_us: u64) {
    *x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let us = (*x >> 33) % (max_us + 1);
    if us > 0 {
        std::thread::sleep(Duration::from_micros(us));
    }
}

/// One launch of `ctas` CTAs over `items` items on the shared counters; returns per CTA the
/// items its consumers computed.
fn launch(ctas: usize, items: u64, courier: bool, next: &AtomicU64, exit: &AtomicU64, seed: u64) -> Vec<Vec<u64>> {
    let readers = CONSUMER_WARPS as u32 + courier as u32;
    let rings: Vec<Ring> = (0..ctas).map(|_| Ring::new(readers)).collect();
    let computed: Vec<Mutex<Vec<Vec<u64>>>> = (0..ctas).map(|_| Mutex::new(Vec::new())).collect();
    std::thread::scope(|s| {
        for (c, ring) in rings.iter().enumerate() {
            let computed = &computed[c];
            // A CTA: its roles in threads of their own; once all have left (the CTA's
            // __syncthreads), release_tile_tickets' arrival.
            s.spawn(move || {
                let roles = std::thread::scope(|r| {
                    let producer = r.spawn(move || {
                        let mut x = seed ^ (c as u64) << 8;
                        let mut taken = Vec::new();
                        let mut ticket = next.fetch_add(1, Ordering::Relaxed);
                        for k in 0.. {
                            let t = ticket;
                            ring.publish(k, t);
                            taken.push(t);
                            if t >= items {
                                break;
                            }
                            pause(&mut x, 30); // AWait, before started()
                            ticket = next.fetch_add(1, Ordering::Relaxed); // started(): one item ahead
                            pause(&mut x, 60); // the item's loads
                        }
                        taken
                    });
                    let warps: Vec<_> = (0..CONSUMER_WARPS + courier as usize)
                        .map(|w| {
                            r.spawn(move || {
                                let mut x = seed ^ ((c * 16 + w) as u64) << 16;
                                let mut seen = Vec::new();
                                for k in 0.. {
                                    let t = ring.ticket_at(k);
                                    seen.push(t);
                                    if t >= items {
                                        break;
                                    }
                                    pause(&mut x, 80); // the item's mainloop and epilogue, or its flags
                                }
                                seen
                            })
                        })
                        .collect();
                    let taken = producer.join().unwrap();
                    let seen: Vec<Vec<u64>> = warps.into_iter().map(|h| h.join().unwrap()).collect();
                    (taken, seen)
                });
                let (taken, seen) = roles;
                for (w, s) in seen.iter().enumerate() {
                    assert_eq!(s, &taken, "CTA {c}: reader {w} saw other tickets than its producer took");
                }
                assert!(taken.windows(2).all(|p| p[0] < p[1]), "CTA {c}: tickets increase: {taken:?}");
                assert_eq!(taken.iter().filter(|&&t| t >= items).count(), 1, "CTA {c}: one ticket ends the walk");
                computed.lock().unwrap().push(taken.into_iter().filter(|&t| t < items).collect());
                // release_tile_tickets: the last of the launch's CTAs resets both counters.
                if exit.fetch_add(1, Ordering::AcqRel) + 1 == ctas as u64 {
                    exit.store(0, Ordering::Relaxed);
                    next.store(0, Ordering::Relaxed);
                }
            });
        }
    });
    computed.into_iter().map(|m| m.into_inner().unwrap().pop().unwrap()).collect()
}

#[test]
fn every_item_once_every_reader_in_step_and_the_counter_back_at_zero() {
    let (next, exit) = (AtomicU64::new(0), AtomicU64::new(0));
    // Launches one after another on the same counters (stream order); 0 items: every CTA's
    // first ticket ends its walk.
    for (round, (ctas, items, courier)) in
        [(4, 37u64, true), (3, 0, false), (5, 120, false), (1, 9, true), (6, 5, true), (2, 64, true)]
            .into_iter()
            .enumerate()
    {
        let per_cta = launch(ctas, items, courier, &next, &exit, 0x5eed + round as u64);
        let mut all: Vec<u64> = per_cta.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..items).collect::<Vec<_>>(), "round {round}: every item exactly once");
        assert_eq!(
            (next.load(Ordering::Relaxed), exit.load(Ordering::Relaxed)),
            (0, 0),
            "round {round}: the counters are zero for the next launch"
        );
    }
}
