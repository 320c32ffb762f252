#!/usr/bin/env bash
# Install liandan (editable) with its test tools into the active Python environment.
# An installed torch is kept as it is (a CUDA build on a GPU machine, say); without one, torch
# ${LIANDAN_TORCH_VERSION:-2.13.0} is installed first, so pyproject.toml's torch range needs nothing else.
# The other packages take the versions in scripts/constraints.txt, the set the tests last ran with.
# The dashboard's and report's browser tests drive the system's Chromium (never a downloaded one): on Debian or
# Ubuntu, run as root, the chromium package is installed too unless LIANDAN_NO_BROWSER=1; elsewhere those tests
# skip, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if ! "$python" -c "import torch" >/dev/null 2>&1; then
    "$python" -m pip install "torch==${LIANDAN_TORCH_VERSION:-2.13.0}"
fi
"$python" -m pip install -e ".[dev]" -c scripts/constraints.txt
if [ "${LIANDAN_NO_BROWSER:-0}" != 1 ] && ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q chromium >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
            || echo "install.sh: could not install chromium; the browser tests will skip" >&2
    else
        echo "install.sh: no chromium (Debian's package); the browser tests will skip" >&2
    fi
fi
