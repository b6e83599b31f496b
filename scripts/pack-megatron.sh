#!/usr/bin/env bash
# Packs what scripts/gpu-megatron.sh needs on a GPU machine that has no Rust and no network,
# into one folder (default .carry/megatron, ignored by git):
#   - the megatron-core wheel of python/requirements-gpu-megatron.txt for CPython 3.12 on
#     x86-64 (the GPU machine's python3), checked against its pinned hash; cached in
#     .whl/megatron so a repeat needs no network;
#   - the mkernel wheel (scripts/build-wheel.sh) and the stripped libmkernel_nccl.so
#     (cargo build --release --workspace), or the ones --wheel and --nccl-so name;
#   - COMMIT, the commit they were built from.
#   scripts/pack-megatron.sh [--wheel FILE] [--nccl-so FILE] [DIR]
# Prints each file's size and the total: the device call's copy is limited to 64 MiB with
# the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=""; nccl_so=""; dir=.carry/megatron
while [ $# -gt 0 ]; do
  case "$1" in
    --wheel|--nccl-so) [ $# -ge 2 ] || { echo "pack-megatron: $1 needs a value" >&2; exit 2; } ;;
  esac
  case "$1" in
    --wheel) wheel=$2; shift ;;
    --nccl-so) nccl_so=$2; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "pack-megatron: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) dir=$1 ;;
  esac
  shift
done
for f in "$wheel" "$nccl_so"; do
  [ -z "$f" ] || [ -f "$f" ] || { echo "pack-megatron: $f does not exist" >&2; exit 2; }
done

requirements=python/requirements-gpu-megatron.txt
cache=.whl/megatron
mkdir -p "$cache"
# The GPU machine's interpreter: CPython 3.12 on x86-64, glibc new enough for manylinux_2_28.
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# --require-hashes checks the cached wheel as well as a fresh download.
if ! python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-index --find-links "$cache" \
     "${target[@]}" --require-hashes -r "$requirements" -d "$cache" 2>/dev/null; then
  echo "pack-megatron: downloading $(grep -v '^#' "$requirements" | cut -d' ' -f1) into $cache"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps "${target[@]}" \
    --require-hashes -r "$requirements" -d "$cache"
fi

if [ -z "$wheel" ] || [ -z "$nccl_so" ]; then
  cargo build --release --workspace --lib
fi
if [ -z "$wheel" ]; then
  scripts/build-wheel.sh >/dev/null
  wheel=$(ls -t dist/mkernel-*.whl | head -1)
fi
nccl_so=${nccl_so:-target/release/libmkernel_nccl.so}

rm -rf "$dir"
mkdir -p "$dir"
cp "$cache"/megatron_core-0.16.1-cp312-*.whl "$dir/"
cp "$wheel" "$dir/"
strip -o "$dir/libmkernel_nccl.so" "$nccl_so"
git rev-parse HEAD > "$dir/COMMIT"
n=$(ls "$dir"/megatron_core-*.whl | wc -l)
[ "$n" = 1 ] || { echo "pack-megatron: $n megatron-core wheels in $dir, expected 1" >&2; exit 1; }
(cd "$dir" && ls -l | awk 'NR > 1 { printf "  %-72s %6.1f MiB\n", $9, $5 / 1048576 }')
echo "pack-megatron: $dir ($(du -sb "$dir" | awk '{ printf "%.1f MiB", $1 / 1048576 }'))"
