# Sourced by the GPU scripts (gpu-run.sh, gpu-sanitize.sh, gpu-fused.sh) from the repository
# root: sets $OUT (created; default gpu-run-logs), $BIN, the folder of the carried binaries:
# BIN=DIR (default target/release), or BIN_TAR=FILE as scripts/pack-bins.sh packed them
# (stripped, xz), unpacked here into a temporary folder; and $CTEST_BIN / $CTEST_LIB, the
# C tests built by `make ctest` and the libmkernel (plus sanitizer runtimes) they load:
# $BIN/ctests and $BIN/ctests/lib from a BIN_TAR, else build/ctests and build/prefix/lib.
# Also `outcome RC`: how a step's exit status reads in the summaries (77 is mktest's
# SKIPPED, 124/137 timeout's TIMEOUT; only 0 is a pass); $SMS, the SM count of GPU 0
# (scripts/sm-count.sh; SMS=N overrides); and `max_ctas_for N`, the MK_MAX_CTAS of each of
# N rank processes sharing the GPU.
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
SMS=${SMS:-$(scripts/sm-count.sh)}
# Under MPS each of N ranks gets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100/N % of the SMs; its
# grid cap is half of that share, of the SM count rounded down to a multiple of 8, so every
# persistent grid stays co-resident (132 SMs: 32, 16 and 8 at 2, 4 and 8 ranks, at least 1).
# One rank: empty (every SM).
max_ctas_for() {
  local n=$1 cap
  [ "$n" -gt 1 ] || { echo ""; return; }
  cap=$(( SMS / 8 * 8 / n / 2 ))
  echo $(( cap > 0 ? cap : 1 ))
}
