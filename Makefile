# Build, install and uninstall mkernel; C-test it.
#
#   make                                  cargo build --release --lib (libmkernel and libmkernel-nccl), then build/dist/ (what install copies)
#   make install PREFIX=/opt/mkernel      lib/libmkernel.so.<version> (stripped; .so.<major>, .so links),
#                                         lib/libmkernel.a (one prelinked object: only mk* symbols global),
#                                         include/mkernel.h, lib/pkgconfig/mkernel.pc and mkernel-static.pc,
#                                         lib/cmake/mkernel/mkernelConfig.cmake and mkernelConfigVersion.cmake
#                                         lib/libmkernel-nccl.so.2 (+ .so link), lib/pkgconfig/mkernel-nccl.pc,
#                                         lib/mkernel-nccl/libnccl.so.2 (a link: NCCL's name, see docs/nccl.md)
#   make uninstall PREFIX=/opt/mkernel    removes exactly those files, and the directories install
#                                         created once they are empty (give it the same variables)
#
# LIBDIR and INCLUDEDIR default to $(PREFIX)/lib and $(PREFIX)/include; DESTDIR stages the
# files under another root (the installed .pc and CMake files name the final paths).
# INSTALL_DEBUG=1 also installs the library's debug info as libmkernel.so.<version>.debug
# beside it, where gdb finds it through the library's .gnu_debuglink.
# install and uninstall use only what `make` built (no cargo), so `sudo make install` works.

PREFIX ?= /usr/local
LIBDIR = $(PREFIX)/lib
INCLUDEDIR = $(PREFIX)/include
DESTDIR ?=
INSTALL_DEBUG ?= 0
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
MAJOR := $(firstword $(subst ., ,$(VERSION)))
CTEST_PREFIX := $(CURDIR)/build/prefix
CTEST_BIN := $(CURDIR)/build/ctests
CWARN := -Wall -Wextra -Wpedantic -Werror
SAN := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all

CARGO_SO := target/release/libmkernel.so
CARGO_NCCL_SO := target/release/libmkernel_nccl.so
CARGO_A := target/release/libmkernel.a
DIST := build/dist
SO_NAME := libmkernel.so.$(VERSION)
DIST_SO := $(DIST)/$(SO_NAME)
DIST_DEBUG := $(DIST)/$(SO_NAME).debug
DIST_A := $(DIST)/libmkernel.a
NCCL_DIST_SO := $(DIST)/libmkernel-nccl.so.2

# The .pc and CMake files name libdir relative to ${prefix} (pkg-config) or to their own
# location (CMake) so that a copied prefix keeps working.
PC_LIBDIR = $(patsubst $(PREFIX)/%,$${prefix}/%,$(LIBDIR))
PC_INCLUDEDIR = $(patsubst $(PREFIX)/%,$${prefix}/%,$(INCLUDEDIR))
CMAKE_DIR = $(LIBDIR)/cmake/mkernel
CMAKE_INCLUDEDIR = $(shell realpath -m --relative-to=$(LIBDIR) $(INCLUDEDIR))

INSTALLED_FILES = $(LIBDIR)/$(SO_NAME) $(LIBDIR)/libmkernel.so.$(MAJOR) $(LIBDIR)/libmkernel.so \
  $(LIBDIR)/$(SO_NAME).debug $(LIBDIR)/libmkernel.a $(INCLUDEDIR)/mkernel.h \
  $(LIBDIR)/pkgconfig/mkernel.pc $(LIBDIR)/pkgconfig/mkernel-static.pc \
  $(CMAKE_DIR)/mkernelConfig.cmake $(CMAKE_DIR)/mkernelConfigVersion.cmake
# NCCL's own file name for the library, in a directory of its own: on the loader path only
# where a user puts it (LD_LIBRARY_PATH), never taking over NCCL for the whole system.
NCCL_ALIAS_DIR = $(LIBDIR)/mkernel-nccl
NCCL_INSTALLED_FILES = $(LIBDIR)/libmkernel-nccl.so.2 $(LIBDIR)/libmkernel-nccl.so \
  $(LIBDIR)/pkgconfig/mkernel-nccl.pc $(NCCL_ALIAS_DIR)/libnccl.so.2

# Each directory install creates (one that did not exist; parents first) is written to
# DIRS_RECORD, so that uninstall removes exactly those once they are empty, never a
# directory that was there before (/usr/local/lib). $(call make_dirs,DIR...): LIBDIR's
# subdirectories first (the record lives in LIBDIR).
DIRS_RECORD = $(LIBDIR)/.mkernel-created-dirs
make_dirs = for d in $(1); do \
	  new=""; p="$$d"; \
	  while [ "$$p" != / ] && [ ! -d "$(DESTDIR)$$p" ]; do new="$$p $$new"; p=$$(dirname "$$p"); done; \
	  install -d "$(DESTDIR)$$d" || exit 1; \
	  for n in $$new; do echo "$$n" >>"$(DESTDIR)$(DIRS_RECORD)" || exit 1; done; \
	done
# Removes the recorded directories that are empty, children first (reverse order puts a path
# before its prefix); those still holding files stay on record for the next uninstall.
remove_created_dirs = record="$(DESTDIR)$(DIRS_RECORD)"; \
	if [ -f "$$record" ]; then \
	  dirs=$$(sort -r "$$record"); rm -f "$$record"; \
	  for d in $$dirs; do rmdir "$(DESTDIR)$$d" 2>/dev/null || true; done; \
	  for d in $$dirs; do \
	    if [ -d "$(DESTDIR)$$d" ] && [ -d "$(DESTDIR)$(LIBDIR)" ]; then echo "$$d" >>"$$record"; fi; \
	  done; \
	fi

.PHONY: all build dist install uninstall ctest clean FORCE

all: build
	@$(MAKE) --no-print-directory dist

build:
	cargo build --release --lib

dist: $(DIST_SO) $(DIST_A) $(NCCL_DIST_SO)

$(CARGO_SO) $(CARGO_A) $(CARGO_NCCL_SO):
	@test -f $@ || { echo "$@ is missing: build it first with 'make' (cargo build --release --lib)" >&2; exit 1; }

# cargo puts target/release/libmkernel.* in place as hard links to its deps/ files, which
# can be older than the ones they replace (after building with other features), so their
# mtimes cannot tell make that they changed. The stamp records each file's inode, size and
# mtime, and is rewritten (so newer than build/dist) only when one of them differs.
CARGO_STAMP := $(DIST)/cargo-artefacts
$(CARGO_STAMP): FORCE $(CARGO_SO) $(CARGO_A)
	@mkdir -p $(DIST)
	@stat -c '%n %i %s %Y' $(CARGO_SO) $(CARGO_A) > $@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi

FORCE:

# The shared library without its debug info (about half the size), linked to that info by
# .gnu_debuglink; the dynamic symbol table (the mk* API) is kept.
$(NCCL_DIST_SO): $(CARGO_NCCL_SO)
	@mkdir -p $(DIST)
	strip --strip-unneeded -o $@ $(CARGO_NCCL_SO)

$(DIST_SO): $(CARGO_STAMP)
	objcopy --only-keep-debug $(CARGO_SO) $(DIST_DEBUG)
	strip --strip-unneeded -o $@ $(CARGO_SO)
	objcopy --add-gnu-debuglink=$(DIST_DEBUG) $@

# The static archive as one relocatable object (ld -r) in which only the mk* API stays
# global: the Rust runtime inside is local, so it cannot clash with another Rust static
# library (or anything else) in the same link. The removed sections are LLVM bitcode and
# address-significance tables that ld -r concatenates into something invalid (binutils'
# LLVM plugin aborts on it); they serve LTO and lld's ICF only.
$(DIST_A): $(CARGO_STAMP)
	mkdir -p $(DIST)/prelink
	ld -r --whole-archive $(CARGO_A) -o $(DIST)/prelink/mkernel.o
	objcopy --strip-debug -R .llvmbc -R .llvmcmd -R .llvm_addrsig \
	  --wildcard --keep-global-symbol='mk[A-Z]*' $(DIST)/prelink/mkernel.o
	rm -f $@
	ar rcs $@ $(DIST)/prelink/mkernel.o
	rm -rf $(DIST)/prelink

install: dist install-nccl
	@$(call make_dirs,$(LIBDIR)/pkgconfig $(CMAKE_DIR) $(INCLUDEDIR))
	install -m 755 $(DIST_SO) $(DESTDIR)$(LIBDIR)/$(SO_NAME)
	ln -sf $(SO_NAME) $(DESTDIR)$(LIBDIR)/libmkernel.so.$(MAJOR)
	ln -sf libmkernel.so.$(MAJOR) $(DESTDIR)$(LIBDIR)/libmkernel.so
	if [ "$(INSTALL_DEBUG)" = 1 ]; then install -m 644 $(DIST_DEBUG) $(DESTDIR)$(LIBDIR)/$(SO_NAME).debug; fi
	install -m 644 $(DIST_A) $(DESTDIR)$(LIBDIR)/libmkernel.a
	install -m 644 include/mkernel.h $(DESTDIR)$(INCLUDEDIR)/mkernel.h
	for pc in mkernel mkernel-static; do \
	  sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@LIBDIR@|$(PC_LIBDIR)|' -e 's|@INCLUDEDIR@|$(PC_INCLUDEDIR)|' \
	      -e 's|@VERSION@|$(VERSION)|' \
	      pkgconfig/$$pc.pc.in > $(DESTDIR)$(LIBDIR)/pkgconfig/$$pc.pc || exit 1; \
	done; \
	sed -e 's|@INCLUDEDIR_FROM_LIBDIR@|$(CMAKE_INCLUDEDIR)|' -e 's|@SO_NAME@|$(SO_NAME)|' \
	    -e 's|@SONAME@|libmkernel.so.$(MAJOR)|' \
	    cmake/mkernelConfig.cmake.in > $(DESTDIR)$(CMAKE_DIR)/mkernelConfig.cmake
	sed -e 's|@VERSION@|$(VERSION)|' cmake/mkernelConfigVersion.cmake.in > $(DESTDIR)$(CMAKE_DIR)/mkernelConfigVersion.cmake

uninstall: uninstall-nccl
	rm -f $(addprefix $(DESTDIR),$(INSTALLED_FILES))
	@$(remove_created_dirs)

# C tests against the installed header and library, found through pkg-config only:
# plain with strict warnings, again under ASan/UBSan, and a C++ translation unit.
# test_watchdog needs a GPU: without one it prints SKIPPED and exits 77, which counts as
# a skip here (ASan runs it with protect_shadow_gap=0, which the CUDA driver needs).
ctest:
	$(MAKE) install PREFIX=$(CTEST_PREFIX)
	mkdir -p $(CTEST_BIN)
	set -e; export PKG_CONFIG_PATH=$(CTEST_PREFIX)/lib/pkgconfig; \
	CFLAGS="$$(pkg-config --cflags mkernel)"; LIBS="$$(pkg-config --libs mkernel)"; \
	RPATH="-Wl,-rpath,$$(pkg-config --variable=libdir mkernel)"; \
	cc -std=c11 $(CWARN) $$CFLAGS ctests/test_abi.c -o $(CTEST_BIN)/test_abi $$LIBS $$RPATH; \
	cc -std=c11 $(CWARN) $(SAN) -g $$CFLAGS ctests/test_abi.c -o $(CTEST_BIN)/test_abi_san $$LIBS $$RPATH; \
	c++ -std=c++17 $(CWARN) $$CFLAGS ctests/test_cxx.cpp -o $(CTEST_BIN)/test_cxx $$LIBS $$RPATH; \
	cc -std=c11 $(CWARN) -pthread $$CFLAGS ctests/test_watchdog.c -o $(CTEST_BIN)/test_watchdog $$LIBS $$RPATH -ldl; \
	cc -std=c11 $(CWARN) -pthread $(SAN) -g $$CFLAGS ctests/test_watchdog.c -o $(CTEST_BIN)/test_watchdog_san $$LIBS $$RPATH -ldl; \
	$(CTEST_BIN)/test_abi; \
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 $(CTEST_BIN)/test_abi_san; \
	$(CTEST_BIN)/test_cxx; \
	$(CTEST_BIN)/test_watchdog || [ $$? -eq 77 ]; \
	ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 $(CTEST_BIN)/test_watchdog_san || [ $$? -eq 77 ]

clean:
	cargo clean
	rm -rf build

# libmkernel-nccl (nccl/): NCCL's C API over mkernel, built by the same `cargo build
# --release`. Installed as lib/libmkernel-nccl.so.2 (its SONAME: the major of NCCL's ABI,
# stripped as libmkernel.so is), the libmkernel-nccl.so link, lib/pkgconfig/mkernel-nccl.pc
# and lib/mkernel-nccl/libnccl.so.2, a link for programs that open NCCL by that name.
# No header: programs compile against the nccl.h of the NCCL they were written for.
.PHONY: install-nccl uninstall-nccl
install-nccl: $(NCCL_DIST_SO)
	@$(call make_dirs,$(LIBDIR)/pkgconfig $(NCCL_ALIAS_DIR))
	install -m 755 $(NCCL_DIST_SO) $(DESTDIR)$(LIBDIR)/libmkernel-nccl.so.2
	ln -sf libmkernel-nccl.so.2 $(DESTDIR)$(LIBDIR)/libmkernel-nccl.so
	ln -sf ../libmkernel-nccl.so.2 $(DESTDIR)$(NCCL_ALIAS_DIR)/libnccl.so.2
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@LIBDIR@|$(PC_LIBDIR)|' -e 's|@VERSION@|$(VERSION)|' \
	    pkgconfig/mkernel-nccl.pc.in > $(DESTDIR)$(LIBDIR)/pkgconfig/mkernel-nccl.pc

uninstall-nccl:
	rm -f $(addprefix $(DESTDIR),$(NCCL_INSTALLED_FILES))
	@$(remove_created_dirs)
