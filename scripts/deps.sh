#!/usr/bin/env bash
# Installs the Debian packages named on the command line that are missing.
# As root with apt-get, it installs them; otherwise it lists what is missing
# and fails, so a test run never silently lacks a tool.
set -euo pipefail
missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "missing packages: ${missing[*]} (install them, or run as root to have them installed)" >&2
  exit 1
fi
