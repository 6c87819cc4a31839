#!/usr/bin/env bash
# The whole test suite, from a fresh clone: sets up (idempotent), then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1
.venv/bin/ruff check src tests bench scripts
.venv/bin/mypy
exec .venv/bin/python -m pytest -p no:cacheprovider -q -rs --durations=25 "$@"
