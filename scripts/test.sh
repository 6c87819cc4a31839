#!/usr/bin/env bash
# The whole test suite, from a fresh clone: sets up (idempotent), then runs every test in a random order
# (pytest-randomly). The order's seed is printed first: `./scripts/test.sh --randomly-seed=N` runs that order again.
# Tracebacks are short (the failing line and its message per frame), so a CI log shows why each test failed.
# One pytest-xdist worker per core (at most 4: each may hold a vLLM server and the reference model), each with one
# OpenMP thread (tests/conftest.py); a module's tests stay in one worker (--dist loadfile), so its engine starts once.
# Then the tests marked `alone` (vLLM servers, tensor- and pipeline-parallel workers: several busy processes each)
# in one process, nothing beside them: beside another worker's test they and it ran two to three times slower.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1
.venv/bin/ruff check src tests bench scripts
.venv/bin/mypy
seed=$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')
workers=$(nproc)
[ "$workers" -le 4 ] || workers=4
echo "test order: --randomly-seed=$seed, $workers workers, then the tests marked alone"
run() {  # pytest's exit status, where 5 (nothing selected, e.g. a path without tests marked alone) counts as 0
  .venv/bin/python -m pytest -p no:cacheprovider -q -rs --tb=short --durations=25 --randomly-seed="$seed" "$@" \
    || { status=$?; [ "$status" -eq 5 ] || return "$status"; }
}
workers_status=0
run -n "$workers" --dist loadfile --no-loadscope-reorder -m "not alone and not extended" "$@" || workers_status=$?
run -m "alone and not extended" "$@"
exit "$workers_status"
