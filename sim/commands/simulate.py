"""``bidikv simulate``: flags generated from the config dataclasses (one source of defaults).

``--json`` prints one object of a fixed shape, whatever the flags (``--compare`` only adds a run)::

    {"format": "bidikv.simulate/1",
     "workload": {"kind", "description", "conversations", "turns"},
     "runs": {"on": SUMMARY, "off": SUMMARY},   # only the modes that ran ("on" and/or "off")
     "warnings": [str, ...]}

SUMMARY is :func:`sim.engine.records.summarize`'s dict, except that ``ttft_by_prompt_bucket`` is replaced by
``prompt_buckets``: a list in increasing prompt length, one entry per bucket that has turns, with
``bucket`` ("4-8k"), ``min_tokens``, ``max_tokens`` (null for the last, open bucket), ``turns``,
``first_turns`` and ``later_turns`` (TTFT distributions: ``n``, ``p50_ms``, ``p90_ms``, ``p99_ms``,
``mean_ms``) and ``queue_mean_ms`` (time waiting for P and D, mean over the bucket's turns).

The output is strict JSON: never ``NaN`` or ``Infinity``. ``null`` stands for "no value" (a
percentile of no turns) and, for a limit, "no limit": ``"decoder_kv_blocks_ttl": null`` in
config.json means blocks are never released by time (what ``--decoder-kv-blocks-ttl inf`` asks for),
``"max_sim_time_s": null`` that the clock runs until the last turn ends.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import dataclasses
import json
import math
import os
import pathlib
import sys
from typing import Any, Callable, Sequence

from impl.old_flags import add_refused_flags
from impl.policy import catalogue
from sim.engine.config import ClientConfig, PolicyConfig, SimConfig, TopologyConfig, load_config
from sim.engine.records import PROMPT_BUCKETS, RECORD_FIELDS, bucket_label, distribution, fields_of, percentile
from sim.workload import WORKLOAD_HELP, WORKLOAD_KINDS

_SECTIONS = (("topology", TopologyConfig), ("policy", PolicyConfig), ("clients", ClientConfig))
_TOP_LEVEL = ("seed", "profile", "num_clients", "max_sim_time_s")
JSON_FORMAT = "bidikv.simulate/1"

# Warn when the answer is about capacity rather than reuse (what the warnings suggest to change).
UTILISATION_WARN = 0.95
QUEUE_SHARE_WARN = 0.5  # queueing over this share of mean TTFT


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _metavar(name: str, default: Any) -> str:
    if name.endswith("_bytes_per_s"):
        return "BYTES_PER_S"
    if name.endswith("_per_s"):
        return "RATE"
    if name.endswith("_s") or name.endswith("_ttl"):
        return "SECONDS"
    if "tokens" in name or "threshold" in name:
        return "TOKENS"
    if isinstance(default, int):
        return "N"
    if isinstance(default, float):
        return "NUMBER"
    return "NAME" if name != "profile" else "NAME|PATH"


def number(kind: type) -> Callable[[str], Any]:
    """argparse type: an int or a float, never NaN (argparse names the flag when this raises)."""

    def parse(text: str) -> Any:
        if kind is int:
            return int(text)
        value = float(text)
        if math.isnan(value):
            raise ValueError(text)
        return value

    parse.__name__ = "integer" if kind is int else "number"  # argparse's message: "invalid integer value"
    return parse


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; defaults stay None so only given flags override the TOML file."""
    defaults = SimConfig()
    for name in _TOP_LEVEL:
        f = {f.name: f for f in dataclasses.fields(SimConfig)}[name]
        default = getattr(defaults, name)
        kw: dict[str, Any] = {"dest": f"cfg__{name}", "default": None, "metavar": _metavar(name, default),
                              "help": f"{f.metadata['help']} (default: {_shown(default)})"}
        kw["type"] = number(type(default)) if isinstance(default, (int, float)) else str
        parser.add_argument(_flag(name), **kw)
    for section, cls in _SECTIONS:
        group = parser.add_argument_group(section)
        instance = getattr(defaults, section)
        for f in dataclasses.fields(cls):
            default = getattr(instance, f.name)
            kw = {"dest": f"cfg__{section}__{f.name}", "default": None,
                  "help": f"{f.metadata['help']} (default: {_shown(default)})"}
            if isinstance(default, bool):
                kw["action"] = argparse.BooleanOptionalAction
            elif "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            else:
                kw["type"] = number(type(default)) if isinstance(default, (int, float)) else str
                kw["metavar"] = _metavar(f.name, default)
            group.add_argument(_flag(f.name), **kw)
    add_refused_flags(parser, catalogue.SIM)
    w = parser.add_argument_group("workload")
    kinds = "; ".join(f"{kind}: {WORKLOAD_HELP[kind]}" for kind in WORKLOAD_KINDS).replace("%", "%%")
    w.add_argument("--workload", dest="workload_kind", default=None, choices=WORKLOAD_KINDS,
                   help=f"workload generator or preset ({kinds}; default: {describe_spec(defaults.workload)})")
    w.add_argument("--trace", default=None, metavar="PATH",
                   help="a trace to replay: what `bidikv router --trace-out` wrote (a file or its directory: "
                        "--workload router_trace), or a Mooncake JSONL trace (--workload mooncake; download: "
                        "https://github.com/kvcache-ai/Mooncake/tree/main/FAST25-release/traces)")
    w.add_argument("--conversations", type=number(int), default=None, metavar="N",
                   help="number of conversations (synthetic/agentic; the other workload settings are kept)")
    add_vllm_flags(parser)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's multi-turn benchmark: its JSON config and its client flags, under vLLM's names (shared with
    ``bidikv bench``, so both describe the same run)."""
    from sim.clients.bench import VllmClientConfig

    group = parser.add_argument_group("vLLM multi-turn benchmark (benchmarks/multi_turn in vLLM)")
    group.add_argument("--vllm-multi-turn-config", default=None, metavar="JSON",
                       help="a vLLM multi-turn benchmark config (the generate_multi_turn.json format, "
                            "\"filetype\": \"generate_conversations\"), read as is: the same conversations as "
                            "`benchmark_serving_multi_turn.py --input-file JSON`, sent by its client loop (--num-clients, "
                            "--max-active-conversations, early stop); implies --workload vllm_multi_turn")
    from sim.workload.chat_template import DEFAULT_TEMPLATE, TEMPLATE_FAMILIES

    group.add_argument("--chat-template", dest="vllm_chat_template", default=None, metavar="FAMILY",
                       help="the tokens the server's chat template adds around the benchmark's messages: "
                            f"{', '.join(TEMPLATE_FAMILIES)}, or PER_MESSAGE,SYSTEM,GENERATION as three integers "
                            f"(default: {DEFAULT_TEMPLATE}; sim/workload/chat_template.py gives each family's "
                            "counts; needs --vllm-multi-turn-config)")
    defaults = VllmClientConfig()
    for f in dataclasses.fields(VllmClientConfig):
        default = getattr(defaults, f.name)
        kw: dict[str, Any] = {"dest": f"vllm__{f.name}", "default": None,
                              "help": f"{f.metadata['help']} (default: {default}; needs --vllm-multi-turn-config)"}
        if isinstance(default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"], kw["metavar"] = number(type(default)), "RATE" if f.name.endswith("rate") else "N"
        group.add_argument(_flag(f.name), **kw)


def _shown(default: Any) -> str:
    return "no limit" if isinstance(default, float) and math.isinf(default) else f"{default}"


def describe_spec(spec: dict) -> str:
    """The [workload] table in words (before generating it)."""
    kind = spec.get("kind", "synthetic")
    if kind == "mooncake":
        return f"Mooncake trace {spec.get('path', '?')} (its own arrival times)"
    if kind == "router_trace":
        return (f"router trace {spec.get('path', '?')} (its own arrival times; not in it, so assumed: no prefix "
                "shared between conversations, a miss continues faithfully; failed turns and turns without token "
                "counts left out)")
    if kind == "vllm_multi_turn":
        return f"vLLM multi-turn benchmark config {spec.get('path', '?')}"
    what = {"synthetic": "synthetic chat in vLLM's multi-turn benchmark shapes",
            "agentic": "agentic tool loops"}.get(kind, kind)
    n = spec.get("num_conversations")
    rate = spec.get("arrival_rate_per_s")
    start = (f"arriving as a Poisson stream at {rate:g}/s (one every {1 / rate:g} s on average)" if rate
             else "all starting at 0 s")
    return f"{what}, {n} conversations {start}" if n is not None else f"{what}, conversations {start}"


def describe_workload(config: SimConfig, conversations: Sequence[Any]) -> dict[str, Any]:
    """What was simulated, in words a reader can check against --help: counts and observed think time."""
    turns = sum(len(c.turns) for c in conversations)
    gaps: list[float] = []
    for c in conversations:
        previous = c.start_s
        for i, t in enumerate(c.turns):
            if i and t.arrival_s is not None:
                gaps.append(t.arrival_s - previous)
            elif i:
                gaps.append(t.gap_before_s)
            previous = t.arrival_s if t.arrival_s is not None else previous
    gaps.sort()
    text = f"{describe_spec(config.workload)}: {len(conversations):,} conversations, {turns:,} turns"
    if gaps and config.workload.get("kind") != "vllm_multi_turn":  # its client loop sends back to back
        text += (f"; time between turns p50 {percentile(gaps, 50):,.0f} s, p90 {percentile(gaps, 90):,.0f} s"
                 if config.workload.get("kind") in ("mooncake", "router_trace") else
                 f"; think time after a reply p50 {percentile(gaps, 50):,.0f} s, p90 {percentile(gaps, 90):,.0f} s")
    if config.workload.get("kind") == "vllm_multi_turn":
        clients = config.num_clients or 1
        active = config.workload.get("max_active_conversations") or clients
        stop = "stopping when the first client stops" if config.workload.get("early_stop", True) else "no early stop"
        text += (f"; vLLM's client loop: {clients} clients, {active // clients} active conversations each, "
                 f"round robin, {stop}")
    elif config.num_clients:
        text += f"; {config.num_clients} clients, each running one conversation at a time"
    return {"kind": config.workload.get("kind", "synthetic"), "description": text,
            "conversations": len(conversations), "turns": turns}


def overrides_from_args(args: argparse.Namespace) -> dict:
    out: dict[str, Any] = {}
    for key, value in vars(args).items():
        if not key.startswith("cfg__") or value is None:
            continue
        parts = key.split("__")[1:]
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def workload_from_args(base: dict, args: argparse.Namespace) -> dict:
    """The config's [workload] table with --trace, --workload and --conversations applied."""
    workload = dict(base)
    if getattr(args, "vllm_multi_turn_config", None):
        workload = {"kind": "vllm_multi_turn", "path": args.vllm_multi_turn_config}
    elif args.trace:
        from sim.workload.router_trace import is_router_trace

        kind = "router_trace" if is_router_trace(args.trace) else "mooncake"  # the router's own trace, or Mooncake's
        workload = {"kind": kind, "path": args.trace}
    elif args.workload_kind and args.workload_kind != workload.get("kind"):
        workload = {"kind": args.workload_kind}
    if args.conversations is not None:
        if workload.get("kind", "synthetic") in ("mooncake", "router_trace"):
            raise ValueError("--conversations does not apply to a trace (its conversations are fixed)")
        if workload.get("kind") == "vllm_multi_turn":
            raise ValueError("--conversations does not apply to a vLLM config (its num_conversations is in the file)")
        if args.conversations < 1:
            raise ValueError(f"--conversations must be >= 1, got {args.conversations}")
        workload["num_conversations"] = args.conversations
    template = getattr(args, "vllm_chat_template", None)
    if template is not None:
        if workload.get("kind") != "vllm_multi_turn":
            raise ValueError("--chat-template applies to vLLM's benchmark config: it needs --vllm-multi-turn-config "
                             "(or a [workload] with kind = \"vllm_multi_turn\")")
        workload["chat_template"] = template
    for key, value in vars(args).items():
        if key.startswith("vllm__") and value is not None:
            if workload.get("kind") != "vllm_multi_turn":
                raise ValueError(f"{_flag(key[len('vllm__'):])} is one of vLLM's benchmark client flags: it needs "
                                 "--vllm-multi-turn-config (or a [workload] with kind = \"vllm_multi_turn\")")
            workload[key[len("vllm__"):]] = value
    return workload


def config_from_args(args: argparse.Namespace) -> SimConfig:
    config = load_config(args.config, overrides_from_args(args))
    config.workload = workload_from_args(config.workload, args)
    return config


def register(subparsers: Any) -> None:
    default = describe_spec(SimConfig().workload)
    p = subparsers.add_parser(
        "simulate", help="simulate a multi-turn workload on a P/D cluster",
        description="Simulate router, prefill and decode nodes and the interconnect, with decisions from impl.policy, "
                    f"and print TTFT by prompt length, first turns apart from later turns. Default workload: {default}, "
                    "on 1 prefill + 1 decode instance (1P1D) of the qwen3-32b@p5en-tp8 profile.")
    p.add_argument("--config", default=None, metavar="TOML", help="TOML config file (flags override it)")
    add_config_flags(p)
    p.add_argument("--compare", action="store_true", help="run bidirectional ON and OFF and print both")
    p.add_argument("--json", action="store_true", help=f"print a JSON object on stdout ({JSON_FORMAT}; strict JSON, "
                                                        "null for no value or no limit)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="directory for records.csv, series.csv, summary.json and config.json (one per mode with --compare)")
    p.add_argument("--parquet", action="store_true", help="also write records.parquet (needs pyarrow)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar with an estimate of the time left (default: on when stderr is a terminal)")
    p.set_defaults(run=run)


def load_conversations(config: SimConfig) -> list[Any]:
    """The workload, refused before the run starts when it is empty or would not fit in memory."""
    from sim.workload import load_workload

    conversations = load_workload(config.workload, config.seed)
    if not conversations:
        raise ValueError(f"workload {describe_spec(config.workload)} has no conversations (empty trace?)")
    turns = sum(len(c.turns) for c in conversations)
    need = turns * RECORD_BYTES
    have = available_memory_bytes()
    if have is not None and need > have:
        raise ValueError(f"{turns:,} turns need about {need / 1e9:,.1f} GB for their records, more than the "
                         f"{have / 1e9:,.1f} GB available: simulate fewer conversations or a shorter trace")
    return conversations


# Python heap per simulated turn at the peak of a run (workload, records, series, summary), measured
# with tracemalloc on the default workload: 1.1 kB; rounded up for --compare and what tracemalloc misses.
RECORD_BYTES = 2500


def available_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not every platform reports it
        return None


def run(args: argparse.Namespace) -> int:
    from sim.engine.runner import run_config  # heavy imports only when simulating

    config = config_from_args(args)
    if args.parquet:
        parquet_modules()  # missing pyarrow fails here, not after minutes of simulation
        if not args.out:
            raise ValueError("--parquet writes records.parquet into --out: give --out DIR")
    if args.out:
        prepare_dir(args.out, "--out")
    conversations = load_conversations(config)
    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    modes = (True, False) if args.compare else (config.policy.bidirectional,)
    results = {}
    for bidirectional in modes:
        cfg = dataclasses.replace(config, policy=dataclasses.replace(config.policy, bidirectional=bidirectional))
        results["on" if bidirectional else "off"] = run_config(cfg, progress=show_progress, conversations=conversations)
    workload = describe_workload(config, conversations)
    warnings = capacity_warnings(results, config)
    if args.out:
        for mode, result in results.items():
            write_outputs(pathlib.Path(args.out) / mode if len(results) > 1 else pathlib.Path(args.out), result,
                          args.parquet)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.json:
        payload = {"format": JSON_FORMAT, "workload": workload,
                   "runs": {mode: json_summary(r) for mode, r in results.items()}, "warnings": warnings}
        print(dumps(payload))
    else:
        print(format_comparison(results, workload, config))
    return 0


def prepare_dir(path: str, flag: str) -> pathlib.Path:
    """Create an output directory up front, so a typo fails before minutes of simulation, naming the flag."""
    out = pathlib.Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"{flag} {path}: exists and is not a directory") from None
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot create the directory: {exc.strerror}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: the directory is not writable")
    return out


def strict(value: Any) -> Any:
    """``value`` with every NaN and infinity replaced by None (see the module docstring)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(value: Any) -> str:
    # sort_keys would put "16-32k" before "2-4k"; buckets are a list, so plain key order is stable
    return json.dumps(strict(value), indent=2, allow_nan=False)


def bucket_rows(records: Sequence[Any]) -> list[dict[str, Any]]:
    """Per prompt-length bucket, in increasing length: counts, TTFT of first and of later turns, queueing.
    One pass over the records' values (fields_of: no record built from a run's table); each bucket's
    values in record order, as a pass over the completed turns per bucket had them."""
    edges = list(PROMPT_BUCKETS) + [None]
    groups: dict[int, tuple[list[float], list[float], list[Any]]] = {}  # bucket -> first, later, [turns, queue]
    for rejected, prompt_tokens, turn, ttft_s, p_queue_s, d_queue_s in fields_of(
            records, "rejected", "prompt_tokens", "turn", "ttft_s", "p_queue_s", "d_queue_s"):
        if rejected or prompt_tokens < 0:  # below the first edge: in no bucket
            continue
        i = bisect.bisect_right(PROMPT_BUCKETS, prompt_tokens) - 1
        group = groups.get(i)
        if group is None:
            group = groups[i] = ([], [], [0, 0])  # the queue sum starts from the int 0, as sum() did
        if turn == 0:
            group[0].append(ttft_s)
        elif turn > 0:
            group[1].append(ttft_s)
        group[2][0] += 1
        group[2][1] += p_queue_s + d_queue_s
    rows = []
    for i in sorted(groups):
        first, later, (turns, queue) = groups[i]
        lo, hi = edges[i], edges[i + 1]
        rows.append({"bucket": bucket_label(lo), "min_tokens": lo, "max_tokens": hi, "turns": turns,
                     "first_turns": distribution(first), "later_turns": distribution(later),
                     "queue_mean_ms": queue / turns * 1e3})
    return rows


def json_summary(result: Any) -> dict[str, Any]:
    summary = {k: v for k, v in result.summary.items() if k != "ttft_by_prompt_bucket"}
    summary["prompt_buckets"] = bucket_rows(result.records)
    return summary


TARGET_UTILISATION = 0.7  # what the suggested prefill count aims for: headroom for bursts


def prefill_needed(summary: dict, records: Sequence[Any], num_prefill: int) -> int:
    """Prefill instances that would carry the offered load at TARGET_UTILISATION: P's total busy time
    (all of it is done by the end, however long the queue) over the span in which turns arrived."""
    busy = sum(summary.get("prefill_utilisation", {}).values()) * summary.get("sim_time_s", 0.0)
    arrivals = [t for (t,) in fields_of(records, "arrival_s") if not math.isnan(t)]
    span = max(arrivals, default=0.0) - min(arrivals, default=0.0)
    if span <= 0 or busy <= 0:
        return num_prefill + 1
    return max(num_prefill + 1, math.ceil(busy / span / TARGET_UTILISATION))


def capacity_warnings(results: dict, config: SimConfig) -> list[str]:
    """Say when TTFT is about capacity (a saturated P, queueing), not about KV reuse."""
    out = []
    for mode, r in results.items():
        s = r.summary
        # completed turns, queueing and TTFT summed per group in record order (sum() from the int 0 over
        # each group's turns), read from the table's columns: no record built, no list of them kept
        groups = {"all turns": [0, 0, 0], "first turns": [0, 0, 0], "later turns": [0, 0, 0]}
        everyone, first, later = groups.values()
        for rejected, turn, p_queue, d_queue, ttft in fields_of(r.records, "rejected", "turn", "p_queue_s",
                                                                "d_queue_s", "ttft_s"):
            if rejected:
                continue
            queued = p_queue + d_queue
            for group in (everyone, first) if turn == 0 else (everyone, later) if turn > 0 else (everyone,):
                group[0] += 1
                group[1] += queued
                group[2] += ttft
        more = prefill_needed(s, r.records, config.topology.num_prefill)
        busy = {name: u for name, u in s.get("prefill_utilisation", {}).items() if u >= UTILISATION_WARN}
        if busy:
            names = ", ".join(f"{n} {u:.0%}" for n, u in sorted(busy.items()))
            out.append(f"[{mode}] prefill utilisation {names}: TTFT here measures a saturated cluster, not KV reuse; "
                       f"add prefill instances (--num-prefill {more} keeps them about {TARGET_UTILISATION:.0%} busy) "
                       "or lower the load")
        # first turns apart: a burst of new conversations can queue while the later turns look fine
        for which, (count, queued, ttft_sum) in groups.items():
            if not count:
                continue
            queue = queued / count
            ttft = ttft_sum / count
            if ttft > 0 and queue / ttft > QUEUE_SHARE_WARN:
                out.append(f"[{mode}] {which}: queueing is {queue / ttft:.0%} of mean TTFT ({queue * 1e3:,.0f} of "
                           f"{ttft * 1e3:,.0f} ms), so TTFT here is mostly waiting, not prefill or reuse; add "
                           f"prefill instances (--num-prefill {more} or more) or lower the arrival rate")
                break
        if s.get("d_waits_behind_retained"):
            wait = s["d_wait"]
            fix = ("a shorter --decoder-kv-blocks-ttl, or --retained-under-pressure give_back (D gives retained KV back "
                   "under pressure)" if config.policy.retained_under_pressure == "pinned" else
                   "a larger --give-back-headroom (memory given back before it is needed) or a shorter "
                   "--give-back-publish-window-s" if config.policy.retained_under_pressure == "give_back" else
                   "more decode memory")
            out.append(f"[{mode}] D's memory binds: {s['d_waits_behind_retained']:,} waits for blocks that retained turns "
                       f"held (turns waited up to {_num(wait['p99_ms'] / 1e3, ',.1f')} s at p99, "
                       f"{_num(wait['total_s'], ',.0f')} s in all); try {fix}")
        if s.get("rejected"):
            out.append(f"[{mode}] {s['rejected']:,} turns did not complete (see records.csv 'rejected' with --out)")
    return out


def _num(value: float | None, fmt: str = ",.0f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def format_comparison(results: dict, workload: dict | None = None, config: SimConfig | None = None) -> str:
    """TTFT p50/p90 by prompt-length bucket, later turns (where reuse happens) apart from first turns,
    with turn counts and queueing per bucket, then each mode's headline numbers."""
    modes = list(results)
    rows = {m: {b["bucket"]: b for b in bucket_rows(results[m].records)} for m in modes}
    buckets = [b["bucket"] for b in bucket_rows(results[modes[0]].records)]
    for m in modes[1:]:
        buckets += [b for b in rows[m] if b not in buckets]
    lines = []
    if workload:
        lines.append(f"workload: {workload['description']}")
    if config:
        lines.append(f"cluster:  {config.topology.num_prefill}P{config.topology.num_decode}D, profile {config.profile}")
    lines += ["", "TTFT (ms) by prompt length; later turns are where D's KV can be reused, a first turn has none; "
                  "queue = mean wait for P and D"]
    cols = [("turns", 6), ("first", 6)]
    head = f"{'prompt':>7}" + "".join(f"{c:>{w}}" for c, w in cols)
    for m in modes:
        head += f"{'later p50 ' + m:>15}{'p90':>7}"
    if len(modes) == 2:
        head += f"{'speed-up':>9}"
    for m in modes:
        head += f"{'first p50 ' + m:>15}"
    for m in modes:
        head += f"{'queue ' + m:>10}"
    lines.append(head)
    for b in buckets:
        cells = [rows[m].get(b) for m in modes]
        any_cell = next(c for c in cells if c)
        row = f"{b:>7}{any_cell['turns']:>6}{any_cell['first_turns']['n']:>6}"
        for c in cells:
            row += (f"{_num(c['later_turns']['p50_ms']):>15}{_num(c['later_turns']['p90_ms']):>7}" if c
                    else f"{'-':>15}{'-':>7}")
        if len(modes) == 2:
            a, o = (c["later_turns"]["p50_ms"] if c else math.nan for c in cells)
            ratio = o / a if a and not math.isnan(a) and not math.isnan(o) else math.nan
            row += f"{'-' if math.isnan(ratio) else format(ratio, '.2f') + 'x':>9}"
        for c in cells:
            row += f"{_num(c['first_turns']['p50_ms']) if c else '-':>15}"
        for c in cells:
            row += f"{_num(c['queue_mean_ms']) if c else '-':>10}"
        lines.append(row)
    lines.append("")
    for m in modes:
        s = results[m].summary
        util = ", ".join(f"{n} {u:.0%}" for n, u in sorted(s.get("prefill_utilisation", {}).items()))
        hit = "-" if s["reuse_hit_rate"] is None or math.isnan(s["reuse_hit_rate"]) else f"{s['reuse_hit_rate']:.0%}"
        lines.append(
            f"[{m}] turns {s['completed']:,}/{s['turns']:,}  TTFT p50 {_num(s['ttft']['p50_ms'])} ms p90 "
            f"{_num(s['ttft']['p90_ms'])} ms  later turns reusing D's KV {hit}  recomputed tokens "
            f"{s['tokens_recomputed']:,}  retained {_num(s['retained_hbm_gb_s'])} GB*s (peak "
            f"{_num(s['peak_retained_hbm_gb'], ',.1f')} GB)  P utilisation {util or '-'}  preemptions {s['preemptions']}")
        memory = decode_memory_line(s)
        if memory:
            lines.append(f"[{m}] {memory}")
        if s.get("tokens_offered"):  # P pulls only the prefix it verified equal to its prompt's token ids
            lines.append(f"[{m}] D's tokens offered {s['tokens_offered']:,}  verified {s['tokens_verified']:,}  "
                         f"pulled {s['tokens_pulled']:,}")
    return "\n".join(lines)


def decode_memory_line(s: dict) -> str:
    """What D's memory cost: turns that waited for blocks, preemptions, what was given back ('' if nothing)."""
    parts = []
    wait = s.get("d_wait") or {}
    if wait.get("n"):
        parts.append(f"{wait['n']:,} turns waited at D for blocks (p50 {_num(wait['p50_ms'] / 1e3, ',.1f')} s, p90 "
                     f"{_num(wait['p90_ms'] / 1e3, ',.1f')} s, p99 {_num(wait['p99_ms'] / 1e3, ',.1f')} s), "
                     f"{s['d_waits_behind_retained']:,} of {s['d_waits']:,} waits behind retained blocks")
    if s.get("preemptions"):
        parts.append(f"{s['preemptions']:,} preemptions ({s['preemptions_behind_retained']:,} while retained blocks "
                     "held part of the pool)")
    if s.get("given_back"):
        parts.append(f"given back {s['given_back']:,} retained turns ({s['given_back_blocks']:,} blocks) in "
                     f"{_num(s['give_back_mean_s'], ',.1f')} s on average")
    if s.get("declined_freed"):
        parts.append(f"{s['declined_freed']:,} retained turns freed when P declined them")
    return ("D memory: " + "; ".join(parts)) if parts else ""


def write_outputs(out: pathlib.Path, result: Any, parquet: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "records.csv", "w", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(RECORD_FIELDS + ["prefill_s"])
        for rec in result.records:
            writer.writerow([_cell(getattr(rec, f)) for f in RECORD_FIELDS] + [_cell(rec.prefill_s)])
    with open(out / "series.csv", "w", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(["t_s", "node", "running_blocks", "retained_blocks", "cached_blocks", "capacity_blocks"])
        writer.writerows((_cell(t), *rest) for t, *rest in result.series)
    (out / "summary.json").write_text(dumps(json_summary(result)) + "\n")
    (out / "config.json").write_text(json.dumps(strict(dataclasses.asdict(result.config)), indent=2, sort_keys=True,
                                                default=str, allow_nan=False) + "\n")
    if parquet:
        pa, pq = parquet_modules()
        cols = {f: [v for (v,) in fields_of(result.records, f)] for f in RECORD_FIELDS}
        pq.write_table(pa.table(cols), out / "records.parquet")


def parquet_modules() -> tuple[Any, Any]:
    """pyarrow and pyarrow.parquet, or a clear error naming the flag and the install."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("--parquet needs pyarrow (pip install 'bidikv[parquet]' or pip install pyarrow)") from None
    return pa, pq


def _cell(value: Any) -> Any:
    # repr() of a float is the shortest round-trip form: byte-identical across runs and platforms
    return repr(value) if isinstance(value, float) else value
