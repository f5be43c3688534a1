#!/usr/bin/env bash
# Join this machine to a kvray cluster started with scripts/ray-start-head.sh.
#
#   RAY_HEAD=HEAD_IP:6379 scripts/ray-start-worker.sh [extra `ray start` options...]
#
# No `kvray start` here: the kvray index notices the new node and puts a block pool on it
# (capacity as given to `kvray start` on the head). Check with `kvray status`.
#
# Environment (defaults in brackets):
#   RAY_HEAD (required)             the head's GCS address, HOST:PORT.
#   RAY_METRICS_EXPORT_PORT [8080]  this node's Prometheus endpoint (same port on every node).
#   RAY_OBJECT_STORE_BYTES []       object store size; keep it above kvray's per-node capacity
#                                   plus in-flight puts (a few 32 MiB segments).
#   RAY_AUTH_MODE [token]           must match the head's.
#   RAY [ray]                       the command, if not on PATH.
#
# Token authentication (Ray 2.60): with RAY_AUTH_MODE=token this node needs the head's token:
#   RAY_AUTH_TOKEN=<token> (e.g. from a secret store), or RAY_AUTH_TOKEN_PATH=<file>, or the
#   file ~/.ray/auth_token (copy it from the head: `ray get-auth-token` prints it there).
#   Without it `ray start` stops with "Token authentication is enabled but no authentication
#   token was found"; a wrong one is refused by the head's GCS ("InvalidAuthToken" in the log).
#
# Leave: `ray stop` on this node (its pool and the blocks it held go with it; the index drops
# them and clients recompute what they asked for).
set -euo pipefail

RAY=${RAY:-ray}
RAY_HEAD=${RAY_HEAD:?set RAY_HEAD=HEAD_IP:PORT (the address ray-start-head.sh printed)}
RAY_METRICS_EXPORT_PORT=${RAY_METRICS_EXPORT_PORT:-8080}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}

if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ] \
  && [ ! -s "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; then
  echo "ray-start-worker: RAY_AUTH_MODE=token but no token: set RAY_AUTH_TOKEN or copy the" \
    "head's ~/.ray/auth_token here (on the head: ray get-auth-token)" >&2
  exit 1
fi

args=(
  --address "$RAY_HEAD"
  --metrics-export-port "$RAY_METRICS_EXPORT_PORT"
  --disable-usage-stats
)
if [ -n "${RAY_OBJECT_STORE_BYTES:-}" ]; then
  args+=(--object-store-memory "$RAY_OBJECT_STORE_BYTES")
fi
"$RAY" start "${args[@]}" "$@"
echo "joined $RAY_HEAD; kvray adds a pool here within seconds (kvray status --address $RAY_HEAD)" >&2
