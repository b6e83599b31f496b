//! Link settings of libmkernel-nccl.so: its SONAME, and an export list of NCCL's functions
//! alone. rustc exports every `#[no_mangle]` function of every crate linked in, mkernel's
//! mk* included; `--exclude-libs ALL` hides what comes from the linked rlibs (archives), and
//! the version script keeps nccl* and hides the rest.
fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap();
    println!("cargo:rerun-if-changed=exports.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/exports.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--exclude-libs,ALL");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libmkernel-nccl.so.2");
}
