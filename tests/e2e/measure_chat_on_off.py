"""Bidirectional ON vs OFF for *chat* traffic with a byte-level BPE tokenizer: what token-exact reuse keeps.

    .venv/bin/python -m tests.e2e.measure_chat_on_off --out-dir /tmp/chat_on_off

``measure_on_off`` drives token-id prompts, whose reuse is exact by construction. Chat traffic goes
through detokenize -> chat template -> retokenize, so D's held ids and the next prompt's ids diverge
(tests/e2e/tiny_model.py); P pulls only the verified prefix (impl/policy/prefix_check.py). This runs
the same multi-turn chats through the router ON and OFF, per chat template (plain, and a reasoning
template that drops earlier thinking), on the wider float32 model of ``measure_on_off`` with its
byte-level BPE, P without prefix caching, and prints per turn: median TTFT OFF and ON, and of the
tokens D offered how many P verified and pulled (the router's per-turn headers).

Turns are spaced by ``--gap-s`` so a turn does not compete on the 2 cores with the tail of the one before.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.e2e.client import chat
from tests.e2e.deployment import start_deployment
from tests.e2e.measure_on_off import on_off_spec
from tests.e2e.tiny_model import build_tiny_model

TOPICS = ["bicycle gears", "lighthouse keepers", "steam engines", "river tides", "volcano magma", "refrigerators"]


def converse(router: str, template: dict, turns: int, answer: int, gap_s: float, topic: str) -> list[dict]:
    extra = {"chat_template_kwargs": template} if template else {}
    cid = f"chat-{uuid.uuid4().hex}"
    messages = [{"role": "system", "content": f"[{cid}] You are a helpful assistant. " * 4},
                {"role": "user", "content": f"Tell me about {topic}, in detail please. " * 6}]
    rows = []
    for turn in range(turns):
        got = chat(router, messages, max_tokens=answer, conversation_id=cid, timeout=600, **extra)
        h = {k.lower(): v for k, v in (got.headers or {}).items()}
        rows.append({"turn": turn + 1, "ttft_s": got.ttft_s, "offered": int(h.get("x-bidikv-reuse-offered-tokens", 0)),
                     "verified": int(h.get("x-bidikv-reuse-verified-tokens", 0)),
                     "pulled": int(h.get("x-bidikv-reuse-pulled-tokens", 0))})
        messages = messages + [{"role": "assistant", "content": got.text},
                               {"role": "user", "content": f"Thanks. And what else about {topic}? " * 5}]
        time.sleep(gap_s)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=None, help="logs and model (default: a temp dir)")
    ap.add_argument("--conversations", type=int, default=3, help="conversations per template and mode")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threshold", type=int, default=64, help="kv_recompute_threshold (vLLM's default 64)")
    ap.add_argument("--gap-s", type=float, default=1.5, help="pause between a turn's end and the next turn")
    args = ap.parse_args()
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="bidikv-chat-on-off-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(out_dir / f"model-h{args.hidden}-l{args.layers}", hidden_size=args.hidden,
                             num_hidden_layers=args.layers)
    templates = {"plain": {}, "reasoning-strip": {"think": True}}
    results: dict[tuple[str, str], list[dict]] = {}
    for mode in ("on", "off"):
        dep = start_deployment(model, out_dir / f"logs-{mode}", on_off_spec(mode, args.threshold))
        try:
            converse(dep.router.url, {}, 2, 16, 0.5, "warm-up")  # the first NIXL handshakes are slow
            for name, template in templates.items():
                rows = []
                for i in range(args.conversations):
                    rows += converse(dep.router.url, template, args.turns, args.answer_tokens, args.gap_s,
                                     TOPICS[i % len(TOPICS)])
                results[(mode, name)] = rows
                print(f"[{mode}] {name}: {len(rows)} turns", flush=True)
        finally:
            dep.stop()
    print(f"\n{'template':16}{'turn':>5}{'OFF ms':>9}{'ON ms':>9}{'OFF/ON':>8}{'offered':>9}{'verified':>9}{'pulled':>8}")
    for name in templates:
        for turn in range(1, args.turns + 1):
            on = [r for r in results[("on", name)] if r["turn"] == turn]
            off = [r for r in results[("off", name)] if r["turn"] == turn]
            t_on = statistics.median(r["ttft_s"] for r in on) * 1e3
            t_off = statistics.median(r["ttft_s"] for r in off) * 1e3
            print(f"{name:16}{turn:>5}{t_off:>9.0f}{t_on:>9.0f}{t_off / t_on:>7.2f}x{sum(r['offered'] for r in on):>9}"
                  f"{sum(r['verified'] for r in on):>9}{sum(r['pulled'] for r in on):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
