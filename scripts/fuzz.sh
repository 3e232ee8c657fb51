#!/usr/bin/env bash
# scripts/fuzz.sh SECONDS: run every fuzz target of the repository for
# SECONDS each (go test -fuzz runs one target at a time). Inputs that fail
# are written under the package's testdata/fuzz and from then on run as
# regression tests by every `go test`.
set -euo pipefail
t=${1:-10}
cd "$(dirname "$0")/.."
for pkg in $(go list ./...); do
  dir=$(go list -f '{{.Dir}}' "$pkg")
  for target in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go 2>/dev/null | sed 's/^func //' | sort -u); do
    echo "== $pkg $target (${t}s)"
    go test -run XXX -fuzz "^${target}\$" -fuzztime "${t}s" -fuzzminimizetime 5s "$pkg" | grep -v '^fuzz: elapsed' || exit 1
  done
done
