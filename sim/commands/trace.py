"""``bidikv trace``: convert between the router's trace and the Mooncake trace format."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("trace", help="convert a router trace (--trace-out) to or from the Mooncake format",
                              description=__doc__)
    sub = p.add_subparsers(dest="trace_command", required=True)
    to = sub.add_parser("to-mooncake", help="a router trace (file or directory) as a Mooncake JSONL trace")
    to.add_argument("source", help="router trace file, or the --trace-out directory")
    to.add_argument("out", help="Mooncake JSONL file to write")
    to.set_defaults(run=_to_mooncake)
    back = sub.add_parser("from-mooncake", help="a Mooncake JSONL trace as a router trace (lengths and arrivals only)")
    back.add_argument("source", help="Mooncake JSONL trace")
    back.add_argument("out", help="router trace file to write (readable by simulate/tune --trace)")
    back.set_defaults(run=_from_mooncake)


def _to_mooncake(args: argparse.Namespace) -> int:
    from sim.workload.router_trace import RouterTraceSummary, load_router_trace
    from sim.workload.trace_convert import to_mooncake

    summary = RouterTraceSummary()
    conversations = load_router_trace(args.source, summary)
    written = to_mooncake(conversations, args.out)
    print(f"{summary.describe()}\nwrote {written} requests to {args.out} (Mooncake finds conversations again only "
          "for prompts of two 512-token blocks or more)")
    return 0


def _from_mooncake(args: argparse.Namespace) -> int:
    from sim.workload.trace_convert import from_mooncake

    written = from_mooncake(args.source, args.out)
    print(f"wrote {written} turns to {args.out} (arrivals and lengths; no reuse or latency: Mooncake has none)")
    return 0
