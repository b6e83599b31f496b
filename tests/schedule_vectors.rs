//! The host mirrors in `mkernel::ops::schedule` against the device code itself:
//! `kernels/common/gemm/scheduler.cuh` is plain integer arithmetic, so it compiles as host
//! C++ with `__device__` and `__forceinline__` defined away. A driver runs it over a sweep of
//! shapes and prints every tile; each must equal the mirror's. A change to either side that
//! the other does not follow fails here, on a machine without a GPU.

use mkernel::ops::schedule::{grouped_index, grouped_tile, interleaved_tile};
use std::path::Path;
use std::process::Command;

const DRIVER: &str = r#"
#define __device__
#define __forceinline__ inline
#include <algorithm>
#include <cstdio>
using std::max;
using std::min;
#include "scheduler.cuh"
using namespace mk::gemm;

int main() {
  const int tiles_ms[] = {1, 2, 3, 5, 8, 12, 13, 16, 33, 64};
  const int tiles_ns[] = {1, 2, 7, 16, 57};
  const int groups[] = {1, 2, 3, 8, 16};
  const int owners_list[] = {1, 2, 3, 4, 8};
  for (int tm : tiles_ms)
    for (int tn : tiles_ns)
      for (int g : groups)
        for (int t = 0; t < tm * tn; ++t) {
          const TileCoord c = grouped_tile(tm, tn, g, t);
          std::printf("grouped %d %d %d %d %d %d %d\n", tm, tn, g, t, c.m_block, c.n_block, grouped_index(tm, tn, g, c));
          for (int owners : owners_list) {
            if (tm % owners != 0) continue;
            const TileCoord o = interleaved_tile(tm, tn, g, owners, t);
            std::printf("interleaved %d %d %d %d %d %d %d\n", tm, tn, g, owners, t, o.m_block, o.n_block);
          }
        }
  return 0;
}
"#;

fn device_vectors() -> String {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("schedule_vectors");
    std::fs::create_dir_all(&dir).unwrap();
    let (src, exe) = (dir.join("driver.cpp"), dir.join("driver"));
    std::fs::write(&src, DRIVER).unwrap();
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/common/gemm");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let built = Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-Wall", "-Werror", "-I"])
        .arg(&include)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("{cxx}: {e} (a C++ compiler is needed; scripts/setup.sh installs one)"));
    assert!(built.status.success(), "{cxx} failed:\n{}", String::from_utf8_lossy(&built.stderr));
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success());
    String::from_utf8(run.stdout).unwrap()
}

#[test]
fn host_mirrors_print_the_device_schedulers_tiles() {
    let (mut grouped, mut interleaved) = (0, 0);
    for line in device_vectors().lines() {
        let mut words = line.split(' ');
        let kind = words.next().unwrap();
        let v: Vec<usize> = words.map(|w| w.parse().unwrap()).collect();
        match kind {
            "grouped" => {
                let [tm, tn, g, t, m, n, index] = v[..] else { panic!("{line}") };
                assert_eq!(grouped_tile(tm, tn, g, t), (m, n), "grouped_tile: {line}");
                assert_eq!(grouped_index(tm, tn, g, (m, n)), index, "grouped_index: {line}");
                assert_eq!(index, t, "the device's grouped_index inverts its grouped_tile: {line}");
                grouped += 1;
            }
            "interleaved" => {
                let [tm, tn, g, owners, t, m, n] = v[..] else { panic!("{line}") };
                assert_eq!(interleaved_tile(tm, tn, g, owners, t), (m, n), "interleaved_tile: {line}");
                interleaved += 1;
            }
            _ => panic!("unexpected line {line}"),
        }
    }
    // The sweep above: 10 × 5 × 5 shapes of up to 64 × 57 tiles.
    assert!(grouped > 50_000 && interleaved > 50_000, "{grouped} grouped, {interleaved} interleaved tiles");
}
