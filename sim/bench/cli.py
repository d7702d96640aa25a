"""``bidikv bench``: flags, workload loading, the summary table."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
from typing import Any, Sequence

from sim.bench.config import BenchConfig
from calibration.bench_records import BenchRecord
from impl.bench.stats import bucket_label, percentile

_BENCH_DEFAULTS = BenchConfig(url="", mode="on")  # the one source of the bench's defaults


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="multi-turn benchmark against a router URL; per-turn JSONL",
                              description="Run the simulator's workloads against a real deployment (through "
                                          "bidikv router) and record per turn: prompt tokens, TTFT, total time, "
                                          "reused tokens. The JSONL is what `bidikv calibrate --from-bench` reads.")
    p.add_argument("--url", required=True, help="router (or OpenAI-compatible server) base URL")
    p.add_argument("--mode", required=True, choices=("on", "off"), help="what the deployment runs (bidirectional ON/OFF)")
    p.add_argument("--out", default=None, help="per-turn JSONL output file")
    p.add_argument("--config", default=None, help="TOML file whose [workload] table and seed are used")
    p.add_argument("--workload", dest="workload_kind", default=None, choices=("synthetic", "agentic", "mooncake"),
                   help="workload generator (default: the config's, else bidikv simulate's default)")
    p.add_argument("--trace", default=None, help="Mooncake JSONL trace (implies --workload mooncake)")
    p.add_argument("--conversations", type=int, default=None, help="number of conversations (synthetic/agentic)")
    p.add_argument("--seed", type=int, default=None, help="workload seed (default: the config's, else 0)")
    p.add_argument("--model", default=None, help="model name (default: the first /v1/models lists)")
    p.add_argument("--concurrency", type=int, default=None,
                   help=f"clients, one conversation each at a time (default: {_BENCH_DEFAULTS.concurrency})")
    p.add_argument("--max-rate", type=float, default=None, help="turn starts per second, all clients (default: unlimited)")
    p.add_argument("--gap-scale", type=float, default=None,
                   help="think time = workload gap x this (default: 0, back to back like vLLM's benchmark)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="stop conversations before this (default: from /v1/models)")
    p.add_argument("--api-key-env", default="BIDIKV_API_KEY", help="environment variable holding the API key")
    p.add_argument("--token-id-low", type=int, default=_BENCH_DEFAULTS.token_id_low,
                   help="synthetic prompt token ids are drawn from [low, high) (default: %(default)s)")
    p.add_argument("--token-id-high", type=int, default=_BENCH_DEFAULTS.token_id_high,
                   help="exclusive upper bound; at most the model's vocabulary size (default: %(default)s)")
    p.add_argument("--run-id", default=None,
                   help="prefix of every conversation id the bench sends, so two runs never reuse each other's KV "
                        "through the router (default: a fresh random one per run; give one to repeat a run's ids)")
    p.add_argument("--num-clients", type=int, default=None,
                   help="vLLM's --num-clients, with --vllm-multi-turn-config (default: the config's num_clients, "
                        "else 1); other workloads use --concurrency")
    from sim.commands.simulate import add_vllm_flags

    add_vllm_flags(p)
    p.set_defaults(run=run)


def plan_from_args(args: argparse.Namespace) -> tuple[dict, int, int]:
    """The [workload] table, seed and number of clients, read as ``bidikv simulate`` reads them (TOML,
    then flags), so the same config and flags describe the same run in both."""
    from sim.commands.simulate import workload_from_args
    from sim.engine.config import load_config
    from sim.workload import VLLM_MULTI_TURN

    base = load_config(args.config)
    workload = workload_from_args(base.workload, args)
    if workload.get("kind") == VLLM_MULTI_TURN:
        # vLLM's client loop has its own: --num-clients, --request-rate, and prompts that may exceed the
        # model's length (the server refuses them and the conversation is dropped, as in vLLM)
        for flag, value in (("--concurrency", args.concurrency), ("--max-rate", args.max_rate),
                            ("--gap-scale", args.gap_scale), ("--max-model-len", args.max_model_len)):
            if value is not None:
                raise ValueError(f"{flag} does not apply to vLLM's client loop (--vllm-multi-turn-config): "
                                 "use --num-clients, --max-active-conversations, --request-rate")
    elif args.num_clients is not None:
        raise ValueError("--num-clients is vLLM's client flag (with --vllm-multi-turn-config); use --concurrency")
    seed = base.seed if args.seed is None else args.seed
    return workload, seed, base.num_clients if args.num_clients is None else args.num_clients


def run(args: argparse.Namespace) -> int:
    from sim.bench.client import run_bench
    from calibration.bench_records import write_jsonl
    from sim.workload import VLLM_MULTI_TURN, load_workload

    workload, seed, num_clients = plan_from_args(args)
    conversations = load_workload(workload, seed)
    given = {name: value for name, value in (("concurrency", args.concurrency), ("max_rate_per_s", args.max_rate),
                                             ("gap_scale", args.gap_scale), ("max_model_len", args.max_model_len))
             if value is not None}
    config = BenchConfig(url=args.url, mode=args.mode, model=args.model, **given,
                         seed=seed, api_key=os.environ.get(args.api_key_env), token_id_low=args.token_id_low,
                         token_id_high=args.token_id_high,
                         run_id=args.run_id if args.run_id is not None else os.urandom(4).hex())
    if workload.get("kind") == VLLM_MULTI_TURN:
        from sim.bench.vllm_clients import run_vllm_bench
        from sim.clients.bench import config_from_workload

        records = asyncio.run(run_vllm_bench(config, conversations, config_from_workload(workload), num_clients))
    else:
        records = asyncio.run(run_bench(config, conversations))
    if args.out:
        write_jsonl(records, args.out)
    print(summary_table(records))
    print(f"run id {config.run_id}: conversation ids were sent as {config.wire_id('<id>')} (--run-id repeats them)")
    return 0 if records and all(r.ok for r in records) else 1


def _pct(values: Sequence[float], q: float) -> float:
    return percentile(sorted(values), q)


def summary_table(records: Sequence[BenchRecord]) -> str:
    ok = [r for r in records if r.ok and not math.isnan(r.ttft_s)]
    lines = [f"{len(records)} turns, {len(records) - len(ok)} failed; TTFT (ms) by prompt length",
             f"{'prompt':>9}{'turns':>7}{'p50':>9}{'p90':>9}{'reused (P-reported) / prompt':>31}"]
    buckets: dict[str, list[BenchRecord]] = {}
    for r in ok:
        buckets.setdefault(bucket_label(r.prompt_tokens), []).append(r)
    for label, rs in buckets.items():
        cached = sum(r.prefill_cached_tokens or 0 for r in rs)
        lines.append(f"{label:>9}{len(rs):>7}{_pct([r.ttft_s for r in rs], 50) * 1e3:>9.1f}"
                     f"{_pct([r.ttft_s for r in rs], 90) * 1e3:>9.1f}{cached / sum(r.prompt_tokens for r in rs):>31.1%}")
    errors = sorted({r.error for r in records if r.error})
    if errors:
        lines.append("errors: " + "; ".join(errors[:5]))
    return "\n".join(lines)


