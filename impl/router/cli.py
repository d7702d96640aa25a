"""``bidikv router``: the command line of the router.

Every setting of :class:`~impl.router.config.RouterConfig` is a flag (``--max-conversations``,
``--health-interval-s``, ``--notify/--no-notify`` ...); no flag carries a default of its own, so
the dataclass stays the one source of defaults and a TOML file (``--config``) sits between the two.
vLLM's proxy flags (``--prefiller-hosts/--prefiller-ports/--decoder-hosts/--decoder-ports``) are
accepted as well and add to ``--prefill``/``--decode``.

``register(subparsers)`` plugs the subcommand into the project's CLI; ``python -m impl.router``
runs it alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any, Sequence

from impl.old_flags import add_refused_flags
from impl.policy import catalogue
from impl.policy.catalogue import REGISTRIES, ROUTER
from impl.router.config import FLAG_HELP, RouterConfig, build_config, host_port_urls, load_toml

_CHOICES = {"loop": ("auto", "asyncio", "uvloop"), "log_level": ("debug", "info", "warning", "error"),
            # the catalogue's selectors: the policies of their registry the router runs
            **{s.name: REGISTRIES[s.family].names(ROUTER) for s in catalogue.on(ROUTER) if s.family}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML file of settings (keys as the long flags, with _)")
    defaults = RouterConfig()
    for f in dataclasses.fields(RouterConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        shown = f" (default: {default!r})" if default not in ((), None) else ""
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": FLAG_HELP[f.name] + shown}
        if f.name in ("prefill", "decode"):
            kwargs.update(nargs="+", action="extend", metavar="URL")
        elif isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name in _CHOICES:
            kwargs["choices"] = _CHOICES[f.name]
        elif isinstance(default, int):
            kwargs["type"] = int
        elif isinstance(default, float):
            kwargs["type"] = float
        else:
            kwargs["type"] = str
        parser.add_argument(flag, **kwargs)
    add_refused_flags(parser, ROUTER)
    compat = parser.add_argument_group("vLLM proxy compatibility")
    compat.add_argument("--prefiller-hosts", "--prefiller-host", nargs="+", default=None, metavar="HOST",
                        help="prefill hosts, paired in order with --prefiller-ports (vLLM's proxy flags)")
    compat.add_argument("--prefiller-ports", "--prefiller-port", nargs="+", type=int, default=None, metavar="PORT",
                        help="prefill HTTP ports, one per --prefiller-hosts entry")
    compat.add_argument("--decoder-hosts", "--decoder-host", nargs="+", default=None, metavar="HOST",
                        help="decode hosts, paired in order with --decoder-ports (vLLM's proxy flags)")
    compat.add_argument("--decoder-ports", "--decoder-port", nargs="+", type=int, default=None, metavar="PORT",
                        help="decode HTTP ports, one per --decoder-hosts entry")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    file_values = load_toml(args.config) if getattr(args, "config", None) else {}
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(RouterConfig) if hasattr(args, f.name)}
    for role, hosts, ports in (("prefill", args.prefiller_hosts, args.prefiller_ports),
                               ("decode", args.decoder_hosts, args.decoder_ports)):
        urls = host_port_urls(hosts, ports, role)
        if urls:
            overrides[role] = list(overrides.get(role, ())) + urls
    return build_config(file_values, overrides)


def _run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        config.require_upstreams()
    except (ValueError, OSError) as e:
        print(f"bidikv router: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from impl.router.app import run  # aiohttp is imported only when the router actually runs

    run(config)
    return 0


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    parser = subparsers.add_parser("router", help="KV-cache-aware multi-turn router for P/D-disaggregated vLLM",
                                   description="Route OpenAI-compatible requests through prefill (P) and decode (D) "
                                               "vLLM instances, reusing D's KV cache across the turns of a conversation.")
    add_arguments(parser)
    parser.set_defaults(run=_run)  # impl/cli.py's convention for every subcommand
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bidikv")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)
