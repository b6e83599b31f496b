//! mkbench: benchmarks in the style of nccl-tests. `mkbench <op> [options]`; each op
//! measures its baseline (cuBLAS, the unfused sequence, NCCL where GPUs allow) in the same
//! run and prints both side by side, with a closing OK/FAILED line.

mod gemm;

use mkernel::testing::gpu_unavailable_reason;

type Bench = fn(&[String]) -> mkernel::Result<bool>;

/// Every benchmark, by name. Add a module and one line here.
const BENCHES: &[(&str, Bench, &str)] = &[
    ("gemm", gemm::run, "GEMM engine vs cuBLASLt (--dtype, --shape MxNxK, --sweep, --json PATH)"),
];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = || {
        eprintln!("usage: mkbench <op> [options]");
        for (name, _, help) in BENCHES {
            eprintln!("  {name:<12} {help}");
        }
    };
    let Some(op) = args.first() else {
        usage();
        std::process::exit(2);
    };
    let Some((_, bench, _)) = BENCHES.iter().find(|b| b.0 == op) else {
        eprintln!("mkbench: unknown op {op:?}");
        usage();
        std::process::exit(2);
    };
    if let Some(why) = gpu_unavailable_reason() {
        println!("SKIPPED: no GPU ({why})");
        return;
    }
    match bench(&args[1..]) {
        Ok(true) => println!("OK"),
        Ok(false) => {
            println!("FAILED");
            std::process::exit(1);
        }
        Err(e) => {
            println!("FAILED: {e}");
            std::process::exit(1);
        }
    }
}
