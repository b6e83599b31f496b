//! Device headers compiled as host C++. A test writes a driver program that includes a
//! header of kernels/common and prints what its functions compute; comparing that output
//! with the Rust checks the device's own code, not a copy of it, without a GPU.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Writes `source` as driver.cpp in the folder `name` of the test's temporary directory
/// (one per caller: tests run in parallel), compiles it with the host compiler (CXX, else
/// c++) with kernels/common and kernels/common/gemm on the include path, and returns the
/// executable.
pub fn build_driver(name: &str, source: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let (src, exe) = (dir.join("driver.cpp"), dir.join("driver"));
    std::fs::write(&src, source).unwrap();
    let common = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/common");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let built = Command::new(&cxx)
        // The device code's `#pragma unroll` means nothing to the host compiler.
        .args(["-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-unknown-pragmas", "-I"])
        .arg(common.join("gemm"))
        .arg("-I")
        .arg(&common)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("{cxx}: {e} (a C++ compiler is needed; scripts/setup.sh installs one)"));
    assert!(built.status.success(), "{cxx} failed:\n{}", String::from_utf8_lossy(&built.stderr));
    exe
}

/// Runs a driver with `args`; what it printed. It must exit 0.
pub fn run_driver(exe: &Path, args: &[&Path]) -> String {
    let run = Command::new(exe).args(args).output().unwrap();
    assert!(run.status.success(), "{} failed:\n{}", exe.display(), String::from_utf8_lossy(&run.stderr));
    String::from_utf8(run.stdout).unwrap()
}
