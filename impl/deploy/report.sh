#!/usr/bin/env bash
# bidikv EFA deployment: the ON/OFF table and calibrate --from-bench. Flags: --config FILE, --mode on|off, --dry-run (impl/deploy/lib.sh).
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/lib.sh"
deploy_main report "$(basename -- "$0")" "$@"
