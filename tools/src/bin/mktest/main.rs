//! mktest: the GPU test suite. `mktest [suite ...]` runs the named suites (all when none
//! are named) and prints one line per check and a closing OK / FAILED / SKIPPED line.
//!
//! Exit status: 0 when every selected suite passed, 1 when one failed, 77 (`SKIP_EXIT`)
//! when none failed but at least one was skipped; without a GPU every suite is reported
//! SKIPPED and the status is 77, so a script tells "nothing ran" from "passed". A rank
//! process that skips exits 77 too, and its parent counts that as a failure of the
//! multi-rank case. Each suite must execute at least its floor of checks (the table
//! below), so a case matrix that silently shrinks fails.

mod ag_gemm;
mod ag_gemm_fp8;
mod api;
mod chaos;
mod collectives;
mod fused_common;
mod gemm;
mod gemm_fp8;
mod gemm_reduce;
mod gemm_reduce_fp8;
mod mixed;
mod moe;
mod moe_capacity;
mod moe_gated;
mod nodes;
mod outcome;
mod ranks;
mod ring_attn;
mod ring_attn_bwd;
mod smoke;
mod soak;

use mkernel_tools::testing::gpu_unavailable_reason;
use outcome::{Outcome, SKIP_EXIT};

type Suite = fn() -> mkernel::Result<Outcome>;

/// Every suite: name, entry point, and the fewest checks one rank of it must execute at any
/// rank count (below what the case matrix gives at N = 1..8). Add a module and one line.
/// Under MK_TEST_SANITIZE the fused suites run smaller sets: `SANITIZER_FLOORS`.
const SUITES: &[(&str, Suite, usize)] = &[
    ("smoke", smoke::run, 4),
    // At least 534 on an H200 (132 SMs): 185 variants of the fixed shapes per dtype, 12 or
    // more per random shape, 60 decode checks, 8 of the entry point. The floor fails when
    // the cluster or split-K variants stop being planned for the fixed shapes.
    ("gemm", gemm::run, 500),
    // mkScaledGemm: 9 shapes x 2-3 scale modes (block where K % 128 == 0) x 2-4 kernels
    // (78 in all) x 2 input kinds x 2 outputs x 2 types of A (e4m3, e5m2) = 624, then the
    // entry points' 2 calls, 10 refusals and the untouched C, and 2 CUDA-graph checks
    // (3 replays each): 639.
    ("gemm_fp8", gemm_fp8::run, 600),
    ("collectives", collectives::run, 900),
    ("api", api::run, 50),
    ("ag_gemm", ag_gemm::run, 38),
    // mkAllGatherScaledGemm: 19 shape x mode cases x 2 outputs x 2 rounds = 76, 9 refusals
    // (10 with several ranks) and the untouched C, 6 around the graph: 92 at one rank.
    ("ag_gemm_fp8", ag_gemm_fp8::run, 85),
    ("gemm_reduce", gemm_reduce::run, 80),
    // mkScaledGemmReduceScatter / mkScaledGemmAllReduce: (19 ReduceScatter + 22 AllReduce
    // shape x mode cases) x 2 outputs x 2 rounds = 164, 13 refusals per op (14 for
    // ReduceScatter with several ranks) and the untouched C of each, 12 around the graph:
    // 204 at one rank.
    ("gemm_reduce_fp8", gemm_reduce_fp8::run, 190),
    // 13 rounds of dispatch then combine over 7 sizes, a bitwise repeat, 6 around the
    // graph, the capacity overflow and its retry, 2 rounds and 6 around the graph in drop
    // mode; gated: 6 rounds (SiLU and GELU over 3 sizes), 1 in drop mode, 6 around the
    // graph, 2 argument rules.
    ("moe", moe::run, 45),
    ("ring_attn", ring_attn::run, 55),
    // 36 gradient checks, 4 argument errors, 6 around the graph (46 at one rank).
    ("ring_attn_bwd", ring_attn_bwd::run, 44),
    // 6 rounds of 4 ops, and 4 captured ops x 3 replays + 3 direct calls.
    ("mixed", mixed::run, 36),
    // MK_TEST_NODES=fused leaves the ~900 collective cases out: the floor covers the rest.
    ("nodes", nodes::run, 120),
    // The first round (every op once, the MoE pair two checks) runs whatever the duration.
    ("soak", soak::run, soak::CHECKS_PER_ROUND),
    // A survivor: an op before the death, its own stop, two ops on the survivors' communicator.
    ("chaos", chaos::run, 4),
];

/// The floors of the sanitizer-sized sets (fused_common::sanitizer_sized: one dtype, at
/// most two rounds, the small shapes), about half of the whole sets' floors.
const SANITIZER_FLOORS: &[(&str, usize)] = &[
    ("ag_gemm", 17),
    ("ag_gemm_fp8", 45),
    ("gemm_reduce", 36),
    ("gemm_reduce_fp8", 100),
    ("moe", 24),
    ("ring_attn", 22),
    ("ring_attn_bwd", 16),
    ("mixed", 14),
];

/// MK_TEST_KILL=only runs a suite's killed-rank test alone: one check per surviving rank.
fn floor_of(name: &str, floor: usize) -> usize {
    if std::env::var("MK_TEST_KILL").is_ok_and(|v| v == "only") {
        1
    } else if fused_common::sanitizer_sized() {
        SANITIZER_FLOORS.iter().find(|s| s.0 == name).map_or(floor, |s| s.1)
    } else {
        floor
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("usage: mktest [suite ...]   suites: {}", SUITES.iter().map(|s| s.0).collect::<Vec<_>>().join(" "));
        println!("exit status: 0 passed, 1 failed, {SKIP_EXIT} skipped (nothing failed, something did not run)");
        return;
    }
    let selected: Vec<&(&str, Suite, usize)> = if args.is_empty() {
        SUITES.iter().collect()
    } else {
        let mut v = Vec::new();
        for a in &args {
            match SUITES.iter().find(|s| s.0 == a) {
                Some(s) => v.push(s),
                None => {
                    eprintln!("mktest: unknown suite {a:?}");
                    std::process::exit(2);
                }
            }
        }
        v
    };
    if let Some(why) = gpu_unavailable_reason() {
        for (name, _, _) in &selected {
            println!("[suite {name}] SKIPPED: no GPU ({why})");
        }
        println!("SKIPPED ({} suite(s), none run)", selected.len());
        std::process::exit(SKIP_EXIT);
    }
    let (mut failed, mut skipped) = (0, 0);
    for (name, run, floor) in selected {
        let t = std::time::Instant::now();
        outcome::take_tally();
        let secs = || t.elapsed().as_secs_f64();
        match run() {
            Ok(Outcome::Ran) => {
                let checks = outcome::take_tally();
                let floor = floor_of(name, *floor);
                if checks < floor {
                    println!("[suite {name}] FAILED: {checks} checks executed, fewer than the suite's floor of {floor} ({:.1} s)", secs());
                    failed += 1;
                } else {
                    println!("[suite {name}] ok, {checks} checks ({:.1} s)", secs());
                }
            }
            Ok(Outcome::Threads { nranks, fewest_checks }) => {
                let floor = floor_of(name, *floor);
                if fewest_checks < floor {
                    println!("[suite {name}] FAILED: a rank thread executed {fewest_checks} checks, fewer than the suite's floor of {floor} ({:.1} s)", secs());
                    failed += 1;
                } else {
                    println!(
                        "[suite {name}] ok on {nranks} rank threads, each at least {fewest_checks} checks ({:.1} s)",
                        secs()
                    );
                }
            }
            Ok(Outcome::Spawned { nranks }) => {
                println!(
                    "[suite {name}] ok on {nranks} rank processes, each at least {} checks ({:.1} s)",
                    floor_of(name, *floor),
                    secs()
                )
            }
            Ok(Outcome::Skipped(why)) => {
                println!("[suite {name}] SKIPPED: {why}");
                skipped += 1;
            }
            Err(e) => {
                println!("[suite {name}] FAILED: {e}");
                failed += 1;
            }
        }
    }
    if failed > 0 {
        println!(
            "FAILED ({failed} suite(s){})",
            if skipped > 0 { format!(", {skipped} skipped") } else { String::new() }
        );
        std::process::exit(1);
    }
    if skipped > 0 {
        println!("SKIPPED ({skipped} suite(s) not run, the others passed)");
        std::process::exit(SKIP_EXIT);
    }
    println!("OK");
}
