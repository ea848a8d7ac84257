#!/usr/bin/env bash
# Debian's chromium and chromium-driver, which the page tests drive (installed once; needs root and apt). Run by .ci/run
# and by the page tests themselves when the browser is missing, so that the README's test command needs no step first.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
