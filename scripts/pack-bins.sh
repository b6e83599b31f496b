#!/usr/bin/env bash
# Packs the GPU run's two binaries for carrying to the GPU machine, whose copy of the
# working tree is size-limited (64 MiB): target/release/{mktest,mkbench} stripped of their
# debug info and xz-compressed into one file (~2 MB instead of ~44 MB).
#   scripts/pack-bins.sh [OUT_FILE]     (default .carry/bins.tar.xz)
# Then, on the GPU machine: BIN_TAR=OUT_FILE scripts/gpu-run.sh ...
# It first runs the kernel build checks CI runs (tests/kernels.rs: every kernel family
# embedded, no engine kernel spilling), so device time is not spent on a build that CI
# would then reject (session 11 measured a build whose AG+GEMM kernels spilled; its CI
# failed). MK_PACK_UNCHECKED=1 skips them, for an experiment that knows it spills.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${MK_PACK_UNCHECKED:-0}" != 1 ] && ! check_log=$(cargo test --release -q --test kernels 2>&1); then
  echo "pack-bins: the kernel build checks fail (cargo test --release --test kernels); not packing" >&2
  grep -E "panicked at|^assertion|^  left|^ right" <<<"$check_log" | head -n 8 >&2 || true
  exit 1
fi
out=${1:-.carry/bins.tar.xz}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for b in mktest mkbench; do strip -o "$tmp/$b" "target/release/$b"; done
mkdir -p "$(dirname "$out")"
tar -C "$tmp" -cf - mktest mkbench | xz -T0 -6 > "$out"
echo "pack-bins: $out ($(du -h "$out" | cut -f1))"
