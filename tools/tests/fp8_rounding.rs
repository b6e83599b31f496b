//! The host's fp8 rounding (`testing::fp8`), which the fp8 tests' references use, against
//! CUDA's own conversion: cuda_fp8.h's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)`,
//! whose host code is NVIDIA's model of the `cvt.rn.satfinite` instruction the kernels
//! run. A small C++ program built against the pinned CUDA headers (those beside the nvcc
//! that compiles the kernels) converts every fp8 value, every midpoint between neighbours
//! (the ties), a hair to either side of each, the special values and 400,000 random bit
//! patterns; every result must equal the host's, NaN for NaN.

use mkernel_tools::testing::fp8::{e4m3_to_f32, e5m2_to_f32, f32_to_e4m3, f32_to_e5m2};
use std::path::{Path, PathBuf};
use std::process::Command;

const PROGRAM: &str = r#"
#include <cuda_fp8.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>

static void emit(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  unsigned e4 = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
  unsigned e5 = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E5M2);
  std::printf("%08x %02x %02x\n", bits, e4, e5);
}

static float decode(uint8_t b, bool e5) {
  __nv_fp8_storage_t s = b;
  return (float)__half(__nv_cvt_fp8_to_halfraw(s, e5 ? __NV_E5M2 : __NV_E4M3));
}

int main() {
  for (int e5 = 0; e5 < 2; e5++)
    for (int c = 0; c < 255; c++) {
      float a = decode((uint8_t)c, e5), b = decode((uint8_t)(c + 1), e5);
      if (std::isnan(a) || std::isnan(b) || std::isinf(a) || std::isinf(b)) continue;
      float mid = (float)(((double)a + (double)b) / 2);
      float values[] = {a, -a, mid, -mid, std::nextafterf(mid, 0.0f), std::nextafterf(mid, INFINITY)};
      for (float f : values) emit(f);
    }
  float specials[] = {INFINITY, -INFINITY, NAN, 0.0f, -0.0f, 448.0f, 464.0f, 480.0f, 1e9f, 57344.0f,
                      61440.0f, 65504.0f, 1e-30f, -1e-30f};
  for (float f : specials) emit(f);
  uint64_t x = 0x6d6b65726e656cull;
  for (int i = 0; i < 400000; i++) {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    uint32_t bits = (uint32_t)(z >> 32);
    float f;
    std::memcpy(&f, &bits, 4);
    emit(f);
  }
  return 0;
}
"#;

/// The CUDA headers beside the nvcc that builds the kernels (build.rs's search: MK_NVCC,
/// then the repository's .venv-cuda, then /usr/local/cuda).
fn cuda_include() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let mut candidates = Vec::new();
    if let Some(nvcc) = std::env::var_os("MK_NVCC") {
        candidates.push(PathBuf::from(nvcc).parent().unwrap().parent().unwrap().join("include"));
    }
    if let Ok(entries) = std::fs::read_dir(workspace.join(".venv-cuda/lib")) {
        for e in entries.flatten() {
            candidates.push(e.path().join("site-packages/nvidia/cu13/include"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    candidates.into_iter().find(|d| d.join("cuda_fp8.h").is_file()).unwrap_or_else(|| {
        panic!("cuda_fp8.h not found: the kernels' nvcc (MK_NVCC, .venv-cuda or /usr/local/cuda) brings it")
    })
}

fn same(host: u8, cuda: u8, decode: fn(u8) -> f32) -> bool {
    if decode(cuda).is_nan() {
        decode(host).is_nan()
    } else {
        host == cuda
    }
}

#[test]
fn host_rounding_equals_cudas_saturating_conversion() {
    let dir = std::env::temp_dir().join(format!("mk-fp8-rounding-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (source, binary) = (dir.join("convert.cpp"), dir.join("convert"));
    std::fs::write(&source, PROGRAM).unwrap();
    let built = Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
        .args(["-std=c++17", "-O1", "-I"])
        .arg(cuda_include())
        .arg(&source)
        .arg("-o")
        .arg(&binary)
        .output()
        .expect("running the C++ compiler");
    assert!(built.status.success(), "building the converter: {}", String::from_utf8_lossy(&built.stderr));
    let run = Command::new(&binary).output().expect("running the converter");
    assert!(run.status.success());
    std::fs::remove_dir_all(&dir).ok();
    let text = String::from_utf8(run.stdout).unwrap();
    let (mut checked, mut differ) = (0usize, Vec::new());
    for line in text.lines() {
        let mut fields = line.split(' ');
        let mut next = || u32::from_str_radix(fields.next().unwrap(), 16).unwrap();
        let (bits, e4, e5) = (next(), next() as u8, next() as u8);
        let f = f32::from_bits(bits);
        let (h4, h5) = (f32_to_e4m3(f), f32_to_e5m2(f));
        if !same(h4, e4, e4m3_to_f32) || !same(h5, e5, e5m2_to_f32) {
            differ.push(format!("{f:e} ({bits:#010x}): cuda e4m3 {e4:#04x} e5m2 {e5:#04x}, host {h4:#04x} {h5:#04x}"));
        }
        checked += 1;
    }
    assert!(checked > 400_000, "the converter printed {checked} lines");
    assert!(differ.is_empty(), "{} of {checked} differ, first: {:#?}", differ.len(), &differ[..differ.len().min(8)]);
}
