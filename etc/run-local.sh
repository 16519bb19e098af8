#!/usr/bin/env bash
# The main job: a local deployment (3 broker nodes + the router) on embedded defaults.
# No external services. Ctrl-C stops everything. Extra arguments go to `lodestone-local`.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/etc/bootstrap.sh"
cd "$repo"
exec "$repo/.venv/bin/lodestone-local" "$@"
