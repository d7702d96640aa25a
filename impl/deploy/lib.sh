# shellcheck shell=bash
# Shared by the launch scripts (sourced, not run). The renderer (python -m impl.deploy) checks the
# config and produces every command; this file only parses the script's flags, then either prints
# the commands (--dry-run) or runs them: all but the last in turn, the last with exec, so a server
# stays in the foreground and Ctrl-C reaches it.

set -euo pipefail

DEPLOY_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd -- "$DEPLOY_DIR/../.." && pwd)

deploy_usage() {
    local script=$1 step=$2
    cat <<USAGE
usage: $script [--config FILE] [--mode on|off] [--dry-run]

Runs the "$step" step of the bidikv EFA deployment (impl/deploy/README.md).
  --config FILE  deployment config (default: \$BIDIKV_DEPLOY_CONFIG, else impl/deploy/deploy.toml)
  --mode on|off  bidirectional KV transfer ON or OFF (every step but report)
  --dry-run      print the exact commands instead of running them
The renderer runs with \$BIDIKV_PYTHON, else the checkout's .venv/bin/python, else python3.
USAGE
}

# deploy_main STEP SCRIPT_NAME [flags...]
deploy_main() {
    local step=$1 script=$2
    shift 2
    local config=${BIDIKV_DEPLOY_CONFIG:-$DEPLOY_DIR/deploy.toml}
    local dry_run=0
    local -a mode_args=()
    while (($#)); do
        case $1 in
            --config | --mode)
                if (($# < 2)); then
                    echo "$script: $1 needs a value" >&2
                    return 2
                fi
                if [[ $1 == --config ]]; then config=$2; else mode_args=(--mode "$2"); fi
                shift 2
                ;;
            --config=*) config=${1#--config=}; shift ;;
            --mode=*) mode_args=(--mode "${1#--mode=}"); shift ;;
            --dry-run) dry_run=1; shift ;;
            -h | --help) deploy_usage "$script" "$step"; return 0 ;;
            *)
                echo "$script: unknown argument: $1 (see --help)" >&2
                return 2
                ;;
        esac
    done
    # the renderer runs from the checkout (so impl.deploy imports); keep a relative config path valid
    if [[ $config != /* ]]; then config=$PWD/$config; fi

    local python=${BIDIKV_PYTHON:-}
    if [[ -z $python ]]; then
        if [[ -x $REPO_DIR/.venv/bin/python ]]; then python=$REPO_DIR/.venv/bin/python; else python=python3; fi
    fi
    cd -- "$REPO_DIR"
    local -a render=("$python" -m impl.deploy)

    if ((dry_run)); then
        "${render[@]}" show --config "$config" "$step" "${mode_args[@]}"
        return
    fi

    # Render to a file first: a bad config fails here (set -e) and nothing is launched.
    local rendered
    rendered=$(mktemp)
    if ! "${render[@]}" argv --config "$config" "$step" "${mode_args[@]}" >"$rendered"; then
        rm -f -- "$rendered"
        return 2
    fi
    local -a words=()
    mapfile -d '' -t words <"$rendered"
    rm -f -- "$rendered"

    # an empty word ends a command (impl.deploy.render.nul_argv)
    local -a command=()
    local i last_end=-1
    for ((i = 0; i < ${#words[@]}; i++)); do
        if [[ -z ${words[i]} ]]; then last_end=$i; fi
    done
    for ((i = 0; i < ${#words[@]}; i++)); do
        if [[ -n ${words[i]} ]]; then
            command+=("${words[i]}")
            continue
        fi
        { printf '+'; printf ' %q' "${command[@]}"; printf '\n'; } >&2
        if ((i == last_end)); then exec "${command[@]}"; fi
        "${command[@]}"
        command=()
    done
}
