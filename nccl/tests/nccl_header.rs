//! libmkernel-nccl against the real nccl.h of NCCL 2.28.9 (fetched from the
//! nvidia-nccl-cu13==2.28.9 wheel by scripts/test-nccl.sh into build/nccl-2.28.9/include,
//! or MK_NCCL_INCLUDE): every exported prototype, as cbindgen reads it from the Rust, is
//! redeclared after the header (a conflicting type is a compile error); the library exports
//! exactly the header's functions and nothing else; ncclConfig_t's layout and the constants
//! are the Rust ones.

use mkernel_nccl::abi::*;
use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn nccl_include() -> PathBuf {
    let dir = std::env::var_os("MK_NCCL_INCLUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("build/nccl-2.28.9/include"));
    assert!(
        dir.join("nccl.h").is_file(),
        "{}/nccl.h is missing: run scripts/test-nccl.sh --fetch (it takes nccl.h from the nvidia-nccl-cu13==2.28.9 \
         wheel), or point MK_NCCL_INCLUDE at a directory holding NCCL 2.28.9's nccl.h",
        dir.display()
    );
    dir
}

/// nccl.h includes cuda_runtime.h: the CUDA headers of .venv-cuda (scripts/setup.sh), or MK_CUDA_INCLUDE.
fn cuda_include() -> PathBuf {
    if let Some(d) = std::env::var_os("MK_CUDA_INCLUDE") {
        return PathBuf::from(d);
    }
    let lib = workspace().join(".venv-cuda/lib");
    std::fs::read_dir(&lib)
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("site-packages/nvidia/cu13/include"))
        .find(|p| p.join("cuda_runtime.h").is_file())
        .unwrap_or_else(|| {
            panic!("no cuda_runtime.h under {}: run scripts/setup.sh or set MK_CUDA_INCLUDE", lib.display())
        })
}

fn out_dir() -> PathBuf {
    let d = workspace().join("build/nccl-tests");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Compiles (and with `run`, runs) a C file against nccl.h with warnings as errors.
fn compile_c(name: &str, source: &str, run: bool) {
    let dir = out_dir();
    let c = dir.join(format!("{name}.c"));
    std::fs::write(&c, source).unwrap();
    let exe = dir.join(name);
    let mut cc = Command::new("cc");
    cc.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-isystem"])
        .arg(cuda_include())
        .arg("-isystem")
        .arg(nccl_include())
        .arg(&c);
    if run {
        cc.arg("-o").arg(&exe);
    } else {
        cc.args(["-fsyntax-only"]);
    }
    let out = cc.output().expect("cc runs");
    assert!(
        out.status.success(),
        "{name}.c does not compile against nccl.h:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    if run {
        let out = Command::new(&exe).output().unwrap();
        assert!(
            out.status.success(),
            "{name} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The prototypes of every `#[no_mangle]` function of this crate, as cbindgen writes them,
/// naming NCCL's types.
fn rust_prototypes() -> String {
    let mut config = cbindgen::Config {
        language: cbindgen::Language::C,
        no_includes: true,
        usize_is_size_t: true,
        ..Default::default()
    };
    // The types and constants the prototypes name are the header's: none is emitted.
    use cbindgen::ItemType::*;
    config.export.item_types = vec![Functions, Structs, Typedefs, OpaqueItems];
    config.export.exclude = [
        "ncclResult_t",
        "ncclDataType_t",
        "ncclRedOp_t",
        "ncclScalarResidence_t",
        "cudaStream_t",
        "CUstream_st",
        "ncclUniqueId",
        "ncclComm",
        "ncclComm_t",
        "ncclWindow_vidmem",
        "ncclWindow_t",
        "ncclConfig_t",
        "ncclSimInfo_t",
    ]
    .map(String::from)
    .to_vec();
    config.documentation = false;
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_crate(env!("CARGO_MANIFEST_DIR"))
        .with_config(config)
        .generate()
        .expect("cbindgen reads the crate")
        .write(&mut out);
    String::from_utf8(out).unwrap()
}

fn function_names(prototypes: &str) -> Vec<String> {
    let mut names: Vec<String> = prototypes
        .split(';')
        .filter_map(|decl| {
            let head = decl.split('(').next()?;
            let name = head.split_whitespace().last()?.trim_start_matches('*');
            name.starts_with("nccl").then(|| name.to_string())
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The functions nccl.h declares (its pnccl* profiling twins left out).
fn header_functions() -> Vec<String> {
    let text = std::fs::read_to_string(nccl_include().join("nccl.h")).unwrap();
    let decls: String = text
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("ncclResult_t") || l.starts_with("const char*") || l.starts_with("void"))
        .map(|l| format!("{l};"))
        .collect();
    function_names(&decls)
}

#[test]
fn every_exported_prototype_matches_the_real_header() {
    let prototypes = rust_prototypes();
    let names = function_names(&prototypes);
    assert!(names.len() >= 40, "cbindgen found {} functions:\n{prototypes}", names.len());
    // A redeclaration with another type is "conflicting types", an error in C.
    compile_c("prototypes", &format!("#include <nccl.h>\n\n{prototypes}\n"), false);
    assert_eq!(names, header_functions(), "the library's functions and nccl.h's differ");
}

#[test]
fn the_library_exports_exactly_the_header_functions() {
    let lib = workspace().join("target/release/libmkernel_nccl.so");
    let lib = if lib.is_file() { lib } else { workspace().join("target/debug/libmkernel_nccl.so") };
    let out = Command::new("nm").args(["-D", "--defined-only"]).arg(&lib).output().expect("nm runs");
    assert!(out.status.success(), "nm {}", lib.display());
    let mut exported: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(String::from))
        .collect();
    exported.sort();
    assert_eq!(exported, header_functions(), "{} must export nccl.h's functions and nothing else", lib.display());
}

#[test]
fn config_layout_and_constants_match_the_real_header() {
    let mut checks = String::new();
    let mut sa = |cond: String| checks.push_str(&format!("_Static_assert({cond}, \"{}\");\n", cond.replace('"', "'")));
    sa(format!("sizeof(ncclConfig_t) == {}", size_of::<ncclConfig_t>()));
    macro_rules! field {
        ($t:ty, $($f:ident),*) => {$(
            sa(format!("offsetof({}, {}) == {}", stringify!($t), stringify!($f), offset_of!($t, $f)));
            sa(format!("sizeof((({}*)0)->{}) == {}", stringify!($t), stringify!($f), {
                let v: $t = unsafe { std::mem::zeroed() };
                std::mem::size_of_val(&v.$f)
            }));
        )*};
    }
    field!(
        ncclConfig_t,
        size,
        magic,
        version,
        blocking,
        cgaClusterSize,
        minCTAs,
        maxCTAs,
        netName,
        splitShare,
        trafficClass,
        commName,
        collnetEnable,
        CTAPolicy,
        shrinkShare,
        nvlsCTAs,
        nChannelsPerNetPeer,
        nvlinkCentricSched
    );
    sa(format!("sizeof(ncclSimInfo_t) == {}", size_of::<ncclSimInfo_t>()));
    field!(ncclSimInfo_t, size, magic, version, estimatedTime);
    sa(format!("sizeof(ncclUniqueId) == {}", size_of::<ncclUniqueId>()));
    sa(format!("NCCL_UNIQUE_ID_BYTES == {NCCL_UNIQUE_ID_BYTES}"));
    sa(format!("NCCL_VERSION_CODE == {NCCL_VERSION_CODE}"));
    sa(format!("NCCL_CONFIG_UNDEF_INT == {NCCL_CONFIG_UNDEF_INT} - 0"));
    for (name, v) in [
        ("ncclSuccess", ncclSuccess),
        ("ncclUnhandledCudaError", ncclUnhandledCudaError),
        ("ncclSystemError", ncclSystemError),
        ("ncclInternalError", ncclInternalError),
        ("ncclInvalidArgument", ncclInvalidArgument),
        ("ncclInvalidUsage", ncclInvalidUsage),
        ("ncclRemoteError", ncclRemoteError),
        ("ncclInProgress", ncclInProgress),
        ("ncclNumResults", ncclNumResults),
        ("ncclFloat8e4m3", ncclFloat8e4m3),
        ("ncclFloat8e5m2", ncclFloat8e5m2),
        ("ncclNumTypes", ncclNumTypes),
        ("ncclSum", ncclSum),
        ("ncclNumOps", ncclNumOps),
    ] {
        sa(format!("{name} == {v}"));
    }
    // mkernel's data types and ops carry NCCL's numbers (they are passed through unchanged).
    for t in mkernel::types::mkDataType_t::ALL {
        // datatype_name is checked here too: a wrong name fails the static assert.
        let nccl = datatype_name(t as ncclDataType_t);
        sa(format!("{nccl} == {} && sizeof(ncclDataType_t) == sizeof(int)", t as i32));
    }
    for (o, nccl) in mkernel::types::mkRedOp_t::ALL.iter().zip(["ncclSum", "ncclProd", "ncclMax", "ncclMin", "ncclAvg"])
    {
        sa(format!("{nccl} == {} && sizeof(ncclRedOp_t) == sizeof(int)", *o as i32));
    }
    sa("sizeof(ncclResult_t) == sizeof(int)".into());
    let program = format!(
        "#include <nccl.h>\n#include <stddef.h>\n#include <stdio.h>\n{checks}\n\
         int main(void) {{\n  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;\n  ncclSimInfo_t s = NCCL_SIM_INFO_INITIALIZER;\n  \
         if (c.magic != {NCCL_CONFIG_MAGIC}u || c.size != sizeof c || c.version != NCCL_VERSION_CODE || c.blocking != {NCCL_CONFIG_UNDEF_INT} - 0 || s.size != sizeof s) {{\n    \
         printf(\"NCCL_CONFIG_INITIALIZER differs: magic %#x\\n\", c.magic);\n    return 1;\n  }}\n  return 0;\n}}\n"
    );
    compile_c("config_layout", &program, true);
}
