#!/usr/bin/env bash
# Installs mkernel into a temporary prefix as a user would (make install, LIBDIR overridden)
# and checks what a user meets there: the stripped library and its debug file, the .pc and
# CMake files, an archive whose only global symbols are the mk* API, the C / C++ / Go
# examples built through pkg-config and CMake, linked shared and static, the Go binding's
# tests, and an uninstall that leaves no file, and no directory install created, behind.
#
# Examples exit 0 after checking the all-reduce's sums on a GPU machine; without a usable
# GPU they exit 77 after the library's init error, and this script prints SKIPPED for them.
# Needs target/release/libmkernel.{so,a} (cargo build --release --lib), a C/C++ compiler,
# pkg-config, cmake and go (scripts/setup.sh installs them).
#
#   scripts/test-examples.sh [--keep DIR]
#
# --keep DIR also leaves the shared-linked example binaries in DIR/bin and the library in
# DIR/lib, for a GPU machine without compilers:
#   LD_LIBRARY_PATH=DIR/lib examples/run-examples.sh --require-gpu DIR/bin/*
set -euo pipefail
keep=""
if [ "${1:-}" = --keep ] && [ -n "${2:-}" ]; then keep=$(realpath -m "$2"); fi
cd "$(dirname "$0")/.."
repo=$PWD
work=$(mktemp -d "${TMPDIR:-/tmp}/mkernel-examples.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

prefix=$work/prefix
libdir=$prefix/lib64 # not $prefix/lib: the .pc and CMake files must follow LIBDIR
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)

echo "== make install PREFIX=<tmp> LIBDIR=<tmp>/lib64 INSTALL_DEBUG=1"
make -s install PREFIX="$prefix" LIBDIR="$libdir" INSTALL_DEBUG=1 >/dev/null
export PKG_CONFIG_PATH=$libdir/pkgconfig
[ "$(pkg-config --variable=libdir mkernel)" = "$libdir" ] || fail "mkernel.pc libdir is $(pkg-config --variable=libdir mkernel), not $libdir"
[ "$(pkg-config --variable=libdir mkernel-static)" = "$libdir" ] || fail "mkernel-static.pc libdir does not follow LIBDIR"
[ "$(pkg-config --modversion mkernel)" = "$version" ] || fail "mkernel.pc version"

so=$libdir/libmkernel.so.$version
grep -q '\.debug_' <<<"$(readelf -SW "$so")" && fail "the installed library has debug sections"
grep -q ' \.symtab ' <<<"$(readelf -SW "$so")" && fail "the installed library has a full symbol table"
grep -qF "libmkernel.so.$version.debug" <<<"$(readelf -p .gnu_debuglink "$so")" || fail "no .gnu_debuglink to the debug file"
[ -s "$so.debug" ] || fail "INSTALL_DEBUG=1 installed no debug file"
echo "  stripped library $(stat -c %s "$so") bytes (build: $(stat -c %s target/release/libmkernel.so)), debug file beside it"
# The test and benchmark helpers (the tools crate's testing and cuBLASLt loader) serve
# mktest and mkbench and are not in the library's crate; a workspace build compiles the
# library beside them, so check that none of their code reached it. Each has a message of
# its own: none may be in the library's data. (The strings go to a file
# first: `strings | grep -q` under pipefail reads a match as a failure once grep stops early.)
strings "$so" >"$work/so.strings"
for marker in "tools/src/cublaslt.rs:libcublasLt.so not found" "tools/src/testing/acceptance.rs:not judged below"; do
  file=${marker%%:*} text=${marker#*:}
  grep -qF "$text" "$file" || fail "the marker \"$text\" is no longer in $file: choose another"
  grep -qF "$text" "$work/so.strings" && fail "the installed library holds code of $file (\"$text\")"
done
# Ring attention's `_trace` twins are `tool` kernels (kernels/instances.txt), compiled into a
# fatbin only mkbench embeds: the library holds the kernels' code (ELF section .text.<name>)
# but not the twins'.
grep -qx '\.text\.mk_ring_attn_bf16_d128' "$work/so.strings" || fail "the library holds no ring attention kernel (the check below would prove nothing)"
grep -qx '\.text\.mk_ring_attn_bf16_d128_trace' "$work/so.strings" && fail "the installed library holds the ring attention _trace kernels"
echo "  no test or benchmark helpers, and no tool kernels, in the library"

echo "== libmkernel.a: only the mk* API is global, the same symbols the shared library exports"
nm -D --defined-only "$so" | awk '{print $3}' | sort >"$work/so.syms"
nm -g --defined-only "$libdir/libmkernel.a" | awk 'NF == 3 {print $3}' | sort >"$work/a.syms"
grep -q '^mkAllReduce$' "$work/so.syms" || fail "the shared library does not export mkAllReduce"
cmp -s "$work/so.syms" "$work/a.syms" || { diff "$work/so.syms" "$work/a.syms" | head; fail "archive globals differ from the .so exports"; }
# Nothing Rust-mangled is left for the final link to resolve (it is all inside the archive).
nm -u "$libdir/libmkernel.a" | awk '{print $2}' | grep -E '^(_ZN|_R)' && fail "the archive needs Rust symbols from elsewhere"
echo "  $(wc -l <"$work/a.syms") global symbols, all mk*"
# A program that defines symbols of a Rust runtime of its own (as another Rust static library
# would) links with the archive without a duplicate-symbol error.
cat >"$work/clash.c" <<'C'
#include <mkernel.h>
#include <stdio.h>
void rust_eh_personality(void) {}
void rust_begin_unwind(void) {}
int main(void) { int v = 0; return mkGetVersion(&v) == mkSuccess && v == MK_VERSION_CODE ? 0 : 1; }
C
cc "$work/clash.c" -o "$work/clash" $(pkg-config --cflags --libs mkernel-static) || fail "the archive clashes with another runtime's symbols"
"$work/clash" || fail "the program linked with the archive and its own runtime symbols failed"

# Examples run without LD_LIBRARY_PATH: shared ones find the library through their RPATH.
run_examples() { env -u LD_LIBRARY_PATH examples/run-examples.sh "$@" || fail "an example failed"; }

# no_mkernel_needed BINARY: the program does not load libmkernel.so.
no_mkernel_needed() { grep -q 'NEEDED.*libmkernel' <<<"$(readelf -d "$1")" && fail "$1 needs libmkernel.so"; true; }

echo "== C and C++ examples through pkg-config, shared (RPATH from pkg-config's libdir)"
make -s -C examples LINK=shared OUT="$work/pc-shared" >/dev/null
run_examples "$work"/pc-shared/*

echo "== C and C++ examples through pkg-config mkernel-static"
make -s -C examples LINK=static OUT="$work/pc-static" >/dev/null
for ex in "$work"/pc-static/*; do no_mkernel_needed "$ex"; done
run_examples "$work"/pc-static/*

echo "== a fully static executable (cc -static) with the archive"
cc -static "$work/clash.c" -o "$work/clash-static" $(pkg-config --static --cflags --libs mkernel-static) 2>"$work/static.log" ||
  { cat "$work/static.log"; fail "cc -static with mkernel-static"; }
grep -q NEEDED <<<"$(readelf -d "$work/clash-static" 2>/dev/null)" && fail "cc -static produced a dynamic executable"
"$work/clash-static" || fail "the fully static executable failed"
echo "  links and runs (glibc warns that getaddrinfo/dlopen need its shared libraries at run time)"

echo "== C++ example through CMake find_package(mkernel), mkernel::mkernel and mkernel::mkernel_static"
# CMake does not search lib64 on Debian (multiarch): mkernel_DIR names the package directory.
for variant in shared static; do
  static=OFF; [ $variant = static ] && static=ON
  cmake -S examples/cpp -B "$work/cmake-$variant" -Dmkernel_DIR="$libdir/cmake/mkernel" -DMKERNEL_STATIC=$static \
    -DCMAKE_CXX_FLAGS="-Wall -Wextra -Wpedantic -Werror" >"$work/cmake-$variant.log" 2>&1 ||
    { cat "$work/cmake-$variant.log"; fail "cmake configure ($variant)"; }
  cmake --build "$work/cmake-$variant" >>"$work/cmake-$variant.log" 2>&1 || { cat "$work/cmake-$variant.log"; fail "cmake build ($variant)"; }
  [ $variant = static ] && no_mkernel_needed "$work/cmake-$variant/allreduce_cpp"
  cp "$work/cmake-$variant/allreduce_cpp" "$work/allreduce_cpp_cmake_$variant"
  run_examples "$work/allreduce_cpp_cmake_$variant"
done
echo "== Go binding: go test (shared, RPATH through CGO_LDFLAGS; and -tags mkernel_static)"
export CGO_LDFLAGS="-Wl,-rpath,$libdir"
# The build cache under build/ (kept between runs, works without $HOME); nothing is downloaded.
export GOCACHE=${GOCACHE:-$repo/build/go-cache} GOPROXY=off
(cd bindings/go/mkernel && go vet ./... && go test -count=1 ./... && go test -count=1 -tags mkernel_static ./...)
(cd examples/go && go build -o "$work/allreduce_go" . && go build -tags mkernel_static -o "$work/allreduce_go_static" .)
no_mkernel_needed "$work/allreduce_go_static"
run_examples "$work/allreduce_go" "$work/allreduce_go_static"
unset CGO_LDFLAGS

if [ -n "$keep" ]; then
  mkdir -p "$keep/bin" "$keep/lib"
  cp "$work"/pc-shared/* "$work/allreduce_cpp_cmake_shared" "$work/allreduce_go" "$keep/bin/"
  cp -L "$libdir/libmkernel.so.${version%%.*}" "$keep/lib/"
  echo "== kept the example binaries in $keep/bin, the library in $keep/lib"
fi

echo "== make uninstall removes every installed file and the directories install created"
# A directory that was there before install stays (as /usr/local/lib would).
mkdir "$work/existing"
make -s install PREFIX="$work/existing" >/dev/null
make -s uninstall PREFIX="$work/existing" >/dev/null
[ -d "$work/existing" ] || fail "make uninstall removed the prefix that existed before install"
left=$(find "$work/existing" -mindepth 1)
[ -z "$left" ] || fail "make uninstall left: $left"
make -s uninstall PREFIX="$prefix" LIBDIR="$libdir" >/dev/null
[ ! -e "$prefix" ] || fail "make uninstall left: $(find "$prefix")"

echo "== DESTDIR stages the files; the .pc names the final prefix; the CMake package is relocatable"
make -s install DESTDIR="$work/stage" PREFIX=/opt/mkernel >/dev/null
grep -qx 'prefix=/opt/mkernel' "$work/stage/opt/mkernel/lib/pkgconfig/mkernel.pc" || fail "staged mkernel.pc prefix"
# find_package through CMAKE_PREFIX_PATH, in the staged (moved) prefix: the package's paths are
# relative to its own file. The version file accepts 0.1 and refuses a newer major.
mkdir -p "$work/cmake-find"
cat >"$work/cmake-find/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.16)
project(find_mkernel LANGUAGES C)
find_package(mkernel ${WANT} REQUIRED)
get_target_property(location mkernel::mkernel_static IMPORTED_LOCATION)
message(STATUS "mkernel::mkernel_static at ${location}")
CMAKE
cmake -S "$work/cmake-find" -B "$work/cmake-find/ok" -DCMAKE_PREFIX_PATH="$work/stage/opt/mkernel" -DWANT=0.1 >"$work/find-ok.log" 2>&1 ||
  { cat "$work/find-ok.log"; fail "find_package(mkernel 0.1) in a moved prefix"; }
grep -qF "mkernel::mkernel_static at $work/stage/opt/mkernel/lib/libmkernel.a" "$work/find-ok.log" || fail "imported location outside the moved prefix"
cmake -S "$work/cmake-find" -B "$work/cmake-find/new" -DCMAKE_PREFIX_PATH="$work/stage/opt/mkernel" -DWANT=99 >"$work/find-99.log" 2>&1 &&
  fail "find_package(mkernel 99) accepted version $version"
grep -q "version: $version" "$work/find-99.log" || { cat "$work/find-99.log"; fail "find_package(mkernel 99) failed for another reason"; }
make -s uninstall DESTDIR="$work/stage" PREFIX=/opt/mkernel >/dev/null
left=$(find "$work/stage" -mindepth 1)
[ -z "$left" ] || fail "make uninstall DESTDIR=... left: $left"

echo "== examples and packaging: all checks passed"
