#!/usr/bin/env bash
# bidikv EFA deployment: the D (decode) vLLM server. Flags: --config FILE, --mode on|off, --dry-run (impl/deploy/lib.sh).
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/lib.sh"
deploy_main decode "$(basename -- "$0")" "$@"
