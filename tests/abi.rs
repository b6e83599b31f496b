//! The C ABI's packaging: the committed header is what the sources generate, its version
//! macros match Cargo.toml, its hand-written constants match the Rust ones, and the shared
//! library exports only `mk` symbols.

use mkernel::ffi::config::{MK_CONFIG_MAGIC, MK_CONFIG_UNDEF_INT};
use mkernel::ffi::fused::MK_MOE_OPTIONS_MAGIC;
use mkernel::ops::moe::{MK_MOE_ACT_GELU, MK_MOE_ACT_NONE, MK_MOE_ACT_SILU, MK_MOE_DROP, MK_MOE_NO_DROP};
use std::process::Command;

const COMMITTED: &str = include_str!("../include/mkernel.h");
const GENERATED: &str = include_str!(concat!(env!("OUT_DIR"), "/mkernel.h"));

fn define(header: &str, name: &str) -> String {
    let prefix = format!("#define {name} ");
    header
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("header lacks #define {name}"))
        .trim()
        .to_string()
}

#[test]
fn committed_header_is_fresh() {
    assert!(
        COMMITTED == GENERATED,
        "include/mkernel.h is stale: regenerate it with `MK_UPDATE_HEADER=1 cargo build` and commit it"
    );
}

#[test]
fn header_reads_lifecycle_then_collectives_then_fused_ops() {
    // The declarations, not mentions in doc comments.
    let position = |name: &str| {
        [format!("\nmkResult_t {name}("), format!("\nconst char *{name}(")]
            .iter()
            .find_map(|decl| COMMITTED.find(decl.as_str()))
            .unwrap_or_else(|| panic!("header lacks a declaration of {name}"))
    };
    let order = [
        "mkGetUniqueId",
        "mkCommInitRank",
        "mkCommDestroy",
        "mkCommAbort",
        "mkConfigInit",
        "mkGetVersion",
        "mkGetLastError",
        "mkAllGather",
        "mkAllReduce",
        "mkAllGatherGemm",
        "mkRingAttention",
        "mkGemm",
    ];
    for pair in order.windows(2) {
        assert!(position(pair[0]) < position(pair[1]), "{} must come before {} in include/mkernel.h", pair[0], pair[1]);
    }
}

#[test]
fn header_documents_threads_limits_and_error_string_lifetimes() {
    for needle in [
        "mkCommAbort (and mkCommDestroy) may be called from another thread",
        "mkGetLastError(NULL): the calling thread's last failure",
        "shared by all threads",
        "`nranks` is at most 65536",
        "capability 9.0 (H100, H200, GH200)",
    ] {
        assert!(COMMITTED.contains(needle), "the header does not say {needle:?}");
    }
}

#[test]
fn header_version_macros_match_cargo_toml() {
    assert_eq!(define(COMMITTED, "MK_MAJOR"), env!("CARGO_PKG_VERSION_MAJOR"));
    assert_eq!(define(COMMITTED, "MK_MINOR"), env!("CARGO_PKG_VERSION_MINOR"));
    assert_eq!(define(COMMITTED, "MK_PATCH"), env!("CARGO_PKG_VERSION_PATCH"));
    let cargo_toml = include_str!("../Cargo.toml");
    let version_line = cargo_toml.lines().find(|l| l.starts_with("version = ")).unwrap();
    assert_eq!(version_line, format!("version = \"{}\"", env!("CARGO_PKG_VERSION")));
    let mut v = 0;
    unsafe { mkernel::ffi::query::mkGetVersion(&mut v) };
    assert_eq!(v, mkernel::version_code());
}

#[test]
fn handwritten_header_constants_match_rust() {
    assert_eq!(define(COMMITTED, "MK_CONFIG_MAGIC"), format!("{MK_CONFIG_MAGIC:#x}u"));
    assert_eq!(define(COMMITTED, "MK_CONFIG_UNDEF_INT"), "INT_MIN");
    assert_eq!(MK_CONFIG_UNDEF_INT, i32::MIN);
    assert_eq!(define(COMMITTED, "MK_MOE_OPTIONS_MAGIC"), format!("{MK_MOE_OPTIONS_MAGIC:#x}u"));
    assert_eq!(define(COMMITTED, "MK_MOE_NO_DROP"), MK_MOE_NO_DROP.to_string());
    assert_eq!(define(COMMITTED, "MK_MOE_DROP"), MK_MOE_DROP.to_string());
    assert_eq!(define(COMMITTED, "MK_MOE_ACT_NONE"), MK_MOE_ACT_NONE.to_string());
    assert_eq!(define(COMMITTED, "MK_MOE_ACT_SILU"), MK_MOE_ACT_SILU.to_string());
    assert_eq!(define(COMMITTED, "MK_MOE_ACT_GELU"), MK_MOE_ACT_GELU.to_string());
}

#[test]
fn shared_library_exports_only_mk_symbols() {
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().parent().unwrap().join("libmkernel.so");
    assert!(lib.exists(), "{} not built: `cargo test` builds only the rlib; run `cargo build --lib` (same profile) first, as scripts/test.sh does", lib.display());
    let out = Command::new("nm").args(["-D", "--defined-only"]).arg(&lib).output().expect("nm (binutils) is needed");
    assert!(out.status.success());
    let symbols: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_string))
        .collect();
    assert!(symbols.iter().any(|s| s == "mkCommInitRank"), "{symbols:?}");
    let foreign: Vec<&String> = symbols.iter().filter(|s| !s.starts_with("mk")).collect();
    assert!(foreign.is_empty(), "non-mk symbols exported: {foreign:?}");
}

#[test]
fn soname_carries_the_major_version() {
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().parent().unwrap().join("libmkernel.so");
    let out = Command::new("readelf").arg("-d").arg(&lib).output().expect("readelf (binutils) is needed");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("[libmkernel.so.{}]", env!("CARGO_PKG_VERSION_MAJOR"))), "{text}");
}
