//! mkbench: benchmarks in the style of nccl-tests. `mkbench <op> [options]`; each op
//! measures its baseline (cuBLAS, the unfused sequence, NCCL where GPUs allow) in the same
//! run and prints both side by side, with a closing OK/FAILED line.

mod ag_gemm;
mod collectives;
mod fused_common;
mod gemm;
mod gemm_reduce;
mod moe;
mod nccl;
mod ring_attn;
#[path = "../mktest/ranks.rs"]
#[allow(dead_code)]
mod ranks;

use mkernel::testing::gpu_unavailable_reason;

type Bench = fn(&[String]) -> mkernel::Result<bool>;

/// Every benchmark, by name. Add a module and one line here.
const BENCHES: &[(&str, Bench, &str)] = &[
    ("all_gather", collectives::all_gather, "mkAllGather vs D2D copy, nccl-tests style (-b -e -f -n -w -g, --op, --json PATH)"),
    ("reduce_scatter", collectives::reduce_scatter, "mkReduceScatter, same options"),
    ("all_reduce", collectives::all_reduce, "mkAllReduce, same options"),
    ("ag_gemm", ag_gemm::run, "mkAllGatherGemm vs mkAllGather+GEMM, mkAllGather+cuBLAS, cuBLAS (-g, --rows, --nk NxK,..., --dtype, -n, -w)"),
    ("gemm_rs", gemm_reduce::gemm_rs, "mkGemmReduceScatter vs GEMM+mkReduceScatter, cuBLAS+mkReduceScatter, cuBLAS (-g, --m, --nk NxK,..., -n, -w)"),
    ("gemm_ar", gemm_reduce::gemm_ar, "mkGemmAllReduce vs GEMM+mkAllReduce, cuBLAS+mkAllReduce, cuBLAS (-g, --m, --nk NxK,..., -n, -w)"),
    ("moe", moe::run, "mkMoeDispatchGemm / mkMoeGemmCombine vs exchange + per-expert GEMMs (-g, --tokens, --hidden, --ffn, --experts, --topk, -n, -w)"),
    ("ring_attn", ring_attn::run, "mkRingAttention vs mkAllGather(K,V)+attention, the attention alone (-g, --seq S,..., --heads, --kv-heads, --dim, --causal 0,1, -n, -w)"),
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
        // Rank processes other than 0 (multi-rank benches) stay quiet.
        Ok(true) if std::env::var("MK_TEST_RANK").map_or(true, |r| r == "0") => println!("OK"),
        Ok(true) => {}
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
