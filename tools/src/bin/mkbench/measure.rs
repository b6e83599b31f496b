//! The measurement protocol every bench shares, as plain functions testable without a GPU:
//! contenders timed in interleaved blocks (A B C, B C A, C A B, ...) so each sees the same
//! clocks, temperature and neighbours; summaries as median with p10 / p90; the host's
//! enqueue time per call; the progress line of a long bench. The GPU timing itself (CUDA
//! events) is `timer` in `measure_interleaved`, so the protocol is the same whatever does
//! the timing.

use mkernel::error::{MkError, Result};
use std::time::Instant;

/// How many blocks of how many timed calls each contender gets, after `warmup` calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Protocol {
    pub warmup: usize,
    pub blocks: usize,
    pub iters: usize,
}

impl Protocol {
    /// The default: 5 blocks of 20 timed calls after 5 warm-up calls per contender.
    pub const DEFAULT: Protocol = Protocol { warmup: 5, blocks: 5, iters: 20 };

    /// Refuses a protocol with no timed call.
    pub fn validate(&self) -> Result<()> {
        if self.blocks == 0 || self.iters == 0 {
            return Err(MkError::invalid_argument(
                "mkbench: need at least one block (--blocks) of at least one call (-n)",
            ));
        }
        Ok(())
    }
}

/// A summary of one contender's samples (µs): median, 10th and 90th percentiles (nearest
/// rank), the fastest, and how many samples.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stats {
    pub median: f64,
    pub p10: f64,
    pub p90: f64,
    pub min: f64,
    pub samples: usize,
}

impl Stats {
    /// None for no samples or a NaN among them (a broken timer must not read as a time).
    pub fn of(samples: &[f64]) -> Option<Stats> {
        if samples.is_empty() || samples.iter().any(|s| s.is_nan()) {
            return None;
        }
        let mut v = samples.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
        Some(Stats { median, p10: percentile(&v, 0.10), p90: percentile(&v, 0.90), min: v[0], samples: n })
    }
}

/// The nearest-rank percentile of sorted samples: the smallest sample with at least a
/// fraction `q` of the samples at or below it.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The order in which `contenders` run in block `block`: rotated by one per block, so
/// every contender leads, follows and trails equally often over `contenders` blocks.
pub fn block_order(contenders: usize, block: usize) -> Vec<usize> {
    (0..contenders).map(|i| (i + block) % contenders.max(1)).collect()
}

/// Runs the protocol: `warmup(c)` once per contender, then `p.blocks` rounds in which every
/// contender, in `block_order`, is timed by `timer(c, p.iters)` (one sample per timed call,
/// e.g. its µs, or its GPU and host µs); returns each contender's samples, in contender
/// order.
pub fn measure_interleaved<S>(
    contenders: usize,
    p: Protocol,
    mut warmup: impl FnMut(usize) -> Result<()>,
    mut timer: impl FnMut(usize, usize) -> Result<Vec<S>>,
) -> Result<Vec<Vec<S>>> {
    p.validate()?;
    for c in 0..contenders {
        warmup(c)?;
    }
    let mut samples: Vec<Vec<S>> = (0..contenders).map(|_| Vec::with_capacity(p.blocks * p.iters)).collect();
    for block in 0..p.blocks {
        for c in block_order(contenders, block) {
            samples[c].extend(timer(c, p.iters)?);
        }
    }
    Ok(samples)
}

/// Per-call samples across ranks: the slowest rank's time for each call (every rank ran
/// the same calls in the same order). `ranks[r][i]` is rank r's i-th sample.
pub fn slowest_per_call(ranks: &[Vec<f64>]) -> Vec<f64> {
    let n = ranks.iter().map(Vec::len).min().unwrap_or(0);
    (0..n).map(|i| ranks.iter().map(|r| r[i]).fold(f64::NEG_INFINITY, f64::max)).collect()
}

/// Calls captured into each CUDA graph whose replays are timed: enough that a replay's
/// launch is a small share of its time, few enough that a replay of the largest cases stays
/// within a block.
pub const GRAPH_CALLS: usize = 10;

/// The suffix of a contender timed by graph replays (`fused_graph`, `out_of_place_graph`).
pub const GRAPH_SUFFIX: &str = "_graph";

/// What the shared protocol gives per contender, in contender order: the statistics of its
/// per-call GPU times (the slowest rank's, call by call) and the host's time to enqueue one
/// call (µs; the median over this rank's calls, the slowest rank's median).
#[derive(Clone, Debug, PartialEq)]
pub struct Measured {
    pub stats: Vec<Stats>,
    pub host_us: Vec<f64>,
}

impl Measured {
    pub fn median(&self, c: usize) -> f64 {
        self.stats[c].median
    }
}

/// The progress line of a long bench at the start of step `k` of `n` (1-based), after
/// `elapsed_s` seconds: the time left is estimated from the mean of the steps done.
pub fn progress_line(k: usize, n: usize, elapsed_s: f64, what: &str) -> String {
    let left = if k > 1 {
        format!(", about {:.0} s left", elapsed_s / (k - 1) as f64 * (n + 1 - k) as f64)
    } else {
        String::new()
    };
    format!("# step {k} of {n} ({elapsed_s:.0} s elapsed{left}): {what}")
}

/// Prints `progress_line` to stderr for each step of a long bench (the tables stay on
/// stdout). Only the process that reports (rank 0) should make one.
pub struct Progress {
    total: usize,
    done: usize,
    start: Instant,
}

impl Progress {
    pub fn new(total: usize) -> Progress {
        Progress { total, done: 0, start: Instant::now() }
    }

    pub fn step(&mut self, what: &str) {
        self.done += 1;
        eprintln!("{}", progress_line(self.done, self.total, self.start.elapsed().as_secs_f64(), what));
    }
}

/// Host microseconds to enqueue one call of `f`: `calls` calls back to back, timed on
/// the host clock (the GPU work they queue is not waited for; the caller synchronises).
pub fn host_enqueue_us(calls: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let calls = calls.max(1);
    let t = Instant::now();
    for _ in 0..calls {
        f()?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / calls as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift64*): random inputs without a dependency.
    fn random_samples(seed: u64, n: usize) -> Vec<f64> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s >> 12;
                s ^= s << 25;
                s ^= s >> 27;
                (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64 * 100.0
            })
            .collect()
    }

    #[test]
    fn stats_match_a_counting_definition_on_random_samples() {
        for (seed, n) in [(1, 1), (2, 2), (3, 7), (4, 100), (5, 101), (6, 1000)] {
            let v = random_samples(seed, n);
            let s = Stats::of(&v).unwrap();
            // Median: at least half the samples on either side of it.
            assert!(v.iter().filter(|&&x| x <= s.median).count() * 2 >= n, "n {n}");
            assert!(v.iter().filter(|&&x| x >= s.median).count() * 2 >= n, "n {n}");
            // Nearest-rank percentiles: a sample; at least q of the samples at or below it,
            // fewer than q strictly below it.
            for (q, p) in [(0.10, s.p10), (0.90, s.p90)] {
                assert!(v.contains(&p));
                assert!(v.iter().filter(|&&x| x <= p).count() as f64 >= q * n as f64, "n {n} q {q}");
                assert!((v.iter().filter(|&&x| x < p).count() as f64) < q * n as f64 || n == 1, "n {n} q {q}");
            }
            assert!(s.min <= s.p10 && s.p10 <= s.median && s.median <= s.p90);
            assert_eq!(s.min, v.iter().copied().fold(f64::INFINITY, f64::min));
            assert_eq!(s.samples, n);
        }
    }

    #[test]
    fn stats_refuse_no_samples_and_nan() {
        assert_eq!(Stats::of(&[]), None);
        assert_eq!(Stats::of(&[1.0, f64::NAN, 3.0]), None);
        let s = Stats::of(&[4.0, 2.0]).unwrap();
        assert_eq!(s.median, 3.0);
    }

    #[test]
    fn blocks_rotate_so_every_contender_takes_every_position() {
        for n in 1..6 {
            let mut position_counts = vec![vec![0; n]; n];
            for block in 0..n {
                let order = block_order(n, block);
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "each block runs every contender once");
                for (pos, &c) in order.iter().enumerate() {
                    position_counts[c][pos] += 1;
                }
            }
            assert!(position_counts.iter().flatten().all(|&k| k == 1), "n {n}: {position_counts:?}");
        }
    }

    #[test]
    fn measurement_interleaves_blocks_after_every_warmup() {
        let log = std::cell::RefCell::new(Vec::new());
        let p = Protocol { warmup: 2, blocks: 3, iters: 4 };
        let samples = measure_interleaved(
            2,
            p,
            |c| {
                log.borrow_mut().push(format!("w{c}"));
                Ok(())
            },
            |c, iters| {
                log.borrow_mut().push(format!("t{c}"));
                Ok((0..iters).map(|i| (c * 100 + i) as f64).collect())
            },
        )
        .unwrap();
        assert_eq!(*log.borrow(), ["w0", "w1", "t0", "t1", "t1", "t0", "t0", "t1"]);
        assert_eq!(samples.len(), 2);
        assert!(samples.iter().all(|s| s.len() == 12));
        assert!(samples[1].iter().all(|&x| x >= 100.0));
        assert!(measure_interleaved(1, Protocol { blocks: 0, ..p }, |_| Ok(()), |_, _| Ok(Vec::<f64>::new())).is_err());
        // A timer error stops the measurement and comes back.
        assert!(
            measure_interleaved(1, p, |_| Ok(()), |_, _| Err::<Vec<f64>, _>(MkError::invalid_argument("x"))).is_err()
        );
    }

    #[test]
    fn the_slowest_rank_is_taken_call_by_call() {
        let a = random_samples(7, 50);
        let b = random_samples(8, 50);
        let s = slowest_per_call(&[a.clone(), b.clone()]);
        assert_eq!(s.len(), 50);
        for i in 0..50 {
            assert_eq!(s[i], a[i].max(b[i]));
        }
        assert_eq!(slowest_per_call(&[vec![1.0, 2.0], vec![3.0]]), [3.0]);
    }

    #[test]
    fn progress_estimates_what_is_left_from_the_steps_done() {
        assert_eq!(progress_line(1, 4, 0.2, "first"), "# step 1 of 4 (0 s elapsed): first");
        // Two steps done in 20 s: 10 s each, three to go (this one included).
        assert_eq!(progress_line(3, 4, 20.0, "M 16"), "# step 3 of 4 (20 s elapsed, about 20 s left): M 16");
        assert_eq!(progress_line(4, 4, 30.0, "last"), "# step 4 of 4 (30 s elapsed, about 10 s left): last");
    }

    #[test]
    fn host_enqueue_time_is_per_call() {
        let mut calls = 0;
        let us = host_enqueue_us(10, || {
            calls += 1;
            std::thread::sleep(std::time::Duration::from_millis(2));
            Ok(())
        })
        .unwrap();
        assert_eq!(calls, 10);
        assert!((2000.0..20000.0).contains(&us), "{us} µs per 2 ms call");
    }
}
