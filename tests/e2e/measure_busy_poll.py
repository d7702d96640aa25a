"""Measure what NIXL's threading and vLLM's idle stepping cost on this machine, before/after our defaults.

    .venv/bin/python -m tests.e2e.measure_busy_poll --out /tmp/busy_poll.json [--configs ours vllm_default]

For each configuration it starts P + D (our connector, tiny float32 model) and the router, then:

1. idle CPU of each server's process tree (API server + engine core + worker), before any request;
2. two 3-turn conversations through the router: TTFT per turn and the reader's NIXL transfer time
   (``vllm:nixl_xfer_time_seconds`` sum/count deltas: D reading P's prompt, P reading D's blocks);
3. CPU while D retains the last turn's blocks (D's TTL not yet over);
4. CPU after the TTL (nothing retained).

CPU is read from /proc (psutil cpu_times of the process trees), so other load on the machine does not
count; it is reported in % of one core.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from tests.e2e.client import chat
from tests.e2e.deployment import DeploymentSpec, delta, pull_counters, start_deployment
from tests.e2e.tiny_model import build_tiny_model

TURN_TIMEOUT_S = 90.0

CONFIGS = {
    # vLLM 0.32's own behaviour: num_threads 4, NIXL progress thread spinning (delay 0), vLLM's 1 ms idle stepping
    "vllm_default": {"num_threads": 4, "bidikv_nixl_progress_thread": True, "bidikv_nixl_progress_delay_us": 0,
                     "bidikv_idle_step_sleep_s": 0},
    # the usual raw-NIXL remedy: progress thread off, one UCX thread
    "prog_off": {"num_threads": 1, "bidikv_nixl_progress_thread": False, "bidikv_idle_step_sleep_s": 0},
    # progress thread with a 1 ms delay, vLLM's idle stepping unchanged
    "delay_only": {"bidikv_idle_step_sleep_s": 0},
    # our defaults: num_threads 1, progress thread with a 1 ms delay, idle-step wait 5 s
    "ours": {},
}


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def cpu_percent(procs, seconds: float) -> dict[str, float]:
    pids = {p.name: p.pids() for p in procs}
    before = {name: _cpu_seconds(ps) for name, ps in pids.items()}
    time.sleep(seconds)
    return {name: round(100 * (_cpu_seconds(ps) - before[name]) / seconds, 1) for name, ps in pids.items()}


def conversation(dep, marker: str, turns: int = 3) -> list[dict]:
    out = []
    messages = [{"role": "system", "content": f"[{marker}] You are a terse assistant. " * 3},
                {"role": "user", "content": "Explain how a bicycle gear works, step by step. " * 3}]
    for turn in range(turns):
        try:
            bp, bd = pull_counters(dep.prefill.url), pull_counters(dep.decode.url)
            result = chat(dep.router.url, messages, max_tokens=64, conversation_id=marker, timeout=TURN_TIMEOUT_S)
            time.sleep(0.3)  # let the counters of the step that finished the read be published
            dp, dd = delta(pull_counters(dep.prefill.url), bp), delta(pull_counters(dep.decode.url), bd)
        except Exception as exc:  # noqa: BLE001 - a hung turn or an unresponsive server is a result too
            out.append({"turn": turn + 1, "error": f"{type(exc).__name__}: {exc}"})
            return out
        out.append({
            "turn": turn + 1, "ttft_s": round(result.ttft_s or 0, 4), "total_s": round(result.total_s, 4),
            "p_pulled_tokens": dp["external_tokens"], "p_xfers": dp["xfers"],
            "p_xfer_s": round(dp["xfer_seconds"] / dp["xfers"], 4) if dp["xfers"] else None,
            "d_pulled_tokens": dd["external_tokens"], "d_xfers": dd["xfers"],
            "d_xfer_s": round(dd["xfer_seconds"] / dd["xfers"], 4) if dd["xfers"] else None,
        })
        messages += [{"role": "assistant", "content": result.text},
                     {"role": "user", "content": f"Turn {turn + 2}: and what about the chain? " * 3}]
    return out


def measure(name: str, extra: dict, model_dir: Path, log_root: Path, ttl_s: float) -> dict:
    spec = DeploymentSpec(threshold=16, decoder_ttl_s=ttl_s, prefill_extra=dict(extra), decode_extra=dict(extra),
                          reference=False, router=True)
    t0 = time.monotonic()
    dep = start_deployment(model_dir, log_root / name, spec)
    try:
        result = {"config": name, "extra": extra, "healthy_s": round(time.monotonic() - t0, 1)}
        servers = [dep.prefill, dep.decode]
        time.sleep(5)
        result["idle_cpu_pct"] = cpu_percent(servers, 20)
        result["load_avg_1m_after_idle"] = round(psutil.getloadavg()[0], 2)
        turns = conversation(dep, uuid.uuid4().hex) + conversation(dep, uuid.uuid4().hex)
        result["turns"] = turns
        done = time.monotonic()
        result["retaining_cpu_pct"] = cpu_percent(servers, 10)
        time.sleep(max(0.0, ttl_s + 3 - (time.monotonic() - done)))
        result["after_ttl_cpu_pct"] = cpu_percent(servers, 10)
        ok = [t for t in turns if "error" not in t]
        p_x = [t["p_xfer_s"] for t in ok if t["p_xfer_s"] is not None]
        d_x = [t["d_xfer_s"] for t in ok[1:] if t["d_xfer_s"] is not None]
        result["summary"] = {
            "p_reads_s": p_x, "d_reads_s_excluding_first": d_x,
            "ttft_turn2_3_s": [t["ttft_s"] for t in ok if t["turn"] > 1],
            "errors": [t["error"] for t in turns if "error" in t],
        }
        return result
    finally:
        dep.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="busy_poll.json")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--ttl", type=float, default=25.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bidikv-busy-poll-"))
    model_dir = build_tiny_model(work / "model")
    results = []
    for name in args.configs:
        r = measure(name, CONFIGS[name], model_dir, work / "logs", args.ttl)
        print(json.dumps(r, indent=1), flush=True)
        results.append(r)
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"logs under {work / 'logs'}")


if __name__ == "__main__":
    main()
