#!/usr/bin/env bash
# bidikv: the first GPU run of the host tier (docs/guides/host-tier.md). Start P, D and the router from a
# deploy.toml with a [host_tier] table (start_decode.sh, start_prefill.sh, start_router.sh --mode on), then:
#   bash impl/deploy/check_host_tier.sh --config my.toml --gap 30
# --gap: seconds between the two turns, longer than D's decoder_kv_blocks_ttl (its HBM copy expires, the
# host tier's stays). Passes when P pulled the second turn from D's host tier (impl/deploy/host_tier_check.py).
set -euo pipefail
here=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
root=$(cd -- "$here/../.." && pwd)
python=${BIDIKV_PYTHON:-$root/.venv/bin/python}
[[ -x $python ]] || python=python3
config=deploy.toml
gap=""
while (($#)); do
    case $1 in
        --config) config=$2; shift 2 ;;
        --gap) gap=$2; shift 2 ;;
        -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
        *) echo "check_host_tier.sh: unknown flag $1 (flags: --config FILE --gap SECONDS)" >&2; exit 2 ;;
    esac
done
[[ -n $gap ]] || { echo "check_host_tier.sh: --gap SECONDS is required (longer than D's TTL)" >&2; exit 2; }
mapfile -t urls < <(PYTHONPATH=$root "$python" -c '
import sys
from impl.deploy.config import load_config
c = load_config(sys.argv[1])
if c.host_tier is None:
    sys.exit(f"{c.source}: no [host_tier] table: the deployment runs no host tier to check")
print(c.router.url); print(c.prefill.url); print(c.model.served_name)' "$config")
[[ ${#urls[@]} -eq 3 ]] || exit 1
exec env PYTHONPATH="$root" "$python" -m impl.deploy.host_tier_check --router "${urls[0]}" --prefill "${urls[1]}" \
    --model "${urls[2]}" --gap "$gap"
