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
        "util",
        "fused_fence",
        "gemm",
        "collectives",
        "hier_collectives",
        "ag_gemm",
        "gemm_reduce",
        "proxy",
        "moe",
        "ring_attention",
        "ring_attention_backward",
    ] {
        assert!(embedded.contains(&family), "kernels/{family}.cu is not embedded: {embedded:?}");
    }
    let tools: Vec<&str> = mkernel::cuda::kernels::TOOL_FATBINS.iter().map(|(name, _)| *name).collect();
    assert_eq!(tools, ["ring_attention_tools"], "the fatbins of kernels/instances.txt's `tool` kernels");
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
        if let Some(library_twin) = k.file.strip_suffix("_tools") {
            let (_, library) = FATBINS.iter().find(|(name, _)| *name == library_twin).expect("the library's build");
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
    let families =
        ["gemm", "ag_gemm", "gemm_reduce", "moe", "ring_attention", "ring_attention_tools", "ring_attention_backward"];
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
    for family in ["gemm", "ag_gemm", "gemm_reduce", "moe", "ring_attention"] {
        let report = reports.get(family).unwrap_or_else(|| panic!("no ptxas report for kernels/{family}.cu"));
        let serialised: Vec<&str> = report.lines().filter(|l| l.contains("instructions are serialized")).collect();
        assert!(serialised.is_empty(), "kernels/{family}.cu: {serialised:#?}");
    }
}

/// The hierarchical collectives: one kernel per dtype, none spilling (a small stack frame
/// holds the per-parity proxy tickets, which are indexed by the step's parity).
#[test]
fn hierarchical_collective_kernels_are_built_without_spills() {
    let reports = ptxas_reports();
    let report = reports.get("hier_collectives").expect("no ptxas report for kernels/hier_collectives.cu");
    let props: Vec<(String, String)> =
        properties(report).into_iter().filter(|(f, _)| f.starts_with("mk_hier_collective_")).collect();
    assert_eq!(props.len(), 10, "one kernel per dtype: {props:?}");
    for (function, line) in props {
        assert!(line.ends_with("0 bytes spill stores, 0 bytes spill loads"), "{function}: {line}");
    }
}

/// The collectives within a node: one kernel per dtype, none spilling. They sit at the
/// register cap of 512 threads (128), with both the register and the shared-memory-staged
/// loops inlined, so a small change can tip one dtype into spilling.
#[test]
fn collective_kernels_are_built_without_spills() {
    let reports = ptxas_reports();
    let report = reports.get("collectives").expect("no ptxas report for kernels/collectives.cu");
    let props: Vec<(String, String)> = properties(report)
        .into_iter()
        .filter(|(f, _)| f.starts_with("mk_collective_") && f != "mk_collective_check")
        .collect();
    assert_eq!(props.len(), 10, "one kernel per dtype: {props:?}");
    for (function, line) in props {
        assert_eq!(line, "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", "{function}");
    }
}
