"""Record the bench runs ``bidikv validate`` checks the simulator against: two deployments, five runs.

    .venv/bin/python -m tests.e2e.record_validate --out-dir /tmp/validate

Deployment ON (bidirectional, a short ``decoder_kv_blocks_ttl`` so that some turns outlive D's
blocks) and deployment OFF (TTL 480), both as ``tests/e2e/measure_on_off.py`` builds them (h512/l8
float32 model, P without prefix caching). On each, one throwaway warm-up bench (the first NIXL
handshakes are slow), then the runs below; each JSONL gets a ``<name>.deployment.json`` beside it with
the settings the simulator must be told (threshold, TTL, block size, KV bytes per token, ON/OFF), and
``uptime`` before and after, so a reader knows the load it ran under.

    run       deployment  seed  concurrency  gap scale   why
    on-c1     ON          7     1            0.01        fit: pulls at one turn at a time
    on-c2a    ON          9     2            0.01        fit: two sequences decode together (decode per-seq term)
    on-c2     ON          8     2            0.03        held out: longer gaps (turns expire), two at once
    off-c1    OFF         7     1            0.01        bidirectional OFF: the whole history recomputed
    off-c2    OFF         9     2            0.01        OFF, two at once

``--only on`` starts only the ON deployment (its three runs); the CPU budget of a shared machine may
allow only that.

Not part of the e2e test suite (no ``test_`` prefix): it runs for tens of minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.deployment import BLOCK_SIZE, NUM_KV_BLOCKS, DeploymentSpec, start_deployment
from tests.e2e.measure_on_off import WORKLOAD_TOML, _warmup_config, bench
from tests.e2e.tiny_model import build_tiny_model

# (name, mode, seed, concurrency, gap_scale)
RUNS = (("on-c1", "on", 7, 1, 0.01), ("on-c2a", "on", 9, 2, 0.01), ("on-c2", "on", 8, 2, 0.03),
        ("off-c1", "off", 7, 1, 0.01), ("off-c2", "off", 9, 2, 0.01))


def kv_bytes_per_token(hidden: int, layers: int) -> int:
    """K and V, every layer, float32: build_tiny_model's kv heads (hidden // 32) x head_dim 32."""
    return layers * 2 * max(hidden // 32, 1) * 32 * 4


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--messages", type=int, default=8, help="messages per conversation (requests = messages / 2)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threshold", type=int, default=64, help="kv_recompute_threshold (vLLM's default 64)")
    # 10 s leaves 5 s of usable window after vLLM's 5 s expiry margin: with the held-out run's gaps
    # (x0.03: median ~3.8 s) about a third of its turns arrive too late, with the fit run's (x0.01) few do
    ap.add_argument("--on-ttl-s", type=float, default=10.0, help="decoder_kv_blocks_ttl of the ON deployment")
    ap.add_argument("--only", choices=("on", "off"), default=None, help="start only this deployment")
    args = ap.parse_args()
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(out / f"model-h{args.hidden}-l{args.layers}", hidden_size=args.hidden,
                             num_hidden_layers=args.layers)
    for mode in ("on", "off"):
        if args.only and mode != args.only:
            continue
        ttl = args.on_ttl_s if mode == "on" else 480.0
        spec = DeploymentSpec(threshold=args.threshold, decoder_ttl_s=ttl, reference=False, router=True,
                              prefill_extra={"bidirectional_kv_xfer": mode == "on"},
                              decode_extra={"bidirectional_kv_xfer": mode == "on"},
                              prefill_args=["--no-enable-prefix-caching"], max_model_len=4096)
        started = time.monotonic()
        dep = start_deployment(model, out / f"logs-{mode}", spec)
        try:
            print(f"[{mode}] up in {time.monotonic() - started:.0f} s; {_uptime()}", flush=True)
            bench(dep.router.url, mode, _warmup_config(out, 1000), out / f"warmup-{mode}.jsonl", 1, 0.01)
            for name, run_mode, seed, concurrency, gap in RUNS:
                if run_mode != mode:
                    continue
                config = out / f"{name}.toml"
                config.write_text(WORKLOAD_TOML.format(seed=seed, conversations=args.conversations,
                                                       messages=args.messages))
                before = _uptime()
                summary = bench(dep.router.url, mode, config, out / f"{name}.jsonl", concurrency, gap)
                settings = {"mode": mode, "bidirectional": mode == "on", "kv_recompute_threshold": args.threshold,
                            "decoder_kv_blocks_ttl": ttl, "block_size": BLOCK_SIZE,
                            "kv_bytes_per_token": kv_bytes_per_token(args.hidden, args.layers),
                            "decode_kv_blocks": NUM_KV_BLOCKS, "max_num_seqs": 8,  # deployment.vllm_cmd's
                            "prefix_caching_on_p": False, "concurrency": concurrency, "gap_scale": gap, "seed": seed,
                            "model": f"tiny h{args.hidden} l{args.layers} float32",
                            "uptime_before": before, "uptime_after": _uptime()}
                (out / f"{name}.deployment.json").write_text(json.dumps(settings, indent=2) + "\n")
                print(f"[{name}] {settings['uptime_before']} -> {settings['uptime_after']}\n{summary}", flush=True)
        finally:
            dep.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
