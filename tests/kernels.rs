//! Kernel build checks that need no GPU: every kernel family was compiled into the
//! embedded fatbins, and the GEMM-engine kernels (the plain GEMM and the fused ops) keep
//! their accumulators in registers — ptxas reports no spills and no stack frame for them
//! (a spill there costs far more than any fusion gains).

use std::collections::BTreeMap;

fn ptxas_reports() -> BTreeMap<String, String> {
    let dir = std::path::Path::new(env!("OUT_DIR"));
    std::fs::read_dir(dir)
        .expect("OUT_DIR")
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let stem = name.strip_suffix(".ptxas.log")?.to_string();
            Some((stem, std::fs::read_to_string(e.path()).ok()?))
        })
        .collect()
}

/// (function, "N bytes stack frame, N bytes spill stores, N bytes spill loads") per function.
fn properties(report: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current = None;
    for line in report.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = Some(rest.trim().to_string());
        } else if line.contains("bytes stack frame") {
            if let Some(f) = current.take() {
                out.push((f, line.trim().to_string()));
            }
        }
    }
    out
}

#[test]
fn every_kernel_family_is_embedded() {
    let embedded: Vec<&str> = mkernel::cuda::kernels::FATBINS.iter().map(|(name, _)| *name).collect();
    for family in [
        "fused_fence",
        "gemm",
        "collectives",
        "hier_collectives",
        "ag_gemm",
        "gemm_reduce",
        "gemm_reduce_early",
        "moe",
        "ring_attention",
        "ring_attention_backward",
        "scaled_gemm",
        "ag_scaled_gemm",
        "gemm_reduce_scaled",
    ] {
        assert!(embedded.contains(&family), "kernels/{family}.cu is not embedded: {embedded:?}");
    }
    // The test kernels' files have no library kernel: the library does not embed them.
    for tool_only in ["util", "proxy"] {
        assert!(!embedded.contains(&tool_only), "kernels/{tool_only}.cu holds only tool kernels: {embedded:?}");
    }
    let mut tools: Vec<&str> = mkernel::cuda::kernels::TOOL_FATBINS.iter().map(|(name, _)| *name).collect();
    tools.sort();
    assert_eq!(
        tools,
        [
            "ag_gemm_tools",
            "collectives_tools",
            "gemm_reduce_early_tools",
            "gemm_reduce_tools",
            "moe_tools",
            "proxy_tools",
            "ring_attention_tools",
            "util_tools"
        ],
        "the fatbins of kernels/instances.txt's `tool` kernels"
    );
    for (name, bytes) in mkernel::cuda::kernels::FATBINS.iter().chain(mkernel::cuda::kernels::TOOL_FATBINS) {
        assert!(bytes.len() > 1000, "{name}: fatbin of {} bytes", bytes.len());
    }
}

/// Every kernel constant names a fatbin that exists, and the kernel is in that fatbin's image
/// (as its ELF section `.text.<name>`), not in the other build of the same file.
#[test]
fn every_kernel_is_in_the_fatbin_it_names() {
    use mkernel::cuda::kernels::{ALL, FATBINS, TOOL_FATBINS};
    let contains = |image: &[u8], text: &str| image.windows(text.len()).any(|w| w == text.as_bytes());
    for k in ALL {
        let image = FATBINS.iter().chain(TOOL_FATBINS).find(|(name, _)| *name == k.file).map(|(_, b)| *b);
        let image = image.unwrap_or_else(|| panic!("{}: no fatbin named {}", k.name, k.file));
        let section = format!(".text.{}\0", k.name);
        assert!(contains(image, &section), "{} is not in {}.fatbin", k.name, k.file);
        let library_twin = k.file.strip_suffix("_tools");
        if let Some((library_twin, library)) = library_twin.and_then(|t| FATBINS.iter().find(|(name, _)| *name == t)) {
            assert!(
                !contains(library, &section),
                "tool kernel {} is also in the library's {library_twin}.fatbin",
                k.name
            );
        }
    }
}

#[test]
fn engine_kernels_do_not_spill() {
    let reports = ptxas_reports();
    let families = [
        "gemm",
        "ag_gemm",
        "gemm_reduce",
        "moe",
        "ring_attention",
        "ring_attention_tools",
        "ring_attention_backward",
        "scaled_gemm",
        "ag_scaled_gemm",
        "gemm_reduce_scaled",
    ];
    for family in families {
        let report = reports.get(family).unwrap_or_else(|| panic!("no ptxas report for {family}.fatbin"));
        let props = properties(report);
        assert!(!props.is_empty(), "kernels/{family}.cu: no function properties in the ptxas report");
        for (function, line) in props {
            assert_eq!(
                line, "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
                "{function} in kernels/{family}.cu"
            );
        }
    }
}

/// ptxas serialises every wgmma of a function it cannot pipeline (a call, too few
/// registers, an accumulator written by another instruction: "Potential Performance Loss:
/// wgmma.mma_async instructions are serialized", C7515): several times slower and still
/// correct, so only the build log shows it.
#[test]
fn engine_kernels_keep_wgmma_pipelined() {
    let reports = ptxas_reports();
    for family in [
        "gemm",
        "ag_gemm",
        "gemm_reduce",
        "moe",
        "ring_attention",
        "scaled_gemm",
        "ag_scaled_gemm",
        "gemm_reduce_scaled",
    ] {
        let report = reports.get(family).unwrap_or_else(|| panic!("no ptxas report for kernels/{family}.cu"));
        let serialised: Vec<&str> = report.lines().filter(|l| l.contains("instructions are serialized")).collect();
        assert!(serialised.is_empty(), "kernels/{family}.cu: {serialised:#?}");
    }
}

/// Element types whose `accepted` passes `takes`: how many kernels a family has.
fn types_where(takes: impl Fn(&mkernel::types::Accepted) -> bool) -> usize {
    mkernel::types::ELEMENT_TYPES.iter().filter(|t| takes(&t.accepted)).count()
}

/// The hierarchical collectives: one kernel per dtype reduced across nodes, none spilling (a
/// small stack frame holds the per-parity proxy tickets, which are indexed by the step's
/// parity).
#[test]
fn hierarchical_collective_kernels_are_built_without_spills() {
    let reports = ptxas_reports();
    let report = reports.get("hier_collectives").expect("no ptxas report for kernels/hier_collectives.cu");
    let props: Vec<(String, String)> =
        properties(report).into_iter().filter(|(f, _)| f.starts_with("mk_hier_collective_")).collect();
    assert_eq!(props.len(), types_where(|a| a.reduce_across_nodes), "one kernel per dtype: {props:?}");
    for (function, line) in props {
        assert!(line.ends_with("0 bytes spill stores, 0 bytes spill loads"), "{function}: {line}");
    }
}

/// The collectives within a node: one kernel per dtype (fp8 included), none spilling. They
/// sit at the register cap of 512 threads (128), with both the register and the
/// shared-memory-staged loops inlined, so a small change can tip one dtype into spilling.
#[test]
fn collective_kernels_are_built_without_spills() {
    let reports = ptxas_reports();
    let report = reports.get("collectives").expect("no ptxas report for kernels/collectives.cu");
    let props: Vec<(String, String)> = properties(report)
        .into_iter()
        .filter(|(f, _)| f.starts_with("mk_collective_") && f != "mk_collective_check")
        .collect();
    assert_eq!(props.len(), types_where(|a| a.reduce), "one kernel per dtype: {props:?}");
    for (function, line) in props {
        assert_eq!(line, "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", "{function}");
    }
}

/// Every kernel with trace hooks has its `_trace` twin in the tools' build of its file, and
/// the library's kernels name no twin of their own.
#[test]
fn every_traced_kernel_has_a_twin_in_the_tools_fatbin() {
    use mkernel::cuda::kernels::{trace_twin, ALL};
    let traced = ["ag_gemm", "gemm_reduce", "gemm_reduce_early", "moe", "ring_attention"];
    let mut twins = 0;
    for k in ALL.iter().filter(|k| traced.contains(&k.file)) {
        let twin = trace_twin(*k).unwrap_or_else(|e| panic!("{}: {}", k.name, e.message));
        assert_eq!(twin.file, format!("{}_tools", k.file), "{}", k.name);
        twins += 1;
    }
    assert_eq!(twins, 4 + 10 + 2 + 8 + 4);
    let gemm = ALL.iter().find(|k| k.file == "gemm").unwrap();
    assert!(trace_twin(*gemm).is_err(), "the plain GEMM has no hooks and no twin");
}
