#!/usr/bin/env bash
# Builds the mkernel Python wheel into dist/: the release library, stripped of debug
# info, and the C header are copied into a staged copy of python/, which pip turns into
# a wheel tagged py3-none-<platform> (no Rust toolchain needed where it is installed).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
cargo build --release --lib

stage=build/python-wheel
rm -rf "$stage"
mkdir -p "$stage" dist
cp -r python/pyproject.toml python/setup.py python/README.md python/src "$stage/"
find "$stage" -name __pycache__ -prune -exec rm -rf {} +
cp target/release/libmkernel.so "$stage/src/mkernel/libmkernel.so"
strip --strip-debug "$stage/src/mkernel/libmkernel.so"
mkdir -p "$stage/src/mkernel/include"
cp include/mkernel.h "$stage/src/mkernel/include/mkernel.h"

version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' python/src/mkernel/_version.py)
rm -f dist/mkernel-"$version"-*.whl
python3 -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir dist "$stage"
ls dist/mkernel-"$version"-*.whl
