#!/usr/bin/env bash
# Installs Debian's `prometheus` package (it ships both `prometheus` and `promtool`) when either
# binary is missing. Non-interactive and idempotent: the project's set-up and .ci/run call it.
#
# The package's maintainer scripts would start a system service; kvray's tests run their own
# prometheus process on a free port instead, so service start-up is blocked for the install
# (policy-rc.d exit 101) and any service that still came up is stopped and disabled.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    echo "prometheus already installed: $(prometheus --version 2>&1 | head -n1)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

# Only add a policy-rc.d when none exists, and remove only the one we added.
POLICY=/usr/sbin/policy-rc.d
ADDED_POLICY=0
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod 755 "$POLICY"
    ADDED_POLICY=1
fi
cleanup() {
    if [ "$ADDED_POLICY" -eq 1 ]; then
        $SUDO rm -f "$POLICY"
    fi
}
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# --no-install-recommends: the recommended node-exporter would be one more service to keep down.
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null

# Belt and braces for hosts whose init system ignores policy-rc.d.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
elif command -v service >/dev/null 2>&1; then
    $SUDO service prometheus stop >/dev/null 2>&1 || true
fi

echo "installed: $(prometheus --version 2>&1 | head -n1)"
promtool --version 2>&1 | head -n1
