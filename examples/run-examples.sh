#!/usr/bin/env bash
# Runs built examples and judges each: exit 0 with an OK line passes; exit 77 with SKIPPED
# and the library's init error (mkCommInit...: <why>) is a skip (no usable GPU); anything
# else fails. Exits 1 when any failed.
#
#   examples/run-examples.sh BINARY...
#
# allreduce_two_procs* gets a fresh id file. On a GPU machine every example must pass:
# --require-gpu turns a skip into a failure.
set -uo pipefail
require_gpu=0
if [ "${1:-}" = --require-gpu ]; then require_gpu=1; shift; fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/mkernel-run.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
failed=0
for bin in "$@"; do
  name=$(basename "$bin")
  args=()
  case $name in allreduce_two_procs*) args=("$tmp/id.$name") ;; esac
  out=$(timeout 300 "$bin" "${args[@]}" 2>&1)
  rc=$?
  if [ $rc = 0 ] && grep -q ': OK' <<<"$out"; then
    echo "  $name: $(grep ': OK' <<<"$out" | head -1)"
  elif [ $rc = 77 ] && grep -q SKIPPED <<<"$out" && grep -q 'mkCommInit[A-Za-z]*: ' <<<"$out" && [ $require_gpu = 0 ]; then
    echo "  $name: SKIPPED (no usable GPU): $(grep -o 'mkCommInit[A-Za-z]*: .*' <<<"$out" | head -1)"
  else
    echo "  $name: FAILED (exit $rc):"
    sed 's/^/    /' <<<"$out"
    failed=1
  fi
  if [ ${#args[@]} -gt 0 ] && [ -e "${args[0]}" ]; then
    echo "  $name: FAILED: left its id file behind"
    failed=1
  fi
done
exit $failed
