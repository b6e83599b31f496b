//! The GEMM engine's split-K fold on the CPU: a port of `split_k_fold`
//! (kernels/common/gemm/engine.cuh) and the persistent loop around it, one host thread per
//! CTA of a cluster (its consumer warpgroup), mbarriers modelled with their phase and
//! arrival count, the "shared memory" partial slabs plain host memory. The K blocks of a
//! tile are split as the kernel splits them (CTA r: [r·kb/S, (r+1)·kb/S)), each CTA's
//! partial is the sum of its blocks' values, and CTA 0 must fold exactly this tile's
//! partials of every CTA, in rank order, for every tile, whatever the threads' timing:
//! a phase mixed up (a partial overwritten before it was read, or read before it was
//! stored) shows as a wrong sum or a hang. Keep it in step with the kernel.

mod common;
use common::mbarrier::Mbarrier;
use mkernel::ops::gemm::plan;
use mkernel::ops::gemm::PlanOverrides;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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

/// Runs the cluster over `tiles` tiles (the items this cluster takes) of `k_blocks` K
/// blocks; returns CTA 0's folded sums per tile.
fn run_cluster(split: usize, k_blocks: usize, tiles: usize, elems: usize, jitter: bool) -> Vec<Vec<f64>> {
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
                // engine.cuh: kb0 = rank * k_blocks / split, kbs = (rank + 1) * k_blocks / split - kb0.
                let kb0 = rank * k_blocks / split;
                let kbs = (rank + 1) * k_blocks / split - kb0;
                let mut phase = 0u32;
                let mut folded = Vec::new();
                for t in 0..tiles {
                    // The mainloop: this CTA's K range of tile t.
                    let acc: Vec<f64> =
                        (0..elems).map(|e| (kb0..kb0 + kbs).map(|kb| block_value(t, kb, e)).sum()).collect();
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
                let folded = run_cluster(split, k_blocks, tiles, elems, jitter);
                assert_eq!(folded.len(), tiles);
                for (t, sum) in folded.iter().enumerate() {
                    // The rank-order sum of the CTAs' K ranges, as the fold forms it.
                    for (e, &got) in sum.iter().enumerate() {
                        let mut want = 0.0;
                        for r in 0..split {
                            let (kb0, kb1) = (r * k_blocks / split, (r + 1) * k_blocks / split);
                            let part: f64 = (kb0..kb1).map(|kb| block_value(t, kb, e)).sum();
                            want += part;
                        }
                        assert_eq!(got, want, "split {split} k_blocks {k_blocks} tile {t} element {e}");
                    }
                }
            }
        }
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
            for r in 0..s {
                let (kb0, kb1) = (r * k_blocks / s, (r + 1) * k_blocks / s);
                assert!(kb1 > kb0, "{m}x{n}x{k}: CTA {r} of {s} has no K block");
                assert_eq!(kb0, covered);
                covered = kb1;
            }
            assert_eq!(covered, k_blocks);
            assert_eq!(p.grid % s, 0, "whole clusters");
        }
    }
}
