#!/usr/bin/env bash
# The test command: set up .venv, then run the whole suite (CPU; GPU tests skip without CUDA).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh || exit 1
# The dashboard browser test needs Chromium; install Debian's package when we can (root, apt).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
        || echo "[test] chromium could not be installed; browser tests will skip"
fi
# Lint first (under a minute): pyflakes, pycodestyle, isort, bugbear, pyupgrade, simplify and
# ruff's own rules plus the formatter, as configured in pyproject.toml's [tool.ruff], and mypy
# on the whole package ([tool.mypy]).
# A lint or type error fails the run, like a failing test.
lint_rc=0
.venv/bin/ruff check asyncrl tests bench examples || lint_rc=1
.venv/bin/ruff format --check asyncrl tests bench examples || lint_rc=1
[ "$lint_rc" = 0 ] || echo "[test] lint failed: run .venv/bin/ruff check --fix and .venv/bin/ruff format"
if ! .venv/bin/mypy asyncrl; then
    lint_rc=1
    echo "[test] type check failed: .venv/bin/mypy asyncrl"
fi
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
if [ $# -gt 0 ]; then
    .venv/bin/python -m pytest --durations=20 "$@"
    rc=$?
else
    # The whole suite, as two lanes side by side (scripts/lanes.sh says how and why).
    bash scripts/lanes.sh
    rc=$?
fi
# pytest exits 5 when it collected no test: that is a broken suite here, not a pass.
if [ "$rc" = 5 ]; then echo "[test] pytest collected no tests"; exit 1; fi
[ "$rc" = 0 ] && rc=$lint_rc
exit "$rc"
