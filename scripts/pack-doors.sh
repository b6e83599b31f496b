#!/usr/bin/env bash
# Packs what scripts/gpu-doors.sh runs on a GPU machine that has no Rust, Go or network:
# the example binaries and the library they load (scripts/test-examples.sh --keep), the
# Python wheel (scripts/build-wheel.sh), the stripped libmkernel-nccl, and the commit.
#   scripts/pack-doors.sh [DIR]     (default .carry/doors)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.carry/doors}
rm -rf "$dir"
mkdir -p "$dir"
cargo build --release --workspace
scripts/test-examples.sh --keep "$dir/examples" >/dev/null
scripts/build-wheel.sh >/dev/null
cp "$(ls -t dist/mkernel-*.whl | head -1)" "$dir/"
strip -o "$dir/libmkernel_nccl.so" target/release/libmkernel_nccl.so
git rev-parse HEAD > "$dir/COMMIT"
echo "pack-doors: $dir ($(du -sh "$dir" | cut -f1))"
