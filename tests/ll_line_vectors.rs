//! The low-latency line of kernels/collectives.cu against the device code itself:
//! `kernels/common/ll_line.cuh` is plain integer arithmetic, so it compiles as host C++ with
//! `__device__` and `__forceinline__` defined away. A driver prints which lines a reader
//! takes and the bytes `ll_read` / `ll_write` move; each must be what the protocol needs,
//! on a machine without a GPU.

mod common;

const DRIVER: &str = r#"
#define __device__
#define __forceinline__ inline
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
struct uint2 {
  uint32_t x, y;
};
inline uint2 make_uint2(uint32_t x, uint32_t y) { return uint2{x, y}; }
#include "ll_line.cuh"

// "take W R": whether a reader at step R takes a line whole from step W (W = 0: the
// zeroed region). "torn A B R": a line whose first half came from step A, its second
// from step B.
static void acceptance(FILE* f) {
  char kind[8];
  unsigned long long a, b, r;
  while (std::fscanf(f, "%7s", kind) == 1) {
    if (std::strcmp(kind, "take") == 0 && std::fscanf(f, "%llu %llu", &a, &r) == 2) {
      const LlFlags w = a == 0 ? LlFlags{0, 0} : ll_flags(a);
      std::printf("take %llu %llu %d\n", a, r, (int)ll_flags_match(w.lo, w.hi, ll_flags(r)));
    } else if (std::strcmp(kind, "torn") == 0 && std::fscanf(f, "%llu %llu %llu", &a, &b, &r) == 3) {
      const LlFlags first = ll_flags(a), second = ll_flags(b);
      std::printf("torn %llu %llu %llu %d\n", a, b, r, (int)ll_flags_match(first.lo, second.hi, ll_flags(r)));
    }
  }
}

// Every line of every piece of 1..40 bytes at every alignment: what ll_read returns from a
// numbered buffer and what ll_write leaves in a poisoned one.
static void bytes() {
  alignas(16) unsigned char src[64], dst[64];
  for (int shift = 0; shift < 8; ++shift)
    for (uint64_t nb = 1; nb <= 40; ++nb)
      for (uint64_t i = 0; i * 8 < nb; ++i) {
        for (int k = 0; k < 64; ++k) src[k] = (unsigned char)(k * 37 + 11);
        const uint2 v = ll_read(reinterpret_cast<const char*>(src + shift), nb, i);
        std::memset(dst, 0xa5, sizeof dst);
        ll_write(reinterpret_cast<char*>(dst + shift), nb, i, make_uint2(0x03020100u, 0x07060504u));
        std::printf("bytes %d %llu %llu %u %u", shift, (unsigned long long)nb, (unsigned long long)i, v.x, v.y);
        for (int k = 0; k < 64; ++k) std::printf(" %u", dst[k]);
        std::printf("\n");
      }
}

int main(int argc, char** argv) {
  if (argc > 1) {
    FILE* f = std::fopen(argv[1], "r");
    if (f == nullptr) return 1;
    acceptance(f);
    std::fclose(f);
  }
  bytes();
  return 0;
}
"#;

/// Builds and runs the driver in a directory of its own per test (`name`): the tests run in
/// parallel.
fn device_vectors(name: &str, cases: &str) -> String {
    let exe = common::host_cxx::build_driver(&format!("ll_line_vectors/{name}"), DRIVER);
    let input = exe.with_file_name("cases.txt");
    std::fs::write(&input, cases).unwrap();
    common::host_cxx::run_driver(&exe, &[&input])
}

/// Reader steps around the places a 32-bit flag wraps (and ordinary ones), each paired with
/// the steps a line of its area (the same parity) may still hold.
fn acceptance_cases() -> String {
    const WRAP: u64 = 1 << 32;
    let mut cases = String::new();
    let readers = [1, 2, 3, 1000, WRAP - 2, WRAP - 1, WRAP, WRAP + 1, WRAP + 2, WRAP + 1000, 2 * WRAP, 3 * WRAP + 5];
    for r in readers {
        // Written whole: this step, the step two before (the area's last use), an old one,
        // and the same low half one and two wraps back; never written (the zeroed region).
        for w in [r, r.wrapping_sub(2), r % 2 + 2, r.wrapping_sub(WRAP), r.wrapping_sub(2 * WRAP), 0] {
            if w <= r && (w == 0 || w % 2 == r % 2) {
                cases += &format!("take {w} {r}\n");
            }
        }
        // Torn between this step's store and an older one of the area, either half first:
        // the previous use, and older stores within 2^32 steps.
        for older in [r.wrapping_sub(2), r.wrapping_sub(4), r % 2 + 2, r.wrapping_sub(WRAP - 2)] {
            if older >= 1 && older < r && r - older < WRAP && older % 2 == r % 2 {
                cases += &format!("torn {r} {older} {r}\ntorn {older} {r} {r}\n");
            }
        }
    }
    cases
}

#[test]
fn a_reader_takes_only_a_whole_line_of_its_own_step() {
    let out = device_vectors("acceptance", &acceptance_cases());
    let (mut whole, mut wrapped, mut torn) = (0, 0, 0);
    for line in out.lines() {
        let mut words = line.split(' ');
        let kind = words.next().unwrap();
        let v: Vec<u64> = words.map(|w| w.parse().unwrap()).collect();
        match kind {
            "take" => {
                let [w, r, taken] = v[..] else { panic!("{line}") };
                assert_eq!(
                    taken == 1,
                    w == r,
                    "a reader at step {r} and a line written at step {w} (0: never): {line}"
                );
                whole += 1;
                wrapped += (w + (1 << 32) == r) as usize;
            }
            "torn" => {
                let [a, b, r, taken] = v[..] else { panic!("{line}") };
                assert_eq!(taken, 0, "a line torn between steps {a} and {b}, read at step {r}: {line}");
                torn += 1;
            }
            _ => {}
        }
    }
    // Every reader has its own step and the zeroed region; six readers past the wrap have a
    // line one wrap back (at step 2^32 it is the zeroed region itself).
    assert!(whole >= 2 * 12 && wrapped >= 5 && torn >= 2 * 12, "{whole} whole ({wrapped} a wrap back), {torn} torn");
}

#[test]
fn lines_carry_exactly_the_bytes_of_the_piece() {
    let out = device_vectors("bytes", "");
    let mut cases = 0;
    for line in out.lines().filter(|l| l.starts_with("bytes ")) {
        let v: Vec<u64> = line.split(' ').skip(1).map(|w| w.parse().unwrap()).collect();
        let (shift, nb, i, x, y) = (v[0] as usize, v[1], v[2], v[3] as u32, v[4] as u32);
        let dst = &v[5..];
        // ll_read: bytes 8i.. of the piece, zero past its end.
        let src = |k: usize| (k as u64 * 37 + 11) as u8;
        let mut want = [0u8; 8];
        for (k, b) in want.iter_mut().enumerate() {
            let at = i * 8 + k as u64;
            if at < nb {
                *b = src(shift + at as usize);
            }
        }
        let got = [x.to_le_bytes(), y.to_le_bytes()].concat();
        assert_eq!(got, want, "ll_read shift {shift} nb {nb} line {i}");
        // ll_write: the line's bytes inside the piece, nothing else.
        for (k, &b) in dst.iter().enumerate() {
            let at = k as i64 - shift as i64 - (i * 8) as i64;
            let inside = (0..8).contains(&at) && (i * 8 + at as u64) < nb;
            let want = if inside { at as u64 } else { 0xa5 };
            assert_eq!(b, want, "ll_write shift {shift} nb {nb} line {i}: byte {k}");
        }
        cases += 1;
    }
    // Lines of pieces of 1..=40 bytes, each at 8 alignments.
    assert_eq!(cases, 8 * (1..=40u64).map(|nb| nb.div_ceil(8)).sum::<u64>());
}
