//! Every CUDA-graph capture in the workspace (the test driver's, the benchmarks') goes
//! through `testing::CapturedGraph`, which captures in thread-local mode: in global mode,
//! ranks that run as threads of one process make each other's captures fail
//! (tools/src/testing/graph.rs).

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source tree").flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_capture_goes_through_the_thread_local_helper() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root");
    let mut files = Vec::new();
    for dir in ["src", "nccl", "tests", "tools"] {
        rust_files(&root.join(dir), &mut files);
    }
    let this = Path::new(file!()).file_name().expect("a file name");
    let capturing: Vec<String> = files
        .iter()
        .filter(|p| p.file_name() != Some(this))
        .filter(|p| std::fs::read_to_string(p).is_ok_and(|text| text.contains("cuStreamBeginCapture")))
        .map(|p| p.strip_prefix(root).expect("under the root").display().to_string())
        .collect();
    assert_eq!(capturing, ["tools/src/testing/graph.rs"], "captures outside testing::CapturedGraph");
    assert_eq!(
        mkernel_tools::testing::CAPTURE_MODE,
        mkernel::cuda::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    );
}
