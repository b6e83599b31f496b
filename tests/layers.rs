//! The layers of docs/architecture.md hold: a module of the library names only modules of its
//! own layer or of the layers below it, so a lower layer never depends on an op (the GEMM
//! planner, an op's enum, an op's error word) and the import graph has no circle through
//! the layers. A source scan: every `crate::<module>` path (and every `crate::{..}` list) in
//! src/, comments left out, against the table below.

use std::path::{Path, PathBuf};

/// Each top-level module of src/ and its layer; a module may name modules of its layer and
/// of lower layers only. `ffi` over `ops` over `comm` over `transport` over `bootstrap` over
/// the base (the driver layer, settings, logging, errors, the data types, the kernel ABI),
/// whose modules may name each other. (The test and benchmark support is the tools crate,
/// tools/, outside the library: a `crate::` path here cannot name it.)
const LAYERS: &[(&str, u32)] = &[
    ("ffi", 6),
    ("ops", 5),
    ("comm", 4),
    ("transport", 3),
    ("bootstrap", 2),
    ("cuda", 1),
    ("env", 1),
    ("log", 1),
    ("tuning", 1),
    ("error", 1),
    ("types", 1),
    ("kernel_abi", 1),
];

/// Names at the crate root that are not modules (exported macros, re-exports, functions).
const ROOT_ITEMS: &[&str] =
    &["mk_info", "mk_warn", "mk_debug", "ensure_arg", "mkResult_t", "MkError", "Result", "version_code"];

fn layer_of(module: &str) -> Option<u32> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|(_, l)| *l)
}

/// The source with `//` comments removed (doc comments name modules of other layers freely).
fn strip_comments(text: &str) -> String {
    text.lines().map(|l| l.find("//").map_or(l, |i| &l[..i])).collect::<Vec<_>>().join("\n")
}

/// Every top-level module a source names through `crate::`.
fn named_modules(text: &str) -> Vec<String> {
    let code = strip_comments(text);
    let mut names = Vec::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `$crate::` or `mkernel_crate::`: not this crate's path
        }
        if let Some(list) = rest.strip_prefix('{') {
            let end = list.find('}').unwrap_or(list.len());
            for item in list[..end].split(',') {
                let first = item.trim().split("::").next().unwrap_or("").trim();
                if !first.is_empty() {
                    names.push(first.to_string());
                }
            }
        } else {
            let ident: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            if !ident.is_empty() {
                names.push(ident);
            }
        }
    }
    names
}

/// The top-level module a file of src/ belongs to: `src/ops/gemm/engine.rs` → `ops`.
fn module_of(relative: &Path) -> String {
    let first = relative.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
    first.trim_end_matches(".rs").to_string()
}

/// Every import that runs upward or names an unclassified module, as "file: message".
fn violations(files: &[(PathBuf, String)]) -> Vec<String> {
    let mut found = Vec::new();
    for (path, text) in files {
        let module = module_of(path);
        let Some(layer) = layer_of(&module) else {
            found.push(format!("{}: module `{module}` has no layer in tests/layers.rs", path.display()));
            continue;
        };
        for name in named_modules(text) {
            if ROOT_ITEMS.contains(&name.as_str()) || name == module {
                continue;
            }
            match layer_of(&name) {
                Some(l) if l <= layer => {}
                Some(l) => found.push(format!(
                    "{}: `{module}` (layer {layer}) names `crate::{name}` (layer {l}), a layer above it",
                    path.display()
                )),
                None => found.push(format!("{}: names `crate::{name}`, which has no layer", path.display())),
            }
        }
    }
    found
}

fn collect(dir: &Path, root: &Path, out: &mut Vec<(PathBuf, String)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let relative = path.strip_prefix(root).unwrap().to_path_buf();
        if path.is_dir() {
            if relative != Path::new("bin") {
                collect(&path, root, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") && relative != Path::new("lib.rs") {
            out.push((relative, std::fs::read_to_string(&path).unwrap()));
        }
    }
}

fn library_sources() -> Vec<(PathBuf, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    collect(&root, &root, &mut files);
    files
}

#[test]
fn no_module_names_a_layer_above_its_own() {
    let files = library_sources();
    assert!(files.len() > 50, "the scan found only {} files under src/", files.len());
    let found = violations(&files);
    assert!(found.is_empty(), "imports against the layers:\n{}", found.join("\n"));
}

#[test]
fn every_top_level_module_has_a_layer() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = std::fs::read_to_string(root.join("lib.rs")).unwrap();
    let declared: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod ").or_else(|| l.trim().strip_prefix("mod ")))
        .map(|l| l.trim_end_matches(';').trim())
        .collect();
    assert!(declared.len() >= 10, "lib.rs declares {declared:?}");
    let missing: Vec<_> = declared.iter().filter(|m| layer_of(m).is_none()).collect();
    assert!(missing.is_empty(), "modules of lib.rs without a layer: {missing:?}");
}

/// The crate's Rust interface is the C ABI: lib.rs declares `ffi` and the modules cbindgen
/// reads the header's types from (`error`, `types`) public, and every other layer public only
/// under the feature `internals` (private without it).
#[test]
fn only_the_c_abi_is_public_without_internals() {
    let lib = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    let lines: Vec<&str> = lib.lines().map(str::trim).collect();
    let mut always_public = Vec::new();
    let (mut gated_public, mut gated_private) = (Vec::new(), Vec::new());
    for (i, line) in lines.iter().enumerate() {
        let previous = if i > 0 { lines[i - 1] } else { "" };
        let declared = |prefix: &str| line.strip_prefix(prefix).map(|m| m.trim_end_matches(';').to_string());
        if let Some(m) = declared("pub mod ") {
            match previous {
                "#[cfg(feature = \"internals\")]" => gated_public.push(m),
                _ => always_public.push(m),
            }
        } else if let Some(m) = declared("mod ") {
            assert_eq!(previous, "#[cfg(not(feature = \"internals\"))]", "lib.rs: `mod {m}` outside the feature gate");
            gated_private.push(m);
        }
    }
    always_public.sort();
    assert_eq!(always_public, ["error", "ffi", "types"], "modules public without `internals`");
    assert_eq!(gated_public, gated_private, "each gated layer: public with `internals`, private without");
    let declared: Vec<&str> = always_public.iter().chain(&gated_public).map(String::as_str).collect();
    let missing: Vec<_> = LAYERS.iter().map(|(m, _)| *m).filter(|m| !declared.contains(m)).collect();
    assert!(missing.is_empty(), "layers lib.rs does not declare: {missing:?}");
}

#[test]
fn the_scan_reports_an_upward_import() {
    let file = |path: &str, text: &str| (PathBuf::from(path), text.to_string());
    let planted = [
        file("comm/mod.rs", "use crate::ops::common::fused_fence::FenceState;\n"),
        file("cuda/mod.rs", "static M: crate::cuda::memo::Memo<i32, i32> = crate::ops::x();\n"),
        file("transport/inter_node.rs", "use crate::{error::Result, comm::Comm};\n"),
        file("tuning.rs", "fn f() { let _ = crate::testing::x(); }\n"),
    ];
    let found = violations(&planted);
    assert_eq!(found.len(), 4, "{found:#?}");
    assert!(found[0].contains("`comm` (layer 4) names `crate::ops`"), "{}", found[0]);
    assert!(found[2].contains("names `crate::comm`"), "{}", found[2]);
    // Downward and same-layer names, comments and other crates' `$crate::` pass.
    let fine = [
        file("ops/moe.rs", "use crate::comm::Comm;\nuse crate::{cuda::sys, ops::common::launch};\n"),
        file("env.rs", "use crate::tuning::Reducers; // not crate::ops::gemm\n"),
        file("log.rs", "macro_rules! m { () => { $crate::log::emit() } }\n"),
    ];
    assert_eq!(violations(&fine), Vec::<String>::new());
    assert!(violations(&[file("newlayer/x.rs", "")])[0].contains("has no layer"));
}
