"""``bidikv calibrate`` and ``bidikv profile``: argparse only, no I/O at import.

``register(subparsers, load_simulator)`` adds both subcommands to the caller's ``argparse`` subparsers;
each sets ``run`` to a handler taking the parsed namespace and returning an exit code.
``load_simulator`` returns the simulator (:class:`Simulator`) when a command runs: calibration is a
layer below the simulator and never imports it, so the caller passes it in. ``bidikv`` registers
these commands through ``sim.commands.calibrate``, which does. ``main(argv)`` runs them standalone
without it (``python -m calibration.cli calibrate``: the closed form, and its source line says so).

* ``calibrate`` loads the shipped profiles (or refits them with ``--refit``, in memory) and prints per
  model and figure: measured, simulated, relative error; the simulated column comes from the simulator
  when one is passed in and loads, otherwise from the closed form, and the output says which.
  ``--json``: a list of records (model, prompt_tokens, metric, mode, measured_ms, simulated_ms,
  rel_error, source). ``--plots DIR``: TTFT vs prompt length ON/OFF and the prefill split, per model,
  PNG. ``--leave-one-model-out`` (alias ``--leave-one-out``): calibration.loo's report (it needs the
  simulator).
* ``profile`` builds a profile for a model nobody measured from its ``config.json``, the hardware and
  the efficiencies of the measured model of its kernel family, and prints it (JSON) with its physical
  floors and calibration.trust's account of what to trust and how to replace the rest (the expected
  error in it needs the simulator).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import json
import sys
from typing import Any, Callable, Mapping, Sequence

TOLERANCE = 0.03


@dataclasses.dataclass(frozen=True)
class Simulator:
    """The simulator's two runs the calibration commands compare with, passed in from above
    (sim.commands.calibrate passes sim.replay.published's)."""
    published_point: Callable[..., Mapping[str, float]]  # calibration.report.SimulatedPoint
    heldout_benchmark: Callable[..., Mapping[str, float]]  # calibration.heldout.SimulatedBenchmark


SimulatorLoader = Callable[[], Simulator]  # called when a command runs, so registering loads nothing
NOT_PASSED_IN = "no simulator passed in (calibration does not import it; bidikv calibrate compares with the simulator)"


def _simulator(args: argparse.Namespace) -> tuple[Simulator | None, str]:
    """The simulator the command was registered with, or None and why."""
    load: SimulatorLoader | None = getattr(args, "load_simulator", None)
    if load is None:
        return None, NOT_PASSED_IN
    try:
        return load(), ""
    except Exception as exc:  # noqa: BLE001 - any failure to load means "not importable"
        return None, f"the simulator is not importable: {type(exc).__name__}: {exc}"


def register(subparsers: Any, load_simulator: SimulatorLoader | None = None) -> None:
    cal = subparsers.add_parser(
        "calibrate", help="published figures vs the profiles (simulated when the simulator is importable)",
        description="Print, per measured model and published figure: measured, simulated and relative error.")
    cal.add_argument("--json", action="store_true", help="print a JSON list of records instead of a table")
    cal.add_argument("--plots", metavar="DIR", help="write TTFT-vs-prompt and prefill-split PNGs per model to DIR")
    cal.add_argument("--refit", action="store_true",
                     help="fit the profiles from the published figures (in memory) instead of loading the shipped ones")
    cal.add_argument("--source", choices=("auto", "sim", "closed-form"), default="auto",
                     help="where the simulated column comes from (auto: the simulator if importable)")
    cal.add_argument("--seed", type=int, default=0, help="simulator seed")
    cal.add_argument("--leave-one-model-out", "--leave-one-out", dest="leave_one_out", action="store_true",
                     help="instead: fit on one measured model, predict the other's published figures from its "
                          "config.json (closed form), and Llama-3.3-70B's vLLM PR #32553 means, which no fit saw "
                          "(simulator); per point and median/max |error|")
    cal.add_argument("--from-bench", metavar="FILE",
                     help="instead: fit a profile from a `bidikv bench` JSONL of your own cluster")
    cal.add_argument("--base-profile", default="qwen3-32b@p5en-tp8",
                     help="with --from-bench: the profile whose unmeasurable terms are kept (default: %(default)s)")
    cal.add_argument("--output", "-o", metavar="PROFILE_JSON", help="with --from-bench: write the fitted profile here")
    add_bench_fit_flags(cal)
    cal.set_defaults(run=run_calibrate, load_simulator=load_simulator)
    from calibration.hardware import preset_choices

    prof = subparsers.add_parser(
        "profile", help="a latency profile for an unmeasured model from its config.json",
        description="Build a latency profile from an HF-style config.json and the hardware (exact physics), the "
                    "engine terms fitted on both measured models and the prefill terms of the measured model of "
                    "the same kernel family; prints the profile JSON on stdout and, on stderr, the physical "
                    "floors, what to trust, the expected error (leave one model out) and the bench commands "
                    "that replace the rest.")
    prof.add_argument("--model-config", required=True, metavar="CONFIG_JSON",
                      help="the model's Hugging Face config.json (layers, heads, KV heads, head size)")
    prof.add_argument("--hardware", default="p5en", metavar="NAME|PATH",
                      help=f"hardware preset: {preset_choices()} (calibration/data/hardware_<name>.json, every "
                           "value with its source), its instance type (p6-b200.48xlarge) or a JSON path; off p5en "
                           "the fitted terms are p5en's, carried over (default: %(default)s)")
    prof.add_argument("--tp", type=int, required=True, help="tensor-parallel ranks per instance")
    prof.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bf16", "fp8"),
                      help="KV cache element type (auto: the model's dtype) (default: %(default)s)")
    prof.add_argument("--block-size", type=int, help="KV block tokens (default: 16 GQA, 64 MLA)")
    prof.add_argument("--efficiencies", help="efficiencies JSON or shipped hardware name (default: carried from the "
                                             "measured models, calibration.portable)")
    prof.add_argument("--name", help="model name in the profile (default: the config file's stem)")
    prof.add_argument("--output", "-o", help="write the profile JSON here instead of stdout")
    prof.set_defaults(run=run_profile, load_simulator=load_simulator)


# --- calibrate -----------------------------------------------------------------------------------

def add_bench_fit_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of a fit from bench records (calibrate --from-bench, validate); defaults from their modules."""
    from calibration.bench_settings import DeploymentSettings
    from calibration.busy import DEFAULT_BUSY_WINDOW_S
    from calibration.from_bench import DEFAULT_LOSS, DEFAULT_MAX_TRANSFER_BYTES_PER_S, LOSSES

    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(DeploymentSettings)}
    parser.add_argument("--deployment", metavar="JSON",
                        help="the deployment's settings (default: <bench>.deployment.json beside the JSONL, if any)")
    parser.add_argument("--block-size", type=int, default=None, help=helps["block_size"])
    parser.add_argument("--kv-bytes-per-token", type=float, default=None, help=helps["kv_bytes_per_token"])
    parser.add_argument("--max-transfer-bytes-per-s", type=float, default=DEFAULT_MAX_TRANSFER_BYTES_PER_S,
                        help="bound on the fitted wire rate when the pulled turns cannot resolve a per-token cost "
                             "(default: %(default)g, above any NIC or memory copy a bench resolves)")
    parser.add_argument("--busy-window-s", type=float, default=DEFAULT_BUSY_WINDOW_S,
                        help="a turn starting this soon after another one decoded counts as busy (P and D share "
                             "cores on the CPU rehearsal); 0 fits no busy term (default: %(default)s)")
    parser.add_argument("--loss", choices=LOSSES, default=DEFAULT_LOSS,
                        help="fit loss on the relative error: soft_l1 (robust: a few turns slowed by other load do "
                             "not set the terms) or linear (least squares) (default: %(default)s)")


def bench_settings(args: argparse.Namespace, bench_path: str) -> Any:
    from calibration.bench_settings import DeploymentSettings, settings_for

    overrides = {"block_size": args.block_size, "kv_bytes_per_token": args.kv_bytes_per_token}
    if args.deployment:
        return DeploymentSettings.load(args.deployment).replace(**overrides)
    return settings_for(bench_path, **overrides)


def _profiles(refit: bool) -> dict[str, Any]:
    from calibration.profile import LatencyProfile
    from calibration.published import MEASURED

    if refit:
        from calibration.fit import run

        return dict(run(write=False)["profiles"])
    return {d.model: LatencyProfile.load(d.profile_name) for d in MEASURED}


def run_from_bench(args: argparse.Namespace) -> int:
    from calibration.from_bench import fit_from_bench
    from calibration.profile import LatencyProfile
    from calibration.bench_records import read_jsonl

    settings = bench_settings(args, args.from_bench)
    profile, report = fit_from_bench(read_jsonl(args.from_bench), LatencyProfile.load(args.base_profile),
                                     settings=settings, max_transfer_bytes_per_s=args.max_transfer_bytes_per_s,
                                     busy_window_s=args.busy_window_s, loss=args.loss)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(fit_summary(report, args.from_bench, args.base_profile, profile))
    if args.output:
        pathlib.Path(args.output).write_text(profile.to_json())
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def fit_summary(report: dict[str, Any], source: str, base_name: str, profile: Any) -> str:
    """The human-readable account of a bench fit, one line each."""
    lines = [f"fitted from {report['turns']} turns ({report['turns_with_pull']} with a pull, "
             f"{report['turns_busy']} busy) of {source}"]
    for term, value in report["terms"].items():
        lines.append(f"  {term:24} " + ("not identifiable from these turns" if value is None else f"{value:.6g} s"))
    lines.append(f"  {'busy factor':24} {report['busy_factor']:.3f} (a busy turn's compute x {1 + report['busy_factor']:.2f}; "
                 f"window {report['busy_window_s']:g} s; a rig property: bidikv validate replays it, simulate does not)")
    lines.append(f"  TTFT fit: median |error| {report['rel_error_p50']:.1%}, max {report['rel_error_max']:.1%}")
    decode = report.get("decode")
    if decode:
        for term, value in decode["terms"].items():
            lines.append(f"  {term:24} " + ("not identifiable from these turns" if value is None else f"{value:.6g} s"))
        lines.append(f"  TPOT fit ({decode['turns']} turns, batch {decode['batch_range'][0]:.2f}-{decode['batch_range'][1]:.2f}): "
                     f"median |error| {decode['rel_error_p50']:.1%}, max {decode['rel_error_max']:.1%}")
    lines.append(f"  block_size {profile.block_size}, kv_bytes_per_token {profile.kv_bytes_per_token:g}, "
                 f"transfer_bytes_per_s {profile.transfer_bytes_per_s:.4g}"
                 + (" (bounded)" if report.get("transfer_bytes_per_s_bounded") else ""))
    lines.append(f"  kept from {base_name}: {', '.join(report['kept_from_base'])}")
    if "note" in report:
        lines.append(f"  note: {report['note']}")
    return "\n".join(lines)


def run_calibrate(args: argparse.Namespace) -> int:
    if args.from_bench:
        return run_from_bench(args)
    from calibration.published import load_published
    from calibration.report import CLOSED_FORM, records, resolve_source, write_plots

    simulator, missing = _simulator(args) if args.source != CLOSED_FORM or args.leave_one_out else (None, "")
    try:
        source = resolve_source(args.source, seed=args.seed,
                                simulator=simulator.published_point if simulator else None, missing=missing)
    except ValueError as exc:
        print(f"bidikv calibrate: error: {exc}", file=sys.stderr)
        return 2
    if args.leave_one_out:
        if simulator is None:
            print(f"bidikv calibrate: error: --leave-one-model-out runs the simulator; {missing}", file=sys.stderr)
            return 2
        return _print_leave_one_out(args.json, simulator)
    figures = load_published()
    profiles = _profiles(args.refit)
    try:
        recs = records(profiles, figures, source)
        plots = write_plots(profiles, figures, source, args.plots) if args.plots else []
    except Exception as exc:  # noqa: BLE001 - the simulator failing is reported, never papered over
        if source.kind == CLOSED_FORM:
            raise
        print(f"bidikv calibrate: error: the simulator failed: {type(exc).__name__}: {exc} "
              "(--source closed-form gives the closed form instead)", file=sys.stderr)
        return 1
    print(f"source: {source.description}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(recs, indent=2))
    else:
        _print_table(recs, profiles, refit=args.refit)
    for path in plots:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _print_table(recs: list[dict[str, Any]], profiles: dict[str, Any], refit: bool) -> None:
    print(f"profiles: {'refitted from the published figures' if refit else 'shipped (calibration/profiles/)'}")
    for model, profile in profiles.items():
        print(f"\n{model}  [{profile.name}]")
        print(f"  {'prompt':>7} {'mode':4} {'metric':8} {'measured':>10} {'simulated':>10} {'error':>8}")
        for r in (r for r in recs if r["model"] == model):
            flag = "" if abs(r["rel_error"]) <= TOLERANCE else "  > 3 %"
            print(f"  {r['prompt_tokens']:7d} {r['mode']:4} {r['metric']:8} {r['measured_ms']:8.1f}ms "
                  f"{r['simulated_ms']:8.1f}ms {100 * r['rel_error']:+7.2f}%{flag}")
        floors = profile.provenance.get("floors", [])
        if floors:
            print("  physical floors (prefill at peak FLOP/s, transfer at EFA line rate):")
            for f in floors:
                measured = (f"measured {f['measured_ms']:.0f} ms = {f['measured_over_floor']:.1f}x floor, "
                            if "measured_ms" in f else "")
                print(f"    {f['description']:38} floor {f['floor_ms']:7.1f} ms; {measured}"
                      f"profile {f['profile_ms']:.0f} ms = {f['profile_over_floor']:.1f}x")
    within = sum(abs(r["rel_error"]) <= TOLERANCE for r in recs)
    print(f"\n{within} of {len(recs)} figures within 3 %")


def _print_leave_one_out(as_json: bool, simulator: Simulator) -> int:
    from calibration.loo import format_text, report

    try:
        rep = report(simulator.heldout_benchmark)
    except Exception as exc:  # noqa: BLE001 - the simulator failing is reported, never papered over
        print(f"bidikv calibrate: error: the held-out simulation failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(rep, indent=2) if as_json else format_text(rep))
    return 0


# --- profile -------------------------------------------------------------------------------------

def run_profile(args: argparse.Namespace) -> int:
    from calibration.architecture import ConfigError
    from calibration.build import profile_from_architecture

    try:
        profile = profile_from_architecture(args.model_config, args.hardware, args.tp, args.efficiencies,
                                            name=args.name, kv_cache_dtype=args.kv_cache_dtype,
                                            block_size=args.block_size)
    except (ConfigError, ValueError) as exc:
        print(f"bidikv profile: error: {exc}", file=sys.stderr)
        return 2
    text = profile.to_json()
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    print(f"{profile.name}: physical floors (prefill at peak FLOP/s, transfer at EFA line rate):", file=sys.stderr)
    for f in profile.provenance["floors"]:
        print(f"  {f['description']:38} floor {f['floor_ms']:7.1f} ms; profile {f['profile_ms']:.0f} ms "
              f"= {f['profile_over_floor']:.1f}x", file=sys.stderr)
    from calibration.trust import trust_report

    simulator, _ = _simulator(args)
    print(trust_report(profile, args.output, simulate_benchmark=simulator.heldout_benchmark if simulator else None),
          file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None, load_simulator: SimulatorLoader | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bidikv", description="calibration commands")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub, load_simulator)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
