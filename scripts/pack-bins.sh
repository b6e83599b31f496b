#!/usr/bin/env bash
# Packs the GPU run's two binaries for carrying to the GPU machine, whose copy of the
# working tree is size-limited (64 MiB): target/release/{mktest,mkbench} stripped of their
# debug info and xz-compressed into one file (~2 MB instead of ~44 MB).
#   scripts/pack-bins.sh [OUT_FILE]     (default .carry/bins.tar.xz)
# Then, on the GPU machine: BIN_TAR=OUT_FILE scripts/gpu-run.sh ...
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.carry/bins.tar.xz}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for b in mktest mkbench; do strip -o "$tmp/$b" "target/release/$b"; done
mkdir -p "$(dirname "$out")"
tar -C "$tmp" -cf - mktest mkbench | xz -T0 -6 > "$out"
echo "pack-bins: $out ($(du -h "$out" | cut -f1))"
