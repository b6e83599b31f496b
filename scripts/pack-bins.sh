#!/usr/bin/env bash
# Packs what the GPU run needs for carrying to the GPU machine, whose copy of the working
# tree is size-limited (64 MiB) and which has no Rust: target/release/{mktest,mkbench}
# stripped of their debug info, the cargo test binary whose tests need a GPU
# (transport_gpu, run there with --ignored), and the C tests that `make ctest` builds (ctests/: test_abi,
# test_abi_san, test_cxx, with lib/ holding the libmkernel.so they link and the ASan/UBSan
# runtimes of the compiler that built them), xz-compressed into one file.
#   scripts/pack-bins.sh [OUT_FILE]     (default .carry/bins.tar.xz)
# Then, on the GPU machine: BIN_TAR=OUT_FILE scripts/gpu-run.sh ...
# It first runs the kernel build checks CI runs (tests/kernels.rs: every kernel family
# embedded, no engine kernel spilling) and `make ctest` (which builds the C tests and runs
# them here), so device time is not spent on a build that CI would reject.
# MK_PACK_UNCHECKED=1 skips the kernel checks, for an experiment that knows it spills.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${MK_PACK_UNCHECKED:-0}" != 1 ] && ! check_log=$(cargo test --release -q --test kernels 2>&1); then
  echo "pack-bins: the kernel build checks fail (cargo test --release --test kernels); not packing" >&2
  grep -E "panicked at|^assertion|^  left|^ right" <<<"$check_log" | head -n 8 >&2 || true
  exit 1
fi
if ! ctest_log=$(make -s ctest 2>&1); then
  echo "pack-bins: make ctest fails; not packing" >&2
  tail -n 20 <<<"$ctest_log" >&2
  exit 1
fi
out=${1:-.carry/bins.tar.xz}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for b in mktest mkbench; do strip -o "$tmp/$b" "target/release/$b"; done
gpu_test=$(cargo test --release --test transport_gpu --no-run 2>&1 | sed -n 's/.*Executable .*(\(.*\))$/\1/p' | tail -n 1)
[ -x "$gpu_test" ] || { echo "pack-bins: cannot build the transport_gpu test binary" >&2; exit 1; }
strip -o "$tmp/transport_gpu" "$gpu_test"
mkdir -p "$tmp/ctests/lib"
for t in test_abi test_abi_san test_cxx; do cp "build/ctests/$t" "$tmp/ctests/$t"; done
# The library under every name the loader may ask for (soname, plain, versioned).
for l in build/prefix/lib/libmkernel.so*; do
  if [ -L "$l" ]; then cp -P "$l" "$tmp/ctests/lib/"; else strip -o "$tmp/ctests/lib/$(basename "$l")" "$l"; fi
done
# The sanitizer runtimes test_abi_san needs, from the compiler that linked it.
for rt in $(ldd build/ctests/test_abi_san | awk '/lib(asan|ubsan)/ { print $3 }'); do cp -L "$rt" "$tmp/ctests/lib/"; done
mkdir -p "$(dirname "$out")"
git rev-parse HEAD > "$tmp/COMMIT"
tar -C "$tmp" -cf - COMMIT mktest mkbench transport_gpu ctests | xz -T0 -6 > "$out"
echo "pack-bins: $out ($(du -h "$out" | cut -f1))"
