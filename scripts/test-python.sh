#!/usr/bin/env bash
# Tests the Python package as a user gets it: builds the wheel (scripts/build-wheel.sh),
# installs it into a fresh venv with the pinned test dependencies, and runs pytest on
# python/tests. GPU tests print SKIPPED without a GPU (pytest counts them apart).
#
# torch (MK_PYTHON_TORCH): PyPI's Linux torch wheel is the CUDA build; with its nvidia-*
# dependencies it is 2.6 GB of wheels and 4.5 GB installed. By default (`stubbed`) the
# torch wheel (530 MB) is installed alone (--no-deps) with its pure-Python requirements,
# and python/tools/cuda_stubs.py builds small stand-ins for the CUDA libraries it links,
# so `import torch` works with torch's CPU side (1.2 GB installed). `full` installs torch
# with its CUDA wheels instead; `system` uses the torch installed for python3 (a GPU
# machine). Wheels are cached in .whl/python (MK_WHEEL_CACHE) so reruns need no network.
# MK_PYTHON_WHEEL=path tests that wheel instead of building one.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.11.0
cache=${MK_WHEEL_CACHE:-.whl/python}
venv=build/python-test-venv
t0=$(date +%s)
echo "== Python package: wheel, fresh venv, pytest (GPU tests SKIPPED without a GPU)"

if [ -n "${MK_PYTHON_WHEEL:-}" ]; then
  wheel=$MK_PYTHON_WHEEL  # a wheel built elsewhere (a GPU machine without a Rust toolchain or network)
else
  ./scripts/build-wheel.sh
  wheel=$(ls -t dist/mkernel-*.whl | head -1)
fi

rm -rf "$venv"
pip=(--quiet --disable-pip-version-check --no-compile)
if [ "${MK_PYTHON_TORCH:-stubbed}" = system ]; then
  # The machine's own python3 and torch, which may live in a venv of their own (a new venv's
  # --system-site-packages would see the base interpreter's packages, not that venv's): the
  # wheel goes into a folder put first on PYTHONPATH instead.
  py=python3
  "$py" - "$TORCH_VERSION" <<'PY'
import sys, torch
pinned = sys.argv[1].rsplit(".", 1)[0]
print("test-python: torch", torch.__version__, "from", torch.__file__)
if not torch.__version__.startswith(pinned + "."):
    print(f"test-python: warning: the tests are pinned to torch {pinned}, this is {torch.__version__}")
PY
  "$py" -m pytest --version >/dev/null 2>&1 || { echo "test-python: $py has no pytest"; exit 1; }
  site=$PWD/$venv/site
  "$py" -m pip install "${pip[@]}" --no-deps --target "$site" "$wheel"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  echo "test-python: wheel installed into $site in $(( $(date +%s) - t0 )) s"
else
  python3 -m venv "$venv"
  py=$PWD/$venv/bin/python
  mkdir -p "$cache"
  # Installs from the cache without an index; on a miss, downloads into the cache first.
  cached() {
    "$venv/bin/pip" install "${pip[@]}" --no-index --find-links "$cache" "$@" 2>/dev/null || {
      echo "test-python: downloading $* into $cache"
      python3 -m pip download --quiet --disable-pip-version-check -d "$cache" "$@"
      "$venv/bin/pip" install "${pip[@]}" --no-index --find-links "$cache" "$@"
    }
  }
  if [ "${MK_PYTHON_TORCH:-stubbed}" = full ]; then
    cached "torch==$TORCH_VERSION"  # with its CUDA wheels
  else
    cached --no-deps "torch==$TORCH_VERSION"
  fi
  cached -r python/requirements-test-cpu.txt
  # mkernel.megatron's tests need the real megatron-core; required here, so they cannot skip.
  cached --no-deps -r python/requirements-test-megatron.txt
  export MK_TEST_MEGATRON=required
  if [ "${MK_PYTHON_TORCH:-stubbed}" != full ]; then
    stubs="$PWD/$venv/cuda-stubs"
    torch_lib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/torch/lib
    "$venv/bin/python" python/tools/cuda_stubs.py "$torch_lib" "$stubs"
    export LD_LIBRARY_PATH="$stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  "$venv/bin/pip" install "${pip[@]}" --no-deps "$wheel"
  echo "test-python: venv ready in $(( $(date +%s) - t0 )) s ($(du -sh "$venv" | cut -f1))"
fi

# From python/, so `import mkernel` finds the installed wheel, not python/src.
cd python
"$py" -m pytest tests "$@"
