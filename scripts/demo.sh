#!/usr/bin/env bash
# The main job: installs what it needs into .venv, then runs `kvray demo` on an embedded
# local Ray cluster. Extra arguments go to `kvray demo`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export RAY_USAGE_STATS_ENABLED=0
exec "$ROOT/.venv/bin/kvray" demo "$@"
