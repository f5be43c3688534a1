#!/usr/bin/env bash
# Start the head of a kvray cluster with plain `ray start` (no `ray up`), then deploy kvray.
#
#   scripts/ray-start-head.sh [extra `ray start` options...]
#
# Then, on every other machine: RAY_HEAD=<this host's IP>:6379 scripts/ray-start-worker.sh
# kvray puts a block pool on each node as it joins (no `kvray start` needed there).
#
# Environment (defaults in brackets):
#   RAY_PORT [6379]                 GCS port; workers, drivers and vLLM use HEAD_IP:RAY_PORT.
#   RAY_DASHBOARD_PORT [8265]       dashboard (bound to 0.0.0.0: firewall it, see below).
#   RAY_METRICS_EXPORT_PORT [8080]  Prometheus endpoint of this node (ray_kvray_* live here);
#                                   use the same port on every node so one scrape job covers
#                                   them all. Ray also writes Prometheus file-SD targets of all
#                                   nodes to /tmp/ray/prom_metrics_service_discovery.json here.
#   RAY_OBJECT_STORE_BYTES []       object store size (Ray's default: 30% of RAM). kvray's
#                                   blocks live in it: keep it above KVRAY_CAPACITY + in-flight
#                                   puts (a few segments, 32 MiB each by default).
#   KVRAY_CAPACITY [8GiB]           KV bytes each node's pool may hold.
#   KVRAY_NAMESPACE [default]       kvray namespace (one per model/deployment if you like).
#   RAY_AUTH_MODE [token]           Ray token authentication, see below. `disabled` turns it
#                                   off (only on a private network you trust).
#   RAY / KVRAY [ray / kvray]       the commands, if not on PATH (e.g. .venv/bin/ray).
#
# Token authentication (Ray >= 2.52; this is how Ray 2.60 does it):
#   - Every Ray process of the cluster, and every client (kvray CLI, vLLM, ray.init) needs
#     RAY_AUTH_MODE=token and the same token, found in this order: $RAY_AUTH_TOKEN (the token
#     itself), the file $RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token.
#   - This script makes one if none exists: `ray get-auth-token --generate` writes a random
#     256-bit token to ~/.ray/auth_token. `ray get-auth-token` prints it.
#   - Copy it to the workers and clients (scp ~/.ray/auth_token worker:~/.ray/auth_token, or a
#     secret store that sets RAY_AUTH_TOKEN). Treat it like a password: it lets anyone run code
#     on the cluster. The dashboard asks for it in the browser.
#   - Ray's Prometheus endpoint (RAY_METRICS_EXPORT_PORT) is NOT behind the token: keep it
#     (and 6379, 8265, 10001) reachable from the cluster network and your Prometheus only.
#
# Stop: `kvray stop` (drops the cached blocks), then `ray stop` on each node.
set -euo pipefail

RAY=${RAY:-ray}
KVRAY=${KVRAY:-kvray}
RAY_PORT=${RAY_PORT:-6379}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}
RAY_METRICS_EXPORT_PORT=${RAY_METRICS_EXPORT_PORT:-8080}
KVRAY_CAPACITY=${KVRAY_CAPACITY:-8GiB}
KVRAY_NAMESPACE=${KVRAY_NAMESPACE:-default}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}

if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
  if [ -n "${RAY_AUTH_TOKEN_PATH:-}" ]; then
    if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
      echo "ray-start-head: RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH is missing or empty" >&2
      exit 1
    fi
  elif [ ! -s "$HOME/.ray/auth_token" ]; then
    echo "ray-start-head: no Ray auth token yet; generating ~/.ray/auth_token" >&2
    "$RAY" get-auth-token --generate >/dev/null
  fi
fi

args=(
  --head
  --port "$RAY_PORT"
  --dashboard-host 0.0.0.0
  --dashboard-port "$RAY_DASHBOARD_PORT"
  --metrics-export-port "$RAY_METRICS_EXPORT_PORT"
  --disable-usage-stats
)
if [ -n "${RAY_OBJECT_STORE_BYTES:-}" ]; then
  args+=(--object-store-memory "$RAY_OBJECT_STORE_BYTES")
fi
"$RAY" start "${args[@]}" "$@"

# Idempotent: a second run (or a restarted head) keeps the running index and its pools.
"$KVRAY" start --address "127.0.0.1:$RAY_PORT" --capacity "$KVRAY_CAPACITY" \
  --namespace "$KVRAY_NAMESPACE"

head_ip=$(hostname -I 2>/dev/null | awk '{print $1}')
cat >&2 <<EOF

kvray is up on the head. Next:
  workers:  RAY_HEAD=${head_ip:-HEAD_IP}:$RAY_PORT scripts/ray-start-worker.sh
            (with the same token: RAY_AUTH_TOKEN=\$(ray get-auth-token) or ~/.ray/auth_token)
  status:   kvray status --address ${head_ip:-HEAD_IP}:$RAY_PORT --namespace $KVRAY_NAMESPACE
  vLLM:     RAY_ADDRESS=${head_ip:-HEAD_IP}:$RAY_PORT MODEL=... scripts/serve-vllm-gpu.sh
  metrics:  http://NODE_IP:$RAY_METRICS_EXPORT_PORT/metrics on every node; Grafana dashboard:
            scripts/grafana_kvray.json
EOF
