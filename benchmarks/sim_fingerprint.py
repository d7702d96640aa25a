"""A fingerprint of what the simulator computes, for checking that a speed change changes nothing.

Run: python benchmarks/sim_fingerprint.py [--only NAME ...] [--out FILE]

Runs a fixed set of configurations that together reach every code path of the cluster (1P1D to
64P64D, memory pressure with preemption and drops, leases with each client renewal, the oracle, the
learnt TTL, P's and D's prefix caches, OFF, history rewrites, pooled clients, a clock limit) and prints
one line per configuration: the SHA-256 of every record's every field (``repr`` of floats, so one bit
of difference shows) and of the summary. Compare the output of two commits with ``diff``; a change
that is meant to move nothing must print the same lines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def configs() -> dict[str, dict]:
    """name -> overrides of SimConfig (dotted), each a path the others do not take."""
    synthetic = {"kind": "synthetic", "num_conversations": 300, "arrival_rate_per_s": 0.5,
                 "inter_turn_gap_s": {"kind": "exponential", "mean": 30.0}}
    busy = {"kind": "synthetic", "num_conversations": 400, "arrival_rate_per_s": 4.0,
            "inter_turn_gap_s": {"kind": "exponential", "mean": 10.0}}
    agentic = {"kind": "agentic", "num_conversations": 100, "arrival_rate_per_s": 0.5}
    return {
        "default": {},
        "1p1d-ll": {"workload": synthetic, "policy.placement": "least_loaded"},
        "8p8d-ll": {"workload": busy, "topology.num_prefill": 8, "topology.num_decode": 8,
                    "policy.placement": "least_loaded"},
        "64p64d-ll": {"workload": {**busy, "num_conversations": 1500, "arrival_rate_per_s": 16.0},
                      "topology.num_prefill": 64, "topology.num_decode": 64, "policy.placement": "least_loaded"},
        "4p4d-kv-aware": {"workload": busy, "topology.num_prefill": 4, "topology.num_decode": 4,
                          "policy.placement": "kv_aware", "policy.prefix_caching": True},
        "pressure": {"workload": busy, "topology.decode_kv_blocks": 3000, "topology.max_num_seqs": 16,
                     "policy.decoder_kv_blocks_ttl": 600.0},
        "preempt": {"workload": busy, "topology.decode_kv_blocks": 900, "policy.decoder_kv_blocks_ttl": 60.0},
        "off": {"workload": synthetic, "policy.bidirectional": False},
        "no-d-cache": {"workload": synthetic, "policy.decode_prefix_caching": False, "policy.kv_recompute_threshold": 0},
        "break-even": {"workload": synthetic, "policy.recompute_policy": "break_even"},
        "lease-open": {"workload": synthetic, "policy.retention": "lease"},
        "lease-tools": {"workload": agentic, "policy.retention": "lease",
                        "clients.client_renewal": "tool_calls"},
        "lease-clairvoyant": {"workload": synthetic, "policy.retention": "lease",
                              "clients.client_renewal": "until_next_turn"},
        "oracle": {"workload": synthetic, "policy.retention": "oracle"},
        "gap-quantile": {"workload": synthetic, "policy.retention": "gap_quantile"},
        "edited-history": {"workload": {**synthetic, "kind": "edited_history"}},
        "reasoning": {"workload": {**agentic, "kind": "reasoning_agent"}, "policy.prefix_caching": True},
        "pooled-clients": {"workload": busy, "num_clients": 20},
        "clock-limit": {"workload": busy, "max_sim_time_s": 120.0},
    }


def build(overrides: dict):
    from sim.engine.config import SimConfig

    config = SimConfig(seed=7)
    for dotted, value in overrides.items():
        target = config
        *path, name = dotted.split(".")
        for part in path:
            target = getattr(target, part)
        setattr(target, name, value)
    config.validate()
    return config


def fingerprint(overrides: dict) -> tuple[str, int, float]:
    from sim.engine.records import RECORD_FIELDS
    from sim.engine.runner import run_config

    config = build(overrides)
    start = time.process_time()
    result = run_config(config)
    cpu = time.process_time() - start
    digest = hashlib.sha256()
    for rec in result.records:
        digest.update(repr(tuple(getattr(rec, f) for f in RECORD_FIELDS)).encode())
    digest.update(json.dumps(result.summary, sort_keys=True, default=repr).encode())
    digest.update(repr(result.series).encode())
    summary = result.summary
    paths = f"preempted={summary.get('preemptions')} dropped={summary.get('dropped_under_pressure')} heartbeats={summary.get('heartbeats')}"
    return digest.hexdigest()[:16], f"records={len(result.records)} {paths}", cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="run only these configurations")
    args = parser.parse_args()
    table = configs()
    unknown = set(args.only or ()) - set(table)
    if unknown:
        parser.error(f"--only: unknown configuration(s) {', '.join(sorted(unknown))} (known: {', '.join(table)})")
    for name, overrides in table.items():
        if args.only and name not in args.only:
            continue
        digest, records, cpu = fingerprint(overrides)
        print(f"{name:20s} {digest} {records}", flush=True)
        print(f"  ({cpu:.1f} cpu s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
