#!/usr/bin/env bash
# Set up the light environment and run the main job (a default multi-turn simulation, ON vs OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${BIDIKV_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e .
exec "$VENV/bin/bidikv" simulate --compare "$@"
