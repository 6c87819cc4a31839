#!/usr/bin/env bash
# On the lent GPU machine, from the checkout's root (where the device tool runs commands), once per call that
# carries a part (docs/gpu.md has the exact calls):
#
#   bash scripts/gpu/install_on_device.sh [PARTS_DIR]        # PARTS_DIR: default .gpu-parts
#
# Checks each carried part's sha256 against the manifest and unpacks it into $VLLM_GPU_DIR (default
# /tmp/vllm-gpu: outside the checkout, so the parts of earlier calls stay there while the machine is warm). Until
# every part is in, it says which are missing and exits 0. Then, once: installs the dependency wheels into
# $VLLM_GPU_DIR/site (no index, no dependency resolution: the pack resolved them); and on every complete call:
# makes this checkout's kvcompact entry point visible there and prints, step by step, what imports.
# $PYTHON picks the interpreter (default python3, the one that holds the machine's CUDA torch).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
DEST=${VLLM_GPU_DIR:-/tmp/vllm-gpu}
PARTS=${1:-.gpu-parts}

status=0
"$PYTHON" scripts/gpu/pack_vllm.py unpack --parts "$PARTS" --dest "$DEST" || status=$?
if [ "$status" -eq 3 ]; then
  exit 0  # more parts to come, in later calls
fi
[ "$status" -eq 0 ] || exit "$status"

if [ ! -e "$DEST/.wheels-installed" ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$DEST/site" "$DEST"/wheels/*.whl
  touch "$DEST/.wheels-installed"
  echo "installed $(ls "$DEST"/wheels/*.whl | wc -l) dependency wheels into $DEST/site"
fi
"$PYTHON" scripts/gpu/pack_vllm.py kvcompact --site "$DEST/site"
VLLM_GPU_DIR="$DEST" "$PYTHON" scripts/gpu/device_common.py
