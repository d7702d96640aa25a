"""What ``bidikv profile`` prints beside a profile it built: what to trust, how far, and how to replace the rest.

Three parts, from data, never from fixed text:

* every field by kind (calibration.portable): exact physics, carried over from which fit, assumed; off
  the measured hardware (p5en), a warning first that the fitted terms were carried over from it, and on a
  Neuron accelerator (trn2) that vLLM's engine overheads there are unknown (calibration.build);
* the expected error, from the leave-one-model-out report (calibration.loo, computed on the spot with the
  simulator the caller passes in): the same-family held-out model (Llama-3.3-70B from Qwen3-32B's fit) and
  the cross-family pair (Qwen3-32B <-> GLM-5-FP8), and which of the two applies to this profile;
* the commands that replace every carried-over and assumed term with a fit on the user's deployment
  (``bidikv bench`` twice, ``bidikv calibrate --from-bench``, ``bidikv validate``), pasteable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from calibration.decode_fit import DECODE_COMMAND, DECODE_SOURCE, load_record
from calibration.portable import DECODE, ENGINE, FAMILY, PHYSICS
from calibration.profile import LatencyProfile

if TYPE_CHECKING:
    from calibration.heldout import SimulatedBenchmark

BENCH_CONVERSATIONS = 8  # enough turns for every term of the bench fit (first turns, pulls, decode) in minutes
ROUTER_URL = "http://localhost:8000"  # bidikv router's default --port


def _value(field: str, value: float) -> str:
    if value == 0:
        return "0"
    if field.endswith("_bytes_per_s"):
        return f"{value / 1e9:.3g} GB/s"
    if field.endswith("_s"):
        for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns"), (1e-12, "ps")):
            if abs(value) >= scale or scale == 1e-12:
                return f"{value / scale:.3g} {unit}"
    return f"{value:.6g}"


def _group_errors(summary: Sequence[dict[str, Any]], trained_on: str, model_prefix: str, group: str
                  ) -> list[dict[str, Any]]:
    return [s for s in summary if s["trained_on"] == trained_on and s["model"].startswith(model_prefix)
            and s["group"] == group]


def expected_error_lines(summary: Sequence[dict[str, Any]], same_family: bool) -> list[str]:
    from calibration.loo import DEFAULT_SOURCE

    def band(rows: Sequence[dict[str, Any]]) -> str:
        return " / ".join(f"{r['model'].split('(')[-1].rstrip(')')}: median {100 * r['median_abs_error']:.0f} %, "
                          f"max {100 * r['max_abs_error']:.0f} % ({100 * r['min_error']:+.0f} to {100 * r['max_error']:+.0f} %)"
                          for r in rows)

    ttft = _group_errors(summary, DEFAULT_SOURCE, "Llama", "prefill/TTFT")
    tpot = _group_errors(summary, DEFAULT_SOURCE, "Llama", "TPOT")
    cross = [s for s in summary if not s["model"].startswith("Llama")]
    cross_pf = [s for s in cross if s["group"] == "prefill/TTFT"]
    cross_tr = [s for s in cross if s["group"] == "transfer"]
    lines = ["expected error (leave one model out; every point: bidikv calibrate --leave-one-model-out):",
             f"  same kernel family, a model no fit saw (Llama-3.3-70B on p5en from Qwen3-32B's fit, vLLM PR #32553 "
             f"means; its TP is not published):",
             f"    TTFT |error| {band(ttft)}",
             f"    TPOT |error| {band(tpot)}  (decode fitted on published decode rows, never on this run)",
             "  across kernel families (Qwen3-32B <-> GLM-5-FP8, published single-request figures): prefill/TTFT "
             f"|error| up to {100 * max(s['max_abs_error'] for s in cross_pf):.0f} %, transfer up to "
             f"{100 * max(s['max_abs_error'] for s in cross_tr):.0f} %"]
    lines.append("  -> this profile: " + ("its family was measured: expect the same-family band" if same_family else
                                          "no measured model shares its family: expect the cross-family band"))
    return lines


def decode_error_lines(decode_source: str) -> list[str]:
    """The decode fit's leave-one-model-out and leave-one-GPU-out TPOT error (shipped with its fit)."""
    if decode_source != DECODE_SOURCE:
        return ["    (given decode constants: the decode fit's error bands below do not describe them)"]
    rec = load_record()
    out = []
    for what, key in (("model", "leave_one_model_out_summary"), ("GPU", "leave_one_gpu_out_summary")):
        every = next((s for s in rec[key] if s["held_out"] == "all"), None)
        if every is None:
            out.append(f"    TPOT with its {what} left out of the fit: not measurable (the data has one {what})")
            continue
        out.append(f"    TPOT |error| with its {what} left out of the fit: median {100 * every['median_of_group_medians']:.0f} % "
                   f"over {what}s ({100 * every['median_abs_error']:.0f} % over {every['points']} published rows), max "
                   f"{100 * every['max_abs_error']:.0f} % ({len(rec['models'])} models, {', '.join(rec['gpus'])}; "
                   f"{DECODE_COMMAND})")
    return out


def bench_commands(profile: LatencyProfile, profile_path: str | None) -> list[str]:
    path = profile_path or "PROFILE.json"
    lines = ["replace the carried-over and assumed terms with a short bench on your deployment (bidirectional ON"
             + ("; save this profile with -o PROFILE.json first" if profile_path is None else "") + "):"]
    lines += [f"  bidikv bench --url {ROUTER_URL} --mode on --conversations {BENCH_CONVERSATIONS} --seed 1 --out fit.jsonl",
              f"  bidikv bench --url {ROUTER_URL} --mode on --conversations {BENCH_CONVERSATIONS} --seed 2 --out check.jsonl",
              f"  bidikv calibrate --from-bench fit.jsonl --base-profile {path} --block-size {profile.block_size} "
              f"--kv-bytes-per-token {profile.kv_bytes_per_token:.0f} -o mine.json",
              f"  bidikv validate --fit fit.jsonl --bench check.jsonl --base-profile {path} --block-size {profile.block_size} "
              f"--kv-bytes-per-token {profile.kv_bytes_per_token:.0f}",
              "  (the fit replaces prefill's fixed and per-token cost, the pull's setup and per-token cost and decode's "
              "fixed, per-sequence and per-context-token terms; validate checks it on the run it did not see)"]
    return lines


def trust_report(profile: LatencyProfile, profile_path: str | None = None,
                 summary: Sequence[dict[str, Any]] | None = None,
                 simulate_benchmark: SimulatedBenchmark | None = None) -> str:
    """The text ``bidikv profile`` prints; ``summary`` defaults to calibration.loo's, computed now with
    ``simulate_benchmark`` (the simulator, passed in); with neither, the expected error is not computed."""
    prov = profile.provenance
    failure = ""
    if summary is None and simulate_benchmark is None:
        failure = "it runs the simulator, which was not passed in (bidikv profile passes it)"
    elif summary is None:
        from calibration.loo import report

        try:  # the default source is all the bands need
            summary = report(simulate_benchmark=simulate_benchmark, with_alternatives=False)["summary"]
        except Exception as exc:  # noqa: BLE001 - said in the output; the profile itself stands
            failure = f"the held-out simulation failed ({type(exc).__name__}: {exc})"
    rows = prov["fields"]
    by_kind = {k: [r for r in rows if r["kind"] == k] for k in (PHYSICS, FAMILY, ENGINE, DECODE)}

    def listing(kind: str) -> str:
        return ", ".join(f"{r['field']} {_value(r['field'], r['value'])}" for r in by_kind[kind])

    lines = [f"{profile.name}: what to trust (kernel family {prov['kernel_family']}; calibration/README.md)"]
    lines += [f"  WARNING: {caveat}" for caveat in prov.get("hardware_caveats", [])]  # off p5en only
    lines += [f"  exact (config.json x {prov['hardware']}): {listing(PHYSICS)}, and the floors above",
             f"  prefill terms from {prov['carried_from']}: {listing(FAMILY)}",
             f"  engine terms from {prov['engine_terms_from']}: {listing(ENGINE)}",
             f"  decode step from {prov['decode_terms_from']}: {listing(DECODE)}"]
    lines += decode_error_lines(prov["decode_terms_from"])
    if failure:
        lines.append(f"expected error: not computed, {failure}; "
                     "calibration/README.md 'Leave one model out' has the last table")
    else:
        lines += expected_error_lines(summary, prov["same_family_fit"])
        if prov["carried_from"].startswith("given"):
            lines[-1] = ("  -> this profile: built from given efficiencies; the bands above were measured for the "
                         "built-in carry-over, not for them")
    lines += bench_commands(profile, profile_path)
    return "\n".join(lines)
