#!/usr/bin/env bash
# Installs the Go programs the tests need, at pinned versions, into
# $(go env GOPATH)/bin when they are missing or at another version:
#   versitygw, the S3 server of the remote/ tests (test/servers).
# `make test` runs it and puts that folder on PATH for the tests.
set -euo pipefail
GO=${GO:-go}
bin="$($GO env GOPATH)/bin"
install() { # name module-path@version
  local name=$1 pkg=${2%@*} version=${2#*@}
  if [ -x "$bin/$name" ] && $GO version -m "$bin/$name" 2>/dev/null | grep -q "^[[:space:]]*mod[[:space:]].*[[:space:]]$version[[:space:]]"; then
    return 0
  fi
  echo "installing $name $version (go install $pkg@$version)"
  $GO install "$pkg@$version"
}
install versitygw github.com/versity/versitygw/cmd/versitygw@v1.8.0
