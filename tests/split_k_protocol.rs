//! The GEMM engine's split-K fold on the CPU: a port of `split_k_fold`
//! (kernels/common/gemm/engine.cuh) and the persistent loop around it, one host thread per
//! CTA of a cluster (its consumer warpgroup), mbarriers modelled with their phase and
//! arrival count, the "shared memory" partial slabs plain host memory. The K blocks of a
//! tile are split by the kernel's own `split_k_range` (kernels/common/gemm/scheduler.cuh,
//! compiled as host C++ and run here), each CTA's partial is the sum of its blocks' values,
//! and CTA 0 must fold exactly this tile's partials of every CTA, in rank order, for every
//! tile, whatever the threads' timing: a phase mixed up (a partial overwritten before it
//! was read, or read before it was stored) shows as a wrong sum or a hang. Keep the fold's
//! port in step with the kernel.

mod common;
use common::mbarrier::Mbarrier;
use mkernel::ops::gemm::engine::plan;
use mkernel::ops::gemm::engine::PlanOverrides;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

const DRIVER: &str = r#"
#define __device__
#define __forceinline__ inline
#include <algorithm>
#include <cstdio>
using std::min;
#include "scheduler.cuh"
using namespace mk::gemm;

// Every CTA's K blocks for splits 1..8 of 1..1024 K blocks and of a few large counts (K up
// to 2^31 - 1: 2^25 blocks of 64): "split k_blocks rank first count".
int main() {
  const int large[] = {4095, 65536, 131071, 1 << 24, 1 << 25};
  for (uint32_t split = 1; split <= 8; ++split) {
    auto print = [&](int k_blocks) {
      for (uint32_t rank = 0; rank < split; ++rank) {
        const KBlockRange r = split_k_range(rank, split, k_blocks);
        std::printf("%u %d %u %d %d\n", split, k_blocks, rank, r.first, r.count);
      }
    };
    for (int k_blocks = 1; k_blocks <= 1024; ++k_blocks) print(k_blocks);
    for (int k_blocks : large) print(k_blocks);
  }
  return 0;
}
"#;

/// (split, k_blocks) to the K blocks of each CTA of the cluster, in rank order.
type KRanges = HashMap<(usize, usize), Vec<Range<usize>>>;

/// The K blocks of a tile that each CTA of a split-K cluster takes, by the device's own
/// function, for every pair the driver prints. Built once per test binary (its tests run
/// in parallel).
fn device_k_ranges() -> &'static KRanges {
    static RANGES: OnceLock<KRanges> = OnceLock::new();
    RANGES.get_or_init(|| {
        let exe = common::host_cxx::build_driver("split_k_protocol", DRIVER);
        let out = common::host_cxx::run_driver(&exe, &[]);
        let mut ranges = KRanges::new();
        for line in out.lines() {
            let v: Vec<i64> = line.split(' ').map(|w| w.parse().unwrap()).collect();
            let [split, k_blocks, rank, first, count] = v[..] else { panic!("{line}") };
            assert!(first >= 0 && count >= 0, "split {split} k_blocks {k_blocks}: CTA {rank} has [{first}, +{count})");
            let cta = ranges.entry((split as usize, k_blocks as usize)).or_default();
            assert_eq!(cta.len() as i64, rank, "{line}: ranks in order");
            cta.push(first as usize..(first + count) as usize);
        }
        ranges
    })
}

/// The ranges of `split` CTAs over `k_blocks` K blocks (a pair the driver printed).
fn k_ranges(split: usize, k_blocks: usize) -> &'static [Range<usize>] {
    device_k_ranges()
        .get(&(split, k_blocks))
        .unwrap_or_else(|| panic!("no device ranges for split {split} of {k_blocks}"))
}

/// One CTA's split-K state: its partial slab and its two barriers (only CTA 0's "stored"
/// and only the others' "read" are used).
struct Cta {
    part: Mutex<Vec<f64>>,
    stored: Mbarrier,
    read: Mbarrier,
}

/// The value of K block `kb` of tile `t` at slab element `e`: every (tile, block, element)
/// distinct, sums exact in f64.
fn block_value(t: usize, kb: usize, e: usize) -> f64 {
    (t * 1000 + kb) as f64 * 4.0 + e as f64
}

/// Runs the cluster over `tiles` tiles (the items this cluster takes), CTA r computing K
/// blocks `ranges[r]` of each; returns CTA 0's folded sums per tile.
fn run_cluster(ranges: &'static [Range<usize>], tiles: usize, elems: usize, jitter: bool) -> Vec<Vec<f64>> {
    let split = ranges.len();
    let ctas: Arc<Vec<Cta>> = Arc::new(
        (0..split)
            .map(|_| Cta {
                part: Mutex::new(vec![f64::NAN; elems]),
                stored: Mbarrier::new(split as u32 - 1, "split-K barrier"),
                read: Mbarrier::new(1, "split-K barrier"),
            })
            .collect(),
    );
    let handles: Vec<_> = (0..split)
        .map(|rank| {
            let ctas = Arc::clone(&ctas);
            std::thread::spawn(move || {
                let mut phase = 0u32;
                let mut folded = Vec::new();
                for t in 0..tiles {
                    // The mainloop: this CTA's K range of tile t.
                    let acc: Vec<f64> =
                        (0..elems).map(|e| ranges[rank].clone().map(|kb| block_value(t, kb, e)).sum()).collect();
                    if jitter && (t + rank) % 3 == 0 {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    // split_k_fold
                    if rank == 0 {
                        ctas[0].stored.wait(phase);
                        let mut sum = acc.clone();
                        for r in 1..split {
                            let p = ctas[r].part.lock().unwrap();
                            for (s, v) in sum.iter_mut().zip(p.iter()) {
                                *s += v;
                            }
                        }
                        for r in 1..split {
                            ctas[r].read.arrive();
                        }
                        folded.push(sum);
                    } else {
                        ctas[rank].read.wait(phase ^ 1);
                        ctas[rank].part.lock().unwrap().copy_from_slice(&acc);
                        ctas[0].stored.arrive();
                    }
                    phase ^= 1;
                }
                folded
            })
        })
        .collect();
    let mut results: Vec<Vec<Vec<f64>>> = handles.into_iter().map(|h| h.join().expect("cta thread")).collect();
    results.swap_remove(0)
}

#[test]
fn cta_zero_folds_every_tiles_partials_in_rank_order() {
    for split in [2, 3, 4, 8] {
        for (k_blocks, tiles) in [(split, 1), (16, 7), (17, 12), (128, 5)] {
            for jitter in [false, true] {
                let elems = 8;
                let ranges = k_ranges(split, k_blocks);
                let folded = run_cluster(ranges, tiles, elems, jitter);
                assert_eq!(folded.len(), tiles);
                for (t, sum) in folded.iter().enumerate() {
                    // The rank-order sum of the CTAs' K ranges, as the fold forms it.
                    for (e, &got) in sum.iter().enumerate() {
                        let mut want = 0.0;
                        for range in ranges {
                            let part: f64 = range.clone().map(|kb| block_value(t, kb, e)).sum();
                            want += part;
                        }
                        assert_eq!(got, want, "split {split} k_blocks {k_blocks} tile {t} element {e}");
                    }
                }
            }
        }
    }
}

/// The device's ranges: consecutive in rank order from block 0, covering the tile's K
/// blocks once, sizes within one of each other, so every CTA has a block whenever
/// split <= k_blocks (what the planner keeps and the kernel traps without).
#[test]
fn k_ranges_cover_the_k_blocks_once_in_rank_order() {
    let ranges = device_k_ranges();
    assert_eq!(ranges.len(), 8 * (1024 + 5), "every (split, k_blocks) the driver sweeps");
    for (&(split, k_blocks), ctas) in ranges {
        let what = format!("split {split} of {k_blocks} K blocks: {ctas:?}");
        assert_eq!(ctas.len(), split, "{what}");
        let mut covered = 0;
        for r in ctas {
            assert_eq!(r.start, covered, "{what}");
            covered = r.end;
        }
        assert_eq!(covered, k_blocks, "{what}");
        let (least, most) = (ctas.iter().map(|r| r.len()).min().unwrap(), ctas.iter().map(|r| r.len()).max().unwrap());
        assert!(most - least <= 1 && least == k_blocks / split, "{what}");
    }
}

/// Every CTA of a planned split has K blocks, and the K ranges cover the K blocks once.
#[test]
fn planned_splits_give_every_cta_k_blocks() {
    for (m, n, k) in [(1, 8192, 8192), (128, 8192, 8192), (16, 1024, 8192), (1, 64, 128), (256, 28672, 8192)] {
        for split in [None, Some(2), Some(3), Some(8)] {
            let p = plan(m, n, k, 132, true, PlanOverrides { split_k: split, ..Default::default() });
            let k_blocks = k.div_ceil(64);
            let s = p.split_k;
            assert!(s >= 1 && s <= k_blocks, "{m}x{n}x{k}: split {s}");
            let mut covered = 0;
            for (r, range) in k_ranges(s, k_blocks).iter().enumerate() {
                assert!(!range.is_empty(), "{m}x{n}x{k}: CTA {r} of {s} has no K block");
                assert_eq!(range.start, covered);
                covered = range.end;
            }
            assert_eq!(covered, k_blocks);
            assert_eq!(p.grid % s, 0, "whole clusters");
        }
    }
}
