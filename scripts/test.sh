#!/usr/bin/env bash
# The whole test suite, from a fresh clone: sets up (idempotent), then runs every test in a random order
# (pytest-randomly). The order's seed is printed first: `./scripts/test.sh --randomly-seed=N` runs that order again.
# Tracebacks are short (the failing line and its message per frame), so a CI log shows why each test failed.
# One pytest-xdist worker per core (at most 4: each may hold a vLLM server and the reference model), each with one
# OpenMP thread (tests/conftest.py); a module's tests stay in one worker (--dist loadfile), so its engine starts once.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1
.venv/bin/ruff check src tests bench scripts
.venv/bin/mypy
seed=$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')
workers=$(nproc)
[ "$workers" -le 4 ] || workers=4
echo "test order: --randomly-seed=$seed, $workers workers"
exec .venv/bin/python -m pytest -p no:cacheprovider -q -rs --tb=short --durations=25 --randomly-seed="$seed" \
  -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
