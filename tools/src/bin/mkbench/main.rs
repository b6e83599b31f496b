//! mkbench: benchmarks in the style of nccl-tests. `mkbench <op> [options]`; each op
//! measures its baseline (cuBLAS, the unfused sequence, NCCL where GPUs allow) in the same
//! run and prints both side by side, with a closing OK/FAILED line. `--json PATH` (any
//! op) writes the run's record (docs/benchmarks.md). Options are checked before any GPU
//! is touched, so a typo fails the same way on a machine without one.

mod ag_gemm;
mod ag_gemm_fp8;
mod collective_check;
mod collectives;
mod copy_engine;
mod cublas_grouped;
mod fused_common;
mod fused_options;
mod gemm;
mod gemm_reduce;
mod gemm_reduce_fp8;
mod host;
mod measure;
mod moe;
mod nccl;
#[path = "../mktest/ranks.rs"]
#[allow(dead_code)]
mod ranks;
mod record;
mod ring_attn;
mod ring_attn_bwd;
mod timing;

use mkernel_tools::testing::gpu_unavailable_reason;

type Bench = fn(&[String]) -> mkernel::Result<bool>;

/// Parses a bench's options without touching a GPU (the same parser its run uses).
type Check = fn(&str, &[String]) -> mkernel::Result<()>;

/// Every benchmark, by name. Add a module and one line here.
const BENCHES: &[(&str, Bench, &str)] = &[
    ("all_gather", collectives::all_gather, "mkAllGather vs D2D copy and NCCL, nccl-tests style, every element checked (-b -e -f -n -w --blocks -g, --op sum|prod|max|min|avg, --dtype T,...|all)"),
    ("reduce_scatter", collectives::reduce_scatter, "mkReduceScatter, same options"),
    ("all_reduce", collectives::all_reduce, "mkAllReduce, same options"),
    ("ag_gemm", ag_gemm::run, "mkAllGatherGemm vs mkAllGather+cuBLASLt, copy-engine AllGather+cuBLASLt, cuBLASLt alone, capped GEMM (-g, --rows, --nk NxK,..., --dtype bf16|fp16, -n, -w, --blocks)"),
    ("ag_gemm_fp8", ag_gemm_fp8::run, "mkAllGatherScaledGemm (e4m3, rowwise scales) vs mkAllGatherGemm in bf16, mkAllGather(e4m3 rows, scales)+mkScaledGemm, mkScaledGemm alone; bytes pushed per call (-g, --rows, --nk NxK,..., -n, -w, --blocks)"),
    ("gemm_rs", gemm_reduce::gemm_rs, "mkGemmReduceScatter vs cuBLASLt+mkReduceScatter, cuBLASLt alone, capped GEMM+mkReduceScatter (-g, --m, --nk NxK,..., -n, -w, --blocks)"),
    ("gemm_ar", gemm_reduce::gemm_ar, "mkGemmAllReduce vs cuBLASLt+mkAllReduce, cuBLASLt alone, capped GEMM+mkAllReduce (-g, --m, --nk NxK,..., -n, -w, --blocks)"),
    ("gemm_rs_fp8", gemm_reduce_fp8::gemm_rs_fp8, "mkScaledGemmReduceScatter (e4m3, rowwise scales) vs mkGemmReduceScatter in bf16, mkScaledGemm+mkReduceScatter, mkScaledGemm alone (-g, --m, --nk NxK,..., -n, -w, --blocks)"),
    ("gemm_ar_fp8", gemm_reduce_fp8::gemm_ar_fp8, "mkScaledGemmAllReduce (e4m3, rowwise scales) vs mkGemmAllReduce in bf16, mkScaledGemm+mkAllReduce, mkScaledGemm alone (-g, --m, --nk NxK,..., -n, -w, --blocks)"),
    ("moe", moe::run, "mkMoeDispatchGemm / mkMoeGemmCombine vs exchange + cuBLAS grouped GEMM (-g, --tokens, --hidden, --ffn, --experts, --topk, -n, -w, --blocks)"),
    ("ring_attn", ring_attn::run, "mkRingAttention vs mkAllGather(K,V)+attention, the attention alone (-g, --seq S,..., --heads, --kv-heads, --dim, --causal 0,1, --dtype bf16|fp16, -n, -w)"),
    ("ring_attn_bwd", ring_attn_bwd::run, "mkRingAttentionBackward alone and after mkRingAttention, checked (bitwise repeat, finite, float64 rows); torch SDPA in benches/sdpa_baseline.py --backward (-g, --seq S,..., --heads, --kv-heads, --dim, --causal 0,1, --dtype bf16|fp16, -n, -w, --blocks, --rest-ms, --threads)"),
    ("gemm", gemm::run, "GEMM engine vs cuBLASLt, from M = 1 (--dtype, --shape MxNxK, --sweep, --json PATH)"),
    ("host", host::run, "host µs per call, piece by piece (context, pointer check, capture query, launch, copy call) and whole mkAllReduce / mkGemm calls, one rank (-n, -w, --blocks)"),
];

/// The option checks, by bench name (every bench's parser).
const CHECKS: &[(&str, Check)] = &[
    ("all_gather", collectives::check),
    ("reduce_scatter", collectives::check),
    ("all_reduce", collectives::check),
    ("ag_gemm", ag_gemm::check),
    ("ag_gemm_fp8", ag_gemm_fp8::check),
    ("gemm_rs", gemm_reduce::check),
    ("gemm_ar", gemm_reduce::check),
    ("gemm_rs_fp8", gemm_reduce_fp8::check),
    ("gemm_ar_fp8", gemm_reduce_fp8::check),
    ("moe", moe::check),
    ("ring_attn", ring_attn::check),
    ("ring_attn_bwd", ring_attn_bwd::check),
    ("gemm", gemm::check),
    ("host", host::check),
];

/// Takes `--json PATH` out of a bench's arguments (every bench takes it; the record
/// module writes the file): the remaining arguments and the path.
fn split_json(args: &[String]) -> Result<(Vec<String>, Option<String>), String> {
    let mut rest = Vec::with_capacity(args.len());
    let mut path = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--json" {
            path = Some(it.next().filter(|p| !p.starts_with('-')).ok_or("--json needs a path")?.clone());
        } else {
            rest.push(a.clone());
        }
    }
    Ok((rest, path))
}

fn main() {
    // `--trace` launches ring attention's `_trace` twins, which live outside the library.
    mkernel::cuda::register_tool_kernels();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = || {
        eprintln!("usage: mkbench <op> [options]");
        for (name, _, help) in BENCHES {
            eprintln!("  {name:<14} {help}");
        }
    };
    let Some(op) = args.first() else {
        usage();
        std::process::exit(2);
    };
    if op == "--help" || op == "-h" {
        usage();
        return;
    }
    let Some((_, bench, help)) = BENCHES.iter().find(|b| b.0 == op) else {
        eprintln!("mkbench: unknown op {op:?}");
        usage();
        std::process::exit(2);
    };
    if args[1..].iter().any(|a| a == "--help" || a == "-h") {
        println!("mkbench {op}: {help}\n  every op also takes --json PATH (docs/benchmarks.md)");
        return;
    }
    let (bench_args, json) = match split_json(&args[1..]) {
        Ok(x) => x,
        Err(why) => {
            eprintln!("mkbench {op}: {why}");
            std::process::exit(2);
        }
    };
    let check = CHECKS.iter().find(|c| c.0 == op).map(|c| c.1);
    if let Some(Err(e)) = check.map(|c| c(op, &bench_args)) {
        eprintln!("mkbench {op}: {e}");
        std::process::exit(2);
    }
    if let Some(path) = json {
        // Before any rank process starts: they inherit it, and rank 0 writes the file.
        std::env::set_var(record::ENV_JSON, path);
    }
    if let Some(why) = gpu_unavailable_reason() {
        println!("SKIPPED: no GPU ({why})");
        // 77: did not run (as mktest), never read as a pass by scripts/gpu-run.sh.
        std::process::exit(77);
    }
    let outcome = bench(&bench_args);
    if let Err(e) = record::finish(op, matches!(outcome, Ok(true))) {
        eprintln!("mkbench {op}: {e}");
    }
    match outcome {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused_options::command_line as args;

    #[test]
    fn json_path_is_taken_out_of_any_bench_arguments() {
        let (rest, path) = split_json(&args("-g 2 --json out.json --rows 128")).unwrap();
        assert_eq!(rest, args("-g 2 --rows 128"));
        assert_eq!(path.as_deref(), Some("out.json"));
        assert_eq!(split_json(&args("-n 3")).unwrap(), (args("-n 3"), None));
        assert!(split_json(&args("--json")).is_err());
        assert!(split_json(&args("--json -g 2")).is_err());
    }

    #[test]
    fn every_bench_has_an_option_check_that_refuses_a_typo() {
        for (name, _, _) in BENCHES {
            let check = CHECKS.iter().find(|c| c.0 == *name).unwrap_or_else(|| panic!("{name} has no check")).1;
            assert!(check(name, &[]).is_ok(), "{name}: defaults must parse");
            let e = check(name, &args("--no-such-option 1")).unwrap_err();
            assert!(e.message.contains("--no-such-option"), "{name}: {}", e.message);
            assert!(check(name, &args("-n")).is_err(), "{name}: a flag without its value");
        }
    }
}
