"""``bidikv validate``: flags and output only (argparse at import; the work is in sim.replay.validate)."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from typing import Any


def register(subparsers: Any) -> None:
    from calibration.cli import add_bench_fit_flags

    p = subparsers.add_parser(
        "validate", help="replay recorded bench runs through the simulator and compare turn by turn",
        description="Fit a profile from bench runs (--fit, default: the replayed runs themselves) or take one "
                    "(--profile), replay each --bench run's conversations at their recorded times through the "
                    "simulator with the deployment's threshold and TTL, and compare per turn: the reuse decision "
                    "and pulled tokens (expected exact), TTFT and TPOT |error| by prompt bucket and turn index. "
                    "A run's deployment settings come from <run>.deployment.json beside it, or --deployment.")
    p.add_argument("--bench", action="append", required=True, metavar="JSONL",
                   help="a bench run to replay (repeatable: each is its own deployment), or a router trace "
                        "(`bidikv router --trace-out`: a file or its directory)")
    p.add_argument("--fit", action="append", default=None, metavar="JSONL",
                   help="bench runs to fit the profile on (repeatable; default: the --bench runs, i.e. in sample; "
                        "pass other runs for a held-out check)")
    p.add_argument("--profile", default=None, help="use this profile (name or JSON) instead of fitting one")
    p.add_argument("--base-profile", default="qwen3-32b@p5en-tp8",
                   help="with a fit: the profile whose unmeasurable terms are kept (default: %(default)s)")
    p.add_argument("--threshold", type=int, default=None, help="override every run's kv_recompute_threshold")
    p.add_argument("--ttl", type=float, default=None, help="override every run's decoder_kv_blocks_ttl (s)")
    p.add_argument("--bucket-tokens", type=int, default=512, help="prompt bucket width for the tables (default: %(default)s)")
    p.add_argument("--timing", choices=("think", "absolute", "pool"), default="think",
                   help="think: each conversation from its recorded start, each later turn after the simulated "
                        "previous one by the think time the client slept (what the bench client does; D's TTL runs "
                        "from its finish); absolute: every turn at its recorded start; pool: as think, but each "
                        "conversation when a client of the bench's pool is free (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON (fit report, per-run summaries and turns)")
    p.add_argument("--output-profile", metavar="JSON", help="write the fitted profile here")
    add_bench_fit_flags(p)
    p.set_defaults(run=run)


def read_run(path: str) -> list[Any]:
    """A bench run's records, or a router trace's turns as bench records (the router saw the same things:
    arrival, lengths, what it offered, P's cached tokens, TTFT and finish)."""
    from calibration.bench_records import read_jsonl
    from sim.workload.router_trace import is_router_trace

    if not is_router_trace(path):
        return read_jsonl(path)
    from calibration.bench_records import BenchRecord
    from sim.workload.router_trace import read_turns

    turns = read_turns(path)
    t0 = turns[0].t if turns else 0.0
    records = []
    for t in turns:
        if t.prompt_tokens is None or t.output_tokens is None:
            continue  # nothing to replay (no usage from vLLM)
        error = "" if t.status == 200 and t.ttft_s is not None else f"HTTP {t.status}"
        records.append(BenchRecord(conversation=t.conversation, turn=t.turn, mode="on", prompt_tokens=t.prompt_tokens,
                                   output_tokens=t.output_tokens, start_s=t.t - t0,
                                   ttft_s=t.ttft_s if t.ttft_s is not None else math.nan,
                                   total_s=t.finish_s if t.finish_s is not None else math.nan,
                                   reuse_offered_tokens=t.offered, prefill_cached_tokens=t.cached_tokens,
                                   prefill_instance=t.prefill or "", decode_instance=t.decode or "", error=error))
    return records


def ranking(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The runs ordered by mean TTFT, as measured and as simulated: does the simulator rank them as reality does?"""
    def order(which: str) -> list[str]:
        return [pathlib.Path(p).name for p in sorted(summaries, key=lambda p: summaries[p]["mean_ttft_ms"][which])]

    real, sim = order("real"), order("sim")
    return {"real": real, "sim": sim, "same": real == sim}


def _finite(value: Any) -> Any:
    """NaN (no TPOT: a one-token turn, or one whose tokens all came in the first read; an empty bucket) as
    null: NaN is not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _settings(args: argparse.Namespace, path: str) -> Any:
    from calibration.cli import bench_settings

    return bench_settings(args, path).replace(kv_recompute_threshold=args.threshold, decoder_kv_blocks_ttl=args.ttl)


def run(args: argparse.Namespace) -> int:
    from calibration.cli import fit_summary
    from calibration.from_bench import fit_from_runs
    from calibration.profile import LatencyProfile
    from sim.replay.validate import format_summary, validate_run
    if args.bucket_tokens < 1:
        raise ValueError("--bucket-tokens must be >= 1")
    out: dict[str, Any] = {}
    text: list[str] = []
    if args.profile:
        profile = LatencyProfile.load(args.profile)
        text.append(f"profile {profile.name} (given)")
    else:
        fit_paths = args.fit or args.bench
        geometry = {(s.block_size, s.kv_bytes_per_token) for s in (_settings(args, f) for f in fit_paths)}
        if len(geometry) != 1:
            raise ValueError(f"the fitted runs disagree on block size / KV bytes per token: {sorted(geometry)}")
        profile, report = fit_from_runs([read_run(f) for f in fit_paths], LatencyProfile.load(args.base_profile),
                                        name="bench-fit", settings=_settings(args, fit_paths[0]),
                                        max_transfer_bytes_per_s=args.max_transfer_bytes_per_s,
                                        busy_window_s=args.busy_window_s, loss=args.loss)
        out["fit"] = {"runs": fit_paths, "report": report}
        text.append(fit_summary(report, ", ".join(fit_paths), args.base_profile, profile))
        held_out = sorted(set(args.bench) - set(fit_paths))
        text.append("held out (not fitted on): " + (", ".join(held_out) if held_out else "none: in-sample"))
        if args.output_profile:
            pathlib.Path(args.output_profile).write_text(profile.to_json())
            print(f"wrote {args.output_profile}", file=sys.stderr)
    out["runs"] = {}
    for path in args.bench:
        settings = _settings(args, path)
        summary, comparisons = validate_run(read_run(path), profile, settings, args.bucket_tokens, args.timing)
        summary["held_out"] = not args.profile and path not in (args.fit or args.bench)
        summary["settings"] = {"kv_recompute_threshold": settings.kv_recompute_threshold,
                               "decoder_kv_blocks_ttl": settings.decoder_kv_blocks_ttl, "block_size": profile.block_size}
        out["runs"][path] = {"summary": summary, "turns": [
            {**{k: getattr(c, k) for k in c.__slots__}, "ttft_error": c.ttft_error(), "tpot_error": c.tpot_error()}
            for c in comparisons]}
        text.append(format_summary(f"{path} ({'held out' if summary['held_out'] else 'in sample'}; threshold "
                                   f"{settings.kv_recompute_threshold}, TTL {settings.decoder_kv_blocks_ttl:g} s)", summary))
    if len(args.bench) > 1:
        out["ranking"] = ranking({p: r["summary"] for p, r in out["runs"].items()})
        text.append(f"ranking by mean TTFT (fastest first): real {' < '.join(out['ranking']['real'])}; "
                    f"simulated {' < '.join(out['ranking']['sim'])}: "
                    + ("the same" if out["ranking"]["same"] else "DIFFERENT"))
    if args.json:
        print(json.dumps(_finite(out), indent=2, sort_keys=True, allow_nan=False))
    else:
        print("\n\n".join(text))
    return 0 if all(math.isfinite(r["summary"]["overall"]["ttft"]["median_abs_pct"]) or r["summary"]["turns"] == 0
                    for r in out["runs"].values()) else 1
