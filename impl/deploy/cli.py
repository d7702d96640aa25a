"""``bidikv deploy``: check a deployment config, print or hand over the exact commands, compare runs.

    bidikv deploy check   --config deploy.toml                 what the config resolves to
    bidikv deploy plan    --config deploy.toml                 every step's commands, ON then OFF, then the report
    bidikv deploy show    --config deploy.toml STEP [--mode M] one step's commands (the scripts' --dry-run)
    bidikv deploy argv    --config deploy.toml STEP [--mode M] the same, NUL-separated, for the scripts to exec
    bidikv deploy compare ON.jsonl OFF.jsonl [--merged FILE]   the ON/OFF table
    bidikv deploy manifests --config deploy.toml [--mode M] [--out FILE]   Kubernetes manifests (XpYd), checked
    bidikv deploy check-manifests FILE...                      check (edited) manifests offline

``register(subparsers)`` plugs it into impl/cli.py; ``python -m impl.deploy`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

STEP_HELP = "decode | prefill | router | bench | report"


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="TOML", help="deployment config (see impl/deploy/deploy.toml)")


def _add_step(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    p.add_argument("step", metavar="STEP", help=STEP_HELP)
    p.add_argument("--mode", choices=("on", "off"), help="bidirectional KV transfer ON or OFF (all steps but report)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from impl.deploy.k8s_check import KUBERNETES_VERSION

    actions = parser.add_subparsers(dest="deploy_action", required=True, metavar="ACTION")
    for name, help_text, add, run in (
            ("check", "validate the config and print what it resolves to", _add_config, _check),
            ("plan", "print every step's exact commands in order (ON, OFF, report)", _add_config, _plan),
            ("show", "print one step's exact commands (what --dry-run prints)", _add_step, _show),
            ("argv", "one step's commands as NUL-separated arguments (for the scripts)", _add_step, _argv)):
        action = actions.add_parser(name, help=help_text)
        add(action)
        action.set_defaults(run=run)
    man = actions.add_parser("manifests", help="Kubernetes manifests for XpYd from the same config, checked offline",
                             description="Render the Namespace, Secret, store, P and D (StatefulSets, or "
                                         "LeaderWorkerSets when the TP spans instances), router, PodDisruptionBudgets "
                                         "and monitoring objects from the config's [kubernetes] table, check them "
                                         "against the Kubernetes schemas and each other, and print them as YAML. "
                                         "Secrets are read from BIDIKV_API_KEYS, BIDIKV_METRICS_TOKEN, "
                                         "BIDIKV_STORE_PASSWORD, BIDIKV_UPSTREAM_API_KEY, BIDIKV_TRACE_SALT and "
                                         "HF_TOKEN: the output holds them.")
    _add_config(man)
    man.add_argument("--mode", choices=("on", "off"), default="on", help="bidirectional KV transfer (default: on)")
    man.add_argument("--out", metavar="FILE", help="write the YAML to FILE (mode 0600) instead of stdout")
    man.add_argument("--kubernetes-version", default=None, metavar="X.Y",
                     help=f"Kubernetes version whose schemas to check against (default: {KUBERNETES_VERSION})")
    man.set_defaults(run=_manifests)
    chk = actions.add_parser("check-manifests", help="check Kubernetes manifests (YAML files) offline",
                             description="The checks `manifests` runs, on YAML files (for manifests edited by hand).")
    chk.add_argument("files", nargs="+", metavar="FILE", help="YAML files of Kubernetes objects (--- between them)")
    chk.add_argument("--kubernetes-version", default=None, metavar="X.Y",
                     help=f"Kubernetes version whose schemas to check against (default: {KUBERNETES_VERSION})")
    chk.set_defaults(run=_check_manifests)
    comp = actions.add_parser("compare", help="the ON/OFF TTFT table of two bench JSONLs")
    comp.add_argument("on", metavar="ON_JSONL")
    comp.add_argument("off", metavar="OFF_JSONL")
    comp.add_argument("--merged", metavar="FILE", help="also write both runs to FILE (for calibrate --from-bench)")
    comp.set_defaults(run=_compare)


def _load(args: argparse.Namespace) -> Any:
    from impl.deploy.config import load_config

    return load_config(args.config)


def _check(args: argparse.Namespace) -> int:
    from impl.connector.two_tier import check_kv_transfer_config
    from impl.deploy.render import kv_transfer_config, router_ttl_s

    c = _load(args)
    print(f"{c.source}: OK")
    hw = c.instance
    print(f"  instance {hw.name}: {hw.gpus_per_node} x {hw.accelerator}, {hw.hbm_bytes_per_gpu / 1e9:.0f} GB HBM at "
          f"{hw.hbm_bytes_per_s_per_gpu / 1e12:.1f} TB/s each, EFA {hw.efa_bytes_per_s_per_gpu / 1e9:.0f} GB/s per "
          f"accelerator (calibration/data/hardware_{hw.key}.json)")
    if hw.is_neuron:
        print(f"  WARNING: {hw.accelerator} runs vLLM's Neuron backend: the launch commands below are the CUDA "
              "recipe's (kv_buffer_device, EFA RDMA env) and vLLM's engine overheads on Neuron are unknown to this "
              "project; adapt them and measure with the bench before trusting any profile")
    print(f"  model {c.model.name} (served as {c.model.served_name}), TP {c.model.tensor_parallel_size}"
          + (f" over {c.nodes_per_server} instances per server (Kubernetes only: a LeaderWorkerSet; the ssh recipe "
             "refuses it)" if c.nodes_per_server > 1 else ""))
    for s in (c.prefill, c.decode):
        print(f"  {s.role:8} {s.url}  NIXL side channel {s.host}:{s.side_channel_port}"
              + (f"  via ssh {s.ssh}" if s.ssh else "  (this machine)"))
    print(f"  router   {c.router.url}  (D notifies {c.router.url}/internal/kv_params; entries live <= "
          f"{router_ttl_s(c):g} s)")
    print(f"  NIXL backends {list(c.transfer.backends)}, env " + " ".join(f"{k}={v}" for k, v in c.transfer.env))
    decode = check_kv_transfer_config(kv_transfer_config(c, "decode", "on"))  # bidikv's part, alone or composed
    print("  kv_connector_extra_config (ON): " + json.dumps(decode.nixl["kv_connector_extra_config"], sort_keys=True))
    if c.host_tier is not None:
        t = c.host_tier
        print(f"  host tier (vLLM's OffloadingConnector + P2P tier): D {t.decode_cpu_bytes_to_use / 2**30:,.0f} GiB, "
              f"P2P {c.decode.host}:{t.decode_p2p_port}; P {t.prefill_cpu_bytes_to_use / 2**30:,.0f} GiB, P2P "
              f"{c.prefill.host}:{t.prefill_p2p_port}; {t.eviction_policy}; the router counts D's tier as "
              f"{t.capacity_tokens:,} tokens of {c.base_profile} and asks for pulls of >= {t.min_cached_token_delta:,}")
    print(f"  results in {c.results_path('')}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from impl.deploy.render import format_commands, plan

    for name, commands in plan(_load(args)):
        print(f"## {name}")
        sys.stdout.write(format_commands(commands))
    return 0


def _show(args: argparse.Namespace) -> int:
    from impl.deploy.render import format_commands, step_commands

    sys.stdout.write(format_commands(step_commands(_load(args), args.step, args.mode)))
    return 0


def _argv(args: argparse.Namespace) -> int:
    from impl.deploy.render import nul_argv, step_commands

    sys.stdout.buffer.write(nul_argv(step_commands(_load(args), args.step, args.mode)))
    sys.stdout.flush()
    return 0


def _problems(objects: list, version: str | None) -> list[str]:
    from impl.deploy.k8s_check import KUBERNETES_VERSION, consistency_problems, schema_problems

    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        print("bidikv deploy: schemas not checked: kubernetes-validate is not installed (pip install "
              "kubernetes-validate); the checks between objects ran", file=sys.stderr)
        return consistency_problems(objects)
    return schema_problems(objects, version or KUBERNETES_VERSION) + consistency_problems(objects)


def _report(problems: list[str]) -> int:
    for p in problems:
        print(f"bidikv deploy: manifest problem: {p}", file=sys.stderr)
    return 1 if problems else 0


def _manifests(args: argparse.Namespace) -> int:
    import os

    from impl.deploy.k8s_render import render_manifests, to_yaml

    rendered = render_manifests(_load(args), args.mode, os.environ)
    for w in rendered.warnings:
        print(f"bidikv deploy: warning: {w}", file=sys.stderr)
    if _report(_problems(rendered.objects, args.kubernetes_version)):
        return 1
    text = to_yaml(rendered.objects)
    if args.out:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the Secret's values
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        print(f"wrote {args.out}: {len(rendered.objects)} objects", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _check_manifests(args: argparse.Namespace) -> int:
    import yaml

    objects = []
    for name in args.files:
        try:
            with open(name) as fh:
                objects += [o for o in yaml.safe_load_all(fh) if o]
        except OSError as e:
            raise ValueError(f"{name}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{name}: not valid YAML ({e})") from None
    bad = [o for o in objects if not isinstance(o, dict) or "kind" not in o]
    if bad:
        raise ValueError(f"{args.files[0]}: a document is not a Kubernetes object (no kind): {str(bad[0])[:80]}")
    code = _report(_problems(objects, args.kubernetes_version))
    if not code:
        print(f"{len(objects)} objects: OK")
    return code


def _compare(args: argparse.Namespace) -> int:
    from impl.deploy.compare import compare

    print(compare(args.on, args.off, args.merged))
    if args.merged:
        print(f"wrote {args.merged}", file=sys.stderr)
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "deploy", help="EFA deployment recipe: P/D vLLM with NIXL LIBFABRIC, router, bench, ON/OFF report; "
                       "Kubernetes manifests",
        description="Check a deployment config and print (or hand the launch scripts) the exact commands that "
                    "start D, P and the router on EFA hosts, run the bench ON and OFF, and report; or render the "
                    "same deployment as Kubernetes manifests (XpYd), checked offline.")
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m impl.deploy",
                                     description="bidikv's EFA deployment recipe (same as `bidikv deploy`)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ValueError as exc:  # a bad config or input: name it, no traceback, nothing launched
        print(f"bidikv deploy: error: {exc}", file=sys.stderr)
        return 2
