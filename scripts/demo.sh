#!/usr/bin/env bash
# The main job: set up .venv, then train the CPU demo (a tiny model learns a synthetic task).
# Extra arguments are config overrides, e.g. `bash scripts/demo.sh control.total_steps=50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
exec .venv/bin/asyncrl train configs/demo.yaml "$@"
