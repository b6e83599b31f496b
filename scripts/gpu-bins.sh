# Sourced by the GPU scripts (gpu-run.sh, gpu-sanitize.sh) from the repository root: sets
# $OUT (created; default gpu-run-logs) and $BIN, the folder of the carried binaries: BIN=DIR
# (default target/release), or BIN_TAR=FILE as scripts/pack-bins.sh packed them (stripped,
# xz), unpacked here into a temporary folder.
OUT=${OUT:-gpu-run-logs}
mkdir -p "$OUT"
BIN=${BIN:-target/release}
if [ -n "${BIN_TAR:-}" ]; then
  BIN=$(mktemp -d)
  xz -dc "$BIN_TAR" | tar -C "$BIN" -xf - || { echo "$(basename "$0"): cannot unpack $BIN_TAR"; exit 2; }
fi
