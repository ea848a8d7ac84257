#!/usr/bin/env bash
# Debian's chromium and chromium-driver, which the page tests drive (installed once; needs root and apt). Run by .ci/run
# and by the page tests themselves when the browser is missing, so that the README's test command needs no step first.
set -euo pipefail
installed() { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }
installed && exit 0
# one install at a time: the test workers (pytest -n 2) may all find the browser missing at once
exec 9>"${TMPDIR:-/tmp}/ppoflow-install-chromium.lock"
flock 9
installed && exit 0
apt-get update -qq -o DPkg::Lock::Timeout=300
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 chromium chromium-driver >/dev/null
