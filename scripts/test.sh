#!/usr/bin/env bash
# The test command: installs what it needs into .venv, then runs the whole suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k store).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export RAY_USAGE_STATS_ENABLED=0
exec "$ROOT/.venv/bin/python" -m pytest "$@"
