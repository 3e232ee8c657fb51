# qcowfs: see README.md. `make demo` and `make test` do all set-up on a
# fresh Debian machine (they install missing packages when run as root).

GO      ?= go
PREFIX  ?= /usr/local
VERSION := $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X main.version=$(VERSION)
BIN     := bin/qcowfs
MAN     := bin/qcowfs.1
# Packages the tests and the demo need (Debian names); nginx serves the
# remote images of the tests, and qemu-block-extra (qemu's curl driver) is
# their oracle for the block status of a URL; mtools and dosfstools are the
# FAT reader's oracle, and xfsprogs, btrfs-progs and ntfs-3g make the file
# systems guestfs.Probe must name and refuse.
TEST_PKGS := fuse3 qemu-utils qemu-block-extra fdisk e2fsprogs dosfstools mtools xfsprogs btrfs-progs ntfs-3g util-linux libdeflate-dev libzstd-dev gcc groff-base systemd nginx time fio curl
# Go programs the tests need (scripts/go-tools.sh pins their versions:
# versitygw, the S3 server), installed into $(go env GOPATH)/bin, which
# the tests find on PATH.
GOBIN_DIR = $(shell $(GO) env GOPATH)/bin

.PHONY: all build man test demo lint fuzz install uninstall deps deps-build deps-go clean

all: build

build: deps-build
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/qcowfs

deps:
	@scripts/deps.sh $(TEST_PKGS)

deps-go:
	@GO=$(GO) scripts/go-tools.sh

# Building needs the headers of libdeflate and libzstd (cgo); CGO_ENABLED=0
# builds a pure-Go binary with slower decompression instead.
deps-build:
	@[ "$$CGO_ENABLED" = 0 ] || scripts/deps.sh libdeflate-dev libzstd-dev gcc

# Packages with concurrency of their own (remote: parallel range fetches
# into a shared chunk cache) run under the race detector; the other
# packages run as they are. The end-to-end tests (every package under
# test/) run last, one package at a time: they mount, attach loop devices
# and time and bound their daemons, which tests of another package running
# beside them would disturb. With QCOWFS_TEST_RACE=1 each of those
# packages builds a -race daemon too for the tests whose daemons run
# concurrent requests (harness.Racy), and fails on any race it reports
# (test/harness/main.go).
RACE_PKGS := ./qcow2/ ./fs/ ./readahead/ ./fiemap/ ./remote/
E2E_PKGS  := ./test/...
OTHER_PKGS = $(filter-out $(shell $(GO) list $(RACE_PKGS) $(E2E_PKGS)),$(shell $(GO) list ./...))
# The read and write suites run a second time with every mount over FUSE
# over io_uring (--io-uring=on): the harness switches the kernel's
# /sys/module/fuse/parameters/enable_uring on for the run, as root, and
# puts it back after (test/harness/uring.go). Their daemons are the plain
# build there: the race-built ones ran the same requests in the run before,
# and the transport's own goroutines are the same in both.
URING_PKGS := ./test/read/ ./test/write/
test: deps deps-go lint
	$(GO) test -race -count=1 -timeout 30m $(RACE_PKGS)
	PATH="$$PATH:$(GOBIN_DIR)" $(GO) test -count=1 -timeout 30m $(OTHER_PKGS)
	PATH="$$PATH:$(GOBIN_DIR)" QCOWFS_TEST_RACE=1 $(GO) test -p 1 -count=1 -timeout 30m $(E2E_PKGS)
	PATH="$$PATH:$(GOBIN_DIR)" QCOWFS_TEST_IO_URING=on $(GO) test -p 1 -count=1 -timeout 30m $(URING_PKGS)

demo: deps build
	@scripts/demo.sh $(BIN) $(IMAGES)

# staticcheck, pinned; go run fetches it through the module proxy.
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	  if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) run $(STATICCHECK) ./...

# Every fuzz target (qcow2 header, image, L2 entries, compressed clusters,
# snapshot table; partition tables; FAT boot sector, directories, whole
# FAT partitions; ext2/3/4 superblock, image, inode and directory) for
# FUZZTIME seconds each. Failing
# inputs land in testdata/fuzz and run with every `make test` after.
FUZZTIME ?= 30
fuzz:
	@scripts/fuzz.sh $(FUZZTIME)

# The man page is made from the command's own help (qcowfs help-man), so
# it says what --help says.
man: build
	$(BIN) help-man > $(MAN)

install: build man
	install -D -m 0755 $(BIN) $(DESTDIR)$(PREFIX)/bin/qcowfs
	install -D -m 0644 $(MAN) $(DESTDIR)$(PREFIX)/share/man/man1/qcowfs.1

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/bin/qcowfs $(DESTDIR)$(PREFIX)/share/man/man1/qcowfs.1

clean:
	rm -rf bin

# Benchmarks (test/bench): every contestant (qcowfs, qemu's FUSE export,
# qcowmount, qemu-img, the raw file, curl) on the same work, interleaved, in
# one run; the report, with the machine and the date, is docs/benchmarks.md.
# Images are built once and kept in .work/bench (QCOWFS_BENCH_WORK=folder to
# move them). BENCH_FLAGS passes more flags: "--only dd-,w-", "--skip r-",
# "--runs 5", "--ref 813bc8e" (qcowfs built from that revision beside it);
# go run ./test/bench -h lists them, --list the workloads.
BENCH_PKGS  := $(TEST_PKGS) qemu-system-common libqcow-utils fio strace time curl
BENCH_FLAGS ?=

.PHONY: bench bench-quick bench-deps

bench-deps: deps-go
	@scripts/deps.sh $(BENCH_PKGS)

bench: bench-deps build        # the full suite, 3 rounds (the time of the last run is in docs/benchmarks.md)
	$(GO) run ./test/bench --build=false --bin $(BIN) $(BENCH_FLAGS)

bench-quick: bench-deps build  # a subset in under 3 minutes, to .work/bench/quick/benchmarks.md
	$(GO) run ./test/bench --quick --build=false --bin $(BIN) $(BENCH_FLAGS)
