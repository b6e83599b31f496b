//! The host mirrors in `mkernel::ops::common::schedule` and `mkernel::ops::moe` against the device
//! code itself: `kernels/common/gemm/scheduler.cuh` and `kernels/common/moe_raster.cuh` are
//! plain integer arithmetic, so they compile as host C++ with `__device__` and
//! `__forceinline__` defined away. A driver runs them over a sweep of shapes (and of MoE
//! layouts the host mirror builds) and prints every tile; each must equal the mirror's. A
//! change to either side that the other does not follow fails here, on a machine without a GPU.

mod common;
use mkernel::ops::common::schedule::{grouped_index, grouped_tile, interleaved_tile};
use mkernel::ops::moe::{band_width, block_tables, moe_tile_banded, MoeShape};
use std::path::Path;

const DRIVER: &str = r#"
#define __device__
#define __forceinline__ inline
#include <algorithm>
#include <cstdio>
#include <vector>
using std::max;
using std::min;
template <class T>
T __ldcg(const T* p) {
  return *p;
}
#include "scheduler.cuh"
#include "moe_raster.cuh"
using namespace mk::gemm;

// MoE cases from argv[1], one per line: tiles_m tiles_n band_w group_m has_order, then
// tiles_m words each of order, runs (first | length << 15) and expert. Every ticket's tile.
static void moe_cases(const char* path) {
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return;
  int tm, tn, bw, g, has_order;
  for (int c = 0; std::fscanf(f, "%d %d %d %d %d", &tm, &tn, &bw, &g, &has_order) == 5; ++c) {
    std::vector<int> order(tm), runs(tm), expert(tm), rows(tm, 128);
    for (int& v : order) (void)!std::fscanf(f, "%d", &v);
    for (int& v : runs) (void)!std::fscanf(f, "%d", &v);
    for (int& v : expert) (void)!std::fscanf(f, "%d", &v);
    const mk::moe::MoeRaster::Params p{has_order ? order.data() : nullptr, runs.data(), expert.data(), rows.data(),
                                       tm, tn, bw, g, nullptr};
    for (int t = 0; t < tm * tn; ++t) {
      const TileCoord m = mk::moe::MoeRaster::tile(p, t);
      std::printf("moe %d %d %d %d\n", c, t, m.m_block, m.n_block);
    }
  }
  std::fclose(f);
}

int main(int argc, char** argv) {
  if (argc > 1) moe_cases(argv[1]);
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

/// A MoE raster case: (tiles_m, tiles_n, band_w, group_m, order or none, runs, expert).
struct MoeCase {
    tiles_n: usize,
    band_w: usize,
    group_m: usize,
    order: Option<Vec<usize>>,
    runs: Vec<(usize, usize)>,
    expert: Vec<usize>,
}

/// The block tables ops::moe builds for random routings at 1 to 8 ranks, each as the
/// dispatch walks them (the order table, expert runs, one band) and as the combine does (no
/// order table, expert segments, column bands), over several column counts and groups.
fn moe_cases() -> Vec<MoeCase> {
    let mut cases = Vec::new();
    let mut x = 0x9e3779b97f4a7c15u64;
    for (nranks, tokens, top_k, experts) in
        [(1, 300, 2, 8), (2, 400, 4, 16), (4, 512, 8, 32), (8, 256, 8, 64), (3, 200, 3, 12)]
    {
        let s = MoeShape::new(tokens, top_k, experts, nranks);
        let routing: Vec<Vec<i32>> = (0..nranks)
            .map(|_| {
                (0..tokens)
                    .flat_map(|_| {
                        let mut picked: Vec<i32> = Vec::new();
                        while picked.len() < top_k {
                            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                            // Skewed: half the choices fall on the first quarter of the experts.
                            let e = if (x >> 20) & 1 == 0 {
                                (x >> 33) % experts as u64
                            } else {
                                (x >> 33) % (experts as u64 / 4).max(1)
                            };
                            if !picked.contains(&(e as i32)) {
                                picked.push(e as i32);
                            }
                        }
                        picked
                    })
                    .collect()
            })
            .collect();
        for rank in 0..nranks {
            let t = block_tables(&s, &routing, rank).unwrap();
            for (tiles_n, g) in [(1, 1), (8, 5), (3, 2), (28, 6), (4, 100), (14, 3)] {
                let g = g.min(t.expert.len()).max(1);
                let common = |order: Option<Vec<usize>>, runs: &[(usize, usize)], band_w| MoeCase {
                    tiles_n,
                    band_w,
                    group_m: g,
                    order,
                    runs: runs.to_vec(),
                    expert: t.expert.clone(),
                };
                cases.push(common(Some(t.order.clone()), &t.run, tiles_n));
                cases.push(common(None, &t.seg, band_width(tiles_n, 4)));
            }
        }
    }
    cases
}

fn write_moe_cases(cases: &[MoeCase], path: &Path) {
    let mut text = String::new();
    for c in cases {
        let tm = c.expert.len();
        let words = |v: &mut String, it: &mut dyn Iterator<Item = usize>| {
            for w in it {
                v.push_str(&format!(" {w}"));
            }
        };
        text.push_str(&format!("{tm} {} {} {} {}", c.tiles_n, c.band_w, c.group_m, c.order.is_some() as u8));
        words(&mut text, &mut (0..tm).map(|b| c.order.as_ref().map_or(b, |o| o[b])));
        words(&mut text, &mut c.runs.iter().map(|&(first, len)| first | len << 15));
        words(&mut text, &mut c.expert.iter().copied());
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

fn device_vectors(moe: &[MoeCase]) -> String {
    let exe = common::host_cxx::build_driver("schedule_vectors", DRIVER);
    if moe.is_empty() {
        return common::host_cxx::run_driver(&exe, &[]);
    }
    let cases = exe.with_file_name("moe_cases.txt");
    write_moe_cases(moe, &cases);
    common::host_cxx::run_driver(&exe, &[&cases])
}

#[test]
fn host_mirrors_print_the_device_schedulers_tiles() {
    let (mut grouped, mut interleaved, mut moe) = (0, 0, 0);
    let cases = moe_cases();
    let mut next_ticket = vec![0; cases.len()];
    for line in device_vectors(&cases).lines() {
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
            "moe" => {
                // Ticket t of the MoE kernels' dynamic schedule is tile t of MoeRaster's order:
                // the device's tile and the host mirror's (block, column of the expert).
                let [c, t, m, n] = v[..] else { panic!("{line}") };
                let case = &cases[c];
                assert_eq!(t, next_ticket[c], "every ticket in order: {line}");
                next_ticket[c] += 1;
                let (tiles_m, tn) = (case.expert.len(), case.tiles_n);
                let (b, nb) =
                    moe_tile_banded(case.order.as_deref(), Some(&case.runs), tiles_m, tn, case.band_w, case.group_m, t);
                assert_eq!((m, n), (b, case.expert[b] * tn + nb), "MoeRaster::tile against moe_tile_banded: {line}");
                moe += 1;
            }
            _ => panic!("unexpected line {line}"),
        }
    }
    // The sweep above: 10 × 5 × 5 shapes of up to 64 × 57 tiles.
    assert!(grouped > 50_000 && interleaved > 50_000, "{grouped} grouped, {interleaved} interleaved tiles");
    for (c, case) in cases.iter().enumerate() {
        assert_eq!(next_ticket[c], case.expert.len() * case.tiles_n, "case {c}: every ticket printed");
    }
    assert!(cases.len() >= 200 && moe > 40_000, "{} MoE cases, {moe} tiles", cases.len());
}
