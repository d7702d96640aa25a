"""Record the bench runs ``bidikv validate`` checks the simulator against: four deployments, eight runs.

    .venv/bin/python -m tests.e2e.record_validate --out-dir /tmp/validate

Every deployment is built as ``tests/e2e/measure_on_off.py`` builds it (h512/l8 float32 model, P without
prefix caching) and, on a machine with at least two cores, pins P to core 0 and D to core 1 (``--no-pin``
leaves placement to the OS); the router and the bench client run wherever the OS puts them. On each, one
throwaway warm-up bench (the first NIXL handshakes are slow), then its runs; each JSONL gets a
``<name>.deployment.json`` beside it with the settings the simulator must be told (threshold, TTL, block
size, KV bytes per token, ON/OFF), the pinning, and ``uptime`` before and after, so a reader knows the
load it ran under.

    run         deployment             seed  concurrency  gap scale   why
    on-c1       ON  thr 64  TTL 10 s   7     1            0.01        fit: pulls at one turn at a time
    on-c2a      ON  thr 64  TTL 10 s   9     2            0.01        fit: two sequences decode together
    on-c2       ON  thr 64  TTL 10 s   8     2            0.03        held out: longer gaps, some turns expire
    on-c3       ON  thr 64  TTL 10 s   10    3            0.01        held out: another concurrency
    t512-c2     ON  thr 512 TTL 10 s   8     2            0.03        held out: another threshold
    ttl30-c2    ON  thr 64  TTL 30 s   8     2            0.03        held out: a TTL no gap outlives
    off-c1      OFF                    7     1            0.01        held out: the whole history recomputed
    off-c2      OFF                    8     2            0.03        held out: OFF on on-c2's workload
    press-c2    ON  thr 64  TTL 60 s   8     2            0.03        held out: D's memory binds (a 96-block
                D pool, 95 usable): retained turns pinned to the TTL, later turns wait for blocks

On a machine other work shares, run it at a higher priority than that work (as root: ``nice -n -15
.venv/bin/python -m tests.e2e.record_validate ...``): the servers, the router and the bench client inherit
it, and so does the scheduler group of each process's session (Linux autogroup: with
``kernel.sched_autogroup_enabled`` a niceness only ranks threads within their session's group, and the
servers each run in a session of their own), so other processes yield the cores to the deployment; each
deployment.json records the niceness.

on-c2, t512-c2, ttl30-c2 and off-c2 are one workload under four configurations: the ranking the
simulator must reproduce. ``--only NAME`` starts only that deployment.

Not part of the e2e test suite (no ``test_`` prefix): it runs for tens of minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.deployment import BLOCK_SIZE, autogroup_takes_our_niceness, NUM_KV_BLOCKS, DeploymentSpec, start_deployment
from tests.e2e.measure_on_off import WORKLOAD_TOML, _warmup_config, bench
from tests.e2e.tiny_model import build_tiny_model, kv_bytes_per_token

PRESSURE_BLOCKS = 96  # 95 usable: three conversations' retained turns (up to ~45 blocks each) fill it

# deployment name -> (bidirectional, kv_recompute_threshold, decoder_kv_blocks_ttl, D's KV blocks or None: the default)
DEPLOYMENTS = {"on": (True, 64, 10.0, None), "t512": (True, 512, 10.0, None), "ttl30": (True, 64, 30.0, None),
               "off": (False, 64, 480.0, None), "press": (True, 64, 60.0, PRESSURE_BLOCKS)}
# (name, deployment, seed, concurrency, gap_scale)
RUNS = (("on-c1", "on", 7, 1, 0.01), ("on-c2a", "on", 9, 2, 0.01), ("on-c2", "on", 8, 2, 0.03),
        ("on-c3", "on", 10, 3, 0.01), ("t512-c2", "t512", 8, 2, 0.03), ("ttl30-c2", "ttl30", 8, 2, 0.03),
        ("off-c1", "off", 7, 1, 0.01), ("off-c2", "off", 8, 2, 0.03), ("press-c2", "press", 8, 2, 0.03))


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--messages", type=int, default=8, help="messages per conversation (requests = messages / 2)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--only", choices=sorted(DEPLOYMENTS), action="append", default=None,
                    help="start only this deployment (repeatable)")
    ap.add_argument("--no-pin", action="store_true", help="leave P and D wherever the OS puts them")
    ap.add_argument("--idle-step-sleep-s", type=float, default=None,
                    help="bidikv_idle_step_sleep_s on P and D (default: the connector's 5 s). While D holds blocks "
                         "its engine steps once per this interval, and after every step vLLM's worker spins a core "
                         "for ~1 s (the shm reader's busy loop): on a 2-core rig a turn landing in such a second is "
                         "slowed. 30 (the most the connector allows) makes those seconds rare")
    args = ap.parse_args()
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    model = build_tiny_model(out / f"model-h{args.hidden}-l{args.layers}", hidden_size=args.hidden,
                             num_hidden_layers=args.layers)
    for deployment, (bidirectional, threshold, ttl, d_blocks) in DEPLOYMENTS.items():
        if args.only and deployment not in args.only:
            continue
        mode = "on" if bidirectional else "off"
        extra: dict[str, object] = {"bidirectional_kv_xfer": bidirectional}
        if args.idle_step_sleep_s is not None:
            extra["bidikv_idle_step_sleep_s"] = args.idle_step_sleep_s
        spec = DeploymentSpec(threshold=threshold, decoder_ttl_s=ttl, reference=False, router=True,
                              prefill_extra=dict(extra), decode_extra=dict(extra),
                              prefill_args=["--no-enable-prefix-caching"],
                              # vLLM refuses a max_model_len the KV pool cannot hold
                              max_model_len=4096 if d_blocks is None else 2048,
                              decode_kv_blocks=d_blocks or NUM_KV_BLOCKS,
                              prefill_cpus=frozenset({0}) if pin else None, decode_cpus=frozenset({1}) if pin else None)
        started = time.monotonic()
        dep = start_deployment(model, out / f"logs-{deployment}", spec)
        try:
            autogroup_takes_our_niceness()  # the bench client's session; the servers' own sessions took it at start
            print(f"[{deployment}] up in {time.monotonic() - started:.0f} s; {_uptime()}", flush=True)
            bench(dep.router.url, mode, _warmup_config(out, 1000), out / f"warmup-{deployment}.jsonl", 1, 0.01)
            for name, run_deployment, seed, concurrency, gap in RUNS:
                if run_deployment != deployment:
                    continue
                if d_blocks is not None:
                    # D must hold nothing of the warm-up (or of a previous run) when a pressure run starts: the
                    # replay knows only the run's own turns, and a leftover turn pinned to the TTL takes blocks
                    time.sleep(ttl + 2.0)
                config = out / f"{name}.toml"
                config.write_text(WORKLOAD_TOML.format(seed=seed, conversations=args.conversations,
                                                       messages=args.messages))
                before = _uptime()
                summary = bench(dep.router.url, mode, config, out / f"{name}.jsonl", concurrency, gap)
                settings = {"mode": mode, "bidirectional": bidirectional, "kv_recompute_threshold": threshold,
                            "decoder_kv_blocks_ttl": ttl, "block_size": BLOCK_SIZE,
                            "kv_bytes_per_token": kv_bytes_per_token(args.hidden, args.layers),
                            "decode_kv_blocks": d_blocks or NUM_KV_BLOCKS, "max_num_seqs": 8,  # deployment.vllm_cmd's
                            "prefix_caching_on_p": False, "concurrency": concurrency, "gap_scale": gap, "seed": seed,
                            "model": f"tiny h{args.hidden} l{args.layers} float32",
                            "pinning": "P core 0, D core 1, router and client unpinned" if pin else "none",
                            "idle_step_sleep_s": args.idle_step_sleep_s if args.idle_step_sleep_s is not None else 5.0,
                            "niceness": os.nice(0), "uptime_before": before, "uptime_after": _uptime()}
                (out / f"{name}.deployment.json").write_text(json.dumps(settings, indent=2) + "\n")
                print(f"[{name}] {settings['uptime_before']} -> {settings['uptime_after']}\n{summary}", flush=True)
        finally:
            dep.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
