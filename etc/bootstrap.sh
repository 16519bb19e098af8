#!/usr/bin/env bash
# Make ./.venv with Lodestone and its Python dependencies (idempotent; quick when already done).
# Sourced by etc/run-local.sh and etc/run-tests.sh; `extras` selects optional dependency groups
# (`test`; `gravity`: PySpark and matplotlib for lodestone-gravity, docs/gravity.md — `test` has them too;
# `gravity` also installs Java, Debian's default-jre-headless, when no `java` is on PATH and JAVA_HOME is unset:
# PySpark's driver runs on it).
# With `test` it also installs the Node client tests' npm packages (rhea and minimist, pinned by
# clients/node/package-lock.json) with `npm ci`, when npm is on PATH (etc/run-tests.sh puts it there).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-}"
py="${PYTHON:-python3}"
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "Lodestone needs Python >= 3.11 (found: $("$py" --version 2>&1))" >&2
    exit 1
fi
if [ ! -x "$repo/.venv/bin/python" ]; then
    "$py" -m venv "$repo/.venv"
fi
stamp="$repo/.venv/.lodestone-installed${extras:+-$extras}"
if [ ! -f "$stamp" ] || [ "$repo/pyproject.toml" -nt "$stamp" ]; then
    "$repo/.venv/bin/pip" install --quiet --disable-pip-version-check -e "$repo${extras:+[$extras]}"
    touch "$stamp"
fi
if [ "$extras" = gravity ] && [ -z "${JAVA_HOME:-}" ] && ! command -v java >/dev/null 2>&1; then
    echo "bootstrap: installing Java for PySpark (Debian's default-jre-headless)" >&2
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq default-jre-headless >/dev/null
    else
        sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq default-jre-headless >/dev/null
    fi
fi
if [ "$extras" = test ] && command -v npm >/dev/null 2>&1; then
    node_dir="$repo/clients/node"
    node_stamp="$node_dir/node_modules/.lodestone-installed"
    if [ ! -f "$node_stamp" ] || [ "$node_dir/package-lock.json" -nt "$node_stamp" ]; then
        (cd "$node_dir" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
        touch "$node_stamp"
    fi
fi
