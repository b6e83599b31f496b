# Sourced by the GPU scripts (gpu-run.sh, gpu-sanitize.sh, gpu-fused.sh) from the repository
# root: sets $OUT (created; default gpu-run-logs), $BIN, the folder of the carried binaries:
# BIN=DIR (default target/release), or BIN_TAR=FILE as scripts/pack-bins.sh packed them
# (stripped, xz), unpacked here into a temporary folder; and $CTEST_BIN / $CTEST_LIB, the
# C tests built by `make ctest` and the libmkernel (plus sanitizer runtimes) they load:
# $BIN/ctests and $BIN/ctests/lib from a BIN_TAR, else build/ctests and build/prefix/lib.
# Also `outcome RC`: how a step's exit status reads in the summaries (77 is mktest's
# SKIPPED, 124/137 timeout's TIMEOUT; only 0 is a pass); and the MPS helpers of
# scripts/mps.sh ($SMS, max_ctas_for, as_ranks, mps_start, mps_stop).
OUT=${OUT:-gpu-run-logs}
mkdir -p "$OUT"
BIN=${BIN:-target/release}
CTEST_BIN=build/ctests; CTEST_LIB=build/prefix/lib
if [ -n "${BIN_TAR:-}" ]; then
  BIN=$(mktemp -d)
  xz -dc "$BIN_TAR" | tar -C "$BIN" -xf - || { echo "$(basename "$0"): cannot unpack $BIN_TAR"; exit 2; }
  CTEST_BIN=$BIN/ctests; CTEST_LIB=$BIN/ctests/lib
fi
outcome() {
  case "$1" in
    0) echo PASS ;;
    77) echo "SKIPPED (exit 77: did not run; not a pass)" ;;
    124|137) echo "TIMEOUT (exit $1; not a pass)" ;;
    *) echo "FAIL (exit $1)" ;;
  esac
}
. scripts/mps.sh  # $SMS, max_ctas_for, as_ranks, mps_start, mps_stop
