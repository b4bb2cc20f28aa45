#!/usr/bin/env bash
# What the browser test of `tidal report` (tests/run/test_report_browser.py) needs on a
# fresh Debian 12 machine, as root: Debian's Chromium, driven headless over its DevTools
# pipe (no driver package, no browser download). Idempotent: installs nothing when a
# chromium is present. ~25 s and ~300 MB with apt's lists fetched.
#
#   chromium     /usr/bin/chromium (156.x in Debian 12's security updates)
#   fonts-dejavu-core   the report's font (matplotlib's own), so text measures the same
set -euo pipefail

need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
[ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)

if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "chromium-deps: not root: cannot install ${need[*]}" \
             "(tests/run/test_report_browser.py needs them)" >&2
        exit 0
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    echo "chromium-deps: installed ${need[*]}"
fi
exit 0
