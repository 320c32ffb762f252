#!/usr/bin/env bash
# Install liandan (editable) with its test tools into the active Python environment.
# An installed torch is kept as it is (a CUDA build on a GPU machine, say); without one, torch
# ${LIANDAN_TORCH_VERSION:-2.13.0} is installed first, so pyproject.toml's torch range needs nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if ! "$python" -c "import torch" >/dev/null 2>&1; then
    "$python" -m pip install "torch==${LIANDAN_TORCH_VERSION:-2.13.0}"
fi
"$python" -m pip install -e ".[dev]"
