#!/usr/bin/env bash
# scripts/fuzz.sh SECONDS: run every fuzz target of the repository for
# SECONDS each (go test -fuzz runs one target at a time). Inputs that fail
# are written under the package's testdata/fuzz and from then on run as
# regression tests by every `go test`.
#
# Go 1.26's fuzz coordinator can fail a run with a bare "context deadline
# exceeded" as -fuzztime ends, while a worker is still busy (a race in
# internal/fuzz, go.dev/issue/75804, fixed in Go 1.27); it is most likely
# on a loaded machine. Such a failure writes no input. A run that fails so,
# with no new input under testdata/fuzz, is run once more; a second
# failure, or any failure that wrote an input, fails.
set -uo pipefail
t=${1:-10}
cd "$(dirname "$0")/.."
inputs() { find "$1/testdata/fuzz/$2" -type f 2>/dev/null | sort; }
for pkg in $(go list ./...); do
  dir=$(go list -f '{{.Dir}}' "$pkg")
  for target in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go 2>/dev/null | sed 's/^func //' | sort -u); do
    for attempt in 1 2; do
      echo "== $pkg $target (${t}s)"
      before=$(inputs "$dir" "$target")
      out=$(go test -run XXX -fuzz "^${target}\$" -fuzztime "${t}s" -fuzzminimizetime 5s "$pkg" 2>&1)
      rc=$?
      grep -v '^fuzz: elapsed' <<<"$out"
      [ $rc -eq 0 ] && break
      after=$(inputs "$dir" "$target")
      if [ $attempt -eq 1 ] && [ "$before" = "$after" ] && grep -q '^    context deadline exceeded$' <<<"$out"; then
        echo "-- $target: 'context deadline exceeded' with no failing input (go.dev/issue/75804); running it again"
        continue
      fi
      exit 1
    done
  done
done
