#!/usr/bin/env bash
# The whole test suite, from a fresh clone: sets up (idempotent), then runs every test in a random order
# (pytest-randomly). The order's seed is printed first: `./scripts/test.sh --randomly-seed=N` runs that order again.
# Tracebacks are short (the failing line and its message per frame), so a CI log shows why each test failed.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1
.venv/bin/ruff check src tests bench scripts
.venv/bin/mypy
seed=$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')
echo "test order: --randomly-seed=$seed"
exec .venv/bin/python -m pytest -p no:cacheprovider -q -rs --tb=short --durations=25 --randomly-seed="$seed" "$@"
