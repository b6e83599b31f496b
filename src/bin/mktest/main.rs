//! mktest: the GPU test suite. `mktest [suite ...]` runs the named suites (all when none
//! are named) and prints one line per check and a closing OK/FAILED line. Without a GPU it
//! prints SKIPPED and exits 0, so CI (which has no GPU) can run it.

mod ag_gemm;
mod collectives;
mod fused_common;
mod gemm;
mod gemm_reduce;
mod moe;
mod nodes;
mod ranks;
mod ring_attn;
mod smoke;

use mkernel::testing::gpu_unavailable_reason;

type Suite = fn() -> mkernel::Result<()>;

/// Every suite, by name. Add a module and one line here.
const SUITES: &[(&str, Suite)] = &[("smoke", smoke::run), ("gemm", gemm::run), ("collectives", collectives::run), ("ag_gemm", ag_gemm::run), ("gemm_reduce", gemm_reduce::run), ("moe", moe::run), ("ring_attn", ring_attn::run), ("nodes", nodes::run)];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("usage: mktest [suite ...]   suites: {}", SUITES.iter().map(|s| s.0).collect::<Vec<_>>().join(" "));
        return;
    }
    let selected: Vec<&(&str, Suite)> = if args.is_empty() {
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
        println!("SKIPPED: no GPU ({why}); {} GPU suite(s) not run", selected.len());
        return;
    }
    let mut failed = 0;
    for (name, run) in selected {
        let t = std::time::Instant::now();
        match run() {
            Ok(()) => println!("[suite {name}] ok ({:.1} s)", t.elapsed().as_secs_f64()),
            Err(e) => {
                println!("[suite {name}] FAILED: {e}");
                failed += 1;
            }
        }
    }
    if failed == 0 {
        println!("OK");
    } else {
        println!("FAILED ({failed} suite(s))");
        std::process::exit(1);
    }
}
