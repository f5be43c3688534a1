#!/usr/bin/env bash
# Serve a model with vLLM on a GPU Ray cluster, with kvray as vLLM's KV connector.
#
#   RAY_ADDRESS=HEAD_IP:6379 MODEL=Qwen/Qwen2.5-7B-Instruct TP=2 scripts/serve-vllm-gpu.sh \
#       [extra `vllm serve` options, e.g. --max-model-len 16384]
#
# Before: a Ray cluster with GPUs (scripts/cluster.yaml with `ray up`, or
# scripts/ray-start-head.sh + scripts/ray-start-worker.sh) and kvray installed on every node
# with the vLLM extra (pip install "kvray[vllm,cuda12]"). Run this on a GPU node of the
# cluster: vLLM's Ray executor places its GPU workers with a placement group that must include
# the node it runs on. Keep TP within one node's GPUs (across nodes works, but slowly).
#
# Prefix blocks computed by any vLLM instance in the same kvray namespace are stored in the
# nodes' pools and loaded by every other instance instead of being recomputed. Start more
# instances (other hosts, other ports) with the same KVRAY_NAMESPACE to share the cache; use
# another namespace per model family if you like (keys already include a layout fingerprint,
# so different models never read each other's blocks).
#
# Environment (defaults in brackets):
#   MODEL (required)            model name or path, as for `vllm serve`.
#   RAY_ADDRESS [127.0.0.1:6379] the cluster's GCS address; vLLM and kvray join it.
#   TP [1]                      tensor-parallel size (GPUs per engine).
#   KVRAY_NAMESPACE [default]   kvray namespace shared by the instances that share a cache.
#   KVRAY_CAPACITY [8GiB]       per-node capacity, only used if kvray is not running yet in
#                               the namespace (kvray start is idempotent and keeps a running
#                               deployment as it is).
#   HOST [0.0.0.0] PORT [8000]  the OpenAI-compatible HTTP server.
#   RAY_AUTH_MODE [token]       with the cluster's token in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH
#                               or ~/.ray/auth_token (see scripts/ray-start-head.sh).
#
# kv_load_failure_policy=recompute: a block kvray cannot serve (evicted, node lost, corrupt)
# is recomputed by vLLM instead of failing the request.
#
# Not runnable on a machine without NVIDIA GPUs (the CPU path is `kvray demo`).
set -euo pipefail

MODEL=${MODEL:?set MODEL to a model name or path}
export RAY_ADDRESS=${RAY_ADDRESS:-127.0.0.1:6379}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
TP=${TP:-1}
KVRAY_NAMESPACE=${KVRAY_NAMESPACE:-default}
KVRAY_CAPACITY=${KVRAY_CAPACITY:-8GiB}

# Make sure kvray runs in the namespace (a no-op when it does). This also checks that the
# cluster is reachable and accepts our token, with a one-line error if not.
kvray start --address "$RAY_ADDRESS" --capacity "$KVRAY_CAPACITY" --namespace "$KVRAY_NAMESPACE"

KV_TRANSFER_CONFIG='{"kv_connector":"KVRayConnector","kv_connector_module_path":"kvray.connector","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"namespace":"'"${KVRAY_NAMESPACE}"'"}}'

exec vllm serve "$MODEL" \
  --distributed-executor-backend ray \
  --tensor-parallel-size "$TP" \
  --host "${HOST:-0.0.0.0}" \
  --port "${PORT:-8000}" \
  --kv-transfer-config "$KV_TRANSFER_CONFIG" \
  "$@"
