//! The MoE dispatch's prep on the CPU: a port of kernels/moe.cu `prep` and `prep_tables`
//! (the token passes over CTAs, the column scans, CTA 0's count exchange and offsets) and of
//! the end-of-kernel handshake (`mk_op_epoch_end`) that orders one rank's launch against its
//! peers' next. One host thread per CTA of each rank; the ranks run their launches
//! concurrently, each rank's launches in order (stream order), with random pauses between
//! steps. The prep CTAs' four waits share one arrival counter (`MOE_PREP_ARRIVE`): the last
//! arrival of a barrier sets it back to zero before it raises the barrier's flag, and the
//! next barrier's arrivals come after the wait for that flag.
//! Whatever the timing, after every launch each rank's layout words (rows at the owners,
//! the send list and its starts, the receive counts) must equal the host mirrors
//! (`ops::moe::device_layout`, `send_tables`); a launch whose receive buffers are too small
//! must report the overflow on every rank and write nothing else; in drop mode the rows the
//! drop rule drops (`ops::moe::kept`) must have no owner and no send entry, and the drop
//! counts must equal `ops::moe::drop_counts`; every counter must be back at zero. A barrier miscounted shows as a hang (bounded here) or wrong words.
//! Not modelled: the device memory model (flags are SeqCst atomics here), the senders and
//! the GEMM. Keep it in step with the kernel.

use mkernel::ops::moe::{device_layout, drop_counts, prep_split, send_tables, MoeShape, ROW_BLOCK};
use mkernel_tools::testing::collective_values::splitmix;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

/// Warps per CTA doing the column scans (the kernel's MOE_WARPS is 12; fewer here so that
/// several CTAs share the experts).
const WARPS: usize = 2;
/// Threads per CTA as `prep_split` sees them: small, so that a launch has several prep CTAs.
const THREADS: usize = 8;

fn words(n: usize, v: i32) -> Vec<AtomicI32> {
    (0..n).map(|_| AtomicI32::new(v)).collect()
}

/// Random draws: SplitMix64 of a counter.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        splitmix(self.0)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pause(&mut self) {
        match self.below(8) {
            0 => std::thread::sleep(Duration::from_micros(self.below(200) as u64)),
            1 | 2 => std::thread::yield_now(),
            _ => {}
        }
    }
}

/// One rank's signal words and buffers that outlive a launch.
struct Rank {
    epoch: AtomicU64,
    arrive: AtomicU64,
    prep_arrive: AtomicU64,
    counted: AtomicU64,
    scanned: AtomicU64,
    offsets: AtomicU64,
    prep: AtomicU64,
    /// MOE_DONE + q: rank q finished MoE kernel e.
    done: Vec<AtomicU64>,
    /// MOE_CNT + s: rank s wrote its counts here.
    cnt_flag: Vec<AtomicU64>,
    /// The count-exchange area: [n][E] exchanged counts, then the prep's scratch.
    area: Vec<AtomicI32>,
}

/// One launch's inputs and the caller's buffers on one rank.
struct Launch {
    ids: Vec<i32>,
    k: usize,
    experts: usize,
    capacity: usize,
    /// Drop mode's cap (MoeParams::expert_capacity); None: no-drop mode.
    expert_capacity: Option<usize>,
    split_ctas: usize,
    tokens_per_cta: usize,
    grid: usize,
    lay_dest: Vec<AtomicI32>,
    lay_row: Vec<AtomicI32>,
    send: Vec<AtomicI32>,
    send_row0: Vec<AtomicI32>,
    recv_counts: Vec<AtomicI32>,
    drop_counts: Vec<AtomicI32>,
    overflow: AtomicI32,
}

fn wait(flag: &AtomicU64, target: u64, what: &str) {
    let t0 = Instant::now();
    while flag.load(SeqCst) < target {
        assert!(t0.elapsed() < Duration::from_secs(20), "a wait for {what} >= {target} never ended");
        std::thread::yield_now();
    }
}

/// `prep_barrier`: arrive; the last of `ctas` arrivals resets the counter, then raises `flag`.
fn barrier(r: &Rank, flag: &AtomicU64, epoch: u64, ctas: usize, what: &str) {
    if r.prep_arrive.fetch_add(1, SeqCst) + 1 == ctas as u64 {
        r.prep_arrive.store(0, SeqCst);
        flag.store(epoch, SeqCst);
    }
    wait(flag, epoch, what);
}

/// CTA `c` of rank `me` in the launch of `epoch` (`prep`, `prep_tables`, the end handshake).
fn cta(ranks: &[Rank], me: usize, c: usize, l: &Launch, epoch: u64, rng: &mut Rng) {
    let (n, e_all, k) = (ranks.len(), l.experts, l.k);
    let el = e_all / n;
    let r = &ranks[me];
    let p = l.split_ctas;
    let scratch = n * e_all; // cta counts [p][E], totals [E], first rows [E]
    let (total, first_row) = (scratch + p * e_all, scratch + (p + 1) * e_all);
    if c < p {
        // Pass 1: this CTA's tokens, positions among its tokens of each expert.
        let tokens = l.ids.len() / k;
        let (t0, t1) = ((c * l.tokens_per_cta).min(tokens), ((c + 1) * l.tokens_per_cta).min(tokens));
        let mut run = vec![0i32; e_all];
        for t in t0..t1 {
            let ids = &l.ids[t * k..(t + 1) * k];
            for (j, &e) in ids.iter().enumerate() {
                if e < 0 {
                    l.lay_dest[t * k + j].store(-1, SeqCst);
                    l.lay_row[t * k + j].store(-1, SeqCst);
                    continue;
                }
                let e = e as usize;
                let pos = match ids[..j].iter().position(|&u| u as usize == e && u >= 0) {
                    Some(u) => l.lay_row[t * k + u].load(SeqCst),
                    None => {
                        run[e] += 1;
                        run[e] - 1
                    }
                };
                l.lay_dest[t * k + j].store((e / el) as i32, SeqCst);
                l.lay_row[t * k + j].store(pos, SeqCst);
            }
            rng.pause();
        }
        for (e, &v) in run.iter().enumerate() {
            r.area[scratch + c * e_all + e].store(v, SeqCst);
        }
        barrier(r, &r.counted, epoch, p, "the counts");
        // Column scans: warp w of CTA c takes experts c * WARPS + w, then every p * WARPS-th.
        for w in 0..WARPS {
            for e in (c * WARPS + w..e_all).step_by(p * WARPS) {
                let mut carry = 0;
                for i in 0..p {
                    let v = r.area[scratch + i * e_all + e].load(SeqCst);
                    r.area[scratch + i * e_all + e].store(carry, SeqCst);
                    carry += v;
                }
                r.area[total + e].store(carry, SeqCst);
            }
        }
        rng.pause();
        barrier(r, &r.scanned, epoch, p, "the scans");
        if c == 0 {
            tables(ranks, me, l, epoch, rng);
        } else {
            wait(&r.offsets, epoch, "the offsets");
        }
        if l.overflow.load(SeqCst) == 0 {
            // Pass 2: rows at the owners and the send list.
            for t in t0..t1 {
                let ids = &l.ids[t * k..(t + 1) * k];
                for (j, &e) in ids.iter().enumerate() {
                    if e < 0 {
                        continue;
                    }
                    let e = e as usize;
                    let (i, d) = (t * k + j, e / el);
                    let before = r.area[scratch + c * e_all + e].load(SeqCst);
                    let pos = l.lay_row[i].load(SeqCst);
                    let room = l.expert_capacity.map_or(i32::MAX, |cap| cap as i32 - before);
                    if pos >= room {
                        l.lay_dest[i].store(-1, SeqCst);
                        l.lay_row[i].store(-1, SeqCst);
                        continue;
                    }
                    l.lay_row[i].store(pos + before + r.area[first_row + e].load(SeqCst), SeqCst);
                    if !ids[..j].iter().any(|&u| u as usize == e && u >= 0) {
                        let q = (e - d * el) * n + (d + n - me) % n;
                        let slot = l.send_row0[q].load(SeqCst) + before + pos;
                        l.send[slot as usize].store(i as i32, SeqCst);
                    }
                }
                rng.pause();
            }
        }
        barrier(r, &r.prep, epoch, p, "the layout");
    } else {
        wait(&r.prep, epoch, "the layout");
    }
    rng.pause();
    // mk_op_epoch_end: the last CTA of the grid advances the epoch and tells every peer.
    if r.arrive.fetch_add(1, SeqCst) + 1 == l.grid as u64 {
        r.arrive.store(0, SeqCst);
        r.epoch.store(epoch, SeqCst);
        for (q, peer) in ranks.iter().enumerate() {
            if q != me {
                peer.done[me].store(epoch, SeqCst);
            }
        }
    }
}

/// `prep_tables` without the m-block tables: the exchange, the offsets, the overflow.
fn tables(ranks: &[Rank], me: usize, l: &Launch, epoch: u64, rng: &mut Rng) {
    let (n, e_all) = (ranks.len(), l.experts);
    let el = e_all / n;
    let r = &ranks[me];
    let scratch = n * e_all;
    let p = l.split_ctas;
    let rows: Vec<i32> = (0..e_all).map(|e| r.area[scratch + p * e_all + e].load(SeqCst)).collect();
    let run: Vec<i32> = rows.iter().map(|&v| l.expert_capacity.map_or(v, |cap| v.min(cap as i32))).collect();
    for e in 0..e_all {
        l.drop_counts[e].store(rows[e] - run[e], SeqCst);
    }
    for q in (0..n).filter(|&q| q != me) {
        wait(&r.done[q], epoch - 1, "a peer's previous kernel");
    }
    for peer in ranks {
        for (e, &v) in run.iter().enumerate() {
            peer.area[me * e_all + e].store(v, SeqCst);
        }
        peer.cnt_flag[me].store(epoch, SeqCst);
    }
    rng.pause();
    for s in 0..n {
        wait(&r.cnt_flag[s], epoch, "a rank's counts");
    }
    let cnt: Vec<i32> = (0..n * e_all).map(|i| r.area[i].load(SeqCst)).collect();
    let (mut off, mut needed, mut overflow) = (vec![0i32; e_all], 0, 0);
    for d in 0..n {
        let mut base = 0;
        for le in 0..el {
            let e = d * el + le;
            let mut rows = 0;
            for s in 0..n {
                if s == me {
                    off[e] = base + rows;
                }
                rows += cnt[s * e_all + e];
            }
            base += (rows + ROW_BLOCK as i32 - 1) / ROW_BLOCK as i32 * ROW_BLOCK as i32;
        }
        needed = needed.max(base);
        if base as usize > l.capacity {
            overflow = d as i32 + 1;
        }
    }
    for le in 0..el {
        l.recv_counts[le].store((0..n).map(|s| cnt[s * e_all + me * el + le]).sum(), SeqCst);
    }
    l.recv_counts[el].store(needed, SeqCst);
    l.overflow.store(overflow, SeqCst);
    let mut start = 0;
    for q in 0..e_all {
        l.send_row0[q].store(start, SeqCst);
        start += run[((me + q % n) % n) * el + q / n];
    }
    l.send_row0[e_all].store(start, SeqCst);
    for (e, &o) in off.iter().enumerate() {
        r.area[scratch + (p + 1) * e_all + e].store(o, SeqCst);
    }
    r.offsets.store(epoch, SeqCst);
}

/// Every rank's routing of launch `launch`: skewed (one hot expert), -1s and repeats.
fn routing(seed: u64, n: usize, tokens: usize, k: usize, experts: usize) -> Vec<Vec<i32>> {
    let mut rng = Rng(seed);
    let hot = rng.below(experts);
    (0..n)
        .map(|_| {
            let mut v: Vec<i32> = Vec::with_capacity(tokens * k);
            for _ in 0..tokens {
                for j in 0..k {
                    let roll = rng.below(100);
                    v.push(if roll < 30 {
                        hot as i32
                    } else if roll < 38 {
                        -1
                    } else if roll < 44 && j > 0 {
                        v[v.len() - 1]
                    } else {
                        rng.below(experts) as i32
                    });
                }
            }
            v
        })
        .collect()
}

fn run(n: usize, experts: usize, k: usize, grid: usize, launches: u64, seed: u64) {
    let area = 64 << 10 >> 2;
    let ranks: Vec<Rank> = (0..n)
        .map(|_| Rank {
            epoch: AtomicU64::new(0),
            arrive: AtomicU64::new(0),
            prep_arrive: AtomicU64::new(0),
            counted: AtomicU64::new(0),
            scanned: AtomicU64::new(0),
            offsets: AtomicU64::new(0),
            prep: AtomicU64::new(0),
            done: (0..n).map(|_| AtomicU64::new(0)).collect(),
            cnt_flag: (0..n).map(|_| AtomicU64::new(0)).collect(),
            area: words(area, -7),
        })
        .collect();
    // The same inputs on every rank's thread: tokens, routing and capacity per launch.
    let plan = |epoch: u64| {
        let mut rng = Rng(seed ^ (epoch * 7919));
        let tokens = 1 + rng.below(60);
        let all = routing(seed * 31 + epoch, n, tokens, k, experts);
        // Every third launch in drop mode, with a cap from 1 row to a few more than a rank
        // sends one expert.
        let expert_capacity = (epoch % 3 == 2).then(|| 1 + rng.below(tokens / 2 + 2));
        let shape = MoeShape { expert_capacity, ..MoeShape::new(tokens, k, experts, n) };
        let needed = device_layout(&shape, &all, 0).unwrap().rows_needed;
        // Every fourth launch a receive buffer one block too small.
        let capacity = if epoch % 4 == 3 && needed >= ROW_BLOCK { needed - ROW_BLOCK } else { needed };
        (tokens, all, capacity, expert_capacity)
    };
    // Some drop launch drops rows (else the drop checks below would check nothing).
    let dropping = (1..=launches).any(|epoch| {
        let (tokens, all, _, expert_capacity) = plan(epoch);
        let shape = MoeShape { expert_capacity, ..MoeShape::new(tokens, k, experts, n) };
        all.iter().any(|ids| drop_counts(&shape, ids).iter().any(|&d| d > 0))
    });
    assert!(dropping, "no launch of seed {seed} drops a row");
    std::thread::scope(|s| {
        for me in 0..n {
            let ranks = &ranks;
            s.spawn(move || {
                for epoch in 1..=launches {
                    let (tokens, all, capacity, expert_capacity) = plan(epoch);
                    let split = prep_split(tokens, experts, n, grid, THREADS);
                    let l = Launch {
                        ids: all[me].clone(),
                        k,
                        experts,
                        capacity,
                        expert_capacity,
                        split_ctas: split.ctas,
                        tokens_per_cta: split.tokens_per_cta,
                        grid,
                        lay_dest: words(tokens * k, -9),
                        lay_row: words(tokens * k, -9),
                        send: words(tokens * k, -9),
                        send_row0: words(experts + 1, -9),
                        recv_counts: words(experts / n + 1, -9),
                        drop_counts: words(experts, -9),
                        overflow: AtomicI32::new(-9),
                    };
                    std::thread::scope(|s| {
                        for c in 0..grid {
                            let l = &l;
                            s.spawn(move || {
                                let mut rng = Rng(seed ^ (epoch << 20) ^ ((me as u64) << 10) ^ c as u64);
                                cta(ranks, me, c, l, epoch, &mut rng);
                            });
                        }
                    });
                    check(&ranks[me], me, &l, &all, tokens, capacity, expert_capacity, epoch);
                }
            });
        }
    });
}

#[allow(clippy::too_many_arguments)]
fn check(
    r: &Rank,
    me: usize,
    l: &Launch,
    all: &[Vec<i32>],
    tokens: usize,
    capacity: usize,
    expert_capacity: Option<usize>,
    epoch: u64,
) {
    let (n, k, experts) = (all.len(), l.k, l.experts);
    let at = format!(
        "rank {me} of {n}, launch {epoch}, {tokens} tokens, {} prep CTAs, expert capacity {expert_capacity:?}",
        l.split_ctas
    );
    let shape = MoeShape { expert_capacity, ..MoeShape::new(tokens, k, experts, n) };
    let want = device_layout(&shape, all, me).unwrap();
    let get = |v: &[AtomicI32]| v.iter().map(|x| x.load(SeqCst)).collect::<Vec<i32>>();
    let dropped: Vec<i32> = drop_counts(&shape, &all[me]).iter().map(|&v| v as i32).collect();
    assert_eq!(get(&l.drop_counts), dropped, "drop counts (written in both outcomes): {at}");
    assert_eq!(r.prep_arrive.load(SeqCst), 0, "the prep's counter is back at zero: {at}");
    assert_eq!(r.arrive.load(SeqCst), 0, "the end counter is back at zero: {at}");
    assert_eq!(get(&l.recv_counts)[experts / n], want.rows_needed as i32, "rows needed: {at}");
    if want.rows_needed > capacity {
        assert!(l.overflow.load(SeqCst) > 0, "the overflow is reported: {at}");
        assert!(get(&l.send).iter().all(|&v| v == -9), "nothing is listed to send after an overflow: {at}");
        return;
    }
    assert_eq!(l.overflow.load(SeqCst), 0, "{at}");
    let counts: Vec<i32> = want.recv_counts.iter().map(|&c| c as i32).collect();
    assert_eq!(get(&l.recv_counts)[..experts / n], counts[..], "receive counts: {at}");
    let (dest, row): (Vec<i32>, Vec<i32>) =
        want.slots.iter().map(|s| s.map_or((-1, -1), |(d, row)| (d as i32, row as i32))).unzip();
    assert_eq!(get(&l.lay_dest), dest, "owners: {at}");
    assert_eq!(get(&l.lay_row), row, "rows at the owners: {at}");
    let (row0, send) = send_tables(&shape, &all[me], me);
    assert_eq!(get(&l.send_row0), row0.iter().map(|&v| v as i32).collect::<Vec<_>>(), "send list starts: {at}");
    assert_eq!(get(&l.send)[..send.len()], send.iter().map(|&v| v as i32).collect::<Vec<_>>()[..], "send list: {at}");
}

#[test]
fn one_rank_several_prep_ctas() {
    run(1, 8, 3, 5, 12, 1);
}

#[test]
fn ranks_prep_and_exchange_concurrently() {
    run(2, 8, 2, 4, 10, 2);
    run(3, 12, 4, 6, 8, 3);
}

#[test]
fn more_experts_than_warps_and_a_grid_wider_than_the_prep() {
    run(2, 64, 6, 9, 6, 4);
}
