#!/usr/bin/env bash
# Debian's PostgreSQL server, which `ppoflow up --backend postgres` starts (installed once; needs root and apt). Run by
# .ci/run and by the team-stack test itself when the server is missing, so that the README's test command needs no
# step first.
set -euo pipefail
installed() { command -v initdb >/dev/null || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; }
installed && exit 0
# one install at a time: the test workers (pytest -n 2) may both find it missing at once
exec 9>"${TMPDIR:-/tmp}/ppoflow-install-postgres.lock"
flock 9
installed && exit 0
apt-get update -qq -o DPkg::Lock::Timeout=300
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 postgresql >/dev/null
