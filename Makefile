# qcowfs: see README.md. `make demo` and `make test` do all set-up on a
# fresh Debian machine (they install missing packages when run as root).

GO      ?= go
PREFIX  ?= /usr/local
VERSION := $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X main.version=$(VERSION)
BIN     := bin/qcowfs
# Packages the tests and the demo need (Debian names).
TEST_PKGS := fuse3 qemu-utils fdisk e2fsprogs dosfstools util-linux

.PHONY: all build test demo lint install uninstall deps clean

all: build

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/qcowfs

deps:
	@scripts/deps.sh $(TEST_PKGS)

test: deps lint
	$(GO) test -count=1 -timeout 30m ./...

demo: deps build
	@scripts/demo.sh $(BIN) $(IMAGES)

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	  if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

install: build
	install -D -m 0755 $(BIN) $(DESTDIR)$(PREFIX)/bin/qcowfs

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/bin/qcowfs

clean:
	rm -rf bin
