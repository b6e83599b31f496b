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
    for family in
        ["util", "gemm", "collectives", "hier_collectives", "ag_gemm", "gemm_reduce", "proxy", "moe", "ring_attention"]
    {
        assert!(embedded.contains(&family), "kernels/{family}.cu is not embedded: {embedded:?}");
    }
    for (name, bytes) in mkernel::cuda::kernels::FATBINS {
        assert!(bytes.len() > 1000, "{name}: fatbin of {} bytes", bytes.len());
    }
}

#[test]
fn engine_kernels_do_not_spill() {
    let reports = ptxas_reports();
    for family in ["gemm", "ag_gemm", "gemm_reduce", "moe", "ring_attention"] {
        let report = reports.get(family).unwrap_or_else(|| panic!("no ptxas report for kernels/{family}.cu"));
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
