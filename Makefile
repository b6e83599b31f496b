# Build, install and C-test mkernel. `make install PREFIX=/opt/mkernel` installs
# lib/libmkernel.so.<version> (+ .so.<major>, .so links), lib/libmkernel.a,
# include/mkernel.h and lib/pkgconfig/mkernel.pc.

PREFIX ?= /usr/local
DESTDIR ?=
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
MAJOR := $(firstword $(subst ., ,$(VERSION)))
LIBDIR := $(DESTDIR)$(PREFIX)/lib
INCDIR := $(DESTDIR)$(PREFIX)/include
CTEST_PREFIX := $(CURDIR)/build/prefix
CTEST_BIN := $(CURDIR)/build/ctests
CWARN := -Wall -Wextra -Wpedantic -Werror
SAN := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all

.PHONY: build install ctest clean

build:
	cargo build --release --lib

install: build
	install -d $(LIBDIR)/pkgconfig $(INCDIR)
	install -m 755 target/release/libmkernel.so $(LIBDIR)/libmkernel.so.$(VERSION)
	ln -sf libmkernel.so.$(VERSION) $(LIBDIR)/libmkernel.so.$(MAJOR)
	ln -sf libmkernel.so.$(MAJOR) $(LIBDIR)/libmkernel.so
	install -m 644 target/release/libmkernel.a $(LIBDIR)/libmkernel.a
	install -m 644 include/mkernel.h $(INCDIR)/mkernel.h
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(VERSION)|' pkgconfig/mkernel.pc.in > $(LIBDIR)/pkgconfig/mkernel.pc

# C tests against the installed header and library, found through pkg-config only:
# plain with strict warnings, again under ASan/UBSan, and a C++ translation unit.
ctest:
	$(MAKE) install PREFIX=$(CTEST_PREFIX)
	mkdir -p $(CTEST_BIN)
	set -e; export PKG_CONFIG_PATH=$(CTEST_PREFIX)/lib/pkgconfig; \
	CFLAGS="$$(pkg-config --cflags mkernel)"; LIBS="$$(pkg-config --libs mkernel)"; \
	RPATH="-Wl,-rpath,$$(pkg-config --variable=libdir mkernel)"; \
	cc -std=c11 $(CWARN) $$CFLAGS ctests/test_abi.c -o $(CTEST_BIN)/test_abi $$LIBS $$RPATH; \
	cc -std=c11 $(CWARN) $(SAN) -g $$CFLAGS ctests/test_abi.c -o $(CTEST_BIN)/test_abi_san $$LIBS $$RPATH; \
	c++ -std=c++17 $(CWARN) $$CFLAGS ctests/test_cxx.cpp -o $(CTEST_BIN)/test_cxx $$LIBS $$RPATH; \
	$(CTEST_BIN)/test_abi; \
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 $(CTEST_BIN)/test_abi_san; \
	$(CTEST_BIN)/test_cxx

clean:
	cargo clean
	rm -rf build

# libmkernel-nccl (nccl/): NCCL's C API over mkernel. Installs lib/libmkernel-nccl.so.2 (its
# SONAME: the major of NCCL's ABI), the libmkernel-nccl.so link and lib/pkgconfig/mkernel-nccl.pc.
# No header: programs compile against the nccl.h of the NCCL they were written for.
.PHONY: install-nccl uninstall-nccl
install-nccl:
	cargo build --release -p mkernel-nccl
	install -d $(LIBDIR)/pkgconfig
	install -m 755 target/release/libmkernel_nccl.so $(LIBDIR)/libmkernel-nccl.so.2
	ln -sf libmkernel-nccl.so.2 $(LIBDIR)/libmkernel-nccl.so
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(VERSION)|' pkgconfig/mkernel-nccl.pc.in > $(LIBDIR)/pkgconfig/mkernel-nccl.pc

uninstall-nccl:
	rm -f $(LIBDIR)/libmkernel-nccl.so.2 $(LIBDIR)/libmkernel-nccl.so $(LIBDIR)/pkgconfig/mkernel-nccl.pc
